"""MiniMax-M2's tiny model on CUDA in float32 left transformers' greedy tokens at the 8th token (s73 call 1): where
do the two differ, and by how much? Prints, for the failing prompt, Atlas's tokens on CPU and CUDA, transformers'
on CPU and CUDA, transformers' top-2 margin at every generated position of Atlas's CUDA continuation, and the
largest logit difference of one prefill (Atlas CUDA against transformers CUDA)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
from conftest import CUDA_KV, hf_greedy, hf_model  # noqa: E402
from test_models import atlas_logits  # noqa: E402
from test_moe_families import _llm, _prompts, _tokens, build_moe_checkpoint  # noqa: E402

path = build_moe_checkpoint(Path(sys.argv[1]), "minimax_m2")
DEV = sys.argv[2] if len(sys.argv) > 2 else "cuda"
prompts = _prompts()[3:]
gpu = _llm(path, device=DEV, dtype="float32", kv_cache_memory=CUDA_KV)
cpu = _llm(path)
ref_gpu = hf_model(path, dtype=torch.float32, device=DEV)
ref_cpu = hf_model(path)
for i, prompt in enumerate(prompts):
    a_gpu, a_cpu = _tokens(gpu, [prompt])[0], _tokens(cpu, [prompt])[0]
    h_gpu, h_cpu = hf_greedy(ref_gpu, prompt, 16), hf_greedy(ref_cpu, prompt, 16)
    print(f"prompt {i}: atlas cuda {a_gpu}\n  atlas cpu {a_cpu}\n  hf cuda {h_gpu}\n  hf cpu {h_cpu}")
    with torch.no_grad():
        logits = ref_gpu(torch.tensor([prompt + a_gpu], device=DEV)).logits[0].float()
    top = logits[len(prompt) - 1:-1].topk(2, dim=-1)
    print("  hf margins along atlas-cuda:", [round(float(v[0] - v[1]), 6) for v in top.values],
          "hf argmax:", top.indices[:, 0].tolist())
    seq = prompt + a_gpu
    got = atlas_logits(gpu, seq, [len(seq)]).float().cpu()
    print("  max |atlas cuda prefill - hf cuda|:", float((got - logits.cpu()).abs().max()))
