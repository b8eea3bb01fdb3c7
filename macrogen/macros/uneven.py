"""The arguments of uneven machines, shared by ``mg.parallelize`` and ``@data_parallel``.

``dp_shares`` ("even", "measured" or one share per data rank) cuts each step's global
batch unevenly over the data ranks (``mg.shard``) and weights each rank's gradient by its
rows (``macrogen.runtime.shares``), with ``dp_rebalance_every`` and ``dp_max_rows``;
``pp_split`` ("measured" or one speed per stage) cuts the pipeline's stages by speed
(``macrogen.runtime.pipeline_speeds``). Here: their values' checks and what they go with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from macrogen.macro import Arg, MacroError


def _degree(v: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else "an int >= 1"


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _shares(v: Any) -> str | None:
    fixed = isinstance(v, (list, tuple)) and len(v) > 1 and all(_number(w) for w in v)
    ok = v is None or v in ("even", "measured") or fixed
    return None if ok else '"even", "measured" or one positive share per data rank ([3, 1])'


def _pp_split(v: Any) -> str | None:
    fixed = isinstance(v, (list, tuple)) and len(v) > 1 and all(_number(w) for w in v)
    ok = v is None or v == "measured" or fixed
    return None if ok else '"measured" or one positive speed per stage ([2, 1])'


def _max_rows(v: Any) -> str | None:
    def rows(n: Any) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n >= 1

    ok = v is None or rows(v) or (isinstance(v, (list, tuple)) and v and all(map(rows, v)))
    return None if ok else "None, an int >= 1 or one int >= 1 per data rank"


CHECKS: dict[str, Callable[[Any], str | None]] = {
    "dp_shares": _shares,
    "dp_rebalance_every": _degree,
    "dp_max_rows": _max_rows,
    "pp_split": _pp_split,
}


def check_shares(args: dict[str, Arg], values: dict[str, Any]) -> None:
    """``dp_shares`` splits one global batch per step over the data ranks of a replicated model
    (or a sharded optimizer's), weighting each rank's gradient by its rows."""
    if values["dp_shares"] is None:
        for name in ("dp_rebalance_every", "dp_max_rows"):
            if name in args:
                raise MacroError(
                    f'{name} applies with dp_shares="measured" (or fixed shares)', args[name].node
                )
        return
    node = args["dp_shares"].node
    if values["dp"] not in ("replicate", "zero1"):
        raise MacroError(f'dp_shares takes dp="replicate" or "zero1", not {values["dp"]!r}', node)
    blockers = (
        ("pp", values["pp"] != 1, "pipeline micro-batches"),
        ("accumulate", values["accumulate"] != 1, "gradient accumulation"),
        ("servers", values["servers"] != 0, "parameter servers"),
    )
    for name, bad, what in blockers:
        if bad:
            raise MacroError(
                f"dp_shares with {what} ({name}={values[name]}) is not supported: it weights one"
                " backward per step by its rows",
                node,
            )
    if values["dp_shares"] == "measured" and values["tp"] != 1:
        raise MacroError(
            f'dp_shares="measured" with tp={values["tp"]} is not supported: the ranks of one'
            " tensor-parallel group would measure apart; give fixed shares ([3, 1])",
            node,
        )


def check_pp_split(args: dict[str, Arg], values: dict[str, Any]) -> None:
    """``pp_split`` cuts the stages unevenly: one stage per rank, one speed per stage."""
    split = values["pp_split"]
    if split is None:
        return
    node = args["pp_split"].node
    if values["pp"] == 1:
        raise MacroError("pp_split applies with pp=N > 1: it cuts the pipeline's stages", node)
    if values["schedule"] == "interleaved":
        raise MacroError(
            'pp_split takes one stage per rank: schedule="1f1b" or "gpipe", not "interleaved"',
            node,
        )
    if not isinstance(split, str) and len(split) != values["pp"]:
        raise MacroError(
            f"pp_split gives {len(split)} speeds for pp={values['pp']} stages: one per stage",
            node,
        )
