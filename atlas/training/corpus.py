"""Training documents from what every Python installation has: its own standard library.

Three kinds of documents come out:
- `code`: the source of each standard-library module (`.py` files under the running Python's stdlib
  folder; installed packages, charmap codec tables and undecodable files are left out).
- `chat`: short ChatML conversations made from the same files: a question about a public function or
  class answered with its docstring, and a request for a function answered with its source. They teach
  the model the chat format and to end its turn with `<|im_end|>`.
- `docs`: the pydoc topics (the language reference pages `help()` shows), as plain text and as chat.

The split is by file (by topic for pydoc), decided by a hash of the seed and the file's relative path,
so it does not depend on the order files are listed in, and a file keeps its split across Python
versions that both have it. Chat documents follow the split of the file they come from.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import sysconfig
import textwrap
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")

# Folders under the stdlib directory that are not the standard library itself.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# Path prefixes (relative, with '/') of data rather than code: Python 2 fixtures of lib2to3.
_SKIP_PREFIXES = ("lib2to3/tests/data/",)
# Rendered as text documents instead (the file is one big dict literal of escaped strings).
_TOPICS_FILE = "pydoc_data/topics.py"


@dataclass(frozen=True)
class Document:
    text: str
    source: str  # "stdlib:json/decoder.py", "chat:json/decoder.py:JSONDecoder.decode", "pydoc:assert"
    kind: str  # "code" | "chat" | "docs"
    split: str  # "train" | "valid" | "test"


@dataclass
class CorpusConfig:
    seed: int = 0
    valid_fraction: float = 0.02
    test_fraction: float = 0.05
    chat: bool = True  # chat-formatted documents from docstrings and sources
    pydoc_topics: bool = True  # the pydoc topics as docs (and chat, if chat is on)
    limit_bytes: int | None = None  # a deterministic subset of about this many bytes of source, for quick runs
    stdlib_dir: str | None = None  # default: the running Python's stdlib


@dataclass
class Corpus:
    documents: list[Document]
    stdlib_dir: str
    python_version: str | None  # None: another Python's stdlib folder (CorpusConfig.stdlib_dir), version not known
    stats: dict = field(default_factory=dict)

    def split(self, name: str) -> list[Document]:
        return [d for d in self.documents if d.split == name]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _unit(key: str, seed: int) -> float:
    """A uniform number in [0, 1) determined by (seed, key)."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_of(key: str, seed: int, valid_fraction: float, test_fraction: float) -> str:
    u = _unit(key, seed)
    if u < test_fraction:
        return "test"
    if u < test_fraction + valid_fraction:
        return "valid"
    return "train"


def _is_codec_table(rel: str, text: str) -> bool:
    return rel.startswith("encodings/") and "decoding_table = (" in text


def stdlib_sources(root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path with '/', text) of every standard-library .py file worth training on, sorted."""
    root = Path(root) if root is not None else stdlib_dir()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel_parts = path.relative_to(root).parts
        if _SKIP_DIRS.intersection(rel_parts[:-1]):
            continue
        rel = "/".join(rel_parts)
        if rel == _TOPICS_FILE or rel.startswith(_SKIP_PREFIXES):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # deliberately mis-encoded test fixtures, unreadable files
        text = text.replace("\r\n", "\n")
        if not text.strip() or _is_codec_table(rel, text):
            continue
        out.append((rel, text))
    return out


def pydoc_topics() -> dict[str, str]:
    """The pydoc topics of the running Python (empty if this installation lacks pydoc_data)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return {}
    return {k: v for k, v in sorted(topics.items()) if isinstance(v, str) and v.strip()}


# ---------------------------------------------------------------------------------------------- chat


def format_chatml(messages: Iterable[dict], add_generation_prompt: bool = False) -> str:
    """Messages in ChatML, exactly as `tokenizer.CHATML_TEMPLATE` renders them."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


_EXPLAIN_QUESTIONS = (
    "What does `{name}` do?",
    "Explain `{name}` from the Python standard library.",
    "What is `{name}` in Python?",
)
_WRITE_REQUESTS = (
    "Write the function `{sig}` of `{module}`. {summary}",
    "Implement `{sig}` in Python. {summary}",
    "Show me the source of `{module}.{name}`.",
)
_TOPIC_QUESTIONS = (
    "Explain {title} in Python.",
    "Tell me about {title}.",
    "How does {title} work in Python?",
)
_MAX_DOC_CHARS = 1500
_MAX_SOURCE_CHARS = 2500
_MAX_TOPIC_CHARS = 3000


def _pick(options: tuple[str, ...], key: str) -> str:
    return options[int(_unit(key, 7) * len(options))]


def _first_paragraphs(text: str, limit: int) -> str:
    """Whole paragraphs from the start of text, up to about limit characters (at least one)."""
    out: list[str] = []
    size = 0
    for para in text.strip().split("\n\n"):
        if out and size + len(para) > limit:
            break
        out.append(para)
        size += len(para) + 2
    return "\n\n".join(out)[: limit * 2]


def _module_name(rel: str) -> str:
    name = rel[:-3].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _public_definitions(tree: ast.Module) -> Iterable[tuple[str, ast.AST]]:
    """(qualified name, node) of public top-level functions and classes, and public methods."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            yield node.name, node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not sub.name.startswith("_"):
                        yield f"{node.name}.{sub.name}", sub


def chat_from_source(rel: str, text: str) -> list[tuple[str, list[dict]]]:
    """(key, messages) conversations about the public, documented definitions of one module."""
    module = _module_name(rel)
    if any(part.startswith(("test", "idle_test", "_")) for part in module.split(".")):
        return []  # test suites and private modules: their docstrings make poor answers
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for qual, node in _public_definitions(tree):
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40:
            continue
        full = f"{module}.{qual}"
        answer = _first_paragraphs(doc, _MAX_DOC_CHARS)
        question = _pick(_EXPLAIN_QUESTIONS, full).format(name=full)
        out.append((f"{full}#explain", [{"role": "user", "content": question},
                                        {"role": "assistant", "content": answer}]))
        if isinstance(node, ast.ClassDef):
            continue
        start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
        source = textwrap.dedent("".join(lines[start:node.end_lineno])).rstrip()
        if len(source) > _MAX_SOURCE_CHARS:
            continue
        summary = doc.strip().split("\n\n")[0].replace("\n", " ")
        sig = f"{node.name}({ast.unparse(node.args)})"
        request = _pick(_WRITE_REQUESTS, full + "#write").format(sig=sig, module=module, name=qual, summary=summary)
        out.append((f"{full}#write", [{"role": "user", "content": request.strip()},
                                      {"role": "assistant", "content": f"```python\n{source}\n```"}]))
    return out


# ---------------------------------------------------------------------------------------------- corpus


def _subset(sources: list[tuple[str, str]], splits: dict[str, str], limit: int, cfg: CorpusConfig
            ) -> list[tuple[str, str]]:
    """About `limit` bytes of sources, each split getting its share and at least one file."""
    share = {"test": cfg.test_fraction, "valid": cfg.valid_fraction}
    share["train"] = 1.0 - share["test"] - share["valid"]
    keep: set[str] = set()
    for split in SPLITS:
        pool = sorted((s for s in sources if splits[s[0]] == split), key=lambda s: _unit(s[0], cfg.seed + 1))
        budget = limit * share[split]
        size = 0
        for rel, text in pool:
            if size and size + len(text) > budget:
                continue
            keep.add(rel)
            size += len(text)
    return [s for s in sources if s[0] in keep]


def build_corpus(cfg: CorpusConfig | None = None) -> Corpus:
    import platform

    cfg = cfg or CorpusConfig()
    root = Path(cfg.stdlib_dir) if cfg.stdlib_dir else stdlib_dir()
    sources = stdlib_sources(root)
    if not sources:
        raise RuntimeError(f"found no Python source files under {root}")
    splits = {rel: split_of(rel, cfg.seed, cfg.valid_fraction, cfg.test_fraction) for rel, _ in sources}
    if cfg.limit_bytes is not None:
        sources = _subset(sources, splits, cfg.limit_bytes, cfg)

    docs: list[Document] = []
    for rel, text in sources:
        split = splits[rel]
        docs.append(Document(text, f"stdlib:{rel}", "code", split))
        if cfg.chat:
            for key, messages in chat_from_source(rel, text):
                docs.append(Document(format_chatml(messages), f"chat:{rel}:{key}", "chat", split))

    topics = pydoc_topics() if cfg.pydoc_topics and cfg.limit_bytes is None else {}
    for key, text in topics.items():
        split = split_of(f"pydoc:{key}", cfg.seed, cfg.valid_fraction, cfg.test_fraction)
        text = text.strip() + "\n"
        docs.append(Document(text, f"pydoc:{key}", "docs", split))
        if cfg.chat:
            title = text.split("\n", 1)[0].strip()
            question = _pick(_TOPIC_QUESTIONS, key).format(title=title)
            answer = _first_paragraphs(text, _MAX_TOPIC_CHARS)
            docs.append(Document(format_chatml([{"role": "user", "content": question},
                                                {"role": "assistant", "content": answer}]),
                                 f"chat:pydoc:{key}", "chat", split))

    stats: dict = {"files": Counter(splits[rel] for rel, _ in sources), "documents": {}, "chars": {}}
    for d in docs:
        key = f"{d.split}/{d.kind}"
        stats["documents"][key] = stats["documents"].get(key, 0) + 1
        stats["chars"][key] = stats["chars"].get(key, 0) + len(d.text)
    stats["files"] = dict(stats["files"])
    stats["pydoc_topics"] = len(topics)
    corpus = Corpus(docs, str(root), None if cfg.stdlib_dir else platform.python_version(), stats)
    origin = f"of Python {corpus.python_version}" if corpus.python_version else f"from {root}"
    logger.info("corpus: %d stdlib files (%s) %s, %d documents, %.1f M characters",
                len(sources), ", ".join(f"{k} {v}" for k, v in sorted(stats["files"].items())),
                origin, len(docs), sum(len(d.text) for d in docs) / 1e6)
    return corpus
