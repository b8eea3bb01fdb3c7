"""What a macro's ``expand`` receives: ``Site``, now defined with the protocol."""

from macrogen.expand.protocol import Site

__all__ = ["Site"]
