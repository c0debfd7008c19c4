"""MTP drafting (`--speculative mtp`) with DeepSeek-V3's multi-token-prediction module: its math against
a dense reference written from the spec (transformers' decoder layer at index num_hidden_layers plus
enorm / hnorm / eh_proj / shared_head), lossless greedy decoding under batching, chunked prefill, prefix
caching and preemption, the target's distribution under sampling, and the setups it refuses."""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import pytest
import torch
from chained_drafting import greedy_then_mixed, through_static_buffers
from conftest import assert_pages_returned, build_deepseek_checkpoint, hf_model, mtp_reference_layer
from spec_stats import (
    CONTINUATION,
    TINY_PROMPT,
    TINY_VOCAB,
    assert_samples_follow,
    exact_sequence_distribution,
)

from atlas import LLM, SamplingParams
from atlas.errors import ConfigError
from atlas.speculative.proposer import CommittedTokens

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"kv_cache_memory": "8MiB", "block_size": 8, "skip_tokenizer_init": True, **kw})


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def reference_mtp(ckpt, token_ids: list[int], drafts: int) -> tuple[torch.Tensor, list[int]]:
    """The spec's MTP, densely: h_i = the target's final (normed) hidden state at i, row i reads
    t_{i+1}: u_i = block(eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])) at position i, causal over rows;
    logits_i = shared_head.head(shared_head.norm(u_i)). Then `drafts - 1` chained rows: token = the
    previous row's argmax, hidden = the previous row's u, position + 1.
    -> (u of the rows 0 .. n-2, the greedy drafts from the last row on)."""
    hf = hf_model(ckpt)
    layer, w = mtp_reference_layer(ckpt)
    layer.self_attn.config._attn_implementation = "eager"
    h = hf.model(torch.tensor([token_ids])).last_hidden_state[0]  # after the final norm
    embed = hf.model.embed_tokens
    rope = hf.model.rotary_emb  # (the family's own: V3's, or V3.2's / GLM-5's, whose DSA indexer reads positions)

    def block(z: torch.Tensor) -> torch.Tensor:
        n = z.shape[0]
        positions = torch.arange(n)[None]
        cos_sin = rope(z[None], positions)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(z[None], attention_mask=mask, position_embeddings=cos_sin, position_ids=positions)
        return (out[0] if isinstance(out, tuple) else out)[0]  # (GLM-5's layer returns a tuple)

    def combine(tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e, g = _rms(embed(tokens), w["enorm.weight"]), _rms(hidden, w["hnorm.weight"])
        return torch.cat([e, g], -1) @ w["eh_proj.weight"].T

    def logits(u: torch.Tensor) -> torch.Tensor:
        return _rms(u, w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T

    return chained_reference(block, combine, logits, token_ids, h, drafts)


def chained_reference(block, combine, logits, token_ids: list[int], h: torch.Tensor, drafts: int
                      ) -> tuple[torch.Tensor, list[int]]:
    """The spec's rows, densely: z_i = combine(t_{i+1}, h_i) for the committed rows, u = block(z) causal over rows;
    then `drafts - 1` chained rows (token = the previous row's argmax, hidden = its u, position + 1).
    -> (u of the committed rows, the greedy drafts from the last row on). (Shared with the LongCat MTP test.)"""
    z = combine(torch.tensor(token_ids[1:]), h[:-1])
    u = real = block(z)
    out = [int(logits(u[-1]).argmax())]
    for _ in range(drafts - 1):
        z = torch.cat([z, combine(torch.tensor([out[-1]]), u[-1:])])
        u = block(z)
        out.append(int(logits(u[-1]).argmax()))
    return real, out


def _last_layer_stream(ckpt, token_ids: list[int]) -> torch.Tensor:
    """The residual stream after the target's last decoder layer (before the final norm)."""
    hf = hf_model(ckpt)
    seen = {}
    hook = hf.model.layers[-1].register_forward_hook(lambda m, a, out: seen.setdefault("h", out))
    with torch.no_grad():
        hf(torch.tensor([token_ids]))
    hook.remove()
    h = seen["h"]
    return (h[0] if isinstance(h, tuple) else h)[0]


def assert_module_matches_reference(ckpt, ids: list[int], reference=None, **engine) -> None:
    """Commits of 30 tokens in two chunks (the second attends over the module's cached rows of the first), then
    a chain of 3 drafts: the module's u at each chunk end and the drafts equal the dense reference (`reference`,
    default DeepSeek's: reference_mtp). engine: more engine arguments."""
    llm = _llm(ckpt, speculative="mtp", speculative_policy="always", num_draft_tokens=3, **engine)
    proposer = llm.engine.proposer
    ref_u, ref_drafts = (reference or reference_mtp)(ckpt, ids, 3)
    stream = _last_layer_stream(ckpt, ids)
    kv = llm.engine.kv
    req = SimpleNamespace(request_id="r", all_token_ids=ids, page_ids=kv.pool.allocate(5), num_computed_tokens=29)
    try:
        proposer.on_commit([CommittedTokens(req, 0, 15, stream[:15])])
        pos, u, _ = proposer.state["r"]
        assert pos == 14
        torch.testing.assert_close(u, ref_u[14], rtol=1e-4, atol=1e-4)
        proposer.on_commit([CommittedTokens(req, 15, 14, stream[15:29])])
        pos, u, _ = proposer.state["r"]
        assert pos == 28
        torch.testing.assert_close(u, ref_u[28], rtol=1e-4, atol=1e-4)
        assert proposer.propose([req])[0].read_tokens() == ref_drafts
    finally:
        kv.pool.release(req.page_ids)


def test_mtp_module_matches_the_spec_reference(deepseek_checkpoints):
    ids = torch.randint(0, 384, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    assert_module_matches_reference(deepseek_checkpoints["v3"], ids)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 5-token-vocabulary V3 checkpoint with an MTP module (drafts are often right), and the exact
    distribution of its 3-token continuations of TINY_PROMPT."""
    ckpt = build_deepseek_checkpoint(tmp_path_factory.mktemp("mtp"), "v3", seed=4, vocab_size=TINY_VOCAB)
    hf = hf_model(ckpt)

    @functools.cache  # (31 distinct prefixes)
    @torch.no_grad()
    def target(prefix: tuple) -> torch.Tensor:
        return hf(torch.tensor([TINY_PROMPT + list(prefix)])).logits[0, -1].float().softmax(-1)

    return ckpt, exact_sequence_distribution(target, TINY_VOCAB, CONTINUATION)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_equals_plain_under_pressure(tiny, k):
    """Batched, chunked prefill, prefix-cache hits and forced preemption."""
    ckpt, _ = tiny
    g = torch.Generator().manual_seed(k)
    shared = torch.randint(0, TINY_VOCAB, (24,), generator=g).tolist()
    prompts = [shared + torch.randint(0, TINY_VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 20, (8,), generator=g)]
    plain = _llm(ckpt, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    llm = _llm(ckpt, speculative="mtp", speculative_policy="always", num_draft_tokens=k, num_gpu_blocks_override=22, max_num_batched_tokens=32,
               max_model_len=72, max_num_seqs=6)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.stats
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.stats.hits > 0
    assert_pages_returned(llm)


def test_mtp_chain_through_the_graph_buffers(tiny):
    """The chained draft steps through the static buffers CUDA graphs replay (run eagerly on the CPU,
    batches padded into scratch pages): the same tokens as plain decoding, and the same drafts as the
    eager chain."""
    ckpt, _ = tiny
    prompts = [torch.randint(0, TINY_VOCAB, (int(n),), generator=torch.Generator().manual_seed(int(n))).tolist()
               for n in (7, 12, 20, 9, 15)]
    plain = _llm(ckpt).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    eager = _llm(ckpt, speculative="mtp", speculative_policy="always", num_draft_tokens=3, max_num_seqs=7)
    eager_outs = eager.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    llm = _llm(ckpt, speculative="mtp", speculative_policy="always", num_draft_tokens=3, max_num_seqs=7)
    proposer = llm.engine.proposer
    proposer.capture_chain_graphs(llm.engine.runner.proposer_context(), use_graphs=False)
    runs = []
    original = proposer.graphs.run
    proposer.graphs.run = lambda *a: runs.append(a[2].num_reqs) or original(*a)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert runs and max(runs) > 1
    stats, eager_stats = llm.engine.stats, eager.engine.stats
    assert (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (
        eager_stats.spec_num_draft_tokens, eager_stats.spec_num_accepted_tokens)
    assert [o.outputs[0].token_ids for o in eager_outs] == [o.outputs[0].token_ids for o in plain]
    assert_pages_returned(llm)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_catch_up_through_the_graph_buffers(tiny, k):
    """The pass over each step's committed rows through the static buffers its CUDA graphs replay (run
    eagerly on the CPU): K + 1 rows a request with the padding written into scratch pages, prompt chunks
    beside it eagerly. The same tokens as plain decoding, the same drafts as the eager pass."""
    ckpt, _ = tiny
    prompts = [torch.randint(0, TINY_VOCAB, (int(n),), generator=torch.Generator().manual_seed(int(n))).tolist()
               for n in (7, 12, 20, 9, 15)]
    plain = _llm(ckpt).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    eager = _llm(ckpt, speculative="mtp", speculative_policy="always", num_draft_tokens=k, max_num_seqs=7, max_num_batched_tokens=32)
    eager.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    llm = _llm(ckpt, speculative="mtp", speculative_policy="always", num_draft_tokens=k, max_num_seqs=7, max_num_batched_tokens=32)
    proposer = llm.engine.proposer
    ctx = llm.engine.runner.proposer_context()
    proposer.capture_catch_up_graphs(ctx, use_graphs=False)
    if k > 1:
        proposer.capture_chain_graphs(ctx, use_graphs=False)
    runs, eager_runs = [], []
    graphed, unpadded = proposer.catch_up.run, proposer._catch_up_eager
    proposer.catch_up.run = lambda *a: runs.append(a[2].num_reqs) or graphed(*a)
    proposer._catch_up_eager = lambda rows_of: eager_runs.append(len(rows_of)) or unpadded(rows_of)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert runs and max(runs) > 1 and eager_runs  # (prompt chunks of 32-token steps went eagerly)
    stats, eager_stats = llm.engine.stats, eager.engine.stats
    assert stats.spec_num_accepted_tokens > 0
    assert (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (
        eager_stats.spec_num_draft_tokens, eager_stats.spec_num_accepted_tokens)
    assert_pages_returned(llm)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_chains_right_behind_verify_steps_give_the_same_drafts(tiny, k):
    """The module's pass over a verify step's rows and its chain queued right behind the step (the default on one
    device; the accepted drafts, the bonus token and the positions from the step's outputs on the device), through
    the static buffers CUDA graphs replay, over the latent cache: plain decoding's tokens and the very drafts of
    drafts made after the read-back (--tuning draft_after_verify=0), greedy and penalised sampled requests, under
    page pressure too."""
    ckpt, _ = tiny
    prompts = [torch.randint(0, TINY_VOCAB, (int(n),), generator=torch.Generator().manual_seed(int(n))).tolist()
               for n in (7, 12, 20, 9, 15, 26)]
    plain = [o.outputs[0].token_ids for o in _llm(ckpt).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    kwargs = dict(speculative="mtp", speculative_policy="always", num_draft_tokens=k, max_num_seqs=6)
    host = through_static_buffers(_llm(ckpt, tuning={"draft_after_verify": False}, **kwargs), 6)
    reference = greedy_then_mixed(host, prompts, GREEDY, 6)
    assert reference[0][: len(prompts)] == plain and not reference[3]
    for extra in ({}, {"kv_cache_memory": None, "num_gpu_blocks_override": 24, "max_num_batched_tokens": 32,
                       "max_model_len": 96}):
        llm = through_static_buffers(_llm(ckpt, **kwargs, **extra), 6)
        assert llm.engine.proposer.drafts_after_verify
        tokens, counts, drafts, queued, handed_out = greedy_then_mixed(llm, prompts, GREEDY, 6)
        assert tokens[: len(prompts)] == plain and sum(queued) > 0
        if extra:
            assert llm.engine.scheduler.num_preemptions > 0
        else:
            assert (tokens, counts, drafts) == reference[:3] and counts[1] > 0 and all(queued)
        assert 0.8 * sum(queued) <= sum(handed_out) <= sum(queued)
        assert_pages_returned(llm)


def test_mtp_drafts_left_on_the_device(tiny):
    """Drafts left on the device (the default) with the chain's and the catch-up's static buffers: the same
    tokens as plain decoding and the same accepted drafts as drafts read back at once (--tuning
    device_drafts=0)."""
    ckpt, _ = tiny
    prompts = [torch.randint(0, TINY_VOCAB, (int(n),), generator=torch.Generator().manual_seed(int(n))).tolist()
               for n in (7, 12, 20, 9, 15)]
    plain = [o.outputs[0].token_ids for o in _llm(ckpt).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    kwargs = dict(speculative="mtp", speculative_policy="always", num_draft_tokens=3, max_num_seqs=7, max_num_batched_tokens=32)
    host = _llm(ckpt, tuning={"device_drafts": False}, **kwargs)
    assert not host.engine.proposer.device_drafts
    host.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    llm = _llm(ckpt, **kwargs)
    proposer = llm.engine.proposer
    assert proposer.device_drafts
    ctx = llm.engine.runner.proposer_context()
    proposer.capture_catch_up_graphs(ctx, use_graphs=False)
    proposer.capture_chain_graphs(ctx, use_graphs=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    a, b = host.engine.stats, llm.engine.stats
    assert (a.spec_num_draft_tokens, a.spec_num_accepted_tokens) == (b.spec_num_draft_tokens, b.spec_num_accepted_tokens)
    assert b.spec_num_accepted_tokens > 0
    assert_pages_returned(llm)


def test_mtp_token_map_keeps_outputs_and_drafts_from_the_map(tiny, tmp_path):
    """--speculative-token-map with MTP: a map of every id (in reverse order) drafts what the whole head drafts (the
    same accepted counts); a map of the even ids drafts only even ids, through the chain's and the catch-up's
    static buffers too; outputs equal plain decoding's either way."""
    ckpt, _ = tiny
    prompts = [torch.randint(0, TINY_VOCAB, (int(n),), generator=torch.Generator().manual_seed(int(n))).tolist()
               for n in (7, 12, 20, 9, 15)]
    plain = [o.outputs[0].token_ids for o in _llm(ckpt).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    kwargs = dict(speculative="mtp", speculative_policy="always", num_draft_tokens=3, max_num_seqs=7,
                  max_num_batched_tokens=32)

    def run(static: bool = False, **extra):
        llm = _llm(ckpt, **kwargs, **extra)
        proposer, drafted = llm.engine.proposer, []
        if static:
            ctx = llm.engine.runner.proposer_context()
            proposer.capture_catch_up_graphs(ctx, use_graphs=False)
            proposer.capture_chain_graphs(ctx, use_graphs=False)
        draft_ids = proposer._draft_ids
        proposer._draft_ids = lambda u: drafted.append(draft_ids(u).clone()) or drafted[-1]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == plain
        assert_pages_returned(llm)
        stats = llm.engine.stats
        return (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens), torch.cat(drafted), llm

    whole, _, _ = run()
    every = tmp_path / "every.json"
    every.write_text(json.dumps(list(range(TINY_VOCAB))[::-1]))
    mapped, _, llm = run(speculative_token_map=str(every))
    assert mapped == whole and whole[1] > 0
    assert llm.engine.proposer.token_map.ids.tolist() == list(range(TINY_VOCAB))
    even = tmp_path / "even.pt"
    torch.save(torch.arange(0, TINY_VOCAB, 2), even)
    _, drafted, llm = run(static=True, speculative_token_map=str(even))
    assert drafted.numel() > 0 and bool((drafted % 2 == 0).all())
    module_bytes = sum(p.numel() * p.element_size() for p in llm.engine.proposer.module.parameters())
    map_rows = len(range(0, TINY_VOCAB, 2))  # (float32 rows of the head)
    assert llm.engine.proposer.weight_bytes() == module_bytes + map_rows * llm.engine.model_config.hidden_size * 4


def test_mtp_sampling_keeps_the_target_distribution(tiny):
    ckpt, exact = tiny
    llm = _llm(ckpt, speculative="mtp", speculative_policy="always", num_draft_tokens=2, kv_cache_memory="16MiB", max_num_seqs=1024,
               max_num_batched_tokens=8192)
    assert_samples_follow(llm, exact)
    assert llm.engine.stats.spec_num_accepted_tokens > 0


def test_mtp_refuses_models_without_one_module(deepseek_checkpoints, tmp_path):
    with pytest.raises(ConfigError, match="multi-token-prediction heads; DeepseekV2ForCausalLM has none"):
        _llm(deepseek_checkpoints["v2"], speculative="mtp", speculative_policy="always")
    ckpt = build_deepseek_checkpoint(tmp_path, "v3", num_nextn_predict_layers=2)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers = 2: --speculative mtp supports one"):
        _llm(ckpt, speculative="mtp", speculative_policy="always")
    assert json.loads((ckpt / "config.json").read_text())["num_nextn_predict_layers"] == 2
