"""The cache of compiled grammars is bounded in bytes as well as in entries, least recently used out first, and a
grammar it evicted compiles again into the same constraint (the same token masks as the first compile)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atlas.config import ConfigError, EngineConfig
from atlas.sampling_params import StructuredOutputsParams
from atlas.structured import StructuredOutputManager

MODEL = Path(__file__).resolve().parent.parent / "atlas" / "assets" / "default-model"
VOCAB = 8192
WIDTH = 24  # properties per schema: a grammar of a few hundred kilobytes


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL))


def _schema(i: int) -> StructuredOutputsParams:
    """Schemas of one shape and size; schema i's keys are its own."""
    props = {f"k{i:02d}_{j:02d}": {"type": "integer"} for j in range(WIDTH)}
    return StructuredOutputsParams(json={"type": "object", "properties": props, "required": list(props),
                                         "additionalProperties": False})


def _doc(i: int) -> str:
    return json.dumps({f"k{i:02d}_{j:02d}": j for j in range(WIDTH)}, separators=(", ", ": "))


def _masks(manager, hf, spec, text: str) -> torch.Tensor:
    """The token masks of a fresh sequence after each token of `text` (which the grammar must accept)."""
    g = manager.request_grammar(spec)
    g.compiled.result()
    g.start()
    tokens = hf.encode(text, add_special_tokens=False)
    rows = torch.full((len(tokens) + 1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    for k, t in enumerate(tokens):
        g.matcher.fill_bitmask(rows, k)
        assert g.accept([t]) == 1, (k, t)
    g.matcher.fill_bitmask(rows, len(tokens))
    return rows


def _manager(hf, backend: str, cache_bytes: int) -> StructuredOutputManager:
    return StructuredOutputManager(hf, VOCAB, [hf.eos_token_id], backend=backend, cache_bytes=cache_bytes,
                                   compile_memory=None)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_many_large_grammars_keep_the_cache_under_its_bound_and_evicted_ones_compile_again(hf, backend):
    probe = _manager(hf, backend, 1 << 40)
    probe.compile(_schema(99)).result()
    one = probe.cache_info()[1]
    probe.close()
    assert one > 50_000  # (hundreds of kilobytes each: the bound counts bytes, not entries)
    bound = int(3.5 * one)
    manager = _manager(hf, backend, bound)
    first = {}
    reference = _masks(manager, hf, _schema(0), _doc(0))
    first[0] = manager.compile(_schema(0))
    for i in range(1, 10):
        first[i] = manager.compile(_schema(i))
        first[i].result()
        count, used = manager.cache_info()
        assert used <= bound and count <= 4
    cached = [i for i in range(10) if manager.cached(_schema(i))]
    assert cached == list(range(10 - len(cached), 10)) and 2 <= len(cached) <= 4  # (the most recent ones)
    assert manager.compile(_schema(9)) is first[9]  # (a hit)
    # Least recently used, not least recently compiled: a hit keeps the oldest one past the next eviction.
    oldest = cached[0]
    assert manager.compile(_schema(oldest)) is first[oldest]
    manager.compile(_schema(10)).result()
    assert manager.cached(_schema(oldest)) and not manager.cached(_schema(cached[1]))
    assert manager.cache_info()[1] <= bound
    # The evicted grammar compiled again is the same constraint: the same masks at every token of a document.
    assert not manager.cached(_schema(0))
    assert torch.equal(_masks(manager, hf, _schema(0), _doc(0)), reference)
    refused = manager.request_grammar(_schema(0))
    refused.compiled.result()
    refused.start()
    wrong = hf.encode(_doc(1), add_special_tokens=False)
    assert refused.accept(wrong) < len(wrong) and refused.error is not None


def test_a_grammar_larger_than_the_bound_serves_its_request_and_is_not_kept(hf):
    manager = _manager(hf, "llguidance", 1024)
    masks = _masks(manager, hf, _schema(3), _doc(3))
    assert masks.shape[0] > WIDTH and manager.cache_info() == (0, 0)


def test_the_bound_is_an_engine_flag():
    assert EngineConfig(model="m").grammar_cache_bytes == 512 << 20
    assert EngineConfig(model="m", structured_outputs_cache_memory="64MiB").grammar_cache_bytes == 64 << 20
    with pytest.raises(ConfigError, match="--structured-outputs-cache-memory must be a positive size, e.g. 512MiB"):
        EngineConfig(model="m", structured_outputs_cache_memory="0")
    with pytest.raises(ConfigError, match="--structured-outputs-cache-memory: cannot read 'much' as a size"):
        EngineConfig(model="m", structured_outputs_cache_memory="much")
