# ruff: noqa: B023 - every closure is used right where it is made
"""Split-K decode on the GPU over shapes no benchmark names: batch, speculative query lengths,
GQA ratios, head dims, KV lengths that are not multiples of anything, dtypes, score and mask mods,
each against an fp32 reference on random inputs, with the plan the runtime chose.

    python -m bench.decode_check      (GPU machine; writes $OUT/decode_check.json)
"""

from __future__ import annotations

import itertools

import torch

import neptune_fusion as nf
from bench.common import environment, reference, rel_err, write_results
from neptune_fusion.integrations.attention import _compiled_for, _resolve

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2, torch.float32: 1e-4}


def mods(name: str, hq: int, sk: int, sq: int, batch: int):
    """(score_mod, mask_mod) of one named variant for these sizes."""
    dev = "cuda"
    slopes = torch.exp2(-8.0 * torch.arange(1, hq + 1, device=dev) / hq)
    lengths = torch.randint(1, sk + 1, (batch,), device=dev)
    offset = sk - sq  # query i sits at position sk - sq + i (speculative decoding)
    table = {
        "plain": (None, None),
        "causal_offset": (None, lambda b, h, qi, ki: ki <= qi + offset),
        "alibi": (lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi - offset), None),
        "softcap": (lambda s, b, h, qi, ki: 30 * torch.tanh(s / 30), None),
        "lengths": (None, lambda b, h, qi, ki: ki < lengths[b]),
        "window_softcap": (lambda s, b, h, qi, ki: 20 * torch.tanh(s / 20),
                           lambda b, h, qi, ki: (ki <= qi + offset) & (qi + offset - ki < 1000)),
    }
    return table[name]


def main() -> None:
    torch.manual_seed(0)
    rows = []
    shapes = [  # (batch, hq, hkv, sq, sk, d)
        (1, 32, 32, 1, 1000, 128), (1, 64, 8, 1, 5000, 128), (4, 32, 8, 1, 3333, 128), (2, 16, 2, 4, 777, 128),
        (1, 8, 1, 8, 40000, 128), (3, 12, 4, 2, 2049, 64), (1, 16, 16, 1, 9001, 256), (1, 28, 4, 3, 130, 128),
        (2, 32, 32, 1, 65, 128), (1, 64, 8, 1, 70000, 128),
    ]
    variants = ["plain", "causal_offset", "alibi", "softcap", "lengths", "window_softcap"]
    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    failures = 0
    for (batch, hq, hkv, sq, sk, d), name, dtype in itertools.product(shapes, variants, dtypes):
        if dtype != torch.float16 and (name not in ("plain", "softcap", "lengths") or sk > 10000):
            continue  # other dtypes on a subset: each case compiles its own kernels
        q = torch.randn(batch, hq, sq, d, device="cuda", dtype=dtype)
        k = torch.randn(batch, hkv, sk, d, device="cuda", dtype=dtype)
        v = torch.randn(batch, hkv, sk, d, device="cuda", dtype=dtype)
        score_mod, mask_mod = mods(name, hq, sk, sq, batch)
        scale = d ** -0.5
        row = {"batch": batch, "hq": hq, "hkv": hkv, "sq": sq, "sk": sk, "d": d, "variant": name,
               "dtype": str(dtype).removeprefix("torch.")}
        try:
            out = nf.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, enable_gqa=hq != hkv)
            ref, _ = reference(q, k, v, score_mod, mask_mod, scale)
            row["rel_err"] = rel_err(out, ref)
            call = _resolve(q, k, v, score_mod, mask_mod, None, hq != hkv, False)
            compiled = _compiled_for(call, None)
            exe = compiled.executable_for(compiled.program_def.trace(**call.args), call.args)
            row["plan"] = str(exe.plan)
            row["ok"] = bool(row["rel_err"] <= TOLERANCE[dtype])
        except Exception as exc:  # noqa: BLE001 - a failure is a finding, recorded with the case
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            row["ok"] = False
        failures += not row["ok"]
        rows.append(row)
        print(f"{'ok  ' if row['ok'] else 'FAIL'} b{batch} h{hq}/{hkv} q{sq} k{sk} d{d} {name:15s} {row['dtype']:9s} "
              f"err {row.get('rel_err', float('nan')):.1e} {row.get('plan', row.get('error', ''))}", flush=True)
        del q, k, v
        if len(rows) % 10 == 0:
            write_results("decode_check", {"environment": environment(), "rows": rows, "failures": failures})
    print(f"{len(rows) - failures} / {len(rows)} correct")
    write_results("decode_check", {"environment": environment(), "rows": rows, "failures": failures})


if __name__ == "__main__":
    main()
