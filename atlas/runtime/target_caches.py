"""The target model's caches as its forward uses them, set after the runner is made: the KV cache tensors and the
scratch page ids that only padding rows write into (ModelRunner.allocate_kv_cache), and the layers whose residual
stream each forward captures (set by the engine for its drafter)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TargetCaches:
    """One object that the runner and its parts (graph_plan.py, stage_launch.py) share: they hold it rather than
    copies of its fields, so they read what the runner set last, and never the runner itself."""

    kv_caches: list[torch.Tensor] = field(default_factory=list)
    scratch_pages: list[int] = field(default_factory=list)
    # KV cache groups (engine/kv_groups.py): the window group's scratch page ids (past its pool's); None without.
    window_scratch_pages: list[int] | None = None
    capture_layers: tuple[int, ...] = ()
