"""How far apart transformers' best two logits are at each greedy step of the hybrids' CUDA test (its prompts and
tiny checkpoints, built as tests/test_ssm_hybrids.py builds them), on the CPU: the smallest margin per prompt and its
step. Run from the repository root: `PYTHONPATH=.:tests python3 benchmarks/s74/near_ties.py`."""

import tempfile
from pathlib import Path

import test_ssm_hybrids as hybrids
from conftest import _build, hf_greedy_margins, hf_model, random_ids

root = Path(tempfile.mkdtemp())
prompts = [random_ids(n, 20 + n) for n in (5, 30, 47)]
for name in ("bamba", "moe", "dense", "nemotron_h"):
    model = hf_model(_build(root, name, hybrids.CONFIGS[name], None, 0, {}, randomize=hybrids.routing_biases))
    _, margins = hf_greedy_margins(model, prompts, hybrids.GREEDY.max_tokens)
    print(name, [(i, m.index(min(m)), round(min(m), 5)) for i, m in enumerate(margins)])
