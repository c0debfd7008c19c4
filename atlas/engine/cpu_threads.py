"""How many CPU threads torch should use: the CPUs this process may actually run on.

torch's default is the machine's core count, which in a container or under `taskset` can be far more
than the process gets; its threads then fight over the few CPUs it has and every step slows down
(3x was measured under load). The CPUs available are the smaller of the affinity mask
(`os.sched_getaffinity`) and the cgroup CPU quota (cgroup v2 `cpu.max`, or v1
`cpu.cfs_quota_us / cpu.cfs_period_us`), rounded up. An OMP_NUM_THREADS in the environment is the
user's choice and is kept.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from atlas.errors import ConfigError

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_quota(root: Path) -> float | None:
    """CPUs allowed by the cgroup quota, or None when unlimited or unknown."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            quota, _, period = v2.read_text().strip().partition(" ")
            if quota != "max" and period:
                return int(quota) / int(period)
            return None
        quota_file, period_file = root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"
        if quota_file.is_file() and period_file.is_file():
            quota, period = int(quota_file.read_text()), int(period_file.read_text())
            if quota > 0 and period > 0:
                return quota / period
    except (OSError, ValueError):
        pass
    return None


def available_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    """CPUs this process can use: affinity mask, capped by the cgroup quota; at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        count = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup_root)
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


def configure_cpu_threads(requested: int | None, processes: int = 1) -> int:
    """Set torch's intra-op thread count to `requested`, or to this process's share of the CPUs available
    (`processes` of an engine share them: its ranks on this machine); returns it."""
    import torch

    if requested is not None and requested < 1:
        raise ConfigError(f"--num-cpu-threads must be a positive integer, got {requested}")
    if requested is None and os.environ.get("OMP_NUM_THREADS"):
        # The user chose already (torch honours OMP_NUM_THREADS): e.g. one thread in each of several
        # processes that share the cores.
        threads = torch.get_num_threads()
        logger.info("torch CPU threads: %d (OMP_NUM_THREADS)", threads)
        return threads
    threads = requested or max(1, available_cpus() // processes)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    logger.info("torch CPU threads: %d (%s)", threads, "--num-cpu-threads" if requested else "CPUs available")
    return threads


def grammar_mask_threads(requested: int | None) -> int:
    """Threads of the llguidance grammar engine for a step's token masks (--structured-outputs-mask-threads):
    `requested`, else a quarter of the CPUs available, at most 8 (0, the step's own thread, below 4 CPUs).
    llguidance's own default, 80 % of the CPUs, adds a thread for nearly every CPU that torch's threads and the
    step loop already use. On the H200 host (16 CPUs, 12 such threads) the llguidance runs of `atlas bench
    structured`, the only ones with that pool, were slower in every step at 32 sequences, unconstrained ones
    included (1.28-1.43 ms against 0.76-0.88), which fits threads competing for the CPUs; this default is a
    choice until tools/gpu_structured.sh (MASK_THREADS) measures the counts there. On a CPU of one or two cores a
    pool only adds a hand-over to another thread."""
    if requested is not None:
        return requested
    return min(8, available_cpus() // 4)
