"""Per-request sampling parameters, with the names and defaults users know from vLLM."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from atlas.errors import InvalidRequestError, PromptTooLongError

# Upper bounds that keep one request from monopolising the engine.
MAX_N = 128
# Logprobs a request may ask for per token, unless --max-logprobs says otherwise (vLLM's default, OpenAI's top).
DEFAULT_MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_BAD_WORDS = 128
# logit_bias values, as OpenAI bounds them (-100 bans a token in practice, +100 all but forces it).
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# Bounds that keep the sampler's float32 arithmetic finite (logits / temperature, logits x penalty): past
# them a row could turn into infinities and NaNs and sample garbage. Temperatures below GREEDY_TEMPERATURE
# are greedy decoding. Values far inside these bounds already behave like their limits.
MAX_TEMPERATURE = 1e4
REPETITION_PENALTY_RANGE = (1e-4, 1e4)
GREEDY_TEMPERATURE = 1e-5


def check_logprobs(name: str, value: int | None, limit: int) -> None:
    """A request's logprobs field (`name`) at most the engine's limit (--max-logprobs)."""
    if value is not None and value > limit:
        raise InvalidRequestError(f"{name}: at most {limit} on this engine (--max-logprobs), got {value}", param=name)


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, as vLLM names it: exactly one of `json` (a JSON schema, as a dict or
    its text), `regex`, `choice` (the output is one of these strings), `grammar` (EBNF, as xgrammar and
    llama.cpp's GBNF write it) or `json_object` (any JSON object). The grammar engine masks every token
    that would leave the language, so the output is in it whenever the request ends on a stop token."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's structural tag (an object or its JSON text): free text with tagged JSON (atlas/structured/structural_tag.py)
    structural_tag: str | dict | None = None
    # JSON only: separators "," and ":" instead of ", " and ": " (no whitespace at all).
    disable_any_whitespace: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def _given(self) -> list[str]:
        # (json may be a boolean schema; json_object: False means not asked for)
        return [k for k in self.KINDS if getattr(self, k) is not None and not (k == "json_object" and
                                                                                 not self.json_object)]

    @property
    def kind(self) -> str:
        return self._given()[0]

    def validate(self, param: str = "structured_outputs") -> None:
        given = self._given()
        if len(given) != 1:
            raise InvalidRequestError(
                f"{param}: give exactly one of {', '.join(self.KINDS)}"
                + (f" (got {', '.join(given)})" if given else ""), param=param)
        if self.json is not None and not isinstance(self.json, (str, dict, bool)):
            raise InvalidRequestError(f"{param}.json: must be a JSON schema (an object, a boolean or its text)",
                                      param=param)
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise InvalidRequestError(f"{param}.structural_tag: must be an object or its JSON text", param=param)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{param}.{name}: must be a non-empty string", param=param)
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError(f"{param}.choice: must be a non-empty list of non-empty strings", param=param)
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise InvalidRequestError(f"{param}.{name}: must be a boolean", param=param)

    def cache_key(self) -> tuple:
        """Equal keys compile to the same grammar."""
        import json as _json

        value = getattr(self, self.kind)
        if isinstance(value, (dict, list, bool)):  # (key order kept: it is the order the grammar writes properties in)
            value = _json.dumps(value)
        return self.kind, value, self.disable_any_whitespace


@dataclass
class SamplingParams:
    """How to sample the continuation of one prompt.

    temperature == 0 means greedy decoding. top_k <= 0 and top_p == 1 and min_p == 0 disable
    those filters. `seed` makes sampling reproducible for this request regardless of what else
    is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # False: no output text (token ids only; logprob entries keep their tokens' texts). Stop strings need the text.
    detokenize: bool = True
    # A grammar the output must follow (JSON schema, regex, choice, EBNF); a dict is read as its fields.
    structured_outputs: StructuredOutputsParams | dict | None = None
    # Prefix-cache isolation (vLLM's cache_salt): only requests with the same salt share cached prompt pages.
    cache_salt: str | None = None
    # With --scheduling-policy priority: lower runs first (vLLM's request priority); must be 0 otherwise.
    priority: int = 0
    # OpenAI's logit_bias: {token id: bias in [-100, 100]} added to those logits before anything else (penalties,
    # grammar masks, temperature, filters; greedy takes the argmax after it). Keys may be ints or their decimal
    # strings (as JSON sends them); normalised to {int: float} without the zero biases, None when none is left.
    # The logprobs returned stay the raw model's, as with penalties.
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: every generated token is one of these (the others' logits are -inf before anything
    # else; logprobs stay the raw model's). Give the stop token among them for the output to end before max_tokens.
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words: words the output never holds. Each is tokenized as it would start the text and, where that
    # makes other tokens, after a space (bad_words_token_ids, filled in by the engine from its tokenizer, or given
    # as token ids); a word's last token is banned wherever the output's last tokens are the rest of it.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    # Normalised forms, filled in by __post_init__.
    stop_strings: list[str] = field(init=False, default_factory=list)

    def summary(self) -> str:
        """The settings that differ from the defaults, e.g. for a log line."""
        default = SamplingParams()
        parts = []
        for name in ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "ignore_eos",
                     "logprobs", "prompt_logprobs", "priority"):
            value = getattr(self, name)
            if value != getattr(default, name):
                parts.append(f"{name}={value!r}")
        if self.logit_bias:
            parts.append(f"logit_bias={len(self.logit_bias)} token(s)")
        if self.allowed_token_ids is not None:
            parts.append(f"allowed_token_ids={len(self.allowed_token_ids)} token(s)")
        if self.bad_words or self.bad_words_token_ids:
            parts.append(f"bad_words={len(self.bad_words or self.bad_words_token_ids)}")
        if self.structured_outputs is not None:
            parts.append(f"structured_outputs={getattr(self.structured_outputs, 'kind', 'yes')}")
        if self.cache_salt is not None:
            parts.append("cache_salt set")  # (not its value: a tenant's secret)
        return ", ".join(parts) or "defaults"

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - {f for f in StructuredOutputsParams.__dataclass_fields__}
            if unknown:
                raise InvalidRequestError(f"structured_outputs: unknown field(s) {', '.join(sorted(unknown))}",
                                          param="structured_outputs")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.logit_bias = _normalised_logit_bias(self.logit_bias)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

    @property
    def needs_output_history(self) -> bool:
        """Whether the sampler reads the output tokens before each row (penalties count them; bad words match
        their end): the runner keeps them, and a step waits for the last one on the host."""
        return self.needs_penalties or bool(self.bad_words_token_ids)

    @property
    def changes_logits(self) -> bool:
        """Whether the sampler must process this request's logits before a greedy argmax (logit_bias, allowed
        tokens, bad words or penalties; min_tokens and grammars are the batch's to tell, as they depend on the
        step)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or self.needs_output_history

    def check_token_ids(self, vocab_size: int) -> None:
        """The token ids the parameters name, within the model's vocabulary (what only the engine knows)."""
        named = {"logit_bias": self.logit_bias or (), "allowed_token_ids": self.allowed_token_ids or (),
                 "bad_words": [t for word in self.bad_words_token_ids or () for t in word]}
        for param, ids in named.items():
            bad = sorted({t for t in ids if t >= vocab_size})
            if bad:
                shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
                raise InvalidRequestError(f"{param}: token id(s) {shown} outside the vocabulary [0, {vocab_size})",
                                          param=param)

    def check_logprobs_limit(self, limit: int) -> None:
        """logprobs and prompt_logprobs at most the engine's limit (--max-logprobs)."""
        for name in ("logprobs", "prompt_logprobs"):
            check_logprobs(name, getattr(self, name), limit)

    @property
    def max_stop_string_len(self) -> int:
        return max((len(s) for s in self.stop_strings), default=0)

    def validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param}: {msg}", param=param)

        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise bad("priority", f"must be an integer, got {self.priority!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > 1024):
            raise bad("cache_salt", "must be a non-empty string of at most 1,024 characters")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (0 means greedy), got {self.temperature}")
        # A positive top_p too small for float32 (1e-46) still keeps the most likely token: the sampler
        # never masks the top-ranked one.
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", f"must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise bad("repetition_penalty", f"must be in [{low:g}, {high:g}] (1 disables it), "
                                            f"got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):  # (the upper bound is the engine's: check_logprobs_limit)
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise bad(name, f"must be an integer >= 0, got {value!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop_strings)}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop", "stop strings must be non-empty strings")
        if self.stop_strings and not self.detokenize:
            raise bad("stop", "stop strings are matched in the output text: they need detokenize=True")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias)
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, list) or not allowed or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in allowed)):
            raise bad("allowed_token_ids", "must be a non-empty list of token ids (non-negative integers)")
        words = self.bad_words
        if words is not None and (not isinstance(words, list) or len(words) > MAX_BAD_WORDS or any(
                not isinstance(w, str) or not w.strip() for w in words)):
            raise bad("bad_words", f"must be a list of at most {MAX_BAD_WORDS} non-blank strings")
        ids = self.bad_words_token_ids
        if ids is not None and (not isinstance(ids, list) or any(
                not isinstance(w, list) or not w or any(not isinstance(t, int) or isinstance(t, bool) or t < 0
                                                        for t in w) for w in ids)):
            raise bad("bad_words", "bad_words_token_ids must be lists of token ids (non-negative integers)")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams or a dict of its fields")
            self.structured_outputs.validate()


def _bias_token(key: object) -> int:
    """A logit_bias key as a token id: an int (not a bool), or the decimal digits of one (JSON's keys)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    raise InvalidRequestError(f"logit_bias: keys must be token ids (integers, or their decimal strings), got {key!r}",
                              param="logit_bias")


def _normalised_logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias: must be a map from token id to bias", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = _bias_token(key)
        if token in out:  # ("5" and 5, say)
            raise InvalidRequestError(f"logit_bias: token id {token} is given twice", param="logit_bias")
        out[token] = value
    _check_logit_bias(out)
    return {t: float(v) for t, v in out.items() if v != 0} or None


def _check_logit_bias(bias: dict) -> None:
    low, high = LOGIT_BIAS_RANGE
    for token, value in bias.items():
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise InvalidRequestError(f"logit_bias: keys must be token ids (integers >= 0), got {token!r}",
                                      param="logit_bias")
        if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                or not low <= value <= high):
            raise InvalidRequestError(f"logit_bias: the bias of token {token} must be a number in [{low:g}, "
                                      f"{high:g}], got {value!r}", param="logit_bias")


def resolve_max_tokens(requested: int | None, default: int | None, num_prompt_tokens: int, max_model_len: int,
                       param: str = "max_tokens") -> int:
    """The one rule for how many tokens a request may generate, shared by the server and the CLI.

    Not given: `default`, capped at what the context leaves (no default: all of it). Given: it must be
    >= 1 and fit with the prompt in the context, or the request is refused (never silently cut).
    `param` is how the caller names the setting (a request field, or a flag)."""
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room if default is None else min(default, room)
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        raise InvalidRequestError(f"{param}: must be an integer >= 1, got {requested!r}", param=param)
    if requested > room:
        raise PromptTooLongError(
            f"{param} is {requested} but the context is {max_model_len} tokens and the prompt uses "
            f"{num_prompt_tokens}: {param} may be at most {room} here (prompt + {param} <= {max_model_len})",
            param=param)
    return requested


@dataclass
class BeamSearchParams:
    """vLLM's beam search (LLM.beam_search; the server's use_beam_search): the beam_width best continuations by
    their summed logprobs, each of at most max_tokens tokens; ended by an end-of-sequence token unless ignore_eos.
    Finished beams are ranked by summed logprob / (generated tokens ** length_penalty), the end token not counted
    (transformers' score). Beam search is deterministic: a temperature other than 0 is refused."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param}: {msg}", param=param)

        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or not (
                1 <= self.beam_width <= MAX_BEAM_WIDTH):
            raise bad("beam_width", f"must be an integer in [1, {MAX_BEAM_WIDTH}] (each step scores the best "
                                    f"{2 * MAX_BEAM_WIDTH} tokens of a beam), got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature != 0:
            raise bad("temperature", "beam search keeps the most likely beams: only temperature 0 is supported")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool) or not (
                math.isfinite(self.length_penalty)):
            raise bad("length_penalty", f"must be a finite number, got {self.length_penalty!r}")


MAX_BEAM_WIDTH = DEFAULT_MAX_LOGPROBS // 2


def check_beam_logprobs(beam_width: int, limit: int, param: str = "beam_width",
                        logprobs_mode: str = "raw_logprobs") -> None:
    """A beam search's steps ask for 2 x beam_width logprobs each: within the engine's --max-logprobs, and the
    model's logprobs (--logprobs-mode raw_logprobs), which rank the beams."""
    if logprobs_mode != "raw_logprobs":
        raise InvalidRequestError(f"beam search ranks beams by the model's logprobs, and this engine's logprobs are "
                                  f"{logprobs_mode} (--logprobs-mode): serve it with raw_logprobs (the default) to "
                                  "search", param=param)
    if 2 * beam_width > limit:
        raise InvalidRequestError(f"{param}: a beam search of width {beam_width} scores {2 * beam_width} tokens a step, "
                                  f"more than this engine's --max-logprobs ({limit}): at most {limit // 2}",
                                  param=param)
