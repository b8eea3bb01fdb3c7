"""macrogen's version: in every generated file's header, the cache's key and the tuning records
(a module of its own, so that the pass reads it without importing the package's markers)."""

__version__ = "0.1.0"
