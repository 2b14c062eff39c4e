"""`nf.compile`d programs inside torch.compile: each call one registered torch op.

Called while torch.compile traces, a `Compiled` hands its call to `call_in_graph`, which puts one
`neptune_fusion::program` op into the graph: the op's tensors are the call's tensors, its scalars
the call's numbers, and a constant handle names the compiled function and the order of its
arguments. The op runs the same kernels as an eager call; its fake implementation derives the
output shapes and dtypes from the traced program, so the graph is built without running them.

Example:
    >>> import torch, neptune_fusion as nf
    >>> @nf.program
    ... def softmax(x):
    ...     e = nf.exp(x - x.max(axis=-1, keepdims=True))
    ...     return e / e.sum(axis=-1, keepdims=True)
    >>> fn = nf.compile(softmax)
    >>> graph_fn = torch.compile(lambda x: fn(x) * 2, fullgraph=True, backend="aot_eager")   # one op per call
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from neptune_fusion.runtime import compiled as _compiled
from neptune_fusion.runtime.compiled import Compiled, output_specs
from neptune_fusion.runtime.state import in_cudagraph_tree, object_of, private_state

__all__ = ["argument_kinds", "call_in_graph", "is_eager", "run_kernels"]

_calls: list[tuple[Compiled, tuple[str, ...], tuple[str, ...]]] = []  # handle -> (function, argument names, kinds)
_handle_of: dict[tuple[int, tuple[str, ...], tuple[str, ...]], int] = {}


@torch._dynamo.assume_constant_result
def _handle(fn_id: int, positional: int, keywords: tuple[str, ...], kinds: tuple[str, ...]) -> tuple[int, tuple[str, ...]]:
    """A handle for (function, argument order, kinds), and the argument names in call order (the
    compiled function comes as its id: runtime/state.py `object_of`)."""
    fn: Compiled = object_of(fn_id)
    params = [p.name for p in fn.program_def.signature.parameters.values()]
    names = (*params[:positional], *keywords)
    unknown = [n for n in keywords if n not in params]
    if unknown or len(set(names)) != len(names) or positional > len(params):
        raise TypeError(f"{fn.program_def.name}() got arguments that do not match its signature {tuple(params)}")
    key = (id(fn), names, kinds)
    if key not in _handle_of:
        _handle_of[key] = len(_calls)
        _calls.append((fn, names, kinds))
    return _handle_of[key], names


def _named(handle: int, tensors: list[torch.Tensor], floats: list[float], ints: list[int]) -> tuple[Compiled, dict[str, Any]]:
    fn, names, kinds = _calls[handle]
    sources = {"tensor": iter(tensors), "float": iter(floats), "int": iter(ints)}
    return fn, {n: next(sources[k]) for n, k in zip(names, kinds)}


@torch.library.custom_op("neptune_fusion::program", mutates_args=())
def _program_op(tensors: list[torch.Tensor], floats: list[float], ints: list[int], handle: int) -> list[torch.Tensor]:
    """One call of an `nf.compile`d function as a torch op (its kernels, run as an eager call runs them)."""
    fn, named = _named(handle, tensors, floats, ints)
    with private_state(in_cudagraph_tree()):  # in torch.compile's CUDA graphs no memory may outlive the call
        result = fn(**named)  # (not compiling here: torch.compile traces the fake implementation)
    return list(result) if isinstance(result, tuple) else [result]


@_program_op.register_fake
def _(tensors: list[torch.Tensor], floats: list[float], ints: list[int], handle: int) -> list[torch.Tensor]:
    fn, named = _named(handle, tensors, floats, ints)
    device = tensors[0].device if tensors else torch.device("cpu")
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in output_specs(fn, named)]


def is_eager(tensors: Any) -> bool:
    """Whether a call on `tensors` runs its kernels directly: not traced (torch.compile, a dispatch
    mode such as make_fx's, fake or functional tensors), where it must be a registered op instead.
    The op's Python dispatch costs more host time than the kernels' launches.

    Example:
        >>> is_eager([torch.ones(2), torch.nn.Parameter(torch.ones(2))])
        True
    """
    return (not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and all(type(t) in _PLAIN for t in tensors))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def run_kernels(fn: Compiled, args: dict[str, Any]) -> Any:
    """`fn(**args)` for a caller that checked gradients itself: launched directly in an eager call,
    one `neptune_fusion::program` op where the call is traced."""
    if is_eager(v for v in args.values() if isinstance(v, torch.Tensor)):
        return fn.launch(**args)
    return call_in_graph(fn, (), args)


def argument_kinds(values: tuple[Any, ...]) -> tuple[str, ...]:
    """How each of a call's arguments travels to a registered op: "tensor", "float" or "int"."""
    return tuple("tensor" if isinstance(v, torch.Tensor) else "float" if isinstance(v, float) else "int"
                 for v in values)


def call_in_graph(fn: Compiled, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call `fn(*args, **kwargs)` as torch.compile traces it: one `neptune_fusion::program` op."""
    values = (*args, *kwargs.values())
    kinds = argument_kinds(values)
    handle, _ = _handle(id(fn), len(args), tuple(kwargs), kinds)
    tensors = [v for v, k in zip(values, kinds) if k == "tensor"]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(f"{fn.program_def.name}: this op runs the program without its backward, but an input "
                           f"requires grad; call the compiled function itself (its derived backward is a "
                           f"registered op of its own) or pass detached tensors")
    floats = [v for v, k in zip(values, kinds) if k == "float"]
    ints = [v for v, k in zip(values, kinds) if k == "int"]
    out = _program_op(tensors, floats, ints, handle)
    return out[0] if len(out) == 1 else tuple(out)


_compiled.IN_GRAPH = call_in_graph
