"""Chat templates render in a sandbox with limits, exactly as transformers renders the same template."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from conftest import CHATML
from transformers import AutoTokenizer

from atlas.engine.chat_template import ChatTemplate, TemplateLimitError, TemplateLimits
from atlas.engine.core import default_model_path
from atlas.engine.tokenizer import Tokenizer
from atlas.errors import InvalidRequestError

# A template using what real ones use: namespace, loop controls, filters, tojson, the generation tag,
# special tokens, raise_exception, extra variables.
RICH = (
    "{%- set ns = namespace(n=0) -%}"
    "{%- for m in messages -%}{%- set ns.n = ns.n + 1 -%}"
    "{%- if loop.first %}{{ bos_token or '' }}{% endif -%}"
    "{%- if m.role == 'system' %}[SYS {{ m.content | trim }}]{% continue %}{% endif -%}"
    "{% generation %}<{{ m.role | upper }}>{{ m['content'] }}{% if m.reasoning_content is defined %}"
    "(thought: {{ m.reasoning_content }}){% endif %}</{{ m.role }}>{% endgeneration %}\n"
    "{%- if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif -%}"
    "{%- endfor -%}"
    "{{ ns.n }} {{ {'k': [1, 'é']} | tojson }} {{ dict(a=1) | tojson(indent=2) }} {{ '%s-%d' | format('x', 3) }}"
    "{{ '{}+{}'.format(1, 2) }} {{ eos_token ~ '!' }} {{ extra | default('none') }}"
    "{%- if add_generation_prompt %}<assistant>{% endif -%}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "  be brief  "}, {"role": "user", "content": "a <|im_start|> b"},
     {"role": "assistant", "content": "yes", "reasoning_content": "because"}, {"role": "user", "content": "é\n"}],
    [{"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": "y", "thinking": "t"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(str(default_model_path()))


@pytest.mark.parametrize("source", ["model", CHATML, RICH])
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(hf_tokenizer, source, messages, add_generation_prompt):
    source = hf_tokenizer.chat_template if source == "model" else source
    kwargs = {"extra": "E"} if source is RICH else {}
    ours = ChatTemplate(source).render(messages, add_generation_prompt, hf_tokenizer.special_tokens_map, **kwargs)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                              chat_template=source, **kwargs)
    assert ours == theirs


BOMBS = {
    "repeat": "{{ 'a' * 10**9 }}",
    "list repeat": "{{ ([1] * 10**9) | length }}",
    "power": "{{ 7 ** 100000 }}",
    "squaring": "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "concat doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}",
    "plus doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}",
    "format width": "{{ '{:>999999999}'.format(1) }}",
    "percent width": "{{ '%999999999d' % 1 }}",
    "format filter": "{{ '%999999999s' | format('x') }}",
    "center": "{{ 'a' | center(999999999) }}",
    "ljust": "{{ 'a'.ljust(999999999) }}",
    "replace": "{{ ('a' * 1000000).replace('', 'xxxxxxxxxxxxxxxxxxxxxxxxx') }}",
    "join": "{{ (['x' * 1000000] * 100) | join }}",
    "indent": "{{ ('a\n' * 100000) | indent(1000) }}",
    "captured block": "{% set s = 'x' * 1000000 %}{% set t %}{% for i in range(100) %}{{ s }}{% endfor %}{% endset %}",
    "output": "{% set s = 'x' * 1000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
    "tojson indent": "{{ messages | tojson(indent=100000000) }}",
}
LIMITS = TemplateLimits(max_chars=4 * 2**20, timeout_s=2.0)


@pytest.mark.parametrize("name", list(BOMBS))
def test_size_limits_stop_bombs_before_they_build(name):
    t0 = time.perf_counter()
    with pytest.raises(Exception) as info:  # noqa: PT011 - jinja2's SecurityError or our TemplateLimitError
        ChatTemplate(BOMBS[name], LIMITS).render([{"role": "user", "content": "hi"}])
    assert type(info.value).__name__ in ("SecurityError", "TemplateLimitError"), info.value
    assert time.perf_counter() - t0 < 1.0, "the limit acted too late"


def test_time_limit_stops_loops_and_leaves_other_threads_alone():
    nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    template = ChatTemplate(nested, TemplateLimits(timeout_s=0.5))
    other_ticks = []
    stop = threading.Event()

    def other():  # another thread keeps running meanwhile, untraced
        while not stop.is_set():
            other_ticks.append(sys.gettrace())
            time.sleep(0.01)

    t = threading.Thread(target=other)
    t.start()
    t0 = time.perf_counter()
    with pytest.raises(TemplateLimitError, match="ran for more than 0.5 s"):
        template.render([{"role": "user", "content": "hi"}])
    took = time.perf_counter() - t0
    stop.set()
    t.join()
    assert 0.45 < took < 3
    assert len(other_ticks) > 5 and all(tr is None for tr in other_ticks)
    previous = sys.gettrace()
    assert ChatTemplate("{{ messages[0].content }}").render([{"role": "user", "content": "ok"}]) == "ok"
    assert sys.gettrace() is previous  # the trace hook is gone after a render


@pytest.mark.parametrize("source", ["{{ ''.__class__.__mro__ }}", "{% set l = [] %}{{ l.append(1) }}",
                                    "{{ cycler.__init__.__globals__ }}", "{% set ns = namespace() %}"
                                    "{% set ns._x = 1 %}"])
def test_sandbox_refuses_python_internals(source):
    with pytest.raises(Exception) as info:  # noqa: PT011
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert type(info.value).__name__ in ("SecurityError", "UndefinedError"), info.value


def test_tokenizer_turns_template_failures_into_request_errors(qwen3_dir):
    tok = Tokenizer(qwen3_dir)
    messages = [{"role": "user", "content": "hi"}]
    cases = {
        "{{ raise_exception('no system messages') }}": "no system messages",
        "{% for %}": "does not compile",
        "{{ 'a' * 10**9 }}": "tried to build",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}": "recursed too deeply",
        "{{ messages[0].content + 1 }}": "failed on these messages",
    }
    for source, message in cases.items():
        with pytest.raises(InvalidRequestError, match=message) as info:
            tok.apply_chat_template(messages, chat_template=source)
        assert info.value.param == "chat_template"
    assert tok.apply_chat_template(messages) == tok.hf.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True)


# A template that reads a message's content as a list of parts (as Gemma 3's and Llama 4's do).
PARTS = "{% for m in messages %}<{{ m.role }}>{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"


def test_content_format_is_detected_from_how_the_template_reads_content():
    from atlas.engine.chat_content import content_format

    assert content_format("auto", CHATML) == "string"
    assert content_format("auto", PARTS) == "openai"
    assert content_format("auto", "{% for m in messages %}{{ m.content[0].text }}{% endfor %}") == "openai"
    assert content_format("auto", "{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p.text }}"
                                  "{% endfor %}{% endfor %}") == "openai"
    assert content_format("auto", "{% for m in messages %}{{ m.content | trim }}{% endfor %}") == "string"
    assert content_format("auto", None) == "string" and content_format("openai", CHATML) == "openai"
    assert content_format("string", PARTS) == "string"
    assert content_format("auto", "{% for m in messages %}{{ m.content ") == "string"  # (rendering reports it)


def test_text_parts_reach_the_template_as_the_content_format_says(qwen3_dir):
    """Over HTTP and offline: a list of text parts is joined by newlines for a string template, and handed over as
    parts (a string as one part) to a template that loops over them, as vLLM renders both."""
    import httpx
    from serving import start_server

    from atlas import LLM, SamplingParams

    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    server = start_server(str(qwen3_dir), kv_cache_memory="4MiB", max_model_len=128)
    try:
        def ids(body):
            reply = httpx.post(server.url + "/tokenize", json=body, timeout=30)
            assert reply.status_code == 200, reply.text
            return reply.json()["tokens"]

        assert ids({"messages": [{"role": "user", "content": parts}]}) == ids(
            {"messages": [{"role": "user", "content": "a\nb"}]})
        # the Responses API's input parts alike
        counts = [httpx.post(server.url + "/v1/responses", timeout=30, json={
            "model": str(qwen3_dir), "max_output_tokens": 1, "input": [{"role": "user", "content": content}]}
        ).json()["usage"]["input_tokens"] for content in (
            [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}], "a\nb", "ab")]
        assert counts[0] == counts[1] != counts[2]
    finally:
        server.stop()
    # (the string format hands PARTS strings, whose characters it loops over: an empty [] each)
    for settings, want in (({}, "<user>[x]<user>[a][b]"),
                           ({"chat_template_content_format": "string"}, "<user>[]<user>[][][]")):
        server = start_server(str(qwen3_dir), settings=settings, kv_cache_memory="4MiB", max_model_len=128,
                              chat_template=PARTS)
        try:
            got = httpx.post(server.url + "/tokenize", timeout=30, json={"messages": [
                {"role": "user", "content": "x"}, {"role": "user", "content": parts}], "add_generation_prompt": False})
            text = httpx.post(server.url + "/tokenize", timeout=30, json={"prompt": want, "add_special_tokens": False})
            assert got.status_code == text.status_code == 200, (got.text, text.text)
            assert got.json()["tokens"] == text.json()["tokens"], settings
        finally:
            server.stop()
    llm = LLM(str(qwen3_dir), kv_cache_memory="4MiB", max_model_len=128, chat_template=PARTS)
    params = SamplingParams(max_tokens=1)
    out = llm.chat([{"role": "user", "content": "x"}, {"role": "user", "content": parts}], params)[0]
    assert out.prompt_token_ids == llm.engine.tokenizer.encode("<user>[x]<user>[a][b]", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="only text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)


def test_offline_chat_takes_vllm_s_parameters_in_vllm_s_order(qwen3_dir):
    """LLM.chat(messages, sampling_params, use_tqdm, lora_request, chat_template, ...) as vLLM's: a template of the
    caller's own, the tools and extra template variables reach the template; one sampling params each; a variable
    the parameters set, or multimodal processor settings, are refused by name."""
    from atlas import LLM, SamplingParams

    llm = LLM(str(qwen3_dir), kv_cache_memory="4MiB", max_model_len=128)
    template = ("{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if tools %}[{{ tools | length }} tools]"
                "{% endif %}{{ greeting }}{% if add_generation_prompt %}!{% endif %}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    params = SamplingParams(max_tokens=1, temperature=0)
    conversations = [[{"role": "user", "content": "x"}], [{"role": "user", "content": "y"}]]
    outs = llm.chat(conversations, [params, SamplingParams(max_tokens=2, temperature=0)], False, None, template,
                    tools=tools, chat_template_kwargs={"greeting": "hi"})
    encode = llm.engine.tokenizer.encode
    assert [o.prompt_token_ids for o in outs] == [encode(f"<{c}>[1 tools]hi!", add_special_tokens=False)
                                                  for c in "xy"]
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2]
    plain = llm.chat(conversations[0], params, chat_template=template, add_generation_prompt=False)[0]
    assert plain.prompt_token_ids == encode("<x>", add_special_tokens=False)
    for kwargs, name in [({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
                         ({"chat_template_kwargs": {"add_generation_prompt": False}},
                          "chat_template_kwargs.add_generation_prompt"),
                         ({"mm_processor_kwargs": {"fps": 1}}, "mm_processor_kwargs")]:
        with pytest.raises(InvalidRequestError, match=name):
            llm.chat(conversations[0], params, **kwargs)
