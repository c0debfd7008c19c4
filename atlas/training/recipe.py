"""Pieces shared by the training recipes (default model, DFlash drafter, MTP model): the start of a run
(device, seeds, deadline, a clock of named phases), logging into the output folder, a corpus tokenized
with a given tokenizer, the trainer settings, and the common parts of a report."""

from __future__ import annotations

import logging
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> Any:
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available (use --device cpu)")
    return torch.device(name)


def versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


class Clock:
    """Seconds of named phases: `with clock.phase("training"): ...`."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}

    def phase(self, name: str):
        clock = self

        class _Phase:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                clock.phases[name] = round(time.perf_counter() - self.t, 3)
                logger.info("%s: %.1fs", name, clock.phases[name])

        return _Phase()


@dataclass
class Run:
    """A started run: where it writes, on what, until when."""

    started: float
    deadline: float | None
    out: Path
    device: Any
    clock: Clock = field(default_factory=Clock)

    @property
    def autocast(self) -> Any:
        """bf16 autocast on CUDA, plain fp32 elsewhere."""
        import torch

        return torch.bfloat16 if self.device.type == "cuda" else None

    @property
    def device_name(self) -> str:
        import torch

        return str(self.device) + (f" ({torch.cuda.get_device_name(self.device)})" if self.device.type == "cuda" else "")

    def train_deadline(self, reserve: float) -> float | None:
        """The deadline for training, keeping `reserve` seconds for what comes after it (logged)."""
        if self.deadline is None:
            return None
        end = self.deadline - reserve
        logger.info("time budget %.0fs: %.0fs used before training, %.0fs kept for the end, %.0fs for training",
                    self.deadline - self.started, time.perf_counter() - self.started, reserve, end - time.perf_counter())
        return end

    def timings(self) -> dict[str, float]:
        return {**self.clock.phases, "total": round(time.perf_counter() - self.started, 2)}


def start_run(out: str | Path, device: str, seed: int, time_budget_minutes: float,
              started_at: float | None = None) -> Run:
    """Create the output folder, seed python / numpy / torch, pick the device (TF32 on CUDA), and set the
    deadline of the whole run (time_budget_minutes <= 0: none)."""
    import numpy as np
    import torch

    started = started_at if started_at is not None else time.perf_counter()
    budget = time_budget_minutes * 60.0
    run = Run(started, started + budget if budget > 0 else None, Path(out), resolve_device(device))
    run.out.mkdir(parents=True, exist_ok=True)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if run.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    logger.info("device %s, versions %s", run.device_name, versions())
    return run


def log_to(out: Path) -> logging.Handler:
    """Log the `atlas` loggers at INFO to out/train.log and stderr; -> the file handler."""
    out.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    file_handler = logging.FileHandler(out / "train.log", mode="w")
    stream = logging.StreamHandler(sys.stderr)
    root = logging.getLogger("atlas")
    root.setLevel(logging.INFO)
    for h in (file_handler, stream):
        h.setFormatter(fmt)
        root.addHandler(h)
    return file_handler


def tokenized_corpus(tokenizer: Any, clock: Clock, seed: int, chat: bool, corpus_limit_mb: float | None,
                     stdlib_dir: str | None) -> tuple[Any, dict[str, Any], int]:
    """The default model's corpus (by file: train / valid / test), tokenized with `tokenizer` (a
    `tokenizers.Tokenizer`) and packed per split with the end-of-text token between documents.
    -> (corpus, token stream per split, end-of-text id)."""
    from atlas.training import corpus as corpus_mod
    from atlas.training.data import pack_documents
    from atlas.training.tokenizer import EOS_TOKEN, encode_batch

    with clock.phase("corpus"):
        limit = int(corpus_limit_mb * 1e6) if corpus_limit_mb else None
        corpus = corpus_mod.build_corpus(corpus_mod.CorpusConfig(seed=seed, chat=chat, limit_bytes=limit,
                                                                 stdlib_dir=stdlib_dir))
    with clock.phase("tokenization"):
        ids = encode_batch(tokenizer, [d.text for d in corpus.documents])
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    eos_id = eos_id if eos_id is not None else 0
    streams = {split: pack_documents([i for d, i in zip(corpus.documents, ids, strict=True) if d.split == split],
                                     eos_id) for split in corpus_mod.SPLITS}
    logger.info("tokens per split: %s", {k: len(v) for k, v in streams.items()})
    return corpus, streams, eos_id


def train_config(settings: Any, autocast: Any) -> Any:
    """The trainer's settings from a recipe's (lr, min_lr_ratio, warmup_steps, weight_decay, grad_clip,
    max_steps, eval_every, keep_best, compile)."""
    from atlas.training.trainer import TrainConfig

    return TrainConfig(lr=settings.lr, min_lr_ratio=settings.min_lr_ratio, warmup_steps=settings.warmup_steps,
                       weight_decay=settings.weight_decay, grad_clip=settings.grad_clip, max_steps=settings.max_steps,
                       eval_every=settings.eval_every, keep_best=settings.keep_best, autocast_dtype=autocast,
                       compile=settings.compile)


def training_report(result: Any, **extra: Any) -> dict[str, Any]:
    """The report's "training" section for a TrainResult (plus recipe-specific entries, placed after
    the step counts)."""
    return {"steps": result.steps, "planned_steps": result.planned_steps, "stopped_by": result.stopped_by, **extra,
            "seconds": round(result.seconds, 2), "seconds_per_step": result.seconds_per_step,
            "final_train_loss": result.final_train_loss, "best_step": result.best_step,
            "best_valid_loss": result.best_loss, "restored_best": result.restored_best, "history": result.history}


def report_header(settings: Any, command: str | None, result: Any, run: Run) -> dict[str, Any]:
    """The first entries of every report: settings, command, the command that repeats the run without a
    clock, versions, device."""
    from dataclasses import asdict

    return {"settings": asdict(settings), "command": command,
            "reproduce": (f"{command} --max-steps {result.steps} --time-budget-minutes 0" if command else None),
            "versions": versions(), "device": run.device_name}
