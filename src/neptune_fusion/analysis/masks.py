"""Mask analysis: which tiles of a fused loop can be skipped, and which need no mask arithmetic.

A *mask* is a `where(cond, x, b)` inside the loop's reductions such that, for every
member reduction, replacing it by `b` makes the member's contribution the reducer's
identity (proved with the algebra: `exp(-inf - m) = 0` adds nothing to a sum). Where
`cond` is false the element can be dropped, so a tile where it is false everywhere
can be skipped. The affine conjuncts of `cond` (`a*row + b*col + c >= 0`, |b| = 1)
give loop bounds per row tile and the range of tiles where `cond` holds everywhere.

Example:
    >>> import torch
    >>> from neptune_fusion.algebra.repair import contribution_vanishes
    >>> from neptune_fusion.library import causal_attention
    >>> from neptune_fusion.transform.inline import inline_along, inline_elementwise
    >>> from neptune_fusion.transform.rolling import rolling_update
    >>> q = k = v = torch.randn(1, 1, 16, 8)
    >>> prog = inline_along(inline_elementwise(causal_attention.trace(q, k, v, 0.5)), "k")
    >>> loop = rolling_update(prog, "k").stages[0]
    >>> info = analyze_masks(loop, "q", set(), contribution_vanishes)
    >>> [(c.row_coeff, c.col_coeff) for c in info.constraints], info.residual   # q - k >= 0: affine
    ([(1, -1)], False)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from neptune_fusion.ir.expr import (
    REDUCER_IDENTITY,
    Binary,
    Cast,
    Const,
    Expr,
    Index,
    Load,
    Param,
    Reduce,
    Size,
    Unary,
    Where,
    free_axes,
    loads_of,
    transform_bottom_up,
    walk,
)
from neptune_fusion.ir.program import FusedLoop


@dataclass(frozen=True)
class Constraint:
    """`row_coeff * row + col_coeff * col + offset >= 0`, offset independent of row and col."""

    row_coeff: int
    col_coeff: int
    offset: Expr


@dataclass(frozen=True)
class MaskedWhere:
    """One mask: `where(cond, visible, masked)`; cond = common AND (OR of union boxes) AND residual.

    `constraints` are the affine conjuncts common to the whole region, `union` the boxes of an
    affine disjunction (prefix-LM: `kv < P | kv <= q`), `residual` what is not affine (None: nothing).
    """

    node: Where
    visible: Expr
    constraints: tuple[Constraint, ...]
    union: tuple[tuple[Constraint, ...], ...]
    residual: Expr | None
    # further where-nodes with the same condition (the mask written on the scores with -inf for the
    # max and on the weights with 0 for the sums): (node, its visible branch)
    others: tuple[tuple[Where, Expr], ...] = ()

    def unmasked(self) -> Expr:
        """What the where-node becomes in a tile where the affine part of cond holds everywhere."""
        return self._unmasked(self.node, self.visible)

    def _unmasked(self, node: Where, visible: Expr) -> Expr:
        if self.residual is None:
            return visible
        return Where(self.residual, visible, node.b if visible is node.a else node.a)

    def replacements(self, exact: bool) -> dict[Expr, Expr]:
        """Every where-node of this mask -> what it becomes in a tile where the mask holds
        everywhere (`exact`: the whole condition, residual included, is known to hold)."""
        return {node: (visible if exact else self._unmasked(node, visible))
                for node, visible in ((self.node, self.visible), *self.others)}

    def boxes(self) -> list[tuple[Constraint, ...]]:
        """The visible region as a union of boxes, each a conjunction of affine constraints."""
        if not self.union:
            return [self.constraints]
        return [self.constraints + box for box in self.union]


@dataclass(frozen=True)
class MaskInfo:
    """All masks of a fused loop (their conditions hold together)."""

    masks: tuple[MaskedWhere, ...]

    @property
    def constraints(self) -> tuple[Constraint, ...]:
        return tuple(c for m in self.masks for c in m.constraints)

    def boxes(self) -> list[tuple[Constraint, ...]]:
        """Visible region of all masks together (their intersection), as a union of boxes."""
        out: list[tuple[Constraint, ...]] = [()]
        for m in self.masks:
            out = [a + b for a in out for b in m.boxes()]
        return out

    @property
    def residual(self) -> bool:
        """True when some part of a mask is not affine (needs a run-time block map to skip tiles)."""
        return any(m.residual is not None for m in self.masks)


def _affine(expr: Expr, row: str, col: str) -> tuple[int, int, Expr] | None:
    """expr as (row coeff, col coeff, offset) if it is affine in row and col with int coefficients."""
    if not ({row, col} & free_axes(expr)):
        return 0, 0, expr
    if isinstance(expr, Index):
        return (1, 0, Const(0)) if expr.axis == row else (0, 1, Const(0))
    if isinstance(expr, Unary) and expr.op == "neg":
        inner = _affine(expr.x, row, col)
        return None if inner is None else (-inner[0], -inner[1], Unary("neg", inner[2]))
    if isinstance(expr, Binary) and expr.op in ("add", "sub"):
        a, b = _affine(expr.a, row, col), _affine(expr.b, row, col)
        if a is None or b is None:
            return None
        sign = 1 if expr.op == "add" else -1
        return a[0] + sign * b[0], a[1] + sign * b[1], Binary(expr.op, a[2], b[2])
    if isinstance(expr, Binary) and expr.op == "mul":
        for lin, k in ((expr.a, expr.b), (expr.b, expr.a)):
            if isinstance(k, Const) and isinstance(k.value, int) and not isinstance(k.value, bool):
                inner = _affine(lin, row, col)
                if inner is not None:
                    return inner[0] * k.value, inner[1] * k.value, Binary("mul", inner[2], k)
    return None


def _is_integer(expr: Expr, int_params: set[str], int_buffers: frozenset[str] = frozenset()) -> bool:
    """Whether `expr` computes an integer from indices, integer parameters and loads of
    `int_buffers` only (exact wherever it is computed)."""
    for node in walk(expr):
        if isinstance(node, Const) and isinstance(node.value, float):
            return False
        if isinstance(node, Param) and node.name not in int_params:
            return False
        if isinstance(node, Cast) and not node.dtype.startswith("i"):
            return False
        if isinstance(node, Binary) and node.op in ("div", "pow"):
            return False
        if isinstance(node, Unary) and node.op not in ("neg", "abs"):
            return False
    return loads_of(expr) <= int_buffers


def conjuncts(cond: Expr) -> list[Expr]:
    if isinstance(cond, Binary) and cond.op == "and":
        return conjuncts(cond.a) + conjuncts(cond.b)
    return [cond]


def disjuncts(cond: Expr) -> list[Expr]:
    if isinstance(cond, Binary) and cond.op == "or":
        return disjuncts(cond.a) + disjuncts(cond.b)
    return [cond]


_NEGATED = {"lt": "ge", "ge": "lt", "le": "gt", "gt": "le", "eq": "ne", "ne": "eq"}


def push_not(cond: Expr) -> Expr:
    """~(a < b) -> a >= b, ~(x & y) -> ~x | ~y, ... so masks written with ~ stay affine."""
    if isinstance(cond, Unary) and cond.op == "not":
        x = cond.x
        if isinstance(x, Binary) and x.op in _NEGATED:
            return Binary(_NEGATED[x.op], x.a, x.b)
        if isinstance(x, Binary) and x.op in ("and", "or"):
            other = "or" if x.op == "and" else "and"
            return Binary(other, push_not(Unary("not", x.a)), push_not(Unary("not", x.b)))
        if isinstance(x, Unary) and x.op == "not":
            return push_not(x.x)
    if isinstance(cond, Binary) and cond.op in ("and", "or"):
        return Binary(cond.op, push_not(cond.a), push_not(cond.b))
    return cond


def _constraints_of(cmp: Expr, row: str, col: str, int_params: set[str]) -> list[Constraint] | None:
    if not (isinstance(cmp, Binary) and cmp.op in ("ge", "gt", "le", "lt", "eq")):
        return None
    if not (_is_integer(cmp.a, int_params) and _is_integer(cmp.b, int_params)):
        return None
    diff = _affine(Binary("sub", cmp.a, cmp.b), row, col)
    if diff is None:
        return None
    a, b, c = diff
    neg = (-a, -b, Unary("neg", c))
    forms = {
        "ge": [(a, b, c)], "gt": [(a, b, Binary("sub", c, Const(1)))],
        "le": [neg], "lt": [(neg[0], neg[1], Binary("sub", neg[2], Const(1)))], "eq": [(a, b, c), neg],
    }[cmp.op]
    out = [Constraint(x, y, z) for x, y, z in forms]
    if any(abs(k.col_coeff) != 1 for k in out):
        return None
    return out


Vanishes = Callable[[Expr, Expr, float, float, tuple[str, ...]], bool]


def exact_anywhere(cond: Expr, int_params: set[str], int_buffers: frozenset[str]) -> bool:
    """Whether `cond` has the same value wherever it is computed (the host building a block map,
    the kernel): it compares loaded values, indices and integers, with no floating-point
    arithmetic, whose results depend on how it is computed (`exp` against `exp2(x * log2e)`, a fused
    multiply-add against a product rounded before the sum).

    Example:
        >>> doc = Load("doc", (Index("q"),)), Load("doc", (Index("k"),))
        >>> exact_anywhere(Binary("eq", *doc), set(), frozenset({"doc"}))
        True
        >>> x = Load("x", (Index("q"), Index("k")))
        >>> exact_anywhere(Binary("gt", Unary("exp", x), Const(1.0)), set(), frozenset())
        False
    """
    def exact(e: Expr) -> bool:
        if isinstance(e, (Const, Index, Param, Size)):
            return True
        if isinstance(e, Load):
            return all(_is_integer(i, int_params, int_buffers) for i in e.index)
        if isinstance(e, Cast):
            return exact(e.x)
        if isinstance(e, Unary):
            return e.op in ("not", "neg", "abs") and exact(e.x)
        if isinstance(e, Where):
            return exact(e.cond) and exact(e.a) and exact(e.b)
        if isinstance(e, Binary):
            if e.op in ("and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge", "max", "min"):
                return exact(e.a) and exact(e.b)
            return _is_integer(e, int_params, int_buffers)
        return False

    return exact(cond)


def analyze_masks(loop: FusedLoop, row: str, int_params: set[str] | None, vanishes: Vanishes,
                  int_buffers: frozenset[str] = frozenset(), held: frozenset[str] = frozenset()) -> MaskInfo:
    """The masks of `loop` (see module docstring); `row` is the axis tiled per program.

    `held`: the axes a program holds as tiles besides the row and the loop axis (a matmul's
    output columns). A condition reading one is not a mask: its bounds on the loop axis would
    differ across the tile, so it stays an element-wise `where` in every tile.

    `vanishes(g, node, value, identity, producers)` must prove that g with `node` set to `value`
    is the reducer's identity (the algebra layer's `contribution_vanishes`). Only conditions
    `exact_anywhere` are masks (tiles are skipped by their value on the host or in the program);
    `int_buffers`: the buffers holding integers or booleans.
    """
    col = loop.axis
    int_params = int_params or set()
    bodies = []
    for m in loop.members:
        assert isinstance(m.body, Reduce)
        bodies.append((m, m.body.body))
    candidates: list[Where] = []
    for _, g in bodies:
        for node in walk(g):
            if (isinstance(node, Where) and col in free_axes(node.cond) and node not in candidates
                    and not free_axes(node.cond) & held
                    and any(_is_number(x) for x in (node.a, node.b))
                    and exact_anywhere(node.cond, int_params, int_buffers)):
                candidates.append(node)
    # where-nodes that show the same condition (the mask on the scores for the max, on the weights
    # for the sums) form one mask: where it is false, every member must add its identity
    groups: dict[Expr, list[tuple[Where, Expr]]] = {}
    for w in candidates:
        cond, visible = (w.cond, w.a) if _masked_in_b(w) else (Unary("not", w.cond), w.b)
        groups.setdefault(cond, []).append((w, visible))
    masks: list[MaskedWhere] = []
    for cond, nodes in groups.items():
        ok = True
        for m, g in bodies:
            in_g = set(walk(g))
            present = [w for w, _ in nodes if w in in_g]
            if not present:
                ok = False
                break
            producers = loop.producers.get(m.name, ())
            # all but one of the nodes take their masked value here; the algebra proves the last
            others = {w: _masked_value(w) for w in present[1:]}
            g = transform_bottom_up(g, lambda n, o=others: o.get(n))
            last = present[0]
            if not vanishes(g, last, float(_masked_value(last).value), REDUCER_IDENTITY[m.body.op], producers):  # type: ignore[attr-defined]
                ok = False
                break
        if not ok:
            continue
        (w, visible), others = nodes[0], tuple(nodes[1:])
        cond = push_not(cond)
        constraints: list[Constraint] = []
        union: tuple[tuple[Constraint, ...], ...] = ()
        residual: list[Expr] = []
        for conj in conjuncts(cond):
            cs = _constraints_of(conj, row, col, int_params)
            if cs is not None:
                constraints.extend(cs)
                continue
            boxes = _union_of(conj, row, col, int_params)
            if boxes is not None and not union:
                union = boxes
            else:
                residual.append(conj)
        rest: Expr | None = None
        for r in residual:
            rest = r if rest is None else Binary("and", rest, r)
        masks.append(MaskedWhere(w, visible, tuple(constraints), union, rest, others))
    return MaskInfo(tuple(masks))


def _is_number(x: Expr) -> bool:
    return isinstance(x, Const) and isinstance(x.value, (int, float)) and not isinstance(x.value, bool)


def _masked_in_b(w: Where) -> bool:
    """where(cond, x, number): the element is masked where cond is false."""
    return _is_number(w.b)


def _masked_value(w: Where) -> Const:
    value = w.b if _masked_in_b(w) else w.a
    assert isinstance(value, Const)
    return value


def _union_of(cond: Expr, row: str, col: str, int_params: set[str]) -> tuple[tuple[Constraint, ...], ...] | None:
    """An OR of conjunctions of affine constraints, as boxes; None if any part is not affine."""
    parts = disjuncts(cond)
    if len(parts) < 2:
        return None
    boxes = []
    for part in parts:
        box: list[Constraint] = []
        for conj in conjuncts(part):
            cs = _constraints_of(conj, row, col, int_params)
            if cs is None:
                return None
            box.extend(cs)
        boxes.append(tuple(box))
    return tuple(boxes)
