# ruff: noqa: B023 - every closure is timed right where it is made
"""nf.attention inside PyTorch code on the GPU: host time per call beside SDPA's, torch.compile
(fullgraph, and mode="reduce-overhead", i.e. CUDA graphs) correct against eager, replay host time.

    python -m bench.integration      (GPU machine; writes $OUT/integration.json)

Host time is the Python and launch cost of one call while the GPU keeps up (decode-sized inputs,
so the kernels are short): what a decode loop pays per layer unless it replays a CUDA graph.
"""

from __future__ import annotations

import cProfile
import io
import math
import pstats
from typing import Any

import torch
import torch.nn.functional as F

import neptune_fusion as nf
from bench.common import bench, captured, environment, host_us, rel_err, warm_up_gpu, write_results
from neptune_fusion.integrations import attention as attention_module
from neptune_fusion.integrations.attention import attend

HQ, HKV, D = 32, 8, 128
SLOPES = torch.exp2(-8.0 * torch.arange(1, HQ + 1, dtype=torch.float32) / HQ).cuda()
LENGTHS = torch.tensor([4096, 1000, 3000, 77], device="cuda")


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def by_length(b, h, q_idx, kv_idx):
    return kv_idx < LENGTHS[b]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class Layer(torch.nn.Module):
    """One attention layer with a projection, as a model calls nf.attention."""

    def __init__(self, score_mod: Any, mask_mod: Any) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(D, D, dtype=torch.float16, device="cuda")
        self.score_mod, self.mask_mod = score_mod, mask_mod

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = nf.attention(self.proj(q), k, v, score_mod=self.score_mod, mask_mod=self.mask_mod, enable_gqa=True)
        return self.proj(out)


class MethodLayer(Layer):
    """The layer with its score_mod a method of its own (`score_mod=self.bias`), reading ALiBi's
    slopes through the module."""

    def __init__(self, mask_mod: Any) -> None:
        super().__init__(None, mask_mod)
        self.slopes = SLOPES

    def bias(self, score, b, h, q_idx, kv_idx):
        return score + self.slopes[h] * (kv_idx - q_idx)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = nf.attention(self.proj(q), k, v, score_mod=self.bias, mask_mod=self.mask_mod, enable_gqa=True)
        return self.proj(out)


@nf.program
def rownorm(x):
    """A softmax over the last axis, as an nf.compile'd program inside torch.compile."""
    e = nf.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def reference(q, k, v, score_mod, mask_mod) -> torch.Tensor:
    kf, vf = (t.float().repeat_interleave(HQ // HKV, 1) for t in (k, v))
    s = q.float() @ kf.transpose(-1, -2) / math.sqrt(D)
    b = torch.arange(q.shape[0], device="cuda")[:, None, None, None]
    h = torch.arange(HQ, device="cuda")[None, :, None, None]
    qi = torch.arange(q.shape[2], device="cuda")[None, None, :, None]
    ki = torch.arange(k.shape[2], device="cuda")[None, None, None, :]
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, qi, ki), -math.inf)
    return torch.softmax(s, -1).nan_to_num(0.0) @ vf


def host_times() -> dict[str, Any]:
    """Host microseconds per call: decode (batch 4, one query, 4096 keys), ours beside SDPA."""
    q = torch.randn(4, HQ, 1, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(4, HKV, 4096, D, device="cuda", dtype=torch.float16) for _ in range(2))
    out: dict[str, Any] = {}
    with torch.no_grad():
        calls = {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            "nf_plain": lambda: nf.attention(q, k, v, enable_gqa=True),
            "nf_alibi": lambda: nf.attention(q, k, v, score_mod=alibi, enable_gqa=True),
            "nf_alibi_lengths": lambda: nf.attention(q, k, v, score_mod=alibi, mask_mod=by_length, enable_gqa=True),
            "nf_attend_softcap": lambda: attend(q, k, v, enable_gqa=True, causal=True, softcap=50.0),
        }
        try:  # the package before a change (bench/ab_baseline.sh), for host time before / after in one run
            import nf_before  # type: ignore[import-not-found]

            calls["before_nf_alibi"] = lambda: nf_before.attention(q, k, v, score_mod=alibi, enable_gqa=True)
            calls["before_nf_attend_softcap"] = lambda: nf_before.integrations.attention.attend(
                q, k, v, enable_gqa=True, causal=True, softcap=50.0)
        except ImportError:
            pass
        # one launch (a short prefill, no split-K combine) beside SDPA's
        qp, kp, vp = (torch.randn(1, HQ, 16, D, device="cuda", dtype=torch.float16) for _ in range(3))
        calls["sdpa_prefill16"] = lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
        calls["nf_alibi_prefill16"] = lambda: nf.attention(qp, kp, vp, score_mod=alibi, mask_mod=causal)
        for name, call in calls.items():
            call()
            out[f"{name}_host_us"] = min(host_us(call) for _ in range(5))
            out[f"{name}_gpu_us"] = bench(call)
            if name.startswith("nf_"):  # which plans served it (the latest compiled function is this call's)
                latest = next(reversed(attention_module._compiled.values()))
                out[f"{name}_plans"] = [f"{exe.plan} grid {exe.main.tile.grid} combine {exe.combine is not None}"
                                        for exe in latest._cache.values()]
        for name in ("sdpa", "nf_alibi", "nf_alibi_lengths"):  # a captured step replayed: host time per replay
            graph, _ = captured(calls[name])
            out[f"{name}_graph_replay_host_us"] = min(host_us(graph.replay) for _ in range(3))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            calls["nf_alibi_lengths"]()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
        out["profile_nf_alibi_lengths"] = text.getvalue()
    return out


def compiled_checks() -> list[dict[str, Any]]:
    """torch.compile of a layer calling nf.attention: fullgraph with inductor, and reduce-overhead
    (CUDA graphs), each against eager, with a captured tensor changed between calls."""
    rows = []
    q = torch.randn(4, HQ, 1, D, device="cuda", dtype=torch.float16)
    qp = torch.randn(1, HQ, 2048, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(4, HKV, 4096, D, device="cuda", dtype=torch.float16) for _ in range(2))
    kp, vp = (torch.randn(1, HKV, 2048, D, device="cuda", dtype=torch.float16) for _ in range(2))
    cases = [("decode_alibi_lengths", Layer(alibi, by_length), (q, k, v)),
             ("prefill_alibi_causal", Layer(alibi, causal), (qp, kp, vp)),
             ("prefill_method_alibi_causal", MethodLayer(causal), (qp, kp, vp))]
    for name, layer, args in cases:
        for mode in ("default", "reduce-overhead"):
            row: dict[str, Any] = {"case": name, "mode": mode}
            try:
                torch._dynamo.reset()
                with torch.no_grad():
                    explained = torch._dynamo.explain(layer)(*args)
                    row["graph_breaks"] = explained.graph_break_count
                    fn = torch.compile(layer, fullgraph=True, mode=None if mode == "default" else mode)
                    for _ in range(3):
                        got = fn(*args).clone()
                    row["rel_err_vs_eager"] = rel_err(got, layer(*args))
                    SLOPES.mul_(1.5)  # a captured tensor changes in place between calls
                    LENGTHS[1] -= 100
                    got = fn(*args).clone()
                    row["rel_err_after_change"] = rel_err(got, layer(*args))
                    ref = layer.proj(reference(layer.proj(args[0]), args[1], args[2], alibi, layer.mask_mod)
                                     .to(torch.float16))
                    row["rel_err_vs_fp32"] = rel_err(got, ref)
                    SLOPES.div_(1.5)
                    LENGTHS[1] += 100
                    row["compiled_us"] = bench(lambda: fn(*args))
                    row["eager_us"] = bench(lambda: layer(*args))
                    row["compiled_host_us"] = host_us(lambda: fn(*args))
                    row["eager_host_us"] = host_us(lambda: layer(*args))
                    row["ok"] = bool(row["graph_breaks"] == 0 and row["rel_err_vs_eager"] < 1e-3
                                     and row["rel_err_after_change"] < 1e-3 and row["rel_err_vs_fp32"] < 5e-3)
            except Exception as exc:  # noqa: BLE001 - a failure is the finding
                text = str(exc)
                # a graph-pool failure's allocation history: its Python frames say where it was made
                python_frames = [line for line in text.splitlines() if '.py"' in line]
                row["error"] = f"{type(exc).__name__}: {text[:600]}"
                if python_frames:
                    row["error_python_frames"] = python_frames[-60:]
                row["ok"] = False
            print(row, flush=True)
            rows.append(row)
    program = nf.compile(rownorm)
    x = torch.randn(4096, 1000, device="cuda", dtype=torch.float16)
    for mode in ("default", "reduce-overhead"):
        row = {"case": "program_rownorm", "mode": mode}
        try:
            torch._dynamo.reset()
            with torch.no_grad():
                row["graph_breaks"] = torch._dynamo.explain(lambda x: program(x) + 1)(x).graph_break_count
                fn = torch.compile(lambda x: program(x) + 1, fullgraph=True, mode=None if mode == "default" else mode)
                for _ in range(3):
                    got = fn(x).clone()
                row["rel_err_vs_fp32"] = rel_err(got, torch.softmax(x.float(), -1) + 1)
                row["ok"] = bool(row["graph_breaks"] == 0 and row["rel_err_vs_fp32"] < 5e-3)
        except Exception as exc:  # noqa: BLE001 - a failure is the finding
            row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
            row["ok"] = False
        print(row, flush=True)
        rows.append(row)
    # SDPA in the same two modes, for the host-time comparison
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), fullgraph=True,
                           mode=None if mode == "default" else mode)
        with torch.no_grad():
            for _ in range(3):
                fn(q, k, v)
            rows.append({"case": "sdpa_decode", "mode": mode, "compiled_us": bench(lambda: fn(q, k, v)),
                         "compiled_host_us": host_us(lambda: fn(q, k, v))})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    # a graph-pool failure then names where the tensor that outlived the graph was allocated
    torch._inductor.config.triton.cudagraph_trees_history_recording = True
    warm_up_gpu()
    result = {"environment": environment(), "host": host_times()}
    for key, value in result["host"].items():
        print(key, f"{value:.1f}" if isinstance(value, float) else value, flush=True)
    result["compiled"] = compiled_checks()
    print("wrote", write_results("integration", result))


if __name__ == "__main__":
    main()
