"""Training: corpora, tokenizers, token packing, a general training loop, evaluation, checkpoints.

Atlas trains its own small default model with this package (see `tools/train_default_model.py`), and
the same pieces are meant for drafters of that model later (DFlash, MTP): the training loop takes any
module and any loss function, the data module hands out packed token windows, and `lm.py` builds and
saves Hugging Face Qwen3 checkpoints that load both in `transformers` and in Atlas.

Modules (none imports torch, transformers or tokenizers at package import time):

| module | owns |
|---|---|
| `corpus.py` | documents from the running Python's standard library (source, chat-formatted docstrings, pydoc topics) with a deterministic train/valid/test split by file |
| `tokenizer.py` | byte-level BPE training with `tokenizers`, the special tokens, the ChatML template, saving as a `PreTrainedTokenizerFast` |
| `data.py` | batch encoding, the packed token stream, training windows by epoch |
| `trainer.py` | the loop: AdamW, warmup + cosine, bf16 autocast on CUDA, clipping, time budget, periodic eval |
| `evaluate.py` | held-out perplexity, the unigram baseline, greedy decoding |
| `lm.py` | Qwen3 causal-LM construction, its loss, bf16 checkpoint saving |
| `default_model.py` | the whole recipe of the shipped default model |
"""
