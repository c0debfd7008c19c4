"""LongCat-Flash-Lite (LongcatFlashNgramForCausalLM): LongCat-Flash with the n-gram input embedding. transformers has
no class for it, so the reference is the published formula written out here (spec section 5.3), its embeddings fed
to transformers' LongcatFlashModel as inputs_embeds: logits over one prefill, chunks and decode steps, with
end-of-sequence tokens inside the prompt (and a negative check: the same formula without the segment reset gives
other logits); greedy tokens; chunked prefill with preemption and prefix caching on equal to off; speculation equal
to plain greedy (replayed drafts with rejections: a draft row's n-grams read the drafts before it); tensor and
pipeline parallelism as one device; the token history's cache; the remote code's alias of the word table; the
random-checkpoint tool's shape; refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import (
    _build,
    _correction_bias,
    assert_pages_returned,
    assert_tight_pool_gives,
    checkpoint_tool,
    hf_model,
)
from test_dsa import _ids, _llm
from test_longcat import LONGCAT, _edit, check_ngram_speculation_equals_plain_greedy
from test_models import atlas_logits

from atlas import SamplingParams
from atlas.errors import ModelLoadError, UnsupportedModelError

EOS = 7
ORDER, SPLITS, RATIO = 5, 2, 0.5  # orders 2..5, two tables each: 8 tables of 64 / 8 = 8 dims, about 200 rows
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _ngram_tensors(vocab: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tables = SPLITS * (ORDER - 1)
    dim = hidden // tables
    out = {}
    for i in range(tables):
        rows = int(RATIO * vocab + 2 * i + 1)
        out[f"model.ngram_embeddings.embedders.{i}.weight"] = torch.randn(rows, dim, generator=g)
        out[f"model.ngram_embeddings.post_projs.{i}.weight"] = torch.randn(hidden, dim, generator=g) / dim ** 0.5
    return out


def _ngram_checkpoint(src, dst, alias: bool = False, **fields):
    """The LongCat checkpoint with n-gram tables, as LongCat-Flash-Lite names them; alias: the word table also
    under the remote code's name."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(architectures=["LongcatFlashNgramForCausalLM"], ngram_vocab_size_ratio=RATIO, emb_neighbor_num=ORDER,
               emb_split_num=SPLITS, eos_token_id=EOS, **fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(dst / "model.safetensors")
    tensors |= _ngram_tensors(cfg["vocab_size"], cfg["hidden_size"], seed=11)
    if alias:
        tensors["model.ngram_embeddings.word_embeddings.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def lite(tmp_path_factory):
    root = tmp_path_factory.mktemp("longcat-ngram")
    plain = _build(root, "longcat", LONGCAT, None, 0, {}, randomize=_correction_bias)
    return _ngram_checkpoint(plain, root / "lite")


@pytest.fixture(scope="module")
def llm(lite):
    return _llm(lite)


# --------------------------------------------------------------------------- the published formula
def _look_back(tokens: list[int], k: int, eos: int, reset: bool = True) -> list[int]:
    """s_k(p) for every p: the token k before p when it is in p's segment (segments start at the sequence start and
    after each EOS, which ends its own), else 0."""
    segment, seg = [], 0
    for t in tokens:
        segment.append(seg)
        seg += reset and t == eos
    return [tokens[p - k] if p >= k and segment[p - k] == segment[p] else 0 for p in range(len(tokens))]


@torch.no_grad()
def reference_embeds(path, tokens: list[int], reset: bool = True) -> torch.Tensor:
    from safetensors.torch import load_file

    w = load_file(path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    vocab, order, splits = cfg["vocab_size"], cfg["emb_neighbor_num"], cfg["emb_split_num"]
    tables = splits * (order - 1)
    t = torch.tensor(tokens)
    shifted = {k: torch.tensor(_look_back(tokens, k, cfg["eos_token_id"], reset)) for k in range(1, order)}
    x = w["model.embed_tokens.weight"][t].float().clone()
    for i in range(tables):
        n, rows = i // splits + 2, int(cfg["ngram_vocab_size_ratio"] * vocab + 2 * i + 1)
        ids = t.clone()
        for k in range(1, n):
            ids = ids + shifted[k] * (pow(vocab, k, rows))
        ids = ids % rows
        x += (w[f"model.ngram_embeddings.embedders.{i}.weight"][ids].float()
              @ w[f"model.ngram_embeddings.post_projs.{i}.weight"].float().T)
    return x / (1 + tables)


def _hf(path):
    """transformers' LongcatFlashForCausalLM over the same decoder weights (it ignores the n-gram tensors)."""
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp())
    shutil.copytree(path, tmp / "hf")
    cfg = json.loads((tmp / "hf" / "config.json").read_text())
    cfg["architectures"] = ["LongcatFlashForCausalLM"]
    for key in ("ngram_vocab_size_ratio", "emb_neighbor_num", "emb_split_num"):
        cfg.pop(key)
    (tmp / "hf" / "config.json").write_text(json.dumps(cfg))
    return hf_model(tmp / "hf")


@torch.no_grad()
def reference_logits(path, tokens: list[int], reset: bool = True, model=None) -> torch.Tensor:
    model = model or _hf(path)
    return model(inputs_embeds=reference_embeds(path, tokens, reset)[None]).logits[0].float()


@torch.no_grad()
def reference_greedy(path, prompt: list[int], steps: int) -> list[int]:
    model, tokens = _hf(path), list(prompt)
    for _ in range(steps):
        tokens.append(int(reference_logits(path, tokens, model=model)[-1].argmax()))
    return tokens[len(prompt):]


def replayed_with_rejections(prompts: list[list[int]], outputs: list[list[int]]):
    """A proposer of 3 drafts a step: the plain greedy outputs replayed, every third of them wrong (so drafts are kept
    and rejected)."""
    from atlas.bench.offline import replay_proposer

    replay = replay_proposer(3)
    replay.record(prompts, [[t if (i + 1) % 3 else (t + 1) % 384 for i, t in enumerate(o)] for o in outputs])
    return replay


def _with_eos(n: int, seed: int) -> list[int]:
    ids = _ids(n, seed)
    for p in (3, 4, n // 2):  # (two back to back, one mid-prompt)
        ids[p] = EOS
    return ids


# --------------------------------------------------------------------------- tests
def test_the_token_history_is_one_more_paged_cache(llm):
    caches = llm.engine.runner.kv_caches
    assert len(caches) == 5 and caches[-1].dtype == torch.int32 and caches[-1].dim() == 2
    row = LONGCAT["kv_lora_rank"] + LONGCAT["qk_rope_head_dim"]
    assert llm.engine.runner.attention.bytes_per_token(torch.float32) == 4 * (4 * row) + 4


def test_logits_over_one_prefill_chunks_and_decode_steps_match_the_formula(lite, llm):
    ids = _with_eos(40, 1)
    expected = reference_logits(lite, ids)
    torch.testing.assert_close(atlas_logits(llm, ids, [40]), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(atlas_logits(llm, ids, [13, 11, 5] + [1] * 11), expected, rtol=1e-4, atol=1e-4)
    # The segment reset matters: the same formula reaching back across the EOS gives other logits.
    assert (reference_logits(lite, ids, reset=False) - expected).abs().max() > 1e-2


def test_greedy_tokens_match_the_formula(lite, llm):
    prompts = [[5, 17, EOS, 99, 3], _with_eos(30, 2), _ids(37, 3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [reference_greedy(lite, p, GREEDY.max_tokens) for p in prompts]
    assert_pages_returned(llm)


def test_chunked_prefill_preemption_and_prefix_caching_do_not_change_outputs(lite):
    """Prompts sharing a 16-token prefix with an EOS in it: caching off with room for everything, against caching
    on with 12-token steps and too few pages (preemption); a prefix hit seeds the look-back from the cached pages."""
    g = torch.Generator().manual_seed(5)
    shared = _with_eos(16, 9)
    prompts = [shared + torch.randint(1, 384, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 24, (5,), generator=g)]
    roomy = _llm(lite, enable_prefix_caching=False, kv_cache_memory="16MiB")
    expected = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    assert reference_greedy(lite, prompts[0], GREEDY.max_tokens) == expected[0]
    tight = _llm(lite, num_gpu_blocks_override=12, max_num_batched_tokens=12, max_model_len=56, max_num_seqs=4)
    assert_tight_pool_gives(tight, prompts, GREEDY, expected)


def test_ngram_speculation_equals_plain_greedy(lite, llm):
    check_ngram_speculation_equals_plain_greedy(lite, llm, eos=EOS)


def test_verify_rows_read_the_drafts_before_them(lite, llm):
    """Drafts replayed from plain greedy decoding with every third token wrong: the right ones are accepted, so
    each verify row's n-grams (the drafts before it, written in the same step) decide the tokens, which equal plain
    decoding's."""
    prompts = [_with_eos(30, 2), _ids(21, 8)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    spec = _llm(lite, speculative="ngram", speculative_policy="always", num_draft_tokens=3)
    spec.engine.proposer = replayed_with_rejections(prompts, plain)
    outs = spec.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = spec.engine.stats
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert_pages_returned(spec)


def test_the_remote_codes_name_for_the_word_table_is_read(lite, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _ngram_checkpoint(_hf_source(lite, tmp_path), tmp_path / "alias", alias=True)
    ids = _with_eos(20, 4)
    torch.testing.assert_close(atlas_logits(_llm(path), ids, [20]), reference_logits(lite, ids), rtol=1e-4, atol=1e-4)
    tensors = load_file(path / "model.safetensors")
    tensors["model.ngram_embeddings.word_embeddings.weight"] += 1
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="differ"):
        _llm(path)


def _hf_source(lite, tmp_path):
    """The plain LongCat checkpoint under the n-gram one (its config without the n-gram fields)."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "plain"
    shutil.copytree(lite, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["LongcatFlashForCausalLM"]
    for key in ("ngram_vocab_size_ratio", "emb_neighbor_num", "emb_split_num"):
        cfg.pop(key)
    (src / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v for k, v in load_file(src / "model.safetensors").items() if ".ngram_embeddings." not in k}
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    return src


@pytest.mark.parametrize("fields,needle", [
    ({"eos_token_id": [7, 8]}, "needs one eos_token_id"),
    ({"emb_split_num": 3}, "not a multiple of the n-gram tables' count"),
    ({"emb_neighbor_num": 1}, "'emb_neighbor_num' must be an integer >= 2"),
    ({"ngram_vocab_size_ratio": 0}, "'ngram_vocab_size_ratio' must be a positive number")])
def test_malformed_ngram_fields_are_refused(lite, tmp_path, fields, needle):
    with pytest.raises((ModelLoadError, UnsupportedModelError), match=needle):
        _llm(_edit(lite, tmp_path / "edited", **fields))


def test_random_checkpoint_tool_ngram_shape(tmp_path):
    """longcat-flash-ngram-tiny: the tool writes the n-gram tables (Atlas loads every one, as written), and its
    config alone serves with --load-format dummy."""
    module = checkpoint_tool()
    out = tmp_path / "lite"
    assert module.main(["--shape", "longcat-flash-ngram-tiny", "--out", str(out), "--std", "0.2", "--device", "cpu"]) == 0
    from safetensors.torch import load_file

    written = {k: v for k, v in load_file(out / "model.safetensors").items() if ".ngram_embeddings." in k}
    assert len(written) == 2 * 2 * (5 - 1)
    ngram = _llm(out).engine.runner.model.model.ngram_embeddings
    assert all(torch.equal(ngram.get_parameter(k.removeprefix("model.ngram_embeddings.")), v) for k, v in written.items())
    ids = _ids(24, 6)
    config_only = tmp_path / "config-only"
    assert module.main(["--shape", "longcat-flash-ngram-tiny", "--out", str(config_only), "--config-only"]) == 0
    outs = _llm(config_only, load_format="dummy").generate([{"prompt_token_ids": ids}], GREEDY)
    assert len(outs[0].outputs[0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_parallel_matches_one_device(lite, llm, tp, pp):
    """Two ranks on gloo: greedy tokens through chunked prompts and a preemption (every rank computes the same
    embedding from whole tables; in two stages the first embeds), then drafts replayed with rejections, as on one
    device."""
    from test_parallel import ENGINE, PARALLEL

    from atlas import LLM

    prompts = [_with_eos(30, 2), _ids(21, 8), _with_eos(40, 3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    par = LLM(str(lite), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE, **PARALLEL)
    try:
        assert [o.outputs[0].token_ids for o in par.generate([{"prompt_token_ids": p} for p in prompts], params)] == want
        par.engine.proposer = replayed_with_rejections(prompts, want)
        assert [o.outputs[0].token_ids for o in par.generate([{"prompt_token_ids": p} for p in prompts], params)] == want
        assert par.engine.stats.spec_num_accepted_tokens > 0
        assert_pages_returned(par)
    finally:
        par.shutdown()
