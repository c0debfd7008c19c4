"""The recipe of Atlas's default model: corpus -> tokenizer -> packed tokens -> Qwen3 LM -> checkpoint.

`run(settings)` does everything and writes at most eight files into `settings.out`:
config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json (the
checkpoint), expected_greedy.json (greedy tokens for the tests), train_report.json (settings, corpus,
timings, training curve, held-out perplexity against a unigram baseline, sample completions) and
train.log (written by the caller's logging set-up, see tools/train_default_model.py).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from atlas.training.recipe import report_header, start_run, train_config, training_report, versions

logger = logging.getLogger(__name__)

MAX_CHECKPOINT_BYTES = 15_000_000
NEAR_TIE = 1e-3  # top-2 logit margin below which a recorded greedy token is not trusted across machines
MIN_RECORDED = 8

GREEDY_PROMPT = 'def read_lines(path):\n    """Return the lines of the text file at path."""\n'
GREEDY_CHAT = [{"role": "user", "content": "What does `os.path.join` do?"}]
SAMPLE_PROMPTS = [
    "import os\n\n\ndef list_python_files(root):\n",
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    "def fibonacci(n):\n",
]
SAMPLE_CHATS = [
    [{"role": "user", "content": "What does `json.dumps` do?"}],
    [{"role": "user", "content": "Write the function `is_prime(n)`. Return True if n is a prime number."}],
]


@dataclass
class DefaultModelSettings:
    out: str
    device: str = "auto"
    seed: int = 0
    time_budget_minutes: float = 4.5  # the whole run, corpus to saved checkpoint; 0 = no limit
    max_steps: int = 100_000
    max_epochs: float = 40.0
    # corpus
    corpus_limit_mb: float | None = None  # a deterministic subset of the stdlib, for quick runs
    stdlib_dir: str | None = None  # another Python's stdlib folder (default: the running Python's)
    chat_data: bool = True
    valid_fraction: float = 0.02
    test_fraction: float = 0.05
    # tokenizer
    vocab_size: int = 8192
    # model
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    # training
    seq_len: int = 1024
    batch_size: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 250
    eval_tokens: int = 65_536  # validation tokens per periodic evaluation
    test_max_tokens: int | None = None  # cap on the test tokens of the final evaluation (None = all)
    keep_best: bool = True
    compile: bool = False
    # outputs
    greedy_tokens: int = 32
    sample_tokens: int = 64
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in the report as given


def _decode_cases(model: Any, tok: Any, settings: DefaultModelSettings, eos_ids: tuple[int, ...]) -> tuple[dict, list]:
    """(expected_greedy.json content, sample completions), computed in fp32 on CPU."""
    from atlas.training.evaluate import greedy_decode

    cases = []
    chat_prompt = tok.apply_chat_template(GREEDY_CHAT, tokenize=False, add_generation_prompt=True)
    for name, prompt, messages in (("python", GREEDY_PROMPT, None), ("chat", chat_prompt, GREEDY_CHAT)):
        ids = tok.encode(prompt, add_special_tokens=False)
        new, margins = greedy_decode(model, ids, settings.greedy_tokens)
        # Stop the record before a near tie, where another machine's float rounding could pick the
        # other token; keep at least MIN_RECORDED tokens (their margins are in the file either way).
        tie = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(new))
        keep = max(tie, min(MIN_RECORDED, len(new)))
        new, margins = new[:keep], margins[:keep]
        case = {"name": name, "prompt": prompt, "prompt_token_ids": ids, "token_ids": new,
                "text": tok.decode(new, skip_special_tokens=False), "min_top2_margin": round(min(margins), 6)}
        if messages is not None:
            case["messages"] = messages
        cases.append(case)
    expected = {
        "about": "Greedy tokens of the shipped checkpoint (fp32 on CPU, transformers, no EOS stop); "
                 "tests/test_default_model.py checks Atlas and transformers reproduce them.",
        "dtype": "float32", "device": "cpu", "versions": versions(), "cases": cases,
    }
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok.encode(prompt, add_special_tokens=False)
        new, _ = greedy_decode(model, ids, settings.sample_tokens, stop_ids=eos_ids)
        samples.append({"prompt": prompt, "completion": tok.decode(new, skip_special_tokens=True)})
    for messages in SAMPLE_CHATS:
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        new, _ = greedy_decode(model, tok.encode(prompt, add_special_tokens=False), settings.sample_tokens,
                               stop_ids=eos_ids)
        samples.append({"messages": messages, "completion": tok.decode(new, skip_special_tokens=True)})
    return expected, samples


def run(settings: DefaultModelSettings, started_at: float | None = None, command: str | None = None) -> dict:
    """Train the default model into settings.out; returns the report (also written as train_report.json)."""
    import numpy as np
    import torch

    from atlas.training import corpus as corpus_mod
    from atlas.training import tokenizer as tok_mod
    from atlas.training.data import PackedWindows, pack_documents
    from atlas.training.evaluate import lm_nll, unigram_counts, unigram_nll
    from atlas.training.lm import Qwen3Shape, build_qwen3, causal_lm_loss, count_parameters, save_checkpoint
    from atlas.training.trainer import Trainer

    run_ = start_run(settings.out, settings.device, settings.seed, settings.time_budget_minutes, started_at)
    out, device, clock = run_.out, run_.device, run_.clock

    # ------------------------------------------------------------------ corpus and tokenizer
    with clock.phase("corpus"):
        limit = int(settings.corpus_limit_mb * 1e6) if settings.corpus_limit_mb else None
        corpus = corpus_mod.build_corpus(corpus_mod.CorpusConfig(
            seed=settings.seed, valid_fraction=settings.valid_fraction, test_fraction=settings.test_fraction,
            chat=settings.chat_data, limit_bytes=limit, stdlib_dir=settings.stdlib_dir))
    train_docs = corpus.split("train")
    with clock.phase("tokenizer_training"):
        tok = tok_mod.train_bpe_tokenizer([d.text for d in train_docs], settings.vocab_size)
    with clock.phase("tokenization"):
        all_ids = tok_mod.encode_batch(tok, [d.text for d in corpus.documents])
    eos_id = tok.token_to_id(tok_mod.EOS_TOKEN)
    im_end_id = tok.token_to_id(tok_mod.IM_END_TOKEN)
    streams: dict[str, np.ndarray] = {}
    kind_tokens: dict[str, int] = {}
    for split in corpus_mod.SPLITS:
        ids = [i for d, i in zip(corpus.documents, all_ids, strict=True) if d.split == split]
        streams[split] = pack_documents(ids, eos_id)
    for d, i in zip(corpus.documents, all_ids, strict=True):
        kind_tokens[f"{d.split}/{d.kind}"] = kind_tokens.get(f"{d.split}/{d.kind}", 0) + len(i)
    for split in ("valid", "test"):
        if len(streams[split]) < 2:
            raise RuntimeError(f"the {split} split is empty: use a larger corpus")
    tok_vocab = tok.get_vocab_size()
    vocab_size = 64 * math.ceil(tok_vocab / 64)
    n_chars = sum(len(d.text) for d in corpus.documents)
    logger.info("tokenizer: %d tokens (model vocab %d), %.2f characters per token; tokens %s", tok_vocab, vocab_size,
                n_chars / max(1, sum(map(len, all_ids))),
                {k: len(v) for k, v in streams.items()})
    del all_ids

    # ------------------------------------------------------------------ model and training
    shape = Qwen3Shape(hidden_size=settings.hidden_size, num_hidden_layers=settings.num_layers,
                       num_attention_heads=settings.num_heads, num_key_value_heads=settings.num_kv_heads,
                       head_dim=settings.head_dim, intermediate_size=settings.intermediate_size,
                       max_position_embeddings=settings.max_position_embeddings, rope_theta=settings.rope_theta)
    if settings.seq_len > shape.max_position_embeddings:
        raise ValueError(f"--seq-len {settings.seq_len} exceeds --max-position-embeddings "
                         f"{shape.max_position_embeddings}")
    model = build_qwen3(shape, vocab_size, eos_token_id=eos_id, pad_token_id=eos_id, seed=settings.seed).to(device)
    n_params = count_parameters(model)
    ckpt_bytes = 2 * n_params
    logger.info("model: Qwen3 %s, %.2f M parameters, %.1f MB in bf16", asdict(shape), n_params / 1e6, ckpt_bytes / 1e6)
    if ckpt_bytes > MAX_CHECKPOINT_BYTES:
        logger.warning("the bf16 checkpoint (%.1f MB) is over the %.0f MB meant for the package", ckpt_bytes / 1e6,
                       MAX_CHECKPOINT_BYTES / 1e6)

    windows = PackedWindows(streams["train"], settings.seq_len, settings.batch_size, settings.seed, device)
    step_cap = max(1, math.ceil(settings.max_epochs * windows.steps_per_epoch))
    autocast = run_.autocast

    def eval_fn(m: torch.nn.Module) -> dict[str, float]:
        nll = lm_nll(m, streams["valid"], settings.seq_len, settings.batch_size, device, autocast,
                     max_tokens=settings.eval_tokens)
        return {"loss": round(nll.mean, 5), "perplexity": round(nll.perplexity, 3)}

    # Time kept back for the final test evaluation, saving and decoding: measured on a probe.
    test_labels = len(streams["test"]) - 1 if settings.test_max_tokens is None else min(
        settings.test_max_tokens, len(streams["test"]) - 1)
    probe_tokens = min(settings.eval_tokens, 4 * settings.seq_len, len(streams["valid"]) - 1)
    lm_nll(model, streams["valid"], settings.seq_len, settings.batch_size, device, autocast,
           max_tokens=settings.seq_len)  # warm-up: first-call costs (CUDA kernels, allocator) are not the rate
    t = time.perf_counter()
    probe = lm_nll(model, streams["valid"], settings.seq_len, settings.batch_size, device, autocast,
                   max_tokens=probe_tokens)
    rate = probe.tokens / max(1e-6, time.perf_counter() - t)
    reserve = 20.0 + 1.5 * test_labels / rate
    train_deadline = run_.train_deadline(reserve)
    if train_deadline is not None and train_deadline <= time.perf_counter():
        logger.warning("no time left for training under --time-budget-minutes %s: raise it (0 = no limit) or "
                       "lower --test-max-tokens", settings.time_budget_minutes)

    train_cfg = train_config(settings, autocast)
    trainer = Trainer(model, train_cfg, device, causal_lm_loss, eval_fn)
    with clock.phase("training"):
        result = trainer.fit(windows, deadline=train_deadline, step_cap=step_cap)
    steps_per_epoch = windows.steps_per_epoch
    epochs = result.steps / steps_per_epoch

    # ------------------------------------------------------------------ evaluation of the saved weights
    with clock.phase("evaluation"), torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # exactly the weights the checkpoint holds
        test = lm_nll(model, streams["test"], settings.seq_len, settings.batch_size, device, autocast,
                      max_tokens=settings.test_max_tokens)
        counts = unigram_counts(streams["train"], vocab_size)
        unigram = unigram_nll(counts, streams["test"], settings.test_max_tokens)
        assert unigram.tokens == test.tokens
    logger.info("held-out test: model perplexity %.3f (%.4f nats/token), unigram %.3f, on %d tokens",
                test.perplexity, test.mean, unigram.perplexity, test.tokens)

    with clock.phase("save"):
        save_checkpoint(model, out, eos_token_ids=[im_end_id, eos_id], pad_token_id=eos_id)
        tok_mod.save_tokenizer(tok, out, shape.max_position_embeddings)
    del model, trainer, windows

    with clock.phase("decode"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        hf_tok = AutoTokenizer.from_pretrained(out)
        expected, samples = _decode_cases(hf, hf_tok, settings, (eos_id, im_end_id))
        (out / "expected_greedy.json").write_text(json.dumps(expected, indent=1) + "\n")

    report = {
        **report_header(settings, command, result, run_),
        "corpus": {"python": corpus.python_version, "stdlib_dir": corpus.stdlib_dir, **corpus.stats,
                   "tokens": kind_tokens, "stream_tokens": {k: int(len(v)) for k, v in streams.items()}},
        "tokenizer": {"vocab_size": tok_vocab, "model_vocab_size": vocab_size,
                      "special_tokens": tok_mod.special_token_ids(),
                      "chars_per_token": round(n_chars / max(1, sum(kind_tokens.values())), 4)},
        "model": {"architecture": "Qwen3ForCausalLM", **asdict(shape), "vocab_size": vocab_size,
                  "parameters": n_params, "checkpoint_bytes": (out / "model.safetensors").stat().st_size},
        "training": training_report(result, tokens=result.tokens, epochs=round(epochs, 3),
                                    steps_per_epoch=steps_per_epoch, max_epochs_step_cap=step_cap,
                                    tokens_per_second=round(result.tokens / max(1e-9, result.seconds))),
        "evaluation": {"split": "test", "weights": "bfloat16 (as saved)",
                       "compute": "bf16 autocast" if autocast is not None else "float32",
                       "model": test.as_dict(), "unigram_add_one": unigram.as_dict(),
                       "perplexity_ratio_unigram_over_model": round(unigram.perplexity / test.perplexity, 3)},
        "samples": samples,
        "timings_seconds": run_.timings(),
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    logger.info("wrote %s in %.1fs", out, report["timings_seconds"]["total"])
    return report
