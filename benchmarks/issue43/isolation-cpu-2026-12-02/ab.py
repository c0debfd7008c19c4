"""Rows of tools/isolation_probe.py by name, with a shorter n x logprobs row (40 tokens), against the code tree in
PYTHONPATH; run from the repository root:

    PYTHONPATH=TREE python benchmarks/issue43/isolation-cpu-2026-12-02/ab.py OUT.json schema_10k,n128_logprobs_40
"""
import sys

sys.path.insert(0, "tools")
import isolation_probe as probe  # noqa: E402

rows = {
    "n128_logprobs_40": [("POST", "/v1/completions", {"model": "m", "prompt": ["a", "b"], "n": 128,
                                                     "max_tokens": 40, "logprobs": 20, "ignore_eos": True})],
    "schema_10k": probe._rows()["schema_10k"],
    "exp_templates": probe._rows()["exp_templates"],
}
names = sys.argv[2].split(",")
probe._rows = lambda: {k: rows[k] for k in names}
sys.argv = ["isolation_probe.py", "--out", sys.argv[1], "--settle-seconds", "5",
            "--serve-args=--trust-request-chat-template"]
raise SystemExit(probe.main())
