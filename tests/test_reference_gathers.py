"""The reference attention reads a sequence's positions a page at a time (paged_attention_ref.load_positions,
gather_positions): the rows must be exactly those of reading them one position at a time through the page table
(load_rows over _gather_slots), for every cache element type, both planes (an 8-bit cache's V plane transposed
within each page), lengths that end inside a page and on its edge, and the MLA cache's layout."""

from __future__ import annotations

import pytest
import torch

from atlas.kernels.paged_attention_ref import (
    _gather_slots,
    _rows,
    gather_positions,
    load_positions,
    load_rows,
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_page_gathers_read_the_rows_of_position_gathers(dtype):
    pages, page, heads, dim = 40, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, pages, page, heads, dim, generator=g).to(dtype)
    tables = torch.randint(0, pages, (5, 14), generator=g, dtype=torch.int32)
    for length in (1, 3, 4, 5, 17, 56):
        for plane in (0, 1):
            got = load_positions(cache, plane, tables, length)
            want = load_rows(cache, plane, _gather_slots(tables, page, length))
            assert got.dtype == want.dtype == dtype and got.shape == (5, length, heads, dim)
            assert torch.equal(_bits(got), _bits(want)), (length, plane)


def test_mla_page_gathers_read_the_rows_of_position_gathers():
    pages, page, width = 30, 16, 24
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(pages, page, width, generator=g)
    tables = torch.randint(0, pages, (3, 6), generator=g, dtype=torch.int32)
    for length in (1, 16, 17, 90):
        want = _rows(cache.view(-1, width), _gather_slots(tables, page, length))
        assert torch.equal(gather_positions(cache, tables, length), want)
