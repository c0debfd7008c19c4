"""Qwen3-architecture causal LMs built with `transformers`, their loss, and bf16 checkpoint saving.

The checkpoint is a plain Hugging Face folder (config.json, model.safetensors, generation_config.json)
that `transformers` and Atlas both load; tied embeddings store one matrix.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class Qwen3Shape:
    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True


def qwen3_config(shape: Qwen3Shape, vocab_size: int, eos_token_id: int, pad_token_id: int) -> Any:
    from transformers import Qwen3Config

    kwargs = asdict(shape)
    rope_theta = kwargs.pop("rope_theta")
    cfg = Qwen3Config(vocab_size=vocab_size, bos_token_id=None, eos_token_id=eos_token_id,
                      pad_token_id=pad_token_id, rope_theta=rope_theta, attention_bias=False,
                      use_sliding_window=False, max_window_layers=shape.num_hidden_layers, **kwargs)
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def build_qwen3(shape: Qwen3Shape, vocab_size: int, eos_token_id: int, pad_token_id: int,
                seed: int = 0) -> torch.nn.Module:
    """A freshly initialised Qwen3ForCausalLM in fp32 (transformers' own initialisation, seeded)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = qwen3_config(shape, vocab_size, eos_token_id, pad_token_id)
    model = Qwen3ForCausalLM(cfg)
    return model.float()


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied matrix counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def causal_lm_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Mean next-token cross-entropy (batch.input_ids -> batch.labels), computed in fp32."""
    logits = model(input_ids=batch.input_ids, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten())


def save_checkpoint(model: torch.nn.Module, out_dir: Path | str, eos_token_ids: list[int], pad_token_id: int,
                    dtype: torch.dtype = torch.bfloat16) -> list[Path]:
    """config.json + model.safetensors + generation_config.json, weights in `dtype`.

    generation_config lists every end token (end of document and end of chat turn) so that both
    transformers' generate() and Atlas stop at either. config.json also gets a top-level rope_theta,
    so that transformers 4.x (which does not read `rope_parameters`) uses the same RoPE base.
    """
    import copy

    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    copy_ = copy.deepcopy(model).to(device="cpu", dtype=dtype)
    copy_.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=list(eos_token_ids),
                                               pad_token_id=pad_token_id)
    copy_.config.use_cache = True
    copy_.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600
    return [cfg_path, out / "model.safetensors", out / "generation_config.json"]
