"""The transformer that finds macro sites in one top-level statement and expands them.

Sites are expanded bottom-up (libcst's ``leave_*``), so a macro sees its body
with inner sites already expanded. Argument nodes and positions always come
from the original tree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import libcst as cst

from macrogen import macros
from macrogen.expand.args import Evaluator
from macrogen.expand.context import Context, Position
from macrogen.expand.errors import MacroError
from macrogen.expand.site import Site
from macrogen.expand.sites import ScopeStack, collect_scope

Result = cst.BaseStatement | cst.FlattenSentinel | cst.RemovalSentinel


class Expander(cst.CSTTransformer):
    def __init__(
        self,
        ctx: Context,
        scopes: ScopeStack,
        position: Callable[[cst.CSTNode], Position],
        errors: list[MacroError],
    ):
        super().__init__()
        self.ctx = ctx
        self.scopes = scopes
        self.position = position
        self.errors = errors
        self.refs: dict[cst.CSTNode, str] = {}  # original macro call (or bare decorator) -> macro
        self.consumed: set[cst.CSTNode] = set()
        self.elifs: set[cst.If] = set()
        self.expanded: list[tuple[str, int]] = []  # (macro, line) of each expanded site
        self.evaluator = Evaluator(ctx.constants, self._is_tunable, self._use_tunable)

    # -- scopes ----------------------------------------------------------------
    def visit_FunctionDef_body(self, node: cst.FunctionDef) -> None:
        self.scopes.push(
            collect_scope("function", node.name.value, [node.params, node.body], self.errors)
        )

    def leave_FunctionDef_body(self, node: cst.FunctionDef) -> None:
        self.scopes.pop()

    def visit_ClassDef_body(self, node: cst.ClassDef) -> None:
        self.scopes.push(collect_scope("class", node.name.value, [node.body], self.errors))

    def leave_ClassDef_body(self, node: cst.ClassDef) -> None:
        self.scopes.pop()

    def visit_Lambda_body(self, node: cst.Lambda) -> None:
        self.scopes.push(collect_scope("function", "<lambda>", [node.params], self.errors))

    def leave_Lambda_body(self, node: cst.Lambda) -> None:
        self.scopes.pop()

    # -- finding macro references ------------------------------------------------
    def visit_Call(self, node: cst.Call) -> None:
        macro = self.scopes.macro_of(node.func)
        if macro is not None:
            self.refs[node] = macro

    def visit_Decorator(self, node: cst.Decorator) -> None:
        if not isinstance(node.decorator, cst.Call):
            macro = self.scopes.macro_of(node.decorator)
            if macro is not None:
                self.refs[node.decorator] = macro

    def visit_Attribute(self, node: cst.Attribute) -> None:
        try:
            self.scopes.check_attribute(node)
        except MacroError as e:
            self.errors.append(e)

    def visit_If(self, node: cst.If) -> None:
        if isinstance(node.orelse, cst.If):
            self.elifs.add(node.orelse)

    # -- sites -----------------------------------------------------------------
    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> Any:
        return self._decorated(original, updated)

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> Any:
        return self._decorated(original, updated)

    def _decorated(self, original: cst.FunctionDef | cst.ClassDef, updated: Any) -> Any:
        found = [i for i, d in enumerate(original.decorators) if d.decorator in self.refs]
        if not found:
            return updated
        for extra in found[1:]:
            self._error(
                MacroError("only one macrogen decorator per definition", original.decorators[extra])
            )
        i = found[0]
        expr = original.decorators[i].decorator
        self.consumed.update(original.decorators[j].decorator for j in found)
        stripped = updated.with_changes(
            decorators=[d for j, d in enumerate(updated.decorators) if j != i]
        )
        qualname = ".".join(filter(None, [self.scopes.qualname, original.name.value]))
        call = expr if isinstance(expr, cst.Call) else None
        return self._expand(self.refs[expr], "decorator", original, stripped, call, expr, qualname)

    def leave_With(self, original: cst.With, updated: cst.With) -> Any:
        found = [item for item in original.items if item.item in self.refs]
        if not found:
            return updated
        item = found[0]
        self.consumed.update(it.item for it in found)
        macro = self.refs[item.item]
        if len(original.items) > 1:
            self._error(MacroError(f"{macro}() must be the only item of its with statement", item))
            return updated
        if item.asname is not None:
            self._error(MacroError(f"{macro}() takes no 'as' target", item.asname))
            return updated
        if original.asynchronous is not None:
            self._error(MacroError(f"{macro}() opens a plain with block, not async with", original))
            return updated
        qualname = self.ctx.site_key(self.scopes.qualname, macro)
        return self._expand(macro, "with", original, updated, item.item, item.item, qualname)

    def leave_If(self, original: cst.If, updated: cst.If) -> Any:
        test = original.test
        if test not in self.refs:
            return updated
        self.consumed.add(test)
        macro = self.refs[test]
        form = "elif" if original in self.elifs else "if"
        qualname = self.ctx.site_key(self.scopes.qualname, macro)
        return self._expand(macro, form, original, updated, test, test, qualname)

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> Any:
        if len(original.body) != 1 or not isinstance(original.body[0], cst.Assign):
            return updated
        value = original.body[0].value
        if value not in self.refs or self.refs[value] not in ("define", "tunable"):
            return updated
        macro = self.refs[value]
        self.consumed.add(value)
        targets = original.body[0].targets
        if not self.scopes.at_module_level:
            self._error(MacroError(f"{macro}() must be assigned to a name at module level", value))
            return updated
        if len(targets) != 1 or not isinstance(targets[0].target, cst.Name):
            self._error(
                MacroError(f"{macro}() must be assigned to one name: NAME = {macro}(...)", original)
            )
            return updated
        self.consumed.update(c for c in self.refs if self.refs[c] == "tunable" and inside(c, value))
        name = targets[0].target.value
        # The value was evaluated before the transform (module constants come first);
        # if that failed, the error is already reported.
        if name not in self.ctx.constants:
            return updated
        return self._expand(macro, "assign", original, updated, None, value, name)

    # -- expansion ---------------------------------------------------------------
    def _expand(
        self,
        macro: str,
        form: str,
        original: cst.CSTNode,
        updated: cst.CSTNode,
        call: cst.Call | None,
        at: cst.CSTNode,
        qualname: str,
    ) -> Any:
        pos = self.position(at)
        try:
            module = _macro_module(macro, at)
            if form not in module.FORMS:
                raise MacroError(f"{macro}() can't be used here: {module.USAGE}", at)
            args = self.evaluator.call_args(call, qualname)
            self.ctx.shadowed = self.scopes.locally_bound()
            site = Site(macro, form, updated, original, call, args, qualname, pos.line, pos.col)
            result = module.expand(site, self.ctx)
        except MacroError as e:
            self._error(e if e.node is not None else MacroError(e.message, at))
            return updated
        self.expanded.append((macro, pos.line))
        if form == "elif":  # an elif keeps its place in the chain
            return result
        return self._splice(
            result, original, f"# macrogen: {macro} at {self.ctx.location(pos.line)}"
        )

    def _splice(
        self, result: Sequence[cst.BaseStatement] | cst.BaseStatement, original: Any, comment: str
    ) -> Result:
        statements = [result] if isinstance(result, cst.BaseStatement) else list(result)
        if not statements:
            statements = [cst.SimpleStatementLine([cst.Pass()])]
        first = statements[0]
        original_leading = list(getattr(original, "leading_lines", ()))
        own = list(first.leading_lines)
        if len(own) == len(original_leading) and all(
            a.deep_equals(b) for a, b in zip(own, original_leading)
        ):
            own = []  # the first statement is the site itself: its leading lines move above the comment
        leading = [*original_leading, cst.EmptyLine(comment=cst.Comment(comment)), *own]
        statements[0] = first.with_changes(leading_lines=leading)
        return cst.FlattenSentinel(statements)

    def check_unconsumed(self) -> None:
        """Macro calls no site took are in a place where that macro means nothing."""
        for node, macro in self.refs.items():
            if node not in self.consumed:
                try:
                    usage = _macro_module(macro, node).USAGE
                except MacroError as e:
                    self._error(e)
                    continue
                self._error(MacroError(f"{macro}() can't be used here: {usage}", node))

    # -- callbacks for argument evaluation -----------------------------------------
    def _is_tunable(self, call: cst.Call) -> bool:
        if self.refs.get(call) == "tunable":
            self.consumed.add(call)
            return True
        return False

    def _use_tunable(
        self, key: str, default: Any, choices: tuple[Any, ...], node: cst.CSTNode
    ) -> Any:
        return self.ctx.tunable(key, default, choices, node, self.position(node).line)

    def _error(self, e: MacroError) -> None:
        self.errors.append(e)


def _macro_module(macro: str, node: cst.CSTNode) -> Any:
    """The macro's module; a marker whose macro is not in this installation is the user's error."""
    try:
        return macros.get(macro)
    except ModuleNotFoundError as e:
        if e.name != f"macrogen.macros.{macro}":
            raise
        raise MacroError(f"{macro}() is not available in this version of macrogen", node) from None


def inside(node: cst.CSTNode, root: cst.CSTNode) -> bool:
    found = False

    class _Find(cst.CSTVisitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            nonlocal found
            found = found or n is node
            return not found

    root.visit(_Find())
    return found
