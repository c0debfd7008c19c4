"""The tool-call parsers of the model families users run, named as vLLM names them (qwen3_coder, glm45, mistral,
pythonic / llama4_pythonic, openai = gpt-oss's harmony format, gemma4, deepseek_v3, deepseek_v31, deepseek_v32,
minimax_m2, granite) and the reasoning parsers that go with them, over
replies written as each model writes them (from the published chat templates and the formats' documents):
each reply parsed whole, and streamed in chunks of many sizes (one character at a time included, so every split
inside a marker), the stream put together equal to the whole reply. One test over real HTTP with the `openai`
client."""

from __future__ import annotations

import json
import random
import re

import pytest

from atlas.server.output_parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ChoiceParser,
    HarmonyToolParser,
    ReasoningParser,
)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temperature": {"type": "number"},
    "metric": {"type": "boolean"}, "options": {"type": "object"}, "tags": {"type": "array"},
    "zip": {"type": "string"}, "when": {"type": ["string", "null"]}}}
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}


def choice(tools: str | None, reasoning: str | None = None, calls: bool = True, max_calls: int | None = None
           ) -> ChoiceParser:
    """The parser the server builds for one choice (app.chat's choice_parser, with tool_choice auto)."""
    parser = TOOL_PARSERS[tools](SCHEMAS) if tools else None
    if tools == "openai" or reasoning == "openai_gptoss":
        return ChoiceParser(None, parser if calls and tools == "openai" else HarmonyToolParser(calls=False),
                            max_calls)
    return ChoiceParser(ReasoningParser(reasoning) if reasoning else None, parser, max_calls)


def whole(make, text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    parsed = make().parse(text, final=True)
    return parsed.reasoning, parsed.content, [(c.name, c.arguments) for c in parsed.calls if c.name is not None]


def streamed(make, text: str, cuts: list[int]) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """Put a stream back together the way a client does: deltas of each longer prefix."""
    parser, reasoning, content, calls, ids = make(), "", "", {}, set()
    model_ids = [call.id for call in make().parse(text, final=True).calls]  # (kimi_k2's calls carry their own)
    for end in cuts:
        r, c, deltas = parser.delta(text[:end], final=end == len(text))
        reasoning += r or ""
        content += c or ""
        for d in deltas:
            if d["index"] not in calls:
                own = model_ids[d["index"]] if d["index"] < len(model_ids) else None
                assert d.get("id") == own if own else d.get("id", "").startswith("call_")
                assert d["id"] not in ids and d["type"] == "function"
                assert d["index"] == len(calls), "calls are streamed in order"
                ids.add(d["id"])
                calls[d["index"]] = [d["function"]["name"], ""]
            else:
                assert "id" not in d and "name" not in d["function"], "a call's id and name come once"
            calls[d["index"]][1] += d["function"].get("arguments", "")
    return reasoning or None, content or None, [tuple(c) for c in calls.values()]


def chunkings(text: str) -> list[list[int]]:
    """Cut points: one character at a time, fixed sizes, random sizes, and the whole text at once."""
    n = len(text)
    out = [list(range(1, n + 1)), [n]]
    for size in (2, 3, 5, 11):
        out.append([*range(size, n, size), n])
    rng = random.Random(n)
    for _ in range(3):
        cuts, at = [], 0
        while at < n:
            at = min(n, at + rng.randint(1, 9))
            cuts.append(at)
        out.append(cuts)
    return out


def check(make, text: str, expected) -> None:
    assert whole(make, text) == expected
    for cuts in chunkings(text):
        assert streamed(make, text, cuts) == expected, cuts


def args(**kw) -> str:
    return json.dumps(kw, ensure_ascii=False)


# ---------------------------------------------------------------------------------- qwen3_coder
QWEN3_CODER = [
    # content before two calls, values typed by the schema (string stays string even when it looks numeric)
    ("I'll check both cities.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=temperature>\n21.5\n</parameter>\n<parameter=metric>\nTrue\n"
     "</parameter>\n<parameter=zip>\n07030\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
     "<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n<parameter=options>\n"
     '{"hourly": true, "lang": "fr"}\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
     "<parameter=when>\nnull\n</parameter>\n</function>\n</tool_call>",
     (None, "I'll check both cities.\n",
      [("get_weather", args(city="Dallas", days=3, temperature=21.5, metric=True, zip="07030")),
       ("get_weather", args(city="San Francisco, CA", options={"hourly": True, "lang": "fr"}, tags=["a", "b"],
                            when=None))])),
    # no content; a number that is whole becomes an integer; text that is not its type stays text; a parameter
    # the schema does not declare stays text; a multi-line value keeps its inner newlines
    ("<tool_call>\n<function=get_weather>\n<parameter=temperature>\n20.0\n</parameter>\n<parameter=days>\nthree\n"
     "</parameter>\n<parameter=note>\n42\n</parameter>\n<parameter=city>\nline one\nline two\n</parameter>\n"
     "</function>\n</tool_call>",
     (None, None, [("get_weather", args(temperature=20, days="three", note="42", city="line one\nline two"))])),
    # a tool not in the request: every value is text; a call without parameters
    ("<tool_call>\n<function=lookup>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
     "<function=get_time>\n</function>\n</tool_call>",
     (None, None, [("lookup", args(n="5")), ("get_time", "{}")])),
    # parameters closed only by the next one or by </function> (vLLM reads them the same)
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>\n</tool_call>",
     (None, None, [("get_weather", args(city="Rome", days=2))])),
    # plain text, and text that only looks like the start of a tag
    ("No tools needed: 2 + 2 = 4. <tool_ and <function are just words.",
     (None, "No tools needed: 2 + 2 = 4. <tool_ and <function are just words.", [])),
    # cut off by max_tokens inside a value: the call keeps what it finished and the cut value (vLLM likewise)
    ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n1",
     (None, "Checking.\n", [("get_weather", args(city="Oslo", days=1))])),
    # <tool_call> without any function: the reply is content (vLLM)
    ("<tool_call>\nnothing here\n</tool_call>", (None, "<tool_call>\nnothing here\n</tool_call>", [])),
    # a function header that never closes: content, as vLLM
    ("<tool_call>\n<function=get_weath", (None, "<tool_call>\n<function=get_weath", [])),
]


@pytest.mark.parametrize("text,expected", QWEN3_CODER)
def test_qwen3_coder(text, expected):
    check(lambda: choice("qwen3_coder"), text, expected)


def test_qwen3_coder_under_qwen3_reasoning():
    text = ("<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>")
    check(lambda: choice("qwen3_coder", "qwen3"), text,
          ("\nThe user wants the weather.\n", None, [("get_weather", args(city="Paris"))]))


# ---------------------------------------------------------------------------------- glm45
GLM45 = [
    ("I'll look that up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>options</arg_key>\n"
     '<arg_value>{"unit": "C"}</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>',
     (None, "I'll look that up.\n",
      [("get_weather", args(city="Beijing", days=3, options={"unit": "C"})), ("get_time", "{}")])),
    # a string parameter stays text even when it reads as JSON; others are JSON, then Python literals, then text
    ("<tool_call>get_weather\n<arg_key>zip</arg_key>\n<arg_value>07030</arg_value>\n<arg_key>metric</arg_key>\n"
     "<arg_value>true</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>['x', 'y']</arg_value>\n"
     "<arg_key>city</arg_key>\n<arg_value> Ho Chi Minh City </arg_value>\n<arg_key>mood</arg_key>\n"
     "<arg_value>sunny day</arg_value>\n</tool_call>",
     (None, None, [("get_weather", args(zip="07030", metric=True, tags=["x", "y"], city="Ho Chi Minh City",
                                        mood="sunny day"))])),
    # GLM-4.7 writes the name and pairs without newlines; a call with no arguments and no newline
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>"
     "<tool_call>get_time</tool_call>",
     (None, None, [("get_weather", args(city="Rome")), ("get_time", "{}")])),
    ("Just text, no calls.", (None, "Just text, no calls.", [])),
    # a call the reply's end cut off is content, not a call (vLLM: not a call either)
    ("Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_val",
     (None, "Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_val", [])),
    # after a finished call, an unfinished one is added to the content (vLLM drops it)
    ("<tool_call>get_time\n</tool_call><tool_call>get_weather\n<arg_key>ci",
     (None, "<tool_call>get_weather\n<arg_key>ci", [("get_time", "{}")])),
]


@pytest.mark.parametrize("text,expected", GLM45)
def test_glm45(text, expected):
    check(lambda: choice("glm45"), text, expected)


# ---------------------------------------------------------------------------------- deepseek_v3 / deepseek_v31
TCB, TCE, TB, TE, TS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                        "<｜tool▁sep｜>")
DEEPSEEK_V3 = [
    # content, then two calls in the published layout (arguments as the model wrote them)
    (f"Let me check.{TCB}{TB}function{TS}get_weather\n```json\n{{\"city\": \"Paris\", \"days\": 2}}\n```{TE}\n"
     f"{TB}function{TS}get_time\n```json\n{{}}\n```{TE}{TCE}",
     (None, "Let me check.", [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", "{}")])),
    # no content; multi-line arguments
    (f"{TCB}{TB}function{TS}get_weather\n```json\n{{\n  \"city\": \"Oslo\"\n}}\n```{TE}{TCE}",
     (None, None, [("get_weather", '{\n  "city": "Oslo"\n}')])),
    # the calls marker left out
    (f"{TB}function{TS}get_time\n```json\n{{}}\n```{TE}", (None, None, [("get_time", "{}")])),
    ("Plain text: <｜ is just text here.", (None, "Plain text: <｜ is just text here.", [])),
    # cut off inside a call: content (as glm45 here)
    (f"Sure.{TCB}{TB}function{TS}get_weather\n```json\n{{\"ci",
     (None, f"Sure.{TB}function{TS}get_weather\n```json\n{{\"ci", [])),
    # a call not in the format (no code fence) is content; the calls marker with no call is content, less the marker
    (f"{TCB}{TB}function{TS}get_time {{}}{TE}", (None, f"{TB}function{TS}get_time {{}}{TE}", [])),
    (f"Nothing to call.{TCB}", (None, "Nothing to call.", [])),
]
DEEPSEEK_V31 = [
    (f"Checking.{TCB}{TB}get_weather{TS}{{\"city\": \"Lima\"}}{TE}{TB}get_time{TS}{{}}{TE}{TCE}",
     (None, "Checking.", [("get_weather", '{"city": "Lima"}'), ("get_time", "{}")])),
    (f"{TCB}{TB}get_weather{TS}{{\"city\": \"Lima\"", (None, f"{TB}get_weather{TS}{{\"city\": \"Lima\"", [])),
    (f"{TCB}{TB}{TS}{{}}{TE}", (None, f"{TB}{TS}{{}}{TE}", [])),  # no name: not a call
    ("No tools.", (None, "No tools.", [])),
]


@pytest.mark.parametrize("text,expected", DEEPSEEK_V3)
def test_deepseek_v3(text, expected):
    check(lambda: choice("deepseek_v3"), text, expected)


@pytest.mark.parametrize("text,expected", DEEPSEEK_V31)
def test_deepseek_v31(text, expected):
    check(lambda: choice("deepseek_v31"), text, expected)


DS = "｜DSML｜"
DSML_CALLS = (f'\n\n<{DS}function_calls>\n<{DS}invoke name="get_weather">\n'
              f'<{DS}parameter name="city" string="true">杭州 "west"</{DS}parameter>\n'
              f'<{DS}parameter name="days" string="false">2</{DS}parameter>\n'
              f'<{DS}parameter name="options" string="false">{{"unit": "C"}}</{DS}parameter>\n</{DS}invoke>\n'
              f'<{DS}invoke name="get_time">\n\n</{DS}invoke>\n</{DS}function_calls>')
DEEPSEEK_V32 = [
    # content before the block (its two newlines kept, as vLLM's); string="true" values are text, "false" JSON
    ("Let me check." + DSML_CALLS,
     (None, "Let me check.\n\n", [("get_weather", args(city='杭州 "west"', days=2, options={"unit": "C"})),
                                   ("get_time", "{}")])),
    (DSML_CALLS.lstrip("\n"), (None, None, [("get_weather", args(city='杭州 "west"', days=2, options={"unit": "C"})),
                                             ("get_time", "{}")])),
    # a "false" value that is not JSON stays text
    (f'<{DS}function_calls>\n<{DS}invoke name="get_weather">\n<{DS}parameter name="days" string="false">two'
     f'</{DS}parameter>\n</{DS}invoke>\n</{DS}function_calls>', (None, None, [("get_weather", args(days="two"))])),
    # no block: all content (an invoke outside a block is not a call)
    ("No tools.", (None, "No tools.", [])),
    (f'<{DS}invoke name="get_time">\n</{DS}invoke>', (None, f'<{DS}invoke name="get_time">\n</{DS}invoke>', [])),
    # cut inside the block's only call: the reply is content (vLLM: no complete call, the whole output)
    (f'Sure.\n\n<{DS}function_calls>\n<{DS}invoke name="get_weather">\n<{DS}parameter name="city" string="true">Pa',
     (None, f'Sure.\n\n<{DS}function_calls>\n<{DS}invoke name="get_weather">\n<{DS}parameter name="city" '
            'string="true">Pa', [])),
]


LC0, LC1 = "<longcat_tool_call>", "</longcat_tool_call>"
LONGCAT = [
    (f'Let me see.{LC0}{{"name": "get_weather", "arguments": {{"city": "Paris", "days": 2}}}}{LC1}'
     f'{LC0}{{"name": "get_time", "arguments": {{}}}}{LC1}',
     (None, "Let me see.", [("get_weather", args(city="Paris", days=2)), ("get_time", "{}")])),
    ("No tools.", (None, "No tools.", [])),
]
GLM47 = [
    # GLM-4.7 writes no newline between the name and the first argument (glm45's parser reads both)
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
     "<arg_value>2</arg_value></tool_call><tool_call>get_time</tool_call>",
     (None, None, [("get_weather", args(city="Paris", days=2)), ("get_time", "{}")])),
]


SEED_OSS = [
    # Qwen3-Coder's XML between Seed's tags, values typed by the schema
    ("Let me check.<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
     "<parameter=days>2</parameter>\n</function>\n</seed:tool_call>",
     (None, "Let me check.", [("get_weather", args(city="Paris", days=2))])),
    ("No tools.", (None, "No tools.", [])),
]


@pytest.mark.parametrize("text,expected", SEED_OSS)
def test_seed_oss(text, expected):
    check(lambda: choice("seed_oss"), text, expected)


def test_seed_oss_reasoning_then_a_tool_call():
    text = ("<seed:think>The user wants the weather.</seed:think>Checking.<seed:tool_call>\n<function=get_time>\n"
            "</function>\n</seed:tool_call>")
    check(lambda: choice("seed_oss", "seed_oss"), text, ("The user wants the weather.", "Checking.",
                                                         [("get_time", "{}")]))


@pytest.mark.parametrize("text,expected", LONGCAT)
def test_longcat(text, expected):
    check(lambda: choice("longcat"), text, expected)


@pytest.mark.parametrize("text,expected", GLM47)
def test_glm47(text, expected):
    check(lambda: choice("glm47"), text, expected)


@pytest.mark.parametrize("text,expected", DEEPSEEK_V32)
def test_deepseek_v32(text, expected):
    check(lambda: choice("deepseek_v32"), text, expected)


# ---------------------------------------------------------------------------------- minimax_m2
MINIMAX_M2 = [
    # content before one block of two invokes (the format MiniMax documents), values stripped and typed by the schema
    # (MiniMax's rules: "1" is a true boolean, a string stays text even when it looks numeric, null is null)
    ("I'll check both.\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Dallas"
     "</parameter>\n<parameter name=\"days\">3</parameter>\n<parameter name=\"temperature\">21.5</parameter>\n"
     "<parameter name=\"metric\">1</parameter>\n<parameter name=\"zip\">07030</parameter>\n</invoke>\n"
     "<invoke name=\"get_weather\">\n<parameter name=\"city\">\nSan Francisco, CA\n</parameter>\n"
     "<parameter name=\"options\">{\"hourly\": true}</parameter>\n<parameter name=\"tags\">[\"a\", \"b\"]"
     "</parameter>\n<parameter name=\"when\">null</parameter>\n</invoke>\n</minimax:tool_call>",
     (None, "I'll check both.\n",
      [("get_weather", args(city="Dallas", days=3, temperature=21.5, metric=True, zip="07030")),
       ("get_weather", args(city="San Francisco, CA", options={"hourly": True}, tags=["a", "b"], when=None))])),
    # bare and single-quoted names; a whole number becomes an integer; text that is not its type stays text; a
    # parameter the schema does not declare stays text; two blocks; a call without parameters
    ("<minimax:tool_call>\n<invoke name=get_weather>\n<parameter name='temperature'>20.0</parameter>\n"
     "<parameter name=days>three</parameter>\n<parameter name=\"note\">42</parameter>\n</invoke>\n"
     "</minimax:tool_call>\n<minimax:tool_call>\n<invoke name=\"get_time\">\n</invoke>\n</minimax:tool_call>",
     (None, None, [("get_weather", args(temperature=20, days="three", note="42")), ("get_time", "{}")])),
    # plain text, and text that only looks like the start of a block
    ("No tools: <minimax:tool and <invoke are just words.", (None, "No tools: <minimax:tool and <invoke are just words.",
                                                           [])),
    # cut off inside a call: the finished call only; a block without a readable call: all content
    ("Checking.\n<minimax:tool_call>\n<invoke name=\"get_time\">\n</invoke>\n<invoke name=\"get_weather\">\n"
     "<parameter name=\"city\">Os",
     (None, "Checking.\n", [("get_time", "{}")])),
    ("<minimax:tool_call>\nnothing here\n</minimax:tool_call>",
     (None, "<minimax:tool_call>\nnothing here\n</minimax:tool_call>", [])),
]


# ---------------------------------------------------------------------------------- phi4_mini_json
PHI4_MINI = [
    # two calls in the functools list, "parameters" read as "arguments", content before it
    ('Let me check. functools[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
     '{"name": "get_time", "parameters": {}}]',
     (None, "Let me check. ", [("get_weather", '{"city": "Oslo", "days": 2}'), ("get_time", "{}")])),
    ('functools[{"name": "get_time", "arguments": {}}]', (None, None, [("get_time", "{}")])),
    ("No tools: the word functools alone is text.", (None, "No tools: the word functools alone is text.", [])),
]


@pytest.mark.parametrize("text,expected", PHI4_MINI)
def test_phi4_mini_json(text, expected):
    check(lambda: choice("phi4_mini_json"), text, expected)


# ---------------------------------------------------------------------------------- granite
GRANITE = [
    # Granite 3.0: the <|tool_call|> token, then the JSON list
    ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
     '{"name": "get_time", "arguments": {}}]',
     (None, None, [("get_weather", '{"city": "Oslo", "days": 2}'), ("get_time", "{}")])),
    # Granite 3.1 / 3.2 / 3.3: the <tool_call> text
    ('<tool_call>[{"name": "get_time", "arguments": {}}]', (None, None, [("get_time", "{}")])),
    ("It is sunny in Oslo.", (None, "It is sunny in Oslo.", [])),
    ("<tool_call> but no list", (None, "<tool_call> but no list", [])),
]


@pytest.mark.parametrize("text,expected", GRANITE)
def test_granite(text, expected):
    check(lambda: choice("granite"), text, expected)


# ---------------------------------------------------------------------------------- jamba, nemotron_json, lfm2
JAMBA = [
    # content before the list; two calls
    ('Checking.\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
     '{"name": "get_time", "arguments": {}}]</tool_calls>',
     (None, "Checking.\n", [("get_weather", '{"city": "Oslo", "days": 2}'), ("get_time", "{}")])),
    ('<tool_calls>\n[{"name": "get_time", "arguments": {}}]\n</tool_calls>', (None, None, [("get_time", "{}")])),
    ("No tools here.", (None, "No tools here.", [])),
    # the marker without a list: all content
    ("<tool_calls> none", (None, "<tool_calls> none", [])),
]
NEMOTRON_JSON = [
    ('<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</TOOLCALL>',
     (None, None, [("get_weather", '{"city": "Oslo"}')])),
    # content before; two blocks; what follows a block is not content
    ('Let me look.<TOOLCALL>[{"name": "get_time", "arguments": {}}]</TOOLCALL>\n<TOOLCALL>[{"name": '
     '"get_weather", "arguments": {"days": 3}}]</TOOLCALL>',
     (None, "Let me look.", [("get_time", "{}"), ("get_weather", '{"days": 3}')])),
    ("Plain answer.", (None, "Plain answer.", [])),
]
LFM2 = [
    # pythonic calls between the markers, content before and after
    ('Checking. <|tool_call_start|>[get_weather(city="Oslo", days=2), get_time()]<|tool_call_end|> Done.',
     (None, "Checking.  Done.", [("get_weather", '{"city": "Oslo", "days": 2}'), ("get_time", "{}")])),
    ('<|tool_call_start|>[get_time()]<|tool_call_end|>', (None, None, [("get_time", "{}")])),
    # LFM2's echo of the call after the end token, capped by a second one: dropped
    ('<|tool_call_start|>[get_time()]<|tool_call_end|>[get_time()]<|tool_call_end|>It is noon.',
     (None, "It is noon.", [("get_time", "{}")])),
    ("It is sunny.", (None, "It is sunny.", [])),
    # not a list of calls: all content
    ("<|tool_call_start|>get_time<|tool_call_end|>", (None, "<|tool_call_start|>get_time<|tool_call_end|>", [])),
]


ERNIE45 = [
    # content before the calls loses its trailing newlines
    ('Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n',
     (None, "Let me check.", [("get_weather", '{"city": "Oslo"}')])),
    # an answer between the response markers: the markers (and their newlines) are not content
    ("<response>\nIt is sunny.\n</response>\n", (None, "It is sunny.\n", [])),
    ("Plain answer.\n", (None, "Plain answer.\n", [])),
]


@pytest.mark.parametrize("text,expected", ERNIE45)
def test_ernie45(text, expected):
    check(lambda: choice("ernie45"), text, expected)


APERTUS = [
    ('I will check. <|tools_prefix|>[{"get_weather": {"city": "Paris", "days": 2}}, {"get_time": {}}]<|tools_suffix|>',
     (None, "I will check. ", [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", "{}")])),
    ('<|tools_prefix|>[{"get_time": {}}]<|tools_suffix|> Then I answer.',
     (None, " Then I answer.", [("get_time", "{}")])),
    ("Nothing to call.", (None, "Nothing to call.", [])),
    ("<|tools_prefix|>not json<|tools_suffix|>", (None, "<|tools_prefix|>not json<|tools_suffix|>", [])),
]


@pytest.mark.parametrize("text,expected", APERTUS)
def test_apertus(text, expected):
    check(lambda: choice("apertus"), text, expected)


OLMO3 = [
    # one call a line, JSON's literals and Python's both read
    ('<function_calls>\nget_weather(city="Oslo", days=2, metric=true, when=null)\nget_time()\n</function_calls>',
     (None, None, [("get_weather", '{"city": "Oslo", "days": 2, "metric": true, "when": null}'), ("get_time", "{}")])),
    ("<function_calls>get_weather(city='Rome', metric=False)</function_calls>",
     (None, None, [("get_weather", '{"city": "Rome", "metric": false}')])),
    ("The answer is 4.", (None, "The answer is 4.", [])),
    # a block of no call: all content
    ("<function_calls>\nnot a call\n</function_calls>", (None, "<function_calls>\nnot a call\n</function_calls>", [])),
]


@pytest.mark.parametrize("text,expected", OLMO3)
def test_olmo3(text, expected):
    check(lambda: choice("olmo3"), text, expected)


@pytest.mark.parametrize("text,expected", JAMBA)
def test_jamba(text, expected):
    check(lambda: choice("jamba"), text, expected)


@pytest.mark.parametrize("text,expected", NEMOTRON_JSON)
def test_nemotron_json(text, expected):
    check(lambda: choice("nemotron_json"), text, expected)


@pytest.mark.parametrize("text,expected", LFM2)
def test_lfm2(text, expected):
    check(lambda: choice("lfm2"), text, expected)


def test_qwen3_xml_is_qwen3_coder():
    text, expected = QWEN3_CODER[0]
    check(lambda: choice("qwen3_xml"), text, expected)


def test_llama4_json_is_llama3_json():
    text = '{"name": "get_time", "parameters": {}}'
    check(lambda: choice("llama4_json"), text, (None, None, [("get_time", "{}")]))


@pytest.mark.parametrize("text,expected", MINIMAX_M2)
def test_minimax_m2(text, expected):
    check(lambda: choice("minimax_m2"), text, expected)


def test_minimax_m2_reasoning_parsers():
    """MiniMax-M2's template opens <think> in the prompt: minimax_m2 reads the reply up to </think> as reasoning;
    minimax_m2_append_think keeps it in the answer, with the opening tag put back (vLLM's two parsers)."""
    text = ("The user wants the time.\n</think>\n\nLet me look.\n<minimax:tool_call>\n<invoke name=\"get_time\">\n"
            "</invoke>\n</minimax:tool_call>")
    check(lambda: choice("minimax_m2", "minimax_m2"), text,
          ("The user wants the time.\n", "Let me look.\n", [("get_time", "{}")]))
    check(lambda: choice("minimax_m2", "minimax_m2_append_think"), text,
          (None, "<think>The user wants the time.\n</think>\n\nLet me look.\n", [("get_time", "{}")]))
    check(lambda: choice(None, "minimax_m2_append_think"), "Thinking.</think>Hi.", (None, "<think>Thinking.</think>Hi.",
                                                                                     []))


def test_deepseek_v3_reasoning_follows_the_requests_thinking_switch():
    """--reasoning-parser deepseek_v3 (vLLM's, for V3.1 / V3.2): with the template variable thinking (or
    enable_thinking) on, the reply up to </think> is reasoning (deepseek_r1's reading: the prompt opened it);
    otherwise the whole reply is the answer."""
    from atlas.server.output_parsers import reasoning_for_request

    text = "The user wants the time.</think>Let me look." + DSML_CALLS
    for kwargs in ({"thinking": True}, {"enable_thinking": True}):
        name = reasoning_for_request("deepseek_v3", kwargs)
        check(lambda name=name: choice("deepseek_v32", name), text,
              ("The user wants the time.", "Let me look.\n\n",
               [("get_weather", args(city='杭州 "west"', days=2, options={"unit": "C"})), ("get_time", "{}")]))
    assert reasoning_for_request("deepseek_v3", {}) is None and reasoning_for_request("qwen3", {}) == "qwen3"
    assert "deepseek_v3" in REASONING_PARSERS


def test_deepseek_r1_reasoning_then_a_tool_call():
    text = f"<think>The user wants the time.</think>Let me look.{TCB}{TB}function{TS}get_time\n```json\n{{}}\n```{TE}{TCE}"
    check(lambda: choice("deepseek_v3", "deepseek_r1"), text,
          ("The user wants the time.", "Let me look.", [("get_time", "{}")]))


# ---------------------------------------------------------------------------------- gemma4
Q = '<|"|>'  # (Gemma 4's string quote token)
GEMMA4 = [
    (f"I'll check.<|tool_call>call:get_weather{{city:{Q}Paris, France{Q},days:3,metric:true,"
     f"options:{{unit:{Q}C{Q}}},tags:[{Q}a{Q},2]}}<tool_call|><|tool_response>",
     (None, "I'll check.", [("get_weather", args(city="Paris, France", days=3, metric=True, options={"unit": "C"},
                                                 tags=["a", 2]))])),
    # two calls back to back, the second without arguments; numbers, null, and a string with the format's
    # punctuation inside its quote tokens
    (f"<|tool_call>call:get_weather{{temperature:-3.5,when:null,city:{Q}a{{b}},c:d [x]{Q}}}<tool_call|>"
     "<|tool_call>call:get_time{}<tool_call|>",
     (None, None, [("get_weather", args(temperature=-3.5, when=None, city="a{b},c:d [x]")), ("get_time", "{}")])),
    # spaces around the pieces; a bare word stays text
    (f"<|tool_call>call:get_weather{{ city : {Q}Rome{Q} , zip : 07030 , mood : sunny }}<tool_call|>",
     (None, None, [("get_weather", args(city="Rome", zip="07030", mood="sunny"))])),
    ("Just text, no calls.", (None, "Just text, no calls.", [])),
    # a call the reply's end cut off is content, not a call
    (f"Sure.<|tool_call>call:get_weather{{city:{Q}Par",
     (None, f"Sure.<|tool_call>call:get_weather{{city:{Q}Par", [])),
    # not the format (no call: prefix; an unclosed string): content
    (f"<|tool_call>get_weather{{}}<tool_call|>ok<|tool_call>call:get_time{{a:{Q}x}}<tool_call|>",
     (None, f"<|tool_call>get_weather{{}}<tool_call|><|tool_call>call:get_time{{a:{Q}x}}<tool_call|>", [])),
]


@pytest.mark.parametrize("text,expected", GEMMA4)
def test_gemma4(text, expected):
    check(lambda: choice("gemma4"), text, expected)
    assert TOOL_PARSERS["gemma4"].needs_special_tokens  # (its markers and quote are special tokens)


GEMMA4_REASONING = [
    # Gemma 4's thought channel (thinking on: <|think|> in the system turn); its "thought" label is not reasoning
    ("<|channel>thought\nThe user greets me.<channel|>Hello!", ("The user greets me.", "Hello!", [])),
    ("<|channel>thought\nLine one\nLine two<channel|>\nHello!", ("Line one\nLine two", "Hello!", [])),
    ("Hello without thinking.", (None, "Hello without thinking.", [])),
    # cut off inside the reasoning; a channel that ends the reply; a channel without the label
    ("<|channel>thought\nStill thinking", ("Still thinking", None, [])),
    ("<|channel>thought\nDone.<channel|>", ("Done.", None, [])),
    ("<|channel>Unlabelled<channel|>Answer", ("Unlabelled", "Answer", [])),
    ("<|channel>thou", ("thou", None, [])),  # (cut off inside what might have been the label: reasoning as it is)
]


@pytest.mark.parametrize("text,expected", GEMMA4_REASONING)
def test_gemma4_reasoning(text, expected):
    check(lambda: choice(None, "gemma4"), text, expected)
    assert ReasoningParser.needs_special_tokens_for("gemma4") and not ReasoningParser.needs_special_tokens_for("qwen3")


def test_gemma4_reasoning_then_a_tool_call():
    text = f"<|channel>thought\nNeed the weather.<channel|><|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
    check(lambda: choice("gemma4", "gemma4"), text, ("Need the weather.", None, [("get_weather", args(city="Paris"))]))


def test_glm45_with_its_reasoning_parser():
    text = ("<think>Need the weather tool.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Paris</arg_value>\n</tool_call>")
    check(lambda: choice("glm45", "glm45"), text, ("Need the weather tool.", None, [("get_weather", args(city="Paris"))]))
    check(lambda: choice(None, "glm45"), "<think>hm</think>\nHello!", ("hm", "Hello!", []))
    check(lambda: choice(None, "glm45"), "Hello without thinking.", (None, "Hello without thinking.", []))


# ---------------------------------------------------------------------------------- mistral
MISTRAL = [
    # before v11 (Mistral-7B-Instruct-v0.3, Mixtral, Nemo): a JSON list; arguments as the model wrote them
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
     '{"name": "get_time", "arguments": {}}]',
     (None, None, [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", "{}")])),
    ('Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "[TOOL_CALLS]"}}]',
     (None, "Let me check.", [("get_weather", '{"city": "[TOOL_CALLS]"}')])),
    # v11+ (Mistral-Small-3.1+, Devstral, Magistral): NAME[ARGS]{...} per call, [CALL_ID] optional
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "options": {"unit": "C"}}[TOOL_CALLS]get_time[ARGS]{}',
     (None, None, [("get_weather", '{"city": "Paris", "options": {"unit": "C"}}'), ("get_time", "{}")])),
    ('Sure.[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Lyon"}',
     (None, "Sure.", [("get_weather", '{"city": "Lyon"}')])),
    # the form vLLM reads through mistral_common, without the [ARGS] token
    ('[TOOL_CALLS]get_weather{"city": "Nice"}', (None, None, [("get_weather", '{"city": "Nice"}')])),
    ("Plain [TOOL_ text.", (None, "Plain [TOOL_ text.", [])),
    # arguments that are not JSON still make a call (vLLM, v11+): the model sees what it tried
    ('[TOOL_CALLS]get_weather[ARGS]{"city": Paris}', (None, None, [("get_weather", '{"city": Paris}')])),
    # neither form after the marker: the reply less the marker is content (vLLM)
    ("Hi [TOOL_CALLS] I cannot call tools here.", (None, "Hi  I cannot call tools here.", [])),
    ("[TOOL_CALLS] [1, 2]", (None, " [1, 2]", [])),
]


@pytest.mark.parametrize("text,expected", MISTRAL)
def test_mistral(text, expected):
    check(lambda: choice("mistral"), text, expected)


# ---------------------------------------------------------------------------------- pythonic
PYTHONIC = [
    ('[get_weather(city="San Francisco", days=2, metric=True), get_time()]',
     (None, None, [("get_weather", args(city="San Francisco", days=2, metric=True)), ("get_time", "{}")])),
    # literals of every kind, quotes of both kinds, nested brackets inside strings
    ("[get_weather(city='Paris (FR)', temperature=-3.5, tags=['a]', \"b)\"], options={'k': None, 'n': (1, 2)})]",
     (None, None, [("get_weather", args(city="Paris (FR)", temperature=-3.5, tags=["a]", "b)"],
                                        options={"k": None, "n": [1, 2]}))])),
    # Llama 4 wraps its calls
    ('<|python_start|>[get_time(tz="UTC")]<|python_end|>', (None, None, [("get_time", args(tz="UTC"))])),
    ("The answer is 4.", (None, "The answer is 4.", [])),
    # a list that is not calls, a call with a non-literal or positional argument: all content (never evaluated)
    ("[1, 2, 3] are numbers.", (None, "[1, 2, 3] are numbers.", [])),
    ("[get_weather(city=open('/etc/passwd').read())]", (None, "[get_weather(city=open('/etc/passwd').read())]", [])),
    ('[get_weather("Paris")]', (None, '[get_weather("Paris")]', [])),
    # a list the reply's end cut off: content
    ('[get_weather(city="Par', (None, '[get_weather(city="Par', [])),
    # text after the calls is content (vLLM makes the whole reply content)
    ('[get_time()]\nDone.', (None, "\nDone.", [("get_time", "{}")])),
]


@pytest.mark.parametrize("text,expected", PYTHONIC)
def test_pythonic(text, expected):
    check(lambda: choice("pythonic"), text, expected)
    check(lambda: choice("llama4_pythonic"), text, expected)


# ---------------------------------------------------------------------------------- openai (harmony, gpt-oss)
ANALYSIS = '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
HARMONY = [
    # reasoning then the answer (the stop token <|return|> is not in the text)
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.",
     ('User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.", [])),
    # a function call (the stop token <|call|> is not in the text)
    ("<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}',
     ("Need to use function get_weather.", None, [("get_weather", '{"location":"San Francisco"}')])),
    # a preamble on commentary is content; the recipient written in the role section; calls kept with <|call|>
    ("<|channel|>analysis<|message|>Plan: two calls.<|end|><|start|>assistant<|channel|>commentary<|message|>"
     "**Action plan**: check the weather, then the time.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather<|constrain|>json<|message|>{"location": "Tokyo"}<|call|>'
     "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
     ("Plan: two calls.", "**Action plan**: check the weather, then the time.",
      [("get_weather", '{"location": "Tokyo"}'), ("get_time", "{}")])),
    # several analysis messages are joined with a newline; a built-in tool on analysis stays reasoning
    ("<|channel|>analysis<|message|>First thought.<|end|><|start|>assistant<|channel|>analysis to=browser.search "
     '<|constrain|>json<|message|>{"query": "x"}<|end|><|start|>assistant<|channel|>final<|message|>Done.',
     ('First thought.\n{"query": "x"}', "Done.", [])),
    # the recipient before the channel in the reply's first header (the prompt ended "<|start|>assistant")
    (' to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}',
     (None, None, [("get_time", '{"tz": "UTC"}')])),
    # cut off: inside the reasoning; and inside a header (markup, dropped)
    ("<|channel|>analysis<|message|>Thinking about", ("Thinking about", None, [])),
    (ANALYSIS + "<|start|>assistant<|channel|>fin",
     ('User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', None, [])),
    # arguments that are not JSON are returned as written (vLLM likewise)
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": SF',
     (None, None, [("get_weather", '{"location": SF')])),
    # text outside the format is content, never dropped
    ("Plain answer with no channels.", (None, "Plain answer with no channels.", [])),
]


@pytest.mark.parametrize("text,expected", HARMONY)
def test_harmony(text, expected):
    check(lambda: choice("openai"), text, expected)


def test_harmony_reasoning_parser_alone_and_tool_choice_none():
    """--reasoning-parser openai_gptoss (or tool_choice none): the same reading with calls off; a message to a
    function is then read by its channel (commentary: content), as vLLM streams it."""
    text = (ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
            "<|message|>{}<|end|><|start|>assistant<|channel|>final<|message|>4")
    expected = ('User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "{}\n4", [])
    check(lambda: choice(None, "openai_gptoss"), text, expected)
    check(lambda: choice("openai", calls=False), text, expected)


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "A"}[TOOL_CALLS]get_time[ARGS]{}'
    check(lambda: choice("mistral", max_calls=1), text, (None, None, [("get_weather", '{"city": "A"}')]))


HUNYUAN = [
    ("<think>\nThe user wants the weather.\n</think>\n<answer>\nIt is sunny.\n\nWarm, too.\n</answer>",
     ("The user wants the weather.", "It is sunny.\n\nWarm, too.", [])),
    ('<think>\nNeeds the tool.\n</think>\n<answer>\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "北京"}}, '
     '{"name": "get_time", "arguments": {}}]</tool_calls>\n</answer>',
     ("Needs the tool.", None, [("get_weather", args(city="北京")), ("get_time", "{}")])),
    ("<think>\n\n</think>\n<answer>\nHi.\n</answer>", (None, "Hi.", [])),  # (thinking off: empty think tags)
    ("<answer>\nHi.\n</answer>", (None, "Hi.", [])),
    ("Hi there.", (None, "Hi there.", [])),
]


@pytest.mark.parametrize("text,expected", HUNYUAN)
def test_hunyuan_a13b_reasoning_and_tool_calls(text, expected):
    """Hunyuan-A13B's replies (vLLM's hunyuan_a13b parsers): the reasoning inside <think>\\n...\\n</think>, the answer
    inside <answer>\\n...\\n</answer>, tool calls as Jamba's <tool_calls> list inside the answer; streamed or not."""
    check(lambda: choice("hunyuan_a13b", "hunyuan_a13b"), text, expected)
    assert "hunyuan_a13b" in REASONING_PARSERS


KIMI_CALLS = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
              '{"city": "北京", "days": 2}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
              "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")
KIMI_K2 = [
    # content before the section; the ids the model wrote; the arguments as written
    ("Let me check." + KIMI_CALLS,
     (None, "Let me check.", [("get_weather", '{"city": "北京", "days": 2}'), ("get_time", "{}")])),
    # the section markers written singular (vLLM reads them too); spaces around the id and arguments
    ("<|tool_call_section_begin|><|tool_call_begin|> functions.get_time:3 <|tool_call_argument_begin|> {} "
     "<|tool_call_end|><|tool_call_section_end|>", (None, None, [("get_time", "{}")])),
    # a call outside a section is not a call; a section whose only call has no index is all content
    ("<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
     (None, "<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{}<|tool_call_end|>", [])),
    ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time<|tool_call_argument_begin|>{}"
     "<|tool_call_end|><|tool_calls_section_end|>",
     (None, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time<|tool_call_argument_begin|>{}"
            "<|tool_call_end|><|tool_calls_section_end|>", [])),
    # cut off inside the second call: the first is a call, the open one dropped (content is the text before the
    # section, as vLLM's)
    ("Hm." + KIMI_CALLS[:KIMI_CALLS.index("{}")], (None, "Hm.", [("get_weather", '{"city": "北京", "days": 2}')])),
    ("Just text, (no content) kept without the reasoning parser.",
     (None, "Just text, (no content) kept without the reasoning parser.", [])),
]
KIMI_K2_THINKING = [
    # Kimi K2 Thinking: reasoning up to </think> (the opening tag written or not), the "(no content)" placeholder
    # before the calls dropped
    ("<think>The user wants the weather.</think>(no content)" + KIMI_CALLS,
     ("The user wants the weather.", None, [("get_weather", '{"city": "北京", "days": 2}'), ("get_time", "{}")])),
    ("Short thought.</think>\n\nIt is sunny.", ("Short thought.", "It is sunny.", [])),
    ("Still thinking (no content) here", ("Still thinking (no content) here", None, [])),
]


@pytest.mark.parametrize("text,expected", KIMI_K2)
def test_kimi_k2_tool_calls_keep_the_models_ids(text, expected):
    """Kimi K2's calls (vLLM's kimi_k2): a section of calls, each `functions.NAME:INDEX` then its JSON arguments;
    the call's id is the model's own (its chat template writes it back into the history); streamed or not."""
    check(lambda: choice("kimi_k2"), text, expected)
    parser = choice("kimi_k2")
    calls = parser.parse(text, final=True).calls
    model_ids = re.findall(r"<\|tool_call_begin\|>\s*(functions\.\w+:\d+)\s*<\|tool_call_argument_begin\|>.*?"
                           r"<\|tool_call_end\|>", text)
    assert parser.call_ids(calls) == [c.id for c in calls] == model_ids[:len(calls)]


@pytest.mark.parametrize("text,expected", KIMI_K2_THINKING)
def test_kimi_k2_reasoning(text, expected):
    check(lambda: choice("kimi_k2", "kimi_k2"), text, expected)


def test_kimi_k2_thinking_off_reads_no_reasoning_and_drops_the_placeholder():
    """A request with chat_template_kwargs {"thinking": false}: no reasoning (vLLM reads the reply as all answer
    then), the placeholder still dropped; the served ids as in the streamed deltas."""
    from atlas.server.output_parsers import reasoning_for_request

    name = reasoning_for_request("kimi_k2", {"thinking": False})
    assert reasoning_for_request("kimi_k2", {}) == "kimi_k2" and name != "kimi_k2"
    check(lambda: choice("kimi_k2", name), "(no content)" + KIMI_CALLS,
          (None, None, [("get_weather", '{"city": "北京", "days": 2}'), ("get_time", "{}")]))
    check(lambda: choice("kimi_k2", name), "No </think> reading: (no content) all answer.",
          (None, "No </think> reading:  all answer.", []))
    parser = choice("kimi_k2", name)
    calls = parser.parse("(no content)" + KIMI_CALLS, final=True).calls
    assert parser.call_ids(calls) == ["functions.get_weather:0", "functions.get_time:1"]
    assert choice("hermes").call_ids(calls[:0] + [calls[0].__class__("f", "{}", True)])[0].startswith("call_")


def test_names_are_vllms_and_unknown_names_are_refused():
    from atlas.server.settings import ServerSettings

    for name in ("qwen3_coder", "glm45", "glm47", "longcat", "seed_oss", "mistral", "pythonic", "llama4_pythonic",
                 "openai", "gemma4", "deepseek_v3", "deepseek_v31", "deepseek_v32", "minimax_m2", "llama4_json",
                 "phi4_mini_json", "granite", "jamba", "nemotron_json", "lfm2", "qwen3_xml", "olmo3",
                 "ernie45", "apertus", "hunyuan_a13b", "kimi_k2"):
        assert name in TOOL_PARSERS
        ServerSettings(enable_auto_tool_choice=True, tool_call_parser=name)
    for name in ("qwen3", "deepseek_r1", "glm45", "gemma4", "openai_gptoss", "minimax_m2", "minimax_m2_append_think",
                 "hunyuan_a13b", "kimi_k2"):
        assert name in REASONING_PARSERS
        ServerSettings(reasoning_parser=name)
    for bad in (dict(tool_call_parser="qwen3_yaml"), dict(reasoning_parser="gpt_oss"),
                dict(reasoning_parser="openai_gptoss", tool_call_parser="hermes")):
        with pytest.raises(ValueError):
            ServerSettings(**bad)


# ---------------------------------------------------------------------------------- over HTTP
def test_over_http_with_the_openai_client(qwen3_dir):
    """A real server and the official client: the grammar makes the tiny model write each format (the parsers
    are not mocked); streamed and whole replies agree, arguments are typed by the request's schema."""
    import dataclasses

    import openai
    from serving import start_server

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    srv = start_server(str(qwen3_dir), kv_cache_memory="16MiB", max_model_len=256,
                       settings=dict(enable_auto_tool_choice=True, tool_call_parser="qwen3_coder"))
    formats = [
        ("qwen3_coder", r"Checking\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n[a-z]{2,6}\n"
                        r"</parameter>\n<parameter=days>\n[1-9]\n</parameter>\n</function>\n</tool_call>",
         "Checking.\n", None),
        ("openai", r"<\|channel\|>analysis<\|message\|>[a-z ]{3,12}<\|end\|><\|start\|>assistant<\|channel\|>"
                   r'commentary to=functions\.get_weather <\|constrain\|>json<\|message\|>\{"city": "[a-z]{2,6}", '
                   r'"days": [1-9]\}', None, r"[a-z ]{3,12}"),
    ]
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as client:
            for parser, regex, content, reasoning in formats:
                srv.state.settings = dataclasses.replace(srv.state.settings, tool_call_parser=parser)
                kw = dict(model=str(qwen3_dir), messages=[{"role": "user", "content": "Weather?"}], tools=tools,
                          max_tokens=200, temperature=0.8, seed=3, extra_body={"structured_outputs": {"regex": regex}})
                reply = client.chat.completions.create(**kw).choices[0]
                assert reply.finish_reason == "tool_calls", reply
                assert reply.message.content == content
                if reasoning:
                    assert re.fullmatch(reasoning, reply.message.reasoning_content)
                (call,) = reply.message.tool_calls
                assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
                arguments = json.loads(call.function.arguments)
                assert set(arguments) == {"city", "days"} and isinstance(arguments["days"], int)
                text, thought, calls, finish = "", "", {}, None
                for chunk in client.chat.completions.create(stream=True, **kw):
                    delta = chunk.choices[0].delta
                    text += delta.content or ""
                    thought += getattr(delta, "reasoning_content", None) or ""
                    for d in delta.tool_calls or []:
                        entry = calls.setdefault(d.index, ["", ""])
                        entry[0] += d.function.name or ""
                        entry[1] += d.function.arguments or ""
                    finish = chunk.choices[0].finish_reason or finish
                assert (text or None, thought or None, finish) == (content, reply.message.reasoning_content,
                                                                    "tool_calls")
                assert list(calls.values()) == [["get_weather", call.function.arguments]]
            # gpt-oss without tools: reasoning and answer still read from the harmony format
            answer = client.chat.completions.create(
                model=str(qwen3_dir), messages=[{"role": "user", "content": "Hi"}], max_tokens=100, seed=1,
                extra_body={"structured_outputs": {"regex": r"<\|channel\|>analysis<\|message\|>[a-z]{3,8}<\|end\|>"
                                                            r"<\|start\|>assistant<\|channel\|>final<\|message\|>Hello [a-z]{2,5}"}})
            message = answer.choices[0].message
            assert re.fullmatch("[a-z]{3,8}", message.reasoning_content) and re.fullmatch("Hello [a-z]{2,5}",
                                                                                          message.content)
            assert not message.tool_calls and answer.choices[0].finish_reason == "stop"
    finally:
        srv.stop()


ALL_CASES = [("qwen3_coder", t) for t, _ in QWEN3_CODER] + [("glm45", t) for t, _ in GLM45] + \
    [("mistral", t) for t, _ in MISTRAL] + [("pythonic", t) for t, _ in PYTHONIC] + [("openai", t) for t, _ in HARMONY] + \
    [("gemma4", t) for t, _ in GEMMA4] + [("deepseek_v3", t) for t, _ in DEEPSEEK_V3] + \
    [("deepseek_v31", t) for t, _ in DEEPSEEK_V31] + [("deepseek_v32", t) for t, _ in DEEPSEEK_V32] + \
    [("longcat", t) for t, _ in LONGCAT] + [("glm47", t) for t, _ in GLM47] + [("seed_oss", t) for t, _ in SEED_OSS] + \
    [("minimax_m2", t) for t, _ in MINIMAX_M2] + [("phi4_mini_json", t) for t, _ in PHI4_MINI] + \
    [("granite", t) for t, _ in GRANITE] + [("jamba", t) for t, _ in JAMBA] + \
    [("nemotron_json", t) for t, _ in NEMOTRON_JSON] + [("lfm2", t) for t, _ in LFM2] + [("olmo3", t) for t, _ in OLMO3] + \
    [("ernie45", t) for t, _ in ERNIE45] + [("apertus", t) for t, _ in APERTUS] + \
    [("hunyuan_a13b", t) for t, _ in HUNYUAN] + [("kimi_k2", t) for t, _ in KIMI_K2]


@pytest.mark.parametrize("parser,text", ALL_CASES)
def test_a_reply_cut_anywhere_parses_and_streams_the_same(parser, text):
    """max_tokens may end a reply at any character: every such reply parses (no exception) and its stream
    equals it whole."""
    for end in range(1, len(text), 3):
        cut = text[:end]
        expected = whole(lambda: choice(parser), cut)
        assert streamed(lambda: choice(parser), cut, [*range(4, end, 4), end]) == expected, cut


def test_gemma4_reasoning_over_http_keeps_its_special_tokens(qwen3_dir, tmp_path):
    """Gemma 4's channel markers are special tokens, which a reply's text drops by default: with
    --reasoning-parser gemma4 the server keeps them, so the official client gets the reasoning apart from the
    answer, streamed and whole (a tokenizer with the two markers as special tokens; the grammar writes them by id)."""
    import shutil

    import openai
    from serving import start_server
    from transformers import AutoTokenizer

    model = tmp_path / "gemma4-markers"
    shutil.copytree(qwen3_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_special_tokens({"additional_special_tokens": ["<|channel>", "<channel|>"]})
    tok.save_pretrained(model)
    start, end = tok.convert_tokens_to_ids(["<|channel>", "<channel|>"])
    assert max(start, end) < 384 and start in tok.all_special_ids  # (inside the model's vocabulary; special)
    grammar = f'start: <[{start}]> "thought\\n" /[a-z]{{3,8}}/ <[{end}]> "Hello " /[a-z]{{2,5}}/'
    srv = start_server(str(model), kv_cache_memory="16MiB", max_model_len=256,
                       settings=dict(reasoning_parser="gemma4"))
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as client:
            kw = dict(model=str(model), messages=[{"role": "user", "content": "Hi"}], max_tokens=60, seed=2,
                      extra_body={"structured_outputs": {"grammar": grammar}})
            message = client.chat.completions.create(**kw).choices[0].message
            assert re.fullmatch("[a-z]{3,8}", message.reasoning_content), message
            assert re.fullmatch("Hello [a-z]{2,5}", message.content), message
            text, thought = "", ""
            for chunk in client.chat.completions.create(stream=True, **kw):
                delta = chunk.choices[0].delta
                text += delta.content or ""
                thought += getattr(delta, "reasoning_content", None) or ""
            assert (thought, text) == (message.reasoning_content, message.content)
    finally:
        srv.stop()

