"""Hub ids resolve through huggingface_hub: its cache and offline mode are honoured."""

from __future__ import annotations

import shutil

import pytest

from atlas import LLM, SamplingParams
from atlas.errors import ModelLoadError
from atlas.models.loader import resolve_model_path


def _fake_hub_cache(cache, repo_id: str, src) -> None:
    """Lay out a hub cache entry exactly as huggingface_hub writes one."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_hub_id_served_from_cache_offline(qwen3_dir, tmp_path, monkeypatch):
    _fake_hub_cache(tmp_path, "atlas-test/tiny-qwen3", qwen3_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    path = resolve_model_path("atlas-test/tiny-qwen3")
    assert (path / "config.json").is_file()
    llm = LLM("atlas-test/tiny-qwen3", kv_cache_memory="8MiB")
    assert len(llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3


def test_unknown_hub_id_offline_is_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="could not get model 'nobody/nothing' from the Hugging Face hub"):
        resolve_model_path("nobody/nothing")


def test_dummy_weights_need_no_weight_files_from_the_hub(qwen3_dir, tmp_path, monkeypatch):
    """--load-format dummy asks the hub for the config and tokenizer files only: a cache entry without the
    .safetensors serves it offline."""
    src = tmp_path / "src"
    shutil.copytree(qwen3_dir, src, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    cache = tmp_path / "cache"
    _fake_hub_cache(cache, "atlas-test/config-only", src)
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    llm = LLM("atlas-test/config-only", load_format="dummy", kv_cache_memory="8MiB")
    assert len(llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3
    with pytest.raises(ModelLoadError, match="--load-format dummy"):
        LLM("atlas-test/config-only", kv_cache_memory="8MiB")


def test_a_quantized_hub_model_is_refused_before_its_weights_are_fetched(qwen3_dir, tmp_path, monkeypatch):
    """The hub's config.json comes first: a quantized checkpoint is refused, naming its method, without asking
    the hub for a single weight file."""
    import json

    import huggingface_hub
    import huggingface_hub.constants as c

    from atlas.errors import UnsupportedModelError

    src = tmp_path / "src"
    shutil.copytree(qwen3_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    # (static activation scales: a layout Atlas does not load; block-scaled FP8 with dynamic ones it does)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}
    (src / "config.json").write_text(json.dumps(cfg))
    cache = tmp_path / "cache"
    _fake_hub_cache(cache, "atlas-test/tiny-qwen3-fp8", src)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    asked = []
    real = huggingface_hub.snapshot_download

    def recording(*args, **kwargs):
        asked.append(kwargs.get("allow_patterns"))
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    with pytest.raises(UnsupportedModelError, match="fp8"):
        LLM("atlas-test/tiny-qwen3-fp8", kv_cache_memory="8MiB")
    assert asked == [["*.json"]]


def test_download_dir_is_the_hub_cache_for_the_model_and_the_tokenizer(qwen3_dir, tmp_path, monkeypatch):
    """--download-dir: hub ids are looked up (offline: only) in that folder's hub cache, not the default one; the
    tokenizer's own hub id at --tokenizer-revision too; --hf-token goes with every fetch and into no repr."""
    import huggingface_hub
    import huggingface_hub.constants as c

    from atlas.config import EngineConfig, HubAccess

    tokens = []
    real = huggingface_hub.snapshot_download

    def recording(*args, **kwargs):
        tokens.append(kwargs.get("token"))
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    assert "hf_secret" not in repr(EngineConfig(hf_token="hf_secret")) and "hf_secret" not in repr(
        EngineConfig(hf_token="hf_secret").hub)

    default, mine = tmp_path / "default-cache", tmp_path / "mine"
    default.mkdir()
    _fake_hub_cache(mine, "atlas-test/tiny-qwen3", qwen3_dir)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(default))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="could not get model 'atlas-test/tiny-qwen3'"):
        resolve_model_path("atlas-test/tiny-qwen3")
    with pytest.raises(ModelLoadError, match=f"in the hub cache, {mine}"):
        resolve_model_path("atlas-test/absent", hub=HubAccess(str(mine)))
    tokens.clear()
    llm = LLM("atlas-test/tiny-qwen3", download_dir=str(mine), tokenizer="atlas-test/tiny-qwen3",
              tokenizer_revision="0123456789abcdef0123456789abcdef01234567", kv_cache_memory="8MiB",
              hf_token="hf_secret")
    assert llm.engine.model_path.is_relative_to(mine)
    assert len(tokens) >= 2 and set(tokens) == {"hf_secret"}  # (every fetch: the model's, the tokenizer's)
    assert len(llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3
    with pytest.raises(ModelLoadError, match="could not get model 'atlas-test/tiny-qwen3'"):  # (a revision not cached)
        LLM("atlas-test/tiny-qwen3", download_dir=str(mine), tokenizer="atlas-test/tiny-qwen3",
            tokenizer_revision="v9", kv_cache_memory="8MiB")
