"""The `atlas` command as a user runs it: generate and chat, in a subprocess."""

from __future__ import annotations

import subprocess
import sys

from atlas import LLM, SamplingParams


def _atlas(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atlas.cli", "--log-level", "warning", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_generate_prints_the_greedy_completion(qwen3_dir):
    prompt = "def wrap(text):\n"
    expected = LLM(str(qwen3_dir), kv_cache_memory="8MiB").generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    proc = _atlas("generate", "--model", str(qwen3_dir), "--prompt", prompt, "--max-tokens", "12", "--ignore-eos",
                  "--kv-cache-memory", "8MiB")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"


def test_chat_answers_through_the_template(qwen3_dir):
    llm = LLM(str(qwen3_dir), kv_cache_memory="8MiB")
    expected = llm.chat([{"role": "user", "content": "hello"}],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0].text
    proc = _atlas("chat", "--model", str(qwen3_dir), "--max-tokens", "10", "--ignore-eos", "--kv-cache-memory", "8MiB",
                  stdin="hello\n\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "> " + expected + "\n> "
