"""Sequence classifiers (*ForSequenceClassification: reward models, classifiers) under --runner pooling: class
probabilities equal transformers' (softmax of its logits; the sigmoid of a single label's), through LLM.classify and
vLLM's POST /classify, and the refusals around them (generation, embeddings of a classifier, classes of an embedding
model)."""

from __future__ import annotations

import base64
import json
import math
import shutil
import struct

import httpx
import pytest
import torch
from conftest import ARCH_CONFIGS, VOCAB, _randomize, build_checkpoint
from serving import assert_error, start_server

from atlas import LLM
from atlas.errors import ConfigError, InvalidRequestError, ModelLoadError

ENGINE = dict(kv_cache_memory="16MiB", max_model_len=128, dtype="float32")
PROMPTS = [[5, 17, 40, 41, 99, 7], [200, 3, 3, 150], list(range(20, 90))]  # (the last longer than a step's budget)
TEXTS = ["def wrap(text, width=70):", "The TextWrapper instance"]


def _classifier(root, tokenizer_dir, arch: str, labels: list[str] | None, num_labels: int = 2):
    """A tiny random transformers *ForSequenceClassification checkpoint (with the test tokenizer)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    spec = dict(ARCH_CONFIGS[arch])
    model_type = spec.pop("model_type")
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=None, eos_token_id=0, pad_token_id=VOCAB - 1, **spec)
    if labels is not None:
        fields.update(id2label=dict(enumerate(labels)), label2id={v: k for k, v in enumerate(labels)})
    else:
        fields["num_labels"] = num_labels
    cfg = AutoConfig.for_model(model_type, **fields)
    cfg.architectures = [arch.replace("ForCausalLM", "ForSequenceClassification")]
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    _randomize(model, 1)
    out = root / cfg.architectures[0]
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out, model.eval()


def _probs(logits: torch.Tensor) -> list[float]:
    return (torch.sigmoid(logits) if logits.numel() == 1 else logits.softmax(-1)).tolist()


def test_class_probabilities_equal_transformers(tmp_path, tokenizer_dir):
    labels = ["negative", "neutral", "positive"]
    path, ref = _classifier(tmp_path, tokenizer_dir, "Qwen3ForCausalLM", labels)
    with torch.no_grad():
        want = [_probs(ref(torch.tensor([p])).logits[0]) for p in PROMPTS]
    assert max(max(w) for w in want) > 0.6  # (the random head separates the classes: a real test of the order)
    llm = LLM(str(path), runner="pooling", max_num_batched_tokens=32, **ENGINE)  # (the long prompt: 3 chunks)
    got = llm.classify([{"prompt_token_ids": p} for p in PROMPTS])
    for out, expected in zip(got, want, strict=True):
        assert out.outputs.num_classes == 3
        assert out.outputs.probs == pytest.approx(expected, abs=1e-5)
    with pytest.raises(InvalidRequestError, match="use LLM.classify"):
        llm.embed([{"prompt_token_ids": PROMPTS[0]}])
    with pytest.raises(ConfigError, match="sequence classifier .*--runner pooling"):
        LLM(str(path), **ENGINE)


def test_a_single_label_model_gives_the_sigmoid(tmp_path, tokenizer_dir):
    path, ref = _classifier(tmp_path, tokenizer_dir, "LlamaForCausalLM", None, num_labels=1)
    with torch.no_grad():
        logits = [ref(torch.tensor([p])).logits[0] for p in PROMPTS[:2]]
    got = LLM(str(path), runner="pooling", **ENGINE).classify([{"prompt_token_ids": p} for p in PROMPTS[:2]])
    for out, logit in zip(got, logits, strict=True):
        assert out.outputs.probs == pytest.approx([1 / (1 + math.exp(-float(logit[0])))], abs=1e-5)


def test_classify_over_http(tmp_path, tokenizer_dir):
    labels = ["negative", "neutral", "positive"]
    path, ref = _classifier(tmp_path, tokenizer_dir, "Qwen3ForCausalLM", labels)
    offline = LLM(str(path), runner="pooling", **ENGINE).classify(TEXTS)
    server = start_server(str(path), runner="pooling", **ENGINE)
    try:
        http = httpx.Client(base_url=server.url, timeout=30)
        body = http.post("/classify", json={"model": str(path), "input": TEXTS}).json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
        for data, out in zip(body["data"], offline, strict=True):
            assert data["probs"] == pytest.approx(out.outputs.probs, abs=1e-6) and data["num_classes"] == 3
            assert data["label"] == labels[max(range(3), key=out.outputs.probs.__getitem__)]
        assert body["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in offline)
        one = http.post("/classify", json={"input": PROMPTS[0]}).json()["data"]
        assert len(one) == 1 and one[0]["probs"] == pytest.approx(
            _probs(ref(torch.tensor([PROMPTS[0]])).logits[0].detach()), abs=1e-5)
        err = assert_error(http.post("/v1/embeddings", json={"input": "hi"}), 400)
        assert "/classify" in err["message"]
        # /pooling (vLLM's): the raw class logits, before the softmax (a reward model's score), floats or base64
        pooled = http.post("/pooling", json={"input": [PROMPTS[0]]}).json()
        with torch.no_grad():
            logits = ref(torch.tensor([PROMPTS[0]])).logits[0].tolist()
        assert pooled["data"][0]["object"] == "pooling" and pooled["data"][0]["data"] == pytest.approx(logits, abs=1e-5)
        packed = http.post("/pooling", json={"input": [PROMPTS[0]], "encoding_format": "base64"}).json()
        raw = base64.b64decode(packed["data"][0]["data"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(logits, abs=1e-5)
        assert_error(http.post("/classify", json={"input": []}), 400, "input")
    finally:
        server.stop()


def test_classify_on_an_embedding_model_is_refused(tmp_path, tokenizer_dir):
    path = build_checkpoint(tmp_path, "Qwen3ForCausalLM", tokenizer_dir)
    llm = LLM(str(path), runner="pooling", **ENGINE)
    with pytest.raises(InvalidRequestError, match="sequence-classification checkpoint"):
        llm.classify(["hi"])
    server = start_server(str(path), runner="pooling", **ENGINE)
    try:
        err = assert_error(httpx.post(server.url + "/classify", json={"input": "hi"}, timeout=30), 400)
        assert "computes embeddings, not classes" in err["message"]
        # /pooling on an embedding model: the embedding itself
        pooled = httpx.post(server.url + "/pooling", json={"input": "hi"}, timeout=30).json()["data"][0]["data"]
        assert pooled == pytest.approx(llm.embed(["hi"])[0].outputs.embedding, abs=1e-6)
    finally:
        server.stop()


QUERY = "def wrap(text, width=70):"
DOCS = ["The TextWrapper instance", "return textwrap.fill(text, width)", "import os"]


def _set_config(path, **fields):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))


def test_a_cross_encoder_scores_pairs_as_transformers_reads_them(tmp_path, tokenizer_dir):
    """A one-label sequence classifier (a cross-encoder reranker) scores a pair as vLLM does for a decoder-only model:
    the query's text then the document's, one prompt, tokenized as one text; its logit through the sigmoid, or the
    activation its config.json names (sentence-transformers' Identity here). LLM.score, POST /score and /rerank
    (best first, top_n) against transformers' logits in float32."""
    from transformers import AutoTokenizer

    path, ref = _classifier(tmp_path, tokenizer_dir, "Qwen3ForCausalLM", None, num_labels=1)
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        logits = [float(ref(torch.tensor([tok(QUERY + doc)["input_ids"]])).logits[0, 0]) for doc in DOCS]
    assert max(logits) - min(logits) > 0.1  # (the documents score apart: the order below is a real test)
    want = [1 / (1 + math.exp(-x)) for x in logits]
    llm = LLM(str(path), runner="pooling", **ENGINE)
    got = llm.score(QUERY, DOCS)
    assert [o.outputs.score for o in got] == pytest.approx(want, abs=1e-5)
    assert got[0].prompt_token_ids == tok(QUERY + DOCS[0])["input_ids"]
    pairs = llm.score(DOCS[:2], [QUERY, QUERY])  # (two lists pair by index)
    with torch.no_grad():
        reverse = [float(ref(torch.tensor([tok(d + QUERY)["input_ids"]])).logits[0, 0]) for d in DOCS[:2]]
    assert [o.outputs.score for o in pairs] == pytest.approx([1 / (1 + math.exp(-x)) for x in reverse], abs=1e-5)
    with pytest.raises(InvalidRequestError, match="lists of one length"):
        llm.score(DOCS[:2], DOCS)
    del llm
    server = start_server(str(path), runner="pooling", **ENGINE)
    try:
        http = httpx.Client(base_url=server.url, timeout=30)
        body = http.post("/score", json={"text_1": QUERY, "text_2": DOCS}).json()
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
        assert body["usage"]["prompt_tokens"] == sum(len(tok(QUERY + d)["input_ids"]) for d in DOCS)
        order = sorted(range(3), key=lambda i: -want[i])
        ranked = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2}).json()["results"]
        assert [r["index"] for r in ranked] == order[:2]
        assert [r["relevance_score"] for r in ranked] == pytest.approx([want[i] for i in order[:2]], abs=1e-5)
        assert ranked[0]["document"]["text"] == DOCS[order[0]]
        assert_error(http.post("/score", json={"text_1": DOCS[:2], "text_2": DOCS}), 400, "text_2")
    finally:
        server.stop()
    _set_config(path, sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"})
    assert [o.outputs.score for o in LLM(str(path), runner="pooling", **ENGINE).score(QUERY, DOCS)] == pytest.approx(
        logits, abs=1e-5)


def test_scoring_what_is_not_a_cross_encoder_is_refused_by_name(tmp_path, tokenizer_dir):
    """A classifier of several classes cannot score a pair (vLLM's score needs one label), nor can a cross-encoder
    whose config names an activation Atlas does not implement, nor a generating engine: each refused, naming why."""
    path, _ = _classifier(tmp_path, tokenizer_dir, "LlamaForCausalLM", ["a", "b", "c"])
    llm = LLM(str(path), runner="pooling", **ENGINE)
    with pytest.raises(InvalidRequestError, match="3 classes.*num_labels 1"):
        llm.score(QUERY, DOCS)
    del llm
    server = start_server(str(path), runner="pooling", **ENGINE)
    try:
        err = assert_error(httpx.post(server.url + "/rerank", json={"query": QUERY, "documents": DOCS}, timeout=30),
                           400)
        assert "num_labels 1" in err["message"]
    finally:
        server.stop()
    one, _ = _classifier(tmp_path / "one", tokenizer_dir, "LlamaForCausalLM", None, num_labels=1)
    _set_config(one, sbert_ce_default_activation_function="torch.nn.modules.activation.GELU")
    with pytest.raises(InvalidRequestError, match="GELU"):
        LLM(str(one), runner="pooling", **ENGINE).score(QUERY, DOCS)
    generator = build_checkpoint(tmp_path / "gen", "Qwen3ForCausalLM", tokenizer_dir)
    with pytest.raises(InvalidRequestError, match="runner='pooling'"):
        LLM(str(generator), **ENGINE).score(QUERY, DOCS)


@pytest.mark.parametrize("tied", [False, True])
def test_a_causal_lm_read_as_a_reranker_scores_the_log_odds_of_its_two_tokens(tmp_path, tokenizer_dir, tied):
    """vLLM's Qwen3-Reranker recipe: a *ForCausalLM checkpoint served with --hf-overrides '{"architectures":
    ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'.
    Its one label's logit is the LM's logit of the second token minus the first's at the last position, so a pair's
    score is the probability of the second in a softmax over the two (against transformers' causal LM in float32,
    with the LM head its own or tied to the embedding). With method no_post_processing each token is a label, its
    logit the LM's; a token the vocabulary lacks, a method Atlas does not implement and a causal-LM architecture
    are refused by name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_checkpoint(tmp_path, "Qwen3ForCausalLM", tokenizer_dir, tie_word_embeddings=tied)
    tok = AutoTokenizer.from_pretrained(path)
    no, yes = tok.convert_ids_to_tokens([40, 41])  # (two tokens as the tokenizer spells them)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        last = [ref(torch.tensor([tok(QUERY + doc)["input_ids"]])).logits[0, -1] for doc in DOCS]
    want = [float(torch.softmax(row[[40, 41]], -1)[1]) for row in last]
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                 "is_original_qwen3_reranker": True}
    llm = LLM(str(path), runner="pooling", hf_overrides=overrides, **ENGINE)
    assert [o.outputs.score for o in llm.score(QUERY, DOCS)] == pytest.approx(want, abs=1e-5)
    assert llm.classify([QUERY + DOCS[0]])[0].outputs.num_classes == 1
    del llm
    if not tied:  # (an engine without a tokenizer reads the tokens' ids from the tokenizer's files all the same)
        bare = LLM(str(path), runner="pooling", hf_overrides=overrides, skip_tokenizer_init=True, **ENGINE)
        got = bare.classify([{"prompt_token_ids": tok(QUERY + DOCS[0])["input_ids"]}])[0].outputs.probs
        assert got == pytest.approx([want[0]], abs=1e-5)
    each = LLM(str(path), runner="pooling", **ENGINE,
               hf_overrides={"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, 41, 7],
                             "method": "no_post_processing"})
    got = each.classify([QUERY + doc for doc in DOCS])
    assert [o.outputs.probs for o in got] == [pytest.approx(torch.softmax(row[[40, 41, 7]], -1).tolist(), abs=1e-5)
                                              for row in last]
    del each
    bad = {**overrides, "classifier_from_token": [no, "not-a-token-of-it"]}
    with pytest.raises(ModelLoadError, match="not-a-token-of-it"):
        LLM(str(path), runner="pooling", hf_overrides=bad, **ENGINE)
    with pytest.raises(ModelLoadError, match="from_3_way"):
        LLM(str(path), runner="pooling", hf_overrides={**overrides, "method": "from_3_way"}, **ENGINE)
    with pytest.raises(ModelLoadError, match="architecture must be one too"):
        LLM(str(path), runner="pooling", hf_overrides={k: v for k, v in overrides.items() if k != "architectures"},
            **ENGINE)
