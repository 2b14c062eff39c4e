"""Triton code generation: prints a TileKernel as a `@triton.jit` Python module.

Broadcasting between tile values is by axis name: an operand with fewer axes
than the result is expanded with `[:, None]`-style indexing. `target="cuda"`
uses fast PTX for tanh; `target="interpreter"` keeps to what TRITON_INTERPRET runs.

Example:
    >>> from neptune_fusion.tile.lower import example_kernel
    >>> kernel = example_kernel()
    >>> source = generate(kernel, target="interpreter")
    >>> source.splitlines()[:2]
    ['import triton', 'import triton.language as tl']
    >>> code = compile(source, "fused_kernel.py", "exec")   # plain Python, loaded with triton.jit kernels
"""

from __future__ import annotations

import math

from neptune_fusion.tile.ir import Assign, If, Loop, Op, Stmt, Store, TileKernel, TVal

TL_DTYPES = {"f32": "tl.float32", "f16": "tl.float16", "bf16": "tl.bfloat16", "i32": "tl.int32",
             "i64": "tl.int64", "bool": "tl.int1"}

_PREAMBLE = '''import triton
import triton.language as tl


@triton.jit
def _floordiv(a, b):
    # Python's floor division of integers (Triton's // truncates toward zero): a - a mod b is a
    # multiple of b, so truncating its quotient is exact
    return (a - _mod(a, b)) // b


@triton.jit
def _mod(a, b):
    # Python's modulo (the sign of the divisor). On integers, without a comparison on a % b: Triton's
    # axis analysis takes a % b of a contiguous run of indices as if the run were not negative
    # (contiguous between multiples of b), and then computes a comparison on it once per run it
    # believes constant, so a where on r < 0 picks wrongly for a negative run (an index below 0)
    if a.dtype.is_floating():  # % is fmod on floats
        r = a % b
        return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
    return ((a % b) + b) % b


@triton.jit
def _floordiv_float(a, b):
    # Python's (and torch's) float floor division, exact where floor(a / b) rounds across an
    # integer (1.0 // 0.1 is 9.0): from the remainder, as CPython's float_floor_div computes it
    r = a % b
    q = (a - r) / b
    q = tl.where((r != 0) & ((r < 0) != (b < 0)), q - 1.0, q)
    f = tl.floor(q)
    f = tl.where(q - f > 0.5, f + 1.0, f)
    f = tl.where(q == 0, (a / b) * 0.0, f)  # a zero quotient keeps the sign of a / b
    return tl.where(b == 0, a / b, f)
'''

# max / min as torch computes them (torch.maximum, torch.amax): a NaN operand gives NaN. Triton's
# tl.maximum drops a NaN by default (PTX max.f32) and tl.max reduces with it and has no switch.
# On the GPU the combine is PTX max.NaN.f32 written out: one FMNMX.NAN for each FMNMX, the kernels'
# machine code otherwise unchanged. tl.maximum(..., propagate_nan=ALL) (LLVM's maximum) gives the
# same instruction but lets LLVM vectorise the reductions built from it and the score arithmetic
# feeding them, which it then scalarises badly.
_NAN_PAIRS = (("maximum", "max", "-inf"), ("minimum", "min", "inf"))


def _each_nan_pair(template: str) -> str:
    return "".join(template.format(fn=fn, op=op, identity=identity) for fn, op, identity in _NAN_PAIRS)


_NAN_COMBINE_CUDA = _each_nan_pair('''

@triton.jit
def _{fn}_nan(a, b):
    if a.dtype == tl.float32:
        return tl.inline_asm_elementwise("{op}.NaN.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.{fn}(a, b, propagate_nan=tl.PropagateNan.ALL)
''')

# (the interpreter's tl.maximum / tl.minimum are numpy's, which propagate NaN either way)
_NAN_COMBINE_PORTABLE = _each_nan_pair('''

@triton.jit
def _{fn}_nan(a, b):
    return tl.{fn}(a, b, propagate_nan=tl.PropagateNan.ALL)
''')

_REDUCE_NAN_CUDA = '''

@triton.jit
def _max_nan(x, AXIS: tl.constexpr):
    # torch.amax: a NaN among the values gives NaN
    return tl.reduce(x, AXIS, _maximum_nan)


@triton.jit
def _min_nan(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, _minimum_nan)
'''

# The interpreter runs a reduction with a combine function of its own one element at a time; its
# tl.max / tl.min are numpy's nanmax / nanmin (NaN skipped, as on the GPU): put the NaN back.
_REDUCE_NAN_PORTABLE = _each_nan_pair('''

@triton.jit
def _{op}_nan(x, AXIS: tl.constexpr):
    nan = tl.sum((x != x).to(tl.int32), AXIS) != 0
    return tl.where(nan, float("nan"), tl.{op}(tl.where(x != x, float("{identity}"), x), AXIS))
''')

_TANH_CUDA = '''

@triton.jit
def _tanh(x):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
'''

_TANH_PORTABLE = '''

@triton.jit
def _tanh(x):
    # 2 sigmoid(2x) - 1 cancels for small |x| (a large softcap's s / c): there the series
    x2 = x * x
    return tl.where(tl.abs(x) < 0.0625, x * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0))), 2.0 * tl.sigmoid(2.0 * x) - 1.0)
'''

_UNARY = {
    "exp2": "tl.exp2({})", "log": "tl.log({})", "log2": "tl.log2({})", "tanh": "_tanh({})",
    "sigmoid": "tl.sigmoid({})", "sqrt": "tl.sqrt({})", "rsqrt": "tl.rsqrt({})", "abs": "tl.abs({})",
    "neg": "-{}", "not": "({} == 0)", "sin": "tl.sin({})", "cos": "tl.cos({})", "recip": "(1.0 / {})",
    "exp": "tl.exp({})", "erf": "tl.erf({})", "detach": "{}",
}
_BINARY = {
    "add": "{} + {}", "sub": "{} - {}", "mul": "{} * {}", "div": "{} / {}",
    "max": "tl.maximum({}, {})", "min": "tl.minimum({}, {})",  # integers; floats: _FLOAT_BINARY
    "lt": "{} < {}", "le": "{} <= {}", "gt": "{} > {}", "ge": "{} >= {}", "eq": "{} == {}", "ne": "{} != {}",
    "and": "{} & {}", "or": "{} | {}", "floordiv": "_floordiv({}, {})", "mod": "_mod({}, {})",
}

# on floats, max / min propagate NaN as torch.maximum / torch.minimum do
_FLOAT_BINARY = {"max": "_maximum_nan({}, {})", "min": "_minimum_nan({}, {})"}
_REDUCE = {"sum": "tl.sum({}, axis={})", "max": "_max_nan({}, {})", "min": "_min_nan({}, {})"}


def _literal(value: object) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float):
        if math.isinf(value):
            return 'float("-inf")' if value < 0 else 'float("inf")'
        if math.isnan(value):
            return 'float("nan")'
        return repr(value)
    return repr(value)


class _Printer:
    def __init__(self, kernel: TileKernel, target: str) -> None:
        self.kernel = kernel
        self.target = target
        self.lines: list[str] = []

    def shape(self, axes: tuple[str, ...]) -> str:
        return "[" + ", ".join(self.kernel.block_sizes[a] for a in axes) + "]"

    def ref(self, v: TVal, axes: tuple[str, ...]) -> str:
        """`v` expanded to broadcast against a value with `axes`."""
        if not v.axes or v.axes == axes:
            return v.name
        index = ", ".join(":" if a in v.axes else "None" for a in axes)
        return f"{v.name}[{index}]"

    def expr(self, op: Op) -> str:
        k, a, out = op.kind, op.args, op.out
        at = op.attrs
        if k == "const":
            return _literal(at["value"])
        if k == "program_id":
            return f"tl.program_id({at['dim']})"
        if k == "cdiv":
            return f"tl.cdiv({a[0].name}, {at['block']})"
        if k == "arange":
            return f"{a[0].name} + tl.arange(0, {at['block']})"
        if k == "unary":
            return _UNARY[at["op"]].format(self.ref(a[0], out.axes))
        if k == "binary":
            op_name = at["op"]
            floating = out.dtype in ("f32", "f16", "bf16")
            if op_name in ("floordiv", "mod") and at.get("nonnegative") and not floating:
                # operands the lowering knows are not negative (grid and tile arithmetic, an index of
                # axes and sizes): the machine's truncating // and % are Python's there
                symbol = "//" if op_name == "floordiv" else "%"
                if not out.axes:
                    return f"{a[0].name} {symbol} {a[1].name}"
                return f"({self.ref(a[0], out.axes)} {symbol} {self.ref(a[1], out.axes)})"
            if op_name == "floordiv" and floating:  # Triton's // is for integers only
                return f"_floordiv_float({self.ref(a[0], out.axes)}, {self.ref(a[1], out.axes)})"
            table = _FLOAT_BINARY if floating and op_name in _FLOAT_BINARY else _BINARY
            return "(" + table[op_name].format(self.ref(a[0], out.axes), self.ref(a[1], out.axes)) + ")"
        if k == "where":
            return f"tl.where({', '.join(self.ref(x, out.axes) for x in a)})"
        if k == "cast":
            return f"tl.cast({a[0].name}, {TL_DTYPES[at['to_dtype']]})"
        if k == "reduce":
            return _REDUCE[at["op"]].format(a[0].name, a[0].axes.index(at["axis"]))
        if k == "dot":
            kax = at["k"]
            x_axis = next(ax for ax in out.axes if ax in a[0].axes)
            lhs = a[0].name if a[0].axes == (x_axis, kax) else f"tl.trans({a[0].name})"
            y_axis = next(ax for ax in out.axes if ax in a[1].axes)
            rhs = a[1].name if a[1].axes == (kax, y_axis) else f"tl.trans({a[1].name})"
            if out.axes != (x_axis, y_axis):
                raise ValueError(f"dot result axes {out.axes} are not in canonical order")
            extra = f", {a[2].name}" if len(a) > 2 else ""
            prec = f", input_precision=\"{at['precision']}\"" if at.get("precision") else ""
            return f"tl.dot({lhs}, {rhs}{extra}{prec})"
        if k == "load":
            ptr = f"{at['buffer']}_ptr + {a[0].name} + {a[1].name}"
            policy = f", eviction_policy=\"{at['eviction']}\"" if at.get("eviction") else ""
            if len(a) > 2:
                other = "0.0" if out.dtype in ("f32", "f16", "bf16") else "0"
                return f"tl.load({ptr}, mask={self.ref(a[2], out.axes)}, other={other}{policy})"
            return f"tl.load({ptr}{policy})"
        if k == "make_desc":
            outer, inner = at["block"]
            return (f"tl.make_tensor_descriptor({at['buffer']}_ptr + {a[0].name}, shape=[{a[1].name}, {at['inner_size']}], "
                    f"strides=[{a[2].name}, 1], block_shape=[{outer}, {inner}])")
        if k == "desc_load":
            block = f"{a[0].name}.load([{a[1].name}, {a[2].name if len(a) > 2 else 0}])"
            return f"tl.trans({block})" if at.get("transposed") else block
        if k == "full":
            if not out.axes:
                return f"tl.full([], {_literal(at['value'])}, {TL_DTYPES[out.dtype]})"
            return f"tl.full({self.shape(out.axes)}, {_literal(at['value'])}, {TL_DTYPES[out.dtype]})"
        raise ValueError(f"unknown tile op {k!r}")

    def stmts(self, stmts: list[Stmt], indent: str) -> None:
        for st in stmts:
            if isinstance(st, Op):
                self.lines.append(f"{indent}{st.out.name} = {self.expr(st)}")
            elif isinstance(st, Assign):
                self.lines.append(f"{indent}{st.target.name} = {st.value.name}")
            elif isinstance(st, Store):
                mask = f", mask={self.ref(st.mask, st.offsets.axes)}" if st.mask is not None else ""
                self.lines.append(f"{indent}tl.store({st.buffer}_ptr + {st.base.name} + {st.offsets.name}, {st.value.name}{mask})")
            elif isinstance(st, If):
                if st.comment:
                    self.lines.append(f"{indent}# {st.comment}")
                self.lines.append(f"{indent}if {st.cond.name}:")
                self.stmts(st.body, indent + "    ")
            elif isinstance(st, Loop):
                if st.comment:
                    self.lines.append(f"{indent}# {st.comment}")
                self.lines.append(f"{indent}for {st.var.name} in range({st.start.name}, {st.stop.name}, {st.step}):")
                if not st.body:
                    self.lines.append(f"{indent}    pass")
                self.stmts(st.body, indent + "    ")
                if st.peeled:
                    self.lines.append(f"{indent}# last iteration ({st.var.name} = {st.stop.name})")

    def source(self) -> str:
        k = self.kernel
        params = [a.name for a in k.args] + [f"{c}: tl.constexpr" for c in k.constexprs]
        text = "\n".join(self._all_lines())
        out = [_PREAMBLE]
        if "_nan(" in text:
            out.append(_NAN_COMBINE_CUDA if self.target == "cuda" else _NAN_COMBINE_PORTABLE)
        if "_max_nan(" in text or "_min_nan(" in text:
            out.append(_REDUCE_NAN_CUDA if self.target == "cuda" else _REDUCE_NAN_PORTABLE)
        if "_tanh(" in text:
            out.append(_TANH_CUDA if self.target == "cuda" else _TANH_PORTABLE)
        out.append("\n\n@triton.jit" + (f"(do_not_specialize={k.do_not_specialize!r})" if k.do_not_specialize else ""))
        out.append(f"def {k.name}(")
        out.extend(f"    {p}," for p in params)
        out.append("):")
        out.extend(f"    # {n}" for n in k.notes)
        out.extend(self._grid_dependency())
        out.extend(self.lines)
        return "\n".join(out) + "\n"

    def _grid_dependency(self) -> list[str]:
        if self.kernel.grid_dependency == "none" or self.target != "cuda":
            return []
        if self.kernel.grid_dependency == "primary":
            return ["    # the dependent kernel may launch now: it waits for this one's writes itself",
                    "    tl.extra.cuda.gdc_launch_dependents()"]
        return ["    # launched early (programmatic dependent launch): wait for the previous kernel's writes",
                "    tl.extra.cuda.gdc_wait()"]

    def _all_lines(self) -> list[str]:
        if not self.lines:
            self.stmts(self.kernel.body, "    ")
        return self.lines


def generate(kernel: TileKernel, target: str = "cuda") -> str:
    """Triton source for `kernel` (`target`: "cuda" or "interpreter")."""
    if target not in ("cuda", "interpreter"):
        raise ValueError(f"unknown target {target!r}")
    return _Printer(kernel, target).source()
