"""Per-thread call state of the runtime: whether launches may keep device memory between calls.

Example:
    >>> from neptune_fusion.runtime.state import CALL_STATE, private_state
    >>> with private_state():
    ...     CALL_STATE.private
    True
"""

from __future__ import annotations

import ctypes
import operator
import threading
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["CALL_STATE", "in_cudagraph_tree", "object_of", "private_state", "static_shape"]


class _CallState(threading.local):
    """Whether the launches of this thread keep no device memory between calls (`private_state`)."""

    private = False


CALL_STATE = _CallState()


@contextmanager
def private_state(enabled: bool = True) -> Iterator[None]:
    """Launches inside allocate their scratch (split-K partials and counters, descriptor space,
    block maps, scalar copies) per call and cache none of it. torch.compile's CUDA graphs
    (mode="reduce-overhead") need this: memory allocated while a graph is recorded, or in its
    warm-up, belongs to the graph's pool, and a cached tensor there would outlive the graph's outputs."""
    before = CALL_STATE.private
    CALL_STATE.private = before or enabled
    try:
        yield
    finally:
        CALL_STATE.private = before


def in_cudagraph_tree() -> bool:
    """Whether torch.compile's CUDA graphs (mode="reduce-overhead") are warming up or recording on
    this device now: then new memory belongs to the graphs' pool, and a call must keep none of it.
    Outside them (eager calls, compiled graphs without CUDA graphs) caches are kept.

    Example:
        >>> in_cudagraph_tree()   # no CUDA graph tree here
        False
    """
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    if torch.cuda.is_current_stream_capturing():
        return True
    try:  # torch's cudagraph trees keep their state in a private module
        from torch._inductor import cudagraph_trees
    except ImportError:
        return False
    try:
        manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        return manager is not None and bool(manager.in_warmup or manager.in_recording)
    except Exception:  # noqa: BLE001 - an unknown torch: keep nothing rather than risk the graph pool
        return True


def object_of(obj_id: int) -> Any:
    """The live object whose `id()` is `obj_id`. torch.compile passes an object to a function it
    keeps the result of (`torch._dynamo.assume_constant_result`) only as a constant, which torch
    2.11 refuses for a module or a plain object (a compiled program, a bound method's object), but
    it passes the object's id, and guards on the object's identity where its id is taken. Call it
    only while the object is alive: during the trace of the call that holds it.

    Example:
        >>> config = object()
        >>> object_of(id(config)) is config
        True
    """
    return ctypes.cast(obj_id, ctypes.py_object).value


def static_shape(tensor: Any) -> tuple[int, ...]:
    """The shape of `tensor` as plain ints. Inside torch.compile with dynamic shapes a size is a
    symbol, which a function whose result torch.compile keeps as a constant cannot take:
    `operator.index` makes torch.compile specialise the graph to the size it sees (a guard on it),
    so a new size traces a new graph, as with `dynamic=False`, instead of failing.

    Example:
        >>> import torch
        >>> static_shape(torch.empty(2, 3))
        (2, 3)
    """
    return tuple(operator.index(d) for d in tensor.shape)
