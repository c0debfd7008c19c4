"""LoRA adapters (--enable-lora): PEFT adapters on a tiny Qwen3, against PEFT itself in float32 (greedy tokens and
their logprobs), in batches that mix adapters and the base model; the base model's rows unchanged bit for bit;
prefix caching per adapter; slots shared by more adapters than there are (the queue); n-gram speculation; tensor
parallelism (gloo); the refusals; and the server over HTTP (the model field, /v1/models, runtime loading)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_pages_returned,
    build_checkpoint,
    build_deepseek_checkpoint,
    build_gemma3_checkpoint,
    hf_model,
)

from atlas import LLM, LoRARequest, SamplingParams
from atlas.errors import (
    ConfigError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
)

peft = pytest.importorskip("peft")

ENGINE = dict(device="cpu", dtype="float32", kv_cache_memory="8MiB", max_model_len=256, max_lora_rank=8)
PROMPTS = [[5, 9, 13, 2, 7, 11], [40, 41, 3, 99, 17], [8, 8, 23, 150, 6, 31, 77], [300, 12, 4]]
GEN = 10


def make_adapter(base: Path, out: Path, seed: int, **lora) -> torch.nn.Module:
    """A PEFT LoRA adapter of random weights (both halves: PEFT starts B at zero) saved to `out`; -> the PEFT model
    (the reference)."""
    model = peft.get_peft_model(hf_model(base), peft.LoraConfig(**lora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(out)
    return model.eval()


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("lora")
    base = build_checkpoint(root, "Qwen3ForCausalLM", tokenizer_dir)
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    refs = {
        # every projection, rank 4
        "full": make_adapter(base, root / "full", 1, r=4, lora_alpha=8, target_modules=every),
        # attention only, rsLoRA, a lower rank on v_proj and its own alpha on q_proj
        "attn": make_adapter(base, root / "attn", 2, r=8, lora_alpha=16, use_rslora=True,
                             target_modules=["q_proj", "v_proj", "o_proj"], rank_pattern={"v_proj": 2},
                             alpha_pattern={"q_proj": 4}),
        # the MLP only
        "mlp": make_adapter(base, root / "mlp", 3, r=2, lora_alpha=2, target_modules=["gate_proj", "down_proj"]),
    }
    return base, root, refs


def reference(model, prompt: list[int], n: int = GEN) -> tuple[list[int], list[float]]:
    """Greedy tokens of a (PEFT) model, and each one's logprob, by re-running the whole sequence."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    out = ids[len(prompt):]
    return out, [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]


def greedy(n: int = GEN, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0, **kw)


def tokens_and_logprobs(outs) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, [next(iter(e.values())).logprob for e in o.outputs[0].logprobs]) for o in outs]


def test_a_mixed_batch_of_adapters_computes_what_peft_computes_and_the_base_rows_stay_the_base_models(lora_setup):
    base, root, refs = lora_setup
    modules = [f"{name}={root / name}" for name in refs]
    llm = LLM(str(base), enable_lora=True, lora_modules=modules, **ENGINE)
    plain = LLM(str(base), **ENGINE)
    adapters = ["full", "attn", None, "mlp", "full", None, "attn", "mlp"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(adapters))]
    got = tokens_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(),
                                           lora_request=[LoRARequest(a) if a else None for a in adapters]))
    want_plain = tokens_and_logprobs(plain.generate([{"prompt_token_ids": p} for p in prompts], greedy()))
    for (tokens, logprobs), prompt, adapter, base_out in zip(got, prompts, adapters, want_plain, strict=True):
        if adapter is None:
            # (an exact zero delta: the base model's output unchanged, bit for bit)
            assert (tokens, logprobs) == base_out
            continue
        want_tokens, want_logprobs = reference(refs[adapter], prompt)
        assert tokens == want_tokens, adapter
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4
        assert tokens != base_out[0]  # (the adapter changes the output: the test can fail)
    assert_pages_returned(llm)


@pytest.mark.parametrize("family", ["gemma3", "gemma2", "gpt-oss"])
def test_other_families_adapters_compute_what_peft_computes(family, tmp_path):
    """Gemma 3 (every projection, its (1 + w) norms and scaled embedding around them), Gemma 2 (the same with
    soft-capped attention) and gpt-oss (the attention projections, with their biases and the sinks; the experts take
    none and an adapter of them is refused)."""
    if family == "gemma3":
        base = build_gemma3_checkpoint(tmp_path)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    elif family == "gemma2":
        from conftest import _build, _gemma_norms
        from test_gemma2 import GEMMA2

        base = _build(tmp_path, "gemma2", GEMMA2, None, 0, {}, randomize=_gemma_norms)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    else:
        from test_gpt_oss import build_gpt_oss_checkpoint

        base = build_gpt_oss_checkpoint(tmp_path)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    ref = make_adapter(base, tmp_path / "adapter", 5, r=4, lora_alpha=8, target_modules=targets)
    llm = LLM(str(base), enable_lora=True, lora_modules=[f"a={tmp_path / 'adapter'}"], skip_tokenizer_init=True,
              **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], greedy(),
                        lora_request=[LoRARequest("a"), None])
    tokens, logprobs = tokens_and_logprobs(outs)[0]
    want_tokens, want_logprobs = reference(ref, PROMPTS[0])
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4
    with ref.disable_adapter():
        assert outs[1].outputs[0].token_ids == reference(ref, PROMPTS[1])[0]
    if family == "gemma3":  # (an image-text checkpoint's adapter: its language model's names, a vision-tower pair)
        from safetensors.torch import load_file, save_file

        image_text = _edit_config(tmp_path / "adapter", tmp_path / "image-text")
        tensors = {k.replace("model.model.layers.", "model.model.language_model.layers."): v
                   for k, v in load_file(image_text / "adapter_model.safetensors").items()}
        tensors["base_model.model.model.vision_tower.encoder.q_proj.lora_A.weight"] = torch.ones(4, 8)
        tensors["base_model.model.model.vision_tower.encoder.q_proj.lora_B.weight"] = torch.ones(8, 4)
        save_file(tensors, image_text / "adapter_model.safetensors")
        again = LLM(str(base), enable_lora=True, lora_modules=[f"a={image_text}"], skip_tokenizer_init=True, **ENGINE)
        assert again.generate({"prompt_token_ids": PROMPTS[0]}, greedy(),
                              lora_request=LoRARequest("a"))[0].outputs[0].token_ids == tokens
    if family == "gpt-oss":  # (an adapter of the router names what Atlas does not adapt)
        from safetensors.torch import load_file, save_file

        experts = _edit_config(tmp_path / "adapter", tmp_path / "experts")
        tensors = load_file(experts / "adapter_model.safetensors")
        tensors["base_model.model.model.layers.0.mlp.router.lora_A.weight"] = torch.zeros(4, 64)
        tensors["base_model.model.model.layers.0.mlp.router.lora_B.weight"] = torch.zeros(4, 4)
        save_file(tensors, experts / "adapter_model.safetensors")
        with pytest.raises(UnsupportedModelError, match="router"):
            LLM(str(base), enable_lora=True, lora_modules=[f"e={tmp_path / 'experts'}"], skip_tokenizer_init=True,
                **ENGINE)


def test_prefix_caching_shares_pages_only_within_one_adapter(lora_setup):
    base, root, refs = lora_setup
    llm = LLM(str(base), enable_lora=True, lora_modules=[f"full={root / 'full'}"], block_size=8, **ENGINE)
    prompt = {"prompt_token_ids": [(7 * i + 3) % 300 + 1 for i in range(40)]}
    first = llm.generate(prompt, greedy(6), lora_request=LoRARequest("full"))[0]
    on_base = llm.generate(prompt, greedy(6))[0]
    again = llm.generate(prompt, greedy(6), lora_request=LoRARequest("full"))[0]
    assert first.num_cached_tokens == 0 and on_base.num_cached_tokens == 0  # (the adapter's KV is not the base's)
    assert again.num_cached_tokens >= 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.outputs[0].token_ids == reference(refs["full"], prompt["prompt_token_ids"], 6)[0]
    assert on_base.outputs[0].token_ids != first.outputs[0].token_ids
    assert_pages_returned(llm)


def test_more_adapters_than_slots_wait_for_a_free_one_and_load_from_their_paths(lora_setup):
    base, root, refs = lora_setup
    llm = LLM(str(base), enable_lora=True, max_loras=1, **ENGINE)
    names = ["full", "attn", "mlp", "full"]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in range(4)], greedy(),
                        lora_request=[LoRARequest(n, i + 1, str(root / n)) for i, n in enumerate(names)])
    for out, name, i in zip(outs, names, range(4), strict=True):
        assert out.outputs[0].token_ids == reference(refs[name], PROMPTS[i])[0], name
    assert llm.engine.lora.slot_names == ["full"]  # (in arrival order: the last "full" waited behind attn and mlp)
    assert_pages_returned(llm)
    # While the one slot is read, the others wait outside the scheduler (and /metrics' lora_requests_info says so).
    engine = llm.engine
    first = engine.add_request(PROMPTS[0], greedy(), lora=LoRARequest("full"))
    engine.add_request(PROMPTS[1], greedy(), lora=LoRARequest("attn"))
    engine.step()
    assert engine.lora_requests() == (["full"], ["attn"]) and len(engine.scheduler.waiting) == 0
    behind = engine.add_request(PROMPTS[2], greedy(), lora=LoRARequest("full"))  # (resident, but behind attn)
    engine.step()
    assert engine.lora_requests() == (["full"], ["attn", "full"])
    engine.abort_request(behind)
    engine.abort_request(first)
    while engine.has_unfinished():
        engine.step()
    assert engine.lora.slot_names == ["attn"]
    assert_pages_returned(llm)
    # A name known from another path is refused; an unknown name without a path names the loaded ones.
    with pytest.raises(InvalidRequestError, match="loaded from"):
        llm.generate([1, 2, 3], greedy(2), lora_request=LoRARequest("full", 1, str(root / "attn")))
    with pytest.raises(ModelNotFoundError, match="attn, mlp|full, attn"):
        llm.generate([1, 2, 3], greedy(2), lora_request=LoRARequest("nope"))


def test_ngram_speculation_under_an_adapter_gives_its_plain_greedy_tokens(lora_setup):
    base, root, refs = lora_setup
    prompt = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]
    kw = dict(enable_lora=True, lora_modules=[f"attn={root / 'attn'}"], **ENGINE)
    spec = LLM(str(base), speculative="ngram", num_draft_tokens=3, speculative_policy="always", **kw)
    out = spec.generate({"prompt_token_ids": prompt}, greedy(16), lora_request=LoRARequest("attn"))[0]
    assert out.outputs[0].token_ids == reference(refs["attn"], prompt, 16)[0]
    assert_pages_returned(spec)


def test_steps_without_adapter_rows_take_the_graph_set_without_the_slots(lora_setup):
    """--enable-lora keeps two sets of step graphs (runtime/graph_plan.py): a step in which no row reads an adapter
    replays the set captured without the slots' kernels, any other the set with them. On the CPU the graphs' static
    buffers run the same path (--tuning static_steps): base-model requests alone, adapter requests alone and both
    together give PEFT's tokens and the base model's bit for bit, each set took the steps it should, and with
    --tuning lora_base_graphs=0 there is one set."""
    base, root, refs = lora_setup
    kw = dict(enable_lora=True, lora_modules=[f"full={root / 'full'}"], **ENGINE)
    llm = LLM(str(base), tuning={"static_steps": True}, **kw)
    plan = llm.engine.runner.graph_plan
    with_slots, without = plan._sets[True][0][1], plan._sets[False][0][1]
    assert with_slots is not without
    plain = LLM(str(base), tuning={"static_steps": True}, **ENGINE)  # (the same padded shapes: the same bits)
    plain = tokens_and_logprobs(plain.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], greedy()))

    def run(adapters):
        return tokens_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:len(adapters)]], greedy(),
                                                lora_request=[LoRARequest(a) if a else None for a in adapters]))

    assert run([None, None]) == plain
    assert without.steps_run >= GEN - 1 and with_slots.steps_run == 0
    steps = without.steps_run
    tokens, _ = run(["full"])[0]
    assert tokens == reference(refs["full"], PROMPTS[0])[0] and tokens != plain[0][0]
    assert with_slots.steps_run >= GEN - 1 and without.steps_run == steps
    mixed = run(["full", None])
    assert mixed[1] == plain[1] and mixed[0][0] == tokens
    assert_pages_returned(llm)
    one = LLM(str(base), tuning={"static_steps": True, "lora_base_graphs": False}, **kw)
    assert not one.engine.runner.graph_plan._sets and one.engine.runner.graph_plan.step_graphs


@pytest.mark.parametrize("two_sets", [True, False])
def test_each_graph_set_is_captured_with_the_slots_its_steps_need(lora_setup, monkeypatch, two_sets):
    """A CUDA graph replays the kernels it captured, so what matters is the slots' switch while each set is
    captured: the adapters' set (and the only set, with --tuning lora_base_graphs=0) with the slots on, the
    base-model set without. Recorded at each capture call of the real engine's graph plan (on the CPU the static
    buffers capture nothing; the GPU test replays them)."""
    from atlas.runtime.cuda_graphs import StepGraphs
    from atlas.runtime.mixed_graphs import MixedStepGraphs

    base, root, _ = lora_setup
    seen: list[tuple[object, bool]] = []
    for cls in (StepGraphs, MixedStepGraphs):
        original = cls.capture

        def capture(self, pool=None, _original=original):
            seen.append((self, llm_slots[0].apply))
            return _original(self, pool)

        monkeypatch.setattr(cls, "capture", capture)
    from atlas.layers import lora as lora_layers

    llm_slots: list = []
    make = lora_layers.LoraSlots.__init__

    def init(self, *args, **kwargs):
        make(self, *args, **kwargs)
        llm_slots.append(self)

    monkeypatch.setattr(lora_layers.LoraSlots, "__init__", init)
    llm = LLM(str(base), enable_lora=True, lora_modules=[f"full={root / 'full'}"],
              tuning={"static_steps": True, "lora_base_graphs": two_sets}, **ENGINE)
    plan = llm.engine.runner.graph_plan
    sets = plan._sets if two_sets else {True: (plan.step_graphs, plan.mixed_graphs)}
    want = {id(g): adapters for adapters, (step_graphs, mixed) in sets.items()
            for g in [*step_graphs.values(), *([mixed] if mixed is not None else [])]}
    assert len(want) == (4 if two_sets else 2)  # (decode and mixed graphs in each set)
    assert {id(g): apply for g, apply in seen} == want
    assert llm_slots[0].apply is False  # (and the switch is back off after capture)


def test_two_tensor_parallel_ranks_give_one_devices_tokens_also_for_adapters_loaded_at_run_time(lora_setup):
    from test_parallel import PARALLEL

    base, root, refs = lora_setup
    modules = [f"full={root / 'full'}", f"attn={root / 'attn'}"]
    llm = LLM(str(base), enable_lora=True, lora_modules=modules, tensor_parallel_size=2, **ENGINE, **PARALLEL)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], greedy(),
                            lora_request=[LoRARequest("full"), None, LoRARequest("attn")])
        assert outs[0].outputs[0].token_ids == reference(refs["full"], PROMPTS[0])[0]
        assert outs[2].outputs[0].token_ids == reference(refs["attn"], PROMPTS[2])[0]
        # an adapter loaded at run time: every rank writes its share into the slot before the step that reads it;
        # with two slots, it replaces the least recently used one ("full"), which then loads back in its turn
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], greedy(),
                            lora_request=[LoRARequest("mlp", 3, str(root / "mlp")), None])
        assert outs[0].outputs[0].token_ids == reference(refs["mlp"], PROMPTS[0])[0]
        assert sorted(n for n in llm.engine.lora.slot_names if n) == ["attn", "mlp"]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], greedy(),
                            lora_request=[LoRARequest("full"), LoRARequest("mlp")])
        assert outs[0].outputs[0].token_ids == reference(refs["full"], PROMPTS[0])[0]
        assert outs[1].outputs[0].token_ids == reference(refs["mlp"], PROMPTS[1])[0]
    finally:
        llm.shutdown()


def _edit_config(src: Path, dst: Path, **fields) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        dst.joinpath(f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(fields)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_what_atlas_cannot_apply_exactly_is_refused_with_its_name(lora_setup, tmp_path):
    base, root, _ = lora_setup
    full = root / "full"
    refusals = [
        (_edit_config(full, tmp_path / "dora", use_dora=True), UnsupportedModelError, "DoRA"),
        (_edit_config(full, tmp_path / "saved", modules_to_save=["lm_head"]), UnsupportedModelError,
         "modules_to_save"),
        (_edit_config(full, tmp_path / "bias", bias="all"), UnsupportedModelError, "bias 'all'"),
        (_edit_config(full, tmp_path / "rank", r=5), ModelLoadError, "rank 4, its config says 5"),
        (tmp_path / "absent", ConfigError, "no such folder|neither a local folder"),
    ]
    for path, error, words in refusals:
        with pytest.raises(error, match=words):
            LLM(str(base), enable_lora=True, lora_modules=[f"x={path}"], **ENGINE)
    with pytest.raises(ConfigError, match="--max-lora-rank 8"):  # (rank 8 adapter, slots of rank 2)
        LLM(str(base), enable_lora=True, lora_modules=[f"a={root / 'attn'}"], **{**ENGINE, "max_lora_rank": 2})
    # An adapter of a model of other shapes.
    other = build_checkpoint(tmp_path, "Qwen3ForCausalLM", None, seed=1, hidden_size=32, head_dim=8)
    make_adapter(other, tmp_path / "other", 4, r=2, lora_alpha=2, target_modules=["q_proj"])
    with pytest.raises(ModelLoadError, match="another base model"):
        LLM(str(base), enable_lora=True, lora_modules=[f"o={tmp_path / 'other'}"], **ENGINE)
    # ... and loaded at run time: refused when it is loaded, not at a request's first step.
    runtime = LLM(str(base), enable_lora=True, **ENGINE)
    with pytest.raises(InvalidRequestError, match="another base model") as info:
        runtime.engine.load_lora_adapter("o", str(tmp_path / "other"))
    assert info.value.param == "lora_path" and runtime.engine.lora_adapters() == []
    # Flags: adapters without --enable-lora, too few slots, pipeline parallelism; a family without adapters.
    for kwargs, words in [(dict(lora_modules=[f"a={full}"]), "needs --enable-lora"),
                          (dict(enable_lora=True, lora_modules=[f"a={full}", f"b={full}"], max_loras=1),
                           "fewer adapters"),
                          (dict(enable_lora=True, pipeline_parallel_size=2), "pipeline"),
                          (dict(enable_lora=True, lora_modules=["nameonly"]), "NAME=PATH")]:
        with pytest.raises(ConfigError, match=words):
            LLM(str(base), **kwargs, **ENGINE)
    with pytest.raises(UnsupportedModelError, match="DeepseekV2ForCausalLM"):
        LLM(str(build_deepseek_checkpoint(tmp_path, "v2")), enable_lora=True, skip_tokenizer_init=True, **ENGINE)
    plain = LLM(str(base), **ENGINE)
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        plain.generate([1, 2, 3], greedy(2), lora_request=LoRARequest("full", 1, str(full)))


def _serve_adapters(url: str, root: Path, refs: dict) -> None:
    """The server at url serves the base model as "base" and adapter "full", and loads adapters at run time."""
    import httpx
    import openai
    from serving import assert_error

    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "full"} and cards["full"].parent == "base" and cards["base"].parent is None

    def complete(model: str) -> list[int]:
        out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=GEN, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        return out.choices[0].token_ids

    assert complete("full") == reference(refs["full"], PROMPTS[0])[0]
    with pytest.raises(openai.NotFoundError, match="mlp"):
        complete("mlp")
    http = httpx.Client(base_url=url, timeout=60)
    # (an adapter shares the base model's tokenizer; an unknown name is a 404 there too)
    assert http.post("/tokenize", json={"model": "full", "prompt": "hello"}).status_code == 200
    assert_error(http.post("/tokenize", json={"model": "mlp", "prompt": "hello"}), 404, "model", "model_not_found")
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(root / "mlp")}
                     ).status_code == 200
    assert complete("mlp") == reference(refs["mlp"], PROMPTS[0])[0]
    assert "mlp" in {m.id for m in client.models.list().data}
    assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(root / "mlp")}),
                 400, "lora_name")
    assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "none")}),
                 400, "lora_path")
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
    assert_error(http.post("/v1/chat/completions", json={"model": "mlp", "messages": [
        {"role": "user", "content": "hi"}]}), 404, "model", "model_not_found")
    assert complete("base") != complete("full")
    metrics = http.get("/metrics").text
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics


def test_the_server_serves_adapters_by_model_name_lists_them_and_loads_them_at_run_time(lora_setup):
    import httpx
    from serving import assert_error, start_server

    base, root, refs = lora_setup
    server = start_server(str(base), served_model_names=["base"], settings={"allow_runtime_lora_updating": True},
                          enable_lora=True, lora_modules=[f"full={root / 'full'}"], max_loras=2, **ENGINE)
    try:
        _serve_adapters(server.url, root, refs)
    finally:
        server.stop()
    plain = start_server(str(base), enable_lora=True, **ENGINE)
    try:
        assert_error(httpx.post(plain.url + "/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": "x"}),
                     400)
    finally:
        plain.stop()


def test_an_adapter_is_read_off_the_engine_thread_while_steps_go_on(lora_setup, monkeypatch):
    """/v1/load_lora_adapter reads the files on another thread: a request served meanwhile finishes while the (here
    slowed) read is still going, rather than waiting for it."""
    import threading
    import time

    import httpx
    from serving import start_server

    import atlas.engine.lora as engine_lora

    base, root, refs = lora_setup
    real = engine_lora.read_adapter

    def slow(*args, **kwargs):
        time.sleep(3.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_lora, "read_adapter", slow)
    server = start_server(str(base), settings={"allow_runtime_lora_updating": True}, enable_lora=True, **ENGINE)
    try:
        done = {}

        def load():
            reply = httpx.post(server.url + "/v1/load_lora_adapter", timeout=60,
                               json={"lora_name": "mlp", "lora_path": str(root / "mlp")})
            done["load"] = (time.monotonic(), reply.status_code)

        loading = threading.Thread(target=load)
        loading.start()
        time.sleep(0.5)  # (the read has begun)
        reply = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"prompt": PROMPTS[0], "max_tokens": GEN, "ignore_eos": True})
        served = time.monotonic()
        loading.join()
        assert reply.status_code == 200 and done["load"][1] == 200
        assert served < done["load"][0] - 1.0, "the request waited for the adapter's read"
        adapted = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "mlp", "prompt": PROMPTS[0], "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}).json()
        assert adapted["choices"][0]["token_ids"] == reference(refs["mlp"], PROMPTS[0])[0]
    finally:
        server.stop()


def test_atlas_serve_with_the_engine_in_its_own_process_and_two_front_ends_serves_adapters(lora_setup):
    from serving import Serve

    base, root, refs = lora_setup
    server = Serve(str(base), "--served-model-name", "base", "--api-server-count", "2", "--enable-lora",
                   "--lora-modules", f"full={root / 'full'}", "--max-loras", "2", "--max-lora-rank", "8",
                   "--allow-runtime-lora-updating")
    try:
        _serve_adapters(server.url, root, refs)
    finally:
        server.close()


def test_an_engine_over_several_nodes_refuses_adapters_at_run_time():
    """(Its workers on another node could not read a run-time adapter's folder: refused before anything is read.)"""
    from atlas.engine.lora import LoraRegistry

    def never(*_):
        raise AssertionError("nothing may be read or written")

    registry = LoraRegistry(1, never, never, [], runtime_loading=False)
    with pytest.raises(InvalidRequestError, match="several nodes") as info:
        registry.register("a", "/nowhere")
    assert info.value.param == "lora_name" and registry.known == {}
