#!/usr/bin/env bash
# GPU checks, run on the GPU machine from the repo root: the CUDA tests, then `atlas bench decode` on a
# Qwen3-0.6B-shaped random-weight model against transformers. Writes logs and JSON under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -m cuda tests/test_cuda.py -x -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/cuda_tests.log"
python3 - <<'PY'
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=40960, eos_token_id=151645, torch_dtype="bfloat16")
torch.manual_seed(0)
with torch.device("cuda"):
    m = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
m.save_pretrained("/tmp/qwen3-0.6b-random")
print("saved")
PY
python3 -m atlas.cli bench decode --model /tmp/qwen3-0.6b-random --skip-tokenizer-init --prompts random \
  --concurrency 1,16,64 --input-len 128 --output-len 128 --max-model-len 4096 --gpu-memory-utilization 0.5 \
  --output-json "$OUT/decode_qwen3_0.6b.json" 2>&1 | tail -12
