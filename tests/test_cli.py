"""The command line on a machine without a GPU (kernels under the Triton interpreter)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from neptune_fusion.benchmarks import cases, report, runner  # noqa: E402
from neptune_fusion.cli import main  # noqa: E402


@pytest.mark.parametrize("argv", [["demo"], ["explain", "--query-len", "1"], ["tune"]])
def test_commands_succeed(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("NEPTUNE_FUSION_CACHE_DIR", str(tmp_path))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.strip()
    if argv[0] == "demo":
        assert "repair when max0 change" in out and "OK" in out


def test_bench_quick_writes_one_folder(tmp_path, monkeypatch, capsys):
    """`neptune-fusion bench --quick`: every suite's tiny cases, correct, timed beside a baseline,
    written as JSON, a markdown table and a figure (where matplotlib is installed)."""
    monkeypatch.setenv("NEPTUNE_FUSION_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(["bench", "--quick", "--out", str(out)]) == 0
    payload = json.loads((out / "results.json").read_text())
    env = payload["environment"]
    assert env["torch"] == torch.__version__ and env["device"] == "cpu" and env["interpreter"]
    rows = payload["results"]
    assert [(r["suite"], r["op"]) for r in rows] == [(c.suite, c.op) for c in cases.select(cases.SUITES, quick=True)]
    for row in rows:
        assert row["ours"]["correct"] and row["ours"]["rel_err"] < row["tolerance"], row
        assert row["ours"]["us"] > 0 and row["ours"]["rounds_us"]
        for name, ratio in row.get("speedup_vs", {}).items():
            assert ratio == pytest.approx(row["baselines"][name]["us"] / row["ours"]["us"])
    # every case but the softcap one has a baseline on the CPU (SDPA or eager torch), checked too
    assert sum("speedup_vs_fastest" in r for r in rows) == len(rows) - 1
    assert all(b["correct"] for r in rows for b in r["baselines"].values())
    # FlashAttention-4 and Flex's FLASH backend cannot run here: skipped with a note, not failed
    prefill = next(r for r in rows if r["op"] == "pf_causal")
    assert "CUDA" in prefill["skipped"]["fa4"] and "flex_flash" in prefill["skipped"]
    assert payload["summary"]["all_correct"] and payload["summary"]["cases"] == len(rows)
    table = (out / "results.md").read_text()
    for row in rows:
        assert f"| {row['op']} | {report.size(row)} |" in table
    assert "fa4 not run: needs a CUDA GPU" in table
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (out / "speedups.png").exists()
        assert "matplotlib is not installed" in capsys.readouterr().out
    else:
        assert (out / "speedups.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_default_folder_counts_up(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    first = runner.default_out(tmp_path)
    first.mkdir()
    second = runner.default_out(tmp_path)
    assert first.name.endswith("-1") and second.name.endswith("-2") and first.name[:-2] == second.name[:-2]
    monkeypatch.setenv("OUT", str(tmp_path / "device"))
    assert runner.default_out(tmp_path) == tmp_path / "device"


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    message = report.plot({"results": [], "environment": {}}, tmp_path / "speedups.png")
    assert message is not None and "matplotlib is not installed" in message
    assert not (tmp_path / "speedups.png").exists()


def _case(systems: dict[str, cases.System], tolerance: float = 1e-3) -> cases.Case:
    expected = torch.arange(4.0)

    def build(setup: cases.Setup) -> cases.Built:
        return cases.Built(systems, lambda out: cases.rel_err(out, expected), tolerance, {"fa4": "not here"})

    return cases.Case("decode", "synthetic", 4, build)


def test_run_case_records_failures_and_wrong_baselines():
    """A baseline that raises or computes the wrong thing is recorded, and no ratio is taken against it."""
    good = torch.arange(4.0)

    def boom() -> torch.Tensor:
        raise RuntimeError("no kernel for this shape")

    systems = {"ours": cases.System(lambda: good.clone()), "right": cases.System(lambda: good + 0),
               "wrong": cases.System(lambda: good * 2), "broken": cases.System(boom),
               "tuple_out": cases.System(lambda: (good.clone(), None), output=lambda r: r[0])}
    row = runner.run_case(_case(systems), cases.Setup("cpu", quick=True), rounds=2, timer=runner.wall_us,
                          status=lambda what: None)
    assert row["ours"]["correct"] and len(row["ours"]["rounds_us"]) == 2
    assert row["baselines"]["broken"]["error"].startswith("RuntimeError: no kernel")
    assert row["baselines"]["wrong"]["correct"] is False and row["baselines"]["wrong"]["rel_err"] == pytest.approx(1.0)
    assert set(row["speedup_vs"]) == {"right", "tuple_out"}
    assert row["fastest"] in {"right", "tuple_out"} and row["skipped"] == {"fa4": "not here"}
    text = report.line(row)
    assert "broken failed" in text and "(wrong: err 1.0e+00)" in text


def test_run_case_wrong_ours_takes_no_ratio():
    systems = {"ours": cases.System(lambda: torch.full((4,), float("nan"))),
               "right": cases.System(lambda: torch.arange(4.0))}
    row = runner.run_case(_case(systems), cases.Setup("cpu", quick=True), rounds=1, timer=runner.wall_us,
                          status=lambda what: None)
    assert row["ours"]["correct"] is False and "speedup_vs" not in row and not runner.ok(row)
    assert runner.summary([row])["all_correct"] is False


def test_select_filters_and_refuses_unknown_suites():
    picked = cases.select(["prefill", "general"], ops=["pf_window", "rmsnorm_matmul"], seqs=[4096])
    assert [(c.op, c.seq) for c in picked] == [("pf_window", 4096), ("rmsnorm_matmul", None)]
    assert len(cases.select(["prefill", "decode"])) == 34  # the points of DESIGN.md section 5
    with pytest.raises(ValueError, match="unknown suite"):
        cases.select(["nonsense"])


def test_bench_before_times_an_earlier_package(tmp_path, monkeypatch):
    """--before MODULE: a copy of the package under another name (as bench/ab_baseline.sh makes one)
    is timed beside ours, checked like any system, and its ratio reported as 'before'."""
    src = Path(__file__).resolve().parent.parent / "src" / "neptune_fusion"
    copy = tmp_path / "site" / "nf_copy_for_test"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for path in copy.rglob("*.py"):
        path.write_text(path.read_text().replace("neptune_fusion", "nf_copy_for_test"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("NEPTUNE_FUSION_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(["bench", "--quick", "--suite", "decode", "--out", str(out), "--before", "nf_copy_for_test"]) == 0
    (row,) = json.loads((out / "results.json").read_text())["results"]
    assert row["baselines"]["before"]["correct"] and "before" in row["speedup_vs"]
    assert row["fastest"] != "before"  # an earlier version of ours is not another system
