"""EAGLE-3 drafting (`--speculative eagle3 --draft-model PATH`): a published one-layer EAGLE-3 drafter chains K
greedy drafts from three target residual streams.

The drafter row at position p reads the target's streams at p (through `fc`) and the token at p + 1, and
predicts the token at p + 2 (../shared/specs/eagle3.md, 5). `on_commit` runs the drafter over every committed
position whose streams were captured, with the following token as input: that writes its own K/V at those
positions (a paged cache addressed by the target's page ids and slots), and the last committed row of a request
(position n - 1 when n tokens are in the target cache and token n is known) gives the first draft d1 and the
pre-norm output u1. `propose` chains the drafter K - 1 more times: step j feeds (d_{j-1}, u_{j-1}) at position
n - 2 + j, writing its K/V there (lookahead slots, overwritten with the real rows once the target has verified
those positions). The draft head scores the drafter's reduced vocabulary; `d2t` maps its argmax to a target id.

Both passes are batched across requests and, on CUDA, replay graphs (speculative/chained.py, shared with MTP;
prompt chunks go eagerly). A position whose streams were not captured keeps
whatever its slot held; the last position of a page served from the prefix cache holds the row computed with the
next token of the request that first computed it: both only lower acceptance, never change outputs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from atlas.errors import ConfigError, ModelLoadError
from atlas.models.eagle3 import Eagle3Config, Eagle3DraftModel
from atlas.models.loader import (
    constructing,
    fill_dummy_weights,
    iterate_weights,
    resolve_model_path,
    safetensors_files,
)
from atlas.speculative.chained import ChainedDrafter
from atlas.speculative.proposer import ProposerContext

if TYPE_CHECKING:
    from atlas.config import EngineConfig, HubAccess, ModelConfig
    from atlas.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

#: K when --num-draft-tokens is not given (vLLM's EAGLE-3 examples verify 3 chained drafts)
DEFAULT_DRAFT_TOKENS = 3


def find_draft_model(config: EngineConfig) -> Path:
    if not config.draft_model:
        raise ConfigError("--speculative eagle3 needs --draft-model PATH (an EAGLE-3 drafter trained for this model, "
                          "e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B for Llama-3.1-8B-Instruct)")
    return resolve_model_path(config.draft_model, hub=config.hub)


def check_against_target(cfg: Eagle3Config, target: ModelConfig, num_draft_tokens: int | None
                         ) -> tuple[int, list[int]]:
    """Refuse a drafter that cannot drive this target; -> (K, the three Atlas capture layer ids)."""
    where = f"EAGLE-3 drafter {cfg.path}"
    fix = "pass a --draft-model trained for this target model"
    if cfg.target_hidden_size != target.hidden_size:
        raise ConfigError(f"{where} reads target hidden states of size {cfg.target_hidden_size} (its fc is "
                          f"[{cfg.hidden_size}, 3 x {cfg.target_hidden_size}]), the target {target.path} has hidden "
                          f"size {target.hidden_size}; {fix}")
    n = target.num_hidden_layers
    aux = cfg.aux_layers(n)
    if any(not 1 <= j <= n for j in aux):
        stated = "its eagle_aux_hidden_state_layer_ids" if cfg.aux_layer_ids is not None else "the default (2, N/2, N-3)"
        raise ConfigError(f"{where} reads target layers {aux} ({stated}: the stream entering layer j, 1 <= j <= N), "
                          f"but the target has {n} layers (ids 1..{n} are capturable; 0, the embedding, is not); {fix}")
    if len(set(aux)) != len(aux):
        raise ConfigError(f"{where} reads target layers {aux}: three distinct layers are needed (its fc reads three "
                          f"streams); the target's {n} layers give "
                          + ("too few for the default ids (2, N/2, N-3)" if cfg.aux_layer_ids is None
                             else "fewer distinct ids than its eagle_aux_hidden_state_layer_ids list") + f"; {fix}")
    if cfg.vocab_size is not None and cfg.vocab_size != target.vocab_size:
        raise ConfigError(f"{where} was trained for a vocabulary of {cfg.vocab_size} tokens, the target {target.path} "
                          f"has {target.vocab_size}; {fix}")
    if cfg.draft_vocab_size > target.vocab_size:
        raise ConfigError(f"{where} has a draft vocabulary of {cfg.draft_vocab_size} tokens, more than the target's "
                          f"{target.vocab_size}; {fix}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"{where}: num_attention_heads ({cfg.num_attention_heads}) is not a multiple of "
                          f"num_key_value_heads ({cfg.num_key_value_heads}); Atlas cannot run it")
    if int(cfg.head_dim * cfg.rope.partial_rotary_factor) % 2:
        raise ConfigError(f"{where}: head_dim {cfg.head_dim} gives an odd rotary dimension; Atlas cannot run it")
    k = num_draft_tokens or DEFAULT_DRAFT_TOKENS
    return k, [j - 1 for j in aux]


def worker_capture_layers(config: EngineConfig, target: ModelConfig) -> tuple[int, ...]:
    """What the driver's proposer captures (`capture_layers`), from the drafter's config.json alone."""
    _, capture = check_against_target(Eagle3Config.from_path(find_draft_model(config)), target, config.num_draft_tokens)
    return tuple(capture)


def check_vocabulary_map(model: Eagle3DraftModel, target: ModelConfig) -> None:
    """The draft head's ids, mapped through d2t, must be target token ids."""
    cfg = model.config
    where = f"EAGLE-3 drafter {cfg.path}"
    if not model.has_d2t:
        if cfg.draft_vocab_size != target.vocab_size:
            raise ConfigError(f"{where} has a draft vocabulary of {cfg.draft_vocab_size} tokens but ships no d2t map "
                              f"to the target's {target.vocab_size}; Atlas cannot tell which token each draft id is")
        return
    mapped = torch.arange(cfg.draft_vocab_size, device=model.d2t.device) + model.d2t
    low, high = int(mapped.min()), int(mapped.max())
    if low < 0 or high >= target.vocab_size:
        raise ConfigError(f"{where}: its d2t map sends draft ids to target ids {low}..{high}, outside the target's "
                          f"vocabulary of {target.vocab_size}; pass a --draft-model trained for this target model")


def _checkpoint(path: Path, model_id: str, hub: HubAccess) -> tuple[str, list[Path]]:
    """("safetensors", files) or ("bin", files): the published EAGLE-3 drafters ship either (a hub id whose
    snapshot has no safetensors gets its pytorch_model*.bin fetched)."""
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
        return "safetensors", safetensors_files(path)
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins and not Path(model_id).expanduser().is_dir():
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(repo_id=model_id, allow_patterns=["*.json", "pytorch_model*.bin"],
                                          **hub.snapshot_args()))
        except Exception as exc:  # network, auth, offline cache miss
            raise ModelLoadError(f"could not get the weights of EAGLE-3 drafter {model_id!r} from the hub "
                                 f"({type(exc).__name__}: {exc})") from exc
        bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        return "safetensors", safetensors_files(path)  # (raises the loader's "no weights" error)
    return "bin", bins


def _tensor_names(kind: str, files: list[Path]) -> set[str]:
    if kind == "safetensors":
        from safetensors import safe_open

        names: set[str] = set()
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                names.update(handle.keys())
        return names
    return {name for name, _ in _bin_weights(files)}


def _bin_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        try:
            state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise ModelLoadError(f"malformed EAGLE-3 drafter: cannot read {f} ({exc})") from exc
        yield from state.items()


class Eagle3Proposer(ChainedDrafter):
    name = "eagle3"
    uses_target_vocab = True  # (the target's embedding, unless the drafter ships one; its head is its own)
    uses_target_head = False

    def __init__(self, model: Eagle3DraftModel, num_draft_tokens: int, capture: list[int], device: torch.device,
                 dtype: torch.dtype):
        self.model = model
        self.config = model.config
        self.num_draft_tokens = num_draft_tokens
        self.device = device
        self.dtype = dtype
        self.layers = tuple(capture)  # (three distinct ids, ascending: fc reads low | mid | high)
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        self.embed = None
        self._init_chain()  # (the per-request state is the drafter's pre-norm output at the last committed row)

    @staticmethod
    def draft_count(config: EngineConfig, target: ModelConfig) -> int:
        return config.num_draft_tokens or DEFAULT_DRAFT_TOKENS

    @classmethod
    def from_config(cls, config: EngineConfig, ctx: ProposerContext) -> Eagle3Proposer:
        target = ctx.target_config
        path = find_draft_model(config)
        cfg = Eagle3Config.from_path(path)
        k, capture = check_against_target(cfg, target, config.num_draft_tokens)
        kind, files = ("safetensors", []) if config.dummy_weights else _checkpoint(path, config.draft_model, config.hub)
        names = _tensor_names(kind, files) if files else set()
        own_embedding = any(n.removeprefix("model.") == "embed_tokens.weight" for n in names)
        if not own_embedding and cfg.hidden_size != target.hidden_size:
            raise ConfigError(f"EAGLE-3 drafter {path} has hidden size {cfg.hidden_size} and ships no embedding: it "
                              f"shares the target's ({target.hidden_size} wide), so they must match; pass a "
                              "--draft-model trained for this target model")
        with constructing(ctx.device, ctx.dtype):  # (whole: on a tensor-parallel driver it drafts alone)
            model = Eagle3DraftModel(cfg, ctx.max_model_len + k + 1, own_embedding,
                                     fc_bias=any(n.removeprefix("model.") == "fc.bias" for n in names) if names else None)
        if config.dummy_weights:
            fill_dummy_weights(model)
            model.has_d2t = True  # (zero offsets: draft id i drafts target id i, within the vocabulary checked above)
        else:
            weights = (iterate_weights(files, desc="loading drafter") if kind == "safetensors"
                       else _bin_weights(files))
            with torch.no_grad():
                model.load_weights(weights)
        model.eval().requires_grad_(False)
        check_vocabulary_map(model, target)
        proposer = cls(model, k, capture, ctx.device, ctx.dtype)
        proposer.catch_up_graphs = config.tuning.mtp_catch_up_graphs
        proposer.embed = ctx.embed
        logger.info("EAGLE-3 drafter %s: K=%d (chained), target layers %s (capture ids %s), draft vocabulary %d, "
                    "%s embedding, %.1f M parameters", path, k, cfg.aux_layers(target.num_hidden_layers), capture,
                    cfg.draft_vocab_size, "its own" if own_embedding else "the target's",
                    sum(p.numel() for p in model.parameters()) / 1e6)
        return proposer

    # ------------------------------------------------------------------ what the engine asks
    def capture_layers(self) -> tuple[int, ...]:
        return self.layers

    def weight_bytes(self) -> int:
        return (sum(p.numel() * p.element_size() for p in self.model.parameters())
                + self.model.d2t.numel() * self.model.d2t.element_size())

    @property
    def hidden_width(self) -> int:
        return self.config.hidden_size

    def bind(self, ctx: ProposerContext) -> None:
        self.embed = ctx.embed
        super().bind(ctx)  # (the graphs, which embed through it)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        own = self.model.embed_tokens
        return own(ids) if own is not None else self.embed(ids)

    def _commit_hidden(self, captured: torch.Tensor) -> torch.Tensor:
        return self.model.project(captured)

    def _forward_rows(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        normed, prenorm = self.model(self._embed(ids), hidden, positions, self.kv_caches, meta)
        return prenorm, normed

    def _draft_ids(self, head_input: torch.Tensor) -> torch.Tensor:
        return self.model.draft_tokens(head_input)

    def _graph_dims(self, target: ModelConfig) -> tuple[int, int]:
        return self.config.intermediate_size, self.config.draft_vocab_size
