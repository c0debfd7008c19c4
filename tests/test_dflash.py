"""DFlash drafting: the z-lab checkpoint format, the drafter's math against a dense reference written
from the spec, lossless greedy and sampled decoding through the engine, and the capture buffer."""

from __future__ import annotations

import gc
import json
import logging
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_pages_returned,
    build_checkpoint,
    continuous_arrivals,
    hf_model,
    run_cases_script,
    run_in_triton_interpreter,
    step_input_numbers,
    tool_module,
)
from safetensors.torch import load_file, save_file
from spec_stats import assert_samples_follow, tiny_vocab_target

from atlas import LLM, SamplingParams
from atlas.errors import ConfigError, ModelLoadError
from atlas.models.dflash import DFlashConfig, default_target_layer_ids
from atlas.runtime.model_runner import ModelRunner
from atlas.runtime.request_tables import snapshot_batch
from atlas.runtime.step_inputs import InputPreparer
from atlas.speculative.proposer import CommittedTokens

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def write_drafter(out: Path, hidden: int, layer_ids: list[int], mask_token_id: int, num_layers: int = 2,
                  block_size: int = 4, heads: int = 2, kv_heads: int = 1, head_dim: int = 16,
                  intermediate: int = 64, seed: int = 0, prefix: str = "", fc_in: int | None = None,
                  dflash_extra: dict | None = None, **config_fields) -> Path:
    """A random drafter exactly as z-lab ships one: config.json (DFlashDraftModel, dflash_config,
    top-level block_size and num_target_layers) and model.safetensors with unprefixed keys and no
    embedding or LM head."""
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": num_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 512, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "vocab_size": 384, "torch_dtype": "float32",
        "block_size": block_size, "num_target_layers": 36,
        "layer_types": ["full_attention"] * num_layers,
        "dflash_config": {"target_layer_ids": layer_ids, "mask_token_id": mask_token_id, **(dflash_extra or {})},
    }
    config.update(config_fields)
    config = {k: v for k, v in config.items() if v is not None}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / cols ** 0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    w = {"fc.weight": mat(hidden, fc_in or len(layer_ids) * hidden), "hidden_norm.weight": norm(hidden),
         "norm.weight": norm(hidden)}
    for i in range(num_layers):
        p = f"layers.{i}."
        w |= {p + "self_attn.q_proj.weight": mat(heads * head_dim, hidden),
              p + "self_attn.k_proj.weight": mat(kv_heads * head_dim, hidden),
              p + "self_attn.v_proj.weight": mat(kv_heads * head_dim, hidden),
              p + "self_attn.o_proj.weight": mat(hidden, heads * head_dim),
              p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim),
              p + "mlp.gate_proj.weight": mat(intermediate, hidden), p + "mlp.up_proj.weight": mat(intermediate, hidden),
              p + "mlp.down_proj.weight": mat(hidden, intermediate),
              p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden)}
    save_file({prefix + k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    return out


# --------------------------------------------------------------------------- the dense reference
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def target_features(hf_target, token_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """[n, len(layer_ids) * H]: HF hidden_states[id + 1] for each id. transformers returns the LAST
    entry after the final norm, so for the last layer the residual stream is taken from the layer's
    output instead (the spec: capture after the loop, before the final norm)."""
    layers = hf_target.model.layers
    outputs: dict[int, torch.Tensor] = {}
    hooks = [layers[-1].register_forward_hook(
        lambda mod, args, out: outputs.__setitem__(len(layers) - 1, out[0] if isinstance(out, tuple) else out))]
    try:
        with torch.no_grad():
            hs = hf_target(torch.tensor([token_ids]), output_hidden_states=True).hidden_states
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([(outputs[i] if i == len(layers) - 1 else hs[i + 1])[0] for i in layer_ids], dim=-1)


def dense_reference_logits(hf_target, drafter_dir: Path, context_ids: list[int], x0: int, k: int) -> torch.Tensor:
    """The spec's forward, written out densely: target hidden_states[id + 1] of the context ->
    fc -> hidden_norm -> per-layer injected K/V; the block [x0, MASK x k] embedded by the target; each
    layer attends (no mask) over context ++ block with RoPE at absolute positions; final norm; the
    target's LM head on block rows 1..k. -> logits [k, V]."""
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    raw = json.loads((drafter_dir / "config.json").read_text())
    w = {name.removeprefix("model."): t.float() for name, t in load_file(str(drafter_dir / "model.safetensors")).items()}
    ids = raw["dflash_config"]["target_layer_ids"]
    mask = raw["dflash_config"]["mask_token_id"]
    heads, kv_heads, d = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    hf_cfg = AutoConfig.for_model("qwen3", **{k2: v for k2, v in raw.items() if k2 not in ("architectures", "auto_map", "model_type",
                                                                                           "dflash_config")})
    n = len(context_ids)
    with torch.no_grad():
        feat = target_features(hf_target, context_ids, ids)
        c = _rms(feat @ w["fc.weight"].T, w["hidden_norm.weight"])
        block = torch.tensor([x0] + [mask] * k)
        h = hf_target.get_input_embeddings()(block)
        positions = torch.arange(n + k + 1)[None]
        cos, sin = Qwen3RotaryEmbedding(hf_cfg)(h[None], positions)
        cos, sin = cos[0][:, None], sin[0][:, None]  # [n + k + 1, 1, d]

        def rope(x: torch.Tensor, pos: slice) -> torch.Tensor:
            return x * cos[pos] + _rotate_half(x) * sin[pos]

        for i in range(raw["num_hidden_layers"]):
            p = f"layers.{i}."
            x = _rms(h, w[p + "input_layernorm.weight"])
            q = _rms((x @ w[p + "self_attn.q_proj.weight"].T).view(-1, heads, d), w[p + "self_attn.q_norm.weight"])
            k_all = torch.cat([c, x]) @ w[p + "self_attn.k_proj.weight"].T
            v_all = (torch.cat([c, x]) @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, d)
            k_all = _rms(k_all.view(-1, kv_heads, d), w[p + "self_attn.k_norm.weight"])
            q = rope(q, slice(n, n + k + 1))
            k_all = rope(k_all, slice(0, n + k + 1))
            rep = heads // kv_heads
            k_all, v_all = k_all.repeat_interleave(rep, 1), v_all.repeat_interleave(rep, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k_all) * d ** -0.5
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v_all).reshape(k + 1, heads * d)
            h = h + attn @ w[p + "self_attn.o_proj.weight"].T
            x = _rms(h, w[p + "post_attention_layernorm.weight"])
            h = h + (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) \
                @ w[p + "mlp.down_proj.weight"].T
        out = _rms(h, w["norm.weight"])
        return hf_target.lm_head(out[1:]).float()


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> Path:
    """For the conftest Qwen3 target (2 layers, hidden 64, vocab 384): both layers, YaRN RoPE of its own,
    block size from dflash_config (wins over the top-level one), mask id past the tokenizer's tokens."""
    return write_drafter(tmp_path_factory.mktemp("drafter"), hidden=64, layer_ids=[0, 1], mask_token_id=383,
                         num_layers=2, block_size=16, heads=4, kv_heads=2, head_dim=16, intermediate=96,
                         dflash_extra={"block_size": 5},
                         rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64})


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory) -> tuple[Path, Path]:
    """A 4-layer, 16-token target (drafts are often right, often wrong) and a drafter reading layers 1
    and 3 (the last: captured after the loop, before the final norm), with a `model.` key prefix."""
    root = tmp_path_factory.mktemp("small")
    target = build_checkpoint(root, "Qwen3ForCausalLM", None, seed=1, vocab_size=16, hidden_size=32,
                              intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              num_hidden_layers=4)
    drafter = write_drafter(root / "drafter", hidden=32, layer_ids=[1, 3], mask_token_id=15, block_size=4,
                            prefix="model.")
    return target, drafter


def _random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


# --------------------------------------------------------------------------- format and validation
def test_default_target_layer_ids_follow_the_zlab_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(6, 2) == [1, 3]


def test_config_fields(tmp_path, drafter_dir):
    cfg = DFlashConfig.from_path(drafter_dir)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (5, 383, [0, 1])
    assert cfg.rope.rope_type == "yarn" and cfg.rope.theta == 1e6 and cfg.fc_in_features == 128
    assert cfg.sliding_windows == [None, None] and not cfg.causal
    # No layer ids: the default rule over num_target_layers; top-level block_size when dflash_config has none.
    d = write_drafter(tmp_path / "d", 64, [0], 383, num_layers=5, block_size=8)
    raw = json.loads((d / "config.json").read_text())
    del raw["dflash_config"]["target_layer_ids"]
    cfg = DFlashConfig.from_dict(raw, d)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.block_size == 8
    raw["layer_types"] = ["sliding_attention"] + ["full_attention"] * 4
    raw["sliding_window"] = 64
    assert DFlashConfig.from_dict(raw, d).sliding_windows == [64, None, None, None, None]


def test_loader_reads_the_zlab_format(qwen3_dir, drafter_dir):
    llm = LLM(str(qwen3_dir), speculative="dflash", speculative_policy="always", draft_model=str(drafter_dir), kv_cache_memory="8MiB")
    proposer = llm.engine.proposer
    assert proposer.capture_layers() == (0, 1)
    assert proposer.num_draft_tokens == 4 and proposer.lookahead_slots == 5
    assert proposer.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x fp32
    n_params = 64 * 128 + 2 * 64 + 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 2 * 16 + 3 * 64 * 96 + 2 * 64)
    assert proposer.weight_bytes() == 4 * n_params
    # The drafter's cache has the target's page ids: the pool's pages and the graphs' scratch pages.
    assert len(proposer.kv_caches) == 2 and proposer.kv_caches[0].shape[1] == llm.engine.runner.kv_caches[0].shape[1]
    assert llm.engine.runner.kv_caches[0].shape[1] == llm.engine.plan.num_pages + len(llm.engine.runner.scratch_pages)
    assert llm.engine.runner.capture.width == 2 * 64
    # A smaller K than the block allows.
    llm = LLM(str(qwen3_dir), speculative="dflash", speculative_policy="always", draft_model=str(drafter_dir), num_draft_tokens=2,
              kv_cache_memory="8MiB")
    assert llm.engine.proposer.num_draft_tokens == 2 and llm.engine.proposer.lookahead_slots == 3


@pytest.mark.parametrize("case, error, match", [
    ("hidden", ConfigError, "hidden size 32, the target .* has 64"),
    ("fc", ModelLoadError, r"fc.weight is \[64, 192\] but 2 target layers \[0, 1\] of hidden size 64 need \[64, 128\]"),
    ("layer", ConfigError, r"reads target layers \[0, 2\], but the target has only 2 layers"),
    ("mask", ConfigError, "mask_token_id 384, outside the target's vocabulary of 384"),
    ("k", ConfigError, "--num-draft-tokens 5 does not fit .* block size 5 allows 1 to 4"),
    ("heads", ConfigError, r"num_attention_heads \(3\) is not a multiple of num_key_value_heads \(2\)"),
    ("no-drafter", ConfigError, "--speculative dflash needs --draft-model"),
    ("not-a-drafter", ModelLoadError, "is not a DFlash drafter"),
])
def test_mismatched_drafters_are_refused_at_startup(tmp_path, qwen3_dir, case, error, match):
    kwargs: dict = {}
    base = dict(hidden=64, layer_ids=[0, 1], mask_token_id=383, heads=4, kv_heads=2, head_dim=16,
                dflash_extra={"block_size": 5})
    if case == "hidden":
        base |= dict(hidden=32)
    elif case == "fc":
        base |= dict(fc_in=192)
    elif case == "layer":
        base |= dict(layer_ids=[0, 2])
    elif case == "mask":
        base |= dict(mask_token_id=384)
    elif case == "k":
        kwargs["num_draft_tokens"] = 5
    elif case == "heads":
        base |= dict(heads=3)
    path = write_drafter(tmp_path / "d", **base)
    if case == "no-drafter":
        path = None
    elif case == "not-a-drafter":
        path = qwen3_dir
    with pytest.raises(error, match=match):
        LLM(str(qwen3_dir), speculative="dflash", speculative_policy="always", draft_model=str(path) if path else None, kv_cache_memory="8MiB",
            **kwargs)


def test_a_drafter_shipped_inside_the_model_folder_is_the_default(tmp_path, qwen3_dir, drafter_dir):
    import shutil

    target = tmp_path / "model"
    shutil.copytree(qwen3_dir, target)
    shutil.copytree(drafter_dir, target / "dflash-drafter")
    llm = LLM(str(target), speculative="dflash", speculative_policy="always", kv_cache_memory="8MiB")
    assert llm.engine.proposer.config.path == target / "dflash-drafter"


# --------------------------------------------------------------------------- numerics
def test_paged_block_logits_equal_the_dense_reference(qwen3_dir, drafter_dir):
    """Two requests in one flat block forward, scattered pages, context written in several commits
    (one with fewer captured rows than tokens, then completed), against the dense spec forward."""
    hf = hf_model(qwen3_dir)
    llm = LLM(str(qwen3_dir), speculative="dflash", speculative_policy="always", draft_model=str(drafter_dir), kv_cache_memory="8MiB",
              block_size=4, enable_prefix_caching=False)
    proposer = llm.engine.proposer
    k = proposer.num_draft_tokens
    g = torch.Generator().manual_seed(5)
    contexts = [torch.randint(1, 380, (n,), generator=g).tolist() for n in (11, 6)]
    x0s = [17, 250]
    pages = [[9, 2, 30, 5, 11], [4, 21, 7]]
    requests = [SimpleNamespace(request_id=f"r{i}", all_token_ids=ctx + [x0], num_computed_tokens=len(ctx),
                                page_ids=p) for i, (ctx, x0, p) in enumerate(zip(contexts, x0s, pages, strict=True))]
    feats = [target_features(hf, c, [0, 1]) for c in contexts]
    # Request 0: positions 0..6 arrive with only their last 4 rows captured, then 0..2 on their own
    # (as a recomputation would), then 7..10; request 1 in one commit.
    proposer.on_commit([CommittedTokens(requests[0], 0, 7, feats[0][3:7]),
                        CommittedTokens(requests[1], 0, 6, feats[1])])
    proposer.on_commit([CommittedTokens(requests[0], 0, 3, feats[0][0:3]),
                        CommittedTokens(requests[0], 7, 4, feats[0][7:11])])
    with torch.inference_mode():
        got = llm.engine.runner.model.compute_logits(proposer.block_hidden(requests).flatten(0, 1)).view(2, k, -1)
    for i, (ctx, x0) in enumerate(zip(contexts, x0s, strict=True)):
        ref = dense_reference_logits(hf, drafter_dir, ctx, x0, k)
        torch.testing.assert_close(got[i], ref, atol=2e-4, rtol=2e-4)
    drafts = proposer.propose(requests)
    assert proposer.device_drafts and all(d.device_tokens is not None for d in drafts)  # (the default)
    assert [d.read_tokens() for d in drafts] == got.argmax(-1).tolist() and drafts[0].probs is None


def test_engine_drafts_equal_the_reference_with_chunked_prefill_and_prefix_hits(qwen3_dir, drafter_dir):
    """Through the engine (capture after the listed layers, context from prefill chunks, prefix-cache
    hits and verify rows): each draft is the dense reference's argmax given the committed tokens."""
    hf = hf_model(qwen3_dir)
    llm = LLM(str(qwen3_dir), speculative="dflash", speculative_policy="always", draft_model=str(drafter_dir), kv_cache_memory="8MiB",
              block_size=4, max_num_batched_tokens=16)
    proposer = llm.engine.proposer
    calls: list[tuple[list[int], list[int]]] = []
    original = proposer.propose

    def recording(requests):
        drafts = original(requests)
        calls.extend((list(r.all_token_ids), d.read_tokens()) for r, d in zip(requests, drafts, strict=True))
        return drafts

    proposer.propose = recording
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(1, 380, (37,), generator=g).tolist()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt}, params)[0]
    second = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert second.num_cached_tokens > 0 and first.outputs[0].token_ids == second.outputs[0].token_ids
    assert len(calls) >= 4
    for tokens, drafts in calls:
        ref = dense_reference_logits(hf, drafter_dir, tokens[:-1], tokens[-1], proposer.num_draft_tokens)
        chosen = ref.gather(1, torch.tensor(drafts)[:, None])[:, 0]
        assert torch.all(chosen >= ref.max(-1).values - 1e-4), (tokens, drafts, ref.argmax(-1).tolist())


# --------------------------------------------------------------------------- lossless decoding
@pytest.fixture(scope="module")
def small_vocab_plain(small_vocab):
    target, _ = small_vocab
    prompts = _random_prompts(12, 16)
    llm = LLM(str(target), skip_tokenizer_init=True, kv_cache_memory="16MiB", max_model_len=160,
              enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("k", [None, 2])
def test_dflash_greedy_equals_plain_under_pressure(small_vocab, small_vocab_plain, k):
    """Batched, prefix caching on, chunked prefill and forced preemption."""
    target, drafter = small_vocab
    prompts, expected = small_vocab_plain
    llm = LLM(str(target), skip_tokenizer_init=True, speculative="dflash", speculative_policy="always", draft_model=str(drafter),
              num_draft_tokens=k, num_gpu_blocks_override=30, block_size=8, max_num_batched_tokens=48, max_num_seqs=6,
              max_model_len=160)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    for _ in range(2):  # the second run reads the first one's pages (target and draft KV) from the prefix cache
        again = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY)[0]
        assert again.outputs[0].token_ids == expected[0]
    assert again.num_cached_tokens > 0
    stats = llm.engine.stats
    assert stats.spec_num_verify_steps > 0 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.stats.hits > 0
    assert_pages_returned(llm)


def test_a_token_map_drafts_from_its_ids_and_keeps_the_outputs(tmp_path, small_vocab, small_vocab_plain):
    """--speculative-token-map: drafts come from the listed ids only and outputs stay plain decoding's; a map
    of every id (in any order) drafts exactly what the whole LM head does: the same accepted drafts."""
    target, drafter = small_vocab
    prompts, expected = small_vocab_plain
    kwargs = dict(skip_tokenizer_init=True, speculative="dflash", speculative_policy="always", draft_model=str(drafter), kv_cache_memory="16MiB",
                  max_model_len=160, max_num_seqs=6)

    def run(**extra):
        llm = LLM(str(target), **kwargs, **extra)
        drafted = []
        argmax = llm.engine.proposer._argmax_logits

        def recording(rows, argmax=argmax):
            ids = argmax(rows)
            drafted.append(ids.clone())
            return ids

        llm.engine.proposer._argmax_logits = recording
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        stats = llm.engine.stats
        assert_pages_returned(llm)
        return ([o.outputs[0].token_ids for o in outs], (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens),
                torch.cat(drafted), llm)

    tokens, whole_stats, _, llm = run()
    assert tokens == expected and whole_stats[1] > 0
    vocab = llm.engine.model_config.vocab_size
    every = tmp_path / "every.json"
    every.write_text(json.dumps(list(range(vocab))[::-1]))
    tokens, stats, _, llm = run(speculative_token_map=str(every))
    assert tokens == expected and stats == whole_stats
    assert llm.engine.proposer.token_map.ids.tolist() == list(range(vocab))
    even = tmp_path / "even.pt"
    torch.save(torch.arange(0, vocab, 2), even)
    tokens, _, drafted, llm = run(speculative_token_map=str(even))
    assert tokens == expected
    assert drafted.numel() > 0 and bool((drafted % 2 == 0).all())
    assert llm.engine.proposer.weight_bytes() > sum(p.numel() * p.element_size()
                                                      for p in llm.engine.proposer.model.parameters())


def test_most_frequent_tokens_keeps_the_top_ids_and_the_forced_ones():
    from atlas.speculative.token_map import most_frequent_tokens

    counts = [[5, 5, 5, 2, 2, 7, 7, 9], [2, 3]]  # 5: 3, 2: 3, 7: 2, 9: 1, 3: 1
    ids, coverage = most_frequent_tokens(counts, 12, 3)
    assert ids.tolist() == [2, 5, 7] and coverage == pytest.approx(8 / 10)
    ids, coverage = most_frequent_tokens(counts, 12, 3, always=[11])  # (forced, never seen)
    assert ids.tolist() == [2, 5, 11] and coverage == pytest.approx(6 / 10)
    ids, _ = most_frequent_tokens(counts, 12, 3, always=[5])  # (forced and frequent: no room lost)
    assert ids.tolist() == [2, 5, 7]
    assert most_frequent_tokens(counts, 12, 4)[0].tolist() == [2, 3, 5, 7]  # (ties: the lower id)
    with pytest.raises(ConfigError, match="no text"):
        most_frequent_tokens([[]], 12, 3)


def test_atlas_token_map_command_writes_a_map_the_engine_serves(tmp_path, qwen3_dir, drafter_dir, capsys):
    """`atlas token-map` counts a corpus (text and JSONL records) with the model's tokenizer; the map it writes
    holds the frequent ids and the end-of-sequence token, and an engine drafts from it with unchanged outputs."""
    from atlas.cli import main
    from atlas.engine.tokenizer import Tokenizer

    text = tmp_path / "corpus.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 50)
    records = tmp_path / "chat.jsonl"
    records.write_text(json.dumps({"messages": [{"role": "user", "content": "print the sum"}]}) + "\n"
                       + json.dumps({"prompt": "import os", "completion": " and sys"}) + "\n")
    out = tmp_path / "map.pt"
    assert main(["token-map", "--model", str(qwen3_dir), "--corpus", str(text), str(records), "--size", "40",
                 "--out", str(out)]) == 0
    assert "token ids of" in capsys.readouterr().out
    ids = torch.load(out, weights_only=True)
    tokenizer = Tokenizer(qwen3_dir)
    assert ids.numel() == 40 and ids.tolist() == sorted(set(ids.tolist()))
    assert tokenizer.eos_token_id in ids.tolist()
    assert set(tokenizer.encode("def add(a, b):", add_special_tokens=False)) <= set(ids.tolist())
    assert main(["token-map", "--model", str(qwen3_dir), "--corpus", str(tmp_path / "none.txt"),
                 "--out", str(out)]) == 2
    prompt = tokenizer.encode("def add(a, b):\n    return", add_special_tokens=False)
    plain = LLM(str(qwen3_dir), kv_cache_memory="16MiB").generate({"prompt_token_ids": prompt}, GREEDY)
    llm = LLM(str(qwen3_dir), kv_cache_memory="16MiB", speculative="dflash", speculative_policy="always", draft_model=str(drafter_dir),
              speculative_token_map=str(out))
    assert llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.engine.proposer.token_map.ids.tolist() == ids.tolist()


@pytest.mark.parametrize("content, match", [
    (None, "no file at"),
    ("[]", "holds no token ids"),
    ("[1, 2, 2]", "repeats 1 token ids"),
    ("[1, -3]", "id -3, outside"),
    ("[1, 100000000]", "id 100000000, outside"),
    ("[[1, 2]]", "1-D list or tensor of integer"),
    ("[1.5]", "1-D list or tensor of integer"),
    ("{not json", "cannot read"),
])
def test_bad_token_maps_are_refused_with_the_fix(tmp_path, small_vocab, content, match):
    target, drafter = small_vocab
    path = tmp_path / "map.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        LLM(str(target), skip_tokenizer_init=True, speculative="dflash", speculative_policy="always", draft_model=str(drafter),
            kv_cache_memory="16MiB", max_model_len=160, speculative_token_map=str(path))


def test_a_token_map_is_for_dflash_and_mtp_only(tmp_path, small_vocab):
    target, _ = small_vocab
    with pytest.raises(ConfigError, match="--speculative-token-map is for --speculative dflash or mtp, not ngram"):
        LLM(str(target), skip_tokenizer_init=True, speculative="ngram", speculative_policy="always", speculative_token_map=str(tmp_path / "m.pt"))
    with pytest.raises(ConfigError, match="--speculative-token-map needs --speculative"):
        LLM(str(target), skip_tokenizer_init=True, speculative_token_map=str(tmp_path / "m.pt"))


def _greedy_then_mixed(llm, prompts: list[list[int]], mixed: int) -> tuple[list[list[int]], tuple[int, int, int]]:
    """Greedy outputs of every prompt, then of the first `mixed` prompts with half of them sampled under a
    repetition penalty (which reads the drafts' values); -> (the tokens, (drafts, accepted, preemptions))."""
    sampled = [SamplingParams(max_tokens=24, temperature=0.8, seed=i, repetition_penalty=1.3, ignore_eos=True)
               for i in range(mixed // 2)]
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    both = llm.generate([{"prompt_token_ids": p} for p in prompts[:mixed]], [GREEDY] * (mixed - len(sampled)) + sampled)
    stats = llm.engine.stats
    return ([o.outputs[0].token_ids for o in greedy + both],
            (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens, llm.engine.scheduler.num_preemptions))


def _through_static_buffers(llm, max_num_seqs: int):
    """The uniform-step paths CUDA graphs replay (target steps and the drafter's block), run eagerly."""
    k = llm.engine.proposer.num_draft_tokens
    llm.engine.runner.capture_step_graphs(max_num_seqs, [1, k + 1], use_graphs=False)
    llm.engine.proposer.capture_block_graphs(use_graphs=False)
    if llm.engine.proposer.drafts_after_verify:
        llm.engine.proposer.bind_verify_graphs(llm.engine.runner.step_graphs[k + 1])
    return llm


def test_drafts_left_on_the_device_give_the_same_tokens(small_vocab, small_vocab_plain):
    """Drafts left on the device (the default; --tuning device_drafts=0 reads them back at once): the verify
    step takes its input ids from there and reads them back with its results. Under pressure (chunked prefill, preemption), through the static
    buffers of the CUDA graphs, with greedy requests and sampled ones with a repetition penalty (which
    reads the drafts' values): the same tokens and accepted drafts as drafts read back at once."""
    target, drafter = small_vocab
    prompts, expected = small_vocab_plain
    kwargs = dict(skip_tokenizer_init=True, speculative="dflash", speculative_policy="always", draft_model=str(drafter), num_gpu_blocks_override=30,
                  block_size=8, max_num_batched_tokens=48, max_num_seqs=6, max_model_len=160)

    def run(llm):
        return _greedy_then_mixed(llm, prompts, 8)

    # (Blocks drafted right after verify steps reserve their pages earlier, which moves preemptions: they
    #  are checked on their own below.)
    host_llm = LLM(str(target), tuning={"draft_after_verify": False, "device_drafts": False}, **kwargs)
    assert not host_llm.engine.proposer.device_drafts
    host_tokens, host_stats = run(host_llm)
    for buffered in (False, True):
        llm = LLM(str(target), tuning={"draft_after_verify": False}, **kwargs)
        proposer = llm.engine.proposer
        assert proposer.device_drafts
        if buffered:
            _through_static_buffers(llm, 6)
        left = []

        def recording(requests, propose=proposer.propose, left=left):
            drafts = propose(requests)
            left.extend(d.device_tokens is not None for d in drafts)
            return drafts

        proposer.propose = recording
        tokens, stats = run(llm)
        assert tokens[: len(prompts)] == expected and tokens == host_tokens
        assert stats == host_stats and stats[1] > 0 and stats[2] > 0
        assert left and all(left)
        assert_pages_returned(llm)


def test_blocks_drafted_right_after_verify_steps_give_the_same_tokens(small_vocab, small_vocab_plain):
    """The next block queued right behind each verify step, from the accepted drafts the device tells (the
    default where drafts stay on the device and verify steps are uniform), through the static buffers CUDA
    graphs replay: greedy and penalised sampled requests get the same tokens and accepted drafts as blocks
    drafted after the read-back (--tuning draft_after_verify=0; steps with a sampled request fall back), and
    under pressure (chunked prefill, preemption, prefix hits) greedy tokens equal plain decoding."""
    target, drafter = small_vocab
    prompts, expected = small_vocab_plain
    kwargs = dict(skip_tokenizer_init=True, speculative="dflash", speculative_policy="always", draft_model=str(drafter), block_size=8,
                  max_num_seqs=6, max_model_len=160)
    pressure = dict(num_gpu_blocks_override=34, max_num_batched_tokens=48)

    def run(llm):
        tokens, stats = _greedy_then_mixed(llm, prompts, 6)
        return tokens, stats[:2]  # (preemptions move: pages are reserved earlier)

    def buffered(llm):
        return _through_static_buffers(llm, 6)

    after_read_back = buffered(LLM(str(target), kv_cache_memory="16MiB", tuning={"draft_after_verify": False},
                                   **kwargs))
    assert not after_read_back.engine.proposer.drafts_after_verify
    reference = run(after_read_back)
    for extra in ({"kv_cache_memory": "16MiB"}, pressure):
        llm = buffered(LLM(str(target), **kwargs, **extra))
        proposer = llm.engine.proposer
        assert proposer.drafts_after_verify and llm.engine.runner.draft_after_verify is not None
        queued, handed_out = [], []

        def recording_after(step, after=proposer.draft_after_verify, queued=queued):
            done = after(step)
            queued.append(len(step.request_ids) if done else 0)
            return done

        def recording_propose(requests, propose=proposer.propose, proposer=proposer, handed_out=handed_out):
            handed_out.extend(r.request_id in proposer.behind.ready for r in requests)
            return propose(requests)

        llm.engine.runner.draft_after_verify = recording_after
        proposer.propose = recording_propose
        tokens, stats = run(llm)
        assert tokens[: len(prompts)] == expected
        if extra is pressure:
            assert llm.engine.scheduler.num_preemptions > 0
            again = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY)[0]  # (its pages from the prefix cache)
            assert again.outputs[0].token_ids == expected[0] and again.num_cached_tokens > 0
        else:
            assert (tokens, stats) == reference and stats[1] > 0
        # Every uniform verify step drafted behind itself where pages sufficed, and the drafts of the requests
        # that went on were handed out (the rest: drafts after prefill or mixed steps, sampled batches).
        assert all(queued) if extra is not pressure else sum(map(bool, queued)) > len(queued) // 2
        assert 0.8 * sum(queued) <= sum(handed_out) <= sum(queued)
        # Each as one replay over the verify step's buffers (drafts cut short too).
        assert proposer.blocks_behind == sum(map(bool, queued))
        assert_pages_returned(llm)



def test_the_verify_step_of_a_block_behind_takes_its_inputs_from_the_device(small_vocab, small_vocab_plain):
    """A verify step of exactly the block queued behind the last one (the same requests, each verifying that
    block's whole drafts) takes the block's ids, positions, slots and lengths from the device
    (InputPreparer.prepare_behind): every such step, prepared the usual way too, gives the same numbers, with and
    without page pressure (the pages the block wrote to are kept for the step); greedy tokens equal plain decoding."""
    target, drafter = small_vocab
    prompts, expected = small_vocab_plain
    kwargs = dict(skip_tokenizer_init=True, speculative="dflash", speculative_policy="always", draft_model=str(drafter), block_size=8,
                  max_num_seqs=6, max_model_len=160)
    for extra in ({"kv_cache_memory": "16MiB"}, {"num_gpu_blocks_override": 34, "max_num_batched_tokens": 48}):
        llm = _through_static_buffers(LLM(str(target), **kwargs, **extra), 6)
        runner = llm.engine.runner
        compared = []

        def both_ways(batch, following, requests, runner=runner, compared=compared):
            preparer = runner.inputs
            usual = step_input_numbers(preparer.prepare(batch))  # (first: both fill the same reused buffers)
            fast = InputPreparer.prepare_behind(preparer, batch, following, requests)
            if fast is None:
                return None
            numbers = step_input_numbers(fast)
            assert numbers.keys() == usual.keys()
            for key, value in usual.items():
                same = torch.equal(numbers[key], value) if isinstance(value, torch.Tensor) else numbers[key] == value
                assert same, (key, numbers[key], value)
            compared.append(len(batch.seqs))
            return fast

        runner.prepare_inputs(snapshot_batch([], []))  # (makes the preparer)
        runner.inputs.prepare_behind = both_ways
        tokens, _ = _greedy_then_mixed(llm, prompts, 6)
        assert tokens[: len(prompts)] == expected
        assert compared and runner.steps_behind == len(compared) and max(compared) > 1
        if "num_gpu_blocks_override" in extra:
            assert llm.engine.scheduler.num_preemptions > 0
        assert_pages_returned(llm)


def test_verify_steps_queued_behind_the_block_give_the_same_tokens(small_vocab, small_vocab_plain):
    """--tuning prelaunch_verify=1: the verify step after a drafted block is queued on the device behind it, from
    the block's ids, positions, slots and lengths, before the host schedules it; the next launch adopts it when
    it schedules that very step, else drops it. Through the static buffers CUDA graphs replay: one request at a
    time (most steps adopted) and batches with sampled requests and waiting ones (dropped or not queued), the
    same tokens and accepted drafts as without; under page pressure, greedy tokens equal plain decoding."""
    target, drafter = small_vocab
    prompts, expected = small_vocab_plain
    kwargs = dict(skip_tokenizer_init=True, speculative="dflash", speculative_policy="always", draft_model=str(drafter), block_size=8,
                  max_num_seqs=6, max_model_len=160)

    # A stop token well inside the first output ends that request with a step queued behind its last block.
    stopping = SamplingParams(max_tokens=32, temperature=0, stop_token_ids=[expected[0][12]])

    def run(llm):
        one_by_one = [llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in prompts[:3]]
        stopped = llm.generate({"prompt_token_ids": prompts[0]}, stopping)[0].outputs[0].token_ids
        tokens, stats = _greedy_then_mixed(llm, prompts, 6)
        return one_by_one + [stopped] + tokens, stats[:2]

    reference = run(_through_static_buffers(LLM(str(target), kv_cache_memory="16MiB", **kwargs), 6))
    for extra in ({"kv_cache_memory": "16MiB"}, {"num_gpu_blocks_override": 34, "max_num_batched_tokens": 48}):
        llm = _through_static_buffers(LLM(str(target), tuning={"prelaunch_verify": True}, **kwargs, **extra), 6)
        runner = llm.engine.runner
        assert runner.prelaunch_allowed is not None
        tokens, stats = run(llm)
        assert tokens[:3] == expected[:3] and tokens[4: 4 + len(prompts)] == expected
        assert tokens[3] == expected[0][: expected[0].index(expected[0][12]) + 1]
        if "kv_cache_memory" in extra:
            assert (tokens, stats) == reference
        else:
            assert llm.engine.scheduler.num_preemptions > 0
        # Most queued steps were the next step; the others (a request ending, a batch changing) were dropped.
        assert runner.prelaunches_adopted > runner.prelaunches // 2
        assert runner.prelaunches > runner.prelaunches_adopted  # (the stopped request's was dropped)
        assert_pages_returned(llm)


def test_dflash_sampling_matches_the_exact_distribution(tmp_path):
    """A 5-token vocabulary: 3-token continuations sampled with DFlash drafts (one-hot, verified by
    the rejection rule) follow the exact distribution computed from transformers' logits."""
    ckpt, exact = tiny_vocab_target(tmp_path)
    drafter = write_drafter(tmp_path / "drafter", hidden=32, layer_ids=[0, 1], mask_token_id=4, block_size=3,
                            seed=3)
    llm = LLM(str(ckpt), skip_tokenizer_init=True, kv_cache_memory="16MiB", speculative="dflash", speculative_policy="always",
              draft_model=str(drafter))
    assert_samples_follow(llm, exact)
    stats = llm.engine.stats
    assert stats.spec_num_verify_steps > 0 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


# --------------------------------------------------------------------------- the capture buffer
class RecordingAllocator:
    """Stands in for torch.empty in HiddenCapture: records each allocation and whether every buffer
    it handed out before is already gone; can fail one call with OutOfMemoryError."""

    def __init__(self, fail_call: int | None = None):
        self.fail_call = fail_call
        self.calls: list[dict] = []
        self.refs: list[weakref.ref] = []

    def __call__(self, shape, dtype, device):
        gc.collect()
        record = {"rows": shape[0], "previous_alive": sum(r() is not None for r in self.refs)}
        self.calls.append(record)
        if self.fail_call is not None and len(self.calls) == self.fail_call:
            record["failed"] = True
            raise torch.OutOfMemoryError("simulated: no memory for the capture buffer")
        t = torch.empty(shape, dtype=dtype, device=device)
        self.refs.append(weakref.ref(t))
        return t


def _sliding_drafter(root: Path) -> Path:
    """Every layer has a 6-token window: prefill rows past the window are of no use, so the buffer shrinks."""
    return write_drafter(root, hidden=32, layer_ids=[1, 3], mask_token_id=15, block_size=4,
                         layer_types=["sliding_attention"] * 2, sliding_window=6)


def _install(monkeypatch, allocator) -> None:
    original = ModelRunner.install_capture

    def install(self, layers, rows, min_rows, allocator_=None):
        return original(self, layers, rows, min_rows, allocator)

    monkeypatch.setattr(ModelRunner, "install_capture", install)


def test_capture_buffer_shrinks_freeing_the_old_one_first(tmp_path, monkeypatch, small_vocab, small_vocab_plain):
    target, _ = small_vocab
    prompts, expected = small_vocab_plain
    allocator = RecordingAllocator()
    _install(monkeypatch, allocator)
    llm = LLM(str(target), skip_tokenizer_init=True, speculative="dflash", speculative_policy="always", draft_model=str(_sliding_drafter(tmp_path)),
              max_num_batched_tokens=128, max_num_seqs=4, kv_cache_memory="16MiB", max_model_len=160)
    proposer = llm.engine.proposer
    # Planned for a full step (128 rows), then rightsized to 4 sequences x (window 6 + block 4) rows.
    assert [c["rows"] for c in allocator.calls] == [128, 40]
    assert allocator.calls[1]["previous_alive"] == 0  # the 128-row buffer was gone before the new one
    assert proposer.prefill_hidden_rows(128) == 40 and llm.engine.runner.capture.rows == 40
    assert llm.engine.runner.capture.prefill_enabled
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:6]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected[:6]
    assert llm.engine.stats.spec_num_accepted_tokens > 0


def test_failed_capture_allocation_turns_prefill_capture_off(tmp_path, monkeypatch, caplog, small_vocab,
                                                              small_vocab_plain):
    target, _ = small_vocab
    prompts, expected = small_vocab_plain
    allocator = RecordingAllocator(fail_call=2)
    _install(monkeypatch, allocator)
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(target), skip_tokenizer_init=True, speculative="dflash", speculative_policy="always",
                  draft_model=str(_sliding_drafter(tmp_path)), max_num_batched_tokens=128, max_num_seqs=4,
                  kv_cache_memory="16MiB", max_model_len=160)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "capture buffer" in warnings[0].getMessage()
    capture = llm.engine.runner.capture
    assert not capture.prefill_enabled and capture.rows == capture.min_rows == 4 * 4
    assert [c["rows"] for c in allocator.calls] == [128, 40, 16] and allocator.calls[1]["previous_alive"] == 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.stats.spec_num_verify_steps > 0
    assert_pages_returned(llm)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_capture_shrink_peak_memory_on_cuda(tmp_path, monkeypatch, small_vocab):
    """On the GPU, the peak during the shrink never holds both buffers."""
    target, _ = small_vocab
    seen: dict = {}

    def allocator(shape, dtype, device):
        if "base" not in seen:
            torch.cuda.synchronize()
            seen["base"] = torch.cuda.memory_allocated()
            t = torch.empty(shape, dtype=dtype, device=device)
            seen["old_bytes"] = t.numel() * t.element_size()
            torch.cuda.reset_peak_memory_stats()
            return t
        t = torch.empty(shape, dtype=dtype, device=device)
        torch.cuda.synchronize()
        seen["peak"] = torch.cuda.max_memory_allocated()
        seen["new_bytes"] = t.numel() * t.element_size()
        return t

    _install(monkeypatch, allocator)
    LLM(str(target), skip_tokenizer_init=True, speculative="dflash", speculative_policy="always", draft_model=str(_sliding_drafter(tmp_path)),
        device="cuda", max_num_batched_tokens=65536, max_num_seqs=4, num_gpu_blocks_override=64, max_model_len=160,
        enforce_eager=True)
    assert seen["new_bytes"] < seen["old_bytes"]
    assert seen["peak"] <= seen["base"] + seen["old_bytes"]


# --------------------------------------------------------------------------- training
def _training_drafter(**config_fields):
    """A drafter as the training code builds it (the serving module), for the conftest Qwen3 target,
    with random norms so that every weight matters; `config_fields` change its config.json."""
    from atlas.models.dflash import DFlashDraftModel
    from atlas.training.dflash import DrafterShape, drafter_config, reset_parameters

    shape = DrafterShape(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, target_layer_ids=[1, 0], block_size=5,
                         mask_token_id=383, vocab_size=384, num_target_layers=2, rope_theta=1e6,
                         max_position_embeddings=512)
    raw = {**drafter_config(shape, "float32"), **config_fields}
    drafter = DFlashDraftModel(DFlashConfig.from_dict(raw, Path("<test>")), 512)
    reset_parameters(drafter, std=0.2)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return drafter


def test_training_forward_matches_the_reference_and_saves_the_zlab_format(tmp_path, qwen3_dir):
    """The dense, batched training forward (all anchors of a window in one masked attention) gives the
    same draft logits as the spec's reference for each anchor, and its checkpoint loads in Atlas."""
    from atlas.training.dflash import (
        FrozenTarget,
        block_logits,
        make_batch,
        sample_anchors,
        save_drafter,
    )

    hf = hf_model(qwen3_dir)
    torch.manual_seed(0)
    drafter = _training_drafter()
    shape = drafter.config
    target = FrozenTarget(hf, shape.target_layer_ids, None)
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(1, 380, (2, 24), generator=g)
    anchors = sample_anchors(2, 24, 3, shape.block_size, g, torch.device("cpu"))
    assert anchors.shape == (2, 3) and anchors.min() >= 1 and anchors.max() <= 24 - shape.block_size
    batch = make_batch(target, windows, anchors, shape.block_size, shape.mask_token_id, greedy_labels=True)
    with torch.no_grad():
        logits = block_logits(drafter, target, batch)  # [2, 3, 4, V]
        greedy = hf(windows).logits.argmax(-1)
    files = save_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)
    assert [f.name for f in files] == ["config.json", "model.safetensors"]
    keys = set(load_file(str(files[1])))
    assert len(keys) == 3 + 11 * 2 and "fc.weight" in keys and "layers.1.self_attn.k_norm.weight" in keys
    assert not any(k.startswith(("model.", "embed_tokens", "lm_head")) for k in keys)
    for b in range(2):
        for i, a in enumerate(anchors[b].tolist()):
            ref = dense_reference_logits(hf, tmp_path / "drafter", windows[b, :a].tolist(), int(windows[b, a]), 4)
            torch.testing.assert_close(logits[b, i], ref, atol=2e-4, rtol=2e-4)
            assert batch.labels[b, i].tolist() == greedy[b, a:a + 4].tolist()
    llm = LLM(str(qwen3_dir), speculative="dflash", speculative_policy="always", draft_model=str(tmp_path / "drafter"), kv_cache_memory="8MiB")
    assert llm.engine.proposer.capture_layers() == (1, 0) and llm.engine.proposer.num_draft_tokens == 4


@pytest.mark.parametrize("variant", ["zlab", "causal-sliding"])
def test_a_trained_drafter_serves_the_block_logits_it_was_trained_with(tmp_path, qwen3_dir, variant):
    """Training is the serving module: a few optimizer steps through its cache-free forward (gradients
    reach every parameter), save_drafter, then the engine's proposer loads exactly those parameters and
    its paged block forward gives the training forward's draft logits for every anchor (fp32). Also for
    a config with a causal block and a sliding-window layer, which the training forward applies by
    position as the paged kernel does."""
    from atlas.training.dflash import (
        FrozenTarget,
        block_logits,
        drafter_loss,
        make_batch,
        sample_anchors,
        save_drafter,
    )

    hf = hf_model(qwen3_dir)
    torch.manual_seed(3)
    fields = {} if variant == "zlab" else {"layer_types": ["sliding_attention", "full_attention"],
                                           "sliding_window": 6, "dflash_config": {
                                               "target_layer_ids": [1, 0], "mask_token_id": 383, "is_causal": True}}
    drafter = _training_drafter(**fields)
    cfg = drafter.config
    target = FrozenTarget(hf, cfg.target_layer_ids, None)
    g = torch.Generator().manual_seed(4)
    windows = torch.randint(1, 380, (2, 24), generator=g)
    anchors = sample_anchors(2, 24, 3, cfg.block_size, g, torch.device("cpu"))
    batch = make_batch(target, windows, anchors, cfg.block_size, cfg.mask_token_id, greedy_labels=True)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = drafter_loss(drafter, target, batch, gamma=4.0)
        loss.backward()
        assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in drafter.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with torch.no_grad():
        trained = block_logits(drafter, target, batch)  # [2, 3, K, V]
    save_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)

    llm = LLM(str(qwen3_dir), speculative="dflash", speculative_policy="always", draft_model=str(tmp_path / "drafter"), kv_cache_memory="8MiB",
              block_size=4, enable_prefix_caching=False)
    proposer = llm.engine.proposer
    served = dict(proposer.model.named_parameters())
    assert served.keys() == dict(drafter.named_parameters()).keys()
    for name, p in drafter.named_parameters():
        assert torch.equal(served[name], p.detach()), name
    k = proposer.num_draft_tokens
    requests, commits = [], []
    for b in range(2):
        for a in anchors[b].tolist():
            first_page = 8 * len(requests)
            req = SimpleNamespace(request_id=f"r{len(requests)}", all_token_ids=windows[b, :a + 1].tolist(),
                                  num_computed_tokens=a, page_ids=list(range(first_page, first_page + 8)))
            requests.append(req)
            commits.append(CommittedTokens(req, 0, a, batch.features[b, :a]))
    proposer.on_commit(commits)
    with torch.inference_mode():
        got = llm.engine.runner.model.compute_logits(proposer.block_hidden(requests).flatten(0, 1))
    torch.testing.assert_close(got.view(2, 3, k, -1), trained, atol=2e-4, rtol=2e-4)


def test_tiny_dflash_training_run(tmp_path):
    """tools/train_dflash_drafter.py on the shipped model (CPU, a few steps, no engine measurement): the
    report and a z-lab checkpoint that the engine serves with the shipped model."""
    module = tool_module("train_dflash_drafter")
    out = tmp_path / "drafter"
    args = ["--device", "cpu", "--out", str(out), "--max-steps", "2", "--time-budget-minutes", "0",
            "--corpus-limit-mb", "0.1", "--seq-len", "48", "--batch-size", "2", "--anchors-per-window", "4",
            "--warmup-steps", "1", "--eval-every", "2", "--eval-windows", "2", "--no-engine-eval"]
    assert module.main(args) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert report["training"]["steps"] == 2 and report["drafter"]["files"] == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["torch_dtype"] == "bfloat16"
    assert "layers.0.self_attn.q_proj.weight" in load_file(str(out / "model.safetensors"))
    llm = LLM(speculative="dflash", speculative_policy="always", draft_model=str(out), kv_cache_memory="8MiB", max_model_len=128,
              skip_tokenizer_init=True)
    outs = llm.generate({"prompt_token_ids": [5, 9, 200, 31]}, SamplingParams(max_tokens=4, temperature=0))
    assert len(outs[0].outputs[0].token_ids) == 4 and llm.engine.stats.spec_num_verify_steps > 0


def _fp32_plain_greedy(target, prompts: list[list[int]], device: str) -> tuple[dict, list[list[int]]]:
    """(engine options of the fp32 comparisons on `device`, plain greedy tokens of `prompts` with them)."""
    common = dict(skip_tokenizer_init=True, device=device, dtype="float32", max_model_len=160)
    plain = LLM(str(target), enforce_eager=True, enable_prefix_caching=False, num_gpu_blocks_override=256, **common)
    return common, [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dflash_on_cuda_matches_the_reference_and_plain_greedy(qwen3_dir, drafter_dir, small_vocab):
    """The Triton path (non-causal block over paged context) against the dense reference, and fp32
    greedy with DFlash (CUDA graphs for plain decodes, preemption, prefix hits) equal to plain decoding."""
    hf = hf_model(qwen3_dir)
    llm = LLM(str(qwen3_dir), speculative="dflash", speculative_policy="always", draft_model=str(drafter_dir), device="cuda", dtype="float32",
              num_gpu_blocks_override=64, block_size=4, max_model_len=160)
    proposer = llm.engine.proposer
    k = proposer.num_draft_tokens
    g = torch.Generator().manual_seed(5)
    contexts = [torch.randint(1, 380, (n,), generator=g).tolist() for n in (37, 6)]
    requests = [SimpleNamespace(request_id=f"r{i}", all_token_ids=ctx + [17], num_computed_tokens=len(ctx),
                                page_ids=pages)
                for i, (ctx, pages) in enumerate(zip(contexts, [list(range(40, 52)), [7, 3, 60]], strict=True))]
    proposer.on_commit([CommittedTokens(r, 0, len(c), target_features(hf, c, [0, 1]).cuda())
                        for r, c in zip(requests, contexts, strict=True)])
    with torch.inference_mode():
        got = llm.engine.runner.model.compute_logits(proposer.block_hidden(requests).flatten(0, 1)).view(2, k, -1)
    for i, ctx in enumerate(contexts):
        torch.testing.assert_close(got[i].cpu(), dense_reference_logits(hf, drafter_dir, ctx, 17, k), atol=1e-3,
                                   rtol=1e-3)

    target, drafter = small_vocab
    prompts = _random_prompts(12, 16)
    common, expected = _fp32_plain_greedy(target, prompts, "cuda")
    llm = LLM(str(target), speculative="dflash", speculative_policy="always", draft_model=str(drafter), num_gpu_blocks_override=30, block_size=8,
              max_num_batched_tokens=48, max_num_seqs=6, **common)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.stats.spec_num_accepted_tokens > 0 and llm.engine.scheduler.num_preemptions > 0
    assert_pages_returned(llm)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_cuda_graph_pool_fits_its_share_of_the_memory_plan():
    """The drafter's graphs are captured after the KV pages are allocated, so the plan must count them
    beforehand: on the shipped model and drafter at 256 requests (its block logits the largest part), what
    capturing each set of graphs reserved stays within what the plan set aside for it."""
    from atlas.engine.core import default_model_path

    llm = LLM(str(default_model_path()), speculative="dflash", speculative_policy="always", device="cuda", dtype="bfloat16",
              gpu_memory_utilization=0.2, max_model_len=512, max_num_seqs=256, skip_tokenizer_init=True)
    plan, runner, proposer = llm.engine.plan, llm.engine.runner, llm.engine.proposer
    drafter = proposer.graphs.captured_mib * 2**20
    target = sum(g.captured_mib for g in runner.step_graphs.values()) * 2**20
    target += runner.mixed_graphs.captured_mib * 2**20 if runner.mixed_graphs is not None else 0
    assert 0 < drafter <= plan.breakdown["drafter cuda graphs"]
    assert 0 < target <= plan.breakdown["cuda graphs"]
    outs = llm.generate([{"prompt_token_ids": p} for p in _random_prompts(8, 400)], GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    assert_pages_returned(llm)


def test_block_prologue_kernel_equals_its_reference_in_the_interpreter():
    """The kernel that lays out the block queued behind a verify step (accepted drafts, bonus token, positions,
    slots, lengths, context rows), in Triton's interpreter against the PyTorch reference, also where the step's
    positions and slots sit in the buffers it writes (a pre-launched step)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    assert "24 cases agree" in run_in_triton_interpreter("draft_prologue_cases.py", "24")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_block_prologue_kernel_equals_its_reference_on_cuda():
    assert "200 cases agree" in run_cases_script("draft_prologue_cases.py", "200", timeout=300)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dflash_drafts_left_on_cuda_equal_plain_greedy(small_vocab):
    """Drafts left on the device on CUDA, with the graphs: fp32 greedy equal to plain decoding, the same
    accepted drafts as drafts read back at once (--tuning device_drafts=0). Then the default, blocks drafted
    right behind each verify step: with pages to spare, the same accepted drafts again (every verify step
    drafting behind itself); under page pressure (preemptions move), the same tokens."""
    target, drafter = small_vocab
    prompts = _random_prompts(12, 16)
    common, expected = _fp32_plain_greedy(target, prompts, "cuda")
    kwargs = dict(speculative="dflash", speculative_policy="always", draft_model=str(drafter), block_size=8, max_num_batched_tokens=48,
                  max_num_seqs=6, **common)
    pressure = dict(num_gpu_blocks_override=30)
    host = LLM(str(target), tuning={"draft_after_verify": False, "device_drafts": False}, **kwargs, **pressure)
    assert not host.engine.proposer.device_drafts
    host.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    stats = []
    for extra in (pressure, {"num_gpu_blocks_override": 256}):
        llm = LLM(str(target), tuning={"draft_after_verify": False}, **kwargs, **extra)
        assert llm.engine.proposer.device_drafts and llm.engine.proposer.graphs is not None
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected
        stats.append((llm.engine.stats.spec_num_draft_tokens, llm.engine.stats.spec_num_accepted_tokens))
        assert_pages_returned(llm)
    a = host.engine.stats
    assert (a.spec_num_draft_tokens, a.spec_num_accepted_tokens) == stats[0]
    for extra in (pressure, {"num_gpu_blocks_override": 256}):
        llm = LLM(str(target), **kwargs, **extra)
        assert llm.engine.proposer.drafts_after_verify
        queued = []
        after = llm.engine.runner.draft_after_verify
        llm.engine.runner.draft_after_verify = lambda step, after=after, queued=queued: queued.append(after(step)) or queued[-1]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert any(queued)
        if extra is not pressure:
            assert all(queued) and stats[1] == (llm.engine.stats.spec_num_draft_tokens,
                                                llm.engine.stats.spec_num_accepted_tokens)
        assert_pages_returned(llm)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_token_maps_on_cuda_keep_plain_greedy(tmp_path, small_vocab):
    """--speculative-token-map inside the block's CUDA graph: fp32 greedy equal to plain decoding; a map of
    every id accepts exactly the drafts of the whole head, a map of the even ids only drafts even ids."""
    target, drafter = small_vocab
    prompts = _random_prompts(12, 16)
    common, expected = _fp32_plain_greedy(target, prompts, "cuda")
    kwargs = dict(speculative="dflash", speculative_policy="always", draft_model=str(drafter), block_size=8, max_num_seqs=6,
                  num_gpu_blocks_override=256, **common)
    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    every, even = tmp_path / "every.json", tmp_path / "even.pt"
    every.write_text(json.dumps(list(range(vocab))))
    torch.save(torch.arange(0, vocab, 2), even)
    stats = []
    for token_map in (None, every, even):
        llm = LLM(str(target), **kwargs, speculative_token_map=None if token_map is None else str(token_map))
        assert llm.engine.proposer.graphs is not None and llm.engine.proposer.graphs.use_graphs
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected
        stats.append((llm.engine.stats.spec_num_draft_tokens, llm.engine.stats.spec_num_accepted_tokens))
        assert_pages_returned(llm)
    assert stats[0] == stats[1] and stats[0][1] > 0
    with torch.inference_mode():  # (the even map's head on some rows: only even ids come out)
        proposer = llm.engine.proposer
        rows = torch.randn(64, proposer.token_map.rows.shape[1], device="cuda", dtype=proposer.token_map.rows.dtype)
        assert bool((proposer._argmax_logits(rows) % 2 == 0).all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dflash_prelaunched_verify_steps_on_cuda_equal_plain_greedy(small_vocab):
    """--tuning prelaunch_verify=1 on CUDA with the graphs: the verify steps queued behind each block give fp32
    greedy tokens equal to plain decoding and the accepted drafts of the default engine, one request at a time
    (most of them adopted) and in a batch of 12 with 6 running at once."""
    target, drafter = small_vocab
    prompts = _random_prompts(12, 16)
    common, expected = _fp32_plain_greedy(target, prompts, "cuda")
    kwargs = dict(speculative="dflash", speculative_policy="always", draft_model=str(drafter), block_size=8, max_num_seqs=6,
                  num_gpu_blocks_override=256, **common)

    def run(llm):
        one_by_one = [llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in prompts[:3]]
        batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
        return one_by_one + batched, (llm.engine.stats.spec_num_draft_tokens, llm.engine.stats.spec_num_accepted_tokens)

    reference = run(LLM(str(target), **kwargs))
    llm = LLM(str(target), tuning={"prelaunch_verify": True}, **kwargs)
    tokens, stats = run(llm)
    assert tokens == expected[:3] + expected and (tokens, stats) == reference
    runner = llm.engine.runner
    assert runner.prelaunches > 0 and runner.prelaunches_adopted > runner.prelaunches // 2
    assert_pages_returned(llm)


def test_uniform_step_buffers_give_the_same_drafts_and_tokens(small_vocab, small_vocab_plain):
    """The static-buffer paths that CUDA graphs replay, for the target (decode and verify steps) and
    for the drafter's block, run eagerly on the CPU: the same drafts are accepted and the tokens equal
    plain decoding. Batches that are not on the size ladder are padded into scratch pages."""
    target, drafter = small_vocab
    prompts, expected = small_vocab_plain
    kwargs = dict(skip_tokenizer_init=True, speculative="dflash", speculative_policy="always", draft_model=str(drafter), kv_cache_memory="16MiB",
                  max_model_len=160, max_num_seqs=5, block_size=8)
    eager = LLM(str(target), **kwargs)
    eager_outs = eager.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    buffered = _through_static_buffers(LLM(str(target), **kwargs), 5)
    outs = buffered.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected == [o.outputs[0].token_ids for o in eager_outs]
    a, b = eager.engine.stats, buffered.engine.stats
    assert (a.spec_num_draft_tokens, a.spec_num_accepted_tokens) == (b.spec_num_draft_tokens, b.spec_num_accepted_tokens)
    assert b.spec_num_accepted_tokens > 0
    assert_pages_returned(buffered)


def test_dflash_over_an_8_bit_target_cache_equals_plain_decoding_over_it(small_vocab):
    """--kv-cache-dtype fp8 with a drafter: the target's caches are 8-bit, the drafter's keep the model dtype,
    and the greedy tokens are plain decoding's over the same 8-bit cache."""
    target, drafter = small_vocab
    prompts = _random_prompts(6, 16, seed=4)
    common = dict(skip_tokenizer_init=True, kv_cache_dtype="fp8", num_gpu_blocks_override=40, block_size=8,
                  max_model_len=160)
    plain = LLM(str(target), **common)
    expected = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    llm = LLM(str(target), speculative="dflash", speculative_policy="always", draft_model=str(drafter), **common)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(c.dtype == torch.float8_e4m3fn for c in llm.engine.runner.kv_caches)
    assert all(c.dtype == torch.float32 for c in llm.engine.proposer.kv_caches)
    assert llm.engine.stats.spec_num_accepted_tokens > 0
    assert_pages_returned(llm)


def test_continuous_arrivals_through_mixed_step_buffers_equal_plain_greedy(small_vocab, small_vocab_plain):
    """DFlash with requests joining as others end (each arrival a mixed step: its prompt chunk beside the
    others' verify rows), every step through the static buffers CUDA graphs replay (uniform verify steps, the
    drafter's blocks, the mixed steps): the tokens of plain greedy decoding, pages all returned."""
    target, drafter = small_vocab
    prompts, expected = small_vocab_plain
    llm = LLM(str(target), skip_tokenizer_init=True, speculative="dflash", speculative_policy="always", draft_model=str(drafter), block_size=8,
              max_num_seqs=3, max_model_len=160, kv_cache_memory="16MiB", enable_prefix_caching=False)
    _through_static_buffers(llm, 3)
    mixed = llm.engine.runner.mixed_graphs
    tokens = continuous_arrivals(llm, prompts, [len(t) for t in expected])
    assert tokens == expected
    assert mixed.steps_run >= 5 and llm.engine.stats.spec_num_accepted_tokens > 0
    assert_pages_returned(llm)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_continuous_arrivals_with_mixed_step_graphs_on_cuda_equal_plain_greedy(small_vocab):
    """On the GPU, requests joining as others end: each arrival's mixed step replays a mixed-step CUDA graph
    beside the verify and block graphs; fp32 greedy tokens equal plain decoding's."""
    target, drafter = small_vocab
    prompts = _random_prompts(12, 16)
    common, expected = _fp32_plain_greedy(target, prompts, "cuda")
    llm = LLM(str(target), speculative="dflash", speculative_policy="always", draft_model=str(drafter), block_size=8, max_num_seqs=3,
              num_gpu_blocks_override=256, enable_prefix_caching=False, **common)
    mixed = llm.engine.runner.mixed_graphs
    assert mixed is not None and mixed.graphs
    assert continuous_arrivals(llm, prompts, [len(t) for t in expected]) == expected
    assert mixed.steps_run >= 5 and llm.engine.stats.spec_num_accepted_tokens > 0
    assert_pages_returned(llm)


def test_a_preempted_request_drops_its_context_rows_still_waiting(tmp_path):
    """Context rows of small commits wait for the next block (through the static buffers CUDA graphs replay); a
    request preempted meanwhile loses its pages, so its waiting rows must go (it computes them again when it runs
    next): they were written at slots read from its page table at the next flush, which by then was empty (an
    IndexError ended the step) or another set of pages. Greedy tokens equal plain decoding, with preemptions."""
    target = build_checkpoint(tmp_path, "Qwen3ForCausalLM", None, seed=6, num_hidden_layers=4)
    drafter = write_drafter(tmp_path / "drafter", hidden=64, layer_ids=[1, 3], mask_token_id=383, block_size=4)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30, 9)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine = dict(skip_tokenizer_init=True, block_size=4, num_gpu_blocks_override=32, max_num_batched_tokens=20,
                  max_num_seqs=6, max_model_len=128)
    plain = LLM(str(target), **engine).generate([{"prompt_token_ids": p} for p in prompts], params)
    llm = _through_static_buffers(LLM(str(target), speculative="dflash", speculative_policy="always",
                                      draft_model=str(drafter), **engine), 6)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pages_returned(llm)
