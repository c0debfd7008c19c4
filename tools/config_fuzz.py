"""Random engine configurations against the plain engine, on tiny random checkpoints of the families Atlas loads (CPU,
float32): the interactions no single test walks (preemption with n > 1 siblings, prefix-cache hits mid-batch, the
priority policy on a tight pool, chunked prefill under speculation, pipeline stages, ...).

Each configuration draws engine flags (prefix caching, a pool from one sequence's pages up, max_num_seqs, the token
budget, block size, asynchronous scheduling, the static-buffer path, the priority policy, per-request slot shares,
the long-prefill cap, hybrid models' snapshots, a proposer: n-gram, MTP where the family has it, EAGLE-3 and a draft
model on their own small targets, TP = 2 or PP = 2 with --parallel) and a workload (shared prefixes, repeated text,
n of 1-3, penalties, min_tokens, logit bias, stop ids, logprobs, priorities). It checks that every completion equals
the plain engine's (one sequence slot free of all of the above) and that every KV page is back afterwards; a greedy
completion that parts from it where the reference's top two logprobs are within 1e-5 (`near_tie`: float32 rounding of
another batch decides such a tie either way) is printed as a near-tie, not counted as a failure.
Greedy by default; --sampled draws seeded samples instead (speculation off), which the README says are the same
whatever else is batched; --aborts aborts some requests part-way, as clients that go away, and the others must not
change. Exit status 1 if any configuration fails; `--only K` reruns configuration K of a seed.

    python tools/config_fuzz.py [--seed 0] [--configs 100] [--families qwen3,gemma3,...] [--sampled] [--parallel]
        [--aborts] [--only K] [--workdir /tmp/atlas-config-fuzz]

The checkpoints are the test suite's (tests/conftest.py and the family test modules), built once under --workdir.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import conftest as C  # noqa: E402
import test_moe_families  # noqa: E402

from atlas import LLM, SamplingParams  # noqa: E402
from atlas.errors import ConfigError, UnsupportedModelError  # noqa: E402


def _builders(tmp: Path) -> dict:
    """family -> () -> checkpoint path (the test suite's tiny configs); '*_drafter' are drafters, not families."""
    import test_cohere
    import test_eagle3
    import test_gemma2
    import test_gpt_oss
    import test_hybrid_models
    import test_llama4
    import test_ssm_hybrids

    small = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, num_hidden_layers=4)
    builders = {
        "qwen3": lambda: C.build_checkpoint(tmp, "Qwen3ForCausalLM", None),
        "llama": lambda: C.build_checkpoint(tmp, "LlamaForCausalLM", None),
        "mistral_window": lambda: C.build_checkpoint(tmp, "MistralForCausalLM", None),
        "gemma3": lambda: C.build_gemma3_checkpoint(tmp),
        "gemma4": lambda: C.build_gemma4_checkpoint(tmp),
        "deepseek_v3": lambda: C.build_deepseek_checkpoint(tmp, "v3"),
        "deepseek_v2_lite": lambda: C.build_deepseek_checkpoint(tmp, "v2-lite"),
        "qwen3_moe": lambda: test_moe_families.build_moe_checkpoint(tmp, "qwen3_moe"),
        "glm4_moe": lambda: test_moe_families.build_moe_checkpoint(tmp, "glm4_moe"),
        "gpt_oss": lambda: test_gpt_oss.build_gpt_oss_checkpoint(tmp),
        "llama4": lambda: C._build(tmp, "llama4", test_llama4.LLAMA4, None, 0, {}),
        "gemma2": lambda: C._build(tmp, "gemma2", test_gemma2.GEMMA2, None, 0, {}, randomize=C._gemma_norms),
        "cohere2": lambda: C._build(tmp, "cohere2", test_cohere.CONFIGS["cohere2"], None, 0, {}),
        "minimax_m2": lambda: test_moe_families.build_moe_checkpoint(tmp, "minimax_m2"),
        "qwen3_5": lambda: test_hybrid_models.build_hybrid(tmp, "qwen3_5", None),
        "qwen3_next": lambda: test_hybrid_models.build_hybrid(tmp, "qwen3_next", None),
        "granite_h": lambda: C._build(tmp, "granite_h", test_ssm_hybrids.CONFIGS["moe"], None, 0, {}),
        "nemotron_h": lambda: C._build(tmp, "nemotron_h", test_ssm_hybrids.CONFIGS["nemotron_h"], None, 0, {}),
        "bamba": lambda: C._build(tmp, "bamba", test_ssm_hybrids.CONFIGS["bamba"], None, 0, {}),
        "jamba": lambda: C._build(tmp, "jamba", test_ssm_hybrids.CONFIGS["jamba"], None, 0, {}),
        "lfm2": lambda: C._build(tmp, "lfm2", test_ssm_hybrids.CONFIGS["lfm2_bias"], None, 0, {}),
        "lfm2_moe": lambda: C._build(tmp, "lfm2_moe", test_ssm_hybrids.CONFIGS["lfm2_moe"], None, 0, {},
                                     randomize=test_ssm_hybrids.routing_biases),
        "falcon_h1": lambda: C._build(tmp, "falcon_h1", test_ssm_hybrids.CONFIGS["falcon_h1"], None, 0, {}),
        "nemotron_h_moe": lambda: C._build(tmp, "nemotron_h_moe", test_ssm_hybrids.CONFIGS["nemotron_h_moe"], None,
                                           0, {}, randomize=test_ssm_hybrids.routing_biases),
        "eagle3_target": lambda: C.build_checkpoint(tmp, "Qwen3ForCausalLM", None, seed=1, **small),
        "eagle3_drafter": lambda: test_eagle3.write_eagle3_drafter(
            tmp / "eagle3-drafter", hidden=32, vocab=16, draft_vocab=12, aux_ids=[1, 2, 3], heads=2, kv_heads=1,
            intermediate=64, seed=2),
        "draft_model_drafter": lambda: C.build_checkpoint(tmp, "Qwen3ForCausalLM", None, seed=7, hidden_size=32,
                                                          intermediate_size=64, num_hidden_layers=1),
    }
    # The rest of the families the test suite builds: its dense table by model type, its MoE table by family.
    for family, arch in DENSE.items():
        builders[family] = lambda arch=arch: C.build_checkpoint(tmp, arch, None)
    for family in MOE:
        builders[family] = lambda family=family: test_moe_families.build_moe_checkpoint(tmp, family)
    return builders


# model type -> architecture of the test suite's dense table (conftest.ARCH_CONFIGS) not named above; MoE families of
# test_moe_families.CONFIGS not named above
DENSE = {spec["model_type"]: arch for arch, spec in C.ARCH_CONFIGS.items()
         if arch not in ("LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")}
MOE = [f for f in test_moe_families.CONFIGS if f not in ("qwen3_moe", "glm4_moe", "minimax_m2")]
FAMILIES = ["qwen3", "llama", "mistral_window", "gemma3", "gemma4", "deepseek_v3", "deepseek_v2_lite", "qwen3_moe",
            "glm4_moe", "gpt_oss", "qwen3_5", "qwen3_next", "eagle3_target", "llama4", "gemma2", "cohere2",
            "minimax_m2", "granite_h", "nemotron_h", "bamba", "falcon_h1", "nemotron_h_moe", "lfm2",
            "lfm2_moe", "jamba", *DENSE, *MOE]
VOCAB = {"eagle3_target": 16}  # (the rest: conftest.VOCAB)
HYBRIDS = {"qwen3_5", "qwen3_next", "granite_h", "nemotron_h", "bamba", "falcon_h1", "nemotron_h_moe", "lfm2",
           "lfm2_moe", "jamba"}


def checkpoints(workdir: Path, names: list[str]) -> dict[str, Path]:
    """Each named checkpoint under workdir, built the first time."""
    builders = _builders(workdir / "building")
    out = {}
    for name in names:
        path = workdir / name
        if not path.exists():
            built = builders[name]()
            built.rename(path)
        out[name] = path
    return out


def engine_flags(r: random.Random, family: str, paths: dict[str, Path], args) -> dict:
    bs = r.choice([8, 16])
    pages = args.max_model_len // bs
    flags = dict(skip_tokenizer_init=True, max_model_len=args.max_model_len, block_size=bs,
                 enable_prefix_caching=r.random() < 0.6,
                 num_gpu_blocks_override=r.choice([pages + 1, pages + 3, 3 * pages, 200]),
                 max_num_seqs=r.choice([1, 2, 3, 8, 64]), max_num_batched_tokens=r.choice([16, 33, 64, 2048]),
                 async_scheduling=r.random() < 0.7)
    proposers = [None, None] if args.sampled else [None, None, "ngram"]
    if not args.sampled and family == "deepseek_v3":
        proposers += ["mtp", "mtp"]
    if family == "eagle3_target":
        proposers = [None] if args.sampled else ["eagle3", "eagle3", "ngram"]
    elif family == "qwen3" and not args.sampled:
        proposers.append("draft_model")
    proposer = r.choice(proposers)
    if proposer:
        flags.update(speculative=proposer, speculative_policy=r.choice(["adaptive", "always"]),
                     num_draft_tokens=r.choice([1, 2, 4] if proposer == "ngram" else [1, 2, 3]))
        if proposer in ("eagle3", "draft_model"):
            flags["draft_model"] = str(paths[f"{proposer}_drafter"])
    if r.random() < 0.3:
        flags["tuning"] = {"static_steps": True}
    if r.random() < 0.3:
        flags["scheduling_policy"] = "priority"
    if r.random() < 0.3:
        flags["max_num_seqs_per_request"] = min(flags["max_num_seqs"], r.choice([1, 2]))
    if r.random() < 0.3:
        flags["long_prefill_token_threshold"] = r.choice([8, 20])
    if family in HYBRIDS and r.random() < 0.2:
        flags["state_snapshots"] = r.choice([0, 2])
    if args.parallel:
        key = r.choice(["tensor_parallel_size", "pipeline_parallel_size"])
        flags[key] = 2
    if args.kv_cache_dtype != "auto":
        flags["kv_cache_dtype"] = args.kv_cache_dtype
    return flags


def workload(r: random.Random, vocab: int, sampled: bool, priorities: bool, max_len: int) -> tuple[list, list]:
    """Prompts and their parameters; a prompt and its output each take up to about half of max_len."""
    prompts, params = [], []
    for _ in range(r.randint(3, 10)):
        p = [r.randint(1, vocab - 1) for _ in range(r.randint(2, max_len * 15 // 32))]
        if prompts and r.random() < 0.4:  # (a prefix of an earlier prompt, then its own tail)
            q = r.choice(prompts)
            p = q[:r.randint(1, len(q))] + p[:r.randint(0, 30)]
        if r.random() < 0.2:  # (repeated text: the n-gram proposer's case)
            unit = p[:r.randint(2, 5)]
            p = (unit * 30)[:r.randint(8, 70)]
        kw = dict(max_tokens=r.randint(1, max_len * 25 // 64), n=r.choice([1, 1, 1, 2, 3]), ignore_eos=r.random() < 0.8,
                  temperature=0.0)
        if sampled:
            kw.update(temperature=r.choice([0.7, 1.0, 1.3]), seed=r.randint(0, 10**6), top_k=r.choice([0, 5, 50]),
                      top_p=r.choice([1.0, 0.9]), min_p=r.choice([0.0, 0.05]))
        x = r.random()
        if x < 0.1:
            kw["repetition_penalty"] = 1.3
        elif x < 0.2:
            kw.update(presence_penalty=0.8, frequency_penalty=0.3)
        elif x < 0.27:
            kw["min_tokens"] = r.randint(0, kw["max_tokens"])
        elif x < 0.34:
            kw["logit_bias"] = {r.randint(1, vocab - 1): r.choice([-100.0, 8.0])}
        elif x < 0.42:
            kw["stop_token_ids"] = [r.randint(1, vocab - 1) for _ in range(min(20, vocab // 8))]
        elif x < 0.5:
            kw["logprobs"] = 2
        if priorities and r.random() < 0.3:
            kw["priority"] = r.randint(-2, 2)
        prompts.append(p)
        params.append(SamplingParams(**kw))
    return prompts, params


class NoProgress(Exception):
    pass


def completions(llm: LLM, prompts: list, params: list, aborts: dict[int, int] | None = None,
                max_steps: int = 20_000, record=lambda c: list(c.token_ids)) -> list[list | None]:
    """Each request's completions (`record` of each: its tokens), stepping the engine as LLM.generate does, but at
    most max_steps: a scheduler that stops making progress (requests preempting one another forever) fails the
    configuration. prompts: token-id lists or texts. aborts: {request index: engine step} to abort it at (as a
    client that goes away); None for a request aborted before it finished."""
    core = llm.engine
    ids = [core.add_request({"prompt_token_ids": p} if isinstance(p, list) else p, sp)
           for p, sp in zip(prompts, params, strict=True)]
    done, aborts = {}, aborts or {}
    for step in range(max_steps):
        for i, at in aborts.items():
            if at == step and ids[i] not in done and core.abort_request(ids[i]):
                done[ids[i]] = None
        for out in core.step(final_only=True):
            if out.finished and out.request_id not in done:
                done[out.request_id] = [record(c) for c in out.outputs]
        if len(done) == len(ids):
            return [done[rid] for rid in ids]
    raise NoProgress(f"{len(ids) - len(done)} of {len(ids)} requests unfinished after {max_steps} engine steps")


TIE = 1e-5  # logprob gap under which two greedy tokens are a tie that float32 rounding may decide either way


def near_tie(reference: LLM, prompt: list, params: SamplingParams, want: list, gots: list) -> bool:
    """Whether every greedy completion in gots that differs from want parts from it where the reference's top two
    raw logprobs are within TIE (the two tokens there), so that the rest differs by a tie, not by a fault. Only for
    greedy requests with nothing processing the logits (no penalties, bias, token lists or min_tokens), whose raw
    logprobs are the distribution greedy decoding picks from, and completions recorded as token ids."""
    if (not isinstance(prompt, list) or not params.greedy or params.changes_logits or params.bad_words
            or params.min_tokens or params.structured_outputs
            or not all(isinstance(c, list) for got in [want, *gots] if got is not None for c in got)):
        return False
    parted = [(w, g) for got in gots if got is not None for w, g in zip(want, got, strict=True) if w != g]
    if not parted:
        return False
    for w, g in parted:
        d = next((j for j, (a, b) in enumerate(zip(w, g, strict=False)) if a != b), None)
        if d is None:  # (one stopped where the other went on: no tie decides that)
            return False
        probe = dataclasses.replace(params, n=1, max_tokens=1, min_tokens=0, logprobs=2, stop_token_ids=[],
                                    ignore_eos=True)
        out = reference.generate({"prompt_token_ids": prompt + w[:d]}, probe, use_tqdm=False)[0].outputs[0]
        top = {token: getattr(lp, "logprob", lp) for token, lp in out.logprobs[0].items()}
        if w[d] not in top or g[d] not in top or abs(top[w[d]] - top[g[d]]) > TIE:
            return False
    return True


def check_configuration(reference: LLM, llm: LLM, prompts: list, params: list, aborts: dict[int, int],
                        prefix_caching: bool, record=lambda c: list(c.token_ids)) -> tuple[list, list, list[str]]:
    """Run the workload on the reference and on llm (some requests aborted part-way, as clients that go away: the
    others' completions must not change; with prefix caching, the same workload again, now from the cache) and
    compare. -> (the reference's completions, llm's, the failures as lines to print)."""
    want = completions(reference, prompts, params, record=record)
    got = completions(llm, prompts, params, aborts, record=record)
    again = completions(llm, prompts, params, record=record) if prefix_caching else got
    wrong = [i for i in range(len(want)) if got[i] not in (want[i], None) or (again is not got and again[i] != want[i])]
    failures = []
    ties = [i for i in wrong if near_tie(reference, prompts[i], params[i], want[i], [got[i], again[i]])]
    if ties:  # (printed before the configuration's verdict line, and not counted)
        print(f"   near-tie: {len(ties)} request(s) parted where the reference's top two logprobs are within {TIE} "
              "(float32 rounding of another batch, not a fault)", flush=True)
        wrong = [i for i in wrong if i not in ties]
    if wrong:
        i = wrong[0]
        failures.append(f"   {len(wrong)} of {len(want)} requests differ; request {i} ({prompts[i]!r:.60}, {params[i]}):\n"
                        f"   want {want[i]}\n   got  {got[i]}\n   again {again[i]}")
    try:
        C.assert_pages_returned(llm)
    except AssertionError as e:
        failures.append(f"   {e}")
    return want, got, failures


def finish(label: str, flags: dict, failures: list[str], llm: LLM, note: str = "") -> int:
    """Print a configuration's verdict and failures, shut its engine down; -> 1 if it failed."""
    print(label, "FAILED" if failures else "ok", *([note] if note else []), json.dumps(flags), flush=True)
    for line in failures:
        print(line, flush=True)
    llm.shutdown()
    gc.collect()
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", type=int, default=100)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--sampled", action="store_true", help="Seeded sampling (speculation off) instead of greedy.")
    ap.add_argument("--parallel", action="store_true", help="TP = 2 or PP = 2 (gloo) in every configuration.")
    ap.add_argument("--aborts", action="store_true", help="Abort some requests part-way (the rest must not change).")
    ap.add_argument("--max-model-len", type=int, default=256,
                    help="Prompts and outputs scale with it (longer generations cross more sliding windows).")
    ap.add_argument("--kv-cache-dtype", default="auto", help="Every engine's, the reference's included (e.g. fp8).")
    ap.add_argument("--only", type=int, default=None, help="Run configuration K of this seed alone.")
    ap.add_argument("--workdir", default="/tmp/atlas-config-fuzz")
    args = ap.parse_args()
    families = args.families.split(",")
    unknown = set(families) - set(FAMILIES)
    if unknown:
        ap.error(f"unknown families {sorted(unknown)}; choose from {FAMILIES}")
    drafters = ["eagle3_drafter"] * ("eagle3_target" in families) + ["draft_model_drafter"] * ("qwen3" in families)
    paths = checkpoints(Path(args.workdir), families + drafters)
    # The reference: one engine a family, nothing shared between sequences, nothing preempted, no speculation. It
    # takes the priority policy so that it accepts every request; with room for all, priorities change no output.
    references = {}
    for f in list(families):
        try:
            references[f] = LLM(str(paths[f]), skip_tokenizer_init=True, kv_cache_memory="64MiB",
                                max_model_len=args.max_model_len, enable_prefix_caching=False,
                                async_scheduling=False, scheduling_policy="priority", kv_cache_dtype=args.kv_cache_dtype)
        except ConfigError as e:
            if "--max-model-len" not in str(e):
                raise
            # (a tiny checkpoint whose position table is shorter than the asked length: that family sits this out)
            print(f"{f} left out: {e}", flush=True)
            families.remove(f)
    if not families:
        ap.error(f"no family's tiny checkpoint takes --max-model-len {args.max_model_len} (their position tables: above)")
    rng = random.Random(args.seed)
    failed = 0
    for k in range(args.configs):
        r = random.Random(rng.random())
        if args.only is not None and k != args.only:
            continue
        family = r.choice(families)
        flags = engine_flags(r, family, paths, args)
        priorities = flags.get("scheduling_policy") == "priority"
        prompts, params = workload(r, VOCAB.get(family, C.VOCAB), args.sampled, priorities, args.max_model_len)
        if not priorities:
            params = [dataclasses.replace(p, priority=0) for p in params]
        try:
            try:
                llm = LLM(str(paths[family]), **flags)
            except UnsupportedModelError as e:  # (a combination the engine refuses by name at start-up)
                print(k, family, "refused", json.dumps(flags), f"({e})", flush=True)
                continue
            aborts = {i: r.randint(0, 30) for i in range(len(prompts)) if args.aborts and r.random() < 0.3}
            _, _, failures = check_configuration(references[family], llm, prompts, params, aborts,
                                                 flags["enable_prefix_caching"])
            failed += finish(f"{k} {family}", flags, failures, llm)
        except Exception:
            failed += 1
            print(k, family, "ERROR", json.dumps(flags), flush=True)
            traceback.print_exc()
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":  # (the guard: parallel engines start their workers by spawning)
    sys.exit(main())
