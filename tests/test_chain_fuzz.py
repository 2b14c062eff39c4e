"""Random chains of reductions (not attention) against float64 torch.

`m = R1(f(x))`, `l = R2(g(x, m))`, `out = R3(h(x, y, m, l))` with sum/max/min and maps that may
or may not have repairs. A chain the compiler refuses must raise `FusionError`; one it compiles
must be right wherever float32 can hold the true value. This found a hoisted running value and a
`-inf * 0` in max/min repairs (bench/NOTES.md item 23).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

FIRST = {
    "id": (lambda x: x, lambda x: x),
    "square": (lambda x: x * x, lambda x: x * x),
    "exp": (lambda x: nf.exp(x * 0.3), lambda x: torch.exp(x * 0.3)),
    "tanh": (lambda x: nf.tanh(x), torch.tanh),
}
SECOND = {
    "exp": (lambda x, m: nf.exp(x - m), lambda x, m: torch.exp(x - m)),
    "exp_scaled": (lambda x, m: nf.exp((x - m) * 2.0), lambda x, m: torch.exp((x - m) * 2.0)),
    "square": (lambda x, m: (x - m) * (x - m), lambda x, m: (x - m) ** 2),
    "sigmoid": (lambda x, m: nf.sigmoid(x - m), lambda x, m: torch.sigmoid(x - m)),
    "ratio": (lambda x, m: x / m, lambda x, m: x / m),
    "where": (lambda x, m: nf.where(x > 0, nf.exp(x - m), 0.0), lambda x, m: torch.where(x > 0, torch.exp(x - m), 0.0)),
}
THIRD = {
    "weighted": (lambda x, y, m, n: nf.exp(x - m) / n * y, lambda x, y, m, n: torch.exp(x - m) / n * y),
    "entropy": (lambda x, y, m, n: nf.exp(x - m) / n * (x - m - nf.log(n)),
                lambda x, y, m, n: torch.exp(x - m) / n * (x - m - torch.log(n))),
    "linear": (lambda x, y, m, n: y * n + x * m, lambda x, y, m, n: y * n + x * m),
    "none": (None, None),
}


def _reduce(op: str, t, library: str):
    if library == "nf":
        return getattr(t, op)(axis=-1, keepdims=True)
    return {"sum": t.sum(-1, keepdim=True), "max": t.amax(-1, keepdim=True), "min": t.amin(-1, keepdim=True)}[op]


@pytest.mark.parametrize("seed", range(int(os.environ.get("NF_FUZZ_SEEDS", "16")) * 2))
def test_random_reduction_chains(seed):
    rng = random.Random(7000 + seed)
    r1, r2, r3 = (rng.choice(["sum", "max", "min"]) for _ in range(3))
    f, g, h = rng.choice(list(FIRST)), rng.choice(list(SECOND)), rng.choice(list(THIRD))

    def stages(library: str, x, y):
        side = 0 if library == "nf" else 1
        m = _reduce(r1, FIRST[f][side](x), library)
        n = _reduce(r2, SECOND[g][side](x, m), library)
        if THIRD[h][side] is None:
            return n[..., 0]
        return _reduce(r3, THIRD[h][side](x, y, m, n), library)[..., 0]

    @nf.program
    def chain(x, y):
        return stages("nf", x, y)

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, rng.choice([40, 100, 150]), generator=gen)
    y = torch.randn(x.shape, generator=gen)

    schedule = rng.choice([None, nf.split_k(splits=3)])
    label = f"{r1}({f}) -> {r2}({g}) -> {r3}({h}) {schedule}"
    try:
        out = nf.compile(chain, schedule=schedule)(x, y)
    except nf.FusionError:
        return  # refused with a reason: allowed
    expected = stages("torch", x.double(), y.double())
    representable = torch.isfinite(stages("torch", x, y))  # where float32 (computed plainly) holds the true value
    torch.testing.assert_close(out.double()[representable], expected[representable], rtol=1e-4, atol=1e-5,
                               msg=label)
