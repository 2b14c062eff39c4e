"""Random model code (plain torch, as a modeling file writes it) through `nf.compile`: a stack of
layers drawn from projections, RMSNorm / LayerNorm, activations, gated units, softmax over either
axis, self-attention-like products, residuals, slices and concatenations, ending in a loss, a
reduction or the activations themselves. Each case runs forward and backward (every input
requires grad, a random seed gradient) and is checked against eager torch in float64.

    TRITON_INTERPRET=1 PYTHONPATH=.:src python bench/model_fuzz.py SEED COUNT

Prints each case that fails (an error above tolerance, an exception other than a FusionError),
each FusionError (a refusal: right, or a fusion missed, to be read), and a summary.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import neptune_fusion as nf  # noqa: E402

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
               "softplus": F.softplus, "relu": F.relu}


@dataclass
class Model:
    """A random layer stack: `layers` map (h, weights) -> h; `shapes` are the weights' shapes."""
    width: int
    layers: list[tuple[str, Callable[..., torch.Tensor], int]] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    tail: str = "out"

    def weight(self, *shape: int) -> int:
        self.shapes.append(shape)
        return len(self.shapes) - 1

    def __call__(self, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        h, kept = x, x
        for _, layer, _ in self.layers:
            h, kept = layer(h, kept, weights)
        return tail(self.tail, h, weights[-1])

    def as_function(self) -> Callable[..., torch.Tensor]:
        """The stack as a function of named tensors (what `nf.compile` traces)."""
        names = ", ".join(["x", *(f"w{i}" for i in range(len(self.shapes))), "labels"])
        scope: dict[str, object] = {"model": self}
        exec(f"def model_code({names}):\n    return model({names})\n", scope)  # noqa: S102
        return scope["model_code"]  # type: ignore[return-value]

    def describe(self) -> str:
        return " > ".join(name for name, _, _ in self.layers) + f" > {self.tail}"


def tail(kind: str, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if kind == "sum":
        return h.sum()
    if kind == "mean_rows":
        return h.mean(-1)
    if kind == "logsumexp":
        return torch.logsumexp(h, -1)
    if kind == "amax":
        return h.amax(-1)
    if kind == "cross_entropy":
        return F.cross_entropy(h.reshape(-1, h.shape[-1]), labels.reshape(-1) % h.shape[-1])
    if kind == "mse":
        return F.mse_loss(h, torch.zeros_like(h) + 0.5)
    return h


def build(rng: random.Random, width: int, depth: int, long_axes: bool) -> Model:
    model = Model(width)
    c = width
    for _ in range(depth):
        kind = rng.choice(["linear", "linear", "rmsnorm", "layernorm", "act", "glu", "softmax_last",
                           "softmax_tokens", "attention", "residual", "slice", "cat", "scale", "rotary"])
        if kind == "linear":
            out = rng.choice([c, rng.randint(3, 700 if long_axes else 96)])
            w = model.weight(c, out)
            model.layers.append((f"linear{c}x{out}", lambda h, k, ws, w=w, c=c: (h @ (ws[w] * c ** -0.5), k), out))
            c = out
        elif kind == "rmsnorm":
            g = model.weight(c)
            model.layers.append(("rmsnorm", lambda h, k, ws, g=g: (F.rms_norm(h, (h.shape[-1],), ws[g], 1e-6), k), c))
        elif kind == "layernorm":
            g, b = model.weight(c), model.weight(c)
            model.layers.append(("layernorm", lambda h, k, ws, g=g, b=b: (F.layer_norm(h, (h.shape[-1],), ws[g], ws[b]), k), c))
        elif kind == "act":
            name = rng.choice(sorted(ACTIVATIONS))
            model.layers.append((name, lambda h, k, ws, f=ACTIVATIONS[name]: (f(h), k), c))
        elif kind == "glu" and c % 2 == 0 and c >= 4:
            model.layers.append(("glu", lambda h, k, ws: (F.silu(h[..., : h.shape[-1] // 2]) * h[..., h.shape[-1] // 2:], k), c // 2))
            c //= 2
        elif kind == "softmax_last":
            model.layers.append(("softmax(-1)", lambda h, k, ws: (torch.softmax(h, -1), k), c))
        elif kind == "softmax_tokens":
            model.layers.append(("softmax(-2)", lambda h, k, ws: (torch.softmax(h, -2), k), c))
        elif kind == "attention":
            mask = rng.choice(["none", "sdpa_causal", "made_causal"])

            def attend(h: torch.Tensor, k: torch.Tensor, ws: tuple[torch.Tensor, ...], mask: str = mask) -> tuple[torch.Tensor, torch.Tensor]:
                if mask == "sdpa_causal":
                    return F.scaled_dot_product_attention(h, h, h, is_causal=True), k
                s = h @ h.transpose(-1, -2) * h.shape[-1] ** -0.5
                if mask == "made_causal":  # a mask the code makes itself
                    t = s.shape[-1]
                    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1), float("-inf"))
                return torch.softmax(s, -1) @ h, k
            model.layers.append((f"attention({mask})", attend, c))
        elif kind == "rotary" and c % 2 == 0:
            model.layers.append(("rotary", lambda h, k, ws: (rotary(h), k), c))
        elif kind == "residual":
            model.layers.append(("residual", lambda h, k, ws: (h + k, h) if h.shape == k.shape else (h, h), c))
        elif kind == "slice" and c > 4:
            lo, hi = c // 4, c - c // 5
            model.layers.append((f"slice{lo}:{hi}", lambda h, k, ws, lo=lo, hi=hi: (h[..., lo:hi], k), hi - lo))
            c = hi - lo
        elif kind == "cat":
            model.layers.append(("cat", lambda h, k, ws: (torch.cat([h, torch.tanh(h)], -1), k), 2 * c))
            c *= 2
        elif kind == "scale":
            model.layers.append(("scale", lambda h, k, ws: (h * 0.5 + 0.25, k), c))
    model.tail = rng.choice(["out", "out", "sum", "mean_rows", "logsumexp", "amax", "cross_entropy", "mse"])
    return model


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the tokens, its tables made from torch.arange in the code."""
    t, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    emb = torch.cat([torch.arange(t, dtype=torch.float32, device=x.device)[:, None] * inv[None, :]] * 2, -1)
    return x * emb.cos().to(x.dtype) + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * emb.sin().to(x.dtype)


def relative_error(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if got is None and want is None:
        return 0.0
    want = torch.zeros_like(got, dtype=torch.float64) if want is None else want.double()
    got = torch.zeros_like(want) if got is None else got.double()
    # floored: a gradient that is zero analytically (of a softmax's sum) is rounding noise
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-4)


def errors(run: Callable[..., torch.Tensor], inputs: list[torch.Tensor], want: torch.Tensor,
           exact: list[torch.Tensor], seed: torch.Tensor) -> float:
    """The largest relative error of `run`'s output and every input's gradient against `want`'s."""
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = run(*leaves)
    got_grads = torch.autograd.grad(out, leaves[:-1], seed.to(out.dtype), allow_unused=True)
    want_grads = torch.autograd.grad(want, exact[:-1], seed, allow_unused=True, retain_graph=True)
    return max([relative_error(out.detach(), want.detach())]
               + [relative_error(a, b) for a, b in zip(got_grads, want_grads)])


def check(model: Model, inputs: list[torch.Tensor]) -> tuple[float, float]:
    """(ours, eager torch's) largest relative error against float64 eager, of the output and of
    every input's gradient."""
    exact = [t.detach().double().requires_grad_() for t in inputs[:-1]] + [inputs[-1]]
    want = model(*exact)
    seed = torch.randn(want.shape, dtype=torch.float64)
    ours = errors(nf.compile(model.as_function()), inputs, want, exact, seed)
    return ours, errors(model, inputs, want, exact, seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("seed", type=int)
    ap.add_argument("count", type=int)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    bad = refused = 0
    for case in range(a.count):
        long_axes = rng.random() < 0.2
        width = rng.randint(3, 600 if long_axes else 80)
        model = build(rng, width, rng.randint(1, 4), long_axes)
        batch, tokens = rng.randint(1, 3), rng.randint(1, 64)
        dtype = rng.choice([torch.float32, torch.float16])
        x = torch.randn(batch, tokens, width)
        weights = [1 + 0.1 * torch.randn(s) if len(s) == 1 else torch.randn(s) for s in model.shapes]
        labels = torch.randint(0, 1 << 20, (batch, tokens))
        inputs = [t.to(dtype) for t in [x, *weights]] + [labels]
        label = f"{case} [{model.describe()}] x{tuple(x.shape)} {dtype}"
        try:
            err, eager = check(model, inputs)
            # within twice what eager torch's own rounding gives (ill-conditioned cases)
            if not err <= max(1e-3 if dtype == torch.float32 else 3e-2, 2 * eager):
                bad += 1
                print("BAD", label, f"err {err:.2e} (eager {eager:.2e})", flush=True)
        except nf.FusionError as exc:
            refused += 1
            print("REFUSED", label, str(exc)[:300], flush=True)
        except Exception as exc:  # noqa: BLE001 - a crash is the finding
            bad += 1
            print("ERR", label, type(exc).__name__, str(exc)[:300], flush=True)
    print(f"seed {a.seed}: {a.count} cases, {bad} failed, {refused} refused")


if __name__ == "__main__":
    main()
