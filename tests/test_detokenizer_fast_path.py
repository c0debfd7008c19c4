"""The detokenizer's fast path: a byte-level BPE token whose bytes are whole characters adds exactly its own text
after text that ends on a whole character, so such tokens need no window decode (Tokenizer.token_pieces)."""

from __future__ import annotations

import random

import pytest

from atlas.engine.core import default_model_path
from atlas.engine.tokenizer import IncrementalDetokenizer, Tokenizer, detokenize_runs


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(default_model_path())


def test_pieces_are_what_each_token_adds_behind_any_text(tok):
    pieces = tok.token_pieces
    assert pieces is not None and len(pieces) >= len(tok.hf)
    simple = [i for i, p in enumerate(pieces) if p is not None]
    assert len(simple) > 0.9 * len(tok.hf)
    backend = tok.hf.backend_tokenizer
    rng = random.Random(1)
    for _ in range(300):
        before = [rng.randrange(len(tok.hf)) for _ in range(rng.randint(1, 4))]
        t = rng.choice(simple)
        base = backend.decode(before, skip_special_tokens=True)
        if base.endswith("\ufffd"):  # (text that ends inside a character: the fast path is not used there)
            continue
        assert backend.decode([*before, t], skip_special_tokens=True) == base + pieces[t]
    # a token holding part of a character, and the added (special) tokens, have no piece
    partial = [i for i in range(len(tok.hf)) if "\ufffd" in backend.decode([i]) and i not in tok.hf.added_tokens_decoder]
    assert partial and all(pieces[i] is None for i in partial)
    assert all(pieces[i] is None for i in tok.hf.added_tokens_decoder if i < len(pieces))


def test_simple_tokens_are_not_decoded_again(tok, monkeypatch):
    """After the first token (where the prompt's end is not known to be a whole character), a run of simple tokens
    costs no decode, and the texts are those of adding the tokens one at a time."""
    ids = tok.encode("def area(r):\n    return 3.14159 * r * r  # the circle's area\n", add_special_tokens=False)
    pieces = tok.token_pieces
    assert all(pieces[t] is not None for t in ids)
    reference = IncrementalDetokenizer(tok, ids[:5])
    want = [reference.add(t) for t in ids[5:]]
    decoded = []
    real = tok.decode_batch
    monkeypatch.setattr(tok, "decode_batch", lambda seqs, skip=True: decoded.append(len(seqs)) or real(seqs, skip))
    d = IncrementalDetokenizer(tok, ids[:5])
    got = detokenize_runs(tok, [d], [ids[5:6]])[0]
    assert decoded == [2]  # (the first token: its two windows)
    got += detokenize_runs(tok, [d], [ids[6:9]])[0]
    for t in ids[9:]:
        got += detokenize_runs(tok, [d], [[t]])[0]
    assert decoded == [2] and got == want
    assert (d.prefix_offset, d.read_offset, d.tokens) == (reference.prefix_offset, reference.read_offset,
                                                          reference.tokens)


def test_other_vocabularies_keep_the_window_decode(tmp_path):
    """A sentencepiece-style vocabulary (its decoder drops the first word's space, so a token's text depends on
    where it stands) has no pieces, and its texts are still those of adding one token at a time."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁a": 3, "b": 4, "▁": 5}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(tmp_path)
    tok = Tokenizer(tmp_path)
    assert tok.token_pieces is None
    ids = [1, 2, 3, 4, 2, 1]
    one, many = IncrementalDetokenizer(tok, ids[:1]), IncrementalDetokenizer(tok, ids[:1])
    want = [one.add(t) for t in ids[1:]]
    assert detokenize_runs(tok, [many], [ids[1:]])[0] == want == [" world", " a", "b", " world", " hello"]


def test_ids_the_tokenizer_does_not_know_add_nothing_on_both_paths(tok):
    """A model's vocabulary can be larger than its tokenizer's (random weights sample such ids all the time): those
    ids add no text and keep the fast path; texts and offsets equal adding one token at a time."""
    pieces = tok.token_pieces
    vocab = len(tok.hf)
    rng = random.Random(3)
    simple = [i for i, p in enumerate(pieces) if p]
    for _ in range(40):
        seq = [rng.choice(simple) if rng.random() < 0.4 else
               (rng.randrange(vocab, 4 * vocab) if rng.random() < 0.8 else rng.randrange(vocab))
               for _ in range(50)]
        one, many = IncrementalDetokenizer(tok, seq[:5]), IncrementalDetokenizer(tok, seq[:5])
        want = [one.add(t) for t in seq[5:]]
        got, i = [], 5
        while i < len(seq):
            n = rng.randint(1, 4)
            got += detokenize_runs(tok, [many], [seq[i:i + n]])[0]
            i += n
        assert got == want
        assert (many.prefix_offset, many.read_offset, many.tokens) == (one.prefix_offset, one.read_offset, one.tokens)
        assert many.flush() == one.flush()


def test_unknown_ids_after_text_take_no_decode(tok, monkeypatch):
    ids = tok.encode("x = 1\n", add_special_tokens=False)
    unknown = len(tok.hf) + 7
    d = IncrementalDetokenizer(tok, ids[:2])
    assert detokenize_runs(tok, [d], [ids[2:3]])[0] == [tok.decode(ids[:3])[len(tok.decode(ids[:2])):]]
    calls = []
    monkeypatch.setattr(tok, "decode_batch", lambda seqs, skip=True: calls.append(seqs) or [])
    assert detokenize_runs(tok, [d], [[unknown, unknown, ids[3], unknown]])[0][:2] == ["", ""]
    assert calls == [] and d.read_offset == len(d.tokens) - 1
