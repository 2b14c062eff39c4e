"""FlexAttention `BlockMask` support: its sparse block lists as dense tables a traced mask_mod can index.

Compiled FlexAttention visits, for each (batch, head, query block), only the key blocks listed in
`kv_indices[..., :kv_num_blocks]` (*partial* blocks, where `mask_mod` is applied) and in
`full_kv_indices[..., :full_kv_num_blocks]` (*full* blocks, where it is not); every other block is
skipped. So a position (b, h, q, kv) is attended to iff

    full[b', h', q // QB, kv // KB]  |  (partial[b', h', q // QB, kv // KB]  &  mask_mod(b, h, q, kv))

with (QB, KB) = `block_mask.BLOCK_SIZE` and b' = 0 / h' = 0 where the BlockMask's batch / head dim
is 1 (broadcast). Positions past the sequence lengths never exist (the inputs' lengths must equal
`block_mask.seq_lengths`). Note that *eager* `flex_attention` (no torch.compile) ignores the block
lists and applies only `mask_mod`; this module follows the compiled kernels, which is what a
`BlockMask.from_kv_blocks(...)` (whose mask_mod is a no-op) relies on.

Most BlockMasks say nothing their mask_mod does not: `create_block_mask` lists a block as full
only where mask_mod keeps every position and skips it only where mask_mod keeps none. Then the
keep condition above is mask_mod itself, and `implied_by_mask_mod(tables, ...)` says so (it
evaluates mask_mod over the whole grid, a chunk of query blocks at a time); `nf.attention` then
traces mask_mod alone, so the compiler analyses it as it would `mask_mod=` (a causal triangle
becomes loop bounds) instead of reading the tables.

Two steps, so the caller can cache the first and trace the second:
- `block_tables(block_mask, batch, heads, q_len, kv_len)` validates the BlockMask against the
  inputs and builds the dense boolean tables (torch ops only, traceable by dynamo fullgraph);
- `visible(...)` (or the ready-made `as_mask_mod(tables)`) is the keep condition above, written as
  an ordinary FlexAttention mask_mod body, so nf's tracer turns the table reads into gathers of
  captured tensors;
- `implied_by_mask_mod(...)` (optional, not traceable) says whether the tables add nothing to
  the BlockMask's mask_mod, so that mask_mod alone may stand for the whole BlockMask.

Example:
    >>> import torch
    >>> from torch.nn.attention.flex_attention import create_block_mask
    >>> def causal(b, h, q_idx, kv_idx):
    ...     return q_idx >= kv_idx
    >>> bm = create_block_mask(causal, None, None, 200, 136, device="cpu", BLOCK_SIZE=64)
    >>> t = block_tables(bm, batch=2, heads=4, q_len=200, kv_len=136)
    >>> tuple(t.partial.shape), t.q_block, t.kv_block, t.mask_mod is causal
    ((1, 1, 4, 3), 64, 64, True)
    >>> t.full[0, 0].int().tolist()     # below the diagonal: no mask_mod (the last row is padded, never full)
    [[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 0, 0]]
    >>> t.partial[0, 0].int().tolist()
    [[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 1]]
    >>> mask_mod = as_mask_mod(t)       # then: nf.attention(q, k, v, mask_mod=mask_mod)
    >>> implied_by_mask_mod(t, batch=2, heads=4, q_len=200, kv_len=136)   # ... or mask_mod=causal
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.nn.attention import flex_attention as _flex
from torch.nn.attention.flex_attention import BlockMask, create_mask

__all__ = ["BlockTables", "as_mask_mod", "block_tables", "implied_by_mask_mod", "mask_mod_of", "visible"]

MaskMod = Callable[[Any, Any, Any, Any], Any]

# BlockMask of flex_attention(block_mask=None): one block as large as any sequence; torch skips the
# sequence-length check for it (private in torch, hence the fallback)
_LARGE_BLOCK = getattr(_flex, "_LARGE_SPARSE_BLOCK_SIZE", 1 << 30)
_SLICED_MASK_MOD = getattr(_flex, "_sliced_mask_mod_error", None)  # torch >= 2.9 only
# implied_by_mask_mod: mask positions evaluated at once (the bool mask's bytes; its padded copy
# doubles it), and the most it evaluates in all before it gives up (answers False) as too costly
_CHUNK_POSITIONS = 1 << 25
_MAX_POSITIONS = 1 << 34


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensor fields elementwise would be meaningless
class BlockTables:
    """A BlockMask's block lists as dense tables, for one (batch, heads, q_len, kv_len) of inputs.

    `partial` / `full` are bool (Bm, Hm, QB, KB) on the BlockMask's device, with Bm in {1, batch}
    and Hm in {1, heads} as the BlockMask has them (size 1: broadcast), QB = ceil(q_len / q_block),
    KB = ceil(kv_len / kv_block). `full` is None when the BlockMask has no full lists. A block set
    in both is visited twice by torch's kernel (double counted); here it is simply visible.
    `mask_mod` is the BlockMask's mask_mod, None when it is torch's `noop_mask` (always True).
    """

    partial: torch.Tensor
    full: torch.Tensor | None
    q_block: int
    kv_block: int
    mask_mod: MaskMod | None


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _check_lengths(block_mask: BlockMask, q_len: int, kv_len: int) -> None:
    """flex_attention's own check (its messages), so a misfit fails here as it would there."""
    if tuple(block_mask.BLOCK_SIZE) == (_LARGE_BLOCK, _LARGE_BLOCK):
        return  # the "no block mask" BlockMask fits any lengths
    bm_q, bm_kv = block_mask.seq_lengths
    if q_len > bm_q or kv_len > bm_kv:
        raise ValueError(
            f"block_mask was created for block_mask.shape={tuple(block_mask.shape)} but got q_len={q_len} "
            f"and kv_len={kv_len}. As the block mask was created for a smaller length than you're using it "
            "for, you likely need to create a new block mask."
        )
    if q_len != bm_q or kv_len != bm_kv:
        raise ValueError(
            f"block_mask was created for block_mask.shape={tuple(block_mask.shape)} but got q_len={q_len} "
            f"and kv_len={kv_len}. As the block mask was created for a larger length than you're using it "
            "for, create a new block mask with the correct length, or crop it with "
            "block_mask._adjust(q_len, kv_len) (which is wrong for some mask_mods)."
        )


def _check_lists(name: str, num: torch.Tensor, idx: torch.Tensor, batch: int, heads: int, rows: int) -> None:
    if idx.dim() != 4 or num.dim() != 3 or tuple(num.shape) != tuple(idx.shape[:3]):
        raise ValueError(
            f"block_mask.{name} must have shape (B, H, q_blocks, n) and its num_blocks (B, H, q_blocks), "
            f"got {tuple(idx.shape)} and {tuple(num.shape)}; index a BlockMask only by slicing, "
            "keeping its 4 dims"
        )
    bm_b, bm_h, bm_rows, _ = idx.shape
    if bm_b not in (1, batch):
        raise ValueError(f"block_mask has batch size {bm_b}, which must be 1 or the inputs' batch size {batch}")
    if bm_h not in (1, heads):
        raise ValueError(f"block_mask has {bm_h} heads, which must be 1 or the inputs' number of query heads {heads}")
    if bm_rows < rows:
        raise ValueError(
            f"block_mask.{name} has {bm_rows} query-block rows, fewer than the {rows} the sequence "
            "length needs"
        )
    if idx.is_floating_point() or num.is_floating_point() or idx.dtype == torch.bool:
        raise ValueError(f"block_mask.{name} and its num_blocks must be integer tensors, got {idx.dtype}, {num.dtype}")


def _dense(num: torch.Tensor, idx: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Scatter the first num entries of each index row into a (.., cols) bool table.

    Unlisted slots (and out-of-range indices, which the kernel would read as garbage) go to an
    extra padding column that is dropped, so nothing depends on tensor values (dynamo fullgraph).
    """
    idx = idx[:, :, :rows].long()
    slot = torch.arange(idx.shape[-1], device=idx.device)
    listed = (slot < num[:, :, :rows, None]) & (idx >= 0) & (idx < cols)
    col = torch.where(listed, idx, cols)
    table = torch.zeros((*idx.shape[:3], cols + 1), dtype=torch.int8, device=idx.device)
    table = table.scatter(-1, col, 1)
    return table[..., :cols] != 0


def _unwrapped(mask_mod: Any) -> Any:
    """The function inside torch's pytree wrapper of a BlockMask's mask_mod (else mask_mod)."""
    return getattr(mask_mod, "fn", mask_mod) if type(mask_mod).__name__ == "_MaskModWrapper" else mask_mod


def mask_mod_of(block_mask: BlockMask) -> MaskMod | None:
    """The mask_mod `block_tables` gives: the BlockMask's own function, None for torch's no-op.

    Example:
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        >>> mask_mod_of(create_block_mask(causal, None, None, 64, 64, device="cpu")) is causal
        True
    """
    mask_mod = _unwrapped(block_mask.mask_mod)
    return None if mask_mod is _flex.noop_mask else mask_mod


def block_tables(block_mask: BlockMask, batch: int, heads: int, q_len: int, kv_len: int) -> BlockTables:
    """Validate `block_mask` for inputs (batch, heads [query heads], q_len, kv_len) and densify its lists.

    Raises TypeError for a non-BlockMask, ValueError where it doesn't fit (flex_attention's
    seq_lengths rule: lengths must equal `block_mask.seq_lengths`; batch / heads 1 or equal; enough
    query-block rows), RuntimeError for a sliced BlockMask whose mask_mod torch replaced by an error
    stub (as flex_attention does). Only shapes and attributes are inspected, never tensor values,
    so this traces under torch.compile(fullgraph=True); nothing is cached (the caller does). The
    caller checks that the tables' device is the inputs' (flex_attention raises RuntimeError).
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a torch.nn.attention.flex_attention.BlockMask, got {type(block_mask).__name__}")
    mask_mod = _unwrapped(block_mask.mask_mod)
    if _SLICED_MASK_MOD is not None and mask_mod is _SLICED_MASK_MOD:
        raise RuntimeError(
            "Cannot use mask_mod from a sliced BlockMask: set block_mask.mask_mod from the original BlockMask's "
            "mask_mod (shifted to the slice) first"
        )
    q_block, kv_block = (int(s) for s in block_mask.BLOCK_SIZE)
    if q_block <= 0 or kv_block <= 0:
        raise ValueError(f"block_mask.BLOCK_SIZE must be positive, got {tuple(block_mask.BLOCK_SIZE)}")
    _check_lengths(block_mask, q_len, kv_len)
    rows, cols = _cdiv(q_len, q_block), _cdiv(kv_len, kv_block)
    num, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    _check_lists("kv_indices", num, idx, batch, heads, rows)
    partial = _dense(num, idx, rows, cols)
    full = None
    if block_mask.full_kv_num_blocks is not None and block_mask.full_kv_indices is not None:
        fnum, fidx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
        _check_lists("full_kv_indices", fnum, fidx, batch, heads, rows)
        if tuple(fidx.shape[:2]) != tuple(idx.shape[:2]):
            raise ValueError(
                f"block_mask.full_kv_indices has batch/heads {tuple(fidx.shape[:2])} but kv_indices "
                f"{tuple(idx.shape[:2])}; the kernel indexes both with the partial lists' sizes"
            )
        full = _dense(fnum, fidx, rows, cols)
    if mask_mod is _flex.noop_mask:
        mask_mod = None
    return BlockTables(partial, full, q_block, kv_block, mask_mod)


def visible(partial: Any, full: Any | None, q_block: int, kv_block: int, user_keep: Any,
            b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """The keep condition `full[..] | (partial[..] & user_keep)` at (b, h, q_idx, kv_idx).

    `partial` / `full` are the tables (torch tensors captured by a traced mask_mod, or symbolic
    tensors); `user_keep` is the BlockMask mask_mod's result at these indices, or None / True.
    The index arguments are what a FlexAttention mask_mod receives (nf's symbolic tensors, or
    torch's under vmap). A table dim of size 1 is read at index 0 (broadcast); an int 0, not
    `b * 0`, since nf's gather takes ints for fixed positions.
    """
    bb = 0 if partial.shape[0] == 1 else b
    hh = 0 if partial.shape[1] == 1 else h
    qb, kb = q_idx // q_block, kv_idx // kv_block
    keep = partial[bb, hh, qb, kb]
    if user_keep is not None and user_keep is not True:
        keep = keep & user_keep
    if full is not None:
        keep = full[bb, hh, qb, kb] | keep
    return keep


def as_mask_mod(tables: BlockTables) -> MaskMod:
    """A FlexAttention mask_mod honouring the whole BlockMask: tables plus its own mask_mod in partial blocks.

    A closure over the tables (and the user's mask_mod), so nf captures the tables as kernel
    inputs and a new closure from new tables of the same shapes reuses the compiled kernel.
    """
    partial, full, q_block, kv_block, user = (tables.partial, tables.full, tables.q_block, tables.kv_block,
                                              tables.mask_mod)

    def block_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        keep = user(b, h, q_idx, kv_idx) if user is not None else None
        return visible(partial, full, q_block, kv_block, keep, b, h, q_idx, kv_idx)

    return block_mask_mod


def implied_by_mask_mod(tables: BlockTables, batch: int, heads: int, q_len: int, kv_len: int) -> bool:
    """Whether the tables add nothing to their mask_mod: `visible(...)` is mask_mod everywhere.

    True iff, at every (b, h) of inputs with `batch` entries and `heads` query heads, each full
    block holds no position mask_mod masks and each block neither full nor partial holds no
    position it keeps (partial blocks may hold anything; positions past q_len / kv_len don't
    exist). mask_mod is evaluated with torch ops on the tables' device (on broadcast index tensors,
    or vmapped as `create_mask` does where that fails), about 32M positions at a time, at a single b (h) where its value cannot depend on b (h).
    The answer is False, which is always safe, where mask_mod fails to evaluate or the evaluation
    would exceed 2**34 positions. Reads tensor values: not for torch.compile; cache the answer.

    Example:
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        >>> bm = create_block_mask(causal, None, None, 128, 128, device="cpu", BLOCK_SIZE=64)
        >>> implied_by_mask_mod(block_tables(bm, 2, 4, 128, 128), 2, 4, 128, 128)
        True
        >>> skip = BlockMask.from_kv_blocks(torch.tensor([[[1, 1]]]), torch.tensor([[[[0, 1], [0, 1]]]]),
        ...                                 BLOCK_SIZE=64, seq_lengths=(128, 128), mask_mod=causal)
        >>> implied_by_mask_mod(block_tables(skip, 2, 4, 128, 128), 2, 4, 128, 128)  # (1, 1) skipped
        False
    """
    partial, full = tables.partial, tables.full
    listed = partial if full is None else partial | full
    if tables.mask_mod is None:  # the no-op mask_mod keeps everything: only a grid listed whole adds nothing
        return bool(listed.all())
    if q_len == 0 or kv_len == 0:
        return True
    qb, kb = min(tables.q_block, q_len), min(tables.kv_block, kv_len)  # one block spans a shorter sequence
    try:
        with torch.no_grad():
            by_b, by_h, broadcasts = _varies(tables.mask_mod, batch, heads, q_len, kv_len, partial.device)
            nb, nh = (batch if by_b else 1), (heads if by_h else 1)
            if nb * nh * q_len * kv_len > _MAX_POSITIONS:
                return False
            for box in _boxes(nb, nh, partial.shape[2], partial.shape[3], qb, kb):
                if not _box_implied(tables.mask_mod, listed, full, box, qb, kb, q_len, kv_len, by_b, by_h,
                                    broadcasts):
                    return False
    except Exception:  # noqa: BLE001 - a mask_mod torch cannot evaluate eagerly: the tables stay
        return False
    return True


def _varies(mask_mod: MaskMod, batch: int, heads: int, q_len: int, kv_len: int,
            device: torch.device) -> tuple[bool, bool, bool]:
    """Whether mask_mod's value may differ between batch entries / between heads, and whether it
    evaluates on broadcast index tensors as create_mask evaluates it (point by point).

    create_mask vmaps over b and h; a result vmap never batched over one of them comes back
    expanded along it (stride 0). Then no operation read that index, whatever the others are (no
    Python code sees a vmapped index's value, so every evaluation runs the same operations), and
    one value of it stands for all. Evaluated at two values of each (where the inputs have them),
    on a corner of up to 16 x 16 positions, where the broadcast evaluation must agree with it.
    """
    nb, nh, nq, nk = min(batch, 2), min(heads, 2), min(q_len, 16), min(kv_len, 16)
    keep = create_mask(mask_mod, nb, nh, nq, nk, device=device)
    if tuple(keep.shape) != (nb, nh, nq, nk):
        raise ValueError(f"mask_mod returned a value of shape {tuple(keep.shape[4:])}, not a scalar")
    try:
        broadcast = _broadcast(mask_mod, (0, nb), (0, nh), (0, nq), (0, nk), device)
        broadcasts = broadcast is not None and torch.equal(broadcast, keep)
    except Exception:  # noqa: BLE001 - an op that needs scalar indices: vmap gives it them
        broadcasts = False
    return nb > 1 and keep.stride(0) != 0, nh > 1 and keep.stride(1) != 0, broadcasts


Box = tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]


def _boxes(nb: int, nh: int, rows: int, cols: int, qb: int, kb: int) -> list[Box]:
    """Boxes (b, h, query-block rows, key-block columns; each a half-open range) covering the grid,
    each of at most _CHUNK_POSITIONS positions where one block allows: all of b and h at once
    where a whole block row of them fits, else one (b, h) at a time."""
    row = qb * kb * cols  # the positions of one block row of one (b, h)
    whole = nb * nh * row <= _CHUNK_POSITIONS
    bhs = [((0, nb), (0, nh))] if whole else [((b, b + 1), (h, h + 1)) for b in range(nb) for h in range(nh)]
    col_step = cols if row <= _CHUNK_POSITIONS else max(1, _CHUNK_POSITIONS // (qb * kb))
    row_step = max(1, _CHUNK_POSITIONS // ((nb * nh if whole else 1) * qb * kb * col_step))
    return [(b, h, (r, min(rows, r + row_step)), (c, min(cols, c + col_step)))
            for b, h in bhs for r in range(0, rows, row_step) for c in range(0, cols, col_step)]


def _offset(mask_mod: MaskMod, b0: int, h0: int, q0: int, kv0: int) -> MaskMod:
    """mask_mod read from (b0, h0, q0, kv0) on: create_mask of it evaluates a box of the grid."""
    if not (b0 or h0 or q0 or kv0):
        return mask_mod

    def shifted(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mask_mod(b + b0, h + h0, q_idx + q0, kv_idx + kv0)

    return shifted


def _broadcast(mask_mod: MaskMod, b: tuple[int, int], h: tuple[int, int], q: tuple[int, int],
               kv: tuple[int, int], device: torch.device) -> torch.Tensor | None:
    """mask_mod over a box of the grid, (b, h, q, kv) each a half-open range, its element-wise torch
    ops applied to broadcast index tensors (as nf traces a mask_mod: point by point): a few passes
    over the box. None where the result is not a tensor of at most the box's dims."""
    shape = (b[1] - b[0], h[1] - h[0], q[1] - q[0], kv[1] - kv[0])
    axes = [torch.arange(lo, hi, device=device).view([-1 if d == i else 1 for d in range(4)])
            for i, (lo, hi) in enumerate((b, h, q, kv))]
    keep = mask_mod(*axes)
    return keep.expand(shape) if isinstance(keep, torch.Tensor) and keep.dim() <= 4 else None


def _evaluate(mask_mod: MaskMod, b: tuple[int, int], h: tuple[int, int], q: tuple[int, int], kv: tuple[int, int],
              device: torch.device, broadcasts: bool) -> torch.Tensor:
    """mask_mod over a box of the grid: on broadcast index tensors where `_varies` found that
    agrees with `create_mask`'s vmap, whose fixed cost per call is milliseconds (for a mask
    indexing a captured tensor); else through create_mask."""
    if broadcasts:
        keep = _broadcast(mask_mod, b, h, q, kv, device)
        if keep is not None:
            return keep
    shape = (b[1] - b[0], h[1] - h[0], q[1] - q[0], kv[1] - kv[0])
    return create_mask(_offset(mask_mod, b[0], h[0], q[0], kv[0]), *shape, device=device)


def _box_implied(mask_mod: MaskMod, listed: torch.Tensor, full: torch.Tensor | None, box: Box, qb: int, kb: int,
                 q_len: int, kv_len: int, by_b: bool, by_h: bool,
                 broadcasts: bool) -> bool:
    """`implied_by_mask_mod` on one box: which blocks hold a kept / a masked position, against the
    tables (broadcast over b / h where mask_mod cannot depend on them or the tables don't)."""
    (b0, b1), (h0, h1), (r0, r1), (c0, c1) = box
    q0, q1, k0, k1 = r0 * qb, min(q_len, r1 * qb), c0 * kb, min(kv_len, c1 * kb)
    keep = _evaluate(mask_mod, (b0, b1), (h0, h1), (q0, q1), (k0, k1), listed.device, broadcasts)
    if keep.dtype != torch.bool:
        raise TypeError(f"mask_mod must return a boolean, got {keep.dtype}")
    pad = (0, (c1 - c0) * kb - (k1 - k0), 0, (r1 - r0) * qb - (q1 - q0))

    def per_block(reduce: Callable[..., torch.Tensor], fill: int) -> torch.Tensor:
        # as bytes: amax / amin over bytes run far faster than any / all over bools on the CPU;
        # `fill` pads the positions that don't exist, so they decide nothing
        x = keep.view(torch.uint8)
        if pad != (0, 0, 0, 0):
            x = torch.nn.functional.pad(x, pad, value=fill)
        return reduce(x.reshape(b1 - b0, h1 - h0, r1 - r0, qb, c1 - c0, kb), dim=(3, 5)) != 0

    bs = slice(b0, b1) if by_b and listed.shape[0] > 1 else slice(None)
    hs = slice(h0, h1) if by_h and listed.shape[1] > 1 else slice(None)
    bad = ~listed[bs, hs, r0:r1, c0:c1] & per_block(torch.amax, 0)  # an unlisted block with a kept position
    if full is not None:
        bad |= full[bs, hs, r0:r1, c0:c1] & ~per_block(torch.amin, 1)  # a full block with a masked one
    return not bool(bad.any())
