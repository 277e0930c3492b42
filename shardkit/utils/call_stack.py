"""Frames of the running Python call stack that run a given function: how shardkit finds the
torch call around one of its hooks when torch hands the hook nothing else (the dict that
``nn.Module.load_state_dict`` loads, the optimizers torch's ``get_state_dict`` was given, the
modules whose forward is running around an FSDP root)."""

from __future__ import annotations

import sys
from types import CodeType, FrameType
from typing import Optional


def frames_running(code: Optional[CodeType], depth: Optional[int] = None) -> list[FrameType]:
    """The frames that run ``code`` (a function's ``__code__``), innermost first, among the
    ``depth`` frames above the caller (``None``: the whole stack; ``code=None``: none). Local;
    one walk over the stack, no allocation beyond the list."""
    found: list[FrameType] = []
    frame = sys._getframe(2)  # the caller's caller: the caller itself never runs ``code``
    seen = 0
    while frame is not None and code is not None and (depth is None or seen < depth):
        if frame.f_code is code:
            found.append(frame)
        frame = frame.f_back
        seen += 1
    return found
