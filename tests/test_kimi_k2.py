"""Kimi K2: a DeepSeek-V3 checkpoint (model_type kimi_k2) whose tokenizer ships as code (tiktoken.model and
tokenization_kimi.py, named by tokenizer_config.json's auto_map), served with --trust-remote-code, and its
kimi_k2 tool-call and reasoning parsers over real HTTP with the official client. The tokenizer code here is a
tiktoken tokenizer written for the test in the layout Kimi's takes (tests/data/tiktoken_tokenizer); the parsers'
formats are tested reply by reply in test_tool_parsers_families.py."""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import DEEPSEEK_CONFIGS, VOCAB, _build, _corpus, _correction_bias, hf_greedy, hf_model

from atlas import LLM, SamplingParams
from atlas.errors import ModelLoadError

CODE = Path(__file__).parent / "data" / "tiktoken_tokenizer" / "tokenization_kimi.py"
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
# Kimi's chat format: tools declared in a system turn, each assistant call written back with its id, a tool's result
# headed by the id of the call it answers.
TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>{{ m['content'] or '' }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>{%- for tc in m['tool_calls'] -%}"
    "{%- set a = tc['function']['arguments'] -%}"
    "<|tool_call_begin|>{{ tc['id'] }}<|tool_call_argument_begin|>{{ a if a is string else a | tojson }}"
    "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m['tool_call_id'] }}\n"
    "{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_user|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
ENGINE = dict(kv_cache_memory="8MiB", block_size=8, max_model_len=256)


def write_tiktoken_tokenizer(out: Path) -> None:
    """tiktoken.model (the 256 bytes, then merges learned on a stdlib module, ranked in order), the special tokens
    after them, and the code, in Kimi K2's layout."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([_corpus()], trainers.BpeTrainer(
        vocab_size=VOCAB + 64, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for a, b in json.loads(tok.to_str())["model"]["merges"]:
        token = bytes(to_byte[c] for c in a + b)
        if token not in ranks and len(ranks) < VOCAB - len(SPECIALS):
            ranks[token] = len(ranks)
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in ranks.items()]
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
    added = {str(len(ranks) + i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": True} for i, s in enumerate(SPECIALS)}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added, "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
        "chat_template": TEMPLATE}))
    shutil.copy(CODE, out / CODE.name)


@pytest.fixture(scope="module")
def deepseek_v3_dir(tmp_path_factory) -> Path:
    """The weights, as a DeepSeek-V3 checkpoint (transformers' reference reads Kimi K2's config as its own)."""
    eos = VOCAB - len(SPECIALS) + 1  # ([EOS])
    return _build(tmp_path_factory.mktemp("kimi"), "deepseek-v3", DEEPSEEK_CONFIGS["v3"], None, 0,
                  dict(num_nextn_predict_layers=0, eos_token_id=eos), randomize=_correction_bias)


@pytest.fixture(scope="module")
def kimi_dir(deepseek_v3_dir) -> Path:
    path = deepseek_v3_dir.parent / "kimi-k2"
    shutil.copytree(deepseek_v3_dir, path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                                                  "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    write_tiktoken_tokenizer(path)
    return path


def test_the_tokenizer_code_runs_only_with_trust_remote_code(kimi_dir, deepseek_v3_dir):
    with pytest.raises(ModelLoadError, match=r"tokenization_kimi\.TikTokenTokenizer.*--trust-remote-code"):
        LLM(str(kimi_dir), **ENGINE)
    llm = LLM(str(kimi_dir), trust_remote_code=True, **ENGINE)
    tokenizer = llm.get_tokenizer()
    assert type(tokenizer.hf).__name__ == "TikTokenTokenizer"  # (the checkpoint's class, not a converted one)
    text = "def wrap(text, width=70):\n    return 北京"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text and len(ids) < len(text.encode())  # (merged, and round-trips)
    # Greedy tokens against transformers' DeepSeek-V3 on the same weights, prompted through the chat template
    out = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=8, temperature=0.0,
                                                                        ignore_eos=True))[0]
    prompt = tokenizer.encode("<|im_user|>user<|im_middle|>Hello<|im_end|><|im_assistant|>assistant<|im_middle|>",
                              add_special_tokens=False)
    assert out.prompt_token_ids == prompt
    want = hf_greedy(hf_model(deepseek_v3_dir), prompt, 8)
    assert list(out.outputs[0].token_ids) == want
    assert out.outputs[0].text == tokenizer.decode(want)


def test_kimi_k2_parsers_over_http(kimi_dir):
    """--trust-remote-code --tool-call-parser kimi_k2 --reasoning-parser kimi_k2: the reply's call carries the id the
    model wrote (streamed or not), and that id goes back into the next turn's prompt through the chat template, which
    the tokenizer's own code renders (it overrides apply_chat_template)."""
    import httpx
    import openai
    from serving import start_server

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    regex = (r"<think>[a-z ]{3,12}</think>\(no content\)<\|tool_calls_section_begin\|><\|tool_call_begin\|>"
             r'functions\.get_weather:0<\|tool_call_argument_begin\|>\{"city": "[a-z]{2,6}"\}<\|tool_call_end\|>'
             r"<\|tool_calls_section_end\|>")
    srv = start_server(str(kimi_dir), trust_remote_code=True, structured_outputs_backend="xgrammar",
                       settings=dict(enable_auto_tool_choice=True, tool_call_parser="kimi_k2",
                                     reasoning_parser="kimi_k2"), **{**ENGINE, "max_model_len": 512})
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as client:
            messages = [{"role": "user", "content": "Weather?"}]
            kw = dict(model=str(kimi_dir), messages=messages, tools=tools, max_tokens=340, temperature=0.8, seed=5,
                      extra_body={"structured_outputs": {"regex": regex}})
            reply = client.chat.completions.create(**kw).choices[0]
            assert reply.finish_reason == "tool_calls", reply.message.content
            assert reply.message.content is None and re.fullmatch("[a-z ]{3,12}", reply.message.reasoning_content)
            (call,) = reply.message.tool_calls
            assert (call.id, call.function.name) == ("functions.get_weather:0", "get_weather")
            city = json.loads(call.function.arguments)["city"]
            streamed = [d for chunk in client.chat.completions.create(stream=True, **kw)
                        for d in chunk.choices[0].delta.tool_calls or []]
            assert streamed[0].id == "functions.get_weather:0" and streamed[0].function.name == "get_weather"
            assert "".join(d.function.arguments or "" for d in streamed) == call.function.arguments
        history = [*messages, reply.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        ids = httpx.post(srv.url + "/tokenize", json={"model": str(kimi_dir), "messages": history, "tools": tools},
                         timeout=30).json()["tokens"]
        prompt = srv.core.tokenizer.decode(ids, skip_special_tokens=False)
        # (rendered by the tokenizer's own apply_chat_template, which here sorts the tools' keys)
        assert prompt.startswith('<|im_system|>tool_declare<|im_middle|>[{"function": {"name": "get_weather", '
                                 '"parameters": {"properties": {"city": {"type": "string"}}, "type": "object"}}, '
                                 '"type": "function"}]<|im_end|>')
        assert (f'<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{{"city": "{city}"}}'
                f"<|tool_call_end|>") in prompt
        assert prompt.endswith("<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
                               "<|im_assistant|>assistant<|im_middle|>")
    finally:
        srv.stop()


def test_tokenizer_code_that_does_not_import_is_refused_with_the_import_named(kimi_dir, tmp_path):
    """Code written for another transformers release (Moonshot's imports bytes_to_unicode from transformers 4's GPT-2
    tokenizer module): the load stops with the import named, not a traceback."""
    path = tmp_path / "old-code"
    shutil.copytree(kimi_dir, path)
    code = (path / CODE.name).read_text()
    (path / CODE.name).write_text("from transformers.models.gpt2.tokenization_gpt2 import no_such_function  # noqa\n"
                                  + code)
    with pytest.raises(ModelLoadError, match=r"tokenizer code of .* does not import here .*no_such_function"):
        LLM(str(path), trust_remote_code=True, **ENGINE)
