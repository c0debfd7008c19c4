"""`atlas run-batch` (vLLM's run-batch) through the real command: an OpenAI batch file's chat and completion requests
answered as the server answers them (the same greedy text as the offline engine), in the input's order, and the
lines that are not requests, or that the server refuses, answered with their error while the others go on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from atlas import LLM, SamplingParams

ENGINE = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256"]
PROMPTS = ["def wrap(text", "import os", "class Text", "return the", "for line in", "while True"]


def test_a_batch_file_is_answered_in_order_as_the_server_answers(qwen3_dir, tmp_path):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": str(qwen3_dir), "prompt": p, "max_tokens": 6, "temperature": 0}}
             for i, p in enumerate(PROMPTS)]
    lines.insert(2, {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}})
    rows = [json.dumps(line) for line in lines]
    rows += ["{not json", json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/models", "body": {}}),
             json.dumps({"custom_id": "stream", "url": "/v1/completions", "body": {"prompt": "a", "stream": True}}),
             json.dumps({"custom_id": "too-long", "url": "/v1/completions", "body": {"prompt": "a", "max_tokens": 9999}})]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(rows) + "\n")
    done = subprocess.run([sys.executable, "-m", "atlas.cli", "run-batch", "-i", str(source), "-o", str(out),
                           "--model", str(qwen3_dir), *ENGINE], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    outputs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == [line["custom_id"] for line in lines] + [None, "get", "stream",
                                                                                         "too-long"]
    llm = LLM(str(qwen3_dir), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))]
    texts = [o["response"]["body"]["choices"][0]["text"] for o in outputs[:len(lines)] if o["custom_id"] != "chat"]
    assert texts == want
    chat = next(o for o in outputs if o["custom_id"] == "chat")["response"]
    assert chat["status_code"] == 200 and chat["request_id"] == chat["body"]["id"]
    reply = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=5, temperature=0))[0]
    assert chat["body"]["choices"][0]["message"]["content"] == reply.outputs[0].text
    bad_json, get, stream, too_long = outputs[len(lines):]
    assert bad_json["response"] is None and bad_json["error"]["code"] == "invalid_json"
    assert get["response"] is None and "only POST" in get["error"]["message"]
    assert stream["response"] is None and "stream" in stream["error"]["message"]
    assert too_long["error"] is None and too_long["response"]["status_code"] == 400
    assert "max_tokens" in json.dumps(too_long["response"]["body"])
