"""A short training run (issue 13): a small random-initialised Llama-style transformers model trained
on random tokens in bf16 with attn_implementation="neptune_fusion" (our derived backward) and with
"sdpa", the same seed, weights and batches; the two loss curves written as JSON and a PNG.

    python -m bench.train [--steps 200] [--seq 1024] [--layers 4]      (GPU machine; writes $OUT/train.json, .png)

Both runs start from the same weights and see the same batches, so their curves differ only by
the attention kernels' rounding; "within noise" is judged against the spread of the sdpa curve
between consecutive steps.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bench.common import environment, warm_up_gpu, write_results
from neptune_fusion.integrations.transformers import register


def losses(implementation: str, config: LlamaConfig, batches: list[torch.Tensor], lr: float) -> list[float]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                             torch_dtype=torch.bfloat16).cuda()
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for ids in batches:
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()
    warm_up_gpu()
    config = LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=args.layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=2 * args.seq)
    g = torch.Generator().manual_seed(1)
    # a learnable stream: random tokens repeated with a period, so the loss falls well below log(vocab)
    period = torch.randint(0, config.vocab_size, (args.batch, 64), generator=g)
    batches = [period.repeat(1, args.seq // 64).roll(int(s), dims=1).cuda() for s in torch.randint(0, 64, (args.steps,),
                                                                                                    generator=g)]
    curves: dict[str, Any] = {}
    for implementation in (register(), "sdpa"):
        start = time.perf_counter()
        curves[implementation] = {"loss": losses(implementation, config, batches, args.lr),
                                  "seconds": time.perf_counter() - start}
        print(implementation, "final loss", curves[implementation]["loss"][-1], f"{curves[implementation]['seconds']:.1f} s",
              flush=True)
    ours, sdpa = curves[register()]["loss"], curves["sdpa"]["loss"]
    gap = max(abs(a - b) for a, b in zip(ours, sdpa))
    noise = max(abs(a - b) for a, b in zip(sdpa[1:], sdpa[:-1]))
    print(f"largest gap between the curves {gap:.4f}; largest step-to-step change of sdpa's {noise:.4f}")
    write_results("train", {"env": environment(), "args": vars(args), "curves": curves, "max_gap": gap,
                            "sdpa_step_noise": noise})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, curve in curves.items():
            ax.plot(curve["loss"], label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        fig.tight_layout()
        fig.savefig(Path(os.environ.get("OUT", "bench/results")) / "train.png", dpi=120)
    except ImportError:
        print("matplotlib is not installed: no PNG")


if __name__ == "__main__":
    main()
