"""The command line on a machine without a GPU (kernels under the Triton interpreter)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from neptune_fusion.cli import main  # noqa: E402


@pytest.mark.parametrize("argv", [["demo"], ["explain", "--query-len", "1"], ["bench", "--causal"], ["tune"]])
def test_commands_succeed(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("NEPTUNE_FUSION_CACHE_DIR", str(tmp_path))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.strip()
    if argv[0] == "demo":
        assert "repair when max0 change" in out and "OK" in out
