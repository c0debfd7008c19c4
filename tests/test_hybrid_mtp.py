"""The hybrid models' own multi-token-prediction module (`mtp.*`) as the drafter of --speculative mtp. transformers
has no MTP class, so the reference is the module as vLLM's qwen3_next_mtp computes it, written here on transformers'
own pieces (the family's decoder layer at index num_hidden_layers as a full-attention layer, its (1 + w) RMSNorm):
the module's rows over two chunks of commits and a chain of drafts equal it; greedy decoding with MTP drafts equals
transformers' under chunked prefill, prefix caching (state snapshots) and preemption, with drafts accepted and
rejected (the target's recurrent state restored from its backup); every page and slot comes back; a checkpoint
without the module is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import CUDA_KV, _randomize, hf_greedy, hf_model
from test_hybrid_models import build_hybrid
from test_hybrid_prefix_cache import assert_all_returned
from test_hybrid_speculation import PROMPTS, build_echo_hybrid, record_restores
from test_mtp import assert_module_matches_reference, chained_reference

from atlas import LLM
from atlas.errors import ModelLoadError

NAMES = ["qwen3_next", "qwen3_5_moe"]  # (a SwiGLU MTP layer; a sparse-MoE one)
NEW = 24


def _mtp_layer(hf):
    """transformers' decoder layer of the family at index num_hidden_layers, a full-attention layer."""
    cfg = copy.deepcopy(hf.config)
    n = cfg.num_hidden_layers
    cfg.layer_types = list(cfg.layer_types) + ["full_attention"]
    cfg._attn_implementation = "eager"
    return type(hf.model.layers[0])(cfg, n).float().eval()


def add_mtp_module(ckpt, seed: int = 5) -> None:
    """A random MTP module in the checkpoint, under the published names (mtp.fc, mtp.pre_fc_norm_embedding /
    _hidden, mtp.layers.0.*, mtp.norm)."""
    from safetensors.torch import load_file, save_file

    hf = hf_model(ckpt)
    layer = _mtp_layer(hf)
    _randomize(layer, seed)
    d, g = hf.config.hidden_size, torch.Generator().manual_seed(seed)
    tensors = load_file(ckpt / "model.safetensors")
    tensors |= {f"mtp.layers.0.{k}": v.detach().clone().contiguous() for k, v in layer.state_dict().items()}
    tensors |= {"mtp.fc.weight": torch.randn(d, 2 * d, generator=g) / (2 * d) ** 0.5,
                "mtp.pre_fc_norm_embedding.weight": 0.2 * torch.randn(d, generator=g),
                "mtp.pre_fc_norm_hidden.weight": 0.2 * torch.randn(d, generator=g),
                "mtp.norm.weight": 0.2 * torch.randn(d, generator=g)}
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


@torch.no_grad()
def reference_mtp(ckpt, token_ids: list[int], drafts: int):
    """u_i = norm(layer(fc([pre_fc_norm_embedding(embed(t_{i+1})) | pre_fc_norm_hidden(h_i)]))), h the model's final
    (normed) hidden state; logits = lm_head(u); the chain feeds u back."""
    from safetensors.torch import load_file

    hf = hf_model(ckpt)
    w = {k[len("mtp."):]: v for k, v in load_file(ckpt / "model.safetensors").items() if k.startswith("mtp.")}
    layer = _mtp_layer(hf)
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = copy.deepcopy(hf.model.norm)
        norms[name].weight.copy_(w[f"{name}.weight"])
    h = hf.model(torch.tensor([token_ids])).last_hidden_state[0]

    def block(z):
        n = z.shape[0]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(z[None], position_embeddings=hf.model.rotary_emb(z[None], positions), attention_mask=mask,
                    position_ids=positions)
        return norms["norm"]((out[0] if isinstance(out, tuple) else out)[0])

    def combine(tokens, hidden):
        e = norms["pre_fc_norm_embedding"](hf.model.embed_tokens(tokens))
        return torch.cat([e, norms["pre_fc_norm_hidden"](hidden)], -1) @ w["fc.weight"].T

    return chained_reference(block, combine, hf.lm_head, token_ids, h, drafts)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("hybrid-mtp")
    out = {}
    for name in NAMES:
        out[name] = build_echo_hybrid(root, name, tokenizer_dir)
        add_mtp_module(out[name])
    return out


@pytest.mark.parametrize("name", NAMES)
def test_mtp_module_matches_the_reference(dirs, name):
    ids = torch.randint(1, 300, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    assert_module_matches_reference(dirs[name], ids, reference=reference_mtp, max_num_seqs=4)


@pytest.mark.parametrize("name", NAMES)
def test_mtp_greedy_equals_transformers_with_restores_chunks_prefix_hits_and_preemption(dirs, name):
    path = dirs[name]
    model = hf_model(path)
    expected = [hf_greedy(model, p, NEW) for p in PROMPTS]
    from atlas import SamplingParams

    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    llm = LLM(str(path), block_size=8, speculative="mtp", speculative_policy="always", num_draft_tokens=2,
              max_num_batched_tokens=24, max_num_seqs=4, num_gpu_blocks_override=14, max_model_len=64)
    restores = record_restores(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.scheduler.stats
    # (the random module of the echoing Qwen3-Next guesses some continuations; Qwen3.5-MoE's none, all rejected)
    assert (stats.spec_num_accepted_tokens > 0) == (name == "qwen3_next")
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens
    assert restores and llm.engine.scheduler.num_preemptions > 0
    assert_all_returned(llm)
    roomy = LLM(str(path), block_size=8, speculative="mtp", speculative_policy="always", num_draft_tokens=2,
                max_num_seqs=4)
    for _ in range(2):  # (the second time from a cached prefix: pages and a state snapshot)
        again = roomy.generate({"prompt_token_ids": PROMPTS[0]}, params)[0]
        assert again.outputs[0].token_ids == expected[0]
    assert again.num_cached_tokens > 0
    assert_all_returned(roomy)


SPEC_COUNTS = ("spec_num_verify_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens")


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_mtp_under_parallelism_equals_transformers_and_one_device(dirs, parallel):
    """Two ranks on gloo. Tensor parallelism: the driver drafts alone with the module built whole and whole copies
    of the embedding and of the LM head it reads through (the model's are vocabulary shards); pipeline: on the
    first stage, the last layer's rows sent back to it. Transformers' tokens, and the drafts and acceptances of one
    device (drafts made from wrong hidden states or a head shard would differ)."""
    from test_parallel import PARALLEL

    from atlas import SamplingParams

    path = dirs["qwen3_next"]
    model = hf_model(path)
    expected = [hf_greedy(model, p, NEW) for p in PROMPTS]
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    engine = dict(speculative="mtp", speculative_policy="always", num_draft_tokens=2, block_size=8, max_num_seqs=4,
                  max_model_len=64)
    one = LLM(str(path), **engine)
    assert [o.outputs[0].token_ids for o in one.generate([{"prompt_token_ids": p} for p in PROMPTS], params)] == expected
    llm = LLM(str(path), **{parallel: 2}, **engine, **PARALLEL)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].token_ids for o in outs] == expected
        stats, alone = llm.engine.scheduler.stats, one.engine.scheduler.stats
        assert [getattr(stats, c) for c in SPEC_COUNTS] == [getattr(alone, c) for c in SPEC_COUNTS]
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
        if parallel == "tensor_parallel_size":
            assert llm.engine.runner.proposer_context().whole_lm_head is not None
    finally:
        llm.shutdown()


def test_a_token_map_through_the_targets_head_drafts_as_the_whole_head_also_split_over_two_ranks(dirs, tmp_path):
    """--speculative-token-map with the hybrid MTP module, which scores drafts with the target's LM head: a map of
    every id drafts and accepts what the whole head does, on one device and with tensor parallelism (the driver's
    whole copy of the head gives the map's rows); transformers' tokens either way."""
    import json

    from test_parallel import PARALLEL

    from atlas import SamplingParams

    path = dirs["qwen3_next"]
    expected = [hf_greedy(hf_model(path), p, NEW) for p in PROMPTS]
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    engine = dict(speculative="mtp", speculative_policy="always", num_draft_tokens=2, block_size=8, max_num_seqs=4,
                  max_model_len=64)
    whole = LLM(str(path), **engine)
    vocab = whole.engine.model_config.vocab_size
    every = tmp_path / "every.json"
    every.write_text(json.dumps(list(range(vocab))))
    assert [o.outputs[0].token_ids for o in whole.generate([{"prompt_token_ids": p} for p in PROMPTS], params)] == expected
    counts = [getattr(whole.engine.scheduler.stats, c) for c in SPEC_COUNTS]
    assert counts[2] > 0
    mapped = LLM(str(path), **engine, speculative_token_map=str(every))
    assert [o.outputs[0].token_ids for o in mapped.generate([{"prompt_token_ids": p} for p in PROMPTS], params)] == expected
    assert [getattr(mapped.engine.scheduler.stats, c) for c in SPEC_COUNTS] == counts
    llm = LLM(str(path), tensor_parallel_size=2, **engine, **PARALLEL, speculative_token_map=str(every))
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert [getattr(llm.engine.scheduler.stats, c) for c in SPEC_COUNTS] == counts
        assert llm.engine.proposer.token_map is not None
    finally:
        llm.shutdown()


def test_a_checkpoint_without_the_module_is_refused_by_name(tmp_path, tokenizer_dir):
    path = build_hybrid(tmp_path, "qwen3_5", tokenizer_dir, mtp_num_hidden_layers=1)
    with pytest.raises(ModelLoadError, match=r"has no MTP module \(no mtp\.\* tensors\)"):
        LLM(str(path), speculative="mtp")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("no_tf32")
def test_mtp_on_cuda_equals_transformers(dirs):
    """On the GPU (eager steps: Triton attention and the recurrent decode kernel), fp32: MTP drafts kept and
    rejected, tokens equal transformers'."""
    from atlas import SamplingParams

    path = dirs["qwen3_next"]
    ref = hf_model(path, dtype=torch.float32, device="cuda")
    llm = LLM(str(path), device="cuda", dtype="float32", kv_cache_memory=CUDA_KV, max_model_len=256,
              block_size=16, speculative="mtp", speculative_policy="always", num_draft_tokens=2, max_num_seqs=8)
    restores = record_restores(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, NEW) for p in PROMPTS]
    assert llm.engine.scheduler.stats.spec_num_accepted_tokens > 0 and restores
    assert_all_returned(llm)
