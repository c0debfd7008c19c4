"""The collector during an offline generate call (atlas/heap.py's frozen_heap): what was alive before the call is
left out of its collections and given back after it, so nothing frozen there can leak."""

from __future__ import annotations

import gc
import weakref

from atlas import LLM, SamplingParams
from atlas.heap import frozen_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # (a reference cycle: only the collector frees it)


def test_a_generate_call_keeps_the_heap_before_it_out_of_its_collections_and_frees_it_after():
    llm = LLM("atlas/assets/default-model", skip_tokenizer_init=True, max_model_len=128, kv_cache_memory="32MiB")
    node = _Node()
    alive = weakref.ref(node)
    del node  # cyclic garbage from before the call
    seen: list[int] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(gc.get_freeze_count())

    gc.callbacks.append(watch)
    try:
        gc.collect(2)  # (outside the call: not frozen)
        garbage_before = alive() is None
        node = _Node()
        alive = weakref.ref(node)
        gc.collect(2)  # (alive still: now in the oldest generation, which only a full collection reads)
        del node
        threshold = gc.get_threshold()
        gc.set_threshold(50, 5, 5)  # (collections every few allocations: some happen during the call)
        try:
            out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0))
        finally:
            gc.set_threshold(*threshold)
    finally:
        gc.callbacks.remove(watch)
    assert garbage_before and len(out[0].outputs[0].token_ids) == 4
    # the call's collections ran with the heap before it (the engine's objects by the hundred thousand) frozen;
    # after the call nothing is frozen, and the garbage made before it is collected as any other
    assert seen[0] == 0 and max(seen) > 100_000
    assert alive() is not None and gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None  # given back after the call: collected


def test_frozen_heap_leaves_an_existing_freeze_alone():
    """Inside the block and after it the count neither grows (a second freeze would take the 1,000 lists made after
    the first) nor drops to nothing (an unfreeze). Not exactly equal: frozen objects that other threads of the test
    process free leave the permanent generation (two did once, on 2 busy cores)."""
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        fresh = [[] for _ in range(1000)]  # (tracked containers made after the freeze)
        with frozen_heap():
            assert frozen // 2 < gc.get_freeze_count() <= frozen
        assert frozen // 2 < gc.get_freeze_count() <= frozen  # (not unfrozen: the freeze was not its own)
        assert len(fresh) == 1000
    finally:
        gc.unfreeze()
