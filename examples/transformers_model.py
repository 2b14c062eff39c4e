"""A transformers model on neptune_fusion's kernels: attn_implementation="neptune_fusion".

A small Llama-style config with random weights (nothing is downloaded); its logits and greedy
tokens are compared with attn_implementation="sdpa" on the same weights. Runs on CUDA, or on the
CPU under Triton's interpreter.

    python examples/transformers_model.py
"""

import copy
import os

import torch

# no GPU, or TRITON_INTERPRET=1 asked for (CI does): the kernels run in Triton's interpreter, on the
# CPU, at small sizes
on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not on_gpu:
    os.environ["TRITON_INTERPRET"] = "1"

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from neptune_fusion.integrations.transformers import register  # noqa: E402

device = "cuda" if on_gpu else "cpu"
config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32)
torch.manual_seed(0)
ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=register()).to(device).eval()
sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").to(device).eval()
sdpa.load_state_dict(ours.state_dict())

ids = torch.randint(0, config.vocab_size, (2, 24), device=device)
mask = torch.ones_like(ids)
mask[0, :5] = 0  # left padding in the first sequence
with torch.no_grad():
    torch.testing.assert_close(ours(ids, attention_mask=mask).logits[mask.bool()],
                               sdpa(ids, attention_mask=mask).logits[mask.bool()], atol=1e-4, rtol=1e-4)
    tokens = ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens, sdpa.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False))
print("logits and generated tokens match sdpa:", tokens[:, 24:].tolist())
