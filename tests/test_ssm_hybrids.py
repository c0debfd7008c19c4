"""The state-space hybrids against transformers on tiny random checkpoints (fp32, CPU): the Mamba-2 ones, Granite
4.0-H (granitemoehybrid), Bamba, Falcon-H1 and Nemotron-H (nemotron_h), Jamba (Mamba version 1) and LFM2 / LFM2-MoE
(gated short convolutions). The SSD scan's chunked form against its recurrence and against transformers' own torch functions;
logits over chunks (prompts across several scan chunks, continued from the recurrent state); greedy tokens batched,
preempted, from the prefix cache (the state snapshots) and under n-gram speculation (the state backed up and replayed
after rejections), every KV page and state slot returned; two tensor-parallel ranks and two pipeline stages against
one device; Granite's MoE model with NoPE attention as released and a dense one with RoPE, Nemotron-H's Mamba-2 /
attention / squared-ReLU MLP / MoE blocks; the released configs' layers_block_type, hybrid_override_pattern and
full_attn_idxs; the Triton kernels in the interpreter; refusals by name."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    _build,
    _correction_bias,
    check_batched_and_cached,
    generated_tokens,
    hf_greedy,
    hf_model,
    random_ids,
)
from test_hybrid_models import assert_slots_returned
from test_models import atlas_logits, hf_logits

from atlas import LLM, SamplingParams
from atlas.kernels import mamba2

_MAMBA = dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4,
              mamba_chunk_size=8, mamba_expand=1, embedding_multiplier=3.0, residual_multiplier=0.4,
              attention_multiplier=0.2, logits_scaling=2.5, shared_intermediate_size=48)
CONFIGS = {
    # Granite 4.0-H as released (H-Small / H-Tiny): routed experts + shared expert, attention without RoPE
    "moe": dict(model_type="granitemoehybrid", architectures=["GraniteMoeHybridForCausalLM"], num_hidden_layers=4,
                layer_types=["mamba", "attention", "mamba", "mamba"], num_local_experts=4, num_experts_per_tok=2,
                intermediate_size=32, **_MAMBA),
    # the dense variant (H-1B / H-350M: shared expert only), here with RoPE attention and one Mamba-2 group
    "dense": dict(model_type="granitemoehybrid", architectures=["GraniteMoeHybridForCausalLM"], num_hidden_layers=3,
                  layer_types=["mamba", "mamba", "attention"], num_local_experts=0, position_embedding_type="rope",
                  **{**_MAMBA, "mamba_n_groups": 1}),
    # Bamba: Granite 4.0-H's layers without its multipliers, a dense MLP, RoPE on half of each head
    "bamba": dict(model_type="bamba", architectures=["BambaForCausalLM"], num_hidden_layers=3, attn_layer_indices=[1],
                  intermediate_size=96, mamba_n_heads=8, mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=8,
                  mamba_expand=1),
    # Falcon-H1: Mamba-2 and attention side by side in every block, its mup multipliers all set (none 1), the
    # Mamba-2 width apart from the hidden size, no output norm
    "falcon_h1": dict(model_type="falcon_h1", architectures=["FalconH1ForCausalLM"], num_hidden_layers=2,
                      intermediate_size=96, mamba_d_ssm=48, mamba_n_heads=6, mamba_d_state=8, mamba_n_groups=2,
                      mamba_chunk_size=8, embedding_multiplier=2.0, lm_head_multiplier=0.5, key_multiplier=0.7,
                      attention_in_multiplier=1.3, attention_out_multiplier=0.8, ssm_in_multiplier=1.2,
                      ssm_out_multiplier=0.6, mlp_multipliers=[1.5, 0.7], ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 1.3]),
    # ... and with the output norm before the gate (mamba_rms_norm, mamba_norm_before_gate)
    "falcon_h1_norm": dict(model_type="falcon_h1", architectures=["FalconH1ForCausalLM"], num_hidden_layers=2,
                           intermediate_size=96, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_state=8, mamba_n_groups=2,
                           mamba_chunk_size=8, mamba_rms_norm=True, mamba_norm_before_gate=True),
    # Nemotron-H (Nano 2's block kinds): one mixer or MLP a block
    "nemotron_h": dict(model_type="nemotron_h", architectures=["NemotronHForCausalLM"],
                       layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"],
                       intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
                       chunk_size=8),
    # Nemotron 3 Nano's blocks: routed non-gated experts (grouped sigmoid routing with a correction bias, scaled)
    # and a shared expert in the moe blocks
    "nemotron_h_moe": dict(model_type="nemotron_h", architectures=["NemotronHForCausalLM"],
                           layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
                           mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=8,
                           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
                           routed_scaling_factor=2.5),
    # Jamba: Mamba (version 1) layers, an attention layer every 4th from 1, MoE every 2nd from 1 (dense MLPs
    # between), the scan's dt rank auto (ceil(hidden / 16))
    "jamba": dict(model_type="jamba", architectures=["JambaForCausalLM"], num_hidden_layers=4, intermediate_size=96,
                  attn_layer_period=4, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_expand=1),
    # LFM2's layout: convolution layers and attention layers, the MLP width auto-adjusted (2/3, rounded up to 32)
    "lfm2": dict(model_type="lfm2", architectures=["Lfm2ForCausalLM"], num_hidden_layers=4,
                 layer_types=["conv", "full_attention", "conv", "conv"], intermediate_size=144, block_multiple_of=32,
                 block_ffn_dim_multiplier=1.5, conv_L_cache=3, norm_eps=1e-5, tie_word_embeddings=True),
    # ... with the convolution's biases, the width as given, an untied head
    "lfm2_bias": dict(model_type="lfm2", architectures=["Lfm2ForCausalLM"], num_hidden_layers=3,
                      layer_types=["conv", "conv", "full_attention"], intermediate_size=96, conv_bias=True,
                      block_auto_adjust_ff_dim=False, conv_L_cache=4, tie_word_embeddings=False),
    # LFM2-MoE: a dense first layer, then sparse blocks (sigmoid routing with the expert bias, renormalized, scaled)
    "lfm2_moe": dict(model_type="lfm2_moe", architectures=["Lfm2MoeForCausalLM"], num_hidden_layers=4,
                     layer_types=["conv", "full_attention", "conv", "conv"], intermediate_size=96,
                     moe_intermediate_size=32, num_dense_layers=1, num_experts=8, num_experts_per_tok=2,
                     routed_scaling_factor=2.0, tie_word_embeddings=True),
}
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"kv_cache_memory": "8MiB", "block_size": 4, "skip_tokenizer_init": True, **kw})


def routing_biases(model: torch.nn.Module, seed: int) -> None:
    """Non-zero routing biases (Nemotron-H's e_score_correction_bias, LFM2-MoE's expert_bias; buffers, which the
    randomizer leaves at zero): they must choose the experts and not weight them."""
    _correction_bias(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith(".expert_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ssm_hybrids")
    return {name: _build(root, name, spec, None, 0, {}, randomize=routing_biases) for name, spec in CONFIGS.items()}


@pytest.fixture(scope="module")
def expected(checkpoints):
    prompts = [random_ids(n, 20 + n) for n in (5, 30, 47)]
    out = {}
    for name, path in checkpoints.items():
        model = hf_model(path)
        out[name] = (prompts, [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts])
    return out


def _scan_inputs(n: int, L: int, H: int = 4, P: int = 8, N: int = 6, G: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, L, H, P, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(n, L, H, generator=g))
    A = -torch.rand(H, generator=g) - 0.1
    B, C = torch.randn(n, L, G, N, generator=g), torch.randn(n, L, G, N, generator=g)
    state = torch.randn(n, H, N, P, generator=g)
    return x, dt, A, B, C, state


def test_chunked_scan_equals_the_recurrence_and_transformers():
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as ref

    x, dt, A, B, C, state = _scan_inputs(2, 21)
    y, final = mamba2.ssd_recurrent(x, dt, A, B, C, state)
    for chunk in (4, 8, 64):  # (chunks that divide the length, that do not, and one past it)
        yc, fc = mamba2.ssd_chunked(x, dt, A, B, C, state, chunk=chunk)
        torch.testing.assert_close(yc, y, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fc, final, rtol=1e-4, atol=1e-4)
    # transformers' torch scan takes the state as [H, P, N] and the raw dt (softplus inside): same numbers
    raw_dt = torch.log(torch.expm1(dt))
    want, want_state = ref.mamba2_chunk_scan(x, raw_dt, A, B, C, chunk_size=8, dt_softplus=True,
                                             initial_states=state.transpose(-1, -2), return_final_states=True)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, want_state.transpose(-1, -2), rtol=1e-4, atol=1e-4)


def test_zero_rows_leave_the_state_as_it_is():
    """The padding of a batched prefill (dt = 0, x = 0) is the identity on the state."""
    x, dt, A, B, C, state = _scan_inputs(1, 9)
    x[:, 5:], dt[:, 5:] = 0, 0
    _, after_five = mamba2.ssd_chunked(x[:, :5], dt[:, :5], A, B[:, :5], C[:, :5], state, chunk=4)
    _, after_nine = mamba2.ssd_chunked(x, dt, A, B, C, state, chunk=4)
    torch.testing.assert_close(after_nine, after_five)


def test_triton_kernels_in_the_interpreter():
    """The scan's decode / verify kernel (kernels/mamba2_triton.py) and the biased convolution kernels against the
    PyTorch reference, and a layer's eager and uniform steps through the Triton paths against the PyTorch ones, on
    CPU through Triton's interpreter (tests/mamba2_cases.py)."""
    from conftest import run_in_triton_interpreter

    assert "3 mamba2 cases match" in run_in_triton_interpreter("mamba2_cases.py", "3")


def test_triton_kernels_compile_for_sm90():
    """The scan kernel (decode and verify forms) at Granite 4.0-H-Small's heads and the convolution kernels with
    their bias compiled for the H200 on this CPU (triton_compile.py), bf16 rows."""
    from triton_compile import compile_for_sm90

    from atlas.kernels.gated_delta_rule_triton import _conv_uniform_kernel, _conv_varlen_kernel
    from atlas.kernels.mamba1_triton import _selective_scan_kernel
    from atlas.kernels.mamba2_triton import _ssd_decode_kernel

    types = {n: "*bf16" for n in ("x_ptr", "b_ptr", "c_ptr")}
    types |= {n: "*fp32" for n in ("dt_ptr", "a_ptr", "state_ptr", "out_ptr")}
    types |= {"rows_ptr": "*i64", "slots_ptr": "*i64", "keep_ptr": "*i32"}
    for q in (1, 3):
        ptx = compile_for_sm90(_ssd_decode_kernel, types, {"RATIO": 128, "N": 128, "P": 64, "BLOCK_N": 128,
                                                           "BLOCK_P": 32, "Q": q})
        assert ".visible .entry _ssd_decode_kernel" in ptx
    scan = {n: "*bf16" for n in ("x_ptr", "b_ptr", "c_ptr")}
    scan |= {n: "*fp32" for n in ("dt_ptr", "a_ptr", "state_ptr", "out_ptr")}
    scan |= {n: "*i64" for n in ("starts_ptr", "counts_ptr", "slots_ptr")} | {"keep_ptr": "*i32"}
    assert ".visible .entry _selective_scan_kernel" in compile_for_sm90(  # (Jamba's: 16 state entries)
        _selective_scan_kernel, scan, {"N": 16, "BLOCK_D": 128, "BLOCK_N": 16})
    conv = {n: "*bf16" for n in ("x_ptr", "w_ptr", "state_ptr", "out_ptr", "bias_ptr")}
    conv |= {n: "*i64" for n in ("row_seq_ptr", "starts_ptr", "slots_ptr")} | {"keep_ptr": "*i32"}
    for silu in (True, False):  # (False: LFM2's short convolution)
        assert ".visible .entry _conv_uniform_kernel" in compile_for_sm90(
            _conv_uniform_kernel, conv, {"Q": 3, "K": 4, "BLOCK_C": 256, "LIBDEVICE": True, "HAS_BIAS": True,
                                         "SILU": silu})
        assert ".visible .entry _conv_varlen_kernel" in compile_for_sm90(
            _conv_varlen_kernel, conv, {"K": 4, "BLOCK_T": 16, "BLOCK_C": 128, "HAS_STATE": True, "LIBDEVICE": True,
                                        "HAS_BIAS": True, "SILU": silu})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_over_chunks_match_transformers(name, checkpoints):
    llm = _llm(checkpoints[name])
    ids = random_ids(45, 1)
    want = hf_logits(checkpoints[name], ids)
    torch.testing.assert_close(atlas_logits(llm, ids, [45]), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(atlas_logits(llm, ids, [7, 13, 10] + [1] * 15), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_batched_preempted_cached_and_speculated(name, checkpoints, expected):
    prompts, tokens = expected[name]
    tight = _llm(checkpoints[name], num_gpu_blocks_override=28, max_num_batched_tokens=32, max_model_len=80)
    check_batched_and_cached(tight, prompts, tokens, GREEDY)
    assert_slots_returned(tight)
    ngram = _llm(checkpoints[name], speculative="ngram", speculative_policy="always", num_draft_tokens=3, ngram_min=1,
                 ngram_max=3)
    assert generated_tokens(ngram, prompts, GREEDY) == tokens
    assert_slots_returned(ngram)


def test_the_released_configs_layers_block_type_is_read(tmp_path, checkpoints, expected):
    import json
    import shutil

    path = tmp_path / "released"
    shutil.copytree(checkpoints["moe"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["layers_block_type"] = ["mamba" if t == "linear_attention" else "attention" for t in cfg.pop("layer_types")]
    cfg["position_embedding_type"] = "nope"
    (path / "config.json").write_text(json.dumps(cfg))
    prompts, tokens = expected["moe"]
    assert generated_tokens(_llm(path), prompts, GREEDY) == tokens


@pytest.mark.parametrize("name", ["nemotron_h", "nemotron_h_moe"])
def test_nemotrons_released_pattern_is_read(name, tmp_path, checkpoints, expected):
    """hybrid_override_pattern (one letter a block: M, *, -, E) in place of layers_block_type, as the released
    configs give it."""
    import json
    import shutil

    path = tmp_path / "pattern"
    shutil.copytree(checkpoints[name], path)
    cfg = json.loads((path / "config.json").read_text())
    letters = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    cfg["hybrid_override_pattern"] = "".join(letters[t] for t in cfg.pop("layers_block_type"))
    (path / "config.json").write_text(json.dumps(cfg))
    prompts, tokens = expected[name]
    assert generated_tokens(_llm(path), prompts, GREEDY) == tokens


def test_nemotrons_latent_expert_projections_match_transformers(tmp_path):
    """moe_latent_size: the routed experts between fc1_latent_proj and fc2_latent_proj (the router and the shared
    expert on the block's input), logits against transformers'."""
    path = _build(tmp_path, "latent", {**CONFIGS["nemotron_h_moe"], "moe_latent_size": 24}, None, 0, {},
                  randomize=routing_biases)
    ids = random_ids(30, 2)
    torch.testing.assert_close(atlas_logits(_llm(path), ids, [11, 19]), hf_logits(path, ids), rtol=1e-4, atol=1e-4)


def test_lfm2s_released_full_attn_idxs_is_read(tmp_path, checkpoints, expected):
    import json
    import shutil

    path = tmp_path / "idxs"
    shutil.copytree(checkpoints["lfm2"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["full_attn_idxs"] = [i for i, t in enumerate(cfg.pop("layer_types")) if t == "full_attention"]
    (path / "config.json").write_text(json.dumps(cfg))
    prompts, tokens = expected["lfm2"]
    assert generated_tokens(_llm(path), prompts, GREEDY) == tokens


def test_the_mamba1_scan_kernel_in_the_interpreter():
    """Jamba's selective scan: the Triton kernel over eager and uniform steps against the PyTorch path, through
    Triton's interpreter (tests/mamba2_cases.py's Mamba version 1 cases)."""
    from conftest import run_in_triton_interpreter

    assert "2 mamba1 cases match" in run_in_triton_interpreter("mamba2_cases.py", "2", "--mamba1")


def test_the_short_convolution_without_its_silu_in_the_interpreter():
    """LFM2's convolution: the eager and uniform kernels with SILU off (and a bias) against the reference, through
    Triton's interpreter (tests/mamba2_cases.py's short-convolution cases)."""
    from conftest import run_in_triton_interpreter

    assert "short convolution cases match" in run_in_triton_interpreter("mamba2_cases.py", "2", "--short-conv")


@pytest.mark.parametrize("name", ["moe", "nemotron_h_moe"])
def test_an_fp8_block_checkpoint_loads_as_its_dequantized_weights(name, checkpoints, tmp_path):
    """These families keep no FP8 weights: a block-FP8 checkpoint (Mamba-2 projections, attention, experts) loads
    dequantized to the model dtype, the tokens of its dequantized weights exactly."""
    from test_quantization_refusal import (
        BLOCK,
        _dequantize,
        _is_linear,
        _rewrite,
        fp8_block_quantize,
        fp8_checkpoint,
    )

    def dequantized(tensor_name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        return {tensor_name: _dequantize(*fp8_block_quantize(t, BLOCK)).to(t.dtype) if _is_linear(tensor_name, t)
                else t}

    fp8 = fp8_checkpoint(checkpoints[name], tmp_path / "fp8")
    reference = _rewrite(checkpoints[name], tmp_path / "dequantized", dequantized, None)
    prompts = [[5, 6, 7, 8], list(range(20, 44))]
    assert generated_tokens(_llm(fp8), prompts, GREEDY) == generated_tokens(_llm(reference), prompts, GREEDY)
    assert generated_tokens(_llm(fp8), prompts, GREEDY) != generated_tokens(_llm(checkpoints[name]), prompts, GREEDY)


def test_what_atlas_does_not_compute_is_refused_by_name(tmp_path, checkpoints):
    import json
    import shutil

    from atlas.errors import AtlasError

    with pytest.raises(AtlasError, match="GraniteMoeHybridForCausalLM"):
        _llm(checkpoints["moe"], quantization="fp8")
    with pytest.raises(AtlasError, match="NemotronHForCausalLM"):
        _llm(checkpoints["nemotron_h"], quantization="fp8")
    bias = tmp_path / "bamba_bias"
    shutil.copytree(checkpoints["bamba"], bias)
    cfg = json.loads((bias / "config.json").read_text())
    (bias / "config.json").write_text(json.dumps({**cfg, "mlp_bias": True}))
    with pytest.raises(AtlasError, match="mlp_bias"):
        _llm(bias)
    with pytest.raises(AtlasError, match="(?i)lora|adapter"):
        _llm(checkpoints["moe"], enable_lora=True)
    path = tmp_path / "mamba_only"
    shutil.copytree(checkpoints["dense"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"] = ["mamba"] * cfg["num_hidden_layers"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AtlasError, match="Mamba-2 layers only"):
        _llm(path)


@pytest.mark.parametrize("name", ["moe", "lfm2_bias"])
def test_two_pipeline_stages_give_one_devices_tokens(name, checkpoints, expected):
    """The layers split over two stages (each keeps the state pools of its own recurrent layers; a stage of recurrent
    layers only keeps no KV pages), with n-gram drafts verified and rejected."""
    from test_parallel import PARALLEL

    prompts, tokens = expected[name]
    pp = LLM(str(checkpoints[name]), pipeline_parallel_size=2, kv_cache_memory="8MiB", skip_tokenizer_init=True,
             max_num_batched_tokens=16, speculative="ngram", speculative_policy="always", num_draft_tokens=3,
             ngram_min=1, ngram_max=3, **PARALLEL)
    try:
        assert generated_tokens(pp, prompts, GREEDY) == tokens
    finally:
        pp.shutdown()


# (one config of each way a layer splits: Granite's experts and its single shared group, Falcon-H1's parallel block,
#  Nemotron-H's non-gated experts, Jamba's Mamba channels, LFM2's biased convolution and LFM2-MoE's experts)
@pytest.mark.parametrize("name", ["moe", "dense", "falcon_h1", "nemotron_h_moe", "jamba", "lfm2_bias", "lfm2_moe"])
def test_two_tensor_parallel_ranks_give_one_devices_tokens(name, checkpoints, expected):
    """Each rank holds half of the recurrent layers' heads or channels: Granite's MoE config's and Nemotron-H's two
    groups split one a rank; Granite's dense config has one group, which both ranks read whole, their gated norm
    summing its squares over both. With n-gram drafts verified and rejected (each rank's state backed up and
    replayed)."""
    from test_parallel import PARALLEL

    prompts, tokens = expected[name]
    tp = LLM(str(checkpoints[name]), tensor_parallel_size=2, kv_cache_memory="8MiB", skip_tokenizer_init=True,
             max_num_batched_tokens=16, speculative="ngram", speculative_policy="always", num_draft_tokens=3,
             ngram_min=1, ngram_max=3, **PARALLEL)
    try:
        assert generated_tokens(tp, prompts, GREEDY) == tokens
    finally:
        tp.shutdown()


def test_layouts_the_mamba_heads_do_not_split_into_are_refused(checkpoints, tmp_path):
    """Five Mamba-2 heads over two ranks: refused at start-up, naming the heads (before any weight is read)."""
    import json
    import shutil

    from test_parallel import PARALLEL

    from atlas.errors import AtlasError

    path = tmp_path / "odd"
    shutil.copytree(checkpoints["nemotron_h"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(mamba_num_heads=5, n_groups=1)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AtlasError, match=r"does not divide the model's 5 Mamba-2 heads \(mamba_num_heads\)"):
        LLM(str(path), tensor_parallel_size=2, kv_cache_memory="8MiB", skip_tokenizer_init=True, **PARALLEL)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_on_cuda_the_graphs_give_transformers_tokens(name, checkpoints, expected):
    """The Triton kernels on the GPU against the reference (tests/mamba2_cases.py, fp32 and bf16), then greedy tokens
    through the CUDA graphs, plain and under n-gram speculation, equal to transformers' in float32 up to a near-tie of
    its logits."""
    from conftest import (
        CUDA_KV,
        assert_greedy_agrees,
        assert_pages_returned,
        atlas_greedy_margins,
        hf_greedy_margins,
        run_cases_script,
        stale_reference,
    )

    if name == "moe":
        assert "6 mamba2 cases match on cuda" in run_cases_script("mamba2_cases.py", "6")
    if name == "jamba":
        assert "4 mamba1 cases match on cuda" in run_cases_script("mamba2_cases.py", "4", "--mamba1")
    if name == "lfm2":
        assert "4 short convolution cases match on cuda" in run_cases_script("mamba2_cases.py", "4", "--short-conv")

    prompts, _ = expected[name]
    # (the tokens equal up to a near-tie of the reference's logits: tests/conftest.assert_greedy_agrees)
    if stale_reference(checkpoints[name]):  # (this transformers computes the family wrongly: Atlas's CPU path)
        want, margins = atlas_greedy_margins(_llm(checkpoints[name], device="cpu", dtype="float32"), prompts,
                                             GREEDY.max_tokens)
    else:
        ref = hf_model(checkpoints[name], dtype=torch.float32, device="cuda")
        want, margins = hf_greedy_margins(ref, prompts, GREEDY.max_tokens)
    llm = _llm(checkpoints[name], device="cuda", dtype="float32", kv_cache_memory=CUDA_KV)
    assert_greedy_agrees(generated_tokens(llm, prompts, GREEDY), want, margins)
    assert_pages_returned(llm)
    ngram = _llm(checkpoints[name], device="cuda", dtype="float32", kv_cache_memory=CUDA_KV, speculative="ngram",
                 speculative_policy="always", num_draft_tokens=3, ngram_min=1, ngram_max=3)
    assert_greedy_agrees(generated_tokens(ngram, prompts, GREEDY), want, margins)
