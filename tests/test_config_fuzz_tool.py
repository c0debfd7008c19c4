"""tools/config_fuzz.py keeps working: a few of its random configurations (seeded, so the same ones each run) against
the plain engine, on two families, with aborted requests, in a subprocess as it is run by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_few_random_configurations_match_the_plain_engine(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "config_fuzz.py"), "--seed", "0", "--configs", "4", "--aborts",
         "--families", "qwen3,mistral_window", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line[:1].isdigit()]
    assert len(lines) == 5 and lines[-1] == "0 failed", proc.stdout
    assert all(" ok " in line for line in lines[:4]), proc.stdout


def test_a_reference_tie_excuses_a_parted_greedy_completion_and_nothing_else(tmp_path):
    """config_fuzz.near_tie: where two tokens' logits are exactly equal (their LM-head rows made the same), a
    completion that takes the other one parts from the reference by a tie, which float32 rounding of another batch
    may decide either way; the same swap at a position without a tie, or a request whose logits are processed
    (a penalty), is still a failure."""
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(ROOT / "tools"))
    import config_fuzz
    from conftest import build_checkpoint

    from atlas import LLM, SamplingParams

    path = build_checkpoint(tmp_path, "Qwen3ForCausalLM", None)
    weights = load_file(path / "model.safetensors")
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    prompt = [5, 17, 33, 2, 9]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = LLM(str(path), skip_tokenizer_init=True, max_model_len=64)
    first = plain.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids[0]
    plain.shutdown()
    twin = 3 if first != 3 else 4
    weights[head] = weights[head].clone()
    weights[head][twin] = weights[head][first]  # (the two tokens' logits are now equal at every position)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    reference = LLM(str(path), skip_tokenizer_init=True, max_model_len=64)
    want = [list(reference.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids)]
    assert want[0][0] in (first, twin)
    tied = [[first + twin - want[0][0]] + want[0][1:]]
    assert config_fuzz.near_tie(reference, prompt, params, want, [tied])
    other = [[want[0][0]] + [(want[0][1] + 1) % 384] + want[0][2:]]  # (position 1 has no tie)
    assert not config_fuzz.near_tie(reference, prompt, params, want, [other])
    penalized = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.2)
    assert not config_fuzz.near_tie(reference, prompt, penalized, want, [tied])
    assert not config_fuzz.near_tie(reference, prompt, params, want, [want, None])
    reference.shutdown()
