"""LongCat-Flash's MTP module (`model.mtp.*`) as the drafter of --speculative mtp. transformers has no MTP class, so
the reference is the module written from the spec (section 3.2, LongCat's names) on transformers' own LongCat pieces
(its MLA, with LongCat's scaling, its dense MLP and RMSNorm): the module's rows over two chunks of commits and a chain
of drafts equal it; greedy decoding with MTP drafts equals plain under batching, chunked prefill, prefix caching and
preemption; drafts are accepted on a small vocabulary; a checkpoint without the module is refused by name."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import _build, _correction_bias, assert_pages_returned, hf_model
from test_dsa import _llm
from test_longcat import LONGCAT
from test_mtp import assert_module_matches_reference, chained_reference

from atlas import SamplingParams
from atlas.errors import ModelLoadError

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
MTP_KW = dict(speculative="mtp", speculative_policy="always")


def _with_mtp(plain, dst):
    """The checkpoint plus a random MTP module under LongCat's published names (embedding copy included)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(plain, dst)
    tensors = load_file(dst / "model.safetensors")
    d, g = LONGCAT_D, torch.Generator().manual_seed(21)
    q, kv, rope, nope, v = (LONGCAT[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                                                  "qk_nope_head_dim", "v_head_dim"))
    heads = tensors["model.layers.0.self_attn.0.q_b_proj.weight"].shape[0] // (nope + rope)
    inter = tensors["model.layers.0.mlps.0.down_proj.weight"].shape[1]  # (the dense MLPs' size)

    def rand(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    def norm(n):
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    p = "model.mtp.layers.0."
    tensors |= {
        "model.mtp.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        f"{p}enorm.m.weight": norm(d), f"{p}hnorm.m.weight": norm(d), f"{p}eh_proj.weight": rand(d, 2 * d),
        f"{p}input_layernorm.weight": norm(d), f"{p}post_attention_layernorm.weight": norm(d),
        f"{p}self_attn.q_a_proj.weight": rand(q, d), f"{p}self_attn.q_a_layernorm.weight": norm(q),
        f"{p}self_attn.q_b_proj.weight": rand(heads * (nope + rope), q),
        f"{p}self_attn.kv_a_proj_with_mqa.weight": rand(kv + rope, d), f"{p}self_attn.kv_a_layernorm.weight": norm(kv),
        f"{p}self_attn.kv_b_proj.weight": rand(heads * (nope + v), kv), f"{p}self_attn.o_proj.weight": rand(d, heads * v),
        f"{p}transformer_layer.mlp.gate_proj.weight": rand(inter, d),
        f"{p}transformer_layer.mlp.up_proj.weight": rand(inter, d),
        f"{p}transformer_layer.mlp.down_proj.weight": rand(d, inter),
        "model.mtp.norm.weight": norm(d)}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


LONGCAT_D = 64


@pytest.fixture(scope="module")
def longcat_mtp(tmp_path_factory):
    root = tmp_path_factory.mktemp("longcat-mtp")
    return _with_mtp(_build(root, "longcat", LONGCAT, None, 0, {}, randomize=_correction_bias), root / "mtp")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 5-token vocabulary: the module's drafts are often right."""
    root = tmp_path_factory.mktemp("longcat-mtp-tiny")
    return _with_mtp(_build(root, "longcat", LONGCAT, None, 4, {"vocab_size": 5}, randomize=_correction_bias),
                     root / "mtp")


@torch.no_grad()
def reference_mtp(ckpt, token_ids: list[int], drafts: int) -> tuple[torch.Tensor, list[int]]:
    """The spec's MTP with LongCat's pieces, densely: row i reads t_{i+1} and the target's normed hidden h_i,
    u_i = z + a + mlp(post_norm(z + a)), a = mla(input_norm(z)), z = eh_proj([enorm(embed) | hnorm(h)]); logits =
    lm_head(mtp.norm(u)); then chained rows (token = the previous argmax, hidden = the previous u)."""
    from safetensors.torch import load_file
    from transformers.models.longcat_flash import modeling_longcat_flash as lc

    hf = hf_model(ckpt)
    cfg = hf.config
    cfg._attn_implementation = "eager"
    w = {k[len("model.mtp."):]: v.float() for k, v in load_file(ckpt / "model.safetensors").items()
         if k.startswith("model.mtp.")}
    attn, mlp = lc.LongcatFlashMLA(cfg, 0).eval(), lc.LongcatFlashMLP(cfg, intermediate_size=cfg.ffn_hidden_size)
    attn.load_state_dict({k[len("layers.0.self_attn."):]: v for k, v in w.items()
                          if k.startswith("layers.0.self_attn.")})
    mlp.load_state_dict({k[len("layers.0.transformer_layer.mlp."):]: v for k, v in w.items()
                         if k.startswith("layers.0.transformer_layer.mlp.")})
    norms = {}
    for name, key in (("enorm", "layers.0.enorm.m.weight"), ("hnorm", "layers.0.hnorm.m.weight"),
                      ("input", "layers.0.input_layernorm.weight"), ("post", "layers.0.post_attention_layernorm.weight"),
                      ("final", "norm.weight")):
        norms[name] = lc.LongcatFlashRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        norms[name].weight.copy_(w[key])
    h = hf.model(torch.tensor([token_ids])).last_hidden_state[0]
    rope = hf.model.rotary_emb

    def block(z: torch.Tensor) -> torch.Tensor:
        n = z.shape[0]
        cos_sin = rope(z[None], torch.arange(n)[None])
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        a = attn(norms["input"](z[None]), cos_sin, mask)[0][0]
        return z + a + mlp(norms["post"](z + a))

    def combine(tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([norms["enorm"](hf.model.embed_tokens(tokens)), norms["hnorm"](hidden)], -1) @ w[
            "layers.0.eh_proj.weight"].T

    def logits(u: torch.Tensor) -> torch.Tensor:
        return hf.lm_head(norms["final"](u))

    return chained_reference(block, combine, logits, token_ids, h, drafts)


def test_mtp_module_matches_the_spec_reference(longcat_mtp):
    ids = torch.randint(1, 384, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    assert_module_matches_reference(longcat_mtp, ids, reference=reference_mtp)


def test_mtp_greedy_equals_plain_under_pressure(longcat_mtp):
    g = torch.Generator().manual_seed(8)
    shared = torch.randint(1, 384, (24,), generator=g).tolist()
    prompts = [shared + torch.randint(1, 384, (int(n),), generator=g).tolist() for n in (3, 17, 9, 30, 1, 12)]
    plain = _llm(longcat_mtp, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    llm = _llm(longcat_mtp, num_draft_tokens=2, num_gpu_blocks_override=24, max_num_batched_tokens=32,
               max_model_len=80, max_num_seqs=5, **MTP_KW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.stats.spec_num_draft_tokens > 0
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.stats.hits > 0
    assert_pages_returned(llm)


def test_mtp_drafts_are_accepted(tiny):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 5, (n,), generator=g).tolist() for n in (7, 12, 20, 9)]
    expected = [o.outputs[0].token_ids for o in _llm(tiny).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    llm = _llm(tiny, num_draft_tokens=3, **MTP_KW)
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)] == expected
    stats = llm.engine.stats
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert_pages_returned(llm)


def test_a_checkpoint_without_the_module_is_refused_by_name(tmp_path):
    plain = _build(tmp_path, "longcat", LONGCAT, None, 0, {}, randomize=_correction_bias)
    with pytest.raises(ModelLoadError, match=r"has no MTP module \(no model\.mtp\.\* tensors\)"):
        _llm(plain, **MTP_KW)


SPEC_COUNTS = ("spec_num_verify_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens")


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_mtp_under_parallelism_equals_one_device(tiny, parallel):
    """Two ranks on gloo. Tensor parallelism: the driver drafts alone with the module built whole and whole copies
    of the embedding and of the LM head it reads through; pipeline: on the first stage. The tokens of plain decoding
    and the drafts and acceptances of one device's speculation."""
    from test_parallel import PARALLEL

    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, 5, (n,), generator=g).tolist()} for n in (7, 12, 20, 9)]
    expected = [o.outputs[0].token_ids for o in _llm(tiny).generate(prompts, GREEDY)]
    one = _llm(tiny, num_draft_tokens=2, **MTP_KW)
    assert [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)] == expected
    llm = _llm(tiny, **{parallel: 2}, num_draft_tokens=2, **MTP_KW, **PARALLEL)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
        assert [getattr(llm.engine.stats, c) for c in SPEC_COUNTS] == [getattr(one.engine.stats, c) for c in SPEC_COUNTS]
        assert llm.engine.stats.spec_num_accepted_tokens > 0
    finally:
        llm.shutdown()
