"""Session 91: the aten ops a step of the plain engine and of an n-gram engine (policy adaptive) on the CPU, 64
random requests of 32 tokens x 48 greedy tokens on a tiny random checkpoint (`python tools/make_random_checkpoint.py
--shape tiny --out /tmp/tinyck --std 0.2 --dtype bfloat16`): whether an n-gram engine that drafts nothing does more
work a step than a plain one (issue 38's n-gram row at 256 streams, 0.967x with no step drafted).

    python benchmarks/s91/ops_per_step.py plain; python benchmarks/s91/ops_per_step.py ngram
"""
import collections
import sys

import torch

from atlas import LLM, SamplingParams

method = sys.argv[1]
kw = {} if method == "plain" else dict(speculative="ngram", speculative_policy="adaptive")
llm = LLM("/tmp/tinyck", skip_tokenizer_init=True, max_model_len=256, kv_cache_memory="256MiB", **kw)
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(10, 500, (32,), generator=g).tolist()} for _ in range(64)]
params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
llm.generate(prompts, params)
steps0 = llm.engine.scheduler.stats.num_steps
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    llm.generate(prompts, params)
steps = llm.engine.scheduler.stats.num_steps - steps0
c = collections.Counter()
for e in prof.events():
    # (the ops the engine calls itself: an aten op whose caller is not another aten op)
    if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")):
        c[e.name] += 1
print(method, "steps", steps)
for k, v in sorted(c.items(), key=lambda kv: -kv[1])[:40]:
    print(f"{v / steps:8.2f} {k}")
