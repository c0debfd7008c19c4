"""A general training loop: any module, any loss, batches from any iterator.

AdamW (weight decay on matrices only), linear warmup then cosine decay to `min_lr_ratio`, gradient
clipping, bf16 autocast on CUDA (fp32 master weights) and plain fp32 on CPU, progress with tqdm,
periodic evaluation through a callback, and optionally the weights of the best evaluation restored
at the end.

With a deadline, the number of steps is fixed early: the loop times a few steps during warmup, then
sets the total so that training (and its evaluations) ends before the deadline, and the cosine
schedule runs to completion over that total. The warmup does not depend on the total, so the run is
the same as one started with `max_steps` equal to that total and no deadline. If the deadline passes
anyway (a slow machine), the loop stops cleanly after the current step.

The loss callback gets (model, batch) and returns a scalar tensor; the eval callback gets the model
and returns a dict of floats (its "loss" entry picks the best weights). A DFlash or MTP drafter
trains through the same loop with its own model, loss and batches.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from atlas.training.evaluate import autocast_for

logger = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    max_steps: int = 100_000
    eval_every: int = 250  # steps; 0 = only before and after training
    log_every: int = 25  # steps between host syncs (progress bar, loss check)
    calibration_steps: int = 20  # with a deadline: steps timed before the total is fixed
    plan_fraction: float = 0.95  # with a deadline: share of the time left that the planned steps may fill
    keep_best: bool = True  # restore the weights of the best evaluation at the end
    autocast_dtype: torch.dtype | None = torch.bfloat16  # used on CUDA only
    compile: bool = False  # torch.compile the model for the training steps


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at 0-based `step`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    steps: int
    planned_steps: int
    tokens: int
    seconds: float
    stopped_by: str  # "planned steps" | "time budget"
    seconds_per_step: float | None
    final_train_loss: float | None
    best_step: int | None = None
    best_loss: float | None = None
    restored_best: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linear and embedding weights); not norms, biases or other vectors."""
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    def __init__(self, model: torch.nn.Module, config: TrainConfig, device: torch.device | str,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                 eval_fn: Callable[[torch.nn.Module], dict[str, float]] | None = None,
                 num_tokens: Callable[[Any], int] | None = None):
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.loss_fn = loss_fn
        self.eval_fn = eval_fn
        self.num_tokens = num_tokens or (lambda batch: int(getattr(batch, "num_tokens", 0)))
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr,
                                           betas=config.betas, eps=config.eps, fused=fused)
        self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.forward_model = torch.compile(model) if config.compile else model
        self._best_state: dict[str, torch.Tensor] | None = None

    # -------------------------------------------------------------------------------------- eval
    def _evaluate(self, step: int, tokens: int, t0: float, train_loss: float | None,
                  result: TrainResult) -> float:
        t = time.perf_counter()
        metrics = self.eval_fn(self.model) if self.eval_fn is not None else {}
        seconds = time.perf_counter() - t
        record = {"step": step, "tokens": tokens, "seconds": round(time.perf_counter() - t0, 2),
                  "train_loss": train_loss, **metrics}
        result.history.append(record)
        loss = metrics.get("loss")
        if loss is not None and (result.best_loss is None or loss < result.best_loss):
            result.best_loss, result.best_step = loss, step
            if self.config.keep_best:
                self._best_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        logger.info("step %d: %s", step, ", ".join(
            f"{k} {v:.5g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items() if k != "step"))
        return seconds

    # -------------------------------------------------------------------------------------- loop
    def fit(self, batches: Iterable, deadline: float | None = None, step_cap: int | None = None) -> TrainResult:
        """Train until the planned number of steps (max_steps, step_cap and the deadline decide it).

        deadline: a time.perf_counter() value by which training and its evaluations should be done.
        """
        from tqdm.auto import tqdm

        cfg = self.config
        planned = min(cfg.max_steps, step_cap or cfg.max_steps)
        warmup = max(1, min(cfg.warmup_steps, planned))
        result = TrainResult(0, planned, 0, 0.0, "planned steps", None, None)
        t0 = time.perf_counter()
        self.model.train()
        eval_seconds = self._evaluate(0, 0, t0, None, result) if self.eval_fn is not None else 0.0

        # The total is fixed within warmup, so the cosine phase only ever sees the final total.
        calib_end = max(1, min(3 + cfg.calibration_steps, warmup, planned))
        calib_start = min(3, calib_end - 1)
        calib_t = 0.0
        tty = sys.stderr.isatty()
        bar = tqdm(total=planned, unit="step", dynamic_ncols=True, mininterval=0.5 if tty else 5.0)
        interval_loss = torch.zeros((), device=self.device)
        interval_steps = since_eval_steps = 0
        since_eval_loss = 0.0
        tokens = 0
        last_log = (time.perf_counter(), 0)
        it = iter(batches)
        step = 0
        loop_t = time.perf_counter()
        while step < planned:
            if deadline is not None and step == calib_start:
                _sync(self.device)
                calib_t = time.perf_counter()
            for group in self.optimizer.param_groups:
                group["lr"] = cfg.lr * lr_factor(step, warmup, planned, cfg.min_lr_ratio)
            batch = next(it)
            with autocast_for(self.device, cfg.autocast_dtype):
                loss = self.loss_fn(self.forward_model, batch)
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self._params, cfg.grad_clip, foreach=True)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens += self.num_tokens(batch)
            interval_loss += loss.detach()
            interval_steps += 1

            if deadline is not None and step == calib_end:
                _sync(self.device)
                now = time.perf_counter()
                per_step = (now - calib_t) / max(1, calib_end - calib_start)
                result.seconds_per_step = per_step
                evals_cost = eval_seconds / cfg.eval_every if cfg.eval_every else 0.0
                left = cfg.plan_fraction * (deadline - now) - eval_seconds
                fit = step + int(max(0.0, left) / (per_step + evals_cost))
                if fit < planned:
                    planned = max(step, fit)
                    logger.info("time budget: %.3fs per step, %d steps planned (%.0fs left)",
                                per_step, planned, deadline - now)
                bar.total = planned
                bar.refresh()

            at_eval = cfg.eval_every and step % cfg.eval_every == 0 and step < planned
            if step % cfg.log_every == 0 or at_eval or step == planned:
                mean = float(interval_loss) / interval_steps
                if not math.isfinite(mean):
                    bar.close()
                    raise RuntimeError(f"training diverged at step {step} (loss {mean}); lower --lr")
                since_eval_loss += mean * interval_steps
                since_eval_steps += interval_steps
                interval_loss.zero_()
                interval_steps = 0
                now = time.perf_counter()
                rate = (tokens - last_log[1]) / max(1e-9, now - last_log[0])
                last_log = (now, tokens)
                bar.set_postfix(loss=f"{mean:.3f}", lr=f"{self.optimizer.param_groups[0]['lr']:.2e}",
                                tok_s=f"{rate:,.0f}", refresh=False)
                result.final_train_loss = mean
            bar.update(1)

            if at_eval and self.eval_fn is not None:
                train_loss = since_eval_loss / max(1, since_eval_steps)
                since_eval_loss, since_eval_steps = 0.0, 0
                eval_seconds = self._evaluate(step, tokens, t0, train_loss, result)
            if deadline is not None and step < planned and time.perf_counter() > deadline:
                logger.warning("time budget reached at step %d of %d: stopping here", step, planned)
                result.stopped_by = "time budget"
                break
        bar.close()
        if interval_steps:  # (steps since the last log: a time budget can stop the loop between logs)
            since_eval_loss += float(interval_loss)
            since_eval_steps += interval_steps
            result.final_train_loss = float(interval_loss) / interval_steps
        _sync(self.device)
        if deadline is not None and result.seconds_per_step is None and step:
            # (the time budget ran out before the calibration steps were timed: the steps that ran, then)
            result.seconds_per_step = (time.perf_counter() - loop_t) / step
        result.steps, result.tokens, result.planned_steps = step, tokens, planned
        if self.eval_fn is not None:
            last_loss = since_eval_loss / since_eval_steps if since_eval_steps else result.final_train_loss
            self._evaluate(step, tokens, t0, last_loss, result)
            if self._best_state is not None and result.best_step != step:
                logger.info("restoring the weights of step %d (held-out loss %.4f)", result.best_step,
                            result.best_loss)
                self.model.load_state_dict(self._best_state)
                result.restored_best = True
        self._best_state = None
        result.seconds = time.perf_counter() - t0
        return result
