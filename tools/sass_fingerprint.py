"""Fingerprints of the decode path's default Triton kernels as compiled for sm_90 (H100 / H200), from a CPU, for a
tree given by its root: a refactor of a kernel's source that should not change its code can be checked where no GPU
is, by comparing the fingerprints of the tree before (e.g. `git archive REV atlas | tar x -C /tmp/before`) and
after. A fingerprint is a hash of the kernel's SASS with addresses dropped; the kernels and constexprs are those the
Qwen3-8B shape's decode and prefill run (RMSNorm with and without the residual add, the bf16 one-row GEMV and its
gate|up epilogue, the tensor-core GEMV tile, the FP8 row tiles at 1 and 4 rows and as routed experts' gate|up, the
FP8 activation quantizer per 1 x 128 group). Knobs a later tree added (`PREFETCH`, `FMA`) are passed off where the
kernel takes them.

    python tools/sass_fingerprint.py [ROOT ...]       # one column per tree (default: this checkout)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_ONE = r'''
import hashlib, importlib, json, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
fo = importlib.import_module("atlas.kernels.fused_ops_triton")
kt = importlib.import_module("atlas.kernels.fp8_linear_triton")
gt = importlib.import_module("atlas.kernels.gemv_triton")
assert fo.__file__.startswith(sys.argv[1]), fo.__file__

def fingerprint(fn, sig, consts, warps=4, stages=3):
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    free = {fn.arg_names[a] if isinstance(a, int) else a for a in (fn.do_not_specialize or ())}
    full = {}
    for name, p in zip(fn.arg_names, fn.params):
        if not p.is_constexpr:
            full[name] = sig.get(name, "*i32" if name.endswith("_ptr") else "i32")
        elif name in consts:
            full[name] = "constexpr"
    # (the launcher specializes pointers and integers divisible by 16: so does this compile)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, k in full.items()
             if k != "constexpr" and n not in free and (k.startswith("*") or k == "i32")}
    k = triton.compile(ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    body = "\n".join(line.split("\t", 1)[1].strip() for line in k.asm["sass"].splitlines() if "\t" in line)
    return hashlib.sha256(body.encode()).hexdigest()[:12]

off = {"PREFETCH": False}
bf16 = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16"}
out = {}
for res in (True, False):
    out[f"rms_norm residual={res}"] = fingerprint(fo._rms_norm_kernel, dict(
        bf16, res_ptr="*bf16", out_ptr="*bf16", res_out_ptr="*bf16", gate_ptr="*bf16", eps="fp32", inv_n="fp32"),
        dict(N=4096, BLOCK_M=1, BLOCK_N=4096, HAS_RESIDUAL=res, PDL=2, SCALE_F32=False, W_OFFSET=0.0, HAS_GATE=False,
             LIBDEVICE=True), warps=16)
for act in (-1, 0):
    out[f"gemv sum act={act}"] = fingerprint(gt._gemv_sum_kernel, dict(
        bf16, buffer_ptrs="*i64", own_ptr="*i16", counter_ptr="*i32"), dict(
        ROWS=1, BLOCK_N=4, BLOCK_K=2048, NUM_STAGES=3, EVEN_N=True, EVEN_K=True, HAS_BIAS=False, ACT=act,
        LIBDEVICE=True, PDL=2, **gt._NO_PUSH["constexprs"], **off))
out["gemv dot n16k256w4s4"] = fingerprint(gt._gemv_kernel, bf16, dict(
    BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, NUM_STAGES=4, EVEN_N=True, EVEN_K=True, HAS_BIAS=False, IEEE=False, PDL=2,
    **off), stages=4)
rt = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16",
      "ids_ptr": "*i32", "rw_ptr": "*fp32", "alpha": "fp32", "limit": "fp32"}
for rows, act, pairs in ((1, -1, False), (1, 0, False), (4, -1, False), (1, 0, True)):
    out[f"fp8 row tiles rows={rows} act={act} experts={pairs}"] = fingerprint(kt._fp8_gemv_row_tiles_kernel, rt, dict(
        GROUP_N=128, GROUP_K=128, ROWS=rows, BLOCK_N=4, RUNS=128, RUN=16, NUM_STAGES=1, EVEN_K=True, CHANNEL=False,
        HAS_BIAS=False, ACT=act, LIBDEVICE=True, PDL=2, PAIRS=pairs, TOPK=8 if pairs else 1, **off), stages=1)
out["fp8 quantize groups of 128"] = fingerprint(kt._quantize_groups_kernel, dict(
    x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"), dict(GROUP=128, GROUPS=32, FP8_MAX=448.0, FMA=False), stages=1)
print(json.dumps(out))
'''


def fingerprints(root: Path) -> dict[str, str]:
    """The kernels' fingerprints for the tree at root (its own interpreter: the modules of two trees cannot share
    one)."""
    import json

    done = subprocess.run([sys.executable, "-c", _ONE, str(root.resolve())], capture_output=True, text=True,
                          check=False)
    if done.returncode:
        raise SystemExit(f"{root}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'failed'}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    roots = [Path(r) for r in sys.argv[1:]] or [Path(__file__).resolve().parents[1]]
    columns = [fingerprints(root) for root in roots]
    names = list(columns[0])
    width = max(len(n) for n in names)
    print(" " * width, *(str(r)[-24:].rjust(24) for r in roots))
    for name in names:
        cells = [c.get(name, "-") for c in columns]
        mark = "" if len(set(cells)) == 1 else "   differs"
        print(name.ljust(width), *(cell.rjust(24) for cell in cells), mark)


if __name__ == "__main__":
    main()
