#!/usr/bin/env python3
"""Train a DFlash drafter for a target checkpoint (default: Atlas's shipped default model).

    python tools/train_dflash_drafter.py --out runs/dflash-drafter            # GPU if there is one
    python tools/train_dflash_drafter.py --target /tmp/tiny-target --device cpu --max-steps 40 \\
        --out /tmp/drafter --corpus-limit-mb 1 --seq-len 128 --batch-size 8 --eval-prompts 4

The target is frozen; its residual streams after the drafter's target layers and its own greedy
tokens on the Python-stdlib corpus (atlas.training.corpus, tokenized with the target's tokenizer)
train a small block-diffusion drafter under a wall-clock budget for the whole run. --out receives
config.json and model.safetensors (the z-lab DFlash format: copy both into
atlas/assets/default-model/dflash-drafter/ to ship the drafter, so that `atlas serve --speculative
dflash` needs no other flag), train_report.json (settings, curve, held-out block metrics, mean
acceptance length and speed measured through the Atlas engine on held-out prompts) and train.log.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()

import argparse  # noqa: E402
import logging  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from atlas.training.dflash import DFlashTrainSettings, run  # noqa: E402
from atlas.training.recipe import log_to  # noqa: E402

logger = logging.getLogger("atlas.tools.train_dflash_drafter")

DEFAULT_TARGET = ROOT / "atlas" / "assets" / "default-model"


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, got {text!r}") from exc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = DFlashTrainSettings(target="", out="")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=str(DEFAULT_TARGET), help="Target checkpoint folder (with tokenizer.json).")
    p.add_argument("--out", required=True, help="Output folder (created).")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default=d.device)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--time-budget-minutes", type=float, default=d.time_budget_minutes,
                   help="Wall-clock budget of the whole run (corpus to measured acceptance); 0 = none. Training steps "
                        "are fixed early to fit it, and the run stops cleanly if it is reached anyway.")
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="Upper bound on optimizer steps.")
    g = p.add_argument_group("drafter")
    g.add_argument("--num-layers", type=int, default=d.num_layers, help="Draft decoder layers.")
    g.add_argument("--block-size", type=int, default=d.block_size, help="Block size B (K = B - 1 drafts per step).")
    g.add_argument("--target-layer-ids", type=_ids, default=None,
                   help="Comma-separated target layers to read (default: the z-lab rule for --num-layers).")
    g.add_argument("--mask-token-id", type=int, default=None, help="Default: the tokenizer's <|mask|>.")
    g.add_argument("--intermediate-size", type=int, default=None, help="Default: the target's.")
    g = p.add_argument_group("data")
    g.add_argument("--corpus-limit-mb", type=float, default=d.corpus_limit_mb,
                   help="Use a deterministic subset of about this much stdlib source (quick runs).")
    g.add_argument("--stdlib-dir", default=d.stdlib_dir,
                   help="Train on this Python standard-library folder instead of the running Python's.")
    g.add_argument("--no-chat-data", dest="chat_data", action="store_false")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="Tokens per window.")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="Windows per step.")
    g.add_argument("--anchors-per-window", type=int, default=d.anchors_per_window, help="Blocks per window.")
    g.add_argument("--corpus-labels", dest="greedy_labels", action="store_false",
                   help="Train on corpus tokens instead of the target's own greedy tokens.")
    g.add_argument("--loss-gamma", type=float, default=None, help="Slot weight decay (default: by block size).")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--grad-clip", type=float, default=d.grad_clip)
    g.add_argument("--eval-every", type=int, default=d.eval_every)
    g.add_argument("--eval-windows", type=int, default=d.eval_windows, help="Held-out windows per evaluation.")
    g.add_argument("--no-keep-best", dest="keep_best", action="store_false")
    g.add_argument("--compile", action="store_true")
    g = p.add_argument_group("measured acceptance (Atlas engine, held-out prompts)")
    g.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    g.add_argument("--eval-prompt-tokens", type=int, default=d.eval_prompt_tokens)
    g.add_argument("--eval-max-tokens", type=int, default=d.eval_max_tokens)
    g.add_argument("--no-engine-eval", dest="engine_eval", action="store_false")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    log_to(out)
    settings = DFlashTrainSettings(**vars(args))
    command = "python tools/train_dflash_drafter.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    report = run(settings, started_at=_STARTED, command=command)
    blocks, engine = report["held_out_blocks"], report["engine_acceptance"]
    logger.info("held-out blocks: acceptance length %.3f (slot-1 accuracy %.3f); engine: %s; %d steps, %.1fs in all",
                blocks["acceptance_length"], blocks["slot1_accuracy"],
                {k: v.get("mean_acceptance_length", v.get("tokens_per_second")) for k, v in engine.items()
                 if isinstance(v, dict)},
                report["training"]["steps"], report["timings_seconds"]["total"])
    logger.info("files in %s: %s", out, ", ".join(sorted(p.name for p in out.iterdir())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
