"""Output dtypes (lang/dtypes.py): what a compiled program returns has the dtype torch gives the
same code, and the values torch gives, for comparisons, integer sums, casts and mixed inputs."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402

PROGRAMS = {
    "comparison of a sum": lambda x, y: x.sum(-1) > 0,
    "count of positives": lambda x, y: (x > 0).sum(-1),
    "cast before a sum": lambda x, y: x.half().sum(-1),
    "cast after a sum, times a scalar": lambda x, y: x.sum(-1).half() * 2,
    "max to int32": lambda x, y: x.amax(-1).to(torch.int32),
    "mask": lambda x, y: x > y,
    "fp16 with fp32": lambda x, y: (x.half() * y).sum(-1),
    "int with a Python float": lambda x, y: ((x > 0).long() * 0.5).sum(-1),
    "0-d fp32 sum with an fp16 tensor": lambda x, y: x.sum() * y.half(),
    "two outputs": lambda x, y: (torch.softmax(x, -1), x.amax(-1) < y.amax(-1)),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_outputs_take_torchs_dtypes(name, randn):
    fn = PROGRAMS[name]
    x, y = randn(8, 24), randn(8, 24)
    got, want = nf.compile(fn)(x, y), fn(x, y)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        tol = 2e-3 if w.dtype == torch.float16 else 1e-5
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)
