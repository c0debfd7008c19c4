"""FP8 checkpoints of the MoE families (the block-scaled layout DeepSeek-V3 and the Qwen / GLM -FP8 models ship) keep
the attention projections, the dense and shared-expert MLPs and the routed experts in FP8, and dequantize, in
DeepSeek, kv_b_proj (attention absorbs it: its weight is read whole) and the MTP module as they load: on the CPU,
whose FP8 layers and experts compute with their dequantized weights, the same logits as the checkpoint of the
dequantized weights (DeepSeek with and without MTP speculation; Qwen3-MoE, Mixtral and GLM-4.5). The FP8 expert
kernels against the dequantizing reference: moe_fp8_cases.py (the interpreter here, CUDA in the cuda tests)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import assert_pages_returned, assert_same_tokens_and_logprobs
from safetensors.torch import load_file, save_file
from test_moe_families import build_moe_checkpoint

from atlas import LLM, SamplingParams
from atlas.bench.common import release
from atlas.kernels.fp8_linear import dequantize, quantize_weight
from atlas.layers.linear import Linear

BLOCK = [8, 8]  # (the tiny models' widths are multiples of 8; the published checkpoints use 128)
ENGINE = dict(kv_cache_memory="8MiB", block_size=8, skip_tokenizer_init=True, max_model_len=256)
FP8 = torch.float8_e4m3fn


def _quantize(w: torch.Tensor, layout: str = "block") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, its scale per BLOCK tile (weight_scale_inv; layout "channel": per row [N, 1], "tensor": one
    number, both weight_scale), the dequantized weight in w's dtype)."""
    if layout != "block":
        amax = w.float().abs().amax(dim=1, keepdim=True) if layout == "channel" else w.float().abs().amax()
        scale = amax.clamp(min=1e-12) / 448.0
        q = (w.float() / scale).to(FP8)
        return q, scale, (q.float() * scale).to(w.dtype)
    rows, cols = w.shape
    br, bc = BLOCK
    blocks = w.float().reshape(rows // br, br, cols // bc, bc)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(FP8)
    back = (q.float() * scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)).to(w.dtype)
    return q, scale, back


def _is_linear(name: str, w: torch.Tensor) -> bool:
    """A linear layer's weight as quantizers quantize them: 2-D, not an embedding, LM head, norm or router."""
    return w.dim() == 2 and name.endswith(".weight") and not any(
        part in name for part in ("embed", "lm_head", "norm", ".gate.weight", "shared_head.head"))


def _quantizable(name: str, w: torch.Tensor) -> bool:
    """_is_linear, where the weight is whole BLOCK tiles (a quantizer leaves the hybrids' one-row shared-expert gate
    and their small b and a projections of the tiny models in floating point)."""
    return _is_linear(name, w) and w.shape[0] % BLOCK[0] == 0 and w.shape[1] % BLOCK[1] == 0


# The quantization_config of each layout: block-scaled (DeepSeek-V3's), per channel (fbgemm_fp8), per tensor.
_CONFIGS = {"block": {"quant_method": "fp8", "weight_block_size": BLOCK, "activation_scheme": "dynamic", "fmt": "e4m3"},
            "channel": {"quant_method": "fbgemm_fp8"},
            "tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"}}


def _fp8_pair(src, root, layout: str = "block", quantizes=_is_linear):
    """(the FP8 checkpoint of every linear layer of `src` (those `quantizes` says), MTP module and experts included;
    the checkpoint of its dequantized weights)."""
    fp8, ref = root / "fp8", root / "dequantized"
    shutil.copytree(src, fp8)
    shutil.copytree(src, ref)
    quantized, dequantized = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if quantizes(name, w):
            q, scale, back = _quantize(w, layout)
            suffix = "_scale_inv" if layout == "block" else "_scale"
            quantized[name], quantized[name + suffix], dequantized[name] = q, scale, back
        else:
            quantized[name] = dequantized[name] = w
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(dequantized, str(ref / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = _CONFIGS[layout]
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, ref


@pytest.fixture(scope="module")
def fp8_pairs(deepseek_checkpoints, tmp_path_factory):
    return {name: _fp8_pair(deepseek_checkpoints[name], tmp_path_factory.mktemp(f"fp8-{name}"))
            for name in ("v3", "v2-lite")}


def _outputs(llm, prompts):
    """Greedy: per prompt (16 token ids, per position {token id: logprob} of the top 3)."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def _generate(path, prompts, **kw):
    llm = LLM(str(path), **{**ENGINE, **kw})
    got = _outputs(llm, prompts)
    assert_pages_returned(llm)
    return llm, got


PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60))]


def _assert_fp8_experts(experts, llm, layout: str = "block") -> None:
    """The routed experts hold FP8 weights [E, N, K] and float32 scales [E, N / 8, K / 8] (the checkpoint's 8x8
    blocks; per row, [E, N], for the other layouts): a byte a weight, half the bf16 experts' bytes (with 1/16 of that
    for the block scales, 4 bytes a row of the tiny model's 32 or 64 columns for row scales)."""
    assert experts
    for m in experts:
        assert m.fp8 is not None and m.w13.dtype == m.w2.dtype == FP8
        scales = 0
        for w in (m.w13, m.w2):
            e, n, k = w.shape
            s = m.scale_of(w)
            assert s.dtype == torch.float32 and tuple(s.shape) == ((e, n // 8, k // 8) if layout == "block" else (e, n))
            scales += s.numel() * 4
        size = sum(p.numel() * p.element_size() for p in m.parameters())
        weights = m.w13.numel() + m.w2.numel()
        assert size == weights + scales and scales <= weights // (16 if layout == "block" else 8)  # (bf16: 2 * weights)


@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_fp8_deepseek_equals_its_dequantized_weights(fp8_pairs, name):
    fp8, ref = fp8_pairs[name]
    llm, got = _generate(fp8, PROMPTS)
    _, want = _generate(ref, PROMPTS)
    assert got == want
    # What stays FP8 and what was dequantized.
    model = llm.engine.runner.model
    attn = model.model.layers[0].self_attn
    kept = [attn.fused_qkv_a_proj, attn.q_b_proj] if name == "v3" else [attn.fused_q_kv_a_proj]
    kept += [attn.o_proj, model.model.layers[0].mlp.gate_up_proj, model.model.layers[1].mlp.shared_experts.down_proj]
    assert all(layer.weight.dtype == FP8 and layer.fp8 is not None for layer in kept)
    assert attn.kv_b_proj.weight.dtype != FP8 and attn.kv_b_proj.fp8 is None
    _assert_fp8_experts([model.model.layers[1].mlp.experts], llm)
    if name == "v3":  # (one engine is enough for the bench's byte count)
        _assert_bench_counts_fp8_expert_bytes(model, fp8)


def _assert_bench_counts_fp8_expert_bytes(model, path) -> None:
    """The latency bench's bytes a batch-1 step reads (its roofline's floor) count FP8 experts at their own size, a
    byte a weight plus the scales, not at the activations' (it once came out negative)."""
    from atlas.bench.latency import model_bytes
    from atlas.bench.roofline import ModelShape
    from atlas.layers.moe import FusedExperts

    shape = ModelShape.from_config(json.loads((path / "config.json").read_text()))
    sizes = model_bytes(model, shape)
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    expert = sum(p.numel() * p.element_size() for m in experts for p in m.parameters()) / sum(
        m.num_experts for m in experts)
    assert expert == pytest.approx(shape.expert_params + sum(
        m.scale_of(m.w13).numel() * 4 + m.scale_of(m.w2).numel() * 4 for m in experts) / sum(
        m.num_experts for m in experts))  # (FP8: a byte a weight)
    embedding = shape.embedding_params * model.model.embed_tokens.weight.element_size()
    idle = shape.moe_layers * (shape.num_experts - shape.experts_read(1)) * expert
    assert sizes["expert_bytes"] == pytest.approx(expert)
    assert sizes["weight_read_bytes_per_step"] == pytest.approx(sizes["weight_bytes"] - embedding - idle, abs=1)


def test_fp8_deepseek_mtp_speculation_equals_plain(fp8_pairs):
    fp8, ref = fp8_pairs["v3"]
    _, plain = _generate(fp8, PROMPTS)
    llm, spec = _generate(fp8, PROMPTS, speculative="mtp", speculative_policy="always", num_draft_tokens=2)
    assert [t for t, _ in spec] == [t for t, _ in plain]
    assert llm.engine.stats.spec_num_verify_steps > 0
    # the module itself holds the dequantized weights: its drafts are those of the dequantized checkpoint's
    _, ref_spec = _generate(ref, PROMPTS, speculative="mtp", speculative_policy="always", num_draft_tokens=2)
    assert [t for t, _ in spec] == [t for t, _ in ref_spec]
    ref_llm = LLM(str(ref), **ENGINE, speculative="mtp", speculative_policy="always", num_draft_tokens=2)
    for mine, theirs in zip(llm.engine.proposer.module.parameters(), ref_llm.engine.proposer.module.parameters(),
                            strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("family,layout", [("qwen3_moe", "block"), ("mixtral", "block"), ("glm4_moe", "block"),
                                           ("qwen3_moe", "channel"), ("mixtral", "tensor")])
def test_fp8_sparse_moe_equals_its_dequantized_weights(family, layout, tmp_path):
    fp8, ref = _fp8_pair(build_moe_checkpoint(tmp_path, family), tmp_path / "pair", layout)
    llm, got = _generate(fp8, PROMPTS)
    _, want = _generate(ref, PROMPTS)
    assert got == want
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(m.weight.dtype == FP8 for m in layers)  # (attention, dense MLPs, shared experts)
    _assert_fp8_experts([m for name, m in model.named_modules() if name.endswith(".experts")], llm, layout)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_fp8_hybrid_equals_its_dequantized_weights(name, tmp_path):
    """Qwen3-Next (MoE) and Qwen3.5 (dense) hybrids, every linear layer block-scaled FP8 as a quantizer writes them
    (the linear-attention layers' input projections too; the router, norms, conv and embeddings not): greedy tokens
    and top logprobs equal the dequantized checkpoint's; attention, out_proj, MLP, shared-expert and expert weights
    are FP8, the linear-attention input projections the model dtype (dequantized as they load). --quantization fp8
    of the dequantized checkpoint quantizes the same layers."""
    from test_hybrid_models import build_hybrid

    src = build_hybrid(tmp_path, name, None)
    fp8, ref = _fp8_pair(src, tmp_path / "pair", quantizes=_quantizable)
    llm, got = _generate(fp8, PROMPTS)
    _, want = _generate(ref, PROMPTS)
    assert got == want
    model = llm.engine.runner.model
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    in_proj = {n for n in layers if n.endswith("linear_attn.in_proj")}
    assert in_proj and all(layers[n].weight.dtype == torch.float32 for n in in_proj)
    # (the shared expert's one-row gate: a checkpoint with no FP8 tensor for it, as a quantizer leaves it, loads
    #  it in the model dtype)
    gates = {n for n in layers if n.endswith("shared_expert_gate")}
    assert all(layers[n].weight.dtype == torch.float32 for n in gates)
    fp8_layers = [n for n in layers if n not in in_proj | gates]
    assert any(n.endswith("linear_attn.out_proj") for n in fp8_layers)
    assert all(layers[n].weight.dtype == FP8 for n in fp8_layers), [n for n in fp8_layers if layers[n].weight.dtype != FP8]
    experts = [m for n, m in model.named_modules() if n.endswith(".experts")]
    if name == "qwen3_next":
        _assert_fp8_experts(experts, llm)
    online = LLM(str(ref), quantization="fp8", **ENGINE).engine.runner.model
    kinds = {n: m.weight.dtype for n, m in online.named_modules() if isinstance(m, Linear)}
    assert {kinds[n] for n in in_proj} == {torch.float32} and {kinds[n] for n in fp8_layers} == {FP8}


def test_fp8_hybrid_mtp_speculation_equals_plain(tmp_path):
    """A Qwen3.5 FP8 checkpoint with its MTP module quantized too: the target keeps its FP8 layers, the module
    (--speculative mtp) dequantizes its own tensors; greedy tokens with K = 2 drafts equal plain decoding's
    (logprobs within 1e-4)."""
    from test_hybrid_models import build_hybrid
    from test_hybrid_mtp import add_mtp_module

    src = build_hybrid(tmp_path, "qwen3_5", None)
    add_mtp_module(src)
    fp8, _ = _fp8_pair(src, tmp_path / "pair", quantizes=_quantizable)
    assert any(k.startswith("mtp.") and k.endswith("_scale_inv") for k in load_file(str(fp8 / "model.safetensors")))
    _, plain = _generate(fp8, PROMPTS)
    llm, spec = _generate(fp8, PROMPTS, speculative="mtp", num_draft_tokens=2, speculative_policy="always",
                          kv_cache_memory="32MiB")  # (the state slots' backups for the verify steps)
    assert_same_tokens_and_logprobs(spec, plain)  # (logprobs within 1e-4: verify steps score rows in other batches)
    assert llm.engine.scheduler.stats.spec_num_draft_tokens > 0


def test_a_quantized_router_is_dequantized_and_a_half_quantized_fused_layer_refused(tmp_path):
    """A checkpoint that quantized the router too (it stays float32 in the model): dequantized as it loads, the same
    logits as the dequantized checkpoint. One that quantized q_a_proj but not kv_a_proj_with_mqa, which Atlas fuses
    into one layer: refused, naming the mixed pieces (it was an AttributeError when the plain piece came first)."""
    from conftest import build_deepseek_checkpoint

    from atlas.errors import ModelLoadError

    src = build_moe_checkpoint(tmp_path, "qwen3_moe")
    fp8, ref = _fp8_pair(src, tmp_path / "router", quantizes=lambda name, w: _is_linear(name, w) or (
        name.endswith(".mlp.gate.weight")))
    assert any(name.endswith(".mlp.gate.weight_scale_inv") for name in load_file(str(fp8 / "model.safetensors")))
    assert _generate(fp8, PROMPTS)[1] == _generate(ref, PROMPTS)[1]
    v3 = build_deepseek_checkpoint(tmp_path, "v3", seed=2)
    half, _ = _fp8_pair(v3, tmp_path / "half", quantizes=lambda name, w: _is_linear(name, w) and (
        "kv_a_proj_with_mqa" not in name))
    with pytest.raises(ModelLoadError, match="fused projection of mixed dtypes"):
        LLM(str(half), **ENGINE)


def test_online_fp8_quantization_leaves_the_absorbed_projection(deepseek_checkpoints, tmp_path):
    """--quantization fp8 on a plain DeepSeek checkpoint: its linear layers to FP8 with a scale per row, except
    kv_b_proj (read whole by the absorbed attention; the routed experts are no linear layers): the same logits as the
    checkpoint whose projections are those rows quantized and dequantized, kv_b_proj left as it is."""
    src = deepseek_checkpoints["v3"]
    ref = tmp_path / "rows-dequantized"
    shutil.copytree(src, ref)
    state = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        linear = name.endswith(("_proj.weight", "_proj_with_mqa.weight")) and ".kv_b_proj." not in name and (
            ".mlp.experts." not in name) and layer is not None and int(layer) < 3
        if linear:
            q, scale = quantize_weight(w)
            w = dequantize(q, scale, None, torch.float32)
        state[name] = w.float() if w.is_floating_point() else w
    save_file(state, str(ref / "model.safetensors"))
    llm, got = _generate(src, PROMPTS, quantization="fp8")
    _, want = _generate(ref, PROMPTS)
    assert got == want
    model = llm.engine.runner.model
    linears = [m for n, m in model.named_modules() if isinstance(m, Linear)]
    assert all((m.fp8 is None) == m.keeps_model_dtype for m in linears)
    assert sum(m.keeps_model_dtype for m in linears) == model.config.num_hidden_layers == 3


@pytest.mark.parametrize("family,size", [("qwen3_moe", {"tensor_parallel_size": 2}),
                                         ("qwen3_moe", {"pipeline_parallel_size": 2}),
                                         ("qwen3_next", {"tensor_parallel_size": 2})])
def test_an_fp8_moe_engine_split_over_two_ranks_equals_one_device(tmp_path, family, size):
    """Qwen3-MoE with FP8 experts and linear layers in a tensor-parallel engine of two ranks (each its halves of the
    experts' rows with their scale blocks) and in two pipeline stages (each its own layers), and the Qwen3-Next
    hybrid over two tensor-parallel ranks (its linear-attention heads split too): tokens as on one device, logprobs
    within 1e-4."""
    if family == "qwen3_next":
        from test_hybrid_models import build_hybrid

        src, quantizes = build_hybrid(tmp_path, family, None), _quantizable
    else:
        src, quantizes = build_moe_checkpoint(tmp_path, family), _is_linear
    fp8, _ = _fp8_pair(src, tmp_path / "pair", quantizes=quantizes)
    engine = dict(num_gpu_blocks_override=32, num_cpu_threads=1, kv_cache_memory=None)
    _, want = _generate(fp8, PROMPTS, **engine)
    llm = LLM(str(fp8), **{**ENGINE, **engine, **size, "distributed_timeout": 5.0})
    try:
        _assert_fp8_experts(_experts_of(llm.engine.runner.model), llm)
        got = _outputs(llm, PROMPTS)
    finally:
        llm.shutdown()
    assert_same_tokens_and_logprobs(got, want)


def _cuda_tokens(llm) -> list[list[list[int]]]:
    """Greedy tokens of two prompts (3 and 70 tokens), one request at a time and then together."""
    prompts = [[5, 6, 7], list(range(30, 100))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    alone = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    return [alone, together]


# (a fixed KV size, not a share of the GPU: the CUDA tests run in three workers, whose memory the plan would count
#  as "outside PyTorch" against a share)
_CUDA = dict(device="cuda", kv_cache_memory="256MiB", max_model_len=256, skip_tokenizer_init=True, dtype="bfloat16")


def _eager_tokens_then_graphs(path):
    """(_cuda_tokens of an eager bf16 engine on CUDA, given back; a second engine with CUDA graphs)."""
    eager = LLM(str(path), enforce_eager=True, **_CUDA)
    want = _cuda_tokens(eager)
    del eager
    release()
    return want, LLM(str(path), **_CUDA)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_deepseek_on_cuda_graphs_equal_eager_and_follow_the_dequantized_model(fp8_pairs):
    """bf16 on CUDA: the FP8 layers' kernels replayed in CUDA graphs give the eager run's tokens (one request at a
    time: GEMV steps; together: W8A16 steps; a 70-token prompt: the W8A8 prefill), the FP8 weights stay FP8 on the
    GPU, and the first tokens are the dequantized checkpoint's (later ones may part at near-ties)."""
    fp8, ref = fp8_pairs["v3"]
    want, llm = _eager_tokens_then_graphs(fp8)
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert attn.fused_qkv_a_proj.weight.dtype == FP8 and attn.fused_qkv_a_proj.weight.is_cuda
    assert _cuda_tokens(llm) == want
    del llm, attn
    release()
    dequantized = _cuda_tokens(LLM(str(ref), **_CUDA))[1]
    assert [g[:4] for g in want[1]] == [w[:4] for w in dequantized]


def test_fp8_expert_kernels_in_the_interpreter_match_the_dequantizing_reference():
    """kernels/moe_triton.py reading FP8 experts (pairs, fused gate|up+act, down+combine, grouped) in Triton's CPU
    interpreter, float32: 16x8 blocks with partial ones, row scales, 8x256 and 16x12 blocks (each way the kernels load
    scales: a scale per row and tile, a small tile of them broadcast over each block's columns, one per element):
    moe_fp8_cases.py."""
    from conftest import run_in_triton_interpreter

    assert run_in_triton_interpreter("moe_fp8_cases.py").strip().endswith(" 0 failure(s)")


def test_the_expert_kernels_compile_for_sm90():
    """Every expert kernel compiled to PTX for the H200 on this CPU (triton_compile.py), FP8 weights with bf16
    activations (the plain bf16 variants run on the GPU in the CUDA tests): the interpreter ran the FP8 branch of a
    helper whose two returns differ in type, which the compiler refuses (it failed the first GPU run). Each way of
    loading the scales: 128-column blocks (one per row and tile), 32 (a tile of them), row scales (GROUP_K 0), 96
    (one per element)."""
    fp8 = True
    from triton_compile import compile_for_sm90

    from atlas.kernels import moe_triton

    rows_kernel = moe_triton._moe_down_combine_rows_kernel  # (its tile is TOPK_P2 x BLOCK_N rows: compiled apart)
    kernels = [getattr(moe_triton, n) for n in dir(moe_triton) if n.startswith("_moe") and n.endswith("_kernel")
               and getattr(moe_triton, n) is not rows_kernel]
    assert len(kernels) >= 4
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv" if fp8 else "*bf16", "y_ptr": "*bf16", "s_ptr": "*fp32",
            "h_ptr": "*bf16", "rw_ptr": "*fp32", "b_ptr": "*bf16", "alpha": "fp32", "limit": "fp32"}
    for group_k in (128, 32, 0, 96):
        consts = dict(TOPK=8, BLOCK_N=64, BLOCK_K=128, BLOCK_M=16, NUM_STAGES=2, EVEN_N=True, EVEN_K=True, FP8=fp8,
                      GROUP_N=128 if group_k else 1, GROUP_K=group_k, MXFP4=False)
        # (the other scale loads are one helper's branches: one kernel types them)
        for kernel in kernels if group_k == 128 else [moe_triton._moe_matmul_grouped_kernel]:
            assert ".entry" in compile_for_sm90(kernel, ptrs, consts), (kernel.__name__, group_k)
    # (the down kernel that loads a token's choices in one tile, off by default: FP8 blocks and bf16, at its tile)
    for w, fmt in (("*fp8e4nv", dict(FP8=True, GROUP_N=128, GROUP_K=128)), ("*bf16", dict(FP8=False))):
        consts = dict(TOPK=8, TOPK_P2=8, BLOCK_N=4, BLOCK_K=256, NUM_STAGES=3, EVEN_K=False, MXFP4=False,
                      HAS_BIAS=True, **fmt)
        assert ".entry" in compile_for_sm90(rows_kernel, dict(ptrs, w_ptr=w), consts), w


def _experts_of(model):
    return [m for name, m in model.named_modules() if name.endswith(".experts")]


@pytest.mark.parametrize("expert_parallel,layout", [(False, "block"), (True, "block"), (False, "channel")])
def test_fp8_experts_split_under_tensor_and_expert_parallelism(tmp_path, expert_parallel, layout):
    """Each rank's FP8 experts (tp 2: half of every expert's intermediate rows with their scale blocks, or row
    scales; expert parallelism: half of the experts whole) dequantize to its slice of the whole model's."""
    import atlas.models.loader as loader
    from atlas.config import ModelConfig
    from atlas.layers.parallel import ModelParallel

    fp8, _ = _fp8_pair(build_moe_checkpoint(tmp_path, "qwen3_moe"), tmp_path / "pair", layout)
    cfg = ModelConfig.from_path(fp8)
    whole = _experts_of(loader.build_model(cfg, torch.device("cpu"), torch.float32, 128))
    for rank in range(2):
        view = ModelParallel(tp_rank=rank, tp_size=2, expert_parallel=expert_parallel)
        part = _experts_of(loader.build_model(cfg, torch.device("cpu"), torch.float32, 128, view))
        for mine, full in zip(part, whole, strict=True):
            assert mine.fp8 is not None and mine.w13.dtype == FP8
            (w13, w2), (f13, f2) = mine.dequantized(torch.float32), full.dequantized(torch.float32)
            if expert_parallel:
                e = mine.num_local_experts
                assert torch.equal(w13, f13[rank * e: (rank + 1) * e]) and torch.equal(w2, f2[rank * e: (rank + 1) * e])
            else:
                i = mine.intermediate_size
                gate, up = f13[:, :2 * i], f13[:, 2 * i:]
                assert torch.equal(w13, torch.cat([gate[:, rank * i: (rank + 1) * i], up[:, rank * i: (rank + 1) * i]], 1))
                assert torch.equal(w2, f2[:, :, rank * i: (rank + 1) * i])


def test_fp8_experts_whose_slices_cut_the_scale_blocks_are_dequantized():
    """An intermediate size (this rank's) that does not split into whole scale blocks: plain experts (the checkpoint's
    dequantized as they load, as before), not FP8 ones that would read the wrong scales; likewise experts with biases
    and checkpoints with static activation scales. Row scales split anywhere."""
    from atlas.layers.linear import Fp8Scheme, quantizing
    from atlas.layers.moe import FusedExperts
    from atlas.layers.parallel import ModelParallel, building_with

    scheme = Fp8Scheme("block", (16, 16), "dynamic", "weight_scale_inv")
    with quantizing(scheme):
        assert FusedExperts(4, 32, 32, "silu").fp8 is not None
        assert FusedExperts(4, 32, 24, "silu").fp8 is None  # (gate|up rows: 24 is no multiple of 16)
        with building_with(ModelParallel(tp_rank=1, tp_size=2)):
            assert FusedExperts(4, 32, 48, "silu").fp8 is None  # (24 a rank)
            assert FusedExperts(4, 32, 64, "silu").fp8 is not None
        assert FusedExperts(4, 32, 32, "silu", bias=True).fp8 is None
    with quantizing(Fp8Scheme("channel")), building_with(ModelParallel(tp_rank=1, tp_size=2)):
        assert FusedExperts(4, 32, 24, "silu").fp8 is not None  # (a scale per row: no block to cut)
    with quantizing(Fp8Scheme("tensor", None, "static")):
        assert FusedExperts(4, 32, 32, "silu").fp8 is None  # (static activation scales: dequantized as they load)


def test_fp8_experts_missing_scales_are_refused(tmp_path):
    """An expert's FP8 weight without its weight_scale_inv is refused by name, never computed unscaled."""
    from atlas.errors import ModelLoadError

    fp8, _ = _fp8_pair(build_moe_checkpoint(tmp_path, "qwen3_moe"), tmp_path / "pair")
    state = load_file(str(fp8 / "model.safetensors"))
    name = next(n for n in state if n.endswith("experts.3.up_proj.weight_scale_inv"))
    del state[name]
    save_file(state, str(fp8 / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"experts\.3\.up_proj\.weight_scale_inv"):
        LLM(str(fp8), **ENGINE)


def test_fp8_experts_load_format_dummy(tmp_path):
    """--load-format dummy fills FP8 experts: FP8 values over the range, every scale 1e-3 / 448."""
    fp8, _ = _fp8_pair(build_moe_checkpoint(tmp_path, "qwen3_moe"), tmp_path / "pair")
    llm = LLM(str(fp8), load_format="dummy", **ENGINE)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    for m in _experts_of(llm.engine.runner.model):
        assert m.w13.dtype == FP8 and m.w13.float().abs().max() > 1
        assert torch.all(m.w13_weight_scale_inv == 1e-3 / 448) and torch.all(m.w2_weight_scale_inv == 1e-3 / 448)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_expert_kernels_on_cuda_match_the_dequantizing_reference():
    """Each FP8 expert kernel (pairs, fused gate|up+act, down+combine, grouped) and FusedExperts' Triton path at 1-30
    tokens on CUDA, bf16 activations, DeepSeek-V3's expert shapes (8 experts of hidden 7168, intermediate 2048) and
    128x128 blocks, against the dequantizing reference: moe_fp8_cases.py v3."""
    from conftest import run_cases_script

    assert run_cases_script("moe_fp8_cases.py", "v3").strip().endswith(" 0 failure(s)")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_qwen3_moe_experts_in_cuda_graphs_equal_eager(tmp_path):
    """bf16 on CUDA: an FP8 Qwen3-MoE's experts stay FP8 on the GPU, the model runs in CUDA graphs (the FP8 experts'
    Triton kernels at every token count, no host sync) and gives the eager run's tokens (one request at a time: the
    pairs kernels; together, and a 70-token prompt: the grouped kernel)."""
    fp8, _ = _fp8_pair(build_moe_checkpoint(tmp_path, "qwen3_moe"), tmp_path / "pair")
    want, llm = _eager_tokens_then_graphs(fp8)
    experts = _experts_of(llm.engine.runner.model)
    assert experts and all(m.w13.dtype == FP8 and m.w13.is_cuda and m.graph_safe() for m in experts)
    assert llm.engine.runner.model.supports_cuda_graphs(torch.bfloat16, torch.device("cuda"))
    assert _cuda_tokens(llm) == want
    del llm, experts
    release()


# llm-compressor's FP8 recipe for Qwen3.5(-MoE) (FP8_DYNAMIC: per-channel weights, per-token activations), with its
# ignore list: the linear-attention layers, routers, shared-expert gates and shared experts stay in floating point.
_CT_RECIPE_IGNORE = ["re:.*lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$", r"re:.*mlp\.shared_expert$",
                     "re:.*linear_attn.*"]


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_compressed_tensors_hybrid_with_the_recipes_ignore_list_equals_its_dequantized_weights(name, tmp_path):
    """A compressed-tensors checkpoint as llm-compressor's Qwen3.5 example writes it (channel scales, dynamic
    per-token activations; `ignore` regexes leaving every linear-attention layer, router and shared expert in
    floating point): greedy tokens and top logprobs equal the dequantized checkpoint's; the quantized layers hold
    FP8, the linear-attention layers and shared-expert gates the model dtype."""
    import re

    from test_fp8_linear import _TOKEN, _ct
    from test_hybrid_models import build_hybrid

    src = build_hybrid(tmp_path, name, None)
    patterns = [re.compile(p.removeprefix("re:")) for p in _CT_RECIPE_IGNORE]

    def quantized(weight: str, w: torch.Tensor) -> bool:
        module = weight.removesuffix(".weight")
        return _is_linear(weight, w) and not any(p.fullmatch(module) for p in patterns)

    fp8, ref = _fp8_pair(src, tmp_path / "pair", layout="channel", quantizes=quantized)
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {**_ct("channel", _TOKEN), "ignore": _CT_RECIPE_IGNORE}
    (fp8 / "config.json").write_text(json.dumps(config))
    stored = load_file(str(fp8 / "model.safetensors"))
    assert any(k.endswith("weight_scale") for k in stored) and not any(
        "linear_attn" in k and k.endswith("_scale") for k in stored)
    llm, got = _generate(fp8, PROMPTS)
    _, want = _generate(ref, PROMPTS)
    assert got == want
    layers = {n: m for n, m in llm.engine.runner.model.named_modules() if isinstance(m, Linear)}
    # (the regexes name modules: `mlp.shared_expert$` matches no Linear of the shared expert, whose projections a
    #  quantizer matching them one by one quantizes)
    plain = {n for n in layers if "linear_attn" in n or n.endswith("shared_expert_gate")}
    assert plain and all(layers[n].weight.dtype == torch.float32 for n in plain), [n for n in plain if layers[n].weight.dtype != torch.float32]
    fp8_layers = [n for n in layers if n not in plain]
    assert any("self_attn" in n for n in fp8_layers)
    assert all(layers[n].weight.dtype == FP8 for n in fp8_layers), [n for n in fp8_layers
                                                                    if layers[n].weight.dtype != FP8]
