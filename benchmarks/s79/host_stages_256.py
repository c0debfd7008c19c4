"""The host's Python a step at 256 requests (CPU): a plain engine against an n-gram engine with its policy held plain
(every step plain), alternated twice, `cProfile` over `generate` of 256 random prompts of 128 tokens (96 greedy
output tokens each, ignore_eos); prints ms a step and each engine's 30 costliest atlas functions by own time.

    python tools/make_random_checkpoint.py --shape tiny --out /tmp/tiny --std 0.2 --dtype bfloat16
    python benchmarks/s79/host_stages_256.py /tmp/tiny [--concurrency 256]
"""

import argparse
import cProfile
import pstats
import random
import time

from atlas import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--concurrency", type=int, default=256)
    args = ap.parse_args()
    c = args.concurrency
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 500) for _ in range(128)]} for _ in range(c)]
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    for method in ("plain", "ngram", "plain", "ngram"):
        extra = {} if method == "plain" else dict(speculative="ngram", num_draft_tokens=4)
        llm = LLM(model=args.model, skip_tokenizer_init=True, kv_cache_memory="1GiB", max_num_seqs=c, **extra)
        llm.generate(prompts[:8], params)
        engine = llm.engine
        if method != "plain":  # (held plain: the drafting engine's plain steps)
            engine.policy.decide = lambda request_ids, remaining=None: False
        steps0 = engine.stats.num_steps
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        llm.generate(prompts, params)
        prof.disable()
        wall, steps = time.perf_counter() - t0, engine.stats.num_steps - steps0
        print(f"== {method}: {steps} steps, {1000 * wall / steps:.2f} ms a step, drafted steps "
              f"{engine.stats.spec_num_drafted_steps}")
        rows = [(tt, ct, nc, f.split("atlas/")[-1], line, name)
                for (f, line, name), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items() if "atlas" in f]
        for tt, ct, nc, f, line, name in sorted(rows, reverse=True)[:30]:
            print(f"  own {1000 * tt / steps:7.3f} with callees {1000 * ct / steps:7.3f} ms a step  "
                  f"x{nc / steps:6.1f}  {f}:{line} {name}")
        del llm, engine


if __name__ == "__main__":
    main()
