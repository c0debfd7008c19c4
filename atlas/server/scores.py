"""POST /score and /rerank (vLLM's, on a server started with --runner pooling on an embedding checkpoint): the
cosine similarity of two texts' embeddings, computed from the same pooled vectors /v1/embeddings returns (in
float64, whatever the model's normalization).

/score pairs text_1 with text_2 as vLLM does: one text against a list scores it against each, two lists of one
length pair by index. /rerank scores each document against the query and returns them best first (ties: the
earlier document first), top_n of them (all when left out or 0).
"""

from __future__ import annotations

import math
import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from atlas.server import protocol as P
from atlas.server.bodies import json_response
from atlas.server.embeddings import Embeddings
from atlas.server.errors import APIError


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm else 0.0


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing of /score's two fields (a 400 for two lists of different lengths)."""
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(left) == 1:
        return [(left[0], r) for r in right]
    if len(right) == 1:
        return [(item, right[0]) for item in left]
    if len(left) != len(right):
        raise APIError(400, f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text on a side, or "
                            "lists of one length (paired by index)", param="text_2")
    return list(zip(left, right, strict=True))


class Scores:
    """The /score and /rerank endpoints over the embeddings endpoint's pooling."""

    def __init__(self, embeddings: Embeddings):
        self.embeddings = embeddings
        self.front = embeddings.front

    async def _vectors(self, request: Request, texts: list[str], truncate: int | None, request_id: str,
                       arrival: float) -> tuple[dict[str, list[float]], int] | None:
        """Each distinct text's vector (a text given twice is embedded once) and the tokens embedded."""
        distinct = list(dict.fromkeys(texts))
        body = P.EmbeddingRequest(input=distinct, truncate_prompt_tokens=truncate)
        got = await self.embeddings.pooled(request, body, request_id, arrival)
        if got is None:
            return None
        vectors, tokens = got
        return dict(zip(distinct, vectors, strict=True)), tokens

    async def score(self, request: Request) -> Response:
        arrival = time.time()
        req: P.ScoreRequest = await self.front.parse_body(request, P.ScoreRequest)
        model = self.front.check_model(req.model)
        pairs = score_pairs(req.text_1, req.text_2)
        request_id = f"score-{uuid.uuid4().hex}"
        got = await self._vectors(request, [t for pair in pairs for t in pair], req.truncate_prompt_tokens,
                                  request_id, arrival)
        if got is None:
            return Response(status_code=499)
        vectors, tokens = got
        data = [P.ScoreData(index=i, score=cosine(vectors[a], vectors[b])) for i, (a, b) in enumerate(pairs)]
        return json_response(P.ScoreResponse(id=request_id, model=model, data=data,
                                             usage=P.EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)))

    async def rerank(self, request: Request) -> Response:
        arrival = time.time()
        req: P.RerankRequest = await self.front.parse_body(request, P.RerankRequest)
        model = self.front.check_model(req.model)
        request_id = f"rerank-{uuid.uuid4().hex}"
        got = await self._vectors(request, [req.query, *req.documents], req.truncate_prompt_tokens, request_id,
                                  arrival)
        if got is None:
            return Response(status_code=499)
        vectors, tokens = got
        query = vectors[req.query]
        scores = [cosine(query, vectors[doc]) for doc in req.documents]
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        if req.top_n:
            order = order[: req.top_n]
        results = [P.RerankResult(index=i, relevance_score=scores[i],
                                  document=P.RerankDocument(text=req.documents[i]) if req.return_documents else None)
                   for i in order]
        return json_response(P.RerankResponse(id=request_id, model=model, usage=P.RerankUsage(total_tokens=tokens),
                                              results=results))
