"""A request's sampling fields as the engine's SamplingParams (the model's --generation-config defaults for what
it leaves out), and its one output constraint (response_format, structured_outputs or a guided_* field)."""

from __future__ import annotations

from atlas.engine.info import EngineInfo
from atlas.errors import InvalidRequestError
from atlas.sampling_params import SamplingParams, StructuredOutputsParams, check_logprobs
from atlas.server import protocol as P
from atlas.server.errors import APIError


def sampling_params(info: EngineInfo, req: P.SamplingRequest, max_tokens: int, logprobs: int | None,
                    rename: dict[str, str] | None = None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (only best_of == n)", param="best_of")
    defaults = info.sampling_defaults  # (--generation-config: for the fields the request leaves out)

    def pick(name: str, builtin: float) -> float:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, builtin)

    try:
        params = SamplingParams(
            n=req.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=structured,
            cache_salt=req.cache_salt,
            priority=req.priority or 0,
            logit_bias=req.logit_bias,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
        )
        params.check_token_ids(info.vocab_size)
        # (--max-logprobs: also checked by the engine, but here the error names the request's own field)
        params.check_logprobs_limit(info.max_logprobs)
        check_logprobs("prompt_logprobs", req.prompt_logprobs, info.max_logprobs)
        return params
    except InvalidRequestError as exc:
        param = (rename or {}).get(exc.param, exc.param)
        if param != exc.param:
            raise InvalidRequestError(str(exc).replace(exc.param, param, 1), param=param) from None
        raise


def check_stream_options(req: P.SamplingRequest, force_usage: bool = False) -> bool:
    """Whether a stream ends with a usage chunk: stream_options.include_usage, or every stream with force_usage
    (--enable-force-include-usage)."""
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs: returned only in non-streaming responses (stream: false)",
                       param="prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    return force_usage or bool(req.stream_options and req.stream_options.include_usage)


def continuous_usage(req: P.SamplingRequest) -> bool:
    """vLLM's stream_options.continuous_usage_stats (with include_usage): usage in every chunk."""
    options = req.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)


def structured_spec(req: P.SamplingRequest) -> tuple[StructuredOutputsParams, str] | None:
    """The request's output constraint and the field that gave it, from response_format, structured_outputs
    or the guided_* fields (at most one of them)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        spec = (StructuredOutputsParams(json_object=True) if fmt.type == "json_object"
                else StructuredOutputsParams(structural_tag=fmt.structural_tag()) if fmt.type == "structural_tag"
                else StructuredOutputsParams(json=fmt.json_schema.json_schema))
        found.append((spec, "response_format"))
    if req.structured_outputs is not None:
        fields = req.structured_outputs
        unknown = sorted(set(fields) - set(StructuredOutputsParams.__dataclass_fields__))
        if unknown:
            raise APIError(400, f"structured_outputs: unknown field(s) {', '.join(unknown)}; it takes "
                                f"{', '.join(StructuredOutputsParams.KINDS)}", param="structured_outputs")
        found.append((StructuredOutputsParams(**fields), "structured_outputs"))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            found.append((StructuredOutputsParams(**{kind: getattr(req, name)}), name))
    if len(found) > 1:
        raise APIError(400, f"{found[1][1]}: the output is already constrained by {found[0][1]}; give one "
                            "constraint", param=found[1][1])
    if not found:
        return None
    spec, param = found[0]
    try:
        spec.validate(param)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=param) from None
    return spec, param
