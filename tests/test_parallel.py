"""Tensor and pipeline parallelism on CPU with gloo and 2 processes, against one device.

Each multi-process test starts one parallel engine (a few seconds of process start-up) and checks
everything it can on it: prompt and sampled logprobs, greedy tokens with prefix-cache hits and
preemption under asynchronous scheduling, seeded sampling, n-gram speculative decoding (DFlash and MTP
drafts, with tensor and with pipeline parallelism, in tests of their own); then, on some,
what a failing rank does to the engine. The one-device reference runs in this process, with the same
number of KV pages so that scheduling is the same.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    ARCHS,
    assert_pages_returned,
    build_checkpoint,
    build_deepseek_checkpoint,
    run_cases_script,
    run_in_triton_interpreter,
)

from atlas import LLM, SamplingParams
from atlas.config import EngineConfig, ModelConfig
from atlas.errors import ConfigError, WorkerError
from atlas.layers.moe import FusedExperts
from atlas.layers.parallel import ModelParallel, split_evenly
from atlas.runtime.parallel_groups import check_model
from atlas.runtime.parallel_protocol import StepInfo, decode_step, encode_step
from atlas.speculative.ngram import NgramProposer

PAGES = 26  # KV pages of every engine here: few enough that the batch below is preempted
# (speculative_policy "always": every step of the n-gram part drafts, so that verification is what is compared)
ENGINE = dict(num_gpu_blocks_override=PAGES, block_size=8, max_model_len=128, skip_tokenizer_init=True,
              num_cpu_threads=1, speculative_policy="always")
PARALLEL = dict(distributed_timeout=5.0)


class _Models(dict):
    """Tiny checkpoints, each built when a test first asks for it (tests of a module may run in different
    pytest-xdist processes)."""

    BUILD = {
        "qwen3": lambda root: build_checkpoint(root, "Qwen3ForCausalLM", None),
        # One KV head for two ranks: each rank holds a replica of it.
        "llama": lambda root: build_checkpoint(root, "LlamaForCausalLM", None, num_key_value_heads=1),
        "deepseek-v3": lambda root: build_deepseek_checkpoint(root, "v3"),
        "deepseek-v2-lite": lambda root: build_deepseek_checkpoint(root, "v2-lite"),
        # A 16-token vocabulary (drafts are often right) and a DFlash drafter for it, in <target>/dflash-drafter.
        "small-dflash": lambda root: _small_dflash(root),
        # DeepSeek-V3 with its MTP module and an 8-token vocabulary (seed 4: over half its drafts accepted).
        "small-mtp": lambda root: build_deepseek_checkpoint(root, "v3", seed=4, vocab_size=8),
    }

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Path:
        self[name] = self.BUILD[name](self.root)
        return self[name]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return _Models(tmp_path_factory.mktemp("parallel"))


def _small_dflash(root: Path) -> Path:
    from test_dflash import write_drafter

    target = build_checkpoint(root, "Qwen3ForCausalLM", None, seed=1, vocab_size=16, hidden_size=32,
                              intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              num_hidden_layers=4)
    # (seed 3: a random drafter whose drafts the target accepts at times)
    write_drafter(target / "dflash-drafter", hidden=32, layer_ids=[1, 3], mask_token_id=15, block_size=4, seed=3)
    return target


def _prompts() -> list[list[int]]:
    """Six prompts, pairs of which share two pages of prefix, some with repeats for n-gram lookup."""
    g = torch.Generator().manual_seed(7)
    shared = [torch.randint(1, 384, (16,), generator=g).tolist() for _ in range(3)]
    tails = [torch.randint(1, 384, (n,), generator=g).tolist() for n in (9, 21, 4, 30, 13, 17)]
    return [shared[i // 2] + t + t[:6] for i, t in enumerate(tails)]


GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _run(llm: LLM) -> dict:
    """Everything compared between one device and a parallel engine."""
    prompts = _prompts()
    engine = llm.engine
    out: dict = {}
    scored = llm.generate([{"prompt_token_ids": prompts[3]}],
                          SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=20,
                                         logprobs=20))[0]
    out["prompt_logprobs"] = scored.prompt_logprobs[1:]
    out["logprobs"] = scored.outputs[0].logprobs
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    out["greedy"] = [o.outputs[0].token_ids for o in greedy]
    out["preemptions"] = engine.scheduler.num_preemptions
    llm.generate([{"prompt_token_ids": prompts[5]}], GREEDY)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts[4:]], GREEDY)  # prefix-cache hits
    out["again"] = [o.outputs[0].token_ids for o in again]
    out["cached"] = sum(o.num_cached_tokens for o in again)
    sampled = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]],
                           SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True))
    out["sampled"] = [o.outputs[0].token_ids for o in sampled]
    # N-gram drafts from here on: the driver proposes them (host work), every rank verifies them.
    engine.proposer = NgramProposer(4, 2, 4)
    spec = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=24, temperature=0,
                                                                                   ignore_eos=True))
    out["spec"] = [o.outputs[0].token_ids for o in spec]
    out["accepted"] = engine.stats.spec_num_accepted_tokens
    assert_pages_returned(llm)
    return out


_REFERENCES: dict[str, dict] = {}


def reference(models, name: str) -> dict:
    if name not in _REFERENCES:
        _REFERENCES[name] = _run(LLM(str(models[name]), **ENGINE))
    return _REFERENCES[name]


def _assert_logprobs_close(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert set(g) == set(w)
        for token in w:
            assert g[token].rank == w[token].rank
            assert g[token].logprob == pytest.approx(w[token].logprob, abs=1e-4)


def check_against_one_device(llm: LLM, models, name: str) -> dict:
    """Tokens and logprobs as on one device. Tensor parallelism schedules exactly as one device does, so
    its preemptions, prefix hits and accepted drafts are the same too; pipeline stages schedule
    micro-batches, so theirs only have to happen."""
    got, want = _run(llm), reference(models, name)
    _assert_logprobs_close(got["prompt_logprobs"], want["prompt_logprobs"])
    _assert_logprobs_close(got["logprobs"], want["logprobs"])
    for key in ("greedy", "again", "sampled", "spec"):
        assert got[key] == want[key], key
    counters = ("preemptions", "cached", "accepted")
    if llm.engine.config.pipeline_parallel_size == 1:
        assert [got[k] for k in counters] == [want[k] for k in counters]
    assert all(got[k] > 0 for k in counters), {k: got[k] for k in counters}
    assert llm.engine.plan.num_pages == PAGES
    return got


def _wait_for_error(llm: LLM, seconds: float) -> WorkerError:
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY)
    assert time.monotonic() - t0 < seconds
    with pytest.raises(WorkerError):  # the engine stays down
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY)
    return info.value


# ---------------------------------------------------------------------------------- tensor parallel
def test_tensor_parallel_llama_with_replicated_kv_head_then_a_hung_worker(models, tmp_path):
    llm = LLM(str(models["llama"]), tensor_parallel_size=2, **ENGINE, **PARALLEL)
    try:
        assert llm.engine.runner.share_samples  # (async scheduling: decodes read the sampled ids on device)
        # (graphs holding captured collectives are dropped before the groups are left)
        assert llm.engine.runner.release_graphs in llm.engine.parallel.before_leaving
        check_against_one_device(llm, models, "llama")
        # The worker's host time of its last steps (the benches' answer to "who holds the devices back").
        [path] = llm.engine.parallel.report_worker_host_times(str(tmp_path / "host"), 5)
        deadline = time.monotonic() + 10
        while not path.is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        report = json.loads(path.read_text())
        assert report["rank"] == 1 and report["steps"] == 5
        assert report["launch_ms"]["median"] > 0 and report["wait_for_message_ms"]["median"] >= 0
        rank, proc = llm.engine.parallel.children[0]
        os.kill(proc.pid, signal.SIGSTOP)  # alive but frozen: only the watchdog can tell
        error = _wait_for_error(llm, PARALLEL["distributed_timeout"] + 10)
        assert error.rank == rank == 1 and "rank 1 stopped responding" in str(error)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL  # (the watchdog ends a frozen worker)
    finally:
        llm.shutdown()


def test_tensor_parallel_over_an_8_bit_cache_matches_one_device(models):
    """--kv-cache-dtype fp8 at TP=2: each rank keeps its KV heads' 8-bit pages; tokens as on one device."""
    prompts = [{"prompt_token_ids": [3 + i, 40 + 7 * i, 11, 90 - i, 5] * (1 + i % 3)} for i in range(5)]
    one = LLM(str(models["qwen3"]), kv_cache_dtype="fp8", **ENGINE)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    del one
    llm = LLM(str(models["qwen3"]), kv_cache_dtype="fp8", tensor_parallel_size=2, **ENGINE, **PARALLEL)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want
        assert all(c.dtype == torch.float8_e4m3fn for c in llm.engine.runner.kv_caches)
        assert_pages_returned(llm)
    finally:
        llm.shutdown()


def test_tensor_parallel_deepseek_then_a_killed_worker(models):
    llm = LLM(str(models["deepseek-v3"]), tensor_parallel_size=2, **ENGINE, **PARALLEL)
    try:
        check_against_one_device(llm, models, "deepseek-v3")
        rank, proc = llm.engine.parallel.children[0]
        proc.kill()
        error = _wait_for_error(llm, 5)
        assert error.rank == 1 and "rank 1" in str(error) and "SIGKILL" in str(error)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite"])
def test_expert_parallel_deepseek_matches_one_device(models, name):
    """--enable-expert-parallel: each rank holds half the routed experts whole (V3: 8 experts, grouped
    sigmoid routing; V2-Lite: 6, softmax), attention and shared experts stay sharded; tokens, logprobs,
    prefix hits, preemption and n-gram drafts as on one device."""
    llm = LLM(str(models[name]), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE, **PARALLEL)
    try:
        moe = next(m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts))
        assert moe.expert_parallel and moe.first_expert == 0 and moe.num_local_experts == moe.num_experts // 2
        assert moe.w13.shape[:2] == (moe.num_experts // 2, 2 * moe.full_intermediate_size)  # whole experts
        check_against_one_device(llm, models, name)
    finally:
        llm.shutdown()


def test_tensor_parallel_qwen3_over_two_nodes_then_node_one_dies(models, tmp_path):
    """Node 1 is `atlas serve --node-rank 1` (a headless worker, no HTTP); node 0 is this process."""
    port = str(_free_port())
    flags = ["--model", str(models["qwen3"]), "-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", port, "--num-cpu-threads", "1", "--skip-tokenizer-init",
             "--num-gpu-blocks-override", str(PAGES), "--block-size", "8", "--max-model-len", "128",
             "--distributed-timeout", "5"]
    log = (tmp_path / "node1.log").open("w")
    node1 = subprocess.Popen([sys.executable, "-m", "atlas.cli", "serve", *flags, "--node-rank", "1"],
                             stdout=log, stderr=subprocess.STDOUT)
    llm = None
    try:
        llm = LLM(str(models["qwen3"]), tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
                  master_port=int(port), **ENGINE, **PARALLEL)
        assert not llm.engine.parallel.children
        check_against_one_device(llm, models, "qwen3")
        node1.kill()
        error = _wait_for_error(llm, 10)
        assert error.rank == 1 and "rank 1" in str(error)
    finally:
        if llm is not None:
            llm.shutdown()
        node1.kill()
        node1.wait(10)
    assert "rank 1 of 2 (node 1)" in (tmp_path / "node1.log").read_text()


def test_a_worker_whose_driver_vanishes_says_so_and_exits(models, tmp_path):
    """The driver (another process here) ends without stopping its engine, as a killed one would: the
    worker on node 1 notices within seconds, logs that it lost the driver (no traceback of its own) and
    exits."""
    port = _free_port()
    flags = ["--model", str(models["qwen3"]), "-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--num-cpu-threads", "1", "--skip-tokenizer-init",
             "--num-gpu-blocks-override", str(PAGES), "--block-size", "8", "--max-model-len", "128",
             "--distributed-timeout", "5"]
    log = (tmp_path / "node1.log").open("w")
    node1 = subprocess.Popen([sys.executable, "-m", "atlas.cli", "serve", *flags, "--node-rank", "1"],
                             stdout=log, stderr=subprocess.STDOUT)
    engine = dict(tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port,
                  **ENGINE, **PARALLEL)
    driver = (f"import os\nfrom atlas import LLM, SamplingParams\n"
              f"llm = LLM({str(models['qwen3'])!r}, **{engine!r})\n"
              "out = llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0, "
              "ignore_eos=True))\n"
              "print(len(out[0].outputs[0].token_ids), flush=True)\n"
              "os._exit(0)\n")
    try:
        done = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == "4", done.stderr[-3000:]
        node1.wait(30)
    finally:
        node1.kill()
        node1.wait(10)
    text = (tmp_path / "node1.log").read_text()
    assert "rank 1: lost the driver" in text and "Traceback" not in text, text[-3000:]


def _prefix_sharing_prompts(seed: int, low: int, high: int) -> list[list[int]]:
    """Three prompts of ids in [low, high) that share a 16-token prefix."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(low, high, (16,), generator=g).tolist()
    return [shared + torch.randint(low, high, (n,), generator=g).tolist() for n in (5, 11, 3)]


def _greedy_twice(llm: LLM, prompts: list[list[int]]) -> tuple[list, list]:
    """Greedy tokens of the prompts, then of all but the first again (prefix-cache hits); pages returned."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    assert sum(o.num_cached_tokens for o in again) > 0
    assert_pages_returned(llm)
    return [o.outputs[0].token_ids for o in first], [o.outputs[0].token_ids for o in again]


def test_tensor_parallel_dflash_drafts_on_the_driver(models):
    """The driver drafts with whole copies of the embedding and LM head (no collective); every rank
    verifies. Greedy tokens as with one device's DFlash and as plain decoding, prefix hits included."""
    target = str(models["small-dflash"])
    prompts = _prefix_sharing_prompts(3, 1, 15)

    plain = _greedy_twice(LLM(target, **ENGINE), prompts)
    one = LLM(target, speculative="dflash", **ENGINE)
    assert _greedy_twice(one, prompts) == plain
    assert one.engine.stats.spec_num_accepted_tokens > 0
    llm = LLM(target, speculative="dflash", tensor_parallel_size=2, **ENGINE, **PARALLEL)
    try:
        engine = llm.engine
        embedding, head = engine.runner._full_vocab
        assert embedding.weight.shape == head.weight.shape == (16, 32)  # whole, where the model holds halves
        assert engine.runner.model.lm_head.weight.shape[0] == 8
        assert engine.proposer.num_draft_tokens == one.engine.proposer.num_draft_tokens == 3
        assert _greedy_twice(llm, prompts) == plain
        stats = engine.stats
        assert stats.spec_num_verify_steps > 0 and stats.spec_num_accepted_tokens > 0
        assert engine.plan.num_pages == PAGES
    finally:
        llm.shutdown()


def test_tensor_parallel_mtp_drafts_on_the_driver(models):
    """The driver runs the MTP module alone, built whole (its block, latent cache and head unsharded) and
    sharing the whole embedding copy; workers verify. Greedy tokens as with one device's MTP and as
    plain decoding, prefix hits included, drafts accepted on both."""
    target = str(models["small-mtp"])
    prompts = _prefix_sharing_prompts(5, 0, 8)
    spec = dict(speculative="mtp", num_draft_tokens=2)

    plain = _greedy_twice(LLM(target, **ENGINE), prompts)
    one = LLM(target, **spec, **ENGINE)
    assert _greedy_twice(one, prompts) == plain
    assert one.engine.stats.spec_num_accepted_tokens > 0
    llm = LLM(target, **spec, tensor_parallel_size=2, **ENGINE, **PARALLEL)
    try:
        engine = llm.engine
        module = engine.proposer.module
        assert engine.runner.model.model.embed_tokens.weight.shape[0] == 4  # the model's half
        assert module._embed["fn"] is engine.runner._full_vocab[0]  # the checkpoint's copy equals it: shared
        if not engine.model_config.tie_word_embeddings:  # (its own head: no whole copy of the target's)
            assert engine.runner._full_vocab[1] is None
        assert module.shared_head.head.weight.shape == (8, engine.model_config.hidden_size)
        whole = one.engine.proposer.module.state_dict()
        for name, tensor in module.state_dict().items():  # every tensor whole, as on one device
            torch.testing.assert_close(tensor, whole[name], rtol=0, atol=0, msg=name)
        assert [c.shape for c in engine.proposer.kv_caches] == [c.shape for c in one.engine.proposer.kv_caches]
        assert engine.proposer.num_draft_tokens == 2
        assert _greedy_twice(llm, prompts) == plain
        # The same drafts as on one device: the driver's captured hidden states are the whole (reduced) ones.
        counts = ("spec_num_verify_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens")
        assert [getattr(engine.stats, c) for c in counts] == [getattr(one.engine.stats, c) for c in counts]
        assert engine.plan.num_pages == PAGES
    finally:
        llm.shutdown()


def test_full_vocab_copies_equal_the_model_tied_or_not(models, tmp_path):
    from atlas.models.loader import build_model, load_full_vocab

    tied = build_checkpoint(tmp_path, "Qwen2ForCausalLM", None, vocab_size=40)
    for path in (models["small-dflash"], tied, models["deepseek-v3"]):
        cfg = ModelConfig.from_path(path)
        ids = torch.tensor([0, 5, cfg.vocab_size - 1])
        model = build_model(cfg, torch.device("cpu"), torch.float32, 64)
        embedding, head = load_full_vocab(cfg, model, torch.device("cpu"), torch.float32)
        assert (head.weight is embedding.weight) == cfg.tie_word_embeddings
        alone, no_head = load_full_vocab(cfg, model, torch.device("cpu"), torch.float32, with_head=False)
        torch.testing.assert_close(alone.weight, embedding.weight, rtol=0, atol=0)
        assert (no_head is None) != cfg.tie_word_embeddings  # (a tied head is the embedding: kept)
        hidden = torch.randn(3, cfg.hidden_size)
        torch.testing.assert_close(embedding(ids), model.embed(ids), rtol=0, atol=0)
        torch.testing.assert_close(head(hidden), model.compute_logits(hidden), rtol=0, atol=0)



@pytest.mark.parametrize("arch", ARCHS)
def test_a_whole_vocabulary_copy_is_the_families_embedding_and_head_or_is_refused(checkpoints, arch):
    """The dense families: the embedding and LM head a tensor-parallel driver reads whole for a drafter compute what
    the model's embed and compute_logits do, or, where the model multiplies or scales them (Granite's
    embedding_multiplier and logits_scaling), the copy is refused by name rather than drafting from other values."""
    from atlas.errors import ModelLoadError
    from atlas.models.loader import build_model, load_full_vocab

    cfg = ModelConfig.from_path(checkpoints[arch])
    model = build_model(cfg, torch.device("cpu"), torch.float32, 64)
    ids, hidden = torch.tensor([0, 5, cfg.vocab_size - 1]), torch.randn(3, cfg.hidden_size)
    if model.vocab_weight_names() is None:
        with pytest.raises(ModelLoadError, match=arch):
            load_full_vocab(cfg, model, torch.device("cpu"), torch.float32)
        return
    embedding, head = load_full_vocab(cfg, model, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(embedding(ids), model.embed(ids), rtol=0, atol=0)
    torch.testing.assert_close(head(hidden), model.compute_logits(hidden), rtol=0, atol=0)

def test_a_worker_gets_k_without_the_drafter(models):
    from atlas.speculative import VerifyOnly, verify_only

    target = models["small-dflash"]
    worker = verify_only(EngineConfig(model=str(target), speculative="dflash", num_draft_tokens=2,
                                      tensor_parallel_size=2), ModelConfig.from_path(target))
    assert isinstance(worker, VerifyOnly) and worker.num_draft_tokens == 2
    assert worker.capture_layers() == () and worker.kv_bytes_per_token() == 0
    # A pipeline stage captures the layers the driver's drafter reads (those among its own layers).
    staged = verify_only(EngineConfig(model=str(target), speculative="dflash", pipeline_parallel_size=2),
                         ModelConfig.from_path(target))
    assert staged.capture_layers() == (1, 3) and staged.num_draft_tokens == 3
    mtp = models["deepseek-v3"]  # (K from its config.json: one MTP module unless --num-draft-tokens says)
    for k, want in ((None, 1), (3, 3)):
        worker = verify_only(EngineConfig(model=str(mtp), speculative="mtp", num_draft_tokens=k,
                                          tensor_parallel_size=2), ModelConfig.from_path(mtp))
        assert worker.num_draft_tokens == want and worker.kv_bytes_per_token() == 0
    staged = verify_only(EngineConfig(model=str(mtp), speculative="mtp", pipeline_parallel_size=2),
                         ModelConfig.from_path(mtp))
    assert staged.capture_layers() == (ModelConfig.from_path(mtp).num_hidden_layers - 1,)


# ---------------------------------------------------------------------------------- pipeline parallel
def count_steps_in_flight(engine) -> list[int]:
    """From now on, the number of steps still in flight as each step launches (the list fills as the engine runs)."""
    in_flight: list[int] = []
    launch = engine.runner.launch

    def counting_launch(batch):
        in_flight.append(len(engine._inflight))
        return launch(batch)

    engine.runner.launch = counting_launch
    return in_flight


@pytest.mark.parametrize(("name", "tp", "static"), [("qwen3", 1, False), ("llama", 1, True),
                                                    ("deepseek-v2-lite", 2, False)])
def test_pipeline_parallel_matches_one_device_with_steps_in_flight_on_both_stages(models, name, tp, static):
    """(DeepSeek with tensor parallelism in each stage too: 4 ranks, the first stage's two make the logits.
    Llama with every stage's decode steps on the static buffers of its CUDA graphs, uncaptured on a CPU: the
    static_steps tuning knob reaches the workers with the config they are started with.)"""
    llm = LLM(str(models[name]), pipeline_parallel_size=2, tensor_parallel_size=tp, tuning={"static_steps": static},
              **ENGINE, **PARALLEL)
    engine = llm.engine
    in_flight = count_steps_in_flight(engine)
    try:
        check_against_one_device(llm, models, name)
        # A step was launched while another was still in flight (the stages overlapped).
        assert max(in_flight) >= 1
        graphs = engine.runner.step_graphs
        assert (graphs[1].steps_run > 0) if static else not graphs
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("name", "spec", "first_stage_layers", "static"),
                         [("small-dflash", dict(speculative="dflash"), (1,), True),
                          ("small-mtp", dict(speculative="mtp", num_draft_tokens=2), (), False)])
def test_pipeline_parallel_dflash_and_mtp_draft_on_the_first_stage(models, name, spec, first_stage_layers, static):
    """The drafter runs on the first stage (the driver, which holds the embedding and the LM head); the
    layers it reads are captured on the stage that holds them and sent back with the step's rows (DFlash
    reads layers 1 and 3 of 4: one on each stage; MTP the last). Greedy tokens as plain decoding and as
    one device's speculation, prefix hits included, drafts accepted. DFlash with every stage's decode
    and verify steps on the static buffers of its CUDA graphs (uncaptured on a CPU: --tuning static_steps=1),
    whose outputs carry the captured rows."""
    target = str(models[name])
    prompts = _prefix_sharing_prompts(5, 0, 8) if name == "small-mtp" else _prefix_sharing_prompts(3, 1, 15)
    plain = _greedy_twice(LLM(target, **ENGINE), prompts)
    one = LLM(target, **spec, **ENGINE)
    assert _greedy_twice(one, prompts) == plain
    llm = LLM(target, **spec, pipeline_parallel_size=2, tuning={"static_steps": static}, **ENGINE, **PARALLEL)
    try:
        engine = llm.engine
        per_stage = engine.runner.stage_captures
        assert tuple(per_stage[0]) == first_stage_layers and per_stage[1]  # (a slab comes back from stage 1)
        assert _greedy_twice(llm, prompts) == plain
        graphs = engine.runner.step_graphs
        if static:  # (decode and verify steps of the driver's stage both took the static buffers)
            assert graphs[1].steps_run > 0 and graphs[engine.proposer.num_draft_tokens + 1].steps_run > 0
        else:
            assert not graphs
        # The same drafts as on one device (drafts made from missing or wrong slabs are accepted less).
        counts = ("spec_num_verify_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens")
        assert [getattr(engine.stats, c) for c in counts] == [getattr(one.engine.stats, c) for c in counts]
        assert engine.stats.spec_num_accepted_tokens > 0
        assert engine.plan.num_pages == PAGES
    finally:
        llm.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------- one process
class _Spy:
    """safe_open whose reads are recorded: name -> elements read, and whole-tensor reads."""

    def __init__(self, real):
        self.real = real
        self.read: dict[str, int] = {}
        self.whole: list[str] = []

    def __call__(self, path, framework="pt"):
        spy = self

        class File:
            def __enter__(self):
                self.f = spy.real(path, framework=framework).__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, name):
                spy.whole.append(name)
                t = self.f.get_tensor(name)
                spy.read[name] = spy.read.get(name, 0) + t.numel()
                return t

            def get_slice(self, name):
                sl = self.f.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return sl.get_shape()

                    def __getitem__(self, index):
                        t = sl[index]
                        spy.read[name] = spy.read.get(name, 0) + t.numel()
                        return t

                return Slice()

        return File()


@pytest.mark.parametrize("name", ["qwen3", "deepseek-v3"])
def test_a_rank_reads_only_its_slices_and_its_stage(models, name, monkeypatch):
    from safetensors import safe_open
    from safetensors.torch import load_file

    import atlas.models.loader as loader

    path = models[name]
    cfg = ModelConfig.from_path(path)
    full = load_file(str(path / "model.safetensors"))
    spy = _Spy(safe_open)
    monkeypatch.setattr(loader, "safe_open", spy)
    model = loader.build_model(cfg, torch.device("cpu"), torch.float32, 128, ModelParallel(tp_rank=1, tp_size=2))
    assert not spy.whole
    replicated = ("norm", "kv_a_proj", "q_a_proj", "mlp.gate.", "e_score_correction_bias", "o_proj.bias")
    for tensor_name, t in full.items():
        if tensor_name.startswith(f"model.layers.{cfg.num_hidden_layers}."):
            assert tensor_name not in spy.read  # the MTP module: not read for the model
        elif any(piece in tensor_name for piece in replicated):
            assert spy.read[tensor_name] == t.numel(), tensor_name
        else:
            assert spy.read[tensor_name] == t.numel() // 2, tensor_name  # half: this rank's heads / columns
    params = dict(model.named_parameters())
    if name == "qwen3":
        q, k, v = (full[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
        want = torch.cat([q[q.shape[0] // 2:], k[k.shape[0] // 2:], v[v.shape[0] // 2:]])
        torch.testing.assert_close(params["model.layers.0.self_attn.qkv_proj.weight"], want)
        o = full["model.layers.1.self_attn.o_proj.weight"]
        torch.testing.assert_close(params["model.layers.1.self_attn.o_proj.weight"], o[:, o.shape[1] // 2:])
        torch.testing.assert_close(params["model.embed_tokens.weight"], full["model.embed_tokens.weight"][192:])
    else:
        down = full["model.layers.1.mlp.experts.3.down_proj.weight"]
        torch.testing.assert_close(params["model.layers.1.mlp.experts.w2"][3], down[:, down.shape[1] // 2:])
        kv_b = full["model.layers.2.self_attn.kv_b_proj.weight"]
        torch.testing.assert_close(params["model.layers.2.self_attn.kv_b_proj.weight"], kv_b[kv_b.shape[0] // 2:])

    # A later pipeline stage reads only its own layers (and neither the embedding nor the LM head).
    spy.read.clear()
    spy.whole.clear()
    model = loader.build_model(cfg, torch.device("cpu"), torch.float32, 128, ModelParallel(pp_rank=1, pp_size=2))
    first, count = split_evenly(cfg.num_hidden_layers, 2, 1)
    assert [n for n, _ in model.named_parameters() if n.startswith("model.layers.")]
    assert {int(n.split(".")[2]) for n in spy.read if n.startswith("model.layers.")} == set(range(first, first + count))
    assert not any(n.startswith(("model.embed_tokens", "lm_head")) for n in spy.read)


def test_step_messages_carry_the_records_and_every_rank_keeps_the_scheduler_page_tables():
    """A step message carries each sequence's id, tokens and page-table change (the scheduler's records) and the
    requests to forget: a worker's tables, changed by the messages alone, are the scheduler's page tables at every
    step, through decodes, preemptions (pages are short) and requests that end; only changes travel."""
    from atlas.engine.kv_cache import KVCacheManager
    from atlas.engine.request import Request
    from atlas.engine.scheduler import Scheduler, SchedulerConfig
    from atlas.runtime.batch import StepResult
    from atlas.runtime.request_tables import RequestTables

    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64),
                  KVCacheManager(10, 4, False))
    for i in range(4):
        s.add(Request(f"r{i}", f"r{i}", 0, None, list(range(10 * i, 10 * i + 7)), SamplingParams(max_tokens=12), []))
    worker = RequestTables()
    sent = held = steps = 0
    while s.has_unfinished():
        out = s.schedule()
        steps += 1
        batch, info = decode_step(encode_step(out.batch, StepInfo(steps, [3], True)))
        assert info.number == steps and info.prompt_rows == [3] and info.share_samples
        assert [seq[:3] for seq in batch.seqs] == [(seq.request_id, seq.tokens, seq.pages) for seq in out.batch.seqs]
        assert all(seq.params is None for seq in batch.seqs)  # (a worker samples nothing)
        assert (batch.finished_request_ids, batch.preempted_request_ids) == (
            out.batch.finished_request_ids, out.batch.preempted_request_ids)
        worker.bind(batch)
        assert batch.page_tables.lists() == [r.page_ids for r in out.requests]
        sent += sum(len(seq.pages[1]) for seq in batch.seqs if seq.pages is not None)
        held += sum(batch.page_tables.counts)
        tokens = [[7] if m else [] for m in out.batch.num_sample_rows]
        s.update_from_output(out, StepResult(tokens, [None] * len(tokens), []))
    assert s.num_preemptions and sent < held / 2


def test_parallel_flags_and_layouts_are_checked(models):
    with pytest.raises(ConfigError, match="--node-rank"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=2)
    with pytest.raises(ConfigError, match="split evenly"):
        EngineConfig(tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ConfigError, match="--enable-expert-parallel .*--tensor-parallel-size 2"):
        EngineConfig(enable_expert_parallel=True)
    dense = ModelConfig.from_path(models["qwen3"])
    with pytest.raises(ConfigError, match="no routed experts"):
        check_model(EngineConfig(tensor_parallel_size=2, enable_expert_parallel=True), dense)
    v2 = ModelConfig.from_path(models["deepseek-v2-lite"])  # 6 routed experts
    with pytest.raises(ConfigError, match="does not divide the model's 6 routed experts"):
        check_model(EngineConfig(tensor_parallel_size=4, enable_expert_parallel=True), v2)
    cfg = ModelConfig.from_path(models["qwen3"])  # 4 heads, 2 KV heads, 2 layers
    with pytest.raises(ConfigError, match="attention heads"):
        check_model(EngineConfig(tensor_parallel_size=3), cfg)
    with pytest.raises(ConfigError, match="layers"):
        check_model(EngineConfig(pipeline_parallel_size=4), cfg)
    check_model(EngineConfig(tensor_parallel_size=4), cfg)  # KV heads replicated: fine
    assert [split_evenly(27, 4, i) for i in range(4)] == [(0, 6), (6, 7), (13, 7), (20, 7)]


# ---------------------------------------------------------------------------------------------------
# The peer-memory all-reduce (kernels/peer_all_reduce.py), two ranks at once
# ---------------------------------------------------------------------------------------------------

def test_peer_all_reduce_kernel_in_the_interpreter_sums_like_the_oracle_on_both_ranks():
    """Two processes, their buffers in shared memory, the kernel in Triton's interpreter: every sum and
    fused norm against the reference over calls of changing rows and widths (slots, parities and the
    EMPTY marks written back), zeros of both signs, both ranks bit-identical, then the engine's start-up
    check against gloo's sums."""
    out = run_in_triton_interpreter("peer_all_reduce_cases.py", "cpu", timeout=300)
    assert "rank 0: ok" in out and "rank 1: ok" in out and "ranks agree bit for bit: True" in out, out


def test_rows_pushed_by_a_gemv_must_be_the_next_all_reduced():
    """A GEMV that sent its rows to the peers (push_args) leaves them in the slots of the next epoch: any other
    all-reduce before theirs, or a second push, would read or overwrite them, so both are refused before a
    kernel runs."""
    from atlas.kernels.peer_all_reduce import PeerAllReduce

    buffer = torch.empty(PeerAllReduce.size(1, 4, 64), dtype=torch.bfloat16)
    PeerAllReduce.mark_empty(buffer)
    ar = PeerAllReduce(0, 1, [buffer.data_ptr()], buffer, torch.bfloat16, torch.device("cpu"), max_rows=4, row_slot=64)
    y, other = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16)
    args = ar.push_args(y)
    assert args["constexprs"]["PUSH"] and args["pointers"][0] is ar.buffer_ptrs
    with pytest.raises(AssertionError, match="never all-reduced"):
        ar.push_args(other)
    with pytest.raises(AssertionError, match="must be the next one all-reduced"):
        ar(other)
    with pytest.raises(AssertionError, match="push only rows this all-reduce takes"):
        ar.push_args(torch.zeros(5, 64, dtype=torch.bfloat16))  # more rows than its slots


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_peer_all_reduce_on_two_gpus_equals_nccl_eager_and_in_graphs():
    assert "ranks agree bit for bit: True" in run_cases_script("peer_all_reduce_cases.py", "cuda", timeout=400)


def test_the_all_reduce_choice_is_checked():
    assert EngineConfig().tuning.tp_all_reduce == "peer"
    assert EngineConfig(tuning="tp_all_reduce=NCCL").tuning.tp_all_reduce == "nccl"
    with pytest.raises(ConfigError, match="use one of nccl, peer, symm_mem"):
        EngineConfig(tuning={"tp_all_reduce": "mpi"})
