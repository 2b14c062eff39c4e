"""No plan asks for more shared memory or registers than the device has (issue 12), checked without
a GPU: a few cases of bench/sweep.py are planned as on an H200 and their kernels compiled for sm_90
by Triton's own compiler, the schedule's estimate against what Triton allocates; the footprint
model on hand-made tile kernels; the fit's order; and the plans of the 34 benchmark points (head
dim 128), which must not change.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from bench.sweep import H200_SHARED_BYTES, SPILL_LIMIT_BYTES, Case  # noqa: E402
from neptune_fusion.schedule.auto import Plan, choose, fit  # noqa: E402
from neptune_fusion.schedule.templates import Auto  # noqa: E402
from neptune_fusion.tile.ir import Assign, Loop, Op, TileKernel, TVal  # noqa: E402
from neptune_fusion.tile.resources import (  # noqa: E402
    HOPPER_REGISTERS,
    HOPPER_SHARED_BYTES,
    SLACK_BYTES,
    narrow_loops_first,
    register_estimate,
    shared_memory_estimate,
)

# the estimate is an upper bound of Triton's number, and within this of it for kernels of 64 KB or
# more (smaller kernels are far from the limit: their mma.sync operands, which Triton may keep in
# registers, are counted in shared memory)
TOLERANCE = 1.25

# sweep cases (bench/sweep.py) that stopped with OutOfResources or did not fit before, or sit near
# the limit: head dim 256 with masks, a block map with gathered mask tables, decode under split-K,
# value head dim different from the key's
CASES = [
    # split-K prefill (8 heads x 8 row tiles leave the machine idle): 128 x 64 tiles, 3 stages, 4
    # warps was 256 KB (the query tile resident beside three stages) and 1.4-2.9 KB of spills a thread
    Case(0, 1, 8, 4, 1000, 1000, 256, 256, "causal", "softcap", "float16"),
    Case(1, 1, 8, 8, 700, 700, 256, 256, "document_blockmask", "none", "bfloat16", docs=3),
    Case(2, 2, 8, 2, 3, 2000, 192, 192, "window", "alibi", "float16", window=1024),
    Case(3, 1, 4, 4, 300, 900, 192, 128, "prefix_lm", "none", "float16", prefix=200),
]

_OFFLINE = """
import json, sys, torch
import neptune_fusion as nf
from bench.sweep import Case, backward_plans, benchmark_plans, check_case, stand_in_h200
from neptune_fusion.library import layernorm_matmul
cases = [Case(**c) for c in json.loads(sys.argv[1])]
# a training call whose backward's split-K combine contracts a gradient with a weight in fp32
training = []
x = torch.randn(2387, 1024, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(1024, 296, dtype=torch.bfloat16, requires_grad=True)
with stand_in_h200(training):
    nf.compile(layernorm_matmul)(x, w).float().sum().backward()
print(json.dumps({"cases": [check_case(c) for c in cases], "plans": benchmark_plans(),
                  "backward": backward_plans(), "training": training}))
"""


@pytest.fixture(scope="module")
def offline() -> dict:
    """bench/sweep.py's check of CASES and the benchmark's plans, with an H200 stood in for, in a
    process of its own: kernels compile for CUDA there (this process runs Triton's interpreter,
    whose library functions a CUDA kernel cannot call)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", _OFFLINE, json.dumps([asdict(c) for c in CASES])],
                          capture_output=True, text=True, env=env, timeout=900, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.label() for c in CASES])
def test_sweep_cases_fit_the_h200(offline, index):
    result = offline["cases"][index]
    assert result["kernels"], result
    assert not result["failures"], result["failures"]
    for kernel in result["kernels"]:
        assert kernel["shared"] <= H200_SHARED_BYTES, kernel
        assert kernel["spill_bytes"] <= SPILL_LIMIT_BYTES, kernel
        if kernel["backend"] == "triton":  # Gluon kernels allocate their ring themselves (codegen/gluon_source.py)
            assert kernel["estimate"] >= kernel["shared"], kernel
            if kernel["shared"] >= 65536:
                assert kernel["estimate"] <= TOLERANCE * kernel["shared"], kernel
            assert kernel["register_estimate"] <= HOPPER_REGISTERS, kernel


def test_the_split_k_prefill_plan_is_fitted_at_schedule_time(offline):
    """The plan of the first case, as the schedule chooses it from the shapes, does not fit; the
    kernel runs the fitted plan, the executable's (what the block map and the cache use too), so no
    first launch has to re-plan it."""
    main = next(k for k in offline["cases"][0]["kernels"] if k["kernel"] == "nf_attention")
    chosen = choose(Auto(), rows=1000, cols=1000, batch=8, full_sizes={"d": 256, "e": 256}, dtype="f16",
                    num_sms=132, interpreter=False)
    # split, 128-row tiles stay compute-bound: the plan of one pass, not decode's memory-bound one
    assert (chosen.block_row, chosen.block_col, chosen.num_warps, chosen.num_stages) == (128, 64, 8, 3)
    assert chosen.splits > 1
    # fewer stages for shared memory
    assert (main["blocks"]["BLOCK_R"], main["blocks"]["BLOCK_C"], main["warps"], main["stages"]) == (128, 64, 8, 2)


def test_benchmark_plans_are_unchanged(offline):
    """The 34 points of DESIGN.md section 5 (head dim 128) keep the plans they had before the
    shared-memory and register checks: all of them fit."""
    prefill = {"block_row": 128, "block_col": 128, "num_warps": 8, "num_stages": 3, "splits": 1, "prefetch_dot": False}
    decode = {("dc_causal", 1024): (3, 4), ("dc_alibi", 1024): (3, 4), ("dc_softcap", 1024): (3, 8)}
    for op in ("dc_causal", "dc_alibi"):
        decode.update({(op, n): (2, 16) for n in (4096, 16384, 32768)})
    decode.update({("dc_gqa", n): (3, 16) for n in (1024, 4096, 16384, 32768)})
    decode.update({("dc_softcap", n): (3, 16) for n in (4096, 16384, 32768)})
    points = offline["plans"]
    assert len(points) == 34
    for p in points:
        if p["op"].startswith("pf_"):
            assert (p["plan"], p["backend"]) == (prefill, "gluon"), p
        else:
            stages, splits = decode[(p["op"], p["seq"])]
            assert p["plan"] == {"block_row": 16, "block_col": 64, "num_warps": 4, "num_stages": stages,
                                 "splits": splits, "prefetch_dot": False}, p
            assert p["backend"] == "triton" and p["kernel"]["stages"] == stages, p


def test_attention_backward_kernels_fit_without_spilling(offline):
    """The derived backward's kernels at the benchmark's shapes: D, dK+dV over queries, dQ over keys.
    dK+dV carries two accumulators and computes two tiles per iteration (S and dP): planned wide in
    keys and narrow in queries, it neither spills nor shrinks to tiles too small for the tensor
    cores (it ran on 16 x 16 tiles when its dV product was a broadcast rather than a dot)."""
    for case in offline["backward"]:
        kernels = {k["kernel"].rsplit("_", 1)[-1]: k for k in case["kernels"]}
        assert set(kernels) == {"k0", "k1", "k2"}, case
        for kernel in kernels.values():
            assert kernel["shared"] <= H200_SHARED_BYTES, kernel
            assert kernel["spill_bytes"] <= SPILL_LIMIT_BYTES, kernel
        assert kernels["k1"]["blocks"]["BLOCK_R"] >= 64 and kernels["k1"]["blocks"]["BLOCK_C"] >= 32, case
        assert kernels["k2"]["blocks"]["BLOCK_R"] >= 64 and kernels["k2"]["blocks"]["BLOCK_C"] >= 32, case


# --------------------------------------------------------------------------- the footprint model


def _attention_kernel(block_row: int, block_col: int, head: int, stages: int, warps: int) -> TileKernel:
    """Attention's loop in tile IR: q loaded before it, k and v tiles in it, two dots."""
    i32 = lambda n: TVal(n, (), "i32")  # noqa: E731
    q, k, v = TVal("q", ("r", "d"), "f16"), TVal("k", ("c", "d"), "f16"), TVal("v", ("c", "e"), "f16")
    s, p = TVal("s", ("r", "c"), "f32"), TVal("p", ("r", "c"), "f16")
    acc, new = TVal("acc", ("r", "e"), "f32"), TVal("new", ("r", "e"), "f32")
    body = [Op(TVal("cols", ("c",), "i32"), "arange", (i32("j"),), {"block": "BC"}),
            Op(k, "load", (), {"buffer": "k"}), Op(s, "dot", (q, k), {"k": "d"}),
            Op(p, "cast", (s,), {"to_dtype": "f16"}), Op(v, "load", (), {"buffer": "v"}),
            Op(new, "dot", (p, v, acc), {"k": "c"}), Assign(acc, new)]
    return TileKernel("attn", [], ("r", "c", "d", "e"), {"r": "BR", "c": "BC", "d": "BD", "e": "BE"}, [],
                      [Op(q, "load", (), {"buffer": "q"}), Op(acc, "full", (), {"value": 0.0}),
                       Loop(i32("j"), i32("lo"), i32("hi"), "BC", body)],
                      warps, stages, {"BR": block_row, "BC": block_col, "BD": head, "BE": head})


def test_a_training_call_with_an_fp32_contraction_in_its_combine_fits(offline):
    """LayerNorm -> matmul's backward (bf16, 2387 x 1024 @ 1024 x 296) contracts the gradient with
    w in fp32. The normalised rows' gradient (x's size) is computed once by a kernel of its own
    (schedule/partition.py), where a split reduction's combine once contracted it again in a second
    pass (266 KB of shared memory at 128-wide tiles, narrowed until it fit). Every kernel fits the
    H200, and the estimate, which counts an fp32 operand at 4 bytes, is at least what it takes."""
    assert offline["training"]
    for kernel in offline["training"]:
        assert kernel["shared"] <= H200_SHARED_BYTES, kernel
        assert kernel["estimate"] >= kernel["shared"], kernel


def test_a_dot_operand_is_staged_in_the_dtype_the_dot_reads():
    """A 16-bit tile cast to fp32 for an fp32 dot is staged at 4 bytes an element."""
    i32 = lambda n: TVal(n, (), "i32")  # noqa: E731
    g = TVal("g", ("r", "e"), "f32")
    w16, w32 = TVal("w", ("e", "k"), "bf16"), TVal("w32", ("e", "k"), "f32")
    out = TVal("o", ("r", "k"), "f32")
    body = [Op(TVal("ks", ("k",), "i32"), "arange", (i32("j"),), {"block": "BK"}),
            Op(w16, "load", (), {"buffer": "w"}), Op(w32, "cast", (w16,), {"to_dtype": "f32"}),
            Op(out, "dot", (g, w32), {"k": "e"})]
    kernel = TileKernel("combine", [], ("r", "k", "e"), {"r": "BR", "k": "BK", "e": "BE"}, [],
                        [Op(g, "load", (), {"buffer": "g"}), Loop(i32("j"), i32("lo"), i32("hi"), "BK", body)],
                        8, 1, {"BR": 16, "BK": 128, "BE": 512})
    assert shared_memory_estimate(kernel) >= 512 * 128 * 4


def test_wgmma_loops_keep_a_stage_more_than_mma_sync_loops():
    # 128 rows over a warpgroup multiple: wgmma, asynchronous, so k and v are `stages` slots deep,
    # and the query tile stays resident
    q, kv = 128 * 256 * 2, 64 * 256 * 2
    assert shared_memory_estimate(_attention_kernel(128, 64, 256, 3, 8)) == q + 3 * 2 * kv + SLACK_BYTES
    # 16 rows: mma.sync, `stages - 1` slots, and p converted through shared memory to its operand layout
    q16, p16 = 16 * 256 * 2, 16 * 64 * 2
    assert shared_memory_estimate(_attention_kernel(16, 64, 256, 3, 4)) == q16 + 2 * 2 * kv + p16 + SLACK_BYTES
    # one stage pipelines nothing: each operand is staged at its dot
    assert shared_memory_estimate(_attention_kernel(128, 64, 256, 1, 8)) == q + kv + SLACK_BYTES


def test_registers_count_the_accumulator_per_thread():
    # a 128 x 256 fp32 accumulator is 256 values a thread on 4 warps: more than a thread has
    assert register_estimate(_attention_kernel(128, 64, 256, 2, 4)) > HOPPER_REGISTERS
    assert register_estimate(_attention_kernel(128, 64, 256, 2, 8)) <= HOPPER_REGISTERS
    assert register_estimate(_attention_kernel(128, 128, 128, 3, 8)) <= HOPPER_REGISTERS


def test_nested_loops_add_their_buffers():
    i32 = lambda n: TVal(n, (), "i32")  # noqa: E731
    a, b = TVal("a", ("r", "k"), "f16"), TVal("b", ("k", "c"), "f16")
    acc = TVal("acc", ("r", "c"), "f32")
    x = TVal("x", ("c",), "f32")
    inner = Loop(i32("kk"), i32("lo"), i32("hi"), "BK", [
        Op(TVal("ks", ("k",), "i32"), "arange", (i32("kk"),), {"block": "BK"}),
        Op(a, "load", (), {"buffer": "a"}), Op(b, "load", (), {"buffer": "b"}),
        Op(TVal("d", ("r", "c"), "f32"), "dot", (a, b, acc), {"k": "k"}), Assign(acc, TVal("d", ("r", "c"), "f32"))])
    outer = Loop(i32("j"), i32("lo"), i32("hi"), "BC", [
        Op(TVal("cols", ("c",), "i32"), "arange", (i32("j"),), {"block": "BC"}),
        Op(x, "load", (), {"buffer": "x"}), inner])
    blocks = {"BR": 128, "BC": 128, "BK": 64}
    kernel = TileKernel("k", [], ("r", "c", "k"), {"r": "BR", "c": "BC", "k": "BK"}, [], [outer], 8, 3, blocks)
    tiles = 3 * (128 * 64 * 2 + 64 * 128 * 2)  # the inner loop's operands, three slots deep (wgmma)
    # plus the outer loop's x, two slots deep (no dot of its own waits on it asynchronously)
    assert shared_memory_estimate(kernel) == 2 * 128 * 4 + tiles + SLACK_BYTES


# --------------------------------------------------------------------------- the fit


def _usage(resident: int, per_stage: int, row_values: int):
    """(shared, registers) of a toy kernel: a resident tile, one tile a stage (scaled by block_col
    / 64), an fp32 accumulator of block_row x row_values."""
    def usage(p: Plan) -> tuple[int, int]:
        return (resident + p.num_stages * per_stage * p.block_col // 64,
                p.block_row * row_values // (32 * p.num_warps) + 40)
    return usage


def test_fit_keeps_a_plan_that_fits():
    plan = Plan(128, 128, 8, 3, 1)
    assert fit(plan, _usage(32768, 65536 // 2, 128), HOPPER_SHARED_BYTES, HOPPER_REGISTERS) is plan


def test_fit_gives_up_stages_then_loop_tiles_then_the_last_stage_then_rows():
    usage = _usage(65536, 65536, 64)
    assert fit(Plan(128, 64, 8, 4, 1), usage, HOPPER_SHARED_BYTES, HOPPER_REGISTERS) == Plan(128, 64, 8, 2, 1)
    # with little room: two stages of 32-wide tiles before a single stage
    assert fit(Plan(128, 64, 8, 3, 1), usage, 65536 + 70000, HOPPER_REGISTERS) == Plan(128, 32, 8, 2, 1)
    assert fit(Plan(128, 64, 8, 3, 1), usage, 65536 + 40000, HOPPER_REGISTERS) == Plan(128, 32, 8, 1, 1)


def test_fit_spreads_registers_over_more_warps_then_fewer_rows():
    usage = _usage(0, 0, 512)
    assert fit(Plan(128, 64, 4, 2, 4), usage, HOPPER_SHARED_BYTES, HOPPER_REGISTERS) == Plan(64, 64, 8, 2, 4)


def test_fit_stops_at_the_smallest_plan():
    plan = fit(Plan(64, 64, 4, 2, 1), lambda p: (10**9, 0), HOPPER_SHARED_BYTES, HOPPER_REGISTERS)
    assert plan == Plan(16, 16, 4, 1, 1)



def test_fit_narrows_a_loop_of_two_work_tiles_before_it_gives_up_rows():
    """A loop computing two tiles per iteration (a backward's S and dP): registers grow with rows x
    loop width three times over and with rows alone for the accumulators; a narrower loop tile fits
    first and keeps the rows (each loaded tile reused by all of them)."""
    def usage(p: Plan) -> tuple[int, int]:
        carried, work = p.block_row * 256, 3 * p.block_row * p.block_col
        return 0, (carried + work) // (32 * p.num_warps) + 40
    plan = Plan(128, 128, 8, 2, 1)
    assert fit(plan, usage, HOPPER_SHARED_BYTES, HOPPER_REGISTERS) == Plan(64, 128, 8, 2, 1)
    assert fit(plan, usage, HOPPER_SHARED_BYTES, HOPPER_REGISTERS, narrow_first=True) == Plan(128, 32, 8, 2, 1)


def test_registers_count_one_work_tile_per_dot_along_the_loop_and_one_more():
    i32 = lambda n: TVal(n, (), "i32")  # noqa: E731
    k, q = TVal("k", ("r", "d"), "f16"), TVal("q", ("c", "d"), "f16")
    v, g = TVal("v", ("r", "e"), "f16"), TVal("g", ("c", "e"), "f16")
    s, dp = TVal("s", ("r", "c"), "f32"), TVal("dp", ("r", "c"), "f32")
    body = [Op(TVal("cols", ("c",), "i32"), "arange", (i32("j"),), {"block": "BC"}),
            Op(q, "load", (), {"buffer": "q"}), Op(g, "load", (), {"buffer": "g"}),
            Op(s, "dot", (k, q), {"k": "d"}), Op(dp, "dot", (v, g), {"k": "e"})]
    blocks = {"BR": 128, "BC": 32, "BD": 128, "BE": 128}
    kernel = TileKernel("bwd", [], ("r", "c", "d", "e"), {"r": "BR", "c": "BC", "d": "BD", "e": "BE"}, [],
                        [Op(k, "load", (), {"buffer": "k"}), Op(v, "load", (), {"buffer": "v"}),
                         Loop(i32("j"), i32("lo"), i32("hi"), "BC", body)], 8, 2, blocks)
    assert register_estimate(kernel) == 3 * 128 * 32 // 256 + 40
    assert narrow_loops_first(kernel)
    assert not narrow_loops_first(_attention_kernel(128, 128, 128, 3, 8))


def test_fit_restores_the_stages_a_later_narrowing_makes_room_for():
    """Three stages of 128-wide tiles overflow shared memory and two are kept; the registers then
    narrow the loop tile to 32, after which three stages fit again and come back."""
    def usage(p: Plan) -> tuple[int, int]:
        carried, work = p.block_row * 256, 3 * p.block_row * p.block_col
        return 40000 * p.num_stages * p.block_col // 64, (carried + work) // (32 * p.num_warps) + 40
    plan = Plan(128, 128, 8, 3, 1)
    assert fit(plan, usage, HOPPER_SHARED_BYTES, HOPPER_REGISTERS, narrow_first=True) == Plan(128, 32, 8, 3, 1)
