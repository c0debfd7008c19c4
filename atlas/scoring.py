"""Scoring text pairs (vLLM's LLM.score, POST /score and /rerank) on a --runner pooling engine.

Two kinds of model score a pair. An embedding model: the cosine similarity of the two texts' embeddings. A sequence
classifier with one label (a cross-encoder reranker such as a Qwen3 or Llama *ForSequenceClassification fine-tuned
for relevance): its logit over the two texts as one prompt, through the activation its checkpoint names. As vLLM
does for a decoder-only ("LLM as reranker") model, the prompt is the query's text followed by the document's, with
no separator, tokenized as one text (the tokenizer's usual special tokens added); the activation is the
sentence-transformers one in config.json (`sentence_transformers.activation_fn`, or
`sbert_ce_default_activation_function`), else the sigmoid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from atlas.errors import InvalidRequestError

# The activations a cross-encoder's config may name (torch.nn.modules.*), by their class name. vLLM applies its
# classify activation for Sigmoid and Softmax, which for one label is the sigmoid.
_ACTIVATIONS = {"Sigmoid": "sigmoid", "Softmax": "sigmoid", "Identity": "identity", "Tanh": "tanh"}


def cross_encoder_activation(raw: dict) -> str:
    """The activation (sigmoid, identity, tanh) a classifier's config.json names for scoring pairs, or the
    qualified name it gives when Atlas does not implement that one (refused when a pair is scored)."""
    name = None
    st = raw.get("sentence_transformers")
    if isinstance(st, dict) and st.get("activation_fn"):
        name = st["activation_fn"]
    elif raw.get("sbert_ce_default_activation_function"):
        name = raw["sbert_ce_default_activation_function"]
    if name is None:
        return "sigmoid"
    name = str(name)
    if name.startswith("torch.nn.modules.") and name.rsplit(".", 1)[-1] in _ACTIVATIONS:
        return _ACTIVATIONS[name.rsplit(".", 1)[-1]]
    return name


def check_cross_encoder(class_labels: Sequence[str], activation: str) -> None:
    """A classifier can score pairs: it has one label and an activation Atlas implements."""
    if len(class_labels) != 1:
        raise InvalidRequestError(
            f"this model is a sequence classifier of {len(class_labels)} classes: scoring a pair needs a "
            "cross-encoder with one label (num_labels 1); use /classify for class probabilities")
    if activation not in ("sigmoid", "identity", "tanh"):
        raise InvalidRequestError(
            f"this cross-encoder's config.json names the scoring activation {activation!r}, which Atlas does not "
            "implement (Sigmoid, Softmax, Identity and Tanh are)")


def cross_encoder_prompt(query: str, document: str) -> str:
    """The one prompt a decoder-only cross-encoder reads for a pair (vLLM's: the texts back to back)."""
    return query + document


def activate(logit: float, activation: str) -> float:
    """A cross-encoder's score from its one logit."""
    if activation == "identity":
        return logit
    if activation == "tanh":
        return math.tanh(logit)
    return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1.0 + math.exp(logit))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two vectors, summed in float64 (0 for a zero vector)."""
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm else 0.0


def pair_texts(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing of a score call's two sides: one text against a list scores it against each (either side);
    two lists of one length pair by index; anything else is refused."""
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    for side, texts in (("text_1", left), ("text_2", right)):
        if not texts:
            raise InvalidRequestError(f"{side}: give at least one text", param=side)
        if not all(isinstance(t, str) and t for t in texts):
            raise InvalidRequestError(f"{side}: every item must be a non-empty string", param=side)
    if len(left) == 1:
        return [(left[0], r) for r in right]
    if len(right) == 1:
        return [(item, right[0]) for item in left]
    if len(left) != len(right):
        raise InvalidRequestError(f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text on a side, "
                                  "or lists of one length (paired by index)", param="text_2")
    return list(zip(left, right, strict=True))
