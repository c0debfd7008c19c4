"""KV cache groups: a model whose sliding-window layers sit beside global ones (Gemma 3's five local layers to one
global, gpt-oss's and Gemma 4's alternating ones) keeps the windowed layers' caches in a page pool of their own.

The global layers read the whole context, so their pages (the full group: KVCacheManager's own pool and each
request's `page_ids`) stay while the sequence runs. The windowed layers read at most the last W positions, so their
pages (the window group: a second KVCacheManager with `sliding_window=W`, and each request's `window_table`) go
back to their pool once they fall below every future query's window: a long generation holds a bounded number of
them, and the windowed layers' memory is that of the window rather than of the context.

`GroupedKVCacheManager` is the full group's manager that drives the window group in lockstep: every call the
scheduler makes (allocate, release out of the window, trim, free, share a sibling's prompt, find and register
cached prefixes) acts on both, so the scheduler still speaks to one page manager, in pages only. A request is given
pages only when both pools have them: the memory plan sizes the window pool for the windows of as many
--max-model-len sequences as the full pool holds (runtime/memory.split_kv_groups); where it runs short first (many
much shorter sequences), the scheduler waits or preempts as it does when the full pool runs short.

Prefix caching: both groups register a computed page under the same chained hash. A hit of k pages needs the full
group's pages for positions [0, k * block) and the window group's for those the window of its first uncached query
reaches, [k * block - W + 1, k * block); a hit is cut back to the longest one for which both are still cached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from atlas.engine.kv_cache import NULL_PAGE, KVCacheManager

if TYPE_CHECKING:
    from atlas.engine.request import Request


class WindowTable:
    """A request's page table in the window group, with the page manager's per-table state (KVCacheManager reads
    and writes these as it does a request's own); the request's tokens, computed positions and page hashes are
    read through to the request (the groups share positions and hashes, never pages)."""

    def __init__(self, req: Request):
        self.req = req
        self.page_ids: list[int] = []
        self.runner_pages = 0
        self.runner_pages_valid = 0
        self.num_registered_pages = 0
        self.num_released_pages = 0
        self.pending_snapshots: list[tuple[int, int]] = []  # (always empty: no snapshots in a window group)

    @property
    def num_computed_tokens(self) -> int:
        return self.req.num_computed_tokens

    @property
    def num_tokens(self) -> int:
        return self.req.num_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.req.all_token_ids

    @property
    def page_hashes(self) -> list[bytes]:
        return self.req.page_hashes

    @property
    def params(self):
        return self.req.params

    @property
    def lora_key(self) -> str | None:
        return self.req.lora_key

    @property
    def prompt_logprobs(self):
        return self.req.prompt_logprobs

    @property
    def num_prompt_tokens(self) -> int:
        return self.req.num_prompt_tokens


class GroupedKVCacheManager(KVCacheManager):
    """The full group's page manager (the global layers' pages: `pool`, `page_ids`) driving the window group's
    (`window`: the windowed layers' pages, released out of the window W) in lockstep. See the module docstring."""

    def __init__(self, num_pages: int, block_size: int, enable_prefix_caching: bool, window: int,
                 num_window_pages: int):
        super().__init__(num_pages, block_size, enable_prefix_caching)
        self.window = KVCacheManager(num_window_pages, block_size, enable_prefix_caching, sliding_window=window)
        self.group_window = window

    def reset_prefix_cache(self) -> bool:
        """Both groups' cached prefixes forgotten (False, nothing changed, while a request holds pages of either)."""
        if any(self.pool.ref_cnt) or any(self.window.pool.ref_cnt):
            return False
        return self.pool.forget_cached() and self.window.pool.forget_cached()

    @property
    def usage(self) -> float:
        """The fuller pool's share in use: a request needs pages of both, so that one is what admits or preempts
        (the pools' own figures: `pool` and `window.pool`)."""
        return max(super().usage, self.window.usage)

    @staticmethod
    def table(req: Request) -> WindowTable:
        """req's window-group table (made on first use)."""
        if req.window_table is None:
            req.window_table = WindowTable(req)
        return req.window_table

    # ------------------------------------------------------------------ prefix caching
    def _window_pages_of_hit(self, req: Request, k: int) -> list[int | None]:
        """The window group's cached pages for the first k pages of req that the window of position k * block
        reaches (None where one is not cached)."""
        first = max(0, k * self.block_size - self.group_window + 1) // self.block_size
        lookup = self.window.pool.lookup
        return [lookup(h) for h in req.page_hashes[first:k]]

    def find_cached_prefix(self, req: Request) -> list[int]:
        pages = super().find_cached_prefix(req)
        k = len(pages)
        while k and None in self._window_pages_of_hit(req, k):
            k -= 1  # (the windowed layers' keys the next query reads are gone: a shorter hit)
        return pages[:k]

    # ------------------------------------------------------------------ allocation
    def allocate(self, req: Request, num_new_tokens: int, cached_pages: list[int] | None = None) -> bool:
        table = self.table(req)
        window = self.window
        if not cached_pages:
            needed = self.pages_for(req.num_computed_tokens + num_new_tokens) - len(table.page_ids)
            if needed > window.pool.num_free or not super().allocate(req, num_new_tokens):
                return False
            if needed > 0:
                table.page_ids.extend(window.pool.allocate(needed))
            return True
        assert not table.page_ids and req.num_computed_tokens == 0, "a prefix hit is a new request's first pages"
        k = len(cached_pages)
        hit = self._window_pages_of_hit(req, k)
        assert None not in hit, "find_cached_prefix cut the hit to pages both groups hold"
        needed = self.pages_for(k * self.block_size + num_new_tokens) - k
        reclaimable = sum(1 for p in hit if window.pool.ref_cnt[p] == 0)
        if needed > window.pool.num_free - reclaimable or not super().allocate(req, num_new_tokens, cached_pages):
            return False
        window.pool.acquire(hit)
        released = k - len(hit)  # (pages below the window of the first query: never read again)
        table.page_ids = [NULL_PAGE] * released + hit
        if needed > 0:
            table.page_ids.extend(window.pool.allocate(needed))
        table.num_released_pages = released
        table.num_registered_pages = k
        return True

    def share_prefix(self, src: Request, dst: Request, num_tokens: int) -> None:
        """As KVCacheManager.share_prefix, in both groups: nothing once src has released a window-group page (dst
        then computes its prompt itself)."""
        src_table = src.window_table
        if src_table is None or src_table.num_released_pages or src.num_released_pages:
            return
        super().share_prefix(src, dst, num_tokens)
        pages = src_table.page_ids[: len(dst.page_ids)]
        self.window.pool.acquire(pages)
        self.table(dst).page_ids.extend(pages)

    def cache_computed_pages(self, req: Request) -> None:
        super().cache_computed_pages(req)
        if req.window_table is not None:
            self.window.cache_computed_pages(req.window_table)

    def release_out_of_window(self, req: Request) -> int:
        """The window group's pages below the window (KVCacheManager.release_out_of_window); the full group keeps
        its own. -> window-group pages released."""
        return self.window.release_out_of_window(self.table(req))

    def trim(self, req: Request, num_tokens: int) -> None:
        super().trim(req, num_tokens)
        if req.window_table is not None:
            self.window.trim(req.window_table, num_tokens)

    def window_table_change(self, req: Request) -> tuple[int, list[int]] | None:
        """The change of req's window-group table for the runner's copy (KVCacheManager.table_change)."""
        return self.window.table_change(self.table(req))

    def held_window_pages(self, req: Request) -> int:
        """Window-group pages req holds."""
        return 0 if req.window_table is None else self.window.held_pages(req.window_table)

    def free(self, req: Request) -> None:
        super().free(req)
        if req.window_table is not None:
            self.window.free(req.window_table)
            req.window_table = None  # (a new one if it runs again; the table's link back to req goes with it)
