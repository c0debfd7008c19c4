"""The garbage collector in long-lived processes (the server, a parallel worker).

A full collection traverses every object the collector tracks, and a process that has built an engine holds
a great many that live as long as it does (modules, the model's Python objects, tokenizer tables). On a 2-core
host 1,000 requests of 512 tokens added to a fresh engine spent 56 % of their intake in collections (305
against 134 us a request with the collector off), 17 % with the start-up heap frozen (162 us). Moving the
start-up heap into the permanent generation once the engine is built (gc.freeze) leaves collections the
objects made while serving. Only for processes that build one engine and keep it: frozen objects that later
become cyclic garbage are never collected."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then freeze what is left; -> how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
