"""Programs: a DAG of stages over named axes.

A `Stage` writes one buffer over its spatial `axes`; its body is a scalar `Expr`
(a `Reduce` at the top makes it a reduction). A `FusedLoop` is what the fusion
transforms produce: several reductions along one axis computed in one loop,
each with the repair function that corrects its accumulator when a running
value it depends on changes.

Example:
    >>> from neptune_fusion.ir.expr import Index, Load, Reduce
    >>> st = Stage("m", ("i",), Reduce("max", "j", Load("x", (Index("i"), Index("j")))))
    >>> st.reduce_op
    'max'
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Union

from neptune_fusion.ir.expr import Expr, Reduce, loads_of


@dataclass(frozen=True)
class InputBuffer:
    """A tensor argument. `dims` names the axis each dimension indexes (None: broadcast size 1)."""

    name: str
    dims: tuple[str | None, ...]
    kind: str = "float"  # "float" | "int" | "bool"


@dataclass(frozen=True)
class Stage:
    """`name[axes] = body`, where the body may be a `Reduce` over one more axis."""

    name: str
    axes: tuple[str, ...]
    body: Expr

    @property
    def reduce_op(self) -> str | None:
        return self.body.op if isinstance(self.body, Reduce) else None

    @property
    def reduce_axis(self) -> str | None:
        return self.body.axis if isinstance(self.body, Reduce) else None

    def reads(self) -> set[str]:
        return loads_of(self.body)


@dataclass(frozen=True)
class FusedLoop:
    """Reductions along `axis` fused into one loop with repair terms.

    mode "rolling": one pass over the axis; members read the *running* values of
    earlier members and repair their accumulators with `repairs[name]`.
    mode "split_k": the axis is cut into `splits` chunks, each computed as a
    rolling loop into private partial states, merged by the same repairs.
    """

    name: str
    axis: str
    members: tuple[Stage, ...]
    producers: dict[str, tuple[str, ...]]
    repairs: dict[str, Expr | None]
    mode: str = "rolling"
    splits: int = 1

    def member(self, name: str) -> Stage:
        for st in self.members:
            if st.name == name:
                return st
        raise KeyError(name)

    def reads(self) -> set[str]:
        names = {m.name for m in self.members}
        out: set[str] = set()
        for m in self.members:
            out |= m.reads()
        return out - names

    def __hash__(self) -> int:
        return hash((self.name, self.axis, self.members, self.mode, self.splits))


Node = Union[Stage, FusedLoop]


def axis_sources(inputs: tuple[InputBuffer, ...] | list[InputBuffer]) -> dict[str, tuple[str, int]]:
    """For each axis the inputs name, the first (input, dimension) giving its size.

    Example:
        >>> axis_sources([InputBuffer("x", ("i", None)), InputBuffer("y", ("j", "i"))])
        {'i': ('x', 0), 'j': ('y', 0)}
    """
    sources: dict[str, tuple[str, int]] = {}
    for buf in inputs:
        for pos, axis in enumerate(buf.dims):
            if axis is not None:
                sources.setdefault(axis, (buf.name, pos))
    return sources


@dataclass(frozen=True)
class OutputSpec:
    """An output: the stage it comes from and the dims of the returned tensor (None: size 1)."""

    stage: str
    dims: tuple[str | None, ...]
    view: tuple[str | None, ...] | None = None  # dims of the returned tensor when a layout transform changed `dims`


@dataclass
class Program:
    """A whole program: inputs, scalar parameters, stages in topological order, outputs."""

    name: str
    inputs: tuple[InputBuffer, ...]
    params: tuple[str, ...]
    stages: tuple[Node, ...]
    outputs: tuple[OutputSpec, ...]
    axis_sizes: dict[str, tuple[str, int]] = field(default_factory=dict)
    param_kinds: dict[str, str] = field(default_factory=dict)
    derived_axes: dict[str, tuple[str, object, object]] = field(default_factory=dict)
    # the axis the main fused loop runs over, where a transform decided it (a backward's kernel
    # loops over queries or keys; its head-dim contractions tie with it as chains)
    loop_axis: str | None = None
    _fingerprint: str | None = field(default=None, init=False, repr=False, compare=False)

    def stage(self, name: str) -> Stage:
        for node in self.stages:
            if isinstance(node, Stage) and node.name == name:
                return node
            if isinstance(node, FusedLoop):
                for m in node.members:
                    if m.name == name:
                        return m
        raise KeyError(f"program {self.name!r} has no stage {name!r}")

    def input(self, name: str) -> InputBuffer:
        for buf in self.inputs:
            if buf.name == name:
                return buf
        raise KeyError(f"program {self.name!r} has no input {name!r}")

    def all_stages(self) -> list[Stage]:
        out: list[Stage] = []
        for node in self.stages:
            out.extend(node.members if isinstance(node, FusedLoop) else (node,))
        return out

    def producer_of(self, name: str) -> Node | None:
        for node in self.stages:
            if isinstance(node, Stage) and node.name == name:
                return node
            if isinstance(node, FusedLoop) and any(m.name == name for m in node.members):
                return node
        return None

    def consumers(self, name: str) -> list[Node]:
        return [n for n in self.stages if name in n.reads()]

    def holds_as_large(self, axes: tuple[str, ...] | list[str] | set[str]) -> bool:
        """Whether an input or output of the program spans all of `axes`: a value over them costs
        no more memory than a tensor the program already holds.

        Example:
            >>> prog = Program("p", (InputBuffer("x", ("i", "j")),), (), (), ())
            >>> prog.holds_as_large(("i",)), prog.holds_as_large(("i", "k"))
            (True, False)
        """
        tensors = [b.dims for b in self.inputs] + [o.dims for o in self.outputs]
        return any(set(axes) <= set(dims) - {None} for dims in tensors)

    def with_stages(self, stages: list[Node] | tuple[Node, ...]) -> Program:
        return replace(self, stages=tuple(stages))

    def fingerprint(self) -> str:
        """A stable hash of the program's structure (used as the cache key; computed once)."""
        from neptune_fusion.ir.printer import format_program

        if self._fingerprint is not None:
            return self._fingerprint
        text = format_program(self) + repr(self.axis_sizes) + repr(self.inputs) + repr(self.derived_axes)
        text += repr([(o.dims, o.view) for o in self.outputs])
        # kernels specialise on them: an int parameter is an i32 argument (integer loop bounds)
        text += repr(sorted(self.param_kinds.items())) + repr(self.loop_axis)
        self._fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
        return self._fingerprint

    def validate(self) -> None:
        """Check names resolve and stages come after what they read."""
        known = {b.name for b in self.inputs}
        for node in self.stages:
            missing = node.reads() - known
            if missing:
                raise ValueError(f"stage {node.name!r} reads {sorted(missing)} before they are defined")
            known |= {m.name for m in node.members} if isinstance(node, FusedLoop) else {node.name}
        for out in self.outputs:
            if out.stage not in known:
                raise ValueError(f"output {out.stage!r} is not a stage")
