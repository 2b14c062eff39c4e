"""One training case of bench/general_check.py on the GPU: LayerNorm -> matmul, bf16, 2387 x 1024 @
1024 x 296 (its backward's split-K combine asked for 266 KB of shared memory before its epilogue
tiles were fitted), gradients against torch autograd of the fp32 reference.

    python -m bench.case_check      (GPU machine)
"""

import torch

import neptune_fusion as nf
from bench.common import rel_err
from bench.general_check import PROGRAMS, _gradient_error


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    prog, make, plain = PROGRAMS["layernorm_matmul"]
    inputs = tuple(t.to(torch.bfloat16) for t in make(randn, 2387, 1024, 296))
    fn = nf.compile(prog)
    out = fn(*inputs)
    print("forward", rel_err(out.float(), plain(*(t.float() for t in inputs)).float()))
    print("gradients", _gradient_error(fn, plain, inputs, randn))


if __name__ == "__main__":
    main()
