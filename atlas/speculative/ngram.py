"""N-gram (prompt lookup) drafting: no weights. If the sequence's last n tokens occurred before, the
tokens that followed that occurrence are proposed. Longer n-grams are tried first, and the most recent
earlier occurrence wins."""

from __future__ import annotations

import numpy as np

from atlas.speculative.proposer import Draft, DraftProposer


def ngram_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    length = len(tokens)
    if length < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n:]
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)  # excludes the suffix itself
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start: start + k].tolist()
    return []


class NgramProposer(DraftProposer):
    def __init__(self, num_draft_tokens: int, min_n: int, max_n: int):
        self.num_draft_tokens = num_draft_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests) -> list[Draft]:
        return [Draft(ngram_lookup(r.all_token_ids, self.min_n, self.max_n, self.num_draft_tokens))
                for r in requests]
