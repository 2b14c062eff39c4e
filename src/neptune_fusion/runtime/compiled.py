"""Compiled programs: the staged, cached driver from a traced Program to launched Triton kernels.

Stages (each a named function, each result cached): trace -> fuse (transform passes)
-> plan (schedule) -> lower (tile IR) -> generate (Triton source) -> load -> launch.

Example:
    >>> import torch, neptune_fusion as nf
    >>> from neptune_fusion.library import causal_attention
    >>> q = k = v = torch.randn(1, 2, 16, 16)       # (on the CPU: under TRITON_INTERPRET=1)
    >>> out = nf.compile(causal_attention)(q, k, v, scale=0.25)
    >>> tuple(out.shape)
    (1, 2, 16, 16)
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from triton import knobs
from triton.runtime.errors import OutOfResources, PTXASError

from neptune_fusion.algebra.repair import contribution_vanishes
from neptune_fusion.analysis.masks import MaskInfo, analyze_masks
from neptune_fusion.codegen.gluon_source import GLUON_LOOP_TILES, consumer_registers, generate_gluon, gluon_support
from neptune_fusion.codegen.gluon_source import ROW_BLOCK as GLUON_ROW_BLOCK
from neptune_fusion.codegen.triton_source import generate
from neptune_fusion.ir.errors import FusionError, UnsupportedProgramError
from neptune_fusion.ir.expr import Cast, Index, Load, Reduce, free_axes, rename_reads, walk
from neptune_fusion.ir.program import FusedLoop, InputBuffer, Program, Stage
from neptune_fusion.lang.tensor import input_dtype_name
from neptune_fusion.lang.trace import ProgramDef
from neptune_fusion.runtime.blockmap import block_map, block_map_axes
from neptune_fusion.runtime.gemm import einsum_fp32
from neptune_fusion.runtime.options import Options
from neptune_fusion.runtime.reference import axis_extents, run_reference, torch_dtype
from neptune_fusion.runtime.state import CALL_STATE
from neptune_fusion.schedule.auto import MAX_GRID_AXIS, Plan, choose, fit
from neptune_fusion.schedule.library import LibraryContraction, library_contraction
from neptune_fusion.schedule.partition import (
    Group,
    length_axes,
    narrow_materialised,
    needed_stages,
    partition,
    split_at,
    split_to_fit,
    subprogram,
)
from neptune_fusion.schedule.pipeline import SPLIT_AXIS, Step, combine_program, fuse, with_split_k
from neptune_fusion.schedule.templates import Auto, Autotune, Flash, Schedule, SplitK
from neptune_fusion.schedule.tiles import (
    MAX_WHOLE,
    AxisTiling,
    check_fits,
    choose_tiling,
    grid_tiles,
    inner_loop_axes,
)
from neptune_fusion.tile.ir import TileKernel
from neptune_fusion.tile.lower import (
    BLOCK_MAP_PREFIX,
    LoweringConfig,
    assign_roles,
    descriptor_hazards,
    fused_loop_of,
    lower,
)
from neptune_fusion.tile.pipeline import prefetch_first_dot, prefetch_scalar_loads, separate_dot_operand_loads
from neptune_fusion.tile.resources import (
    HOPPER_REGISTERS,
    HOPPER_SHARED_BYTES,
    TRITON_MAX_NUMEL,
    largest_tile,
    narrow_loops_first,
    plan_usage,
    shared_memory_estimate,
)
from neptune_fusion.transform.grad import without_detach
from neptune_fusion.transform.layout import group_divisor, pack_groups

FLOAT_TORCH = (torch.float16, torch.bfloat16, torch.float32)


def interpreter_mode() -> bool:
    """True when kernels run under Triton's interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_name(program_name: str) -> str:
    """The kernel's name for a program: a Python identifier (and a plain file name) whatever the
    program is called (`nf.program(lambda x: ...)` is named "<lambda>").

    Example:
        >>> kernel_name("<lambda>")
        'nf__lambda_'
    """
    return "nf_" + re.sub(r"\W", "_", program_name, flags=re.ASCII)


def _load_kernel(source: str, name: str, directory: Path) -> Callable[..., Any]:
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    path = directory / f"{name}_{digest}.py"
    if not path.exists():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(source)
        tmp.replace(path)
    module_name = f"neptune_fusion_kernels.{name}_{digest}"
    if module_name in sys.modules:
        return getattr(sys.modules[module_name], name)
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


@dataclass
class KernelLaunch:
    """A loaded kernel with what is needed to launch it."""

    tile: TileKernel
    source: str
    fn: Callable[..., Any]
    program: Program
    backend: str = "triton"  # "triton" or "gluon" (codegen/gluon_source.py, warp-specialised, Hopper)


@dataclass(frozen=True)
class KernelPlan:
    """Every decision behind one kernel, as one record: the schedule's plan (tiles, warps, stages,
    splits), how the tile walks its axes, the layout, the loads, the grid, the backend setting and
    the target. It is the kernel cache's key (with the program's fingerprint) and what `explain`
    prints. `options` are the switches it was compiled under (runtime/options.py).

    Example:
        >>> from neptune_fusion.schedule.auto import Plan
        >>> from neptune_fusion.schedule.tiles import AxisTiling
        >>> record = KernelPlan(Plan(128, 64, 8, 3, 1), AxisTiling((("e", 128),)), (("q", "f16"),), (("e", 128),))
        >>> record.plan.block_row, record.options.backend
        (128, 'auto')
    """

    plan: Plan
    tiling: AxisTiling  # block sizes of the held axes; which are grid-tiled or inner loops
    dtypes: tuple[tuple[str, str], ...]
    full_sizes: tuple[tuple[str, int], ...]
    layout: tuple[str, str, int] | None = None  # query heads of a KV head packed into one program's rows
    descriptor_loads: frozenset[str] = frozenset()  # inputs read through tensor descriptors
    positive_params: frozenset[str] = frozenset()
    combine_rows: int = 16
    prefetch_index: bool = False  # block-mapped loops read the next tile's index an iteration ahead
    grid_group: int | None = None
    dependent_launch: bool = False  # the split-K combine launches early and waits for the main kernel
    options: Options = Options()
    device: str = "cpu"
    whole_loop: bool = False  # the loop axis fits one loop tile: no loop, a second pass reuses its loads
    compute_dtype: str = ""  # the dtype of the dots' operands: the program's, or that of the program it is a part of

    def describe(self) -> str:
        """One line per decision (what `explain` prints)."""
        return "\n".join(f"{f.name}: {getattr(self, f.name)!r}" for f in fields(self))


@dataclass(frozen=True)
class LibraryRun:
    """A contraction run by the GEMM library (schedule/library.py): its plan and, for each operand
    a kernel writes, that operand program's executable (None: an input as it stands)."""

    plan: LibraryContraction
    operands: tuple[Executable | None, ...]


@dataclass
class Executable:
    """Everything compiled for one (program, dtypes, full sizes, plan, target)."""

    steps: list[Step]
    plan: Plan | None  # None: no kernel of ours (a library contraction of two inputs)
    main: KernelLaunch | None
    combine: KernelLaunch | None
    combine_steps: list[Step] = field(default_factory=list)
    masks: MaskInfo | None = None  # set when tiles are visited from a run-time block map
    combine_tile: TileKernel | None = None  # split-K combine (its own launch, or called by the main kernel)
    # a program that needs several kernels: each group's program and executable, run in order
    # (main, combine, ... are the first group's)
    groups: tuple[tuple[Group, Executable], ...] = ()
    record: KernelPlan | None = None  # every decision behind the main kernel
    library: LibraryRun | None = None  # the output is a library contraction of these operands
    apart: str | None = None  # why the program runs as several kernels, where fusing it failed


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
# fusion failures a later kernel for the failing reduction removes: its repair, and a loop that
# cannot hold what it reads
SPLITTABLE_PASSES = ("repair derivation", "rolling update")


def _check_tensors(program: Program, args: dict[str, Any], interpreter: bool) -> torch.device:
    device: torch.device | None = None
    float_dtype: torch.dtype | None = None
    for buf in program.inputs:
        t = args.get(buf.name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"argument {buf.name!r} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"argument {buf.name!r} is a {t.layout} tensor; kernels read dense (strided) tensors "
                            "(call .to_dense())")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"all tensors must be on one device: {buf.name!r} is on {t.device}, others on {device}")
        if t.is_floating_point():
            if t.dtype not in FLOAT_TORCH:
                raise TypeError(f"argument {buf.name!r} has dtype {t.dtype}; supported: float16, bfloat16, float32")
            float_dtype = float_dtype or t.dtype
        elif t.dtype not in (torch.int32, torch.int64, torch.bool, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"argument {buf.name!r} has unsupported dtype {t.dtype}")
        if any(s < 0 for s in t.stride()):
            raise ValueError(f"argument {buf.name!r} has a negative stride {t.stride()}")
    assert device is not None
    if device.type == "meta":
        raise ValueError("inputs are meta tensors, which hold no data to compute on (torch.compile traces a call "
                         "with fake tensors of the real device instead)")
    if device.type != "cuda" and not interpreter:
        raise ValueError(
            f"inputs are on {device}; kernels run on CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1)"
        )
    if float_dtype is None:
        raise TypeError("a program needs at least one floating-point tensor input")
    for p in program.params:
        v = args.get(p)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise TypeError(f"scalar parameter {p!r} must be a Python int or float, got {type(v).__name__}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"scalar parameter {p!r} must be finite, got {v}")
        # kernels take float parameters as float32 and int parameters as int32
        if isinstance(v, float) and abs(v) > _FLOAT32_MAX:
            raise ValueError(f"scalar parameter {p!r} = {v} is outside the float32 range kernels compute in")
        if isinstance(v, int) and not -2**31 <= v < 2**31:
            raise ValueError(f"scalar parameter {p!r} = {v} is outside the int32 range kernels compute in")
    extents = axis_extents(program, args)
    empty = sorted({n.axis for st in program.all_stages() for n in walk(st.body)
                    if isinstance(n, Reduce) and extents.get(n.axis) == 0})
    if empty:
        raise ValueError(f"{program.name}: the reduction axis {empty[0]!r} has length 0 at these arguments' shapes "
                         "(a reduction over nothing: torch gives 0 for a sum, nan for a mean); pass non-empty tensors")
    return device


_FUSED: dict[tuple[str, int], tuple[Step, ...]] = {}


def _fuse_cached(program: Program, splits: int) -> tuple[Step, ...]:
    """The fusion passes' results, cached by program fingerprint (SymPy proofs are not free).

    A fingerprint holds no sizes (axes are named; their extents are read from the arguments when
    the program runs, and a length the program computes with is a `Size` term), so the lengths of
    a decode loop share one entry. A split count only appends the split-K step to the rolling
    program: the passes and their proofs run once for all split counts."""
    key = (program.fingerprint(), splits)
    if key not in _FUSED:
        _FUSED[key] = tuple(with_split_k(_fuse_cached(program, 1), splits) if splits > 1 else fuse(program))
    return _FUSED[key]


_PARTS: dict[tuple[str, frozenset[str], frozenset[str]], list[Group]] = {}


def _partition_cached(program: Program, long_axes: frozenset[str] = frozenset(),
                      narrow: frozenset[str] = frozenset()) -> list[Group]:
    """`partition(program, long_axes, narrow)`, cached by fingerprint (like `_fuse_cached`), the long
    axes and the 16-bit inputs."""
    key = (program.fingerprint(), long_axes, narrow)
    if key not in _PARTS:
        _PARTS[key] = partition(program, long_axes, narrow)
    return _PARTS[key]


def narrow_inputs(program: Program, args: dict[str, Any]) -> frozenset[str]:
    """The inputs these arguments store as 16-bit floats (transform/distribute.py).

    Example:
        >>> import torch
        >>> from neptune_fusion.library import rmsnorm_matmul
        >>> x, w = torch.randn(4, 8).half(), torch.randn(8, 2)
        >>> sorted(narrow_inputs(rmsnorm_matmul.trace(x, w), {"x": x, "w": w}))
        ['x']
    """
    return frozenset(b.name for b in program.inputs
                     if isinstance(args.get(b.name), torch.Tensor) and args[b.name].dtype in (torch.float16, torch.bfloat16))


def long_axes(program: Program, args: dict[str, Any]) -> frozenset[str]:
    """The axes longer than a tile holds whole at these arguments' sizes (schedule/tiles.py)."""
    return frozenset(a for a, n in axis_extents(program, args).items() if n > MAX_WHOLE)


_MASKS: dict[str, MaskInfo] = {}


def _masks_of(fused: Program) -> MaskInfo:
    """The mask analysis of a fused program's loop, as its kernel sees it (tile/lower.py), cached
    by its fingerprint (like `_fuse_cached`)."""
    key = fused.fingerprint()
    if key not in _MASKS:
        roles = _roles_of(fused)
        int_params = {p for p, k in fused.param_kinds.items() if k == "int"}
        int_buffers = frozenset(b.name for b in fused.inputs if b.kind != "float")
        _MASKS[key] = analyze_masks(fused_loop_of(fused), roles.row, int_params, contribution_vanishes, int_buffers,
                                    roles.held)
    return _MASKS[key]


_ROLES: dict[str, Any] = {}


def _roles_of(fused: Program) -> Any:
    """`assign_roles(fused)`, cached by the program's fingerprint."""
    key = fused.fingerprint()
    if key not in _ROLES:
        _ROLES[key] = assign_roles(fused)
    return _ROLES[key]


_LAYOUTS: dict[tuple[str, int], tuple[Program, tuple[str, str, int] | None]] = {}


def _choose_layout(fused: Program, sizes: dict[str, int]) -> tuple[Program, tuple[str, str, int] | None]:
    """Pack the query heads of a KV group into one program when rows are few (decode); cached by
    the program and its number of rows, all the choice depends on."""
    roles = _roles_of(fused)
    key = (fused.fingerprint(), sizes[roles.row])
    if key not in _LAYOUTS:
        _LAYOUTS[key] = _layout_for(fused, roles, sizes[roles.row])
    return _LAYOUTS[key]


def _layout_for(fused: Program, roles: Any, rows: int) -> tuple[Program, tuple[str, str, int] | None]:
    masks = _masks_of(fused)
    if any(roles.row in free_axes(m.node.cond) for m in masks.masks):
        return fused, None  # packing would turn a mask affine in the rows into one needing a block map
    for axis in roles.batch:
        group = group_divisor(fused, axis, roles.col)
        if group is not None and rows * group <= 64:
            try:
                return pack_groups(fused, axis, roles.row, group), (axis, roles.row, group)
            except FusionError:
                return fused, None
    return fused, None


def _check_offsets(fused: Program, roles: Any, args: dict[str, Any]) -> None:
    """Element offsets within one program's slice of a tensor are 32-bit (batch offsets are 64-bit)."""
    batch = set(roles.batch)
    for buf in fused.inputs:
        t = args.get(buf.name)
        if not isinstance(t, torch.Tensor):
            continue
        span = sum((size - 1) * abs(stride) for axis, size, stride in zip(buf.dims, t.shape, t.stride())
                   if axis not in batch and size > 0)
        if span >= 2**31:
            raise ValueError(
                f"input {buf.name!r} spans {span} elements within one (batch, head) slice; kernels address "
                f"such slices with 32-bit offsets (make the sequence or head-dim layout more compact)")


WIDE_TILE = 256  # a tile this wide (loop tile or grid tile) makes a tiled kernel read through descriptors


def _tma_buffers(program: Program, args: dict[str, Any], device: torch.device, options: Options) -> frozenset[str]:
    """Inputs whose tiles can be read through tensor descriptors (Hopper's copy engine): floating
    point, last dimension contiguous, other strides and the base 16-byte aligned (`options.tma`:
    "0" never, "force" also in the interpreter)."""
    interpreter = options.interpreter
    if options.tma == "0" or (interpreter and options.tma != "force"):
        return frozenset()
    if not interpreter and (device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9):
        return frozenset()
    out = set()
    for buf in program.inputs:
        t = args[buf.name]
        if not t.is_floating_point() or t.dim() < 2 or t.stride(-1) != 1 or t.data_ptr() % 16:
            continue
        if all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1]):
            out.add(buf.name)
    if out:
        install_allocator()
    return frozenset(out)


@functools.cache
def _descriptor_allocator() -> Callable[[int, int, Any], torch.Tensor]:
    """Tensor descriptors made inside kernels need a little global scratch memory."""
    cache: dict[tuple[Any, int], torch.Tensor] = {}

    def alloc(size: int, alignment: int, stream: Any) -> torch.Tensor:
        # descriptors live only while their kernel runs, and kernels of one stream run in order:
        # one buffer per stream and size is enough (allocating per launch costs microseconds)
        if CALL_STATE.private:
            return torch.empty(size, dtype=torch.int8, device="cpu" if interpreter_mode() else "cuda")
        key = (stream, size)
        if key not in cache:
            cache[key] = torch.empty(size, dtype=torch.int8, device="cpu" if interpreter_mode() else "cuda")
        return cache[key]

    return alloc


_allocator_threads: set[int] = set()


def install_allocator() -> None:
    """Triton keeps its allocator per thread (a context variable): set ours in this one, once.
    Autograd runs backward passes in threads of its own, so each of them needs it too."""
    import threading

    import triton

    ident = threading.get_ident()
    if ident not in _allocator_threads:
        triton.set_allocator(_descriptor_allocator())
        _allocator_threads.add(ident)


COMBINE_TILE_ELEMENTS = 8192  # fp32 values of one (row, split, feature) tile: 64 registers a thread at 4 warps


def _combine_tiles(plan: Plan, rows: int, full_sizes: dict[str, int]) -> tuple[int, int, int]:
    """(row block, split block, pipeline stages) of the split-K combine.

    The combine is elementwise math over a few partial states per row (no dot), bound by the
    latency of its loads: a tile holding every split at once needs one round trip, and more,
    smaller row blocks give more programs. Its 3-D (row, split, feature) tile must still fit in
    registers; `full_sizes` are the partial states' feature axes (axes a second pass walks in
    tiles of its own, or an inner loop, are not held, and a dot there needs 16 rows or more).

    Example:
        >>> _combine_tiles(Plan(16, 64, 4, 2, 64), 8, {"e": 128})
        (1, 64, 1)
    """
    features = math.prod(1 << max(0, (n - 1).bit_length()) for n in full_sizes.values())
    all_splits = 1 << (plan.splits - 1).bit_length()
    block_split = min(all_splits, 64, max(2, COMBINE_TILE_ELEMENTS // features))
    block_rows = max(1, min(rows, COMBINE_TILE_ELEMENTS // (block_split * features)))
    block_rows = 1 << (block_rows.bit_length() - 1)
    return block_rows, block_split, 1 if block_split >= all_splits else 3


def _device_limits(device: torch.device) -> tuple[int, int]:
    """(bytes of shared memory one program may use, registers per thread) on the device; Hopper's
    where no GPU can be asked (a CUDA target planned on a machine without one)."""
    if not torch.cuda.is_available():
        return HOPPER_SHARED_BYTES, HOPPER_REGISTERS
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", HOPPER_SHARED_BYTES), HOPPER_REGISTERS


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


GLUON_BLOCK_MAP_MIN_KEYS = 4096  # block-mapped loops go through Gluon only above this many keys
CUBLAS_ROW_ALIGNMENT = 16  # bytes: rows of an operand written for cuBLAS start at multiples of it (full-rate GEMMs)


def _gluon_precondition(device: torch.device, options: Options) -> str | None:
    """Why no Gluon kernel can run here at all (None: it can, for tile programs it accepts)."""
    if options.backend == "triton":
        return "NEPTUNE_FUSION_BACKEND=triton"
    if options.interpreter:
        return "Triton's interpreter runs Triton kernels only"
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return "the warp-specialised Gluon kernels are written for Hopper (compute capability 9.x)"
    return None


def _backend_for(reason: str | None, options: Options) -> tuple[str, str]:
    """("gluon" or "triton", why) for a main kernel, given why Gluon cannot print it (None: it can).
    `options.backend`: "auto" (Gluon where it can), "triton", or "gluon" (required: raises where it
    cannot)."""
    if reason is None:
        return "gluon", "warp-specialised (Gluon): a producer warp and two consumer warpgroups"
    if options.backend == "gluon":
        raise ValueError(f"NEPTUNE_FUSION_BACKEND=gluon, but {reason}")
    return "triton", f"Triton (not Gluon: {reason})"


def _supports_dependent_launch(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA on Hopper or newer (not the interpreter)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _grid_group(row_tiles: int, batch: int, splits: int, num_sms: int, block_mapped: bool,
                device: torch.device, setting: int | None = None) -> int | None:
    """How many batch entries (heads) run their row tiles interleaved, heaviest first, on a one-axis
    grid (tile/lower.py `_grouped_program_ids`; `setting`, Options.grid_group, overrides); None for the
    plain (row tiles, batch) grid, which holds at most 65535 batch entries.

    The largest divisor of the batch whose group still fits one wave of programs: each wave then
    starts with the longest row tiles of its group and ends with the shortest, which balances causal
    prefill; a group that does not divide the heads or overfills a wave gains nothing.
    Block-mapped loops read only the tiles listed for their row tile, so they keep every head in one
    group while the whole launch is at most eight waves; past that, interleaving all heads costs more
    than it balances.
    """
    if splits > 1:
        # split-K's partial states and its combine are indexed by the plain (row tiles, batch) grid
        if batch > MAX_GRID_AXIS:
            raise ValueError(f"split_k runs at most {MAX_GRID_AXIS} batch entries (batch x heads) at once, "
                             f"got {batch}; use flash() or fewer sequences per call")
        return None
    if setting is not None:
        return setting
    group = 1
    if device.type == "cuda" and block_mapped and batch * row_tiles <= 8 * num_sms:
        group = batch
    elif device.type == "cuda":
        fit = max(1, min(batch, num_sms // max(1, row_tiles)))
        group = max(d for d in range(1, fit + 1) if batch % d == 0)
    return None if group == 1 and batch <= MAX_GRID_AXIS else group


# launchers kept per compiled function (~20 KB each); a decode loop adds one per key length, and a
# new one costs a millisecond or two of host time (the executable for its plan is cached)
MAX_LAUNCHERS = 256

# set by integrations.ops: how a call made while torch.compile traces becomes one registered op
IN_GRAPH: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] | None = None
# set by integrations.autograd: how a call whose inputs require grad records its derived backward
WITH_GRAD: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] | None = None


def output_specs(fn: Compiled, named: dict[str, Any]) -> list[tuple[list[int], torch.dtype]]:
    """Shapes and dtypes of what `fn(**named)` returns, from the traced program (no kernel runs).
    Symbolic sizes (torch.compile's dynamic shapes) stay symbolic: the program is traced at their
    example values, without a guard on them, and the shapes are read off the arguments."""
    program = fn.program_def.trace(**{n: _at_hints(v) for n, v in named.items()})
    sizes = axis_extents(program, named)
    dtypes = fn.program_def.output_dtypes(program, named)
    return [([sizes[d] if d else 1 for d in (spec.view or spec.dims)], dtype)
            for spec, dtype in zip(program.outputs, dtypes)]


def _at_hints(value: Any) -> Any:
    """A tensor with symbolic sizes as a meta tensor of their example values; anything else as is."""
    if not isinstance(value, torch.Tensor) or all(isinstance(d, int) for d in value.shape):
        return value
    shape = [d if isinstance(d, int) else d.node.hint for d in value.shape]
    if any(d is None for d in shape):  # a size without an example value (data-dependent): as it is
        return value
    return torch.empty(shape, dtype=value.dtype, device="meta")


class Compiled:
    """A program compiled for the GPU: call it with torch tensors (and Python scalars).

    The template is resolved from the shapes at the first call for each new shape
    bucket; kernels are cached in memory and their sources on disk.
    """

    def __init__(self, program: ProgramDef | Callable[..., Any], schedule: Schedule | None = None,
                 allow_fallback: bool = False, options: Options | None = None, compute_dtype: str | None = None,
                 split_to_fit: bool = True) -> None:
        self.program_def = program if isinstance(program, ProgramDef) else ProgramDef(program)
        self.schedule = schedule or Auto()
        # a kernel whose tile is too large to lower runs as several (`_apart_to_fit`); off for a
        # backward's kernel, whose caller tries a chunked plan first (integrations/autograd.py)
        self.split_to_fit = split_to_fit
        self.options = options  # the switches; None: read from the environment at each compile
        # the dtype of the dots' operands at every call, for a kernel of a larger program (a
        # backward's, reading fp32 pools); None: its first float input's
        self.compute_dtype = compute_dtype
        self.allow_fallback = allow_fallback
        self._cache: dict[tuple[Any, ...], Executable] = {}
        self._scratch: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}
        self._launchers: dict[tuple[Any, ...], Callable[[Sequence[Any]], Any]] = {}
        params = self.program_def.signature.parameters.values()
        self._names = [p.name for p in params]
        plain = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)
        self._arity = len(self._names) if plain else -1  # calls with exactly these positionals skip bind()
        self.fallback_reason: str | None = None
        self.training: dict[tuple[Any, ...], Any] = {}  # (program, wrt) -> its derived backward, compiled
        self.training_handles: dict[tuple[Any, ...], int] = {}  # call layout -> its registered op's handle

    # --- compile ------------------------------------------------------------------
    def executable_for(self, program: Program, args: dict[str, Any], plan: Plan | None = None,
                       options: Options | None = None, compute_dtype: str | None = None) -> Executable:
        """Compile (or fetch from cache) the kernels for these arguments (`plan` overrides the
        schedule; `options`, the switches, are read from the environment unless given).
        `compute_dtype` is the dtype of the dots' operands (default: the first float input's); the
        parts of a program cut into several kernels take the whole program's, so a part that reads
        only what an earlier part materialised in fp32 still multiplies in the program's dtype."""
        options = options or self.options or Options.from_environment()
        compute_dtype = compute_dtype or self.compute_dtype
        interpreter = options.interpreter
        device = _check_tensors(program, args, interpreter)
        program = without_detach(program)
        main_dtype = compute_dtype or next(input_dtype_name(args[b.name].dtype) for b in program.inputs
                                           if args[b.name].is_floating_point())
        if plan is None and isinstance(self.schedule, (Auto, Autotune)):
            # a part of a program multiplies in the whole program's dtype (what its operand kernels
            # write, and what its direct operands must be), whatever it reads materialised in fp32
            dtype = main_dtype if compute_dtype is not None else gemm_dtype(program, args)
            dtypes = input_dtypes(program, args)
            routed = library_contraction(program, axis_extents(program, args), dtype, dtypes)
            if isinstance(routed, LibraryContraction):
                return self._library(program, routed, args, options)
            apart = library_outputs_apart(program, axis_extents(program, args), dtype, dtypes)
            if apart is not None:
                return self._grouped(program, apart, args, device, options, main_dtype,
                                     "an output the GEMM library computes runs apart from the others")
        groups = _partition_cached(program, long_axes(program, args), narrow_inputs(program, args))
        if len(groups) > 1:
            return self._grouped(program, groups, args, device, options, main_dtype)
        program = groups[0].program  # as rewritten before partitioning (transform/distribute.py)
        dtypes = {b.name: input_dtype_name(args[b.name].dtype) for b in program.inputs}
        try:
            fused = _fuse_cached(program, 1)[-1].program
        except FusionError as exc:
            # a reduction that cannot join the loop of those it reads runs in a later kernel,
            # which reads them finished (schedule/partition.py `split_at`)
            apart = split_at(program, exc.stage) if exc.pass_name in SPLITTABLE_PASSES else None
            if apart is None:
                raise
            why = (f"{exc.stage!r} could not join the fused loop of the reductions it reads ({exc}); it runs in a "
                   "later kernel that reads them finished")
            return self._grouped(program, apart, args, device, options, main_dtype, why)
        fused, layout = _choose_layout(fused, axis_extents(fused, args))
        roles = _roles_of(fused)
        sizes = axis_extents(fused, args)
        full_sizes = {a: sizes[a] for a in roles.full}
        batch = math.prod(sizes[a] for a in roles.batch)
        masks = _masks_of(fused)
        use_block_map = masks.residual
        given_plan = plan is not None
        inner_loop_length = sum(full_sizes[a] for a in inner_loop_axes(fused, full_sizes))
        if plan is None:
            def plan_for(programs_per_row_tile: int) -> Plan:
                return choose(self.schedule, rows=sizes[roles.row], cols=sizes[roles.col],
                              batch=batch * programs_per_row_tile, full_sizes=full_sizes, dtype=main_dtype,
                              num_sms=_num_sms(device), interpreter=interpreter, block_mapped=use_block_map,
                              streams=roles.streams, rereads=roles.rereads, k_loop=roles.k_loop,
                              inner_loop_length=inner_loop_length, reduces=bool(fused_loop_of(fused).members))

            plan = plan_for(1)
            # the tiles of grid-tiled axes are programs too: split-K only where all of them leave the
            # machine idle
            try:
                tiles = grid_tiles(choose_tiling(fused, full_sizes, plan.block_row, plan.block_col), full_sizes)
            except UnsupportedProgramError as exc:
                return self._apart_to_fit(program, exc, args, device, options, main_dtype)
            if tiles > 1:
                plan = plan_for(tiles)
        # a loop no longer than one tile, with a second pass over its axis, is computed without a
        # loop, and the second pass reuses its loads (tile/lower.py `LoweringConfig.whole_loop`)
        whole_loop = (roles.rereads and plan.splits == 1 and not plan.prefetch_dot and not use_block_map
                      and sizes[roles.col] <= plan.block_col)
        if plan.splits > 1 or plan.prefetch_dot:
            gluon_reason = "split-K and software-pipelined plans run through Triton"
        elif whole_loop:
            gluon_reason = "a loop held in one tile runs through Triton"
        else:
            gluon_reason = _gluon_precondition(device, options)
        if not given_plan and gluon_reason is None:
            explicit_width = isinstance(self.schedule, (Flash, SplitK)) and self.schedule.block_k is not None
            if use_block_map and sizes[roles.col] > GLUON_BLOCK_MAP_MIN_KEYS and not explicit_width:
                # block-mapped loops through Gluon run fastest with 128-wide key tiles: fewer listed
                # tiles, each a longer copy for the producer warp
                plan = replace(plan, block_col=128)
        _check_offsets(fused, roles, args)
        all_tma = _tma_buffers(program, args, device, options)
        # how the axes the tile cannot hold whole are walked: across the grid or by inner loops
        tiling = choose_tiling(fused, full_sizes, plan.block_row, plan.block_col,
                               4 if main_dtype == "f32" else 2, plan.num_stages, plan.num_warps)
        try:
            check_fits(tiling, fused, plan.block_row, plan.num_warps)
        except UnsupportedProgramError as exc:
            return self._apart_to_fit(program, exc, args, device, options, main_dtype)
        tma = all_tma - descriptor_hazards(fused)  # Gluon's kernels order their own copies
        if use_block_map or (plan.splits > 1 and not tiling.loops):
            # tiles at run-time coordinates (from the block map) and split-K's memory-bound single
            # reads of each key tile load faster through pointers: a descriptor costs more to set up
            # than a tile read once saves. A split loop with inner K-loops reads its tiles many times
            # and is compute-bound: descriptors spare it the address tiles in registers
            tma = frozenset()
        # a kernel that tiles axes reads its tiled blocks (K-steps, grid tiles) through descriptors
        # where its tiles are 256 wide: the accumulators then fill half the registers, and pointer
        # loads' address tiles would spill; at 128-wide tiles pointer loads measured as fast or
        # faster. Blocks of a held axis read through descriptors either way
        tiled_descriptors = options.tma == "force" or max([plan.block_col, *(tiling.block(a) for a in tiling.grid)]) >= WIDE_TILE
        positive = frozenset(p for p in program.params if isinstance(args[p], float) and args[p] > 0)
        combine_rows = min(16, 1 << max(0, (sizes[roles.row] - 1).bit_length()))
        # the next listed tile's index read an iteration early: 5-6% faster (document mask)
        prefetch_index = use_block_map
        # the separate combine launches while the main kernel runs and waits for its writes itself
        # (a loop with no members writes its outputs from every chunk: no partial states, no combine)
        merges = plan.splits > 1 and bool(fused_loop_of(fused).members)
        dependent_launch = merges and not interpreter and _supports_dependent_launch(device)
        grid_group = None if tiling.grid else _grid_group(
            math.ceil(sizes[roles.row] / plan.block_row), batch, plan.splits, _num_sms(device), use_block_map, device,
            options.grid_group)
        record = KernelPlan(plan, tiling, tuple(sorted(dtypes.items())), tuple(sorted(full_sizes.items())), layout,
                            tma, positive, combine_rows, prefetch_index, grid_group, dependent_launch,
                            options, str(device), whole_loop, main_dtype)
        key = (program.fingerprint(), record)
        if key in self._cache:
            return self._cache[key]
        steps = list(_fuse_cached(program, plan.splits))
        fused = steps[-1].program
        if layout is not None:
            fused = pack_groups(fused, *layout)
            steps.append(Step(f"pack the {layout[2]} query heads of each KV head into one program's rows", fused))
        block_axes = None
        if use_block_map:
            block_axes = block_map_axes(masks, roles)
            dtypes = dict(dtypes)
            for kind in ("full", "partial"):
                dtypes[f"{BLOCK_MAP_PREFIX}{kind}_count"] = dtypes[f"{BLOCK_MAP_PREFIX}{kind}_index"] = "i32"
        # Triton's interpreter computes bfloat16 wrongly: there, tiles are converted to float32 after
        # loading and multiplied in float32
        dot_dtype = "f32" if interpreter and main_dtype == "bf16" else main_dtype
        config = LoweringConfig(dtypes, full_sizes, plan.block_row, plan.block_col, plan.num_warps,
                                plan.num_stages, plan.splits, dot_dtype, partial_outputs=merges,
                                block_map_axes=block_axes, tma_buffers=tma, positive_params=positive,
                                grid_group=grid_group, tiling=tiling, tiled_descriptors=tiled_descriptors,
                                whole_loop=whole_loop)
        target = "interpreter" if interpreter else "cuda"
        name = kernel_name(program.name)
        combine = None
        combine_steps: list[Step] = []
        ctile = None
        if merges:
            try:
                cprog = combine_program(fused)
                combine_steps = list(_fuse_cached(cprog, 1))  # the same for every split count
            except FusionError:
                if isinstance(self.schedule, SplitK) or given_plan:
                    raise
                # the partial states cannot be merged (a proof that holds inside one pass, say with a
                # positive normaliser, does not carry over to the merge): one pass per row tile instead
                flash = choose(Flash(), rows=sizes[roles.row], cols=sizes[roles.col], batch=batch,
                               full_sizes=full_sizes, dtype=main_dtype, num_sms=_num_sms(device),
                               interpreter=interpreter, block_mapped=use_block_map,
                               streams=roles.streams, rereads=roles.rereads, k_loop=roles.k_loop,
                               inner_loop_length=inner_loop_length)
                exe = self.executable_for(program, args, flash, options, main_dtype)
                self._cache[key] = exe
                return exe
            cfused = combine_steps[-1].program
            cdtypes = {b.name: ("f32" if b.name.startswith("part_") else dtypes[b.name]) for b in cprog.inputs}
            cfull = {a: full_sizes[a] for a in assign_roles(cfused).full}
            # the combine's tile holds the axes of the partial states; others its second pass walks
            states = {a for b in cprog.inputs if b.name.startswith("part_") for a in b.dims}
            block_rows, block_split, cstages = _combine_tiles(plan, combine_rows,
                                                              {a: n for a, n in cfull.items() if a in states})
            cconfig = LoweringConfig(cdtypes, cfull, block_rows, block_split, plan.num_warps, cstages, 1, "f32",
                                     block_epilogue=32 if interpreter else 128)
            ctile = lower(cfused, cconfig, f"{name}_combine")
            # a second pass of the combine over an axis only outputs have (a gradient contracted
            # with a weight: an fp32 dot per epilogue tile) takes narrower tiles until it fits the
            # device's shared memory
            while (not interpreter and cconfig.block_epilogue > 16
                   and shared_memory_estimate(ctile) > _device_limits(device)[0]):
                cconfig = replace(cconfig, block_epilogue=cconfig.block_epilogue // 2, notes=[])
                ctile = lower(cfused, cconfig, f"{name}_combine")
            if dependent_launch:
                ctile.grid_dependency = "dependent"
            csource = generate(ctile, target)
            combine = KernelLaunch(ctile, csource, _load_kernel(csource, ctile.name, options.kernel_directory()), cfused)
        def lowered() -> TileKernel:
            tile = separate_dot_operand_loads(lower(fused, config, name))
            if prefetch_index:
                tile = prefetch_scalar_loads(tile)
            # the rewrite moves a top-level loop's first dot; one inside an inner (K-)loop stays put
            tile = prefetch_first_dot(tile) if plan.prefetch_dot and not tiling.loops else tile
            if dependent_launch:
                tile.grid_dependency = "primary"
            numel, value = largest_tile(tile)
            if numel > TRITON_MAX_NUMEL:
                raise UnsupportedProgramError(
                    "tile planning", fused.name, "tile sizes",
                    f"the tile value {value!r} would hold {numel} elements (blocks {tile.constexprs}); Triton "
                    f"allows {TRITON_MAX_NUMEL}")
            return tile

        # the Gluon backend reads every tile it can through descriptors (its producer warp issues the
        # copies), block-mapped ones too, and needs no software-pipelining rewrites of the loop
        reason = gluon_reason
        if reason is None and use_block_map and sizes[roles.col] <= GLUON_BLOCK_MAP_MIN_KEYS and options.backend == "auto":
            # short listed loops: the producer warp's ring never fills, and Triton's kernel is faster
            reason = f"block-mapped loops over at most {GLUON_BLOCK_MAP_MIN_KEYS} keys measured faster through Triton"
        if reason is None:
            gluon_tile = lower(fused, replace(config, tma_buffers=all_tma, notes=[]), name)
            reason = gluon_support(gluon_tile)
            narrower = plan.block_col // 2
            if (reason is not None and narrower in GLUON_LOOP_TILES and plan.block_col in GLUON_LOOP_TILES
                    and plan.block_row == GLUON_ROW_BLOCK and options.backend != "triton"
                    and consumer_registers(gluon_tile) > HOPPER_REGISTERS):
                # a consumer's work tiles shrink with the loop tile while its carried state does not:
                # the warp-specialised kernel at half the width before Triton's at any (Triton holds
                # the same tiles in one 8-warp program and must narrow further)
                exe = self.executable_for(program, args, replace(plan, block_col=narrower), options, main_dtype)
                self._cache[key] = exe
                return exe
        backend, why = _backend_for(reason, options)
        if backend == "gluon":
            gluon_tile.notes.append(f"backend: {why}")
            source = generate_gluon(gluon_tile)
            # Gluon's default partition is one warpgroup; the others are declared by the kernel itself
            tile = replace(gluon_tile, num_warps=4)
        else:
            try:
                tile = lowered()
            except UnsupportedProgramError as exc:
                if not self.split_to_fit:
                    raise
                return self._apart_to_fit(program, exc, args, device, options, main_dtype)
            if not interpreter:
                # a plan whose kernel needs more shared memory or registers than the device has is
                # planned again smaller, before anything is compiled (schedule/auto.py `fit`)
                usage = plan_usage(tile, lambda p: choose_tiling(fused, full_sizes, p.block_row, p.block_col,
                                                                 4 if main_dtype == "f32" else 2, p.num_stages,
                                                                 p.num_warps))
                fitted = fit(plan, usage, *_device_limits(device), narrow_first=narrow_loops_first(tile))
                if fitted != plan:
                    exe = self.executable_for(program, args, fitted, options, main_dtype)
                    self._cache[key] = exe
                    return exe
            tile.notes.append(f"backend: {why}")
            source = generate(tile, target)
        main = KernelLaunch(tile, source, _load_kernel(source, name, options.kernel_directory()), fused, backend)
        exe = Executable(steps, plan, main, combine, combine_steps, masks if use_block_map else None, ctile,
                         record=record)
        self._cache[key] = exe
        return exe

    def _apart_to_fit(self, program: Program, error: UnsupportedProgramError, args: dict[str, Any],
                      device: torch.device, options: Options, compute_dtype: str) -> Executable:
        """The program in several kernels where one kernel's tile cannot be planned (`error`), or
        `error` raised where no split applies (schedule/partition.py `split_to_fit`)."""
        found = split_to_fit(program, long_axes(program, args), any_reductions=self.split_to_fit)
        if found is None:
            raise error
        groups, why = found
        return self._grouped(program, groups, args, device, options, compute_dtype,
                             f"one kernel's tile does not fit ({error}); {why}")

    def _grouped(self, program: Program, groups: list[Group], args: dict[str, Any],
                 device: torch.device, options: Options, compute_dtype: str, why: str | None = None) -> Executable:
        """One executable per group (schedule/partition.py), each compiled for example arguments:
        the call's own, and for the reductions one group writes for the next, contiguous fp32
        tensors of their shapes (what the launcher allocates for them); every group multiplies in
        the whole program's `compute_dtype`."""
        key = ("groups", program.fingerprint(), compute_dtype,
               tuple((n, _arg_key(v)) for n, v in sorted(args.items())))
        if key in self._cache:
            return self._cache[key]
        if compute_dtype in ("f16", "bf16"):
            groups = narrow_materialised(groups, compute_dtype)
        sizes = axis_extents(program, args)
        env = {**args, **lengths_of(program, length_params_of(program, [g.program for g in groups]), args)}
        parts: list[tuple[Group, Executable]] = []
        steps: list[Step] = []
        for k, group in enumerate(groups):
            exe = self.executable_for(group.program, {n: env[n] for n in arg_names(group.program)}, options=options,
                                      compute_dtype=compute_dtype)
            parts.append((group, exe))
            steps += [Step(f"kernel {k + 1} of {len(groups)}: {s.name}", s.program) for s in exe.steps]
            env.update(_materialised(program, group, sizes, device))
        first = parts[0][1]
        self._cache[key] = Executable(steps, first.plan, first.main, first.combine, first.combine_steps,
                                      first.masks, first.combine_tile, tuple(parts), apart=why)
        return self._cache[key]

    def _library(self, program: Program, plan: LibraryContraction, args: dict[str, Any],
                 options: Options) -> Executable:
        """The operand programs' executables (each compiled for the call's arguments) and the
        contraction that cuBLAS computes from their outputs."""
        key = ("library", program.fingerprint(), tuple((n, _arg_key(v)) for n, v in sorted(args.items())))
        if key in self._cache:
            return self._cache[key]
        parts: list[Executable | None] = []
        steps: list[Step] = []
        for j, operand in enumerate(plan.operands):
            if operand.program is None:
                parts.append(None)
                continue
            exe = self.executable_for(operand.program, {n: args[n] for n in arg_names(operand.program)},
                                      options=options)
            parts.append(exe)
            steps += [Step(f"operand {j} of {plan.stage} (for cuBLAS): {s.name}", s.program) for s in exe.steps]
        first = next((p for p in parts if p is not None), None)
        exe = Executable(steps, first.plan if first else None, first.main if first else None,
                         first.combine if first else None, library=LibraryRun(plan, tuple(parts)))
        self._cache[key] = exe
        return exe

    def _library_launcher(self, exe: Executable, program: Program, example: dict[str, Any],
                          order: list[str]) -> Callable[[Sequence[Any]], Any]:
        """Write the operands that need it, then `torch.einsum` of the two in the inputs' dtype."""
        assert exe.library is not None
        plan = exe.library.plan
        position = {n: i for i, n in enumerate(order)}
        # per operand: the call's input at a position, or the launcher writing it and its arguments' positions
        sources: list[int | tuple[Callable[[Sequence[Any]], Any], list[int]]] = []
        for operand, part in zip(plan.operands, exe.library.operands):
            if operand.program is None:
                sources.append(position[operand.input or ""])
            else:
                names = arg_names(operand.program)
                launch = self._launcher(part, operand.program, {n: example[n] for n in names}, names,
                                        pitch_bytes=CUBLAS_ROW_ALIGNMENT)
                sources.append((launch, [position[n] for n in names]))
        sizes = axis_extents(program, example)
        spec = program.outputs[0]
        view = [sizes[d] if d else 1 for d in spec.view] if spec.view is not None else None
        equation = plan.spec

        contract = functools.partial(einsum_fp32 if plan.widened else torch.einsum, equation)

        def run(values: Sequence[Any]) -> Any:
            operands = [values[s] if isinstance(s, int) else s[0]([values[j] for j in s[1]]) for s in sources]
            out = contract(*operands)
            return out if view is None else out.view(view)

        return run

    def _grouped_launcher(self, exe: Executable, program: Program, example: dict[str, Any],
                          order: list[str]) -> Callable[[Sequence[Any]], Any]:
        """Run the groups' kernels in order; each group's materialised reductions are inputs of
        the later ones."""
        env = dict(example)
        sizes = axis_extents(program, example)
        device = example[program.inputs[0].name].device
        length_params = length_params_of(program, [g.program for g, _ in exe.groups])
        env.update(lengths_of(program, length_params, example))
        later_reads = {b.name for group, _ in exe.groups for b in group.program.inputs}
        runs = []
        for group, part in exe.groups:
            names = arg_names(group.program)
            # an output a later group reads is known by its stage's name as well
            aliases = tuple((k, o.stage) for k, (r, o) in enumerate(zip(group.results, group.program.outputs))
                            if r.startswith("output:") and o.stage in later_reads)
            runs.append((names, self._launcher(part, group.program, {n: env[n] for n in names}, names), group.results,
                         aliases))
            env.update(_materialised(program, group, sizes, device))
        # a group that reads only materialised (fp32) values would return fp32: outputs keep the
        # dtypes the whole program gives them
        dtypes = self.program_def.output_dtypes(program, example)

        def run(values: list[Any]) -> Any:
            known = dict(zip(order, values))
            if length_params:
                known.update(lengths_of(program, length_params, known))
            for names, launch, results, aliases in runs:
                out = launch([known[n] for n in names])
                written = out if isinstance(out, tuple) else (out,)
                known.update(zip(results, written))
                for k, name in aliases:
                    known[name] = written[k]
            outs = [known[f"output:{j}"].to(dtype) for j, dtype in enumerate(dtypes)]
            return outs[0] if len(outs) == 1 else tuple(outs)

        return run

    # --- run ----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self._needs_grad(args, kwargs):
            if WITH_GRAD is None:
                raise RuntimeError(f"{self.program_def.name}: an input requires grad, and no backward is "
                                   f"registered (import neptune_fusion, not only its runtime layer)")
            return WITH_GRAD(self, args, kwargs)  # the derived backward, as a torch.autograd.Function
        if IN_GRAPH is not None and torch.compiler.is_compiling():
            return IN_GRAPH(self, args, kwargs)  # one registered op in torch.compile's graph
        return self._launch(args, kwargs)

    def launch(self, *args: Any, **kwargs: Any) -> Any:
        """A call for callers that checked gradients themselves (nf.attention)."""
        return self._launch(args, kwargs)

    @staticmethod
    def _needs_grad(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values()))

    def _launch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not args and self._arity == len(kwargs) and all(n in kwargs for n in self._names):
            args = tuple(kwargs[n] for n in self._names)  # every parameter by name: no bind()
        elif kwargs or len(args) != self._arity:
            args = tuple(v for _, v in self.program_def.bind(*args, **kwargs))
        return self.launcher_for(args)(args)

    def launcher_for(self, args: Sequence[Any]) -> Callable[[Sequence[Any]], Any]:
        """The per-call function for positional arguments like `args` (compiled at the first call
        with their shapes, dtypes, strides and alignment): `launcher_for(args)(args)` runs it."""
        try:
            key = tuple(map(_arg_key, args))
        except RuntimeError:  # a tensor without data (sparse): the checks say which and why
            named = dict(zip(self._names, args))
            _check_tensors(self.program_def.trace(**named), named, (self.options or Options.from_environment()).interpreter)
            raise
        run = self._launchers.get(key)
        if run is None:
            run = self._until_launched(key, dict(zip(self._names, args)))
            self._launchers[key] = run
            if len(self._launchers) > MAX_LAUNCHERS:  # oldest first: a decode loop never returns to a length
                del self._launchers[next(iter(self._launchers))]
        return run

    def _until_launched(self, key: tuple[Any, ...], named: dict[str, Any],
                        plan: Plan | None = None) -> Callable[[Sequence[Any]], Any]:
        """The launcher for `key` until its first call returns, which then puts the launcher itself
        in its place. Triton compiles a kernel at its first launch; one that needs more shared
        memory than the device has (the schedule's estimate counts the pipelined tiles, the
        compiler's buffers can exceed it), or that the device's assembler fails on (ptxas crashes on
        some pipelined loops of wide tiles that one stage fewer compiles), is planned again
        smaller: fewer pipeline stages first, then narrower loop tiles; a plan that cannot shrink
        re-raises."""
        run, used = self._prepare(named, plan)

        def first(values: Sequence[Any]) -> Any:
            try:
                out = run(values)
            except (OutOfResources, PTXASError) as exc:
                if used is None or (used.num_stages == 1 and used.block_col <= 16):
                    raise
                smaller = (replace(used, num_stages=used.num_stages - 1) if used.num_stages > 1
                           else replace(used, block_col=used.block_col // 2))
                why = (f"does not fit the device ({exc})" if isinstance(exc, OutOfResources) else
                       f"fails in the device's assembler ({str(exc).splitlines()[0]})")
                warnings.warn(f"neptune_fusion: {self.program_def.name!r} with {used} {why}; compiling {smaller} "
                              "instead", stacklevel=2)
                again = self._until_launched(key, named, smaller)
                self._launchers[key] = again
                return again(values)
            if self._launchers.get(key) is first:
                self._launchers[key] = run
            return out

        return first

    def _prepare(self, named: dict[str, Any], plan: Plan | None = None
                 ) -> tuple[Callable[[Sequence[Any]], Any], Plan | None]:
        """Trace, check, compile, and build the launcher for arguments like `named` (`plan`
        overrides the schedule); with the plan it runs (None: unfused)."""
        program = self.program_def.trace(**named)
        order = list(named)
        try:
            if plan is None and isinstance(self.schedule, Autotune):
                from neptune_fusion.runtime.autotune import tune

                exe = tune(self, program, named, order)
            else:
                exe = self.executable_for(program, named, plan)
        except FusionError as exc:
            if not self.allow_fallback:
                raise
            warnings.warn(f"neptune_fusion: running {program.name!r} unfused: {exc}", stacklevel=3)
            self.fallback_reason = str(exc)
            dtypes = self.program_def.output_dtypes(program, named)
            return (lambda values: _cast_outputs(run_reference(program, dict(zip(order, values))), dtypes)), None
        # a plan asked for that the executable does not run (a program of several kernels plans each
        # of its own): nothing to shrink
        # (a library contraction's operand kernels are planned by their own programs)
        shrinkable = exe.library is None and plan in (None, exe.plan)
        return self._launcher(exe, program, named, order), exe.plan if shrinkable else None

    def _launcher(self, exe: Executable, program: Program, example: dict[str, Any],
                  order: list[str], pitch_bytes: int = 1) -> Callable[[Sequence[Any]], Any]:
        """The per-call function for arguments like `example`: everything that does not change from
        call to call (sizes, strides, grids, constexprs, where each kernel argument comes from) is
        resolved here once; a call allocates its outputs and launches. `pitch_bytes`: the rows of
        an output (its last dim) start at multiples of it (padded, returned as a view)."""
        if exe.library is not None:
            return self._library_launcher(exe, program, example, order)
        if exe.groups:  # several kernels, run in order
            return self._grouped_launcher(exe, program, example, order)
        assert exe.main is not None and exe.plan is not None
        sizes = axis_extents(exe.main.program, example)
        device = example[program.inputs[0].name].device
        fused = exe.main.program
        roles = _roles_of(fused)
        out_shapes = {spec.stage: [sizes[a] for a in fused.stage(spec.stage).axes] for spec in fused.outputs}
        # each output is stored in the dtype torch would give it (lang/dtypes.py)
        out_dtypes = dict(zip((o.stage for o in fused.outputs), self.program_def.output_dtypes(program, example),
                              strict=True))
        # each output is allocated in the shape it is returned in: a reshape of the contiguous shape the
        # kernel indexes, so the kernel's strides hold for it and a call makes no views
        returned = [(spec.stage, [sizes[d] if d else 1 for d in (spec.view or spec.dims)]) for spec in fused.outputs]
        alloc_shape = {name: next(shape for stage, shape in returned if stage == name) for name in out_shapes}
        # split-K partial states: (shape, dtype) here, the tensors per call or kept
        scratch: dict[str, tuple[list[int], torch.dtype]] = {}
        if exe.plan.splits > 1:
            loop = next(n for n in fused.stages if isinstance(n, FusedLoop))
            scratch = {f"part_{m.name}": ([exe.plan.splits, *(sizes[a] for a in m.axes)], torch.float32)
                       for m in loop.members}
        # keyed by the buffers' shapes: calls that differ only in the length of the split axis share them
        scratch_key = (tuple((n, tuple(shape)) for n, (shape, _) in scratch.items()), str(device), fused.fingerprint())
        extras: dict[str, torch.Tensor] = {}
        if exe.masks is not None:
            extras = block_map(fused, exe.masks, roles, sizes, example, exe.plan.block_row, exe.plan.block_col)
        # a call's slots: its arguments, then the outputs, the scratch buffers and the block map
        slot = {name: i for i, name in enumerate(order)}
        for group in (out_shapes, scratch, extras):
            slot.update({name: len(slot) + i for i, name in enumerate(group)})
        csizes = dict(sizes)
        csizes[SPLIT_AXIS] = exe.plan.splits
        kernels = [exe.main] if exe.combine is None else [exe.main, exe.combine]
        interpreted = exe.record.options.interpreter if exe.record is not None else interpreter_mode()
        pitched = {name: _pitched(shape, out_dtypes[name], pitch_bytes) if shape == alloc_shape[name] else shape
                   for name, shape in out_shapes.items()}
        launchers = [_FastLaunch(*self._arg_plan(k, csizes, slot, scratch, example, pitched, extras),
                                 interpreted=interpreted) for k in kernels]
        allocs = [_allocator(alloc_shape[name], out_dtypes[name], device) if pitched[name] == out_shapes[name]
                  else _padded_allocator(pitched[name], alloc_shape[name], out_dtypes[name], device)
                  for name in out_shapes]
        results = [(slot[stage], None if shape == alloc_shape[stage] else shape) for stage, shape in returned]
        single = results[0][0] if len(results) == 1 and results[0][1] is None else None
        masks = exe.masks
        map_key = (fused.fingerprint(), tuple(sorted(sizes.items())), exe.plan.block_row, exe.plan.block_col)
        guard_device = device.index if device.type == "cuda" else None

        @functools.cache
        def kept_scratch() -> dict[str, torch.Tensor]:  # allocated at the first call that may keep it
            if scratch_key not in self._scratch:
                self._scratch[scratch_key] = _fresh_scratch(scratch, device)
            return self._scratch[scratch_key]

        def run(values: Sequence[Any]) -> Any:
            slots = [*values, *[alloc() for alloc in allocs]]
            if scratch:  # per call where no state may outlive it (private_state), else kept
                slots.extend((_fresh_scratch(scratch, device) if CALL_STATE.private else kept_scratch()).values())
            if masks is not None:
                slots.extend(block_map(fused, masks, roles, sizes, dict(zip(order, values)), exe.plan.block_row,
                                       exe.plan.block_col, map_key).values())
            if guard_device is not None and torch._C._cuda_getDevice() != guard_device:
                with torch.cuda.device(guard_device):  # kernels run on the inputs' GPU, not the current one
                    for launcher in launchers:
                        launcher(slots)
            else:
                for launcher in launchers:
                    launcher(slots)
            if single is not None:
                return slots[single]
            out = [slots[i] if shape is None else slots[i].view(shape) for i, shape in results]
            return out[0] if len(out) == 1 else tuple(out)

        return run

    def _arg_plan(self, launch: KernelLaunch, sizes: dict[str, int], slot: dict[str, int],
                  scratch: dict[str, tuple[list[int], torch.dtype]], example: dict[str, Any], out_shapes: dict[str, list[int]],
                  extras: dict[str, torch.Tensor]) -> tuple[Any, ...]:
        """Where each kernel argument comes from: a slot of the call (tensors, parameters) or a value
        fixed for the launcher (sizes, strides), resolved once per shape."""
        tile = launch.tile
        sources: list[tuple[bool, Any, bool]] = []  # (from a slot, slot index or the fixed value, a tensor)
        for arg in tile.args:
            kind, name, dim = arg.source.kind, arg.source.name, arg.source.dim
            if kind in ("input", "param", "scratch"):
                if name not in slot:
                    raise ValueError(f"kernel argument {arg.name!r} reads {name!r}, which this call does not have")
                sources.append((True, slot[name], arg.kind == "pointer"))
            elif kind == "output":
                sources.append((True, slot[name.removeprefix("out_")], True))
            elif kind == "size":
                sources.append((False, sizes[name], False))
            else:  # a stride
                assert dim is not None
                if name in example:
                    stride = example[name].stride(dim)
                elif name in scratch:
                    stride = math.prod(scratch[name][0][dim + 1:])  # allocated contiguous
                elif name in extras:
                    stride = extras[name].stride(dim)
                else:
                    stride = math.prod(out_shapes[name[len("out_"):]][dim + 1:])
                sources.append((False, stride, False))
        env: dict[str, int] = {f"size_{a}": s for a, s in sizes.items()}
        env.update(tile.constexprs)
        grid = tuple(dim.value(env) for dim in tile.grid)
        return (launch.fn, grid, sources, dict(tile.constexprs), tile.num_warps, tile.num_stages,
                tile.grid_dependency == "dependent")


def arg_names(program: Program) -> list[str]:
    """A group program's arguments, by name: its inputs, then its scalar parameters."""
    return [b.name for b in program.inputs] + list(program.params)


def input_dtypes(program: Program, args: dict[str, Any]) -> dict[str, str]:
    """Each tensor input's dtype name."""
    return {b.name: input_dtype_name(args[b.name].dtype) for b in program.inputs
            if isinstance(args.get(b.name), torch.Tensor)}


def library_outputs_apart(program: Program, sizes: dict[str, int], dtype: str,
                          dtypes: dict[str, str]) -> list[Group] | None:
    """A program of several outputs, one of which the GEMM library would compute alone (a
    backward's weight gradient beside a norm's): that output as a group of its own beside a group
    of the others (each of which may part again), or None. The later group reads what the earlier
    one returns instead of computing it again (`_reading_outputs`: a training forward's saved
    projection, its attention's statistics); the order that saves the larger reductions runs, the
    others first where neither saves any.

    Example:
        >>> import neptune_fusion as nf
        >>> @nf.program
        ... def matmul_and_sum(x, w):
        ...     return x @ w, x.sum(axis=-1)
        >>> x, w = torch.randn(8, 16).half(), torch.randn(16, 8).half()
        >>> program = matmul_and_sum.trace(x, w)
        >>> sizes = axis_extents(program, {"x": x, "w": w})
        >>> [g.results for g in library_outputs_apart(program, sizes, "f16", {})]
        [('output:1',), ('output:0',)]
    """
    if len(program.outputs) < 2:
        return None
    for j in range(len(program.outputs)):
        alone = _outputs_program(program, [j])
        if isinstance(library_contraction(alone, sizes, dtype, dtypes), LibraryContraction):
            rest = [i for i in range(len(program.outputs)) if i != j]
            orders = [((rest, [j]), _reading_outputs(program, [j], rest, sizes)),
                      (([j], rest), _reading_outputs(program, rest, [j], sizes))]
            (first, second), (later, _) = max(orders, key=lambda order: order[1][1])
            return [*(Group(_outputs_program(program, part), tuple(f"output:{i}" for i in part))
                      for part in _independent_outputs(program, first)),
                    Group(later, tuple(f"output:{i}" for i in second))]
    return None


def _independent_outputs(program: Program, outputs: list[int]) -> list[list[int]]:
    """`outputs` in clusters that share a stage or an input: outputs of different clusters share
    nothing one kernel could reuse (a norm's statistic of x and a gated activation of a saved
    projection), so each runs as a kernel tiled for itself, not as the second pass of another's.

    Example:
        >>> import neptune_fusion as nf
        >>> @nf.program
        ... def two_rows(x, y):
        ...     return x.sum(axis=-1), y.max(axis=-1), x.max(axis=-1)
        >>> _independent_outputs(two_rows.trace(torch.randn(4, 8), torch.randn(4, 8)), [0, 1, 2])
        [[0, 2], [1]]
    """
    stages = [st for st in program.stages if isinstance(st, Stage)]
    reads = {j: {st.name for st in needed_stages(stages, {program.outputs[j].stage})} for j in outputs}
    reads = {j: names | {r for st in stages if st.name in names for r in st.reads()} for j, names in reads.items()}
    clusters: list[tuple[list[int], set[str]]] = []
    for j in outputs:
        joined = [c for c in clusters if c[1] & reads[j]]
        merged = ([k for c in joined for k in c[0]] + [j], set().union(reads[j], *(c[1] for c in joined)))
        clusters = [c for c in clusters if all(c is not d for d in joined)] + [merged]
    return sorted(sorted(c[0]) for c in clusters)


def _outputs_program(program: Program, outputs: list[int], returned: dict[str, Stage] | None = None) -> Program:
    """`program` computing only these of its outputs (the stages they need, the inputs those
    read); a stage in `returned` is read from the output stage given for it (an input)."""
    specs = [program.outputs[j] for j in outputs]
    roots = {o.stage for o in specs}
    stages: list[Any] = list(program.stages)
    extra: list[InputBuffer] = []
    if returned:
        needed = {st.name for st in needed_stages(stages, roots)}
        use = {r: out for r, out in returned.items() if r in needed}
        given = {out.name for out in use.values()}  # inputs now, not stages computed again
        # read from the input itself (no stage aliasing it), so a GEMM's operand is an input as it stands
        renamed = {r: out.name for r, out in use.items()}
        stages = [replace(st, body=rename_reads(st.body, renamed)) if isinstance(st, Stage) else st
                  for st in stages if st.name not in given and st.name not in use]
        extra = [InputBuffer(out.name, out.axes) for out in use.values()]
    stages = needed_stages(stages, roots)
    read = {r for st in stages for r in st.reads()}
    return subprogram(program, f"{program.name}_out{'_'.join(map(str, outputs))}", stages, specs,
                      [b for b in extra if b.name in read])


def _reading_outputs(program: Program, later: list[int], earlier: list[int],
                     sizes: dict[str, int]) -> tuple[Program, int]:
    """The program of the outputs `later` reading every value it needs that one of the outputs
    `earlier` returns as it stands (cast, at its own axes: a saved `f16(x @ w)` or `f16(silu(g) *
    u)`), and the elements those values sum or are (what reading them saves). The later part then
    reads the value rounded to the output's dtype, as model code's own tensors hold it."""
    returned: dict[str, Stage] = {}
    for j in earlier:
        out = program.stage(program.outputs[j].stage)
        body = out.body
        if (isinstance(body, Cast) and isinstance(body.x, Load) and body.x.index == tuple(map(Index, out.axes))
                and any(st.name == body.x.buffer and st.axes == out.axes for st in program.stages if isinstance(st, Stage))):
            returned[body.x.buffer] = out
    part = _outputs_program(program, later, returned)
    read = {b.name for b in part.inputs}
    saved = sum(math.prod(sizes.get(a, 1) for a in (*program.stage(r).axes, program.stage(r).reduce_axis))
                for r, out in returned.items() if out.name in read)
    return part, saved


def gemm_dtype(program: Program, args: dict[str, Any]) -> str:
    """The floating inputs' one dtype (`mixed` where they differ): a library GEMM's operand dtype."""
    names = {input_dtype_name(args[b.name].dtype) for b in program.inputs
             if isinstance(args.get(b.name), torch.Tensor) and args[b.name].is_floating_point()}
    return names.pop() if len(names) == 1 else "mixed"


def _materialised(program: Program, group: Group, sizes: dict[str, int], device: torch.device) -> dict[str, torch.Tensor]:
    """Tensors of the shapes and dtype (fp32 unless narrowed, contiguous) of the reductions `group`
    writes for the groups after it: example arguments for compiling those."""
    # the group's own stage gives the axes: a group may be a rewritten part of `program`
    # (transform/distribute.py adds basis sums), so not every result is one of its stages
    # an output a later group reads (`library_outputs_apart`) goes by its stage's name too
    stages = [group.program.stage(o.stage) for o in group.program.outputs]
    return {(st.name if r.startswith("output:") else r):
            torch.empty([sizes[a] for a in st.axes], device=device, dtype=written_dtype(st))
            for st, r in zip(stages, group.results) if not r.startswith("output:") or isinstance(st.body, Cast)}


def written_dtype(stage: Stage) -> torch.dtype:
    """The dtype a kernel writes a result stage in: its cast's (a narrowed pool, a saved
    activation), else fp32.

    Example:
        >>> from neptune_fusion.ir.expr import Load
        >>> written_dtype(Stage("r", ("i",), Cast(Load("s", (Index("i"),)), "f16")))
        torch.float16
    """
    return torch_dtype(stage.body.dtype) if isinstance(stage.body, Cast) else torch.float32


def result_dtypes(group: Group) -> dict[str, torch.dtype]:
    """The dtype each of `group`'s results is written in (`written_dtype`), by result."""
    return {r: written_dtype(group.program.stage(o.stage)) for r, o in zip(group.results, group.program.outputs)}


def length_params_of(program: Program, parts: list[Program]) -> dict[str, str]:
    """The axes whose lengths `parts` (kernels of `program`) read as parameters, by parameter
    (`partition.length_axes`: axes none of their inputs has).

    Example:
        >>> import torch
        >>> from neptune_fusion.library import softmax
        >>> length_params_of(softmax.trace(torch.zeros(2, 3)), [])
        {}
    """
    return {p: a for part in parts for p, a in length_axes(part, program).items()}


def lengths_of(program: Program, params: dict[str, str], values: dict[str, Any]) -> dict[str, int]:
    """Those parameters' values for a call of `program` with `values`.

    Example:
        >>> import torch
        >>> from neptune_fusion.library import softmax
        >>> x = torch.zeros(2, 3)
        >>> lengths_of(softmax.trace(x), {"size_of_a1": "a1"}, {"x": x})
        {'size_of_a1': 3}
    """
    if not params:
        return {}
    extents = axis_extents(program, values)
    return {p: extents[a] for p, a in params.items()}


def _allocator(shape: list[int], dtype: torch.dtype, device: torch.device) -> Callable[[], torch.Tensor]:
    """A function making an uninitialised contiguous tensor of this shape, dtype and device.

    `torch.empty_like` of a one-element tensor expanded to the shape parses no arguments and makes
    a contiguous tensor: about half of `torch.empty(shape, dtype=..., device=...)`'s host time.

    Example:
        >>> alloc = _allocator([2, 3], torch.float16, torch.device("cpu"))
        >>> t = alloc()
        >>> (tuple(t.shape), t.stride(), t.dtype)
        ((2, 3), (3, 1), torch.float16)
    """
    if shape:
        template = torch.empty(1, dtype=dtype, device=device).expand(shape)
        made = torch.empty_like(template)
        if made.is_contiguous() and made.shape == template.shape:
            return functools.partial(torch.empty_like, template)
    return functools.partial(torch.empty, shape, dtype=dtype, device=device)


def _pitched(shape: list[int], dtype: torch.dtype, pitch_bytes: int) -> list[int]:
    """`shape` with its last dim rounded up so that rows start at multiples of `pitch_bytes`."""
    if not shape:
        return shape
    multiple = max(1, pitch_bytes // dtype.itemsize)
    return [*shape[:-1], -(-shape[-1] // multiple) * multiple]


def _padded_allocator(padded: list[int], shape: list[int], dtype: torch.dtype,
                      device: torch.device) -> Callable[[], torch.Tensor]:
    """A function making a view of `shape` into a fresh tensor of the `padded` shape (its rows at
    the padded pitch: cuBLAS multiplies 16-bit operands at full rate only from 16-byte aligned rows).

    Example:
        >>> t = _padded_allocator([3, 8], [3, 5], torch.float16, torch.device("cpu"))()
        >>> (tuple(t.shape), t.stride())
        ((3, 5), (8, 1))
    """
    def make() -> torch.Tensor:
        return torch.empty(padded, dtype=dtype, device=device)[..., :shape[-1]]

    return make


def _fresh_scratch(specs: dict[str, tuple[list[int], torch.dtype]], device: torch.device) -> dict[str, torch.Tensor]:
    """Split-K partial-state buffers."""
    return {n: torch.empty(shape, dtype=dtype, device=device) for n, (shape, dtype) in specs.items()}


class _FastLaunch:
    """Launch one kernel; after the first call, straight through Triton's compiled launcher.

    Triton's `kernel[grid](...)` re-binds and re-specialises every argument on each call (tens of
    microseconds of Python). The launcher key (`_arg_key`) already fixes everything the
    specialisation depends on, so later calls reuse the compiled kernel: the argument tuple is
    built by one generated function from the call's slots and the fixed values (as Triton builds
    its own binder), and, while no launch hook is installed and the kernel needs no global
    scratch, it goes straight to the C launcher with the tensors' addresses: given a tensor, that
    launcher asks the driver whether each pointer is a device pointer, about a microsecond per
    argument, and the launcher key has already fixed every tensor's device.
    """

    def __init__(self, fn: Any, grid: tuple[int, ...], sources: list[tuple[bool, Any, bool]], constexprs: dict[str, int],
                 warps: int, stages: int, dependent_launch: bool = False, interpreted: bool = False) -> None:
        self.fn, self.constexprs = fn, constexprs
        self.interpreted = interpreted  # Triton's interpreter has no compiled launcher to keep
        # compiled with launch_pdl: every launch then carries the programmatic-dependent attribute
        self.options = {"launch_pdl": True} if dependent_launch else {}
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.empty = 0 in self.grid  # an empty axis: nothing to compute (CUDA refuses empty grids)
        self.warps, self.stages = warps, stages
        self.kernel: Any = None
        # after the first launch, while no launch hook is installed: `direct(slots, stream)` calls
        # the C launcher with every fixed argument bound (`_direct_binder`)
        self.direct: Callable[[list[Any], int], None] | None = None
        self.n_args = len(sources)
        self.fixed = tuple(value for from_slot, value, _ in sources if not from_slot) + tuple(constexprs.values())
        parts, raw, j = [], [], 0
        for from_slot, value, pointer in sources:
            parts.append(f"s[{value}]" if from_slot else f"c[{j}]")
            raw.append(f"s[{value}].data_ptr()" if pointer else parts[-1])
            j += not from_slot
        tail = [f"c[{j + i}]" for i in range(len(constexprs))]
        self.bind: Callable[[list[Any]], tuple[Any, ...]] = _binder(", ".join(parts + tail))(self.fixed)
        self.address_parts = ", ".join(raw + tail)

    def __call__(self, slots: list[Any]) -> None:
        direct = self.direct
        if direct is not None and not _hooks_installed():
            direct(slots, torch._C._cuda_getCurrentRawStream(self.device))
            return
        if self.empty:
            return
        k = self.kernel
        if k is None:
            self._first(slots)
            return
        stream = torch._C._cuda_getCurrentRawStream(self.device)
        args = self.bind(slots)
        meta = k.launch_metadata(self.grid, stream, *args)
        k.run(*self.grid, stream, k.function, k.packed_metadata, meta, knobs.runtime.launch_enter_hook,
              knobs.runtime.launch_exit_hook, *args)

    def _first(self, slots: list[Any]) -> None:
        """The first launch, through Triton's JIT (which compiles); then keep its compiled kernel."""
        args = self.bind(slots)[:self.n_args]
        kernel = self.fn[self.grid](*args, **self.constexprs, num_warps=self.warps, num_stages=self.stages,
                                    **self.options)
        if self.interpreted or not (hasattr(kernel, "run") and hasattr(kernel, "packed_metadata")):
            return
        self.kernel = kernel
        self.device = torch.cuda.current_device()  # the caller made the inputs' GPU current
        launcher = kernel.run
        if getattr(launcher, "global_scratch_size", 1) == 0 and getattr(launcher, "profile_scratch_size", 1) == 0:
            self.direct = _direct_binder(self.address_parts)(
                launcher.launch, *self.grid, kernel.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                kernel.packed_metadata, self.fixed)


def _hooks_installed() -> bool:
    """Whether a Triton launch hook would run (a profiler's): then launches take Triton's own path."""
    runtime = knobs.runtime
    return _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook)


@functools.lru_cache(maxsize=1024)
def _direct_binder(parts: str) -> Callable[..., Callable[[list[Any], int], None]]:
    """`make(launch, gx, gy, gz, function, cooperative, pdl, metadata, c)`: the function
    `(s, stream) -> launch(...)` that calls Triton's C launcher `launch` for the call's slots `s`
    (`parts` reads tensors' addresses from them) and fixed values `c`, no scratch and no hooks."""
    return eval(  # noqa: S307 - indices only
        "lambda launch, gx, gy, gz, function, cooperative, pdl, metadata, c: lambda s, stream: "
        f"launch(gx, gy, gz, stream, function, cooperative, pdl, None, None, metadata, None, None, None, {parts})",
        {"__builtins__": {}})


@functools.lru_cache(maxsize=1024)
def _binder(parts: str) -> Callable[[tuple[Any, ...]], Callable[[list[Any]], tuple[Any, ...]]]:
    """`make(c)`: the function `s -> (parts,)` reading the call's slots `s` and fixed values `c`
    (generated once per argument pattern: launchers for new lengths share it)."""
    return eval(f"lambda c: lambda s: ({parts},)", {"__builtins__": {}})  # noqa: S307 - indices only


@functools.lru_cache(maxsize=1024)
def _hooked(hook: Any) -> bool:
    """Whether a Triton launch hook would do anything (a HookChain with no calls does nothing)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _cast_outputs(result: Any, dtypes: list[torch.dtype]) -> Any:
    """The reference executor's outputs in the dtypes the compiled kernels return."""
    outs = result if isinstance(result, tuple) else (result,)
    cast = tuple(o.to(d) for o, d in zip(outs, dtypes, strict=True))
    return cast if isinstance(result, tuple) else cast[0]


def _arg_key(value: Any) -> Any:
    """What selects a compiled launcher: tensors' shape, dtype, device, strides and 16-byte
    alignment; for ints, the properties Triton specialises on (== 1, divisible by 16)."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device, value.stride(), value.data_ptr() % 16 == 0)
    if isinstance(value, int) and not isinstance(value, bool):
        return (int, value == 1, value % 16 == 0)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"scalar parameters must be finite, got {value}")
        return (float, value > 0)  # kernels are specialised on positive scale factors
    return type(value)


def compile(program: ProgramDef | Callable[..., Any], schedule: Schedule | None = None,  # noqa: A001
            allow_fallback: bool = False, options: Options | None = None) -> Compiled:
    """Compile a program for the GPU; the template is chosen from the shapes unless given, the
    switches (`runtime/options.py`) read from the environment unless given.

    Example:
        >>> import torch, neptune_fusion as nf
        >>> from neptune_fusion.library import attention
        >>> fn = nf.compile(attention, schedule=nf.flash(block_q=16, block_k=16))
        >>> q = k = v = torch.randn(1, 2, 32, 16)
        >>> torch.allclose(fn(q, k, v, scale=0.25), torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v, atol=1e-5)
        True
    """
    return Compiled(program, schedule, allow_fallback, options)
