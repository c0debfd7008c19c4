"""A small DeepSeek-V3-architecture model with a multi-token-prediction (MTP) module, trained on the
default model's corpus, for measuring `--speculative mtp` on a model whose MTP module is trained.

The model is transformers' DeepseekV3ForCausalLM (MLA, a dense first layer, then MoE layers with
sigmoid routing, a correction bias and shared experts). The MTP module is built from the same
transformers pieces as DeepSeek-V3 describes it (spec 3.1-3.2, ../shared/specs/mla-mtp-dsa-longcat.md):
for position i, u_i = block(eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])) with h_i the main model's
final (normed) hidden state, and shared_head(u_i) predicts t_{i+2}; the embedding and the output head are
shared with the main model. The loss is the main next-token loss plus mtp_loss_weight times the MTP's.
The routing correction biases are trained as DeepSeek-V3 does (aux-loss-free balancing: after each
step, every bias moves by bias_update_speed towards the experts that got fewer tokens than average).

The checkpoint is what DeepSeek-V3 ships: config.json (num_nextn_predict_layers 1), model.safetensors
with the main model under transformers' names and the MTP module at layer index num_hidden_layers
(enorm, hnorm, eh_proj, shared_head.norm / .head, a copy of the embedding, the decoder block with
per-expert names), generation_config.json and the tokenizer. transformers loads it (ignoring the MTP
layer); Atlas serves it with or without `--speculative mtp`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

DEFAULT_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "default-model"


@dataclass
class MTPModelShape:
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    q_lora_rank: int | None = 128
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 32
    v_head_dim: int = 32
    intermediate_size: int = 768  # dense layers
    moe_intermediate_size: int = 128
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_group: int = 2
    topk_group: int = 1
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 1.0
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


def deepseek_v3_config(shape: MTPModelShape, vocab_size: int, eos_token_id: int, pad_token_id: int) -> Any:
    from transformers import DeepseekV3Config

    kwargs = asdict(shape)
    rope_theta = kwargs.pop("rope_theta")
    cfg = DeepseekV3Config(vocab_size=vocab_size, bos_token_id=None, eos_token_id=eos_token_id,
                           pad_token_id=pad_token_id, num_key_value_heads=shape.num_attention_heads,
                           head_dim=shape.qk_rope_head_dim, norm_topk_prob=True, num_nextn_predict_layers=1,
                           tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                           **kwargs)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg._attn_implementation = "sdpa"
    return cfg


class MTPModule(nn.Module):
    """The MTP module's own weights (enorm, hnorm, eh_proj, the block, shared_head.norm); the embedding
    and the head are the main model's."""

    def __init__(self, config: Any):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = DeepseekV3RMSNorm(d, eps)
        self.hnorm = DeepseekV3RMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.head_norm = DeepseekV3RMSNorm(d, eps)


class LMWithMTP(nn.Module):
    """DeepseekV3ForCausalLM plus one MTP module; `losses` gives both next-token losses of a batch."""

    def __init__(self, config: Any, seed: int = 0):
        super().__init__()
        from transformers import DeepseekV3ForCausalLM

        torch.manual_seed(seed)
        self.lm = DeepseekV3ForCausalLM(config).float()
        self.mtp = MTPModule(config).float()
        with torch.no_grad():
            for m in self.mtp.modules():  # transformers' initialisation (experts and router included)
                self.lm._init_weights(m)

    def mtp_hidden(self, hidden: torch.Tensor, next_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Main hidden states h_i [B, S, D] (normed) and tokens t_{i+1} [B, S] -> u_i [B, S, D]."""
        mtp = self.mtp
        e = mtp.enorm(self.lm.model.embed_tokens(next_ids))
        z = mtp.eh_proj(torch.cat([e, mtp.hnorm(hidden)], dim=-1))
        cos_sin = self.lm.model.rotary_emb(z, position_ids)
        return mtp.block(z, attention_mask=None, position_embeddings=cos_sin)  # causal (sdpa)

    def losses(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (main next-token CE, MTP CE of t_{i+2}, MTP top-1 hits) over the window."""
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device)[None].expand(b, -1)
        hidden = self.lm.model(input_ids=input_ids, position_ids=positions, use_cache=False).last_hidden_state
        logits = self.lm.lm_head(hidden)
        main = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        # Row i: hidden h_i and token t_{i+1} (= labels[i]) predict t_{i+2} (= labels[i + 1]).
        u = self.mtp_hidden(hidden[:, :-1], labels[:, :-1], positions[:, :-1])
        mtp_logits = self.lm.lm_head(self.mtp.head_norm(u)).float()
        target = labels[:, 1:]
        mtp = F.cross_entropy(mtp_logits.flatten(0, 1), target.flatten())
        hits = (mtp_logits.argmax(-1) == target).sum()
        return main, mtp, hits


class RouterBalance:
    """Aux-loss-free load balancing: counts the tokens each expert gets in training forwards, and moves
    each router's e_score_correction_bias by `speed` towards under-loaded experts."""

    def __init__(self, model: nn.Module, speed: float):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.speed = speed
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.counts: dict[int, torch.Tensor] = {}
        for r in self.routers:
            r.register_forward_hook(self._record)

    def _record(self, router: nn.Module, args, out) -> None:
        if router.training and self.speed:
            ids = out[2].flatten()
            counts = torch.bincount(ids, minlength=router.num_experts)
            self.counts[id(router)] = self.counts.get(id(router), 0) + counts

    @torch.no_grad()
    def update(self) -> None:
        for r in self.routers:
            counts = self.counts.pop(id(r), None)
            if counts is not None:
                load = counts.float()
                r.e_score_correction_bias += self.speed * torch.sign(load.mean() - load)

    def imbalance(self) -> list[float]:
        """max/mean tokens per expert of each router in the last recorded step (1.0 = balanced)."""
        return [round(float(c.max() / c.float().mean()), 3) for c in self.counts.values() if c.sum() > 0]


def mtp_checkpoint_tensors(module_state: dict[str, torch.Tensor], embed: torch.Tensor, head: torch.Tensor,
                           layer_idx: int) -> dict[str, torch.Tensor]:
    """The MTP module's tensors under DeepSeek-V3's names at `model.layers.{layer_idx}.`: enorm, hnorm,
    eh_proj, shared_head.norm / .head, embed_tokens, and the decoder block with per-expert names (from
    transformers' fused `experts.gate_up_proj` [E, 2I, D] / `experts.down_proj` [E, D, I]).
    module_state: the block's state dict under `block.` plus enorm, hnorm, eh_proj and head_norm."""
    prefix = f"model.layers.{layer_idx}."
    out = {prefix + "embed_tokens.weight": embed, prefix + "shared_head.head.weight": head}
    for name, t in module_state.items():
        if name.startswith("head_norm."):
            out[prefix + "shared_head.norm." + name[len("head_norm."):]] = t
        elif name == "block.mlp.experts.gate_up_proj":
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2)
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up
        elif name == "block.mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = t[e]
        elif name.startswith("block."):
            out[prefix + name[len("block."):]] = t
        else:
            out[prefix + name] = t
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in out.items()}


def save_mtp_checkpoint(model: LMWithMTP, out: Path, eos_token_ids: list[int], pad_token_id: int,
                        dtype: torch.dtype = torch.bfloat16) -> None:
    """transformers' checkpoint of the main model, plus the MTP module's tensors in model.safetensors."""
    from safetensors.torch import load_file, save_file

    from atlas.training.lm import save_checkpoint

    save_checkpoint(model.lm, out, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, dtype=dtype)
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    state = {k: v.to(dtype) for k, v in model.mtp.state_dict().items()}
    state["block.mlp.gate.e_score_correction_bias"] = model.mtp.block.mlp.gate.e_score_correction_bias.float()
    tensors |= mtp_checkpoint_tensors(state, tensors["model.embed_tokens.weight"],
                                      tensors["lm_head.weight"], model.lm.config.num_hidden_layers)
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)


# ---------------------------------------------------------------------------------------- the recipe
@dataclass
class MTPModelSettings:
    out: str
    device: str = "auto"
    seed: int = 0
    time_budget_minutes: float = 5.0  # the whole run, corpus to measured acceptance; 0 = no limit
    max_steps: int = 100_000
    max_epochs: float = 40.0
    tokenizer: str | None = None  # folder with tokenizer.json (default: the shipped default model's)
    # corpus
    corpus_limit_mb: float | None = None
    stdlib_dir: str | None = None
    chat_data: bool = True
    shape: MTPModelShape = field(default_factory=MTPModelShape)
    # training
    seq_len: int = 1024
    batch_size: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_loss_weight: float = 0.3
    bias_update_speed: float = 1e-3
    eval_every: int = 250
    eval_tokens: int = 65_536
    keep_best: bool = True
    compile: bool = False
    # measured acceptance through the engine
    engine_eval: bool = True
    eval_prompts: int = 32
    eval_prompt_tokens: int = 64
    eval_max_tokens: int = 64
    eval_draft_tokens: tuple[int, ...] = (1, 2, 3)
    extra: dict[str, Any] = field(default_factory=dict)


@torch.no_grad()
def evaluate(model: LMWithMTP, tokens: Any, seq_len: int, batch_size: int, device: torch.device,
             autocast: torch.dtype | None, max_tokens: int, weight: float) -> dict[str, float]:
    """Held-out main and MTP losses, and the MTP's top-1 accuracy on t_{i+2} (the chance that a first
    draft is accepted under greedy decoding, were the main model always right)."""
    from atlas.training.data import eval_windows
    from atlas.training.evaluate import autocast_for

    full, _ = eval_windows(tokens, seq_len, max_tokens)
    was = model.training
    model.eval()
    main = mtp = hits = 0.0
    rows = 0
    for i in range(0, len(full), batch_size):
        w = full[i:i + batch_size].to(device)
        with autocast_for(device, autocast):
            m, t, h = model.losses(w[:, :-1], w[:, 1:])
        main += float(m) * w.shape[0]
        mtp += float(t) * w.shape[0]
        hits += float(h)
        rows += w.shape[0]
    model.train(was)
    main, mtp = main / max(1, rows), mtp / max(1, rows)
    return {"loss": round(main + weight * mtp, 5), "main_loss": round(main, 5), "mtp_loss": round(mtp, 5),
            "mtp_top1": round(hits / max(1, rows * (seq_len - 1)), 4)}


def run(settings: MTPModelSettings, started_at: float | None = None, command: str | None = None) -> dict:
    """Train into settings.out; returns the report (also written as train_report.json)."""
    import math

    from tokenizers import Tokenizer

    from atlas.training.data import PackedWindows
    from atlas.training.dflash import engine_acceptance, held_out_prompts
    from atlas.training.lm import count_parameters
    from atlas.training.recipe import (
        report_header,
        start_run,
        tokenized_corpus,
        train_config,
        training_report,
    )
    from atlas.training.tokenizer import IM_END_TOKEN
    from atlas.training.trainer import Trainer

    run_ = start_run(settings.out, settings.device, settings.seed, settings.time_budget_minutes, started_at)
    out, device, clock, autocast = run_.out, run_.device, run_.clock, run_.autocast

    # ------------------------------------------------------------------ corpus, tokenized by the default tokenizer
    tok_dir = Path(settings.tokenizer) if settings.tokenizer else DEFAULT_TOKENIZER
    if not (tok_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{tok_dir} has no tokenizer.json: pass --tokenizer (a folder with tokenizer.json)")
    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    corpus, streams, eos_id = tokenized_corpus(tokenizer, clock, settings.seed, settings.chat_data,
                                               settings.corpus_limit_mb, settings.stdlib_dir)
    im_end = tokenizer.token_to_id(IM_END_TOKEN)
    vocab_size = 64 * math.ceil(tokenizer.get_vocab_size() / 64)
    logger.info("tokenizer %s: %d tokens, model vocabulary %d", tok_dir, tokenizer.get_vocab_size(), vocab_size)

    # ------------------------------------------------------------------ model
    shape = settings.shape
    if settings.seq_len > shape.max_position_embeddings:
        raise ValueError(f"--seq-len {settings.seq_len} exceeds --max-position-embeddings {shape.max_position_embeddings}")
    config = deepseek_v3_config(shape, vocab_size, eos_id, eos_id)
    model = LMWithMTP(config, settings.seed).to(device)
    n_params = count_parameters(model)
    logger.info("model: DeepseekV3 %s + 1 MTP module, %.2f M parameters (%.1f MB in bf16)", asdict(shape),
                n_params / 1e6, 2 * n_params / 1e6)
    balance = RouterBalance(model, settings.bias_update_speed)
    weight = settings.mtp_loss_weight

    def loss_fn(m: LMWithMTP, batch: Any) -> torch.Tensor:
        balance.update()  # the previous step's loads move the correction biases
        main, mtp, _ = m.losses(batch.input_ids, batch.labels)
        return main + weight * mtp

    def eval_fn(m: LMWithMTP) -> dict[str, float]:
        metrics = evaluate(m, streams["valid"], settings.seq_len, settings.batch_size, device, autocast,
                           settings.eval_tokens, weight)
        return {**metrics, "router_max_over_mean": max(balance.imbalance(), default=0.0)}

    windows = PackedWindows(streams["train"], settings.seq_len, settings.batch_size, settings.seed, device)
    step_cap = max(1, math.ceil(settings.max_epochs * windows.steps_per_epoch))
    prompts = held_out_prompts(corpus.split("test"), tokenizer, settings.eval_prompts, settings.eval_prompt_tokens,
                               settings.seed) if settings.engine_eval else []
    reserve = ((90.0 if device.type == "cuda" else 30.0) if settings.engine_eval else 10.0) + 10.0
    train_deadline = run_.train_deadline(reserve)
    train_cfg = train_config(settings, autocast)
    trainer = Trainer(model, train_cfg, device, loss_fn, eval_fn)
    with clock.phase("training"):
        result = trainer.fit(windows, deadline=train_deadline, step_cap=step_cap)

    with clock.phase("evaluation"), torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # exactly the weights the checkpoint holds
        test = evaluate(model, streams["test"], settings.seq_len, settings.batch_size, device, autocast,
                        settings.eval_tokens, weight)
    logger.info("held-out test: %s (main perplexity %.3f)", test, math.exp(test["main_loss"]))
    with clock.phase("save"):
        save_mtp_checkpoint(model, out, eos_token_ids=[t for t in (im_end, eos_id) if t is not None],
                            pad_token_id=eos_id)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tok_dir / name).is_file():
                (out / name).write_bytes((tok_dir / name).read_bytes())
    trainer = model = None
    if device.type == "cuda":
        torch.cuda.empty_cache()

    engine: dict[str, Any] = {}
    if prompts:
        with clock.phase("engine_acceptance"):
            try:
                methods = ("plain", *(f"mtp:{k}" for k in settings.eval_draft_tokens))
                engine = engine_acceptance(out, None, prompts, settings.eval_max_tokens, device.type, methods)
            except Exception as exc:  # report it; the checkpoint is written either way
                logger.exception("measuring acceptance through the engine failed")
                engine = {"error": f"{type(exc).__name__}: {exc}"}

    report = {
        **report_header(settings, command, result, run_),
        "tokenizer": {"path": str(tok_dir), "vocab_size": tokenizer.get_vocab_size(), "model_vocab_size": vocab_size},
        "model": {"architecture": "DeepseekV3ForCausalLM", **asdict(shape), "num_nextn_predict_layers": 1,
                  "parameters": n_params, "checkpoint_bytes": (out / "model.safetensors").stat().st_size},
        "corpus": {"python": corpus.python_version, "stdlib_dir": corpus.stdlib_dir, **corpus.stats,
                   "stream_tokens": {k: int(len(v)) for k, v in streams.items()}},
        "training": training_report(result, tokens=result.tokens,
                                    epochs=round(result.steps / windows.steps_per_epoch, 3)),
        "held_out_test": {**test, "main_perplexity": round(math.exp(test["main_loss"]), 3),
                          "weights": "bfloat16 (as saved)"},
        "engine_acceptance": {"split": "test", "prompts": len(prompts), "max_tokens": settings.eval_max_tokens,
                              "sampling": "greedy", **engine},
        "timings_seconds": run_.timings(),
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    logger.info("wrote %s in %.1fs", out, report["timings_seconds"]["total"])
    return report
