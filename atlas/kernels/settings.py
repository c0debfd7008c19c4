"""The kernel settings of this process: the engine's config, handed to the kernels once at start-up.

Which attention tiles, pipelining depth, launch mode, MoE path and mask kernel run is a choice of the
kernels below the model, which many layers (and the drafters' own models) reach without an engine at
hand. So the engine sets them here once: the model runner calls `configure(config)` before it builds the
model, on every rank of a parallel engine (each builds its own runner). Until then (tests, tools and
benchmarks that call the kernels directly) the defaults hold, which are `EngineConfig`'s. The setting is
process-wide, as the kernels are: two engines of different settings in one process share the later one's.

Kernels read `tuning` (a `TuningConfig`: kv_block_n, kv_stages, mla_kv_stages, pdl, pdl_trigger,
moe_triton_max_tokens, mask_kernel) and `split_kv` (EngineConfig.split_kv) when they launch; nothing is
read from the environment. The other knobs reach their component with the config it is built with.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

from atlas.config import TuningConfig

if TYPE_CHECKING:
    from atlas.config import EngineConfig

#: The tuning knobs in effect (EngineConfig.tuning).
tuning: TuningConfig = TuningConfig()
#: Split-KV decode attention for the GQA and MLA kernels (EngineConfig.split_kv).
split_kv: bool = True


def configure(config: EngineConfig) -> None:
    """Take `config`'s kernel settings, for every kernel launched from now on."""
    set_kernel_settings(config.tuning, config.split_kv)


@contextlib.contextmanager
def tuned(**knobs) -> Iterator[None]:
    """These tuning knobs in effect for a block, the settings before restored after it (tests and tools that
    compare a kernel's paths in one process)."""
    before = tuning, split_kv
    set_kernel_settings(dataclasses.replace(before[0], **knobs), before[1])
    try:
        yield
    finally:
        set_kernel_settings(*before)


def set_kernel_settings(new_tuning: TuningConfig, new_split_kv: bool = True) -> None:
    """Set the knobs directly (tests and tools that run kernels without an engine)."""
    global tuning, split_kv
    if new_tuning.fp8_gemv:
        from atlas.kernels.fp8_linear import parse_gemv_table

        parse_gemv_table(new_tuning.fp8_gemv)  # (a ConfigError at start-up, not at the first decode step)
    if new_tuning.gemv_rows:
        from atlas.kernels.gemv import parse_rows_table

        parse_rows_table(new_tuning.gemv_rows)
    if new_tuning.moe_pairs_tiles:
        from atlas.kernels.moe_triton import parse_pairs_tiles

        parse_pairs_tiles(new_tuning.moe_pairs_tiles)
    if new_tuning.moe_mxfp4_row_steps:
        from atlas.kernels.moe_triton import parse_row_steps

        parse_row_steps(new_tuning.moe_mxfp4_row_steps)
    tuning, split_kv = new_tuning, bool(new_split_kv)
    from atlas.kernels import pdl

    pdl.enabled.cache_clear()  # (decided once per device for the settings in effect)
    pdl.trigger_flag.cache_clear()
