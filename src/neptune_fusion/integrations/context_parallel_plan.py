"""Context parallelism, the arithmetic: who holds which positions, which chunk pairs can see each
other, and which strategy (ring or all-gather) the shapes favour. No communication here.

Layout. A sequence of length L is cut into `n` chunks by `torch.tensor_split`'s rule: the first
`L % n` chunks are one position longer than the others, so odd lengths give chunks that differ
by at most one. With `load_balance="zigzag"` there are n = 2 * world chunks and rank r holds
chunks r and 2 * world - 1 - r (a head chunk and a tail chunk: under a causal mask every rank
then has about the same visible work); with `load_balance=None` there are n = world chunks and
rank r holds chunk r (contiguous shards). A rank's shard is its chunks concatenated in that order.

Visibility. The mask analysis of the attention program (`analysis/masks.py`, over global
positions) gives the affine part of the mask as boxes of constraints `a * q + b * kv + c >= 0`.
For a (query chunk, key chunk) rectangle the visible elements are counted row by row from those
constraints: exact for affine masks (causal, windows, prefixes), an upper bound when a residual
(a document mask's gather) remains, since the affine conjuncts are necessary conditions. A pair
counted 0 is skipped without a launch; a BlockMask's block lists skip pairs whose blocks are all
unlisted (`listed_pairs`).

Example:
    >>> shard_ranges(10, world=2, rank=0)                  # zigzag: chunks 0 and 3 of 4
    ((0, 3), (8, 10))
    >>> shard_ranges(10, world=2, rank=1, load_balance=None)
    ((5, 10),)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from neptune_fusion.algebra.repair import contribution_vanishes
from neptune_fusion.analysis.masks import Constraint, analyze_masks
from neptune_fusion.ir.expr import Binary, Const, Expr, Size, Unary
from neptune_fusion.ir.program import FusedLoop, Program

LOAD_BALANCES = ("zigzag", None)
STRATEGIES = ("ring", "all_gather", None)

Bounds = tuple[tuple[int, int], ...]


# --------------------------------------------------------------------------- layout


def check_load_balance(load_balance: Any) -> None:
    if load_balance not in LOAD_BALANCES:
        raise ValueError(f"load_balance must be 'zigzag' or None (contiguous shards), got {load_balance!r}")


def chunk_count(world: int, load_balance: str | None) -> int:
    """How many chunks the sequence is cut into."""
    return 2 * world if load_balance == "zigzag" else world


def chunk_bounds(length: int, chunks: int) -> Bounds:
    """(start, stop) of each chunk: `torch.tensor_split`'s sizes (the first `length % chunks` one longer).

    Example:
        >>> chunk_bounds(7, 3)
        ((0, 3), (3, 5), (5, 7))
    """
    base, extra = divmod(length, chunks)
    bounds, start = [], 0
    for i in range(chunks):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def rank_chunks(world: int, rank: int, load_balance: str | None) -> tuple[int, ...]:
    """The chunk ids rank `rank` holds, in the order its shard concatenates them."""
    return (rank, 2 * world - 1 - rank) if load_balance == "zigzag" else (rank,)


def shard_ranges(length: int, world: int, rank: int, load_balance: str | None = "zigzag") -> Bounds:
    """The global (start, stop) ranges rank `rank` holds of a sequence of `length` positions."""
    check_load_balance(load_balance)
    bounds = chunk_bounds(length, chunk_count(world, load_balance))
    return tuple(bounds[c] for c in rank_chunks(world, rank, load_balance))


def shard_length(length: int, world: int, rank: int, load_balance: str | None) -> int:
    return sum(b - a for a, b in shard_ranges(length, world, rank, load_balance))


# --------------------------------------------------------------------------- visibility


def fused_loop(fused: Program) -> FusedLoop:
    return next(n for n in fused.stages if isinstance(n, FusedLoop))


def _int_value(expr: Expr, sizes: dict[str, int]) -> int | None:
    """An integer offset of a mask constraint, or None where it reads anything but constants and sizes."""
    if isinstance(expr, Const) and isinstance(expr.value, int) and not isinstance(expr.value, bool):
        return expr.value
    if isinstance(expr, Size):
        return sizes.get(expr.axis)
    if isinstance(expr, Unary) and expr.op == "neg":
        x = _int_value(expr.x, sizes)
        return None if x is None else -x
    if isinstance(expr, Binary) and expr.op in ("add", "sub", "mul"):  # what the affine analysis builds offsets of
        a, b = _int_value(expr.a, sizes), _int_value(expr.b, sizes)
        if a is None or b is None:
            return None
        return a + b if expr.op == "add" else a - b if expr.op == "sub" else a * b
    return None


def _column_range(box: tuple[Constraint, ...], rows: torch.Tensor, sizes: dict[str, int]
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per row, the lowest and highest key column the box's constraints allow (None: unbounded).

    A constraint `a * row + b * col + c >= 0` with b = 1 bounds col from below by -(a * row + c),
    with b = -1 from above by a * row + c. One whose offset cannot be evaluated is left out: the
    box only grows, so emptiness stays sound."""
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    for c in box:
        off = _int_value(c.offset, sizes)
        if off is None:
            continue
        v = c.row_coeff * rows + off
        if c.col_coeff == 1:
            lo = -v if lo is None else torch.maximum(lo, -v)
        else:
            hi = v if hi is None else torch.minimum(hi, v)
    return lo, hi


@dataclass(frozen=True)
class PairWork:
    """Visible (query, key) elements of every (query chunk, key chunk) pair, over global positions.

    `counts[i, j]` (int64, CPU) is exact where `exact` (the mask is affine), else an upper bound;
    0 means the pair is fully masked and is skipped."""

    counts: torch.Tensor
    exact: bool


def pair_work(fused: Program, q_bounds: Bounds, kv_bounds: Bounds, sizes: dict[str, int]) -> PairWork:
    """Count each pair's visible elements from the affine part of the fused program's masks.

    `fused` is the fused attention program traced with the user's mods over global positions;
    `sizes` gives the global extent of each axis (for `Size` terms in a constraint).
    """
    loop = fused_loop(fused)
    row = fused.input("q").dims[2]
    assert row is not None
    int_params = {p for p, kind in fused.param_kinds.items() if kind == "int"}
    int_buffers = frozenset(b.name for b in fused.inputs if b.kind != "float")
    info = analyze_masks(loop, row, int_params, contribution_vanishes, int_buffers)
    boxes = info.boxes()
    counts = torch.zeros(len(q_bounds), len(kv_bounds), dtype=torch.int64)
    for i, (q0, q1) in enumerate(q_bounds):
        if q1 <= q0:
            continue
        rows = torch.arange(q0, q1, dtype=torch.int64)
        ranges = [_column_range(box, rows, sizes) for box in boxes]
        for j, (k0, k1) in enumerate(kv_bounds):
            area = (q1 - q0) * (k1 - k0)
            if area == 0:
                continue
            total = 0
            for lo, hi in ranges:
                low = torch.full_like(rows, k0) if lo is None else lo.clamp_min(k0)
                high = torch.full_like(rows, k1 - 1) if hi is None else hi.clamp_max(k1 - 1)
                total += int((high - low + 1).clamp_min(0).sum())
            counts[i, j] = min(area, total)  # boxes of a union may overlap: never above the area
    return PairWork(counts, exact=not info.residual and len(boxes) <= 1)


def listed_pairs(partial: torch.Tensor, full: torch.Tensor | None, q_block: int, kv_block: int,
                 q_bounds: Bounds, kv_bounds: Bounds) -> torch.Tensor:
    """Which chunk pairs meet a block a BlockMask lists (partial or full), as a bool (nq, nk) CPU
    tensor: a position outside every listed block is masked, so an unlisted pair is empty."""
    listed = partial if full is None else partial | full
    listed = listed.flatten(0, 1).any(dim=0).to(torch.int64)  # (q blocks, kv blocks), any batch / head
    prefix = torch.nn.functional.pad(listed.cumsum(0).cumsum(1), (1, 0, 1, 0)).cpu()
    out = torch.zeros(len(q_bounds), len(kv_bounds), dtype=torch.bool)
    for i, (q0, q1) in enumerate(q_bounds):
        for j, (k0, k1) in enumerate(kv_bounds):
            if q1 <= q0 or k1 <= k0:
                continue
            r0, r1 = q0 // q_block, math.ceil(q1 / q_block)
            c0, c1 = k0 // kv_block, math.ceil(k1 / kv_block)
            out[i, j] = bool(prefix[r1, c1] - prefix[r0, c1] - prefix[r1, c0] + prefix[r0, c0] > 0)
    return out


# --------------------------------------------------------------------------- the strategy


@dataclass(frozen=True)
class Machine:
    """Rough rates of a device and its links: they only need to rank the two strategies.

    flops: attention FLOP/s one kernel call reaches; link: bytes/s one point-to-point transfer
    moves; memory: bytes/s of the torch ops of a merge; latency: seconds of host work and launch
    per kernel call or message."""

    flops: float
    link: float
    memory: float
    latency: float


def machine_for(device_type: str, dtype: torch.dtype) -> Machine:
    """A GPU over NVLink (NCCL) for CUDA tensors; Triton's interpreter and gloo over loopback for CPU."""
    if device_type == "cuda":
        return Machine(flops=4e14 if dtype in (torch.float16, torch.bfloat16) else 5e13, link=2e11, memory=3e12,
                       latency=4e-5)
    return Machine(flops=1e9, link=1e9, memory=1e10, latency=5e-3)


@dataclass(frozen=True)
class Shapes:
    """The global problem: batch, heads, head dims, element size and the chunk layout."""

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    itemsize: int
    world: int
    load_balance: str | None
    q_bounds: Bounds
    kv_bounds: Bounds

    def kv_bytes(self, rank: int) -> int:
        """Bytes of the K/V shard rank `rank` holds (what one ring transfer moves)."""
        rows = sum(self.kv_bounds[c][1] - self.kv_bounds[c][0] for c in rank_chunks(self.world, rank, self.load_balance))
        return self.batch * self.kv_heads * rows * (self.head_dim + self.value_dim) * self.itemsize


@dataclass(frozen=True)
class Estimate:
    """Seconds each strategy is expected to take on its slowest rank, and whether the gathered K/V fits."""

    ring: float
    all_gather: float
    fits: bool

    @property
    def choice(self) -> str:
        return "all_gather" if self.fits and self.all_gather < self.ring else "ring"


_MERGE_PASSES = 8  # a merge stacks two fp32 partial outputs, reads them, writes the merged one, then the epilogue


def estimate(counts: torch.Tensor, shapes: Shapes, machine: Machine, memory_budget: float) -> Estimate:
    """The cost comparison behind `strategy=None`.

    ring, per rank: sum over the `world` steps of max(compute + merges, transfer), the transfer of
    the next K/V shard being overlapped with the step's compute; compute is the visible pairs'
    FLOPs (2 * (E + Ev) per visible element and head) over `flops` plus `latency` per call, a
    merge `_MERGE_PASSES` passes over an fp32 partial output. all_gather, per rank: world - 1
    rounds of the largest shard's transfer (not overlapped), a reordering copy of the whole K/V,
    then one call per query chunk. Both are taken on their slowest rank; the all-gather needs the
    whole K/V twice (gathered, then ordered) within `memory_budget` bytes.
    """
    w, m = shapes.world, machine
    per_element = 2.0 * shapes.batch * shapes.q_heads * (shapes.head_dim + shapes.value_dim)
    flops = [[c * per_element for c in row] for row in counts.tolist()]
    ring = gather = 0.0
    for r in range(w):
        mine = rank_chunks(w, r, shapes.load_balance)
        seen: set[int] = set()
        total = 0.0
        for t in range(w):
            src, nxt = (r - t) % w, (r - t - 1) % w
            pairs = [(i, j) for i in mine for j in rank_chunks(w, src, shapes.load_balance) if flops[i][j] > 0]
            compute = sum(flops[i][j] for i, j in pairs) / m.flops + m.latency * len(pairs)
            merge = 0.0
            for i, _ in pairs:
                if i in seen:
                    rows = shapes.q_bounds[i][1] - shapes.q_bounds[i][0]
                    state = shapes.batch * shapes.q_heads * rows * (shapes.value_dim + 1) * 4
                    merge += _MERGE_PASSES * state / m.memory + m.latency
                seen.add(i)
            transfer = max(shapes.kv_bytes(src), shapes.kv_bytes(nxt)) / m.link + m.latency if t < w - 1 else 0.0
            total += max(compute + merge, transfer)
        ring = max(ring, total)
        calls = [i for i in mine if sum(flops[i]) > 0]
        compute = sum(sum(flops[i]) for i in calls) / m.flops + m.latency * len(calls)
        gather = max(gather, compute)
    kv_total = sum(shapes.kv_bytes(r) for r in range(w))
    largest = max(shapes.kv_bytes(r) for r in range(w))
    gather += (w - 1) * (largest / m.link + m.latency) + 2 * kv_total / m.memory
    return Estimate(ring=ring, all_gather=gather, fits=2 * kv_total <= memory_budget)
