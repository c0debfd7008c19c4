"""Which LoRA adapter each device slot holds (--enable-lora), and which slot a request reads.

Adapters are known by name: those of --lora-modules (loaded into the first slots at start), those a caller
registers later (the server's /v1/load_lora_adapter, or an LLM.generate LoRARequest with a path). A request of a
known adapter takes the slot that holds it; one whose adapter is not resident takes a free slot, or the least
recently used slot that no unfinished request reads, and the adapter is written into it (queued behind the steps in
flight, which read the slot as it was). An adapter is read from disk and checked against the model once, when it
is registered, and kept in host memory until it is unregistered. When every slot is read by unfinished requests, the request waits
(EngineCore keeps it out of the scheduler) until one is free.

Each registration gets a prefix-cache key of its own (Request.lora_key): a prompt's KV pages under an adapter are
shared only with requests of that same adapter, and an adapter registered again under the same name (new weights)
never meets the pages of the old one.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from atlas.config import HubAccess
from atlas.errors import InvalidRequestError, ModelNotFoundError
from atlas.lora_request import LoRARequest
from atlas.models.lora import LoraAdapter, PlacedAdapter, read_adapter

logger = logging.getLogger(__name__)


@dataclass
class _Known:
    adapter: PlacedAdapter  # (checked against the model, cut to this rank's share: what a slot gets)
    key: str  # the prefix-cache key of this registration


class LoraRegistry:
    """Adapter names -> adapters and device slots. `prepare(adapter)` checks an adapter against the model and cuts
    it to this rank's share, `load(slot, prepared)` writes one into a slot (the model runner's); `start` are the
    adapters prepared at start (they take the first slots)."""

    def __init__(self, num_slots: int, prepare: Callable[[LoraAdapter], PlacedAdapter],
                 load: Callable[[int, PlacedAdapter], None], start: Iterable[PlacedAdapter],
                 runtime_loading: bool = True, hub: HubAccess | None = None):
        self._prepare = prepare
        self._hub = hub  # (--download-dir, --hf-token: how adapters loaded by hub id are fetched)
        self._load = load
        self.num_slots = num_slots
        # (an engine over several nodes loads adapters at start only: a worker reads a runtime load's share from the
        #  adapter's folder, which another node's disk need not have)
        self.runtime_loading = runtime_loading
        self._generations = itertools.count(1)
        self.known: dict[str, _Known] = {}
        self.slot_names: list[str | None] = [None] * num_slots
        self._last_used = [0] * num_slots
        self._clock = itertools.count(1)
        for slot, adapter in enumerate(start):
            self.known[adapter.name] = _Known(adapter, self._new_key(adapter.name))
            self._load(slot, adapter)
            self.slot_names[slot] = adapter.name

    def _new_key(self, name: str) -> str:
        return f"{name}#{next(self._generations)}"

    def adapters(self) -> list[tuple[str, str]]:
        """(name, path) of every known adapter, in the order they were loaded."""
        return [(name, str(known.adapter.path)) for name, known in self.known.items()]

    def register(self, name: str, path: str) -> None:
        """Make adapter `name` (at `path`) known: read and checked against the model now (refused with its reason,
        rather than at a request's first step), written into a slot when a request first uses it. A name known
        already is refused: unregister it first."""
        self.add(name, self.read(name, path))

    def read(self, name: str, path: str) -> PlacedAdapter:
        """register's slow part, the files read and checked against the model: it changes nothing here, so it may
        run off the engine's thread while steps go on (a large adapter's read would stall them), add() after it."""
        self._check_new(name, path)
        return self._prepare(read_adapter(name, path, self._hub))

    def add(self, name: str, prepared: PlacedAdapter) -> None:
        """register's last part, on the engine's thread: `prepared` (read()'s) known as `name`."""
        self._check_new(name, str(prepared.path))
        self.known[name] = _Known(prepared, self._new_key(name))

    def _check_new(self, name: str, path: str) -> None:
        if not self.runtime_loading:
            raise InvalidRequestError("this engine runs over several nodes and loads adapters at start only "
                                      "(--lora-modules, read by every node from its own disk)", param="lora_name")
        if name in self.known:
            raise InvalidRequestError(f"the LoRA adapter {name!r} is loaded already", param="lora_name")
        if not name or not path:
            raise InvalidRequestError("a LoRA adapter needs a name and a path", param="lora_name")

    def unregister(self, name: str, busy: set[int]) -> None:
        """Forget adapter `name` (its slot is free for another); refused while unfinished requests use it."""
        if name not in self.known:
            raise InvalidRequestError(f"the LoRA adapter {name!r} is not loaded", param="lora_name")
        if name in self.slot_names:
            slot = self.slot_names.index(name)
            if slot + 1 in busy:
                raise InvalidRequestError(f"the LoRA adapter {name!r} has unfinished requests: unload it when they "
                                          "end", param="lora_name")
            self.slot_names[slot] = None
        del self.known[name]

    def resolve(self, lora: LoRARequest | str) -> str:
        """The name of a request's adapter, registering a LoRARequest's new adapter. Refuses an unknown name."""
        if isinstance(lora, LoRARequest):
            name, path = lora.lora_name, lora.lora_path
            known = self.known.get(name)
            if known is None and path:
                self.register(name, path)
            elif known is not None and path and path != str(known.adapter.path):
                raise InvalidRequestError(f"the LoRA adapter {name!r} is loaded from {known.adapter.path}, not "
                                          f"{path}: give another name", param="lora_request")
        else:
            name = lora
        if name not in self.known:
            raise ModelNotFoundError(f"the model {name!r} does not exist: it is neither the served model nor a loaded "
                                     f"LoRA adapter (adapters: {', '.join(self.known) or 'none'})", param="model")
        return name

    def acquire(self, name: str, busy: Callable[[], set[int]]) -> tuple[int, str] | None:
        """(slot + 1, prefix-cache key) of a known adapter, written into a slot if it is not resident; None when
        every slot is read by unfinished requests (busy(): their slots + 1)."""
        known = self.known[name]
        if name in self.slot_names:
            slot = self.slot_names.index(name)
        else:
            free = [i for i, held in enumerate(self.slot_names) if held is None]
            if not free:
                used = busy()
                free = sorted((i for i in range(self.num_slots) if i + 1 not in used), key=self._last_used.__getitem__)
            if not free:
                return None
            slot, before = free[0], self.slot_names[free[0]]
            self._load(slot, known.adapter)
            if before is not None:
                logger.info("LoRA: adapter %r replaces %r in slot %d", name, before, slot)
            self.slot_names[slot] = name
        self._last_used[slot] = next(self._clock)
        return slot + 1, known.key
