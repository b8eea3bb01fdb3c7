"""Random elementwise and row-reduction bodies: the torch path equals the loop (hypothesis).

Expressions mix loads with every broadcasting pattern of a 2-loop nest
(``x[i, j]``, ``r[j]``, ``c[i]``), offsets, a scalar argument, numbers,
arithmetic, comparisons, ``torch.where``, ``min``/``max`` and the unary
functions, so that operator precedence, broadcasting and scalar/tensor
mixing in the emitted code are all exercised.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.macros.tile_cases import LEAVES, body_case, compare, modules


def _expressions(depth: int):
    leaf = st.sampled_from(LEAVES)
    if depth == 0:
        return leaf
    sub = _expressions(depth - 1)
    return st.one_of(
        leaf,
        st.tuples(sub, st.sampled_from(["+", "-", "*"]), sub).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"
        ),
        # torch functions take tensors (as in the loop): each argument gets a load
        st.tuples(sub, sub).map(lambda t: f"{t[0]} / (1.0 + torch.abs({t[1]} + r[j]))"),
        st.tuples(st.sampled_from(["torch.tanh", "torch.sigmoid", "torch.abs"]), sub).map(
            lambda t: f"{t[0]}({t[1]} - c[i])"
        ),
        st.tuples(sub, sub, sub).map(lambda t: f"torch.where({t[0]} > x[i, j], {t[1]}, {t[2]})"),
        st.tuples(st.sampled_from(["max", "min"]), sub, sub).map(
            lambda t: f"{t[0]}({t[1]}, {t[2]})"
        ),
        sub.map(lambda e: f"({e}) ** 2"),
    )


def _is_tensor(expr: str) -> bool:
    return "[" in expr  # every leaf that is a tensor is a load


@pytest.mark.slow  # many random bodies, each expanded and run
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(expr=_expressions(3), reduce=st.sampled_from([None, "sum", "max"]))
def test_torch_path_equals_the_loop(expr: str, reduce: str | None, tmp_path_factory) -> None:
    if reduce is not None and "j" not in expr:
        expr = f"{expr} + x[i, j]"  # a reduction over j must depend on j
    if not _is_tensor(expr):
        expr = f"{expr} + r[j]"
    case = body_case(expr, reduce)
    reference, expanded = modules(case, tmp_path_factory.mktemp(case.name))
    message = compare(case, reference, getattr(expanded, f"_{case.name}_torch"))
    assert message is None, f"{message}\n{expr}"
