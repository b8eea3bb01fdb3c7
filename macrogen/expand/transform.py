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

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import libcst as cst

from macrogen import macros
from macrogen.expand import protocol
from macrogen.expand.args import ArgumentHook, Evaluator
from macrogen.expand.context import Context, Position, SiteArguments
from macrogen.expand.errors import InternalError, MacroError
from macrogen.expand.fast.rendered import materialized
from macrogen.expand.protocol import Expanded, Form, Macro, Site
from macrogen.expand.sites import (
    Comprehension,
    Scope,
    ScopeStack,
    collect_scope,
    comprehension_scope,
    nfkc,
)
from macrogen.expand.walk import children, leaf, nodes


class HotLines(Protocol):
    """Which statements mention a name that may mean macrogen (``expand/__init__.py``)."""

    names: set[str]

    def __call__(self, node: cst.CSTNode) -> bool: ...

    def add(self, names: Iterable[str]) -> None: ...


Result = cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement] | cst.RemovalSentinel
_STATEMENT_FORMS: tuple[Form, ...] = ("decorator", "with", "loop", "assign", "if", "elif")


class Expander(cst.CSTTransformer):
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

    # -- scopes ----------------------------------------------------------------
    def _push(self, scope: Scope) -> None:
        self.scopes.push(scope)
        if self.hot is not None and scope.macros:
            self.hot.add(scope.macros)  # a local import of macrogen: its names are hot below
            self.live = None  # (found with the names before: visit everything from here)

    def _scope(
        self, kind: str, node: cst.FunctionDef | cst.ClassDef, parts: list[cst.CSTNode]
    ) -> Scope:
        """The names a def or class binds. Only worth collecting when a statement of its
        block mentions a name that may mean macrogen: no other is visited, so nothing in
        the block asks (a @tile kernel's loops, a @tensor_parallel class's methods)."""
        body = node.body
        if (
            self.hot is not None
            and isinstance(body, cst.IndentedBlock)
            and not any(map(self.hot, body.body))
        ):
            return Scope(kind, node.name.value)
        return collect_scope(kind, node.name.value, parts, self.errors)

    def visit_FunctionDef_body(self, node: cst.FunctionDef) -> None:
        self._push(self._scope("function", node, [node.params, node.body]))

    def leave_FunctionDef_body(self, node: cst.FunctionDef) -> None:
        self.scopes.pop()

    def visit_ClassDef_body(self, node: cst.ClassDef) -> None:
        self._push(self._scope("class", node, [node.body]))

    def leave_ClassDef_body(self, node: cst.ClassDef) -> None:
        self.scopes.pop()

    def visit_Lambda_body(self, node: cst.Lambda) -> None:
        self._push(collect_scope("function", "<lambda>", [node.params], self.errors))

    def leave_Lambda_body(self, node: cst.Lambda) -> None:
        self.scopes.pop()

    # A comprehension's for names are its own scope's, around all of it but the
    # outermost iterable, which Python evaluates outside (``[mg for mg in mg.x]``).
    def _enter_comprehension(self, node: Comprehension, whole: bool) -> None:
        if whole:
            self.outermost.add(node.for_in)
        self._push(comprehension_scope(node))

    def _leave_comprehension(self, node: Comprehension, whole: bool) -> None:
        if whole:
            self.outermost.discard(node.for_in)
        self.scopes.pop()

    def visit_CompFor_iter(self, node: cst.CompFor) -> None:
        if node in self.outermost:
            self.suspended.append(self.scopes.stack.pop())

    def leave_CompFor_iter(self, node: cst.CompFor) -> None:
        if node in self.outermost:
            self.scopes.push(self.suspended.pop())

    def visit_ListComp_elt(self, node: cst.ListComp) -> None:
        self._enter_comprehension(node, False)

    def leave_ListComp_elt(self, node: cst.ListComp) -> None:
        self._leave_comprehension(node, False)

    def visit_ListComp_for_in(self, node: cst.ListComp) -> None:
        self._enter_comprehension(node, True)

    def leave_ListComp_for_in(self, node: cst.ListComp) -> None:
        self._leave_comprehension(node, True)

    def visit_SetComp_elt(self, node: cst.SetComp) -> None:
        self._enter_comprehension(node, False)

    def leave_SetComp_elt(self, node: cst.SetComp) -> None:
        self._leave_comprehension(node, False)

    def visit_SetComp_for_in(self, node: cst.SetComp) -> None:
        self._enter_comprehension(node, True)

    def leave_SetComp_for_in(self, node: cst.SetComp) -> None:
        self._leave_comprehension(node, True)

    def visit_GeneratorExp_elt(self, node: cst.GeneratorExp) -> None:
        self._enter_comprehension(node, False)

    def leave_GeneratorExp_elt(self, node: cst.GeneratorExp) -> None:
        self._leave_comprehension(node, False)

    def visit_GeneratorExp_for_in(self, node: cst.GeneratorExp) -> None:
        self._enter_comprehension(node, True)

    def leave_GeneratorExp_for_in(self, node: cst.GeneratorExp) -> None:
        self._leave_comprehension(node, True)

    def visit_DictComp_key(self, node: cst.DictComp) -> None:
        self._enter_comprehension(node, False)

    def leave_DictComp_key(self, node: cst.DictComp) -> None:
        self._leave_comprehension(node, False)

    def visit_DictComp_value(self, node: cst.DictComp) -> None:
        self._enter_comprehension(node, False)

    def leave_DictComp_value(self, node: cst.DictComp) -> None:
        self._leave_comprehension(node, False)

    def visit_DictComp_for_in(self, node: cst.DictComp) -> None:
        self._enter_comprehension(node, True)

    def leave_DictComp_for_in(self, node: cst.DictComp) -> None:
        self._leave_comprehension(node, True)

    # -- statements: where a call-form site's comment goes -------------------------
    def on_visit(self, node: cst.CSTNode) -> bool:
        statement, leaf, visit, _ = _dispatch(type(self), type(node))
        if leaf:
            return False  # whitespace, a comma, an operator: nothing inside (nor to rebuild)
        if statement:
            self.statements.append([])
            if self.hot is not None:
                if not self.hot(node):
                    return False  # no macro name in its lines: nothing to find (on_leave runs)
                if len(self.statements) == 1:  # the top-level statement
                    self.live = _live_nodes(node, self.hot)
        elif self.live is not None and id(node) not in self.live:
            return False  # no name that may mean macrogen below: no site, nothing to check
        return visit is None or visit(self, node) is not False

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode) -> Any:
        statement, _, _, leave = _dispatch(type(self), type(original))
        result = updated if leave is None else leave(self, original, updated)
        if statement:
            comments = self.statements.pop()
            if comments:
                result = _with_comments(result, comments)
        return result

    def hooked_attributes(self) -> frozenset[str]:
        """The attributes of this class's ``visit_<Node>_<attribute>`` hooks (``drive.py``)."""
        return _hooked_attributes(type(self))

    # libcst's own dispatch formats a method name and looks it up for every node and
    # every attribute of every node; these look each up once per node type, and only
    # for the attributes this class has hooks for (``_FunctionDef_body``...).
    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        if attribute in _hooked_attributes(type(self)):
            visit = _method(type(self), "visit_", type(node), attribute)
            if visit is not None:
                visit(self, node)

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        if attribute in _hooked_attributes(type(self)):
            leave = _method(type(self), "leave_", type(original_node), attribute)
            if leave is not None:
                leave(self, original_node)

    # -- finding macro references and deciding their form ----------------------------
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


_METHODS: dict[tuple[type, str, type, str], Callable[..., Any] | None] = {}


def _live_nodes(root: cst.CSTNode, hot: HotLines) -> set[int]:
    """The ids of the nodes at or below ``root`` that hold a ``Name`` in ``hot.names``,
    not looking into the statements ``hot`` rules out (they are not visited)."""
    live: set[int] = set()
    _mark(root, root, hot, live)
    return live


def _mark(node: cst.CSTNode, root: cst.CSTNode, hot: HotLines, live: set[int]) -> bool:
    # (a function of its own, not a closure: a closure that calls itself is a reference
    # cycle, which would keep the tree alive until the cycle collector runs)
    kind = type(node)
    statement = _STATEMENTS.get(kind)
    if statement is None:
        statement = _STATEMENTS[kind] = _dispatch(Expander, kind)[0]
    if statement and node is not root and not hot(node):
        return False
    found = kind is cst.Name and nfkc(node.value) in hot.names  # type: ignore[attr-defined]
    for child in children(node):
        if _mark(child, root, hot, live):
            found = True
    if found:
        live.add(id(node))
    return found


_STATEMENTS: dict[type, bool] = {}  # node type -> whether a statement (_dispatch's first)


_ATTRIBUTES: dict[type, frozenset[str]] = {}


def _hooked_attributes(owner: type) -> frozenset[str]:
    """The attributes of ``owner``'s own ``visit_<Node>_<attribute>``/``leave_...`` hooks."""
    found = _ATTRIBUTES.get(owner)
    if found is None:
        found = _ATTRIBUTES[owner] = frozenset(
            name.split("_", 2)[2]
            for name in dir(owner)
            if name.startswith(("visit_", "leave_"))
            and name.count("_") >= 2
            and getattr(owner, name) is not getattr(cst.CSTTransformer, name, None)
        )
    return found


_Dispatch = tuple[bool, bool, Callable[..., Any] | None, Callable[..., Any] | None]
_DISPATCH: dict[tuple[type, type], _Dispatch] = {}


def _dispatch(owner: type, kind: type) -> _Dispatch:
    """For a node type: whether it is a statement, whether a leaf (``walk.leaf``), and
    ``owner``'s visit and leave methods for it; worked out once per type."""
    try:
        return _DISPATCH[owner, kind]
    except KeyError:
        found = _DISPATCH[owner, kind] = (
            issubclass(kind, cst.BaseStatement),
            leaf(kind),
            _method(owner, "visit_", kind),
            _method(owner, "leave_", kind),
        )
        return found


def _method(owner: type, prefix: str, kind: type, attribute: str = "") -> Callable[..., Any] | None:
    """``owner``'s ``visit_If``, ``leave_FunctionDef_body``...: what libcst's dispatch finds;
    None where that is libcst's default (a visit that goes on, a leave that keeps the node)."""
    key = (owner, prefix, kind, attribute)
    try:
        return _METHODS[key]
    except KeyError:
        name = f"{prefix}{kind.__name__}" + (f"_{attribute}" if attribute else "")
        found = getattr(owner, name, None)
        if found is not None and found is getattr(cst.CSTTransformer, name, None):
            found = None
        _METHODS[key] = found
        return found


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
