"""MTP drafting (`--speculative mtp`): the target's own multi-token-prediction module proposes K tokens.

The module (e.g. DeepSeek-V3's, at layer index num_hidden_layers) turns the target's final hidden state
h_i at position i and the token t_{i+1} that follows into u_i, whose logits predict t_{i+2}
(spec 3.2). It has its own decoder block and its own paged latent cache, addressed by the target's page
ids and slots.

It chains as every such drafter does (speculative/chained.py): `on_commit` runs the module over every committed
position whose hidden state was captured (the target's last-layer residual stream; the module applies the target's
final norm) with the following token as input, and the last committed row of a request gives the first draft d1 =
argmax, predicting t_n; `propose` chains the module K - 1 more times, u feeding the next row.

A position whose hidden state was not captured (capture buffer full) keeps whatever its slot held, and
the last position of a page served from the prefix cache holds the row computed with the next token of
the request that first computed it: both only lower acceptance.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from atlas.errors import ConfigError
from atlas.layers.attention import AttentionMetadata
from atlas.models.loader import constructing, fill_dummy_weights, iterate_weights, safetensors_files
from atlas.models.quantization import dequantize_fp8, fp8_scheme
from atlas.speculative.chained import ChainedDrafter
from atlas.speculative.proposer import ProposerContext
from atlas.speculative.token_map import MappedHead, load_token_map

if TYPE_CHECKING:
    from atlas.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)


class MTPProposer(ChainedDrafter):
    name = "mtp"
    reads_mtp_input = True  # (what the target captures for it is its model's MTP input: CausalLM.captured_width)
    uses_target_vocab = True  # (the target's embedding; its head is its own or, for some families, the target's)
    uses_target_head = False

    @classmethod
    def needs_target_head(cls, model: object) -> bool:
        return bool(getattr(model, "mtp_uses_target_head", False))

    def __init__(self, module: torch.nn.Module, num_draft_tokens: int, num_target_layers: int,
                 device: torch.device, dtype: torch.dtype, catch_up_graphs: bool = True,
                 max_context: int | None = None):
        self.module = module
        # --speculative-max-model-len: the module runs at positions below it only (rows past it are never handed
        # to it, and a request past it gets no drafts)
        self.max_context = max_context
        # (On an H200 the graphed catch-up pass took a small MTP model's bf16 batch-1 speed from 331 to 752 tok/s,
        #  greedy tokens equal to the eager pass's; --tuning mtp_catch_up_graphs=0 runs it eagerly.)
        self.catch_up_graphs = catch_up_graphs
        self.num_draft_tokens = num_draft_tokens
        self.num_target_layers = num_target_layers
        self.device = device
        self.dtype = dtype
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        self._init_chain()  # (the per-request state is u, the module's output at the last committed row)
        # --speculative-token-map: the ids drafts are drawn from, and the module's LM head rows for them
        self.token_map: MappedHead | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, ctx: ProposerContext) -> MTPProposer:
        target = ctx.target_config
        if ctx.build_mtp is None and target.raw.get("num_nextn_predict_layers"):
            raise ConfigError(
                f"--speculative mtp: Atlas does not run the multi-token-prediction layers of {target.architecture} "
                f"checkpoints yet (num_nextn_predict_layers in {target.path / 'config.json'}). Use --speculative ngram "
                "or dflash")
        if ctx.build_mtp is None or not ctx.num_mtp_modules:
            raise ConfigError(
                f"--speculative mtp needs a model with multi-token-prediction heads; {target.architecture} has none "
                f"(no num_nextn_predict_layers in {target.path / 'config.json'}). Use --speculative ngram or dflash")
        if ctx.num_mtp_modules > 1:
            raise ConfigError(
                f"{target.path} has num_nextn_predict_layers = {ctx.num_mtp_modules}: --speculative mtp supports one "
                "MTP module (chained for K drafts); checkpoints with several are not supported yet")
        k = cls.draft_count(config, target)  # (as a worker's stand-in counts it)
        # Built whole (constructing takes no parallel view): on a tensor-parallel driver it runs alone, with no
        # collective the workers would have to join.
        with constructing(ctx.device, ctx.dtype):
            module = ctx.build_mtp(ctx.max_model_len + k + 1, ctx.whole_embedding, ctx.whole_lm_head)
        if config.dummy_weights:
            fill_dummy_weights(module)  # (its own parameters: the target's embedding and final norm are not among them)
        else:
            weights = iterate_weights(safetensors_files(target.path), desc="loading MTP", prefix=module.weight_prefix)
            scheme = fp8_scheme(target.raw, target.path)
            if scheme is not None:  # (an FP8 checkpoint's module: kept in the model dtype, dequantized as it loads)
                weights = dequantize_fp8(weights, scheme, ctx.dtype, target.path)
            with torch.no_grad():
                module.load_weights(weights)
        module.eval().requires_grad_(False)
        cap = config.speculative_max_model_len
        logger.info("MTP module %s* of %s: K=%d (chained), %.1f M parameters%s", module.weight_prefix, target.path, k,
                    sum(p.numel() for p in module.parameters()) / 1e6,
                    f", attending over positions below {cap} (--speculative-max-model-len)" if cap else "")
        proposer = cls(module, k, target.num_hidden_layers, ctx.device, ctx.dtype,
                       catch_up_graphs=config.tuning.mtp_catch_up_graphs, max_context=cap)
        if config.speculative_token_map is not None:
            proposer.use_token_map(load_token_map(config.speculative_token_map, target.vocab_size))
        return proposer

    @staticmethod
    def draft_count(config: EngineConfig, target: ModelConfig) -> int:
        """K for this target, from its config.json alone (a tensor-parallel worker's, which builds no module)."""
        return config.num_draft_tokens or int(target.raw.get("num_nextn_predict_layers") or 0)

    # ------------------------------------------------------------------ what the engine asks
    def capture_layers(self) -> tuple[int, ...]:
        return (self.num_target_layers - 1,)  # the last layer's residual stream (final-normed by the module)

    def cache_module(self) -> torch.nn.Module:
        return self.module

    @property
    def hidden_width(self) -> int:
        return self.module.input_width

    def prefill_hidden_rows(self, max_rows: int) -> int:
        # Its attention sees every position below its cap: every captured row there is useful, none past it.
        return max_rows if self.max_context is None else min(max_rows, self.max_context)

    def weight_bytes(self) -> int:
        head = 0 if self.token_map is None else self.token_map.nbytes
        return sum(p.numel() * p.element_size() for p in self.module.parameters()) + head

    def use_token_map(self, token_ids: torch.Tensor) -> None:
        """Draft from these token ids only (--speculative-token-map): the module's LM head rows for them, copied
        once, score its outputs instead of the whole head (its bytes dominate a draft step over a large
        vocabulary)."""
        head = self.module.draft_head
        rows = head.weight_rows(token_ids) if hasattr(head, "weight_rows") else None
        self.token_map = MappedHead.make(rows, token_ids, self.device, self.dtype, "MTP module")

    def _draft_ids(self, u: torch.Tensor) -> torch.Tensor:
        """The module's output rows -> their greedy drafts: the argmax over the whole vocabulary, or over the token
        map's ids (as token ids)."""
        if self.token_map is None:
            return self.module.compute_logits(u).argmax(-1)
        return self.token_map.argmax(self.module.head_input(u))

    def _commit_hidden(self, captured: torch.Tensor) -> torch.Tensor:
        return self.module.target_hidden(captured)

    def _forward_rows(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        u = self.module(ids, hidden, positions, self.kv_caches, meta)
        return u, u  # (u is both the next row's hidden state and the head's input)

    def _graph_dims(self, target: ModelConfig) -> tuple[int, int]:
        return target.intermediate_size, target.vocab_size
