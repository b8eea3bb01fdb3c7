"""Printing the expanded statements: libcst's codegen, less its per-node costs.

``print_module`` is ``module.code`` with a codegen state whose
``record_syntactic_position`` is a shared no-op (libcst's makes a generator
per node, for positions nobody asks of the output).

``VerbatimBlock`` stands in for a block the transform left as it was parsed (a
``@tensor_parallel`` class's body under its new name): at module level, with
the module's indentation and ``\\n`` line endings, libcst would print exactly
the source lines it was parsed from, so it prints those
(``tests/test_pass_shortcuts.py`` compares the two on the goldens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import libcst as cst
from libcst._nodes.internal import CodegenState

VERBATIM = True  # False: print every block through libcst (the tests compare the two)


class _NoPosition:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_POSITION = _NoPosition()


class _PrintState(CodegenState):
    def record_syntactic_position(self, node: Any, **kwargs: Any) -> Any:
        return _NO_POSITION


def print_module(module: cst.Module) -> str:
    """``module.code``."""
    try:
        state = _PrintState(default_indent=module.default_indent, default_newline=module.default_newline)
        module._codegen(state)
    except (AttributeError, TypeError):  # pragma: no cover - a libcst with another protocol
        return module.code
    return "".join(state.tokens)


@dataclass(frozen=True)
class VerbatimBlock(cst.BaseSuite):
    block: cst.IndentedBlock  # as parsed
    text: str  # the source lines after its header line, its footer included; ends with "\n"
    default_indent: str  # the parsed module's

    def _visit_and_replace_children(self, visitor: Any) -> VerbatimBlock:
        return self

    def _codegen_impl(self, state: CodegenState) -> None:
        if not (
            VERBATIM
            and not state.indent_tokens
            and state.default_indent == self.default_indent
            and state.default_newline == "\n"
        ):
            self.block._codegen(state)
            return
        self.block.header._codegen(state)
        state.add_token(self.text[:-1])
        state.add_token("\n")  # a token of its own: the module may pop a last newline
