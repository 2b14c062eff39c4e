"""Evaluating the scalar part of a tile kernel on the host: which loop ranges a program runs.

Used to check what the mask analysis promises (fully masked tiles are never visited)
without running the kernel.

Example: causal attention in tiles of 16, rows 32..47 (programs walk the row tiles heaviest first):
    >>> from neptune_fusion.tile.lower import example_kernel
    >>> kernel = example_kernel()
    >>> for lo, hi, what in loop_ranges(kernel, pids=(1, 0, 0), sizes={"q": 64, "k": 64}):
    ...     print(lo, hi, what)
    0 0 tiles that need masks (before the fully visible range)
    0 32 fully visible tiles: no mask arithmetic
    32 48 tiles that need masks (after the fully visible range)
"""

from __future__ import annotations

from typing import Any

from neptune_fusion.tile.ir import If, Loop, Op, Stmt, TileKernel

_BINARY = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b, "max": max, "min": min,
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
    "and": lambda a, b: a and b, "or": lambda a, b: a or b, "div": lambda a, b: a / b,
}


def loop_ranges(kernel: TileKernel, pids: tuple[int, int, int], sizes: dict[str, int],
                params: dict[str, Any] | None = None) -> list[tuple[int, int, str]]:
    """(start, stop, comment) of every top-level loop of `kernel` for program ids `pids`."""
    env: dict[str, Any] = dict(kernel.constexprs)
    env.update({f"size_{a}": s for a, s in sizes.items()})
    for name, value in (params or {}).items():
        env[f"param_{name}"] = value
    out: list[tuple[int, int, str]] = []
    _walk(kernel.body, env, pids, out)
    return out


def _walk(stmts: list[Stmt], env: dict[str, Any], pids: tuple[int, int, int], out: list[tuple[int, int, str]]) -> None:
    for st in stmts:
        if isinstance(st, Loop):
            # a peeled loop runs its last iteration after the loop: it covers one more step
            stop = int(env[st.stop.name]) + (int(env.get(st.step, st.step)) if st.peeled else 0)
            out.append((int(env[st.start.name]), stop, st.comment))
            continue
        if isinstance(st, If):
            if env.get(st.cond.name, True):
                _walk(st.body, env, pids, out)
            continue
        if not isinstance(st, Op) or st.out.axes:
            continue
        try:
            env[st.out.name] = _eval(st, env, pids)
        except KeyError:
            continue  # depends on something only the device has (a pointer, a tile)



def _eval(op: Op, env: dict[str, Any], pids: tuple[int, int, int]) -> Any:
    args = [env[a.name] for a in op.args]
    kind, at = op.kind, op.attrs
    if kind == "const":
        return at["value"]
    if kind == "program_id":
        return pids[at["dim"]]
    if kind == "cdiv":
        return -(-args[0] // env[at["block"]])
    if kind == "binary":
        return _BINARY[at["op"]](*args)
    if kind == "unary" and at["op"] == "neg":
        return -args[0]
    if kind == "where":
        return args[1] if args[0] else args[2]
    if kind == "cast":
        return args[0]
    raise KeyError(kind)
