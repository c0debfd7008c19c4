"""Random problems for the token-mask kernel (kernels/token_mask_triton.py) against `apply_token_bitmask`'s
PyTorch path, shared by the tests (Triton's CPU interpreter in CI, the real GPU in test_cuda.py).

Run as a script it checks the kernel on the default device and exits non-zero on a mismatch:

    TRITON_INTERPRET=1 python tests/token_mask_cases.py 12   # CPU, in Triton's interpreter
    python tests/token_mask_cases.py 60                      # GPU

The results must be bit-equal: the kernel only copies logits or writes -inf and 0.
"""

from __future__ import annotations

import argparse
import sys

import torch

# Vocabulary sizes: below one block, not multiples of 32 or of the block, a multiple of both, a real one.
VOCABS = [37, 280, 2047, 2048, 4100, 8192, 32000, 151936]


def case(seed: int, device: str, max_vocab: int = 1 << 30) -> dict:
    g = torch.Generator().manual_seed(seed)
    vocabs = [v for v in VOCABS if v <= max_vocab]
    vocab = vocabs[seed % len(vocabs)]
    n = int(torch.randint(1, 9, (1,), generator=g))
    words = (vocab + 31) // 32
    if seed % 3 == 1:  # narrower than the vocabulary: the missing bits allow nothing
        words = max(0, words - int(torch.randint(1, 4, (1,), generator=g)))
    logits = torch.randn(n, vocab, generator=g) * 4
    # some logits already -inf (banned tokens), on allowed tokens too
    logits[torch.rand(n, vocab, generator=g) < 0.2] = float("-inf")
    subset = seed % 2 == 1
    if subset:
        r = int(torch.randint(0, n + 1, (1,), generator=g))
        rows = torch.randperm(n, generator=g)[:r]  # any order
    else:
        r, rows = n, None
    density = [0.5, 0.01, 0.0005][seed % 3]
    bits = torch.rand(r, words * 32, generator=g) < density
    bitmask = _pack(bits)
    if r:
        bitmask[0] = 0  # every token masked: the fallback (nothing allowed: a row of -inf)
    if r > 1:  # allowed tokens all -inf already: the fallback gives them 0
        row = rows[1] if rows is not None else 1
        allowed = bits[1, :vocab].nonzero().flatten()
        logits[row, allowed] = float("-inf")
    if r > 2 and words:  # a row allowing everything but with every logit -inf
        bitmask[2] = -1
        logits[rows[2] if rows is not None else 2] = float("-inf")
    return {"logits": logits.to(device), "bitmask": bitmask.to(device),
            "rows": rows.to(device) if rows is not None else None}


def _pack(bits: torch.Tensor) -> torch.Tensor:
    """[R, words * 32] bool -> [R, words] int32 with bit t % 32 of word t // 32 for token t."""
    r, width = bits.shape
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    words = (bits.view(r, width // 32, 32).long() * weights).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def check(device: str, seeds, max_vocab: int = 1 << 30) -> list[str]:
    from atlas.kernels.token_mask_triton import apply_token_bitmask_triton_
    from atlas.runtime.sampler import _apply_token_bitmask_torch

    problems = []
    for seed in seeds:
        t = case(seed, device, max_vocab)
        expected = _apply_token_bitmask_torch(t["logits"], t["bitmask"], t["rows"])
        got = apply_token_bitmask_triton_(t["logits"].clone(), t["bitmask"], t["rows"])
        if not torch.equal(got, expected):
            bad = (got != expected).nonzero()
            problems.append(f"seed {seed}: vocab {t['logits'].shape[1]} rows {t['rows']} words "
                            f"{t['bitmask'].shape[1]}: {len(bad)} elements differ, first {bad[:4].tolist()}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", type=int)
    parser.add_argument("--max-vocab", type=int, default=1 << 30)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    problems = check(device, range(args.cases), args.max_vocab)
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"{args.cases} cases agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
