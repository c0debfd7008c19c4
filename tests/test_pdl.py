"""Programmatic dependent launch (kernels/pdl.py): each kernel that takes part, compiled for an H100/H200
(sm_90) on the CPU, must wait for the previous kernel before it reads or writes anything another kernel
touches, whichever order it triggers the next kernel in. The flag is off on the CPU and with --tuning pdl=0; on CUDA the kernels run with it in every CUDA test, and its GPU figures are in BENCHMARKS.md."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from atlas.config import EngineConfig, TuningConfig  # noqa: E402
from atlas.errors import ConfigError  # noqa: E402
from atlas.kernels import pdl  # noqa: E402
from atlas.kernels import settings as kernel_settings  # noqa: E402


def _ptx(fn, args: dict, constexprs: dict, num_warps: int = 4) -> list[str]:
    from triton.backends.compiler import GPUTarget

    signature = dict(args) | {name: "constexpr" for name in constexprs}
    # As the launcher specialises them: pointers 16-byte aligned, sizes and strides divisible by 16.
    free = {fn.arg_names[a] if isinstance(a, int) else a for a in (fn.do_not_specialize or ())}
    divisible = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in args.items()
                 if name not in free and (kind.startswith("*") or kind == "i32")}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=divisible)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                                "launch_pdl": True})
    except Exception as exc:  # noqa: BLE001 - a Triton install without the CUDA toolchain
        pytest.skip(f"this Triton cannot compile for sm_90 here: {type(exc).__name__}: {str(exc)[:200]}")
    return kernel.asm["ptx"].splitlines()


def _before_wait(ptx: list[str], flag: int) -> list[str]:
    """The PTX before the wait; the trigger must come before it (pdl.TRIGGER_FIRST) or after (WAIT_FIRST)."""
    waits = [i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line]
    assert waits, "no griddepcontrol.wait in the kernel"
    after = ptx[waits[0]:] if flag == pdl.WAIT_FIRST else ptx[: waits[0]]
    assert any("griddepcontrol.launch_dependents" in line for line in after)
    return ptx[: waits[0]]


def _memory_ops(lines: list[str]) -> tuple[int, int]:
    loads = sum(("ld.global" in ln or "cp.async" in ln) for ln in lines)
    stores = sum(("st.global" in ln or "atom." in ln or "red." in ln) for ln in lines)
    return loads, stores


def _ptrs(*names: str, dtype: str = "*bf16") -> dict:
    return {name: dtype for name in names}


def _ints(*names: str) -> dict:
    return {name: "i32" for name in names}


def _elementwise_kernels():
    from atlas.kernels import fused_ops_triton as f
    from atlas.kernels import paged_attention_triton as a

    block_h, block_r, block_p, _ = f.qk_block(32, 8, 128, 128, 1)
    yield "rms_norm", f._rms_norm_kernel, (
        _ptrs("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr") | _ints("n_rows") | {"eps": "fp32", "inv_n": "fp32"}
        | _ints("stride_x", "stride_res", "stride_out", "stride_res_out"),
        dict(N=4096, BLOCK_M=1, BLOCK_N=4096, HAS_RESIDUAL=True, PDL=True))
    yield "qk_norm_rope_kv", f._qk_norm_rope_kv_kernel, (
        _ptrs("qkv_ptr") | {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
        | _ptrs("q_w_ptr", "k_w_ptr", "q_out_ptr", "kv_ptr") | {"slot_ptr": "*i64", "eps": "fp32", "inv_d": "fp32"}
        | _ints("stride_qkv", "stride_cos", "stride_sin", "stride_q_out", "stride_kv_plane", "stride_kv_slot",
                "stride_kv_head"),
        dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, ROT_DIM=128, IS_NEOX=True, HAS_NORM=True, BLOCK_H=block_h,
             BLOCK_R=block_r, BLOCK_P=block_p, KV_LIMIT=0.0, PAGE=16, V_T=False, PDL=True))
    yield "act_and_mul", f._act_and_mul_kernel, (
        _ptrs("x_ptr", "out_ptr") | _ints("inter", "stride_x", "stride_out") | {"alpha": "fp32", "limit": "fp32"},
        dict(ACT=0, BLOCK=1024, LIBDEVICE=True, PDL=True))
    yield "paged_attention", a._paged_attention_kernel, (
        _ptrs("q_ptr", "k_ptr", "v_ptr", "out_ptr") | _ptrs("part_m_ptr", "part_l_ptr", "part_acc_ptr", dtype="*fp32")
        | _ptrs("page_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "prog_req_ptr", "prog_q0_ptr",
                dtype="*i32")
        | _ptrs("sinks_ptr") | {"scale": "fp32"} | _ints("window", "attn_chunk") | {"softcap": "fp32"}
        | _ints("stride_qt", "stride_qh", "stride_kslot", "stride_kh", "stride_ot", "stride_oh", "stride_bt"),
        dict(PAGE=16, GROUP=4, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=64, HEAD_DIM=128, BLOCK_D=128, CAUSAL=True,
             USE_WINDOW=False, IEEE=False, NUM_SPLITS=1, NUM_STAGES=3, DOT_F16=False, V_T=False, PDL=True,
             HAS_SINKS=False, USE_CHUNK=False, SOFTCAP=False))
    from atlas.kernels import peer_all_reduce_triton as p

    yield "peer_all_reduce", p._peer_all_reduce_kernel, (
        _ptrs("x_ptr") | _ints("stride_x") | _ptrs("res_ptr") | _ints("stride_res") | _ptrs("w_ptr", "out_ptr")
        | _ints("stride_out") | _ptrs("res_out_ptr") | _ints("stride_res_out")
        | {"buffer_ptrs": "*i64", "own_ptr": "*i16", "counter_ptr": "*i32", "eps": "fp32", "inv_n": "fp32"},
        dict(RANK=0, WORLD=2, N=4096, BLOCK_N=4096, EMPTY=-32768, ROW_SLOT=4096, SOURCE_STRIDE=64 * 4096,
             PARITY_STRIDE=2 * 64 * 4096, NORM=True, PUSHED=False, PDL=True))
    yield "split_kv_combine", a._paged_attention_combine_kernel, (
        _ptrs("part_m_ptr", "part_l_ptr", "part_acc_ptr", dtype="*fp32") | _ptrs("out_ptr")
        | _ints("stride_ot", "stride_oh") | _ptrs("sinks_ptr"),
        dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=4, PDL=True, HAS_SINKS=False))


FLAGS = [pdl.TRIGGER_FIRST, pdl.WAIT_FIRST]


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("name", ["rms_norm", "qk_norm_rope_kv", "act_and_mul", "paged_attention",
                                  "split_kv_combine", "peer_all_reduce"])
def test_kernels_touch_no_memory_before_the_previous_kernel_ends(name, flag):
    fn, args, constexprs = next((f, a, c) for n, f, (a, c) in _elementwise_kernels() if n == name)
    assert _memory_ops(_before_wait(_ptx(fn, args, constexprs | {"PDL": flag}), flag)) == (0, 0)


@pytest.mark.parametrize("kind", ["sum", "sum+act", "sum+push", "dot"])
def test_gemv_touches_no_memory_before_the_previous_kernel_ends(kind):
    from atlas.kernels import gemv_triton as g

    args = _ptrs("x_ptr", "w_ptr", "b_ptr", "y_ptr") | _ints("M", "N", "K", "stride_xm", "stride_wn", "stride_ym")
    common = dict(BLOCK_N=16 if kind == "dot" else 4, BLOCK_K=256 if kind == "dot" else 2048, NUM_STAGES=3,
                  EVEN_N=True, EVEN_K=True, HAS_BIAS=False, PDL=pdl.TRIGGER_FIRST)
    common["PREFETCH"] = False
    if kind == "dot":
        fn, constexprs = g._gemv_kernel, common | {"BLOCK_M": 16, "IEEE": False}
    else:
        args |= {"buffer_ptrs": "*i64", "own_ptr": "*i16", "counter_ptr": "*i32"}
        push = dict(PUSH=True, RANK=1, WORLD=2, EMPTY=-32768, ROW_SLOT=4096, SOURCE_STRIDE=64 * 4096,
                    PARITY_STRIDE=2 * 64 * 4096) if kind == "sum+push" else g._NO_PUSH["constexprs"]
        fn, constexprs = g._gemv_sum_kernel, common | push | {"ROWS": 1, "ACT": 0 if kind == "sum+act" else -1,
                                                               "LIBDEVICE": True}
    assert _memory_ops(_before_wait(_ptx(fn, args, constexprs), pdl.TRIGGER_FIRST)) == (0, 0)


@pytest.mark.parametrize("kernel", ["bf16-sum", "fp8-row-tiles"])
def test_prefetching_gemvs_read_only_weights_before_the_previous_kernel_ends(kernel):
    """The gemv_prefetch knob's one-row GEMVs (PREFETCH): compiled for sm_90, they issue their first weight tile's
    loads (and the FP8 scales') before the wait, and no store; without it, nothing before the wait."""
    from atlas.kernels import fp8_linear_triton as kt
    from atlas.kernels import gemv_triton as g

    if kernel == "bf16-sum":
        args = _ptrs("x_ptr", "w_ptr", "b_ptr", "y_ptr") | _ints("M", "N", "K", "stride_xm", "stride_wn", "stride_ym")
        args |= {"buffer_ptrs": "*i64", "own_ptr": "*i16", "counter_ptr": "*i32"}
        fn, constexprs = g._gemv_sum_kernel, dict(BLOCK_N=4, BLOCK_K=2048, NUM_STAGES=3, EVEN_N=True, EVEN_K=True,
                                                   HAS_BIAS=False, ROWS=1, ACT=0, LIBDEVICE=True,
                                                   **g._NO_PUSH["constexprs"])
    else:
        args = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16",
                "ids_ptr": "*i32", "rw_ptr": "*fp32", "alpha": "fp32", "limit": "fp32"} | _ints(
            "M", "N", "K", "stride_wn", "stride_sn", "stride_sk", "stride_xm", "stride_ym", "stride_we", "stride_se")
        fn, constexprs = kt._fp8_gemv_row_tiles_kernel, dict(
            GROUP_N=128, GROUP_K=128, ROWS=1, BLOCK_N=4, RUNS=128, RUN=kt.ROW_TILES_RUN, NUM_STAGES=1, EVEN_K=True,
            CHANNEL=False, HAS_BIAS=False, ACT=-1, LIBDEVICE=True, PAIRS=False, TOPK=1)
    flag = pdl.TRIGGER_FIRST
    loads, stores = _memory_ops(_before_wait(_ptx(fn, args, constexprs | {"PDL": flag, "PREFETCH": True}), flag))
    assert loads > 0 and stores == 0
    assert _memory_ops(_before_wait(_ptx(fn, args, constexprs | {"PDL": flag, "PREFETCH": False}), flag)) == (0, 0)


def _jit_functions() -> dict[str, list]:
    """Every @triton.jit function of atlas/kernels by name (a name defined in two modules: both)."""
    import ast
    from pathlib import Path

    import atlas.kernels

    found: dict[str, list] = {}
    for path in sorted(Path(atlas.kernels.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                found.setdefault(node.name, []).append((path.name, node))
    return found


_MEMORY = ("load", "store") + tuple(f"atomic_{op}" for op in ("add", "cas", "xchg", "max", "min", "and", "or", "xor"))


def _memory_calls(node, touching: set[str]) -> list[str]:
    """The calls under `node` that read or write memory: tl's loads, stores and atomics, and the jit helpers that
    do (`touching`)."""
    import ast

    calls = []
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        f = call.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "tl" and f.attr in _MEMORY:
            calls.append(f"tl.{f.attr}")
        elif isinstance(f, ast.Name) and f.id in touching:
            calls.append(f.id)
    return calls


def test_every_kernel_waits_before_it_reads_what_another_kernel_writes():
    """In every Triton kernel of atlas/kernels that takes part in PDL, nothing before its pdl_begin (the wait for
    the kernel before) reads or writes memory, directly or through a helper: under PDL the kernel may start while
    the one before still writes (a router's expert ids read early choose stale experts). The one exception is an
    `if PREFETCH:` block, which may read weights (no kernel of a step writes them) while the kernel before runs.
    Nor does a program return before it (the kernel would end early, and the next one pass its own wait while the
    one before still runs). The PTX tests above check the compiled code of the dense decode kernels; this checks the
    source of all of them."""
    import ast

    functions = _jit_functions()
    touching: set[str] = set()
    while True:  # (helpers that touch memory, through the helpers they call: to a fixed point)
        more = {name for name, defs in functions.items() if name not in touching
                and any(_memory_calls(fn, touching) for _, fn in defs)}
        if not more:
            break
        touching |= more
    kernels, problems = 0, []
    for name, defs in functions.items():
        for module, fn in defs:
            waits = [i for i, st in enumerate(fn.body) if isinstance(st, ast.Expr)
                     and isinstance(st.value, ast.Call) and ast.unparse(st.value.func) == "pdl_begin"]
            if not waits:
                continue
            kernels += 1
            for st in fn.body[: waits[0]]:
                # (a program that returned before its wait would let the kernel end, and the one after it start,
                #  before the kernel before had ended)
                problems += [f"{module}:{name} line {r.lineno}: a return before pdl_begin"
                             for r in ast.walk(st) if isinstance(r, ast.Return)]
                if isinstance(st, ast.If) and ast.unparse(st.test) == "PREFETCH":
                    continue
                problems += [f"{module}:{name} line {st.lineno}: {call} before pdl_begin"
                             for call in _memory_calls(st, touching)]
    assert kernels >= 20 and "expert_pair" in touching and "_load_w" in touching
    assert not problems, problems


def test_flag_off_on_cpu_and_refused_when_malformed(monkeypatch):
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    for version, recent in (("13.0", True), ("12.4", True), ("12.1", False), (None, False)):
        monkeypatch.setattr(torch.version, "cuda", version)
        assert pdl._cuda_at_least(12, 4) is recent, version
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="tuning pdl must be a boolean"):
        TuningConfig(pdl="maybe")
    with pytest.raises(ConfigError, match="pdl_trigger must be one of first, after-wait"):
        TuningConfig.parse("pdl_trigger=last")


def test_the_pdl_knobs_reach_the_launches(monkeypatch):
    """The engine's pdl and pdl_trigger knobs (set once at start-up through kernels/settings.py) decide the
    launch options, on a device that takes PDL (here pretended: the checks of the hardware patched)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_cuda_at_least", lambda major, minor: True)
    monkeypatch.setattr(pdl, "_triton_has_pdl", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = torch.device("cuda", 0)
    try:
        for knobs, expected in (("", {"PDL": pdl.TRIGGER_FIRST, "launch_pdl": True}),
                                ("pdl_trigger=after-wait", {"PDL": pdl.WAIT_FIRST, "launch_pdl": True}),
                                ("pdl=0", {"PDL": 0})):
            kernel_settings.configure(EngineConfig(tuning=knobs))
            assert pdl.launch_options(gpu) == expected == pdl.launch_options(gpu, moe=True), knobs
        # moe_pdl=0: the router and expert kernels launch plainly, the others keep PDL
        kernel_settings.configure(EngineConfig(tuning="moe_pdl=0"))
        assert pdl.launch_options(gpu) == {"PDL": pdl.TRIGGER_FIRST, "launch_pdl": True}
        assert pdl.launch_options(gpu, moe=True) == {"PDL": 0}
    finally:
        kernel_settings.set_kernel_settings(TuningConfig())
