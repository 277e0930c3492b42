"""Hooks that do not keep their owner alive.

torch keeps some hooks where Python's garbage collector cannot follow them: a tensor's
post-accumulate-grad hooks, and the context of a custom autograd node reachable from a tensor
a module holds, live in C++. A hook bound to the wrapper that registered it then closes a
reference cycle the collector cannot see, and the wrapper, the user's model and every buffer
they hold stay alive for good after the user drops them.
"""

from __future__ import annotations

import weakref
from typing import Callable

__all__ = ["weakly_bound"]


def weakly_bound(method: Callable) -> Callable:
    """``method`` (a bound method) called through a weak reference to its object; a call after
    the object is gone does nothing and returns None. No memory beyond the weak reference."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        if bound is not None:
            return bound(*args, **kwargs)
        return None
    return call
