"""Tokenizer access: encoding, the chat template, and incremental detokenization with stop strings."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

from atlas.engine.chat_template import TemplateCache, TemplateLimitError, TemplateLimits
from atlas.errors import ConfigError, InvalidRequestError, ModelLoadError

logger = logging.getLogger(__name__)

# Windows from which decode_batch makes one call into the Rust tokenizer (its thread pool) rather than one a window.
BATCH_DECODE_MIN = 128
# Put after the final message's content to find where it ends in the rendered chat (continue_final_message); the
# trailing space shows whether the template keeps the content's trailing whitespace.
_CONTINUE_MARK = "<|atlas-continue-final-message|> "
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "spiece.model",
                    "vocab.txt")


def _tokenizer_code(folder: Path) -> str | None:
    """The tokenizer class a checkpoint's tokenizer_config.json names in its own code (auto_map's AutoTokenizer,
    "module.Class"), None where it names none."""
    try:
        auto_map = json.loads((folder / "tokenizer_config.json").read_text()).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return None  # (no such file, or not a JSON object: AutoTokenizer reports it)
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    names = [n for n in (entry if isinstance(entry, list) else [entry]) if isinstance(n, str)]
    return names[0] if names else None


class Tokenizer:
    """A thin wrapper over a Hugging Face tokenizer (tokenizer.json / tokenizer_config.json)."""

    def __init__(self, path: Path | str, revision: str | None = None, chat_template: str | None = None,
                 chat_encoding: str | None = None, trust_remote_code: bool = False):
        """`chat_template`: a template to use instead of the tokenizer's own (--chat-template, resolved).
        `chat_encoding`: a chat format written in code rather than a template (engine/chat_encodings.py), for a
        checkpoint that ships none (--tokenizer-mode deepseek_v32). `trust_remote_code`: run the tokenizer code
        the checkpoint ships, where its tokenizer_config.json names a class of its own (--trust-remote-code)."""
        from transformers import AutoTokenizer

        folder = Path(path)
        if folder.is_dir() and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
            raise ModelLoadError(
                f"{folder} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])}, ...). Give --tokenizer PATH, "
                "or --skip-tokenizer-init to serve token-id prompts only")
        try:
            self.hf = AutoTokenizer.from_pretrained(str(path), revision=revision, trust_remote_code=trust_remote_code)
        except ImportError as exc:  # the checkpoint's tokenizer code imports what is not here (tiktoken, or a
            #                           transformers function its release moved)
            raise ModelLoadError(
                f"the tokenizer code of {path} does not import here ({exc}): install the package it names, or the "
                "transformers release the checkpoint's code was written for") from exc
        except Exception as exc:  # missing or malformed tokenizer files, or code not allowed to run
            code = _tokenizer_code(folder) if folder.is_dir() and not trust_remote_code else None
            if code is not None and "trust_remote_code" in str(exc):
                raise ModelLoadError(
                    f"the tokenizer of {folder} is code that ships with the checkpoint ({code}, named by auto_map "
                    "in tokenizer_config.json): give --trust-remote-code (LLM(..., trust_remote_code=True)) to run "
                    "it, as with vLLM, or --tokenizer PATH for another tokenizer of the same vocabulary") from None
            raise ModelLoadError(
                f"cannot load a tokenizer from {path} ({type(exc).__name__}: {exc}). Give --tokenizer PATH, or "
                "--skip-tokenizer-init to serve token-id prompts only") from exc
        # Atlas checks prompt lengths against --max-model-len itself; the tokenizer's own limit only
        # produces a misleading warning for long texts.
        self.hf.model_max_length = 1 << 62
        self.eos_token_id = self.hf.eos_token_id
        self.vocab_size = len(self.hf)
        self.templates = TemplateCache()  # compiled chat templates, rendered with DEFAULT_LIMITS
        self.template_override = chat_template
        self.chat_encoding = chat_encoding
        self.trust_remote_code = trust_remote_code
        self._path, self._revision = str(path), revision

    @property
    def source(self) -> tuple:
        """What a worker process loads the same tokenizer from (this class's arguments)."""
        return self._path, self._revision, self.template_override, self.chat_encoding, self.trust_remote_code

    def set_template_limits(self, limits: TemplateLimits) -> None:
        self.templates = TemplateCache(limits=limits)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's bad_words as token ids: each word as it would start the text, and also after a space where that
        gives a word of as many tokens starting with another one (a tokenizer whose words carry their leading
        space)."""
        out: list[list[int]] = []
        for word in words:
            first = self.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(first)
            if spaced and first and spaced[0] != first[0] and len(spaced) == len(first):
                out.append(spaced)
        return [w for w in out if w]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """decode() of many sequences: one call into the Rust tokenizer (where there is one) for many, since its
        threads then pay for themselves; one call a sequence for a few, where waking those threads (asleep
        between two engine steps) costs more than the decoding."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return [self.decode(s, skip_special_tokens) for s in sequences]
        if len(sequences) < BATCH_DECODE_MIN:  # (straight into Rust: the Python tokenizer's decode costs more)
            texts = [backend.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]
        else:
            texts = backend.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
        if getattr(self.hf, "clean_up_tokenization_spaces", False):
            texts = [self.hf.clean_up_tokenization(t) for t in texts]
        return texts

    @functools.cached_property
    def token_pieces(self) -> list[str | None] | None:
        """Each token's text where it is exactly what the token adds to any decoded text that ends on a whole
        character (None for the others), for the detokenizer's fast path; None for the whole vocabulary where
        that is not known to hold. It holds for a byte-level BPE (its decoder joins the tokens' bytes and
        decodes them as UTF-8) for every token that is not an added one and whose bytes are whole UTF-8
        characters, and ids the tokenizer does not know add nothing ("": a model's vocabulary can be larger than
        its tokenizer's; ids past the end of the list are such ids too); a check of a few tokens behind two others
        confirms it before it is used."""
        return byte_level_pieces(self)

    def prepare_detokenizer(self) -> None:
        """Build token_pieces now (a pass over the vocabulary: 0.08 s at 32k tokens on a 2-core CPU), at
        start-up rather than on the first request's step."""
        _ = self.token_pieces

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return [self.hf.decode([t]) for t in token_ids]

    @property
    def chat_template(self) -> str | None:
        """--chat-template if given, else the tokenizer's own (the "default" one of a set of named templates)."""
        if self.template_override is not None:
            return self.template_override
        template = getattr(self.hf, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        return template or None

    def chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """The token ids of apply_chat_template(messages, add_generation_prompt, **kwargs)'s text."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None or self.chat_encoding is not None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
                            continue_final_message: bool = False, **template_kwargs: Any) -> str:
        """Render the conversation as prompt text, through `chat_template` if given (e.g. a request's own)
        or the tokenizer's, with the tool definitions as `tools`, in a sandbox with limits (see atlas/engine/chat_template.py). Problems are
        InvalidRequestErrors naming the request field at fault ("messages", or "chat_template" for a
        template of the caller's own).

        With `continue_final_message` the last message is left open (transformers' and vLLM's field): the
        conversation is rendered without a generation prompt, with a marker after the last message's content,
        and the text is cut where the marker starts (and stripped of trailing whitespace there, if the template
        trims the content), so whatever the template writes after the content (its end of turn) is gone."""
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to "
                                          "True (send add_generation_prompt: false to continue the final message)",
                                          param="continue_final_message")
            if not messages:
                raise InvalidRequestError("continue_final_message needs a message to continue",
                                          param="continue_final_message")
            final = messages[-1].get("content")
            if not isinstance(final, str):
                raise InvalidRequestError("continue_final_message: the final message has no text content to continue",
                                          param="continue_final_message")
            marked = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_MARK}]
            text = self.apply_chat_template(marked, False, chat_template, tools, **template_kwargs)
            at = text.rfind(_CONTINUE_MARK.strip())
            if at < 0 or text.count(_CONTINUE_MARK.strip()) != 1:
                raise InvalidRequestError(
                    "continue_final_message: the chat template does not write the final message's content once, "
                    "so it cannot be continued", param="continue_final_message")
            kept = text[:at] if text.startswith(_CONTINUE_MARK, at) else text[:at].rstrip()
            if not kept.rstrip().endswith(final.strip()):
                raise InvalidRequestError(
                    "continue_final_message: the chat template changes the final message's content, so the prompt "
                    "would not end with it", param="continue_final_message")
            return kept
        if chat_template is None and self.template_override is None and self.chat_encoding is not None:
            from atlas.engine.chat_encodings import render_deepseek_v32

            thinking = bool(template_kwargs.get("thinking") or template_kwargs.get("enable_thinking"))
            return render_deepseek_v32(messages, tools, thinking)
        if chat_template is None and self.template_override is None and self.renders_chats_itself:
            return self._render_by_tokenizer_code(messages, add_generation_prompt, tools, template_kwargs)
        source = chat_template if chat_template is not None else self.chat_template
        param = "chat_template" if chat_template is not None else "messages"
        if source is None:
            raise InvalidRequestError(
                "this model's tokenizer has no chat template; use a completion prompt instead", param="messages")
        import jinja2

        try:
            return self.templates.get(source).render(messages, add_generation_prompt, self.hf.special_tokens_map,
                                                     tools=tools, **template_kwargs)
        except TemplateLimitError as exc:
            raise TemplateLimitError(str(exc), param=param) from None
        except InvalidRequestError:
            raise
        except jinja2.exceptions.SecurityError as exc:
            raise TemplateLimitError(str(exc), param=param) from None
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequestError(f"the chat template refused these messages: {exc}", param=param) from None
        except RecursionError:
            raise InvalidRequestError("the chat template recursed too deeply on these messages", param=param) \
                from None
        except Exception as exc:  # noqa: BLE001 - a template's own Python error (a bad type in a message, say)
            # Python's own words about the template's code (an exception type, "unsupported operand type(s)") are
            # for the server's log; the client learns what to check.
            logger.info("the chat template failed on a request's messages (%s: %s)", type(exc).__name__, exc)
            raise InvalidRequestError(
                "the chat template failed on these messages: it cannot use a value in them (a message's content or "
                "tool calls, a tool's definition, or a chat_template_kwargs value of a type or form it does not "
                "expect); send them in the form this model's chat template takes", param=param) from None

    @functools.cached_property
    def renders_chats_itself(self) -> bool:
        """Whether the tokenizer's class (the checkpoint's own code, run with --trust-remote-code) overrides
        apply_chat_template: its chats are then rendered by it, as vLLM renders them, since what it does around
        the template is part of the prompt the model was trained on (e.g. an order of the tools' keys)."""
        from transformers import PreTrainedTokenizerBase

        own = getattr(type(self.hf), "apply_chat_template", None)
        return self.trust_remote_code and own is not PreTrainedTokenizerBase.apply_chat_template and \
            type(self.hf).__module__.startswith("transformers_modules")

    def _render_by_tokenizer_code(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                                  tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any]) -> str:
        import jinja2

        if self.chat_template is None:
            raise InvalidRequestError(
                "this model's tokenizer has no chat template; use a completion prompt instead", param="messages")
        try:
            text = self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                               tokenize=False, **template_kwargs)
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequestError(f"the chat template refused these messages: {exc}", param="messages") from None
        except Exception as exc:  # noqa: BLE001 - the tokenizer code's or its template's own error
            logger.info("the tokenizer's chat rendering failed on a request's messages (%s: %s)",
                        type(exc).__name__, exc)
            raise InvalidRequestError(
                "the chat template failed on these messages: it cannot use a value in them; send them in the form "
                "this model's chat template takes", param="messages") from None
        if not isinstance(text, str):
            raise InvalidRequestError("the tokenizer's chat rendering returned no text", param="messages")
        return text

    def info(self) -> dict[str, Any]:
        """The tokenizer's settings as JSON (tokenizer_config.json's fields, as vLLM's /tokenizer_info gives
        them), without file paths; plus its class and chat template."""

        def plain(value: Any) -> Any:
            if hasattr(value, "content"):  # AddedToken
                return value.content
            if isinstance(value, dict):
                return {str(k): plain(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            if value is None or isinstance(value, (str, int, float, bool)):
                return value
            return str(value)

        config = {k: plain(v) for k, v in (getattr(self.hf, "init_kwargs", None) or {}).items()
                  if not k.endswith("_file") and k not in ("name_or_path", "is_local", "local_files_only")}
        config["tokenizer_class"] = type(self.hf).__name__
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            config.setdefault(name, plain(getattr(self.hf, name, None)))
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        return config


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE writes each byte as one printable character: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def byte_level_pieces(tokenizer: Tokenizer) -> list[str | None] | None:
    """Tokenizer.token_pieces for a byte-level BPE without text clean-up; None for any other tokenizer."""
    backend = getattr(tokenizer.hf, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer.hf, "clean_up_tokenization_spaces", False):
        return None
    if type(backend.decoder).__name__ != "ByteLevel" or type(backend.model).__name__ != "BPE":
        return None
    alphabet = byte_level_alphabet()
    added = set(tokenizer.hf.added_tokens_decoder)
    vocab = backend.get_vocab(with_added_tokens=False)
    size = max(len(tokenizer.hf), max(vocab.values(), default=-1) + 1, max(added, default=-1) + 1)
    pieces: list[str | None] = [None] * size
    for i in range(size):
        if i not in added and backend.id_to_token(i) is None:
            pieces[i] = ""  # (an id it does not know: decoded as nothing)
    for token, i in vocab.items():
        if i in added:
            continue
        try:
            text = bytes(alphabet[c] for c in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue  # (not in the byte alphabet, or part of a character)
        if text and "\ufffd" not in text:
            pieces[i] = text
    # The property the fast path rests on, tried on a spread of tokens behind two different ones.
    simple = [i for i, piece in enumerate(pieces) if piece]
    if not simple:
        return None
    probe = [*simple[:: max(1, len(simple) // 64)], size, size + 1000]  # (and two unknown ids)
    pieces_of = lambda i: pieces[i] if i < size else ""  # noqa: E731
    for anchor in (simple[0], simple[len(simple) // 2]):
        base = backend.decode([anchor], skip_special_tokens=False)
        for i in probe:
            if backend.decode([anchor, i], skip_special_tokens=False) != base + pieces_of(i):
                logger.debug("byte-level pieces do not add up for token %d: no detokenizer fast path", i)
                return None
    return pieces


class IncrementalDetokenizer:
    """Decodes a growing token sequence a little at a time.

    Decoding token by token is wrong for byte-level and sentencepiece vocabularies (a character can
    span tokens; leading spaces depend on the previous token), so each step decodes a small window of
    recent tokens and emits only text that has become final (no trailing U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids)
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - 6, 0)
        # True once the text read so far ends on a whole character and every token after read_offset adds no
        # text (the last token with text made it final; any after it are ids the tokenizer does not know): a
        # simple token then adds exactly its own text (Tokenizer.token_pieces). Not known for the prompt's end.
        self.clean = False

    def add(self, token_id: int) -> str:
        decode = self.tokenizer.decode
        prefix, full = self.windows(token_id)
        return self.advance(decode(prefix, self.skip_special_tokens), decode(full, self.skip_special_tokens))

    def windows(self, token_id: int) -> tuple[list[int], list[int]]:
        """Append token_id; -> the two token windows whose texts `advance` needs (so that many
        detokenizers can decode theirs in one batched call)."""
        self.tokens.append(token_id)
        return self.tokens[self.prefix_offset: self.read_offset], self.tokens[self.prefix_offset:]

    def advance(self, prefix: str, full: str) -> str:
        """-> the text that became final with the token given to `windows`."""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            self.clean = True
            return delta
        self.clean = False
        return ""

    def flush(self) -> str:
        """At the end of a sequence: the text still held back (an incomplete character decodes
        to U+FFFD, as a full decode would)."""
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset: self.read_offset], self.skip_special_tokens)
        full = decode(self.tokens[self.prefix_offset:], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.clean = False
        return full[len(prefix):]


def detokenize_runs(tokenizer: Tokenizer, detokenizers: list[IncrementalDetokenizer], runs: list[list[int]]
                    ) -> list[list[str]]:
    """IncrementalDetokenizer.add of each run's tokens in turn (several tokens a sequence, as a speculative step
    gives) -> each token's text, with every window decoded in one batched call: the windows are laid out
    as if each token made its text final (the usual case), and a sequence where one did not (a character
    split over tokens) goes on token by token from there, so the texts are those of `add`."""
    pieces = tokenizer.token_pieces
    fast: list[list[str] | None] = [None] * len(runs)
    if pieces is not None:  # (a clean detokenizer given simple tokens: each token's own text, no decode)
        size = len(pieces)
        for k, (d, run) in enumerate(zip(detokenizers, runs, strict=True)):
            if not run or not d.clean:
                continue
            texts_of_run = [pieces[t] if t < size else "" for t in run]
            if None in texts_of_run:
                continue
            for t, text in zip(run, texts_of_run, strict=True):  # (the offsets `advance` would leave)
                d.tokens.append(t)
                if text:  # (an id without text leaves them: its window adds nothing, so nothing becomes final)
                    d.prefix_offset, d.read_offset = d.read_offset, len(d.tokens)
            fast[k] = texts_of_run
    plans = []  # per sequence: [(prefix offset, read offset) before each token], its windows' first index
    windows: dict[bool, list[list[int]]] = {True: [], False: []}
    for d, run, done in zip(detokenizers, runs, fast, strict=True):
        if done is not None:
            plans.append(None)
            continue
        base = d.prefix_offset
        tokens = d.tokens[base:] + run  # (the windows start at the prefix offset or later: not the whole sequence)
        p, r, offsets = base, d.read_offset, []
        batch = windows[d.skip_special_tokens]
        first = len(batch)
        for j in range(len(run)):
            end = len(d.tokens) + j + 1
            offsets.append((p, r))
            batch += (tokens[p - base:r - base], tokens[p - base:end - base])
            p, r = r, end
        plans.append((offsets, first))
    decoded = {skip: tokenizer.decode_batch(w, skip) if w else [] for skip, w in windows.items()}
    texts = []
    for d, run, plan, done in zip(detokenizers, runs, plans, fast, strict=True):
        if done is not None:
            texts.append(done)
            continue
        offsets, first = plan
        out, texts_of = [], decoded[d.skip_special_tokens]
        for j, token in enumerate(run):
            if (d.prefix_offset, d.read_offset) == offsets[j]:  # (the windows laid out for this token hold)
                d.tokens.append(token)
                out.append(d.advance(texts_of[first + 2 * j], texts_of[first + 2 * j + 1]))
            else:
                out.append(d.add(token))
        texts.append(out)
    return texts


def find_stop_string(text: str, new_chars: int, stop_strings: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_chars` characters of text -> (index, string)."""
    if not stop_strings:
        return None
    best: tuple[int, str] | None = None
    for stop in stop_strings:
        begin = max(0, len(text) - new_chars - len(stop) + 1)
        idx = text.find(stop, begin)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def resolve_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM takes it: a file's path, or the template itself (on one line)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError as exc:  # (a long template taken for a path)
        if "{" not in value:
            raise ConfigError(f"--chat-template {value!r}: cannot read it ({exc.strerror})") from None
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"--chat-template {value!r}: no such file, and not a Jinja template either (give the "
                      "path of a .jinja file, or the template text)")
