"""``engine.optimizer.step()`` called by the script at ZeRO stages 1-2 (OSS): OSS's agreement on
its param groups rides in the engine's step agreement, as it does under ``engine.step()``, so
the direct step makes one control exchange instead of two.

The engine agrees on the step in a step pre-hook (``engine._refuse_direct_step``); the rows it
gathered for OSS's ``step`` are handed to ``OSS.agreed_in_advance``, whose block must stay open
until OSS's ``step`` has run: the pre-hook opens it here and a step post-hook closes it. A step
that raises leaves no post-hook run: the block left open is closed before the next step of
that optimizer (direct or ``engine.step()``), so a stale agreement is never used.
"""

from __future__ import annotations

from torch.utils.weak import WeakIdKeyDictionary

# optimizer -> the OSS.agreed_in_advance("step", ...) block opened for its direct step
_OPEN_BLOCKS = WeakIdKeyDictionary()


def open_carried_step(optimizer, agreed: dict) -> None:
    """Open ``optimizer.agreed_in_advance`` for its ``step`` on the rows the step agreement
    carried (``agreed``: ``ShardedEngine._agree_on_step``'s result); nothing where it carried
    none. Local: the rows were gathered already."""
    close_carried_step(optimizer)
    if "step" not in agreed:
        return
    rows, arguments = agreed["step"]
    block = optimizer.agreed_in_advance("step", rows, **arguments)
    block.__enter__()
    _OPEN_BLOCKS[optimizer] = block


def close_carried_step(optimizer, *_hook_arguments) -> None:
    """Close the block :func:`open_carried_step` opened for ``optimizer``, if any (also the
    step post-hook: torch passes the step's ``args`` and ``kwargs``, unused). Local."""
    if not _OPEN_BLOCKS:  # (also spares the look-up an optimizer that takes no weak reference)
        return
    block = _OPEN_BLOCKS.pop(optimizer, None)
    if block is not None:
        block.__exit__(None, None, None)
