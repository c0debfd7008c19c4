"""EAGLE-3 drafting: the published checkpoint format (config.json + midlayer/fc/norm/lm_head/d2t/t2d tensors),
the drafter's chained drafts against a dense reference written from the published forward, lossless greedy
decoding through the engine (batched, chunked prefill, prefix hits, preemption), and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from chained_drafting import greedy_then_mixed, through_static_buffers
from conftest import assert_pages_returned, build_checkpoint, hf_model
from safetensors.torch import save_file
from spec_stats import (
    CONTINUATION,
    TINY_PROMPT,
    TINY_VOCAB,
    assert_samples_follow,
    exact_sequence_distribution,
)

from atlas import LLM, SamplingParams
from atlas.config import EngineConfig
from atlas.errors import ConfigError, ModelLoadError
from atlas.models.eagle3 import Eagle3Config, default_aux_layer_ids

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def write_eagle3_drafter(out: Path, hidden: int, vocab: int, draft_vocab: int, aux_ids: list[int] | None,
                         heads: int = 4, kv_heads: int = 2, head_dim: int = 16, intermediate: int = 96, seed: int = 0,
                         target_hidden: int | None = None, d2t: torch.Tensor | None = None, with_d2t: bool = True,
                         embed: bool = False, fmt: str = "safetensors", **config_fields) -> Path:
    """A random drafter exactly as the published EAGLE-3 checkpoints are laid out: config.json
    (LlamaForCausalLMEagle3, draft_vocab_size, ...) and unprefixed tensors `fc.weight`, `midlayer.*` (q/k/v 2H
    wide), `norm.weight`, `lm_head.weight` [draft_vocab, H], `d2t` (int64 offsets) and `t2d` (bool); no
    embedding unless `embed`. The draft vocabulary is a random sorted subset of the target's ids."""
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 2048, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "torch_dtype": "float32", "bos_token_id": 1,
    }
    if target_hidden is not None:
        config["target_hidden_size"] = target_hidden
    if aux_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = aux_ids
    config.update(config_fields)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / cols ** 0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    th = target_hidden or hidden
    p = "midlayer."
    w = {"fc.weight": mat(hidden, 3 * th), "norm.weight": norm(hidden), "lm_head.weight": mat(draft_vocab, hidden) * 4,
         p + "input_layernorm.weight": norm(hidden), p + "hidden_norm.weight": norm(hidden),
         p + "post_attention_layernorm.weight": norm(hidden),
         p + "self_attn.q_proj.weight": mat(heads * head_dim, 2 * hidden),
         p + "self_attn.k_proj.weight": mat(kv_heads * head_dim, 2 * hidden),
         p + "self_attn.v_proj.weight": mat(kv_heads * head_dim, 2 * hidden),
         p + "self_attn.o_proj.weight": mat(hidden, heads * head_dim),
         p + "mlp.gate_proj.weight": mat(intermediate, hidden), p + "mlp.up_proj.weight": mat(intermediate, hidden),
         p + "mlp.down_proj.weight": mat(hidden, intermediate)}
    if with_d2t:
        if d2t is None:
            ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
            d2t = ids - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        mapped = (torch.arange(draft_vocab) + d2t).clamp(0, vocab - 1)
        t2d[mapped] = True
        w |= {"d2t": d2t.to(torch.long), "t2d": t2d}
    if embed:
        w["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=g)
    if fmt == "bin":
        torch.save({k: v.contiguous() for k, v in w.items()}, str(out / "pytorch_model.bin"))
    else:
        save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    return out


# --------------------------------------------------------------------------- the dense reference
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def target_streams(hf_target, token_ids: list[int], aux_ids: list[int]) -> torch.Tensor:
    """[n, 3 * H]: for each id j (ascending), the residual stream ENTERING target layer j (HF hidden_states[j]);
    for j = N (no layer follows) the last layer's output before the final norm, taken with a hook."""
    layers = hf_target.model.layers
    last: list[torch.Tensor] = []
    hook = layers[-1].register_forward_hook(lambda m, a, out: last.append(out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            hs = hf_target(torch.tensor([token_ids]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return torch.cat([(last[0] if j == len(layers) else hs[j])[0] for j in sorted(aux_ids)], dim=-1)


def reference_draft_logits(hf_target, drafter_dir: Path, tokens: list[int], drafts: list[int]) -> torch.Tensor:
    """The published EAGLE-3 forward, densely: rows p = 0..n-1 read (target streams at p -> fc, token p + 1), then
    one chained row per draft step reads (the previous row's pre-norm output, the previous draft). The first len(drafts)
    drafts are fed as given (teacher forcing); -> the draft logits of every step mapped to TARGET ids, [len(drafts), V]
    (ids outside the draft vocabulary at -inf). `tokens`: the request's tokens, the last one not yet computed."""
    from safetensors.torch import load_file

    raw = json.loads((drafter_dir / "config.json").read_text())
    if (drafter_dir / "model.safetensors").is_file():
        w = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(drafter_dir / "model.safetensors")).items()}
    else:
        w = {k: v.float() if v.is_floating_point() else v
             for k, v in torch.load(str(drafter_dir / "pytorch_model.bin"), weights_only=True).items()}
    eps, heads, kv, d = raw["rms_norm_eps"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    n_layers = hf_target.config.num_hidden_layers
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or default_aux_layer_ids(n_layers)
    n = len(tokens) - 1
    embed = (lambda ids: w["embed_tokens.weight"][ids]) if "embed_tokens.weight" in w else \
        (lambda ids: hf_target.get_input_embeddings()(ids).float())
    theta = raw["rope_theta"]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)

    def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        f = pos[:, None].float() * inv[None]
        emb = torch.cat([f, f], -1)
        return x * emb.cos()[:, None] + _rotate_half(x) * emb.sin()[:, None]

    p = "midlayer."
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []

    def rows(e: torch.Tensor, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([_rms(e, w[p + "input_layernorm.weight"], eps), _rms(h, w[p + "hidden_norm.weight"], eps)], -1)
        q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(-1, heads, d), pos)
        keys.append(rope((x @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv, d), pos))
        values.append((x @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv, d))
        k_all, v_all = torch.cat(keys).repeat_interleave(heads // kv, 1), torch.cat(values).repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k_all) * d ** -0.5
        key_pos = torch.arange(k_all.shape[0])
        scores = scores.masked_fill(key_pos[None, None, :] > pos[None, :, None], float("-inf"))
        a = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v_all).reshape(-1, heads * d) @ w[p + "self_attn.o_proj.weight"].T
        r = h + a
        m_in = _rms(r, w[p + "post_attention_layernorm.weight"], eps)
        out = r + (F.silu(m_in @ w[p + "mlp.gate_proj.weight"].T) * (m_in @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
        return out, _rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T

    def to_target(draft_logits: torch.Tensor) -> torch.Tensor:
        full = torch.full((draft_logits.shape[0], hf_target.config.vocab_size), float("-inf"))
        ids = torch.arange(draft_logits.shape[1]) + w["d2t"] if "d2t" in w else torch.arange(draft_logits.shape[1])
        full[:, ids] = draft_logits
        return full

    with torch.no_grad():
        h = target_streams(hf_target, tokens[:n], aux) @ w["fc.weight"].T
        out, logits = rows(embed(torch.tensor(tokens[1:n + 1])), h, torch.arange(n))
        result = [to_target(logits[-1:])]
        u = out[-1:]
        for j, dj in enumerate(drafts[:-1]):
            u, logits = rows(embed(torch.tensor([dj])), u, torch.tensor([n + j]))
            result.append(to_target(logits))
    return torch.cat(result)


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """The conftest Qwen3 and Llama configs (hidden 64, vocab 384) with 4 layers, each with a drafter reading
    layers [1, 2, 4] (4: the last layer's output) through a 96-token draft vocabulary; the Llama one lists them
    out of order, ships its own embedding and says "bias": true."""
    root = tmp_path_factory.mktemp("eagle3")
    out = {}
    # ("bias": true as the EAGLE repo's configs may say it, with no fc.bias tensor: its loader builds fc without one)
    for arch, extra in (("Qwen3ForCausalLM", {}), ("LlamaForCausalLM", {"embed": True, "bias": True})):
        target = build_checkpoint(root, arch, None, seed=3, num_hidden_layers=4)
        ids = [1, 2, 4] if arch.startswith("Qwen") else [4, 1, 2]
        drafter = write_eagle3_drafter(root / f"drafter-{arch}", hidden=64, vocab=384, draft_vocab=96, aux_ids=ids,
                                       seed=1, **extra)
        out[arch] = (target, drafter)
    return out


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory) -> tuple[Path, Path]:
    """A 4-layer, 16-token target (drafts often right, often wrong) and a drafter of 12 draft ids."""
    root = tmp_path_factory.mktemp("eagle3-small")
    target = build_checkpoint(root, "Qwen3ForCausalLM", None, seed=1, vocab_size=16, hidden_size=32,
                              intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              num_hidden_layers=4)
    drafter = write_eagle3_drafter(root / "drafter", hidden=32, vocab=16, draft_vocab=12, aux_ids=[1, 2, 3], heads=2,
                                   kv_heads=1, intermediate=64, seed=2)
    return target, drafter


def _random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def small_vocab_plain(small_vocab):
    target, _ = small_vocab
    prompts = _random_prompts(12, 16)
    llm = LLM(str(target), skip_tokenizer_init=True, kv_cache_memory="16MiB", max_model_len=160,
              enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return prompts, [o.outputs[0].token_ids for o in outs]


# --------------------------------------------------------------------------- format
def test_config_fields_and_capture_layers(targets):
    _, drafter = targets["LlamaForCausalLM"]
    cfg = Eagle3Config.from_path(drafter)
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.draft_vocab_size, cfg.vocab_size) == (64, 64, 96, 384)
    # vLLM's ids name the stream entering layer j (the output of layer j - 1), ascending: Atlas capture ids j - 1.
    assert cfg.aux_layers(4) == [1, 2, 4] and cfg.capture_layers(4) == [0, 1, 3]
    assert default_aux_layer_ids(32) == [2, 16, 29]


def test_loader_reads_the_published_layout(targets):
    target, drafter = targets["Qwen3ForCausalLM"]
    llm = LLM(str(target), skip_tokenizer_init=True, speculative="eagle3", draft_model=str(drafter),
              num_draft_tokens=3, kv_cache_memory="8MiB")
    proposer = llm.engine.proposer
    from safetensors.torch import load_file

    w = load_file(str(drafter / "model.safetensors"))
    model = proposer.model
    # (its chain's K - 1 rows past a step, and the next verify step's too: one device drafts right behind a step)
    assert proposer.capture_layers() == (0, 1, 3) and proposer.drafts_after_verify and proposer.lookahead_slots == 4
    assert model.embed_tokens is None  # (the target's embedding is shared)
    torch.testing.assert_close(model.fc.weight, w["fc.weight"])
    qkv = torch.cat([w[f"midlayer.self_attn.{x}_proj.weight"] for x in "qkv"])
    torch.testing.assert_close(model.midlayer.self_attn.qkv_proj.weight, qkv)
    torch.testing.assert_close(model.lm_head.weight, w["lm_head.weight"])
    torch.testing.assert_close(model.d2t, w["d2t"])
    assert proposer.weight_bytes() > 0 and proposer.kv_bytes_per_token() == 2 * 2 * 16 * 4


def test_a_pytorch_bin_drafter_loads_the_same(tmp_path, targets):
    target, _ = targets["Qwen3ForCausalLM"]
    a = write_eagle3_drafter(tmp_path / "st", hidden=64, vocab=384, draft_vocab=96, aux_ids=[1, 2, 4], seed=5)
    b = write_eagle3_drafter(tmp_path / "bin", hidden=64, vocab=384, draft_vocab=96, aux_ids=[1, 2, 4], seed=5,
                             fmt="bin")
    models = [LLM(str(target), skip_tokenizer_init=True, speculative="eagle3", draft_model=str(d),
                  kv_cache_memory="8MiB").engine.proposer.model for d in (a, b)]
    for (name, x), (_, y) in zip(models[0].state_dict().items(), models[1].state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, msg=name)


# --------------------------------------------------------------------------- the drafter's math
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_engine_drafts_equal_the_dense_reference(targets, arch):
    """Through the engine (the three streams captured, drafter K/V from prefill chunks, verify rows and prefix-cache
    hits): every draft of every step is the argmax of the dense published forward given the committed tokens and
    the drafts before it, mapped to a target id through d2t."""
    target, drafter = targets[arch]
    hf = hf_model(target)
    llm = LLM(str(target), skip_tokenizer_init=True, speculative="eagle3", speculative_policy="always",
              draft_model=str(drafter), num_draft_tokens=3, kv_cache_memory="8MiB", block_size=4,
              max_num_batched_tokens=16)
    proposer = llm.engine.proposer
    calls: list[tuple[list[int], list[int]]] = []
    original = proposer.propose

    sizes: list[int] = []

    def recording(requests):
        drafts = original(requests)
        sizes.append(len(requests))
        calls.extend((list(r.all_token_ids), d.read_tokens()) for r, d in zip(requests, drafts, strict=True))
        return drafts

    proposer.propose = recording
    g = torch.Generator().manual_seed(2)
    prompt, other = (torch.randint(1, 380, (n,), generator=g).tolist() for n in (37, 23))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": other}], params)[0]
    batched = len(calls)
    second = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert second.num_cached_tokens > 0 and first.outputs[0].token_ids == second.outputs[0].token_ids
    assert batched >= 4 and len(calls) > batched and all(len(d) == 3 for _, d in calls)
    assert max(sizes) == 2  # (both requests drafted in one batched chain)
    for tokens, drafts in calls:
        ref = reference_draft_logits(hf, drafter, tokens, drafts)
        chosen = ref.gather(1, torch.tensor(drafts)[:, None])[:, 0]
        assert torch.all(chosen >= ref.max(-1).values - 1e-4), (tokens, drafts, ref.argmax(-1).tolist())
    assert_pages_returned(llm)


def test_paged_drafts_equal_the_dense_reference_with_partial_commits(targets):
    """Two requests in one batched chain, scattered pages, the drafter's K/V written in several commits (one with
    fewer captured rows than tokens, then completed, as a recomputation would), against the dense forward."""
    from types import SimpleNamespace

    from atlas.speculative.proposer import CommittedTokens

    target, drafter = targets["Qwen3ForCausalLM"]
    hf = hf_model(target)
    llm = LLM(str(target), skip_tokenizer_init=True, speculative="eagle3", speculative_policy="always",
              draft_model=str(drafter), num_draft_tokens=4, kv_cache_memory="8MiB", block_size=4,
              enable_prefix_caching=False)
    proposer = llm.engine.proposer
    g = torch.Generator().manual_seed(5)
    contexts = [torch.randint(1, 380, (n,), generator=g).tolist() for n in (11, 6)]
    x0s = [17, 250]
    pages = [[9, 2, 30, 5, 11], [4, 21, 7]]
    requests = [SimpleNamespace(request_id=f"r{i}", all_token_ids=ctx + [x0], num_computed_tokens=len(ctx),
                                page_ids=p) for i, (ctx, x0, p) in enumerate(zip(contexts, x0s, pages, strict=True))]
    feats = [target_streams(hf, c, [1, 2, 4]) for c in contexts]
    proposer.on_commit([CommittedTokens(requests[0], 0, 7, feats[0][3:7]),
                        CommittedTokens(requests[1], 0, 6, feats[1])])
    proposer.on_commit([CommittedTokens(requests[0], 0, 3, feats[0][0:3]),
                        CommittedTokens(requests[0], 7, 4, feats[0][7:11])])
    drafts = [d.read_tokens() for d in proposer.propose(requests)]
    assert all(len(d) == 4 for d in drafts)
    for req, d in zip(requests, drafts, strict=True):
        ref = reference_draft_logits(hf, drafter, req.all_token_ids, d)
        assert d == ref.argmax(-1).tolist()


# --------------------------------------------------------------------------- lossless decoding
@pytest.mark.parametrize("k", [None, 1, 4])
def test_eagle3_greedy_equals_plain_under_pressure(small_vocab, small_vocab_plain, k):
    """Batched, prefix caching on, chunked prefill and forced preemption."""
    target, drafter = small_vocab
    prompts, expected = small_vocab_plain
    llm = LLM(str(target), skip_tokenizer_init=True, speculative="eagle3", speculative_policy="always",
              draft_model=str(drafter), num_draft_tokens=k, num_gpu_blocks_override=30, block_size=8,
              max_num_batched_tokens=48, max_num_seqs=6, max_model_len=160)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    for _ in range(2):  # the second run reads the first one's pages (target and draft KV) from the prefix cache
        again = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY)[0]
        assert again.outputs[0].token_ids == expected[0]
    assert again.num_cached_tokens > 0
    stats = llm.engine.stats
    assert stats.spec_num_verify_steps > 0 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pages_returned(llm)


@pytest.mark.parametrize("k", [1, 4])
def test_eagle3_passes_through_the_graph_buffers(small_vocab, small_vocab_plain, k):
    """The chained steps and the pass over committed rows through the static buffers their CUDA graphs replay (run
    eagerly on the CPU, K + 1 rows a request with padding written into scratch pages, prompt chunks beside it
    eagerly), drafts left on the device: plain decoding's tokens, and exactly the eager passes' drafted and accepted
    counts."""
    target, drafter = small_vocab
    prompts, expected = small_vocab_plain
    kwargs = dict(skip_tokenizer_init=True, speculative="eagle3", speculative_policy="always",
                  draft_model=str(drafter), num_draft_tokens=k, kv_cache_memory="16MiB", max_num_seqs=7,
                  max_num_batched_tokens=48, max_model_len=160)

    def run(static: bool):
        llm = LLM(str(target), **kwargs)
        proposer, passes = llm.engine.proposer, {"catch-up": [], "chain": [], "eager": []}
        assert proposer.device_drafts
        if static:
            ctx = llm.engine.runner.proposer_context()
            proposer.capture_catch_up_graphs(ctx, use_graphs=False)
            graphed = proposer.catch_up.run
            proposer.catch_up.run = lambda *a: passes["catch-up"].append(a[2].num_reqs) or graphed(*a)
            if k > 1:
                proposer.capture_chain_graphs(ctx, use_graphs=False)
                chain = proposer.graphs.run
                proposer.graphs.run = lambda *a: passes["chain"].append(a[2].num_reqs) or chain(*a)
        unpadded = proposer._catch_up_eager
        proposer._catch_up_eager = lambda rows_of: passes["eager"].append(len(rows_of)) or unpadded(rows_of)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert_pages_returned(llm)
        stats = llm.engine.stats
        return (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens), passes

    eager_counts, eager_passes = run(static=False)
    counts, passes = run(static=True)
    assert counts == eager_counts and counts[1] > 0
    assert passes["catch-up"] and max(passes["catch-up"]) > 1 and passes["eager"]  # (prompt chunks went eagerly)
    assert (max(passes["chain"]) > 1) if k > 1 else not passes["chain"]
    assert not eager_passes["catch-up"] and not eager_passes["chain"]


@pytest.mark.parametrize("k", [1, 4])
def test_eagle3_chains_right_behind_verify_steps_give_the_same_tokens(small_vocab, small_vocab_plain, k):
    """The next drafts queued right behind each uniform verify step (the default on one device), through the static
    buffers CUDA graphs replay: the accepted drafts, the bonus token and the positions come from the step's outputs
    on the device. Greedy and penalised sampled requests get the same tokens and the very drafts of drafts made after
    the read-back (--tuning draft_after_verify=0); under pressure (chunks, preemption, prefix hits) greedy tokens
    equal plain decoding's."""
    target, drafter = small_vocab
    prompts, expected = small_vocab_plain
    kwargs = dict(skip_tokenizer_init=True, speculative="eagle3", speculative_policy="always", draft_model=str(drafter),
                  num_draft_tokens=k, max_num_seqs=6, max_model_len=160, block_size=8)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    host = through_static_buffers(LLM(str(target), kv_cache_memory="16MiB", tuning={"draft_after_verify": False},
                                      **kwargs), 6)
    assert not host.engine.proposer.drafts_after_verify and host.engine.proposer.lookahead_slots == k - 1
    reference = greedy_then_mixed(host, prompts, params, 6)
    assert not reference[3]  # (no step drafted behind)
    for extra in ({"kv_cache_memory": "16MiB"}, {"num_gpu_blocks_override": 34, "max_num_batched_tokens": 48}):
        llm = through_static_buffers(LLM(str(target), **kwargs, **extra), 6)
        proposer = llm.engine.proposer
        assert proposer.drafts_after_verify and proposer.lookahead_slots == k + 1
        tokens, counts, drafts, queued, handed_out = greedy_then_mixed(llm, prompts, params, 6)
        assert tokens[: len(prompts)] == expected
        if "num_gpu_blocks_override" in extra:
            assert llm.engine.scheduler.num_preemptions > 0
            again = llm.generate({"prompt_token_ids": prompts[0]}, params)[0]  # (its pages from the prefix cache)
            assert again.outputs[0].token_ids == expected[0] and again.num_cached_tokens > 0
            assert sum(map(bool, queued)) > len(queued) // 2
        else:
            assert (tokens, counts, drafts) == reference[:3] and counts[1] > 0
            assert all(queued)  # (every uniform verify step: the sampled batches' steps verify after read-back)
        assert proposer.blocks_behind == sum(map(bool, queued))
        assert 0.8 * sum(queued) <= sum(handed_out) <= sum(queued)
        assert_pages_returned(llm)


def test_eagle3_greedy_equals_plain_with_stop_tokens(small_vocab, small_vocab_plain):
    """A stop token inside an accepted run ends the request mid-verify; the others go on."""
    target, drafter = small_vocab
    prompts, expected = small_vocab_plain
    llm = LLM(str(target), skip_tokenizer_init=True, speculative="eagle3", speculative_policy="always",
              draft_model=str(drafter), num_draft_tokens=3, kv_cache_memory="16MiB", max_model_len=160)
    stop = expected[0][5]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params)
    for o, exp in zip(outs, expected[:4], strict=True):
        want = exp[: exp.index(stop) + 1] if stop in exp else exp
        assert o.outputs[0].token_ids == want
    assert_pages_returned(llm)


def test_eagle3_sampling_matches_the_exact_distribution(tmp_path):
    """A 5-token vocabulary, 4 layers: 3-token continuations sampled with EAGLE-3 drafts (one-hot, over a 4-id draft
    vocabulary, verified by the rejection rule) follow the exact distribution computed from transformers' logits."""
    ckpt = build_checkpoint(tmp_path, "Qwen3ForCausalLM", None, seed=4, vocab_size=TINY_VOCAB, hidden_size=32,
                            intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_hidden_layers=4)
    hf = hf_model(ckpt)

    @torch.no_grad()
    def target(prefix: tuple) -> torch.Tensor:
        return hf(torch.tensor([TINY_PROMPT + list(prefix)])).logits[0, -1].float().softmax(-1)

    exact = exact_sequence_distribution(target, TINY_VOCAB, CONTINUATION)
    drafter = write_eagle3_drafter(tmp_path / "drafter", hidden=32, vocab=TINY_VOCAB, draft_vocab=4, aux_ids=[1, 3, 4],
                                   heads=2, kv_heads=1, intermediate=64, seed=3)
    llm = LLM(str(ckpt), skip_tokenizer_init=True, kv_cache_memory="16MiB", speculative="eagle3",
              speculative_policy="always", draft_model=str(drafter), num_draft_tokens=2)
    assert_samples_follow(llm, exact)
    stats = llm.engine.stats
    assert stats.spec_num_verify_steps > 0 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


# --------------------------------------------------------------------------- refusals
def _drafter(tmp_path: Path, **kw) -> Path:
    args = dict(hidden=64, vocab=384, draft_vocab=96, aux_ids=[1, 2, 4])
    args.update(kw)
    return write_eagle3_drafter(tmp_path / "d", **args)


@pytest.mark.parametrize("case, error, match", [
    ("hidden", ConfigError, r"target hidden states of size 32 .* the target .* has hidden size 64"),
    ("draft-hidden", ConfigError, r"hidden size 48 and ships no embedding"),
    ("layers", ConfigError, r"reads target layers \[1, 2, 9\] .* has 4 layers"),
    ("embedding-layer", ConfigError, r"0, the embedding, is not"),
    ("duplicate", ConfigError, r"three distinct layers"),
    ("default-too-shallow", ConfigError, r"too few for the default ids"),
    ("d2t", ConfigError, r"d2t map sends draft ids to target ids .* outside the target's vocabulary of 384"),
    ("no-d2t", ConfigError, r"ships no d2t map"),
    ("vocab", ConfigError, r"trained for a vocabulary of 500 tokens"),
    ("arch", ModelLoadError, r"is not an EAGLE-3 drafter"),
    ("layers-count", ModelLoadError, r"has 2 decoder layers"),
])
def test_mismatched_drafters_are_refused_at_startup(tmp_path, targets, case, error, match):
    target, _ = targets["Qwen3ForCausalLM"]
    drafter = {
        "hidden": lambda: _drafter(tmp_path, target_hidden=32),
        "draft-hidden": lambda: _drafter(tmp_path, hidden=48, target_hidden=64),
        "layers": lambda: _drafter(tmp_path, aux_ids=[1, 2, 9]),
        "embedding-layer": lambda: _drafter(tmp_path, aux_ids=[0, 2, 4]),
        "duplicate": lambda: _drafter(tmp_path, aux_ids=[2, 2, 4]),
        "default-too-shallow": lambda: _drafter(tmp_path, aux_ids=None),
        "d2t": lambda: _drafter(tmp_path, d2t=torch.full((96,), 300)),
        "no-d2t": lambda: _drafter(tmp_path, with_d2t=False),
        "vocab": lambda: _drafter(tmp_path, vocab=500),
        "arch": lambda: _drafter(tmp_path, architectures=["DFlashDraftModel"]),
        "layers-count": lambda: _drafter(tmp_path, num_hidden_layers=2),
    }[case]()
    with pytest.raises(error, match=match):
        LLM(str(target), skip_tokenizer_init=True, speculative="eagle3", draft_model=str(drafter),
            kv_cache_memory="8MiB")


def test_eagle3_needs_a_draft_model_and_takes_no_token_map(targets, tmp_path):
    target, drafter = targets["Qwen3ForCausalLM"]
    with pytest.raises(ConfigError, match="--speculative eagle3 needs --draft-model PATH"):
        LLM(str(target), skip_tokenizer_init=True, speculative="eagle3", kv_cache_memory="8MiB")
    with pytest.raises(ConfigError, match="--speculative-token-map is for --speculative dflash"):
        EngineConfig(model=str(target), speculative="eagle3", draft_model=str(drafter),
                     speculative_token_map=str(tmp_path / "map.json"))
    EngineConfig(model=str(target), speculative="eagle3", draft_model=str(drafter))  # (--draft-model is its flag)


def test_a_parallel_worker_stands_in_with_the_same_k_and_layers(targets):
    """A pipeline stage captures the driver's three layers for it; a tensor-parallel worker captures none."""
    from types import SimpleNamespace

    from atlas.config import ModelConfig
    from atlas.speculative import verify_only

    target, drafter = targets["Qwen3ForCausalLM"]
    cfg = ModelConfig.from_path(target)
    for stages, layers in ((2, (0, 1, 3)), (1, ())):
        config = SimpleNamespace(speculative="eagle3", pipeline_parallel_size=stages, num_draft_tokens=None,
                                 draft_model=str(drafter), hub=None)
        worker = verify_only(config, cfg)
        assert (worker.num_draft_tokens, worker.capture_layers()) == (3, layers)


# --------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("no_tf32")
def test_eagle3_replays_its_cuda_graphs_and_keeps_plain_tokens_on_cuda(small_vocab):
    """On CUDA both of the drafter's passes replay captured graphs (the chain, and the pass over committed rows),
    whose pools stay within what the memory plan set aside for them, queued right behind the verify steps; float32
    greedy tokens equal plain decoding's, batched, with drafts accepted and every page returned."""
    target, drafter = small_vocab
    prompts = _random_prompts(12, 16, seed=4)
    common = dict(skip_tokenizer_init=True, kv_cache_memory="64MiB", max_model_len=160, dtype="float32",
                  max_num_seqs=8)
    plain = LLM(str(target), **common).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    llm = LLM(str(target), speculative="eagle3", speculative_policy="always", draft_model=str(drafter),
              num_draft_tokens=4, **common)
    proposer = llm.engine.proposer
    assert proposer.catch_up is not None and proposer.graphs is not None
    captured = (proposer.catch_up.captured_mib + proposer.graphs.captured_mib) * 2**20
    assert 0 < captured <= llm.engine.plan.breakdown["drafter cuda graphs"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert proposer.catch_up.steps_run > 0 and proposer.graphs.steps_run > 0
    assert proposer.blocks_behind > 0  # (greedy uniform verify steps: drafted right behind on the device)
    assert llm.engine.stats.spec_num_accepted_tokens > 0
    assert_pages_returned(llm)
