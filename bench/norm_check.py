"""Where the error of a fused norm -> matmul comes from on the GPU (bench/general.py measures 3e-2
for RMSNorm -> matmul in fp16 against fp32, 2e-4 under the interpreter): the error of each
(row tile, column tile) block, under the default plan, without tensor descriptors and with two
pipeline stages, beside torch's own fp16 computation of the same thing.

    python bench/norm_check.py          (GPU machine; writes $OUT/norm_check.json)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import neptune_fusion as nf
from bench.common import environment, write_results
from neptune_fusion.library import layernorm_matmul, rmsnorm_matmul
from neptune_fusion.runtime.options import Options


def blocks(out: torch.Tensor, ref: torch.Tensor, tile: int = 128) -> dict[str, Any]:
    err = (out.float() - ref).abs()
    per = err.unfold(0, tile, tile).unfold(1, tile, tile).amax(dim=(-1, -2))
    worst = divmod(int(per.argmax()), per.shape[1])
    return {"rel": ((out.float() - ref).norm() / ref.norm()).item(), "max_abs": err.max().item(),
            "worst_block": worst, "blocks_over_0.05": int((per > 0.05).sum()), "blocks": per.numel()}


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 4096, generator=g, device="cuda").half()
    w = (torch.randn(4096, 4096, generator=g, device="cuda") * 4096 ** -0.5).half()
    xf, wf = x.float(), w.float()
    normalised = {"rmsnorm_matmul": xf / torch.sqrt((xf ** 2).mean(-1, keepdim=True) + 1e-6),
                  "layernorm_matmul": (xf - xf.mean(-1, keepdim=True))
                  / torch.sqrt(xf.var(-1, unbiased=False, keepdim=True) + 1e-5)}
    rows = []
    base = Options.from_environment()
    for name, prog in (("rmsnorm_matmul", rmsnorm_matmul), ("layernorm_matmul", layernorm_matmul)):
        ref = normalised[name] @ wf
        torch_fp16 = normalised[name].half() @ w
        rows.append({"case": name, "config": "torch fp16", **blocks(torch_fp16, ref)})
        for label, schedule, options in (("default", None, base),
                                         ("no descriptors", None, dataclasses.replace(base, tma="0")),
                                         ("2 stages", nf.flash(num_stages=2), base),
                                         ("64-wide k tiles", nf.flash(block_k=64), base)):
            fn = nf.compile(prog, schedule, options=options) if schedule else nf.compile(prog, options=options)
            row = {"case": name, "config": label, **blocks(fn(x, w), ref)}
            row["plan"] = str(next(iter(fn._cache.values())).plan)
            rows.append(row)
        for r in rows[-5:]:
            print(r, flush=True)
    print("wrote", write_results("norm_check", {"environment": environment(), "rows": rows}))


if __name__ == "__main__":
    main()
