"""KV page bookkeeping on the host: the page pool, hash-chained prefix caching and LRU eviction.

Plain Python; it never touches a device tensor. A page is `block_size` consecutive token positions
of one sequence. A full page whose tokens are all computed is registered under a hash that chains
the hash of the page before it with the page's token ids, so equal hashes mean equal prefixes.
Pages are reference-counted: prefix hits and forked siblings share pages. A page whose count drops to
zero goes back to the free list but keeps its cached content until it is reused (LRU eviction).

Sliding windows: when every attention layer of the model reads at most the last W positions
(`sliding_window`, layers.attention.release_window), the pages of a sequence that hold only positions
below every future query's window go back to the pool while the sequence runs, so a long generation
holds a bounded number of pages. Their entries in the sequence's page table then read NULL_PAGE (a valid
page id, so that a table stays a plain list of ids; the attention kernels never load a key below a
query's window). A released page stays a prefix-cache entry until it is reused, like any freed page: its
content is exactly the KV of its tokens after its chained prefix, and a lookup still walks the chain from
the first page, so a prefix is served only while every one of its pages is cached. A model whose windowed layers sit
beside global ones keeps the windowed layers' pages in a second manager of this kind, with the window, driven in
lockstep with the global layers' (KV cache groups: engine/kv_groups.py).

Recurrent-state snapshots (hybrid models, whose linear-attention layers keep a state instead of per-token KV): a
cached prefix can be resumed only from the state its last token left, so a cached page may carry a snapshot id (a
plain int; the runner's snapshot slots hold the tensors: every linear-attention layer's conv and delta-rule state
right after the page's last token). A prefix hit is cut back to its last page with a snapshot (possibly none: a
full prefill) and resumes from that snapshot. A request saves at most two snapshots (`snapshot_point`; a prompt
chunk that crosses one saves it inside its step, between two passes of each linear-attention layer, and one that
would cross both ends at the second): at the end of the cached page chain its lookup found when that chain's
last page has none (where its prompt parts from an earlier one: the next prompt with the same shared part, e.g. a
system prompt, resumes there), and at the last page boundary of its prompt before its last token (the same prompt
again, or one extending it, e.g. a chat's next turn, resumes there). Each is taken when its step is scheduled and
attached to the page when the page is registered (given back if the page has one already).
A snapshot lives and dies with its page: when the page's cached content is evicted, its snapshot is freed; when
every snapshot is taken, the one of the page released longest ago among the pages no request holds is taken
(that page stays cached, without a snapshot).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from atlas.engine.request import Request

_ROOT_HASH = b"atlas-prefix-root"
# What a sequence's page table holds in place of a page released out of the window (see the module docstring).
NULL_PAGE = 0


def root_hash(cache_salt: str | None, adapter: str | None = None) -> bytes:
    """The parent of a sequence's first page: with a cache salt, pages only requests with that salt can match; with
    a LoRA adapter (its key: engine/lora.py), only requests of that adapter (its KV is not the base model's)."""
    if cache_salt is None and adapter is None:
        return _ROOT_HASH
    key = b"atlas-prefix-salt:" + (cache_salt or "").encode("utf-8", "surrogatepass")
    if adapter is not None:
        key += b"\x00atlas-lora:" + adapter.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(key, digest_size=16).digest()


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.blake2b(parent + struct.pack(f"<{len(token_ids)}q", *token_ids), digest_size=16).digest()


class PagePool:
    """Reference-counted pages with an LRU free list and a hash -> page map of cached content."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.ref_cnt = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        # Free pages in eviction order: the front is taken first. Pages without cached content are
        # put at the front, so cached content is evicted only when nothing else is free.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self.cached: dict[bytes, int] = {}
        # Recurrent-state snapshots (module docstring): page -> snapshot id, in the order the pages were last
        # released (the front's snapshot is taken first when none is free); the free snapshot ids.
        self.snapshot: OrderedDict[int, int] = OrderedDict()
        self.free_snapshots: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"page pool exhausted: asked for {n}, {len(self.free)} free")
        pages = []
        for _ in range(n):
            page, _ = self.free.popitem(last=False)
            h = self.page_hash[page]
            if h is not None:  # evict its cached content
                if self.cached.get(h) == page:
                    del self.cached[h]
                self.page_hash[page] = None
                snap = self.snapshot.pop(page, None)
                if snap is not None:  # (a snapshot never outlives its page's cached content)
                    self.free_snapshots.append(snap)
            self.ref_cnt[page] = 1
            pages.append(page)
        return pages

    def acquire(self, pages: list[int]) -> None:
        """Take another reference to pages that are in use or cached-but-free."""
        for page in pages:
            if self.ref_cnt[page] == 0:
                del self.free[page]
            self.ref_cnt[page] += 1

    def release(self, pages: list[int]) -> None:
        # Tail pages first, so that a sequence's last pages are evicted before its shared prefix.
        for page in reversed(pages):
            self.ref_cnt[page] -= 1
            assert self.ref_cnt[page] >= 0, f"page {page} released twice"
            if self.ref_cnt[page] == 0:
                self.free[page] = None
                if self.page_hash[page] is None:
                    self.free.move_to_end(page, last=False)
                if page in self.snapshot:
                    self.snapshot.move_to_end(page)

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def register(self, page: int, h: bytes) -> None:
        if self.page_hash[page] is not None:
            return
        if h not in self.cached:
            self.cached[h] = page
        self.page_hash[page] = h

    def forget_cached(self) -> bool:
        """Drop every page's cached content (hash, snapshot) so that no later request hits it; False, with nothing
        changed, while any page is held (a running request's pages are the cache of its own next steps)."""
        if any(self.ref_cnt):
            return False
        self.cached.clear()
        self.page_hash = [None] * self.num_pages
        self.free_snapshots.extend(self.snapshot.values())
        self.snapshot.clear()
        return True

    def take_snapshot(self) -> int | None:
        """A snapshot id: a free one, else the one of the page released longest ago that no request holds (None: every
        snapshot belongs to a page in use)."""
        if self.free_snapshots:
            return self.free_snapshots.pop()
        page = next((p for p in self.snapshot if self.ref_cnt[p] == 0), None)
        return None if page is None else self.snapshot.pop(page)


class StateSlotPool:
    """Recurrent-state slots of a hybrid model (linear-attention layers): one per running sequence. A slot is a
    plain number here; the runner's state pools hold the tensors. Slots are handed out lowest first."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # (a stack: pop() takes the lowest)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError(f"all {self.num_slots} recurrent-state slots are taken")
        return self.free.pop()

    def release(self, slot: int) -> None:
        assert slot not in self.free, f"state slot {slot} released twice"
        self.free.append(slot)
        self.free.sort(reverse=True)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Gives each request the pages its tokens need, finds cached prefixes, shares pages."""

    def __init__(self, num_pages: int, block_size: int, enable_prefix_caching: bool, sliding_window: int | None = None,
                 num_snapshots: int = 0):
        """sliding_window: W when no layer reads a key W or more positions behind its query (pages below every
        future query's window are released; None: a sequence keeps all its pages). num_snapshots: a hybrid model's
        recurrent-state snapshots (module docstring); above 0, a prefix hit must end on a page with one."""
        self.pool = PagePool(num_pages)
        self.num_snapshots = num_snapshots if enable_prefix_caching else 0
        self.pool.free_snapshots = list(range(self.num_snapshots - 1, -1, -1))
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.stats = PrefixCacheStats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache: a benchmark's cold start); False while a request
        holds pages."""
        return self.pool.forget_cached()

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ hashing
    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
        """Make req.page_hashes cover every full page within its first num_tokens tokens."""
        bs = self.block_size
        tokens = req.all_token_ids
        while (len(req.page_hashes) + 1) * bs <= num_tokens:
            i = len(req.page_hashes)
            parent = req.page_hashes[-1] if req.page_hashes else root_hash(req.params.cache_salt, req.lora_key)
            req.page_hashes.append(chain_hash(parent, tokens[i * bs: (i + 1) * bs]))

    # ------------------------------------------------------------------ allocation
    def find_cached_prefix(self, req: Request) -> list[int]:
        """Pages holding the longest cached prefix of req's tokens. At least one token is always
        left to compute, so that the step produces logits; hence only pages within the first
        num_tokens - 1 tokens count."""
        if not self.enable_prefix_caching or req.prompt_logprobs is not None:
            return []  # (prompt logprobs need the logits of every prompt position)
        limit = req.num_tokens - 1
        self._extend_hashes(req, limit)
        pages = []
        for h in req.page_hashes[: limit // self.block_size]:
            page = self.pool.lookup(h)
            if page is None:
                break
            pages.append(page)
        if self.num_snapshots:  # (recurrent state: resume only where a snapshot of it was kept)
            req.num_chain_pages = len(pages)
            while pages and pages[-1] not in self.pool.snapshot:
                pages.pop()
        return pages

    # ------------------------------------------------------------------ recurrent-state snapshots
    def snapshot_of(self, page: int) -> int:
        """The snapshot id of a cached page that has one (the last page of find_cached_prefix's hit)."""
        return self.pool.snapshot[page]

    def snapshot_point(self, req: Request, first: int | None = None) -> int:
        """The next position (a page boundary) after `first` (default: req's computed tokens) where req's state is
        saved as a snapshot (module docstring): the end of the cached chain its lookup found, the last page boundary
        of its prompt before its last token. 0: none (no snapshots, prompt logprobs, or every such point is behind
        `first`, saved already or has a snapshot)."""
        if not self.num_snapshots or req.prompt_logprobs is not None:
            return 0
        first = req.num_computed_tokens if first is None else first
        bs = self.block_size
        pending = [index for index, _ in req.pending_snapshots]
        for point in sorted({req.num_chain_pages * bs, (req.num_prompt_tokens - 1) // bs * bs}):
            if point <= first or point // bs - 1 in pending:
                continue
            self._extend_hashes(req, point)
            page = self.pool.lookup(req.page_hashes[point // bs - 1])
            if page is None or page not in self.pool.snapshot:
                return point
        return 0

    def can_snapshot(self) -> bool:
        """Whether reserve_snapshot would find a snapshot id now."""
        pool = self.pool
        return bool(pool.free_snapshots) or any(pool.ref_cnt[p] == 0 for p in pool.snapshot)

    def reserve_snapshot(self, req: Request, point: int) -> int | None:
        """A snapshot id for req's state at `point` (a step's rows reach it), held by req until the page is registered
        (None: none to be had; the step then saves nothing)."""
        snap = self.pool.take_snapshot()
        if snap is not None:
            req.pending_snapshots.append((point // self.block_size - 1, snap))
        return snap

    def _settle_snapshots(self, req: Request, full: int) -> None:
        """Attach req's saved snapshots to their pages once these are registered (to the page a lookup finds for the
        hash), or give one back if that page has one already."""
        left = []
        for index, snap in req.pending_snapshots:
            if index >= full:
                left.append((index, snap))
                continue
            owner = self.pool.lookup(req.page_hashes[index])
            if owner is not None and owner not in self.pool.snapshot:
                self.pool.snapshot[owner] = snap
                if self.pool.ref_cnt[owner] == 0:
                    self.pool.snapshot.move_to_end(owner)
            else:
                self.pool.free_snapshots.append(snap)
        req.pending_snapshots = left

    def _drop_pending_snapshots(self, req: Request) -> None:
        self.pool.free_snapshots.extend(snap for _, snap in req.pending_snapshots)
        req.pending_snapshots = []

    @property
    def num_free_snapshots(self) -> int:
        return len(self.pool.free_snapshots)

    def allocate(self, req: Request, num_new_tokens: int, cached_pages: list[int] | None = None) -> bool:
        """Make req hold pages for its first num_computed + num_new_tokens positions.

        `cached_pages` (a new request's prefix hit) are taken first and counted as computed.
        Returns False, changing nothing, when the free pages do not suffice.
        """
        if not cached_pages:  # (the usual call, a running request's next step: most often no page is needed)
            needed = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - len(req.page_ids)
            if needed <= 0:
                return True
            if needed > len(self.pool.free):
                return False
            req.page_ids.extend(self.pool.allocate(needed))
            return True
        num_computed = req.num_computed_tokens + len(cached_pages) * self.block_size
        needed = self.pages_for(num_computed + num_new_tokens) - len(req.page_ids) - len(cached_pages)
        reclaimable = sum(1 for p in cached_pages if self.pool.ref_cnt[p] == 0)
        if needed > self.pool.num_free - reclaimable:
            return False
        self.pool.acquire(cached_pages)
        req.page_ids.extend(cached_pages)
        req.num_computed_tokens = num_computed
        if needed > 0:
            req.page_ids.extend(self.pool.allocate(needed))
        return True

    def record_lookup(self, req: Request, num_hit_tokens: int) -> None:
        self.stats.queries += req.num_tokens
        self.stats.hits += num_hit_tokens

    def share_prefix(self, src: Request, dst: Request, num_tokens: int) -> None:
        """dst (a new request with the same leading tokens) shares src's full pages within num_tokens (none
        once src has released its first page out of the window: dst computes its prompt itself)."""
        assert not dst.page_ids and dst.num_computed_tokens == 0
        if src.num_released_pages:
            return
        n_pages = min(num_tokens, src.num_computed_tokens) // self.block_size
        assert n_pages <= len(src.page_ids), "shared pages must be src's own (a finished request holds none)"
        pages = src.page_ids[:n_pages]
        self.pool.acquire(pages)
        dst.page_ids.extend(pages)
        dst.num_computed_tokens = n_pages * self.block_size

    def cache_computed_pages(self, req: Request) -> None:
        """Register req's full, computed pages in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        # (Positions scheduled for the device whose tokens the host does not know yet wait for a later call.)
        full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        if full <= req.num_registered_pages:
            if req.pending_snapshots:
                self._settle_snapshots(req, full)
            return
        self._extend_hashes(req, full * self.block_size)
        # (pages released out of the window before they were registered stay unregistered: a later lookup
        #  stops at them)
        for i in range(max(req.num_registered_pages, req.num_released_pages), full):
            self.pool.register(req.page_ids[i], req.page_hashes[i])
        req.num_registered_pages = full
        if req.pending_snapshots:
            self._settle_snapshots(req, full)

    def release_out_of_window(self, req: Request) -> int:
        """With a sliding window W: give back req's pages that hold only positions below num_computed_tokens -
        W + 1, the first key the window of its next query row reaches (no later query reaches further back:
        the scheduler calls this where num_computed_tokens is the first position its next step computes, and
        no step already scheduled can wind it back). Their table entries become NULL_PAGE. -> pages released."""
        if self.sliding_window is None:
            return 0
        first_needed = req.num_computed_tokens - self.sliding_window + 1
        end = min(max(0, first_needed) // self.block_size, len(req.page_ids))
        start = req.num_released_pages
        if end <= start:
            return 0
        # Registered first, so that they stay prefix-cache entries in the pool (with asynchronous scheduling the
        # step that computes them may still be running: any later step that reads them runs after it).
        self.cache_computed_pages(req)
        self.pool.release(req.page_ids[start:end])
        req.page_ids[start:end] = [NULL_PAGE] * (end - start)
        req.runner_pages_valid = min(req.runner_pages_valid, start)
        req.num_released_pages = end
        return end - start

    def trim(self, req: Request, num_tokens: int) -> None:
        """Return the pages past the first num_tokens positions (e.g. rejected speculative tokens)."""
        keep = max(self.pages_for(num_tokens), req.num_released_pages)
        if len(req.page_ids) > keep:
            self.pool.release(req.page_ids[keep:])
            del req.page_ids[keep:]
            req.runner_pages_valid = min(req.runner_pages_valid, keep)
        req.num_registered_pages = min(req.num_registered_pages, keep)

    def table_change(self, req: Request) -> tuple[int, list[int]] | None:
        """The change of req's page table since the last call, for the runner's copy of it (a step's record,
        ScheduledSeq.pages): (first, pages), which makes the copy copy[:first] + pages, or None when it is the same."""
        table = req.page_ids
        n, first = len(table), req.runner_pages_valid
        if first == n == req.runner_pages:
            return None
        req.runner_pages = req.runner_pages_valid = n
        return first, table[first:]

    def held_pages(self, req: Request) -> int:
        """Pages req holds (its table less the pages released out of the window)."""
        return len(req.page_ids) - req.num_released_pages

    def free(self, req: Request) -> None:
        self._drop_pending_snapshots(req)
        self.pool.release(req.page_ids[req.num_released_pages:])
        req.page_ids = []
        # (the runner forgets its copy when the step after this is launched: the request ended or was preempted)
        req.runner_pages = req.runner_pages_valid = 0
        req.num_registered_pages = 0
        req.num_released_pages = 0
