"""Gluon code generation for Hopper: tile kernels as warp-specialised programs.

Gluon is Triton's explicit-layout dialect. Written through it, a tile kernel whose loop reads its
key-axis tiles through tensor descriptors becomes three partitions of one program:

- a producer warp that issues the copies (TMA) of the row-tile operands once and of every loop
  tile into a ring of shared-memory buffers, each slot guarded by mbarriers;
- two consumer warpgroups, each running the whole tile program for half of the row tile (64 rows):
  they wait on a slot's barriers, run their dots (wgmma) and arithmetic, and release the slot.

No barrier spans the whole program inside the loop, so the two consumers drift out of phase and
one's softmax runs while the other's matrix products use the tensor cores (faster than the same
loop through Triton). Loops over run-time tile lists
(block maps) work the same way: the producer reads the list itself. Kernels of other shapes (split-K,
second passes, fp32 dots, loads the copy engine cannot do) stay with `triton_source`; a runtime asks
`gluon_support` first.

Example: a tile program of 16-row tiles stays with Triton, and `gluon_support` says why:
    >>> from neptune_fusion.tile.lower import example_kernel
    >>> kernel = example_kernel()
    >>> gluon_support(kernel)
    'the row tile must be 128 rows (two consumer warpgroups of 64)'
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neptune_fusion.codegen.triton_source import _BINARY as _BINARY_TRITON
from neptune_fusion.codegen.triton_source import _FLOAT_BINARY, _NAN_COMBINE_CUDA, _TANH_CUDA, TL_DTYPES, _literal
from neptune_fusion.codegen.triton_source import _PREAMBLE as _PREAMBLE_TRITON
from neptune_fusion.codegen.triton_source import _UNARY as _UNARY_TRITON
from neptune_fusion.tile.ir import ArgSource, Assign, If, Loop, Op, Stmt, Store, TileKernel, TVal
from neptune_fusion.tile.resources import HOPPER_REGISTERS, footprint

ROW_BLOCK = 128  # two consumer warpgroups of 64 rows each
GLUON_LOOP_TILES = (64, 128)  # loop tile widths the consumers' wgmma layouts are written for
NUM_BUFFERS = 2  # ring slots (a third adds shared memory and no speed)
SHARED_MEMORY_BYTES = 220 * 1024  # of Hopper's 227 KB per program, with room for the barriers
CONSUMER_REGISTERS = 232  # per thread; the producer warp keeps 24 (setmaxnreg)
GL_DTYPES = {k: v.replace("tl.", "gl.") for k, v in TL_DTYPES.items()}
SIXTEEN_BIT = ("f16", "bf16")  # the tile element types wgmma and the copies here take

def _to_gluon(text: str) -> str:
    """Triton source fragments as Gluon ones: the same element-wise functions under `gl.`."""
    return text.replace("tl.", "gl.").replace("@triton.jit", "@gluon.jit").replace("Triton's", "Gluon's")


_HELPERS = _PREAMBLE_TRITON.split("\n\n\n", 1)[1]  # _floordiv and _mod
# max / min as torch computes them, a NaN operand giving NaN: PTX max.NaN.f32, written out as
# triton_source does it (gl.maximum drops a NaN by default, gl.max reduces with it)
_NAN_HELPERS = _to_gluon(_NAN_COMBINE_CUDA).replace("gl.PropagateNan.ALL", "PROPAGATE_NAN_ALL")
_NAN_HELPERS = "\n\nPROPAGATE_NAN_ALL = gl.constexpr(PropagateNan.ALL)\n" + _NAN_HELPERS
_PREAMBLE = ("from triton.experimental import gluon\n"
             "from triton.experimental.gluon import language as gl\n"
             "from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, "
             "warpgroup_mma_wait\n"
             "from triton.language import PropagateNan\n\n\n" + _to_gluon(_HELPERS + _TANH_CUDA) + _NAN_HELPERS)
_UNARY = {k: _to_gluon(v) for k, v in _UNARY_TRITON.items()}
_UNARY["sigmoid"] = "(1.0 / (1.0 + gl.exp(-({}))))"  # Gluon has no sigmoid
_BINARY = {k: _to_gluon(v) for k, v in _BINARY_TRITON.items()}
_REDUCE = {"sum": "gl.sum({}, axis={})", "max": "gl.reduce({}, {}, _maximum_nan)", "min": "gl.reduce({}, {}, _minimum_nan)"}


@dataclass
class _Shape:
    """What the generator learnt about a kernel it can print (see `_analyse`)."""

    row: str
    col: str
    defs: dict[str, Op]
    row_loads: list[Op]  # descriptor loads of row-tile operands (before the loops)
    rings: list[str]  # descriptors read inside every loop, in the order each body reads them
    loader_ops: list[Op]  # scalar ops the producer recomputes (loop bounds, descriptor arguments)
    coordinates: dict[str, list[Op]]  # loop variable -> the scalar ops giving its tiles' coordinates
    desc_dtypes: dict[str, str]  # descriptor -> the element type of its tiles
    pairs: list[str] = field(default_factory=list)  # X of every (row, X) register layout


def gluon_support(kernel: TileKernel) -> str | None:
    """None when `generate_gluon` can print `kernel`; otherwise why not (for explain and tests)."""
    try:
        _analyse(kernel)
    except _Unsupported as exc:
        return str(exc)
    return None


class _Unsupported(Exception):
    pass


def _walk(stmts: list[Stmt]):
    for st in stmts:
        yield st
        if isinstance(st, Loop):
            yield from _walk(st.body)


def _analyse(kernel: TileKernel) -> _Shape:
    # a split-K kernel takes its split count as the size of the split axis (tile/lower.py `_splits`)
    if kernel.grid_dependency != "none" or any(a.source == ArgSource("size", "split") for a in kernel.args):
        raise _Unsupported("split-K kernels are memory-bound: the Triton backend serves them")
    if kernel.tiled_axes:
        raise _Unsupported(f"axes {kernel.tiled_axes} are tiled across the grid or by inner loops")
    if kernel.constexprs.get("BLOCK_R") != ROW_BLOCK:
        raise _Unsupported(f"the row tile must be {ROW_BLOCK} rows (two consumer warpgroups of 64)")
    block_c = kernel.constexprs.get("BLOCK_C", 0)
    if block_c not in GLUON_LOOP_TILES:
        raise _Unsupported("key tiles must be 64 or 128 wide")
    row, col = kernel.tile_axes[0], kernel.tile_axes[1]
    defs: dict[str, Op] = {}
    uses: dict[str, list[tuple[Op, int]]] = {}
    for st in kernel.body:
        if isinstance(st, If):
            raise _Unsupported(f"a conditional around the loops ({st.comment or 'run-time tile lists'})")
        if not isinstance(st, (Op, Store, Loop)):
            raise _Unsupported(f"statement {type(st).__name__} outside the loops")
    loops = [st for st in kernel.body if isinstance(st, Loop)]
    if not loops:
        raise _Unsupported("no loop over the reduced axis")
    for loop in loops:
        if loop.peeled or loop.ahead:
            raise _Unsupported("software-pipelined loops (prefetch_dot, prefetched indices)")
        for st in loop.body:
            if not isinstance(st, (Op, Assign)):
                raise _Unsupported(f"{type(st).__name__} inside a loop (a second pass or a block map)")
    for st in _walk(kernel.body):
        if isinstance(st, Op):
            defs[st.out.name] = st
            for i, a in enumerate(st.args):
                uses.setdefault(a.name, []).append((st, i))
            if len(st.out.axes) > 2 or (len(st.out.axes) == 2 and st.out.axes[0] != row
                                        and st.kind not in ("desc_load",)):
                raise _Unsupported(f"{st.out.name}: register tiles must be (rows, x), got {st.out.axes}")
            if st.kind == "full" and not st.out.axes:
                raise _Unsupported("scalar full")
    row_loads = [st for st in kernel.body if isinstance(st, Op) and st.kind == "desc_load"]
    for ld in row_loads:
        if ld.out.axes[0] != row or ld.out.dtype not in SIXTEEN_BIT:
            raise _Unsupported(f"{ld.out.name}: a descriptor load outside the loops must be a 16-bit row tile")
        if any(op.kind != "dot" or i != 0 for op, i in uses.get(ld.out.name, [])):
            raise _Unsupported(f"{ld.out.name}: a row tile from shared memory can only feed dots")
    rings: list[str] | None = None
    coordinates: dict[str, list[Op]] = {}
    for loop in loops:
        loads = [st for st in loop.body if isinstance(st, Op) and st.kind == "desc_load"]
        names = [ld.args[0].name for ld in loads]
        if rings is None:
            rings = names
        elif names != rings:
            raise _Unsupported("loops read different descriptor tiles")
        for ld in loads:
            if ld.out.axes[0] != col or ld.out.dtype not in SIXTEEN_BIT:
                raise _Unsupported(f"{ld.out.name}: loop tiles must be 16-bit (key, x) tiles")
            if any(op.kind != "dot" or i != 1 for op, i in uses.get(ld.out.name, [])):
                raise _Unsupported(f"{ld.out.name}: a loop tile from shared memory can only feed dots as their B")
        coordinates[loop.var.name] = _scalar_closure([ld.args[1].name for ld in loads], loop.body,
                                                     "a loop tile's coordinate")
    if not rings:
        raise _Unsupported("the loop reads no tile through a tensor descriptor")
    pairs: list[str] = []
    for op in defs.values():
        if op.kind == "dot":
            a, b = op.args[0], op.args[1]
            if op.attrs.get("precision") or a.dtype not in SIXTEEN_BIT or b.dtype not in SIXTEEN_BIT:
                raise _Unsupported(f"{op.out.name}: wgmma here takes 16-bit operands")
            if defs[b.name].kind != "desc_load" or b.name in {ld.out.name for ld in row_loads}:
                raise _Unsupported(f"{op.out.name}: the B operand must be a loop tile")
            in_loop = any(a.name == st.out.name for loop in loops for st in loop.body if isinstance(st, Op))
            if a.name not in {ld.out.name for ld in row_loads} and not (in_loop and a.axes[0] == row):
                raise _Unsupported(f"{op.out.name}: the A operand must be a row tile read through a descriptor "
                                   "or a tile computed in the loop")
        if len(op.out.axes) == 2 and op.kind != "desc_load" and op.out.axes[1] not in pairs:
            pairs.append(op.out.axes[1])
        if len(op.out.axes) == 1 and op.out.axes[0] != row and op.out.axes[0] not in pairs:
            pairs.append(op.out.axes[0])
    # row vectors take the layout of the (rows, key) tiles they mostly meet
    pairs.sort(key=lambda x: x != col)
    for x in pairs:
        n = kernel.constexprs[kernel.block_sizes[x]]
        if n > 256 or n % 16:
            raise _Unsupported(f"axis {x}: a (rows, {x}) register tile needs a block of at most 256, a multiple of 16")
    ring_bytes = sum(_tile_bytes(kernel, defs[d], block_c) for d in rings)
    row_bytes = sum(_tile_bytes(kernel, defs[ld.args[0].name], ROW_BLOCK) for ld in row_loads)
    desc_dtypes = {ld.args[0].name: ld.out.dtype for ld in row_loads}
    desc_dtypes.update({op.args[0].name: op.out.dtype for op in defs.values() if op.kind == "desc_load"})
    if row_bytes + NUM_BUFFERS * ring_bytes > SHARED_MEMORY_BYTES:
        raise _Unsupported(f"{NUM_BUFFERS} ring slots of {ring_bytes} bytes and {row_bytes} bytes of row tiles "
                           f"exceed {SHARED_MEMORY_BYTES} bytes of shared memory")
    # what the producer recomputes: loop bounds, descriptor arguments and tile coordinates (scalar
    # reads of a block map included)
    todo = [v.name for loop in loops for v in (loop.start, loop.stop)]
    for name in rings + [ld.args[0].name for ld in row_loads]:
        todo.extend(a.name for a in defs[name].args)
    todo.extend(ld.args[1].name for ld in row_loads)
    todo.extend(a.name for ops in coordinates.values() for op in ops for a in op.args)
    loader_ops = _scalar_closure(todo, kernel.body, "a loop bound or descriptor argument")
    # each consumer warpgroup holds half the rows' carried state and work tiles; the Triton backend
    # can plan narrower tiles for a loop that carries more than a consumer's registers hold
    consumer = consumer_registers(kernel)
    if consumer > HOPPER_REGISTERS:
        raise _Unsupported(f"a consumer warpgroup would need about {consumer} registers a thread "
                           f"(at most {HOPPER_REGISTERS})")
    return _Shape(row, col, defs, row_loads, rings, loader_ops, coordinates, desc_dtypes, pairs)


def consumer_registers(kernel: TileKernel) -> int:
    """Registers a thread of one consumer warpgroup needs: it holds half the rows' carried state
    and work tiles (the schedule's register estimate at 64 rows and 4 warps)."""
    return footprint(kernel).registers({**kernel.constexprs, "BLOCK_R": ROW_BLOCK // 2}, 4)


def _tile_bytes(kernel: TileKernel, desc: Op, rows: int) -> int:
    """Bytes of a `rows`-row tile read through descriptor `desc` (16-bit elements)."""
    return rows * kernel.constexprs[desc.attrs["block"][1]] * 2


def _scalar_closure(names: list[str], stmts: list[Stmt], what: str) -> list[Op]:
    """The ops among `stmts` (in their order) that the scalar values `names` are computed from."""
    local = {st.out.name: st for st in stmts if isinstance(st, Op)}
    needed: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in needed or name not in local:
            continue
        if local[name].out.axes:
            raise _Unsupported(f"{name}: {what} computed from a tile")
        needed.add(name)
        todo.extend(a.name for a in local[name].args)
    return [op for name, op in local.items() if name in needed]


class _GluonPrinter:
    def __init__(self, kernel: TileKernel, shape: _Shape, num_buffers: int) -> None:
        self.kernel = kernel
        self.shape = shape
        self.num_buffers = num_buffers
        self.row_load_names = {ld.out.name for ld in shape.row_loads}
        self.smem: dict[str, str] = {}  # desc_load value -> the shared-memory view it reads
        self.canon_row = shape.pairs[0] if shape.pairs else None

    # --- layouts --------------------------------------------------------------------
    def block(self, axis: str) -> str:
        return "HALF_R" if axis == self.shape.row else self.kernel.block_sizes[axis]

    def layout(self, axes: tuple[str, ...]) -> str | None:
        row = self.shape.row
        if not axes:
            return None
        if len(axes) == 2:
            return f"L_{axes[1]}"
        if axes[0] == row:
            return f"R_{self.canon_row}"
        return f"C_{axes[0]}"

    def layout_defs(self) -> list[str]:
        k = self.kernel
        lines = []
        for x in self.shape.pairs:
            n = k.constexprs[k.block_sizes[x]]
            lines.append(f"L_{x}: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], "
                         f"instr_shape=[16, {n}, 16])")
            lines.append(f"R_{x}: gl.constexpr = gl.SliceLayout(1, L_{x})")
            lines.append(f"C_{x}: gl.constexpr = gl.SliceLayout(0, L_{x})")
        for op in self.shape.defs.values():
            a = op.args[0] if op.kind == "dot" else None
            if a is not None and a.name not in self.row_load_names:
                lines.append(f"A_{op.out.name}: gl.constexpr = gl.DotOperandLayout(operand_index=0, "
                             f"parent=L_{op.out.axes[1]}, k_width=2)")
        return lines

    def same_width(self, x: str, y: str | None) -> bool:
        """(rows, x) and (rows, y) tiles share one layout (equal wgmma instruction widths)."""
        k = self.kernel
        return y is not None and k.constexprs[k.block_sizes[x]] == k.constexprs[k.block_sizes[y]]

    def shape_of(self, axes: tuple[str, ...]) -> str:
        return "[" + ", ".join(self.block(a) for a in axes) + "]"

    def ref(self, v: TVal, axes: tuple[str, ...]) -> str:
        """`v` in the layout of values with `axes` (expanded along the axes it lacks)."""
        if not v.axes or v.axes == axes:
            return v.name
        if len(axes) == 1:
            return v.name
        row, x = axes
        if v.axes == (row,):
            value = v.name if self.same_width(x, self.canon_row) else f"gl.convert_layout({v.name}, R_{x})"
            return f"gl.expand_dims({value}, 1)"
        if v.axes == (x,):
            return f"gl.expand_dims({v.name}, 0)"
        raise ValueError(f"cannot broadcast {v.axes} to {axes}")

    # --- ops ------------------------------------------------------------------------
    def expr(self, op: Op) -> str:
        k, a, out, at = op.kind, op.args, op.out, op.attrs
        if k == "const":
            return _literal(at["value"])
        if k == "program_id":
            return f"gl.program_id({at['dim']})"
        if k == "cdiv":
            return f"gl.cdiv({a[0].name}, {at['block']})"
        if k == "arange":
            start = a[0].name
            if out.axes[0] == self.shape.row:
                start = f"({start} + HALF_INDEX * HALF_R)"
            return f"{start} + gl.arange(0, {self.block(out.axes[0])}, layout={self.layout(out.axes)})"
        if k == "unary":
            return _UNARY[at["op"]].format(self.ref(a[0], out.axes))
        if k == "binary":
            name = at["op"]
            if name in ("floordiv", "mod") and at.get("nonnegative") and out.dtype not in ("f32", "f16", "bf16"):
                symbol = "//" if name == "floordiv" else "%"  # operands known not to be negative
                if not out.axes:
                    return f"{a[0].name} {symbol} {a[1].name}"
                return f"({self.ref(a[0], out.axes)} {symbol} {self.ref(a[1], out.axes)})"
            table = _FLOAT_BINARY if out.dtype in ("f32", "f16", "bf16") and name in _FLOAT_BINARY else _BINARY
            return "(" + table[name].format(self.ref(a[0], out.axes), self.ref(a[1], out.axes)) + ")"
        if k == "where":
            return f"gl.where({', '.join(self.ref(x, out.axes) for x in a)})"
        if k == "cast":
            return f"gl.cast({a[0].name}, {GL_DTYPES[at['to_dtype']]})"
        if k == "reduce":
            axis = a[0].axes.index(at["axis"])
            value = _REDUCE[at["op"]].format(a[0].name, axis)
            if axis == 1 and not self.same_width(a[0].axes[1], self.canon_row):
                value = f"gl.convert_layout({value}, R_{self.canon_row})"
            return value
        if k == "load":
            ptr = f"{at['buffer']}_ptr + {a[0].name} + {a[1].name}"
            if len(a) > 2:
                other = "0.0" if out.dtype in ("f32", "f16", "bf16") else "0"
                return f"gl.load({ptr}, mask={self.ref(a[2], out.axes)}, other={other})"
            return f"gl.load({ptr})"
        if k == "full":
            return f"gl.full({self.shape_of(out.axes)}, {_literal(at['value'])}, {GL_DTYPES[out.dtype]}, {self.layout(out.axes)})"
        raise ValueError(f"unknown tile op {k!r}")

    def dot(self, op: Op, indent: str) -> list[str]:
        a, b = op.args[0], op.args[1]
        kax = op.attrs["k"]
        if a.name in self.smem:
            lhs = self.smem[a.name] if a.axes == (self.shape.row, kax) else f"{self.smem[a.name]}.permute((1, 0))"
        else:
            lhs = f"gl.convert_layout({a.name}, A_{op.out.name})"
        rhs = self.smem[b.name]
        if b.axes != (kax, op.out.axes[1]):
            rhs = f"{rhs}.permute((1, 0))"
        if len(op.args) > 2:
            acc, use = op.args[2].name, "True"
        else:
            acc, use = f"ZERO_{op.out.axes[1]}", "False"
        name = op.out.name
        return [f"{indent}{name} = warpgroup_mma({lhs}, {rhs}, {acc}, use_acc={use}, is_async=True)",
                f"{indent}{name} = warpgroup_mma_wait(0, deps=({name}, ))"]

    # --- partitions -----------------------------------------------------------------
    def params(self) -> list[str]:
        return [a.name for a in self.kernel.args] + list(self.kernel.constexprs)

    def signature(self) -> list[str]:
        return [a.name for a in self.kernel.args] + [f"{c}: gl.constexpr" for c in self.kernel.constexprs]

    def shared_names(self) -> list[str]:
        names = [f"rowbuf_{ld.out.name}" for ld in self.shape.row_loads]
        names += [f"ring_{d}" for d in self.shape.rings] + ["row_bar"]
        names += [f"ready_{d}" for d in self.shape.rings] + ["free_bar"]
        return names

    def partition(self, role: str, extra: list[str], comment: str, constants: list[str]) -> list[str]:
        """The header of a partition function: the kernel's parameters, its shared buffers, `extra`."""
        params = ", ".join(self.signature() + self.shared_names() + extra)
        lines = ["", "", "@gluon.jit", f"def {self.kernel.name}_{role}({params}):", f"    # {comment}"]
        return lines + [f"    {line}" for line in self.locals() + constants]

    def locals(self) -> list[str]:
        return ["HALF_R: gl.constexpr = BLOCK_R // 2", f"NUM_BUF: gl.constexpr = {self.num_buffers}"]

    def consumer(self) -> list[str]:
        k = self.kernel
        out = self.partition("consumer", ["HALF_INDEX: gl.constexpr"],
                             "half HALF_INDEX of the row tile: the whole tile program on 64 rows", self.layout_defs())
        for x in sorted({op.out.axes[1] for op in self.shape.defs.values() if op.kind == "dot" and len(op.args) == 2}):
            out.append(f"    ZERO_{x} = gl.zeros([HALF_R, {self.block(x)}], gl.float32, L_{x})  # use_acc=False ignores it")
        for ld in self.shape.row_loads:
            self.smem[ld.out.name] = f"rowbuf_{ld.out.name}.index(HALF_INDEX)"
        out.append("    it = 0  # ring position, shared with the producer")
        waited_rows = False
        for st in k.body:
            if isinstance(st, Op) and st.kind in ("make_desc", "desc_load"):
                continue
            if isinstance(st, Loop):
                if not waited_rows:
                    out.append("    mbarrier.wait(row_bar, 0)")
                    waited_rows = True
                out.extend(self.consumer_loop(st))
            else:
                out.extend(self.stmt(st, "    "))
        return out

    def consumer_loop(self, loop: Loop) -> list[str]:
        lines = []
        if loop.comment:
            lines.append(f"    # {loop.comment}")
        lines.append(f"    for {loop.var.name} in range({loop.start.name}, {loop.stop.name}, {loop.step}):")
        lines.append("        slot = it % NUM_BUF")
        lines.append("        phase = (it // NUM_BUF) & 1")
        for st in loop.body:
            if isinstance(st, Op) and st.kind == "desc_load":
                desc = st.args[0].name
                lines.append(f"        mbarrier.wait(ready_{desc}.index(slot), phase)")
                self.smem[st.out.name] = f"ring_{desc}.index(slot)"
                continue
            lines.extend(self.stmt(st, "        "))
        lines.append("        # every wgmma reading this slot has been waited for: hand it back")
        lines.append("        mbarrier.arrive(free_bar.index(slot), count=1)")
        lines.append("        it += 1")
        return lines

    def stmt(self, st: Stmt, indent: str) -> list[str]:
        if isinstance(st, Op):
            if st.kind == "dot":
                return self.dot(st, indent)
            return [f"{indent}{st.out.name} = {self.expr(st)}"]
        if isinstance(st, Assign):
            return [f"{indent}{st.target.name} = {st.value.name}"]
        if isinstance(st, Store):
            mask = f", mask={self.ref(st.mask, st.offsets.axes)}" if st.mask is not None else ""
            return [f"{indent}gl.store({st.buffer}_ptr + {st.base.name} + {st.offsets.name}, {st.value.name}{mask})"]
        raise ValueError(f"unexpected statement {type(st).__name__}")

    def descriptor(self, op: Op, outer_block: str) -> str:
        at = op.attrs
        base, size, stride = op.args
        inner = at["block"][1]
        return (f"tma.make_tensor_descriptor({at['buffer']}_ptr + {base.name}, shape=[{size.name}, {at['inner_size']}], "
                f"strides=[{stride.name}, 1], block_shape=[{outer_block}, {inner}], layout=SH_{op.out.name})")

    def shared_layouts(self) -> list[str]:
        lines = []
        descs = [ld.args[0].name for ld in self.shape.row_loads] + self.shape.rings
        for d in descs:
            op = self.shape.defs[d]
            dtype = self.shape.desc_dtypes[d]
            inner = self.kernel.constexprs[op.attrs["block"][1]]
            swizzle = min(128, inner * 2)
            lines.append(f"SH_{d}: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width={swizzle}, "
                         f"element_bitwidth=16, rank=2)  # {dtype}")
        return lines

    def producer(self) -> list[str]:
        k = self.kernel
        out = self.partition("producer", [], "one warp: copies of the row-tile operands once, then of every loop "
                             "tile into the ring", self.shared_layouts())
        for op in self.shape.loader_ops:
            out.extend(self.stmt(op, "    "))
        for ld in self.shape.row_loads:
            out.append(f"    {ld.args[0].name} = {self.descriptor(self.shape.defs[ld.args[0].name], 'HALF_R')}")
        for d in self.shape.rings:
            out.append(f"    {d} = {self.descriptor(self.shape.defs[d], self.kernel.block_sizes[self.shape.col])}")
        if self.shape.row_loads:
            total = sum(_tile_bytes(k, self.shape.defs[ld.args[0].name], ROW_BLOCK) for ld in self.shape.row_loads)
            out.append(f"    mbarrier.expect(row_bar, {total})")
            for ld in self.shape.row_loads:
                for half in (0, 1):
                    out.append(f"    tma.async_copy_global_to_shared({ld.args[0].name}, [{ld.args[1].name} + {half} * HALF_R, 0], "
                               f"row_bar, rowbuf_{ld.out.name}.index({half}))")
        else:
            out.append("    mbarrier.arrive(row_bar, count=1)")
        out.append("    it = 0")
        col_block = self.kernel.block_sizes[self.shape.col]
        for st in k.body:
            if not isinstance(st, Loop):
                continue
            out.append(f"    for {st.var.name} in range({st.start.name}, {st.stop.name}, {st.step}):")
            out.append("        slot = it % NUM_BUF")
            out.append("        # a fresh barrier passes a wait for parity 1: the first round finds every slot free")
            out.append("        mbarrier.wait(free_bar.index(slot), ((it // NUM_BUF) & 1) ^ 1)")
            for op in self.shape.coordinates[st.var.name]:
                out.extend(self.stmt(op, "        "))
            loads = {ld.args[0].name: ld for ld in st.body if isinstance(ld, Op) and ld.kind == "desc_load"}
            for d in self.shape.rings:
                nbytes = _tile_bytes(k, self.shape.defs[d], k.constexprs[col_block])
                out.append(f"        mbarrier.expect(ready_{d}.index(slot), {nbytes})")
                out.append(f"        tma.async_copy_global_to_shared({d}, [{loads[d].args[1].name}, 0], "
                           f"ready_{d}.index(slot), ring_{d}.index(slot))")
            out.append("        it += 1")
        return out

    def entry(self) -> list[str]:
        k = self.kernel
        jit = "@gluon.jit" + (f"(do_not_specialize={k.do_not_specialize!r})" if k.do_not_specialize else "")
        out = ["", "", jit, f"def {k.name}(", *[f"    {p}," for p in self.signature()], "):"]
        out.extend(f"    # {n}" for n in k.notes)
        out.append("    # warp-specialised: a producer warp fills a ring of shared-memory tiles, two consumer")
        out.append("    # warpgroups (64 rows each) run the tile program and hand the slots back")
        out.extend(f"    {line}" for line in self.locals() + self.shared_layouts())
        col_block = k.block_sizes[self.shape.col]
        for ld in self.shape.row_loads:
            d = ld.args[0].name
            inner = self.shape.defs[d].attrs["block"][1]
            out.append(f"    rowbuf_{ld.out.name} = gl.allocate_shared_memory({GL_DTYPES[ld.out.dtype]}, [2, HALF_R, {inner}], SH_{d})")
        for d in self.shape.rings:
            inner = self.shape.defs[d].attrs["block"][1]
            out.append(f"    ring_{d} = gl.allocate_shared_memory({GL_DTYPES[self.shape.desc_dtypes[d]]}, [NUM_BUF, {col_block}, {inner}], SH_{d})")
        out.append("    row_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())")
        out.append("    mbarrier.init(row_bar, count=1)")
        for d in self.shape.rings:
            out.append(f"    ready_{d} = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())")
        out.append("    free_bar = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())")
        out.append("    for i in gl.static_range(NUM_BUF):")
        for d in self.shape.rings:
            out.append(f"        mbarrier.init(ready_{d}.index(i), count=1)")
        out.append("        mbarrier.init(free_bar.index(i), count=2)  # both consumers release each slot")
        args = ", ".join(self.params() + self.shared_names())
        out.append("    gl.warp_specialize([")
        out.append(f"        ({k.name}_consumer, ({args}, 0)),")
        out.append(f"        ({k.name}_consumer, ({args}, 1)),")
        out.append(f"        ({k.name}_producer, ({args})),")
        out.append(f"    ], [4, 1], [{CONSUMER_REGISTERS}, 24])")
        return out

    def source(self) -> str:
        lines = [_PREAMBLE, *self.consumer(), *self.producer(), *self.entry()]
        return "\n".join(lines) + "\n"


def generate_gluon(kernel: TileKernel, num_buffers: int = NUM_BUFFERS) -> str:
    """Gluon source of `kernel` as a warp-specialised Hopper program (launch it with num_warps=4).

    Raises ValueError naming the reason when `gluon_support(kernel)` is not None.
    """
    try:
        shape = _analyse(kernel)
    except _Unsupported as exc:
        raise ValueError(f"gluon code generation: {exc}") from None
    return _GluonPrinter(kernel, shape, num_buffers).source()
