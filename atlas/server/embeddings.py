"""POST /v1/embeddings (a server started with --runner pooling on an embedding checkpoint): the inputs' pooled
vectors, shortened for a matryoshka model's `dimensions`, as floats or base64; and POST /classify (vLLM's: on a
sequence-classification checkpoint, each input's class probabilities) and POST /pooling (vLLM's: the raw pooled
output of either kind of model)."""

from __future__ import annotations

import base64
import math
import struct
import time

from fastapi import Request
from fastapi.responses import Response

from atlas.engine.async_engine import EngineStepError
from atlas.engine.info import check_pooled_length
from atlas.errors import InvalidRequestError, PromptTooLongError
from atlas.outputs import ClassificationOutput
from atlas.sampling_params import SamplingParams
from atlas.server import protocol as P
from atlas.server.bodies import json_response
from atlas.server.errors import APIError, raise_if_failed
from atlas.server.frontend import HEAVY_CHARS, INLINE_PROMPT_CHARS, FrontEnd, PromptInfo


def _shorten(vector: list[float], dimensions: int, normalized: bool) -> list[float]:
    """A matryoshka embedding's first `dimensions` values (L2-normalized again when the model's vectors are:
    the same as normalizing the pooled vector's first values, as vLLM does)."""
    head = vector[:dimensions]
    if not normalized:
        return head
    norm = math.sqrt(sum(v * v for v in head)) or 1.0
    return [v / norm for v in head]


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as floats, or base64 of its little-endian float32 values (what the openai client asks for)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


class Embeddings:
    """The /v1/embeddings endpoint over a FrontEnd."""

    def __init__(self, front: FrontEnd):
        self.front = front

    def check_dimensions(self, dimensions: int | None) -> int | None:
        """The request's `dimensions`: only for a matryoshka model (config.json's is_matryoshka or
        matryoshka_dimensions, as vLLM reads them), within its hidden size and the lengths it lists."""
        if dimensions is None:
            return None
        info = self.front.info
        if not info.matryoshka:
            raise APIError(400, "dimensions: this model does not support matryoshka representation (its config.json "
                                "sets neither is_matryoshka nor matryoshka_dimensions), so its embeddings cannot be "
                                "shortened; leave dimensions out", param="dimensions")
        allowed = info.matryoshka_dimensions
        if dimensions > info.embedding_size or (allowed and dimensions not in allowed):
            choices = ", ".join(map(str, allowed)) if allowed else f"1 to {info.embedding_size}"
            raise APIError(400, f"dimensions: {dimensions} is not a length this model's embeddings come in ({choices})",
                           param="dimensions")
        return dimensions

    def embedding_prompts(self, req: P.PooledInputRequest) -> list[PromptInfo]:
        """Tokenize and check every input (runs in the preprocessing pool)."""
        params = SamplingParams(max_tokens=1)
        prompts = []
        for item in req.inputs():
            if isinstance(item, str):
                ids = self.front.need_tokenizer("input").encode(item, add_special_tokens=req.add_special_tokens)
                if not ids:
                    raise InvalidRequestError("the input has no tokens", param="input")
            else:
                try:
                    ids = self.front.info.check_prompt_ids(item)
                except InvalidRequestError as exc:
                    raise InvalidRequestError(str(exc), param="input") from None
            kept = self.front.truncated(ids, req)
            check_pooled_length(len(kept), self.front.info.max_model_len)
            prompts.append(PromptInfo(item if isinstance(item, str) and len(kept) == len(ids) else None, kept,
                                      params))
        return prompts

    async def create(self, request: Request) -> Response:
        got = await self._pool(request, P.EmbeddingRequest, "embd", "embed")
        if got is None:
            return Response(status_code=499)
        req, model, request_id, vectors, tokens = got
        dimensions = req.dimensions  # (checked by _pool)
        data = []
        for i, vector in enumerate(vectors):
            if dimensions is not None:
                vector = _shorten(vector, dimensions, self.front.info.normalized)
            data.append(P.EmbeddingData(index=i, embedding=_encoded(vector, req.encoding_format)))
        return json_response(P.EmbeddingResponse(id=request_id, model=model, data=data,
                                                 usage=P.EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)))

    async def classify(self, request: Request) -> Response:
        """POST /classify: each input's class probabilities (softmax of the classifier's logits; the sigmoid of a
        single-label model's one logit), and the most probable class's label."""
        got = await self._pool(request, P.ClassificationRequest, "classify", "classify")
        if got is None:
            return Response(status_code=499)
        _, model, request_id, logits, tokens = got
        labels = self.front.info.class_labels
        data = []
        for i, row in enumerate(logits):
            probs = ClassificationOutput.from_logits(row).probs
            data.append(P.ClassificationData(index=i, label=labels[max(range(len(probs)), key=probs.__getitem__)],
                                             probs=probs, num_classes=len(probs)))
        return json_response(P.ClassificationResponse(id=request_id, model=model, data=data,
                                                      usage=P.UsageInfo(prompt_tokens=tokens, total_tokens=tokens)))

    async def pooling(self, request: Request) -> Response:
        """POST /pooling (vLLM's): each input's raw pooled output, whatever the model: an embedding model's vector
        (as /v1/embeddings gives it), a sequence classifier's class logits (before the softmax: a reward model's
        score)."""
        got = await self._pool(request, P.PoolingRequest, "pool", "any")
        if got is None:
            return Response(status_code=499)
        req, model, request_id, vectors, tokens = got
        data = [P.PoolingData(index=i, data=_encoded(vector, req.encoding_format)) for i, vector in enumerate(vectors)]
        return json_response(P.PoolingResponse(id=request_id, model=model, data=data,
                                               usage=P.UsageInfo(prompt_tokens=tokens, total_tokens=tokens)))

    async def _pool(self, request: Request, body: type[P.PooledInputRequest], prefix: str, kind: str):
        """A pooling route's request parsed and checked, and its inputs pooled: (request body, served model name,
        request id, vectors, input tokens), or None when the client went away."""
        arrival = time.time()
        req = await self.front.parse_body(request, body)
        model = self.front.check_model(req.model)
        if kind == "embed" and self.front.info.runner == "pooling":
            self.check_dimensions(req.dimensions)  # (before the work: a bad length is the request's fault)
        request_id = self.front.request_id(request, prefix)
        got = await self.pooled(request, req, request_id, arrival, kind=kind)
        return None if got is None else (req, model, request_id, *got)

    async def pooled(self, request: Request, req: P.PooledInputRequest, request_id: str, arrival: float,
                     kind: str = "embed") -> tuple[list[list[float]], int] | None:
        """Each input's pooled vector (a classifier's: its class logits), in order, and the inputs' tokens (None:
        the client went away). kind: the route's ("embed", "classify" or "any"), refused on a model of the other
        kind. Also the way in of /score and /rerank (server/scores.py)."""
        info = self.front.info
        if info.runner != "pooling":
            raise APIError(400, "this server generates text; embeddings and classes need an embedding or sequence-"
                                "classification checkpoint served with --runner pooling (vLLM's flag; --task embed "
                                "is its older form)")
        if kind == "classify" and info.class_labels is None:
            raise APIError(400, "this server's model computes embeddings, not classes: /classify needs a sequence-"
                                "classification checkpoint (*ForSequenceClassification)")
        if kind == "embed" and info.class_labels is not None:
            raise APIError(400, f"this server's model is a sequence classifier ({len(info.class_labels)} classes): "
                                "its outputs are class probabilities, not embeddings; use POST /classify")
        inputs = req.inputs()
        cap = self.front.settings.max_request_list_items
        if len(inputs) > cap:
            raise APIError(400, f"input: {len(inputs):,} items; this server takes at most {cap:,} "
                                "(--max-request-list-items)", param="input")
        self.front.check_sequences(len(inputs), 1)
        per_token, context = self.front.settings.max_prompt_chars_per_token, self.front.info.max_model_len
        chars = context * per_token
        if req.truncate_prompt_tokens is None and any(isinstance(t, str) and len(t) > chars for t in inputs):
            raise PromptTooLongError(f"an input has more than {per_token} characters "
                                     f"per token of the context ({context:,} tokens, --max-model-len) "
                                     "could hold; shorten it", param="input")
        small = sum(len(t) for t in inputs if isinstance(t, str)) <= INLINE_PROMPT_CHARS
        heavy = sum(len(t) for t in inputs if isinstance(t, str)) > HEAVY_CHARS
        prompts = (self.embedding_prompts(req) if small
                   else await self.front.run_blocking(self.embedding_prompts, req, heavy=heavy))
        streams = await self.front.start(request_id, prompts, arrival)
        finals = await self.front.collect(request, streams)
        if finals is None:
            return None
        vectors = []
        for out in finals:
            for c in out.outputs:
                raise_if_failed(c)
            if out.embedding is None:
                raise EngineStepError("the engine returned no embedding for this input")
            vectors.append(out.embedding)
        return vectors, sum(len(p.token_ids) for p in prompts)
