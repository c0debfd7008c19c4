"""`atlas serve` with the engine process's loop under cProfile: the host time per step, by function, written to
$OUT/engine_profile.txt when the server stops (SIGTERM). Usage: python tools/profile_serve.py serve FLAGS..."""

import cProfile
import os
import pstats
import sys

from atlas.engine import engine_process

_run = engine_process.EngineServer.run


def profiled_run(self) -> int:
    profile = cProfile.Profile()
    try:
        return profile.runcall(_run, self)
    finally:
        out = os.environ.get("OUT", "/tmp")
        with open(os.path.join(out, "engine_profile.txt"), "w") as f:
            stats = pstats.Stats(profile, stream=f)
            stats.sort_stats("tottime").print_stats(45)
            stats.sort_stats("cumulative").print_stats(45)


engine_process.EngineServer.run = profiled_run

from atlas.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
