"""Two measurements on one GPU (BENCHMARKS.md, session 23), JSON to $OUT/probe23.json:
(1) the decode attention kernel at the 8B layer shape over bf16 and 8-bit caches in today's page layout (each
page [keys, KV heads, dim]: "nhd") against one where each (page, KV head) is contiguous ("hnd", emulated
through the kernel's strides and page ids), for a few tile settings;
(2) the small-M linear kernels: whether a row's result is the same alone, among 8 and among 16 rows (cuBLAS
and the GEMV's tl.dot variant), and what the GEMV configs and cuBLAS cost at 1, 8 and 16 rows for the 8B
projections and their TP=2 halves.

    OUT=/tmp python tools/cache_layout_and_gemv_rows_probe.py
"""
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
from atlas.bench.common import copy_bandwidth, kernel_time_ms
from atlas.kernels import paged_attention_triton as pat
from atlas.kernels.gemv import GemvConfig, measure
from atlas.kernels.gemv_triton import gemv_triton
from atlas.kernels.paged_attention import block_shape, program_map
from atlas.kernels.paged_attention_ref import paged_attention_ref

out = {}
dev = torch.device("cuda")
bw = copy_bandwidth(dev)
out["copy_bw_GBps"] = bw / 1e9

_EXACT = {}
def attn(batch, ctx, heads, kvh, kvdt, layout, block_n, stages, warps=4, D=128, PAGE=16):
    g = torch.Generator().manual_seed(0)
    pp = -(-ctx // PAGE)
    P = batch * pp
    tables = torch.randperm(P, generator=g).view(batch, pp).to(torch.int32)
    cache = torch.randn(2, P, PAGE, kvh, D, generator=g).to(dev, kvdt)
    q = torch.randn(batch, heads, D, generator=g).to(dev, torch.bfloat16)
    qsl = list(range(batch + 1))
    bq, bm = block_shape(heads, kvh, 1)
    programs = program_map(qsl, bq, dev)
    preq, pq0 = programs.req, programs.q0
    qsl_d = torch.tensor(qsl, dtype=torch.int32, device=dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    scale = D ** -0.5
    key = (batch, ctx, kvdt)
    if key not in _EXACT:
        _EXACT.clear()
        _EXACT[key] = paged_attention_ref(q.float(), cache.float(), qsl, [ctx] * batch, tables.to(dev), scale)
    exact = _EXACT[key]
    o = torch.empty_like(q)
    if layout == "nhd":
        k = cache[0].view(P * PAGE, kvh, D)
        v = cache[1].view(P * PAGE, kvh, D)
        s_slot, s_h = k.stride(0), k.stride(1)
        tab = tables.to(dev)
    else:  # [P, Hkv, PAGE, D]: page p of head h at (p*Hkv + h)*PAGE*D; table entries p*Hkv
        hnd = cache.permute(0, 1, 3, 2, 4).contiguous()
        k = hnd[0]
        v = hnd[1]
        s_slot, s_h = D, PAGE * D
        tab = (tables * kvh).to(dev)
    def run():
        pat._paged_attention_kernel[(preq.numel(), kvh, 1)](
            q, k, v, o, o, o, o, lens, tab, lens, qsl_d, preq, pq0, o, scale, 0, 1, 1.0,
            q.stride(0), q.stride(1), s_slot, s_h, o.stride(0), o.stride(1), tab.stride(0),
            PAGE=PAGE, GROUP=heads // kvh, BLOCK_Q=bq, BLOCK_M=bm, BLOCK_N=block_n, HEAD_DIM=D, BLOCK_D=D,
            CAUSAL=True, USE_WINDOW=False, IEEE=False, NUM_SPLITS=1, NUM_STAGES=stages,
            DOT_F16=kvdt.itemsize == 1, V_T=False, PDL=False, HAS_SINKS=False, USE_CHUNK=False, SOFTCAP=False,
            FUSED_COMBINE=False, num_warps=warps)
        return o
    err = ((run().float() - exact).abs().max() / (1 + exact.abs().max())).item()
    ms = kernel_time_ms(run, 20)
    byt = 2 * batch * ctx * kvh * D * kvdt.itemsize
    return {"us": round(ms * 1000, 1), "of_copy_bw": round(byt / (ms / 1e3) / bw, 3), "err": err}

rows = []
for (batch, ctx) in ((256, 1024), (256, 256), (64, 1024)):
    for kvdt in (torch.bfloat16, torch.float8_e4m3fn):
        for layout in ("nhd", "hnd"):
            for bn, st, w in ((64, 3, 4), (128, 3, 4), (64, 2, 4), (128, 2, 8)):
                try:
                    r = attn(batch, ctx, 32, 8, kvdt, layout, bn, st, w)
                except Exception as e:
                    r = {"error": str(e)[:200]}
                r.update(batch=batch, ctx=ctx, kv=str(kvdt)[6:], layout=layout, block_n=bn, stages=st, warps=w)
                rows.append(r)
                print(r, flush=True)
out["attention"] = rows
Path(os.environ.get("OUT", "/tmp"), "probe23.json").write_text(json.dumps(out, indent=1))

# GEMV: invariance of a row alone vs among 16, and costs
inv = {}
for name, (n, k) in {"q|k|v": (6144, 4096), "down": (4096, 12288)}.items():
    w = torch.randn(n, k, device=dev).to(torch.bfloat16)
    x = torch.randn(16, k, device=dev).to(torch.bfloat16)
    for kind, fn in  (("cublas", lambda xx, w=w: F.linear(xx, w)),
                     ("dot-n16k256", lambda xx, w=w: gemv_triton(xx, w, None, 16, 256, 4, 4, "dot")),
                     ("dot-n32k256", lambda xx, w=w: gemv_triton(xx, w, None, 32, 256, 4, 4, "dot"))):
        full = fn(x)
        same = [bool(torch.equal(fn(x[i:i + 1].contiguous())[0], full[i])) for i in range(16)]
        same8 = [bool(torch.equal(fn(x[:8].contiguous())[i], full[i])) for i in range(8)]
        inv[f"{name} {kind}"] = {"row_alone_equals_row_of_16": sum(same), "row_of_8_equals_row_of_16": sum(same8)}
    print(inv, flush=True)
out["gemv_invariance"] = inv

grid = [GemvConfig(16, 128, 4, 6), GemvConfig(16, 256, 4, 4), GemvConfig(16, 512, 4, 3), GemvConfig(32, 256, 4, 4),
        GemvConfig(16, 256, 8, 4), GemvConfig(64, 128, 4, 4), GemvConfig(32, 512, 4, 3), GemvConfig(16, 1024, 4, 2),
        GemvConfig(4, 2048, 4, 3, "sum"), GemvConfig(4, 2048, 4, 1, "sum")]
shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gateup": (24576, 4096), "down": (4096, 12288), "lm": (151936, 4096),
          "tp2_qkv": (3072, 4096), "tp2_o": (4096, 2048), "tp2_gateup": (12288, 4096), "tp2_down": (4096, 6144),
          "tp2_lm": (75968, 4096)}
l2 = torch.cuda.get_device_properties(dev).L2_cache_size
gm = {}
for name, (n, k) in shapes.items():
    size = n * k * 2
    copies = min(64, max(2, math.ceil(4 * l2 / size)))
    ws = [torch.randn(n, k, device=dev).to(torch.bfloat16) for _ in range(copies)]
    for m in (1, 8, 16):
        g2 = [c for c in grid if c.kind == "dot" or m == 1]
        t = measure(ws, g2, rows=m, replays=7)
        gm[f"{name} m={m}"] = {str(c): round(v * 1000, 2) for c, v in t.items()}
        print(name, m, gm[f"{name} m={m}"], flush=True)
    del ws
    torch.cuda.empty_cache()
out["gemv_us"] = gm
Path(os.environ.get("OUT", "/tmp"), "probe23.json").write_text(json.dumps(out, indent=1))
