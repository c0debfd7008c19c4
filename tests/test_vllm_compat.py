"""A vLLM user's `atlas serve` line: vLLM's flags taken, refused with a reason, or translated; --config FILE.yaml;
request and stats logging."""

from __future__ import annotations

import json
import logging
import re
import shutil
import time

import httpx
import pytest
from serving import assert_error, start_server

from atlas import LLM, SamplingParams
from atlas.cli import build_parser, parse_args
from atlas.config import EngineConfig
from atlas.errors import ConfigError, UnsupportedModelError
from atlas.vllm_config import engine_kwargs

ENGINE = dict(kv_cache_memory="4MiB", max_model_len=128)


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(build_parser(), argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_vllm_flags_atlas_lacks_are_refused_with_the_reason(capsys):
    for argv, words in ((["serve", "--enable-sleep-mode"], "not supported"),
                        (["serve", "--max-cpu-loras", "4"], "device slots"),
                        (["serve", "--swap-space", "4"], "recomputed"),
                        (["serve", "--enable-reasoning"], "--reasoning-parser"),
                        (["serve", "--no-enable-chunked-prefill"], "always splits"),
                        (["serve", "--disable-uvicorn-access-log"], "--no-access-log"),
                        (["serve", "--enable-eplb"], "load balancing"),
                        (["serve", "--disable-sliding-window"], "--max-model-len"),
                        (["serve", "--otlp-traces-endpoint", "x"], "OpenTelemetry"),
                        (["serve", "--kv-offloading-size", "8"], "on the device"),
                        (["serve", "--stream-interval", "4"], "no interval to set"),
                        (["serve", "--enable-dbo"], "dual-batch overlap")):
        err = _error(capsys, argv)
        assert "is a vLLM flag that Atlas does not implement" in err and words in err, err
        assert "usage: atlas serve" in err  # (the sub-command's usage, not the top-level one)
    # flags that ask for what Atlas does anyway: accepted
    parse_args(build_parser(), ["serve", "--disable-cascade-attn", "--preemption-mode", "recompute",
                                "--enable-tokenizer-info-endpoint"])
    assert "invalid choice" in _error(capsys, ["serve", "--preemption-mode", "swap"])
    # --tokenizer-mode: auto (hf) and deepseek_v32 are what Atlas does; the other modes are refused with the reason
    for mode in ("auto", "hf", "deepseek_v32"):
        assert parse_args(build_parser(), ["serve", "--tokenizer-mode", mode]).tokenizer_mode == mode
    assert "tekken.json" in _error(capsys, ["serve", "--tokenizer-mode", "mistral"])
    assert "fast (tokenizers) tokenizer" in _error(capsys, ["serve", "--tokenizer-mode", "slow"])
    # vLLM's LoRA flags that Atlas takes: adapters as NAME=PATH or JSON, their slots and rank
    args = parse_args(build_parser(), ["serve", "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
                                       "--max-loras", "3", "--max-lora-rank", "64"])
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 3, 64)
    from atlas.config import LoraModule
    assert [LoraModule.parse(m) for m in args.lora_modules] == [LoraModule("a", "/x"), LoraModule("b", "/y")]
    # vLLM's dtype names, and its counts with a suffix for --max-model-len
    assert [parse_args(build_parser(), ["serve", "--dtype", d]).dtype for d in ("half", "float")] == [
        "float16", "float32"]
    assert [parse_args(build_parser(), ["serve", "--max-model-len", v]).max_model_len
            for v in ("4096", "4k", "4K", "25.6k")] == [4096, 4000, 4096, 25600]
    assert "not a whole count" in _error(capsys, ["serve", "--max-model-len", "4.5"])


def test_an_unknown_flag_shows_the_sub_commands_usage(capsys):
    err = _error(capsys, ["serve", "--no-such-flag"])
    assert "usage: atlas serve" in err and "unrecognized arguments: --no-such-flag" in err
    err = _error(capsys, ["generate", "--no-such-flag"])
    assert "usage: atlas generate" in err


def test_speculative_config_is_translated(capsys):
    args = parse_args(build_parser(), ["serve", "--speculative-config", json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5})])
    assert (args.speculative, args.num_draft_tokens, args.ngram_min, args.ngram_max) == ("ngram", 3, 2, 5)
    args = parse_args(build_parser(), ["serve", "--speculative-config", '{"method": "deepseek_mtp", "max_model_len": 4096}'])
    assert (args.speculative, args.speculative_max_model_len) == ("mtp", 4096)
    args = parse_args(build_parser(), ["serve", "--speculative-config",
                                       '{"method": "eagle3", "model": "x", "num_speculative_tokens": 3}'])
    assert (args.speculative, args.draft_model, args.num_draft_tokens) == ("eagle3", "x", 3)
    assert "method 'eagle' (EAGLE-1/2 drafters) is not one Atlas implements" in _error(
        capsys, ["serve", "--speculative-config", '{"method": "eagle", "model": "x"}'])
    assert "'draft_tensor_parallel_size' is not a setting" in _error(
        capsys, ["serve", "--speculative-config", '{"method": "ngram", "draft_tensor_parallel_size": 1}'])


def test_config_file_gives_flags_and_the_command_line_wins(tmp_path, capsys):
    path = tmp_path / "serve.yaml"
    path.write_text("port: 9001\nmax-model-len: 128\nenable_prefix_caching: false\nserved-model-name: [a, b]\n"
                    "enable-log-requests: true\n")
    args = parse_args(build_parser(), ["serve", "--config", str(path), "--port", "9002"])
    assert (args.port, args.max_model_len, args.enable_prefix_caching) == (9002, 128, False)
    assert args.served_model_name == ["a", "b"] and args.enable_log_requests
    path.write_text("no-such-flag: 1\n")
    assert "'no-such-flag' is not a flag of this command" in _error(capsys, ["serve", "--config", str(path)])


def test_trust_remote_code_runs_no_modeling_code(qwen3_dir, tmp_path):
    """--trust-remote-code lets a checkpoint's tokenizer code run (test_kimi_k2.py), never its modeling code."""
    args = parse_args(build_parser(), ["serve", "--trust-remote-code"])
    assert args.trust_remote_code and EngineConfig.from_cli_args(args).trust_remote_code
    model = tmp_path / "custom"
    shutil.copytree(qwen3_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["CustomForCausalLM"], auto_map={"AutoModelForCausalLM": "modeling.Custom"})
    (model / "config.json").write_text(json.dumps(config))
    for trust in (False, True):
        with pytest.raises(UnsupportedModelError, match="ships its own modeling code"):
            LLM(str(model), trust_remote_code=trust, **ENGINE)


def test_log_flags():
    from atlas.server.cli import settings_from_args

    def parsed(*flags):
        return parse_args(build_parser(), ["serve", *flags])

    assert not settings_from_args(parsed()).log_requests  # (off by default, as in vLLM)
    assert settings_from_args(parsed("--enable-log-requests")).log_requests
    assert not settings_from_args(parsed("--enable-log-requests", "--disable-log-requests")).log_requests
    args = parsed("--disable-log-stats", "--uvicorn-log-level", "warning")
    assert args.disable_log_stats and args.uvicorn_log_level == "warning"


def test_enable_log_requests_logs_each_request(qwen3_dir, caplog):
    """A line per request; its priority reaches the engine over HTTP under --scheduling-policy priority (the order
    it makes: test_priority_scheduling)."""
    server = start_server(str(qwen3_dir), settings={"log_requests": True}, scheduling_policy="priority", **ENGINE)
    try:
        with caplog.at_level(logging.INFO, logger="atlas.server.frontend"):
            resp = httpx.post(server.url + "/v1/completions", timeout=30, json={
                "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.5, "cache_salt": "s", "priority": -2})
            assert resp.status_code == 200
    finally:
        server.stop()
    lines = [r.getMessage() for r in caplog.records if "prompt tokens" in r.getMessage()]
    assert len(lines) == 1 and "3 prompt tokens" in lines[0] and "temperature=0.5" in lines[0], lines
    assert "priority=-2" in lines[0], lines
    assert "cache_salt set" in lines[0] and "'s'" not in lines[0], lines  # (that there is one, not its value)


def test_enable_log_outputs_logs_each_finished_sequence(qwen3_dir, caplog):
    """--enable-log-outputs: a line per finished sequence with its text cut at --max-log-len (whole and streamed)."""
    args = parse_args(build_parser(), ["serve", "--enable-log-outputs", "--max-log-len", "4"])
    from atlas.server.cli import settings_from_args

    assert (settings_from_args(args).log_outputs, settings_from_args(args).max_log_len) == (True, 4)
    server = start_server(str(qwen3_dir), settings={"log_outputs": True, "max_log_len": 4}, **ENGINE)
    try:
        with caplog.at_level(logging.INFO, logger="atlas.server.frontend"):
            body = {"prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True, "n": 2, "temperature": 0}
            whole = httpx.post(server.url + "/v1/completions", timeout=30, json=body).json()
            httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True, "stream": True})
    finally:
        server.stop()
    lines = [r.getMessage() for r in caplog.records if " output " in r.getMessage()]
    assert len(lines) == 3, lines
    text = whole["choices"][0]["text"]
    want = repr(text if len(text) <= 4 else text[:4] + "...")
    assert lines[0].endswith(f"output 0: finished (length), 6 tokens: {want}") or \
        lines[1].endswith(f"output 0: finished (length), 6 tokens: {want}"), lines
    assert lines[2].startswith("request chatcmpl-") and "finished (length), 6 tokens" in lines[2], lines


def test_stats_line_while_requests_run(qwen3_dir, caplog):
    from atlas.engine.engine_process import StatsLog

    llm = LLM(str(qwen3_dir), **ENGINE)
    stats = StatsLog(llm.engine)
    llm.generate([[5, 6, 7]])
    stats.last = time.monotonic() - 11
    with caplog.at_level(logging.INFO, logger="atlas.engine.engine_process"):
        stats.maybe_log()
    line = caplog.records[-1].getMessage()
    assert line.startswith("engine: ") and "generation tok/s" in line and "KV cache 0.0 %" in line, line


def test_metrics_under_vllms_names(qwen3_dir):
    """vLLM's dashboards read Atlas: its metric names, with the per-request histograms."""
    from prometheus_client.parser import text_string_to_metric_families

    server = start_server(str(qwen3_dir), **ENGINE)
    try:
        for _ in range(2):
            assert httpx.post(server.url + "/v1/completions", timeout=30, json={
                "prompt": [5, 6, 7, 8], "max_tokens": 3, "ignore_eos": True}).status_code == 200
        text = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}

    def value(name: str, **labels) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("vllm:generation_tokens_total") == 6
    assert value("vllm:prompt_tokens_total") + value("vllm:prefix_cache_hits_total") == 8
    assert value("vllm:request_success_total", finished_reason="length") == 2
    assert value("vllm:num_requests_running") == 0 and value("vllm:kv_cache_usage_perc") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_time_per_output_token_seconds"):
        assert value(f"vllm:{name}_count") == 2, name
    assert value("vllm:request_generation_tokens_sum") == 6 and value("vllm:request_prompt_tokens_sum") == 8
    assert value("vllm:request_max_num_generation_tokens_sum") == 6
    # The front end's hand-over is part of the queue time (both from the arrival it stamps).
    assert value("atlas_request_handover_seconds_count") == 2
    assert 0 < value("atlas_request_handover_seconds_sum") <= value("vllm:request_queue_time_seconds_sum")
    # Per-step histograms: the gaps between each request's outputs (2 each) and the tokens of each step.
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert value(f"vllm:{name}_count") == 4 and value(f"vllm:{name}_bucket", le="+Inf") == 4, name
        assert 0 < value(f"vllm:{name}_sum") < value("vllm:e2e_request_latency_seconds_sum"), name
    assert value("vllm:iteration_tokens_total_sum") == 8 + 4  # (prompts, then 2 decode tokens each)


def test_help_and_flag_errors_do_not_import_torch():
    """`atlas --help`, a sub-command's help and a mistyped flag answer without importing torch (seconds on a busy
    machine)."""
    import subprocess
    import sys

    code = ("import sys\nfrom atlas.cli import main\nfor argv in (['--help'], ['serve', '--help'], ['bench', 'serve', "
            "'--help'], ['serve', '--no-such-flag'], ['--version']):\n    try:\n        main(argv)\n"
            "    except SystemExit:\n        pass\nprint('TORCH', 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "TORCH False" in proc.stdout, proc.stdout[-500:] + proc.stderr[-2000:]


def test_cache_salt_isolates_prefix_cache(qwen3_dir):
    """cache_salt (vLLM's): requests share cached prompt pages only with the same salt; outputs are unchanged."""
    from atlas import SamplingParams

    llm = LLM(str(qwen3_dir), **ENGINE)
    prompt = list(range(10, 60))  # (three full pages of 16)

    def run(salt):
        out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, cache_salt=salt))[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    first = run("tenant-a")
    assert first[0] == 0
    assert run("tenant-b")[0] == 0  # another tenant: no hit
    assert run(None)[0] == 0  # no salt: no hit on salted pages
    again = run("tenant-a")
    assert again[0] == 48 and again[1] == first[1]
    assert run(None)[0] == 48  # unsalted requests share with each other


def test_cache_salt_over_http(qwen3_dir):
    from prometheus_client.parser import text_string_to_metric_families

    server = start_server(str(qwen3_dir), **ENGINE)

    def hits() -> float:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == "vllm:prefix_cache_hits_total")

    try:
        body = {"prompt": list(range(10, 60)), "max_tokens": 2, "temperature": 0}
        for salt, new_hits in (("a", 0), ("b", 0), ("a", 48)):
            before = hits()
            assert httpx.post(server.url + "/v1/completions", json={**body, "cache_salt": salt},
                              timeout=30).status_code == 200
            assert hits() - before == new_hits, salt
    finally:
        server.stop()


def test_client_errors_are_logged_with_their_reason(qwen3_dir, caplog):
    server = start_server(str(qwen3_dir), **ENGINE)
    try:
        with caplog.at_level(logging.INFO, logger="atlas.server.app"):
            resp = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=30)
    finally:
        server.stop()
    assert resp.status_code == 400
    lines = [r.getMessage() for r in caplog.records if "-> 400" in r.getMessage()]
    assert lines and lines[0].startswith("POST /v1/completions -> 400: max_tokens"), lines


def test_return_token_ids(qwen3_dir):
    """vLLM's return_token_ids: prompt_token_ids and each choice's token_ids (streams: the prompt's with the first
    chunk, then each chunk's own), absent when not asked for."""
    import openai

    server = start_server(str(qwen3_dir), served_model_names=["m"], **ENGINE)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        ids = {"return_token_ids": True, "ignore_eos": True}
        plain = client.completions.create(model="m", prompt="def f(x):", max_tokens=8, temperature=0, extra_body=ids)
        prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": "def f(x):"}, timeout=30).json()["tokens"]
        choice = plain.choices[0].model_dump()
        assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 8
        chunks = list(client.completions.create(model="m", prompt="def f(x):", max_tokens=8, temperature=0,
                                                stream=True, extra_body=ids))
        dumped = [c.choices[0].model_dump() for c in chunks if c.choices]
        assert dumped[0]["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in d for d in dumped[1:])
        assert sum((d["token_ids"] for d in dumped), []) == choice["token_ids"]
        bare = client.completions.create(model="m", prompt="def f(x):", max_tokens=2).choices[0].model_dump()
        assert "token_ids" not in bare and "prompt_token_ids" not in bare

        messages = [{"role": "user", "content": "hi"}]
        chat = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0,
                                              extra_body=ids).model_dump()
        chat_prompt = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
        assert chat["prompt_token_ids"] == chat_prompt and len(chat["choices"][0]["token_ids"]) == 6
        stream = [c.model_dump() for c in client.chat.completions.create(
            model="m", messages=messages, max_tokens=6, temperature=0, stream=True, extra_body=ids)]
        assert stream[0]["prompt_token_ids"] == chat_prompt
        assert all("prompt_token_ids" not in c for c in stream[1:])
        assert sum((c["choices"][0].get("token_ids") or [] for c in stream if c["choices"]), []) == \
            chat["choices"][0]["token_ids"]
    finally:
        server.stop()


def test_prompt_logprobs_over_http(qwen3_dir):
    """vLLM's prompt_logprobs: each prompt token's logprob and the top k, equal to what echo + logprobs scores; not
    in streams (a 400)."""
    server = start_server(str(qwen3_dir), **ENGINE)
    try:
        http = httpx.Client(base_url=server.url, timeout=30)
        prompt = [5, 17, 40, 41, 99]
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        got = http.post("/v1/completions", json={**body, "prompt_logprobs": 2}).json()["choices"][0]["prompt_logprobs"]
        assert len(got) == len(prompt) and got[0] is None
        echo = http.post("/v1/completions", json={**body, "echo": True, "logprobs": 2}).json()["choices"][0]["logprobs"]
        for position in range(1, len(prompt)):
            entry = got[position]
            assert str(prompt[position]) in entry and 2 <= len(entry) <= 3
            assert entry[str(prompt[position])]["logprob"] == pytest.approx(echo["token_logprobs"][position], abs=1e-5)
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 1, "prompt_logprobs": 0}).json()
        ids = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        assert len(chat["prompt_logprobs"]) == len(ids) and chat["prompt_logprobs"][0] is None
        resp = http.post("/v1/completions", json={**body, "prompt_logprobs": 1, "stream": True})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"
    finally:
        server.stop()


def test_priority_scheduling(qwen3_dir):
    """--scheduling-policy priority (vLLM's): with one sequence slot, a request of a lower priority value takes the
    running one's slot at once, and the rest run in (priority, arrival) order; outputs stay exact. Without the
    policy a non-zero priority is refused."""
    from atlas import SamplingParams
    from atlas.errors import InvalidRequestError

    llm = LLM(str(qwen3_dir), scheduling_policy="priority", max_num_seqs=1, **ENGINE)
    core = llm.engine
    prompts = {"a": [5, 6, 7], "b": [8, 9, 10], "c": [11, 12, 13], "d": [14, 15, 16]}
    params = {"a": 0, "b": 5, "c": -1, "d": 5}
    core.add_request(prompts["a"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), "a")
    core.step()
    core.step()  # (a is running)
    for rid in ("b", "c", "d"):
        core.add_request(prompts[rid], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                      priority=params[rid]), rid)
    order, outputs = [], {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                order.append(out.request_id)
                outputs[out.request_id] = out.outputs[0].token_ids
    assert order == ["c", "a", "b", "d"]
    assert core.scheduler.num_preemptions == 1  # (a gave c its slot, and was recomputed)
    fcfs = LLM(str(qwen3_dir), **ENGINE)
    for rid, prompt in prompts.items():
        ref = fcfs.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        assert outputs[rid] == ref.outputs[0].token_ids, rid
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority"):
        fcfs.generate([[5, 6]], SamplingParams(priority=1))


def test_priority_preemption_when_pages_run_out_takes_a_request_not_yet_scheduled_in_the_step(qwen3_dir):
    """Pages run out while decoding under the priority policy. The request that gives way is the last in priority
    order; it joined the batch first, so the running order has to be priority order too: walking the batch in
    arrival order had scheduled it ahead of the others and then preempted it in the same step, which sent the
    runner a request it had just taken back (a KeyError). Outputs equal first come, first served, pages all back."""
    from conftest import assert_pages_returned

    from atlas import SamplingParams

    llm = LLM(str(qwen3_dir), scheduling_policy="priority", block_size=8, num_gpu_blocks_override=16,
              max_model_len=128)
    core = llm.engine
    prompts = {"low": list(range(40, 70)), "x": list(range(100, 110)), "y": list(range(200, 210))}
    def params(priority: int) -> SamplingParams:
        return SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, priority=priority)
    core.add_request(prompts["low"], params(1), "low")
    core.step()
    core.step()  # (low is running, first in the batch)
    for rid in ("x", "y"):
        core.add_request(prompts[rid], params(0), rid)
    outputs = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert core.scheduler.num_preemptions >= 1
    assert list(outputs)[-1] == "low"  # (it gave way, and was recomputed after the others)
    fcfs = LLM(str(qwen3_dir), **ENGINE)
    for rid, prompt in prompts.items():
        ref = fcfs.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
        assert outputs[rid] == ref.outputs[0].token_ids, rid
    assert_pages_returned(llm)


def test_prompt_tokens_details_report_the_prefix_cache_hits(qwen3_dir):
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens is what the prefix cache gave (whole
    16-token pages of the same prompt the second time), in completions, chat (streamed too) and the Responses API's
    input_tokens_details (there always)."""
    import openai

    prompt = [int(t) % 300 + 5 for t in range(60)]
    server = start_server(str(qwen3_dir), settings={"enable_prompt_tokens_details": True,
                                                    "return_tokens_as_token_ids": True}, **ENGINE)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        first, second = (client.completions.create(model=str(qwen3_dir), prompt=prompt,
                                                   max_tokens=2) for _ in range(2))
        assert first.usage.prompt_tokens == second.usage.prompt_tokens == 60
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens == 48  # (3 full pages; the last token is computed)
        messages = [{"role": "user", "content": "a fairly long question about the prefix cache, asked twice " * 2}]
        chats = [client.chat.completions.create(model=str(qwen3_dir), messages=messages, max_tokens=2) for _ in range(2)]
        total = chats[0].usage.prompt_tokens
        assert chats[0].usage.prompt_tokens_details.cached_tokens == 0
        assert chats[1].usage.prompt_tokens_details.cached_tokens == (total - 1) // 16 * 16 > 0
        stream = client.chat.completions.create(model=str(qwen3_dir), messages=messages, max_tokens=2, stream=True,
                                                stream_options={"include_usage": True})
        last = list(stream)[-1]
        assert last.usage.prompt_tokens_details.cached_tokens == (total - 1) // 16 * 16
        reply = client.responses.create(model=str(qwen3_dir), input=messages[0]["content"], max_output_tokens=2)
        assert reply.usage.input_tokens_details.cached_tokens == (reply.usage.input_tokens - 1) // 16 * 16 > 0
        # --return-tokens-as-token-ids: logprob tokens by id, unless the request says false
        by_id, by_text = (client.completions.create(model=str(qwen3_dir), prompt=prompt, max_tokens=2, logprobs=1,
                                                    extra_body=extra)
                          for extra in ({}, {"return_tokens_as_token_ids": False}))
        assert all(t.startswith("token_id:") for t in by_id.choices[0].logprobs.tokens)
        assert not any(t.startswith("token_id:") for t in by_text.choices[0].logprobs.tokens)
    finally:
        server.stop()
    server = start_server(str(qwen3_dir), **ENGINE)
    try:  # without the flag: no details in chat and completions, still the count in the Responses API
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        for _ in range(2):
            got = client.completions.create(model=str(qwen3_dir), prompt=prompt, max_tokens=2)
            reply = client.responses.create(model=str(qwen3_dir), input="the same words again and again " * 4,
                                            max_output_tokens=2)
        assert got.usage.prompt_tokens_details is None
        assert reply.usage.input_tokens_details.cached_tokens == (reply.usage.input_tokens - 1) // 16 * 16 > 0
    finally:
        server.stop()


def test_usage_role_and_docs_flags(qwen3_dir):
    """--enable-force-include-usage (a usage chunk ends every stream), --response-role, --disable-fastapi-docs,
    --enable-server-load-tracking."""
    from atlas.server.cli import settings_from_args

    args = parse_args(build_parser(), ["serve", "--enable-force-include-usage", "--response-role", "bot",
                                       "--disable-fastapi-docs", "--chat-template-content-format", "openai"])
    settings = settings_from_args(args)
    assert (settings.force_include_usage, settings.response_role, settings.docs,
            settings.chat_template_content_format) == (True, "bot", False, "openai")
    assert parse_args(build_parser(), ["serve"]).response_role == "assistant"
    server = start_server(str(qwen3_dir), settings={"force_include_usage": True, "response_role": "bot",
                                                    "docs": False, "server_load_tracking": True}, **ENGINE)
    try:
        body = {"model": str(qwen3_dir), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "ignore_eos": True}
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).json()
        assert reply["choices"][0]["message"]["role"] == "bot"
        events = [line[6:] for line in httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True},
                                                  timeout=30).text.splitlines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        assert chunks[0]["choices"][0]["delta"]["role"] == "bot"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        assert all(c["usage"] is None for c in chunks[:-1])
        text = httpx.post(server.url + "/v1/completions", timeout=30, json={
            "prompt": "hi", "max_tokens": 2, "ignore_eos": True, "stream": True}).text
        assert '"usage":{"prompt_tokens"' in text.split("data: [DONE]")[0].rsplit("data: ", 1)[1].replace(" ", "")
        for path in ("/docs", "/openapi.json"):
            assert httpx.get(server.url + path, timeout=30).status_code == 404, path
        # --enable-server-load-tracking: GET /load counts the requests being answered (here one whose body is still
        # on its way), this one aside
        assert httpx.get(server.url + "/load", timeout=30).json() == {"server_load": 0}
        import socket
        from urllib.parse import urlsplit

        address = urlsplit(server.url)
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % (address.netloc.encode(), len(body)) + body[:5])
            for _ in range(100):  # (until the server has read the head)
                if httpx.get(server.url + "/load", timeout=30).json() == {"server_load": 1}:
                    break
                time.sleep(0.02)
            assert httpx.get(server.url + "/load", timeout=30).json() == {"server_load": 1}
            sock.sendall(body[5:])
            assert sock.recv(12) == b"HTTP/1.1 200"
        for _ in range(100):
            if httpx.get(server.url + "/load", timeout=30).json() == {"server_load": 0}:
                break
            time.sleep(0.02)
        assert httpx.get(server.url + "/load", timeout=30).json() == {"server_load": 0}
    finally:
        server.stop()
    server = start_server(str(qwen3_dir), **ENGINE)
    try:  # (without the flag there is no /load, rather than a load of 0 that is never counted)
        assert httpx.get(server.url + "/load", timeout=30).status_code == 404
        assert httpx.get(server.url + "/docs", timeout=30).status_code == 200
    finally:
        server.stop()


def test_max_logprobs_sets_the_limit(qwen3_dir):
    """--max-logprobs (vLLM's): requests may ask for that many logprobs per token and no more (a 400 naming the flag),
    /openapi.json states it, a beam search's width is at most half of it; -1 allows the whole vocabulary."""
    from atlas.errors import InvalidRequestError
    from atlas.sampling_params import BeamSearchParams, SamplingParams

    assert parse_args(build_parser(), ["serve", "--max-logprobs", "-1"]).max_logprobs == -1
    with pytest.raises(Exception, match="--max-logprobs must be an integer >= 0"):
        LLM(str(qwen3_dir), max_logprobs=-2, **ENGINE)
    server = start_server(str(qwen3_dir), max_logprobs=30, **ENGINE)
    try:
        http = httpx.Client(base_url=server.url, timeout=30)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}
        reply = http.post("/v1/chat/completions", json={**chat, "top_logprobs": 30}).json()
        assert [len(e["top_logprobs"]) for e in reply["choices"][0]["logprobs"]["content"]] == [30, 30]
        for body, path, param in (({**chat, "top_logprobs": 31}, "/v1/chat/completions", "top_logprobs"),
                                  ({**chat, "prompt_logprobs": 31}, "/v1/chat/completions", "prompt_logprobs"),
                                  ({"prompt": "hi", "logprobs": 31}, "/v1/completions", "logprobs"),
                                  ({"prompt": "hi", "prompt_logprobs": 31}, "/v1/completions", "prompt_logprobs")):
            err = assert_error(http.post(path, json=body), 400, param)
            assert "at most 30" in err["message"] and "--max-logprobs" in err["message"], err
        completion = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": 30,
                                                         "echo": True}).json()["choices"][0]["logprobs"]
        assert all(len(top) >= 30 for top in completion["top_logprobs"][1:])
        components = http.get("/openapi.json").json()["components"]["schemas"]
        assert components["ChatCompletionRequest"]["properties"]["top_logprobs"]["maximum"] == 30
        assert components["CompletionRequest"]["properties"]["logprobs"]["maximum"] == 30
        beams = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 10, "use_beam_search": True})
        assert beams.status_code == 200 and len(beams.json()["choices"]) == 10
    finally:
        server.stop()
    llm = LLM(str(qwen3_dir), max_logprobs=-1, **ENGINE)  # (the default's 20 and a beam search over half of it)
    try:
        vocab = llm.engine.model_config.vocab_size
        out = llm.generate(["hi"], SamplingParams(max_tokens=1, logprobs=vocab, temperature=0))[0].outputs[0]
        assert len(out.logprobs[0]) == vocab
        with pytest.raises(InvalidRequestError, match="at most"):
            llm.generate(["hi"], SamplingParams(max_tokens=1, logprobs=vocab + 1))
    finally:
        llm.shutdown()
    llm = LLM(str(qwen3_dir), max_logprobs=4, **ENGINE)
    try:
        with pytest.raises(InvalidRequestError, match="at most 4 on this engine"):
            llm.generate(["hi"], SamplingParams(max_tokens=1, logprobs=5))
        with pytest.raises(InvalidRequestError, match="width 3 scores 6 tokens"):
            llm.beam_search(["hi"], BeamSearchParams(beam_width=3, max_tokens=2))
        assert len(llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=2))[0].sequences) == 2
    finally:
        llm.shutdown()


def test_root_path_serves_behind_a_prefix_routing_proxy(qwen3_dir):
    """--root-path (vLLM's): requests reach the routes with the prefix (a proxy that passes it on) and without it (one
    that strips it), the API key still guards them, and /docs and /openapi.json name the prefixed URLs."""
    from atlas.server.cli import settings_from_args

    assert settings_from_args(parse_args(build_parser(), ["serve", "--root-path", "api/atlas/"])).root_path == \
        "/api/atlas"
    with pytest.raises(Exception, match="a path prefix"):
        settings_from_args(parse_args(build_parser(), ["serve", "--root-path", "/"]))
    server = start_server(str(qwen3_dir), api_key="k", settings={"root_path": "/api/atlas"}, **ENGINE)
    try:
        http = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": "Bearer k"})
        for prefix in ("/api/atlas", ""):
            reply = http.post(prefix + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2, reply.text
            assert httpx.get(server.url + prefix + "/health", timeout=30).status_code == 200
            assert httpx.get(server.url + prefix + "/v1/models", timeout=30).status_code == 401
        assert http.get("/api/atlas/openapi.json").json()["servers"] == [{"url": "/api/atlas"}]
        assert '"url": "/api/atlas/openapi.json"' in http.get("/api/atlas/docs").text
        assert http.get("/api/other/v1/models").status_code == 404
    finally:
        server.stop()


def test_structured_outputs_config_is_translated(capsys):
    """vLLM's --structured-outputs-config: its backend (vLLM's "guidance" is llguidance) and reasoning parser become
    Atlas's flags; a backend or setting Atlas lacks is refused by name, never dropped."""
    args = parse_args(build_parser(), ["serve", "--structured-outputs-config", '{"backend": "guidance"}'])
    assert args.structured_outputs_backend == "llguidance"
    args = parse_args(build_parser(), ["serve", "--structured-outputs-config",
                                       '{"backend": "xgrammar", "reasoning_parser": "qwen3"}'])
    assert (args.structured_outputs_backend, args.reasoning_parser) == ("xgrammar", "qwen3")
    assert parse_args(build_parser(), ["serve"]).structured_outputs_backend == "auto"
    assert "backend 'outlines' is not one Atlas implements" in _error(
        capsys, ["serve", "--structured-outputs-config", '{"backend": "outlines"}'])
    assert "'disable_any_whitespace' is not a setting Atlas implements" in _error(
        capsys, ["serve", "--structured-outputs-config", '{"backend": "auto", "disable_any_whitespace": true}'])
    assert "reasoning_parser 'nope' is not one Atlas has" in _error(
        capsys, ["serve", "--structured-outputs-config", '{"reasoning_parser": "nope"}'])
    assert "JSON" in _error(capsys, ["serve", "--structured-outputs-config", "backend=xgrammar"])


def test_vllm_optimization_levels(capsys):
    """vLLM's -O0 (no CUDA graphs) is --enforce-eager; -O1..3 keep Atlas's default graphs; dotted compiler settings and
    other levels are refused."""
    assert parse_args(build_parser(), ["serve", "-O0"]).enforce_eager
    assert parse_args(build_parser(), ["serve", "--optimization-level", "0"]).enforce_eager
    for flags in (["-O3"], ["-O", "1"], ["--optimization-level", "2"], []):
        assert not parse_args(build_parser(), ["serve", *flags]).enforce_eager, flags
    assert parse_args(build_parser(), ["serve", "-O2", "--enforce-eager"]).enforce_eager
    assert "Atlas takes vLLM's optimization levels 0-3" in _error(capsys, ["serve", "-O.mode=NONE"])
    assert "Atlas takes vLLM's optimization levels 0-3" in _error(capsys, ["serve", "-O4"])
    assert "--compilation-config is a vLLM flag that Atlas does not implement" in _error(
        capsys, ["serve", "--compilation-config", "{}"])


def test_a_vllm_script_s_llm_keywords_mean_the_same(qwen3_dir):
    """LLM(...) with vLLM's speculative_config, structured_outputs_config, optimization_level and disable_log_stats:
    the engine is configured as the same Atlas keywords would configure it, and serves (n-gram speculation greedy
    equal to plain decoding); what Atlas lacks is refused by name."""
    prompt = {"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}
    params = SamplingParams(max_tokens=12, temperature=0)
    plain = LLM(str(qwen3_dir), **ENGINE).generate([prompt], params)[0].outputs[0].token_ids
    llm = LLM(str(qwen3_dir), **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                            "prompt_lookup_max": 3},
              structured_outputs_config='{"backend": "guidance"}', optimization_level=0, disable_log_stats=True)
    c = llm.config
    assert (c.speculative, c.num_draft_tokens, c.ngram_max, c.structured_outputs_backend, c.enforce_eager) == (
        "ngram", 3, 3, "llguidance", True)
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == plain
    assert not engine_kwargs({"optimization_level": 2}) and engine_kwargs({"optimization_level": "0"}) == {
        "enforce_eager": True}
    for kwargs, message in [
            ({"speculative_config": {"method": "eagle", "model": "x"}}, "method 'eagle' (EAGLE-1/2 drafters)"),
            ({"speculative_config": {"method": "ngram"}, "speculative": "dflash"}, "speculative='dflash' and the vLLM"),
            ({"structured_outputs_config": {"reasoning_parser": "qwen3"}}, "the reasoning parser is the server's"),
            ({"structured_outputs_config": {"backend": "outlines"}}, "backend 'outlines' is not one Atlas implements"),
            ({"optimization_level": 0, "enforce_eager": False}, "enforce_eager=False and the vLLM setting"),
            ({"optimization_level": 5}, "optimization levels 0-3"),
            ({"disable_log_stats": False}, "the offline LLM logs no periodic stats"),
            ({"compilation_config": {"level": 3}}, "compilation_config is a vLLM setting that Atlas does not"),
            ({"speculative_config": "method=ngram"}, "speculative_config: not JSON")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            engine_kwargs(kwargs)


def test_reset_prefix_cache_makes_the_next_prompt_compute_whole(qwen3_dir):
    """LLM.reset_prefix_cache() (vLLM's): a repeated prompt hits the cache, after the reset it is computed whole,
    with the same greedy output."""
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(max_tokens=6, temperature=0)
    llm = LLM(str(qwen3_dir), **ENGINE, block_size=8)
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert llm.reset_prefix_cache()
    cold = llm.generate([prompt], params)[0]
    assert cold.num_cached_tokens == 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == cold.outputs[0].token_ids
