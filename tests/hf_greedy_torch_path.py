"""transformers' greedy tokens for prompts, in float32 on CUDA without TF32, through its PyTorch delta rule and
convolution: run with flash-linear-attention and causal-conv1d off sys.path (test_hybrid_cuda.py drops the folder
they import from), transformers takes its torch path, as on the CPU. Where those kernels are importable it calls
them, and theirs compute in TF32 (on the H200 a Qwen3-Next tiny config's tokens then left the exact argmax at the
25th token). argv: model dir, max new tokens, prompts as JSON; prints the token lists as JSON."""

import importlib.util
import json
import sys

import torch

for name in ("fla", "causal_conv1d"):
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.origin:  # (not a bare namespace folder)
        sys.exit(f"{name} still imports: the reference would run its kernels")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

from transformers import AutoModelForCausalLM  # noqa: E402

path, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
tokens = []
with torch.no_grad():
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, min_new_tokens=max_tokens)
        tokens.append(out[0, len(prompt):].tolist())
print(json.dumps(tokens))
