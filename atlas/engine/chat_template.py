"""Chat templates, rendered in a jinja2 sandbox with limits on what a template may build and on its time.

A chat template is a jinja2 program, and its input (the messages) comes from whoever sends the
request; with `--trust-request-chat-template` the program itself does too. Rendering therefore runs
in jinja2's `ImmutableSandboxedEnvironment` (no access to Python internals, no mutation of lists or
dicts), with two limits on top:

- size: no single step may build a string or list longer than `TemplateLimits.max_chars`
  (repetition `*`, `+`, `~`, `%` and `str.format` formatting, the size-taking string methods and
  filters, captured blocks, macro results, big integers), checked *before* the value is built where
  its size can be known in advance, and the whole output is capped too;
- time: a trace hook on the template's own code (its loops, macros and blocks; not on the Python
  functions it calls) stops the render after `TemplateLimits.timeout_s`.

The environment is set up as `transformers` sets up its own (trim_blocks, lstrip_blocks, loop controls,
the `{% generation %}` tag, `raise_exception`, `strftime_now`, `tojson` without HTML escaping, a safe
`dict` and `namespace`), and the variables are the ones it passes (messages, tools, documents,
add_generation_prompt, the special tokens, extra keyword arguments), so a model's own template
renders exactly as `tokenizer.apply_chat_template(..., tokenize=False)` renders it.

This module needs jinja2 only.
"""

from __future__ import annotations

import functools
import json
import re
import string
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from atlas.errors import InvalidRequestError

# Integers a template computes are kept below this many bits (a 10**10**8 would take minutes).
MAX_INT_BITS = 4096
# tojson(indent=...) beyond this is refused (each line of the output would carry it).
MAX_JSON_INDENT = 32
# Names of the message fields that carry reasoning, the first being the one templates read
# (transformers copies the others into it).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Variables the renderer sets itself; extra keyword arguments may not repeat them.
RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "tools", "documents")
# chat_template_kwargs that a chat's own fields or arguments set (the renderer's variables, and continue_final_message,
# the renderer's argument): refused in chat_template_kwargs.
RESERVED_KWARGS = (*RESERVED_TEMPLATE_VARIABLES, "continue_final_message")


@dataclass(frozen=True)
class TemplateLimits:
    """max_chars bounds the output and any one string or list the template builds on the way; timeout_s
    bounds the time spent in the template's code."""

    max_chars: int = 16 * 2**20
    timeout_s: float = 5.0


DEFAULT_LIMITS = TemplateLimits()


class TemplateLimitError(InvalidRequestError):
    """The template tried to build too much, or ran too long."""


class _OutOfTime(BaseException):
    """Raised inside the template's frames by the time limit. A BaseException, so that no `except
    Exception` on the way (jinja2's undefined-attribute handling, say) can swallow it."""


# ---------------------------------------------------------------------------------- the sandbox
def _jinja():
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return jinja2, CodeGenerator, ImmutableSandboxedEnvironment


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


@functools.lru_cache(maxsize=1)
def _sandbox_class() -> type:
    jinja2, CodeGenerator, ImmutableSandboxedEnvironment = _jinja()

    class CheckedCodeGenerator(CodeGenerator):
        """`a ~ b` calls the environment's checked join instead of jinja2's own."""

        def visit_Concat(self, node, frame) -> None:  # noqa: N802 - jinja2's visitor naming
            self.write("environment.concat_checked((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller) -> str:
            return caller()

    class LimitedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = CheckedCodeGenerator
        intercepted_binops = frozenset({"*", "+", "%", "**"})

        def __init__(self, max_chars: int):
            super().__init__(trim_blocks=True, lstrip_blocks=True,
                             extensions=[GenerationTag, jinja2.ext.loopcontrols])
            self.max_chars = max_chars
            # Captured blocks ({% set x %}...{% endset %}), macro results and caller() bodies go through this.
            self.concat = self.concat_checked
            for name in list(self.filters):
                self.filters[name] = self._checked_filter(name, self.filters[name])

        # ---------------------------------------------------------------- size checks
        def room(self, size: int, what: str) -> None:
            if size > self.max_chars:
                raise jinja2.exceptions.SecurityError(
                    f"the chat template tried to build {what} of {size:,} items; the limit is {self.max_chars:,}")

        def check_built(self, value: Any) -> Any:
            if isinstance(value, (str, list, tuple, dict)):
                self.room(len(value), "a value")
            elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
                raise jinja2.exceptions.SecurityError(f"the chat template built an integer of more than "
                                                      f"{MAX_INT_BITS} bits")
            return value

        def concat_checked(self, parts: Iterable[Any]) -> str:
            strings = [p if isinstance(p, str) else str(p) for p in parts]
            self.room(sum(map(len, strings)), "a string")
            return "".join(strings)

        def check_percent(self, fmt: str, args: Any) -> None:
            values = args if isinstance(args, tuple) else (args,)
            if isinstance(args, dict):
                values = tuple(args.values())
            widest = max((len(str(v)) for v in values), default=0)
            size = len(fmt)
            for m in _PERCENT_SPEC.finditer(fmt):
                if "*" in (m.group(1), m.group(2)):
                    raise jinja2.exceptions.SecurityError("the chat template used a '*' width in %-formatting")
                size += max(int(m.group(1) or 0), int(m.group(2) or 0), widest)
            self.room(size, "a formatted string")

        def check_format(self, fmt: str, args: tuple, kwargs: dict) -> None:
            values = (*args, *kwargs.values())
            widest = max((len(str(v)) for v in values), default=0)
            size = len(fmt)
            for _, field, spec, _ in string.Formatter().parse(fmt):
                if field is None:
                    continue
                if spec and "{" in spec:
                    raise jinja2.exceptions.SecurityError("the chat template used a nested format spec")
                size += max([widest, *(int(d) for d in _DIGITS.findall(spec or ""))])
            self.room(size, "a formatted string")

        def check_str_method(self, text: str, name: str, args: tuple, kwargs: dict) -> tuple:
            """Refuse str methods whose result would be too large; returns args (join's are materialised)."""
            if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
                self.room(args[0], "a padded string")
            elif name == "expandtabs":
                tab = args[0] if args else kwargs.get("tabsize", 8)
                if isinstance(tab, int):
                    self.room(len(text) + max(tab, 0) * text.count("\t"), "a string")
            elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                old, new = args[0], args[1]
                hits = text.count(old) if old else len(text) + 1
                if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
                    hits = min(hits, args[2])
                self.room(len(text) + hits * max(len(new) - len(old), 0), "a string")
            elif name == "join" and args:
                items = list(args[0])
                self.room(sum(len(i) if isinstance(i, str) else 0 for i in items)
                          + len(text) * max(len(items) - 1, 0), "a joined string")
                args = (items, *args[1:])
            return args

        # ---------------------------------------------------------------- the sandbox's hooks
        def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                        self.room(len(seq) * max(times, 0), "a repeated value")
                if isinstance(left, int) and isinstance(right, int) and (
                        left.bit_length() + right.bit_length() > MAX_INT_BITS):
                    raise jinja2.exceptions.SecurityError(
                        f"the chat template multiplied integers past {MAX_INT_BITS} bits")
            elif operator == "+":
                if (isinstance(left, str) and isinstance(right, str)) or (
                        isinstance(left, (list, tuple)) and isinstance(right, (list, tuple))):
                    self.room(len(left) + len(right), "a concatenated value")
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0 and (
                        right * abs(left).bit_length() > MAX_INT_BITS):
                    raise jinja2.exceptions.SecurityError(
                        f"the chat template raised an integer past {MAX_INT_BITS} bits")
            elif operator == "%" and isinstance(left, str):
                self.check_percent(left, right)
            return self.check_built(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja2's signature
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str) and isinstance(getattr(__obj, "__name__", None), str):
                args = __self.check_str_method(owner, __obj.__name__, args, kwargs)
            for value in (*args, *kwargs.values()):
                if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
                    raise jinja2.exceptions.SecurityError("the chat template passed a huge integer to a call")
            return __self.check_built(super().call(__context, __obj, *args, **kwargs))

        def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
            wrapper = super().wrap_str_format(value)
            if wrapper is None:
                return None
            fmt, is_map = value.__self__, value.__name__ == "format_map"

            def checked(*args: Any, **kwargs: Any) -> str:
                if is_map and len(args) == 1 and isinstance(args[0], dict):
                    self.check_format(fmt, (), args[0])
                else:
                    self.check_format(fmt, args, kwargs)
                return wrapper(*args, **kwargs)

            return functools.update_wrapper(checked, wrapper)

        def _checked_filter(self, name: str, fn: Callable) -> Callable:
            pass_arg = getattr(fn, "jinja_pass_arg", None)
            env = self

            @functools.wraps(fn)
            def checked(*args: Any, **kwargs: Any) -> Any:
                plain = args[1:] if pass_arg is not None else args  # drop the context / eval context
                env.precheck_filter(name, plain, kwargs)
                return env.check_built(fn(*args, **kwargs))

            return checked

        def precheck_filter(self, name: str, args: tuple, kwargs: dict) -> None:
            value = args[0] if args else None
            rest = args[1:]
            if name == "center":
                width = rest[0] if rest else kwargs.get("width", 80)
                if isinstance(width, int):
                    self.room(width, "a padded string")
            elif name == "indent" and isinstance(value, str):
                width = rest[0] if rest else kwargs.get("width", 4)
                pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
                self.room(len(value) + max(pad, 0) * (value.count("\n") + 1), "an indented string")
            elif name == "wordwrap" and isinstance(value, str):
                width = rest[0] if rest else kwargs.get("width", 79)
                wrap = rest[2] if len(rest) > 2 else kwargs.get("wrapstring") or "\n"
                if isinstance(width, int) and width > 0 and isinstance(wrap, str):
                    self.room(len(value) + (len(value) // width + 1) * len(wrap), "a wrapped string")
            elif name == "replace" and isinstance(value, str) and len(rest) >= 2:
                self.check_str_method(value, "replace", (str(rest[0]), str(rest[1]), *rest[2:3]), {})
            elif name == "join" and isinstance(value, (list, tuple)):
                sep = rest[0] if rest else kwargs.get("d", "")
                if isinstance(sep, str):
                    self.room(sum(len(v) if isinstance(v, str) else 0 for v in value)
                              + len(sep) * max(len(value) - 1, 0), "a joined string")
            elif name == "format" and isinstance(value, str):
                self.check_percent(value, kwargs or tuple(rest))
            elif name == "tojson":
                indent = rest[1] if len(rest) > 1 else kwargs.get("indent")
                if isinstance(indent, int) and indent > MAX_JSON_INDENT or (
                        isinstance(indent, str) and len(indent) > MAX_JSON_INDENT):
                    raise jinja2.exceptions.SecurityError(f"tojson indent is limited to {MAX_JSON_INDENT}")

    return LimitedSandbox


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without the attribute access a real dict type would give."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _namespace_class() -> type:
    import jinja2.utils
    from jinja2.exceptions import SecurityError

    class TemplateNamespace(jinja2.utils.Namespace):
        """jinja2's namespace, refusing underscore names (the way to CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's signature trick
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"chat templates cannot set underscore attributes on a namespace ({name!r})")

    return TemplateNamespace


# ---------------------------------------------------------------------------------- rendering
def _plain(value: Any) -> Any:
    """JSON-like data only (what a template may see): str, int, float, bool, None, lists and dicts."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


def _messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """As transformers prepares them: keys with None values dropped, reasoning under all its names."""
    out = []
    for message in messages:
        message = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """One compiled chat template. `render` may be called from several threads at once."""

    def __init__(self, source: str, limits: TemplateLimits = DEFAULT_LIMITS):
        import jinja2

        self.source = source
        self.limits = limits
        env = _sandbox_class()(limits.max_chars)
        env.filters["tojson"] = env._checked_filter("tojson", _tojson)
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                           namespace=_namespace_class())
        self.env = env
        try:
            self.template = env.from_string(source)
        except RecursionError:
            raise InvalidRequestError("the chat template nests too deeply to compile", param="chat_template") \
                from None
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise InvalidRequestError(f"the chat template does not compile: {exc.message} (line {exc.lineno})",
                                      param="chat_template") from None
        self._code_file = self.template.root_render_func.__code__.co_filename

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               special_tokens: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
               **kwargs: Any) -> str:
        """The prompt text. Raises TemplateLimitError past the limits; jinja2's own errors (including the
        template's raise_exception) and Python errors in the template propagate to the caller."""
        variables = {**_plain(dict(special_tokens or {})), **_plain(kwargs)}
        variables.update(messages=_messages_for_template(messages), tools=_plain(tools) if tools else None,
                         documents=None,
                         add_generation_prompt=add_generation_prompt)
        max_chars = self.limits.max_chars
        chunks: list[str] = []
        size = 0

        def run() -> None:
            nonlocal size
            for chunk in self.template.generate(**variables):
                size += len(chunk)
                if size > max_chars:
                    raise TemplateLimitError(
                        f"the chat template's output passed {max_chars:,} characters", param="messages")
                chunks.append(chunk)

        _with_deadline(run, self.limits.timeout_s, self._code_file)
        return "".join(chunks)


def _with_deadline(fn: Callable[[], None], timeout_s: float, code_file: str) -> None:
    """Run fn in this thread, stopping the template's frames (those compiled from `code_file`) once
    timeout_s has passed. Other threads are untouched (sys.settrace is per thread)."""
    deadline = time.monotonic() + timeout_s

    def lines(frame, event, arg):
        if time.monotonic() > deadline:
            raise _OutOfTime
        return lines

    def calls(frame, event, arg):
        if frame.f_code.co_filename == code_file:
            return lines(frame, event, arg)
        return None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        fn()
    except _OutOfTime:
        raise TemplateLimitError(f"the chat template ran for more than {timeout_s:g} s", param="messages") \
            from None
    finally:
        sys.settrace(previous)


class TemplateCache:
    """Compiled templates by source text (a small LRU; thread-safe)."""

    def __init__(self, size: int = 16, limits: TemplateLimits = DEFAULT_LIMITS):
        self.size = size
        self.limits = limits
        self._lock = threading.Lock()
        self._items: OrderedDict[str, ChatTemplate] = OrderedDict()

    def get(self, source: str) -> ChatTemplate:
        with self._lock:
            hit = self._items.get(source)
            if hit is not None:
                self._items.move_to_end(source)
                return hit
        compiled = ChatTemplate(source, self.limits)  # outside the lock: compiling may take a while
        with self._lock:
            self._items[source] = compiled
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return compiled
