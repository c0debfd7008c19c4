"""N-gram speculative decoding for the hybrid linear-attention models (Qwen3-Next, Qwen3.5), lossless: a verify step
of K drafts advances the recurrent state K + 1 rows, so the scheduler backs each verifying sequence's state slot up
before the step (StepBatch.state_backups) and, when drafts were rejected, restores it before the next step and
replays the kept rows' saved inputs through the linear-attention layers (StepBatch.state_replays). Greedy tokens with every step drafting equal transformers' (and
so plain greedy) on prompts whose continuations repeat (drafts accepted) and on ones where drafts are rejected, in
mixed batches under a small token budget (chunked prefill), with prefix caching and across preemption; every page,
slot and snapshot comes back; a separate draft model, EAGLE-3 and DFlash drafters the same way (the model's own MTP
module: tests/test_hybrid_mtp.py)."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, hf_model
from test_hybrid_models import build_hybrid, greedy
from test_hybrid_prefix_cache import assert_all_returned

from atlas import LLM
from atlas.layers.linear_attention import state_bytes_per_sequence

NEW = 24
# The models' LM head is a copy of their embedding, so their greedy continuations often repeat a token or a stretch
# (n-gram drafts, of 1-grams up, get accepted) and as often leave it (drafts get rejected).
PROMPTS = [list(range(100, 110)) * 3, [5, 17, 42, 99, 3] * 3, list(range(200, 221)), [7] * 12, [9, 8],
           [11, 12, 13, 11, 12, 13, 11]]


def build_echo_hybrid(root, name, tokenizer_dir):
    import torch
    from transformers import AutoModelForCausalLM

    src = build_hybrid(root, name, tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.copy_(model.get_input_embeddings().weight)
    model.save_pretrained(src)
    return src


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("hybrid-spec")
    return {name: build_echo_hybrid(root, name, tokenizer_dir) for name in ("qwen3_next", "qwen3_5")}


@pytest.fixture(scope="module")
def expected(dirs):
    out = {}
    for name, path in dirs.items():
        model = hf_model(path)
        out[name] = [hf_greedy(model, p, NEW) for p in PROMPTS]
    return out


def spec_llm(path, **kw):
    return LLM(str(path), block_size=8, speculative="ngram", speculative_policy="always", ngram_min=1, **kw)


def record_restores(llm) -> list[int]:
    """The state slots restored from their backups (the runner's copies out of a backup slot), as they happen."""
    restores: list[int] = []
    runner = llm.engine.runner
    original = runner.states.copy

    def copy_states(pairs):
        backups = runner.num_state_slots + runner.num_state_snapshots
        restores.extend(dst for src, dst in pairs if src >= backups)
        return original(pairs)

    runner.states.copy = copy_states
    return restores


def assert_accepted_and_rejected(llm, restores) -> None:
    stats = llm.engine.scheduler.stats
    assert stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens  # (rejections)
    assert restores  # (each rejection restored the state from before its verify step)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_ngram_greedy_equals_transformers_in_mixed_chunked_steps(name, dirs, expected):
    """Six prompts at once under a 16-token budget (prompts chunked while the others verify drafts, in the same
    steps), prefix caching on (snapshots): every step drafts, some drafts are kept and some rejected, and the tokens
    equal transformers'; then one prompt alone."""
    llm = spec_llm(dirs[name], kv_cache_memory="8MiB", max_num_batched_tokens=16, max_num_seqs=8)
    runner = llm.engine.runner
    assert runner.num_state_backups == runner.num_state_slots  # (counted in the memory plan with the slots)
    # (and the inputs of 1 + K rows a slot and layer, for a replay after a rejection)
    rows = runner.states.verify_rows
    assert rows == llm.engine.proposer.num_draft_tokens + 1
    inputs = runner.num_state_slots * rows * sum(spec.verify_row_values for spec in runner.state_specs)
    assert runner.state_bytes == (2 * runner.num_state_slots * state_bytes_per_sequence(runner.state_specs, runner.dtype)
                                  + inputs * runner.dtype.itemsize)
    restores = record_restores(llm)
    assert greedy(llm, PROMPTS, n=NEW) == expected[name]
    assert_accepted_and_rejected(llm, restores)
    assert_all_returned(llm)
    assert greedy(llm, PROMPTS[1:2], n=NEW) == expected[name][1:2]
    assert_all_returned(llm)


def test_ngram_verify_steps_through_the_cuda_graphs_static_inputs(dirs, expected):
    """Verify steps (1 + K rows a sequence) through the CUDA graphs' static buffers (uncaptured on a CPU: --tuning
    static_steps=1): the state advances K + 1 rows from device tensors, backups and restores around it as eagerly;
    transformers' tokens."""
    llm = spec_llm(dirs["qwen3_next"], kv_cache_memory="8MiB", max_num_batched_tokens=16, max_num_seqs=8,
                   tuning={"static_steps": "1"})
    verify = [g for q, g in llm.engine.runner.step_graphs.items() if q > 1]
    restores = record_restores(llm)
    assert greedy(llm, PROMPTS, n=NEW) == expected["qwen3_next"]
    assert_accepted_and_rejected(llm, restores)
    assert verify and all(g.state_scratch_slot is not None for g in verify) and sum(g.steps_run for g in verify) > 0
    assert_all_returned(llm)
    # One prompt alone: after its prefill every step is a uniform one (a rejection's kept rows are replayed into the
    # state before the next step, not recomputed in it as a mixed step), drafts kept and rejected.
    graphs = llm.engine.runner.step_graphs.values()
    stats = llm.engine.scheduler.stats
    before = (stats.num_steps, sum(g.steps_run for g in graphs), len(restores), stats.spec_num_accepted_tokens)
    assert greedy(llm, PROMPTS[1:2], n=NEW) == expected["qwen3_next"][1:2]
    steps, graphed = stats.num_steps - before[0], sum(g.steps_run for g in graphs) - before[1]
    assert graphed == steps - 1 and len(restores) > before[2] and stats.spec_num_accepted_tokens > before[3]
    assert_all_returned(llm)


def test_ngram_mixed_steps_through_the_graphs_static_buffers(dirs, expected):
    """--tuning mixed_graph_recurrent_rows with static_steps (on a CPU: the mixed-step graphs' static buffers,
    uncaptured): chunked prompts beside verify steps take those buffers, which keep each verifying row's inputs in
    its slot's rows for a replay after a rejection; drafts kept and rejected, transformers' tokens."""
    llm = spec_llm(dirs["qwen3_5"], kv_cache_memory="8MiB", max_num_batched_tokens=16, max_num_seqs=8,
                   tuning={"static_steps": "1", "mixed_graph_recurrent_rows": "16"})
    mixed = llm.engine.runner.mixed_graphs
    assert mixed is not None and mixed.states is not None
    assert mixed.states.verify_rows == llm.engine.runner.states.verify_rows == llm.engine.proposer.num_draft_tokens + 1
    restores = record_restores(llm)
    assert greedy(llm, PROMPTS, n=NEW) == expected["qwen3_5"]
    assert_accepted_and_rejected(llm, restores)
    assert mixed.steps_run > 0
    assert_all_returned(llm)


def test_ngram_across_preemption(dirs, expected):
    """Too few pages: requests are preempted (with a restore pending or a backup taken, their slots go back) and
    recomputed; tokens still equal transformers'."""
    llm = spec_llm(dirs["qwen3_5"], num_gpu_blocks_override=9, max_model_len=64, max_num_seqs=4)
    restores = record_restores(llm)
    assert greedy(llm, PROMPTS, n=NEW) == expected["qwen3_5"]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_accepted_and_rejected(llm, restores)
    assert_all_returned(llm)


def repeating_drafter(root, tokenizer_dir):
    """A Qwen3 drafter (the models' vocabulary) that proposes its last token again: its layers add nothing (o_proj
    and down_proj zero) and its LM head is its embedding. The echoing targets often repeat a token, so some of its
    drafts are kept and some rejected."""
    import torch
    from conftest import build_checkpoint
    from safetensors.torch import load_file, save_file

    path = build_checkpoint(root, "Qwen3ForCausalLM", tokenizer_dir)
    tensors = load_file(path / "model.safetensors")
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "dflash"])
@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_drafters_with_their_own_cache_equal_transformers(name, method, dirs, expected, tmp_path, tokenizer_dir):
    """Drafters with their own KV cache and no recurrent state over the same backups and restores as n-gram drafts:
    chunked prompts beside verify steps, drafts rejected (the state restored) and, from the repeating draft model,
    kept; tokens equal transformers'. EAGLE-3 reads target layers 1-3, DFlash layers 1 and 3 (random drafters)."""
    from test_dflash import write_drafter
    from test_eagle3 import write_eagle3_drafter

    drafter = {"draft_model": lambda: repeating_drafter(tmp_path, tokenizer_dir),
               "eagle3": lambda: write_eagle3_drafter(tmp_path / "eagle3", hidden=64, vocab=384, draft_vocab=384,
                                                      aux_ids=[1, 2, 3], seed=1),
               "dflash": lambda: write_drafter(tmp_path / "dflash", hidden=64, layer_ids=[1, 3], mask_token_id=383,
                                               block_size=4)}[method]()
    llm = LLM(str(dirs[name]), block_size=8, speculative=method, draft_model=str(drafter),
              num_draft_tokens=3, speculative_policy="always", max_num_batched_tokens=24, max_num_seqs=4,
              kv_cache_memory="32MiB")
    restores = record_restores(llm)
    assert greedy(llm, PROMPTS, n=NEW) == expected[name]
    stats = llm.engine.scheduler.stats
    assert restores and stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens
    if method == "draft_model":
        assert stats.spec_num_accepted_tokens > 0
    assert_all_returned(llm)
