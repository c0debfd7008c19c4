"""The attention backend object (layers/attention_backend.py): slots, the per-step metadata of a mixed step, the
graphs' static attention inputs and the cache layouts, each against numbers worked out by hand."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from atlas.errors import ConfigError
from atlas.kernels.paged_attention import ProgramMap
from atlas.kernels.paged_attention_ref import write_kv_cache
from atlas.layers.attention import KVCacheSpec
from atlas.layers.attention_backend import GQABackend, MLABackend, attention_backend
from atlas.layers.dsa import DSACacheSpec
from atlas.layers.dsv4_attention import DSV4CacheSpec
from atlas.layers.mla import MLACacheSpec
from atlas.runtime.request_tables import snapshot_batch
from atlas.runtime.step_inputs import InputPreparer

CPU = torch.device("cpu")
# 32 query heads on one key head: programs of 2 query rows in a step with a query longer than one row.
GQA = [KVCacheSpec(num_kv_heads=1, head_dim=8, num_heads=32)] * 2


def test_the_kind_follows_the_specs():
    assert isinstance(attention_backend(GQA, 4), GQABackend)
    mla = attention_backend([MLACacheSpec(16, 8, 16), DSACacheSpec(16, 8, 16, 4)], 4)
    assert isinstance(mla, MLABackend) and (mla.num_heads, mla.num_kv_heads) == (16, 1)
    none = attention_backend([], 4)  # (a pipeline stage of a hybrid model's linear layers)
    assert none.bytes_per_token(torch.float32) == 0 and none.allocate(3, torch.float32, CPU) == []
    assert attention_backend(GQA, 4).bytes_per_token(torch.bfloat16) == 2 * (2 * 8 * 2)
    with pytest.raises(ValueError, match="pack attention heads differently"):
        attention_backend([KVCacheSpec(1, 8, 32), KVCacheSpec(2, 8, 32)], 4)


def test_slots_of_a_sequence_and_of_a_step():
    attn = attention_backend(GQA, 4)
    # positions 2..8 over pages [7, 3, 9]: 7*4+2, 7*4+3, then page 3, then page 9
    assert attn.slots([7, 3, 9], 2, 7) == [30, 31, 12, 13, 14, 15, 36]
    table = np.array([[7, 3, 9], [5, 0, 0]], dtype=np.int32)
    out = np.zeros(4, dtype=np.int64)
    attn.step_slots(table, np.array([0, 0, 1, 1]), np.array([3, 8, 0, 2]), out)
    assert out.tolist() == [31, 36, 20, 22]
    # Padding rows cycle through the scratch pages.
    assert attn.padding_slots([10, 11], 10) == [40, 41, 42, 43, 44, 45, 46, 47, 40, 41]


def _seq(rid, tokens, pages, computed, drafts=()):
    return SimpleNamespace(request_id=rid, all_token_ids=list(tokens), output_token_ids=[], spec_token_ids=list(drafts),
                           page_ids=list(pages), num_computed_tokens=computed, spec_device_tokens=None)


def test_metadata_of_a_mixed_prefill_decode_verify_step():
    """A prefill chunk of 5 rows, a decode and a verify of 2 drafts in one step, pages of 4 tokens."""
    attn = attention_backend(GQA, 4)
    seqs = [_seq("prefill", range(10, 15), [4, 9], 0),
            _seq("decode", range(20, 27), [2, 5], 6),
            _seq("verify", range(30, 33), [8, 1], 2, drafts=[77, 78])]
    batch = snapshot_batch(seqs, [5, 1, 3], num_drafts=[0, 0, 2])
    preparer = InputPreparer(16, 4, 4, attn, CPU)
    for shortcut in (True, False):
        preparer.decode_shortcut = shortcut
        inputs = preparer.prepare(batch)
        meta = inputs.meta
        assert inputs.input_ids.tolist() == [10, 11, 12, 13, 14, 26, 32, 77, 78]
        assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 6, 2, 3, 4]
        # prefill: page 4 then 9; decode: position 6 is page 5, offset 2; verify: 8*4+2, 8*4+3, then page 1
        assert meta.slot_mapping.tolist() == [16, 17, 18, 19, 36, 22, 34, 35, 4]
        assert meta.query_start_loc.tolist() == meta.query_start_loc_cpu == [0, 5, 6, 9]
        assert meta.seq_lens.tolist() == meta.seq_lens_cpu == [5, 7, 5]
        assert meta.page_tables.tolist() == [[4, 9] + [0] * 14, [2, 5] + [0] * 14, [8, 1] + [0] * 14]
        assert (meta.max_query_len, meta.max_seq_len) == (5, 7)
        # Programs of 2 rows: the chunk's rows 0, 2, 4; the decode's row; the verify's rows 0 and 2.
        assert meta.programs.block_q == 2
        assert meta.programs.req.tolist() == [0, 0, 0, 1, 2, 2]
        assert meta.programs.q0.tolist() == [0, 2, 4, 0, 0, 2]
        assert inputs.sample_rows.tolist() == [4, 5, 6, 7, 8]
        assert (inputs.sample_owner, inputs.sample_offset) == ([0, 1, 2, 2, 2], [0, 0, 0, 1, 2])


def test_program_map_of_a_uniform_step_and_the_mla_packing():
    rows = np.arange(16)
    req, q0 = np.zeros(6, dtype=np.int32), np.zeros(6, dtype=np.int32)
    attn = attention_backend(GQA, 4)
    attn.fill_programs(req, q0, None, attn.block_q(3), rows, uniform_q=3)  # 3 sequences of 3 rows, 2 programs each
    assert req.tolist() == [0, 0, 1, 1, 2, 2] and q0.tolist() == [0, 2, 0, 2, 0, 2]
    mla = attention_backend([MLACacheSpec(16, 8, 16)], 4)
    assert (mla.block_q(1), mla.block_q(5)) == (1, 4)  # (16 heads a key head: 64-row programs take 4 query rows)
    assert attention_backend(GQA, 4).num_programs(np.array([5, 1, 3]), 4) == 4


def test_metadata_from_host_lists_for_a_drafter():
    attn = attention_backend(GQA, 4)
    slots = attn.slots([3, 4], 4, 2) + attn.slots([7], 2, 1)
    meta = attn.metadata_for_query_lens([2, 1], [6, 3], [[3, 4], [7]], slots, CPU)
    assert meta.query_start_loc.tolist() == [0, 2, 3] and meta.seq_lens.tolist() == [6, 3]
    assert meta.slot_mapping.tolist() == [16, 17, 30]
    assert meta.page_tables.shape == (2, 16) and meta.page_tables[:, :2].tolist() == [[3, 4], [7, 0]]
    assert (meta.max_query_len, meta.max_seq_len, meta.programs) == (2, 6, None)


def test_a_drafter_step_run_by_run_and_one_token_steps():
    attn = attention_backend(GQA, 4)
    step = attn.rows()
    step.add([3, 4], 4, 2)  # positions 4, 5 of pages [3, 4]
    step.add([7], 2, 1)
    assert len(step) == 2 and step.positions == [4, 5, 2]
    meta = step.metadata(CPU)
    assert meta.query_start_loc.tolist() == [0, 2, 3] and meta.seq_lens.tolist() == [6, 3]
    assert meta.slot_mapping.tolist() == [16, 17, 30]
    one = attn.decode_metadata([[3, 4], [7]], [5, 2], CPU)
    assert one.query_start_loc.tolist() == [0, 1, 2] and one.seq_lens.tolist() == [6, 3]
    assert one.slot_mapping.tolist() == [17, 30] and one.max_query_len == 1
    assert attn.decode_metadata([[3, 4]], [5], CPU, slots=[99]).slot_mapping.tolist() == [99]


def test_uniform_graph_inputs_pad_into_the_scratch_pages():
    attn = attention_backend(GQA, 4)
    g = attn.uniform_graph_attention(3, [10, 11], 2, 2, CPU)
    assert g.pad_slots.tolist() == [40, 41, 42]
    meta = attn.metadata_for_query_lens([3], [5], [[6, 9]], attn.slots([6, 9], 2, 3), CPU)
    g.load(meta)
    g.load_tables(1, meta.page_tables)
    g.pad_slots_and_lens(1, 2)
    assert g.slot_mapping.tolist() == [26, 27, 36, 40, 41, 42]
    assert g.seq_lens.tolist() == [5, 3]
    assert g.page_tables[:, :2].tolist() == [[6, 9], [10, 11]]
    static = g.meta(2, [5, 3])
    assert static.programs.req.tolist() == [0, 0, 1, 1] and static.programs.q0.tolist() == [0, 2, 0, 2]
    assert static.query_start_loc.tolist() == [0, 3, 6]


def test_mixed_graph_inputs_load_and_pad():
    attn = attention_backend(GQA, 4)
    m = attn.mixed_graph_attention(8, 2, [10], 2, CPU)  # slots: 2 sequences, the padding one (2), the empty one (3)
    meta = attn.metadata_for_query_lens([3, 1], [3, 5], [[6], [7, 8]], attn.slots([6], 0, 3) + attn.slots([7, 8], 4, 1),
                                        CPU)
    programs = np.zeros(3, dtype=np.int32), np.zeros(3, dtype=np.int32)
    attn.fill_programs(*programs, np.array([3, 1]), 2, np.arange(8))
    meta.programs = ProgramMap(2, torch.from_numpy(programs[0]), torch.from_numpy(programs[1]))
    count = m.load(meta)
    m.pad(8, 2, 4, count)
    assert m.query_start_loc.tolist() == [0, 3, 4, 8, 8]
    assert m.seq_lens.tolist() == [3, 5, 4, 0]
    assert m.slot_mapping.tolist() == [24, 25, 26, 32, 40, 41, 42, 43]
    # The step's programs, the padding sequence's two, then the empty sequence's.
    assert m.prog_req.tolist()[:5] == [0, 0, 1, 2, 2] and set(m.prog_req.tolist()[5:]) == {3}
    assert m.prog_q0.tolist()[:5] == [0, 2, 0, 0, 2]


def test_the_8bit_layout_is_in_the_spec_and_the_cache_follows_it():
    spec = KVCacheSpec(num_kv_heads=2, head_dim=3)
    fp8, bf16 = spec.layout(5, 4, torch.float8_e4m3fn), spec.layout(5, 4, torch.bfloat16)
    assert fp8.shape == bf16.shape == (2, 5, 4, 2, 3)
    assert fp8.v_transposed and not bf16.v_transposed
    assert fp8.nbytes == 2 * 5 * 4 * 2 * 3 and bf16.nbytes == 2 * fp8.nbytes
    assert not MLACacheSpec(16, 8, 4).layout(5, 4, torch.float8_e4m3fn).v_transposed
    attn = attention_backend([spec], 4)
    assert attn.cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert attn.cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    # MLA's latent row (DSA's with its indexer key) in 8 bits as it is; DeepSeek-V4's rows have no 8-bit path.
    mla = attention_backend([MLACacheSpec(16, 8, 4), DSACacheSpec(16, 8, 4, 4)], 4)
    assert mla.cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(ConfigError, match=r"DSV4CacheSpec \(DeepSeek-V4: .*drop the flag"):
        attention_backend([DSV4CacheSpec(16, 4, 4, True, 8)], 4).cache_dtype("fp8", torch.bfloat16)
    # The allocated cache stores V at [page, head, dim, offset] in memory (K as its shape says).
    cache = attn.allocate(5, torch.float8_e4m3fn, CPU)[0]
    k = torch.arange(6, dtype=torch.float32).view(1, 2, 3) + 1
    v = -k
    write_kv_cache(cache, k, v, torch.tensor([3 * 4 + 1]))  # page 3, offset 1
    bits = cache.view(torch.uint8)
    assert torch.equal(bits[0, 3, 1], k[0].to(torch.float8_e4m3fn).view(torch.uint8))
    v_memory = bits[1].reshape(5, 2, 3, 4)
    assert torch.equal(v_memory[3, :, :, 1], v[0].to(torch.float8_e4m3fn).view(torch.uint8))
