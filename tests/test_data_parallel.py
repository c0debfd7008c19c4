"""`atlas serve --data-parallel-size N` (vLLM's -dp): N engine processes, each a whole model, behind every front end;
requests routed by load, outputs those of one engine, metrics per replica, and a replica's death ends the server."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families
from serving import Serve, wait_until
from test_lora import GEN, PROMPTS, lora_setup, reference  # noqa: F401 - (lora_setup: the fixture)

from atlas import LLM, SamplingParams
from atlas.config import EngineConfig
from atlas.engine.data_parallel import check_data_parallel, merge_metrics, replica_gpus
from atlas.errors import ConfigError


def test_each_replica_takes_its_own_gpus():
    visible = ["3", "5", "6", "7"]
    assert [replica_gpus(r, 2, 2, visible) for r in range(2)] == [["3", "5"], ["6", "7"]]
    assert [replica_gpus(r, 4, 1, visible) for r in range(4)] == [["3"], ["5"], ["6"], ["7"]]
    with pytest.raises(ConfigError, match="need 6 GPUs; 4 are visible"):
        replica_gpus(0, 3, 2, visible)


def test_what_data_parallelism_refuses():
    with pytest.raises(ConfigError, match="positive integer"):
        check_data_parallel(EngineConfig(), 0)
    for kwargs, words in ((dict(tensor_parallel_size=2, enable_expert_parallel=True), "each replica holds every expert"),
                          (dict(master_port=29500), "leave --master-port out"),
                          (dict(tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="10.0.0.1",
                                master_port=29500), "one node")):
        with pytest.raises(ConfigError, match=words):
            check_data_parallel(EngineConfig(device="cpu", **kwargs), 2)
    check_data_parallel(EngineConfig(device="cpu"), 2)


def test_metrics_of_the_replicas_merge_into_one_family_each():
    def text(engine: str, value: int) -> bytes:
        return (f'# HELP atlas_requests_running Sequences running.\n# TYPE atlas_requests_running gauge\n'
                f'atlas_requests_running{{model_name="m",engine="{engine}"}} {value}.0\n'
                f'# HELP vllm:e2e Latency.\n# TYPE vllm:e2e histogram\n'
                f'vllm:e2e_bucket{{engine="{engine}",le="+Inf",model_name="m"}} {value}.0\n'
                f'vllm:e2e_count{{engine="{engine}",model_name="m"}} {value}.0\n'
                f'vllm:e2e_sum{{engine="{engine}",model_name="m"}} 0.5\n').encode()

    merged = merge_metrics([text("0", 2), text("1", 3)]).decode()
    assert merged.count("# TYPE atlas_requests_running gauge") == 1 and merged.count("# HELP vllm:e2e ") == 1
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    assert {s.labels["engine"]: s.value for s in families["atlas_requests_running"].samples} == {"0": 2, "1": 3}
    assert sum(s.value for s in families["vllm:e2e"].samples if s.name == "vllm:e2e_count") == 5


def test_two_replicas_serve_greedy_outputs_equal_one_engine(qwen3_dir):
    """-dp 2 on the CPU: concurrent streams spread over both replicas (each does some of them, as /metrics says per
    `engine`), every one equal to the offline engine's greedy tokens; both replicas' pages come back; a multi-prompt
    request is answered whole; killing one replica ends the server with status 1."""
    prompts = [[5 + i, 6, 7, 8 + i, 9] for i in range(8)]  # (not test_lora's PROMPTS)
    expected = LLM(str(qwen3_dir), kv_cache_memory="4MiB", max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    server = Serve(str(qwen3_dir), "--api-server-count", "1", "--data-parallel-size", "2")
    try:
        assert len(server.engine_pids) == 2 and len(set(server.engine_pids)) == 2

        async def one(client: AsyncOpenAI, prompt: list[int]) -> str:
            stream = await client.completions.create(model=str(qwen3_dir), prompt=prompt, max_tokens=12,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        async def main():
            client = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            try:
                return await asyncio.gather(*(one(client, p) for p in prompts))
            finally:
                await client.close()

        texts = asyncio.run(main())
        assert texts == [ref.outputs[0].text for ref in expected]
        whole = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": prompts[:3], "max_tokens": 12, "temperature": 0, "ignore_eos": True}).json()
        assert [c["text"] for c in sorted(whole["choices"], key=lambda c: c["index"])] == texts[:3]

        def by_engine(name: str) -> dict[str, float]:
            text = httpx.get(server.url + "/metrics", timeout=10).text
            out: dict[str, float] = {}
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name == name:
                        out[s.labels["engine"]] = out.get(s.labels["engine"], 0.0) + s.value
            return out

        done = by_engine("atlas_request_success_total")
        assert set(done) == {"0", "1"} and sum(done.values()) == len(prompts) + 3 and min(done.values()) > 0, done
        assert wait_until(lambda: by_engine("atlas_kv_cache_pages_free") == by_engine("atlas_kv_cache_pages_total"),
                          timeout=10)
        os.kill(server.engine_pids[1], signal.SIGKILL)
        assert server.wait(30) == 1, server.log
        assert "atlas-engine-1 exited" in server.log, server.log
    finally:
        server.close()


def test_adapters_load_into_every_replica_behind_two_front_ends(lora_setup):  # noqa: F811
    """-dp 2 with 2 front ends and runtime LoRA: an adapter loaded over HTTP serves PEFT's greedy tokens from both
    replicas (concurrent requests spread over them), a load one replica refuses leaves none loaded, and an unloaded
    adapter is gone from both."""
    base, root, refs = lora_setup
    server = Serve(str(base), "--api-server-count", "2", "--data-parallel-size", "2", "--enable-lora",
                   "--max-lora-rank", "8", "--allow-runtime-lora-updating")
    try:
        http = httpx.Client(base_url=server.url, timeout=60)
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(root / "mlp")}
                         ).status_code == 200
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "none")})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        want = [reference(refs["mlp"], p)[0] for p in PROMPTS]

        async def one(prompt: list[int]) -> list[int]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:  # (a connection each)
                reply = await client.post("/v1/completions", json={
                    "model": "mlp", "prompt": prompt, "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True})
                return reply.json()["choices"][0]["token_ids"]

        async def main():
            return await asyncio.gather(*(one(p) for p in PROMPTS * 2))

        assert asyncio.run(main()) == want * 2
        served = {}
        for family in text_string_to_metric_families(http.get("/metrics").text):
            for s in family.samples:
                if s.name == "atlas_request_success_total":
                    served[s.labels["engine"]] = served.get(s.labels["engine"], 0.0) + s.value
        assert set(served) == {"0", "1"} and min(served.values()) > 0, served  # (both replicas ran the adapter)
        models = {m["id"] for m in http.get("/v1/models").json()["data"]}
        assert "mlp" in models and "x" not in models
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
        for _ in range(4):  # (either replica, either front end)
            gone = http.post("/v1/completions", json={"model": "mlp", "prompt": PROMPTS[0], "max_tokens": 2})
            assert gone.status_code == 404, gone.text
    finally:
        server.close()


def test_the_waiting_cap_is_shared_by_the_replicas():
    """--max-waiting-requests (default 8 x --max-num-seqs) counts over every replica: each engine gets its share."""
    from atlas.engine.data_parallel import DataParallelClient
    from atlas.engine.engine_client import EngineClient
    from atlas.engine.info import EngineInfo

    infos = [EngineInfo(model=None, tokenizer_path=None, max_model_len=64, max_num_seqs=4, vocab_size=10,
                        compile_timeout=1.0, pid=pid) for pid in (1, 2, 3)]
    client = DataParallelClient([EngineClient(info, f"ipc:///tmp/none-{i}") for i, info in enumerate(infos)])
    assert client.info.max_num_seqs == 12
    client.max_waiting = 8 * client.info.max_num_seqs
    assert [c.max_waiting for c in client.clients] == [32, 32, 32] and client.max_waiting == 96
    client.max_waiting = 10
    assert [c.max_waiting for c in client.clients] == [4, 4, 4]
