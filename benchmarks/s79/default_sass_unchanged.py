"""Whether a change to atlas/kernels/moe_triton.py leaves the MXFP4 row tiles' default form compiling to the same sm_90
SASS as another tree's (CPU): each row-tiles kernel at 32 and 64 runs a step, in the `bits` decode, hashed without
its comments and addresses. Session 79 ran it on the session's start (afb7403) and on 48c8b81 (the decode forms added)
to show that the default kernels the GPU tests ran on this session are the code the tree ships; factoring the run's
scale load into a helper changed down's SASS at 32 runs, and so was left out.

    python benchmarks/s79/default_sass_unchanged.py              # this tree's hashes
    git stash; python benchmarks/s79/default_sass_unchanged.py; git stash pop   # (or a checkout of another tree)
"""

import hashlib
import re
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import sass_loop_mix as s  # noqa: E402


def main() -> None:
    warnings.filterwarnings("ignore")
    table = s.kernels()
    for name in ("mxfp4-moe-gate-up-rt", "mxfp4-moe-down-rt"):
        kernel, sig, const, div, _, stages, _ = table[name]
        for runs in (32, 64):
            constants = dict(const, RUNS=runs, EVEN_K=False)
            if "DECODE" in kernel.arg_names:
                constants["DECODE"] = 0
            compiled = s.compile_sm90(kernel, sig, constants, div, runs // 16, stages)
            sass = "\n".join(line for line in compiled.asm["sass"].splitlines()
                             if not line.strip().startswith(("//", ".")))
            sass = re.sub(r"/\*[0-9a-f]{4}\*/", "", sass)
            print(name, runs, hashlib.sha256(sass.encode()).hexdigest()[:16])


if __name__ == "__main__":
    main()
