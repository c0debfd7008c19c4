"""`atlas bench ...`: each benchmark module adds its own sub-command here."""

from __future__ import annotations

import argparse

from atlas.bench.fp8 import add_fp8_benchmark
from atlas.bench.gemv import add_gemv_benchmark
from atlas.bench.offline import add_offline_benchmarks
from atlas.bench.serve_load import add_serve_benchmark
from atlas.bench.spec_cost import add_spec_cost_benchmark
from atlas.bench.speed import add_speed_benchmarks
from atlas.bench.structured import add_structured_benchmark


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="Benchmarks (each measured against a peer in the same run).")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    add_fp8_benchmark(sub)
    add_gemv_benchmark(sub)
    add_offline_benchmarks(sub)
    add_serve_benchmark(sub)
    add_speed_benchmarks(sub)
    add_spec_cost_benchmark(sub)
    add_structured_benchmark(sub)
