"""CPU cost of making a step's text for many streams (detokenize_runs, one token each), with the byte-level
fast path (Tokenizer.token_pieces) and without it (every token's two windows decoded), alternated in rounds.

    python tools/detokenize_cost.py [--streams 128] [--steps 200] [--rounds 3] [--tokenizer PATH]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from atlas.engine.core import default_model_path
from atlas.engine.tokenizer import IncrementalDetokenizer, Tokenizer, detokenize_runs


def one_pass(tok: Tokenizer, ids: list[int], streams: int, steps: int, fast: bool, seed: int) -> float:
    """-> ms a step."""
    tok.__dict__["token_pieces"] = tok.__dict__.get("_pieces") if fast else None
    rng = random.Random(seed)
    starts = [rng.randrange(len(ids) - steps - 20) for _ in range(streams)]
    dets = [IncrementalDetokenizer(tok, ids[s:s + 20]) for s in starts]
    t0 = time.perf_counter()
    for step in range(steps):
        detokenize_runs(tok, dets, [[ids[s + 20 + step]] for s in starts])
    return (time.perf_counter() - t0) / steps * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokenizer", default=None, help="default: the shipped model's")
    p.add_argument("--unknown-share", type=float, default=0.0,
                   help="share of the tokens drawn past the tokenizer's vocabulary (random weights of a model with a "
                        "larger one sample such ids)")
    args = p.parse_args()
    tok = Tokenizer(args.tokenizer or default_model_path())
    tok.__dict__["_pieces"] = tok.token_pieces
    if tok.token_pieces is None:
        print("this tokenizer has no fast path (not a byte-level BPE)")
        return
    text = "".join(path.read_text() for path in sorted(Path(__file__).resolve().parents[1].glob("atlas/engine/*.py")))
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    vocab = len(tok.hf)
    ids = [rng.randrange(vocab, 16 * vocab) if rng.random() < args.unknown_share else t for t in ids]
    pieces = tok.token_pieces
    share = sum(i >= len(pieces) or pieces[i] is not None for i in ids) / len(ids)
    times: dict[str, list[float]] = {"window decode": [], "fast path": []}
    for r in range(args.rounds):
        for name, fast in (("window decode", False), ("fast path", True)):
            times[name].append(one_pass(tok, ids, args.streams, args.steps, fast, seed=r))
    print(f"{args.streams} streams, a token each, {args.steps} steps; {share:.1%} of the tokens have a piece (or no text)")
    for name, values in times.items():
        print(f"  {name:14s} median {statistics.median(values):.3f} ms a step (rounds: "
              + ", ".join(f"{v:.3f}" for v in values) + ")")


if __name__ == "__main__":
    main()
