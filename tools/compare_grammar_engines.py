"""Measure the two grammar engines Atlas could use for structured outputs, xgrammar and llguidance, on
the same tokenizers, schemas and token streams (CPU).

For each engine and tokenizer: the one-time tokenizer set-up, the compile time of each grammar (first
time, and again for the same schema), and the host time per generated token (computing the next-token
bitmask and advancing the matcher by the token), walking valid JSON documents token by token. Both
engines must accept every document (a check that they enforce the same language here).

    pip install llguidance   # (xgrammar is a dependency of Atlas; llguidance only for this comparison)
    python tools/compare_grammar_engines.py [--big-vocab 65536] [--output-json FILE]

The default model's tokenizer (8,192 tokens) is always measured; --big-vocab also trains a byte-level
BPE of that size on the Python standard library, a vocabulary closer to real LLMs' (seconds to train).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"]},
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "kind": {"enum": ["module", "class", "function"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "owner": {"type": "object", "properties": {"login": {"type": "string"},
                                                       "admin": {"type": "boolean"}},
                      "required": ["login", "admin"]},
            "score": {"type": "number"},
        },
        "required": ["id", "kind", "tags", "owner"],
        "additionalProperties": False,
    },
}
DOCUMENTS = {
    "flat": ['{"name": "textwrap", "age": 31}', '{"name": "a \\"quoted\\" name", "age": -4}'],
    "nested": ['{"id": 12, "kind": "class", "tags": ["io", "text"], "owner": {"login": "guido", "admin": true}, '
               '"score": 0.75}',
               '{"id": 0, "kind": "function", "tags": [], "owner": {"login": "x", "admin": false}}'],
}


def default_tokenizer_path() -> Path:
    return Path(__file__).resolve().parent.parent / "atlas" / "assets" / "default-model"


def train_big_tokenizer(vocab: int, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    text = [f.read_text(errors="ignore") for f in files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(out)
    return out


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf):
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.setup_s = time.perf_counter() - t0
        self.vocab = len(hf)

    def compile(self, schema):
        if schema is None:
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(schema))

    def run(self, compiled, tokens, eos):
        xgr = self.xgr
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, self.vocab)
        times = []
        for t in [*tokens, eos]:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            ok = bool((mask[0, t // 32] >> (t % 32)) & 1) and matcher.accept_token(t)
            times.append(time.perf_counter() - t0)
            if not ok:
                return False, times
        return matcher.is_terminated(), times


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        t0 = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
        self.setup_s = time.perf_counter() - t0
        self.vocab = len(hf)

    def compile(self, schema):
        llg = self.llg
        grammar = llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema if schema is not None else {"type": "object"}),
            defaults={"whitespace_flexible": True})
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)  # (the compile happens here)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def run(self, grammar, tokens, eos):
        import llguidance.torch as lt

        llg = self.llg
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        mask = lt.allocate_token_bitmask(1, self.vocab)
        times = []
        for t in [*tokens, eos]:
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(matcher, mask, 0)
            ok = bool((mask[0, t // 32] >> (t % 32)) & 1) and matcher.consume_token(t)
            times.append(time.perf_counter() - t0)
            if not ok:
                return False, times
        return matcher.is_stopped() or matcher.is_accepting(), times


def measure(engine_cls, hf) -> dict:
    engine = engine_cls(hf)
    eos = hf.eos_token_id
    out = {"tokenizer_setup_ms": engine.setup_s * 1e3, "schemas": {}}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = engine.compile(schema)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.compile(schema)
        again = time.perf_counter() - t0
        per_token, accepted = [], True
        for doc in DOCUMENTS[name]:
            ok, times = engine.run(compiled, hf.encode(doc, add_special_tokens=False), eos)
            accepted &= ok
            per_token += times
        out["schemas"][name] = {"compile_ms": first * 1e3, "compile_again_ms": again * 1e3,
                                "per_token_us_median": statistics.median(per_token) * 1e6,
                                "per_token_us_mean": statistics.fmean(per_token) * 1e6,
                                "per_token_us_max": max(per_token) * 1e6, "tokens": len(per_token),
                                "all_documents_accepted": accepted}
    return out


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big-vocab", type=int, default=65536, help="0: only the default model's tokenizer")
    ap.add_argument("--work-dir", default="/tmp/atlas-grammar-bench")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tokenizers = {"default model (8,192)": default_tokenizer_path()}
    if args.big_vocab:
        tokenizers[f"stdlib BPE ({args.big_vocab:,})"] = train_big_tokenizer(args.big_vocab, Path(args.work_dir))
    results: dict = {"python": sys.version.split()[0], "engines": {}}
    from importlib.metadata import version

    results["versions"] = {"xgrammar": version("xgrammar"), "llguidance": version("llguidance")}
    lines = []
    for tok_name, path in tokenizers.items():
        hf = AutoTokenizer.from_pretrained(str(path))
        for engine_cls in (XGrammar, LLGuidance):
            r = measure(engine_cls, hf)
            results["engines"][f"{engine_cls.name} / {tok_name}"] = r
            for schema, s in r["schemas"].items():
                lines.append(f"| {engine_cls.name} | {tok_name} | {r['tokenizer_setup_ms']:.0f} | {schema} | "
                             f"{s['compile_ms']:.1f} | {s['compile_again_ms']:.2f} | {s['per_token_us_median']:.0f} | "
                             f"{s['per_token_us_mean']:.0f} | {s['per_token_us_max']:.0f} | "
                             f"{'yes' if s['all_documents_accepted'] else 'NO'} |")
    header = ("| engine | tokenizer | tokenizer set-up ms | schema | compile ms | same schema again ms | "
              "mask+advance us/token median | mean | max | documents accepted |\n|---|---|---:|---|---:|---:|---:|---:|---:|---|")
    text = header + "\n" + "\n".join(lines)
    print(f"xgrammar {results['versions']['xgrammar']}, llguidance {results['versions']['llguidance']}, "
          f"Python {results['python']}, 1 torch thread")
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=1))
        Path(args.output_json).with_suffix(".txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
