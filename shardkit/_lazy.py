"""Lazy public names for package ``__init__`` files: a name's module is imported on first use,
so ``import shardkit.optim`` stays cheap and a package lists its public API in one table."""

import importlib


def lazy_exports(package: str, exports: dict[str, str]):
    """A module-level ``__getattr__`` for ``package`` that resolves each name in ``exports``
    (``{name: module path}``) by importing its module."""

    def __getattr__(name):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
