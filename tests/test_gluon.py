"""The Gluon backend (codegen/gluon_source.py): which tile programs it takes, and that what it prints
compiles for Hopper (sm_90) here, without a GPU, into a warp-specialised kernel with wgmma.

Its results are checked on the H200 (bench/gluon_check.py); the interpreter runs Triton kernels only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import neptune_fusion as nf
from neptune_fusion.codegen.gluon_source import generate_gluon, gluon_support
from neptune_fusion.runtime import compiled
from neptune_fusion.runtime.compiled import Compiled, _backend_for, _gluon_precondition
from neptune_fusion.runtime.options import Options
from neptune_fusion.tile.ir import TileKernel

TORCH_POINTER = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int64: "*i64",
                 torch.int32: "*i32", torch.bool: "*i1"}


def _tile_for(monkeypatch, q, k, v, score_mod=None, mask_mod=None, schedule=None, gluon=False,
              **kw) -> tuple[TileKernel, dict]:
    """The main tile kernel the runtime lowers for these inputs, with tensor-descriptor loads;
    `gluon`: as it lowers it for the Gluon backend on a Hopper GPU (which it must then choose)."""
    monkeypatch.setenv("NEPTUNE_FUSION_TMA", "force")
    if gluon:
        monkeypatch.setattr(compiled, "_gluon_precondition", lambda device, options: None)
        monkeypatch.setenv("NEPTUNE_FUSION_BACKEND", "gluon")
    prog = nf.attention_program(q, k, v, score_mod=score_mod, mask_mod=mask_mod, **kw)
    named = nf.attention_inputs(q, k, v, score_mod=score_mod, mask_mod=mask_mod, **kw)
    exe = Compiled(lambda: None, schedule or nf.flash(128, 128, 8, 3)).executable_for(prog, named)
    if gluon:
        assert exe.main.backend == "gluon", exe.main.tile.notes
    return exe.main.tile, named


_COMPILE = """
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
path, name, spec_json = sys.argv[1:4]
spec = json.loads(spec_json)
loader = importlib.util.spec_from_file_location("gluon_kernel", path)
module = importlib.util.module_from_spec(loader)
loader.loader.exec_module(module)
fn = getattr(module, name)
index = {n: i for i, n in enumerate(fn.arg_names)}
attrs = {(index[n],): [["tt.divisibility", 16]] for n in spec["aligned"]}
constexprs = {(index[n],): v for n, v in spec["constexprs"].items()}
kernel = triton.compile(GluonASTSource(fn, spec["signature"], constexprs=constexprs, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print(json.dumps({"ttgir": kernel.asm["ttgir"], "ptx": kernel.asm["ptx"], "num_warps": kernel.metadata.num_warps,
                  "shared": kernel.metadata.shared}))
"""


def _compile_for_hopper(tile: TileKernel, named: dict, tmp_path) -> dict:
    """Compile the Gluon source of `tile` for sm_90 with Triton's own ptxas (no GPU needed), in a
    process of its own: Triton's library functions are interpreted objects once TRITON_INTERPRET=1
    was set at import, as it is for this test session."""
    path = tmp_path / f"{tile.name}.py"
    path.write_text(generate_gluon(tile))
    signature: dict[str, str] = {}
    aligned = []
    for arg in tile.args:
        kind, buffer = arg.source.kind, arg.source.name
        if arg.kind == "pointer":
            if kind == "input":  # block maps are int32 tensors the runtime builds
                signature[arg.name] = TORCH_POINTER[named[buffer].dtype] if buffer in named else "*i32"
            else:
                signature[arg.name] = "*fp16"
            aligned.append(arg.name)
        else:
            signature[arg.name] = "fp32" if arg.kind == "float" else "i32"
    signature.update({c: "constexpr" for c in tile.constexprs})
    spec = json.dumps({"signature": signature, "aligned": aligned, "constexprs": tile.constexprs})
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(path), tile.name, spec], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _qkv(hq=4, hkv=4, sq=256, sk=256, d=128, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, hq, sq, d, generator=g).to(dtype), torch.randn(1, hkv, sk, d, generator=g).to(dtype),
            torch.randn(1, hkv, sk, d, generator=g).to(dtype))


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def softcap(score, b, h, q_idx, kv_idx):
    return 50 * torch.tanh(score / 50)


@pytest.mark.parametrize("case", ["global", "alibi_causal", "softcap_window_gqa", "prefix_lse", "head_dim_64",
                                  "document_block_map"])
def test_gluon_source_compiles_for_hopper(monkeypatch, tmp_path, case):
    """Attention variants (masks as loop bounds, gathered biases, tanh, GQA head maps, a second
    output) print as warp-specialised Gluon that compiles to wgmma for sm_90."""
    kw: dict = {}
    if case == "global":
        q, k, v = _qkv()
        args = {}
    elif case == "alibi_causal":
        q, k, v = _qkv()
        slopes = torch.rand(4)
        args = {"score_mod": lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi), "mask_mod": causal}
    elif case == "softcap_window_gqa":
        q, k, v = _qkv(hq=8, hkv=2, sq=200, sk=300)
        args = {"score_mod": softcap, "mask_mod": lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 64)}
        kw["enable_gqa"] = True
    elif case == "prefix_lse":
        q, k, v = _qkv(sq=192, sk=192)
        args = {"mask_mod": lambda b, h, qi, ki: (ki < 40) | (qi >= ki)}
        kw["return_lse"] = True
    elif case == "head_dim_64":
        q, k, v = _qkv(sq=300, sk=200, d=64)
        args = {"mask_mod": causal}
    else:
        q, k, v = _qkv()
        doc = torch.arange(256) // 70
        args = {"mask_mod": lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki)}
    tile, named = _tile_for(monkeypatch, q, k, v, **args, **kw, gluon=True)
    kernel = _compile_for_hopper(tile, named, tmp_path)
    assert "ttg.warp_specialize" in kernel["ttgir"]
    assert "wgmma.mma_async" in kernel["ptx"]
    # two consumer warpgroups and the producer warp (padded to a warpgroup)
    assert kernel["num_warps"] == 12


def test_gluon_declines_what_it_cannot_print(monkeypatch):
    """Split-K, software-pipelined loops (the Triton backend's block-map index prefetching included)
    and fp32 dots keep the Triton backend, with a reason."""
    q, k, v = _qkv()
    split, _ = _tile_for(monkeypatch, q[:, :, :1], k, v, schedule=nf.split_k(splits=2))
    assert "split-K" in gluon_support(split)
    doc = torch.arange(256) // 100
    mapped, _ = _tile_for(monkeypatch, q, k, v, mask_mod=lambda b, h, qi, ki: doc[qi] == doc[ki])
    assert gluon_support(mapped) is not None
    pipelined, _ = _tile_for(monkeypatch, q, k, v, schedule=nf.flash(128, 128, 8, 2, prefetch_dot=True))
    assert "pipelined" in gluon_support(pipelined)
    f32, _ = _tile_for(monkeypatch, *(x.float() for x in (q, k, v)), schedule=nf.flash(128, 64, 8, 2))
    assert gluon_support(f32) is not None
    wide_q, wide_k, wide_v = _qkv(sq=128, sk=128, d=256)
    wide, _ = _tile_for(monkeypatch, wide_q, wide_k, wide_v, schedule=nf.flash(128, 128, 8, 2))
    assert "shared memory" in gluon_support(wide)
    with pytest.raises(ValueError, match="gluon code generation"):
        generate_gluon(split)


def test_short_block_mapped_loops_stay_on_triton(monkeypatch):
    """Under the automatic choice, block-mapped loops over few keys keep the Triton kernel (measured
    faster there), longer ones take Gluon with 128-wide key tiles unless the schedule fixes the width."""
    monkeypatch.setenv("NEPTUNE_FUSION_TMA", "force")
    monkeypatch.setattr(compiled, "_gluon_precondition", lambda device, options: None)
    for keys, schedule, backend, width in ((256, nf.flash(128), "triton", 32), (4352, nf.flash(128), "gluon", 128),
                                           (4352, nf.flash(128, 64), "gluon", 64)):
        q, k, v = _qkv(hq=1, hkv=1, sq=128, sk=keys, d=16)
        doc = torch.arange(keys) // 300
        mask = lambda b, h, qi, ki, doc=doc: doc[qi] == doc[ki]  # noqa: E731
        prog = nf.attention_program(q, k, v, mask_mod=mask)
        exe = Compiled(lambda: None, schedule).executable_for(prog, nf.attention_inputs(q, k, v, mask_mod=mask))
        assert (exe.main.backend, exe.plan.block_col) == (backend, width), exe.main.tile.notes


def test_interpreter_always_gets_triton_kernels(monkeypatch):
    q, k, v = _qkv(sq=128, sk=128)
    interpreted = Options(interpreter=True)
    reason = _gluon_precondition(torch.device("cpu"), interpreted)
    assert "interpreter" in reason and _backend_for(reason, interpreted)[0] == "triton"
    tile, _ = _tile_for(monkeypatch, q, k, v)
    assert "backend: Triton (not Gluon: Triton's interpreter" in tile.notes[-1]
    required = Options(interpreter=True, backend="gluon")
    with pytest.raises(ValueError, match="interpreter"):
        _backend_for(_gluon_precondition(torch.device("cpu"), required), required)
    monkeypatch.setenv("NEPTUNE_FUSION_BACKEND", "cuda")
    with pytest.raises(ValueError, match="NEPTUNE_FUSION_BACKEND"):
        Options.from_environment()
