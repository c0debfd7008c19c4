"""The `atlas` command: generate, chat, serve, bench. Thin: it builds configs and calls the engine."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator

from atlas.config import EngineConfig
from atlas.errors import AtlasError
from atlas.sampling_params import SamplingParams

logger = logging.getLogger("atlas")


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="Most tokens to generate per reply.")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--sampling-seed", type=int, default=None, help="Per-request seed for reproducible sampling.")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          stop=args.stop, ignore_eos=args.ignore_eos, seed=args.sampling_seed)


def stream_text(engine, prompt, params: SamplingParams) -> Iterator[str]:
    """Yield the reply's text as it is generated (one request, n = 1)."""
    request_id = engine.add_request(prompt, params)
    shown = 0
    try:
        while True:
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


def cmd_generate(args: argparse.Namespace) -> int:
    from atlas.engine.core import EngineCore

    engine = EngineCore(EngineConfig.from_cli_args(args))
    params = sampling_params_from_args(args)
    prompts = args.prompt or [sys.stdin.read()]
    for i, prompt in enumerate(prompts):
        if len(prompts) > 1:
            print(f"--- prompt {i}: {prompt!r}")
        if args.echo:
            print(prompt, end="")
        for piece in stream_text(engine, prompt, params):
            print(piece, end="", flush=True)
        print()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from atlas.engine.core import EngineCore

    engine = EngineCore(EngineConfig.from_cli_args(args))
    if engine.tokenizer is None or not engine.tokenizer.has_chat_template:
        raise AtlasError("atlas chat needs a tokenizer with a chat template; use `atlas generate` for this model")
    params = sampling_params_from_args(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        prompt_text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = {"prompt_token_ids": engine.tokenizer.encode(prompt_text, add_special_tokens=False)}
        reply = []
        for piece in stream_text(engine, prompt, params):
            reply.append(piece)
            print(piece, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atlas", description="Atlas LLM inference and serving engine")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="Generate a completion for one or more prompts.")
    gen.add_argument("--prompt", action="append", help="Prompt text (repeatable; default: read stdin).")
    gen.add_argument("--echo", action="store_true", help="Print the prompt before the completion.")
    add_sampling_args(gen)
    EngineConfig.add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="Chat interactively, through the tokenizer's chat template.")
    chat.add_argument("--system", default=None, help="System message.")
    add_sampling_args(chat, max_tokens=512)
    EngineConfig.add_cli_args(chat)
    chat.set_defaults(func=cmd_chat)

    for module in ("atlas.server.cli", "atlas.bench.cli"):
        try:
            register = __import__(module, fromlist=["register"]).register
        except ImportError as exc:
            if exc.name and exc.name.startswith("atlas"):
                continue  # that part of Atlas is not built yet
            raise
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except AtlasError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
