"""Torch's CPU thread count follows the CPUs the process may use, unless --num-cpu-threads says otherwise."""

from __future__ import annotations

import os

import pytest
import torch

from atlas import LLM
from atlas.engine.cpu_threads import available_cpus
from atlas.errors import ConfigError


def _affinity() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@pytest.mark.parametrize("files,expected", [
    ({"cpu.max": "150000 100000\n"}, lambda n: min(n, 2)),  # 1.5 CPUs: rounded up
    ({"cpu.max": "50000 100000\n"}, lambda n: 1),
    ({"cpu.max": "max 100000\n"}, lambda n: n),  # no quota
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, lambda n: min(n, 3)),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, lambda n: n),
    ({}, lambda n: n),
])
def test_available_cpus_reads_affinity_and_cgroup_quota(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert available_cpus(tmp_path) == expected(_affinity())


def test_engine_sets_torch_threads_on_cpu(qwen3_dir, monkeypatch):
    before = torch.get_num_threads()
    try:
        LLM(str(qwen3_dir), kv_cache_memory="4MiB", num_cpu_threads=1)
        assert torch.get_num_threads() == 1
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        LLM(str(qwen3_dir), kv_cache_memory="4MiB")
        assert torch.get_num_threads() == available_cpus()
        # A thread count the user set through the environment is kept.
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        LLM(str(qwen3_dir), kv_cache_memory="4MiB")
        assert torch.get_num_threads() == 1
        with pytest.raises(ConfigError, match="--num-cpu-threads"):
            LLM(str(qwen3_dir), num_cpu_threads=0)
    finally:
        torch.set_num_threads(before)
