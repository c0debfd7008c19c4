"""`atlas bench latency` and `atlas bench throughput`: the engine's speed, with vLLM's flag names."""

from __future__ import annotations

import argparse
import sys

from atlas.config import EngineConfig


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_speed_benchmarks(sub: argparse._SubParsersAction) -> None:
    command_line = "atlas " + " ".join(sys.argv[1:])

    p = sub.add_parser("latency", help="Batch latency: TTFT, decode step time, roofline, plain-PyTorch peer.")
    g = p.add_argument_group("workload")
    g.add_argument("--batch-size", type=_ints, default=[1, 16, 64],
                   help="Requests per batch; comma-separated for several (e.g. 1,16,64,256).")
    g.add_argument("--input-len", type=int, default=128, help="Prompt tokens per request.")
    g.add_argument("--output-len", type=int, default=128, help="Generated tokens per request (at least 2).")
    g.add_argument("--num-iters", type=int, default=3, help="Timed iterations per batch size (the median is reported).")
    g.add_argument("--num-iters-warmup", type=int, default=1, help="Untimed iterations first, per batch size.")
    g.add_argument("--output-json", default=None, help="Write the results here (and a .txt beside it).")
    g.add_argument("--peer", choices=["pytorch", "none"], default="pytorch",
                   help="pytorch: the plain-PyTorch decoder of atlas/bench/peer.py (CUDA graph on CUDA).")
    g.add_argument("--peer-compile", action="store_true",
                   help="Also the peer with torch.compile(mode='max-autotune-no-cudagraphs') inside its CUDA graph.")
    g.add_argument("--profile", default=None, metavar="DIR",
                   help="Also profile a few decode steps per batch size (torch.profiler); write summaries to DIR.")
    g.add_argument("--profile-steps", type=int, default=10, help="Decode steps per profile.")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_latency, command_line=command_line)

    p = sub.add_parser("throughput", help="Offline throughput: every prompt in one LLM.generate.")
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--input-len", type=int, default=512, help="Prompt tokens (random dataset).")
    g.add_argument("--output-len", type=int, default=256,
                   help="Generated tokens per request (a dataset line's output_len wins).")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Random dataset: lengths uniform in [len * (1 - r), len * (1 + r)].")
    g.add_argument("--dataset", default="random", help="random, or a JSONL / text file of prompts.")
    g.add_argument("--num-prompts-warmup", type=int, default=8,
                   help="Requests run (up to 16 tokens each) before the timed run; 0 for none.")
    g.add_argument("--output-json", default=None, help="Write the results here (and a .txt beside it).")
    g.add_argument("--step-timeline", action="store_true",
                   help="Also time every step's launch and split the run into steps with prompt tokens and "
                        "pure decode steps (time, tokens/s and step time by batch size) in the report.")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_throughput, command_line=command_line)


def cmd_latency(args: argparse.Namespace) -> int:
    from atlas.bench.latency import cmd_latency as run  # (on use: `atlas bench --help` imports no torch)

    return run(args)


def cmd_throughput(args: argparse.Namespace) -> int:
    from atlas.bench.throughput import cmd_throughput as run

    return run(args)
