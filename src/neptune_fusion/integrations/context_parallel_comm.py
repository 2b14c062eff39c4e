"""Context parallelism, the process group side: checks, the small collectives, shard and gather.

`context_parallel_shard` cuts a full tensor into this rank's shard (the layout of
`context_parallel_plan.py`), `context_parallel_gather` puts the shards back together on every
rank. The checks raise before any communication; where the ranks must agree, one small
all-gather of integers lets every rank raise the same ValueError instead of some hanging.

Example:
    >>> shard_offsets(((0, 3), (3, 5), (5, 7), (7, 9)), world=2, rank=0, load_balance="zigzag")
    [(0, 0, 3), (3, 3, 5)]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from neptune_fusion.integrations.context_parallel_plan import (
    Bounds,
    check_load_balance,
    chunk_bounds,
    chunk_count,
    rank_chunks,
    shard_length,
)

__all__ = ["context_parallel_gather", "context_parallel_shard"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_OTHER_DTYPES = (torch.float64, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
                 torch.complex64, torch.complex128)
_MAX_DIMS = 16


def _dtype_code(dtype: torch.dtype) -> int:
    """A number naming `dtype` the same way on every rank (one code for all dtypes not listed)."""
    known = DTYPES + _OTHER_DTYPES
    return known.index(dtype) if dtype in known else len(known)


# --------------------------------------------------------------------------- checks


def group_of(group: Any) -> tuple[Any, int, int]:
    """(the group, this rank's index in it, its size); raises where torch.distributed is not set up."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("torch.distributed is not initialised: call torch.distributed.init_process_group(...) "
                         "on every rank first")
    if group is None:
        group = dist.group.WORLD
    elif not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given group")
    return group, rank, dist.get_world_size(group)


def seq_dim_of(x: Any, seq_dim: Any, name: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise TypeError(f"seq_dim must be an int, got {type(seq_dim).__name__}")
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim={seq_dim} is out of range for {name} of shape {tuple(x.shape)}")
    return seq_dim % x.dim()


def all_gather_ints(values: list[int], device: torch.device, group: Any, world: int) -> list[list[int]]:
    """Every rank's `values` (one small int64 collective)."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def agree(rows: list[list[int]], names: tuple[str, ...], what: str) -> None:
    """Raise the same ValueError on every rank where the ranks disagree on a field."""
    for i, name in enumerate(names):
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            raise ValueError(f"{what}: the ranks disagree on {name}: {values} (rank by rank)")


def check_lengths(lengths: list[int], world: int, load_balance: str | None, what: str) -> int:
    """The global length the shards add up to; each shard must be the one the layout gives its rank."""
    total = sum(lengths)
    for r, n in enumerate(lengths):
        expected = shard_length(total, world, r, load_balance)
        if n != expected:
            raise ValueError(
                f"{what}: rank {r} holds {n} positions, but load_balance={load_balance!r} gives it {expected} of a "
                f"sequence of {total} ({lengths} rank by rank); shard with nf.context_parallel_shard(x, "
                f"load_balance={load_balance!r})")
    return total


def shard_offsets(bounds: Bounds, world: int, rank: int, load_balance: str | None) -> list[tuple[int, int, int]]:
    """(chunk id, start in the rank's shard, stop in the rank's shard) of each chunk the rank holds."""
    out, start = [], 0
    for c in rank_chunks(world, rank, load_balance):
        n = bounds[c][1] - bounds[c][0]
        out.append((c, start, start + n))
        start += n
    return out


# --------------------------------------------------------------------------- shard / gather


def context_parallel_shard(x: torch.Tensor, seq_dim: int = 2, group: Any = None,
                           load_balance: str | None = "zigzag") -> torch.Tensor:
    """This rank's shard of the full tensor `x` along `seq_dim`, in the layout the balancing uses.

    Every rank passes the same full tensor; no communication. With "zigzag" rank r gets chunks r
    and 2 * world - 1 - r of 2 * world, with None chunk r of world (the first `len % chunks`
    chunks one longer). Returns a new contiguous tensor.

    Example (on rank 0 of a group of 2, as in examples/context_parallel.py; rank 1 gets 3..7):
        >>> x = torch.arange(10).view(1, 1, 10, 1)                # doctest: +SKIP
        >>> nf.context_parallel_shard(x).flatten().tolist()       # doctest: +SKIP
        [0, 1, 2, 8, 9]
    """
    dim = seq_dim_of(x, seq_dim, "x")
    check_load_balance(load_balance)
    _, rank, world = group_of(group)
    bounds = chunk_bounds(x.shape[dim], chunk_count(world, load_balance))
    pieces = [x.narrow(dim, bounds[c][0], bounds[c][1] - bounds[c][0]) for c in rank_chunks(world, rank, load_balance)]
    return torch.cat(pieces, dim=dim).contiguous()


def context_parallel_gather(x_local: torch.Tensor, seq_dim: int = 2, group: Any = None,
                            load_balance: str | None = "zigzag") -> torch.Tensor:
    """The full tensor from every rank's shard (the inverse of `context_parallel_shard`), on every rank.

    The shards may differ in length along `seq_dim` (odd totals) but must be the ones the layout
    gives each rank; every other dimension and the dtype must agree across ranks (checked: a
    ValueError on every rank, not a hang).
    """
    dim = seq_dim_of(x_local, seq_dim, "x_local")
    check_load_balance(load_balance)
    if x_local.dim() > _MAX_DIMS:
        raise ValueError(f"x_local has {x_local.dim()} dims; context_parallel_gather takes at most {_MAX_DIMS}")
    group, _, world = group_of(group)
    # every rank sends the same number of integers: the shape padded to _MAX_DIMS
    shape = [s if d != dim else 0 for d, s in enumerate(x_local.shape)]
    rows = all_gather_ints([x_local.shape[dim], x_local.dim(), dim, _dtype_code(x_local.dtype), *shape,
                            *[0] * (_MAX_DIMS - len(shape))], x_local.device, group, world)
    agree([r[1:] for r in rows], ("number of dims", "seq_dim", "dtype", *(f"size of dim {d}" for d in range(_MAX_DIMS))),
          "context_parallel_gather")
    lengths = [r[0] for r in rows]
    total = check_lengths(lengths, world, load_balance, "context_parallel_gather")
    longest = max(lengths)
    padded = x_local
    if x_local.shape[dim] < longest:
        pad_shape = list(x_local.shape)
        pad_shape[dim] = longest - x_local.shape[dim]
        padded = torch.cat([x_local, x_local.new_zeros(pad_shape)], dim=dim)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    bounds = chunk_bounds(total, chunk_count(world, load_balance))
    chunks: dict[int, torch.Tensor] = {}
    for r, part in enumerate(parts):
        for c, a, b in shard_offsets(bounds, world, r, load_balance):
            chunks[c] = part.narrow(dim, a, b - a)
    return torch.cat([chunks[c] for c in sorted(chunks)], dim=dim)
