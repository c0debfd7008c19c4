"""Bad input gets a clear error that names the fix, and never leaves the engine in a bad state."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import assert_pages_returned
from safetensors.torch import load_file, save_file

from atlas import LLM, SamplingParams
from atlas.errors import (
    ConfigError,
    InvalidRequestError,
    ModelLoadError,
    OutOfMemoryPlanError,
    PromptTooLongError,
    UnsupportedModelError,
)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), kv_cache_memory="8MiB", max_model_len=64)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


@pytest.mark.parametrize("bench", ["latency", "throughput", "spec-cost"])
def test_bench_commands_name_a_missing_model_path(tmp_path, capsys, bench):
    """The benches resolve --model as the engine does: one line naming the problem, exit status 2."""
    from atlas.cli import main

    assert main(["bench", bench, "--model", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"model path '{tmp_path / 'nope'}' does not exist")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture_lists_supported(qwen3_dir, tmp_path):
    ckpt = _copy(qwen3_dir, tmp_path / "m")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*Supported: .*LlamaForCausalLM"):
        LLM(str(ckpt))


@pytest.mark.parametrize("breakage,message", [
    (lambda c: c.pop("hidden_size"), "no 'hidden_size'"),
    (lambda c: c.update(num_key_value_heads=3), "not a multiple"),
    (lambda c: c.update(vocab_size="big"), "'vocab_size' must be a positive integer"),
])
def test_malformed_config(qwen3_dir, tmp_path, breakage, message):
    ckpt = _copy(qwen3_dir, tmp_path / "m")
    cfg = json.loads((ckpt / "config.json").read_text())
    breakage(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(ckpt))


def test_config_that_is_not_json(qwen3_dir, tmp_path):
    ckpt = _copy(qwen3_dir, tmp_path / "m")
    (ckpt / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        LLM(str(ckpt))


def test_missing_weight_is_named(qwen3_dir, tmp_path):
    ckpt = _copy(qwen3_dir, tmp_path / "m")
    weights = load_file(ckpt / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, ckpt / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing weight\(s\) model.layers.1.self_attn.k_proj.weight"):
        LLM(str(ckpt))


def test_wrong_weight_shape_is_named(qwen3_dir, tmp_path):
    ckpt = _copy(qwen3_dir, tmp_path / "m")
    weights = load_file(ckpt / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"][:10].clone()
    save_file(weights, ckpt / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.norm.weight.*shape mismatch"):
        LLM(str(ckpt))


def test_missing_shard_and_missing_weights(qwen3_dir, tmp_path):
    ckpt = _copy(qwen3_dir, tmp_path / "m")
    weights = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(weights)
    half = len(names) // 2
    save_file({n: weights[n] for n in names[:half]}, ckpt / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {n: ("model-00001-of-00002.safetensors" if i < half
                                                else "model-00002-of-00002.safetensors")
                                            for i, n in enumerate(names)}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors.*missing"):
        LLM(str(ckpt))
    save_file({n: weights[n] for n in names[half:]}, ckpt / "model-00002-of-00002.safetensors")
    sharded = LLM(str(ckpt), kv_cache_memory="8MiB")  # and a complete sharded checkpoint loads
    assert sharded.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    (ckpt / "model-00001-of-00002.safetensors").unlink()
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    (ckpt / "model.safetensors.index.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors"):
        LLM(str(ckpt))


@pytest.mark.parametrize("kwargs,message", [
    (dict(dtype="int8"), "--dtype must be one of"),
    (dict(device="tpu"), "--device must be one of"),
    (dict(block_size=12), "--block-size must be a power of two"),
    (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization must be in"),
    (dict(kv_cache_memory="lots"), "cannot read 'lots' as a size"),
    (dict(max_num_seqs=0), "--max-num-seqs must be a positive integer"),
    (dict(max_num_seqs=8, max_num_seqs_per_request=9), "--max-num-seqs-per-request must be a whole number from 1 "
     "to --max-num-seqs"),
    (dict(max_model_len=-3), "--max-model-len must be a positive integer"),
    (dict(bogus_flag=1), "unknown engine argument.*bogus_flag"),
    (dict(max_model_len=10_000), "exceeds the model's max_position_embeddings 512"),
])
def test_bad_engine_arguments(qwen3_dir, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(qwen3_dir), **kwargs)


def test_kv_cache_too_small_for_one_sequence(qwen3_dir):
    with pytest.raises(OutOfMemoryPlanError, match="lower --max-model-len, or raise --kv-cache-memory"):
        LLM(str(qwen3_dir), kv_cache_memory="64KiB")


def test_max_seq_len_is_an_alias(qwen3_dir):
    assert LLM(str(qwen3_dir), max_seq_len=100, kv_cache_memory="8MiB").engine.max_model_len == 100


@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-7), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=-1), "logprobs"),  # (the upper bound is the engine's --max-logprobs: test_vllm_compat)
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(stop=[""]), "stop"),
    (dict(stop=["x"] * 40), "stop"),
    (dict(min_tokens=50, max_tokens=10), "min_tokens"),
])
def test_invalid_sampling_parameters(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)


def test_prompt_longer_than_context_and_engine_keeps_working(llm):
    with pytest.raises(PromptTooLongError, match="64 tokens.*raise --max-model-len"):
        llm.generate({"prompt_token_ids": list(range(1, 80))}, SamplingParams(max_tokens=4))
    # A batch with one bad prompt is rejected as a whole, leaving nothing queued.
    with pytest.raises(PromptTooLongError):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": list(range(1, 80))}])
    assert_pages_returned(llm)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("prompt,message", [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, 99999]}, r"token ids must be integers in \[0, 384\)"),
    ({"prompt_token_ids": [1, -2]}, "token ids must be integers"),
    ({"prompt_token_ids": [1, True]}, "token ids must be integers"),
    ({"prompt_token_ids": [1, 2.0]}, "token ids must be integers"),
    ({"text": "hi"}, "needs 'prompt' or 'prompt_token_ids'"),
])
def test_bad_prompts(llm, prompt, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=2))


def test_mismatched_params_list(llm):
    with pytest.raises(InvalidRequestError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()] * 3)


def test_skip_tokenizer_init_needs_token_ids(qwen3_dir):
    llm = LLM(str(qwen3_dir), skip_tokenizer_init=True, kv_cache_memory="8MiB")
    assert llm.get_tokenizer() is None
    with pytest.raises(InvalidRequestError, match="send prompt token ids"):
        llm.generate("hello")
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == ""


def test_checkpoint_without_tokenizer(qwen3_dir, tmp_path):
    ckpt = tmp_path / "m"
    ckpt.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(qwen3_dir / name, ckpt / name)
    with pytest.raises(ModelLoadError, match="no tokenizer files.*--skip-tokenizer-init"):
        LLM(str(ckpt))
    assert LLM(str(ckpt), skip_tokenizer_init=True, kv_cache_memory="8MiB").get_tokenizer() is None


def test_cli_reports_errors_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "atlas.cli", "generate", "--model", str(tmp_path / "none"),
                           "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "error: model path" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "atlas.cli", "generate", "--dtype", "int4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "invalid choice: 'int4'" in proc.stderr


def test_running_out_of_memory_while_profiling_names_the_fix():
    """A GPU shared with another engine can run out in the profiling forward, before any KV page is planned: the
    start refuses with the step's size, what the weights took and the flags that shrink it (runtime/memory_planner.py
    raises this from torch's OutOfMemoryError), not torch's own message alone."""
    from atlas.runtime.memory import profiling_ran_out

    torch_said = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 32.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which 20.19 MiB "
        "is free. Including non-PyTorch memory, this process has 79.15 GiB memory in use.")
    error = profiling_ran_out(torch_said, 8192, 256, 16 * 2**30, 32 * 2**30)
    assert isinstance(error, OutOfMemoryPlanError)
    message = str(error)
    for part in ("8,192 tokens, 256 sequences", "16.00 GiB", "32.00 GiB", "Tried to allocate 32.00 MiB",
                 "--max-num-batched-tokens", "--max-num-seqs", "free the GPU"):
        assert part in message, (part, message)
    assert "Including non-PyTorch" not in message


def test_weights_larger_than_the_gpu_name_the_ways_out():
    """A model whose weights do not fit the GPU runs out of memory while it is built or loaded: the start refuses
    with what was free and the ways to fewer bytes on this device (runtime/model_runner.py raises this from torch's
    OutOfMemoryError on CUDA), not torch's message alone."""
    from atlas.runtime.memory import weights_ran_out

    torch_said = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 1.16 GiB. GPU 0 has a total capacity of 79.18 GiB of which 412.19 MiB "
        "is free.")
    error = weights_ran_out(torch_said, "cuda:0", 78 * 2**30, 80 * 2**30)
    assert isinstance(error, OutOfMemoryPlanError)
    message = str(error)
    for part in ("do not fit cuda:0", "78.00 GiB of 80.00 GiB free at start", "Tried to allocate 1.16 GiB",
                 "--tensor-parallel-size", "pass --quantization fp8", "smaller model"):
        assert part in message, (part, message)
    # (with --quantization fp8 the plain weights load whole first: the flag itself is no way out)
    quantizing = str(weights_ran_out(torch_said, "cuda:0", 78 * 2**30, 80 * 2**30, quantizing=True))
    assert "serve an FP8 checkpoint (--quantization fp8 loads the plain weights whole first)" in quantizing
    assert "pass --quantization fp8" not in quantizing


def test_a_refused_start_lets_go_of_what_the_failed_step_held():
    """After running out of memory, the refusal's chained exception would keep the failed frames' tensors (a
    half-built model, the profile's caches) alive for as long as a caller holds it; release_frames clears them."""
    import weakref

    from atlas.runtime.memory_planner import release_frames

    held = []

    def build():
        weights = torch.zeros(1024)
        held.append(weakref.ref(weights))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    try:
        build()
    except torch.OutOfMemoryError as exc:
        caught = exc
    assert held[0]() is not None  # (the traceback's frame still holds it)
    release_frames(caught)
    assert held[0]() is None
