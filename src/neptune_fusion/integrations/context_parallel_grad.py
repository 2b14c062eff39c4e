"""The backward of context-parallel attention: gradients of q, k and v through a second ring.

The forward keeps each local query chunk's output O and its global log-sum-exp L (the merge of
every pair's partial). The merged output is o = sum_j w_j o_j with w_j = exp(lse_j - L), so a pair
(query chunk i, key chunk j) contributes to the gradients what `w_j * (o_j - o)` contributes, with
L and o held fixed: its derivative along o_j is w_j and along lse_j is w_j (o_j - o), the merge's
own. Each pair's contribution is taken by recomputing the pair with `nf.attention` (its LSE
output, its derived backward) and asking torch's autograd for the gradients of that expression,
so every score_mod and mask_mod the forward runs, at global positions, gets its backward.

The key/value shards travel around the ring again, each with fp32 accumulators of its dK and dV;
every rank adds what its query chunks give them and passes them on, and after `world` steps each
rank holds the complete gradients of its own shard. dQ stays where it is computed. Transfers here
are not overlapped with the compute. Pairs the forward skipped (fully masked) are skipped again.
Tensors the mods capture get no gradient through the ring: a call where one requires grad is
refused before any communication.

Example (the expression whose gradients a pair adds, on one pair of a tiny problem):
    >>> import torch
    >>> o_j, lse_j = torch.randn(1, 1, 2, 3), torch.randn(1, 1, 2)
    >>> o, big_l = torch.randn(1, 1, 2, 3), torch.full((1, 1, 2), float("-inf"))
    >>> pair_term(o_j, lse_j, o, big_l).abs().sum().item()   # rows that see no key give nothing
    0.0
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from neptune_fusion.integrations.context_parallel_comm import shard_offsets
from neptune_fusion.integrations.context_parallel_merge import Partial
from neptune_fusion.integrations.context_parallel_plan import shard_length

__all__ = ["RingAttention", "pair_term"]

# attend(q_chunk, k_chunk, v_chunk, query chunk id, global offset of the key chunk) -> Partial
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], Partial]


def pair_term(o_j: torch.Tensor, lse_j: torch.Tensor, o: torch.Tensor, big_l: torch.Tensor) -> torch.Tensor:
    """`exp(lse_j - L) * (o_j - o)`: the expression whose gradient (L and o held fixed) is what the
    merged output's gradient gives one pair; 0 on rows that see no key at all (L = -inf)."""
    seen = torch.isfinite(big_l)
    exponent = torch.where(seen, lse_j.float() - big_l.float(), torch.full_like(big_l.float(), float("-inf")))
    return torch.exp(exponent)[..., None] * (o_j.float() - o.float())


class RingAttention(torch.autograd.Function):
    """`run(q, k, v) -> (output, {query chunk: its global LSE or None})` as an autograd function
    whose backward is the second ring of the module docstring."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: Callable[..., Any],
                ring: dict[str, Any]) -> torch.Tensor:
        out, lses = run(q, k, v)
        ctx.ring, ctx.lses = ring, lses
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, out, grad, ctx.lses, **ctx.ring)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad: torch.Tensor,
                   lses: dict[int, torch.Tensor | None], *, attend: Attend, q_bounds: Any, kv_bounds: Any,
                   visible: list[list[bool]], group: Any, rank: int, world: int,
                   load_balance: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q_chunks = shard_offsets(q_bounds, world, rank, load_balance)
    lengths = [shard_length(kv_bounds[-1][1], world, r, load_balance) for r in range(world)]
    longest = max(lengths)
    pad = longest - k.shape[2]
    # what travels: this shard's k and v (padded to the longest shard) and its gradients' accumulators
    k_src = torch.nn.functional.pad(k, (0, 0, 0, pad))
    v_src = torch.nn.functional.pad(v, (0, 0, 0, pad))
    dk_src = k_src.new_zeros(k_src.shape, dtype=torch.float32)
    dv_src = v_src.new_zeros(v_src.shape, dtype=torch.float32)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    nxt_peer = dist.get_global_rank(group, (rank + 1) % world) if world > 1 else rank
    prev_peer = dist.get_global_rank(group, (rank - 1) % world) if world > 1 else rank
    for t in range(world):
        src = (rank - t) % world
        for j, a, b in shard_offsets(kv_bounds, world, src, load_balance):
            for i, qa, qb in q_chunks:
                if not visible[i][j] or lses.get(i) is None:
                    continue
                gq, gk, gv = _pair_gradients(attend, q[:, :, qa:qb], k_src[:, :, a:b], v_src[:, :, a:b], i,
                                             kv_bounds[j][0], out[:, :, qa:qb], lses[i], grad[:, :, qa:qb])
                dq[:, :, qa:qb] += gq
                dk_src[:, :, a:b] += gk
                dv_src[:, :, a:b] += gv
        if world > 1:  # pass the shard on; the last pass brings each shard's gradients home
            travelling = [dk_src, dv_src] if t == world - 1 else [k_src, v_src, dk_src, dv_src]
            arriving = [torch.empty_like(x) for x in travelling]
            ops = [dist.P2POp(dist.isend, x.contiguous(), nxt_peer, group) for x in travelling]
            ops += [dist.P2POp(dist.irecv, x, prev_peer, group) for x in arriving]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            if t == world - 1:
                dk_src, dv_src = arriving
            else:
                k_src, v_src, dk_src, dv_src = arriving
    own = k.shape[2]
    return dq, dk_src[:, :, :own], dv_src[:, :, :own]


def _pair_gradients(attend: Attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, kv_off: int,
                    out: torch.Tensor, big_l: torch.Tensor, grad: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What one (query chunk, key chunk) pair adds to dq, dk and dv (fp32)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        part = attend(*leaves, chunk, kv_off)
        term = pair_term(part.out, part.lse, out, big_l)
        found = torch.autograd.grad(term, leaves, grad.float(), allow_unused=True)
    return tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device) if g is None else g.float()  # type: ignore[return-value]
                 for g, t in zip(found, leaves))
