"""A seeded random sweep of attention configurations (issue 12): every case compiles and runs, correct
against fp32, and no plan asks for more shared memory or registers than the device has.

    python bench/sweep.py --check-plans [--cases 240] [--seed 0] [--workers 2]   # no GPU needed
    python bench/sweep.py --run [--cases 240] [--seed 0] [--workers 12] [--budget-s 420]   # on the GPU
    python bench/sweep.py --benchmark-plans                                      # no GPU needed

Cases: head dims 64, 80, 96, 128, 192, 256 (value head dims different from the key's in some),
GQA ratios 1, 2, 4, 8, decode (1-4 queries) and prefill (equal or different query and key lengths,
1..3000), the masks and score mods of the tests (causal, sliding window, document mask by
`mask_mod` and by `BlockMask`, prefix-LM, ALiBi, softcap, none), fp16 and bf16, batch 1 or 2.
Masks are aligned to the end of the keys (query i sits at key position Lk - Lq + i, a KV cache).

`--check-plans` builds every case's plan and kernels as the GPU path does (an H200 stood in for:
compute capability 9.0, 132 multiprocessors, so the same plans, backends and tensor descriptors),
compiles each kernel for sm_90 with Triton's own compiler (no GPU: ptxas from the Triton wheel),
and records the schedule's estimate beside Triton's shared memory and ptxas's registers and
spills. A case fails where a kernel needs more shared memory than the H200 has (232448 bytes),
the estimate is below what Triton allocates, the first-launch fallback had to re-plan, the plan's
register estimate is above 255, or ptxas spills more than SPILL_LIMIT_BYTES a thread.

`--run` runs every case on the GPU against an fp32 reference (random inputs, never all zero). A
case fails on an exception (a compile failure, OutOfResources), a warning of the shared-memory
fallback, or an error above the dtype's tolerance; Triton's registers and spills per kernel are
recorded. Cases of one structure (mods, head dims, GQA ratio, dtype) run in the same worker, so
lengths that share a plan share the compiled kernels.

`--benchmark-plans` prints the plan of every one of the 34 points of DESIGN.md section 5 (as
bench/ab_attention.py builds them) with the H200 stood in for, to compare plans before and after
a change (run it with each version on PYTHONPATH).

Writes $OUT/sweep_check.json, $OUT/sweep_run.json or $OUT/benchmark_plans.json (default
bench/results/).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import torch

HEAD_DIMS = (64, 80, 96, 128, 192, 256)
RATIOS = (1, 2, 4, 8)
MASKS = ("none", "causal", "window", "document", "document_blockmask", "prefix_lm")
SCORES = ("none", "alibi", "softcap")
MAX_LEN = 3000
H200_SHARED_BYTES = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin: what Triton checks at load
H200_SMS = 132
REGISTERS = 255
# a kernel spilling more than this per thread needs a quarter more registers than a thread has
# (255 x 4 bytes); ptxas spills a few words of some kernels that fit, which is recorded, not failed
SPILL_LIMIT_BYTES = 256
TOLERANCE = {"float16": 1e-2, "bfloat16": 3e-2}  # relative (norm) error against fp32


@dataclass(frozen=True)
class Case:
    """One attention configuration of the sweep."""

    index: int
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_kv: int
    dim: int
    dim_v: int
    mask: str
    score: str
    dtype: str
    window: int = 0
    prefix: int = 0
    softcap: float = 0.0
    docs: int = 0

    @property
    def kind(self) -> str:
        return "decode" if self.len_q <= 4 else "prefill"

    @property
    def structure(self) -> tuple[Any, ...]:
        """What a traced program and its kernels depend on apart from the lengths and head counts."""
        return (self.mask, self.score, self.dim, self.dim_v, self.heads_q // self.heads_kv, self.dtype, self.kind)

    def label(self) -> str:
        dims = f"{self.dim}" if self.dim == self.dim_v else f"{self.dim}/{self.dim_v}"
        return (f"#{self.index} B{self.batch} H{self.heads_q}/{self.heads_kv} L{self.len_q}x{self.len_kv} "
                f"E{dims} {self.mask}+{self.score} {self.dtype}")


def _length(rng: random.Random, lo: int = 1) -> int:
    """lo..MAX_LEN: log-uniform seven times in ten (short lengths and their edge cases, cheap to
    run), uniform otherwise (long ones)."""
    if rng.random() < 0.3:
        return rng.randint(lo, MAX_LEN)
    return max(lo, min(MAX_LEN, int(math.exp(rng.uniform(math.log(lo), math.log(MAX_LEN))))))


def make_cases(n: int = 240, seed: int = 0) -> list[Case]:
    """`n` configurations drawn from a seeded generator: the same list every time for a seed.

    Example:
        >>> cases = make_cases(8, seed=1)
        >>> len(cases), cases == make_cases(8, seed=1)
        (8, True)
    """
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        dim = rng.choice(HEAD_DIMS)
        dim_v = rng.choice([d for d in HEAD_DIMS if d != dim]) if rng.random() < 0.12 else dim
        ratio = rng.choice(RATIOS)
        heads_kv = rng.choice((1, 2, 4))
        if rng.random() < 0.4:
            len_q, len_kv = rng.randint(1, 4), _length(rng)
        else:
            len_kv = _length(rng, 5)
            len_q = len_kv if rng.random() < 0.5 else _length(rng, 5)
        mask, score = rng.choice(MASKS), rng.choice(SCORES)
        cases.append(Case(i, rng.choice((1, 1, 2)), heads_kv * ratio, heads_kv, len_q, len_kv, dim, dim_v, mask,
                          score, rng.choice(("float16", "bfloat16")), window=rng.choice((64, 256, 1024)),
                          prefix=rng.randint(0, max(1, len_kv // 2)), softcap=rng.choice((20.0, 30.0, 50.0)),
                          docs=rng.randint(1, 6)))
    return cases


@dataclass
class Mods:
    """A case's mods as a FlexAttention user writes them, and the dense mask they mean."""

    score_mod: Callable[..., Any] | None
    mask_mod: Callable[..., Any] | None
    block_mask: Any
    visible: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None  # (query pos, key pos) -> bool
    score: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None  # (s, query, key)


def _documents(case: Case, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids of each query and each key (queries before the first key position: -1, none)."""
    g = torch.Generator().manual_seed(case.index)
    cuts = torch.sort(torch.randint(0, max(1, case.len_kv), (case.docs - 1,), generator=g)).values
    kv_doc = torch.bucketize(torch.arange(case.len_kv), cuts, right=True)
    pos = torch.arange(case.len_q) + case.len_kv - case.len_q
    q_doc = torch.where(pos >= 0, kv_doc[pos.clamp(0, case.len_kv - 1)], torch.full_like(pos, -1))
    return q_doc.to(device), kv_doc.to(device)


def make_mods(case: Case, device: str) -> Mods:
    """The case's score_mod / mask_mod (or BlockMask), and the same as dense torch math."""
    off = case.len_kv - case.len_q
    slopes = torch.exp2(-8.0 * torch.arange(1, case.heads_q + 1, dtype=torch.float32) / case.heads_q).to(device)
    cap, window, prefix = case.softcap, case.window, case.prefix
    score_mod = score = None
    if case.score == "alibi":
        def score_mod(s, b, h, q_idx, kv_idx):
            return s + slopes[h] * (kv_idx - q_idx - off)

        def score(s, i, j):
            return s + slopes[:, None, None] * (j - i)[None].float()
    elif case.score == "softcap":
        def score_mod(s, b, h, q_idx, kv_idx):
            return cap * torch.tanh(s / cap)

        def score(s, i, j):
            return cap * torch.tanh(s / cap)
    mask_mod = visible = block_mask = None
    if case.mask == "causal":
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx + off >= kv_idx
    elif case.mask == "window":
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx + off >= kv_idx) & (q_idx + off - kv_idx < window)
    elif case.mask == "prefix_lm":
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx < prefix) | (q_idx + off >= kv_idx)
    elif case.mask in ("document", "document_blockmask"):
        q_doc, kv_doc = _documents(case, device)

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_doc[q_idx] == kv_doc[kv_idx]) & (q_idx + off >= kv_idx)
    if mask_mod is not None:
        def visible(i, j, mask=mask_mod):  # bound now: a BlockMask case drops mask_mod below
            return mask(None, None, i - off, j)
    if case.mask == "document_blockmask":
        from torch.nn.attention.flex_attention import create_block_mask

        block_mask = create_block_mask(mask_mod, None, None, case.len_q, case.len_kv, device=device)
        mask_mod = None
    return Mods(score_mod, mask_mod, block_mask, visible, score)


def call(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mods: Mods) -> torch.Tensor:
    import neptune_fusion as nf

    return nf.attention(q, k, v, score_mod=mods.score_mod, block_mask=mods.block_mask, mask_mod=mods.mask_mod,
                        enable_gqa=case.heads_q != case.heads_kv)


def reference(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mods: Mods) -> torch.Tensor:
    """fp32 attention by plain torch math; rows that see no key give 0 (as nf.attention does)."""
    group = case.heads_q // case.heads_kv
    kf, vf = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    off = case.len_kv - case.len_q
    i = torch.arange(case.len_q, device=q.device)[:, None] + off
    j = torch.arange(case.len_kv, device=q.device)[None, :]
    out = torch.empty(case.batch, case.heads_q, case.len_q, case.dim_v, device=q.device)
    for b in range(case.batch):  # one sequence at a time keeps the fp32 scores small
        s = torch.einsum("hqd,hkd->hqk", q[b].float(), kf[b]) / math.sqrt(case.dim)
        if mods.score is not None:
            s = mods.score(s, i, j)
        if mods.visible is not None:
            s = s.masked_fill(~mods.visible(i, j)[None], float("-inf"))
        out[b] = torch.einsum("hqk,hkd->hqd", torch.softmax(s, -1).nan_to_num(0.0), vf[b])
    return out


def inputs(case: Case, device: str, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of the case: random and never zero (`empty`: uninitialised, for compiling only)."""
    dtype = getattr(torch, case.dtype)
    shapes = ((case.batch, case.heads_q, case.len_q, case.dim), (case.batch, case.heads_kv, case.len_kv, case.dim),
              (case.batch, case.heads_kv, case.len_kv, case.dim_v))
    if empty:
        return tuple(torch.empty(s, dtype=dtype, device=device) for s in shapes)  # type: ignore[return-value]
    g = torch.Generator(device=device).manual_seed(case.index)
    out = []
    for s in shapes:
        x = torch.randn(s, generator=g, device=device)
        out.append(torch.where(x.abs() < 1e-3, torch.full_like(x, 1e-3), x).to(dtype))
    return tuple(out)  # type: ignore[return-value]


# --------------------------------------------------------------------------- offline compilation


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def register_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread: spills) of a compiled kernel, by cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no register count: {text[-500:]}")
    return int(found.group(1)), int(found.group(2))


def global_accesses(ptx: str) -> dict[str, int]:
    """Global loads and stores of a kernel's PTX by width (`ld.v4`: four 32-bit words at once; a
    plain `ld.b16` is one element a lane, what a read at a computed address compiles to).

    Example:
        >>> global_accesses("ld.global.v4.b32 {%r1,%r2,%r3,%r4}, [%rd1]; @%p1 ld.global.b16 %rs1, [%rd2];")
        {'ld.b16': 1, 'ld.v4': 1}
    """
    counts: dict[str, int] = {}
    for op, suffix in re.findall(r"\b(ld|st)\.global((?:\.[\w:]+)*)", ptx):
        parts = suffix.split(".")[1:]
        vector = next((p for p in parts if re.fullmatch(r"v[248]", p)), None)
        key = f"{op}.{vector or parts[-1]}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def compile_for_sm90(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Triton's compiled kernel of the JIT function `fn` for these launch arguments, for sm_90,
    specialised as `fn[grid](*args, **kwargs)` would be on an H200 (no GPU used)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    kwargs = {**kwargs, "debug": knobs.runtime.debug, "instrumentation_mode": knobs.compilation.instrumentation_mode}
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    source = (GluonASTSource if fn.is_gluon() else ASTSource)(fn, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


# each loaded kernel's KernelLaunch (its tile, its backend), by the kernel function's id: executables
# are cached, so a later case may launch a kernel an earlier one loaded (loaded kernels stay alive)
_LAUNCHES: dict[int, Any] = {}


@contextlib.contextmanager
def _recording_launches() -> Iterator[None]:
    """Remember the KernelLaunch of every kernel the runtime loads meanwhile (in `_LAUNCHES`)."""
    from neptune_fusion.runtime import compiled

    class Recorded(compiled.KernelLaunch):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _LAUNCHES[id(self.fn)] = self

    with mock.patch.object(compiled, "KernelLaunch", Recorded):
        yield


def _describe(launcher: Any) -> dict[str, Any]:
    """A launched kernel's name, backend, blocks, warps, stages and the schedule's estimates."""
    from neptune_fusion.tile import resources

    entry: dict[str, Any] = {"kernel": launcher.fn.__name__, "warps": launcher.warps, "stages": launcher.stages}
    launch = _LAUNCHES.get(id(launcher.fn))
    if launch is not None:
        tile = launch.tile
        registers = getattr(resources, "register_estimate", None)  # absent before issue 12's change
        entry.update(backend=launch.backend,
                     blocks={k: v for k, v in tile.constexprs.items() if k.startswith("BLOCK")},
                     estimate=resources.shared_memory_estimate(tile),
                     register_estimate=registers(tile) if registers is not None else None)
    return entry


@contextlib.contextmanager
def stand_in_h200(record: list[dict[str, Any]]) -> Iterator[None]:
    """Compile as for an H200 without one: the runtime sees a CUDA device of compute capability 9.0
    with 132 multiprocessors (CPU tensors stand in for its memory), and each kernel's first launch
    compiles it for sm_90 and appends what it needs to `record` instead of running it. A kernel
    needing more shared memory than the H200 has raises OutOfResources, as its launch would."""
    from triton.runtime.errors import OutOfResources

    from neptune_fusion.runtime import compiled

    check = compiled._check_tensors

    def first(self: Any, slots: list[Any]) -> None:
        args = self.bind(slots)[:self.n_args]
        start = time.perf_counter()
        kernel = compile_for_sm90(self.fn, args, dict(self.constexprs, num_warps=self.warps, num_stages=self.stages,
                                                      **self.options))
        seconds = time.perf_counter() - start
        regs, stack = register_usage(kernel.asm["cubin"])
        record.append({**_describe(self), "shared": kernel.metadata.shared, "registers": regs, "spill_bytes": stack,
                       "global_accesses": global_accesses(kernel.asm["ptx"]), "compile_s": round(seconds, 2)})
        if kernel.metadata.shared > H200_SHARED_BYTES:
            raise OutOfResources(kernel.metadata.shared, H200_SHARED_BYTES, "shared memory")

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, {"TRITON_INTERPRET": "0"}))  # CUDA kernels, not the interpreter's
        stack.enter_context(mock.patch.object(
            compiled, "_check_tensors", lambda p, a, i: (check(p, a, True), torch.device("cuda", 0))[1]))
        stack.enter_context(mock.patch.object(compiled, "_num_sms", lambda device: H200_SMS))
        stack.enter_context(mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0)))
        if hasattr(compiled, "_device_limits"):
            stack.enter_context(mock.patch.object(compiled, "_device_limits",
                                                  lambda device: (H200_SHARED_BYTES, REGISTERS)))
        stack.enter_context(_recording_launches())
        stack.enter_context(mock.patch.object(compiled._FastLaunch, "_first", first))
        yield


def check_case(case: Case) -> dict[str, Any]:
    """Plan and compile one case for sm_90 offline; what each kernel needs, and why it fails."""
    record: list[dict[str, Any]] = []
    result: dict[str, Any] = {"case": asdict(case), "label": case.label(), "kernels": record, "failures": []}
    start = time.perf_counter()
    try:
        with stand_in_h200(record), warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            q, k, v = inputs(case, "cpu", empty=True)
            call(case, q, k, v, make_mods(case, "cpu"))
        for w in caught:
            if "does not fit the device" in str(w.message):
                result["failures"].append(f"first-launch fallback: {w.message}")
    except Exception as exc:  # noqa: BLE001 - recorded as the case's failure
        result["failures"].append(f"{type(exc).__name__}: {str(exc)[:400]}")
    for kernel in record:
        if kernel["shared"] > H200_SHARED_BYTES:
            result["failures"].append(f"{kernel['kernel']}: {kernel['shared']} bytes of shared memory")
        if kernel.get("backend") == "triton" and kernel.get("estimate") is not None \
                and kernel["estimate"] < kernel["shared"]:
            result["failures"].append(f"{kernel['kernel']}: estimate {kernel['estimate']} below {kernel['shared']}")
        if kernel.get("backend") == "triton" and (kernel.get("register_estimate") or 0) > REGISTERS:
            result["failures"].append(f"{kernel['kernel']}: register estimate {kernel['register_estimate']}")
        if kernel["spill_bytes"] > SPILL_LIMIT_BYTES:
            result["failures"].append(f"{kernel['kernel']}: spills {kernel['spill_bytes']} bytes a thread")
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


# --------------------------------------------------------------------------- on the GPU


def run_case(case: Case, device: str = "cuda") -> dict[str, Any]:
    """Run one case on the GPU against fp32; the kernels' registers and spills as Triton loaded them
    (`device="cpu"` under TRITON_INTERPRET=1 runs a small case in Triton's interpreter)."""
    from neptune_fusion.runtime import compiled

    kernels: list[dict[str, Any]] = []
    original = compiled._FastLaunch._first

    def first(self: Any, slots: list[Any]) -> None:
        original(self, slots)
        k = self.kernel
        if k is not None:
            kernels.append({**_describe(self), "shared": k.metadata.shared, "registers": k.n_regs,
                            "spill_bytes": 4 * k.n_spills})

    result: dict[str, Any] = {"case": asdict(case), "label": case.label(), "kernels": kernels, "failures": []}
    start = time.perf_counter()
    try:
        with mock.patch.object(compiled._FastLaunch, "_first", first), _recording_launches(), \
                warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            q, k, v = inputs(case, device)
            mods = make_mods(case, device)
            out = call(case, q, k, v, mods)
            if device == "cuda":
                torch.cuda.synchronize()
        result["seconds"] = round(time.perf_counter() - start, 2)
        for w in caught:
            if "does not fit the device" in str(w.message):
                result["failures"].append(f"first-launch fallback: {w.message}")
        ref = reference(case, q, k, v, mods)
        err = _rel_err(out, ref)
        result["rel_err"] = err
        if not err <= TOLERANCE[case.dtype]:
            result["failures"].append(f"relative error {err:.2e} above {TOLERANCE[case.dtype]:.0e}")
    except Exception as exc:  # noqa: BLE001 - a compile failure or OutOfResources is the case's failure
        result["failures"].append(f"{type(exc).__name__}: {str(exc)[:400]}")
        result["seconds"] = round(time.perf_counter() - start, 2)
    for kernel in kernels:
        if kernel["shared"] > H200_SHARED_BYTES:
            result["failures"].append(f"{kernel['kernel']}: {kernel['shared']} bytes of shared memory")
        if kernel["spill_bytes"] > SPILL_LIMIT_BYTES:
            result["failures"].append(f"{kernel['kernel']}: spills {kernel['spill_bytes']} bytes a thread")
    return result


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------- the benchmark's plans


def benchmark_plans() -> list[dict[str, Any]]:
    """The plan of each of the 34 points of DESIGN.md section 5, built as bench/ab_attention.py
    builds them, with an H200 stood in for (no kernel is compiled)."""
    import neptune_fusion as nf
    from neptune_fusion import library
    from neptune_fusion.benchmarks.cases import DECODE_OPS, make_case, plain
    from neptune_fusion.integrations import attention as flex_front

    out = []
    record: list[dict[str, Any]] = []
    with stand_in_h200(record), torch.no_grad():
        for op in ("pf_global", "pf_causal", "pf_alibi", "pf_gqa", "pf_softcap", "pf_window", *DECODE_OPS):
            for seq in (1024, 4096, 16384, 32768) if op.startswith("dc_") else (1024, 4096, 16384):
                if op in ("pf_global", "pf_causal"):
                    q, k, v = (torch.empty(1, 32, seq, 128, dtype=torch.float16) for _ in range(3))
                    fn = nf.compile(library.causal_attention if op == "pf_causal" else library.attention)
                    named = dict(fn.program_def.bind(q, k, v, 1 / math.sqrt(128)))
                    exe = fn.executable_for(fn.program_def.trace(**named), named)
                elif op.startswith("pf_"):
                    q, k, v, score_mod, mask_mod, gqa = make_case(op, seq, "cpu")
                    c, _ = flex_front._resolve_call(q, k, v, score_mod, None, mask_mod, None, gqa, False)
                    exe = flex_front._compiled_for(c, None).executable_for(c.program, c.args)
                else:
                    hq, hkv, kind = DECODE_OPS[op]
                    q = torch.empty(1, hq, 1, 128, dtype=torch.float16)
                    k, v = (torch.empty(1, hkv, seq, 128, dtype=torch.float16) for _ in range(2))
                    fn = nf.compile(plain(kind))
                    named = dict(fn.program_def.bind(q, k, v, torch.ones(hq), 1 / math.sqrt(128)))
                    exe = fn.executable_for(fn.program_def.trace(**named), named)
                tile = exe.main.tile
                # byte-identical kernels before and after a change: a timing ratio between them is noise
                sources = "".join(k.source for k in (exe.main, exe.combine) if k is not None)
                out.append({"op": op, "seq": seq, "plan": asdict(exe.plan), "backend": exe.main.backend,
                            "source_sha1": hashlib.sha1(sources.encode()).hexdigest()[:16],
                            "kernel": {"blocks": {k: v for k, v in tile.constexprs.items() if k.startswith("BLOCK")},
                                       "warps": tile.num_warps, "stages": tile.num_stages}})
    return out


def backward_plans(seq: int = 4096) -> list[dict[str, Any]]:
    """The kernels of attention's derived backward (global and causal, 32 heads of 128, fp16, the
    benchmark's shapes) planned and compiled for sm_90 with an H200 stood in for: what each asks
    of shared memory and registers, and what ptxas spills."""
    import neptune_fusion as nf

    out = []
    for name, mask in (("global", None), ("causal", lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)):
        record: list[dict[str, Any]] = []
        with stand_in_h200(record):
            q, k, v = (torch.empty(1, 32, seq, 128, dtype=torch.float16, requires_grad=True) for _ in range(3))
            o = nf.attention(q, k, v, mask_mod=mask)
            torch.autograd.grad(o, [q, k, v], torch.empty_like(o))
        out.append({"case": name, "kernels": [r for r in record if "backward" in r["kernel"]]})
    return out


# --------------------------------------------------------------------------- driver


def _shards(cases: list[Case], workers: int) -> list[list[Case]]:
    """Cases grouped by structure (a traced program and its kernels serve every length of one),
    the groups dealt to `workers` shards, largest first."""
    groups: dict[tuple[Any, ...], list[Case]] = {}
    for c in cases:
        groups.setdefault(c.structure, []).append(c)
    shards: list[list[Case]] = [[] for _ in range(max(1, workers))]
    for group in sorted(groups.values(), key=len, reverse=True):
        min(shards, key=len).extend(group)
    return [s for s in shards if s]


def _work(mode: str, cases: list[Case], deadline: float | None = None) -> list[dict[str, Any]]:
    """Check or run `cases` in order; those left when the `deadline` (time.time()) has passed are
    recorded as skipped."""
    if mode == "run":
        torch.cuda.set_device(0)
    out = []
    for case in cases:
        if deadline is not None and time.time() > deadline:
            out.append({"case": asdict(case), "label": case.label(), "kernels": [], "failures": [], "skipped": True,
                        "seconds": 0.0})
            continue
        r = (run_case if mode == "run" else check_case)(case)
        status = "FAIL " + "; ".join(r["failures"]) if r["failures"] else "ok"
        worst = max((k["shared"] for k in r["kernels"]), default=0)
        print(f"{case.label():70s} {r['seconds']:6.1f}s shared {worst:6d}  {status}", flush=True)
        out.append(r)
    return out


def _environment(mode: str) -> dict[str, Any]:
    import platform

    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "mode": mode}
    if mode == "run":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sms=props.multi_processor_count)
    else:
        env.update(gpu="none: compiled for sm_90 offline, an H200 stood in for")
    return env


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts, failures, and the estimate against Triton's shared memory over the Triton kernels."""
    kernels = [k for r in results for k in r["kernels"]]
    ratios = [k["estimate"] / k["shared"] for k in kernels
              if k.get("backend") == "triton" and k.get("estimate") is not None and k["shared"] > 0]
    big = [k["estimate"] / k["shared"] for k in kernels
           if k.get("backend") == "triton" and k.get("estimate") is not None and k["shared"] >= 65536]
    summary: dict[str, Any] = {
        "cases": len(results), "failed": sum(bool(r["failures"]) for r in results),
        "skipped": sum(bool(r.get("skipped")) for r in results), "kernels": len(kernels),
        "max_shared": max((k["shared"] for k in kernels), default=0),
        "max_registers": max((k["registers"] for k in kernels), default=0),
        "spilling_kernels": sum(bool(k["spill_bytes"]) for k in kernels),
        "max_spill_bytes": max((k["spill_bytes"] for k in kernels), default=0),
        "backends": dict(Counter(str(k.get("backend")) for k in kernels)),
        "seconds": round(sum(r["seconds"] for r in results), 1),
    }
    if ratios:
        summary.update(estimate_over_shared_min=round(min(ratios), 3), estimate_over_shared_max=round(max(ratios), 3),
                       estimate_over_shared_max_at_64k=round(max(big), 3) if big else None)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check-plans", action="store_true", help="compile every case for sm_90 offline (no GPU)")
    mode.add_argument("--run", action="store_true", help="run every case on the GPU against fp32")
    mode.add_argument("--benchmark-plans", action="store_true", help="the plans of the 34 benchmark points")
    ap.add_argument("--cases", type=int, default=240)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1),
                    help="processes (each compiles its own cases' kernels; --run: all share the GPU)")
    ap.add_argument("--only", type=int, nargs="*", help="case indices to run (default: all)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no case after this many seconds, the rest recorded as skipped (--run: 420 unless given)")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "bench/results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.benchmark_plans:
        plans = benchmark_plans()
        for p in plans:
            print(f"{p['op']:11s} {p['seq']:6d} {p['backend']:6s} {p['plan']} kernel {p['kernel']}")
        path = out_dir / "benchmark_plans.json"
        path.write_text(json.dumps({"environment": _environment("plans"), "plans": plans}, indent=1))
        print("wrote", path)
        return
    name = "run" if args.run else "check"
    cases = make_cases(args.cases, args.seed)
    if args.only:
        cases = [c for c in cases if c.index in set(args.only)]
    start = time.perf_counter()
    budget = args.budget_s if args.budget_s is not None else (420.0 if args.run else None)
    deadline = time.time() + budget if budget else None
    shards = _shards(cases, args.workers)
    if len(shards) == 1:
        results = _work(name, shards[0], deadline)
    else:
        import multiprocessing

        with ProcessPoolExecutor(len(shards), mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = pool.map(_work, [name] * len(shards), shards, [deadline] * len(shards))
            results = [r for part in parts for r in part]
    results.sort(key=lambda r: r["case"]["index"])
    summary = summarize(results)
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    path = out_dir / f"sweep_{name}.json"
    path.write_text(json.dumps({"environment": _environment(name), "seed": args.seed, "summary": summary,
                                "results": results}, indent=1))
    print(json.dumps(summary, indent=1))
    for r in results:
        if r["failures"]:
            print("FAILED", r["label"], "|", "; ".join(r["failures"]))
    print("wrote", path)
    sys.exit(1 if summary["failed"] or summary["skipped"] else 0)


if __name__ == "__main__":
    main()
