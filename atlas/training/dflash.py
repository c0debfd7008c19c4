"""Training a DFlash block-diffusion drafter for a frozen target model, saved in the z-lab format.

Recipe (../shared/specs/dflash.md for the format and the inference semantics it must match):
- The target is frozen. For each window of corpus tokens it gives the residual streams after the
  decoder layers `target_layer_ids` (pre-final-norm, = HF hidden_states[id + 1]) and, as labels, its
  own greedy token at every position (argmax of its logits; corpus tokens with greedy_labels off).
- Several random anchors per window. The block of anchor a is [token at a, MASK x (B - 1)] at
  positions a .. a + B - 1. It attends, without a causal mask, to the context K/V of positions < a
  (fc + hidden_norm of the captured features, projected by each draft layer's k/v, k_norm, RoPE)
  and to its own B positions. All blocks of a window are queries of one attention call with a
  boolean mask over [context ++ blocks].
- Loss: cross-entropy of block slot j = 1 .. B - 1 (through the target's frozen LM head) against the
  label of position a + j, weighted by exp(-(j - 1) / gamma) so early slots, which decide how many
  drafts get accepted, count most.
- The drafter has the target's width, heads and MLP size; it has no embedding or LM head (the
  target's are used). It is the serving module itself (atlas.models.dflash.DFlashDraftModel), run
  through its cache-free `forward_train`, so the weights trained are the weights served. Saved as config.json (architectures DFlashDraftModel, dflash_config,
  block_size) + model.safetensors with unprefixed keys, which Atlas loads with --draft-model, or
  with no flag at all when the folder is copied to <model>/dflash-drafter/.

`run(settings)` does everything: corpus (atlas.training.corpus) tokenized with the target's own
tokenizer, packed windows (atlas.training.data), the general training loop (atlas.training.trainer)
under a wall-clock budget, a held-out block evaluation, the checkpoint, and the mean acceptance
length measured through the Atlas engine on held-out prompts.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atlas.layers.linear import Linear
from atlas.layers.norm import RMSNorm
from atlas.models.dflash import DFlashConfig, DFlashDraftModel, default_target_layer_ids

logger = logging.getLogger(__name__)

MASK_TOKEN_CANDIDATES = ("<|mask|>", "<|MASK|>", "<mask>")


def default_loss_gamma(block_size: int) -> float:
    """Decay of the per-slot loss weight (the DFlash paper uses 7 for blocks of 16, 5 for 10, 4 for 8)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2))


# ---------------------------------------------------------------------------------------- the model
@dataclass
class DrafterShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    vocab_size: int
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048


def build_drafter(shape: DrafterShape, max_positions: int | None = None, std: float = 0.02) -> DFlashDraftModel:
    """The serving module (atlas.models.dflash.DFlashDraftModel) built from the config.json that
    `save_drafter` will write, with fresh weights: matrices ~ N(0, std), norms 1."""
    cfg = DFlashConfig.from_dict(drafter_config(shape, "float32"), Path("<training>"))
    model = DFlashDraftModel(cfg, max(max_positions or 0, shape.max_position_embeddings))
    reset_parameters(model, std)
    return model


def reset_parameters(model: DFlashDraftModel, std: float = 0.02) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, A * B]: positions a .. a + B - 1 of each anchor's block, blocks one after the other."""
    offs = torch.arange(block_size, device=anchors.device)
    return (anchors[:, :, None] + offs).flatten(1)


def block_attention_mask(anchors: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """[N, A * B, L + A * B] bool over [context ++ blocks]: a block sees the context positions before
    its anchor (what the server has committed when it drafts there) and its own B slots."""
    n, num_anchors = anchors.shape
    q_len = num_anchors * block_size
    dev = anchors.device
    block_of_q = torch.arange(q_len, device=dev) // block_size
    sees_ctx = torch.arange(length, device=dev)[None, None, :] < anchors.repeat_interleave(block_size, dim=1)[:, :, None]
    sees_blk = (block_of_q[:, None] == block_of_q[None, :]).expand(n, q_len, q_len)
    return torch.cat([sees_ctx, sees_blk], dim=-1)


def drafter_forward(model: DFlashDraftModel, features: torch.Tensor, block_embeds: torch.Tensor,
                    anchors: torch.Tensor) -> torch.Tensor:
    """features [N, L, F*H]: target features of a window's positions 0..L-1; block_embeds
    [N, A*B, H]: target embeddings of the A blocks [x0, MASK...] of each window; anchors [N, A]: the
    position of each block's x0. -> final-normed hidden [N, A*B, H], all blocks in one masked attention."""
    bsz = model.config.block_size
    return model.forward_train(features, block_embeds, block_positions(anchors, bsz),
                               block_attention_mask(anchors, bsz, features.shape[1]))


# ---------------------------------------------------------------------------------------- the target
class FrozenTarget:
    """A Hugging Face causal LM, frozen, that gives DFlash features and greedy labels for windows."""

    def __init__(self, model: nn.Module, layer_ids: list[int], autocast_dtype: torch.dtype | None):
        self.model = model.eval().requires_grad_(False)
        self.layer_ids = list(layer_ids)
        self.autocast_dtype = autocast_dtype
        self.device = next(model.parameters()).device
        self._outputs: dict[int, torch.Tensor] = {}
        # The residual stream after decoder layer i is that layer's output. (transformers' last
        # hidden_states entry is after the final norm, so hooks rather than hidden_states[i + 1].)
        layers = model.model.layers
        for i in sorted(set(self.layer_ids)):
            layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, args, output):
            self._outputs[i] = output[0] if isinstance(output, tuple) else output
        return hook

    @property
    def embedding(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, want_greedy: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [N, L] -> (features [N, L, F*H], greedy next-token ids [N, L] or None)."""
        from atlas.training.evaluate import autocast_for

        self._outputs.clear()
        with autocast_for(self.device, self.autocast_dtype):
            if want_greedy:
                logits = self.model(input_ids=input_ids, use_cache=False).logits
                greedy = logits.argmax(-1)
                del logits
            else:
                self.model.model(input_ids=input_ids, use_cache=False)
                greedy = None
        feats = torch.cat([self._outputs[i] for i in self.layer_ids], dim=-1)
        self._outputs.clear()
        return feats, greedy


@dataclass
class BlockBatch:
    features: torch.Tensor  # [N, L, F*H]
    block_embeds: torch.Tensor  # [N, A*B, H]
    anchors: torch.Tensor  # [N, A]
    labels: torch.Tensor  # [N, A, B-1]: the token each slot 1..B-1 should predict

    @property
    def num_tokens(self) -> int:
        return self.labels.numel()


def sample_anchors(n: int, length: int, num_anchors: int, block_size: int, generator: torch.Generator | None,
                   device: torch.device) -> torch.Tensor:
    """[n, num_anchors] distinct anchors per row in [1, length - block_size] (a block fits, with context)."""
    span = length - block_size  # anchors 1 .. span
    if span < 1:
        raise ValueError(f"windows of {length} tokens cannot hold a block of {block_size} after one context token")
    k = min(num_anchors, span)
    scores = torch.rand(n, span, generator=generator)
    return (scores.topk(k, dim=1).indices + 1).sort(dim=1).values.to(device)


def make_batch(target: FrozenTarget, input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
               mask_token_id: int, greedy_labels: bool) -> BlockBatch:
    feats, greedy = target(input_ids, want_greedy=greedy_labels)
    n = input_ids.shape[0]
    offs = torch.arange(block_size, device=input_ids.device)
    x0 = input_ids.gather(1, anchors)  # [N, A]
    block = torch.full((n, anchors.shape[1], block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    block[:, :, 0] = x0
    with torch.no_grad():
        embeds = target.embedding(block.flatten(1))
    pos = anchors[:, :, None] + offs[1:]  # positions a+1 .. a+B-1
    if greedy_labels:
        labels = greedy.gather(1, (pos - 1).flatten(1)).view_as(pos)  # the target's token after position p-1
    else:
        labels = input_ids.gather(1, pos.flatten(1)).view_as(pos)
    return BlockBatch(feats.detach(), embeds.detach(), anchors, labels)


def block_logits(model: DFlashDraftModel, target: FrozenTarget, batch: BlockBatch) -> torch.Tensor:
    """[N, A, B-1, V] logits of the draft slots, through the target's frozen LM head."""
    n, num_anchors = batch.anchors.shape
    bsz = model.config.block_size
    hidden = drafter_forward(model, batch.features, batch.block_embeds, batch.anchors)
    hidden = hidden.view(n, num_anchors, bsz, -1)[:, :, 1:]
    return target.lm_head(hidden)


def slot_weights(block_size: int, gamma: float, device: torch.device) -> torch.Tensor:
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


def drafter_loss(model: DFlashDraftModel, target: FrozenTarget, batch: BlockBatch, gamma: float) -> torch.Tensor:
    logits = block_logits(model, target, batch).float()
    ce = F.cross_entropy(logits.flatten(0, 2), batch.labels.flatten(), reduction="none").view(batch.labels.shape)
    w = slot_weights(model.config.block_size, gamma, ce.device)
    return (ce * w).sum(-1).mean() / w.sum()


@torch.no_grad()
def evaluate_blocks(model: DFlashDraftModel, target: FrozenTarget, batches: list[BlockBatch], gamma: float,
                    autocast_dtype: torch.dtype | None) -> dict[str, float]:
    """Held-out weighted loss, per-slot accuracy, and the acceptance length a verifier would see if
    the labels were what the target emits: 1 + the number of leading correct slots, averaged."""
    from atlas.training.evaluate import autocast_for

    was_training = model.training
    model.eval()
    total = 0.0
    correct = None
    accept = 0.0
    blocks = 0
    for batch in batches:
        with autocast_for(batch.features.device, autocast_dtype):
            logits = block_logits(model, target, batch).float()
        ce = F.cross_entropy(logits.flatten(0, 2), batch.labels.flatten(), reduction="none").view(batch.labels.shape)
        w = slot_weights(model.config.block_size, gamma, ce.device)
        total += float((ce * w).sum(-1).mean() / w.sum()) * batch.labels.shape[0]
        hit = logits.argmax(-1) == batch.labels  # [N, A, B-1]
        correct = hit.float().sum((0, 1)) if correct is None else correct + hit.float().sum((0, 1))
        accept += float((1 + hit.int().cumprod(-1).sum(-1)).float().sum())
        blocks += hit.shape[0] * hit.shape[1]
    model.train(was_training)
    rows = sum(b.labels.shape[0] for b in batches)
    acc = (correct / blocks).tolist() if correct is not None else []
    return {"loss": round(total / max(1, rows), 5), "acceptance_length": round(accept / max(1, blocks), 4),
            "slot1_accuracy": round(acc[0], 4) if acc else 0.0,
            "slot_accuracy": [round(a, 3) for a in acc]}


# ---------------------------------------------------------------------------------------- checkpoint
def drafter_config(shape: DrafterShape, dtype: str = "bfloat16") -> dict[str, Any]:
    s = shape
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": s.rope_theta},
        "max_position_embeddings": s.max_position_embeddings,
        "tie_word_embeddings": False,
        "vocab_size": s.vocab_size,
        "torch_dtype": dtype,
        "layer_types": ["full_attention"] * s.num_hidden_layers,
        "block_size": s.block_size,
        "num_target_layers": s.num_target_layers,
        "dflash_config": {"target_layer_ids": list(s.target_layer_ids), "mask_token_id": s.mask_token_id},
    }


def save_drafter(model: DFlashDraftModel, out_dir: Path | str, dtype: torch.dtype = torch.bfloat16) -> list[Path]:
    """config.json (the model's own, with this dtype) + model.safetensors (unprefixed z-lab keys, no
    embedding or LM head): the tensors `DFlashDraftModel.load_weights` reads back into the same model."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {**model.config.raw, "torch_dtype": str(dtype).replace("torch.", "")}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in model.checkpoint_tensors().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return [out / "config.json", out / "model.safetensors"]


# ---------------------------------------------------------------------------------------- helpers
def find_mask_token_id(tokenizer: Any, model_vocab_size: int) -> int:
    """The tokenizer's mask token if it has one, else the first id past its vocabulary (if the
    model's embedding has that row: the drafter never resizes the target)."""
    for token in MASK_TOKEN_CANDIDATES:
        tid = tokenizer.token_to_id(token)
        if tid is not None:
            return int(tid)
    first_unused = tokenizer.get_vocab_size()
    if first_unused < model_vocab_size:
        return first_unused
    raise ValueError("the target's tokenizer has no mask token and no spare embedding row: give --mask-token-id")


def held_out_prompts(docs: list, tokenizer: Any, count: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """Prompts from held-out documents: chats up to the assistant's turn, other documents' first tokens."""
    import random

    rng = random.Random(seed)
    chats = [d for d in docs if d.kind == "chat"]
    others = [d for d in docs if d.kind != "chat"]
    rng.shuffle(chats)
    rng.shuffle(others)
    prompts: list[list[int]] = []
    marker = "<|im_start|>assistant\n"
    for i in range(count):
        pool = chats if (i % 2 == 0 and chats) or not others else others
        if not pool:
            break
        doc = pool.pop()
        if doc.kind == "chat" and marker in doc.text:
            text = doc.text[: doc.text.index(marker) + len(marker)]
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            ids = ids[-4 * prompt_tokens:]
        else:
            ids = tokenizer.encode(doc.text, add_special_tokens=False).ids[:prompt_tokens]
        if len(ids) >= 4:
            prompts.append(ids)
    return prompts


def engine_acceptance(target_path: Path, drafter_path: Path | None, prompts: list[list[int]], max_tokens: int,
                      device: str, methods: tuple[str, ...] = ("plain", "dflash", "ngram")) -> dict[str, Any]:
    """Generate greedily for the held-out prompts (all at once) through the Atlas engine, per method
    ("plain", "dflash", "ngram", or "mtp:K" for the target's MTP module with K drafts): mean acceptance
    length, output tokens, seconds; and whether the outputs equal plain decoding."""
    from atlas import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    max_len = max(len(p) for p in prompts) + max_tokens + 32
    common: dict[str, Any] = dict(device=device, max_model_len=max_len, max_num_seqs=max(1, len(prompts)),
                                  skip_tokenizer_init=True)
    if device == "cuda":
        common["num_gpu_blocks_override"] = len(prompts) * (-(-max_len // 16) + 2) + 16
    else:
        common["kv_cache_memory"] = "256MiB"
    results: dict[str, Any] = {}
    plain_tokens = None
    for method in methods:
        kwargs = dict(common)
        if method == "dflash":
            kwargs.update(speculative="dflash", draft_model=str(drafter_path))
        elif method == "ngram":
            kwargs.update(speculative="ngram")
        elif method.startswith("mtp"):
            kwargs.update(speculative="mtp", num_draft_tokens=int(method.partition(":")[2] or 1))
        t = time.perf_counter()
        llm = LLM(str(target_path), **kwargs)
        load_s = time.perf_counter() - t
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4, temperature=0))
        llm.engine.scheduler.stats = type(llm.engine.stats)()  # count the measured run only
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        tokens = [o.outputs[0].token_ids for o in outs]
        stats = llm.engine.stats
        n_tokens = sum(map(len, tokens))
        entry = {"seconds": round(seconds, 3), "output_tokens": n_tokens,
                 "tokens_per_second": round(n_tokens / max(1e-9, seconds), 1), "engine_load_seconds": round(load_s, 2)}
        if method != "plain":
            entry.update(mean_acceptance_length=round(stats.spec_mean_acceptance_length or 1.0, 4),
                         draft_tokens=stats.spec_num_draft_tokens, accepted_tokens=stats.spec_num_accepted_tokens,
                         verify_steps=stats.spec_num_verify_steps)
        if method == "plain":
            plain_tokens = tokens
        elif plain_tokens is not None:
            entry["outputs_equal_plain"] = tokens == plain_tokens
        results[method] = entry
        logger.info("engine %s: %s", method, entry)
        del llm
        if device == "cuda":
            torch.cuda.empty_cache()
    if "plain" in results:
        for method in methods:
            if method != "plain":
                results[method]["speedup_vs_plain"] = round(results["plain"]["seconds"] / results[method]["seconds"], 3)
    return results


# ---------------------------------------------------------------------------------------- the recipe
@dataclass
class DFlashTrainSettings:
    target: str
    out: str
    device: str = "auto"
    seed: int = 0
    time_budget_minutes: float = 3.5  # the whole run, corpus to measured acceptance; 0 = no limit
    max_steps: int = 100_000
    # drafter
    num_layers: int = 2
    block_size: int = 8
    target_layer_ids: list[int] | None = None  # default: the z-lab rule for num_layers draft layers
    mask_token_id: int | None = None  # default: the tokenizer's <|mask|>
    intermediate_size: int | None = None  # default: the target's
    # data
    corpus_limit_mb: float | None = None
    stdlib_dir: str | None = None  # another Python's stdlib folder (default: the running Python's)
    chat_data: bool = True
    seq_len: int = 512
    batch_size: int = 32
    anchors_per_window: int = 64
    greedy_labels: bool = True
    loss_gamma: float | None = None  # default: by block size (default_loss_gamma)
    # optimisation
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_windows: int = 64
    keep_best: bool = True
    compile: bool = False
    # measured acceptance through the engine
    eval_prompts: int = 32
    eval_prompt_tokens: int = 64
    eval_max_tokens: int = 64
    engine_eval: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def run(settings: DFlashTrainSettings, started_at: float | None = None, command: str | None = None) -> dict:
    """Train a drafter for settings.target into settings.out; returns the report (also written as
    train_report.json next to config.json and model.safetensors)."""
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    from atlas.training.data import PackedWindows, eval_windows
    from atlas.training.recipe import (
        report_header,
        start_run,
        tokenized_corpus,
        train_config,
        training_report,
    )
    from atlas.training.trainer import Trainer

    run_ = start_run(settings.out, settings.device, settings.seed, settings.time_budget_minutes, started_at)
    out, device, clock, autocast = run_.out, run_.device, run_.clock, run_.autocast
    target_path = Path(settings.target)
    logger.info("target %s", target_path)

    # ------------------------------------------------------------------ target and drafter shape
    if not (target_path / "config.json").is_file() or not (target_path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{target_path} is not a target checkpoint with config.json and tokenizer.json: pass "
                                "--target (train the default model first with tools/train_default_model.py)")
    tcfg = AutoConfig.from_pretrained(target_path)
    n_layers = tcfg.num_hidden_layers
    layer_ids = list(settings.target_layer_ids or default_target_layer_ids(n_layers, settings.num_layers))
    if settings.target_layer_ids is None and (len(set(layer_ids)) < len(layer_ids)
                                              or not all(0 <= i < n_layers for i in layer_ids)):
        # Shallow targets (N < 5) make the rule repeat layers or leave the range: read each valid one once.
        valid = sorted({i for i in layer_ids if 0 <= i < n_layers}) or [n_layers // 2]
        logger.warning("the default layer rule gives %s for %d target layers: using %s", layer_ids, n_layers, valid)
        layer_ids = valid
    if not layer_ids or min(layer_ids) < 0 or max(layer_ids) >= n_layers:
        raise ValueError(f"target layer ids {layer_ids} are not all in 0..{n_layers - 1}: give --target-layer-ids")
    tokenizer = Tokenizer.from_file(str(target_path / "tokenizer.json"))
    mask_id = settings.mask_token_id if settings.mask_token_id is not None else find_mask_token_id(
        tokenizer, tcfg.vocab_size)
    rope_theta = getattr(tcfg, "rope_theta", None) or (getattr(tcfg, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0)
    head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
    shape = DrafterShape(
        hidden_size=tcfg.hidden_size, intermediate_size=settings.intermediate_size or tcfg.intermediate_size,
        num_hidden_layers=settings.num_layers, num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads, head_dim=head_dim, target_layer_ids=layer_ids,
        block_size=settings.block_size, mask_token_id=mask_id, vocab_size=tcfg.vocab_size,
        num_target_layers=n_layers, rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta), max_position_embeddings=int(tcfg.max_position_embeddings))
    gamma = settings.loss_gamma or default_loss_gamma(settings.block_size)
    logger.info("drafter: %s, loss gamma %.1f", asdict(shape), gamma)

    # ------------------------------------------------------------------ corpus, tokenized by the target's tokenizer
    corpus, streams, _ = tokenized_corpus(tokenizer, clock, settings.seed, settings.chat_data, settings.corpus_limit_mb,
                                          settings.stdlib_dir)

    # ------------------------------------------------------------------ models
    hf = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.bfloat16 if autocast else torch.float32)
    target = FrozenTarget(hf.to(device), layer_ids, autocast)
    torch.manual_seed(settings.seed)
    drafter = build_drafter(shape, settings.seq_len).to(device)
    n_params = sum(p.numel() for p in drafter.parameters())
    logger.info("drafter parameters: %.2f M (%.1f MB in bf16)", n_params / 1e6, 2 * n_params / 1e6)

    gen = torch.Generator().manual_seed(settings.seed + 1)
    windows = PackedWindows(streams["train"], settings.seq_len, settings.batch_size, settings.seed, device)

    def batches():
        for w in windows:
            anchors = sample_anchors(w.input_ids.shape[0], settings.seq_len, settings.anchors_per_window,
                                     settings.block_size, gen, device)
            yield make_batch(target, w.input_ids, anchors, settings.block_size, mask_id, settings.greedy_labels)

    # Held-out blocks, fixed once: validation windows with seeded anchors.
    full, _ = eval_windows(streams["valid"], settings.seq_len)
    full = full[: settings.eval_windows, :-1].to(device)
    if len(full) == 0:
        raise RuntimeError("the validation split has no full window: use a larger corpus or a smaller --seq-len")
    eval_gen = torch.Generator().manual_seed(settings.seed + 2)
    eval_batches = []
    for i in range(0, len(full), settings.batch_size):
        rows = full[i:i + settings.batch_size]
        anchors = sample_anchors(rows.shape[0], settings.seq_len, settings.anchors_per_window, settings.block_size,
                                 eval_gen, device)
        eval_batches.append(make_batch(target, rows, anchors, settings.block_size, mask_id, settings.greedy_labels))

    def eval_fn(model: nn.Module) -> dict[str, float]:
        return evaluate_blocks(model, target, eval_batches, gamma, autocast)

    def loss_fn(model: nn.Module, batch: BlockBatch) -> torch.Tensor:
        return drafter_loss(model, target, batch, gamma)

    held_docs = corpus.split("test")
    prompts = held_out_prompts(held_docs, tokenizer, settings.eval_prompts, settings.eval_prompt_tokens,
                               settings.seed) if settings.engine_eval else []
    # Time kept back for saving and the engine measurement.
    reserve = (75.0 if device.type == "cuda" else 30.0) if settings.engine_eval else 5.0
    train_deadline = run_.train_deadline(reserve)
    train_cfg = train_config(settings, autocast)
    trainer = Trainer(drafter, train_cfg, device, loss_fn, eval_fn)
    with clock.phase("training"):
        result = trainer.fit(batches(), deadline=train_deadline)

    with clock.phase("evaluation"), torch.no_grad():
        for p in drafter.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # exactly the weights the checkpoint holds
        final = evaluate_blocks(drafter, target, eval_batches, gamma, autocast)
    logger.info("held-out blocks: %s", final)
    with clock.phase("save"):
        files = save_drafter(drafter, out)
    # Free the training state before the engine loads (the closures above hold these names).
    trainer = drafter = target = hf = eval_batches = None
    if device.type == "cuda":
        torch.cuda.empty_cache()

    engine: dict[str, Any] = {}
    if settings.engine_eval and prompts:
        with clock.phase("engine_acceptance"):
            try:
                engine = engine_acceptance(target_path, out, prompts, settings.eval_max_tokens, device.type)
            except Exception as exc:  # report it; the checkpoint is written either way
                logger.exception("measuring acceptance through the engine failed")
                engine = {"error": f"{type(exc).__name__}: {exc}"}

    report = {
        **report_header(settings, command, result, run_),
        "target": {"path": str(target_path), "num_hidden_layers": n_layers, "hidden_size": tcfg.hidden_size,
                   "vocab_size": tcfg.vocab_size},
        "drafter": {**asdict(shape), "parameters": n_params, "loss_gamma": gamma,
                    "files": [f.name for f in files],
                    "checkpoint_bytes": (out / "model.safetensors").stat().st_size},
        "corpus": {"python": corpus.python_version, "stdlib_dir": corpus.stdlib_dir, **corpus.stats,
                   "stream_tokens": {k: int(len(v)) for k, v in streams.items()}},
        "training": training_report(result, label_slots=result.tokens),
        "held_out_blocks": {"split": "valid", "labels": "target greedy" if settings.greedy_labels else "corpus",
                            **final},
        "engine_acceptance": {"split": "test", "prompts": len(prompts), "max_tokens": settings.eval_max_tokens,
                              "sampling": "greedy", **engine},
        "timings_seconds": run_.timings(),
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    logger.info("wrote %s in %.1fs", out, report["timings_seconds"]["total"])
    return report
