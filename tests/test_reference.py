"""The reference executor on hand-built Programs: gathers, int and bool inputs, params, errors,
and fused loops (rolling and split-K) with explicit repair terms."""

from __future__ import annotations

import math

import pytest
import torch

import neptune_fusion as nf
from neptune_fusion.ir.expr import (
    Accumulator,
    Binary,
    Cast,
    Const,
    Index,
    Load,
    Param,
    Reduce,
    Running,
    Unary,
    Where,
)
from neptune_fusion.ir.printer import format_program
from neptune_fusion.ir.program import FusedLoop, InputBuffer, OutputSpec, Program, Stage


def ld(name: str, *axes: str) -> Load:
    return Load(name, tuple(Index(a) for a in axes))


def prog(inputs, stages, outputs, params=(), name="p") -> Program:
    p = Program(name, tuple(inputs), tuple(params), tuple(stages), tuple(outputs))
    p.validate()
    return p


def test_gather_with_index_expression(randn, randint):
    # out[i, e] = table[idx[i], e]: a Load whose index is another load
    table, idx = randn(7, 3), randint(0, 7, 5)
    p = prog(
        [InputBuffer("table", ("t", "e")), InputBuffer("idx", ("i",), "int")],
        [Stage("out", ("i", "e"), Load("table", (ld("idx", "i"), Index("e"))))],
        [OutputSpec("out", ("i", "e"))],
    )
    torch.testing.assert_close(nf.run_reference(p, {"table": table, "idx": idx}), table[idx])
    # int32 indices work too
    torch.testing.assert_close(nf.run_reference(p, {"table": table, "idx": idx.int()}), table[idx])


def test_gather_with_affine_index(randn):
    # reversed rows: out[i, j] = x[i, n - 1 - j]
    x = randn(3, 6)
    p = prog(
        [InputBuffer("x", ("i", "j"))],
        [Stage("out", ("i", "j"), Load("x", (Index("i"), Binary("sub", Const(5), Index("j")))))],
        [OutputSpec("out", ("i", "j"))],
    )
    torch.testing.assert_close(nf.run_reference(p, {"x": x}), x.flip(-1))


def test_document_mask_with_int_input_loaded_at_two_axes(randn):
    # max over keys in the same document: doc ids read once at the query and once at the key
    s = randn(6, 6)
    doc = torch.tensor([0, 0, 1, 1, 1, 2])
    same = Binary("eq", ld("doc", "q"), ld("doc", "k"))
    p = prog(
        [InputBuffer("s", ("q", "k")), InputBuffer("doc", ("q",), "int")],
        [Stage("m", ("q",), Reduce("max", "k", Where(same, ld("s", "q", "k"), Const(-math.inf))))],
        [OutputSpec("m", ("q",))],
    )
    mask = doc[:, None] == doc[None, :]
    torch.testing.assert_close(nf.run_reference(p, {"s": s, "doc": doc}), s.masked_fill(~mask, -math.inf).amax(-1))


def test_bool_mask_input_and_count(randn):
    x = randn(4, 5)
    mask = x > 0
    p = prog(
        [InputBuffer("x", ("i", "j")), InputBuffer("mask", ("i", "j"), "bool")],
        [
            Stage("n", ("i",), Reduce("sum", "j", ld("mask", "i", "j"))),
            Stage("s", ("i",), Reduce("sum", "j", Where(ld("mask", "i", "j"), ld("x", "i", "j"), Const(0.0)))),
            Stage("mean", ("i",), ld("s", "i") / ld("n", "i")),
        ],
        [OutputSpec("mean", ("i",)), OutputSpec("n", ("i",))],
    )
    mean, n = nf.run_reference(p, {"x": x, "mask": mask})
    torch.testing.assert_close(n, mask.sum(-1).float())
    torch.testing.assert_close(mean, (x * mask).sum(-1) / mask.sum(-1))


def test_params_float_and_int(randn):
    x = randn(3, 4)
    p = prog(
        [InputBuffer("x", ("i", "j"))],
        [Stage("y", ("i", "j"), ld("x", "i", "j") * Param("scale") + Param("shift"))],
        [OutputSpec("y", ("i", "j"))],
        params=("scale", "shift"),
    )
    torch.testing.assert_close(nf.run_reference(p, {"x": x, "scale": 0.5, "shift": 3}), x * 0.5 + 3)
    with pytest.raises(ValueError, match="missing scalar parameter 'shift'"):
        nf.run_reference(p, {"x": x, "scale": 0.5})


def test_shape_errors(randn):
    p = prog(
        [InputBuffer("a", ("i", "j")), InputBuffer("b", ("j", "k"))],
        [Stage("c", ("i", "k"), Reduce("sum", "j", ld("a", "i", "j") * ld("b", "j", "k")))],
        [OutputSpec("c", ("i", "k"))],
    )
    a, b = randn(2, 3), randn(3, 4)
    torch.testing.assert_close(nf.run_reference(p, {"a": a, "b": b}), a @ b)
    with pytest.raises(ValueError, match=r"input 'b' dim 0 has size 5, but it indexes axis 'j' of size 3"):
        nf.run_reference(p, {"a": a, "b": randn(5, 4)})
    with pytest.raises(ValueError, match=r"input 'b' must have rank 2"):
        nf.run_reference(p, {"a": a, "b": randn(3, 4, 1)})
    with pytest.raises(ValueError, match="missing input 'b'"):
        nf.run_reference(p, {"a": a})
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        nf.run_reference(p, {"a": a, "b": b.tolist()})


def test_traced_program_shape_mismatch(randn):
    @nf.program
    def f(q, k):
        return nf.einsum("qd,kd->qk", q, k)

    p = f.trace(randn(3, 4), randn(5, 4))
    with pytest.raises(ValueError, match="axis 'd'"):
        nf.run_reference(p, {"q": randn(3, 4), "k": randn(5, 6)})


def test_reducers_and_broadcast_bodies(randn):
    x, a = randn(3, 5), randn(3)
    p = prog(
        [InputBuffer("x", ("i", "j")), InputBuffer("a", ("i",))],
        [
            Stage("pr", ("i",), Reduce("prod", "j", ld("x", "i", "j"))),
            Stage("mn", ("i",), Reduce("min", "j", ld("x", "i", "j"))),
            # bodies that do not depend on the reduce axis: n * value
            Stage("sc", ("i",), Reduce("sum", "j", ld("a", "i") * ld("a", "i"))),
            Stage("mx", ("i",), Reduce("max", "j", ld("a", "i"))),
            Stage("cnt", ("i",), Reduce("sum", "j", Const(1.0))),
        ],
        [OutputSpec(n, ("i",)) for n in ("pr", "mn", "sc", "mx", "cnt")],
    )
    pr, mn, sc, mx, cnt = nf.run_reference(p, {"x": x, "a": a})
    torch.testing.assert_close(pr, x.prod(-1))
    torch.testing.assert_close(mn, x.amin(-1))
    torch.testing.assert_close(sc, 5 * a * a)
    torch.testing.assert_close(mx, a)
    torch.testing.assert_close(cnt, torch.full((3,), 5.0))


def test_nested_reduce_shadowing_the_same_axis(randn):
    # out[q, k] = sum_d(sum_d(q[q,d] k[k,d]) * q[q,d]); the inner d shadows the outer one
    q, k = randn(3, 4), randn(5, 4)
    inner = Reduce("sum", "d", ld("q", "q", "d") * ld("k", "k", "d"))
    p = prog(
        [InputBuffer("q", ("q", "d")), InputBuffer("k", ("k", "d"))],
        [Stage("o", ("q", "k"), Reduce("sum", "d", inner * ld("q", "q", "d")))],
        [OutputSpec("o", ("q", "k"))],
    )
    torch.testing.assert_close(nf.run_reference(p, {"q": q, "k": k}), (q @ k.T) * q.sum(-1, keepdim=True))


def test_output_permutation_and_size_one_dims(randn):
    x = randn(2, 3)
    p = prog(
        [InputBuffer("x", ("i", "j"))],
        [Stage("y", ("i", "j"), Unary("exp", ld("x", "i", "j")))],
        [OutputSpec("y", ("j", None, "i"))],
    )
    torch.testing.assert_close(nf.run_reference(p, {"x": x}), x.exp().T[:, None, :])


def test_cast_and_int_arithmetic(randn):
    x = randn(4, 4) * 3
    p = prog(
        [InputBuffer("x", ("i", "j"))],
        [
            Stage("h", ("i", "j"), Cast(ld("x", "i", "j"), "f16")),
            Stage("t", ("i", "j"), Cast(ld("x", "i", "j"), "i32") + Binary("mod", Index("i") * 7, Const(3))),
        ],
        [OutputSpec("h", ("i", "j")), OutputSpec("t", ("i", "j"))],
    )
    h, t = nf.run_reference(p, {"x": x})
    torch.testing.assert_close(h, x.half().float(), atol=0, rtol=0)
    torch.testing.assert_close(t, (x.int() + (torch.arange(4)[:, None] * 7) % 3).float())


# --------------------------------------------------------------------------- fused loops


def softmax_stages():
    s = ld("x", "i", "j")
    m = Stage("m", ("i",), Reduce("max", "j", s))
    l_ = Stage("l", ("i",), Reduce("sum", "j", Unary("exp", s - ld("m", "i"))))
    u = Stage("u", ("i", "e"), Reduce("sum", "j", Unary("exp", s - ld("m", "i")) * ld("v", "j", "e")))
    o = Stage("o", ("i", "e"), ld("u", "i", "e") / ld("l", "i"))
    return m, l_, u, o


def softmax_program(mode: str | None, splits: int = 1, repair=None) -> Program:
    m, l_, u, o = softmax_stages()
    inputs = [InputBuffer("x", ("i", "j")), InputBuffer("v", ("j", "e"))]
    if mode is None:
        return prog(inputs, [m, l_, u, o], [OutputSpec("o", ("i", "e"))])
    h = Accumulator() * Unary("exp", Running("m", "old") - Running("m", "new")) if repair is None else repair
    loop = FusedLoop("loop", "j", (m, l_, u), {"m": (), "l": ("m",), "u": ("m",)},
                     {"m": None, "l": h, "u": h}, mode, splits)
    return prog(inputs, [loop, o], [OutputSpec("o", ("i", "e"))])


@pytest.mark.parametrize("block", [1, 2, 3, 8, 64])
def test_hand_built_rolling_loop(randn, block):
    x, v = randn(4, 11, scale=3.0), randn(11, 5)
    args = {"x": x, "v": v}
    expected = torch.softmax(x, -1) @ v
    torch.testing.assert_close(nf.run_reference(softmax_program(None), args), expected)
    torch.testing.assert_close(nf.run_reference(softmax_program("rolling"), args, block=block), expected)
    text = format_program(softmax_program("rolling"))
    assert "rolling loop over j" in text and "t <- t * exp(m.old - m.new)" in text


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 20])
def test_hand_built_split_k_loop(randn, splits):
    x, v = randn(4, 11, scale=3.0), randn(11, 5)
    out = nf.run_reference(softmax_program("split_k", splits), {"x": x, "v": v}, block=2)
    torch.testing.assert_close(out, torch.softmax(x, -1) @ v)
    assert f"in {splits} chunks" in format_program(softmax_program("split_k", splits))


def test_wrong_repair_is_caught_by_the_executor(randn):
    # a repair that forgets to rescale gives a different answer: the executor really uses repairs
    x, v = randn(4, 11, scale=3.0), randn(11, 5)
    out = nf.run_reference(softmax_program("rolling", repair=Accumulator()), {"x": x, "v": v}, block=2)
    assert not torch.allclose(out, torch.softmax(x, -1) @ v, atol=1e-3)


def test_fused_loop_member_without_repair_is_an_error(randn):
    m, l_, u, o = softmax_stages()
    loop = FusedLoop("loop", "j", (m, l_), {"m": (), "l": ("m",)}, {"m": None, "l": None})
    p = prog([InputBuffer("x", ("i", "j"))], [loop], [OutputSpec("l", ("i",))])
    with pytest.raises(ValueError, match="has producers but no repair"):
        nf.run_reference(p, {"x": randn(2, 3)})


def test_program_validation_and_lookup():
    s = Stage("a", ("i",), ld("b", "i"))
    with pytest.raises(ValueError, match=r"reads \['b'\] before they are defined"):
        prog([InputBuffer("x", ("i",))], [s], [OutputSpec("a", ("i",))])
    with pytest.raises(ValueError, match="is not a stage"):
        prog([InputBuffer("x", ("i",))], [], [OutputSpec("zz", ("i",))])
    p = softmax_program("rolling")
    assert p.stage("u").reduce_op == "sum" and p.stage("m").reduce_axis == "j"
    assert isinstance(p.producer_of("l"), FusedLoop)
    assert [n.name for n in p.consumers("u")] == ["o"]
    with pytest.raises(KeyError):
        p.stage("nope")
    with pytest.raises(KeyError):
        p.input("nope")


def test_fingerprint_is_stable_and_structural():
    a, b = softmax_program(None), softmax_program(None)
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != softmax_program("rolling").fingerprint()
    assert softmax_program("split_k", 2).fingerprint() != softmax_program("split_k", 3).fingerprint()
