# ruff: noqa: B023 - every closure is used right where it is made
"""Our kernels inside a CUDA graph: a decode step captured once and replayed, the usual answer to
host-bound decode loops (vLLM, gpt-fast). Checks that capture works, that a replay reads new
values written into the captured inputs (correct against fp32), and times replay against direct calls.

    python -m bench.graph_check      (GPU machine; writes $OUT/graph_check.json)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

import neptune_fusion as nf
from bench.common import bench, environment, host_us, rel_err, warm_up_gpu, write_results
from bench.decode import plain, torch_plain
from bench.gluon_check import reference


def captured(call: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `call` (after warm-up calls on a side stream, as torch's docs ask)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def check(name: str, call: Callable[[], torch.Tensor], refill: Callable[[], None],
          expected: Callable[[], torch.Tensor]) -> dict:
    row: dict[str, Any] = {"case": name}
    try:
        graph, out = captured(call)
        refill()  # new values in the captured inputs: the replay must read them
        graph.replay()
        torch.cuda.synchronize()
        row["rel_err"] = rel_err(out, expected())
        row["ok"] = bool(row["rel_err"] < 2e-3)
        row["direct_us"] = bench(call)
        row["replay_us"] = bench(graph.replay)
        row["direct_host_us"] = host_us(call)
        row["replay_host_us"] = host_us(graph.replay)
    except Exception as exc:  # noqa: BLE001 - a failure to capture is the finding
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        row["ok"] = False
    print(name, {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items() if k != "case"}, flush=True)
    return row


def main() -> None:
    warm_up_gpu()
    rows = []
    dev = "cuda"
    for kind, hq, hkv, seq in (("plain", 64, 8, 1024), ("softcap", 32, 16, 4096), ("plain", 32, 32, 16384)):
        q = torch.randn(1, hq, 1, 128, device=dev, dtype=torch.float16)
        k, v = (torch.randn(1, hkv, seq, 128, device=dev, dtype=torch.float16) for _ in range(2))
        slopes = torch.ones(hq, device=dev)
        fn = nf.compile(plain(kind))
        rows.append(check(f"compiled_{kind}_{hq}_{hkv}_{seq}", lambda: fn(q, k, v, slopes, 0.088),
                          lambda: q.copy_(torch.randn_like(q)),
                          lambda: torch_plain(q.float(), k.float(), v.float(), slopes, 0.088, kind).float()))
    batch, hq, hkv, seq = 4, 32, 8, 4096
    q = torch.randn(batch, hq, 1, 128, device=dev, dtype=torch.float16)
    k, v = (torch.randn(batch, hkv, seq, 128, device=dev, dtype=torch.float16) for _ in range(2))
    lengths = torch.tensor([seq, seq // 2 + 3, seq // 4 - 5, seq - 77], device=dev)

    def by_length(b, h, qi, ki):
        return ki < lengths[b]

    def refill() -> None:
        q.copy_(torch.randn_like(q))
        lengths.copy_(torch.tensor([17, seq, seq // 3, 1000], device=dev))  # the mask's tensor changes too

    rows.append(check("attention_lengths_4x32_8_4096", lambda: nf.attention(q, k, v, mask_mod=by_length, enable_gqa=True),
                      refill, lambda: reference(q, k, v, None, by_length, 128 ** -0.5)[0]))
    write_results("graph_check", {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
