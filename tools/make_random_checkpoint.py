"""Write a random-weight Hugging Face checkpoint of a named shape, fast, for speed benchmarks.

    python tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/qwen3-8b [--dflash-drafter]

Weights are drawn on the GPU when there is one (N(0, std), norms = 1), moved to the CPU one shard at a
time and written with safetensors (shards of --shard-size bytes, with model.safetensors.index.json),
beside config.json and generation_config.json. No tokenizer: load it with --skip-tokenizer-init.
Every tensor has its own seed (--seed and its index), so the values do not depend on the sharding.

--dflash-drafter also writes a random DFlash drafter for that target into OUT/dflash-drafter, in the
published z-lab layout (config.json with block_size, num_target_layers and dflash_config
{target_layer_ids, mask_token_id}; fc, hidden_norm, norm and Qwen3 decoder layers with q_norm / k_norm;
no embedding, no LM head). With --config-only, the drafter's config alone; the hybrid shapes (config-only) get a
Qwen3 drafter at the target's hidden size this way.

--config-only writes the config files alone, for `--load-format dummy` (random weights drawn by the engine).

gemma-3-12b is the text model of the published Gemma 3 12B (Gemma3ForCausalLM; its config from the published
text_config, see SHAPES): 11.8 B parameters, 23.5 GB in bf16, best used with --config-only and --load-format dummy.

gemma-4-text-defaults (transformers' Gemma4TextConfig defaults) and gemma-4-tiny are config-only too.

gpt-oss-20b and gpt-oss-120b (and gpt-oss-tiny, for tests) are config-only, from the published config.json files
(MXFP4 quantization_config included): write them with --config-only and run them with --load-format dummy, which
draws the experts as MXFP4 codes where Atlas keeps MXFP4 experts (models/gpt_oss.py), else in the model dtype.

--fp8 block writes the projections (q/k/v/o, gate/up/down, experts) in the Qwen -FP8 / DeepSeek-V3 layout:
float8_e4m3fn weights with a float32 `weight_scale_inv` per 128 x 128 block, `quantization_config: {quant_method:
fp8, weight_block_size: [128, 128], activation_scheme: dynamic}`; --fp8 channel in fbgemm_fp8's (a `weight_scale`
per output row). Embedding, LM head, norms and routers stay in --dtype. With --config-only only the config says so
(the engine then draws FP8 weights itself):

    python tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/qwen3-8b-fp8 --fp8 block --config-only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

QWEN3 = dict(architecture="Qwen3ForCausalLM", model_type="qwen3", head_dim=128, vocab_size=151936,
             rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6, bos_token_id=151643,
             eos_token_id=151645, qk_norm=True, mask_token_id=151669)
SHAPES = {
    "qwen3-0.6b": dict(QWEN3, num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                       intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-8b": dict(QWEN3, num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=12288, tie_word_embeddings=False),
    "qwen3-32b": dict(QWEN3, num_hidden_layers=64, hidden_size=5120, num_attention_heads=64, num_key_value_heads=8,
                      intermediate_size=25600, tie_word_embeddings=False),
    "llama3-70b": dict(architecture="LlamaForCausalLM", model_type="llama", num_hidden_layers=80, hidden_size=8192,
                       num_attention_heads=64, num_key_value_heads=8, head_dim=128, intermediate_size=28672,
                       vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False, qk_norm=False,
                       mask_token_id=128002),
    "tiny": dict(QWEN3, num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=False, mask_token_id=511),
    # DeepSeek-V2-Lite's shape: MLA without q compression (kv_lora_rank 512 + rope 64 cached per token), a
    # dense first layer, then 64 routed experts of 1408 (6 active, softmax greedy routing) + 2 shared.
    "deepseek-v2-lite": dict(
        architecture="DeepseekV2ForCausalLM", model_type="deepseek_v2", num_hidden_layers=27, hidden_size=2048,
        num_attention_heads=16, num_key_value_heads=16, head_dim=64, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=10944,
        moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
        first_k_dense_replace=1, topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, vocab_size=102400, rope_theta=10000.0,
        max_position_embeddings=163840, rms_norm_eps=1e-6, bos_token_id=100000, eos_token_id=100001,
        tie_word_embeddings=False, qk_norm=False, mask_token_id=102399,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}),
}
SHAPES["deepseek-tiny"] = dict(SHAPES["deepseek-v2-lite"], num_hidden_layers=3, hidden_size=64, num_attention_heads=4,
                               num_key_value_heads=4, head_dim=8, kv_lora_rank=32, qk_nope_head_dim=16,
                               qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, vocab_size=512,
                               max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, mask_token_id=511,
                               rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 256,
                                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                             "mscale_all_dim": 0.707})
# DeepSeek-V3.2's per-layer shapes (deepseek-ai/DeepSeek-V3.2 config.json: MLA with q_lora 1536, kv_lora 512 + rope
# 64, 128 heads; DSA indexer of 64 heads x 128, top-2048; experts of 2048, 8 active, sigmoid + correction bias in 8
# groups), CUT to fit one GPU: 8 layers (3 dense) and 32 routed experts in place of 61 and 256 (about 11 B parameters,
# 22 GB in bf16). Not the published model's size: best used with --config-only and --load-format dummy.
SHAPES["deepseek-v3.2-cut"] = dict(
    SHAPES["deepseek-v2-lite"], architecture="DeepseekV32ForCausalLM", model_type="deepseek_v32", num_hidden_layers=8,
    hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, head_dim=64, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432,
    moe_intermediate_size=2048, n_routed_experts=32, num_experts_per_tok=8, n_shared_experts=1,
    first_k_dense_replace=3, topk_method="noaux_tc", scoring_func="sigmoid", n_group=8, topk_group=4,
    norm_topk_prob=True, routed_scaling_factor=2.5, vocab_size=129280, bos_token_id=0, eos_token_id=1,
    mask_token_id=129279, index_topk=2048, index_n_heads=64, index_head_dim=128, num_nextn_predict_layers=1,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
SHAPES["deepseek-v3.2-tiny"] = dict(
    SHAPES["deepseek-v3.2-cut"], num_hidden_layers=3, first_k_dense_replace=1, hidden_size=64, num_attention_heads=4,
    num_key_value_heads=4, head_dim=8, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
    n_group=4, topk_group=2, vocab_size=512, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
    mask_token_id=511, index_topk=8, index_n_heads=4, index_head_dim=16, num_nextn_predict_layers=0,
    rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 256, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
# GLM-5's per-layer shapes (glm_moe_dsa): transformers' GlmMoeDsaConfig defaults, which its docstring ties to
# zai-org/GLM-5 (hidden 6144, 64 heads, MLA with q_lora 2048, kv_lora 512 + rope 64, qk_nope 192, v 256; DSA
# indexer of 32 heads x 128, top-2048, every layer indexing; experts of 2048, 8 active of 256, 1 shared, sigmoid +
# correction bias, one group, scaling 2.5; 3 dense layers of 12288; vocab 154880; 202752 positions; rms eps 1e-5).
# rope_theta is not among those defaults: 1e6 here is an assumption (GLM-4.5's), not a checked fact. CUT to fit one
# GPU as deepseek-v3.2-cut: 8 layers (3 dense) and 32 routed experts in place of 78 and 256. Config-only use.
SHAPES["glm-5-cut"] = dict(
    SHAPES["deepseek-v3.2-cut"], architecture="GlmMoeDsaForCausalLM", model_type="glm_moe_dsa", num_hidden_layers=8,
    hidden_size=6144, num_attention_heads=64, num_key_value_heads=64, head_dim=64, q_lora_rank=2048, kv_lora_rank=512,
    qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, intermediate_size=12288, moe_intermediate_size=2048,
    n_routed_experts=32, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3, n_group=1, topk_group=1,
    routed_scaling_factor=2.5, vocab_size=154880, max_position_embeddings=202752, rms_norm_eps=1e-5, rope_theta=1e6,
    bos_token_id=0, eos_token_id=1, mask_token_id=154879, index_topk=2048, index_n_heads=32, index_head_dim=128,
    rope_scaling=None, indexer_types=["full"] * 8)
# Its tiny sibling: a layer pattern with two layers sharing the first's top-k (full, shared, shared, full); 16
# indexer heads keep exact top-k ties (every head's ReLU at zero) rare, so greedy can be compared to transformers'.
SHAPES["glm-5-tiny"] = dict(
    SHAPES["glm-5-cut"], num_hidden_layers=4, first_k_dense_replace=1, hidden_size=64, num_attention_heads=4,
    num_key_value_heads=4, head_dim=8, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
    vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
    mask_token_id=511, index_topk=8, index_n_heads=16, index_head_dim=16, num_nextn_predict_layers=0,
    indexer_types=["full", "shared", "shared", "full"])
# LongCat-Flash's per-layer shapes (longcat_flash): transformers' LongcatFlashConfig defaults, which its docstring ties
# to meituan-longcat/LongCat-Flash-Chat (hidden 6144; each of 28 layers two MLA sublayers of 64 heads, q_lora 1536,
# kv_lora 512 + rope 64, qk_nope 128, v 128, two dense MLPs of 12288, and one shortcut MoE of 512 experts of 2048 plus
# 256 zero experts, 12 active, softmax + correction bias, scaling 6; vocab 131072; rope_theta 1e7; rms eps 1e-5).
# CUT to fit one GPU: 4 layers and 64 routed + 32 zero experts (the published 2:1) in place of 28 and 512 + 256
# (about 14 B parameters, 28 GB in bf16). num_hidden_layers here counts decoder layers (config.json's num_layers).
SHAPES["longcat-flash-cut"] = dict(
    architecture="LongcatFlashForCausalLM", model_type="longcat_flash", num_hidden_layers=4, hidden_size=6144,
    num_attention_heads=64, num_key_value_heads=64, head_dim=64, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=12288, expert_ffn_hidden_size=2048,
    n_routed_experts=64, zero_expert_num=32, moe_topk=12, routed_scaling_factor=6.0, vocab_size=131072,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1e7, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, mask_token_id=131071)
SHAPES["longcat-flash-tiny"] = dict(
    SHAPES["longcat-flash-cut"], num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
    head_dim=8, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    intermediate_size=96, expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=4, moe_topk=3,
    vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0, mask_token_id=511)
# LongCat-Flash-Lite's n-gram input embedding (LongcatFlashNgramForCausalLM) on the tiny LongCat: orders 2..5, two
# hashed tables each (8 tables of 64 / 8 dims, about 130 rows at ratio 0.25). The published Lite's n-gram fields
# are ratio 78, orders 2..4, four tables each (3,072 / 12 = 256 dims); its other sizes are not among the facts here,
# so there is no Lite shape at its published size.
SHAPES["longcat-flash-ngram-tiny"] = dict(
    SHAPES["longcat-flash-tiny"], architecture="LongcatFlashNgramForCausalLM",
    ngram=dict(ngram_vocab_size_ratio=0.25, emb_neighbor_num=5, emb_split_num=2))
# DeepSeek-V4's per-layer shapes (deepseek_v4): transformers' DeepseekV4Config defaults, which its docstring ties to
# deepseek-ai/DeepSeek-V4-Flash-Base (hidden 4096; 64 query heads sharing one key/value head of 512 with 64 rope
# dims, q_lora 1024, grouped output projection 8 x 1024; sliding window 128; compressed branches every 4 (CSA, with
# a 64 x 128 indexer keeping 512) or 128 (HCA) tokens; 4 hyper-connection streams; every layer an MoE of 256
# experts of 2048, 6 active, sqrtsoftplus, one shared expert, the first 3 hash-routed; vocab 129280). CUT to fit
# one GPU: 6 layers (each attention type, 2 hash layers) and 32 routed experts in place of 43 and 256. The shape's
# own fields are written as they are (`fields`).
SHAPES["deepseek-v4-cut"] = dict(
    architecture="DeepseekV4ForCausalLM", model_type="deepseek_v4", num_hidden_layers=6, hidden_size=4096,
    num_attention_heads=64, num_key_value_heads=1, head_dim=512, intermediate_size=2048, vocab_size=129280,
    max_position_embeddings=1048576, rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=0, eos_token_id=1,
    tie_word_embeddings=False, mask_token_id=129279, fields=dict(
        q_lora_rank=1024, qk_rope_head_dim=64, o_groups=8, o_lora_rank=1024, moe_intermediate_size=2048,
        n_routed_experts=32, num_experts_per_tok=6, n_shared_experts=1, scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5, swiglu_limit=10.0, sliding_window=128, compress_rope_theta=160000.0,
        layer_types=["heavily_compressed_attention", "sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 4, index_n_heads=64, index_head_dim=128, index_topk=512,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, num_nextn_predict_layers=1))
SHAPES["deepseek-v4-tiny"] = dict(
    SHAPES["deepseek-v4-cut"], num_hidden_layers=4, hidden_size=64, num_attention_heads=4, head_dim=32,
    intermediate_size=32, vocab_size=512, max_position_embeddings=1024, mask_token_id=511, fields=dict(
        SHAPES["deepseek-v4-cut"]["fields"], q_lora_rank=32, qk_rope_head_dim=8, o_groups=2, o_lora_rank=16,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe"] + ["moe"] * 3, index_n_heads=16, index_head_dim=16, index_topk=3, hc_mult=2))
# GQA + MoE shapes, from the published config.json files (Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1,
# zai-org/GLM-4.5-Air); `fields` are the family's own config.json fields, written as they are.
SHAPES["qwen3-30b-a3b"] = dict(
    QWEN3, architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048,
    num_attention_heads=32, num_key_value_heads=4, intermediate_size=6144, tie_word_embeddings=False,
    fields=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], sliding_window=None, use_sliding_window=False,
                max_window_layers=48, router_aux_loss_coef=0.001))
SHAPES["mixtral-8x7b"] = dict(
    architecture="MixtralForCausalLM", model_type="mixtral", num_hidden_layers=32, hidden_size=4096,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=32000,
    rope_theta=1e6, max_position_embeddings=32768, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, qk_norm=False, mask_token_id=31999,
    fields=dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=None, router_aux_loss_coef=0.02))
SHAPES["glm-4.5-air"] = dict(
    architecture="Glm4MoeForCausalLM", model_type="glm4_moe", num_hidden_layers=46, hidden_size=4096,
    num_attention_heads=96, num_key_value_heads=8, head_dim=128, intermediate_size=10944, vocab_size=151552,
    rope_theta=1e6, max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=None,
    eos_token_id=[151329, 151336, 151338], tie_word_embeddings=False, qk_norm=False, mask_token_id=151551,
    fields=dict(attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5, moe_intermediate_size=1408,
                n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1, n_group=1,
                topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, num_nextn_predict_layers=1,
                pad_token_id=151329))
# MiniMax-M2 (MiniMaxAI/MiniMax-M2's config.json, as released in FP8; written here in the model dtype): 62 layers of
# 3072, 48 query heads and 8 KV heads of 128 with q / k norms over the whole projections and RoPE on 64 dims of each,
# 256 experts of 1536 (top 8, sigmoid with a correction bias, no shared expert), vocabulary 200064, three MTP modules
# (not written: the engine skips them).
SHAPES["minimax-m2"] = dict(
    architecture="MiniMaxM2ForCausalLM", model_type="minimax_m2", num_hidden_layers=62, hidden_size=3072,
    num_attention_heads=48, num_key_value_heads=8, head_dim=128, intermediate_size=1536, vocab_size=200064,
    rope_theta=5e6, max_position_embeddings=196608, rms_norm_eps=1e-6, bos_token_id=200034, eos_token_id=200020,
    tie_word_embeddings=False, qk_norm=False, mask_token_id=200063,
    fields=dict(rotary_dim=64, num_local_experts=256, num_experts_per_tok=8, scoring_func="sigmoid",
                use_routing_bias=True, use_qk_norm=True, qk_norm_type="per_layer", shared_intermediate_size=0,
                attn_type_list=[1] * 62))
# Their tiny siblings (CPU tests): every switch of the family on, a dense layer where the family has them.
_TINY = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, vocab_size=512, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
             mask_token_id=511)
SHAPES["qwen3-moe-tiny"] = dict(SHAPES["qwen3-30b-a3b"], **_TINY, fields=dict(
    SHAPES["qwen3-30b-a3b"]["fields"], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    mlp_only_layers=[1], max_window_layers=3))
SHAPES["mixtral-tiny"] = dict(SHAPES["mixtral-8x7b"], **_TINY, fields=dict(SHAPES["mixtral-8x7b"]["fields"],
                                                                         num_local_experts=4))
SHAPES["minimax-m2-tiny"] = dict(SHAPES["minimax-m2"], **_TINY, fields=dict(
    SHAPES["minimax-m2"]["fields"], rotary_dim=8, num_local_experts=8, num_experts_per_tok=2, attn_type_list=[1] * 3))
SHAPES["glm-4.5-tiny"] = dict(SHAPES["glm-4.5-air"], **_TINY, fields=dict(
    SHAPES["glm-4.5-air"]["fields"], use_qk_norm=True, moe_intermediate_size=32, n_routed_experts=8,
    num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, pad_token_id=None))
# Gemma 3 12B's text model (Gemma3ForCausalLM, model_type gemma3_text), from the text_config of the published
# google/gemma-3-12b-it config.json: 48 layers of 3840, 16 query heads and 8 KV heads of 256, query_pre_attn_scalar
# 256, GELU-tanh MLP of 15360, vocabulary 262208 (tied), sliding window 1024 on five layers of every six
# (sliding_window_pattern 6; the sixth global), RoPE theta 1e6 with linear scaling x 8 on the global layers and
# 10000 on the local ones, no soft-capping. (The published checkpoint is Gemma3ForConditionalGeneration: its vision
# tower is not part of this shape.) Norm weights are written as 0: Gemma scales by (1 + weight).
SHAPES["gemma-3-12b"] = dict(
    architecture="Gemma3ForCausalLM", model_type="gemma3_text", num_hidden_layers=48, hidden_size=3840,
    num_attention_heads=16, num_key_value_heads=8, head_dim=256, intermediate_size=15360, vocab_size=262208,
    rope_theta=1_000_000.0, max_position_embeddings=131072, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=[1, 106],
    tie_word_embeddings=True, qk_norm=True, mask_token_id=0, norm_weight=0.0,
    gemma3=dict(query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6, rope_local_base_freq=10000.0,
                rope_scaling={"factor": 8.0, "rope_type": "linear"}, hidden_activation="gelu_pytorch_tanh",
                final_logit_softcapping=None, attn_logit_softcapping=None, pad_token_id=0))
DEFAULT_DTYPE = {name: "float32" for name in SHAPES if name.endswith("tiny")}  # the others: bfloat16
# Hybrid linear-attention shapes (Gated DeltaNet + gated attention), config only (--config-only, then
# --load-format dummy): the fields of the published config.json files (Qwen/Qwen3.5-9B: a vision-language checkpoint
# whose language model is under text_config; Qwen/Qwen3-Next-80B-A3B-Instruct), as copied in public code, checked
# against transformers' Qwen3_5TextConfig / Qwen3NextConfig defaults, which are these models'.
_HYBRID_LINEAR = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                  "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
                  "attn_output_gate": True, "head_dim": 256, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                  "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
                  "max_position_embeddings": 262144}
# Qwen3.5 / Qwen3.6 checkpoints are vision-language ones: the language model's config under text_config (the fields
# below plus _HYBRID_LINEAR's), the vision tower's under vision_config (Atlas serves the language model on text and
# loads no vision weights).
_QWEN35_TEXT = dict(_HYBRID_LINEAR, vocab_size=248320, eos_token_id=248044, tie_word_embeddings=False,
                    mtp_num_hidden_layers=1, mamba_ssm_dtype="float32",
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                     "mrope_interleaved": True, "mrope_section": [11, 11, 10]})
_QWEN35_VLM = {"tie_word_embeddings": False, "image_token_id": 248056, "video_token_id": 248057,
               "vision_start_token_id": 248053, "vision_end_token_id": 248054}


def _qwen35_vlm(arch: str, model_type: str, layers: int, hidden: int, **text) -> dict:
    return dict(_QWEN35_VLM, architectures=[arch], model_type=model_type,
                text_config=dict(_QWEN35_TEXT, model_type=f"{model_type}_text", hidden_size=hidden,
                                 num_hidden_layers=layers,
                                 layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4), **text),
                vision_config={"model_type": f"{model_type}_vision", "depth": 27, "hidden_size": 1152,
                               "num_heads": 16, "out_hidden_size": hidden})


HYBRID_CONFIGS = {
    "qwen3.5-9b": _qwen35_vlm("Qwen3_5ForConditionalGeneration", "qwen3_5", 32, 4096, intermediate_size=12288,
                              num_attention_heads=16, num_key_value_heads=4),
    # Qwen/Qwen3.6-35B-A3B (and Qwen3.5-35B-A3B, the same language model's shape): the MoE hybrid; 256 routed experts
    # (8 a token) and one shared one in every layer.
    "qwen3.6-35b-a3b": _qwen35_vlm("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", 40, 2048,
                                   num_attention_heads=16, num_key_value_heads=2, num_experts=256,
                                   num_experts_per_tok=8, moe_intermediate_size=512,
                                   shared_expert_intermediate_size=512, router_aux_loss_coef=0.001),
    "qwen3-next-80b-a3b": dict(
        _HYBRID_LINEAR, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=2048,
        intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
        vocab_size=151936, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        rope_theta=10000000, partial_rotary_factor=0.25, bos_token_id=151643, eos_token_id=151645,
        tie_word_embeddings=False),
}
# gpt-oss, config only (--config-only, then --load-format dummy: the engine draws the experts in the form it
# holds them in, MXFP4 codes where it keeps MXFP4 experts, else the model dtype): the published config.json of
# openai/gpt-oss-20b and openai/gpt-oss-120b (as quoted in public code; they differ in num_hidden_layers,
# num_local_experts and layer_types only), checked against transformers' GptOssConfig fields.
# quantization_config says MXFP4 experts as published (models/gpt_oss.py keeps them MXFP4, or dequantizes them
# at load, and says which).
_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "pad_token_id": 199999, "experts_per_token": 4, "num_experts_per_tok": 4, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "max_position_embeddings": 131072, "num_attention_heads": 64, "num_key_value_heads": 8,
    "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 150000, "router_aux_loss_coef": 0.9,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
}
GPT_OSS_CONFIGS = {
    "gpt-oss-20b": dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32,
                        layer_types=["sliding_attention", "full_attention"] * 12),
    "gpt-oss-120b": dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128,
                         layer_types=["sliding_attention", "full_attention"] * 18),
    # (CPU tests: the same fields at toy sizes)
    "gpt-oss-tiny": dict(_GPT_OSS, num_hidden_layers=2, num_local_experts=4, hidden_size=64, intermediate_size=32,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512, eos_token_id=2,
                         pad_token_id=0, max_position_embeddings=1024, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"]),
}
# Gemma 4 text (Gemma4ForCausalLM), config only. "gemma-4-text-defaults": transformers' Gemma4TextConfig defaults (30
# layers of 2304, 8 query heads, 4 KV heads of 256 on the local layers and 512 on every sixth, global one, per-layer
# embeddings of 256, window 512, proportional RoPE on the global layers, tied 262144 vocabulary): the shape those
# defaults give, not checked against a published checkpoint's config.json. "gemma-4-tiny" (CPU tests): the family's
# switches at toy sizes (KV sharing, keys as values, a global KV-head count, double-wide MLPs).
_GEMMA4 = {
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 2304,
    "intermediate_size": 9216, "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "global_head_dim": 512, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    "tie_word_embeddings": True, "attention_bias": False, "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5, "final_logit_softcapping": None,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1000000.0}},
    "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256, "attention_k_eq_v": False,
    "num_kv_shared_layers": 0, "enable_moe_block": False, "use_double_wide_mlp": False,
}
GEMMA4_CONFIGS = {
    "gemma-4-text-defaults": _GEMMA4,
    "gemma-4-tiny": dict(_GEMMA4, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                         num_global_key_value_heads=1, attention_k_eq_v=True, max_position_embeddings=1024,
                         sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                         vocab_size_per_layer_input=512, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                         use_double_wide_mlp=True, final_logit_softcapping=30.0),
}
# Shapes written as config files only (weights: --load-format dummy).
CONFIG_ONLY = {**HYBRID_CONFIGS, **GPT_OSS_CONFIGS, **GEMMA4_CONFIGS}
DEFAULT_DTYPE = {"tiny": "float32", "deepseek-tiny": "float32", "deepseek-v3.2-tiny": "float32", "glm-5-tiny": "float32", "longcat-flash-tiny": "float32", "longcat-flash-ngram-tiny": "float32", "deepseek-v4-tiny": "float32",
                 "gpt-oss-tiny": "float32",
                 "gemma-4-tiny": "float32"}  # the others: bfloat16
# config.json fields of the DeepSeek family, copied from the shape as they are
_DEEPSEEK_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                    "first_k_dense_replace", "topk_method", "scoring_func", "n_group", "topk_group",
                    "norm_topk_prob", "routed_scaling_factor", "rope_scaling")
_DSA_FIELDS = ("index_topk", "index_n_heads", "index_head_dim", "indexer_types")  # the DSA indexer (V3.2, GLM-5)
_LONGCAT_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                   "expert_ffn_hidden_size", "n_routed_experts", "zero_expert_num", "moe_topk", "routed_scaling_factor")
DFLASH_DEFAULTS = {"tiny": (1, 4)}  # draft layers, block size; the others: the published (5, 16)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_config(shape: dict, dtype: str) -> dict:
    if shape["model_type"] == "deepseek_v4":
        cfg = _base_config(shape, dtype)
        del cfg["intermediate_size"]  # (transformers reads moe_intermediate_size under that name)
        return cfg | shape["fields"]
    if _mla_family(shape):
        return (_base_config(shape, dtype) | {k: shape[k] for k in _DEEPSEEK_FIELDS} | {"moe_layer_freq": 1}
                | {k: shape[k] for k in _DSA_FIELDS if k in shape})
    if shape["model_type"] == "longcat_flash":
        cfg = _base_config(shape, dtype)
        for key in ("num_hidden_layers", "intermediate_size", "mlp_bias"):  # (transformers derives or lacks them)
            del cfg[key]
        return cfg | {"num_layers": shape["num_hidden_layers"], "ffn_hidden_size": shape["intermediate_size"]} | {
            k: shape[k] for k in _LONGCAT_FIELDS} | shape.get("ngram", {})
    if "fields" in shape:
        return _base_config(shape, dtype) | shape["fields"]
    if shape["model_type"] == "gemma3_text":
        cfg = _base_config(shape, dtype) | shape["gemma3"]
        for key in ("hidden_act", "mlp_bias"):
            del cfg[key]
        return cfg
    return _base_config(shape, dtype) | (
        {"sliding_window": None, "use_sliding_window": False, "max_window_layers": shape["num_hidden_layers"]}
        if shape["model_type"] == "qwen3" else {"pretraining_tp": 1})


def _mla_family(shape: dict) -> bool:
    """The DeepSeek family's layers (deepseek_layer): DeepSeek V2 / V3 / V3.2 and GLM-5 (glm_moe_dsa); not V4."""
    return (shape["model_type"].startswith("deepseek") and shape["model_type"] != "deepseek_v4") or shape["model_type"] == "glm_moe_dsa"


def _base_config(shape: dict, dtype: str) -> dict:
    return {
        "architectures": [shape["architecture"]], "model_type": shape["model_type"],
        "hidden_size": shape["hidden_size"], "intermediate_size": shape["intermediate_size"],
        "num_hidden_layers": shape["num_hidden_layers"], "num_attention_heads": shape["num_attention_heads"],
        "num_key_value_heads": shape["num_key_value_heads"], "head_dim": shape["head_dim"],
        "vocab_size": shape["vocab_size"], "max_position_embeddings": shape["max_position_embeddings"],
        "rms_norm_eps": shape["rms_norm_eps"], "rope_theta": shape["rope_theta"], "rope_scaling": None,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": shape["tie_word_embeddings"], "bos_token_id": shape["bos_token_id"],
        "eos_token_id": shape["eos_token_id"], "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": dtype,
    }


def decoder_layer(prefix: str, h: int, heads: int, kv: int, d: int, inter: int, qk_norm: bool, ffn_norms: bool = False
                  ) -> list[tuple[str, tuple[int, ...]]]:
    """ffn_norms: also the pre- and post-feedforward norms (Gemma 3)."""
    names = [(f"{prefix}input_layernorm.weight", (h,)), (f"{prefix}post_attention_layernorm.weight", (h,)),
             (f"{prefix}self_attn.q_proj.weight", (heads * d, h)), (f"{prefix}self_attn.k_proj.weight", (kv * d, h)),
             (f"{prefix}self_attn.v_proj.weight", (kv * d, h)), (f"{prefix}self_attn.o_proj.weight", (h, heads * d)),
             (f"{prefix}mlp.gate_proj.weight", (inter, h)), (f"{prefix}mlp.up_proj.weight", (inter, h)),
             (f"{prefix}mlp.down_proj.weight", (h, inter))]
    if qk_norm:
        names += [(f"{prefix}self_attn.q_norm.weight", (d,)), (f"{prefix}self_attn.k_norm.weight", (d,))]
    if ffn_norms:
        names += [(f"{prefix}pre_feedforward_layernorm.weight", (h,)), (f"{prefix}post_feedforward_layernorm.weight", (h,))]
    return names


def deepseek_layer(prefix: str, s: dict, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    """One DeepSeek decoder layer: MLA (q_proj or q_a/q_b with q_a_layernorm, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj) and a dense MLP or an MoE with per-expert names."""
    h, heads = s["hidden_size"], s["num_attention_heads"]
    qk, lkv = s["qk_nope_head_dim"] + s["qk_rope_head_dim"], s["kv_lora_rank"]
    a = f"{prefix}self_attn."
    names = [(f"{prefix}input_layernorm.weight", (h,)), (f"{prefix}post_attention_layernorm.weight", (h,)),
             (f"{a}kv_a_proj_with_mqa.weight", (lkv + s["qk_rope_head_dim"], h)), (f"{a}kv_a_layernorm.weight", (lkv,)),
             (f"{a}kv_b_proj.weight", (heads * (s["qk_nope_head_dim"] + s["v_head_dim"]), lkv)),
             (f"{a}o_proj.weight", (h, heads * s["v_head_dim"]))]
    if s["q_lora_rank"]:
        names += [(f"{a}q_a_proj.weight", (s["q_lora_rank"], h)), (f"{a}q_a_layernorm.weight", (s["q_lora_rank"],)),
                  (f"{a}q_b_proj.weight", (heads * qk, s["q_lora_rank"]))]
    else:
        names.append((f"{a}q_proj.weight", (heads * qk, h)))
    reuses = s.get("indexer_types") is not None and s["indexer_types"][layer] == "shared"
    if "index_topk" in s and not reuses:  # the DSA indexer (layers/dsa.py; none on GLM-5's "shared" layers)
        hi, di = s["index_n_heads"], s["index_head_dim"]
        names += [(f"{a}indexer.wq_b.weight", (hi * di, s["q_lora_rank"])), (f"{a}indexer.wk.weight", (di, h)),
                  (f"{a}indexer.k_norm.weight", (di,)), (f"{a}indexer.k_norm.bias", (di,)),
                  (f"{a}indexer.weights_proj.weight", (hi, h))]
    m = f"{prefix}mlp."
    if layer < s["first_k_dense_replace"]:
        inter = s["intermediate_size"]
        return names + [(f"{m}gate_proj.weight", (inter, h)), (f"{m}up_proj.weight", (inter, h)),
                        (f"{m}down_proj.weight", (h, inter))]
    inter = s["moe_intermediate_size"]
    names.append((f"{m}gate.weight", (s["n_routed_experts"], h)))
    if s["topk_method"] == "noaux_tc":
        names.append((f"{m}gate.e_score_correction_bias", (s["n_routed_experts"],)))
    for e in range(s["n_routed_experts"]):
        names += [(f"{m}experts.{e}.gate_proj.weight", (inter, h)), (f"{m}experts.{e}.up_proj.weight", (inter, h)),
                  (f"{m}experts.{e}.down_proj.weight", (h, inter))]
    shared = inter * s["n_shared_experts"]
    return names + [(f"{m}shared_experts.gate_proj.weight", (shared, h)),
                    (f"{m}shared_experts.up_proj.weight", (shared, h)),
                    (f"{m}shared_experts.down_proj.weight", (h, shared))]


def longcat_layer(prefix: str, s: dict) -> list[tuple[str, tuple[int, ...]]]:
    """One LongCat-Flash decoder layer (models/longcat.py): two MLA sublayers, two dense MLPs, their four norms, and
    the shortcut MoE (router over routed + zero experts; weights for the routed ones only)."""
    h, inter, heads, lq, lkv = (s["hidden_size"], s["intermediate_size"], s["num_attention_heads"], s["q_lora_rank"],
                                s["kv_lora_rank"])
    nope, rope, v = s["qk_nope_head_dim"], s["qk_rope_head_dim"], s["v_head_dim"]
    names = []
    for j in range(2):
        a, f = f"{prefix}self_attn.{j}.", f"{prefix}mlps.{j}."
        names += [(f"{prefix}input_layernorm.{j}.weight", (h,)), (f"{prefix}post_attention_layernorm.{j}.weight", (h,)),
                  (f"{a}q_a_proj.weight", (lq, h)), (f"{a}q_a_layernorm.weight", (lq,)),
                  (f"{a}q_b_proj.weight", (heads * (nope + rope), lq)),
                  (f"{a}kv_a_proj_with_mqa.weight", (lkv + rope, h)), (f"{a}kv_a_layernorm.weight", (lkv,)),
                  (f"{a}kv_b_proj.weight", (heads * (nope + v), lkv)), (f"{a}o_proj.weight", (h, heads * v)),
                  (f"{f}gate_proj.weight", (inter, h)), (f"{f}up_proj.weight", (inter, h)),
                  (f"{f}down_proj.weight", (h, inter))]
    m, e, z, ei = f"{prefix}mlp.", s["n_routed_experts"], s["zero_expert_num"], s["expert_ffn_hidden_size"]
    names += [(f"{m}router.classifier.weight", (e + z, h)), (f"{m}router.e_score_correction_bias", (e + z,))]
    for i in range(e):
        names += [(f"{m}experts.{i}.gate_proj.weight", (ei, h)), (f"{m}experts.{i}.up_proj.weight", (ei, h)),
                  (f"{m}experts.{i}.down_proj.weight", (h, ei))]
    return names


def deepseek_v4_layer(prefix: str, s: dict, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    """One DeepSeek-V4 decoder layer in DeepSeek's names (models/deepseek_v4.py): the shared-KV attention with its
    grouped output projection and sinks, the layer type's compressor (and CSA's indexer), the MoE (gate bias, or a
    hash layer's tid2eid), the norms and the two hyper-connection maps."""
    f, h, heads, d = s["fields"], s["hidden_size"], s["num_attention_heads"], s["head_dim"]
    lq, groups, lo = f["q_lora_rank"], f["o_groups"], f["o_lora_rank"]
    a, n = f"{prefix}attn.", f["hc_mult"]
    names = [(f"{prefix}attn_norm.weight", (h,)), (f"{prefix}ffn_norm.weight", (h,)),
             (f"{a}wq_a.weight", (lq, h)), (f"{a}q_norm.weight", (lq,)), (f"{a}wq_b.weight", (heads * d, lq)),
             (f"{a}wkv.weight", (d, h)), (f"{a}norm.weight", (d,)), (f"{a}wo_a.weight", (groups * lo, heads * d // groups)),
             (f"{a}wo_b.weight", (h, groups * lo)), (f"{a}attn_sink", (heads,))]
    kind = f["layer_types"][layer]
    if kind != "sliding_attention":
        rate, s2 = f["compress_rates"][kind], 2 if kind == "compressed_sparse_attention" else 1
        names += [(f"{a}compressor.wkv.weight", (s2 * d, h)), (f"{a}compressor.wgate.weight", (s2 * d, h)),
                  (f"{a}compressor.ape", (rate, s2 * d)), (f"{a}compressor.norm.weight", (d,))]
        if s2 == 2:
            hi, di = f["index_n_heads"], f["index_head_dim"]
            names += [(f"{a}indexer.wq_b.weight", (hi * di, lq)), (f"{a}indexer.weights_proj.weight", (hi, h)),
                      (f"{a}indexer.compressor.wkv.weight", (2 * di, h)),
                      (f"{a}indexer.compressor.wgate.weight", (2 * di, h)),
                      (f"{a}indexer.compressor.ape", (rate, 2 * di)), (f"{a}indexer.compressor.norm.weight", (di,))]
    m, e, inter = f"{prefix}ffn.", f["n_routed_experts"], f["moe_intermediate_size"]
    names.append((f"{m}gate.weight", (e, h)))
    names.append((f"{m}gate.tid2eid", (s["vocab_size"], f["num_experts_per_tok"])) if f["mlp_layer_types"][layer]
                 == "hash_moe" else (f"{m}gate.bias", (e,)))
    for i in range(e):
        names += [(f"{m}experts.{i}.w1.weight", (inter, h)), (f"{m}experts.{i}.w3.weight", (inter, h)),
                  (f"{m}experts.{i}.w2.weight", (h, inter))]
    names += [(f"{m}shared_experts.w1.weight", (inter, h)), (f"{m}shared_experts.w3.weight", (inter, h)),
              (f"{m}shared_experts.w2.weight", (h, inter))]
    for site in ("attn", "ffn"):
        names += [(f"{prefix}hc_{site}_fn", ((2 + n) * n, n * h)), (f"{prefix}hc_{site}_base", ((2 + n) * n,)),
                  (f"{prefix}hc_{site}_scale", (3,))]
    return names


def sparse_moe_layer(prefix: str, s: dict, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    """One Qwen3-MoE, Mixtral, GLM-4.5 or MiniMax-M2 decoder layer (models/sparse_moe.py): GQA attention (q/k
    norms and biases where the family has them) and a dense MLP or an MoE, per expert, with the family's names."""
    f, h = s["fields"], s["hidden_size"]
    heads, kv, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    family = s["model_type"]
    qk_norm = family == "qwen3_moe" or (f.get("use_qk_norm", False) and family != "minimax_m2")
    names = decoder_layer(prefix, h, heads, kv, d, s["intermediate_size"], qk_norm)
    if family == "minimax_m2":  # (its q / k norms span the whole projections)
        names += [(f"{prefix}self_attn.q_norm.weight", (heads * d,)), (f"{prefix}self_attn.k_norm.weight", (kv * d,))]
    if f.get("attention_bias"):
        names += [(f"{prefix}self_attn.{p}_proj.bias", (n * d,)) for p, n in (("q", heads), ("k", kv), ("v", kv))]
        if family == "qwen3_moe":
            names.append((f"{prefix}self_attn.o_proj.bias", (h,)))
    if family == "qwen3_moe":
        dense = layer in f["mlp_only_layers"] or (layer + 1) % f["decoder_sparse_step"]
    else:
        dense = layer < f.get("first_k_dense_replace", 0)
    if dense:
        return names
    names = [n for n in names if ".mlp." not in n[0]]
    if family in ("mixtral", "minimax_m2"):
        m, inter = f"{prefix}block_sparse_moe.", s["intermediate_size"]
        names.append((f"{m}gate.weight", (f["num_local_experts"], h)))
        if family == "minimax_m2":
            names.append((f"{m}e_score_correction_bias", (f["num_local_experts"],)))
        for e in range(f["num_local_experts"]):
            names += [(f"{m}experts.{e}.w1.weight", (inter, h)), (f"{m}experts.{e}.w3.weight", (inter, h)),
                      (f"{m}experts.{e}.w2.weight", (h, inter))]
        return names
    m, inter = f"{prefix}mlp.", f["moe_intermediate_size"]
    experts = f.get("num_experts") or f["n_routed_experts"]
    names.append((f"{m}gate.weight", (experts, h)))
    if family == "glm4_moe":
        names.append((f"{m}gate.e_score_correction_bias", (experts,)))
    for e in range(experts):
        names += [(f"{m}experts.{e}.gate_proj.weight", (inter, h)), (f"{m}experts.{e}.up_proj.weight", (inter, h)),
                  (f"{m}experts.{e}.down_proj.weight", (h, inter))]
    shared = inter * f.get("n_shared_experts", 0)
    if shared:
        names += [(f"{m}shared_experts.gate_proj.weight", (shared, h)),
                  (f"{m}shared_experts.up_proj.weight", (shared, h)),
                  (f"{m}shared_experts.down_proj.weight", (h, shared))]
    return names


def target_tensors(s: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, v = s["hidden_size"], s["vocab_size"]
    names = [("model.embed_tokens.weight", (v, h))]
    if s["model_type"] == "deepseek_v4":  # (DeepSeek's names, as transformers saves them)
        n, names = s["fields"]["hc_mult"], [("embed.weight", (v, h))]
        names += [t for i in range(s["num_hidden_layers"]) for t in deepseek_v4_layer(f"layers.{i}.", s, i)]
        if s["fields"].get("num_nextn_predict_layers"):  # (its MTP module: models/deepseek_v4.DeepseekV4MTP)
            f, last = s["fields"], s["num_hidden_layers"]
            block = dict(s, fields=dict(f, layer_types=[*f["layer_types"], "sliding_attention"],
                                        mlp_layer_types=[*f["mlp_layer_types"], "moe"]))
            names += deepseek_v4_layer("mtp.0.", block, last)
            names += [("mtp.0.e_proj.weight", (h, h)), ("mtp.0.h_proj.weight", (h, h)), ("mtp.0.enorm.weight", (h,)),
                      ("mtp.0.hnorm.weight", (h,)), ("mtp.0.norm.weight", (h,)), ("mtp.0.hc_head_fn", (n, n * h)),
                      ("mtp.0.hc_head_base", (n,)), ("mtp.0.hc_head_scale", (1,))]
        return names + [("norm.weight", (h,)), ("hc_head_fn", (n, n * h)), ("hc_head_base", (n,)),
                        ("hc_head_scale", (1,)), ("head.weight", (v, h))]
    for i in range(s["num_hidden_layers"]):
        if _mla_family(s):
            names += deepseek_layer(f"model.layers.{i}.", s, i)
            continue
        if s["model_type"] == "longcat_flash":
            names += longcat_layer(f"model.layers.{i}.", s)
            continue
        if "fields" in s:
            names += sparse_moe_layer(f"model.layers.{i}.", s, i)
            continue
        names += decoder_layer(f"model.layers.{i}.", h, s["num_attention_heads"], s["num_key_value_heads"],
                               s["head_dim"], s["intermediate_size"], s["qk_norm"], "gemma3" in s)
    names.append(("model.norm.weight", (h,)))
    if not s["tie_word_embeddings"]:
        names.append(("lm_head.weight", (v, h)))
    if "ngram" in s:  # (LongCat-Flash-Lite's hashed tables: layers/ngram_embedding.py)
        g = s["ngram"]
        tables = g["emb_split_num"] * (g["emb_neighbor_num"] - 1)
        for i in range(tables):
            rows = int(g["ngram_vocab_size_ratio"] * v + 2 * i + 1)
            names += [(f"model.ngram_embeddings.embedders.{i}.weight", (rows, h // tables)),
                      (f"model.ngram_embeddings.post_projs.{i}.weight", (h, h // tables))]
    return names


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's rule: one draft layer reads the middle target layer; L > 1 read L layers spread evenly from
    layer 1 to layer N - 3 (N = 36, L = 5: [1, 9, 17, 25, 33])."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def drafter_config(s: dict, layers: int, block_size: int, dtype: str) -> dict:
    ids = default_target_layer_ids(s["num_hidden_layers"], layers)
    if min(ids) < 0 or max(ids) >= s["num_hidden_layers"]:
        raise SystemExit(f"{layers} draft layers need a target of more than {s['num_hidden_layers']} layers")
    dense = {k: v for k, v in s.items() if k != "fields"}  # (a Qwen3 drafter, whatever the target's MLP)
    cfg = model_config(dict(dense, model_type="qwen3", num_hidden_layers=layers), dtype)
    cfg.update(architectures=["DFlashDraftModel"], auto_map={"AutoModel": "dflash.DFlashDraftModel"},
               block_size=block_size, num_target_layers=s["num_hidden_layers"],
               dflash_config={"mask_token_id": s["mask_token_id"], "target_layer_ids": ids},
               layer_types=["full_attention"] * layers, tie_word_embeddings=False, max_window_layers=layers,
               sliding_window=None, use_sliding_window=False)
    cfg.pop("pretraining_tp", None)
    return cfg


def drafter_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h = cfg["hidden_size"]
    names = [("fc.weight", (h, len(cfg["dflash_config"]["target_layer_ids"]) * h)), ("hidden_norm.weight", (h,)),
             ("norm.weight", (h,))]
    for i in range(cfg["num_hidden_layers"]):
        names += decoder_layer(f"layers.{i}.", h, cfg["num_attention_heads"], cfg["num_key_value_heads"],
                               cfg["head_dim"], cfg["intermediate_size"], True)
    return names


FP8_CONFIGS = {
    "block": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"},
    "channel": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
}


def fp8_quantize(name: str, t: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """A projection weight as its FP8 values and scales (layout block: 128 x 128 blocks; channel: per row)."""
    w = t.float()
    if layout == "channel":
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        return {name: (w / scale).to(torch.float8_e4m3fn), name.replace(".weight", ".weight_scale"): scale}
    n, k = w.shape
    rows, cols = -(-n // 128), -(-k // 128)
    padded = torch.zeros(rows * 128, cols * 128, device=w.device)
    padded[:n, :k] = w
    tiles = padded.view(rows, 128, cols, 128)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).view(rows * 128, cols * 128)[:n, :k].contiguous()
    return {name: q.to(torch.float8_e4m3fn), name + "_scale_inv": scale}


def _save(tensors: dict[str, torch.Tensor], path: Path, elt: int) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    log(f"  wrote {path.name} ({sum(t.numel() for t in tensors.values()) * elt / 1e9:.3g} GB)")


def write_weights(out: Path, names: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, device: torch.device,
                  std: float, seed: int, shard_bytes: int, norm_weight: float = 1.0, fp8: str | None = None,
                  tables: dict[str, int] | None = None) -> int:
    """Draw and write the tensors, sharded (norm weights all `norm_weight`); returns the total bytes. fp8: the
    projections in that FP8 layout. tables: integer tensors by name, each row distinct values below the bound
    (DeepSeek-V4's hash-routing tid2eid: expert ids)."""
    tables = tables or {}
    for old in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # weights of an earlier run here would be read with these
    elt = torch.empty((), dtype=dtype).element_size()
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, shape) in enumerate(names):
        n = elt * int(torch.Size(shape).numel())
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    gen = torch.Generator(device=device)
    weight_map, total = {}, 0
    # One writer thread: shard k is written while shard k + 1 is drawn and copied to the host.
    with ThreadPoolExecutor(max_workers=1) as writer:
        pending = None
        for file, members in zip(files, shards, strict=True):
            tensors = {}
            for i in members:
                name, shape = names[i]
                if name.endswith("norm.weight"):
                    t = torch.full(shape, norm_weight, dtype=dtype, device=device)
                elif name in tables:  # (integer tables: experts drawn below the bound, distinct along a row)
                    gen.manual_seed(seed * 1_000_003 + i)
                    noise = torch.rand((shape[0], tables[name]), generator=gen, device=device)
                    t = noise.argsort(dim=1)[:, : shape[1]].to(torch.int64).contiguous()
                else:
                    gen.manual_seed(seed * 1_000_003 + i)
                    t = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)
                parts = fp8_quantize(name, t, fp8) if fp8 and name.endswith("proj.weight") else {name: t}
                for part, value in parts.items():
                    tensors[part] = value.cpu()
                    weight_map[part] = file
                    total += value.numel() * value.element_size()
            if pending is not None:
                pending.result()
            pending = writer.submit(_save, tensors, out / file, elt)
        if pending is not None:
            pending.result()
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total


def write_config_only(args, dtype_name: str) -> int:
    """The hybrid, gpt-oss and Gemma 4 shapes: their config files only (weights: --load-format dummy)."""
    if not args.config_only:
        raise SystemExit(f"--shape {args.shape} is config-only: pass --config-only, then load the folder with "
                         "--load-format dummy")
    cfg = json.loads(json.dumps(CONFIG_ONLY[args.shape]))
    text = cfg.get("text_config", cfg)
    if args.fp8:
        if args.shape not in HYBRID_CONFIGS:
            raise SystemExit(f"--fp8 with --shape {args.shape}: only the hybrid shapes' configs take it")
        cfg["quantization_config"] = FP8_CONFIGS[args.fp8]  # (as the published -FP8 checkpoints: at the top level)
    if args.dflash_drafter and args.shape not in HYBRID_CONFIGS:
        raise SystemExit(f"--dflash-drafter: no drafter shape for --shape {args.shape} (the hybrid shapes and the "
                         "weighted ones have one)")
    text["torch_dtype"] = text["dtype"] = dtype_name
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": text.get("bos_token_id"), "eos_token_id": text["eos_token_id"]}, indent=2))
    log(f"{args.shape}: config only (for --load-format dummy) in {out}")
    if args.dflash_drafter:
        write_drafter_config(args, hybrid_drafter_shape(text), out, dtype_name)
    return 0


def hybrid_drafter_shape(text: dict) -> dict:
    """A DFlash drafter's shape for a hybrid target: Qwen3 layers at the target's hidden size (128-wide heads, 8 KV
    heads, the target's MLP width, or 3x the hidden size for a MoE target), the target's vocabulary; its mask token
    the vocabulary's last id (a random drafter's choice; a trained one names its own)."""
    hidden = text["hidden_size"]
    return dict(QWEN3, num_hidden_layers=text["num_hidden_layers"], hidden_size=hidden,
                num_attention_heads=hidden // 128, num_key_value_heads=8,
                intermediate_size=text.get("intermediate_size") or 3 * hidden, vocab_size=text["vocab_size"],
                bos_token_id=text.get("bos_token_id"), eos_token_id=text["eos_token_id"],
                tie_word_embeddings=False, mask_token_id=text["vocab_size"] - 1)


def write_drafter_config(args, shape: dict, out: Path, dtype_name: str) -> tuple[dict, Path]:
    """OUT/dflash-drafter/config.json for this target (--dflash-layers, --dflash-block-size) -> (the config, the
    drafter's folder)."""
    layers, block = DFLASH_DEFAULTS.get(args.shape, (5, 16))
    cfg = drafter_config(shape, args.dflash_layers or layers, args.dflash_block_size or block, dtype_name)
    sub = out / "dflash-drafter"
    sub.mkdir(exist_ok=True)
    (sub / "config.json").write_text(json.dumps(cfg, indent=2))
    return cfg, sub


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted([*SHAPES, *CONFIG_ONLY]))
    ap.add_argument("--out", required=True, help="Checkpoint folder to write (created).")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="Default: bfloat16 (float32 for tiny).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02, help="Standard deviation of the weights (norms are 1).")
    ap.add_argument("--device", default=None, help="Where to draw the weights (default: cuda if available).")
    ap.add_argument("--shard-size", type=float, default=5.0, help="GB per safetensors shard.")
    ap.add_argument("--dflash-drafter", action="store_true",
                    help="Also write a random DFlash drafter for this target into OUT/dflash-drafter.")
    ap.add_argument("--dflash-layers", type=int, default=None, help="Draft layers (default 5; tiny: 1).")
    ap.add_argument("--dflash-block-size", type=int, default=None, help="Block size (default 16; tiny: 4).")
    ap.add_argument("--config-only", action="store_true",
                    help="Write the config files and no weights: serve or bench the folder with --load-format dummy "
                         "(random weights drawn on the device; a 70B shape's 141 GB never touch the disk).")
    ap.add_argument("--fp8", default=None, choices=sorted(FP8_CONFIGS),
                    help="Write the projections in FP8: block (128 x 128 weight_scale_inv, the Qwen -FP8 layout) or "
                         "channel (fbgemm_fp8's per-row weight_scale).")
    args = ap.parse_args(argv)

    dtype_name = args.dtype or DEFAULT_DTYPE.get(args.shape, "bfloat16")
    if args.shape in CONFIG_ONLY:
        return write_config_only(args, dtype_name)
    shape = SHAPES[args.shape]
    dtype = getattr(torch, dtype_name)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    names = target_tensors(shape)
    params = sum(int(torch.Size(s).numel()) for _, s in names)
    log(f"{args.shape}: {params / 1e9:.4g} B parameters in {dtype_name}, drawn on {device}, into {out}")
    config = model_config(shape, dtype_name)
    if args.fp8:
        config["quantization_config"] = FP8_CONFIGS[args.fp8]
        log(f"projections in FP8: {FP8_CONFIGS[args.fp8]}")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": shape["bos_token_id"], "eos_token_id": shape["eos_token_id"]}, indent=2))
    if args.config_only:
        log(f"config only (for --load-format dummy) in {out}")
    else:
        tables = {name: shape["fields"]["n_routed_experts"] for name, _ in names if name.endswith("tid2eid")}
        total = write_weights(out, names, dtype, device, args.std, args.seed, int(args.shard_size * 1e9),
                              shape.get("norm_weight", 1.0), args.fp8, tables)
        log(f"target: {total / 1e9:.3g} GB in {time.perf_counter() - t0:.1f}s")
    if args.dflash_drafter:
        cfg, sub = write_drafter_config(args, shape, out, dtype_name)
        size = 0 if args.config_only else write_weights(sub, drafter_tensors(cfg), dtype, device, args.std,
                                                        args.seed + 1, int(args.shard_size * 1e9))
        log(f"DFlash drafter: {cfg['num_hidden_layers']} layers, block {cfg['block_size']}, target layers "
            f"{cfg['dflash_config']['target_layer_ids']}, {size / 1e9:.3g} GB in {sub}")
    log(f"done in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
