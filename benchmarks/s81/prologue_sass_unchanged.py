"""The attention prologues' sm_90 SASS (Triton's compile for an H100/H200, on the CPU: Triton 3.6, the device's, in a
venv) from two versions of kernels/fused_ops_triton.py, for a refactor that must not change what ran on the GPU:
the GQA prologue in three forms (Qwen3's norm and rotate-half, interleaved pairs without a norm, an 8-bit cache) and
MLA's in two (DeepSeek-V2-Lite's layout into a bf16 cache, rotate-half into an 8-bit one).

    git show REV:atlas/kernels/fused_ops_triton.py > /tmp/old.py
    python benchmarks/s81/prologue_sass_unchanged.py /tmp/old.py atlas/kernels/fused_ops_triton.py
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from sass_loop_mix import compile_sm90  # noqa: E402

GQA_SIG = {"qkv_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_w_ptr": "*bf16",
           "k_w_ptr": "*bf16", "q_out_ptr": "*bf16", "kv_ptr": "*bf16", "slot_ptr": "*i64", "eps": "fp32",
           "inv_d": "fp32", "stride_qkv": "i32", "stride_cos": "i32", "stride_sin": "i32", "stride_q_out": "i32",
           "stride_kv_plane": "i64", "stride_kv_slot": "i32", "stride_kv_head": "i32"}
MLA_SIG = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
           "w_ptr": "*bf16", "q_pe_ptr": "*bf16", "cache_ptr": "*bf16", "slot_ptr": "*i64", "eps": "fp32",
           "inv_l": "fp32", "stride_q": "i32", "stride_kv": "i32", "stride_cos": "i32", "stride_sin": "i32",
           "stride_q_pe": "i32"}


def _digest(compiled) -> str:
    text = "\n".join(line for line in compiled.asm["sass"].splitlines() if "##" not in line)  # (no line info)
    return f"{hashlib.sha256(text.encode()).hexdigest()[:16]}:{len(text.splitlines())}"


def digests(path: str) -> list[str]:
    spec = importlib.util.spec_from_file_location("fused_ops_triton_version", path)
    k = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(k)
    out = []
    for neox, norm, kv, limit, vt in ((True, True, "*bf16", 0.0, False), (False, False, "*bf16", 0.0, False),
                                      (True, True, "*fp8e4nv", 448.0, True)):
        c = dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, ROT_DIM=128, IS_NEOX=neox, HAS_NORM=norm, BLOCK_H=4,
                 BLOCK_R=64, BLOCK_P=1, KV_LIMIT=limit, PAGE=16, V_T=vt, PDL=2)
        out.append(_digest(compile_sm90(k._qk_norm_rope_kv_kernel, dict(GQA_SIG, kv_ptr=kv), c,
                                        ["qkv_ptr", "q_out_ptr", "kv_ptr"], 4, 3)))
    if hasattr(k, "_mla_prologue_kernel"):
        for neox, cache, limit in ((False, "*bf16", 0.0), (True, "*fp8e4nv", 448.0)):
            c = dict(NUM_HEADS=16, NOPE=128, ROPE=64, LATENT=512, IS_NEOX=neox, BLOCK_H=16, BLOCK_R=32, BLOCK_L=512,
                     KV_LIMIT=limit, PDL=2)
            out.append(_digest(compile_sm90(k._mla_prologue_kernel, dict(MLA_SIG, cache_ptr=cache), c,
                                            ["q_ptr", "kv_ptr", "q_pe_ptr", "cache_ptr"], 4, 3)))
    return out


if __name__ == "__main__":
    old, new = digests(sys.argv[1]), digests(sys.argv[2])
    print("old:", " ".join(old))
    print("new:", " ".join(new))
    same = old == new[: len(old)]
    print("unchanged" if same else "CHANGED")
    sys.exit(0 if same else 1)
