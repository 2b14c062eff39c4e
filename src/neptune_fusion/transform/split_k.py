"""Split-K update: parallelism along the reduction axis (Program -> Program).

The axis is cut into `splits` chunks; each chunk computes private partial states of
every member with a rolling loop, and a combine step merges them with the same
derived repair functions: for attention `M = max_c M_c`, `L = sum_c L_c exp(M_c - M)`,
`U = sum_c U_c exp(M_c - M)`. This is FlashDecoding.

Example:
    >>> import torch
    >>> from neptune_fusion.ir.printer import format_program
    >>> from neptune_fusion.library import attention
    >>> from neptune_fusion.transform.inline import inline_along, inline_elementwise
    >>> from neptune_fusion.transform.rolling import rolling_update
    >>> q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 64, 8)   # decode: one query, 64 keys
    >>> fused = rolling_update(inline_along(inline_elementwise(attention.trace(q, k, k, 0.5)), "k"), "k")
    >>> format_program(split_k_update(fused, "k", splits=8)).splitlines()[1]
    '  split_k loop over k in 8 chunks (private partial states, merged by the repairs):'
"""

from __future__ import annotations

from neptune_fusion.ir.errors import FusionError
from neptune_fusion.ir.program import FusedLoop, Node, Program


def split_k_update(program: Program, axis: str, splits: int) -> Program:
    """Turn the rolling loop over `axis` into a split-K loop with `splits` chunks."""
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    stages: list[Node] = []
    found = False
    for node in program.stages:
        if isinstance(node, FusedLoop) and node.axis == axis:
            found = True
            node = FusedLoop(node.name, node.axis, node.members, node.producers, node.repairs, "split_k", splits)
        stages.append(node)
    if not found:
        raise FusionError("split-k update", "-", f"loop over {axis}", "no fused loop over this axis (run rolling_update first)")
    return program.with_stages(stages)
