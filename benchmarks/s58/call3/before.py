"""`python before.py ARGS` = `atlas ARGS` with every MoE router's logits in float32, as before session 57 (the
routing function's added `.float()` is a no-op on float32 logits): the "before" of call.sh in the same call."""
import dataclasses
import sys

from atlas.layers import moe

_init = moe.TopKRouter.__init__


def _float32_router(self, hidden_size, cfg, correction_bias):
    _init(self, hidden_size, dataclasses.replace(cfg, model_dtype_logits=False), correction_bias)


moe.TopKRouter.__init__ = _float32_router

from atlas.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
