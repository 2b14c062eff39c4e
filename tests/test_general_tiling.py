"""The tile layer beyond attention's shape, under the interpreter, each against the reference executor.

Axes too long to hold whole are tiled across the grid (a matmul's output axis) or walked by an
inner loop (a long contraction); a reduction to a single value lowers with a row axis of extent
1 and split-K; a program whose reductions cannot share one loop runs as several kernels. None of
the programs is known to the compiler by name.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.library import (  # noqa: E402
    attention,
    layernorm,
    layernorm_matmul,
    linear_cross_entropy,
    linear_logsumexp,
    rmsnorm,
    rmsnorm_matmul,  # noqa: E402
    softmax_pooling,
)
from neptune_fusion.library import logsumexp as logsumexp_rows  # noqa: E402
from neptune_fusion.library import softmax as softmax_1d  # noqa: E402
from neptune_fusion.runtime.compiled import Compiled  # noqa: E402
from neptune_fusion.schedule.auto import Plan, choose  # noqa: E402
from neptune_fusion.schedule.partition import partition, why_apart  # noqa: E402
from neptune_fusion.schedule.pipeline import fuse  # noqa: E402
from neptune_fusion.schedule.templates import Auto  # noqa: E402
from neptune_fusion.schedule.tiles import MAX_WHOLE, choose_tiling  # noqa: E402
from neptune_fusion.tile.lower import assign_roles  # noqa: E402
from neptune_fusion.transform.layout import UNIT_ROW, needs_unit_row, with_unit_row  # noqa: E402

TOL = {torch.float32: 2e-4, torch.float16: 2e-2}


@nf.program
def softmax_then_column_sum(x):
    e = nf.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).sum(axis=0)


@nf.program
def column_normalised_softmax(x):
    y = x / (x * x).sum(axis=0, keepdims=True)
    e = nf.exp(y - y.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _check(prog, args: tuple, dtype: torch.dtype = torch.float32, equal_nan: bool = False, **kwargs) -> Compiled:
    """Compile and run `prog`, compare with the reference executor on the fp32 inputs (`equal_nan`:
    NaN must sit where the reference's does)."""
    fn = nf.compile(prog, **kwargs)
    cast = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    out = fn(*cast)
    traced = prog.trace(*args)
    ref = nf.run_reference(traced, dict(prog.bind(*args)))
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    for o, r in zip(outs, refs):
        assert o.shape == r.shape
        torch.testing.assert_close(o.float(), r.float(), rtol=TOL[dtype], atol=TOL[dtype], equal_nan=equal_nan)
    return fn


def _kernels(fn: Compiled) -> list:
    exe = next(iter(fn._cache.values()))
    return [k for k in (exe.main, exe.combine) if k is not None]


def test_tiling_decisions_come_from_sizes_and_uses(randn):
    """Short axes stay whole (attention unchanged); a long output axis is tiled across the grid; a
    long contraction gets an inner loop."""
    fused = fuse(attention.trace(randn(1, 2, 64, 64), randn(1, 2, 64, 64), randn(1, 2, 64, 64), 0.1))[-1].program
    whole = choose_tiling(fused, {"d": 128, "d2": 128}, 64, 64)
    assert not whole.tiled and whole.block("d") == 128
    tiled = choose_tiling(fused, {"d": 2048, "d2": 4096}, 128, 64)
    assert tiled.loops == ("d",) and tiled.grid == ("d2",)
    assert tiled.block("d") <= 64 and tiled.block("d2") <= 128


def _group_tiles(fn: Compiled) -> list[list]:
    """Per kernel group of a partitioned program's executable: its kernels' tiles."""
    exe = next(e for e in fn._cache.values() if e.groups)
    return [[k.tile for k in (g.main, g.combine) if k is not None] for _, g in exe.groups]


def _has_dot(tile) -> bool:
    return any(op.kind == "dot" for op in _walk_ops(tile.body))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("prog", [rmsnorm_matmul, layernorm_matmul], ids=["rmsnorm", "layernorm"])
def test_norm_then_matmul_with_long_axes(prog, dtype, randn):
    """(x normalised over k) @ W with k and the output axis e both above 512: under every tile of
    e the norm's statistics would be computed again, so a first kernel streams them over x once
    and a second one is the matmul, reading them."""
    x, w = randn(16, 576), randn(576, 640, scale=0.05)
    fn = _check(prog, (x, w), dtype)
    stats, matmul = _group_tiles(fn)  # (the statistics' kernel may be split over k, with its combine)
    assert not any(map(_has_dot, stats)) and _has_dot(matmul[0])
    assert "lack the axis ['e']" in why_apart(prog.trace(x, w), frozenset({"k", "e"}))
    assert len(partition(prog.trace(x, w), frozenset())) == 1  # short axes: one kernel, as before


@pytest.mark.parametrize("schedule", [nf.flash(), nf.split_k(splits=3)], ids=["flash", "split_k"])
def test_norm_then_matmul_one_pass_or_split(schedule, randn):
    """The same with each template; under split-K the matmul's kernel gets its combine."""
    fn = _check(rmsnorm_matmul, (randn(40, 600), randn(600, 700, scale=0.05)), schedule=schedule)
    groups = _group_tiles(fn)
    assert len(groups) == 2 and _has_dot(groups[1][0])
    assert len(groups[1]) == (2 if isinstance(schedule, nf.SplitK) else 1)


def test_batched_norm_then_matmul_and_narrowed_grid_tiles(randn):
    """A batch axis and a grid-tiled axis share the grid's second axis; with several accumulators
    over the tiled axis its tiles are narrowed until the loop state fits in registers."""

    @nf.program
    def two_matmuls(x, w, u):
        r = nf.sqrt((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-6)
        return nf.einsum("bik,bke->bie", x / r, w), nf.einsum("bik,bke->bie", x, u)

    x, w, u = randn(2, 24, 300), randn(2, 300, 700, scale=0.05), randn(2, 300, 700, scale=0.05)
    fused = fuse(two_matmuls.trace(x, w, u))[-1].program
    wide = choose_tiling(fused, {"e": 700}, 128, 64, num_warps=8)
    narrow = choose_tiling(fused, {"e": 700}, 128, 64, num_warps=1)
    assert wide.grid == narrow.grid == ("e",) and narrow.block("e") < wide.block("e")
    _check(two_matmuls, (x, w, u), schedule=nf.flash())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_logsumexp_with_long_model_dim(dtype, randn):
    """logsumexp_v(H W^T): each score tile is an inner loop over d (640) inside the loop over v."""
    fn = _check(linear_logsumexp, (randn(8, 640, scale=0.2), randn(1100, 640, scale=0.2)), dtype)
    source = _kernels(fn)[0].source
    assert "inner loop over 'd'" in source


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_cross_entropy_gathered_target(dtype, randn, randint):
    """lse - logit[target]: the target's logit is an inner loop over d beside the loop over v."""
    fn = _check(linear_cross_entropy,
                (randn(8, 640, scale=0.2), randn(1100, 640, scale=0.2), randint(0, 1100, 8)), dtype)
    assert all(k.tile.tiled_axes == ("d",) for k in _kernels(fn))


@pytest.mark.parametrize("schedule", [None, nf.flash()], ids=["auto", "flash"])
def test_probabilities_of_a_linear_layer(schedule, randn):
    """softmax_v(H W^T) as an output: the second pass over v recomputes each score tile with its
    own inner loop over d (in the split-K combine under auto, in the one kernel under flash)."""

    @nf.program
    def linear_softmax(h, w):
        s = nf.einsum("id,vd->iv", h, w)
        e = nf.exp(s - s.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    h, w = randn(8, 640, scale=0.2), randn(300, 640, scale=0.2)
    torch.testing.assert_close(nf.compile(linear_softmax, schedule=schedule)(h, w), torch.softmax(h @ w.T, -1),
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("cols", [512, 700], ids=["whole-tiles", "partial-last-tile"])
def test_a_second_pass_masks_only_its_partial_last_tile(cols, randn):
    """A row normalisation written out: the second pass walks whole tiles without the column mask
    (a mask along the contiguous axis would make every access element-wise), then the partial
    last tile with it; both together write every element once."""

    @nf.program
    def rms_rows(x):
        return x / nf.sqrt((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-6)

    x = randn(48, cols)
    fn = _check(rms_rows, (x,), schedule=nf.flash(block_q=16, block_k=128))
    source = _kernels(fn)[0].source
    whole = source.split("# second pass over")[1].split("# second pass over")[0]
    assert "whole tiles" in whole and "tl.store" in whole and "< size_" not in whole
    assert "the partial last tile" in source


def test_softmax_over_one_row_of_100k(randn):
    """A softmax whose max and sum are single values: a row axis of extent 1 and split-K."""
    x = randn(100_000, scale=3.0)
    fn = nf.compile(softmax_1d)
    torch.testing.assert_close(fn(x), torch.softmax(x, -1), rtol=1e-4, atol=1e-8)
    exe = next(iter(fn._cache.values()))
    assert exe.plan.splits > 1
    assert UNIT_ROW in exe.main.program.derived_axes


@pytest.mark.parametrize("shape", [(100_000,), (1, 100_000)], ids=["single-value", "one-row"])
def test_logsumexp_of_one_row_of_100k(shape, randn):
    """Over a vector the logsumexp is a 0-d output; over a matrix of one row, a row of extent 1."""
    x = randn(*shape, scale=3.0)
    out = nf.compile(logsumexp_rows)(x)
    assert out.shape == x.shape[:-1]
    torch.testing.assert_close(out, torch.logsumexp(x, -1), rtol=1e-5, atol=1e-5)


def test_max_over_everything(randn):
    """The max of a matrix: a max over columns per row, then over the rows as a single value (a
    second kernel, with a row axis of extent 1)."""

    @nf.program
    def total_max(x):
        return x.max(axis=-1).max(axis=-1)

    x = randn(60, 300)
    fn = nf.compile(total_max)
    out = fn(x)
    assert out.shape == ()
    torch.testing.assert_close(out, x.max())
    assert any(len(exe.groups) == 2 for exe in fn._cache.values())


def test_unit_row_translation_validation(randn):
    x = randn(300)
    fused = fuse(softmax_1d.trace(x))[-2].program
    assert needs_unit_row(fused)
    with_row = with_unit_row(fused)
    assert assign_roles(with_row).row == UNIT_ROW
    torch.testing.assert_close(nf.run_reference(with_row, {"x": x}), nf.run_reference(fused, {"x": x}))


def _run_groups(groups, args: dict) -> list:
    """The groups run one after the other by the reference executor."""
    known = dict(args)
    for group in groups:
        names = [b.name for b in group.program.inputs] + list(group.program.params)
        out = nf.run_reference(group.program, {n: known[n] for n in names})
        known.update(zip(group.results, out if isinstance(out, tuple) else (out,)))
    return [known[f"output:{j}"] for j in range(sum(r.startswith("output:") for g in groups for r in g.results))]


@pytest.mark.parametrize("prog", [softmax_then_column_sum, column_normalised_softmax], ids=["after", "before"])
def test_partition_translation_validation(prog, randn):
    x = randn(24, 40)
    program = prog.trace(x)
    assert why_apart(program) is not None
    groups = partition(program)
    assert len(groups) == 2
    torch.testing.assert_close(_run_groups(groups, {"x": x})[0], nf.run_reference(program, {"x": x}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("prog", [softmax_then_column_sum, column_normalised_softmax], ids=["after", "before"])
def test_program_that_needs_two_kernels(prog, dtype, randn):
    """A reduction over the rows the main loop tiles across programs: two kernels run in order,
    the reductions between them materialised in fp32."""
    fn = _check(prog, (randn(40, 70, scale=2.0),), dtype)
    exe = next(e for e in fn._cache.values() if e.groups)
    assert len(exe.groups) == 2


def test_a_reduction_over_a_held_axis_stays_in_the_kernel(randn):
    """Summing attention's output over its head dim needs no second kernel: the head dim is held
    whole in each program's tile."""

    @nf.program
    def attention_row_sums(q, k, v, scale):
        return attention.fn(q, k, v, scale).sum(axis=-1)

    q, k, v = randn(1, 2, 40, 32), randn(1, 2, 50, 32), randn(1, 2, 50, 16)
    assert why_apart(attention_row_sums.trace(q, k, v, 0.3)) is None
    fn = _check(attention_row_sums, (q, k, v, 0.3))
    assert not any(exe.groups for exe in fn._cache.values())


def test_attention_with_a_long_head_dim(randn):
    """Attention with head dims above 512: the scores' contraction over d is an inner loop and the
    output's e axis is tiled across the grid (the softmax recomputed per tile of e)."""
    q, k, v = randn(1, 1, 20, 600, scale=0.1), randn(1, 1, 50, 600, scale=0.1), randn(1, 1, 50, 520)
    fn = _check(attention, (q, k, v, 0.05), schedule=nf.flash())
    assert set(_kernels(fn)[0].tile.tiled_axes) == {"d", "d2"}


def test_an_axis_both_reduced_and_stored_runs_in_two_kernels(randn):
    """d is summed by the logits and stored by the output, too long to hold whole: the output,
    which reads the log-normaliser, runs in a later kernel (`partition.split_chained`)."""
    @nf.program
    def lse_and_scaled(h, w):
        s = nf.einsum("id,vd->iv", h, w)
        m = s.max(axis=-1, keepdims=True)
        lse = m + nf.log(nf.exp(s - m).sum(axis=-1, keepdims=True))
        return h * lse

    h, w = randn(8, MAX_WHOLE + 8), randn(40, MAX_WHOLE + 8)
    torch.testing.assert_close(nf.compile(lse_and_scaled)(h, w), h * torch.logsumexp(h @ w.T, -1, keepdim=True),
                               rtol=1e-4, atol=1e-4)


def test_explain_prints_every_kernel_of_a_partitioned_program(randn):
    text = nf.explain(softmax_then_column_sum, randn(12, 20))
    assert "kernel 2 of 2" in text and "inner loop" not in text
    assert text.startswith("=== 2 kernels ===\nthe reduction(s) ['sum1'] run over ['a0']")  # why, first


def test_autotune_leaves_a_partitioned_program_to_its_groups_schedules(randn):
    x = randn(20, 30)
    out = nf.compile(softmax_then_column_sum, schedule=nf.autotune())(x)
    torch.testing.assert_close(out, torch.softmax(x, -1).sum(0))


@nf.program
def exp_of_linear(h, w):
    return nf.exp(nf.einsum("id,vd->iv", h, w) * 0.1)


def test_a_matmul_with_an_epilogue_tiles_both_output_axes_and_contracts_with_dot(randn):
    """Neither output axis of a matmul is a batch axis (a program per token would read all of w
    once per token, a matrix-vector product): the tokens are tiled across the grid, the tile's
    contraction over d is a dot."""
    fn = _check(exp_of_linear, (randn(256, 48), randn(80, 48)))
    traced = exp_of_linear.trace(randn(256, 48), randn(80, 48))
    roles = assign_roles(fuse(traced)[-1].program)
    assert roles.batch == () and set(roles.full) | {roles.row} >= {"i", "v"}
    tile = _kernels(fn)[0].tile
    assert any(op.kind == "dot" for op in _walk_ops(tile.body))


def _walk_ops(stmts):
    from neptune_fusion.tile.ir import Loop, Op
    for st in stmts:
        if isinstance(st, Op):
            yield st
        elif isinstance(st, Loop):
            yield from _walk_ops(st.body)


@nf.program
def gram(x):
    return nf.einsum("id,jd->ij", x, x)


@nf.program
def self_attention_of_one_input(x, wq, wk, wv):
    q, k, v = (nf.einsum("id,de->ie", x, w) for w in (wq, wk, wv))
    s = nf.einsum("ie,je->ij", q, k) * 0.125
    e = nf.exp(s - s.max(axis=-1, keepdims=True))
    return nf.einsum("ij,je->ie", e / e.sum(axis=-1, keepdims=True), v)


def test_one_tensor_under_two_letters_is_two_axes(randn):
    """Distinct einsum letters are distinct indices even over the same tensor: a Gram matrix
    x @ x^T, and attention whose queries, keys and values are projections of one x (their rows
    are one dimension of x, as the keys' and the queries' axes they are two)."""
    x = randn(50, 24)
    traced = gram.trace(x)
    assert traced.stages[0].axes == ("i", "j") and traced.axis_sizes["j"] == ("x", 0)
    _check(gram, (x,))
    torch.testing.assert_close(nf.compile(gram)(x), x @ x.T, rtol=1e-4, atol=1e-4)
    w = [randn(24, 16) * 0.2 for _ in range(3)]
    _check(self_attention_of_one_input, (x, *w))
    q, k, v = (x @ t for t in w)
    want = torch.softmax(q @ k.T * 0.125, -1) @ v
    torch.testing.assert_close(nf.compile(self_attention_of_one_input)(x, *w), want, rtol=1e-4, atol=1e-4)


@nf.program
def cosine_similarity(x):
    y = x / nf.sqrt((x * x).sum(axis=-1, keepdims=True))
    return nf.einsum("id,jd->ij", y, y)


def test_a_norm_read_under_the_other_letter_is_computed_for_it(randn):
    """Cosine similarity of x's rows: each row's norm is read at i and at j; the loop over d
    computes it for both (a copy of the reduction over j), in one kernel."""
    x = randn(50, 24)
    fn = _check(cosine_similarity, (x,))
    y = x / x.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(fn(x), y @ y.T, rtol=1e-4, atol=1e-4)
    assert len(_kernels(fn)) == 1


def _roles(prog, *args):
    return assign_roles(fuse(prog.trace(*args))[-1].program)


def test_streaming_loops_are_told_from_contractions_and_second_passes(randn, randint):
    """A loop whose loads all carry the row axis streams memory (each element serves one row);
    attention's keys, a matmul's weight and a vocabulary matrix are shared by a tile's rows; a
    softmax's probabilities need a second pass over the row."""
    x = randn(64, 300)
    assert _roles(softmax_pooling, x, randn(64, 300)).streams
    assert _roles(logsumexp_rows, x).streams
    assert _roles(softmax_1d, x).streams and _roles(softmax_1d, x).rereads
    assert not _roles(logsumexp_rows, x).rereads
    q = randn(1, 2, 64, 32)
    assert not _roles(attention, q, q, q, 0.1).streams
    assert not _roles(linear_logsumexp, randn(64, 32), randn(600, 32)).streams
    assert not _roles(linear_cross_entropy, randn(64, 32), randn(600, 32), randint(0, 600, 64)).streams
    assert not _roles(rmsnorm_matmul, randn(64, 600), randn(600, 640)).streams


def test_a_matmul_loop_is_a_k_loop_and_takes_k_steps(randn):
    """A loop that only sums products of loaded tiles (a matmul) is a K-loop: its tile is a K-step
    of MAX_K_BLOCK on the GPU; attention's loop computes scores per key first and keeps its tiles."""
    from neptune_fusion.schedule.tiles import MAX_K_BLOCK

    assert _roles(gram, randn(600, 32)).k_loop  # x x^T: the loop runs over the contracted d
    q = randn(1, 2, 64, 32)
    assert not _roles(attention, q, q, q, 0.1).k_loop
    common = dict(rows=8192, cols=4096, batch=1, full_sizes={"e": 128}, dtype="f16", num_sms=132, interpreter=False)
    assert choose(Auto(), k_loop=True, **common).block_col == MAX_K_BLOCK
    assert choose(Auto(), **common).block_col == 128


def test_streaming_plans_take_many_small_programs():
    """For the GPU: a streaming loop gets 16 x 128 tiles, 4 warps (1024 programs over 16384
    rows), where a contraction keeps 128-row tiles; few rows still split the loop."""
    common = dict(cols=8192, batch=1, full_sizes={}, num_sms=132, interpreter=False)
    stream = choose(Auto(), rows=16384, dtype="f16", streams=True, **common)
    assert (stream.block_row, stream.block_col, stream.num_warps, stream.splits) == (16, 128, 4, 1)
    shared = choose(Auto(), rows=16384, dtype="f16", **{**common, "full_sizes": {"d": 128}})
    assert shared.block_row == 128
    few = choose(Auto(), rows=64, dtype="f16", streams=True, **common)
    assert few.splits > 1 and few.block_row == 16 and few.block_col == 128
    # 2048 rows: 128 programs of 16, split until about four share each multiprocessor
    assert choose(Auto(), rows=2048, dtype="f16", streams=True, **common).splits == 4
    # a second pass over each row: a row that fits 64 values a thread is held whole (read once):
    # two rows of 4096 at 4 warps, one of 8192 at 4, one of 16384 at 8; a longer row keeps the
    # streaming tile and reads its rows twice
    def second_pass(cols: int) -> tuple[int, int, int, int]:
        plan = choose(Auto(), rows=16384, dtype="f16", streams=True, rereads=True, **{**common, "cols": cols})
        return plan.block_row, plan.block_col, plan.num_warps, plan.splits

    assert second_pass(4096) == (2, 4096, 4, 1)
    assert second_pass(3000) == (2, 4096, 4, 1)
    assert second_pass(8192) == (1, 8192, 4, 1)
    assert second_pass(16384) == (1, 16384, 8, 1)
    assert second_pass(32768) == (16, 128, 4, 1)
    assert second_pass(100) == (64, 128, 4, 1)  # short rows: many to a program


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_streaming_tile_shapes_run_correctly(dtype, randn):
    """The GPU's streaming tile shapes (16 rows x 256 columns, 4 warps) under the interpreter, with
    ragged rows and columns; and split over the columns."""
    args = (randn(40, 700), randn(40, 700))
    _check(softmax_pooling, args, dtype, schedule=nf.flash(block_q=16, block_k=256, num_warps=4, num_stages=2))
    _check(softmax_pooling, args, dtype, schedule=nf.split_k(splits=2, block_q=16, block_k=256, num_warps=4))
    _check(softmax_1d, (randn(40, 700),), dtype, schedule=nf.flash(block_q=16, block_k=256, num_warps=4))


@nf.program
def softmax_weighted_long_values(x, v):
    """softmax(x) over k, then a weighted sum of v's rows: e longer than a tile."""
    p = nf.exp(x - x.max(axis=-1, keepdims=True))
    return nf.einsum("ik,ke->ie", p, v) / p.sum(axis=-1, keepdims=True)


@nf.program
def rmsnorm_and_its_matmul(x, w):
    """Two outputs reading one norm: the normalised x and its matmul."""
    r = nf.sqrt((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-6)
    return x / r, nf.einsum("ik,ke->ie", x / r, w)


@nf.program
def weight_normalised_matmul(x, w):
    """x @ (w / ||w||) with w's columns normalised over k: a statistic without the rows of x."""
    n = nf.sqrt((w * w).sum(axis=0, keepdims=True))
    return nf.einsum("ik,ke->ie", x, w / n)


@pytest.mark.parametrize(("prog", "rows", "cols", "kernels"), [
    (softmax_weighted_long_values, 40, 600, 2), (rmsnorm_and_its_matmul, 40, 600, 2),
    (weight_normalised_matmul, 600, 40, 2),  # w's column norms lack x's rows, tiled across the grid
    (weight_normalised_matmul, 40, 600, 1),  # e is the row axis: each tile computes its own norms once
], ids=["softmax_values", "two_outputs", "weight_norm_long_rows", "weight_norm_long_columns"])
def test_statistics_under_a_grid_tiled_axis_run_once_and_stay_exact(prog, rows, cols, kernels, randn):
    """A chain reduction without a grid-tiled axis (above 512) of another runs first in its own
    kernel; where no tile would compute it again the program stays one kernel. Either way the
    result is the reference's."""
    fn = _check(prog, (randn(rows, 96), randn(96, cols, scale=0.1)))
    grouped = any(e.groups for e in fn._cache.values())
    assert (len(_group_tiles(fn)) if grouped else 1) == kernels


@nf.program
def probabilities_and_their_average(x, v):
    """The softmax itself returned beside the sum it weights: an output read by a reduction."""
    p = nf.exp(x - x.max(axis=-1, keepdims=True)) / nf.exp(x - x.max(axis=-1, keepdims=True)).sum(axis=-1, keepdims=True)
    return p, nf.einsum("ik,ke->ie", p, v)


@pytest.mark.parametrize("prog", [rmsnorm_and_its_matmul, probabilities_and_their_average], ids=["norm", "softmax"])
def test_an_output_that_a_reduction_reads_is_computed_again_for_it(prog, randn):
    """An element-wise output indexed by the loop axis and read by the loop's reductions: the
    readers compute it again inside the loop (it was refused: not inlined into a rolling member),
    the output keeps its own stage."""
    _check(prog, (randn(24, 40), randn(40, 32, scale=0.2)))
    _check(prog, (randn(24, 40), randn(40, 32, scale=0.2)), torch.float16)


def test_matmul_plans_take_wide_output_tiles_and_deep_pipelines():
    """For the GPU: a loop that only sums loaded products (a matmul) takes 128 x 256 output tiles
    (its accumulators are all the loop holds) and as many K-stages as shared memory holds; a loop
    whose tiles each run an inner K-loop (a linear cross-entropy's vocabulary loop) takes 256-wide
    loop tiles where it reads its rows' operand again for every loop tile from HBM (more than L2
    holds)."""
    from neptune_fusion.schedule.auto import INNER_LOOP_TILE, MAX_K_STAGES
    from neptune_fusion.schedule.tiles import ACCUMULATOR_TILE_VALUES, GRID_TILE_VALUES, grid_block

    assert grid_block(128, True) * 128 == ACCUMULATOR_TILE_VALUES and grid_block(128, False) * 128 == GRID_TILE_VALUES
    # (the grid-tiled axis's 32 tiles are programs too: `batch`)
    common = dict(rows=4096, cols=4096, batch=32, full_sizes={"i": 8192}, dtype="f16", num_sms=132, interpreter=False)
    matmul_plan = choose(Auto(), k_loop=True, **common)
    assert (matmul_plan.block_row, matmul_plan.block_col, matmul_plan.num_stages) == (128, 64, MAX_K_STAGES)
    assert choose(Auto(), **common).num_stages == 3  # attention keeps its pipeline
    vocab = dict(common, rows=8192, cols=128256, batch=1, full_sizes={"d": 4096})
    assert choose(Auto(), inner_loop_length=4096, **vocab).block_col == INNER_LOOP_TILE
    assert choose(Auto(), inner_loop_length=4096, **dict(vocab, dtype="f32")).block_col < INNER_LOOP_TILE
    assert choose(Auto(), inner_loop_length=4096, **dict(vocab, interpreter=True)).block_col == 32
    # a wave of programs re-reading less than L2 holds (a head dim of 1024 over 132 row tiles) keeps its tiles
    heads = dict(common, rows=4096, cols=4096, batch=32, full_sizes={"d": 1024})
    assert choose(Auto(), inner_loop_length=1024, **heads).block_col < INNER_LOOP_TILE


@nf.program
def gram_like_matmul(x, w):
    return nf.einsum("ik,ke->ie", x, w)


@pytest.mark.parametrize("prog", ["matmul", "linear_logsumexp"])
def test_tiled_operands_read_through_tensor_descriptors(prog, monkeypatch, randn):
    """K-steps and grid-tiled tiles read through tensor descriptors (both coordinates at run time,
    a block stored the other way round transposed as read) give the reference result, also where
    the lengths are not multiples of the blocks (out-of-range elements read as zero)."""
    monkeypatch.setenv("NEPTUNE_FUSION_TMA", "force")
    if prog == "matmul":
        program, args = gram_like_matmul, (randn(544, 200), randn(200, 48, scale=0.1))
    else:
        program, args = linear_logsumexp, (randn(24, 600), randn(70, 600, scale=0.05))
    # (an explicit schedule: under auto, a 16-bit contraction of two inputs goes to cuBLAS)
    fn = _check(program, args, torch.float16, schedule=nf.flash() if prog == "matmul" else None)
    sources = [k.source for e in fn._cache.values() for k in (e.main, e.combine) if k is not None]
    assert any("make_tensor_descriptor" in s and ".load([" in s for s in sources)



@nf.program
def exp_prologue_matmul(x, g, w):
    return nf.einsum("ik,ke->ie", nf.exp(x * 0.1) * g, w)


def test_a_computed_operand_against_an_unrescaled_accumulator_reads_the_other_through_pointers(monkeypatch, randn):
    """Triton 3.6 miscompiled a K-loop dot with an operand computed from loads and a descriptor-read
    one, at 8 warps and at 4 (NaN rows on the H200): such kernels read their plain operands through
    pointers and give the reference result. Attention's P @ V (its accumulator rescaled) keeps its
    descriptor reads."""
    from neptune_fusion.schedule.pipeline import fuse
    from neptune_fusion.tile.lower import descriptor_hazards

    monkeypatch.setenv("NEPTUNE_FUSION_TMA", "force")
    args = (randn(200, 96), randn(96), randn(96, 48, scale=0.1))
    fused = fuse(exp_prologue_matmul.trace(*args))[-1].program
    assert descriptor_hazards(fused) == {"g", "w"}
    for warps in (8, 4):
        fn = _check(exp_prologue_matmul, args, torch.float16, schedule=nf.flash(block_q=128, block_k=32, num_warps=warps))
        assert not any("make_tensor_descriptor" in k.source for k in _kernels(fn))
    qkv = (randn(1, 2, 64, 64) for _ in range(3))
    assert not descriptor_hazards(fuse(attention.trace(*qkv, 0.1))[-1].program)
    assert not descriptor_hazards(fuse(gram_like_matmul.trace(randn(64, 32), randn(32, 16)))[-1].program)

def test_a_reduction_over_an_empty_axis_is_a_clear_error(randn):
    """A reduction over an axis of length 0 (no terms: torch's sum is 0, its mean nan) is refused
    before anything is compiled, naming the axis (it raised SymPy's `zoo` from the fusion)."""
    with pytest.raises(ValueError, match="reduction axis .* has length 0"):
        nf.compile(softmax_1d)(torch.randn(4, 0))



@nf.program
def banded_softmax_and_lse(x):
    """Row i sees columns j < i - 2 (rows 0-2 see none), and two outputs: the probabilities and
    the log-normaliser."""
    s = nf.where(nf.index(x, -1) < nf.index(x, -2) - 2, x, -nf.inf)
    m = s.max(axis=-1, keepdims=True)
    e = nf.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    return e / total, (m + nf.log(total))[..., 0]


def _whole_loop(fn: Compiled) -> bool:
    return next(iter(fn._cache.values())).record.whole_loop


ONE_TILE = nf.flash(block_q=16, block_k=64, num_warps=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cols", [1, 13, 48, 64])
def test_a_loop_held_in_one_tile_reads_its_row_once(cols, dtype, randn):
    """A row no longer than the loop tile is computed without a loop, and its second pass reuses
    the loop's loads (x is loaded once); 21 rows (not a multiple of the row tile), columns not a
    multiple of 16, against the reference executor."""
    x, g = randn(21, cols), randn(cols)
    fn = _check(rmsnorm, (x, g), dtype, schedule=ONE_TILE)
    source = _kernels(fn)[0].source.split("def nf_rmsnorm(")[1]
    assert _whole_loop(fn) and source.count("tl.load(x_ptr") == 1 and "for " not in source
    assert _whole_loop(_check(layernorm, (x,), dtype, schedule=ONE_TILE))
    assert _whole_loop(_check(softmax_1d, (x,), dtype, schedule=ONE_TILE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_loop_held_in_one_tile_keeps_nan_and_empty_rows(dtype, randn):
    """In one tile as in a loop: a visible NaN makes its row NaN, a masked one does not; rows that
    see no column give what the reference executor gives; the others are exact."""
    x = randn(10, 40)
    x[5, 1] = float("nan")  # visible (row 5 sees columns 0-2)
    x[6, 20] = float("nan")  # masked
    fn = _check(banded_softmax_and_lse, (x,), dtype, schedule=ONE_TILE, equal_nan=True)
    probs, lse = fn(x.to(dtype))
    assert _whole_loop(fn)
    assert torch.isnan(probs[5]).all() and torch.isfinite(probs[6]).all() and torch.isfinite(lse[3:5]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_row_longer_than_the_tile_keeps_its_loop(dtype, randn):
    """One column more than the loop tile: the loop and its second pass stay (x loaded in both)."""
    fn = _check(rmsnorm, (randn(9, 65), randn(65)), dtype, schedule=ONE_TILE)
    assert not _whole_loop(fn) and _kernels(fn)[0].source.count("tl.load(x_ptr") > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_whole_rows_two_to_a_program(dtype, randn):
    """The GPU's plan for long rows with a second pass (a few rows a program, the row whole) under
    the interpreter: 2 rows of 64 columns a program over 7 rows, against the reference."""
    x, g = randn(7, 50), randn(50)
    fn = nf.compile(rmsnorm)
    named = dict(rmsnorm.bind(x.to(dtype), g.to(dtype)))
    run, used = fn._prepare(named, Plan(2, 64, 4, 1, 1))
    out = run(list(named.values()))
    ref = nf.run_reference(rmsnorm.trace(x, g), dict(rmsnorm.bind(x, g)))
    assert used == Plan(2, 64, 4, 1, 1) and _whole_loop(fn)
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


@nf.program
def attention_probabilities(q, k):
    """softmax(q k^T) written out: a second pass whose scores are a contraction (rows share k)."""
    s = nf.einsum("id,jd->ij", q, k) * 0.25
    e = nf.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_loop_held_in_one_tile_with_a_contraction(dtype, randn):
    """The second pass of a row held whole recomputes nothing it can reuse: the scores' dot runs
    once (one `tl.dot` in the source), 40 keys in one 64-wide tile; 80 keys loop and recompute it."""
    q = randn(33, 16)
    fn = _check(attention_probabilities, (q, randn(40, 16)), dtype, schedule=ONE_TILE)
    assert _whole_loop(fn) and _kernels(fn)[0].source.count("tl.dot(") == 1
    looped = _check(attention_probabilities, (q, randn(80, 16)), dtype, schedule=ONE_TILE)
    assert not _whole_loop(looped) and _kernels(looped)[0].source.count("tl.dot(") > 1


@nf.program
def shifted_matmul(x, w):
    """(x / 2 + max|x| + 1) @ w: the basis expansion leaves `sum_k (x / 2 + 1) w`, a contraction
    plus the column sums of w."""
    return nf.einsum("ik,ke->ie", x * 0.5 + (nf.abs_(x).max(axis=-1, keepdims=True) + 1.0), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_sum_of_a_contraction_and_another_term_is_reduced_term_by_term(dtype, randn):
    """`sum_k (a[i,k] + b[k,e]) w[k,e]`-like sums reduce each term in its own tile: the GPU's
    128-row plan with 200 output columns held whole compiles (the whole body's tile, 128 x 64 x 256,
    is twice what Triton allows) and computes the reference's values."""
    fn = _check(shifted_matmul, (randn(40, 100), randn(100, 200)), dtype,
                schedule=nf.flash(block_q=128, block_k=64, num_warps=8))
    source = _kernels(fn)[0].source
    assert "tl.dot(" in source and "BLOCK_R, BLOCK_C, BLOCK_E" not in source


@nf.program
def vocabulary_probabilities(h, w):
    """softmax(h w^T) written out, the hidden axis longer than a tile: each score tile is an inner
    K-loop."""
    s = nf.einsum("id,vd->iv", h, w)
    e = nf.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_a_loop_held_in_one_tile_reuses_its_inner_loops(randn):
    """A vocabulary of 30 in one 32-wide tile: the scores' K-loop over 700 hidden units runs once
    and the second pass reads its result; 100 words loop and recompute it in the second pass."""
    h = randn(20, 700)
    whole = _check(vocabulary_probabilities, (h, randn(30, 700, scale=0.05)))
    looped = _check(vocabulary_probabilities, (h, randn(100, 700, scale=0.05)))
    assert _whole_loop(whole) and not _whole_loop(looped)
    inner = "inner loop over 'd'"
    assert _kernels(whole)[0].source.count(inner) == 1 < _kernels(looped)[0].source.count(inner)


def test_projections_with_long_outputs_of_their_own_run_apart(randn):
    """`x @ wk` beside `x @ wv`, each output axis too long for a tile: one kernel would tile both
    across the grid and compute each projection again under every tile of the other's axis; they
    run in kernels of their own, each output correct."""

    @nf.program
    def two_projections(x, wk, wv):
        return nf.einsum("ty,ky->tk", x, wk) * 2.0, nf.einsum("ty,vy->tv", x, wv)

    args = (randn(8, 16), randn(MAX_WHOLE + 40, 16), randn(MAX_WHOLE + 8, 16))
    program = two_projections.trace(*args)
    assert "keep long axes other than" in why_apart(program, frozenset({"k", "v"}))
    assert len(partition(program, frozenset({"k", "v"}))) == 2
    _check(two_projections, args)


def _attention_block(x, wq, wk, wv):
    """Model code: projections split into heads by view, attention, heads merged by reshape."""
    t, d = x.shape
    q, k, v = ((x @ w).view(t, d // 8, 8).transpose(0, 1) for w in (wq, wk, wv))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(t, d)


def test_parts_of_a_16_bit_program_multiply_in_its_dtype(randn):
    """A program cut into kernels: the projections an earlier kernel writes for the attention
    after it are matrix products, kept in the program's dtype (as model code's tensors are); the
    attention's kernel reads them and multiplies in fp16, not fp32 (statistics stay fp32)."""
    args = (randn(32, 16), *(randn(16, 16, scale=0.25) for _ in range(3)))
    fn = _check(nf.program(_attention_block), args, torch.float16)
    top = next(e for e in fn._cache.values() if e.groups and any("dot0" in g.results for g, _ in e.groups))
    written = {r: g.program.stage(o.stage).body.dtype for g, _ in top.groups
               for r, o in zip(g.results, g.program.outputs) if not r.startswith("output:")}
    assert {written[r] for r in ("dot0", "dot1", "dot2")} == {"f16"}
    assert {dtype for r, dtype in written.items() if r.startswith(("max", "sum"))} == {"f32"}
    records = [e.record for e in fn._cache.values() if e.record is not None]
    assert records and {r.compute_dtype for r in records} == {"f16"}


def test_a_part_that_writes_for_later_kernels_keeps_that_value_in_fp32(randn):
    """A kernel of a backward writes `__mat_dot0` (fp32) for the kernels after it; cut again, its
    second part reads that returned value (no copy under a name of its own), and narrowing
    leaves it alone: the value returned to the later kernels stays the fp32 they were compiled for."""
    from dataclasses import replace

    from neptune_fusion.ir.expr import Cast, Index, Load
    from neptune_fusion.ir.program import OutputSpec, Stage
    from neptune_fusion.schedule.partition import _split, narrow_materialised

    @nf.program
    def project_twice(x, w, v):
        return (x @ w) @ v

    program = project_twice.trace(randn(8, 8), randn(8, 8), randn(8, 8))
    dims = program.stage("dot0").axes
    kept = Stage("__mat_dot0", dims, Cast(Load("dot0", tuple(Index(a) for a in dims)), "f32"))
    program = replace(program, stages=(*program.stages, kept), outputs=(*program.outputs, OutputSpec(kept.name, dims)))
    first, second = _split(program, {"dot1"})
    names = [st.name for st in first.program.stages]
    assert len(names) == len(set(names)) and not any(n.startswith("__mat_dot0_") for n in names), names
    assert "__mat_dot0" in {b.name for b in second.program.inputs} and "dot0" not in first.results
    narrowed = narrow_materialised([first, second], "f16")[0].program
    assert narrowed.stage("__mat_dot0").body.dtype == "f32"


def test_a_batched_norm_projection_tiles_its_tokens(randn):
    """`rmsnorm(x) @ w` over (batch, tokens, model): both the batch and the tokens index the
    computed operand, so the row is the tokens (the last such axis), not the batch."""
    def batched(x, w, g):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), g) @ w

    x = randn(3, 40, 24)
    traced = nf.program(batched).trace(x, randn(24, 36), randn(24))
    assert assign_roles(fuse(traced)[-1].program).row == traced.inputs[0].dims[1]
