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
``tunable``), ``num_warps=4``, ``num_stages=2`` and ``dot_precision="ieee"``
(``tl.dot``'s input precision for matmul-shaped reductions: "ieee", "tf32" or
"tf32x3"). The accepted loop nests, with examples: docs/tile.md.

Where the rest lives: tile_analysis.py recognises the subset and builds the
IR (tile_ir.py); tile_emit.py turns the IR into kernel and torch code;
templates/tile_*.py.j2 lay the generated functions out.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import libcst as cst

from macrogen import codegen
from macrogen.expand.context import Context
from macrogen.expand.errors import MacroError
from macrogen.expand.site import Site
from macrogen.macros.tile_analysis import analyze
from macrogen.macros.tile_emit import (
    KernelEmitter,
    Names,
    TorchEmitter,
    loads_in,
    make_names,
    parse,
)
from macrogen.macros.tile_ir import Accum, InnerLoop, Let, Nest, Store

FORMS = ("decorator",)
USAGE = "@tile(i=64, j=64) decorates a function whose body is a loop nest over range(...)"

OPTIONS = {"num_warps": 4, "num_stages": 2, "dot_precision": "ieee"}
DOT_PRECISIONS = ("ieee", "tf32", "tf32x3")
MAX_TILE_ELEMENTS = 1 << 20  # Triton's limit on the elements of one block
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Spec:
    nest: Nest
    tiles: tuple[tuple[str, int], ...]  # loop variable -> tile size
    num_warps: int  # warps per program on the GPU
    num_stages: int  # software-pipelining depth of the kernel's loops
    dot_precision: str  # tl.dot input precision; "ieee" matches the fp32 loop

    @property
    def tile(self) -> dict[str, int]:
        return dict(self.tiles)


def default_tile(nest: Nest) -> int:
    """About a thousand elements per tile: 1024, 32x32, 16x16x16 (32 each for a tl.dot)."""
    if nest.dot is not None:
        return 32
    return {1: 1024, 2: 32, 3: 16}[nest.rank]


def validate(site: Site, ctx: Context) -> Spec:
    fn = site.original  # the source's nodes, so that errors point into the file
    if not isinstance(fn, cst.FunctionDef):
        raise MacroError(
            f"tile() decorates a function, not a class: {USAGE}", site.call or site.original
        )
    nest = analyze(fn, ctx.constants)
    variables = list(
        dict.fromkeys([g.var for g in nest.grid] + [s.loop.var for s in nest.inner_loops])
    )
    for var in variables:
        if var in OPTIONS:
            raise MacroError(
                f"name the loop variable something other than {var!r}: it is a tile() option",
                site.original,
            )
    default = default_tile(nest)
    args = site.args.bind({**{v: default for v in variables}, **OPTIONS})
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
    kernel = kernel_nest(nest, tiles)
    shape = [tiles[g.var] for g in kernel.grid] + (
        [max(tiles[s.loop.var] for s in kernel.inner_loops)] if kernel.inner_axis else []
    )
    if math.prod(shape) > MAX_TILE_ELEMENTS:
        raise MacroError(
            f"a tile of {'x'.join(map(str, shape))} elements is more than Triton's {MAX_TILE_ELEMENTS}; use smaller tiles",
            site.call or site.original,
        )
    return Spec(nest, tuple(tiles.items()), num_warps, num_stages, precision)


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


def expand(site: Site, ctx: Context) -> cst.FunctionDef:
    spec = validate(site, ctx)
    nest = spec.nest
    fn = site.node
    assert isinstance(fn, cst.FunctionDef)
    triton = ctx.import_from("macrogen.runtime.triton_support", "triton")
    tl = ctx.import_from("macrogen.runtime.triton_support", "tl")
    use_triton = ctx.import_from("macrogen.runtime.triton_support", "use_triton")
    interpreting = ctx.import_from("macrogen.runtime.triton_support", "interpreting")
    torch = ctx.import_module("torch")
    taken = set(_IDENT.findall(cst.Module([]).code_for_node(site.original)))
    taken |= {triton, tl, use_triton, interpreting, torch}
    names = make_names(nest, taken)
    base = nest.name.strip("_") or "tile"
    fns = {
        "shapes": ctx.names.fresh(f"_{base}_shapes"),
        "kernel": ctx.names.fresh(f"_{base}_kernel"),
        "launcher": ctx.names.fresh(f"_{base}_triton"),
        "torch_fn": ctx.names.fresh(f"_{base}_torch"),
    }
    location = ctx.location(site.line)
    tensors = [
        {
            "name": t,
            "ndim": ndim,
            "ptr": names.ptr[t],
            "strides": names.strides[t],
            "message": f"{t} must have {ndim} dimension{'s' if ndim != 1 else ''} (it is indexed so), not %d",
            "same_message": f"{t} must be on the same device and of the same dtype as {nest.tensors[0][0]}",
        }
        for t, ndim in nest.tensors
    ]
    if not tensors:
        raise MacroError("an @tile function needs at least one tensor parameter", fn.params)
    bounds = list(dict.fromkeys(names.bounds.values()))
    results = [s.name for s in nest.sizes] + [x for b in bounds for x in (b.lo, b.hi)]
    common = {
        "location": location,
        "tensors": tensors,
        "params": nest.params,
        "shapes": fns["shapes"],
        "results": parse(", ".join(results) if len(results) != 1 else f"{results[0]},"),
        **fns,
    }
    ctx.prelude.append(
        codegen.render(
            "tile_shapes.py.j2",
            sizes=nest.sizes,
            bounds=bounds,
            checks=_index_checks(nest, names),
            aliases=[
                {
                    "output": o,
                    "other": t,
                    "message": f"{o} and {t} share memory; @tile needs outputs apart from"
                    " the other tensors (pass a fresh tensor, or a clone)",
                }
                for o in nest.outputs
                for t, _ in nest.tensors
                if t != o
                and not (t in nest.outputs and nest.outputs.index(t) < nest.outputs.index(o))
            ],
            **common,
        )
    )
    pid = names.namer("pid")
    dot_precision = (
        names.namer("DOT_PRECISION") if kernel_nest(nest, spec.tile).dot is not None else ""
    )
    kernel = KernelEmitter(kernel_nest(nest, spec.tile), names.fork(), tl, dot_precision)
    grid = kernel.grid_setup(pid, spec.tile)
    steps = kernel.steps()
    blocks = list(dict.fromkeys(names.block.values()))
    ctx.prelude.append(
        codegen.render(
            "tile_kernel.py.j2",
            triton=triton,
            tl=tl,
            scalars=nest.scalars,
            sizes=[s.name for s in nest.sizes],
            blocks=blocks,
            dot_precision=dot_precision,
            bounds=bounds,
            pid=pid,
            grid=grid,
            steps=steps,
            **common,
        )
    )
    programs = names.namer("programs")
    tiles_code = " * ".join(
        f"{triton}.cdiv(max({names.bounds[g].hi} - {names.bounds[g].lo}, 0), {spec.tile[g.var]})"
        for g in nest.grid
    )
    first = nest.tensors[0][0]
    ctx.prelude.append(
        codegen.render(
            "tile_launcher.py.j2",
            torch=torch,
            interpreting=interpreting,
            first=first,
            device_message=f"{fns['launcher']} runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), not ",
            dtype_message=f"{fns['launcher']} takes float16, bfloat16 or float32 tensors, not ",
            programs=programs,
            programs_code=parse(tiles_code),
            scalars=nest.scalars,
            sizes=[s.name for s in nest.sizes],
            blocks=[{"name": names.block[v], "value": spec.tile[v]} for v in names.block],
            dot_precision=dot_precision,
            dot_precision_value=spec.dot_precision,
            num_warps=spec.num_warps,
            num_stages=spec.num_stages,
            **common,
        )
    )
    ctx.prelude.append(
        codegen.render(
            "tile_torch.py.j2", steps=TorchEmitter(nest, names.fork(), torch).steps(), **common
        )
    )
    body = codegen.render_statements(
        "tile_dispatch.py.j2",
        use_triton=use_triton,
        first=first,
        params=nest.params,
        launcher=fns["launcher"],
        torch_fn=fns["torch_fn"],
    )
    docstring = [s for s in _block(fn)[:1] if _is_docstring(s)]
    return fn.with_changes(body=cst.IndentedBlock([*docstring, *body]))


def _block(fn: cst.FunctionDef) -> list[cst.BaseStatement]:
    return list(fn.body.body) if isinstance(fn.body, cst.IndentedBlock) else []


def _is_docstring(stmt: cst.BaseStatement) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def _index_checks(nest: Nest, names: Names) -> list[dict]:
    """One range check per distinct (tensor, dimension, loop, offset) the nest indexes with."""
    accesses: dict[tuple, None] = {}
    loops = {g.var: g for g in nest.grid}

    def visit(stmts, inner=None) -> None:
        for s in stmts:
            if isinstance(s, InnerLoop):
                visit(s.body, s.loop)
                continue
            scope = {**loops, **({inner.var: inner} if inner else {})}
            if isinstance(s, (Let, Accum, Store)):
                for ld in loads_in(s.value):
                    for d, ix in enumerate(ld.index):
                        accesses[
                            (
                                ld.tensor_name,
                                d,
                                scope.get(ix.var) if ix.var else None,
                                ix.offset,
                                ix.var,
                            )
                        ] = None
            if isinstance(s, Store):
                for d, var in enumerate(s.index):
                    accesses[(s.tensor_name, d, scope[var], 0, var)] = None

    visit(nest.body)
    checks = []
    for tensor, d, loop, offset, var in accesses:
        size = f"{tensor}.shape[{d}]"
        if loop is None:
            checks.append(
                {
                    "test": parse(f"{offset} >= {size}"),
                    "message": f"index {offset} is out of range for dimension {d} of {tensor}",
                }
            )
            continue
        b = names.bounds[loop]
        term = var if offset == 0 else f"{var} {'+' if offset > 0 else '-'} {abs(offset)}"
        checks.append(
            {
                "test": parse(
                    f"{b.lo} < {b.hi} and ({_plus(b.lo, offset)} < 0 or {_plus(b.hi, offset)} > {size})"
                ),
                "message": f"{tensor}: index {term} leaves dimension {d} for some {var} in its range"
                " (the loop would raise IndexError; negative indices do not wrap here)",
            }
        )
    return checks


def _plus(code: str, offset: int) -> str:
    return code if offset == 0 else f"{code} {'+' if offset > 0 else '-'} {abs(offset)}"
