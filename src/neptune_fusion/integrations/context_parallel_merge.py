"""Context parallelism, the merge: partial attention results combined by the compiler's own split-K combine.

The attention program's fused loop (after the rolling update) has a running max M and sums that
read it, each with its derived repair `h(t, M_old, M_new)`. `schedule.pipeline.combine_program`
turns those repairs into the program that merges split-K partial states `part_<member>[split, ..]`
and applies the program's epilogue (for attention: `M = max_c M_c`, `L = sum_c L_c exp(M_c - M)`,
`U = sum_c U_c exp(M_c - M)`, then `out = U / L` and `lse = M + log L`, 0 and -inf where M is
-inf). It is run here with the reference executor (torch ops, any device) on two partials at a
time: the running result and a new step's.

A kernel returns (out, lse), not its loop state. They are read as the state *repaired to running
max lse*: there the normaliser is 1 and the value sum is `out` (and a partial that saw no key is
the reducers' identities: -inf, 0, 0). That reading is checked once per program against the
derived combine itself: merging a partial given as its (out, lse) must equal merging it given as
its loop state (`_check_reading`); a program for which it fails raises FusionError.

Example:
    >>> import torch, neptune_fusion as nf
    >>> from neptune_fusion.schedule.pipeline import fuse
    >>> q = torch.randn(1, 1, 4, 8); k = v = torch.randn(1, 1, 6, 8)
    >>> merge = Merge(fuse(nf.attention_program(q, k, v, return_lse=True))[-1].program)
    >>> a = Partial(torch.zeros(1, 1, 4, 8), torch.full((1, 1, 4), -torch.inf))   # saw no key
    >>> b = Partial(torch.ones(1, 1, 4, 8), torch.zeros(1, 1, 4))
    >>> bool(torch.equal(merge(a, b, scale=1.0).out, b.out))
    True
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from neptune_fusion.ir.errors import FusionError
from neptune_fusion.ir.expr import REDUCER_IDENTITY
from neptune_fusion.ir.program import FusedLoop, Program
from neptune_fusion.runtime.reference import run_reference
from neptune_fusion.schedule.pipeline import combine_program


class Partial(NamedTuple):
    """A partial attention result over some of the keys: out (B, H, Lq, Ev) and lse (B, H, Lq), float32."""

    out: torch.Tensor
    lse: torch.Tensor


def _permuted(t: torch.Tensor, dims: tuple[str | None, ...], axes: tuple[str, ...]) -> torch.Tensor:
    """`t` (dims named `dims`) with its dims in the order `axes`."""
    return t.permute([dims.index(a) for a in axes])


class Merge:
    """The split-K combine of a fused attention program, as a merge of two `Partial`s."""

    def __init__(self, fused: Program) -> None:
        self.program = combine_program(fused)
        loop = next(n for n in fused.stages if isinstance(n, FusedLoop))
        self.row = fused.input("q").dims[2]
        outputs = fused.outputs
        if len(outputs) != 2:
            raise FusionError("context parallel merge", fused.name, "outputs",
                              f"needs the program's (out, lse) outputs, it has {len(outputs)}")
        self.out_dims, self.lse_dims = outputs[0].dims, outputs[1].dims
        maxes = [m for m in loop.members if m.reduce_op == "max" and not loop.producers.get(m.name)]
        sums = [m for m in loop.members if m not in maxes]
        if len(maxes) != 1 or len(sums) != 2 or any(m.reduce_op != "sum" for m in sums):
            raise FusionError("context parallel merge", loop.name, f"loop over {loop.axis}",
                              "a partial (out, lse) is read as the loop state of one running max and two sums "
                              f"(normaliser and values), but the loop has {[(m.name, m.reduce_op) for m in loop.members]}")
        self.max, = maxes
        norm = [m for m in sums if set(m.axes) == set(self.max.axes)]
        value = [m for m in sums if set(m.axes) == {a for a in self.out_dims if a is not None}]
        if len(norm) != 1 or len(value) != 1:
            raise FusionError("context parallel merge", loop.name, f"loop over {loop.axis}",
                              "cannot tell the normaliser (axes of the max) from the value sum (axes of the output)")
        self.norm, self.value = norm[0], value[0]
        self.members = (self.max, self.norm, self.value)
        missing = [b.name for b in self.program.inputs if not b.name.startswith("part_")]
        if missing:
            raise FusionError("context parallel merge", self.program.name, "inputs",
                              f"the epilogue reads {missing}, which a merge of (out, lse) pairs does not have")
        _check_reading(self)

    def state(self, p: Partial) -> dict[str, torch.Tensor]:
        """The loop state `p` stands for, repaired to running max lse (see module docstring)."""
        empty = p.lse == REDUCER_IDENTITY["max"]
        norm = torch.where(empty, REDUCER_IDENTITY["sum"], 1.0).to(torch.float32)
        return {self.max.name: _permuted(p.lse, self.lse_dims, self.max.axes),
                self.norm.name: _permuted(norm, self.lse_dims, self.norm.axes),
                self.value.name: _permuted(p.out.to(torch.float32), self.out_dims, self.value.axes)}

    def combine(self, states: list[dict[str, torch.Tensor]], params: dict[str, float]) -> Partial:
        """Run the derived combine program on loop states (one per split)."""
        args: dict[str, object] = {f"part_{m.name}": torch.stack([s[m.name] for s in states]) for m in self.members}
        out, lse = run_reference(self.program, {**args, **params})
        return Partial(out, lse)

    def __call__(self, a: Partial, b: Partial, **params: float) -> Partial:
        """a and b merged: the result over the keys of both."""
        return self.combine([self.state(a), self.state(b)], params)


def _check_reading(merge: Merge) -> None:
    """Merging a partial given as (out, lse) must equal merging its loop state: on random states
    (rows that saw no key among them), with the program's own combine as the reference."""
    gen = torch.Generator().manual_seed(0)
    sizes = {a: 3 for m in merge.members for a in m.axes}
    params = {p: 0.5 for p in merge.program.params}

    def random_state(empty_row: int) -> dict[str, torch.Tensor]:
        state = {}
        for m, low in ((merge.max, -2.0), (merge.norm, 0.5), (merge.value, -2.0)):
            t = torch.rand([sizes[a] for a in m.axes], generator=gen) * 4.0 + low
            index = [slice(None)] * t.dim()
            index[m.axes.index(merge.row)] = empty_row  # a query row that saw no key
            t[tuple(index)] = REDUCER_IDENTITY[m.reduce_op]
            state[m.name] = t
        return state

    a, b = random_state(0), random_state(1)
    reference = merge.combine([a, b], params)
    got = merge.combine([merge.state(merge.combine([a], params)), b], params)
    for name, x, y in (("out", got.out, reference.out), ("lse", got.lse, reference.lse)):
        if not torch.allclose(x, y, rtol=1e-5, atol=1e-6, equal_nan=True):
            raise FusionError("context parallel merge", merge.program.name, "reading (out, lse) as a loop state",
                              f"merging a partial given by its (out, lse) changes {name} by up to "
                              f"{(x - y).abs().nan_to_num(0).max().item():.3g} against merging its loop state")
