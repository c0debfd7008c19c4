"""Compile a Triton kernel to PTX for an H100/H200 (sm90) on a machine without a GPU: Triton's front end (typing,
constexpr branches, shapes) and its NVIDIA back end run on the CPU, so errors the interpreter lets through (it runs
the Python, it does not type it) fail here instead of on the GPU machine."""

from __future__ import annotations

import pytest


def compile_for_sm90(fn, ptr_types: dict[str, str], constexprs: dict[str, object], num_warps: int = 4,
                     num_stages: int = 3, **options) -> str:
    """fn (a @triton.jit function) compiled with pointer arguments typed per `ptr_types` (the rest "*i32"), integer
    arguments i32, and constexprs given (their defaults where not, else 1) -> its PTX. options: more of Triton's
    compile options, as a launch passes them (enable_fp_fusion=False)."""
    return compiled_for_sm90(fn, ptr_types, constexprs, num_warps, num_stages, **options).asm["ptx"]


def compiled_for_sm90(fn, ptr_types: dict[str, str], constexprs: dict[str, object], num_warps: int = 4,
                      num_stages: int = 3, **options):
    """compile_for_sm90's compiled kernel: its asm, and its metadata (`.metadata.shared`: the shared memory a
    program takes, which the GPU refuses at launch above the SM's 227 KiB)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this triton build has no NVIDIA back end")
    signature, consts = {}, {}
    for name, param in zip(fn.arg_names, fn.params, strict=True):
        if param.is_constexpr:
            # (a constexpr not given: its default where it has one, else 1)
            signature[name], consts[name] = "constexpr", constexprs.get(name, param.default if param.has_default else 1)
        else:
            signature[name] = ptr_types.get(name, "*i32" if name.endswith("_ptr") else "i32")
    return triton.compile(ASTSource(fn, signature, consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages, **options})
