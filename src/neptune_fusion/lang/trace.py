"""Tracing plain Python functions over symbolic tensors into a `Program`.

Example:
    >>> import torch, neptune_fusion as nf
    >>> @nf.program
    ... def rowmax(x):
    ...     return x.max(axis=-1)
    >>> prog = rowmax.trace(torch.randn(4, 8))
    >>> [s.name for s in prog.stages]
    ['max0']
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from neptune_fusion.ir.expr import (
    Cast,
    Expr,
    Index,
    Load,
    Param,
    Reduce,
    Size,
    transform_bottom_up,
    walk,
)
from neptune_fusion.ir.program import InputBuffer, OutputSpec, Program, Stage
from neptune_fusion.lang.tensor import Dim, SymTensor, _load, input_dtype_name


@dataclass(frozen=True)
class ArgSpec:
    """What tracing needs to know about one argument: a tensor's shape and kind, or a scalar's kind."""

    name: str
    shape: tuple[int, ...] | None  # None: a scalar parameter
    kind: str  # "float" | "int" | "bool"


def spec_of(name: str, value: Any) -> ArgSpec:
    """The trace-relevant description of a runtime argument (torch tensor or Python scalar)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        try:
            dt = input_dtype_name(value.dtype)
        except TypeError as exc:
            raise TypeError(f"argument {name!r}: {exc}") from None
        kind = "bool" if dt == "bool" else ("int" if dt[0] in "iu" else "float")
        return ArgSpec(name, tuple(int(s) for s in value.shape), kind)
    if isinstance(value, bool):
        raise TypeError(f"argument {name!r}: boolean scalars are not supported; pass 0 or 1")
    if isinstance(value, int):
        return ArgSpec(name, None, "int")
    if isinstance(value, float):
        return ArgSpec(name, None, "float")
    raise TypeError(
        f"argument {name!r} has type {type(value).__name__}; expected a torch tensor or a Python number"
    )


class Tracer:
    """Collects stages while a function runs on symbolic tensors."""

    def __init__(self) -> None:
        self.stages: list[Stage] = []
        self.counts: dict[str, int] = {}
        self.inputs: list[tuple[str, tuple[Dim, ...], str]] = []
        self.memo: dict[tuple[Expr, tuple[str | None, ...]], SymTensor] = {}
        self.aliases: list[tuple[Dim, Dim]] = []  # (fresh dim, the dim whose size it has): einsum's x, x

    def fresh(self, prefix: str) -> str:
        n = self.counts.get(prefix, 0)
        self.counts[prefix] = n + 1
        return f"{prefix}{n}"

    def input(self, name: str, shape: tuple[int, ...], kind: str) -> SymTensor:
        dims = tuple(Dim(size, f"{name}.{i}") for i, size in enumerate(shape))
        self.inputs.append((name, dims, kind))
        return SymTensor(dims, _load(name, dims), self, kind)

    def stage(self, dims: tuple[Dim | None, ...], body: Expr, kind: str) -> SymTensor:
        key = (body, tuple(d.var if d is not None else None for d in dims))
        if key in self.memo:  # the same value used twice is one stage
            plain = self.memo[key]
            return SymTensor(plain.dims, plain.expr, self, plain.kind)
        real = tuple(d for d in dims if d is not None)
        if isinstance(body, Reduce):
            prefix = "dot" if isinstance(body.body, Expr) and _is_product(body.body) and body.op == "sum" else body.op
        else:
            prefix = "ew"
        name = self.fresh(prefix)
        self.stages.append(Stage(name, tuple(d.var for d in real), body))
        # the stage's buffer has its real axes only: a size-1 dim (kept by keepdims) is a broadcast.
        # The memo keeps the plain load; a use under torch.no_grad() detaches its own copy
        with torch.enable_grad():
            self.memo[key] = SymTensor(dims, _load(name, real), self, kind)
        return SymTensor(dims, _load(name, real), self, kind)

    def materialize(self, x: SymTensor) -> SymTensor:
        """Make `x` a load of a buffer (creating an elementwise stage if it is an expression)."""
        if isinstance(x.expr, Load) and _is_plain_load(x):
            return x
        return self.stage(x.dims, x.expr, x.kind)


def _is_product(expr: Expr) -> bool:
    from neptune_fusion.ir.expr import Binary

    return isinstance(expr, Binary) and expr.op == "mul"


def _is_plain_load(x: SymTensor) -> bool:
    real = [d.var for d in x.dims if d is not None]
    idx = [i.axis for i in x.expr.index if isinstance(i, Index)]  # type: ignore[attr-defined]
    return idx == real and len(idx) == len(x.expr.index)  # type: ignore[attr-defined]


def _rename_axes(expr: Expr, names: dict[str, str]) -> Expr:
    def rule(node: Expr) -> Expr | None:
        if isinstance(node, Index) and node.axis in names:
            return Index(names[node.axis])
        if isinstance(node, Size) and node.axis in names:
            return Size(names[node.axis])
        if isinstance(node, Reduce) and node.axis in names:
            return Reduce(node.op, names[node.axis], node.body)
        return None

    return transform_bottom_up(expr, rule)


def _check_reduce_axes(stage: str, axes: tuple[str, ...], body: Expr) -> None:
    """Refuse a stage that reduces over an axis it also indexes spatially (or already reduces).

    Axes are named by classes of unified dims, so this happens when two different dims of one
    tensor were identified (e.g. a square weight used as `(x @ w) @ w`); the reduction would
    then shadow the spatial index and silently compute a diagonal.
    """

    def visit(node: Expr, bound: tuple[str, ...]) -> None:
        if isinstance(node, Reduce):
            if node.axis in bound:
                raise ValueError(
                    f"stage {stage!r} reduces over axis {node.axis!r}, which it also indexes: two different "
                    f"dimensions (of equal size) were identified with each other while tracing, e.g. a square "
                    f"tensor used along both of its dimensions; this is not supported"
                )
            bound = (*bound, node.axis)
        for child in node.children():
            visit(child, bound)

    visit(body, axes)


def trace(fn: Callable[..., Any], specs: Sequence[ArgSpec], name: str | None = None) -> Program:
    """Run `fn` on symbolic tensors described by `specs` and return the traced Program."""
    with torch.enable_grad():  # the function's own torch.no_grad() blocks are what it detaches
        return _traced(fn, specs, name)


def _traced(fn: Callable[..., Any], specs: Sequence[ArgSpec], name: str | None) -> Program:
    tracer = Tracer()
    tracer.traces_gradients = True  # type: ignore[attr-defined]
    args: list[Any] = []
    params: list[str] = []
    param_kinds: dict[str, str] = {}
    for spec in specs:
        if spec.shape is None:
            params.append(spec.name)
            param_kinds[spec.name] = spec.kind
            args.append(SymTensor((), Param(spec.name), tracer, spec.kind))
        else:
            args.append(tracer.input(spec.name, spec.shape, spec.kind))
    from neptune_fusion.lang.torch_nn.factories import Factories

    with Factories(tracer):  # tensors the code makes itself (a causal mask, positions) are symbolic
        result = fn(*args)
    results = result if isinstance(result, tuple) else (result,)
    outputs: list[OutputSpec] = []
    for r in results:
        if not isinstance(r, SymTensor):
            raise TypeError(f"a traced program must return symbolic tensors, got {type(r).__name__}")
        loaded = tracer.materialize(r)
        if loaded.expr.buffer in {n for n, _, _ in tracer.inputs}:  # type: ignore[attr-defined]
            loaded = tracer.stage(loaded.dims, loaded.expr, loaded.kind)
        outputs.append(OutputSpec(loaded.expr.buffer, tuple(d.var if d else None for d in loaded.dims)))  # type: ignore[attr-defined]
    return _finalize(tracer, outputs, params, param_kinds, name or getattr(fn, "__name__", "program"))


def _finalize(
    tracer: Tracer, outputs: list[OutputSpec], params: list[str], param_kinds: dict[str, str], name: str
) -> Program:
    # Give every class of unified dims one readable name (an einsum letter where there is one).
    roots: dict[int, Dim] = {}
    all_dims: list[Dim] = []
    for _, dims, _ in tracer.inputs:
        all_dims.extend(dims)
    all_dims.extend(getattr(tracer, "extra_dims", ()))  # dims made by views (nf.repeat_interleave)
    all_dims.extend(fresh for fresh, _ in tracer.aliases)
    for d in all_dims:
        roots.setdefault(d.find().uid, d.find())
    taken: set[str] = set()
    root_name: dict[int, str] = {}
    for uid, root in roots.items():
        base = root.letters[0] if root.letters else f"a{len(root_name)}"
        cand, n = base, 2
        while cand in taken:
            cand, n = f"{base}{n}", n + 1
        taken.add(cand)
        root_name[uid] = cand
    names = {d.var: root_name[d.find().uid] for d in all_dims}

    stages = []
    for st in tracer.stages:
        axes = tuple(names[a] for a in st.axes)
        if len(set(axes)) != len(axes):
            raise ValueError(f"stage {st.name!r} indexes the same axis twice ({axes}); this is not supported")
        body = _rename_axes(st.body, names)
        _check_reduce_axes(st.name, axes, body)
        stages.append(Stage(st.name, axes, body))
    inputs = tuple(InputBuffer(n, tuple(names[d.var] for d in dims), kind) for n, dims, kind in tracer.inputs)
    axis_sizes: dict[str, tuple[str, int]] = {}
    for n, dims, _ in tracer.inputs:
        for i, d in enumerate(dims):
            axis_sizes.setdefault(names[d.var], (n, i))
    for fresh, source in tracer.aliases:
        if names[source.var] in axis_sizes:
            axis_sizes.setdefault(names[fresh.var], axis_sizes[names[source.var]])
    outs = tuple(OutputSpec(o.stage, tuple(names[d] if d else None for d in o.dims)) for o in outputs)
    # Keep only stages reachable from the outputs.
    needed = {o.stage for o in outs}
    kept: list[Stage] = []
    for st in reversed(stages):
        if st.name in needed:
            kept.append(st)
            needed |= st.reads()
    # dims of a size fixed while tracing (slices, concatenations): derived axes of that size, also
    # where they meet an input's dimension (the backward tells a slice's axis by it)
    derived = {root_name[d.find().uid]: ("const", d.find().size, None) for d in getattr(tracer, "constant_dims", ())
               if d.find().uid in root_name}
    # dims of tensors the code made (torch.arange, torch.ones): constant only where no input has them
    derived.update({root_name[d.find().uid]: ("const", d.find().size, None) for d in getattr(tracer, "made_dims", ())
                    if d.find().uid in root_name and root_name[d.find().uid] not in axis_sizes})
    # an alias of a constant dim (a slice's, as the keys of attention over x[:, :-1]) is constant too
    for fresh, source in tracer.aliases:
        if names[fresh.var] not in axis_sizes and names[source.var] in derived:
            derived.setdefault(names[fresh.var], derived[names[source.var]])
    for st in kept:
        for a in (*st.axes, *(n.axis for n in walk(st.body) if isinstance(n, Size))):
            if a not in axis_sizes and a not in derived:
                raise ValueError(f"stage {st.name!r}: axis {a!r} is not a dimension of any input, so its size is "
                                 "unknown (a repeat_interleave dimension must meet an input dimension of that size)")
    prog = Program(name, inputs, tuple(params), tuple(reversed(kept)), outs, axis_sizes, param_kinds, derived)
    prog.validate()
    return prog


class ProgramDef:
    """A plain function marked with `@nf.program`; traced on first use for given argument kinds."""

    # outputs take torch's promoted dtype of the floating inputs (fp16 + fp32 gives fp32); where
    # False, the first floating input's (attention's query, as FlexAttention; backward kernels)
    promotes_outputs = True

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.name = fn.__name__
        try:
            self.signature = inspect.signature(fn)
        except (TypeError, ValueError):
            raise TypeError(f"{self.name} has no Python signature to trace (a builtin, such as torch.nn.functional.gelu): "
                            f"wrap it in a Python function, e.g. nf.compile(lambda x: {self.name}(x))") from None
        self.__doc__ = fn.__doc__
        self._cache: dict[tuple[ArgSpec, ...], Program] = {}

    def bind(self, *args: Any, **kwargs: Any) -> list[tuple[str, Any]]:
        """Match call arguments to the function's parameters, in order."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return list(bound.arguments.items())

    def specs(self, *args: Any, **kwargs: Any) -> tuple[ArgSpec, ...]:
        return tuple(spec_of(n, v) for n, v in self.bind(*args, **kwargs))

    def output_dtypes(self, program: Program, values: dict[str, Any]) -> list[Any]:
        """The dtype of each output of `program` called with `values` (torch tensors by input
        name): torch's (lang/dtypes.py); where the program does not promote, a float output takes
        the first floating input's dtype unless a cast declares another.

        Example:
            >>> import torch
            >>> add = ProgramDef(lambda a, b: ((a + b).sum(axis=-1), a.sum(axis=-1) > 0))
            >>> a, b = torch.randn(2, 3, dtype=torch.float16), torch.randn(2, 3)
            >>> add.output_dtypes(add.trace(a, b), {"a": a, "b": b})
            [torch.float32, torch.bool]
        """
        from neptune_fusion.lang.dtypes import output_dtypes

        promoted = output_dtypes(program, values)
        if self.promotes_outputs:
            return promoted
        first = next(values[b.name].dtype for b in program.inputs if values[b.name].is_floating_point())
        return [dtype if not dtype.is_floating_point or isinstance(program.stage(o.stage).body, Cast) else first
                for dtype, o in zip(promoted, program.outputs)]

    def trace(self, *args: Any, **kwargs: Any) -> Program:
        """The Program for arguments like these (torch tensors or example shapes/scalars)."""
        specs = self.specs(*args, **kwargs)
        return self.trace_specs(specs)

    def trace_specs(self, specs: tuple[ArgSpec, ...]) -> Program:
        # keyed by exact shapes: a trace can depend on sizes (programs read x.shape); the Program
        # itself holds none (nf.size keeps a length symbolic), so later caches are keyed by its fingerprint
        if specs not in self._cache:
            self._cache[specs] = trace(self.fn, specs, self.name)
        return self._cache[specs]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the program eagerly, unfused (with the executor the runtime layer registers)."""
        if _EAGER_EXECUTOR is None:
            raise RuntimeError("no eager executor registered; import neptune_fusion (not only its lang layer)")
        named = self.bind(*args, **kwargs)
        prog = self.trace(*args, **kwargs)
        return _EAGER_EXECUTOR(prog, dict(named))


class FixedProgram(ProgramDef):
    """A Program already built (by a transform, not traced): its inputs then its parameters are
    the call's arguments, by name or in that order.

    Example:
        >>> import torch
        >>> from neptune_fusion.library import softmax
        >>> fixed = FixedProgram(softmax.trace(torch.randn(2, 3)))
        >>> list(fixed.signature.parameters)
        ['x']
    """

    def __init__(self, prog: Program, promotes_outputs: bool = False) -> None:
        names = [b.name for b in prog.inputs] + list(prog.params)
        self.promotes_outputs = promotes_outputs
        self.fn = None
        self.name = prog.name
        self.signature = inspect.Signature(
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
        self.__doc__ = f"the program {prog.name!r}"
        self.program = prog
        self._cache = {}

    def trace_specs(self, specs: tuple[ArgSpec, ...]) -> Program:
        return self.program


_EAGER_EXECUTOR: Callable[[Program, dict[str, Any]], Any] | None = None


def set_eager_executor(executor: Callable[[Program, dict[str, Any]], Any]) -> None:
    """Called by the runtime layer so that calling a ProgramDef runs it (the front end does not import it)."""
    global _EAGER_EXECUTOR
    _EAGER_EXECUTOR = executor



def program(fn: Callable[..., Any]) -> ProgramDef:
    """Mark a plain function as a neptune_fusion program.

    Example:
        >>> import neptune_fusion as nf
        >>> @nf.program
        ... def logsumexp(x):
        ...     m = x.max(axis=-1, keepdims=True)
        ...     return (m + nf.log(nf.exp(x - m).sum(axis=-1, keepdims=True)))[..., 0]
    """
    return ProgramDef(fn)

