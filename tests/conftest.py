"""Fixtures: tiny random Hugging Face checkpoints of each supported family, with a real tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

VOCAB = 384
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# One small config per architecture, each exercising that family's switches.
ARCH_CONFIGS = {
    "LlamaForCausalLM": dict(
        model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
        attention_bias=False, tie_word_embeddings=False),
    "MistralForCausalLM": dict(model_type="mistral", sliding_window=24, tie_word_embeddings=False),
    "Qwen2ForCausalLM": dict(model_type="qwen2", tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(
        model_type="qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 128},
        attention_bias=True, tie_word_embeddings=False),
}
ARCHS = list(ARCH_CONFIGS)


def _corpus() -> str:
    import textwrap

    return Path(textwrap.__file__).read_text() * 2


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer trained on a stdlib module, with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_corpus()], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=specials[1:])
    fast.chat_template = CHATML
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(out)
    return out


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Large random weights (and non-trivial norms and biases), so that logits are far from ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def build_checkpoint(root: Path, arch: str, tokenizer_dir: Path | None, seed: int = 0, **overrides) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCH_CONFIGS[arch])
    model_type = spec.pop("model_type")
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=0, architectures=[arch])
    fields.update(spec)
    fields.update(overrides)
    cfg = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    out = root / f"{arch}-{seed}"
    model.save_pretrained(out)
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: build_checkpoint(root, arch, tokenizer_dir) for arch in ARCHS}


@pytest.fixture(scope="session")
def qwen3_dir(checkpoints) -> Path:
    return checkpoints["Qwen3ForCausalLM"]


def assert_pages_returned(llm) -> None:
    """Every KV page is back in the pool and nothing is left queued."""
    engine = llm.engine if hasattr(llm, "engine") else llm
    assert not engine.has_unfinished()
    assert engine.kv.num_free_pages == engine.kv.num_pages, (
        f"{engine.kv.num_pages - engine.kv.num_free_pages} KV pages leaked")
    assert all(c == 0 for c in engine.kv.pool.ref_cnt)


def hf_model(path: Path, dtype=torch.float32, device="cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids], device=device), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()
