"""The Responses API's past conversations (`previous_response_id`), bounded: kept where the engine runs, so that
every front end of `atlas serve` finds them."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

STORE_MAX_RESPONSES = 4096
STORE_MAX_CHARS = 64 * 2**20


class ResponseStore:
    """Conversations of past responses by id (chat messages, the answer included), oldest dropped first."""

    def __init__(self, max_responses: int = STORE_MAX_RESPONSES, max_chars: int = STORE_MAX_CHARS):
        self.items: OrderedDict[str, tuple[list[dict[str, Any]], int]] = OrderedDict()
        self.max_responses, self.max_chars = max_responses, max_chars
        self.chars = 0

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        size = len(json.dumps(messages))
        if size > self.max_chars:
            return
        self.items[response_id] = (messages, size)
        self.chars += size
        while len(self.items) > self.max_responses or self.chars > self.max_chars:
            _, (_, dropped) = self.items.popitem(last=False)
            self.chars -= dropped

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        item = self.items.get(response_id)
        if item is None:
            return None
        self.items.move_to_end(response_id)
        return item[0]
