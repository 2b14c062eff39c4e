"""Model code as a modeling file writes it, forward and gradients against float64 eager torch:
programs `bench/model_fuzz.py` found wrong or refused (bench/NOTES.md item 67)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import neptune_fusion as nf  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _check(fn, *inputs: torch.Tensor, tolerance: float = 1e-4) -> None:
    """`fn` compiled against float64 eager: its output and the gradients of its float inputs."""
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = nf.compile(fn)(*leaves)
    exact = [t.double().requires_grad_() if t.is_floating_point() else t for t in inputs]
    want = fn(*exact)
    seed = torch.randn(want.shape, dtype=torch.float64)
    got = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], seed.float())
    expected = torch.autograd.grad(want, [t for t in exact if t.requires_grad], seed)
    for a, b in zip((out, *got), (want, *expected)):
        assert (a.double() - b).abs().max().item() <= tolerance * max(b.abs().max().item(), 1.0)


def test_norm_projection_softmax_summed_over_tokens():
    # the weight's gradient sums over the batch after the tokens: one kernel's tile would hold
    # both (4M values), so that sum runs in a later kernel (`partition.split_chained`)
    def head(x, w, g):
        return torch.softmax(F.silu(F.rms_norm(x, (x.shape[-1],), g) @ w), -1).sum(-2)

    torch.manual_seed(0)
    _check(head, torch.randn(3, 40, 24), torch.randn(24, 36) / 5, 1 + 0.1 * torch.randn(24))


def test_max_of_attention_over_a_slice():
    # the max's tie test reads the second attention's output: the backward computes that output
    # once, so the max and the test compare the same values (`partition._tie_tested`)
    def f(x):
        h = x[..., 5:]
        h = F.scaled_dot_product_attention(h, h, h, is_causal=True)
        return F.scaled_dot_product_attention(h, h, h, is_causal=True).amax(-1)

    torch.manual_seed(0)
    _check(f, torch.randn(2, 45, 10))


def test_residual_around_a_square_projection():
    def block(x, w):
        return torch.softmax(x @ w + x, -1)

    torch.manual_seed(0)
    _check(block, torch.randn(1, 3, 27), torch.randn(27, 27) / 5)


def _causal_by_hand(h):
    s = h @ h.transpose(-1, -2) * h.shape[-1] ** -0.5
    t = s.shape[-1]
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ h


def _labels_from_positions(h):
    logits = h.reshape(-1, h.shape[-1])
    return F.cross_entropy(logits, torch.arange(logits.shape[0], device=h.device) % h.shape[-1])


def _additive_mask(h):
    t = h.shape[-2]
    return torch.softmax(h @ h.transpose(-1, -2) + torch.full((t, t), float("-inf")).triu(1), -1).sum(-1)


def _rotary(x):
    t, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    emb = torch.cat([torch.arange(t, dtype=torch.float32)[:, None] * inv[None, :]] * 2, -1)
    return x * emb.cos() + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * emb.sin()


@pytest.mark.parametrize("fn", [_causal_by_hand, _labels_from_positions, _additive_mask, _rotary])
def test_tensors_the_code_makes_itself(fn):
    # torch.ones / full / arange made inside the traced code, with triu and tril: symbolic
    # (lang/torch_nn/factories.py), where they were refused as captured tensors
    torch.manual_seed(0)
    _check(fn, torch.randn(2, 9, 8))



def test_cross_entropy_of_attention_reads_its_targets_once():
    # the loss's whole-tile second pass reuses what the loop loaded, guarded reads included
    def f(x, labels):
        h = F.scaled_dot_product_attention(*(torch.softmax(x, -2),) * 3, is_causal=True)
        h = torch.sigmoid(h)
        return F.cross_entropy(h.reshape(-1, h.shape[-1]), labels.reshape(-1) % h.shape[-1])

    torch.manual_seed(0)
    _check(f, torch.randn(3, 3, 19), torch.randint(0, 1000, (3, 3)))


def test_targets_gathered_from_attention():
    # a reshape makes the token axis one of fixed size; the gradient through attention's keys (the
    # same dimension) reads them back position by position, its own query axis renamed apart
    def f(x, labels):
        h = F.scaled_dot_product_attention(*(torch.softmax(x, -2),) * 3, is_causal=True)
        flat = h.reshape(-1, h.shape[-1])
        return flat[torch.arange(flat.shape[0]), labels.reshape(-1)].sum()

    torch.manual_seed(0)
    _check(f, torch.randn(3, 3, 19), torch.randint(0, 19, (3, 3)))


def test_attention_over_a_slice_of_the_tokens():
    # the keys are an alias of a sliced (fixed-size) axis: the trace knows their size
    def f(x):
        h = x[:, :-1]
        return F.scaled_dot_product_attention(h, h, h, is_causal=True)

    torch.manual_seed(0)
    _check(f, torch.randn(2, 9, 8))


def test_a_captured_parameter_is_named_with_how_to_pass_it():
    layer = torch.nn.Linear(8, 4)

    def f(x):
        return torch.softmax(layer(x), -1)

    with pytest.raises(TypeError, match=r"captured \(a module's parameter, a global\).*pass it as one"):
        nf.compile(f)(torch.randn(3, 8))
    torch.testing.assert_close(nf.compile(lambda x, w, b: torch.softmax(F.linear(x, w, b), -1))(
        x := torch.randn(3, 8), layer.weight.detach(), layer.bias.detach()), f(x).detach(), rtol=1e-5, atol=1e-5)


def test_the_max_of_a_logsumexp_of_scaled_values_is_proved_free():
    # exp(0.5 * x + 0.25 - m): the sum's rate along the max's motion is -1 only up to a float
    # rounding of exp(0.25) in SymPy, which the proof now snaps; without it the backward sent the
    # rounding residue of grad - sum(grad * p) to each row's argmax (10x eager's fp16 error)
    from neptune_fusion.transform.grad import differentiate

    def f(x):
        return torch.logsumexp(x * 0.5 + 0.25, -1)

    torch.manual_seed(0)
    x = torch.randn(2, 36, 48)
    assert differentiate(nf.program(f).trace(x), ("x",)).free_stabilisers
    _check(f, x)
