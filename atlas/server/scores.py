"""POST /score and /rerank (vLLM's, on a server started with --runner pooling): pairs of texts scored by the
model's kind (atlas/scoring.py). An embedding model: the cosine similarity of the two texts' embeddings, computed
from the same pooled vectors /v1/embeddings returns (in float64, whatever the model's normalization). A sequence
classifier with one label (a cross-encoder reranker): its logit over the two texts as one prompt, through the
activation its checkpoint names.

/score pairs text_1 with text_2 as vLLM does: one text against a list scores it against each, two lists of one
length pair by index. /rerank scores each document against the query and returns them best first (ties: the
earlier document first), top_n of them (all when left out or 0).
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from atlas.scoring import activate, check_cross_encoder, cosine, cross_encoder_prompt, pair_texts
from atlas.server import protocol as P
from atlas.server.bodies import json_response
from atlas.server.embeddings import Embeddings


class Scores:
    """The /score and /rerank endpoints over the embeddings endpoint's pooling."""

    def __init__(self, embeddings: Embeddings):
        self.embeddings = embeddings
        self.front = embeddings.front

    async def _scores(self, request: Request, pairs: list[tuple[str, str]], truncate: int | None, request_id: str,
                      arrival: float) -> tuple[list[float], int] | None:
        """Each pair's score and the tokens the model read (None: the client went away)."""
        info = self.front.info
        if info.runner == "pooling" and info.class_labels is not None:
            check_cross_encoder(info.class_labels, info.score_activation)
            body = P.ClassificationRequest(input=[cross_encoder_prompt(q, d) for q, d in pairs],
                                           truncate_prompt_tokens=truncate)
            got = await self.embeddings.pooled(request, body, request_id, arrival, kind="classify")
            if got is None:
                return None
            logits, tokens = got
            return [activate(row[0], info.score_activation) for row in logits], tokens
        distinct = list(dict.fromkeys(t for pair in pairs for t in pair))  # (a text given twice is embedded once)
        body = P.EmbeddingRequest(input=distinct, truncate_prompt_tokens=truncate)
        got = await self.embeddings.pooled(request, body, request_id, arrival)
        if got is None:
            return None
        vectors, tokens = got
        by_text = dict(zip(distinct, vectors, strict=True))
        return [cosine(by_text[a], by_text[b]) for a, b in pairs], tokens

    async def score(self, request: Request) -> Response:
        arrival = time.time()
        req: P.ScoreRequest = await self.front.parse_body(request, P.ScoreRequest)
        model = self.front.check_model(req.model)
        pairs = pair_texts(req.text_1, req.text_2)
        request_id = self.front.request_id(request, "score")
        got = await self._scores(request, pairs, req.truncate_prompt_tokens, request_id, arrival)
        if got is None:
            return Response(status_code=499)
        scores, tokens = got
        data = [P.ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        return json_response(P.ScoreResponse(id=request_id, model=model, data=data,
                                             usage=P.EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)))

    async def rerank(self, request: Request) -> Response:
        arrival = time.time()
        req: P.RerankRequest = await self.front.parse_body(request, P.RerankRequest)
        model = self.front.check_model(req.model)
        request_id = self.front.request_id(request, "rerank")
        got = await self._scores(request, [(req.query, doc) for doc in req.documents], req.truncate_prompt_tokens,
                                 request_id, arrival)
        if got is None:
            return Response(status_code=499)
        scores, tokens = got
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        if req.top_n:
            order = order[: req.top_n]
        results = [P.RerankResult(index=i, relevance_score=scores[i],
                                  document=P.RerankDocument(text=req.documents[i]) if req.return_documents else None)
                   for i in order]
        return json_response(P.RerankResponse(id=request_id, model=model, usage=P.RerankUsage(total_tokens=tokens),
                                              results=results))
