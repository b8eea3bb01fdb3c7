"""The transformer that finds macro sites in one top-level statement and expands them.

It knows the site forms of ``protocol.py``, never a particular macro. On the
way down it decides each macro call's form (the statement form the macro
declares, else "call"); on the way up (libcst's ``leave_*``) it expands, so a
macro sees its body with inner sites already expanded. Argument nodes and
positions always come from the original tree.

Stacked decorators expand like Python applies them, bottom-up: the macro
nearest the ``def``/``class`` first; each further one gets the definition that
carries the user's name in the statements the previous one returned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import libcst as cst

from macrogen import macros
from macrogen.expand import protocol
from macrogen.expand.args import ArgumentHook, Evaluator
from macrogen.expand.context import Context, Position, SiteArguments
from macrogen.expand.dispatch import dispatch
from macrogen.expand.errors import InternalError, MacroError
from macrogen.expand.fast.rendered import materialized
from macrogen.expand.protocol import Expanded, Form, Macro, Site
from macrogen.expand.scoping import HotLines, ScopeTracking, live_nodes
from macrogen.expand.sites import Scope, ScopeStack
from macrogen.expand.walk import nodes

Result = cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement] | cst.RemovalSentinel
_STATEMENT_FORMS: tuple[Form, ...] = ("decorator", "with", "loop", "assign", "if", "elif")


class Expander(ScopeTracking):
    def __init__(
        self,
        ctx: Context,
        scopes: ScopeStack,
        position: Callable[[cst.CSTNode], Position],
        errors: list[MacroError],
        *,
        constants: Mapping[cst.CSTNode, bool],
        module_names: Mapping[str, str],
        hot: HotLines | None = None,
    ):
        super().__init__()
        self.ctx = ctx
        self.scopes = scopes
        self.position = position
        self.errors = errors
        # assign sites whose ``constant`` hook ran before the transform -> whether it succeeded
        self.constants = constants
        self.module_names = module_names  # the file's top-level imports: local name -> what
        # Which statements mention a name that may mean macrogen: the others are not visited.
        self.hot = hot
        # The nodes of the top-level statement that hold a name in ``hot.names`` (by id;
        # None: visit every node): the others can hold no site, so are not visited.
        self.live: set[int] | None = None
        self.refs: dict[cst.CSTNode, str] = {}  # original macro call (or bare decorator) -> macro
        self.claimed: dict[cst.CSTNode, Form] = {}  # macro calls a statement form takes
        self.consumed: set[cst.CSTNode] = set()
        self.elifs: set[cst.If] = set()
        self.in_macro_call = 0  # > 0 inside a macro call's arguments
        self.statements: list[list[str]] = []  # per enclosing statement: call-site comments
        self.expanded: list[tuple[str, int]] = []  # (macro, line) of each expanded site
        self.arguments: list[SiteArguments] = []
        self.evaluator = Evaluator(ctx.constants, self._argument_macro, self._use_tunable)
        self.applied: dict[cst.Call, cst.Call] = {}  # macro call -> the call m(...)(obj) around it
        self.outermost: set[cst.CompFor] = set()  # the comprehensions' first for, being visited
        self.suspended: list[Scope] = []  # comprehension scopes left while their first iterable is

    def on_visit(self, node: cst.CSTNode) -> bool:
        statement, leaf, visit, _ = dispatch(type(self), type(node))
        if leaf:
            return False  # whitespace, a comma, an operator: nothing inside (nor to rebuild)
        if statement:
            self.statements.append([])
            if self.hot is not None:
                if not self.hot(node):
                    return False  # no macro name in its lines: nothing to find (on_leave runs)
                if len(self.statements) == 1:  # the top-level statement
                    self.live = live_nodes(node, self.hot)
        elif self.live is not None and id(node) not in self.live:
            return False  # no name that may mean macrogen below: no site, nothing to check
        return visit is None or visit(self, node) is not False

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode) -> Any:
        statement, _, _, leave = dispatch(type(self), type(original))
        result = updated if leave is None else leave(self, original, updated)
        if statement:
            comments = self.statements.pop()
            if comments:
                result = _with_comments(result, comments)
        return result

    def _claim(self, node: cst.CSTNode, *forms: Form) -> None:
        """``node`` (a macro call) is a site of the first of ``forms`` its macro declares."""
        name = self.scopes.macro_of(node)
        macro = _lookup(name) if name is not None else None
        if macro is None:
            return
        declared = next((f for f in forms if f in macro.FORMS), None)
        if declared is not None:
            self.claimed[node] = declared

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Call):
            # m(...)(obj): the inner call is the macro's, this one applies it (to a class or
            # a built model where a decorator belongs: one error, at the inner call)
            if self.scopes.macro_of(node.func) is not None:
                self.applied[node.func] = node
            return
        macro = self.scopes.macro_of(node.func)
        if macro is not None:
            self.refs[node] = macro
            self.in_macro_call += 1

    def visit_Decorator(self, node: cst.Decorator) -> None:
        if not isinstance(node.decorator, cst.Call):
            macro = self.scopes.macro_of(node.decorator)
            if macro is not None:
                self.refs[node.decorator] = macro
        self._claim(node.decorator, "decorator")

    def visit_Attribute(self, node: cst.Attribute) -> None:
        try:
            self.scopes.check_attribute(node)
        except MacroError as e:
            self.errors.append(e)

    def visit_If(self, node: cst.If) -> None:
        if isinstance(node.orelse, cst.If):
            self.elifs.add(node.orelse)
        self._claim(node.test, "elif" if node in self.elifs else "if")

    def visit_With(self, node: cst.With) -> None:
        for item in node.items:
            self._claim(item.item, "with")

    def visit_For(self, node: cst.For) -> None:
        self._claim(node.iter, "loop")

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        value = _assigned(node)
        if value is not None:
            self._claim(value, "assign")

    # -- the call form -----------------------------------------------------------
    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        if original not in self.refs:
            return updated
        self.in_macro_call -= 1
        if original in self.claimed or self.in_macro_call > 0:
            return updated  # a statement form's, or another macro's argument
        macro = _lookup(self.refs[original])
        if macro is None or "call" not in macro.FORMS:
            return updated  # reported by check_unconsumed, with what is supported
        self.consumed.add(original)
        qualname = self.ctx.site_key(self.scopes.qualname, self.refs[original])
        result = self._expand("call", original, updated, original, original, qualname)
        if result is None:
            return updated
        if not isinstance(result.replacement, cst.BaseExpression):
            raise InternalError(f"{self.refs[original]}: a call site expands to an expression")
        self.statements[-1].append(self._comment(self.refs[original], original))
        return result.replacement

    # -- statement forms -------------------------------------------------------------
    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> Any:
        return self._decorated(original, updated)

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> Any:
        return self._decorated(original, updated)

    def _decorated(
        self, original: cst.FunctionDef | cst.ClassDef, updated: cst.FunctionDef | cst.ClassDef
    ) -> Result:
        found = [i for i, d in enumerate(original.decorators) if d.decorator in self.claimed]
        if not found:
            return updated
        self.consumed.update(original.decorators[i].decorator for i in found)
        if self._applied_twice(original, found):
            return updated
        stripped = updated.with_changes(
            decorators=[d for i, d in enumerate(updated.decorators) if i not in found]
        )
        name = original.name.value
        base = ".".join(filter(None, [self.scopes.qualname, name]))
        statements: list[cst.BaseStatement] = [stripped]
        for n, i in enumerate(reversed(found)):  # bottom-up, as Python applies decorators
            expr = original.decorators[i].decorator
            macro = self.refs[expr]
            if n:  # a macro stacked above gets the tree of what the one below rendered
                statements = materialized(statements)
            at = _definition_of(name, statements)
            if at is None:
                self._error(
                    MacroError(
                        f"{macro}() can't be stacked here: the macro below it leaves no"
                        f" definition named {name}",
                        expr,
                    )
                )
                return updated
            target = statements[at]
            qualname = base if n == 0 else f"{base}.{macro}"
            call = expr if isinstance(expr, cst.Call) else None
            result = self._expand("decorator", original, target, call, expr, qualname)
            if result is None:
                return updated
            statements[at : at + 1] = self._splice(result, target, self._comment(macro, expr))
        return cst.FlattenSentinel(statements)

    def _applied_twice(self, original: cst.FunctionDef | cst.ClassDef, found: list[int]) -> bool:
        """A macro decorator used twice on one definition would expand into nested layers
        (a model data-parallel twice over, a kernel of a kernel): an error at the second."""
        first: dict[str, cst.CSTNode] = {}
        twice = False
        for i in found:
            expr = original.decorators[i].decorator
            macro = self.refs[expr]
            if macro in first:
                line = self.position(first[macro]).line
                self._error(
                    MacroError(
                        f"{macro}() is applied twice to {original.name.value} (first at line"
                        f" {line}): a macro decorator goes on a definition once; remove one",
                        expr,
                    )
                )
                twice = True
            else:
                first[macro] = expr
        return twice

    def leave_With(self, original: cst.With, updated: cst.With) -> Result:
        found = [item for item in original.items if item.item in self.claimed]
        if not found:
            return updated
        item = found[0]
        self.consumed.update(it.item for it in found)
        macro = self.refs[item.item]
        if len(original.items) > 1:
            self._error(MacroError(f"{macro}() must be the only item of its with statement", item))
            return updated
        if original.asynchronous is not None:
            self._error(MacroError(f"{macro}() opens a plain with block, not async with", original))
            return updated
        return self._statement_site("with", original, updated, item.item)

    def leave_For(self, original: cst.For, updated: cst.For) -> Result:
        if original.iter not in self.claimed:
            return updated
        self.consumed.add(original.iter)
        if original.asynchronous is not None:
            macro = self.refs[original.iter]
            self._error(MacroError(f"{macro}() opens a plain for loop, not async for", original))
            return updated
        return self._statement_site("loop", original, updated, original.iter)

    def leave_If(self, original: cst.If, updated: cst.If) -> Result | cst.If:
        if original.test not in self.claimed:
            return updated
        self.consumed.add(original.test)
        form = self.claimed[original.test]
        if form == "elif":  # an elif keeps its place in the chain: one If
            result = self._site_expansion(form, original, updated, original.test)
            if result is None:
                return updated
            replacement = result.replacement
            if isinstance(replacement, cst.BaseExpression) or len(replacement) != 1:
                raise InternalError(f"{self.refs[original.test]}: an elif expands to one If")
            elif_ = replacement[0]
            if not isinstance(elif_, cst.If):
                raise InternalError(f"{self.refs[original.test]}: an elif expands to one If")
            return elif_
        return self._statement_site(form, original, updated, original.test)

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> Result:
        value = _assigned(original)
        if value is None or value not in self.claimed:
            return updated
        self.consumed.add(value)
        if value in self.constants:
            # The constant hook evaluated the arguments (and reported their errors).
            self.consumed.update(c for c in self.refs if c is not value and inside(c, value))
            if not self.constants[value]:
                return updated
        return self._statement_site("assign", original, updated, value)

    # -- expansion ---------------------------------------------------------------
    def _statement_site(
        self, form: Form, original: cst.BaseStatement, updated: cst.BaseStatement, at: cst.CSTNode
    ) -> Result:
        result = self._site_expansion(form, original, updated, at)
        if result is None:
            return updated
        return cst.FlattenSentinel(self._splice(result, updated, self._comment(self.refs[at], at)))

    def _site_expansion(
        self, form: Form, original: cst.CSTNode, updated: cst.CSTNode, at: cst.CSTNode
    ) -> Expanded | None:
        macro = self.refs[at]
        target = _assign_target(original) if form == "assign" else None
        if isinstance(target, cst.Name):
            qualname = ".".join(filter(None, [self.scopes.qualname, target.value]))
        else:
            qualname = self.ctx.site_key(self.scopes.qualname, macro)
        call = at if isinstance(at, cst.Call) else None
        return self._expand(form, original, updated, call, at, qualname)

    def _expand(
        self,
        form: Form,
        original: cst.CSTNode,
        updated: cst.CSTNode,
        call: cst.Call | None,
        at: cst.CSTNode,
        qualname: str,
    ) -> Expanded | None:
        name = self.refs[at]
        pos = self.position(at)
        try:
            macro = _macro(name, at)
            if form not in macro.FORMS:
                raise MacroError(f"{name}() can't be used here: {macro.USAGE}", at)
            code = protocol.code_arguments(macro)
            args = self.evaluator.call_args(call, qualname, code)
            view = self.ctx.for_site(self.scopes.locally_bound())
            site = Site(
                macro=name,
                form=form,
                node=updated,
                original=original,
                call=call,
                args=args,
                qualname=qualname,
                line=pos.line,
                col=pos.col,
                scope=self.scopes.qualname,
                names=self.scopes.import_map(self.module_names),
            )
            result = macro.expand(site, view)
        except MacroError as e:
            self._error(e if e.node is not None else MacroError(e.message, at))
            return None
        _check_result(name, form, result)
        self.ctx.add_imports(view.requested)
        self.ctx.prelude.extend(result.helpers)
        for cls, decorator in result.decorates:
            self.ctx.class_decorators.setdefault(cls, decorator)
        self.expanded.append((name, pos.line))
        self.arguments.append(SiteArguments.of(name, qualname, args))
        return result

    def _comment(self, macro: str, at: cst.CSTNode) -> str:
        return f"# macrogen: {macro} at {self.ctx.location(self.position(at).line)}"

    def _splice(
        self, result: Expanded, replaced: cst.CSTNode, comment: str
    ) -> list[cst.BaseStatement]:
        """The replacement statements, the site's comment on the first one.

        The replaced statement's own leading lines (comments, blank lines) stay above the
        site's comment."""
        replacement = result.replacement
        if isinstance(replacement, cst.BaseExpression):
            raise InternalError("a statement site expands to statements, not an expression")
        statements = list(replacement) or [cst.SimpleStatementLine([cst.Pass()])]
        first = statements[0]
        original_leading = list(getattr(replaced, "leading_lines", ()))
        own: list[cst.EmptyLine] = list(getattr(first, "leading_lines", ()))
        if len(own) == len(original_leading) and all(
            a.deep_equals(b) for a, b in zip(own, original_leading)
        ):
            own = []  # the first statement is the site itself: its leading lines move above the comment
        leading = [*original_leading, cst.EmptyLine(comment=cst.Comment(comment)), *own]
        statements[0] = first.with_changes(leading_lines=leading)
        return statements

    def release(self) -> None:
        """Drop the evaluator, whose callbacks are this expander's methods: that reference
        cycle would keep the nodes it holds alive until the cycle collector runs."""
        del self.evaluator

    def check_unconsumed(self) -> None:
        """Macro calls no site took are in a place where that macro means nothing."""
        for node, name in self.refs.items():
            if node not in self.consumed:
                try:
                    macro = _macro(name, node)
                except MacroError as e:
                    self._error(e)
                    continue
                self._error(self._misplaced(name, macro, node))

    def _misplaced(self, name: str, macro: Macro, node: cst.CSTNode) -> MacroError:
        """Why a macro call is not a site; for a decorator called on an object (``m()(Net)``,
        ``m(Net)``), how to write the decorator instead, or how to apply it to a built one."""
        obj: cst.BaseExpression | None = None
        if isinstance(node, cst.Call) and "decorator" in macro.FORMS:
            outer = self.applied.get(node)
            call = outer if outer is not None else node
            if len(call.args) == 1 and not call.args[0].keyword and not call.args[0].star:
                obj = call.args[0].value
        if obj is None or not isinstance(node, cst.Call):
            return MacroError(f"{name}() can't be used here: {macro.USAGE}", node)
        outer = self.applied.get(node)
        decorator = "@" + _code(node if outer is not None else node.func)
        built = protocol.built(macro)  # a model macro: how it applies to a built model
        if built is None:
            message = (
                f"{name}() is a decorator; it is not called on an object: write `{decorator}`"
                f" above the definition of {_code(obj)} ({macro.USAGE})"
            )
        elif isinstance(obj, (cst.Name, cst.Attribute)):  # a class, most likely
            module = _code(node.func.value) if isinstance(node.func, cst.Attribute) else "macrogen"
            cls = _code(obj)
            message = (
                f"{name}() decorates a class definition; it is not called on a class: write"
                f" `{decorator}` above `class My{cls.rsplit('.', 1)[-1]}({cls}): ...` (a"
                f" subclass), or for a built model `model = {module}.{built}`"
            )
        else:  # an instance: a built model
            module = _code(node.func.value) if isinstance(node.func, cst.Attribute) else "macrogen"
            message = (
                f"{name}() decorates a class definition; it is not called on a built model:"
                f" write `model = {module}.{built}`, or put `{decorator}` above a subclass of"
                " its class (`class MyNet(ResNet): ...`)"
            )
        return MacroError(message, outer if outer is not None else node)

    # -- callbacks for argument evaluation -----------------------------------------
    def _argument_macro(self, call: cst.Call) -> tuple[str, str, ArgumentHook] | None:
        name = self.refs.get(call)
        macro = _lookup(name) if name is not None else None
        hook = protocol.argument_hook(macro) if macro is not None else None
        if name is None or macro is None or hook is None or "argument" not in macro.FORMS:
            return None
        self.consumed.add(call)
        return name, macro.USAGE, hook

    def _use_tunable(
        self, key: str, default: Any, choices: tuple[Any, ...], node: cst.CSTNode
    ) -> Any:
        return self.ctx.tunable(key, default, choices, node, self.position(node).line)

    def _error(self, e: MacroError) -> None:
        self.errors.append(e)


def _code(node: cst.CSTNode) -> str:
    """A node's code as the user wrote it (one line)."""
    return " ".join(cst.Module([]).code_for_node(node).split())


def _lookup(name: str) -> Macro | None:
    try:
        return macros.get(name)
    except KeyError:
        return None


def _macro(name: str, node: cst.CSTNode) -> Macro:
    """The macro; a marker whose macro is not in this installation is the user's error."""
    macro = _lookup(name)
    if macro is None:
        raise MacroError(f"{name}() is not available in this version of macrogen", node)
    return macro


def _check_result(name: str, form: Form, result: object) -> None:
    """A macro that breaks the protocol is macrogen's bug: say which and how."""
    if not isinstance(result, Expanded):
        raise InternalError(f"macro {name}: expand returned {type(result).__name__}, not Expanded")
    if form == "call" and not isinstance(result.replacement, cst.BaseExpression):
        raise InternalError(f"macro {name}: a call site expands to an expression")


def _assigned(stmt: cst.SimpleStatementLine) -> cst.BaseExpression | None:
    """The value of ``x = value`` (or ``x: T = value``) standing alone on its line."""
    if len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    if isinstance(small, cst.Assign):
        return small.value
    if isinstance(small, cst.AnnAssign):
        return small.value
    return None


def _assign_target(stmt: cst.CSTNode) -> cst.BaseExpression | None:
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        return small.targets[0].target
    if isinstance(small, cst.AnnAssign):
        return small.target
    return None


def _definition_of(name: str, statements: Sequence[cst.BaseStatement]) -> int | None:
    """The index of the last def or class named ``name``: what the name is bound to."""
    for i in reversed(range(len(statements))):
        stmt = statements[i]
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and stmt.name.value == name:
            return i
    return None


def _with_comments(result: Any, comments: list[str]) -> Any:
    """The statement (or the first of several) with the call sites' comments above it."""
    lines = [cst.EmptyLine(comment=cst.Comment(c)) for c in comments]
    if isinstance(result, cst.FlattenSentinel):
        nodes = list(result.nodes)
        if nodes:
            nodes[0] = nodes[0].with_changes(leading_lines=[*nodes[0].leading_lines, *lines])
        return cst.FlattenSentinel(nodes)
    if isinstance(result, cst.BaseStatement):
        leading = getattr(result, "leading_lines", None)
        if leading is not None:
            return result.with_changes(leading_lines=[*leading, *lines])
    return result


def inside(node: cst.CSTNode, root: cst.CSTNode) -> bool:
    return any(n is node for n in nodes(root))
