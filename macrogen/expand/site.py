"""What a macro's ``expand`` receives."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from macrogen.expand.args import Args


@dataclass(frozen=True)
class Site:
    """One use of a macro in the user's file."""

    macro: str
    form: str  # "decorator", "with", "if", "elif" or "assign"
    node: cst.CSTNode  # the statement, inner sites already expanded, this macro's decorator removed
    original: cst.CSTNode  # the statement as it is in the source
    call: cst.Call | None  # the macro call (None for a bare decorator)
    args: Args  # the call's arguments, evaluated
    qualname: str  # "GPT", "Block.forward", "sync_metrics.fused_allreduce"
    line: int  # 1-based line of the macro call in the source
    col: int
