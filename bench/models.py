# ruff: noqa: B023 - every closure is timed right where it is made
"""transformers models on our kernels (attn_implementation="neptune_fusion") beside "sdpa" (Gemma-2:
"eager") and "flex_attention": random weights, bf16, torch.compile on; logits checked against sdpa, time per
prefill forward and per generated token.

    python -m bench.models [--seq 4096] [--layers 8]      (GPU machine; writes $OUT/models.json)

No weights are downloaded: the configs are Llama-style and Gemma-2-style at about 1B-parameter
width, initialised at random with one seed, and every implementation runs the same weights.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

from bench.common import bench, environment, rel_err, warm_up_gpu, write_results
from neptune_fusion.integrations.transformers import register

# transformers refuses "sdpa" for Gemma-2 (softcapping): its reference there is "eager"
IMPLEMENTATIONS = {"llama": ("neptune_fusion", "sdpa", "flex_attention"),
                   "gemma2": ("neptune_fusion", "eager", "flex_attention")}
DEVICE = "cuda"
DTYPE = torch.bfloat16


def configs(layers: int, seq: int) -> dict[str, Any]:
    llama = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        max_position_embeddings=2 * seq)
    gemma = Gemma2Config(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                         sliding_window=seq // 4, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                         max_position_embeddings=2 * seq)
    return {"llama": llama, "gemma2": gemma}


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def per_token_ms(model: Any, prompt: torch.Tensor, new: int, **generate: Any) -> tuple[float, torch.Tensor]:
    """Milliseconds per generated token (greedy): (time of prompt + new) minus (time of prompt + 1),
    over new - 1 tokens. With cache_implementation="static" transformers compiles the decode step."""
    def run(n: int) -> tuple[float, torch.Tensor]:
        _sync()
        start = time.perf_counter()
        tokens = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, **generate)
        _sync()
        return time.perf_counter() - start, tokens

    run(new)  # warm-up (compiles)
    short, _ = run(1)
    long, tokens = run(new)
    return (long - short) / (new - 1) * 1e3, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--models", nargs="+", default=["llama", "gemma2"])
    ap.add_argument("--static", action="store_true", help="also time generate with a static cache (compiled)")
    args = ap.parse_args()
    register()
    torch._inductor.config.compile_threads = 16  # compiling the models dominates this benchmark's time
    warm_up_gpu()
    results = []
    for name, cfg in configs(args.layers, args.seq).items():
        if name not in args.models:
            continue
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=DTYPE).to(DEVICE).eval()
        ids = torch.randint(0, cfg.vocab_size, (1, args.seq), device=DEVICE)
        mask = torch.ones_like(ids)
        prompt = ids[:, : args.seq // 4]
        row: dict[str, Any] = {"model": name, "seq": args.seq, "layers": args.layers, "by_impl": {}}
        reference = None
        reference_impl = IMPLEMENTATIONS[name][1]
        for impl in IMPLEMENTATIONS[name]:
            entry: dict[str, Any] = {}
            try:
                model.set_attn_implementation(impl)
                torch._dynamo.reset()
                forward = torch.compile(model.forward)
                with torch.no_grad():
                    logits = forward(input_ids=ids, attention_mask=mask).logits.float()
                    if impl == reference_impl:
                        reference = logits
                    entry["forward_ms"] = bench(lambda: forward(input_ids=ids, attention_mask=mask), rep=300) / 1e3
                    entry["per_token_ms"], tokens = per_token_ms(model, prompt, args.new_tokens)
                    entry["tokens"] = tokens[0, prompt.shape[1]:].tolist()
                    try:
                        if not args.static:
                            raise RuntimeError("not asked for (--static)")
                        torch._dynamo.reset()
                        entry["per_token_ms_static_compiled"], static_tokens = per_token_ms(
                            model, prompt, args.new_tokens, cache_implementation="static")
                        entry["static_tokens_equal_dynamic"] = static_tokens[0, prompt.shape[1]:].tolist() == entry["tokens"]
                    except Exception as exc:  # noqa: BLE001
                        entry["static_compiled_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                entry["logits"] = logits
            except Exception as exc:  # noqa: BLE001 - an implementation that cannot run is recorded as such
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            row["by_impl"][impl] = entry
            print(name, impl, {k: v for k, v in entry.items() if k not in ("logits", "tokens")}, flush=True)
        row["reference"] = reference_impl
        ref_tokens = row["by_impl"][reference_impl].get("tokens")
        for entry in row["by_impl"].values():
            logits = entry.pop("logits", None)
            if logits is not None and reference is not None:
                entry["logits_rel_err_vs_reference"] = rel_err(logits, reference)
                entry["argmax_agreement_vs_reference"] = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
            if ref_tokens and entry.get("tokens"):
                entry["tokens_equal_reference"] = entry["tokens"] == ref_tokens
        ours = row["by_impl"]["neptune_fusion"]
        for other in IMPLEMENTATIONS[name][1:]:
            base = row["by_impl"][other]
            for metric in ("forward_ms", "per_token_ms", "per_token_ms_static_compiled"):
                if metric in ours and metric in base:
                    row[f"{metric}_speedup_vs_{other}"] = base[metric] / ours[metric]
        print(name, {k: v for k, v in row.items() if k != "by_impl"}, flush=True)
        results.append(row)
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print("wrote", write_results("models", {"environment": environment(), "results": results}))


if __name__ == "__main__":
    main()
