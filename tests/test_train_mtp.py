"""tools/train_mtp_model.py on a tiny size (CPU, seconds): it trains a DeepSeek-V3-architecture model with
an MTP module, writes a checkpoint that transformers loads and Atlas serves with and without
--speculative mtp (same greedy tokens), and its MTP module reads back as the spec's MTP."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from conftest import hf_greedy, hf_model, tool_module
from safetensors import safe_open
from test_mtp import _last_layer_stream, reference_mtp

from atlas import LLM, SamplingParams
from atlas.speculative.proposer import CommittedTokens


def test_tiny_mtp_training_run(tmp_path):
    out = tmp_path / "mtp"
    args = ["--device", "cpu", "--out", str(out), "--max-steps", "4", "--time-budget-minutes", "0",
            "--corpus-limit-mb", "0.1", "--hidden-size", "32", "--num-layers", "2", "--num-attention-heads", "2",
            "--q-lora-rank", "0", "--kv-lora-rank", "16", "--qk-nope-head-dim", "8", "--qk-rope-head-dim", "8",
            "--v-head-dim", "8", "--intermediate-size", "64", "--moe-intermediate-size", "16",
            "--n-routed-experts", "4", "--seq-len", "64", "--batch-size", "4", "--warmup-steps", "2",
            "--eval-every", "2", "--eval-tokens", "512", "--eval-prompts", "2", "--eval-prompt-tokens", "12",
            "--eval-max-tokens", "6", "--eval-draft-tokens", "2"]
    assert tool_module("train_mtp_model").main(args) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert report["training"]["steps"] == 4
    assert 0.0 <= report["held_out_test"]["mtp_top1"] <= 1.0
    engine = report["engine_acceptance"]
    assert "error" not in engine and engine["mtp:2"]["outputs_equal_plain"] is True

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["num_nextn_predict_layers"] == 1
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    mtp = {n for n in names if n.startswith("model.layers.2.")}
    assert {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight",
            "model.layers.2.shared_head.head.weight", "model.layers.2.mlp.experts.3.down_proj.weight",
            "model.layers.2.mlp.gate.e_score_correction_bias"} <= mtp

    # transformers loads it, and Atlas's greedy tokens are its.
    hf = hf_model(out)
    prompt = [5, 9, 200, 31, 7]
    llm = LLM(str(out), kv_cache_memory="16MiB", speculative="mtp", num_draft_tokens=2)
    got = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert got[0].outputs[0].token_ids == hf_greedy(hf, prompt, 8)

    # The MTP module Atlas reads back is the spec's (transformers' block + the checkpoint's tensors).
    ids = torch.randint(0, config["vocab_size"], (20,), generator=torch.Generator().manual_seed(0)).tolist()
    ref_u, ref_drafts = reference_mtp(out, ids, 2)
    proposer, kv = llm.engine.proposer, llm.engine.kv
    req = SimpleNamespace(request_id="r", all_token_ids=ids, page_ids=kv.pool.allocate(2), num_computed_tokens=19)
    try:
        proposer.on_commit([CommittedTokens(req, 0, 19, _last_layer_stream(out, ids)[:19])])
        torch.testing.assert_close(proposer.state["r"][1], ref_u[18], rtol=1e-4, atol=1e-4)
        assert proposer.propose([req])[0].read_tokens() == ref_drafts
    finally:
        kv.pool.release(req.page_ids)
