#!/usr/bin/env python3
"""Train a small DeepSeek-V3-architecture model with a multi-token-prediction module on the default model's corpus.

    python tools/train_mtp_model.py --out runs/mtp-model                  # GPU if there is one
    python tools/train_mtp_model.py --device cpu --max-steps 4 --out /tmp/x --corpus-limit-mb 0.2 \\
        --hidden-size 32 --num-layers 2 --seq-len 64 --batch-size 4 --eval-prompts 2

Corpus: the running Python's standard library (or --stdlib-dir), tokenized with the default model's
tokenizer (or --tokenizer). Model: transformers' DeepseekV3ForCausalLM (MLA, a dense first layer, MoE
layers with sigmoid routing, correction biases trained aux-loss-free, shared experts) plus one MTP
module trained with weight --mtp-loss-weight. --out receives an HF checkpoint that transformers
loads (config.json with num_nextn_predict_layers 1, model.safetensors with the MTP module at layer index
num_hidden_layers, generation_config.json, the tokenizer), train_report.json (training curve, held-out
main and MTP losses, the MTP's top-1 accuracy, and greedy decoding through Atlas with and without
--speculative mtp: acceptance length, speed and whether the outputs are equal) and train.log.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from atlas.training.mtp_model import MTPModelSettings, MTPModelShape, run  # noqa: E402
from atlas.training.recipe import log_to  # noqa: E402

logger = logging.getLogger("atlas.tools.train_mtp_model")

_SHAPE_FLAGS = {f.name: f for f in dataclasses.fields(MTPModelShape)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = MTPModelSettings(out="")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="Output folder (created).")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default=d.device)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--time-budget-minutes", type=float, default=d.time_budget_minutes,
                   help="Wall-clock budget of the whole run (corpus to measured acceptance); 0 = none.")
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="Upper bound on optimizer steps.")
    p.add_argument("--max-epochs", type=float, default=d.max_epochs, help="Upper bound on passes over the data.")
    g = p.add_argument_group("corpus and tokenizer")
    g.add_argument("--tokenizer", default=d.tokenizer,
                   help="Folder with tokenizer.json (default: the shipped default model's).")
    g.add_argument("--corpus-limit-mb", type=float, default=d.corpus_limit_mb,
                   help="Use a deterministic subset of about this much stdlib source (quick runs).")
    g.add_argument("--stdlib-dir", default=d.stdlib_dir,
                   help="Train on this Python standard-library folder instead of the running Python's.")
    g.add_argument("--no-chat-data", dest="chat_data", action="store_false",
                   help="Leave out the chat-formatted documents made from docstrings and pydoc topics.")
    g = p.add_argument_group("model (DeepSeek-V3 architecture)")
    shape = MTPModelShape()
    for name in _SHAPE_FLAGS:
        value = getattr(shape, name)
        kind = float if isinstance(value, float) else int
        flag = "--num-layers" if name == "num_hidden_layers" else "--" + name.replace("_", "-")
        g.add_argument(flag, dest=name, type=kind, default=value,
                       help="0 = no q compression (a single q_proj, as DeepSeek-V2-Lite)" if name == "q_lora_rank"
                       else None)
    g = p.add_argument_group("training")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="Tokens per training window.")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="Windows per step.")
    g.add_argument("--lr", type=float, default=d.lr, help="Peak learning rate (AdamW).")
    g.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="Final LR / peak LR (cosine).")
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--grad-clip", type=float, default=d.grad_clip)
    g.add_argument("--mtp-loss-weight", type=float, default=d.mtp_loss_weight,
                   help="Weight of the MTP module's loss next to the main next-token loss.")
    g.add_argument("--bias-update-speed", type=float, default=d.bias_update_speed,
                   help="Aux-loss-free balancing: per-step change of the routing correction biases (0 = off).")
    g.add_argument("--eval-every", type=int, default=d.eval_every, help="Steps between validation evaluations.")
    g.add_argument("--eval-tokens", type=int, default=d.eval_tokens, help="Validation tokens per evaluation.")
    g.add_argument("--no-keep-best", dest="keep_best", action="store_false",
                   help="Keep the last weights even if an earlier evaluation was better.")
    g.add_argument("--compile", action="store_true", help="torch.compile the model for training.")
    g = p.add_argument_group("acceptance through the engine (greedy, held-out prompts)")
    g.add_argument("--no-engine-eval", dest="engine_eval", action="store_false")
    g.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    g.add_argument("--eval-prompt-tokens", type=int, default=d.eval_prompt_tokens)
    g.add_argument("--eval-max-tokens", type=int, default=d.eval_max_tokens)
    g.add_argument("--eval-draft-tokens", type=lambda s: tuple(int(k) for k in s.split(",")),
                   default=d.eval_draft_tokens, help="Comma-separated K values of --speculative mtp to measure.")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> MTPModelSettings:
    values = vars(args)
    shape = MTPModelShape(**{k: values.pop(k) for k in _SHAPE_FLAGS})
    if not shape.q_lora_rank:
        shape.q_lora_rank = None
    return MTPModelSettings(shape=shape, **values)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    handler = log_to(out)
    try:
        command = "python tools/train_mtp_model.py " + shlex.join(sys.argv[1:] if argv is None else argv)
        report = run(settings_from_args(args), started_at=_STARTED, command=command)
        test, engine = report["held_out_test"], report["engine_acceptance"]
        logger.info("held-out: main perplexity %.3f, MTP top-1 %.3f; engine: %s", test["main_perplexity"],
                    test["mtp_top1"], {k: (v.get("mean_acceptance_length"), v.get("speedup_vs_plain"))
                                       for k, v in engine.items() if isinstance(v, dict)})
    finally:
        logging.getLogger("atlas").removeHandler(handler)
        handler.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
