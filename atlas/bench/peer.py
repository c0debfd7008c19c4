"""The peer of `atlas bench latency`: the decoder a user writes in plain PyTorch, with no Atlas code.

Llama / Qwen2 / Qwen3 checkpoints (q/k/v/o with optional bias, Qwen3's q_norm / k_norm, SwiGLU MLP,
RMSNorm, plain RoPE, tied or untied head), read from safetensors. Multi-head latent attention and mixtures
of experts (DeepSeek) are refused (`unsupported_reason`): `atlas bench latency` then runs without a peer. A static contiguous KV cache
[layers, batch, max_len, kv_heads, head_dim]; one decode step for the whole batch is a function of
(token ids, position): SDPA over the whole cache with a mask, greedy argmax. On CUDA that step is
captured in one CUDA graph, optionally compiled with torch.compile inside the graph.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def unsupported_reason(cfg: dict) -> str | None:
    """Why this peer cannot run a config whose attention or MLP is not the dense GQA decoder it
    writes out (None when it can; its architecture and RoPE checks come after)."""
    arch = (cfg.get("architectures") or ["?"])[0]
    features = []
    if cfg.get("kv_lora_rank"):
        features.append(f"multi-head latent attention (kv_lora_rank {cfg['kv_lora_rank']}, "
                        f"qk_rope_head_dim {cfg.get('qk_rope_head_dim')}: one latent row per token, not K/V heads)")
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        features.append(f"a mixture of experts ({experts} routed experts)")
    if not features:
        return None
    return (f"the plain-PyTorch peer is a dense GQA decoder; {arch} uses {' and '.join(features)}, "
            "which it does not model")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [B, T, heads, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


class PeerDecoder:
    def __init__(self, path: str | Path, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                 use_graph: bool | None = None, compile: bool = False):
        path, self.device, self.dtype = Path(path), torch.device(device), dtype
        cfg = json.loads((path / "config.json").read_text())
        reason = unsupported_reason(cfg)
        if reason:
            raise ValueError(f"{path}: {reason}")
        arch = (cfg.get("architectures") or ["?"])[0]
        rope_cfg = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        rope_type = rope_cfg.get("rope_type", rope_cfg.get("type", "default"))
        if arch not in ARCHITECTURES or rope_type != "default" or cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"the plain-PyTorch peer runs {', '.join(ARCHITECTURES)} with plain RoPE only; "
                             f"{path} is {arch} with rope_type {rope_type!r}")
        self.layers, self.eps = cfg["num_hidden_layers"], cfg.get("rms_norm_eps", 1e-6)
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads") or self.heads
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.theta = float(rope_cfg.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        self.use_graph = self.device.type == "cuda" if use_graph is None else use_graph
        self.compile, self.graph, self.out, self.k_cache = compile, None, None, None
        index = path / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
            "model.safetensors"]
        w: dict[str, torch.Tensor] = {}
        for name in files:
            with safe_open(path / name, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    w[key.removeprefix("model.")] = f.get_tensor(key).to(self.device, dtype)
        for i in range(self.layers):  # one matmul for q/k/v and one for gate/up
            for module, fused, parts in (("self_attn", "qkv", "qkv"), ("mlp", "gate_up", ("gate", "up"))):
                for kind in ("weight", "bias"):
                    names = [f"layers.{i}.{module}.{p}_proj.{kind}" for p in parts]
                    if names[0] in w:
                        w[f"layers.{i}.{module}.{fused}.{kind}"] = torch.cat([w.pop(n) for n in names])
        if cfg.get("tie_word_embeddings") or "lm_head.weight" not in w:
            w["lm_head.weight"] = w["embed_tokens.weight"]
        self.w = w

    @torch.no_grad()
    def prepare(self, batch: int, max_len: int) -> None:
        """A zeroed cache for `batch` sequences of up to `max_len` tokens; on CUDA, capture the step."""
        self.graph = self.out = self.k_cache = self.v_cache = None
        max_len = -(-max_len // 64) * 64  # an aligned mask keeps SDPA on its fused kernels
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        dev, d = self.device, self.head_dim
        self.k_cache = torch.zeros(self.layers, batch, max_len, self.kv_heads, d, device=dev, dtype=self.dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        inv_freq = 1.0 / self.theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d)
        angles = torch.outer(torch.arange(max_len, device=dev, dtype=torch.float32), inv_freq).repeat(1, 2)
        self.cos, self.sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        self.key_pos = torch.arange(max_len, device=dev)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.step = (torch.compile(self.forward, mode="max-autotune-no-cudagraphs", fullgraph=True)
                     if self.compile else self.forward)
        if self.use_graph:  # warm up on a side stream (this also compiles), then capture one step
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    self.step(self.ids, self.pos)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.step(self.ids, self.pos)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids [B, T] at positions pos [T] (the same for every sequence) -> greedy next tokens [B]."""
        w, (b, t), (h, kv, d) = self.w, ids.shape, (self.heads, self.kv_heads, self.head_dim)
        g = h // kv
        cos, sin = self.cos[pos], self.sin[pos]
        mask = (self.key_pos[None, :] <= pos[:, None]).repeat(g, 1)  # [g * T, max_len]: row j * T + t
        x = F.embedding(ids, w["embed_tokens.weight"])
        for i in range(self.layers):
            p = f"layers.{i}."
            y = rms_norm(x, w[p + "input_layernorm.weight"], self.eps)
            qkv = F.linear(y, w[p + "self_attn.qkv.weight"], w.get(p + "self_attn.qkv.bias"))
            q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
            q, k, v = q.view(b, t, h, d), k.view(b, t, kv, d), v.view(b, t, kv, d)
            if p + "self_attn.q_norm.weight" in w:
                q = rms_norm(q, w[p + "self_attn.q_norm.weight"], self.eps)
                k = rms_norm(k, w[p + "self_attn.k_norm.weight"], self.eps)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            self.k_cache[i].index_copy_(1, pos, k)  # graph- and compile-safe, as transformers' StaticCache
            self.v_cache[i].index_copy_(1, pos, v)
            # Queries grouped by their KV head ([B, kv, g * T, d]) attend over the cache without copying it.
            q = q.view(b, t, kv, g, d).permute(0, 2, 3, 1, 4).reshape(b, kv, g * t, d)
            o = F.scaled_dot_product_attention(q, self.k_cache[i].transpose(1, 2), self.v_cache[i].transpose(1, 2),
                                               attn_mask=mask)
            o = o.view(b, kv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h * d)
            x = x + F.linear(o, w[p + "self_attn.o_proj.weight"], w.get(p + "self_attn.o_proj.bias"))
            y = rms_norm(x, w[p + "post_attention_layernorm.weight"], self.eps)
            gate, up = F.linear(y, w[p + "mlp.gate_up.weight"], w.get(p + "mlp.gate_up.bias")).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"], w.get(p + "mlp.down_proj.bias"))
        return F.linear(rms_norm(x[:, -1], w["norm.weight"], self.eps), w["lm_head.weight"]).argmax(-1)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Prompts [B, T] of one length (eager) -> the first generated tokens [B]."""
        return self.forward(ids, torch.arange(ids.shape[1], device=self.device))

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        """One step: tokens [B] at position `pos` -> next tokens [B] (on CUDA: the graph's output buffer)."""
        if self.graph is None:
            return self.step(ids.view(-1, 1), torch.tensor([pos], device=self.device))
        self.ids.copy_(ids.view(-1, 1))
        self.pos.fill_(pos)
        self.graph.replay()
        return self.out

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        ids = torch.tensor(prompts, device=self.device)
        batch, length = ids.shape
        if self.k_cache is None or self.k_cache.shape[1] != batch or self.k_cache.shape[2] < length + max_new_tokens:
            self.prepare(batch, length + max_new_tokens)
        out = [self.prefill(ids)]
        for step in range(max_new_tokens - 1):
            out.append(self.decode(out[-1], length + step).clone())
        return torch.stack(out, dim=1).tolist()
