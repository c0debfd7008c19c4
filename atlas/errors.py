"""User-facing errors. Each message names what went wrong and how to fix it.

The server maps these to OpenAI-style 4xx responses; anything else is an internal error.
"""

from __future__ import annotations


class AtlasError(Exception):
    """Base of every error a user can cause and fix."""


class ConfigError(AtlasError, ValueError):
    """A bad flag, keyword argument, or combination of them."""


class ModelLoadError(AtlasError):
    """A model path that is missing, malformed or unsupported."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture is not one Atlas implements."""


class OutOfMemoryPlanError(AtlasError):
    """The memory plan cannot fit what was asked for (e.g. one full-length sequence)."""


class InvalidRequestError(AtlasError, ValueError):
    """A request field that is invalid. `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelNotFoundError(InvalidRequestError):
    """A request names a model (or LoRA adapter) this engine does not serve."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit in the model's context."""


class WorkerError(RuntimeError):
    """A rank of a parallel engine died, hung or failed; the engine cannot go on. `rank` names it."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class ServerBusyError(AtlasError):
    """More requests wait for a sequence slot than the server admits (--max-waiting-requests): retry later."""


def busy_message(max_num_seqs: int, max_waiting: int) -> str:
    return (f"the server is at capacity ({max_num_seqs} running and {max_waiting} waiting requests, "
            "--max-waiting-requests); retry later")
