"""Scheduling templates: how a fused program is mapped to GPU programs.

`flash` rolls the fused reductions along the key axis inside each program (one
program per tile of rows): FlashAttention. `split_k` also splits the key axis over
programs and merges partial states: FlashDecoding. `auto` picks from the shapes.

Example:
    >>> import neptune_fusion as nf
    >>> nf.flash(block_q=128, block_k=64)
    Flash(block_q=128, block_k=64, num_warps=None, num_stages=None, prefetch_dot=None)
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_int(name: str, value: object) -> None:
    """A tunable that must be a Python int (or None: chosen from the shapes)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")


def _check_flag(name: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool or None, got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class Flash:
    """Rolling update along the reduced axis; one program per `block_q` rows.

    Unset fields are chosen from the shapes (see `schedule.auto.choose`).
    """

    block_q: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    prefetch_dot: bool | None = None  # issue each loop's first dot one tile ahead (tile/pipeline.py)

    def __post_init__(self) -> None:
        for name in ("block_q", "block_k", "num_warps", "num_stages"):
            _check_int(name, getattr(self, name))
        _check_flag("prefetch_dot", self.prefetch_dot)
        for name in ("block_q", "block_k"):
            v = getattr(self, name)
            if v is not None and (v < 16 or v & (v - 1)):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if self.num_stages is not None and not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in 1..8, got {self.num_stages}")


@dataclass(frozen=True)
class SplitK:
    """Split the reduced axis into `splits` chunks run by different programs, then combine.

    Within a chunk the reductions roll as in `Flash`. `splits=None` picks from the shapes.
    """

    splits: int | None = None
    block_q: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    prefetch_dot: bool | None = None

    def __post_init__(self) -> None:
        _check_int("splits", self.splits)
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"splits must be >= 1, got {self.splits}")
        Flash(self.block_q, self.block_k, self.num_warps, self.num_stages, self.prefetch_dot)


@dataclass(frozen=True)
class Auto:
    """Pick `Flash` or `SplitK` and their parameters from the shapes at the first call."""


@dataclass(frozen=True)
class Autotune:
    """Time a few plans around `base`'s choice at the first call for each shape; keep the fastest.

    Choices are remembered on disk (next to the kernel cache), keyed by program, shapes, dtypes
    and GPU, so a later process does not tune again. Candidates whose output disagrees with the
    untuned plan's are discarded, never used.
    """

    base: Flash | SplitK | Auto = Auto()
    max_candidates: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.base, (Flash, SplitK, Auto)):
            raise TypeError(f"base must be nf.flash(), nf.split_k() or nf.auto(), got {type(self.base).__name__}")
        if not isinstance(self.max_candidates, int) or isinstance(self.max_candidates, bool):
            raise TypeError(f"max_candidates must be an int, got {type(self.max_candidates).__name__}")
        if self.max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {self.max_candidates}")


Schedule = Flash | SplitK | Auto | Autotune


def flash(block_q: int | None = None, block_k: int | None = None, num_warps: int | None = None,
          num_stages: int | None = None, prefetch_dot: bool | None = None) -> Flash:
    """The FlashAttention template: rolling update along the reduced axis.

    `prefetch_dot=True` software-pipelines the loop: the first dot of tile j+1 (the scores) is
    issued before the rest of tile j, so the tensor cores work during the softmax.

    Example:
        >>> flash(block_q=128, block_k=64, prefetch_dot=True).block_k
        64
    """
    return Flash(block_q, block_k, num_warps, num_stages, prefetch_dot)


def split_k(splits: int | None = None, block_q: int | None = None, block_k: int | None = None,
            num_warps: int | None = None, num_stages: int | None = None, prefetch_dot: bool | None = None) -> SplitK:
    """The FlashDecoding template: split the reduced axis over programs, merge with repairs."""
    return SplitK(splits, block_q, block_k, num_warps, num_stages, prefetch_dot)


def autotune(base: Flash | SplitK | Auto | None = None, max_candidates: int = 8) -> Autotune:
    """Tune the plan by timing candidates at the first call for each shape (see `Autotune`)."""
    return Autotune(base or Auto(), max_candidates)


def auto() -> Auto:
    """Choose the template from the shapes at the first call."""
    return Auto()
