# ruff: noqa: B023, E731 - every closure is timed right where it is made
"""Where the host microseconds of one repeated `nf.attention` call go (decode with a captured tensor,
batch 4, 32/8 heads, 4096 keys: a split-K kernel and its combine), beside SDPA's call:

- the whole call, and the same call with its kernel launches replaced by nothing (our Python);
- each kernel's launch alone (from the call's prepared arguments), and `torch.empty` of the output.

    python bench/overhead.py          (GPU machine; writes $OUT/overhead.json)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import neptune_fusion as nf
from bench.common import environment, host_us, write_results
from neptune_fusion.runtime import compiled as compiled_module

HQ, HKV, D = 32, 8, 128
SLOPES = torch.exp2(-8.0 * torch.arange(1, HQ + 1, dtype=torch.float32) / HQ).cuda()


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def _launchers(run) -> list:
    """The kernel launchers a compiled call's function closes over."""
    cells = dict(zip(run.__code__.co_freevars, run.__closure__))
    return cells["launchers"].cell_contents


def main() -> None:
    q = torch.randn(4, HQ, 1, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(4, HKV, 4096, D, device="cuda", dtype=torch.float16) for _ in range(2))
    out: dict[str, float] = {}
    with torch.no_grad():
        call = lambda: nf.attention(q, k, v, score_mod=alibi, enable_gqa=True)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        call()
        for _ in range(3):
            out["sdpa_us"] = min(out.get("sdpa_us", 1e9), host_us(sdpa))
            out["nf_alibi_us"] = min(out.get("nf_alibi_us", 1e9), host_us(call))
        hit = next(iter(nf.integrations.attention._fast.values()))
        launchers = _launchers(hit.run)
        args = [q, k, v, hit.scale, SLOPES]
        result = torch.empty(4, HQ, 1, D, device="cuda", dtype=torch.float16)
        slots = [*args, result]
        cells = dict(zip(hit.run.__code__.co_freevars, hit.run.__closure__))
        if cells["scratch"].cell_contents:
            slots.extend(cells["kept_scratch"].cell_contents().values())
        for i, launcher in enumerate(launchers):
            out[f"launch_kernel{i}_us"] = min(host_us(lambda: launcher(slots)) for _ in range(3))
            out[f"bind_kernel{i}_us"] = min(host_us(lambda: launcher.bind(slots)) for _ in range(3))
        out["torch_empty_us"] = min(host_us(lambda: torch.empty(4, HQ, 1, D, device="cuda", dtype=torch.float16))
                                    for _ in range(3))
        out["raw_stream_us"] = min(host_us(lambda: torch._C._cuda_getCurrentRawStream(0)) for _ in range(3))
        real = compiled_module._FastLaunch.__call__
        compiled_module._FastLaunch.__call__ = lambda self, slots: None
        try:
            out["nf_alibi_python_only_us"] = min(host_us(call) for _ in range(3))
        finally:
            compiled_module._FastLaunch.__call__ = real
    for key, value in out.items():
        print(f"{key} {value:.2f}")
    write_results("overhead", {"environment": environment(), **out})


if __name__ == "__main__":
    main()
