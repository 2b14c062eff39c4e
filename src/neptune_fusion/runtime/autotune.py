"""The autotuner: time candidate plans at the first call for a shape and keep the fastest.

Choices are stored in `autotune.json` in the kernel cache directory, keyed by program
fingerprint, argument shapes and dtypes, and the GPU's name, so later processes reuse them.
A candidate is used only if its output matches the untuned plan's on the call's own inputs.

Example:
    >>> import torch, neptune_fusion as nf
    >>> from neptune_fusion.library import softmax
    >>> fn = nf.compile(softmax, schedule=nf.autotune())   # tunes at the first call of a shape, once
    >>> x = torch.randn(4, 64)
    >>> bool(torch.allclose(fn(x), torch.softmax(x, -1), atol=1e-6))
    True
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from neptune_fusion.ir.errors import FusionError
from neptune_fusion.ir.program import Program
from neptune_fusion.runtime.reference import axis_extents
from neptune_fusion.schedule.auto import Plan, candidates
from neptune_fusion.schedule.templates import Autotune
from neptune_fusion.tile.lower import assign_roles

if TYPE_CHECKING:
    from neptune_fusion.runtime.compiled import Compiled, Executable

last_report: list[dict[str, Any]] = []  # the candidates timed by the latest tuning (for `neptune-fusion tune`)


def _store_path() -> Any:
    from neptune_fusion.runtime.options import Options

    return Options.from_environment().kernel_directory() / "autotune.json"


def _load_store() -> dict[str, Any]:
    path = _store_path()
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache is re-tuned, not trusted


def _save_choice(key: str, plan: Plan) -> None:
    store = _load_store()
    store[key] = asdict(plan)
    path = _store_path()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(store, indent=1, sort_keys=True))
    tmp.replace(path)


def _key(program: Program, named: dict[str, Any]) -> str:
    parts = [program.fingerprint()]
    device = "cpu"
    for name, value in named.items():
        if isinstance(value, torch.Tensor):
            parts.append(f"{name}:{tuple(value.shape)}:{value.dtype}:{value.stride()}")
            if value.is_cuda:
                device = torch.cuda.get_device_name(value.device)
        else:
            parts.append(f"{name}:{type(value).__name__}")
    parts.append(device)
    return "|".join(parts)


def _time(run: Any, values: list[Any], on_gpu: bool) -> float:
    if on_gpu:
        import triton

        return float(triton.testing.do_bench(lambda: run(values), warmup=10, rep=40, return_mode="median")) * 1e3
    start = time.perf_counter()
    run(values)
    return (time.perf_counter() - start) * 1e6


def _agrees(out: Any, reference: Any) -> bool:
    outs = out if isinstance(out, tuple) else (out,)
    refs = reference if isinstance(reference, tuple) else (reference,)
    for a, b in zip(outs, refs):
        a, b = a.float(), b.float()
        if not torch.equal(torch.isnan(a), torch.isnan(b)):
            return False
        ok = ~torch.isnan(b)
        scale = b[ok].abs().max().item() if ok.any() else 1.0
        if ok.any() and (a[ok] - b[ok]).abs().max().item() > 2e-2 * max(scale, 1e-6):
            return False
    return True


def tune(compiled: Compiled, program: Program, named: dict[str, Any], order: list[str]) -> Executable:
    """The fastest correct executable among candidate plans (or the remembered choice)."""
    global last_report
    schedule = compiled.schedule
    assert isinstance(schedule, Autotune)
    key = _key(program, named)
    remembered = _load_store().get(key)
    if remembered is not None:
        try:
            return compiled.executable_for(program, named, Plan(**remembered))
        except (TypeError, FusionError):
            pass  # a choice from another version of the compiler: tune again
    base = compiled.executable_for(program, named)
    if base.groups or base.library is not None:
        # several kernels (or cuBLAS): the candidates are plans of one; each kernel keeps its schedule's
        last_report = []
        return base
    values = [named[n] for n in order]
    reference = compiled._launcher(base, program, named, order)(values)
    fused = base.main.program
    roles = assign_roles(fused)
    sizes = axis_extents(fused, named)
    interpreter = not any(isinstance(v, torch.Tensor) and v.is_cuda for v in values)
    report: list[dict[str, Any]] = []
    best: tuple[float, Executable] | None = None
    for plan in candidates(base.plan, rows=sizes[roles.row], cols=sizes[roles.col], interpreter=interpreter,
                           limit=schedule.max_candidates):
        entry: dict[str, Any] = {"plan": asdict(plan)}
        try:
            exe = compiled.executable_for(program, named, plan)
            run = compiled._launcher(exe, program, named, order)
            if not _agrees(run(values), reference):
                entry["rejected"] = "output differs from the untuned plan"
                report.append(entry)
                continue
            entry["us"] = _time(run, values, not interpreter)
        except Exception as exc:  # noqa: BLE001 - a candidate that does not compile (resources) is skipped
            entry["rejected"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            report.append(entry)
            continue
        report.append(entry)
        if best is None or entry["us"] < best[0]:
            best = (entry["us"], exe)
    last_report = report
    chosen = best[1] if best is not None else base
    _save_choice(key, chosen.plan)
    return chosen
