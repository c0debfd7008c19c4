"""`atlas serve` with the engine process's loop and the first front end under cProfile: host time by function,
written to $OUT/engine_profile.txt and $OUT/front_end_profile.txt when the server stops (SIGTERM).
Usage: python tools/profile_serve.py serve FLAGS..."""

import cProfile
import os
import pstats
import sys

from atlas.engine import engine_process
from atlas.server import launcher


def _dump(profile: cProfile.Profile, name: str) -> None:
    with open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w") as f:
        stats = pstats.Stats(profile, stream=f)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(60)


def profiled(fn, name: str):
    def run(*args, **kwargs):
        profile = cProfile.Profile()
        try:
            return profile.runcall(fn, *args, **kwargs)
        finally:
            _dump(profile, name)
    return run


engine_process.EngineServer.run = profiled(engine_process.EngineServer.run, "engine_profile.txt")
_front_end = launcher.run_front_end


def run_front_end(index, spec):
    if index == 0:
        return profiled(_front_end, "front_end_profile.txt")(index, spec)
    return _front_end(index, spec)


launcher.run_front_end = run_front_end

from atlas.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
