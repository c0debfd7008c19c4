"""DeepSeek-V4 (DeepseekV4ForCausalLM, deepseek_v4) against transformers' deepseek_v4 on a tiny random checkpoint
(fp32, CPU) with every layer type (sliding-only, compressed sparse with its indexer, heavily compressed), a hash-
routed MoE layer, two hyper-connection streams and a SwiGLU limit that clamps: logits over one prefill, chunks and
decode steps (with negative checks that the indexer's top-k, the sinks and the compressed rows matter), greedy
tokens, chunked prefill with preemption and prefix caching on equal to off with every page returned, n-gram
speculation equal to plain greedy, YaRN on the compressed layers, the legacy config forms, the MTP module as a
drafter (against a reference built from transformers' pieces) and skipped without one, and refusals by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import _build, assert_pages_returned, hf_greedy, hf_model, tool_module
from test_dsa import _ids, _llm, check_chunks_preemption_and_prefix_caching, check_greedy_matches_transformers
from test_models import atlas_logits, hf_logits

from atlas import SamplingParams
from atlas.errors import ModelLoadError, UnsupportedModelError

CSA_RATE, HCA_RATE, WINDOW, TOPK = 4, 6, 8, 3
# 40 tokens: 10 CSA windows (top-3 of them per query), 6 HCA windows (which straddle the 8-token pages), a window
# of 8 raw rows. 16 indexer heads keep exact score ties (every head's ReLU at zero: a score of 0) rare, so the top-k
# has no tie for transformers and Atlas to break differently (with 4 heads some queries tie at 0).
V4 = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
    n_routed_experts=8, num_experts_per_tok=2, intermediate_size=32,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": CSA_RATE, "heavily_compressed_attention": HCA_RATE},
    sliding_window=WINDOW, index_topk=TOPK, index_n_heads=16, index_head_dim=16, hc_mult=2, num_hash_layers=1,
    swiglu_limit=1.0)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _randomize_buffers(model: torch.nn.Module, seed: int) -> None:
    """Buffers _randomize leaves alone: a non-zero correction bias (choosing only) and a hash table of distinct
    experts per token."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))
            elif name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                buf.copy_(torch.stack([torch.randperm(experts, generator=g)[: buf.shape[1]]
                                       for _ in range(buf.shape[0])]))


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("v4"), "v4", V4, None, 0, {}, randomize=_randomize_buffers)


@pytest.fixture(scope="module")
def llm(v4):
    return _llm(v4)


def _edit(src, dst, **fields):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **fields}))
    return dst


def test_each_layer_type_keeps_its_cache_row(llm):
    """Key row; + compressed row and the window's projections (HCA: one series; CSA: two, and the indexer's)."""
    d, di = V4["head_dim"], V4["index_head_dim"]
    widths = [c.shape[-1] for c in llm.engine.runner.kv_caches]
    assert widths == [d, 6 * d + 5 * di, 4 * d, 6 * d + 5 * di]


def test_logits_over_one_prefill_chunks_and_decode_steps_match_transformers(v4, llm, monkeypatch):
    """Chunks that start mid-window and mid-page pool windows whose tokens came in earlier chunks; decode steps
    close windows one token at a time. And the pieces matter: attending over every visible compressed row (no
    top-k), no sinks, or no compressed rows at all each miss transformers' logits."""
    ids = _ids(40, 1)
    expected = hf_logits(v4, ids)
    torch.testing.assert_close(atlas_logits(llm, ids, [40]), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(atlas_logits(llm, ids, [13, 11, 5] + [1] * 11), expected, rtol=1e-4, atol=1e-4)
    import atlas.kernels.dsv4_attention_ref as ref

    with monkeypatch.context() as m:
        m.setattr(ref, "select_topk", lambda scores, visible, k: visible)
        assert (atlas_logits(llm, ids, [40]) - expected).abs().max() > 1e-2
    layers = llm.engine.runner.model.model.layers
    sinks = [layer.attn.attn_sink.detach().clone() for layer in layers]
    try:
        for layer in layers:
            layer.attn.attn_sink.data.fill_(-1e4)
        assert (atlas_logits(llm, ids, [40]) - expected).abs().max() > 1e-2
    finally:
        for layer, sink in zip(layers, sinks, strict=True):
            layer.attn.attn_sink.data.copy_(sink)
    # (set and put back by hand: pytest's monkeypatch may delete, on undo, a module's attribute that lives in its
    # _modules rather than its __dict__)
    kept = [(layer.attn.rate, layer.attn.compressor, layer.attn.indexer) for layer in layers]
    try:
        for layer in layers:
            layer.attn.rate, layer.attn.compressor, layer.attn.indexer = 0, None, None
        assert (atlas_logits(llm, ids, [40]) - expected).abs().max() > 1e-2
    finally:
        for layer, (rate, compressor, indexer) in zip(layers, kept, strict=True):
            layer.attn.rate, layer.attn.compressor, layer.attn.indexer = rate, compressor, indexer
    torch.testing.assert_close(atlas_logits(llm, ids, [40]), expected, rtol=1e-4, atol=1e-4)


def test_greedy_tokens_match_transformers(v4, llm):
    check_greedy_matches_transformers(v4, llm, GREEDY)


def test_chunked_prefill_preemption_and_prefix_caching_do_not_change_outputs(v4):
    check_chunks_preemption_and_prefix_caching(v4, GREEDY, 5)


def test_ngram_speculation_equals_plain_greedy(v4, llm):
    """A verify step is a multi-token step; rows of rejected drafts (their projections and any compressed row they
    closed) are rewritten at their positions by the accepted tokens."""
    prompt = torch.randperm(383, generator=torch.Generator().manual_seed(7))[:120].add(1).tolist()
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    spec = _llm(v4, speculative="ngram", speculative_policy="always", num_draft_tokens=3, ngram_min=1, ngram_max=3)
    assert spec.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == plain
    assert spec.engine.stats.spec_num_verify_steps > 0
    assert_pages_returned(spec)


def test_yarn_on_the_compressed_layers_matches_transformers(tmp_path):
    """rope_scaling YaRN applies to the compressed layers' RoPE (compress_rope_theta) with attention_factor 1, the
    sliding layers keep plain RoPE at rope_theta."""
    spec = dict(V4, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                  "beta_fast": 32, "beta_slow": 1}, compress_rope_theta=1000.0)
    path = _build(tmp_path, "yarn", spec, None, 3, {}, randomize=_randomize_buffers)
    assert json.loads((path / "config.json").read_text())["rope_parameters"]["compress"]["rope_type"] == "yarn"
    ids = _ids(40, 4)
    torch.testing.assert_close(atlas_logits(_llm(path), ids, [9, 20, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
                               hf_logits(path, ids), rtol=1e-4, atol=1e-4)


def test_legacy_config_fields_resolve_as_transformers_does(v4, tmp_path):
    """compress_ratios (per-layer 0 / 4 / 128), num_hash_layers and qk_rope_head_dim in place of the modern fields,
    and a config that leaves layer_types out (transformers' default pattern): Atlas builds what transformers builds."""
    from transformers import AutoConfig

    from atlas.config import ModelConfig
    from atlas.models.deepseek_v4 import _hf_config

    cfg = json.loads((v4 / "config.json").read_text())
    for fields in [dict(compress_ratios=[0, 4, 128, 4], num_hash_layers=2, qk_rope_head_dim=16),
                   dict(num_hidden_layers=5)]:
        edited = {k: v for k, v in cfg.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates",
                                                               "partial_rotary_factor", "rope_parameters")}
        path = tmp_path / f"legacy{len(fields)}"
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**edited, **fields}))
        ours = _hf_config(ModelConfig.from_path(path))
        theirs = AutoConfig.from_pretrained(path)
        assert ours.layer_types == theirs.layer_types and ours.mlp_layer_types == theirs.mlp_layer_types
        assert ours.compress_rates == theirs.compress_rates and ours.qk_rope_head_dim == theirs.qk_rope_head_dim
        for label in ("main", "compress"):
            for key in ("rope_type", "rope_theta"):
                assert ours.rope_parameters[label][key] == theirs.rope_parameters[label][key]


def _with_mtp(v4, dst, seed: int = 7):
    """The tiny checkpoint plus an MTP module under DeepSeek's names (mtp.0.*): its decoder layer's attention, norms and
    hyper-connections from layer 0 (sliding-only) and its MoE from layer 1 (routed with a correction bias), perturbed,
    and its own e_proj, h_proj, enorm, hnorm, norm, hc_head_* and head drawn at random. -> (path, the mtp.0.*
    tensors)."""
    from safetensors.torch import load_file, save_file

    path = _edit(v4, dst, num_nextn_predict_layers=1)
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    d, n = 64, V4["hc_mult"]
    mtp = {}
    for name, t in tensors.items():
        for layer, parts in (("model.layers.0.", ("attn.", "attn_norm", "ffn_norm", "hc_attn_", "hc_ffn_")),
                             ("model.layers.1.", ("ffn.",))):
            rest = name.removeprefix(layer)
            if rest != name and rest.startswith(parts):
                noise = 0.05 * torch.randn(t.shape, generator=g) if t.is_floating_point() else 0
                mtp[f"mtp.0.{rest}"] = t + noise
    mtp |= {"mtp.0.e_proj.weight": 0.2 * torch.randn(d, d, generator=g),
            "mtp.0.h_proj.weight": 0.2 * torch.randn(d, d, generator=g),
            "mtp.0.hc_head_fn": 0.1 * torch.randn(n, n * d, generator=g),
            "mtp.0.hc_head_base": 0.1 * torch.randn(n, generator=g), "mtp.0.hc_head_scale": torch.tensor([0.7])}
    for norm in ("enorm", "hnorm", "norm"):
        mtp[f"mtp.0.{norm}.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
    # (a head of its own, which the published checkpoints leave out: used where it differs from the target's)
    mtp["mtp.0.head.weight"] = tensors["head.weight"] + 0.05 * torch.randn(tensors["head.weight"].shape, generator=g)
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    return path, mtp


def _reference_mtp_logits(v4, mtp: dict, tokens: list[int], tmp_path) -> torch.Tensor:
    """The MTP module's logits at rows 0 .. N - 2 of `tokens` (row i reads the target's last-layer streams at i and
    token i + 1, and predicts token i + 2), computed with transformers' own DeepSeek-V4 pieces: the target's streams
    from transformers' model (before its head's collapse), and the module's decoder layer, hc_head, norm and the
    target's head as a one-layer transformers DeepSeek-V4 (sliding-only, routed MoE) whose layer input is replaced by
    h_proj(hnorm(H)) + e_proj(enorm(embed(t))) (vLLM's and SGLang's V4 MTP)."""
    from safetensors.torch import load_file, save_file

    target = hf_model(v4)
    streams = {}
    hook = target.model.hc_head.register_forward_pre_hook(lambda mod, args: streams.update(h=args[0]))
    with torch.no_grad():
        target(torch.tensor([tokens]))
    hook.remove()
    one = _edit(v4, tmp_path / "mtp-reference", num_hidden_layers=1, layer_types=["sliding_attention"],
                mlp_layer_types=["moe"], num_hash_layers=0)
    base = load_file(v4 / "model.safetensors")
    own = {"model.embed_tokens.weight": base["model.embed_tokens.weight"], "head.weight": mtp["mtp.0.head.weight"],
           "model.norm.weight": mtp["mtp.0.norm.weight"]}
    for piece in ("fn", "base", "scale"):
        own[f"model.hc_head.hc_{piece}"] = mtp[f"mtp.0.hc_head_{piece}"]
    for name, t in mtp.items():
        rest = name.removeprefix("mtp.0.")
        if rest.startswith(("attn.", "attn_norm", "ffn_norm", "hc_attn_", "hc_ffn_", "ffn.")):
            own[f"model.layers.0.{rest}"] = t
    save_file(own, one / "model.safetensors", metadata={"format": "pt"})
    block = hf_model(one)

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    h = streams["h"][0, :-1]  # [N - 1, n, D]
    embed = base["model.embed_tokens.weight"][torch.tensor(tokens[1:])]
    s = rms(h, mtp["mtp.0.hnorm.weight"]) @ mtp["mtp.0.h_proj.weight"].T + \
        (rms(embed, mtp["mtp.0.enorm.weight"]) @ mtp["mtp.0.e_proj.weight"].T).unsqueeze(1)
    hook = block.model.layers[0].register_forward_pre_hook(lambda mod, args: (s[None], *args[1:]))
    with torch.no_grad():
        logits = block(torch.tensor([tokens[1:]])).logits[0]
    hook.remove()
    return logits


def test_mtp_drafts_as_the_reference_module_and_speculation_equals_plain_greedy(v4, tmp_path, monkeypatch, caplog):
    """--speculative mtp with DeepSeek-V4's module: every first draft the module makes (the argmax of its logits at
    the last committed row) equals the reference module's over the finished sequence (_reference_mtp_logits); greedy
    outputs with one and with two chained drafts a step equal plain decoding's, every page returned. Without
    --speculative mtp the module's tensors are left out, with a log line."""
    import logging

    from atlas.speculative.mtp import MTPProposer

    path, mtp = _with_mtp(v4, tmp_path / "mtp")
    prompts = [_ids(21, 1), _ids(9, 2)]
    with caplog.at_level(logging.INFO, logger="atlas.models.deepseek_v4"):
        plain = _llm(path)
    assert f"not loading the {len(mtp)} tensors of its MTP module" in caplog.text
    expected = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    seen: dict[str, set] = {}
    commit = MTPProposer.on_commit

    def recording(self, commits):
        commit(self, commits)
        for rid, (pos, _, draft) in self.state.items():
            seen.setdefault(rid, set()).add((pos, int(draft)))

    monkeypatch.setattr(MTPProposer, "on_commit", recording)
    for k in (1, 2):
        llm = _llm(path, speculative="mtp", num_draft_tokens=k, speculative_policy="always")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert_pages_returned(llm)
        assert llm.engine.stats.spec_num_draft_tokens > 0
        if k == 1:
            for prompt, out in zip(prompts, outs, strict=True):
                tokens = prompt + list(out.outputs[0].token_ids)
                ref = _reference_mtp_logits(v4, mtp, tokens, tmp_path / f"ref-{len(prompt)}").argmax(-1)
                drafts = seen[out.request_id]
                assert len(drafts) >= GREEDY.max_tokens - 1
                assert all(draft == int(ref[pos]) for pos, draft in drafts), sorted(drafts)
            seen.clear()


@pytest.mark.parametrize("fields,needle", [
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}, "fp8"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"layer_types": ["sliding_attention"] * 3 + ["global"]}, "layer_types")])
def test_what_is_not_implemented_is_refused_by_name(v4, tmp_path, fields, needle):
    with pytest.raises((ModelLoadError, UnsupportedModelError), match=needle):
        _llm(_edit(v4, tmp_path / "edited", **fields))


def test_unknown_tensors_are_refused(v4, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _edit(v4, tmp_path / "extra")
    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, "model.layers.0.attn.compressor.wkv.weight": torch.zeros(32, 64)},
              path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="layers.0.attn.compressor.wkv"):
        _llm(path)


def test_random_checkpoint_tool_v4_shapes(tmp_path):
    """deepseek-v4-tiny: DeepSeek's tensor names (a hash table of valid experts included, and an MTP module, which
    transformers leaves out), which transformers loads with nothing missing or unexpected; Atlas's greedy tokens equal
    transformers', with its MTP module drafting too, and its config alone serves with --load-format dummy. deepseek-v4-cut (config-only use): the per-layer shapes of transformers' defaults."""

    from transformers import AutoModelForCausalLM

    module = tool_module("make_random_checkpoint")
    out = tmp_path / "v4"
    assert module.main(["--shape", "deepseek-v4-tiny", "--out", str(out), "--std", "0.2", "--device", "cpu"]) == 0
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    prompt = list(range(3, 30))
    llm = _llm(out)
    expected = hf_greedy(model.float().eval(), prompt, GREEDY.max_tokens)
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == expected
    assert_pages_returned(llm)
    mtp = _llm(out, speculative="mtp", num_draft_tokens=2, speculative_policy="always")  # (its mtp.0.* module)
    assert mtp.generate([prompt], GREEDY)[0].outputs[0].token_ids == expected
    assert mtp.engine.stats.spec_num_draft_tokens > 0
    dummy = tmp_path / "v4-dummy"
    assert module.main(["--shape", "deepseek-v4-tiny", "--out", str(dummy), "--config-only"]) == 0
    llm = _llm(dummy, load_format="dummy")
    assert len(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens
    assert_pages_returned(llm)
    cut = tmp_path / "v4-cut"
    assert module.main(["--shape", "deepseek-v4-cut", "--out", str(cut), "--config-only"]) == 0
    cfg = json.loads((cut / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"], cfg["o_groups"],
            cfg["o_lora_rank"], cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"], cfg["sliding_window"],
            cfg["hc_mult"], cfg["moe_intermediate_size"]) == (4096, 64, 512, 1024, 8, 1024, 64, 128, 512, 128, 4, 2048)
    assert set(cfg["layer_types"]) == {"sliding_attention", "compressed_sparse_attention",
                                       "heavily_compressed_attention"}


def test_a_drafter_that_reads_hidden_states_is_refused_at_start_up(tmp_path):
    """DFlash (as EAGLE-3) reads target layers' hidden states; V4 has hc_mult streams in their place: refused when
    the engine starts, not at the first step."""

    module = tool_module("make_random_checkpoint")
    out = tmp_path / "v4"
    assert module.main(["--shape", "deepseek-v4-tiny", "--out", str(out), "--device", "cpu", "--dflash-drafter",
                        "--dflash-layers", "1", "--dflash-block-size", "4"]) == 0
    with pytest.raises(UnsupportedModelError, match="hyper-connection streams"):
        _llm(out, speculative="dflash", draft_model=str(out / "dflash-drafter"))
