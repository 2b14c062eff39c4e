"""Context parallelism: attention over a sequence sharded across the ranks of a process group.

Every rank holds a shard of q, k and v along the sequence (dim 2), as `context_parallel_shard`
cuts it (`context_parallel_plan.py`: zigzag chunks r and 2 * world - 1 - r, or contiguous
shards; odd lengths give chunks one position apart). `context_parallel_attention` computes
each rank's rows of the attention over the whole sequence, with score_mod / mask_mod / BlockMask
seeing global positions, in one of two ways:

- ring: the K/V shards travel around the ring (torch.distributed point-to-point, the next
  step's transfer posted before the current step's compute); at each step every (query chunk,
  key chunk) pair that the mask leaves visible runs our kernel (`nf.attention` with its LSE,
  the mods shifted to the chunks' global offsets), and the partials merge through the split-K
  combine the compiler derives from the program's repair terms (`context_parallel_merge.py`);
- all_gather: K/V gathered once, then one kernel call per local query chunk (no merge).

`strategy=None` picks the one a cost comparison of the shapes favours (`plan.estimate`).
Fully masked pairs are skipped without a launch: the mask analysis of the program over global
positions bounds each pair's visible elements (exact for affine masks), and a BlockMask's block
lists rule out the pairs they do not list; data-dependent masks (document ids) leave the rest
to the kernel's own block maps. With q, k or v requiring grad, the call is differentiable: its
backward runs a second ring (`context_parallel_grad.py`) whatever the forward's strategy.

Runs with gloo on CPU tensors (kernels under TRITON_INTERPRET=1) and NCCL on CUDA tensors.
Multi-GPU runs should keep NVLink multicast off: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 (set before the process group starts).

Example (the layout only; the calls need an initialised process group, see
examples/context_parallel.py):
    >>> from neptune_fusion.integrations.context_parallel_plan import shard_ranges
    >>> [shard_ranges(9, world=2, rank=r) for r in range(2)]     # zigzag, an odd length
    [((0, 3), (7, 9)), ((3, 5), (5, 7))]
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from neptune_fusion.integrations.attention import (
    Builtins,
    MaskMod,
    Outputs,
    ScoreMod,
    _check_inputs,
    _keys,
    _Request,
    attention,
    attention_program,
    mask_arguments,
)
from neptune_fusion.integrations.blockmask import BlockTables, as_mask_mod, block_tables
from neptune_fusion.integrations.context_parallel_comm import (
    DTYPES,
    agree,
    all_gather_ints,
    check_lengths,
    context_parallel_gather,
    context_parallel_shard,
    group_of,
    shard_offsets,
)
from neptune_fusion.integrations.context_parallel_grad import RingAttention
from neptune_fusion.integrations.context_parallel_merge import Merge, Partial
from neptune_fusion.integrations.context_parallel_plan import (
    STRATEGIES,
    Bounds,
    Shapes,
    check_load_balance,
    chunk_bounds,
    chunk_count,
    estimate,
    listed_pairs,
    machine_for,
    pair_work,
    shard_length,
)
from neptune_fusion.ir.program import Program
from neptune_fusion.schedule.pipeline import fuse

__all__ = ["context_parallel_attention", "context_parallel_gather", "context_parallel_shard"]

_CACHE_SIZE = 256

kernel_calls = 0  # attention kernel calls made by context_parallel_attention (read by tests)
last_strategy: str | None = None  # the strategy the last call ran


# --------------------------------------------------------------------------- derived pieces, cached


_derived: OrderedDict[str, tuple[Program, Merge]] = OrderedDict()
_work: OrderedDict[tuple[Any, ...], torch.Tensor] = OrderedDict()
_shifted_mods: OrderedDict[tuple[Any, ...], tuple[Any, Callable[..., Any]]] = OrderedDict()


def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any) -> Any:
    cache[key] = value
    while len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)
    return value


def _fused_and_merge(program: Program) -> tuple[Program, Merge]:
    """The fused program (its masks are analysed) and the merge derived from it, per program."""
    key = program.fingerprint()
    hit = _derived.get(key)
    if hit is None:
        fused = fuse(program)[-1].program
        hit = _remember(_derived, key, (fused, Merge(fused)))
    return hit


def _pair_counts(fused: Program, q_bounds: Bounds, kv_bounds: Bounds, sizes: dict[str, int]) -> torch.Tensor:
    key = (fused.fingerprint(), q_bounds, kv_bounds, tuple(sorted(sizes.items())))
    hit = _work.get(key)
    if hit is None:
        hit = _remember(_work, key, pair_work(fused, q_bounds, kv_bounds, sizes).counts)
    return hit


_block_mask_mods: OrderedDict[tuple[Any, ...], tuple[weakref.ref[Any], BlockTables, Callable[..., Any]]] = OrderedDict()


def _block_mask_mod(block_mask: Any, batch: int, heads: int, q_len: int, kv_len: int) -> tuple[BlockTables, Any]:
    """A BlockMask's dense tables and the mask_mod over global positions honouring it whole, kept
    per BlockMask (and the versions of its lists): the same mask_mod object on every call, so the
    shifted mods and nf.attention's fast path are found again instead of made anew."""
    lists = [t for t in (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                         block_mask.full_kv_indices) if t is not None]
    key = (id(block_mask), batch, heads, q_len, kv_len, tuple(t._version for t in lists))
    hit = _block_mask_mods.get(key)
    if hit is not None and hit[0]() is block_mask:
        return hit[1], hit[2]
    tables = block_tables(block_mask, batch, heads, q_len, kv_len)
    _block_mask_mods[key] = (weakref.ref(block_mask), tables, as_mask_mod(tables))
    while len(_block_mask_mods) > 16:
        _block_mask_mods.popitem(last=False)
    return tables, _block_mask_mods[key][2]


def _shifted(mod: Any, is_score: bool, q_off: int, kv_off: int) -> Any:
    """`mod` seeing global positions from a chunk pair's local indices. The offsets are constants
    of the traced program, so the mask analysis keeps affine masks affine (exact loop bounds); one
    closure per (mod, offsets), kept, so repeated calls take nf.attention's fast path."""
    if mod is None or q_off == kv_off == 0:
        return mod
    key = (id(mod), is_score, q_off, kv_off)
    hit = _shifted_mods.get(key)
    if hit is not None and hit[0] is mod:
        return hit[1]

    if is_score:
        def shifted_score(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return mod(score, b, h, q_idx + q_off, kv_idx + kv_off)
        fn: Callable[..., Any] = shifted_score
    else:
        def shifted_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return mod(b, h, q_idx + q_off, kv_idx + kv_off)
        fn = shifted_mask
    return _remember(_shifted_mods, key, (mod, fn))[1]


# --------------------------------------------------------------------------- one call


@dataclass
class _Call:
    """What every step of one call needs."""

    score_mod: ScoreMod | None
    mask_mod: MaskMod | None  # over global positions (a BlockMask already turned into one)
    scale: float
    enable_gqa: bool
    merge: Merge
    q_bounds: Bounds
    kv_bounds: Bounds
    visible: list[list[bool]]  # [query chunk][key chunk]: the pairs that may see each other


def _attend(call: _Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_chunk: int, kv_off: int) -> Partial:
    global kernel_calls
    kernel_calls += 1
    q_off = call.q_bounds[q_chunk][0]
    out, lse = attention(q, k, v, score_mod=_shifted(call.score_mod, True, q_off, kv_off), scale=call.scale,
                         enable_gqa=call.enable_gqa, return_lse=True,
                         mask_mod=_shifted(call.mask_mod, False, q_off, kv_off))
    return Partial(out, lse)


def _add(call: _Call, states: dict[int, Partial | None], i: int, part: Partial) -> None:
    prev = states[i]
    states[i] = Partial(part.out.float(), part.lse) if prev is None else call.merge(prev, part, scale=call.scale)


def _finish(q: torch.Tensor, v: torch.Tensor, q_chunks: list[tuple[int, int, int]],
            results: dict[int, torch.Tensor | None]) -> torch.Tensor:
    """The local output: each query chunk's result in shard order; 0 for rows no key is visible to."""
    outs = []
    for c, a, b in q_chunks:
        r = results[c]
        outs.append(q.new_zeros((*q.shape[:2], b - a, v.shape[3])) if r is None else r.to(q.dtype))
    return torch.cat(outs, dim=2)


def _pack(k: torch.Tensor, v: torch.Tensor, buf: torch.Tensor) -> None:
    buf[:k.numel()].view_as(k).copy_(k)
    buf[k.numel():k.numel() + v.numel()].view_as(v).copy_(v)


def _unpack(buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (k, v) of a shard of `length` positions packed in `buf` (k's and v's other dims)."""
    kshape = (*k.shape[:2], length, k.shape[3])
    vshape = (*v.shape[:2], length, v.shape[3])
    nk = math.prod(kshape)
    return buf[:nk].view(kshape), buf[nk:nk + math.prod(vshape)].view(vshape)


Lses = dict[int, "torch.Tensor | None"]  # per local query chunk: its global log-sum-exp (None: no pair visible)


def _ring(call: _Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, rank: int, world: int,
          load_balance: str | None) -> tuple[torch.Tensor, Lses]:
    q_chunks = shard_offsets(call.q_bounds, world, rank, load_balance)
    lengths = [shard_length(call.kv_bounds[-1][1], world, r, load_balance) for r in range(world)]
    per_position = k.shape[0] * k.shape[1] * (k.shape[3] + v.shape[3])
    bufs = [k.new_empty(max(lengths) * per_position) for _ in range(2 if world > 1 else 1)]
    _pack(k, v, bufs[0])
    nxt_peer = dist.get_global_rank(group, (rank + 1) % world)
    prev_peer = dist.get_global_rank(group, (rank - 1) % world)
    states: dict[int, Partial | None] = {c: None for c, _, _ in q_chunks}
    for t in range(world):
        src = (rank - t) % world
        works = []
        if t < world - 1:  # the next shard's transfer runs while this step computes
            arriving = lengths[(src - 1) % world]
            ops = []
            if lengths[src]:
                ops.append(dist.P2POp(dist.isend, bufs[0][:lengths[src] * per_position], nxt_peer, group))
            if arriving:
                ops.append(dist.P2POp(dist.irecv, bufs[1][:arriving * per_position], prev_peer, group))
            works = dist.batch_isend_irecv(ops) if ops else []
        k_src, v_src = _unpack(bufs[0], k, v, lengths[src])
        for j, a, b in shard_offsets(call.kv_bounds, world, src, load_balance):
            for i, qa, qb in q_chunks:
                if call.visible[i][j]:
                    part = _attend(call, q[:, :, qa:qb], k_src[:, :, a:b], v_src[:, :, a:b], i, call.kv_bounds[j][0])
                    _add(call, states, i, part)
        for work in works:
            work.wait()
        bufs.reverse()
    out = _finish(q, v, q_chunks, {i: None if s is None else s.out for i, s in states.items()})
    return out, {i: None if s is None else s.lse for i, s in states.items()}


def _all_gathered(call: _Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, rank: int,
                  world: int, load_balance: str | None) -> tuple[torch.Tensor, Lses]:
    q_chunks = shard_offsets(call.q_bounds, world, rank, load_balance)
    lengths = [shard_length(call.kv_bounds[-1][1], world, r, load_balance) for r in range(world)]
    per_position = k.shape[0] * k.shape[1] * (k.shape[3] + v.shape[3])
    mine = k.new_zeros(max(lengths) * per_position)
    _pack(k, v, mine)
    if world > 1 and mine.numel():
        shards = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(shards, mine, group=group)
    else:  # one rank, or no keys anywhere
        shards = [mine] * world
    ks: dict[int, torch.Tensor] = {}
    vs: dict[int, torch.Tensor] = {}
    for r, buf in enumerate(shards):
        k_r, v_r = _unpack(buf, k, v, lengths[r])
        for c, a, b in shard_offsets(call.kv_bounds, world, r, load_balance):
            ks[c], vs[c] = k_r[:, :, a:b], v_r[:, :, a:b]
    k_all = torch.cat([ks[c] for c in sorted(ks)], dim=2)
    v_all = torch.cat([vs[c] for c in sorted(vs)], dim=2)
    del shards, ks, vs
    parts: dict[int, Partial | None] = {}
    for i, a, b in q_chunks:
        seen = any(call.visible[i])
        parts[i] = _attend(call, q[:, :, a:b], k_all, v_all, i, 0) if seen else None
    out = _finish(q, v, q_chunks, {i: None if p is None else p.out for i, p in parts.items()})
    return out, {i: None if p is None else p.lse for i, p in parts.items()}


# --------------------------------------------------------------------------- the API


def _memory_budget(device: torch.device) -> int:
    """Bytes this rank can give a gathered K/V (CUDA: what is free now; CPU: not limited here)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return 1 << 62


_META = ("batch", "query heads", "key/value heads", "head dim", "value head dim", "dtype", "enable_gqa",
         "load_balance", "strategy", "whether a score_mod is given", "whether a mask is given")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: ScoreMod | None = None,
                               block_mask: Any = None, scale: float | None = None, enable_gqa: bool = False, *,
                               mask_mod: MaskMod | None = None, group: Any = None,
                               load_balance: str | None = "zigzag", strategy: str | None = None) -> torch.Tensor:
    """Attention over a sequence sharded across `group`: this rank's rows of the output.

    q (B, Hq, Lq_local, E), k (B, Hkv, Lk_local, E), v (B, Hkv, Lk_local, Ev) are this rank's
    shards of the global q, k, v, as `context_parallel_shard(x, load_balance=...)` cuts them
    (the same `load_balance` on every rank, every call). `score_mod`, `mask_mod` and `block_mask`
    are FlexAttention's, over GLOBAL positions: a BlockMask made by `create_block_mask` for the
    full lengths is honoured whole (block lists and mask_mod). Returns (B, Hq, Lq_local, Ev) in
    the input dtype, this rank's rows of `nf.attention` on the gathered tensors; rows that see
    no key give 0. `strategy`: "ring" (K/V rotate, partials merge through the derived split-K
    combine), "all_gather" (K/V gathered once), or None (the cheaper by `plan.estimate`, the
    same on every rank). Collective: every rank of the group must call it.

    Inputs are checked before any communication (ValueError/TypeError); then one small
    all_gather checks that the ranks agree (shapes, dtype, flags, shard lengths) and raises the
    same ValueError on all of them where not. Differentiable in q, k and v (a second ring in the
    backward, collective too); a tensor the mods capture that requires grad raises RuntimeError.
    Multi-GPU (NCCL): keep NVLink multicast off with
    NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1.

    Example (on every rank, after init_process_group; see examples/context_parallel.py):
        >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        >>> q_loc, k_loc, v_loc = (nf.context_parallel_shard(t) for t in (q, k, v))   # doctest: +SKIP
        >>> out_loc = nf.context_parallel_attention(q_loc, k_loc, v_loc, mask_mod=causal)   # doctest: +SKIP
        >>> out = nf.context_parallel_gather(out_loc)                                    # doctest: +SKIP
    """
    global last_strategy
    scale, block_mask, mask_mod = _check_call(q, k, v, score_mod, block_mask, mask_mod, scale, enable_gqa,
                                              load_balance, strategy)
    group, rank, world = group_of(group)
    q_len, kv_len, budget = _agree_across_ranks(q, k, v, score_mod, block_mask is not None or mask_mod is not None,
                                                enable_gqa, load_balance, strategy, group, world)
    call, counts = _resolve(q, k, v, score_mod, block_mask, mask_mod, scale, enable_gqa, q_len, kv_len,
                            chunk_count(world, load_balance))
    if strategy is None:
        shapes = Shapes(q.shape[0], q.shape[1], k.shape[1], q.shape[3], v.shape[3], q.element_size(), world,
                        load_balance, call.q_bounds, call.kv_bounds)
        strategy = estimate(counts, shapes, machine_for(q.device.type, q.dtype), budget).choice
    last_strategy = strategy
    run = _ring if strategy == "ring" else _all_gathered
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return run(call, q, k, v, group, rank, world, load_balance)[0]
    ring = {"attend": lambda qc, kc, vc, i, kv_off: _attend(call, qc, kc, vc, i, kv_off), "q_bounds": call.q_bounds,
            "kv_bounds": call.kv_bounds, "visible": call.visible, "group": group, "rank": rank, "world": world,
            "load_balance": load_balance}
    return RingAttention.apply(q, k, v, lambda *qkv: run(call, *qkv, group, rank, world, load_balance), ring)


def _check_call(q: Any, k: Any, v: Any, score_mod: Any, block_mask: Any, mask_mod: Any, scale: Any, enable_gqa: bool,
                load_balance: Any, strategy: Any) -> tuple[float, Any, Any]:
    """The local checks, before any communication: (the scale, the BlockMask, the mask function)."""
    _, scale = _check_inputs(q, k, v, score_mod, scale, enable_gqa)
    block_mask, mask_mod = mask_arguments(block_mask, mask_mod, q)
    check_load_balance(load_balance)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be 'ring', 'all_gather' or None (chosen from the shapes), got {strategy!r}")
    _refuse_captured_grad(score_mod, block_mask.mask_mod if block_mask is not None else mask_mod, enable_gqa)
    return scale, block_mask, mask_mod


def _refuse_captured_grad(score_mod: Any, mask_mod: Any, enable_gqa: bool) -> None:
    """The backward through the ring gives q, k and v their gradients, not the tensors the mods
    capture: a call where one of those requires grad (in grad mode) is refused, before any
    communication, rather than returning a result that silently drops its gradient."""
    if not torch.is_grad_enabled():
        return
    request = _Request(score_mod, mask_mod, Builtins(), Outputs(lse=True), bool(enable_gqa), None)
    captured = _keys(request)[1].tensors  # the tensors the mods close over, found as nf.attention finds them
    if any(t.requires_grad for t in captured):
        raise RuntimeError(
            "neptune_fusion context_parallel_attention differentiates q, k and v only, but a tensor its score_mod "
            "or mask_mod captures requires grad: that gradient would silently be dropped. Detach the captured "
            "tensor, or run the call under `torch.no_grad()`.")


def _agree_across_ranks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: Any, masked: bool,
                        enable_gqa: bool, load_balance: str | None, strategy: str | None, group: Any,
                        world: int) -> tuple[int, int, int]:
    """(global query length, global key length, the smallest memory budget): one all-gather that
    every rank checks the same way, so a misfit raises everywhere instead of hanging somewhere."""
    (b, hq, lq, e), (_, hkv, lk, _), ev = q.shape, k.shape, v.shape[3]
    meta = [b, hq, hkv, e, ev, DTYPES.index(q.dtype), int(bool(enable_gqa)), load_balance is None,
            STRATEGIES.index(strategy), score_mod is not None, masked]
    rows = all_gather_ints([lq, lk, _memory_budget(q.device), *map(int, meta)], q.device, group, world)
    agree([r[3:] for r in rows], _META, "context_parallel_attention")
    q_len = check_lengths([r[0] for r in rows], world, load_balance, "context_parallel_attention (query)")
    kv_len = check_lengths([r[1] for r in rows], world, load_balance, "context_parallel_attention (key/value)")
    return q_len, kv_len, min(r[2] for r in rows)


def _resolve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: Any, block_mask: Any, mask_mod: Any,
             scale: float, enable_gqa: bool, q_len: int, kv_len: int, chunks: int) -> tuple[_Call, torch.Tensor]:
    """The call's mods over global positions, its merge and which chunk pairs may see each other
    (and the pairs' visible-element counts from the affine part of the mask, for `estimate`)."""
    q_bounds, kv_bounds = chunk_bounds(q_len, chunks), chunk_bounds(kv_len, chunks)
    listed = None
    if block_mask is not None:
        tables, mask_mod = _block_mask_mod(block_mask, q.shape[0], q.shape[1], q_len, kv_len)
        listed = listed_pairs(tables.partial, tables.full, tables.q_block, tables.kv_block, q_bounds, kv_bounds)
    # the program over global positions: the mods unshifted, traced at a small length (the trace
    # holds lengths symbolically); its masks and its merge serve every chunk pair
    small = [t.new_zeros((*t.shape[:2], 2, t.shape[3])) for t in (q, k, v)]
    program = attention_program(*small, score_mod=score_mod, scale=scale, enable_gqa=enable_gqa, return_lse=True,
                                mask_mod=mask_mod)
    fused, merge = _fused_and_merge(program)
    sizes = {fused.input("q").dims[2]: q_len, fused.input("k").dims[2]: kv_len}
    counts = _pair_counts(fused, q_bounds, kv_bounds, sizes)
    visible = counts > 0 if listed is None else (counts > 0) & listed
    # only the affine counts (the same on every rank) go into the strategy: the ranks must agree on it
    return _Call(score_mod, mask_mod, scale, bool(enable_gqa), merge, q_bounds, kv_bounds, visible.tolist()), counts
