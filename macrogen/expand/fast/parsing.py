"""libcst's parse of a piece of the user's file, without re-validating what its parser built.

libcst builds each node through its dataclass ``__init__``, whose
``__post_init__`` validates the node (``_validate``: are the parentheses
balanced, is the whitespace legal...). The parser only builds valid trees,
so for its nodes that check is repeated work: about a sixth of the parse
(libcst's own comment on ``CSTNode.__post_init__`` says as much). While
``parse_module`` runs here, the validation is skipped for the nodes this
thread builds; every other thread's nodes, and every node the pass builds
itself, are validated as always. (In a process with one thread the hook is
``tuple``, which costs no Python frame per node; with several, a function
that checks the thread.) With ``fast.ENABLED = False`` every node is validated
(the tests compare the trees).
"""

from __future__ import annotations

import threading
from _thread import get_ident

import libcst as cst

from macrogen.expand import fast

_LOCK = threading.Lock()  # one parse at a time swaps the hook (and puts libcst's back)
_NOTHING = staticmethod(tuple)


def parse_module(text: str) -> cst.Module:
    """``cst.parse_module(text)``, the same tree."""
    if not fast.ENABLED:
        return cst.parse_module(text)
    with _LOCK:
        validate = cst.CSTNode.__post_init__
        owner = get_ident()

        def post_init(node: cst.CSTNode) -> None:
            if get_ident() != owner:
                validate(node)

        # The only thread (none can start while the parse runs): a hook without a Python
        # frame per node, tuple() called with no argument.
        hook = _NOTHING if threading.active_count() == 1 else post_init
        cst.CSTNode.__post_init__ = hook  # type: ignore[method-assign, assignment]
        try:
            return cst.parse_module(text)
        finally:
            cst.CSTNode.__post_init__ = validate  # type: ignore[method-assign]
