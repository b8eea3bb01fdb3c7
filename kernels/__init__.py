"""Triton kernels the runtime and generated code call, each with its torch fallback.

Shipped as ``macrogen.kernels`` (see pyproject.toml's package-dir); one module per kernel family.
"""
