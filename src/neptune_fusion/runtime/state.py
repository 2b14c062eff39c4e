"""Per-thread call state of the runtime: whether launches may keep device memory between calls.

Example:
    >>> from neptune_fusion.runtime.state import CALL_STATE, private_state
    >>> with private_state():
    ...     CALL_STATE.private
    True
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["CALL_STATE", "private_state"]


class _CallState(threading.local):
    """Whether the launches of this thread keep no device memory between calls (`private_state`)."""

    private = False


CALL_STATE = _CallState()


@contextmanager
def private_state() -> Iterator[None]:
    """Launches inside allocate their scratch (split-K partials and counters, descriptor space,
    block maps, scalar copies) per call and cache none of it. torch.compile's CUDA graphs
    (mode="reduce-overhead") need this: memory allocated while a graph is recorded, or in its
    warm-up, belongs to the graph's pool, and a cached tensor there would outlive the graph's outputs."""
    before = CALL_STATE.private
    CALL_STATE.private = True
    try:
        yield
    finally:
        CALL_STATE.private = before
