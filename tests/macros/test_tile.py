"""@tile: what the expansion looks like, its arguments, its refusals and its run-time checks.

Numerical parity with the unexpanded loop is in test_tile_parity.py; the full
generated code of several nests is pinned by tests/golden/tile_*.
"""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch

from macrogen.expand import expand_source
from macrogen.macros.tile import USAGE
from tests.helpers import expansion_errors, load_module, strip_header
from tests.macros.tile_cases import CASES, compare, modules

SCALE = """
import torch
import macrogen as mg


@mg.tile(i=128)
def scale(out, x, *, alpha=2.0):
    \"\"\"out = alpha * x\"\"\"
    (N,) = x.shape
    for i in range(N):
        out[i] = alpha * x[i]
"""


def _expand(source: str, **options) -> str:
    return expand_source(textwrap.dedent(source), path="test.py", **options).code


def test_the_function_keeps_its_signature_and_dispatches_by_device() -> None:
    code = strip_header(_expand(SCALE))
    site = code[code.index("# macrogen: tile at test.py:6") :]
    assert site == textwrap.dedent(
        '''\
        # macrogen: tile at test.py:6
        def scale(out, x, *, alpha=2.0):
            """out = alpha * x"""
            if use_triton(out.device):
                _scale_triton(out, x, alpha)
            else:
                _scale_torch(out, x, alpha)
        '''
    )
    for helper in (
        "def _scale_shapes(",
        "def _scale_kernel(",
        "def _scale_triton(",
        "def _scale_torch(",
    ):
        assert helper in code


def test_the_cpu_path_writes_in_place_and_is_not_a_loop(tmp_path) -> None:
    module = load_module(_expand(SCALE), "tile_scale", tmp_path)
    x = torch.randn(1000)
    out = torch.full((1000,), float("nan"))
    keep = out
    assert module.scale(out, x) is None
    assert out is keep
    torch.testing.assert_close(out, 2.0 * x)
    module.scale(out, x, alpha=-1.0)
    torch.testing.assert_close(out, -x)
    torch_path = _expand(SCALE).split("def _scale_torch(")[1].split("\ndef ")[0]
    # Not a loop over elements: the one loop walks blocks of rows (cache-sized passes).
    loops = [line.strip() for line in torch_path.splitlines() if "for " in line]
    assert loops == ["for i_lo in range(i_first, i_last, rows):"]


@pytest.mark.parametrize(
    "name, dtypes",
    [
        ("softmax", (("x", torch.float64),)),  # not the default dtype: no in-place temporaries
        ("attention", tuple((t, torch.float64) for t in ("q", "kk", "v"))),
        ("bias_gelu", (("x", torch.float64),)),  # mixed inputs: float64 results
        ("row_sum_max", (("total", torch.float64), ("biggest", torch.float16))),  # no out=
        ("matmul", (("out", torch.float64),)),  # no addmm_: the dtypes differ
    ],
)
def test_the_cpu_path_keeps_its_dtypes_where_the_fast_forms_cannot(
    name: str, dtypes: tuple, tmp_path
) -> None:
    """The in-place, out= and addmm_ forms need agreeing dtypes; else the plain forms run."""
    case = dataclasses.replace(next(c for c in CASES if c.name == name), dtypes=dtypes)
    reference, expanded = modules(case, tmp_path)
    assert compare(case, reference, getattr(expanded, f"_{name}_torch")) is None


def test_in_place_overwrites_only_dead_temporaries_of_their_own() -> None:
    """t - m becomes t.sub_(m) only where t is a floating temporary nothing reads later,
    that no live local shares, and m fits in t's shape; views of arguments never."""
    from macrogen.macros.tile.code import parse
    from macrogen.macros.tile.steps import Assign, TorchStore
    from macrogen.macros.tile.torch_path import Meta, in_place

    ij, i = frozenset("ij"), frozenset("i")
    meta = {n: Meta(ij, True) for n in ("t", "u", "big")} | {"m": Meta(i, True)}
    meta["b"] = Meta(ij, False)  # a comparison: bool

    def run(*lines: str) -> list[str]:
        steps = []
        for line in lines:
            target, value = line.split(" = ")
            if target.startswith("out"):
                steps.append(TorchStore(parse(target), parse(value), False))
            else:
                steps.append(Assign(target, parse(value)))
        out = in_place(steps, meta, "torch", "ok")
        return [s.value.text for s in out if isinstance(s, Assign)]  # (steps hold text)

    view = "x[i_lo:i_hi, j_lo:j_hi]"
    assert run(f"x_ij = {view}", "t = x_ij * 2.0", "u = t - m", "out[0] = u")[2] == (
        "t.sub_(m) if ok else t - m"
    )
    assert run(f"x_ij = {view}", "u = x_ij - m", "out[0] = u")[1] == "x_ij - m"  # a view
    assert run(f"x_ij = {view}", "t = x_ij * 2.0", "u = t - m", "out[0] = u + t")[2] == "t - m"
    # an alias of t still read afterwards keeps t
    lines = (f"x_ij = {view}", "t = x_ij * 2.0", "s = t", "u = t - m", "out[0] = u + s")
    assert run(*lines)[3] == "t - m"
    # m's shape is smaller than t's: m - t would need a bigger buffer than m's
    assert (
        run(
            f"x_ij = {view}",
            "t = x_ij * 2.0",
            "m = t.amax(dim=1, keepdim=True)",
            "u = m - t",
            "out[0] = u",
        )[3]
        == "m - t"
    )
    assert run(f"x_ij = {view}", "b = x_ij > 0", "u = b * 2.0", "out[0] = u")[2] == "b * 2.0"
    assert run(f"x_ij = {view}", "t = x_ij * 2.0", "u = torch.exp(t)", "out[0] = u")[2] == (
        "t.exp_() if ok else torch.exp(t)"
    )


def test_target_cpu_generates_no_kernel(tmp_path) -> None:
    code = _expand(SCALE, target="cpu")
    assert "triton" not in code and "_scale_kernel" not in code
    assert "    _scale_torch(out, x, alpha)\n" in code
    module = load_module(code, "tile_scale_cpu", tmp_path)
    x, out = torch.randn(5), torch.empty(5)
    module.scale(out, x, alpha=3.0)
    torch.testing.assert_close(out, 3.0 * x)


def test_tile_sizes_and_launch_options_reach_the_kernel() -> None:
    code = _expand(
        """
        import macrogen as mg

        @mg.tile(i=16, j=64, num_warps=8, num_stages=3)
        def add(out, x, y):
            M, N = x.shape
            for i in range(M):
                for j in range(N):
                    out[i, j] = x[i, j] + y[i, j]
        """
    )
    assert "BLOCK_I=16," in code and "BLOCK_J=64," in code
    assert "num_warps=8," in code and "num_stages=3," in code
    assert "BLOCK_I: tl.constexpr," in code


def test_tunable_tiles_are_recorded_and_tuning_picks_them() -> None:
    source = """
    import macrogen as mg

    BLOCK = mg.tunable(64, choices=[32, 64, 128])

    @mg.tile(i=BLOCK, num_warps=mg.tunable(4, choices=[2, 4, 8]))
    def copy(out, x):
        (N,) = x.shape
        for i in range(N):
            out[i] = x[i]
    """
    result = expand_source(textwrap.dedent(source), path="test.py")
    assert set(result.tunables) == {"BLOCK", "copy.num_warps"}
    assert "BLOCK_I=64," in result.code and "num_warps=4," in result.code
    tuned = _expand(source, tuning={"BLOCK": 128, "copy.num_warps": 8})
    assert "BLOCK_I=128," in tuned and "num_warps=8," in tuned


def test_matmul_shape_becomes_tl_dot_only_with_tiles_of_16_or_more() -> None:
    source = """
    import macrogen as mg

    @mg.tile(i={t}, j=32, k=32)
    def mm(out, a, b):
        M, K = a.shape
        N = b.shape[1]
        for i in range(M):
            for j in range(N):
                for k in range(K):
                    out[i, j] += a[i, k] * b[k, j]
    """
    assert "tl.dot(a_ik, b_kj, out_acc_tile, input_precision=DOT_PRECISION)" in _expand(
        source.format(t=32)
    )
    small = _expand(source.format(t=8))
    assert "tl.dot" not in small and "tl.sum(out_acc_tile, axis=2, keep_dims=True)" in small
    # The torch path of a matmul-shaped reduction is a matmul, not a broadcast product:
    # out += a @ b accumulates in place (addmm_) where the dtypes allow it.
    assert ".addmm_(a_ik, b_kj) if out.dtype == a_ik.dtype == b_kj.dtype" in small
    assert ".add_(a_ik @ b_kj)" in small


def test_expansion_is_deterministic() -> None:
    assert _expand(SCALE) == _expand(SCALE)


def test_shapes_and_index_ranges_are_checked_at_run_time(tmp_path) -> None:
    module = load_module(
        _expand(
            """
            import macrogen as mg

            @mg.tile(i=32, j=32)
            def shift(out, x, b):
                M, N = x.shape
                for i in range(M):
                    for j in range(N - 1):
                        out[i, j] = x[i, j + 1] + b[j]
            """
        ),
        "tile_shift",
        tmp_path,
    )
    x, out, b = torch.randn(5, 7), torch.zeros(5, 6), torch.randn(6)
    module.shift(out, x, b)
    torch.testing.assert_close(out, x[:, 1:] + b)
    with pytest.raises(IndexError, match="b: index j leaves dimension 0"):
        module.shift(out, x, torch.randn(5))
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        module.shift(out, torch.randn(5), b)


def test_an_index_that_python_would_wrap_is_an_expansion_error() -> None:
    """out[i] = x[i - 1] over range(M) reads x[-1] at i = 0, which Python wraps to the last
    element; the tiled versions cannot: refused at the index, never a silent difference."""
    source = """
    import macrogen as mg

    @mg.tile(i=32)
    def shift(out, x):
        (M,) = x.shape
        for i in range(M):
            out[i] = x[i - 1]
    """
    (error,) = expansion_errors(textwrap.dedent(source))
    assert error.startswith("test.py:8:20: error: x[i - 1] reads index -1 of dimension 0 of x")
    assert "Python counts a negative index from the end" in error and "start the loop at 1" in error
    # from 1 on, the same read is inside the dimension: it expands and matches the loop
    assert "def _shift_kernel" in _expand(source.replace("range(M)", "range(1, M)"))


def test_an_index_past_the_end_of_its_loops_size_is_an_expansion_error() -> None:
    """x[i + 1] with i up to x.shape[0] - 1: the loop raises IndexError at its last i."""
    source = """
    import macrogen as mg

    @mg.tile(i=32, j=32)
    def diff(out, x):
        M, N = x.shape
        for i in range(M):
            for j in range(1, x.shape[1]):
                out[i, j] = x[i, j + 1] - x[i, j - 1]
    """
    (error,) = expansion_errors(textwrap.dedent(source))
    assert "x[i, j + 1] reads past the end of dimension 1 of x at the last j (j = N - 1)" in error
    assert "stop the loop 1 earlier" in error
    assert "def _diff_kernel" in _expand(source.replace("x.shape[1]", "x.shape[1] - 1"))


def test_a_start_known_at_run_time_is_checked_for_negative_indices_there(tmp_path) -> None:
    module = load_module(
        _expand(
            """
            import macrogen as mg

            @mg.tile(i=32)
            def shift(out, x, lo):
                (M,) = x.shape
                for i in range(lo, M):
                    out[i] = x[i - 1]
            """
        ),
        "tile_shift_from",
        tmp_path,
    )
    x, out = torch.randn(6), torch.full((6,), float("nan"))
    module.shift(out, x, 1)
    torch.testing.assert_close(out[1:], x[:-1])
    with pytest.raises(ValueError, match="index i - 1 of x is negative for some i in its range"):
        module.shift(out, x, 0)  # the loop would read x[-1]: refused, not read as x[0] or junk


def test_outputs_that_share_memory_with_inputs_are_refused(tmp_path) -> None:
    module = load_module(_expand(SCALE), "tile_scale_alias", tmp_path)
    x = torch.randn(8)
    with pytest.raises(ValueError, match="out and x share memory"):
        module.scale(x, x)
    with pytest.raises(ValueError, match="out and x share memory"):
        module.scale(x[:4], x[4:])


def test_launcher_refuses_cpu_tensors_outside_the_interpreter(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    module = load_module(_expand(SCALE), "tile_scale_launch", tmp_path)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        module._scale_triton(torch.zeros(4), torch.zeros(4), 1.0)


def test_benchmark_bandwidth_passes_copy_source_positionally(monkeypatch) -> None:
    """copy_'s argument name differs across torch versions: the benchmark must not name it."""
    import bench.tile

    monkeypatch.setattr(bench.tile, "do_bench", lambda fn, args: (fn(**args), 1e-3)[1])
    assert bench.tile.measured_bandwidth("cpu", 1024) > 0


def test_an_empty_range_writes_nothing_even_where_a_slice_would_wrap(tmp_path) -> None:
    """range(2, n) with n < 2 and range(0, N - 1, 2) with N = 0 are empty; x[2:-1] is not."""
    source = """
    import torch
    import macrogen as mg


    @mg.tile(i=4)
    def copy_from(out, x, n):
        for i in range(2, n):
            out[i] = x[i]


    @mg.tile(i=4)
    def every_other(out, x, like):
        (N,) = like.shape
        for i in range(0, N - 1, 2):
            out[i] = x[i]
    """
    module = load_module(_expand(source), "tile_empty_ranges", tmp_path)
    out, x = torch.full((6,), float("nan")), torch.randn(6)
    module.copy_from(out, x, -1)
    module.every_other(out, x, torch.zeros(0))
    assert out.isnan().all()
    module.copy_from(out, x, 5)
    module.every_other(out, x, torch.zeros(6))
    assert torch.equal(out[[0, 2, 3, 4]], x[[0, 2, 3, 4]]) and out[[1, 5]].isnan().all()


def test_gathered_indices_are_checked_like_the_loop_would(tmp_path, monkeypatch) -> None:
    source = """
    import torch
    import macrogen as mg


    @mg.tile(i=4)
    def embed(out, table, idx):
        (N,) = idx.shape
        for i in range(N):
            out[i] = table[idx[i]]
    """
    module = load_module(_expand(source), "tile_embed_checks", tmp_path)
    table, out = torch.randn(5), torch.full((3,), float("nan"))
    module.embed(out, table, torch.tensor([4, 0, 2]))
    assert torch.equal(out, table[[4, 0, 2]])
    with pytest.raises(IndexError, match="an index read from idx leaves dimension 0"):
        module.embed(out, table, torch.tensor([0, 5, 1]))  # the loop raises IndexError too
    with pytest.raises(ValueError, match="an index read from idx is negative: Python counts it"):
        module.embed(out, table, torch.tensor([0, -1, 1]))  # the loop would read table[-1]
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check, to the dtype checks
    with pytest.raises(ValueError, match="idx indexes other tensors: it must be an int32 or int64"):
        module._embed_triton(out, table, torch.tensor([0.0, 1.0, 2.0]))


def test_fp32_matmul_uses_tf32_only_where_torch_or_the_macro_allows_it() -> None:
    source = """
    import torch
    import macrogen as mg


    @mg.tile(i=32, j=32, k=32{extra})
    def mm(out, a, b):
        M, K = a.shape
        _, N = b.shape
        for i in range(M):
            for j in range(N):
                for k in range(K):
                    out[i, j] += a[i, k] * b[k, j]
    """
    code = _expand(source.format(extra=""))
    assert 'DOT_PRECISION="tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"' in code
    assert "GROUP_SIZE=8," in code and "first_row = pid // in_group * GROUP_SIZE" in code
    code = _expand(source.format(extra=", dot_precision='tf32x3', group_size=1"))
    assert "DOT_PRECISION='tf32x3'," in code and "GROUP_SIZE" not in code


def _errors(body: str, decorator: str = "@mg.tile(i=64, j=64)") -> list[str]:
    source = "import torch\nimport macrogen as mg\n\n" + decorator + "\n" + textwrap.dedent(body)
    return expansion_errors(source)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    for j in range(N):
                        out[i, j] = x[i, j] if x[i, j] > 0 else 0.0
            """,
            "test.py:10:25: error: conditional expressions are not supported; use torch.where",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    for j in range(N):
                        out[i, j] = (x[i, j] > 0) and (x[i, j] < 1)
            """,
            "and/or are not supported on tensors",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    for j in range(N):
                        out[i, j] = x[i, j] // 2
            """,
            "operator // is not supported",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    for j in range(N):
                        out[i, j] = x[i, -1]
            """,
            "a tensor index is a loop variable",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    for j in range(N):
                        out[i, j] = x[i, 1:]
            """,
            "slices are not supported",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    for j in range(N):
                        out[i, j] = x * 2
            """,
            "tensor 'x' must be indexed",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    for j in range(N):
                        out[i, j] = x[i, j] * scale
            """,
            "'scale' is not a parameter, size, local or define()d number",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    for j in range(N):
                        out[i, j] = x[i, j] * k
            """,
            "'k' is not a parameter, size, local or define()d number",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    for j in range(N):
                        out[i, j] = x[i, j]
                        out[i, j] += 1.0
            """,
            "'out' is stored more than once",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    s = 0.0
                    for j in range(N):
                        t = x[i, j]
                        s += t
                    out[i] = s + t
            """,
            "'t' is assigned inside the loop over j; its value is not available after the loop",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    s = 0.0
                    for j in range(N):
                        s += 1.0
                    out[i] = s
            """,
            "the value reduced into 's' does not depend on 'j'",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    for j in range(N):
                        for k in range(N):
                            out[i, j] = x[i, k]
            """,
            "this store does not index 'k'",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    s = 0.0
                    for j in range(N):
                        for k in range(N):
                            s += x[j, k]
                    out[i] = s
            """,
            "'s' is defined outside the loop over j and reduced in the loop over k inside it",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    c = x[i, 0]
                    for j in range(N):
                        for k in range(N):
                            t = 0.0
                            for l in range(N):
                                t += x[k, l]
                            out[i, j] += t * c
            """,
            "at most two levels of inner loops",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    m = 0.0
                    s = 0.0
                    for j in range(N):
                        m_new = max(m, x[i, j])
                        s = s * torch.exp(m - m_new) + torch.exp(x[i, j] - m_new)
                        m = m_new
                    out[i] = s
            """,
            "an online softmax starts from m = float('-inf') and s = 0.0",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    m = float("-inf")
                    s = 0.0
                    for j in range(N):
                        m_new = max(m, x[i, j])
                        s = s * torch.exp(m_new - m) + torch.exp(x[i, j] - m_new)
                        m = m_new
                    out[i] = s
            """,
            "'m' is read inside the loop that reduces into it",
        ),
        (
            """
            async def f(out, x):
                M, N = x.shape
                for i in range(M):
                    for j in range(N):
                        out[i, j] = x[i, j]
            """,
            "@tile functions can't be async",
        ),
        (
            """
            def f(out, x, *rest):
                M, N = x.shape
                for i in range(M):
                    for j in range(N):
                        out[i, j] = x[i, j]
            """,
            "named parameters only",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    for j in range(N):
                        out[i, j] = x[i, j] ** 5
            """,
            "** takes an integer power 2, 3 or 4",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    for j in range(N):
                        out[i, j] = x[i, j]
                    else:
                        pass
            """,
            "for ... else is not supported",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    for i2 in range(N):
                        out[i, i2] = x[i, i2]
                return out
            """,
            "nothing may follow the loop nest",
        ),
        (
            """
            def f(out, x, idx):
                for i in range(idx[0]):
                    out[i] = x[i]
            """,
            "a loop bound may not depend on tensor values",
        ),
        (
            """
            def f(out, x):
                for i in range(x.shape[-1]):
                    out[i] = x[i]
            """,
            "a loop bound is a size (N from .shape, x.shape[d], x.size(d), len(x))",
        ),
        (
            """
            def f(out, x, idx, perm):
                for i in range(len(x)):
                    out[i] = x[idx[perm[i]]]
            """,
            "data-dependent indexing is supported one level deep",
        ),
        (
            """
            def f(out, x, idx):
                for i in range(len(x)):
                    out[i] = x[idx[i]] + idx[i]
            """,
            "'idx' is read both as an index (integers) and as a value",
        ),
        (
            """
            def f(out, x):
                (N,) = x.shape
                for i in range(N):
                    if not x[i] > 0:
                        out[i] = x[i]
            """,
            "not is not supported in an @tile if; swap the branches",
        ),
        (
            """
            def f(out, x):
                M, N = x.shape
                for i in range(M):
                    if x[i, 0] > 0:
                        for j in range(N):
                            out[i, j] = x[i, j]
            """,
            "a loop inside an if is not supported in @tile",
        ),
        (
            """
            def f(out, x):
                (N,) = x.shape
                for i in range(N):
                    if x[i] > 0:
                        v = x[i]
                    out[i] = v
            """,
            "'v' is assigned in only some branches of the if above",
        ),
        (
            """
            def f(out, x):
                (N,) = x.shape
                for i in range(N):
                    if x[i] > 0:
                        out[i] = x[i]
                    else:
                        out[i] += x[i]
            """,
            "store 'out' the same way (same indices, = or +=) in every branch",
        ),
    ],
)
def test_unsupported_constructs_are_errors_at_their_position(body: str, message: str) -> None:
    errors = _errors(body)
    assert len(errors) == 1 and message in errors[0], errors


@pytest.mark.parametrize(
    ("decorator", "message"),
    [
        (
            "@mg.tile(i=64, j=64, num_warps=3)",
            "num_warps must be a power of two from 1 to 32, not 3",
        ),
        ("@mg.tile(i=64, j=64, num_stages=0)", "num_stages must be an integer from 1 to 8, not 0"),
        (
            "@mg.tile(i=64, j=64, dot_precision='fast')",
            "dot_precision must be one of 'torch', 'ieee', 'tf32', 'tf32x3'",
        ),
        ("@mg.tile(i=2048, j=1024)", "a tile of 2048x1024 elements is more than Triton's 1048576"),
        ("@mg.tile(i=64, j=0)", "the tile size of 'j' must be a power of two, not 0"),
        ("@mg.tile(i=64, j='64')", "the tile size of 'j' must be a power of two, not '64'"),
    ],
)
def test_bad_arguments_are_errors(decorator: str, message: str) -> None:
    body = """
    def f(out, x):
        M, N = x.shape
        for i in range(M):
            for j in range(N):
                out[i, j] = x[i, j]
    """
    errors = _errors(body, decorator)
    assert len(errors) == 1 and message in errors[0], errors


def test_tile_on_a_class_is_an_error() -> None:
    errors = _errors("class C:\n    pass\n", "@mg.tile(i=64)")
    assert errors == ["test.py:4:2: error: tile() decorates a function, not a class: " + USAGE]


def test_int64_offsets_are_chosen_from_sizes_and_strides_alone() -> None:
    """The launcher's INDEX_64: a tensor whose farthest element is past int32 offsets.

    Meta tensors and broadcast views have sizes and strides but no memory, so
    no 2^31-element tensor is allocated here.
    """
    from macrogen.runtime.triton_support import int64_offsets

    small = torch.empty(37, 53)
    assert not int64_offsets(small, small.t())
    assert not int64_offsets(torch.empty(2**31, device="meta"))  # last offset 2^31 - 1
    assert int64_offsets(small, torch.empty(2**31 + 1, device="meta"))
    assert int64_offsets(torch.empty(2**16, 2**15 + 1, device="meta"))
    wide_rows = torch.empty(3, 2**30, device="meta")
    assert int64_offsets(wide_rows[:, :2])  # a narrow view of a wide tensor: stride 2^30
    assert not int64_offsets(torch.zeros(1).expand(2**33))  # every element at offset 0
    assert not int64_offsets(torch.empty(0, 2**40, device="meta"))  # nothing to address


def test_launcher_takes_mixed_float_dtypes_except_for_a_dots_operands(
    tmp_path, monkeypatch
) -> None:
    source = """
    import torch
    import macrogen as mg


    @mg.tile(i=16, j=16, k=16)
    def mm(out, a, b):
        M, K = a.shape
        _, N = b.shape
        for i in range(M):
            for j in range(N):
                for k in range(K):
                    out[i, j] += a[i, k] * b[k, j]
    """
    module = load_module(_expand(source), "tile_mixed_dtypes", tmp_path)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check, to the dtype checks
    out = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="the operands of a tl.dot must have one dtype: a and b"):
        module._mm_triton(out, torch.ones(4, 4, dtype=torch.float16), torch.ones(4, 4))
    with pytest.raises(ValueError, match="b must be a float16, bfloat16 or float32 tensor"):
        module._mm_triton(out, torch.ones(4, 4), torch.ones(4, 4, dtype=torch.float64))
