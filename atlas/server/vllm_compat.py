"""`vllm serve` command lines on `atlas serve`: the flags Atlas takes under vLLM's names, the ones it refuses
with a reason (never accepted and ignored), --speculative-config translated, and --config FILE.yaml.

The README's "Coming from vLLM" table lists the same flags.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from atlas.config import json_object
from atlas.errors import ConfigError
from atlas.vllm_config import optimization_level_fields, speculative_fields, structured_outputs_fields

# vLLM flags (with their short forms) that Atlas does not implement, and why / what to use instead.
REFUSED: dict[tuple[str, ...], str] = {
    ("--max-cpu-loras", "--fully-sharded-loras", "--lora-dtype"): "adapters stay resident in their --max-loras "
                                                                   "device slots, in the model dtype",
    ("--swap-space", "--cpu-offload-gb"): "Atlas keeps the KV cache and weights on the device (preempted "
                                          "sequences are recomputed)",
    ("--enable-ssl-refresh",): "certificates are read at start-up: restart the server to load new ones",
    ("--middleware",): "Atlas loads no code from the command line: put a reverse proxy in front for other checks",
    ("--limit-mm-per-prompt", "--mm-processor-kwargs"): "multimodal inputs are not supported",
    ("--distributed-executor-backend", "--worker-cls"): "Atlas starts its own worker processes (--tensor-parallel-size, "
                                                        "--pipeline-parallel-size, --nnodes)",
    ("--compilation-config",): "Atlas captures CUDA graphs itself (--enforce-eager turns them off; vLLM's -O0 is "
                               "taken as that)",
    ("--kv-transfer-config", "--enable-sleep-mode"): "not supported",
    ("--tool-parser-plugin",): "the tool-call parsers are built in (--tool-call-parser)",
    ("--max-seq-len-to-capture", "--disable-custom-all-reduce", "--cuda-graph-sizes"): "Atlas sizes its CUDA graphs "
                                                                                     "itself (--enforce-eager: none)",
    ("--no-enable-chunked-prefill",): "Atlas always splits long prompts into chunks (--max-num-batched-tokens sets "
                                      "their size)",
    ("--max-num-partial-prefills", "--max-long-partial-prefills",
     "--max-parallel-loading-workers", "--prefix-caching-hash-algo"): "not configurable in Atlas",
    ("--enable-reasoning",): "vLLM's older flag: --reasoning-parser NAME alone turns reasoning output on",
    ("--disable-uvicorn-access-log",): "Atlas's form is --no-access-log",
    ("--disable-frontend-multiprocessing",): "the HTTP front ends always run in processes of their own "
                                             "(--api-server-count)",
    ("--code-revision", "--model-impl"): "Atlas runs its own implementation of each architecture, no checkpoint code",
    ("--config-format", "--load-format-config"): "Atlas reads the checkpoint's config.json",
    ("--pooler-config", "--override-pooler-config"): "pooling follows the checkpoint's sentence-transformers files "
                                                     "(1_Pooling, modules.json)",
    ("--logits-processors", "--calculate-kv-scales", "--kv-events-config", "--log-error-stack", "--tool-server",
     "--expand-tools-even-if-tool-choice-none"): "not supported",
    ("--allowed-local-media-path", "--media-io-kwargs"): "multimodal inputs are not supported",
    ("--headless",): "another node's ranks run as atlas serve --nnodes N --node-rank R (with --master-addr)",
    ("--disable-sliding-window",): "Atlas runs sliding-window layers as the checkpoint defines them (cap the context "
                                   "with --max-model-len instead)",
    ("--enable-eplb", "--eplb-config", "--num-redundant-experts"): "expert-parallel load balancing is not "
                                                                   "implemented",
    ("--otlp-traces-endpoint", "--collect-detailed-traces"): "OpenTelemetry tracing is not implemented (/metrics "
                                                             "has Prometheus metrics)",
    ("--safetensors-load-strategy", "--model-loader-extra-config", "--ignore-patterns"): "Atlas reads the "
                                                                                        "checkpoint's safetensors "
                                                                                        "itself",
    ("--kv-sharing-fast-prefill",): "not supported",
    ("--data-parallel-size-local", "--data-parallel-address", "--data-parallel-rpc-port"): "data parallelism runs on "
                                                                                          "one node (-dp N)",
    ("--tokenizer-pool-size",): "tokenization runs in the front ends' pools (--api-server-count)",
    ("--mm-encoder-tp-mode",): "multimodal inputs are not supported",
    ("--all2all-backend", "--enable-dbo", "--dbo-decode-token-threshold", "--dbo-prefill-token-threshold"):
        "Atlas's expert parallelism (--enable-expert-parallel) sums the experts' outputs with one all-reduce, no "
        "all-to-all to choose a backend for; dual-batch overlap is not implemented",
    ("--kv-offloading-size", "--kv-offloading-backend"): "Atlas keeps the KV cache on the device (preempted "
                                                         "sequences are recomputed)",
    ("--data-parallel-backend",): "data-parallel replicas run as Atlas's own processes on one node (-dp N)",
    ("--stream-interval",): "streams send new tokens as soon as the front end reads them (each engine step's, or "
                            "several steps' at once for a client that falls behind); there is no interval to set",
    ("--log-config-file",): "Atlas configures its own logging (--uvicorn-log-level sets the level)",
    ("--h11-max-incomplete-event-size", "--h11-max-header-count"): "Atlas bounds requests with its own limits "
                                                                   "(--header-timeout, --max-request-body-bytes)",
}


class _Refuse(argparse.Action):
    def __init__(self, option_strings, dest, reason: str = "", **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is a vLLM flag that Atlas does not implement: {self.reason}")


def _json_object(parser: argparse.ArgumentParser, text: str, flag: str) -> dict[str, Any]:
    try:
        return json_object(text, flag)
    except ConfigError as exc:
        parser.error(str(exc))


class _ConfigOverride(argparse.Action):
    """vLLM's --rope-scaling JSON and --rope-theta X: the same as --hf-overrides with that one key."""

    def __call__(self, parser, namespace, values, option_string=None):
        key = self.dest
        if key == "rope_scaling":
            value = _json_object(parser, values, "--rope-scaling")
        else:
            try:
                value = float(values)
            except ValueError:
                parser.error(f"--rope-theta: a number, not {values!r}")
        namespace.hf_overrides = {**(getattr(namespace, "hf_overrides", None) or {}), key: value}


class _TranslatedConfig(argparse.Action):
    """A vLLM setting given as JSON (or a level), as the engine fields it means (atlas/vllm_config.py); what Atlas
    has no counterpart for is a parser error naming it."""

    def __init__(self, option_strings, dest, translate=None, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)
        self.translate = translate

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            fields = self.translate(values, option_string)
        except ConfigError as exc:
            parser.error(str(exc))
        for name, value in fields.items():
            setattr(namespace, name, value)


def _structured_outputs(values: str, flag: str) -> dict[str, Any]:
    from atlas.server.output_parsers import REASONING_PARSERS  # (standard library only)

    return structured_outputs_fields(values, REASONING_PARSERS, flag)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's names for what Atlas does, and the refusals, on `atlas serve`."""
    g = parser.add_argument_group("vLLM compatibility")
    g.add_argument("--disable-cascade-attn", action="store_true",
                   help="Accepted: Atlas has no cascade attention to turn off.")
    g.add_argument("--preemption-mode", choices=("recompute",), default=None,
                   help="Accepted as recompute, what Atlas does with a preempted sequence (swap is not "
                        "implemented).")
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="Accepted: GET /tokenizer_info is always served (behind --api-key when one is set).")
    g.add_argument("--enable-chunked-prefill", action="store_true",
                   help="Accepted: Atlas always splits long prompts into chunks within --max-num-batched-tokens.")
    g.add_argument("--rope-scaling", action=_ConfigOverride, dest="rope_scaling", default=argparse.SUPPRESS,
                   metavar="JSON", help="vLLM's older flag: the same as --hf-overrides '{\"rope_scaling\": JSON}'.")
    g.add_argument("--rope-theta", action=_ConfigOverride, dest="rope_theta", default=argparse.SUPPRESS,
                   metavar="THETA", help="vLLM's older flag: the same as --hf-overrides '{\"rope_theta\": THETA}'.")
    g.add_argument("--speculative-config", action=_TranslatedConfig, translate=speculative_fields, metavar="JSON",
                   help='vLLM\'s form of the speculation flags: {"method": "ngram" | "dflash" | "mtp" | "draft_model" '
                        '| "eagle3", "num_speculative_tokens": K, "model": PATH, "prompt_lookup_min": N, '
                        '"prompt_lookup_max": N, "max_model_len": N}.')
    g.add_argument("--structured-outputs-config", action=_TranslatedConfig, translate=_structured_outputs,
                   metavar="JSON",
                   help='vLLM\'s form of the structured-outputs flags: {"backend": "auto" | "xgrammar" | "guidance" | '
                        '"llguidance", "reasoning_parser": NAME}.')
    g.add_argument("-O", "--optimization-level", action=_TranslatedConfig, translate=optimization_level_fields,
                   metavar="LEVEL",
                   help="vLLM's optimization level: 0 is the same as --enforce-eager; 1, 2 and 3 are Atlas's default "
                        "(its own kernels and CUDA graphs; no compiler step at start-up).")
    g.add_argument("--config", metavar="FILE.yaml",
                   help="Flags from a YAML file (keys are flag names: port: 8000, tensor-parallel-size: 2); flags on "
                        "the command line win.")
    for names, reason in REFUSED.items():
        g.add_argument(*names, action=_Refuse, reason=reason)


def expand_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with `--config FILE.yaml` replaced by the flags it holds, put first so that the command line wins."""
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    rest, path = [], None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a file")
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return _flags_from_yaml(parser, Path(path)) + rest


def _flags_from_yaml(parser: argparse.ArgumentParser, path: Path) -> list[str]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML ({exc})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: a mapping of flag names to values, e.g. 'port: 8000'")
    known = {s for action in parser._actions for s in action.option_strings}
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in known:
            raise ConfigError(f"--config {path}: {key!r} is not a flag of this command")
        flags += _tokens(flag, value, known, path)
    return flags


def _tokens(flag: str, value: Any, known: set[str], path: Path) -> list[str]:
    if isinstance(value, bool):
        if value:
            return [flag]
        negative = "--no-" + flag[2:]
        if negative not in known:
            raise ConfigError(f"--config {path}: {flag[2:]}: false is the default here; leave it out")
        return [negative]
    if isinstance(value, (list, tuple)):
        return [flag, *(str(v) for v in value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]
