"""Configuration in one place: every engine setting is a field of EngineConfig (tuning knobs in
EngineConfig.tuning), nothing in atlas/ reads an ATLAS_* environment variable but ATLAS_API_KEY (which
mirrors `atlas serve --api-key`), and a knob set on the config reaches the component it configures."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from atlas import LLM, SamplingParams
from atlas.config import EngineConfig, TuningConfig
from atlas.errors import ConfigError
from atlas.kernels import settings

ATLAS = Path(__file__).resolve().parents[1] / "atlas"
ALLOWED = {"ATLAS_API_KEY"}
_ENV = re.compile(r"\b(environ|getenv)\b")
# A line that reads the environment by an ATLAS_ name (the AST scan below catches it across lines too).
_LINE = re.compile(r"""(\b(environ|getenv)\b.*["']ATLAS_\w+|["']ATLAS_\w+["']\s+(not\s+)?in\s+\w*\.?environ)""")


def _environment_reads(path: Path, root: Path = ATLAS.parent) -> list[str]:
    """`file:line: ATLAS_NAME` for each environment read (os.environ[...] / .get / .pop / os.getenv / `in
    os.environ`) of an ATLAS_ name other than the allowed ones in this Python file (named from root)."""
    source = path.read_text()
    where = path.relative_to(root)
    found = set()
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("ATLAS_"):
            name = node.value
        elif (isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant)
              and str(node.values[0].value).startswith("ATLAS_")):
            name = ast.unparse(node)
        parent = parents.get(node)
        if name is None or name in ALLOWED or isinstance(parent, ast.JoinedStr):
            continue
        if parent is not None and _ENV.search(ast.unparse(parent)):
            found.add(f"{where}:{node.lineno}: {name}")
    for i, line in enumerate(source.splitlines(), 1):
        for match in _LINE.finditer(line):
            names = set(re.findall(r"ATLAS_\w+", match.group(0))) - ALLOWED
            found.update(f"{where}:{i}: {n}" for n in names)
    return sorted(found)


def test_nothing_in_atlas_reads_an_atlas_environment_variable():
    """Every setting is a field of EngineConfig (a tuning knob or a flag): a kernel or layer gets it handed down
    at start-up, never from the environment. ATLAS_API_KEY is the one variable, as vLLM's VLLM_API_KEY."""
    reads = [hit for path in sorted(ATLAS.rglob("*.py")) for hit in _environment_reads(path)]
    assert reads == [], "ATLAS_ environment reads left (make them EngineConfig fields):\n" + "\n".join(reads)


def test_the_scan_finds_every_form_of_read(tmp_path):
    code = tmp_path / "probe.py"
    code.write_text('import os\n"""ATLAS_DOCS only."""\na = os.environ.get("ATLAS_A", "1")\nb = os.environ["ATLAS_B"]\n'
                    'c = os.getenv(\n    "ATLAS_C")\nd = "ATLAS_D" in os.environ\nkey = os.environ.get("ATLAS_API_KEY")\n'
                    'e = os.environ.pop(f"ATLAS_{a}")\n')
    assert _environment_reads(code, tmp_path) == ["probe.py:3: ATLAS_A", "probe.py:4: ATLAS_B", "probe.py:6: ATLAS_C",
                                        "probe.py:7: ATLAS_D", "probe.py:9: f'ATLAS_{a}'"]


def test_defaults_are_the_former_environment_defaults():
    """The defaults of the fields that replaced the ATLAS_* variables are those variables' defaults (so
    outputs and speed do not change)."""
    assert EngineConfig().split_kv is True
    assert TuningConfig() == TuningConfig(
        gemv="default", kv_block_n=0, kv_stages=3, mla_kv_stages=2, pdl=True, pdl_trigger="first",
        moe_triton_max_tokens=64, mask_kernel=True, mixed_graphs=True, pp_graphs=True, static_steps=False,
        tp_all_reduce="peer", mtp_catch_up_graphs=True, device_drafts=True, draft_after_verify=True,
        prelaunch_verify=False)
    assert settings.tuning == TuningConfig() and settings.split_kv  # (kernels run without an engine: tools, tests)


def test_tuning_knobs_from_text_json_a_dict_and_the_command_line():
    knobs = TuningConfig.parse("gemv=AUTO, device-drafts=0,kv_stages=2")
    assert (knobs.gemv, knobs.device_drafts, knobs.kv_stages) == ("auto", False, 2)
    assert knobs.changes() == {"gemv": "auto", "kv_stages": 2, "device_drafts": False}
    assert TuningConfig.parse(str(knobs)) == knobs and str(TuningConfig()) == ""  # (bench serve's flags)
    assert TuningConfig.parse('{"gemv": 0, "pdl": false}') == TuningConfig(gemv="0", pdl=False)
    assert EngineConfig(tuning={"prelaunch_verify": 1}).tuning == TuningConfig(prelaunch_verify=True)
    assert EngineConfig.from_kwargs(tuning="mixed_graphs=off").tuning.mixed_graphs is False
    for bad, words in (("bogus=1", "unknown tuning knob 'bogus'"), ("kv_block_n=24", "power of two from 16"),
                       ("kv_stages=0", "at least 1"), ("moe_triton_max_tokens=-1", ">= 0"),
                       ("mask_kernel=maybe", "must be a boolean"), ("kv_stages", "is not KEY=VALUE"),
                       ("{", "not a valid JSON object")):
        with pytest.raises(ConfigError, match=re.escape(words)):
            EngineConfig(tuning=bad)
    with pytest.raises(ConfigError, match="tuning must be a TuningConfig"):
        EngineConfig(tuning=3)

    from atlas.cli import build_parser, parse_args

    parser = build_parser()
    args = parse_args(parser, ["generate", "--tuning", "gemv=0,kv_stages=1", "--tuning", '{"kv_stages": 2}',
                               "--no-split-kv"])
    config = EngineConfig.from_cli_args(args)
    assert config.tuning == TuningConfig(gemv="0", kv_stages=2) and config.split_kv is False
    defaults = EngineConfig.from_cli_args(parse_args(parser, ["generate"]))
    assert defaults.tuning == TuningConfig() and defaults.split_kv is True


def test_tuning_from_a_serve_config_file(tmp_path):
    pytest.importorskip("yaml")
    from atlas.cli import build_parser, parse_args

    path = tmp_path / "serve.yaml"
    path.write_text("tuning: {gemv: auto, mixed_graphs: false}\nsplit-kv: false\n")
    config = EngineConfig.from_cli_args(parse_args(build_parser(), ["serve", "--config", str(path)]))
    assert config.tuning == TuningConfig(gemv="auto", mixed_graphs=False) and not config.split_kv


def test_non_default_knobs_reach_the_components_they_configure(qwen3_dir):
    """An engine started with non-default knobs: the kernels' settings are its (the attention kernels' tiles
    and stages, split-KV, PDL, the MoE path, the mask kernel), its runner runs uniform steps through the static
    buffers (static_steps) and mixed steps eagerly (mixed_graphs off), and the tokens are unchanged."""
    from atlas.kernels.paged_attention import split_kv_enabled

    knobs = TuningConfig(kv_stages=1, kv_block_n=32, mla_kv_stages=1, pdl=False, pdl_trigger="after-wait",
                         moe_triton_max_tokens=0, mask_kernel=False, static_steps=True, mixed_graphs=False)
    common = dict(kv_cache_memory="8MiB", skip_tokenizer_init=True, max_num_seqs=4, max_model_len=128)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 17)]
    greedy = SamplingParams(max_tokens=6, temperature=0)
    plain = [o.outputs[0].token_ids for o in LLM(str(qwen3_dir), **common).generate(prompts, greedy)]
    assert settings.tuning == TuningConfig() and split_kv_enabled()
    llm = LLM(str(qwen3_dir), tuning=knobs, split_kv=False, **common)
    assert settings.tuning == knobs and not split_kv_enabled()
    runner = llm.engine.runner
    assert runner.mixed_graph_tokens == 0 and runner.mixed_graphs is None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == plain
    assert runner.step_graphs[1].steps_run > 0  # (decode steps through the static buffers)
    triton = pytest.importorskip("triton")  # noqa: F841
    import torch

    from atlas.kernels.paged_attention_triton import kv_block_n, kv_stages

    assert kv_stages(16, torch.bfloat16) == 1 and kv_block_n(16, 16, torch.bfloat16) == 32
