"""N-gram (prompt lookup) drafting: no weights. If the sequence's last n tokens occurred before, the
tokens that followed that occurrence are proposed. Longer n-grams are tried first, and the most recent
earlier occurrence wins."""

from __future__ import annotations

from atlas.speculative.proposer import Draft, DraftProposer


class NgramIndex:
    """The latest end position of every n-gram (min_n..max_n tokens) of one request's growing token list, up to
    the token before the last: `lookup` gives what ngram_lookup gives, indexing only the tokens appended since
    its last call (a few dictionary operations a token) instead of scanning the sequence again. The list may
    only grow (a request's tokens do); a shorter one starts the index over."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> its latest end position (keys of every length)
        self.indexed = 0  # n-grams ending before this position are in `latest`

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        length = len(tokens)
        if length < self.indexed + 1:
            self.latest.clear()
            self.indexed = 0
        if length < self.min_n + 1:
            return []
        latest = self.latest
        for end in range(self.indexed, length - 1):  # (the suffix itself, ending at length - 1, stays out)
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                latest[tuple(tokens[end - n + 1: end + 1])] = end
        self.indexed = length - 1
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = latest.get(tuple(tokens[length - n:]))
            if end is not None:
                return tokens[end + 1: end + 1 + k]
        return []


def ngram_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix (stateless)."""
    return NgramIndex(min_n, max_n).lookup(tokens, k)


class NgramProposer(DraftProposer):
    def __init__(self, num_draft_tokens: int, min_n: int, max_n: int):
        self.num_draft_tokens = num_draft_tokens
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, NgramIndex] = {}  # request id -> its n-gram index

    def propose(self, requests) -> list[Draft]:
        drafts = []
        for r in requests:
            index = self._indexes.get(r.request_id)
            if index is None:
                index = self._indexes[r.request_id] = NgramIndex(self.min_n, self.max_n)
            drafts.append(Draft(index.lookup(r.all_token_ids, self.num_draft_tokens)))
        return drafts

    def on_request_finish(self, req) -> None:
        self._indexes.pop(req.request_id, None)
