"""The generated kernels' integer floor division and modulo (`_floordiv`, `_mod` of
codegen/triton_source.py) follow Python's rules on negative operands, in the interpreter and in
what Triton compiles for sm_90 (checked offline, no GPU).

A gradient through a slice or a concatenation reads its source at `(i - offset) mod n`, and relies
on the modulo to keep the reads off the slice inside the buffer. Triton's axis analysis takes `a %
b` of a contiguous run of indices as if the run were not negative, and then computed a comparison on
it once per run it believed constant: `(i - offset) mod n` came out negative and the read faulted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from neptune_fusion.codegen.triton_source import _PREAMBLE  # noqa: E402

_KERNEL = _PREAMBLE + '''

@triton.jit
def shifted(out_mod_ptr, out_div_ptr, n, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK) - SHIFT
    tl.store(out_mod_ptr + tl.arange(0, BLOCK), _mod(i, n))
    tl.store(out_div_ptr + tl.arange(0, BLOCK), _floordiv(i, n))


@triton.jit
def gather(x_ptr, out_ptr, n, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    # the read of a gradient through a concatenation: the source at (i - SHIFT) mod n
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + _mod(offs - SHIFT, n)))
'''


def _kernel_file(tmp_path: Path) -> Path:
    path = tmp_path / "index_helpers_kernel.py"
    path.write_text(_KERNEL)
    return path


def _load(tmp_path: Path):
    import importlib.util

    path = _kernel_file(tmp_path)
    spec = importlib.util.spec_from_file_location("index_helpers_kernel", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("n", [1408, 7, -5, 64])
def test_floor_division_and_modulo_follow_python_on_negative_runs(tmp_path, n):
    kernels = _load(tmp_path)
    block, shift = 256, 200
    got_mod, got_div = torch.empty(block, dtype=torch.int32), torch.empty(block, dtype=torch.int32)
    kernels.shifted[(1,)](got_mod, got_div, n, SHIFT=shift, BLOCK=block)
    i = torch.arange(block, dtype=torch.int64) - shift
    assert torch.equal(got_mod.long(), torch.remainder(i, n))
    assert torch.equal(got_div.long(), torch.div(i, n, rounding_mode="floor"))


_OFFLINE = """
import importlib.util, json, sys, torch
sys.path.insert(0, ".")
from bench.sweep import compile_for_sm90
spec = importlib.util.spec_from_file_location("index_helpers_kernel", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
x, out = torch.empty(4096, dtype=torch.float16), torch.empty(1024, dtype=torch.float16)
kernel = compile_for_sm90(module.gather, [x, out, 1408], dict(SHIFT=1408, BLOCK=1024, num_warps=1, num_stages=1))
print(json.dumps(kernel.asm["llir"]))
"""


def test_sm90_code_computes_the_modulo_of_every_index(tmp_path):
    """No comparison is taken once for a run of indices: every lane's modulo is computed whole
    (1024 indices, 32 a thread, divisor 1408 specialised as a multiple of 16, the run negative)."""
    import json

    done = subprocess.run([sys.executable, "-c", _OFFLINE, str(_kernel_file(tmp_path))], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=300, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    llir = json.loads(done.stdout.strip().splitlines()[-1])
    scalar_compares = [line for line in llir.splitlines() if "icmp" in line and "<" not in line.split("icmp")[1]]
    assert not scalar_compares, scalar_compares[:4]
