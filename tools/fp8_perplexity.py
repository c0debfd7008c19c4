"""Held-out perplexity of the shipped default model in FP8 against bf16 (issue 34: "quantize the shipped default
model to FP8 (block and per-channel) and report held-out perplexity against bf16, <= 1 % worse").

Every variant is scored by the engine itself (`LLM.generate` with `prompt_logprobs=0`: the log-probability of each
actual next token), in bfloat16, over the same held-out tokens:
- bf16: the shipped checkpoint;
- fp8-channel: `--quantization fp8` (per-output-channel weight scales, quantized at load);
- fp8-block: a block-scaled checkpoint written from the shipped one in the Qwen -FP8 / DeepSeek-V3 layout
  (float8_e4m3fn weights, a float32 `weight_scale_inv` per 128 x 128 block, `quant_method fp8` with
  `weight_block_size`), loaded as any such checkpoint.

Which numerics run: on CUDA, the FP8 kernels (scoring a prompt is prefill, so the W8A8 paths: activations
rounded to FP8 as they arrive). On the CPU, the reference path, which multiplies by the dequantized weight (W8A16);
`--w8a8` on the CPU also scores each FP8 variant with the activations quantized as the GPU's prefill paths quantize
them (`fp8_linear.w8a8_ref`, which the CUDA tests hold those kernels to), so the CPU run bounds both.

The held-out tokens: the test split of the corpus the model was trained on (atlas/training/corpus.py, seed 0),
built from this machine's Python standard library. The shipped model was trained on Python 3.11.7's; another
version's test files differ a little (and a few may have been training files there), which moves every variant's
perplexity alike.

    python tools/fp8_perplexity.py --max-tokens 131072 --output-json /tmp/fp8_ppl.json [--w8a8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from make_random_checkpoint import FP8_CONFIGS, fp8_quantize  # noqa: E402 (this folder's checkpoint writer)

from atlas import LLM, SamplingParams  # noqa: E402
from atlas.kernels import fp8_linear as fp8_mod  # noqa: E402

DEFAULT_MODEL = ROOT / "atlas" / "assets" / "default-model"


def held_out_tokens(model_dir: Path, max_tokens: int) -> list[int]:
    """The corpus's test split, tokenized with the model's tokenizer and packed with EOS between documents."""
    from tokenizers import Tokenizer

    from atlas.training.corpus import CorpusConfig, build_corpus
    from atlas.training.data import pack_documents
    from atlas.training.tokenizer import EOS_TOKEN

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    docs = build_corpus(CorpusConfig(seed=0)).split("test")
    ids = [e.ids for e in tok.encode_batch([d.text for d in docs], add_special_tokens=False)]
    stream = pack_documents(ids, tok.token_to_id(EOS_TOKEN))
    return [int(t) for t in stream[: max_tokens + 1]]


def write_block_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of `src` with every projection of its decoder layers block-quantized as tools/make_random_checkpoint.py
    writes them (each 128 x 128 tile's amax / 448; the embedding, norms and tied LM head stay as they are, as in the
    published -FP8 checkpoints)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("dflash-drafter"))
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        tensors |= fp8_quantize(name, t, "block") if name.endswith("proj.weight") else {name: t}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((dst / "config.json").read_text())
    raw["quantization_config"] = FP8_CONFIGS["block"]
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@contextlib.contextmanager
def w8a8_reference():
    """The CPU reference path with activations quantized as the GPU's prefill (W8A8) paths quantize them."""
    real = fp8_mod.fp8_linear_ref

    def w8a8(x, weight, scale, block, bias=None):
        return fp8_mod.w8a8_ref(x, weight, scale, block, bias)

    fp8_mod.fp8_linear_ref = w8a8
    try:
        yield
    finally:
        fp8_mod.fp8_linear_ref = real


def score(llm: LLM, tokens: list[int], window: int) -> tuple[float, int]:
    """(summed NLL, labels) of `tokens` in windows of `window` + 1 tokens overlapping by one (every token after the
    first is a label once), each window scored as one prompt."""
    prompts = [{"prompt_token_ids": tokens[i:i + window + 1]} for i in range(0, len(tokens) - 1, window)]
    prompts = [p for p in prompts if len(p["prompt_token_ids"]) > 1]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
    nll, count = 0.0, 0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = prompt["prompt_token_ids"]
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            nll -= entry[ids[pos]].logprob
            count += 1
    return nll, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--max-tokens", type=int, default=131072, help="held-out labels scored")
    parser.add_argument("--window", type=int, default=1024, help="tokens a prompt (the model's training windows)")
    parser.add_argument("--w8a8", action="store_true", help="on the CPU, also score with W8A8 activations")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)

    model = Path(args.model)
    tokens = held_out_tokens(model, args.max_tokens)
    engine = {"dtype": "bfloat16", "max_model_len": args.window + 2, "enable_prefix_caching": False,
              "max_num_batched_tokens": 8 * (args.window + 1), "kv_cache_memory": "256MiB"}
    report: dict = {"model": str(model), "labels": len(tokens) - 1, "window": args.window,
                    "device": "cuda" if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                    "python": sys.version.split()[0], "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        block_dir = write_block_checkpoint(model, Path(tmp) / "fp8-block")
        variants = [("bf16", str(model), {}, False), ("fp8-channel", str(model), {"quantization": "fp8"}, False),
                    ("fp8-block", str(block_dir), {}, False)]
        if args.w8a8 and not torch.cuda.is_available():
            variants += [("fp8-channel w8a8", str(model), {"quantization": "fp8"}, True),
                         ("fp8-block w8a8", str(block_dir), {}, True)]
        for name, path, extra, w8a8 in variants:
            start = time.perf_counter()
            llm = LLM(path, **engine, **extra)
            with w8a8_reference() if w8a8 else contextlib.nullcontext():
                nll, count = score(llm, tokens, args.window)
            del llm
            ppl = math.exp(nll / count)
            report["variants"][name] = {"nll_per_token": nll / count, "perplexity": ppl, "labels": count,
                                        "seconds": round(time.perf_counter() - start, 1)}
    base = report["variants"]["bf16"]["perplexity"]
    print(f"held-out perplexity, {report['labels']:,} labels in windows of {args.window}, on {report['device']}:")
    for name, v in report["variants"].items():
        v["over_bf16"] = v["perplexity"] / base
        print(f"  {name:18s} {v['perplexity']:.4f}  ({100 * (v['over_bf16'] - 1):+.2f} % against bf16)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
