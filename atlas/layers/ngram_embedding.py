"""LongCat-Flash-Lite's n-gram input embedding (spec ../shared/specs/mla-mtp-dsa-longcat.md section 5.3).

Each token's input vector is the mean of E + 1 vectors: its word embedding and, for every n-gram order n in
2..N and each of K hashed tables of that order (E = K * (N - 1) tables, table i = (n - 2) * K + j), the
projection of a row of table i chosen by a hash of the token and the n - 1 tokens before it:

    id_i(p) = (t_p + sum_{k=1}^{n-1} s_k(p) * (V^k mod M_i)) mod M_i,    M_i = int(r * V + 2 i + 1)
    x_p = (E_word[t_p] + sum_i post_proj_i(table_i[id_i(p)])) / (1 + E)

V is the vocabulary size and r `ngram_vocab_size_ratio`. s_k(p) is the token at p - k when it lies in p's
segment, else 0: a sequence starts a segment, and so does the token after each end-of-sequence token (the EOS
belongs to the segment it ends), so an n-gram never reaches back across a document boundary.

The look-back tokens come from a paged token cache (`TokenHistorySpec`: one int32 per position, in the same
pages as the KV cache): the step writes its own tokens first, then reads the N - 1 positions before each of
its rows. So chunked prefill, prefix-cache hits (a cached page holds the tokens of the positions it caches),
preemption (recomputed positions are written again) and speculative verify (a draft row reads the drafts before
it, written in the same step; rejected ones are overwritten later) all see exactly a whole-sequence pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from atlas.layers.attention import AttentionMetadata, CacheLayout, CacheSpec
from atlas.layers.embedding import VocabEmbedding


@dataclass(frozen=True)
class TokenHistorySpec(CacheSpec):
    """One token id (int32) per position, layout [pages, block], whatever the KV caches' dtype. No kernel reads
    it; it packs heads as the model's attention layers (`pack`), so the step's one program map serves them."""

    pack: tuple[int, int]
    no_8bit_path: ClassVar[str | None] = None  # (token ids stay int32 beside an 8-bit KV cache)

    def values_per_token(self) -> int:
        return 1

    def cache_shape(self, num_pages: int, block_size: int) -> tuple[int, ...]:
        return (num_pages, block_size)

    @property
    def program_heads(self) -> tuple[int, int]:
        return self.pack

    def layout(self, num_pages: int, block_size: int, dtype: torch.dtype) -> CacheLayout:
        return CacheLayout(self.cache_shape(num_pages, block_size), torch.int32)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 4


@dataclass(frozen=True)
class NgramConfig:
    vocab_size: int
    hidden_size: int
    ratio: float  # ngram_vocab_size_ratio
    max_order: int  # emb_neighbor_num (N)
    splits: int  # emb_split_num (K)
    eos_token_id: int

    @property
    def num_tables(self) -> int:
        return self.splits * (self.max_order - 1)

    @property
    def table_dim(self) -> int:
        return self.hidden_size // self.num_tables

    def table_rows(self, i: int) -> int:
        return int(self.ratio * self.vocab_size + 2 * i + 1)

    def order(self, i: int) -> int:
        return i // self.splits + 2

    def multipliers(self, i: int) -> list[int]:
        """V^k mod M_i for k = 1 .. order(i) - 1."""
        m, out, power = self.table_rows(i), [], 1
        for _ in range(self.order(i) - 1):
            power = power * self.vocab_size % m
            out.append(power)
        return out


class NgramEmbedding(nn.Module):
    """The word table (`model.embed_tokens`, shared) plus E hashed tables and their projections."""

    def __init__(self, cfg: NgramConfig, word: VocabEmbedding):
        super().__init__()
        self.cfg = cfg
        self.word = {"table": word}  # (the model's own embed_tokens: not a submodule of this one)
        self.embedders = nn.ModuleList(nn.Embedding(cfg.table_rows(i), cfg.table_dim) for i in range(cfg.num_tables))
        self.post_projs = nn.ModuleList(nn.Linear(cfg.table_dim, cfg.hidden_size, bias=False)
                                        for _ in range(cfg.num_tables))
        # V^k mod M_i of every table, zero past its order ([E, N - 1]), and M_i: on the model's device, so that a step
        # copies nothing from the host
        mult = torch.zeros(cfg.num_tables, cfg.max_order - 1, dtype=torch.int64)
        for i in range(cfg.num_tables):
            m = cfg.multipliers(i)
            mult[i, : len(m)] = torch.tensor(m, dtype=torch.int64)
        self.register_buffer("multipliers", mult, persistent=False)
        self.register_buffer("rows", torch.tensor([cfg.table_rows(i) for i in range(cfg.num_tables)]),
                             persistent=False)

    def look_back(self, input_ids: torch.Tensor, positions: torch.Tensor, history: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """Write this step's tokens into the paged history, then -> s [T, N - 1] (int64): s[:, k - 1] the token at
        p - k where it is in p's segment, else 0."""
        flat = history.view(-1)
        flat[meta.slot_mapping] = input_ids.to(torch.int32)
        bs = history.shape[1]
        rows = input_ids.shape[0]
        # (each row's sequence, from the step's row ranges)
        seq = torch.searchsorted(meta.query_start_loc[1:].to(torch.int64),
                                 torch.arange(rows, device=input_ids.device), right=True)
        tables = meta.page_tables[seq].to(torch.int64)  # [T, pages]
        out = torch.zeros(rows, self.cfg.max_order - 1, dtype=torch.int64, device=input_ids.device)
        blocked = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
        positions = positions.to(torch.int64)
        for k in range(1, self.cfg.max_order):
            pos = positions - k
            blocked = blocked | (pos < 0)
            at = pos.clamp_min(0)
            slots = tables.gather(1, (at // bs)[:, None])[:, 0] * bs + at % bs
            token = flat[slots].to(torch.int64)
            blocked = blocked | (token == self.cfg.eos_token_id)  # (an EOS at p - k ends p - k's segment)
            out[:, k - 1] = torch.where(blocked, 0, token)
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, history: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        s = self.look_back(input_ids, positions, history, meta)
        # every table's row ids at once: [T, E]
        ids = (input_ids.to(torch.int64)[:, None] + (s[:, None, :] * self.multipliers).sum(-1)) % self.rows
        x = self.word["table"](input_ids)
        acc = x.float()
        for i, (table, proj) in enumerate(zip(self.embedders, self.post_projs, strict=True)):
            acc += proj(table(ids[:, i])).float()
        return (acc / (1 + self.cfg.num_tables)).to(x.dtype)
