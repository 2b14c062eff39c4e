"""Repair-function derivation and proof (DESIGN.md section 1), the SymPy bridge, the printer."""

from __future__ import annotations

import math

import pytest
import sympy as sp
import torch

from neptune_fusion.algebra import symbolic as S  # noqa: N812
from neptune_fusion.algebra.repair import (
    contribution_vanishes,
    derive_repair,
    polynomial_split,
    repair_finite_from_identity,
    separable_split,
)
from neptune_fusion.ir.errors import FusionError
from neptune_fusion.ir.expr import (
    Accumulator,
    Binary,
    Const,
    Expr,
    Index,
    Load,
    Param,
    Running,
    Unary,
    Where,
    simplify,
)
from neptune_fusion.ir.printer import format_expr

NEG_INF = Const(-math.inf)


def ld(name: str, *axes: str) -> Load:
    return Load(name, tuple(Index(a) for a in axes))


S_IJ = ld("s", "i", "j")
X_IJ = ld("x", "i", "j")
V_JE = ld("v", "j", "e")
M = ld("m", "i")
L = ld("l", "i")


def exp(x: Expr) -> Expr:
    return Unary("exp", x)


def numeric_check(g: Expr, h: Expr, producers: tuple[str, ...], reducer: str, seed: int = 0) -> None:
    """Conditions (1) and (2) on random numbers: h(g(r, c), r, r') = g(r', c) and h distributes."""
    g_sym, table = S.to_sympy(g, set(producers))
    h_sym, table = S.to_sympy(h, set(), table)  # Running/Accumulator map to the same symbols
    olds = [table.old(p) for p in producers]
    news = [table.new(p) for p in producers]
    consts = list(table.opaque.values())
    t = sp.Symbol("t", real=True)
    gen = torch.Generator().manual_seed(seed)

    def rand(n: int = 64) -> torch.Tensor:
        return torch.rand(n, generator=gen, dtype=torch.float64) * 2 + 0.25  # positive: valid for /, log

    def f(expr, *syms):
        return sp.lambdify(syms, expr, modules="math")

    g_fn = f(g_sym, *olds, *consts)
    h_fn = f(h_sym, t, *olds, *news, *consts)
    r, r2 = [rand() for _ in olds], [rand() for _ in news]
    c = [rand() for _ in consts]
    x, y = rand(), rand()
    combine = {"sum": lambda a, b: a + b, "max": max, "min": min, "prod": lambda a, b: a * b}[reducer]
    for n in range(64):
        rn, r2n, cn = [v[n].item() for v in r], [v[n].item() for v in r2], [v[n].item() for v in c]
        g_old = g_fn(*rn, *cn)
        g_new = g_fn(*r2n, *cn)
        assert math.isclose(h_fn(g_old, *rn, *r2n, *cn), g_new, rel_tol=1e-9, abs_tol=1e-12)  # (1)
        xn, yn = x[n].item(), y[n].item()
        lhs = h_fn(combine(xn, yn), *rn, *r2n, *cn)
        rhs = combine(h_fn(xn, *rn, *r2n, *cn), h_fn(yn, *rn, *r2n, *cn))
        assert math.isclose(lhs, rhs, rel_tol=1e-9, abs_tol=1e-12)  # (2)


def test_softmax_denominator():
    g = exp(S_IJ - M)
    rep = derive_repair("l", "sum", "j", g, ("m",))
    assert format_expr(rep.h) == "t * exp(m.old - m.new)"
    assert rep.h == Binary("mul", Accumulator(), exp(Running("m", "old") - Running("m", "new")))
    assert rep.combine == "*"
    assert "linear" in rep.proof
    numeric_check(g, rep.h, ("m",), "sum")


def test_numerator_with_v_factor():
    g = exp(S_IJ - M) * V_JE
    rep = derive_repair("u", "sum", "j", g, ("m",))
    assert format_expr(rep.h) == "t * exp(m.old - m.new)"
    numeric_check(g, rep.h, ("m",), "sum")


def test_normalised_p_over_l_with_two_producers():
    g = exp(S_IJ - M) / L * V_JE
    rep = derive_repair("u", "sum", "j", g, ("m", "l"))
    text = format_expr(rep.h)
    assert "exp(m.old - m.new)" in text and "l.old" in text and "/ l.new" in text
    running = {(n.stage, n.which) for n in _nodes(rep.h) if isinstance(n, Running)}
    assert running == {("m", "old"), ("m", "new"), ("l", "old"), ("l", "new")}
    numeric_check(g, rep.h, ("m", "l"), "sum")
    # the order producers are given in does not matter
    assert derive_repair("u", "sum", "j", g, ("l", "m")).h == rep.h


def test_exp2_variant():
    g = Unary("exp2", S_IJ * Const(1.4426950408889634) - M)
    rep = derive_repair("l", "sum", "j", g, ("m",))
    assert format_expr(rep.h) == "t * exp2(m.old - m.new)"
    numeric_check(g, rep.h, ("m",), "sum")


def test_loop_invariant_scale_after_the_shift():
    # exp2((s - m) * scale): the scale does not vary along j, so it may appear in h
    g = Unary("exp2", (S_IJ - M) * Param("scale"))
    rep = derive_repair("l", "sum", "j", g, ("m",))
    assert format_expr(rep.h) == "t * exp2(scale * (m.old - m.new))"
    numeric_check(g, rep.h, ("m",), "sum")
    # a per-row temperature loaded at the output axes is loop-invariant too
    g = exp((S_IJ - M) / ld("temp", "i"))
    rep = derive_repair("l", "sum", "j", g, ("m",))
    assert "temp[i]" in format_expr(rep.h)
    numeric_check(g, rep.h, ("m",), "sum")


def test_scale_varying_along_the_axis_is_not_invariant():
    g = exp((S_IJ - M) * ld("w", "j"))
    with pytest.raises(FusionError, match="no repair function"):
        derive_repair("l", "sum", "j", g, ("m",))


def test_max_of_shifted_values_is_repaired_additively():
    g = S_IJ - M
    rep = derive_repair("m2", "max", "j", g, ("m",))
    assert format_expr(rep.h) == "t + m.old - m.new"
    assert rep.combine == "+"
    assert "monotone" in rep.proof
    numeric_check(g, rep.h, ("m",), "max")
    rep = derive_repair("m2", "min", "j", g, ("m",))
    numeric_check(g, rep.h, ("m",), "min")


def test_max_of_exp_is_repaired_multiplicatively():
    g = exp(S_IJ - M)
    rep = derive_repair("mx", "max", "j", g, ("m",))
    assert format_expr(rep.h) == "t * exp(m.old - m.new)"
    numeric_check(g, rep.h, ("m",), "max")


def test_sum_of_squares_normalisation():
    g = X_IJ * X_IJ / L * V_JE
    rep = derive_repair("u", "sum", "j", g, ("l",))
    assert format_expr(rep.h) == "t * l.old / l.new"
    numeric_check(g, rep.h, ("l",), "sum")


def test_min_shift_softmax():
    # shifting by a running minimum: exp(m - x) <= 1
    g = exp(M - X_IJ) * V_JE
    rep = derive_repair("u", "sum", "j", g, ("m",))
    assert format_expr(rep.h) == "t * exp(m.new - m.old)"
    numeric_check(g, rep.h, ("m",), "sum")


def test_no_repair_for_sin():
    g = Unary("sin", X_IJ - M)
    with pytest.raises(FusionError) as info:
        derive_repair("weird", "sum", "j", g, ("m",))
    err = info.value
    msg = str(err)
    assert err.stage == "weird" and err.reduction == "sum over j"
    assert "'weird'" in msg and "sum over j" in msg
    assert "no repair function" in msg and "sin(x[i, j] - m[i])" in msg
    assert "splits neither" in msg


def test_additive_map_under_sum_fails_distribution():
    # (c - r) splits with '+', but t + r - r' is not linear, so it does not distribute over sum
    with pytest.raises(FusionError, match=r"stage 'u' \(sum over j\).*distribution.*not linear in t"):
        derive_repair("u", "sum", "j", X_IJ - M, ("m",))


def test_prod_reducer_fails_distribution():
    with pytest.raises(FusionError, match=r"prod over j.*not multiplicative"):
        derive_repair("p", "prod", "j", exp(X_IJ - M), ("m",))


def test_max_with_unknown_sign_factor_fails_monotonicity():
    with pytest.raises(FusionError, match=r"max over j.*not provably monotone"):
        derive_repair("mx", "max", "j", X_IJ * M, ("m",))


def test_variance_like_polynomial_map_is_refused():
    d = X_IJ - M
    with pytest.raises(FusionError, match="no repair function"):
        derive_repair("var", "sum", "j", d * d, ("m",))


def test_where_with_a_fixed_condition_and_zero_repairs_like_its_branch():
    """where(cond, exp(x - m), 0) = [cond] * exp(x - m): the indicator is one more per-term input."""
    g = Where(Binary("gt", X_IJ, Const(0.0)), exp(X_IJ - M), Const(0.0))
    assert format_expr(derive_repair("l", "sum", "j", g, ("m",)).h) == "t * exp(m.old - m.new)"
    flipped = Where(Binary("gt", X_IJ, Const(0.0)), Const(0.0), exp(X_IJ - M))
    assert format_expr(derive_repair("l", "sum", "j", flipped, ("m",)).h) == "t * exp(m.old - m.new)"


@pytest.mark.parametrize("g", [
    Where(Binary("gt", X_IJ, M), exp(X_IJ - M), Const(0.0)),  # the condition reads the running max
    Where(Binary("gt", X_IJ, Const(0.0)), exp(X_IJ - M), Const(1.0)),  # the other branch is not 0
])
def test_where_on_running_value_is_refused_with_a_reason(g):
    with pytest.raises(FusionError, match="where"):
        derive_repair("l", "sum", "j", g, ("m",))


def test_unsupported_op_on_running_value():
    g = Binary("floordiv", X_IJ, M)
    with pytest.raises(FusionError, match="floordiv"):
        derive_repair("l", "sum", "j", g, ("m",))


def test_derivation_is_cached():
    g = exp(S_IJ - M) * ld("w", "j", "e")
    a = derive_repair("u", "sum", "j", g, ("m",))
    b = derive_repair("u", "sum", "j", g, ("m",))
    assert a is b


def test_finiteness_sympy_cannot_decide_is_answered_no():
    """t * max(1, r^2) / max(1, r'^2) at r = -inf: SymPy's limit of a Max is not implemented (a
    regression: its NotImplementedError escaped the split-K combine). "Not finite" is the safe answer."""
    old, new = Running("m", "old"), Running("m", "new")
    h = Accumulator() * Binary("max", Const(1.0), old * old) / Binary("max", Const(1.0), new * new)
    assert repair_finite_from_identity(h, "m", -math.inf) is False
    assert repair_finite_from_identity(Accumulator() * exp(old - new), "m", -math.inf) is True


def test_sympy_failures_in_a_derivation_become_fusion_errors(monkeypatch):
    def unsupported(value: object) -> object:
        raise NotImplementedError("no series for Max")

    monkeypatch.setattr(S, "simplify", unsupported)
    with pytest.raises(FusionError, match=r"repair derivation.*l_sympy.*sum over j.*SymPy.*NotImplementedError"):
        derive_repair("l_sympy", "sum", "j", exp(S_IJ - M), ("m",))


# --------------------------------------------------------------------------- contribution_vanishes


MASKED = Where(Binary("ge", Index("i"), Index("j")), S_IJ, NEG_INF)


def test_contribution_vanishes_for_masked_attention_terms():
    assert contribution_vanishes(exp(MASKED - M), MASKED, -math.inf, 0.0, ("m",))
    assert contribution_vanishes(exp(MASKED - M) * V_JE, MASKED, -math.inf, 0.0, ("m",))
    assert contribution_vanishes(exp(MASKED - M) / L * V_JE, MASKED, -math.inf, 0.0, ("m", "l"))
    assert contribution_vanishes(MASKED, MASKED, -math.inf, -math.inf, ())
    assert contribution_vanishes(MASKED - M, MASKED, -math.inf, -math.inf, ("m",))
    assert contribution_vanishes(Unary("exp2", MASKED - M), MASKED, -math.inf, 0.0, ("m",))
    # +inf masking under a min
    pos = Where(Binary("ge", Index("i"), Index("j")), S_IJ, Const(math.inf))
    assert contribution_vanishes(pos, pos, math.inf, math.inf, ())
    assert contribution_vanishes(exp(M - pos), pos, math.inf, 0.0, ("m",))


def test_contribution_does_not_vanish():
    assert not contribution_vanishes(exp(M - MASKED), MASKED, -math.inf, 0.0, ("m",))
    assert not contribution_vanishes(MASKED + Const(1.0), MASKED, -math.inf, 0.0, ())
    assert not contribution_vanishes(-MASKED, MASKED, -math.inf, -math.inf, ())
    assert not contribution_vanishes(Unary("sigmoid", -MASKED), MASKED, -math.inf, 0.0, ())
    # the masked value does not occur in g
    assert not contribution_vanishes(exp(S_IJ - M), MASKED, -math.inf, 0.0, ("m",))


def test_contribution_vanishes_for_finite_masked_values():
    """A mask on the weights (where(cond, p, 0)) is substituted by its own value, not by infinity."""
    weights = Where(Binary("ge", Index("i"), Index("j")), exp(S_IJ - M), Const(0.0))
    assert contribution_vanishes(weights * V_JE, weights, 0.0, 0.0, ("m",))
    assert not contribution_vanishes(exp(-weights), weights, 0.0, 0.0, ("m",))  # exp(-0) = 1
    assert not contribution_vanishes(weights + Const(2.0), weights, 0.0, 0.0, ("m",))


# --------------------------------------------------------------------------- SymPy bridge


def test_to_sympy_abstracts_non_running_parts():
    g = exp(S_IJ * Param("scale") - M) * V_JE
    sym, table = S.to_sympy(g, {"m"})
    assert set(table.running) == {"m"}
    assert len(table.opaque) == 2  # s*scale and v (only the parts that matter are translated)
    assert sym.has(table.old("m"))


def test_sympy_round_trip():
    t = sp.Symbol("t", real=True)
    table = S.SymbolTable()
    r, r2 = table.old("m"), table.new("m")
    c = table.constant(Param("scale"))
    for value in (t * sp.exp(r - r2), t + r - r2, t * r / r2, 2 ** (c * (r - r2)) * t, sp.Max(t, r), -t * r,
                  t * sp.log(r2) ** 2, sp.tanh(r) - t):
        back = S.from_sympy(value, table)
        again, _ = S.to_sympy(back, set(), table)
        assert S.is_zero(again - value), (value, format_expr(back))


def test_simplify_folds_constants():
    e = Binary("add", Binary("mul", Const(2), Const(3)), Unary("neg", Const(1)))
    assert simplify(e) == Const(5)
    x = ld("x", "i")
    assert simplify(x * Const(1) + Const(0)) == x
    assert simplify(Where(Const(True), x, Const(0.0))) == x
    assert simplify(Binary("and", Const(True), Binary("gt", x, Const(0)))) == Binary("gt", x, Const(0))


# --------------------------------------------------------------------------- printer


@pytest.mark.parametrize(("expr", "text"), [
    (Binary("pow", Binary("pow", Param("a"), Param("b")), Param("c")), "(a ** b) ** c"),
    (Binary("pow", Param("a"), Binary("pow", Param("b"), Param("c"))), "a ** b ** c"),
    (Binary("pow", Unary("neg", Param("a")), Const(2)), "(-a) ** 2"),
    (Binary("pow", Param("a"), Unary("neg", Param("b"))), "a ** -b"),
    (Unary("neg", Param("a") * Param("b")), "-(a * b)"),
    (Param("a") - (Param("b") - Param("c")), "a - (b - c)"),
    ((Param("a") - Param("b")) - Param("c"), "a - b - c"),
    (Param("a") / (Param("b") * Param("c")), "a / (b * c)"),
    (Param("a") * Param("b") / Param("c"), "a * b / c"),
    (Where(Binary("ge", Index("q"), Index("k")), Const(1.0), NEG_INF), "where(q >= k, 1.0, -inf)"),
    (Binary("max", Param("a"), Const(math.inf)), "max(a, inf)"),
])
def test_printer(expr, text):
    assert format_expr(expr) == text
    # the text of expressions in Python operators evaluates back to the same value
    if "where" not in text and "max" not in text:
        assert math.isclose(eval(text, {"a": 1.5, "b": 2.0, "c": 3.0}), _eval(expr, a=1.5, b=2.0, c=3.0))


def _eval(expr: Expr, **env: float) -> float:
    if isinstance(expr, Param):
        return env[expr.name]
    if isinstance(expr, Const):
        return float(expr.value)
    if isinstance(expr, Unary):
        assert expr.op == "neg"
        return -_eval(expr.x, **env)
    assert isinstance(expr, Binary)
    a, b = _eval(expr.a, **env), _eval(expr.b, **env)
    return {"add": a + b, "sub": a - b, "mul": a * b, "div": a / b, "pow": a**b}[expr.op]


def _nodes(expr: Expr) -> list[Expr]:
    from neptune_fusion.ir.expr import walk

    return list(walk(expr))


def test_softmax_entropy_map_splits_into_shifted_basis_sums():
    """exp(c - m) * log(exp(c - m) / l) = c exp(c - m) - (m + log l) exp(c - m): each basis keeps
    the shift exp(c - m), whose repair is multiplicative; the split is exact."""
    e = exp(X_IJ - M)
    g = e * Unary("log", e / L)
    assert polynomial_split(g, ("l", "m")) is None
    split = separable_split(g, "j", ("l", "m"))
    assert split is not None and len(split.terms) == 2
    for _, basis in split.terms:
        derive_repair("basis", "sum", "j", _as_loads(basis), ("m",))  # each basis has a repair
    # the recombination equals the map at random values (m, l as running values)
    rng = torch.Generator().manual_seed(3)
    x, m, lv = torch.randn(5, generator=rng).double(), 0.7, 2.5
    env = {"x": x, "m": m, "l": lv}
    recombined = sum(_evaluate(mono, env) * _evaluate(basis, env) for mono, basis in split.terms)
    expected = torch.exp(x - m) * torch.log(torch.exp(x - m) / lv)
    torch.testing.assert_close(recombined, expected)


def test_separable_split_refuses_factors_no_rescaling_repairs():
    g = exp(X_IJ - M) * Unary("log", X_IJ - M)
    assert separable_split(g, "j", ("m",)) is None


def _as_loads(expr: Expr) -> Expr:
    from neptune_fusion.ir.expr import transform_bottom_up

    return transform_bottom_up(expr, lambda n: ld(n.stage, "i") if isinstance(n, Running) else None)


def _evaluate(expr: Expr, env: dict[str, object]) -> torch.Tensor:
    def go(n: Expr):
        if isinstance(n, Running):
            return torch.tensor(env[n.stage], dtype=torch.float64)
        if isinstance(n, Load):
            return env[n.buffer] if n.buffer == "x" else torch.tensor(env[n.buffer], dtype=torch.float64)
        if isinstance(n, Const):
            return torch.tensor(float(n.value), dtype=torch.float64)
        if isinstance(n, Unary):
            return {"exp": torch.exp, "log": torch.log, "neg": torch.neg}[n.op](go(n.x))
        if isinstance(n, Binary):
            a, b = go(n.a), go(n.b)
            return {"add": a + b, "sub": a - b, "mul": a * b, "div": a / b}[n.op]
        raise TypeError(n)

    return go(expr)


def test_max_of_normalised_weights_needs_a_positive_normaliser():
    """max_j exp(x_j - m) * y_j / l: the repair t * (l / l') * exp(m - m') is monotone only if
    l / l' >= 0, which holds when l sums a positive map (a softmax normaliser)."""
    g = exp(X_IJ - M) * ld("y", "i", "j") / L
    with pytest.raises(FusionError, match="not provably monotone"):
        derive_repair("w", "max", "j", g, ("l", "m"))
    h = derive_repair("w", "max", "j", g, ("l", "m"), frozenset({"l"})).h
    assert "l.old" in format_expr(h) and "m.old" in format_expr(h)


def test_max_scaled_by_the_root_of_a_sum_of_squares_needs_its_sign():
    """max_j x_j * g_j * sqrt(s + eps): the repair t * sqrt(s' + eps) / sqrt(s + eps) is monotone
    only if s >= 0, which a sum of squares is (its running value too, from 0 on)."""
    s = ld("s", "i")
    g = X_IJ * ld("g", "j") * Unary("sqrt", Binary("add", s, Const(1e-5)))
    with pytest.raises(FusionError, match="not provably monotone"):
        derive_repair("w", "max", "j", g, ("s",))
    h = derive_repair("w", "max", "j", g, ("s",), nonnegative=frozenset({"s"})).h
    assert "s.old" in format_expr(h) and "s.new" in format_expr(h)


def test_positive_maps():
    from neptune_fusion.algebra.repair import positive_map

    assert positive_map(exp(X_IJ - M), ("m",))
    assert positive_map(exp(X_IJ - M) / L, ("l", "m"), frozenset({"l"}))
    assert not positive_map(exp(X_IJ - M) / L, ("l", "m"))  # l's sign unknown
    assert not positive_map(X_IJ * X_IJ, ())  # 0 for x = 0
