#!/usr/bin/env python3
"""Train Atlas's default model: a small Qwen3-architecture LM on the Python standard library.

    python tools/train_default_model.py --out runs/default-model            # GPU if there is one
    python tools/train_default_model.py --device cpu --max-steps 30 --out /tmp/x \\
        --corpus-limit-mb 2 --vocab-size 1024 --hidden-size 64 --num-layers 2 --seq-len 128 --batch-size 8

Everything runs from this one command and is seeded: corpus from the running Python's stdlib (split by
file), byte-level BPE tokenizer, packed tokens, training under a wall-clock budget for the whole run,
held-out perplexity against a unigram baseline, a bf16 Hugging Face checkpoint. --out receives eight
files: config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json,
expected_greedy.json, train_report.json and train.log. Copy the first six into
atlas/assets/default-model/ to ship a new default model.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from atlas.training.default_model import DefaultModelSettings, run  # noqa: E402
from atlas.training.recipe import log_to  # noqa: E402

logger = logging.getLogger("atlas.tools.train_default_model")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = DefaultModelSettings(out="")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="Output folder (created).")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default=d.device)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--time-budget-minutes", type=float, default=d.time_budget_minutes,
                   help="Wall-clock budget of the whole run (corpus to saved checkpoint); 0 = none. Training "
                        "steps are fixed early to fit it, and the run stops cleanly if it is reached anyway.")
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="Upper bound on optimizer steps.")
    p.add_argument("--max-epochs", type=float, default=d.max_epochs, help="Upper bound on passes over the data.")
    g = p.add_argument_group("corpus and tokenizer")
    g.add_argument("--corpus-limit-mb", type=float, default=d.corpus_limit_mb,
                   help="Use a deterministic subset of about this much stdlib source (quick runs).")
    g.add_argument("--stdlib-dir", default=d.stdlib_dir,
                   help="Train on this Python standard-library folder instead of the running Python's.")
    g.add_argument("--no-chat-data", dest="chat_data", action="store_false",
                   help="Leave out the chat-formatted documents made from docstrings and pydoc topics.")
    g.add_argument("--valid-fraction", type=float, default=d.valid_fraction)
    g.add_argument("--test-fraction", type=float, default=d.test_fraction)
    g.add_argument("--vocab-size", type=int, default=d.vocab_size, help="BPE vocabulary, special tokens included.")
    g = p.add_argument_group("model (Qwen3 architecture, tied embeddings)")
    g.add_argument("--hidden-size", type=int, default=d.hidden_size)
    g.add_argument("--num-layers", type=int, default=d.num_layers)
    g.add_argument("--num-heads", type=int, default=d.num_heads)
    g.add_argument("--num-kv-heads", type=int, default=d.num_kv_heads)
    g.add_argument("--head-dim", type=int, default=d.head_dim)
    g.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    g.add_argument("--max-position-embeddings", type=int, default=d.max_position_embeddings)
    g.add_argument("--rope-theta", type=float, default=d.rope_theta)
    g = p.add_argument_group("training")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="Tokens per training window.")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="Windows per step.")
    g.add_argument("--lr", type=float, default=d.lr, help="Peak learning rate (AdamW).")
    g.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="Final LR / peak LR (cosine).")
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--grad-clip", type=float, default=d.grad_clip)
    g.add_argument("--eval-every", type=int, default=d.eval_every, help="Steps between validation evaluations.")
    g.add_argument("--eval-tokens", type=int, default=d.eval_tokens, help="Validation tokens per evaluation.")
    g.add_argument("--test-max-tokens", type=int, default=d.test_max_tokens,
                   help="Cap on held-out test tokens in the final evaluation (default: all).")
    g.add_argument("--no-keep-best", dest="keep_best", action="store_false",
                   help="Keep the last weights even if an earlier evaluation was better.")
    g.add_argument("--compile", action="store_true", help="torch.compile the model for training.")
    return p.parse_args(argv)


def atlas_check(out: Path) -> dict:
    """Load the checkpoint in Atlas (fp32, CPU) and compare its greedy tokens with transformers'."""
    from atlas import LLM, SamplingParams

    expected = json.loads((out / "expected_greedy.json").read_text())
    llm = LLM(model=str(out), device="cpu", dtype="float32", kv_cache_memory="64MiB")
    result = {}
    for case in expected["cases"]:
        got = llm.generate({"prompt_token_ids": case["prompt_token_ids"]},
                           SamplingParams(max_tokens=len(case["token_ids"]), temperature=0, ignore_eos=True))
        result[case["name"]] = got[0].outputs[0].token_ids == case["token_ids"]
    return {"greedy_matches_transformers": result}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    log_to(out)
    settings = DefaultModelSettings(**vars(args))
    command = "python tools/train_default_model.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    report = run(settings, started_at=_STARTED, command=command)
    try:
        report["atlas_check"] = atlas_check(out)
    except Exception as exc:  # report it; the checkpoint is written either way
        logger.exception("loading the checkpoint in Atlas failed")
        report["atlas_check"] = {"error": f"{type(exc).__name__}: {exc}"}
    report["timings_seconds"]["total_with_checks"] = round(time.perf_counter() - _STARTED, 2)
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    ev = report["evaluation"]
    logger.info("held-out perplexity %.3f (unigram %.3f), %d steps, %.2f epochs, atlas check %s, %.1fs in all",
                ev["model"]["perplexity"], ev["unigram_add_one"]["perplexity"], report["training"]["steps"],
                report["training"]["epochs"], report["atlas_check"], report["timings_seconds"]["total_with_checks"])
    logger.info("files in %s: %s", out, ", ".join(sorted(p.name for p in out.iterdir())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
