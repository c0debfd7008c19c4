"""Image-text checkpoints whose language model Atlas has (Qwen2-VL / Qwen2.5-VL, Qwen3-VL dense and MoE, Mistral 3
and Ministral 3, whose query temperature grows with the position):
served on text,
the vision tower's tensors not loaded. Tiny random checkpoints as transformers saves them: prefill logits and greedy
tokens equal the image-text model's own on text-only input (float32), also from the older Qwen2.5-VL layout (a
top-level config with rope_scaling type mrope, the language model under model.)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import VOCAB, _randomize

from atlas import LLM, SamplingParams
from atlas.errors import UnsupportedModelError

ENGINE = dict(device="cpu", dtype="float32", kv_cache_memory="8MiB", max_model_len=256, skip_tokenizer_init=True)
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None,
            eos_token_id=0, pad_token_id=0)
PROMPTS = [[5, 9, 13, 2, 7, 11, 40], [300, 12, 4, 8, 8, 23, 150, 6, 31, 77, 19]]


def _build(tmp_path, kind: str):
    import transformers as tf

    if kind == "qwen2_5_vl":
        cfg = tf.Qwen2_5_VLConfig(text_config={**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                           "mrope_section": [2, 3, 3]}},
                                  vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                     out_hidden_size=64))
        cls = tf.Qwen2_5_VLForConditionalGeneration
    elif kind == "qwen3_vl":
        cfg = tf.Qwen3VLConfig(text_config={**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                        "mrope_section": [2, 3, 3],
                                                                        "mrope_interleaved": True}},
                               vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                  out_hidden_size=64, deepstack_visual_indexes=[0]))
        cls = tf.Qwen3VLForConditionalGeneration
    elif kind == "qwen3_vl_moe":
        cfg = tf.Qwen3VLMoeConfig(text_config={**TEXT, "num_experts": 4, "num_experts_per_tok": 2,
                                               "moe_intermediate_size": 48, "decoder_sparse_step": 1,
                                               "norm_topk_prob": True,
                                               "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                   "mrope_section": [2, 3, 3],
                                                                   "mrope_interleaved": True}},
                                  vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                     out_hidden_size=64, deepstack_visual_indexes=[0]))
        cls = tf.Qwen3VLMoeForConditionalGeneration
    elif kind == "ministral3":
        # Ministral 3: YaRN with its query temperature, original_max_position_embeddings 4 so that it grows within
        # the prompts (the released models' is 16,384)
        rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 4,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.5}
        cfg = tf.Mistral3Config(text_config={**TEXT, "model_type": "ministral3", "rope_parameters": rope},
                                vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=1, num_attention_heads=2, head_dim=16))
        cls = tf.Mistral3ForConditionalGeneration
    else:
        cfg = tf.Mistral3Config(text_config={**TEXT, "model_type": "mistral"},
                                vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=1, num_attention_heads=2, head_dim=16))
        cls = tf.Mistral3ForConditionalGeneration
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    model = cls(cfg).eval()
    _randomize(model, 0)
    out = tmp_path / kind
    model.save_pretrained(out)
    return out, model


def _reference(model, prompt: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0]
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return logits, ids[len(prompt):]


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "mistral3", "ministral3"])
def test_the_language_model_of_an_image_text_checkpoint_serves_text(tmp_path, kind):
    path, model = _build(tmp_path, kind)
    llm = LLM(str(path), **ENGINE)
    assert not any("visual" in n or "vision" in n for n, _ in llm.engine.runner.model.named_parameters())
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0)
    for prompt, out in zip(PROMPTS, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params), strict=True):
        logits, tokens = _reference(model, prompt, 6)
        assert out.outputs[0].token_ids == tokens
        want = torch.log_softmax(logits.double(), -1)
        got = [next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]]
        assert got == pytest.approx([float(want[i, t]) for i, t in enumerate(prompt[1:])], abs=1e-4)


def test_the_older_qwen2_5_vl_layout_loads_the_same(tmp_path):
    """Hub checkpoints saved before transformers 5: the language model's fields at the top level with rope_scaling
    {type: mrope}, its tensors under model. and the vision tower under visual."""
    from safetensors.torch import load_file, save_file

    path, model = _build(tmp_path, "qwen2_5_vl")
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    old = {**cfg, **text, "model_type": "qwen2_5_vl", "rope_theta": rope["rope_theta"],
           "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    (path / "config.json").write_text(json.dumps(old))
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {name.replace("model.language_model.", "model.").replace("model.visual.", "visual."): t
               for name, t in tensors.items()}
    save_file(renamed, str(path / "model.safetensors"))
    out = LLM(str(path), **ENGINE).generate({"prompt_token_ids": PROMPTS[0]},
                                            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == _reference(model, PROMPTS[0], 6)[1]


def test_qwen3_vl_moe_experts_load_in_either_orientation(tmp_path):
    """Qwen3-VL-MoE's fused experts as transformers 4 saved them ([E, H, 2I] gate|up, [E, I, H] down: the transposes of
    what transformers 5 holds) give the same tokens; a shape neither orientation fits is refused."""
    from safetensors.torch import load_file, save_file

    from atlas.errors import ModelLoadError

    path, model = _build(tmp_path, "qwen3_vl_moe")
    tensors = load_file(str(path / "model.safetensors"))
    fused = [n for n in tensors if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]
    assert fused  # (the checkpoint holds its experts fused)
    save_file({n: t.transpose(1, 2).contiguous() if n in fused else t for n, t in tensors.items()},
              str(path / "model.safetensors"))
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    out = LLM(str(path), **ENGINE).generate({"prompt_token_ids": PROMPTS[1]}, greedy)[0]
    assert out.outputs[0].token_ids == _reference(model, PROMPTS[1], 6)[1]
    save_file({n: t[:, :-1].contiguous() if n == fused[0] else t for n, t in tensors.items()},
              str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="orientation"):
        LLM(str(path), **ENGINE)



def test_the_query_temperature_key_on_another_model_type_is_refused(tmp_path):
    """llama_4_scaling_beta outside a ministral3 text model: transformers ignores it there and vLLM applies it."""
    path, _ = _build(tmp_path, "ministral3")
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["model_type"] = "mistral"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="llama_4_scaling_beta"):
        LLM(str(path), **ENGINE)
