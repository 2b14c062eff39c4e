"""Errors of the compiler, each naming where and why it gave up."""

from __future__ import annotations


class FusionError(Exception):
    """A program the compiler cannot fuse; the message names the stage, reduction and condition.

    Example:
        >>> raise FusionError("repair derivation", "sum0", "sum over k", "the map is not separable")
        Traceback (most recent call last):
        ...
        neptune_fusion.ir.errors.FusionError: [repair derivation] stage 'sum0' (sum over k): the map is not separable
    """

    def __init__(self, pass_name: str, stage: str, reduction: str, condition: str) -> None:
        self.pass_name = pass_name
        self.stage = stage
        self.reduction = reduction
        self.condition = condition
        super().__init__(f"[{pass_name}] stage {stage!r} ({reduction}): {condition}")


class UnsupportedProgramError(FusionError):
    """The fused program has a shape the tile lowering or code generator does not handle."""
