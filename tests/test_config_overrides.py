"""vLLM's --hf-overrides (and its older --rope-scaling / --rope-theta) and --override-generation-config: a change to
config.json given on the command line must act exactly as the same change written into the file, never be read and
then ignored."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import build_checkpoint, hf_greedy, hf_model

from atlas import LLM, SamplingParams
from atlas.cli import build_parser, parse_args
from atlas.config import EngineConfig, ModelConfig, override_config
from atlas.errors import ConfigError

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
ENGINE = dict(kv_cache_memory="8MiB", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def short_context(tmp_path_factory, tokenizer_dir):
    """A Llama checkpoint trained (by its config) on 128 positions, with no RoPE scaling; transformers 5 writes its
    rope as rope_parameters {rope_type: default, rope_theta}, which the reader prefers over rope_scaling."""
    return build_checkpoint(tmp_path_factory.mktemp("ctx"), "LlamaForCausalLM", tokenizer_dir, seed=3,
                            max_position_embeddings=128, rope_scaling=None)


def test_yarn_from_the_command_line_equals_yarn_in_the_config_and_extends_the_context(short_context, tmp_path):
    raw = json.loads((short_context / "config.json").read_text())
    assert raw["rope_parameters"]["rope_type"] == "default" and raw["max_position_embeddings"] == 128
    # The oracle: the same checkpoint with YaRN written into its config.json, as transformers 5 reads it.
    edited = tmp_path / "yarn"
    shutil.copytree(short_context, edited)
    (edited / "config.json").write_text(json.dumps(
        {**raw, "rope_parameters": {**YARN, "rope_theta": raw["rope_parameters"]["rope_theta"]}}))
    prompt = [int(t) for t in torch.randint(1, 300, (170,), generator=torch.Generator().manual_seed(0))]
    want = hf_greedy(hf_model(edited), prompt, 12)

    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings 128.*scale its RoPE"):
        LLM(str(short_context), max_model_len=256, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
    llm = LLM(str(short_context), max_model_len=256, hf_overrides={"rope_scaling": YARN}, **ENGINE)
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want  # 170 + 12 tokens: past the 128 positions of the config
    assert llm.engine.max_model_len == 256
    with pytest.raises(ConfigError, match="exceeds the model's context with its scaled RoPE 512"):
        LLM(str(short_context), max_model_len=600, hf_overrides={"rope_scaling": YARN}, **ENGINE)
    del llm
    # With no --max-model-len the context is the scaled one (original x factor), as vLLM derives it.
    llm = LLM(str(short_context), hf_overrides={"rope_scaling": YARN}, **ENGINE)
    assert llm.engine.max_model_len == 512
    # ... and the override is what changed the numbers: the unscaled model, inside its 128 positions, differs.
    short = prompt[:100]
    scaled = llm.generate([{"prompt_token_ids": short}], params, use_tqdm=False)[0].outputs[0]
    del llm
    plain = LLM(str(short_context), **ENGINE).generate([{"prompt_token_ids": short}], params, use_tqdm=False)
    assert scaled.token_ids == hf_greedy(hf_model(edited), short, 12)
    assert scaled.cumulative_logprob != plain[0].outputs[0].cumulative_logprob


def test_overrides_replace_keys_reach_nested_configs_and_keep_rope_parameters_in_step(tmp_path):
    raw = {"hidden_size": 64, "rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                       "partial_rotary_factor": 0.5},
           "text_config": {"num_hidden_layers": 4, "rope_scaling": None, "vocab_size": 10}}
    out = override_config(raw, {"hidden_size": 32, "rope_scaling": YARN, "text_config": {"num_hidden_layers": 2}})
    assert out["hidden_size"] == 32 and out["text_config"] == {"num_hidden_layers": 2, "rope_scaling": None,
                                                               "vocab_size": 10}
    # rope_parameters (which the reader prefers) takes the new scaling and keeps the base keys
    assert out["rope_parameters"] == {"rope_theta": 1e4, "partial_rotary_factor": 0.5, **YARN}
    assert raw["rope_parameters"]["rope_type"] == "default"  # (the file's dict is not changed)
    assert override_config(raw, {"rope_theta": 5e5})["rope_parameters"]["rope_theta"] == 5e5
    # rope_scaling null turns a file's scaling off; rope_parameters given whole is taken as it is
    off = override_config({"rope_parameters": {**YARN, "rope_theta": 1.0}}, {"rope_scaling": None})
    assert off["rope_parameters"] == {"rope_theta": 1.0, "rope_type": "default"}
    # rope_parameters keyed by layer type (Gemma 3 / 4): the global layers' entry changes
    by_layer = {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    got = override_config(by_layer, {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 2e6})
    assert got["rope_parameters"] == {"full_attention": {"rope_theta": 2e6, "rope_type": "linear", "factor": 8.0},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    whole = {"rope_type": "linear", "factor": 2.0, "rope_theta": 3.0}
    assert override_config(raw, {"rope_scaling": YARN, "rope_parameters": whole})["rope_parameters"] == whole
    cfg = ModelConfig.from_dict(override_config({**raw, "architectures": ["Qwen3ForCausalLM"], "vocab_size": 10,
                                                 "num_hidden_layers": 1, "num_attention_heads": 4,
                                                 "intermediate_size": 8, "max_position_embeddings": 128},
                                                {"rope_scaling": YARN}), tmp_path)
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.context_limit) == ("yarn", 1e4, 512)


def test_the_flags_parse_merge_and_refuse_bad_json(capsys):
    args = parse_args(build_parser(), ["serve", "--rope-scaling", json.dumps(YARN), "--hf-overrides",
                                       '{"num_hidden_layers": 2}', "--rope-theta", "1e6",
                                       "--override-generation-config", '{"temperature": 0.5}'])
    config = EngineConfig.from_cli_args(args)
    assert config.hf_overrides == {"rope_scaling": YARN, "num_hidden_layers": 2, "rope_theta": 1e6}
    assert config.override_generation_config == {"temperature": 0.5}
    for argv, words in ((["serve", "--hf-overrides", "{bad"], "--hf-overrides: not JSON"),
                        (["serve", "--hf-overrides", "[1]"], "--hf-overrides: a JSON object"),
                        (["serve", "--rope-scaling", "4"], "--rope-scaling: a JSON object"),
                        (["serve", "--rope-theta", "big"], "--rope-theta: a number")):
        with pytest.raises(SystemExit):
            parse_args(build_parser(), argv)
        assert words in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--override-generation-config: a JSON object"):
        EngineConfig(override_generation_config="0.5")


def test_override_generation_config_sets_the_sampling_defaults(qwen3_dir, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(qwen3_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    llm = LLM(str(model), max_model_len=128, kv_cache_memory="4MiB",
              override_generation_config={"temperature": 0.3, "max_new_tokens": 7})
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.max_tokens) == (0.3, 0.95, 20, 7)
    del llm
    # with --generation-config vllm: the overrides alone
    d = LLM(str(model), max_model_len=128, kv_cache_memory="4MiB", generation_config="vllm",
            override_generation_config={"top_k": 5}).get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k) == (1.0, 1.0, 5)
    for bad, words in (({"do_sample": True}, "'do_sample' is not a sampling default"),
                       ({"top_k": 2.5}, "top_k must be a number \\(an integer\\)"),
                       ({"temperature": "hot"}, "temperature must be a number")):
        with pytest.raises(ConfigError, match=words):
            LLM(str(model), max_model_len=128, kv_cache_memory="4MiB", override_generation_config=bad)
