"""Derivation and proof of repair functions (DESIGN.md section 1).

For a reduction `X = f_j g(R, c_j)` that reads running values `R` of earlier
reductions along the same axis, find `h(t, r, r')` with
  (1) replacement: h(g(r, c), r, r') = g(r', c), and
  (2) distribution: h(f(x, y), r, r') = f(h(x, r, r'), h(y, r, r')).
`g` is split as gcomb(gx(r), gu(c)) with gcomb `*` (when g(r')/g(r) is free of c)
or `+` (when g(r') - g(r) is free of c); h inverts gx and applies it at r'. Here c
means what varies along the reduce axis; loop-invariant values may appear in h.
(1) then holds by construction and is re-checked; (2) is proved with SymPy.

Example:
    >>> from neptune_fusion.ir.expr import Index, Load, Unary
    >>> g = Unary("exp", Load("s", (Index("j"),)) - Load("m", ()))
    >>> from neptune_fusion.ir.printer import format_expr
    >>> format_expr(derive_repair("l", "sum", "j", g, ("m",)).h)
    't * exp(m.old - m.new)'
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from neptune_fusion.algebra import symbolic as S
from neptune_fusion.ir.errors import FusionError
from neptune_fusion.ir.expr import (
    REDUCER_IDENTITY,
    Const,
    Expr,
    Load,
    Reduce,
    Where,
    free_axes,
    loads_of,
    transform_bottom_up,
    walk,
)
from neptune_fusion.ir.printer import format_expr
from neptune_fusion.ir.program import Stage


@dataclass(frozen=True)
class Repair:
    """A derived repair: `h` uses Accumulator() for t and Running(p, 'old'/'new') for r, r'."""

    h: Expr
    combine: str  # "*" or "+": how g splits into gx(r) and gu(c)
    proof: str


def derive_repair(stage: str, reducer: str, axis: str, g: Expr, producers: tuple[str, ...],
                  positive: frozenset[str] = frozenset(), sums: frozenset[str] = frozenset(),
                  nonnegative: frozenset[str] = frozenset()) -> Repair:
    """Derive and prove the repair of reduction `stage` (`reducer` over `axis` of `g`).

    `positive`: producers whose running value is > 0 once it has seen a term (reductions of
    positive maps, `positive_map`); the proofs may use it. `sums`: producers that are sums of terms
    of either sign, whose running values are not bounded by their final ones: a repair that
    exponentiates a change in one is refused, since the running value can overflow float32 long
    before the last term brings it back (`exp((x - sum(x)) / 2)`, where the plain program gives 0
    and a rolling one inf * 0). Sums of non-negative terms (`nonnegative_map`) only grow, from 0 to
    the final sum, so their exponentials stay between the inputs' and the final ones; `nonnegative`
    names those producers (their running values are >= 0 from the identity on), and the proofs
    may use that too (a max of `x * g / sqrt(sum x^2)` repairs by a positive ratio).
    Raises FusionError naming the stage, the reduction and the condition that failed.
    """
    try:
        return _derive_cached(stage, reducer, axis, g, tuple(sorted(producers)), frozenset(positive) & set(producers),
                              frozenset(sums) & set(producers), frozenset(nonnegative) & set(producers))
    except _SYMPY_FAILURES as exc:
        raise FusionError("repair derivation", stage, f"{reducer} over {axis}",
                          f"the algebra (SymPy) could not decide a condition on the map {format_expr(g)}: "
                          f"{type(exc).__name__}: {exc}") from None
    except S.NotAlgebraic as exc:  # a repair SymPy found but the IR cannot write
        raise FusionError("repair derivation", stage, f"{reducer} over {axis}",
                          f"the repair of the map {format_expr(g)} has no form in the IR: {exc}") from None


# what SymPy raises on forms it cannot handle (limits, series and comparisons of Max, Piecewise, ...)
_SYMPY_FAILURES = (NotImplementedError, TypeError, ValueError, ArithmeticError, RecursionError)


@functools.lru_cache(maxsize=1024)
def _derive_cached(stage: str, reducer: str, axis: str, g: Expr, producers: tuple[str, ...],
                   positive: frozenset[str], sums: frozenset[str] = frozenset(),
                   nonnegative: frozenset[str] = frozenset()) -> Repair:
    where = f"{reducer} over {axis}"

    def fail(condition: str) -> FusionError:
        return FusionError("repair derivation", stage, where, condition)

    if reducer in ("max", "min"):
        g = _drop_identity_guards(g, REDUCER_IDENTITY[reducer], producers)
    try:
        g_old, table = S.to_sympy(g, set(producers), S.SymbolTable(positive=positive, nonnegative=nonnegative))
    except S.NotAlgebraic as exc:
        raise fail(f"the map {format_expr(g)} uses {exc} which the algebra cannot reason about") from None
    # Subexpressions free of the running values are opaque symbols. Those that vary along the
    # reduce axis are the per-term inputs c; loop-invariant ones (a Param such as `scale`, a load
    # indexed by the output axes only) may appear in h: exp((s - m) * scale) repairs with
    # t * exp(scale * (m.old - m.new)).
    constants = {sym for e, sym in table.opaque.items() if _varies_along(e, axis)}
    new_of = {table.old(p): table.new(p) for p in producers}
    g_new = g_old.subs(new_of)
    t = S.symbol("t")

    candidates: list[tuple[str, object]] = []
    ratio = S.simplify(g_new / g_old)
    if not (ratio.free_symbols & constants) and ratio.is_finite is not False:
        candidates.append(("*", t * ratio))
    diff = S.simplify(g_new - g_old)
    if not (diff.free_symbols & constants):
        candidates.append(("+", t + diff))
    if not candidates:
        raise fail(
            f"no repair function: the map {format_expr(g)} (as {g_old}) splits neither as "
            f"gx({', '.join(producers)}) * gu(c) nor as gx(...) + gu(c), so a change of the running "
            f"value(s) cannot be corrected without the individual terms"
        )
    failures: list[str] = []
    for combine, h in candidates:
        h_of_g = h.subs(t, g_old)
        if not S.is_zero(h_of_g - g_new):  # condition (1): replacement
            failures.append(f"h(t) = {h} fails replacement h(g(r)) = g(r')")
            continue
        ok, proof = _distributes(h, t, reducer)
        if ok:
            unbounded = sorted(p for p in sums if _exponentiates(h, {table.old(p), table.new(p)}))
            if unbounded:
                raise fail(
                    f"the repair h = {h} exponentiates a change in the running sum(s) {unbounded} of terms of "
                    f"either sign: partial sums are not bounded by the final sum, so the running value can "
                    f"overflow float32 before the last term (under exp a repair may use a running max or "
                    f"min, or a sum of non-negative terms)"
                )
            return Repair(S.from_sympy(h, table), combine, f"g splits with '{combine}'; h = {h}; {proof}")
        failures.append(proof)
    raise fail("repair fails distribution over the reducer: " + "; ".join(failures))


def _exponentiates(h: object, symbols: set[object]) -> bool:
    """Whether an exponential in `h` (exp, or a constant raised to a power) has any of `symbols` in its exponent."""
    for node in S.preorder(h):
        exponent = S.exponent_of(node)
        if exponent is not None and exponent.free_symbols & symbols:
            return True
    return False


def positive_map(g: Expr, producers: tuple[str, ...], positive: frozenset[str] = frozenset()) -> bool:
    """Whether every value of the map `g` is > 0, so a sum, max or min of it is > 0 once it has a
    term (a softmax normaliser `sum exp(x - m)`, a max of exp(...))."""
    try:
        sym, _ = S.to_sympy(g, set(producers), S.SymbolTable(positive=positive))
    except S.NotAlgebraic:
        return False
    return S.is_positive(sym)


def nonnegative_map(g: Expr, producers: tuple[str, ...], positive: frozenset[str] = frozenset()) -> bool:
    """Whether every value of the map `g` is >= 0, so the partial sums of it never decrease and stay
    between 0 and the final sum (`sum x * x`, a softmax normaliser).

    Loads become symbols of their own here (not opaque subexpressions), so the sign of `x * x` is
    seen; a buffer loaded at two different indices is left opaque, since one symbol would say that
    `x[i] * x[j]` is a square.
    """
    indices: dict[str, set[object]] = {}
    for node in walk(g):
        if isinstance(node, Load):
            indices.setdefault(node.buffer, set()).add(node.index)
    names = set(producers) | {b for b, ix in indices.items() if len(ix) == 1}
    try:
        sym, _ = S.to_sympy(g, names, S.SymbolTable(positive=positive))
    except S.NotAlgebraic:
        return False
    return S.is_nonnegative(sym)


def _drop_identity_guards(g: Expr, identity: float, producers: tuple[str, ...]) -> Expr:
    """where(cond, x, identity) -> x for a max/min whose cond reads no running value: the guarded
    terms add the identity before and after any rescaling (a monotone h keeps +-inf at +-inf),
    so x's repair is the map's repair."""

    def rule(node: Expr) -> Expr | None:
        if not isinstance(node, Where) or loads_of(node.cond) & set(producers):
            return None
        for kept, other in ((node.a, node.b), (node.b, node.a)):
            if isinstance(other, Const) and other.value == identity:
                return kept
        return None

    return transform_bottom_up(g, rule)


def _varies_along(expr: Expr, axis: str) -> bool:
    """Whether `expr` takes different values along `axis` (or reduces over it)."""
    return axis in free_axes(expr) or any(isinstance(n, Reduce) and n.axis == axis for n in walk(expr))


def _distributes(h: object, t: object, reducer: str) -> tuple[bool, str]:
    """Condition (2): does h(., r, r') distribute over `reducer`? Returns (proved, reason)."""
    x, y = S.symbol("x"), S.symbol("y")
    hx, hy = h.subs(t, x), h.subs(t, y)  # type: ignore[attr-defined]
    if reducer == "sum":
        if S.is_zero(h.subs(t, x + y) - hx - hy):  # type: ignore[attr-defined]
            return True, "h(x + y) = h(x) + h(y) (h is linear in t)"
        return False, f"h = {h} is not linear in t, so it does not distribute over sum"
    if reducer == "prod":
        if S.is_zero(h.subs(t, x * y) - hx * hy):  # type: ignore[attr-defined]
            return True, "h(x * y) = h(x) * h(y)"
        return False, f"h = {h} is not multiplicative in t, so it does not distribute over prod"
    if reducer in ("max", "min"):
        slope = S.derivative(h, t)  # type: ignore[arg-type]
        if S.is_nonnegative(slope):
            return True, f"dh/dt = {slope} >= 0, so h is monotone and commutes with {reducer}"
        return False, f"h = {h} is not provably monotone in t (dh/dt = {slope}), so it may not commute with {reducer}"
    return False, f"unknown reducer {reducer!r}"


@functools.lru_cache(maxsize=1024)
def contribution_vanishes(g: Expr, masked: Expr, value: float, identity: float, producers: tuple[str, ...]) -> bool:
    """True when g, with the subexpression `masked` set to `value` (+-inf), equals the reducer identity.

    Proves that a fully masked tile adds nothing to a reduction, so the loop may skip it.
    """
    marker = "__masked__"
    replaced = transform_bottom_up(g, lambda node: Load(marker, ()) if node == masked else None)
    try:
        sym, table = S.to_sympy(replaced, set(producers) | {marker})
    except S.NotAlgebraic:
        return False
    inf = -S.NEG_INF
    target = (-inf if value < 0 else inf) if math.isinf(value) else S.number(value)
    try:
        at = S.simplify(sym.subs(table.old(marker), target))
    except Exception:  # noqa: BLE001 - sympy raises many types on undefined forms
        return False
    if identity == 0:
        return bool(at == 0)
    return bool(at == (-inf if identity < 0 else inf))


def terms_vanish_while_identity(member: Stage, producer: Stage, producers: tuple[str, ...]) -> bool:
    """True when every term of `member` is its reducer's identity wherever the term of the max/min
    `producer` is its identity, whatever the (finite) running values.

    Then, while the producer's running value is still its identity, the member has seen only
    identities too, so standing in any value for the producer there needs no repair later
    (attention: exp(-inf - m) = 0 for every m). When it is false (`sum exp(x - max(where(c, x,
    -inf)))` reads `x` where the max saw -inf), the terms computed with the stand-in count and must
    be repaired from it.
    """
    assert isinstance(member.body, Reduce) and isinstance(producer.body, Reduce)
    assert member.reduce_op is not None and producer.reduce_op is not None
    return contribution_vanishes(member.body.body, producer.body.body, REDUCER_IDENTITY[producer.reduce_op],
                                 REDUCER_IDENTITY[member.reduce_op], producers)


@functools.lru_cache(maxsize=1024)  # a SymPy limit; the split-K combine asks again for every split count
def repair_finite_from_identity(h: Expr, producer: str, identity: float) -> bool:
    """True when h stays finite as the old running value of `producer` is its reducer's identity.

    For `t * exp(r - r')` at r = -inf the factor is 0: a chunk that saw nothing repairs to 0 by
    itself. For `t * (r / r')**2` it is infinite, so the caller must not apply h to such a chunk.
    False also when SymPy cannot tell (its limit of a Max is not implemented): the caller then
    stands in a finite value, which is exact either way.
    """
    import sympy as sp

    try:
        sym, table = S.to_sympy(h, set())
    except S.NotAlgebraic:
        return False
    old = table.old(producer)
    value = sym.subs(S.symbol("t"), 1)
    try:
        value = sp.limit(value, old, -sp.oo if identity < 0 else sp.oo)
    except _SYMPY_FAILURES:
        return False
    return bool(value.is_finite)


@dataclass(frozen=True)
class PolynomialSplit:
    """g = sum_k monomial_k(r) * coefficient_k(c): `terms` pairs (monomial over Running(p, "new"), coefficient)."""

    terms: tuple[tuple[Expr, Expr], ...]


def polynomial_split(g: Expr, producers: tuple[str, ...], max_degree: int = 4,
                     shifts: dict[str, Expr] | None = None) -> PolynomialSplit | None:
    """Split a map that is a polynomial in the running values into basis terms.

    `sum_j (x_j - r)^2 = sum_j x_j^2 - 2 r sum_j x_j + r^2 sum_j 1`: each coefficient is a
    reduction that no longer depends on r, and the result is recombined with the final r.
    Expanded around 0 that is the textbook variance, whose terms cancel where the values are far
    from 0 relative to their spread (a mean 1000 times the spread loses six digits of fp32).
    `shifts` (producer -> a value that does not vary along the sum, near the final r) expands
    around it instead, as a Taylor series: `sum_j (x_j - s)^2 - 2 (r - s) sum_j (x_j - s) +
    (r - s)^2 sum_j 1`, each coefficient the derivative of g at s, kept unexpanded, so nothing
    large cancels. Returns None when g is not such a polynomial.

    Example:
        >>> from neptune_fusion.ir.expr import Index, Load
        >>> from neptune_fusion.ir.printer import format_expr
        >>> x, m = Load("x", (Index("j"),)), Load("m", ())
        >>> len(polynomial_split((x - m) * (x - m), ("m",)).terms)
        3
        >>> shifted = polynomial_split((x - m) * (x - m), ("m",), shifts={"m": Load("x0", ())})
        >>> sorted(format_expr(c) for _, c in shifted.terms)
        ['(x[j] - x0[]) * (x[j] - x0[])', '1', '2 * x0[] - 2 * x[j]']
    """
    import sympy as sp

    try:
        sym, table = S.to_sympy(g, set(producers))
    except S.NotAlgebraic:
        return None
    rs = [table.old(p) for p in producers]
    try:
        poly = sp.Poly(sp.expand(sym), *rs)
    except sp.PolynomialError:
        return None
    if poly.total_degree() > max_degree or poly.total_degree() < 1:
        return None
    terms = []
    if not shifts:
        for powers, coeff in poly.terms():
            if coeff.free_symbols & set(rs):
                return None
            monomial = sp.Mul(*(r**k for r, k in zip(rs, powers)))
            terms.append((S.from_sympy(monomial, table), S.from_sympy(coeff, table)))
        return PolynomialSplit(tuple(terms))
    centre = {r: table.constant(shifts[p]) if p in shifts else sp.Integer(0) for r, p in zip(rs, producers)}
    degrees = [poly.degree(r) for r in rs]
    for powers in itertools.product(*(range(d + 1) for d in degrees)):
        if sum(powers) > poly.total_degree():
            continue
        coeff = sym
        for r, k in zip(rs, powers):
            coeff = sp.diff(coeff, r, k) if k else coeff
        coeff = coeff.subs(centre) / math.prod(math.factorial(k) for k in powers)
        if sp.expand(coeff) == 0:
            continue
        if coeff.free_symbols & set(rs):
            return None
        monomial = sp.Mul(*((r - centre[r]) ** k for r, k in zip(rs, powers)))
        terms.append((S.from_sympy(monomial, table), S.from_sympy(coeff, table)))
    return PolynomialSplit(tuple(terms))


def separable_split(g: Expr, axis: str, producers: tuple[str, ...], max_terms: int = 6) -> PolynomialSplit | None:
    """Split `g = sum_k m_k(r) * b_k(c, r)` into basis sums that a rolling update can carry.

    Each monomial m_k depends on the running values r only; each basis map b_k depends on them only
    through one factor whose ratio at r' and r is free of c, so `sum_j b_k` has a multiplicative
    repair and keeps its shift (it stays finite where exp(c) alone would overflow). The sums are
    recombined with the final r after the loop. This generalises the polynomial split: the entropy
    of a softmax, `exp(c - M) * log(exp(c - M) / L)`, becomes
    `sum_j c_j exp(c_j - M) - (M + log L) * sum_j exp(c_j - M)`. Every rewrite is an identity
    (SymPy's expansion under its real assumptions). Returns None when no such split exists or it
    would not change anything.

    Example:
        >>> from neptune_fusion.ir.expr import Index, Load, Unary
        >>> c, m, l = Load("x", (Index("j"),)), Load("m", ()), Load("l", ())
        >>> e = Unary("exp", c - m)
        >>> len(separable_split(e * Unary("log", e / l), "j", ("l", "m")).terms)
        2
    """
    try:
        sym, table = S.to_sympy(g, set(producers))
    except S.NotAlgebraic:
        return None
    rs = {table.old(p) for p in producers}
    cs = {sym_ for e, sym_ in table.opaque.items() if _varies_along(e, axis)}
    new_of = {table.old(p): table.new(p) for p in producers}
    bases: dict[object, object] = {}  # basis map -> sum of its monomials
    for term in S.expand_terms(sym):
        mixed, monomial, coefficient = [], [], []
        for factor in S.factors(term):
            free = factor.free_symbols
            numeric_or_running = factor.is_Number or (free & rs and not free & cs)
            (mixed if free & rs and free & cs else monomial if numeric_or_running else coefficient).append(factor)
        shift = S.product(mixed)
        if mixed and (S.simplify(shift.subs(new_of) / shift).free_symbols & cs):
            return None  # a factor mixing c and r that no rescaling repairs
        basis = shift * S.product(coefficient)
        bases[basis] = bases.get(basis, 0) + S.product(monomial)
    if len(bases) > max_terms or (len(bases) == 1 and next(iter(bases.values())) == 1):
        return None
    return PolynomialSplit(tuple((S.from_sympy(S.simplify(m), table), S.from_sympy(b, table))
                                 for b, m in bases.items()))
