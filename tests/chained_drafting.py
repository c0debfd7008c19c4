"""What the tests of drafters that chain on the device (EAGLE-3, MTP, a draft model) share: an engine's uniform steps
and the drafter's passes through the static buffers CUDA graphs replay (run eagerly on the CPU), and a run that
records the drafts queued right behind verify steps and those handed out from them."""

from __future__ import annotations

from atlas import SamplingParams


def through_static_buffers(llm, max_num_seqs: int):
    """The target's uniform steps and the drafter's (a chain and its pass over committed rows, or a draft model's
    decode steps) through their graphs' static buffers, eagerly."""
    proposer = llm.engine.proposer
    k = proposer.num_draft_tokens
    llm.engine.runner.capture_step_graphs(max_num_seqs, [1, k + 1], use_graphs=False)
    ctx = llm.engine.runner.proposer_context()
    if not hasattr(proposer, "capture_catch_up_graphs"):  # (a draft model)
        proposer.capture_step_graphs(ctx, use_graphs=False)
        return llm
    proposer.capture_catch_up_graphs(ctx, use_graphs=False)
    if k > 1:
        proposer.capture_chain_graphs(ctx, use_graphs=False)
    return llm


def greedy_then_mixed(llm, prompts: list[list[int]], params: SamplingParams, mixed: int):
    """Greedy outputs of every prompt, then of the first `mixed` with half of them sampled under a repetition
    penalty (a sampled step drafts after its read-back); -> (the tokens, (drafted, accepted), every request's drafts
    in order, chains queued behind verify steps (requests a step, 0 where none was), drafts handed out from them)."""
    proposer = llm.engine.proposer
    queued: list[int] = []
    handed_out: list[bool] = []
    drafts_of: dict[str, list[list[int]]] = {}
    after, propose = proposer.draft_after_verify, proposer.propose

    def recording_after(step):
        done = after(step)
        queued.append(len(step.request_ids) if done else 0)
        return done

    def recording_propose(requests):
        handed_out.extend(r.request_id in proposer.behind.ready for r in requests)
        drafts = propose(requests)
        for r, d in zip(requests, drafts, strict=True):
            drafts_of.setdefault(r.request_id, []).append(d.read_tokens())
        return drafts

    if llm.engine.runner.draft_after_verify is not None:
        llm.engine.runner.draft_after_verify = recording_after
    proposer.propose = recording_propose
    sampled = [SamplingParams(max_tokens=params.max_tokens, temperature=0.8, seed=i, repetition_penalty=1.3,
                              ignore_eos=True) for i in range(mixed // 2)]
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    both = llm.generate([{"prompt_token_ids": p} for p in prompts[:mixed]],
                        [params] * (mixed - len(sampled)) + sampled)
    stats = llm.engine.stats
    return ([o.outputs[0].token_ids for o in greedy + both],
            (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens), drafts_of, queued, handed_out)
