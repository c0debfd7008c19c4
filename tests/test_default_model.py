"""The shipped default model (atlas/assets/default-model) and the training code that makes it.

The shipped-model tests skip only when that folder is absent (it is produced by a GPU run of
tools/train_default_model.py and committed afterwards). The training test always runs: a tiny run on
a slice of the standard library, on CPU, in a few seconds.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import hf_model
from test_models import atlas_logits

from atlas import LLM, SamplingParams
from atlas.engine.core import default_model_path

DEFAULT = default_model_path()
needs_default_model = pytest.mark.skipif(
    not (DEFAULT / "config.json").is_file(),
    reason=f"no shipped default model at {DEFAULT} yet: train it with tools/train_default_model.py and copy "
           "its checkpoint files there")


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads((DEFAULT / "expected_greedy.json").read_text())


@pytest.fixture(scope="module")
def default_llm():
    return LLM(model=str(DEFAULT), device="cpu", dtype="float32", kv_cache_memory="16MiB", block_size=8)


@pytest.fixture(scope="module")
def default_hf():
    return hf_model(DEFAULT)


# ------------------------------------------------------------------------------------------ shipped model


@needs_default_model
def test_shipped_files_are_a_small_complete_checkpoint():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "expected_greedy.json"):
        assert (DEFAULT / name).is_file(), f"{name} is missing from {DEFAULT}"
    size = sum(f.stat().st_size for f in DEFAULT.iterdir() if f.is_file())
    assert size <= 20_000_000, f"the default model takes {size / 1e6:.1f} MB (at most 20 MB in git)"
    cfg = json.loads((DEFAULT / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    gen = json.loads((DEFAULT / "generation_config.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT)
    ends = {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    assert ends <= set(gen["eos_token_id"])


@needs_default_model
def test_tokenizer_has_chatml_template_and_special_tokens():
    from transformers import AutoTokenizer

    from atlas.training.corpus import format_chatml

    tok = AutoTokenizer.from_pretrained(DEFAULT)
    assert tok.chat_template and tok.eos_token == "<|endoftext|>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == format_chatml(messages, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    vocab = json.loads((DEFAULT / "config.json").read_text())["vocab_size"]
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"):
        ids = tok.encode(special, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] < vocab, special
        assert special in tok.all_special_tokens


@needs_default_model
def test_logits_agree_with_transformers(default_llm, default_hf, expected):
    case = expected["cases"][0]
    ids = case["prompt_token_ids"] + case["token_ids"]
    with torch.no_grad():
        want = default_hf(torch.tensor([ids])).logits[0].float()
    got = atlas_logits(default_llm, ids, [len(ids)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-4)
    # The same logits when the prompt is split into chunks and the rest is decoded token by token.
    n = len(case["prompt_token_ids"])
    got = atlas_logits(default_llm, ids, [n // 2, n - n // 2] + [1] * len(case["token_ids"]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-4)


@needs_default_model
def test_greedy_completion_gives_the_recorded_tokens(default_llm, default_hf, expected):
    from atlas.training.evaluate import greedy_decode

    for case in expected["cases"]:
        assert greedy_decode(default_hf, case["prompt_token_ids"], len(case["token_ids"]))[0] == case["token_ids"]
        out = default_llm.generate(case["prompt"], SamplingParams(max_tokens=len(case["token_ids"]), temperature=0,
                                                                  ignore_eos=True))[0]
        assert out.prompt_token_ids == case["prompt_token_ids"], case["name"]
        assert out.outputs[0].token_ids == case["token_ids"], (case["name"], out.outputs[0].text)


@needs_default_model
def test_chat_goes_through_the_template(default_llm, expected):
    case = next(c for c in expected["cases"] if c["name"] == "chat")
    out = default_llm.chat(case["messages"], SamplingParams(max_tokens=len(case["token_ids"]), temperature=0,
                                                            ignore_eos=True))[0]
    assert out.prompt_token_ids == case["prompt_token_ids"]
    assert out.outputs[0].token_ids == case["token_ids"]


@needs_default_model
def test_llm_without_a_model_argument_loads_the_default_model():
    llm = LLM(device="cpu", kv_cache_memory="16MiB")
    assert llm.engine.model_path.resolve() == DEFAULT.resolve()
    out = llm.generate("def ", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


# ------------------------------------------------------------------------------------------ training code


def test_corpus_split_is_deterministic_and_by_file():
    from atlas.training.corpus import split_of

    keys = [f"pkg/mod{i}.py" for i in range(4000)]
    a = [split_of(k, 0, 0.02, 0.05) for k in keys]
    assert a == [split_of(k, 0, 0.02, 0.05) for k in keys]
    assert a != [split_of(k, 1, 0.02, 0.05) for k in keys]
    assert 0.03 < a.count("test") / len(a) < 0.07 and 0.01 < a.count("valid") / len(a) < 0.03


def test_a_corpus_from_another_stdlib_folder_does_not_claim_the_running_pythons_version(tmp_path):
    """`--stdlib-dir` reads another Python's standard library (the held-out prompts of a machine whose Python
    differs): the corpus records that folder and no version, since the running Python's would be wrong."""
    import platform

    from atlas.training.corpus import CorpusConfig, build_corpus

    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "decoder.py").write_text("def decode(s):\n    return s\n")
    (tmp_path / "os.py").write_text("SEP = '/'\n")
    corpus = build_corpus(CorpusConfig(seed=0, chat=False, pydoc_topics=False, stdlib_dir=str(tmp_path)))
    assert corpus.python_version is None and corpus.stdlib_dir == str(tmp_path)
    assert sorted(d.source for d in corpus.documents) == ["stdlib:json/decoder.py", "stdlib:os.py"]
    own = build_corpus(CorpusConfig(seed=0, chat=False, pydoc_topics=False, limit_bytes=20_000))
    assert own.python_version == platform.python_version()


def test_packed_windows_are_shifted_seeded_and_cover_each_epoch():
    import numpy as np

    from atlas.training.data import PackedWindows, eval_labels, eval_windows, pack_documents

    stream = pack_documents([list(range(1, 50)), list(range(100, 180))], eos_id=0)
    assert stream[49] == 0 and stream[-1] == 0 and len(stream) == 131
    a = PackedWindows(stream, seq_len=8, batch_size=3, seed=5)
    b = PackedWindows(stream, seq_len=8, batch_size=3, seed=5)
    it_a, it_b = iter(a), iter(b)
    for _ in range(2 * a.steps_per_epoch):
        x, y = next(it_a), next(it_b)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.input_ids[:, 1:], x.labels[:, :-1])
    full, rest = eval_windows(stream, 16)
    labels = torch.cat([full[:, 1:].flatten(), rest[1:]]).numpy()
    assert np.array_equal(labels, eval_labels(stream))


@pytest.fixture
def one_thread():
    """Tiny models train fastest on one thread (and far faster than on two busy ones)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_tiny_training_run_learns_and_loads_in_atlas(tmp_path, one_thread):
    from transformers import AutoTokenizer

    from atlas.training.corpus import format_chatml
    from atlas.training.default_model import DefaultModelSettings, run

    settings = DefaultModelSettings(
        out=str(tmp_path / "tiny"), device="cpu", time_budget_minutes=0, max_steps=30, corpus_limit_mb=0.15,
        vocab_size=320, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
        intermediate_size=64, max_position_embeddings=256, seq_len=32, batch_size=8, lr=1e-2, warmup_steps=3,
        eval_every=10, eval_tokens=1024, test_max_tokens=2048, greedy_tokens=6, sample_tokens=4)
    report = run(settings)
    out = tmp_path / "tiny"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "expected_greedy.json", "train_report.json"])
    history = report["training"]["history"]
    assert report["training"]["steps"] == 30 and len(history) == 4
    assert history[-1]["loss"] < history[0]["loss"] - 0.5, history  # it learned something
    assert history[0]["loss"] == pytest.approx(math.log(320), abs=0.3)  # and started from uniform
    ev = report["evaluation"]
    assert ev["model"]["tokens"] == ev["unigram_add_one"]["tokens"] == 2048

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_tokens_to_ids("<|mask|>") == 3 and tok.chat_template
    messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}]
    assert tok.apply_chat_template(messages, tokenize=False) == format_chatml(messages)  # as in the training data
    expected = json.loads((out / "expected_greedy.json").read_text())
    llm = LLM(model=str(out), kv_cache_memory="4MiB")
    for case in expected["cases"]:
        got = llm.generate({"prompt_token_ids": case["prompt_token_ids"]},
                           SamplingParams(max_tokens=len(case["token_ids"]), temperature=0, ignore_eos=True))
        assert got[0].outputs[0].token_ids == case["token_ids"]


def test_a_run_stopped_by_its_time_budget_before_any_log_still_reports_its_loss_and_step_time():
    """A deadline already past when the loop starts: one step runs, then the budget stops it, before the first log
    and before the calibration steps are timed. Its loss and step time are still reported (they were None: a busy
    machine that took a second to start the loop made the test below fail on that)."""
    import time

    from atlas.training.trainer import TrainConfig, Trainer

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    x = torch.randn(64, 16)
    cfg = TrainConfig(lr=1e-2, warmup_steps=10, max_steps=1000, calibration_steps=5, eval_every=0, log_every=5)
    result = Trainer(model, cfg, "cpu", lambda m, b: ((m(b) - b) ** 2).mean()).fit(iter(lambda: x, None),
                                                                                   deadline=time.perf_counter())
    assert result.stopped_by == "time budget" and result.steps == 1
    with torch.no_grad():
        want = float(((model(x) - x) ** 2).mean())  # (after the step: the loss it reports is the step's, before it)
    assert result.final_train_loss is not None and result.final_train_loss > want
    assert result.seconds_per_step is not None and result.seconds_per_step > 0


def test_time_budget_fixes_the_step_count_and_finishes_in_time():
    import time

    from atlas.training.trainer import TrainConfig, Trainer, lr_factor

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    x = torch.randn(64, 16)

    def loss_fn(m, batch):
        time.sleep(0.002)
        return ((m(batch) - batch) ** 2).mean()

    cfg = TrainConfig(lr=1e-2, warmup_steps=10, max_steps=1_000_000, calibration_steps=5, eval_every=0, log_every=5)
    t0 = time.perf_counter()
    result = Trainer(model, cfg, "cpu", loss_fn, num_tokens=lambda b: len(b)).fit(iter(lambda: x, None),
                                                                                 deadline=t0 + 1.0)
    # (1,000,000 steps of 2 ms would take over half an hour: it stops near its deadline of 1 s; the slack is for a
    # loaded CI machine, where this once took 2.5 s)
    assert time.perf_counter() - t0 < 5.0
    # Planned from the measured step time to end a little before the deadline, not from max_steps. A busy
    # machine plans fewer steps, and may still hit the deadline (then it stops there, even before the
    # plan is made).
    if result.stopped_by == "planned steps":
        assert 5 <= result.steps == result.planned_steps < 1000
    else:
        assert result.stopped_by == "time budget" and result.steps >= 1
    assert result.final_train_loss is not None and result.seconds_per_step > 0
    # The schedule: linear warmup to the peak, cosine down to min_lr_ratio at the last step.
    assert lr_factor(0, 10, 100, 0.1) == pytest.approx(0.1) and lr_factor(9, 10, 100, 0.1) == 1.0
    assert lr_factor(100, 10, 100, 0.1) == pytest.approx(0.1) and lr_factor(55, 10, 100, 0.1) == pytest.approx(0.55)
