"""Software pipelining of a tile loop: the first dot that reads no loop-carried state is computed
one iteration ahead (FlashAttention-3's intra-warpgroup overlap, derived rather than written).

Hopper runs `tl.dot` asynchronously and a program waits for a dot where its result is first read.
In the plain loop the scores `S_j = Q K_j^T` are read right away by the softmax, so the tensor
cores idle while the exponentials run. Rewritten, iteration j issues `S_{j+1}` first and only then
works on `S_j`, whose dot finished during the previous iteration:

    if lo < hi:
        S = slice(lo)                      # prologue
        for j in range(lo, last, step):
            S_next = slice(j + step)       # issued first, overlaps the rest
            rest(j, S)
            S = S_next
        rest(last, S)                      # the last iteration, peeled: nothing is read past hi

The slice is the dot and everything it needs from the loop (tile loads, index arithmetic); the
rest is the loop body without it. Values of the slice that the rest also reads (column indices,
a block map's tile index) are recomputed by the rest; a tile load or a dot never is, so a loop
needing that is left as it is. Every load happens at a tile the loop visits anyway.

Example:
    >>> from neptune_fusion.tile.lower import example_kernel
    >>> kernel = example_kernel()
    >>> prefetch_first_dot(kernel).notes[-1]
    "software pipelined: each loop's first dot is issued one iteration ahead"
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Callable

from neptune_fusion.tile.ir import Assign, If, Loop, Op, Stmt, TileKernel, TVal

_EXPENSIVE = ("load", "desc_load", "dot")


def prefetch_first_dot(kernel: TileKernel) -> TileKernel:
    """`kernel` with every top-level loop whose first carry-free dot can be computed one
    iteration ahead rewritten so (see the module docstring); other statements unchanged."""
    return _rewrite(kernel, lambda op: op.kind == "dot",
                    "software pipelined: each loop's first dot is issued one iteration ahead", peel=True)


def prefetch_scalar_loads(kernel: TileKernel) -> TileKernel:
    """The same rewrite with the first scalar load as the value computed ahead: a loop over the
    tiles a block map lists reads the next tile's index one iteration early, so the address of
    each tile load is known when its iteration starts (FlexAttention's kernel does this by hand).

    Example: a document mask's loop visits tiles from run-time lists, so the runtime applies it:
        >>> import torch, neptune_fusion as nf
        >>> doc = torch.tensor([0] * 20 + [1] * 12)
        >>> def same_doc(b, h, q_idx, kv_idx):
        ...     return doc[q_idx] == doc[kv_idx]
        >>> q = k = v = torch.randn(1, 1, 32, 16)
        >>> "the next tile's index) is read ahead" in nf.explain_attention(q, k, v, mask_mod=same_doc)
        True
    """
    return _rewrite(kernel, lambda op: op.kind == "load" and not op.out.axes,
                    "software pipelined: each loop's first scalar load (the next tile's index) is read ahead",
                    peel=False)


def _rewrite(kernel: TileKernel, is_root: Callable[[Op], bool], note: str, peel: bool) -> TileKernel:
    names = itertools.count()
    body: list[Stmt] = []
    for st in kernel.body:
        body.extend(_pipeline(st, names, is_root, peel) if isinstance(st, Loop) else [st])
    if body == kernel.body:
        return kernel
    return replace(kernel, body=body, notes=kernel.notes + [note])


def _closure(roots: list[Op], defined: dict[str, Op]) -> set[str]:
    """Names of `roots` and of every op of `defined` they read, directly or not."""
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        op = stack.pop()
        if op.out.name not in seen:
            seen.add(op.out.name)
            stack.extend(defined[a.name] for a in op.args if a.name in defined)
    return seen


def _slice_of_first_root(loop: Loop, is_root: Callable[[Op], bool]) -> list[Op] | None:
    """The ops (in body order) the first root op needs from inside the loop, if none reads loop-carried state."""
    carried = {st.target.name for st in loop.body if isinstance(st, Assign)}
    ops = [st for st in loop.body if isinstance(st, Op)]
    defined = {op.out.name: op for op in ops}
    for root in (op for op in ops if is_root(op) and op.out.name not in carried):
        needed = _closure([root], defined)
        if not any(a.name in carried for name in needed for a in defined[name].args):
            return [op for op in ops if op.out.name in needed]
    return None


def _clone(ops: list[Stmt], rename: dict[str, TVal], names: itertools.count, keep: str | None = None) -> list[Stmt]:
    """`ops` with their arguments renamed by `rename`, each output given a fresh name (recorded in
    `rename`); the op named `keep` keeps its name. Assigns are copied with renamed values."""
    out: list[Stmt] = []
    for st in ops:
        if isinstance(st, Assign):
            out.append(Assign(st.target, rename.get(st.value.name, st.value)))
            continue
        assert isinstance(st, Op)
        new_out = st.out if st.out.name == keep else TVal(f"{st.out.name}_p{next(names)}", st.out.axes, st.out.dtype)
        rename[st.out.name] = new_out
        out.append(Op(new_out, st.kind, tuple(rename.get(a.name, a) for a in st.args), dict(st.attrs)))
    return out


def _scalar(kind: str, name: str, args: tuple[TVal, ...], **attrs: object) -> Op:
    return Op(TVal(name, (), "i32"), kind, args, dict(attrs))


def _pipeline(loop: Loop, names: itertools.count, is_root: Callable[[Op], bool], peel: bool) -> list[Stmt]:
    """`peel`: run the last iteration after the loop, so nothing past it is computed (for a costly
    root); otherwise the last iteration computes its successor at the last index again (a cheap
    root, e.g. a scalar load), and every iteration stays inside the software-pipelined loop."""
    if loop.peeled or any(not isinstance(st, (Op, Assign)) for st in loop.body):
        return [loop]
    sliced = _slice_of_first_root(loop, is_root)
    if sliced is None:
        return [loop]
    root = sliced[-1]
    in_slice = {op.out.name: op for op in sliced}
    rest_reads = [in_slice[a.name] for st in loop.body if not (isinstance(st, Op) and st.out.name in in_slice)
                  for a in (st.args if isinstance(st, Op) else (st.value,)) if a.name in in_slice and a.name != root.out.name]
    # slice values the rest reads, with what they need from the slice, are recomputed by the rest
    needed = _closure(rest_reads, in_slice)
    shared = [op for op in sliced if op.out.name in needed]
    if any(op.kind in _EXPENSIVE and op.out.axes for op in shared):
        return [loop]  # the rest would repeat a tile load or a dot
    moved = in_slice.keys() - needed
    rest = [st for st in loop.body if not (isinstance(st, Op) and st.out.name in moved)]
    assigns = [st for st in rest if isinstance(st, Assign)]
    rest_ops = [st for st in rest if isinstance(st, Op)]

    n = next(names)
    step = TVal(loop.step, (), "i32")
    one = _scalar("const", f"one_p{n}", (), value=1)
    cond = Op(TVal(f"nonempty_p{n}", (), "bool"), "binary", (loop.start, loop.stop), {"op": "lt"})
    span = _scalar("binary", f"span_p{n}", (loop.stop, loop.start), op="sub")
    span1 = _scalar("binary", f"span1_p{n}", (span.out, one.out), op="sub")
    iters = _scalar("binary", f"iters_p{n}", (span1.out, step), op="floordiv", nonnegative=True)
    offset = _scalar("binary", f"offset_p{n}", (iters.out, step), op="mul")
    last = _scalar("binary", f"last_p{n}", (loop.start, offset.out), op="add")
    prologue = _clone(sliced, {loop.var.name: loop.start}, names, keep=root.out.name)
    nxt = _scalar("binary", f"next_p{n}", (loop.var, step), op="add")
    ahead_map: dict[str, TVal] = {loop.var.name: nxt.out}
    ahead_head = [nxt]
    if not peel:
        ahead_head.append(_scalar("binary", f"next_in_p{n}", (nxt.out, last.out), op="min"))
        ahead_map[loop.var.name] = ahead_head[-1].out
    ahead = _clone(sliced, ahead_map, names)
    steady = Loop(loop.var, loop.start, last.out if peel else loop.stop, loop.step,
                  [*ahead_head, *ahead, *rest_ops, *assigns, Assign(root.out, ahead_map[root.out.name])],
                  loop.comment + f" ({root.kind} of {root.out.name} issued one iteration ahead)",
                  peeled=peel, ahead=tuple(op.out.name for op in ahead if isinstance(op, Op)))
    final = _clone(rest_ops + assigns, {loop.var.name: last.out}, names) if peel else []
    return [cond, If(cond.out, [one, span, span1, iters, offset, last, *prologue, steady, *final],
                     "a non-empty loop: prologue, pipelined iterations" + (", the last iteration" if peel else ""))]


def separate_dot_operand_loads(kernel: TileKernel) -> TileKernel:
    """A loop tile that feeds a dot and also other arithmetic (a norm's sum of squares beside its
    matmul) is loaded twice, once for each: with more than one pipeline stage, Triton's pipeliner
    reads the shared copy for the arithmetic while a later stage's copy overwrites it
    (triton-lang/triton#6691), silently wrong results on the GPU. The second load reads the same
    addresses, served by L2; nothing else changes. (Loop tiles read through tensor descriptors
    feed dots only: the Gluon backend requires it, and Triton plans read mixed-use tiles through
    pointers.)

    Example: RMSNorm -> matmul reads x for the dot and for the norm:
        >>> import torch, neptune_fusion as nf
        >>> from neptune_fusion.library import rmsnorm_matmul
        >>> text = nf.explain(rmsnorm_matmul, torch.randn(32, 64), torch.randn(64, 16))
        >>> "loaded again for the arithmetic beside its dot" in text
        True
    """
    names = itertools.count()
    body = [_separated(st, names) if isinstance(st, Loop) else st for st in kernel.body]
    if body == kernel.body:
        return kernel
    note = "each loop tile that feeds a dot is loaded again for the arithmetic beside its dot (triton#6691)"
    return replace(kernel, body=body, notes=kernel.notes + [note])


def _separated(loop: Loop, names: itertools.count) -> Loop:
    ops = [st for st in loop.body if isinstance(st, Op)]
    users: dict[str, list[Op]] = {}
    for op in ops:
        for a in op.args:
            users.setdefault(a.name, []).append(op)

    def feeds_dots_only(op: Op) -> bool:
        """A dot, or a cast whose every user (directly or through casts) is a dot."""
        return op.kind == "dot" or (op.kind == "cast" and all(feeds_dots_only(u) for u in users.get(op.out.name, ())))

    body: list[Stmt] = []
    rename: dict[tuple[int, str], TVal] = {}  # (id of a user, the load it reads) -> the second load
    for st in loop.body:
        if isinstance(st, Loop):
            st = _separated(st, names)
        if isinstance(st, Op) and rename:
            args = tuple(rename.get((id(st), a.name), a) for a in st.args)
            st = replace(st, args=args) if args != st.args else st
        body.append(st)
        if isinstance(st, Op) and st.kind == "load" and st.out.axes:
            readers = users.get(st.out.name, [])
            others = [u for u in readers if not feeds_dots_only(u)]
            if others and len(others) < len(readers):
                # an eviction hint of its own keeps the compiler from merging the two loads back
                # into one (the tile is read again by the programs of the other grid tiles)
                second = replace(st, out=replace(st.out, name=f"{st.out.name}_again{next(names)}"),
                                 attrs={**st.attrs, "eviction": "evict_last"})
                body.append(second)
                rename.update({(id(u), st.out.name): second.out for u in others})
    return replace(loop, body=body)
