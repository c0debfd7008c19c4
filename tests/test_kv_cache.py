"""The page pool and prefix cache, unit by unit."""

from __future__ import annotations

from atlas.engine.kv_cache import KVCacheManager, PagePool, chain_hash
from atlas.engine.request import Request
from atlas.sampling_params import SamplingParams


def _req(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, rid, 0, None, tokens, SamplingParams(), [])


def test_hash_chain_depends_on_the_whole_prefix():
    a = chain_hash(chain_hash(b"root", [1, 2]), [3, 4])
    b = chain_hash(chain_hash(b"root", [9, 2]), [3, 4])
    assert a != b
    assert a == chain_hash(chain_hash(b"root", [1, 2]), [3, 4])


def test_pool_refcounts_and_lru_eviction_order():
    pool = PagePool(4)
    pages = pool.allocate(3)
    for i, p in enumerate(pages):
        pool.register(p, bytes([i]))
    pool.release(pages)  # tail first: the last page becomes least recently used
    assert pool.num_free == 4
    # The never-cached page goes first, then cached pages from the sequence's tail backwards.
    order = pool.allocate(4)
    assert order[0] not in pages
    assert order[1:] == list(reversed(pages))
    assert pool.cached == {}


def test_acquire_takes_a_cached_free_page_back():
    pool = PagePool(2)
    (p,) = pool.allocate(1)
    pool.register(p, b"h")
    pool.release([p])
    assert pool.lookup(b"h") == p and pool.num_free == 2
    pool.acquire([p])
    assert pool.num_free == 1 and pool.ref_cnt[p] == 1
    pool.acquire([p])
    pool.release([p])
    assert pool.ref_cnt[p] == 1


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_pages=3, block_size=4, enable_prefix_caching=True)
    r = _req(list(range(20)))
    assert not kv.allocate(r, 20)  # needs 5 pages
    assert r.page_ids == [] and kv.num_free_pages == 3
    assert kv.allocate(r, 12)
    assert len(r.page_ids) == 3 and kv.num_free_pages == 0
    kv.free(r)
    assert kv.num_free_pages == 3


def test_cached_prefix_lookup_and_reuse():
    kv = KVCacheManager(num_pages=8, block_size=4, enable_prefix_caching=True)
    a = _req(list(range(10)), "a")
    assert kv.find_cached_prefix(a) == []
    assert kv.allocate(a, 10)
    a.num_computed_tokens = 10
    kv.cache_computed_pages(a)
    assert a.num_registered_pages == 2
    b = _req(list(range(8)) + [77, 78, 79], "b")
    hit = kv.find_cached_prefix(b)
    assert hit == a.page_ids[:2]
    assert kv.allocate(b, 3, hit)
    assert b.num_computed_tokens == 8 and b.page_ids[:2] == a.page_ids[:2]
    assert kv.pool.ref_cnt[a.page_ids[0]] == 2
    kv.free(a)
    kv.free(b)
    assert kv.num_free_pages == 8
    # Exactly two pages of the same 8 tokens: only the first page may be reused (the last token must
    # be computed to produce logits).
    c = _req(list(range(8)), "c")
    assert len(kv.find_cached_prefix(c)) == 1


def test_trim_returns_pages_past_a_length():
    kv = KVCacheManager(num_pages=6, block_size=4, enable_prefix_caching=False)
    r = _req(list(range(5)))
    assert kv.allocate(r, 5 + 11)  # room for 11 draft positions
    assert len(r.page_ids) == 4
    kv.trim(r, 7)
    assert len(r.page_ids) == 2 and kv.num_free_pages == 4


def test_reset_forgets_cached_prefixes_only_when_no_page_is_held():
    kv = KVCacheManager(num_pages=8, block_size=4, enable_prefix_caching=True)
    a = _req(list(range(10)), "a")
    assert kv.allocate(a, 10)
    a.num_computed_tokens = 10
    kv.cache_computed_pages(a)
    assert not kv.reset_prefix_cache()  # (a holds its pages: nothing forgotten)
    assert len(kv.find_cached_prefix(_req(list(range(9)), "b"))) == 2
    kv.free(a)
    assert len(kv.find_cached_prefix(_req(list(range(9)), "c"))) == 2
    assert kv.reset_prefix_cache()
    assert kv.find_cached_prefix(_req(list(range(9)), "d")) == [] and kv.num_free_pages == 8
    assert not kv.pool.cached and kv.pool.page_hash == [None] * 8
