"""Random verify steps for the drafter-block prologue (kernels/draft_prologue_triton.py) against its PyTorch
reference (kernels/draft_prologue.py): every output equal. Run as a script on the default device:

    TRITON_INTERPRET=1 python tests/draft_prologue_cases.py 20   # CPU, in Triton's interpreter
    python tests/draft_prologue_cases.py 200                     # GPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atlas.kernels.draft_prologue import BlockInputs, next_block_inputs_ref  # noqa: E402
from atlas.kernels.draft_prologue_triton import next_block_inputs_triton  # noqa: E402

OUTPUTS = ("ids", "positions", "slots", "seq_lens", "bonus", "ctx_positions", "ctx_slots")


def case(seed: int, device: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 7, (1,), generator=g))
    q = [2, 4, 5, 8, 16][seed % 5]
    k = q - 1
    block_size = [8, 16][seed % 2]
    width = 16 * int(torch.randint(1, 3, (1,), generator=g))
    start = torch.randint(0, width * block_size - 2 * q, (n,), generator=g)
    target = torch.randint(0, 1000, (n, q), generator=g)
    ids = torch.randint(0, 1000, (n, q), generator=g)
    for i in range(n):  # drafts that agree with the target for a random number of rows, then one that does not
        agree = int(torch.randint(0, q, (1,), generator=g))
        ids[i, 1: 1 + agree] = target[i, :agree]
        if agree < k:
            ids[i, 1 + agree] = target[i, agree] + 1
    num_drafts = torch.randint(0, q, (n,), generator=g) if seed % 3 == 0 else None
    tables = torch.randperm(4 * width * n, generator=g)[: n * width].view(n, width).to(torch.int32)
    positions = (start[:, None] + torch.arange(q)).flatten()
    slots = (tables.long().gather(1, positions.view(n, q) // block_size) * block_size
             + positions.view(n, q) % block_size).flatten()
    return dict(input_ids=ids.flatten().to(device), target_tokens=target.flatten().to(device),
                positions=positions.to(device), slot_mapping=slots.to(device),
                num_drafts=num_drafts.to(device) if num_drafts is not None else None,
                page_tables=tables.to(device), block_size=block_size, mask_token_id=int(1e6 + seed))


def outputs(n: int, q: int, device: str) -> BlockInputs:
    long = dict(dtype=torch.long, device=device)
    return BlockInputs(ids=torch.full((n * q,), -7, **long), positions=torch.full((n * q,), -7, **long),
                       slots=torch.full((n * q,), -7, **long), seq_lens=torch.full((n,), -7, dtype=torch.int32,
                                                                                  device=device),
                       bonus=torch.full((n,), -7, **long), ctx_positions=torch.full((n * q,), -7, **long),
                       ctx_slots=torch.full((n * q,), -7, **long))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", type=int)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seed in range(args.cases):
        c = case(seed, device)
        n = c["page_tables"].shape[0]
        q = c["input_ids"].shape[0] // n
        want = outputs(n, q, device)
        next_block_inputs_ref(**c, out=want)
        runs = [(next_block_inputs_triton, False)]
        if seed % 4 == 1:  # the step's positions and slots in the buffers the outputs go to (a pre-launched step)
            runs = [(next_block_inputs_triton, True), (next_block_inputs_ref, True)]
        for fn, aliased in runs:
            out = outputs(n, q, device)
            args_ = c
            if aliased:
                out.positions.copy_(c["positions"])
                out.slots.copy_(c["slot_mapping"])
                args_ = dict(c, positions=out.positions, slot_mapping=out.slots)
            fn(**args_, out=out)
            for name in OUTPUTS:
                if not torch.equal(getattr(want, name), getattr(out, name)):
                    sys.exit(f"case {seed} (n={n}, q={q}, {fn.__name__}, aliased {aliased}): {name} differs:\n"
                             f"{getattr(want, name)}\n{getattr(out, name)}")
    print(f"{args.cases} cases agree")


if __name__ == "__main__":
    main()
