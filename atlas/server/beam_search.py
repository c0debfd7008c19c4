"""vLLM's use_beam_search on completions and chat completions: n beams (the beam width) in place of n samples.

The search is engine/beam_search.py's, driven from the front end: each step its live beams go to the engine as
one-token requests (batched with everyone else's work) and come back with their candidates' logprobs. The answer
is an ordinary response of n choices, best first, built from RequestOutputs as a sampled one is. What a beam search
would not honour is refused with its name: streaming, sampling settings, penalties, logit changes, constraints,
logprobs, echo and stop strings (stop_token_ids end a beam as the end-of-sequence tokens do).
"""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi import Request
from pydantic import BaseModel

from atlas.engine.beam_search import BeamSearch, advance_all, step_params, step_work
from atlas.outputs import CompletionOutput, RequestOutput
from atlas.sampling_params import MAX_BEAM_WIDTH, BeamSearchParams, check_beam_logprobs
from atlas.server.errors import APIError
from atlas.server.frontend import FrontEnd, PromptInfo
from atlas.server.protocol import BEAM_SEARCH_NOTHING


def check_beam_search(req: BaseModel, max_logprobs: int, logprobs_mode: str = "raw_logprobs") -> None:
    """400 naming the first field of a use_beam_search request that the search would not honour (the fields and the
    values that ask for nothing: protocol.BEAM_SEARCH_NOTHING, which /openapi.json states)."""
    for name, nothing in BEAM_SEARCH_NOTHING.items():
        value = getattr(req, name, None)
        if value is not None and not any(value == v and isinstance(value, bool) == isinstance(v, bool)
                                         for v in nothing if v is not None):
            if name == "temperature":
                raise APIError(400, "temperature: use_beam_search keeps the most likely beams: leave temperature "
                                    "out or 0", param=name)
            raise APIError(400, f"{name}: not with use_beam_search (the search returns the n most likely "
                                "continuations, whole)", param=name)
    if req.n > MAX_BEAM_WIDTH:
        raise APIError(400, f"n: the beam width, at most {MAX_BEAM_WIDTH} with use_beam_search", param="n")
    check_beam_logprobs(req.n, max_logprobs, param="n", logprobs_mode=logprobs_mode)


async def beam_search(front: FrontEnd, request: Request, req: BaseModel, request_id: str,
                      prompts: list[PromptInfo], arrival: float, lora: str | None) -> list[RequestOutput] | None:
    """Each prompt's n beams as a RequestOutput of n choices, best first; None if the client went away."""
    params = BeamSearchParams(beam_width=req.n, max_tokens=prompts[0].params.max_tokens,
                              ignore_eos=bool(req.ignore_eos),
                              length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
                              include_stop_str_in_output=bool(req.include_stop_str_in_output))
    ends = [*front.info.eos_token_ids, *(req.stop_token_ids or [])]
    searches = []
    for p in prompts:
        search = BeamSearch(p.token_ids, dataclasses.replace(params, max_tokens=p.params.max_tokens), ends)
        front.info.check_prompt_length(search.last_prompt_length)
        searches.append(search)
    step = step_params(params)
    number = 0
    while work := step_work(searches):
        streams = await asyncio.gather(*(
            front.engine.add_request({"prompt_token_ids": beam}, step, f"{request_id}-s{number}-{i}", arrival,
                                     group=request_id, lora=lora)
            for i, (_, beam) in enumerate(work)))
        outs = await front.collect(request, list(streams))
        if outs is None:
            return None
        number += 1
        advance_all(searches, work, outs)
    decode = front.tokenizer.decode if front.tokenizer is not None else None
    finals = []
    for p, search in zip(prompts, searches, strict=True):
        beams = search.output(decode).sequences
        outputs = []
        for i, beam in enumerate(beams):
            outputs.append(CompletionOutput(index=i, text=beam.text or "", token_ids=beam.output_token_ids,
                                            cumulative_logprob=beam.cum_logprob, logprobs=None,
                                            finish_reason=beam.finish_reason, stop_reason=None))
        finals.append(RequestOutput(request_id=request_id, prompt=p.text, prompt_token_ids=p.token_ids,
                                    outputs=outputs, finished=True))
    return finals
