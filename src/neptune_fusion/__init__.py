"""neptune_fusion: fuse chains of reductions (attention and beyond) into single GPU kernels.

Example:
    >>> import neptune_fusion as nf
    >>> @nf.program
    ... def attention(q, k, v, scale):
    ...     s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    ...     p = nf.exp(s - s.max(axis=-1, keepdims=True))
    ...     return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)
    >>> fn = nf.compile(attention)   # then: out = fn(q, k, v, scale=0.088)
"""

import neptune_fusion.integrations.autograd  # noqa: F401  (calls whose inputs require grad get the derived backward)
import neptune_fusion.integrations.ops  # noqa: F401  (nf.compile'd calls inside torch.compile become one op)
from neptune_fusion.integrations.attention import attention, attention_inputs, attention_program, explain_attention
from neptune_fusion.integrations.context_parallel import (
    context_parallel_attention,
    context_parallel_gather,
    context_parallel_shard,
)
from neptune_fusion.ir.errors import FusionError, UnsupportedProgramError
from neptune_fusion.lang.ops import (
    abs_,
    cast,
    cos,
    einsum,
    erf,
    exp,
    exp2,
    index,
    inf,
    log,
    log2,
    matmul,
    max,
    maximum,
    min,
    minimum,
    repeat_interleave,
    rsqrt,
    sigmoid,
    sin,
    size,
    sqrt,
    sum,
    tanh,
    where,
)
from neptune_fusion.lang.trace import ProgramDef, program
from neptune_fusion.runtime.compiled import Compiled, compile
from neptune_fusion.runtime.explain import explain
from neptune_fusion.runtime.options import Options
from neptune_fusion.runtime.reference import run_reference
from neptune_fusion.schedule.templates import Auto, Autotune, Flash, SplitK, auto, autotune, flash, split_k

__version__ = "0.1.0"

__all__ = [
    "Auto", "Autotune", "Compiled", "Flash", "FusionError", "Options", "ProgramDef", "SplitK", "UnsupportedProgramError",
    "abs_", "auto", "autotune", "cast", "compile", "cos", "einsum", "erf", "exp", "exp2", "explain", "flash", "index",
    "inf", "log", "log2", "matmul", "max", "maximum", "min", "minimum", "program", "rsqrt",
    "run_reference", "sigmoid", "sin", "size", "split_k", "sqrt", "sum", "tanh", "where",
]
__all__ += ["attention", "attention_inputs", "attention_program", "explain_attention", "repeat_interleave"]
__all__ += ["context_parallel_attention", "context_parallel_gather", "context_parallel_shard"]
