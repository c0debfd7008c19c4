"""Session 91: the GQA paged-attention kernel as compiled for sm_90 on this CPU, in a tree given by its root, with the
attention_fused_combine knob off (where the tree has it): its SASS opcodes (operands dropped: the new counts_ptr
parameter moves the later ones' offsets) counted and hashed, unsplit and split, bf16 and 8-bit caches. Before and after
the knob (`git archive a0b03e4 atlas | tar x -C /tmp/before`): `python benchmarks/s91/same_sass.py /tmp/before`, then
with `.`: the same four rows."""
import hashlib
import importlib
import json
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

root = os.path.abspath(sys.argv[1])
sys.path.insert(0, root)

m = importlib.import_module("atlas.kernels.paged_attention_triton")
assert m.__file__.startswith(root), m.__file__
fn = m._paged_attention_kernel
out = {}
for splits in (1, 4):
    for cache in ("*bf16", "*fp8e4nv"):
        consts = dict(PAGE=16, GROUP=4, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=32 if splits > 1 else 64, HEAD_DIM=128,
                      BLOCK_D=128, CAUSAL=True, USE_WINDOW=False, IEEE=False, NUM_SPLITS=splits, NUM_STAGES=3,
                      DOT_F16=cache != "*bf16", V_T=cache != "*bf16", PDL=2, HAS_SINKS=False, USE_CHUNK=False,
                      SOFTCAP=False, FUSED_COMBINE=False)
        consts = {k: v for k, v in consts.items() if k in fn.arg_names}
        sig = {"q_ptr": "*bf16", "k_ptr": cache, "v_ptr": cache, "out_ptr": "*bf16", "part_m_ptr": "*fp32",
               "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "sinks_ptr": "*bf16", "scale": "fp32", "softcap": "fp32"}
        full = {}
        for name, p in zip(fn.arg_names, fn.params, strict=True):
            full[name] = "constexpr" if p.is_constexpr else sig.get(name, "*i32" if name.endswith("_ptr") else "i32")
        k = triton.compile(ASTSource(fn=fn, signature=full, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "num_stages": 3})
        ops = [line.split("\t", 1)[1].strip().split()[0] for line in k.asm["sass"].splitlines() if "\t" in line]
        out[f"splits={splits} cache={cache}"] = (len(ops), hashlib.sha256(" ".join(ops).encode()).hexdigest()[:12])
print(json.dumps(out))
