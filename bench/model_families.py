"""transformers model families that no issue names, on our attention against transformers' own
(sdpa, or eager where the family has no sdpa path): tiny random configs, a padded batch, logits
(or last hidden states) compared, greedy generation compared for causal models, and a training
step's gradients where `--grad` is given, over the real (unpadded) positions. Below fp32, ours and
the reference are also both compared with the reference run in fp32. Families cover GQA, sliding windows (causal and
ModernBERT's bidirectional band), attention sinks (gpt-oss), T5's relative position bias,
DeepSeek-V3's value head size unlike the key's, encoder-decoder cross-attention (Whisper, T5),
MoE blocks and partial rotary embeddings.

    TRITON_INTERPRET=1 PYTHONPATH=src:. python -m bench.model_families          (CPU, fp32)
    PYTHONPATH=src:. python -m bench.model_families --device cuda --dtype bfloat16 --grad

Prints a row a family and writes $OUT/model_families.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

if "cuda" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from bench.common import write_results  # noqa: E402
from neptune_fusion.integrations.transformers import register  # noqa: E402

NAME = register()
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# family: (config class, overrides, how it is called, its reference implementation)
FAMILIES: dict[str, tuple[str, dict[str, Any], str, str]] = {
    "qwen2": ("Qwen2Config", {}, "causal", "sdpa"),
    "qwen3": ("Qwen3Config", dict(head_dim=16), "causal", "sdpa"),
    "mistral": ("MistralConfig", dict(sliding_window=8), "causal", "sdpa"),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8), "causal", "sdpa"),
    "phi3": ("Phi3Config", {}, "causal", "sdpa"),
    "gpt_neox": ("GPTNeoXConfig", dict(rotary_pct=0.5), "causal", "sdpa"),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=8), "causal", "sdpa"),
    "cohere2": ("Cohere2Config", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
                "causal", "sdpa"),
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2), "causal", "sdpa"),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4), "causal", "sdpa"),
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
                "causal", "eager"),
    "deepseek_v3": ("DeepseekV3Config", dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                             v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
                                             num_key_value_heads=4), "causal", "sdpa"),
    "llama4": ("Llama4TextConfig", dict(head_dim=16, num_local_experts=4, attention_chunk_size=8,
                                        interleave_moe_layer_step=1), "causal", "sdpa"),
    "modernbert": ("ModernBertConfig", dict(local_attention=8, global_attn_every_n_layers=2), "encoder", "sdpa"),
    "vit": ("ViTConfig", dict(image_size=32, patch_size=8), "vision", "sdpa"),
    "whisper": ("WhisperConfig", dict(d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                                      decoder_attention_heads=4, num_mel_bins=16, max_source_positions=16,
                                      max_target_positions=32), "speech", "sdpa"),
    "t5": ("T5Config", dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0),
           "seq2seq", "eager"),
}


def inputs(kind: str, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 24), generator=gen)
    mask = torch.ones_like(ids)
    if kind == "causal":
        mask[1, :5] = 0  # left padding, as for generation
    else:
        mask[1, 18:] = 0
    named: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": mask}
    if kind == "vision":
        named = {"pixel_values": torch.randn(2, 3, 32, 32, generator=gen)}
    elif kind == "speech":
        named = {"input_features": torch.randn(2, 16, 32, generator=gen),
                 "decoder_input_ids": torch.randint(3, 128, (2, 6), generator=gen)}
    elif kind == "seq2seq":
        named["decoder_input_ids"] = torch.randint(3, 128, (2, 6), generator=gen)
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in named.items()}


def build(family: str, impl: str, device: str, dtype: torch.dtype, state: dict[str, Any] | None) -> torch.nn.Module:
    cls, over, kind, _ = FAMILIES[family]
    cfg = getattr(transformers, cls)(**{**BASE, **over})
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM if kind == "causal" else transformers.AutoModel
    if kind == "seq2seq":
        auto = transformers.AutoModelForSeq2SeqLM
    model = auto.from_config(cfg, attn_implementation=impl).eval()
    if state is not None:
        model.load_state_dict(state)
    else:  # gpt-oss's sinks start at zero: a few units make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("sinks"):
                    p.copy_(torch.randn(p.shape) * 3)
    return model.to(device=device, dtype=dtype)


def output(model: torch.nn.Module, named: dict[str, torch.Tensor]) -> torch.Tensor:
    result = model(**named)
    return (result.logits if hasattr(result, "logits") and result.logits is not None else result.last_hidden_state).float()


def real_positions(kind: str, named: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """Where an output belongs to a real token: a padded query's row is whatever each implementation
    makes of a row with nothing (or only padding) to attend to (sdpa on CUDA attends to every key there)."""
    if kind in ("causal", "encoder"):
        return named["attention_mask"].bool()
    return torch.ones(shape[:-1], dtype=torch.bool, device=named[next(iter(named))].device)


def gradients(model: torch.nn.Module, named: dict[str, torch.Tensor], weights: torch.Tensor) -> list[tuple[str, Any]]:
    model.zero_grad()
    (output(model, named) * weights).sum().backward()
    return [(name, None if p.grad is None else p.grad.float()) for name, p in model.named_parameters()]


def grad_error(got: list[tuple[str, Any]], want: list[tuple[str, Any]], family: str) -> float:
    """The largest error of a parameter's gradient against its own scale, floored at a thousandth of
    the largest (a gradient that is zero in exact arithmetic, as a key bias's under softmax, is
    rounding on both sides)."""
    pairs = [(name, a, b) for (name, a), (_, b) in zip(got, want) if b is not None]
    missing = [name for name, a, _ in pairs if a is None]
    if missing:
        raise AssertionError(f"{family}: no gradient for {missing}")
    floor = 1e-3 * max(float(b.abs().max()) for _, _, b in pairs)
    return max(float((a - b).abs().max()) / max(float(b.abs().max()), floor) for _, a, b in pairs)


def check(family: str, device: str, dtype: torch.dtype, grad: bool) -> dict[str, Any]:
    """Ours against the family's reference implementation in `dtype`; below fp32, both against
    the reference run in fp32 too (`ref_*`: what the reference's own rounding costs)."""
    _, _, kind, ref_impl = FAMILIES[family]
    ref = build(family, ref_impl, device, dtype, None)
    state = {k: v.float().cpu() for k, v in ref.state_dict().items()}
    ours = build(family, NAME, device, dtype, state)
    exact = build(family, ref_impl, device, torch.float32, state) if dtype != torch.float32 else None
    named = inputs(kind, device, dtype)
    named32 = inputs(kind, device, torch.float32)
    row: dict[str, Any] = {"family": family, "reference": ref_impl, "dtype": str(dtype).removeprefix("torch.")}
    start = time.perf_counter()
    with torch.no_grad():
        got, want = output(ours, named), output(ref, named)
        real = real_positions(kind, named, got.shape)
        row["rel_err"] = float(((got - want)[real].abs().max() / want[real].abs().max()).item())
        if exact is not None:
            truth = output(exact, named32)
            scale = truth[real].abs().max()
            row["rel_err_vs_fp32"] = float(((got - truth)[real].abs().max() / scale).item())
            row["ref_rel_err_vs_fp32"] = float(((want - truth)[real].abs().max() / scale).item())
        if kind == "causal":
            args = dict(attention_mask=named["attention_mask"], max_new_tokens=8, do_sample=False)
            a, b = ours.generate(named["input_ids"], **args), ref.generate(named["input_ids"], **args)
            row["generated_equal"] = float((a == b).float().mean().item())
    if grad:
        # a random weighting of the real positions' outputs (the squared norm of a layer-normed output
        # is about constant)
        weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(4)).to(device) * real[..., None]
        ours_grads, ref_grads = gradients(ours, named, weights), gradients(ref, named, weights)
        row["grad_rel_err"] = grad_error(ours_grads, ref_grads, family)
        if exact is not None:
            truth_grads = gradients(exact, named32, weights)
            row["grad_rel_err_vs_fp32"] = grad_error(ours_grads, truth_grads, family)
            row["ref_grad_rel_err_vs_fp32"] = grad_error(ref_grads, truth_grads, family)
    row["seconds"] = time.perf_counter() - start
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--grad", action="store_true")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for family in args.families:
        try:
            row = check(family, args.device, dtype, args.grad)
        except Exception as exc:  # a family that fails is reported, and the others still run
            row = {"family": family, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        print(row, flush=True)
        rows.append(row)
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": args.device,
           "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None}
    write_results("model_families", {"environment": env, "rows": rows})


if __name__ == "__main__":
    main()
