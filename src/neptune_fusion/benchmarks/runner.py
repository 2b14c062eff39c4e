"""Running the benchmark: every case correct against fp32, then timed with its baselines in the same
process, in interleaved rounds; results written after each case into one folder per run.

Timing on the GPU is `triton.testing.do_bench`'s median (after its warm-up; it clears the L2 before
every repetition), and each system keeps its best median over the rounds: short cases swing between
moments of one run and interleaving gives every system the same moments. Host cases time the host
side of a call while the GPU keeps up. Without a GPU the kernels run under Triton's interpreter and
a wall-clock median stands in: only the mechanism is checked then.

Example:
    >>> from neptune_fusion.benchmarks.runner import speedups
    >>> speedups(100.0, {"fa4": {"us": 90.0, "correct": True}, "flex": {"us": 150.0, "correct": True}})
    ({'fa4': 0.9, 'flex': 1.5}, 'fa4')
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from neptune_fusion.benchmarks import report
from neptune_fusion.benchmarks.cases import Case, Setup, select

ERROR_CHARS = 200  # characters of an error message kept in the results


def default_out(root: Path = Path("bench/results")) -> Path:
    """`$OUT` if set, else `bench/results/<date>-<n>` with the first `n` not taken yet."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    day = time.strftime("%Y-%m-%d")
    n = 1
    while (root / f"{day}-{n}").exists():
        n += 1
    return root / f"{day}-{n}"


def detect_baselines(on_gpu: bool) -> tuple[ModuleType | None, dict[str, str]]:
    """FlashAttention-4's interface module where importable, and why each baseline that cannot run here won't."""
    if not on_gpu:
        gpu_only = "needs a CUDA GPU"
        compiled = "timed on the GPU only (compiling for the CPU takes minutes)"
        return None, {"fa4": gpu_only, "flex_flash": gpu_only, "flex": compiled, "torch_compile": compiled}
    if torch.cuda.get_device_capability()[0] < 9:
        return None, {name: "needs Hopper (sm90) or newer" for name in ("fa4", "flex_flash")}
    try:
        import flash_attn.cute.interface as fa4
    except Exception as exc:  # noqa: BLE001 - any failure to import (missing, or a broken CuTeDSL install) skips it
        why = (f"flash_attn.cute not importable ({type(exc).__name__}: {str(exc)[:120]}); "
               "its wheels: ../shared/tools/fa4-baseline.sh")
        return None, {"fa4": why, "flex_flash": why}  # FlexAttention's FLASH backend runs FA4's kernels
    return fa4, {}


def _version(dist: str, module: ModuleType | None) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "unknown"))


def _git_revision() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def environment(setup: Setup) -> dict[str, Any]:
    """Versions, device and baselines of this run."""
    import triton

    import neptune_fusion

    env: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "neptune_fusion": neptune_fusion.__version__, "git": _git_revision(),
        "device": setup.device, "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }
    if setup.on_gpu:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sms=props.multi_processor_count, l2_bytes=props.L2_cache_size)
    else:
        env["gpu"] = None
    env["baselines"] = {"fa4": f"flash-attn-4 {_version('flash-attn-4', setup.fa4)}" if setup.fa4 else None,
                        "unavailable": setup.unavailable}
    if setup.before is not None:
        env["before"] = {"module": setup.before.__name__, "file": getattr(setup.before, "__file__", None)}
    return env


# --- timers: microseconds of one call -----------------------------------------------------------
def device_timer(quick: bool) -> Callable[[Callable[[], Any]], float]:
    import triton

    warmup, rep = (5, 20) if quick else (25, 100)
    return lambda call: triton.testing.do_bench(call, warmup=warmup, rep=rep, return_mode="median") * 1000.0


def host_us(call: Callable[[], Any], n: int = 300) -> float:
    """Host time of one call while the GPU keeps up (the launches queue without waiting)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def wall_us(call: Callable[[], Any], n: int = 3) -> float:
    """Median wall time of `n` calls (the interpreter: nothing to synchronise)."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def host_floors() -> dict[str, float]:
    """Host microseconds of the cheapest things a call does: one launch of an empty Triton kernel and
    one `torch.empty` of a decode output, measured beside the host cases (host speed drifts between runs)."""
    import triton

    @triton.jit
    def empty_kernel(x_ptr):
        pass

    x = torch.empty(1, device="cuda")
    empty_kernel[(1,)](x)
    launch = min(host_us(lambda: empty_kernel[(1,)](x)) for _ in range(3))
    alloc = min(host_us(lambda: torch.empty(4, 32, 1, 128, device="cuda", dtype=torch.float16)) for _ in range(3))
    return {"triton_empty_launch": launch, "torch_empty": alloc}


def warm_up_gpu(seconds: float = 1.0) -> None:
    """Matmuls for a while, so clocks have left their idle state before the first timing (the first
    case of a process otherwise reads slow)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def _configure_torch() -> None:
    import torch._dynamo.config
    import torch._inductor.config

    # FlexAttention and torch.compile baselines compile for every shape and mod of a run: let them
    # recompile instead of falling back to eager after the default limit of 8
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    # no background compile workers: they compete with the host side of the launches being timed
    torch._inductor.config.compile_threads = 1


# --- one case -----------------------------------------------------------------------------------
def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()[:ERROR_CHARS]}"


def _sync(setup: Setup) -> None:
    if setup.on_gpu:
        torch.cuda.synchronize()


def speedups(ours_us: float, baselines: dict[str, dict[str, Any]]) -> tuple[dict[str, float], str | None]:
    """Baseline time over ours for every baseline timed and correct, and the fastest of those other
    than an earlier neptune_fusion ("before")."""
    ratios = {name: b["us"] / ours_us for name, b in baselines.items() if b.get("correct") and "us" in b}
    others = [name for name in ratios if name != "before"]
    return ratios, (min(others, key=lambda name: baselines[name]["us"]) if others else None)


def _extra_bytes(call: Callable[[], Any]) -> int:
    """Device memory a call allocates beyond its output (the fused kernels hold no score matrix)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    first = out[0] if isinstance(out, tuple) else out
    return int(torch.cuda.max_memory_allocated() - before - first.numel() * first.element_size())


def run_case(case: Case, setup: Setup, rounds: int, timer: Callable[[Callable[[], Any]], float],
             status: Callable[[str], None]) -> dict[str, Any]:
    """Build a case, check every system against fp32, time the correct and incorrect alike in
    interleaved rounds; ratios only against baselines that were correct."""
    row: dict[str, Any] = {"suite": case.suite, "op": case.op, "seq": case.seq, "timer": case.timer}
    status("inputs")
    try:
        built = case.build(setup)
    except Exception as exc:  # noqa: BLE001 - a case that cannot be set up is recorded, the run goes on
        row["error"] = _failure(exc)
        return row
    row.update(built.info)
    row["tolerance"] = built.tolerance
    entries: dict[str, dict[str, Any]] = {}
    live: dict[str, Callable[[], Any]] = {}
    with torch.no_grad():
        for name, system in built.systems.items():
            status(f"{name}: first call and check")
            entry: dict[str, Any] = {}
            try:
                result = system.call()
                _sync(setup)
                entry["rel_err"] = built.check(system.output(result))
                entry["correct"] = bool(entry["rel_err"] <= built.tolerance)  # NaN is not correct
                del result
                live[name] = system.call
                if system.plans is not None:
                    entry["plans"] = system.plans()
                if name == "ours" and setup.on_gpu and case.timer == "device":
                    entry["extra_bytes"] = _extra_bytes(system.call)
            except Exception as exc:  # noqa: BLE001 - a system that fails is recorded, the others still run
                entry["error"] = _failure(exc)
            entries[name] = entry
        for r in range(rounds):
            for name, call in list(live.items()):
                status(f"{name}: timing, round {r + 1} of {rounds}")
                try:
                    entries[name].setdefault("rounds_us", []).append(timer(call))
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory in the timing loop
                    entries[name]["error"] = _failure(exc)
                    del live[name]
    for entry in entries.values():
        if entry.get("rounds_us") and "error" not in entry:
            entry["us"] = min(entry["rounds_us"])
    skipped = dict(built.skipped)
    ours = entries.pop("ours", None) or {"error": skipped.pop("ours", "no call of ours in this case")}
    row["ours"] = ours
    row["baselines"] = entries
    row["skipped"] = skipped
    if ours.get("correct") and "us" in ours:
        row["speedup_vs"], fastest = speedups(ours["us"], entries)
        if fastest is not None:
            row["fastest"], row["speedup_vs_fastest"] = fastest, row["speedup_vs"][fastest]
        seconds = ours["us"] * 1e-6
        if "flops" in built.work:
            row["tflops"] = built.work["flops"] / seconds / 1e12
        if "bytes" in built.work:
            row["gbps"] = built.work["bytes"] / seconds / 1e9
    del built
    if setup.on_gpu:
        torch.cuda.empty_cache()
    return row


def ok(row: dict[str, Any]) -> bool:
    """Our call ran, was correct, and was timed."""
    return bool(row.get("ours", {}).get("correct")) and "us" in row.get("ours", {})


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per suite: cases, how many of ours were correct, and the geometric mean of the speed-up over
    the fastest other system."""
    out: dict[str, Any] = {"cases": len(rows), "all_correct": all(ok(r) for r in rows), "suites": {}}
    for suite in dict.fromkeys(r["suite"] for r in rows):
        mine = [r for r in rows if r["suite"] == suite]
        ratios = [r["speedup_vs_fastest"] for r in mine if "speedup_vs_fastest" in r]
        out["suites"][suite] = {
            "cases": len(mine), "correct": sum(ok(r) for r in mine),
            "geomean_speedup_vs_fastest": math.exp(statistics.fmean(map(math.log, ratios))) if ratios else None,
        }
    return out


# --- the run ------------------------------------------------------------------------------------
def run(suites: Sequence[str], ops: Sequence[str] | None = None, seqs: Sequence[int] | None = None,
        rounds: int | None = None, quick: bool = False, out: Path | None = None, before: str | None = None) -> int:
    """Run the selected cases, writing results.json, results.md and speedups.png into `out` after
    each case (the plot after each suite); 0 when every one of ours was correct. `rounds` of timing:
    3 by default, 1 with `quick`."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError as exc:
        raise SystemExit("neptune-fusion bench shows its progress with rich: pip install 'neptune-fusion[bench]'") from exc

    console = Console(markup=False, highlight=False)  # messages hold brackets of their own
    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if not on_gpu and not quick:
        console.print("no GPU here: running the quick cases under the Triton interpreter (timings mean nothing)")
        quick = True
    rounds = rounds or (1 if quick else 3)
    cases = select(suites, ops, seqs, quick)
    if not cases:
        console.print(f"no case matches suites {list(suites)}, ops {ops}, seqs {seqs}")
        return 2
    fa4, unavailable = detect_baselines(on_gpu)
    setup = Setup("cuda" if on_gpu else "cpu", quick, fa4, unavailable,
                  importlib.import_module(before) if before else None)
    out = out or default_out()
    out.mkdir(parents=True, exist_ok=True)
    if on_gpu:
        _configure_torch()
        warm_up_gpu()
    timers = {"device": device_timer(quick) if on_gpu else wall_us, "host": host_us if on_gpu else wall_us}
    payload: dict[str, Any] = {
        "environment": environment(setup),
        "settings": {"suites": list(suites), "ops": list(ops or []), "seqs": list(seqs or []), "rounds": rounds,
                     "quick": quick, "timer": ("triton.testing.do_bench median, best of the rounds" if on_gpu
                                               else "wall-clock median of 3 calls (Triton interpreter)")},
        "results": [],
    }
    rows: list[dict[str, Any]] = payload["results"]
    said: set[str] = set()
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("benchmark", total=len(cases))
        for i, case in enumerate(cases):
            if case.timer == "host" and on_gpu and "host_floors_us" not in payload:
                progress.update(task, description="host floors: an empty launch, torch.empty")
                payload["host_floors_us"] = host_floors()
            label = f"{case.suite} {case.op}" + (f" {case.seq}" if case.seq is not None else "")

            def status(what: str, label: str = label) -> None:
                progress.update(task, description=f"{label}: {what}")

            row = run_case(case, setup, rounds, timers[case.timer], status)
            rows.append(row)
            payload["summary"] = summary(rows)
            message = _write(out, payload, plot=i + 1 == len(cases) or cases[i + 1].suite != case.suite)
            if message and message not in said:
                progress.console.print(message)
                said.add(message)
            progress.console.print(report.line(row))
            progress.advance(task)
    s = payload["summary"]
    console.print(f"{sum(ok(r) for r in rows)} of {len(rows)} cases correct; results in {out}/")
    for suite, info in s["suites"].items():
        g = info["geomean_speedup_vs_fastest"]
        console.print(f"  {suite}: geomean speed-up vs the fastest other system "
                      + (f"{g:.3g}x" if g is not None else "n/a (no baseline ran)"))
    return 0 if s["all_correct"] else 1


def _write(out: Path, payload: dict[str, Any], plot: bool) -> str | None:
    """Write the JSON and the table (and, if `plot`, the figure); a message if the figure could not be made."""
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    (out / "results.md").write_text(report.markdown(payload))
    return report.plot(payload, out / "speedups.png") if plot else None
