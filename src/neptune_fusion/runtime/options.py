"""Every switch of a compilation in one value, read once per compile from the environment.

The driver (`Compiled.executable_for`) reads an `Options` at its start, unless the function was
given one (`Compiled(..., options=)`), and hands it down; no stage below reads the environment.
The switches' effects are recorded in the kernel's plan (`KernelPlan`: the backend setting, which
inputs load through tensor descriptors, the grid's grouping), which is the executable's cache key.
They are read per compile, not per launch: a call layout already compiled keeps the launcher it
was built with (the repeated call's host path reads nothing), so set them before the first call,
or pass `options=`.

Example:
    >>> Options.from_environment({"NEPTUNE_FUSION_BACKEND": "triton", "NEPTUNE_FUSION_GRID_GROUP": "2"})
    Options(interpreter=False, backend='triton', tma='auto', grid_group=2)
    >>> Options.from_environment({"NEPTUNE_FUSION_TMA": "yes"})
    Traceback (most recent call last):
    ...
    ValueError: NEPTUNE_FUSION_TMA must be auto, 0 or force, got 'yes'
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

BACKENDS = ("auto", "triton", "gluon")
TMA_SETTINGS = ("auto", "0", "force")


@dataclass(frozen=True)
class Options:
    """The switches: `interpreter` (TRITON_INTERPRET=1: kernels run in Triton's interpreter),
    `backend` (NEPTUNE_FUSION_BACKEND: "auto" takes Gluon where it can print the kernel, "triton",
    or "gluon", which raises where it cannot), `tma` (NEPTUNE_FUSION_TMA: "auto" reads aligned
    tiles through tensor descriptors on Hopper, "0" never, "force" also in the interpreter) and
    `grid_group` (NEPTUNE_FUSION_GRID_GROUP=N: N heads walk their row tiles interleaved; None:
    derived from the shapes); `cache_dir` (NEPTUNE_FUSION_CACHE_DIR: where generated kernel
    sources and tuning results are kept; empty: ~/.cache/neptune_fusion)."""

    interpreter: bool = False
    backend: str = "auto"
    tma: str = "auto"
    grid_group: int | None = None
    cache_dir: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"NEPTUNE_FUSION_BACKEND must be {', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}, "
                             f"got {self.backend!r}")
        if self.tma not in TMA_SETTINGS:
            raise ValueError(f"NEPTUNE_FUSION_TMA must be {', '.join(TMA_SETTINGS[:-1])} or {TMA_SETTINGS[-1]}, "
                             f"got {self.tma!r}")
        if self.grid_group is not None and self.grid_group < 1:
            raise ValueError(f"NEPTUNE_FUSION_GRID_GROUP must be a positive integer, got {self.grid_group}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Options:
        """The switches as the environment (`os.environ` unless given) sets them."""
        env = os.environ if environ is None else environ
        group = env.get("NEPTUNE_FUSION_GRID_GROUP") or None
        if group is not None and not group.strip().isdigit():
            raise ValueError(f"NEPTUNE_FUSION_GRID_GROUP must be a positive integer, got {group!r}")
        return cls(interpreter=env.get("TRITON_INTERPRET", "0") == "1",
                   backend=env.get("NEPTUNE_FUSION_BACKEND", "auto"),
                   tma=env.get("NEPTUNE_FUSION_TMA", "auto"),
                   grid_group=None if group is None else int(group),
                   cache_dir=env.get("NEPTUNE_FUSION_CACHE_DIR", ""))

    def kernel_directory(self) -> Path:
        """`cache_dir` (or the default), created if missing."""
        path = Path(self.cache_dir) if self.cache_dir else Path.home() / ".cache" / "neptune_fusion"
        path.mkdir(parents=True, exist_ok=True)
        return path


__all__ = ["Options"]
