"""Run-time block maps for masks the compiler cannot bound analytically (document ids, gathers).

For every (row tile, column tile) the mask condition is evaluated on the host device and
classified as empty, partly visible or fully visible; the kernel then visits only the listed
tiles (fully visible ones with no mask arithmetic). Maps are cached per program, shapes, block
sizes and the identity and version of the tensors the condition reads, so repeated calls (and
layers sharing the same document ids) build them once; while a CUDA graph is being captured they
are built every time, so that the build is part of the graph and replays follow the mask's tensors.

Example:
    >>> import torch, neptune_fusion as nf
    >>> from neptune_fusion.runtime import blockmap
    >>> doc = torch.tensor([0] * 20 + [1] * 12)            # two documents packed in 32 tokens
    >>> def same_doc(b, h, q_idx, kv_idx):
    ...     return doc[q_idx] == doc[kv_idx]
    >>> q = k = v = torch.randn(1, 1, 32, 16)
    >>> before = blockmap.builds
    >>> out = nf.attention(q, k, v, mask_mod=same_doc)    # builds the map ...
    >>> out = nf.attention(q, k, v, mask_mod=same_doc)    # ... and the next call finds it
    >>> blockmap.builds - before
    1
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from typing import Any

import torch

from neptune_fusion.analysis.masks import MaskInfo, conjuncts, push_not
from neptune_fusion.ir.expr import Binary, Expr, Unary, free_axes, loads_of, walk
from neptune_fusion.ir.program import Program
from neptune_fusion.runtime.reference import _Evaluator
from neptune_fusion.runtime.state import CALL_STATE
from neptune_fusion.tile.lower import BLOCK_MAP_PREFIX, AxisRoles

# key -> (weak references to the tensors the map was built from, the map)
_CACHE: OrderedDict[tuple[Any, ...], tuple[tuple[weakref.ref[torch.Tensor], ...], dict[str, torch.Tensor]]] = OrderedDict()
_CACHE_SIZE = 64
builds = 0  # how many maps were built (not fetched from the cache); read by tests


def visibility(masks: MaskInfo) -> Expr:
    """The condition under which an element is visible through every mask."""
    cond: Expr | None = None
    for m in masks.masks:
        c = m.node.cond if m.visible is m.node.a else Unary("not", m.node.cond)
        cond = c if cond is None else Binary("and", cond, c)
    assert cond is not None
    return cond


def block_map_axes(masks: MaskInfo, roles: AxisRoles) -> tuple[str, ...]:
    """The batch axes the visibility condition depends on (the map has one slice per value)."""
    axes = free_axes(visibility(masks))
    return tuple(a for a in roles.batch if a in axes)


_CONDITIONS: dict[tuple[str, int], tuple[Expr, tuple[str, ...], tuple[str, ...]]] = {}


def _condition(program: Program, masks: MaskInfo) -> tuple[Expr, tuple[str, ...], tuple[str, ...]]:
    """The visibility condition, the buffers and the parameters it reads (cached: this runs per call)."""
    key = (program.fingerprint(), id(masks))
    if key not in _CONDITIONS:
        cond = visibility(masks)
        names = {getattr(x, "name", None) for x in walk(cond)}
        _CONDITIONS[key] = (cond, tuple(sorted(loads_of(cond))), tuple(p for p in program.params if p in names))
    return _CONDITIONS[key]


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What a map built from `t` depends on: which tensor object, its layout and its version.

    The address alone is not enough: a transposed view shares it, and a new tensor allocated where a
    freed one was starts at version 0 again. `id` tells objects apart while the entry's weak
    reference (checked on every hit) proves the object is still the one the map was built from.
    """
    return (id(t), t.data_ptr(), t.storage_offset(), t._version, tuple(t.shape), t.stride(), t.dtype, t.device)


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def block_map(program: Program, masks: MaskInfo, roles: AxisRoles, sizes: dict[str, int], args: dict[str, Any],
              block_row: int, block_col: int, static_key: Any = None) -> dict[str, torch.Tensor]:
    """Tile lists for the kernel: counts and indices of full and partial column tiles per row tile.

    `static_key` (what does not change between calls of one launcher: program, sizes, blocks) may be
    passed precomputed; only the tensors and parameters the mask reads are looked at per call.
    """
    global builds
    cond, reads, params = _condition(program, masks)
    if static_key is None:
        static_key = (program.fingerprint(), tuple(sorted(sizes.items())), block_row, block_col)
    tensors = tuple(args[n] for n in reads)
    # the type too: 3 == 3.0 but `//` and `%` on them differ
    key = (static_key, tuple(_tensor_key(t) for t in tensors), tuple((type(args[p]), args[p]) for p in params))
    # inside a CUDA graph capture the map is built, never fetched: a replay runs no host code, so only
    # a map whose build is part of the graph follows new values written into the mask's tensors
    capturing = _capturing() or CALL_STATE.private  # (private_state: nothing may outlive the call)
    hit = None if capturing else _fetch(key, tensors)
    if hit is not None:
        return hit
    builds += 1
    device = next(t.device for t in args.values() if isinstance(t, torch.Tensor))
    axes = block_map_axes(masks, roles)
    rows, cols = sizes[roles.row], sizes[roles.col]
    n_rt, n_ct = math.ceil(rows / block_row), math.ceil(cols / block_col)
    buffers = {n: args[n] for n in reads}
    ev = _Evaluator(sizes, buffers, {p: args[p] for p in program.params}, torch.float32, device)
    frame = [*axes, roles.row, roles.col]
    batch_shape = [sizes[a] for a in axes]
    any_vis = torch.ones(*batch_shape, n_rt, n_ct, dtype=torch.bool, device=device)
    all_vis = torch.ones_like(any_vis)
    # conjuncts of one of the two axes (a padding mask, rows the forward left empty) are evaluated
    # on that axis alone: all() of a conjunction is the conjunction of the all()s, and the
    # conjunction of the any()s over-approximates any(), which only makes a tile partly visible
    # (visited, with the mask arithmetic) where it may hold nothing
    dense: Expr | None = None
    for part in conjuncts(push_not(cond)):
        if not free_axes(part) <= set(frame):
            # it varies along an axis the tile holds (a bias's head axis in a backward that sums
            # over heads): it may hold anywhere, so it makes no tile empty and none full
            all_vis[...] = False
            continue
        if {roles.row, roles.col} <= free_axes(part):
            dense = part if dense is None else Binary("and", dense, part)
            continue
        vis = ev.eval(part, frame).bool()
        vis = vis.reshape((1,) * (len(frame) - vis.dim()) + tuple(vis.shape))
        any_part, all_part = _tiles(vis, block_row, block_col, n_rt, n_ct)
        any_vis &= any_part
        all_vis &= all_part
    if dense is not None:
        # the part over both axes (the mask proper) is kept apart: the one-axis parts may read what
        # changes every call (a backward pass's saved statistics) while the mask stays
        dense_reads = tuple(n for n in reads if n in loads_of(dense))
        dense_key = (key[0], "dense", tuple(_tensor_key(args[n]) for n in dense_reads), key[2])
        dense_tensors = tuple(args[n] for n in dense_reads)
        found = None if capturing else _fetch(dense_key, dense_tensors)
        if found is None:
            found = _dense_tiles(ev, dense, frame, roles, sizes, axes, block_row, block_col, n_rt, n_ct)
            if not capturing:
                _store(dense_key, dense_tensors, found)
        any_vis &= found[0]
        all_vis &= found[1]
    if cols % block_col:
        # a full tile is read without bounds checks: one running past the last column is at most
        # partial, whatever the conditions (one of extent 1 along the columns reads as broadcast)
        all_vis[..., -1] = False
    partial = any_vis & ~all_vis
    out: dict[str, torch.Tensor] = {}
    for kind, sel in (("full", all_vis), ("partial", partial)):
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        out[f"{BLOCK_MAP_PREFIX}{kind}_count"] = sel.sum(dim=-1, dtype=torch.int32).contiguous()
        out[f"{BLOCK_MAP_PREFIX}{kind}_index"] = order.contiguous()
    if capturing:
        return out
    _store(key, tensors, out)
    return out


def _fetch(key: tuple[Any, ...], tensors: tuple[torch.Tensor, ...]) -> Any:
    """The cached value of `key`, if the tensors it was built from are these very objects."""
    hit = _CACHE.get(key)
    if hit is None or not all(ref() is t for ref, t in zip(hit[0], tensors)):
        return None
    _CACHE.move_to_end(key)
    return hit[1]


def _store(key: tuple[Any, ...], tensors: tuple[torch.Tensor, ...], value: Any) -> None:
    _CACHE[key] = (tuple(weakref.ref(t) for t in tensors), value)
    _CACHE.move_to_end(key)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)


def _dense_tiles(ev: _Evaluator, dense: Expr, frame: list[str], roles: AxisRoles, sizes: dict[str, int],
                 axes: tuple[str, ...], block_row: int, block_col: int, n_rt: int, n_ct: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, all) per tile of a condition over both axes, evaluated a chunk of row tiles at a time
    (about 16M elements each), so the map of a long sequence never holds its query x key grid."""
    rows, cols = sizes[roles.row], sizes[roles.col]
    used = [a for a in axes if a in free_axes(dense)]
    shape = [sizes[a] if a in used else 1 for a in axes]
    any_vis = torch.zeros(*shape, n_rt, n_ct, dtype=torch.bool, device=ev.device)
    all_vis = torch.zeros_like(any_vis)
    chunk = max(1, (1 << 24) // max(1, cols * math.prod(shape)) // block_row) * block_row
    for lo in range(0, rows, chunk):
        hi = min(rows, lo + chunk)
        ev.ranges[roles.row] = torch.arange(lo, hi, device=ev.device)
        vis = ev.eval(dense, frame).bool()
        vis = vis.reshape((1,) * (len(frame) - vis.dim()) + tuple(vis.shape))
        any_part, all_part = _tiles(vis, block_row, block_col, math.ceil((hi - lo) / block_row), n_ct)
        t0 = lo // block_row
        any_vis[..., t0:t0 + any_part.shape[-2], :] = any_part
        all_vis[..., t0:t0 + all_part.shape[-2], :] = all_part
    ev.ranges.pop(roles.row, None)
    return any_vis, all_vis


def _tiles(vis: torch.Tensor, block_row: int, block_col: int, n_rt: int, n_ct: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, all) of `vis` per (row tile, column tile). Its last two dims are the rows and the
    columns, each of the full extent or 1 (a condition that does not depend on that axis: the
    result keeps the 1). Positions past the ends count as invisible."""
    any_v = all_v = vis
    if vis.shape[-2] != 1:
        pad = (0, 0, 0, n_rt * block_row - vis.shape[-2])
        any_v, all_v = (op(torch.nn.functional.pad(t, pad, value=False).unflatten(-2, (n_rt, block_row)), dim=-2)
                        for op, t in ((torch.any, any_v), (torch.all, all_v)))
    if vis.shape[-1] != 1:
        pad = (0, n_ct * block_col - vis.shape[-1])
        any_v, all_v = (op(torch.nn.functional.pad(t, pad, value=False).unflatten(-1, (n_ct, block_col)), dim=-1)
                        for op, t in ((torch.any, any_v), (torch.all, all_v)))
    return any_v, all_v


__all__ = ["block_map", "block_map_axes", "visibility"]
