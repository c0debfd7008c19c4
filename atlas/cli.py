"""The `atlas` command: generate, chat, serve, bench. Thin: it builds configs and calls the engine."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import atlas
from atlas.config import EngineConfig
from atlas.errors import AtlasError, ConfigError, InvalidRequestError, WorkerError
from atlas.sampling_params import SamplingParams, resolve_max_tokens

logger = logging.getLogger("atlas")


LOG_LEVELS = ("debug", "info", "warning", "error")
# Tokens per reply when --max-tokens is not given (capped at what the context leaves).
GENERATE_DEFAULT_MAX_TOKENS = 128
CHAT_DEFAULT_MAX_TOKENS = 256


def add_sampling_args(parser: argparse.ArgumentParser, default_max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"Most tokens to generate per reply (default {default_max_tokens}, capped at what the context "
                        "leaves). A value that does not fit with the prompt in --max-model-len is refused, as the "
                        "server refuses it.")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--sampling-seed", type=int, default=None, help="Per-request seed for reproducible sampling.")
    parser.set_defaults(default_max_tokens=default_max_tokens)


def sampling_params_from_args(args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          stop=args.stop, ignore_eos=args.ignore_eos, seed=args.sampling_seed)


def prepare_prompt(engine, prompt, args: argparse.Namespace) -> tuple[dict, SamplingParams]:
    """Token ids and sampling parameters of one reply, with the server's rule for max_tokens (shared code:
    an over-long --max-tokens is refused, never silently cut)."""
    _, ids = engine.tokenize_prompt(prompt)
    engine.check_prompt_length(len(ids))
    max_tokens = resolve_max_tokens(args.max_tokens, args.default_max_tokens, len(ids), engine.max_model_len,
                                    "--max-tokens")
    return {"prompt_token_ids": ids}, sampling_params_from_args(args, max_tokens)


def stream_text(engine, prompt, params: SamplingParams, stop: Callable[[], bool] | None = None) -> Iterator[str]:
    """Yield the reply's text as it is generated (one request, n = 1). If `stop()` turns true, the
    request is aborted between two steps and the generator ends."""
    request_id = engine.add_request(prompt, params)
    shown = 0
    try:
        while stop is None or not stop():
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                text = out.outputs[0].text
                if len(text) > shown:
                    yield text[shown:]
                    shown = len(text)
                if out.finished:
                    return
    finally:
        engine.abort_request(request_id)


class CtrlC:
    """While active, Ctrl-C (SIGINT) only sets `hit` instead of raising KeyboardInterrupt mid-step."""

    def __init__(self) -> None:
        self.hit = False

    def __call__(self) -> bool:
        return self.hit

    def __enter__(self) -> CtrlC:
        self.hit = False
        self.previous = signal.signal(signal.SIGINT, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        self.hit = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self.previous)


def cmd_generate(args: argparse.Namespace) -> int:
    from atlas.engine.core import EngineCore
    from atlas.runtime.parallel_groups import is_driver

    config = EngineConfig.from_cli_args(args)
    if not is_driver(config):  # another node's ranks (or a torchrun rank)
        from atlas.engine.workers import run_node

        return run_node(config)
    engine = EngineCore(config)
    prompts = args.prompt or [sys.stdin.read()]
    for i, prompt in enumerate(prompts):
        prompt_ids, params = prepare_prompt(engine, prompt, args)
        if len(prompts) > 1:
            print(f"--- prompt {i}: {prompt!r}")
        if args.echo:
            print(prompt, end="")
        for piece in stream_text(engine, prompt_ids, params):
            print(piece, end="", flush=True)
        print()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from atlas.engine.core import EngineCore

    engine = EngineCore(EngineConfig.from_cli_args(args))
    if engine.tokenizer is None or not engine.tokenizer.has_chat_template:
        raise AtlasError("atlas chat needs a tokenizer with a chat template; use `atlas generate` for this model")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Type a message; an empty line or Ctrl-D quits; Ctrl-C stops a reply.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        try:
            prompt_text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            prompt, params = prepare_prompt(engine, engine.tokenizer.encode(prompt_text, add_special_tokens=False),
                                            args)
        except InvalidRequestError as exc:  # the conversation outgrew the context, say: keep the chat
            messages.pop()
            print(f"error: {exc}", file=sys.stderr)
            continue
        reply = []
        with CtrlC() as interrupted:
            for piece in stream_text(engine, prompt, params, stop=interrupted):
                reply.append(piece)
                print(piece, end="", flush=True)
        print()
        if interrupted.hit:
            print("[reply stopped]", file=sys.stderr)
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _add_log_level(parser: argparse.ArgumentParser, seen: set[int], top: bool = False) -> None:
    """--log-level on the command and every sub-command, so that it works before or after them."""
    if id(parser) in seen:
        return
    seen.add(id(parser))
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info" if top else argparse.SUPPRESS,
                        help="Logging level (default info); also accepted after the sub-command.")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _add_log_level(sub, seen)


def _register_token_map(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("token-map",
                       help="Write a DFlash drafter's or an MTP module's token map: a corpus's most frequent token ids.",
                       description="Counts the tokens of a corpus with the model's tokenizer and writes the SIZE most "
                                   "frequent ids (with the special tokens) for --speculative-token-map.")
    p.add_argument("--model", default=None,
                   help="Model folder or hub id whose tokenizer counts the corpus (default: the built-in model).")
    p.add_argument("--tokenizer", default=None, help="Tokenizer folder or hub id (default: the model's).")
    p.add_argument("--corpus", nargs="+", required=True, metavar="FILE",
                   help="Text files, or .jsonl files of records with text / prompt / completion / messages.")
    p.add_argument("--size", type=int, default=32768, help="Token ids to keep (default 32768).")
    p.add_argument("--out", required=True, help="Where to write the map (.pt, or .json for a list).")
    p.set_defaults(func=_cmd_token_map)


def _cmd_token_map(args: argparse.Namespace) -> int:
    """The corpus's most frequent ids under the model's tokenizer (its special tokens always in), written as a .pt
    tensor or a .json list."""
    import json

    import torch

    from atlas.engine.core import default_model_path
    from atlas.engine.tokenizer import Tokenizer
    from atlas.models.loader import resolve_model_path
    from atlas.speculative.token_map import corpus_texts, most_frequent_tokens

    path = resolve_model_path(args.tokenizer or args.model or str(default_model_path()))
    tokenizer = Tokenizer(path)
    if args.size < 1:
        raise ConfigError(f"--size must be a positive number of tokens, got {args.size}")
    size = min(args.size, tokenizer.vocab_size)
    always = [i for i in (tokenizer.eos_token_id,) if i is not None]
    always += [i for i in tokenizer.hf.all_special_ids if i is not None]
    ids, coverage = most_frequent_tokens((tokenizer.encode(t, add_special_tokens=False) for t in corpus_texts(args.corpus)),
                                         tokenizer.vocab_size, size, always)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".json":
        out.write_text(json.dumps(ids.tolist()))
    else:
        torch.save(ids, out)
    print(f"{out}: {ids.numel():,} token ids of {tokenizer.vocab_size:,}, covering {100 * coverage:.2f} % of the "
          f"corpus's tokens; serve with --speculative dflash --speculative-token-map {out}")
    return 0


# Sub-commands whose parsers live in their own packages: (module with a `register(subparsers)`, the command it
# adds, the pip extra that holds the optional packages it needs).
COMMAND_MODULES = (("atlas.server.cli", "serve", "server"), ("atlas.server.run_batch", "run-batch", "server"),
                   ("atlas.bench.cli", "bench", "server,test"))


def _register_command_module(sub: argparse._SubParsersAction, module: str, command: str, extra: str) -> None:
    """Add `command` from `module`. A broken import inside Atlas (a missing module or name of atlas, a syntax
    error, anything but a missing third-party package) is raised as it is: a command never vanishes silently.
    A third-party package that is not installed leaves the command listed; running it says which package is
    missing and which extra installs it."""
    import importlib

    try:
        register = importlib.import_module(module).register
    except ModuleNotFoundError as exc:
        package = (exc.name or "").partition(".")[0]
        if not package or package == "atlas":
            raise
        _register_unavailable(sub, command, f"atlas {command} needs the Python package {package!r}, which is not "
                                            f"installed (importing {module} failed: {exc}). Install it with pip "
                                            f"install 'atlas[{extra}]' (from a checkout: pip install -e "
                                            f"'.[{extra}]'), or pip install {package}.")
        return
    register(sub)


def _register_unavailable(sub: argparse._SubParsersAction, command: str, message: str) -> None:
    """`command` listed in --help, failing with `message` when run (whatever its arguments)."""
    p = sub.add_parser(command, help="(unavailable here: run it for why)", description=message)
    p.unavailable = message  # (parse_args lets it take any arguments)

    def unavailable(args: argparse.Namespace) -> int:
        raise AtlasError(message)

    p.set_defaults(func=unavailable)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atlas", description="Atlas LLM inference and serving engine")
    parser.add_argument("--version", action="version", version=f"atlas {atlas.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="Generate a completion for one or more prompts.")
    gen.add_argument("--prompt", action="append", help="Prompt text (repeatable; default: read stdin).")
    gen.add_argument("--echo", action="store_true", help="Print the prompt before the completion.")
    add_sampling_args(gen, GENERATE_DEFAULT_MAX_TOKENS)
    EngineConfig.add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="Chat interactively, through the tokenizer's chat template.")
    chat.add_argument("--system", default=None, help="System message.")
    add_sampling_args(chat, CHAT_DEFAULT_MAX_TOKENS)
    EngineConfig.add_cli_args(chat)
    chat.set_defaults(func=cmd_chat)

    for module, command, extra in COMMAND_MODULES:
        _register_command_module(sub, module, command, extra)
    _register_token_map(sub)
    _add_log_level(parser, set(), top=True)
    _no_abbreviations(parser)
    parser.commands = dict(sub.choices)  # (for errors and --config in the sub-command's own terms)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse, with `atlas serve --config FILE.yaml` expanded, and an unknown flag reported with the sub-command's
    own usage (not the top-level one)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    sub = parser.commands.get(command)
    if command == "serve" and sub is not None and not hasattr(sub, "unavailable"):
        from atlas.server.vllm_compat import expand_config_file

        i = argv.index(command) + 1
        try:
            argv = argv[:i] + expand_config_file(sub, argv[i:])
        except AtlasError as exc:
            sub.error(str(exc))
    args, extra = parser.parse_known_args(argv)
    used = parser.commands.get(getattr(args, "command", None)) or parser
    if extra and not hasattr(used, "unavailable"):
        used.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """Flags are matched whole, in every sub-command: argparse's prefix matching turned a vLLM flag that Atlas
    lacks into another flag (--chat-template read as --chat-template-timeout)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _no_abbreviations(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        status = args.func(args)
    except AtlasError as exc:
        print(f"error: {exc}", file=sys.stderr)
        status = 2
    except WorkerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        status = 1
    except KeyboardInterrupt:
        status = 130
    return _exit_if_stuck(status)


def _exit_if_stuck(status: int) -> int:
    """A parallel engine whose process groups could not be left within their limit has a thread stuck in
    the collectives library, on which the interpreter's exit can abort (status 134) after the work is
    done; end the process here instead, with the command's own status."""
    from atlas.runtime import parallel_groups

    if parallel_groups.GROUPS_LEFT_HANGING:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
