"""``@tile(i=64, j=64)``: a Python loop nest becomes a tiled Triton kernel and a vectorized torch path.

    @mg.tile(i=32, j=64)                        # macrogen: tile at ops.py:5
    def bias_gelu(out, x, b):                   def bias_gelu(out, x, b):
        M, N = x.shape                     ->       if use_triton(out.device):
        for i in range(M):                              _bias_gelu_triton(out, x, b)
            for j in range(N):                      else:
                v = x[i, j] + b[j]                      _bias_gelu_torch(out, x, b)
                out[i, j] = v * torch.sigmoid(1.702 * v)

The generated helpers (module level) are ``_bias_gelu_shapes`` (sizes, bounds
and index-range checks), ``_bias_gelu_kernel`` (one Triton program per 32x64
tile, masked at the ragged edges), ``_bias_gelu_triton`` (device and dtype
checks, grid, launch; CPU tensors work under ``TRITON_INTERPRET=1``) and
``_bias_gelu_torch`` (the same computation as whole-tensor torch operations;
``b[j]`` becomes ``b[None, 0:N]``). The function keeps its signature and writes
its outputs in place; CUDA tensors take the kernel, others the torch path.

Arguments: one tile size per loop variable (a power of two; may be
``tunable``), ``num_warps=4``, ``num_stages=2`` and ``dot_precision="torch"``
(``tl.dot``'s input precision for matmul-shaped reductions: "ieee", "tf32" or
"tf32x3"). The accepted loop nests, with examples: docs/tile.md.

Where the rest lives (this package):

- analysis.py recognises the subset (statements and loops; expressions in
  expressions.py) and builds the loop-nest IR of ir.py;
- kernel.py and torch_path.py turn that IR into steps (steps.py: assignments,
  stores, tiled loops; dead stores dropped) whose expressions printer.py and
  code.py write, parenthesized by precedence; names.py names what they share;
- checks.py: the shapes function's run-time checks; constraints.py: what a
  tile size must satisfy (also for autotune);
- templates/tile_*.py.j2 lay the generated functions out (shapes, kernel,
  launcher, torch path, dispatch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import libcst as cst

from macrogen.macro import Arg, Context, Expanded, Form, MacroError, Site, render, render_statements
from macrogen.macros.tile import flash
from macrogen.macros.tile.analysis import analyze, words
from macrogen.macros.tile.checks import alias_checks, index_checks
from macrogen.macros.tile.code import Parsed, parse
from macrogen.macros.tile.constraints import block_shape, too_big
from macrogen.macros.tile.constraints import (
    tuning_constraint as tuning_constraint,  # autotune's hook
)
from macrogen.macros.tile.constraints import (
    tuning_per_device as tuning_per_device,  # the import hook's per-rank lookup
)
from macrogen.macros.tile.flash_output import FlashOutput
from macrogen.macros.tile.flash_output import Options as FlashOptions
from macrogen.macros.tile.ir import InnerLoop, Load, Nest
from macrogen.macros.tile.kernel import (
    PERSISTENT_MAX,
    PERSISTENT_ROWS,
    PERSISTENT_TILE,
    KernelEmitter,
    persistent_ok,
)
from macrogen.macros.tile.kernel import flat as _flat
from macrogen.macros.tile.names import LoopBounds, Namer, Names, loads_in, make_names
from macrogen.macros.tile.steps import Branch, Step
from macrogen.macros.tile.syntax import is_docstring
from macrogen.macros.tile.torch_layout import BLOCK_ELEMENTS, MIN_BLOCK_ROWS, row_blocks
from macrogen.macros.tile.torch_path import TorchEmitter, sharing

NAME = "tile"
FORMS: frozenset[Form] = frozenset({"decorator"})
USAGE = "@tile(i=64, j=64) decorates a function whose body is a loop nest over range(...)"

OPTIONS = {"num_warps": 4, "num_stages": 2, "dot_precision": "torch", "group_size": 8}
# the attention nest's backward kernel (flash_output.py): its own blocks, warps and stages
BACKWARD = {"backward_block": 64, "backward_step": 32, "backward_warps": 4, "backward_stages": 2}
# "torch": TF32 only where torch.backends.cuda.matmul.allow_tf32 allows it (off by default),
# so that an fp32 matmul keeps fp32 semantics unless the user opts in, here or in torch
DOT_PRECISIONS = ("torch", "ieee", "tf32", "tf32x3")


@dataclass(frozen=True)
class Spec:
    nest: Nest
    tiles: tuple[tuple[str, int], ...]  # loop variable -> tile size
    num_warps: int  # warps per program on the GPU
    num_stages: int  # software-pipelining depth of the kernel's loops
    dot_precision: (
        str  # tl.dot input precision; "ieee" matches the fp32 loop, "torch" follows allow_tf32
    )
    group_size: int = (
        8  # a matmul's row tiles that walk the columns together (L2 reuse); 1: row-major
    )
    words: frozenset[str] = frozenset()  # the function's identifier-like words (analysis.words)
    backward: tuple[int, int, int, int] = tuple(BACKWARD.values())  # type: ignore[assignment]

    @property
    def tile(self) -> dict[str, int]:
        return dict(self.tiles)


def default_tile(nest: Nest) -> int:
    """About a thousand elements per tile: 1024, 32x32, 16x16x16, 8x8x8x8 (32 each for a tl.dot;
    64 for the attention nest, whose kernel holds 2-D blocks of queries and keys)."""
    if flash.match(nest) is not None:
        return 64
    if nest.dot is not None:
        return 32
    return {1: 1024, 2: 32, 3: 16, 4: 8}.get(nest.rank, 4)


def validate(site: Site, ctx: Context) -> Spec:
    fn = site.original  # the source's nodes, so that errors point into the file
    if not isinstance(fn, cst.FunctionDef):
        raise MacroError(
            f"tile() decorates a function, not a class: {USAGE}", site.call or site.original
        )
    taken = words(fn, ctx.source_text(fn))  # for the analysis and the generated names
    nest = analyze(fn, ctx.constants, taken)
    variables = list(
        dict.fromkeys([g.var for g in nest.grid] + [s.loop.var for s in nest.all_inner_loops])
    )
    for var in variables:
        if var in OPTIONS or var in BACKWARD:
            raise MacroError(
                f"name the loop variable something other than {var!r}: it is a tile() option",
                site.original,
            )
    default = default_tile(nest)
    attention = flash.match(nest)
    for option, arg in site.args.keywords.items():
        if option in BACKWARD and attention is None:
            raise MacroError(
                f"{option} is an option of the attention nest's backward kernel; this nest has none",
                arg.node,
            )
    backward_options = BACKWARD if attention is not None else {}
    args = site.args.bind({**{v: default for v in variables}, **OPTIONS, **backward_options})
    tiles = {}
    for var in variables:
        value = args[var].value if var in args else default
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or value < 1
            or value & (value - 1)
        ):
            raise MacroError(
                f"the tile size of {var!r} must be a power of two, not {value!r}", args[var].node
            )
        tiles[var] = value
    num_warps = args["num_warps"].value if "num_warps" in args else OPTIONS["num_warps"]
    if num_warps not in (1, 2, 4, 8, 16, 32) or isinstance(num_warps, bool):
        raise MacroError(
            f"num_warps must be a power of two from 1 to 32, not {num_warps!r}",
            args["num_warps"].node,
        )
    num_stages = args["num_stages"].value if "num_stages" in args else OPTIONS["num_stages"]
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or not 1 <= num_stages <= 8:
        raise MacroError(
            f"num_stages must be an integer from 1 to 8, not {num_stages!r}",
            args["num_stages"].node,
        )
    precision = args["dot_precision"].value if "dot_precision" in args else OPTIONS["dot_precision"]
    if precision not in DOT_PRECISIONS:
        raise MacroError(
            f"dot_precision must be one of {', '.join(map(repr, DOT_PRECISIONS))}, not {precision!r}",
            args["dot_precision"].node,
        )
    # a FlashAttention kernel's blocks are 2-D; the elementwise one's have an axis per loop
    problem = (
        None if flash.wanted(nest, tiles) else too_big(block_shape(kernel_nest(nest, tiles), tiles))
    )
    if problem:
        raise MacroError(problem, site.call or site.original)
    group = args["group_size"].value if "group_size" in args else OPTIONS["group_size"]
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
        raise MacroError(
            f"group_size must be a positive integer, not {group!r}", args["group_size"].node
        )
    backward = _backward_options(args)
    return Spec(
        nest,
        tuple(tiles.items()),
        num_warps,
        num_stages,
        precision,
        group,
        frozenset(taken),
        backward,
    )


def _backward_options(args: dict[str, Arg]) -> tuple[int, int, int, int]:
    """The attention backward's blocks, step, warps and stages, checked."""
    values = []
    for option, default in BACKWARD.items():
        if option not in args:
            values.append(default)
            continue
        value, node = args[option].value, args[option].node
        if option == "backward_stages":
            ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 8
            want = "an integer from 1 to 8"
        elif option == "backward_warps":
            ok = value in (1, 2, 4, 8, 16, 32) and not isinstance(value, bool)
            want = "a power of two from 1 to 32"
        else:  # a tl.dot dimension
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 16
            ok = ok and value & (value - 1) == 0
            want = "a power of two of at least 16 (a tl.dot dimension)"
        if not ok:
            raise MacroError(f"{option} must be {want}, not {value!r}", node)
        values.append(value)
    block, step, warps, stages = values
    return block, step, warps, stages


def kernel_nest(nest: Nest, tiles: dict[str, int]) -> Nest:
    """The nest the kernel computes: tl.dot needs tiles of at least 16 along each axis,
    smaller ones reduce elementwise instead (the torch path keeps its matmul)."""
    if nest.dot is None:
        return nest
    loop = nest.inner_loops[0]
    if all(tiles[v] >= 16 for v in (nest.grid[0].var, nest.grid[1].var, loop.loop.var)):
        return nest
    body = tuple(
        dataclasses.replace(s, dot=None) if isinstance(s, InnerLoop) else s for s in nest.body
    )
    return dataclasses.replace(nest, body=body)


def expand(site: Site, ctx: Context) -> Expanded:
    spec = validate(site, ctx)
    if not spec.nest.tensors:
        raise MacroError("an @tile function needs at least one tensor parameter", site.original)
    out = _Output(spec, site, ctx)
    helpers = [out.shapes()]
    if out.attention is not None and out.flash:
        helpers += [out.attention.kernel(), out.attention.backward_kernel()]
        helpers.append(out.attention.launchers())
    elif out.kernel_wanted:
        helpers += [out.kernel(), out.launcher()]
    helpers.append(out.torch_path())
    if out.attention is not None:
        helpers.append(out.attention.autograd())
    return Expanded([out.function()], helpers=tuple(helpers))


class _Output:
    """The generated functions of one site, rendered from its Spec."""

    def __init__(self, spec: Spec, site: Site, ctx: Context):
        self.spec, self.site, self.nest = spec, site, spec.nest
        # the tensor whose device and dtype the others must share (index tensors hold integers)
        self.first = next(t for t, _ in self.nest.tensors if t not in self.nest.index_tensors)
        # With --target cpu no kernel is generated: the function is the torch path.
        self.kernel_wanted = ctx.options.target != "cpu"
        runtime = "macrogen.runtime"
        self.mods = {"torch": ctx.import_module("torch")}
        if self.kernel_wanted:
            for name in ("triton", "tl", "use_triton", "interpreting", "int64_offsets"):
                self.mods[name] = ctx.import_from(runtime, name)
        self.names = make_names(self.nest, set(spec.words) | set(self.mods.values()))
        base = self.nest.name.strip("_") or "tile"
        # the attention nest: differentiable (an autograd function), and with tiles tl.dot
        # takes, FlashAttention kernels (flash.py, flash_output.py)
        matched = flash.match(self.nest)
        self.flash = flash.wanted(self.nest, spec.tile) if self.kernel_wanted else None
        kinds = [("shapes", "shapes"), ("torch_fn", "torch"), ("torch_block", "torch_block")]
        if self.kernel_wanted:
            kinds += [("kernel", "kernel"), ("launcher", "triton")]
            kinds += [("persistent_max", "persistent_max")] if not self.flash else []
        if self.flash:
            kinds += [("launch", "launch"), ("backward_kernel", "backward_kernel")]
            kinds += [("backward_launcher", "backward_triton")]
        if matched:
            kinds += [("backward_torch", "backward_torch"), ("autograd", "autograd")]
        self.fns = {kind: ctx.names.fresh(f"_{base}_{suffix}") for kind, suffix in kinds}
        self.bounds = list(dict.fromkeys(self.names.bounds.values()))
        results = [s.name for s in self.nest.sizes] + [x for b in self.bounds for x in (b.lo, b.hi)]
        self.common = {
            "location": ctx.location(site.line),
            "tensors": [self._tensor(t, ndim) for t, ndim in self.nest.tensors],
            "params": self.nest.params,
            "results": parse(", ".join(results) if len(results) != 1 else f"{results[0]},"),
            **self.fns,
        }
        self.kernel_nest = kernel_nest(self.nest, spec.tile)
        self.dot_precision = (
            self.names.namer("DOT_PRECISION")
            if self.kernel_nest.dot is not None or self.flash
            else ""
        )
        self.group = self.names.namer("GROUP_SIZE") if self.kernel_nest.dot is not None else ""
        self.persistent = (
            self.names.namer("PERSISTENT")
            if self.kernel_wanted and persistent_ok(self.kernel_nest) and not self.flash
            else ""
        )
        self.attention = (
            FlashOutput(
                matched,
                self.nest,
                self.names,
                self.mods,
                self.fns,
                self.common,
                FlashOptions(
                    spec.tile[matched.query.var],
                    spec.tile[matched.keys.var],
                    spec.num_warps,
                    spec.num_stages,
                    *spec.backward,
                ),
                self.dot_precision or self.names.namer("DOT_PRECISION"),
                self._precision(),
            )
            if matched
            else None
        )

    def _precision(self) -> Parsed:
        """The launch argument of DOT_PRECISION: "torch" follows torch's allow_tf32."""
        if self.spec.dot_precision == "torch":
            allow = f"{self.mods['torch']}.backends.cuda.matmul.allow_tf32"
            return parse(f'"tf32" if {allow} else "ieee"')
        return parse(repr(self.spec.dot_precision))

    def _tensor(self, t: str, ndim: int) -> dict[str, object]:
        first = self.first
        return {
            "name": t,
            "ndim": ndim,
            "ptr": self.names.ptr[t],
            "strides": self.names.strides[t],
            "message": f"{t} must have {ndim} dimension{'s' if ndim != 1 else ''} (it is indexed so), not %d",
            "same_message": f"{t} must be a float16, bfloat16 or float32 tensor on the same device"
            f" as {first} (loads compute in float32; stores cast to each output's dtype)",
            "index": t in self.nest.index_tensors,  # integers: device checked, dtype int32/int64
            "index_message": f"{t} indexes other tensors: it must be an int32 or int64 tensor on"
            f" the same device as {first}",
        }

    def shapes(self) -> str:
        return render(
            "tile_shapes.py.j2",
            sizes=self.nest.sizes,
            bounds=self.bounds,
            checks=index_checks(self.nest, self.names),
            aliases=alias_checks(self.nest),
            **self.common,
        )

    def kernel(self) -> str:
        names = self.names.fork()
        emitter = KernelEmitter(self.kernel_nest, names, self.mods["tl"], self.dot_precision)
        pid = names.namer("pid")
        grouped = self.kernel_nest.dot is not None and self.spec.group_size > 1
        return render(
            "tile_kernel.py.j2",
            triton=self.mods["triton"],
            tl=self.mods["tl"],
            scalars=self.nest.scalars,
            sizes=[s.name for s in self.nest.sizes],
            blocks=list(dict.fromkeys(self.names.block.values())),
            dot_precision=self.dot_precision,
            bounds=self.bounds,
            pid=pid,
            grid=emitter.grid_setup(pid, self.spec.tile, self.group if grouped else ""),
            grouping=emitter.grouping,
            group=self.group if grouped else "",
            wide=self.names.wide,
            steps=self._kernel_steps(emitter, names),
            persistent=self.persistent,
            **self.common,
        )

    def _kernel_steps(self, emitter: KernelEmitter, names: Names) -> list[Step]:
        """The kernel's body: with a persistent variant, both under ``if PERSISTENT:``."""
        if not self.persistent:
            return emitter.steps()
        variants = []
        for persistent in (True, False):
            fork = names.fork()  # each variant's locals named afresh: only one is compiled
            variant = KernelEmitter(self.kernel_nest, fork, self.mods["tl"], self.dot_precision)
            variant.grid_vars, variant.grouping = emitter.grid_vars, emitter.grouping
            variants.append(tuple(variant.steps(persistent)))
        comment = "every row in one block: loaded once, each pass reads registers"
        return [Branch(self.persistent, variants[0], variants[1], comment)]

    def launcher(self) -> str:
        triton, launcher = self.mods["triton"], self.fns["launcher"]
        namer = self.names.fork().namer
        programs_name = namer("programs")
        local = {v: namer(f"block_{v}") for v in self.names.block}
        blocks = [
            {"name": self.names.block[v], "value": self.spec.tile[v], "local": local[v]}
            for v in self.names.block
        ]
        persistent = self._persistent_launch(local, namer) if self.persistent else None
        programs = " * ".join(
            f"{triton}.cdiv({_iterations(self.names.bounds[g], g.step, triton)}, "
            f"{local[g.var] if persistent else self.spec.tile[g.var]})"
            for g in self.nest.grid
        )
        return render(
            "tile_launcher.py.j2",
            persistent=persistent,
            triton=triton,
            torch=self.mods["torch"],
            interpreting=self.mods["interpreting"],
            first=self.first,
            device_message=f"{launcher} runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), not ",
            dtype_message=f"{launcher} takes float16, bfloat16 or float32 tensors, not ",
            programs=programs_name,
            programs_code=parse(programs),
            scalars=self.nest.scalars,
            sizes=[s.name for s in self.nest.sizes],
            blocks=blocks,
            dot_precision=self.dot_precision,
            dot_precision_value=self.spec.dot_precision,
            dot_operands=self._dot_operands(),
            dot_message="the operands of a tl.dot must have one dtype: "
            + " and ".join(self._dot_operands()),
            group=self.group
            if self.kernel_nest.dot is not None and self.spec.group_size > 1
            else "",
            group_size=self.spec.group_size,
            allow_tf32=f"{self.mods['torch']}.backends.cuda.matmul.allow_tf32",
            num_warps=self.spec.num_warps,
            num_stages=self.spec.num_stages,
            wide=self.names.wide,
            int64_offsets=self.mods["int64_offsets"],
            **self.common,
        )

    def _persistent_launch(self, local: dict[str, str], namer: Namer) -> dict[str, object]:
        """What the launcher needs to pick the persistent variant and size its blocks
        (``local``: loop variable -> the launcher's local holding its block size)."""
        extents: dict[str, str] = {}
        for s in self.kernel_nest.inner_loops:  # (persistent_ok: one range per variable)
            bounds = self.names.bounds[s.loop]
            extents.setdefault(s.loop.var, _iterations(bounds, s.loop.step, self.mods["triton"]))
        widest = [local[v] for v in extents]
        row_elements = widest[0] if len(widest) == 1 else f"max({', '.join(widest)})"
        grid = [local[g.var] for g in self.nest.grid]
        flag, warps = namer("persistent"), namer("warps")
        # the looped variant's block sizes and warps: ``targets = values`` in the launcher
        targets = [*local.values(), warps]
        defaults = ", ".join(str(v) for v in [*self.spec.tile.values(), self.spec.num_warps])
        knob = self.fns["persistent_max"]
        test = " and ".join(f"{e} <= {knob}" for e in extents.values())
        return {
            "knob": self.fns["persistent_max"],
            "max": PERSISTENT_MAX,
            "tile": PERSISTENT_TILE,
            "max_rows": PERSISTENT_ROWS,
            "flag": self.persistent,
            "flag_local": flag,
            "warps": warps,
            "targets": targets,
            "defaults": parse(defaults),
            "test": parse(test),
            "room": namer("room"),
            "rows": [{"local": local[v], "extent": parse(e)} for v, e in extents.items()],
            "row_elements": parse(row_elements),
            "tile_elements": parse(" * ".join([*grid, row_elements])),
            "grid": [{"local": g} for g in reversed(grid)],  # the last axis shrinks first
        }

    def _dot_operands(self) -> list[str]:
        """The tensors a tl.dot reads in their own dtype (both plain loads), else none."""
        dot = self.kernel_nest.dot
        if dot is None or not (isinstance(dot.left, Load) and isinstance(dot.right, Load)):
            return []
        pair = [dot.left.tensor_name, dot.right.tensor_name]
        return pair if pair[0] != pair[1] else []

    def torch_path(self) -> str:
        if self.attention is not None:  # eager softmax attention (flash_output.py)
            return self.attention.torch_path()
        torch = self.mods["torch"]
        shared = sharing(self.nest, self.names, torch)
        names = self.names.fork()
        steps = TorchEmitter(self.nest, names, torch, shared).steps()
        blocks = row_blocks(self.nest, names)
        # half-precision inputs are read in float32 (outputs cast back when stored)
        read = {ld.tensor_name for st in _flat(self.nest.body) for ld in loads_in(st.value)}
        widen = [
            t
            for t, _ in self.nest.tensors
            if t in read and t not in self.nest.outputs and t not in self.nest.index_tensors
        ]
        return render(
            "tile_torch.py.j2",
            steps=steps,
            widen=widen,
            blocks=blocks,
            block_elements=BLOCK_ELEMENTS,
            min_rows=MIN_BLOCK_ROWS,
            torch=self.mods["torch"],
            **self.common,
        )

    def function(self) -> cst.FunctionDef:
        """The user's function, same signature, its body replaced by the dispatch."""
        fn = self.site.node
        assert isinstance(fn, cst.FunctionDef)
        body = render_statements(
            "tile_dispatch.py.j2",
            use_triton=self.mods.get("use_triton", ""),
            first=self.first,
            params=self.nest.params,
            launcher=self.fns.get("launcher", ""),
            torch_fn=self.fns["torch_fn"],
            autograd=self.fns.get("autograd", ""),
            torch=self.mods["torch"],
            tensors=[t for t, _ in self.nest.tensors],
        )
        docstring = [s for s in _block(fn)[:1] if is_docstring(s)]
        return fn.with_changes(body=cst.IndentedBlock([*docstring, *body]))


def _block(fn: cst.FunctionDef) -> list[cst.BaseStatement]:
    return list(fn.body.body) if isinstance(fn.body, cst.IndentedBlock) else []


def _iterations(b: LoopBounds, step: int, triton: str) -> str:
    """The number of iterations of a loop, as launcher code."""
    span = f"max({b.hi} - {b.lo}, 0)"
    return span if step == 1 else f"{triton}.cdiv({span}, {step})"
