"""Every file in examples/ runs as a user would run it (each checks its own result), on the CPU
under Triton's interpreter at its small sizes (TRITON_INTERPRET=1: the examples then choose them).

The list is a glob, so an example added later runs here without being named. Each runs in its own
process group, so one that starts processes of its own (torch.distributed over gloo) is ended whole
if it hangs.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))
TIMEOUT_S = 300  # the slowest today (torch.compile of a layer) takes about 30 s on 2 cores


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    # examples that start torch.distributed processes rendezvous on this machine's loopback only
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(_free_port()))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _end_group(pid: int) -> None:
    """End whatever is left of the process group the example led (workers it spawned)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left of it


def test_examples_are_found() -> None:
    assert len(EXAMPLES) >= 8, EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_checks_its_result(path: Path) -> None:
    """An example that only prints could not fail here: each asserts what it computed."""
    assert re.search(r"\bassert\b|assert_close\(", path.read_text()), f"{path.name} checks nothing"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    proc = subprocess.Popen([sys.executable, str(path)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_environment(), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _end_group(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{path.name} ran past {TIMEOUT_S} s\n{out[-2000:]}\n{err[-3000:]}")
    finally:
        _end_group(proc.pid)
    assert proc.returncode == 0, f"{path.name} exited {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
