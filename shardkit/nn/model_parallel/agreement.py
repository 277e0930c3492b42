"""The tensor-parallel ranks' agreement on a layer's arguments and on each forward's input.

Every rank of a tensor-parallel group holds ``1/n`` of a layer and joins its collectives, so the
ranks must build each layer with the same unsplit sizes and feed it inputs of the same shape.
A user bug that breaks this (``ColumnParallelLinear(64, 128)`` on one rank and ``(64, 96)`` on
another, a last batch of another size on one rank) made gloo abort the process ("Received data
size doesn't match expected size"), hang, or, where the sizes happened to fit, compute wrong
values without an error. A bad argument on one rank alone (``out_features=97`` at size 2) raised
there while the other ranks went on into a collective that rank never joined.

:func:`agree_on_arguments` (at construction) and :func:`agree_on_input` (before a forward's
first collective or local refusal) make that a clear error on every rank: each rank's local
refusal, or the first argument or input property on which the ranks differ, with every rank's
value, raised on every rank before any collective of the layer.

The construction check always runs (once per layer); the forward check runs in the
collective debug mode only (``SHARDKIT_DEBUG_COLLECTIVES=1`` or
:func:`shardkit.distributed.set_debug_collectives`, which also checks every collective's op,
shape and dtype), as a host synchronisation per layer forward would stall an accelerator's
queue; off, a forward's local refusal is raised on its rank alone, as before.

Cost, per call, at tensor-parallel size ``n > 1`` (nothing at size 1): one all-gather of 16
int64s per rank (a header, a verdict, a CRC-32 of the compared values; ``128 n`` bytes), a control
message on the group's control device that :class:`~shardkit.distributed.CommCounter` does not
count; under NCCL it is on the GPU and its result is read on the host (one host
synchronisation). Only when the ranks differ or one refused, one more object all-gather of
each rank's values, for the message. No memory beyond those few bytes.
"""

from __future__ import annotations

import builtins
import numbers
import zlib
from typing import Any, Mapping, Optional

from shardkit import distributed
from shardkit.collective_check import debug_collectives_enabled

_TP_AGREEMENT = distributed.control_kind("the tensor-parallel ranks' agreement")

__all__ = ["agree_on_arguments", "agree_on_input", "local_problem", "ARGUMENTS_RULE",
           "INPUT_RULE"]

ARGUMENTS_RULE = ("every rank of a tensor-parallel group must build each tensor-parallel layer "
                  "with the same arguments (the unsplit layer's), in the same order")
INPUT_RULE = ("every rank of a tensor-parallel group must pass inputs of the same shape and dtype "
              "(the same batch: e.g. broadcast it over the group with "
              "shardkit.nn.model_parallel.broadcast_data); nothing was exchanged")


def local_problem(check, *args) -> Optional[BaseException]:
    """The error ``check(*args)`` raises on this rank (``None``: none), for the tensor-parallel
    ranks' agreement to raise on every rank. No communication."""
    try:
        check(*args)
    except Exception as error:  # noqa: BLE001 - whatever it is, every rank raises it
        return error
    return None


def agree_on_arguments(what: str, arguments: Mapping[str, Any],
                       problem: Optional[BaseException], group, size: int) -> None:
    """At construction of the tensor-parallel layer ``what``: raise, on every rank of ``group``
    (``size`` ranks), this rank's local ``problem`` (its argument checks' error, or ``None``)
    when any rank had one, else a ``ValueError`` naming each argument of ``arguments``
    (``{name: value}``, the layer's global arguments) on which the ranks differ and every rank's
    value. Collective over ``group``; see the module docstring for the cost."""
    _agree(what, dict(arguments), problem, group, size, ARGUMENTS_RULE,
           "were built with different arguments")


def agree_on_input(what: str, facts: Mapping[str, Any], problem: Optional[BaseException],
                   group, size: int) -> None:
    """Before the forward of ``what`` communicates (or refuses its input on this rank alone):
    raise, on every rank of ``group`` (``size`` ranks), this rank's ``problem`` (its local
    input check's error, or ``None``) when any rank had one, else a ``ValueError`` naming each
    property of ``facts`` (``{name: value}``: the input's shape, dtype, ...) on which the ranks
    differ, with every rank's value. Collective over ``group`` in the collective debug mode
    only (:func:`shardkit.distributed.set_debug_collectives`, ``SHARDKIT_DEBUG_COLLECTIVES=1``);
    otherwise it raises this rank's ``problem`` alone and exchanges nothing, so that a
    forward's path keeps no host synchronisation (see the module docstring)."""
    if not debug_collectives_enabled():
        if problem is not None:
            raise problem
        return
    _agree(what, dict(facts), problem, group, size, INPUT_RULE, "were given different inputs")


def _plain(value: Any) -> Any:
    """``value`` with its numbers as Python's: an integer of any type (``np.int64(64)``) as
    ``int``, a real one (``np.float32``) as ``float``, a bool as itself, a tuple or list item by
    item; anything else as given. Local."""
    if isinstance(value, (tuple, list)):
        return type(value)(_plain(item) for item in value)
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    return float(value) if isinstance(value, numbers.Real) else complex(value)


def _comparable(value: Any) -> str:
    """What the ranks compare of ``value``: numbers by value, whatever their type (``64``,
    ``np.int64(64)`` alike; ``1`` and ``1.0`` alike, as Python compares them), a bool as itself
    (a flag must be a bool: checked before). Local."""
    def collapsed(v):
        if isinstance(v, (tuple, list)):
            return type(v)(collapsed(item) for item in v)
        return int(v) if isinstance(v, float) and v.is_integer() else v
    return repr(collapsed(_plain(value)))


def _digest(what: str, facts: dict) -> int:
    """A CRC-32 of ``what`` and ``facts``, alike on every rank holding equal values (numbers
    by value: :func:`_comparable`)."""
    try:
        text = repr((what, sorted((name, _comparable(value)) for name, value in facts.items())))
    except Exception:  # noqa: BLE001 - a value whose repr fails is compared as unreadable
        text = repr((what, "unreadable"))
    return zlib.crc32(text.encode())


def _agree(what: str, facts: dict, problem: Optional[BaseException], group, size: int,
           rule: str, differ: str) -> None:
    if size <= 1:
        if problem is not None:
            raise problem
        return
    row = [0 if problem is not None else 1, _digest(what, facts)]
    rows = distributed.gather_control_rows(f"{what} (the tensor-parallel ranks' agreement)",
                                           row, group, kind=_TP_AGREEMENT)
    if all(ok for ok, _ in rows) and len({digest for _, digest in rows}) == 1:
        return
    # Note: only here, where every rank saw the same rows (so every rank takes this branch),
    # the values travel, to name them in the message.
    mine = {"rank": distributed.get_rank(), "what": what,
            "facts": {name: (_shown(value), _comparable(value)) for name, value in facts.items()},
            "refusal": None if problem is None else
            (type(problem).__module__, type(problem).__qualname__, str(problem))}
    every = distributed.all_gather_object(mine, group, counted=False,
                                          operation=f"{what} (the ranks' values, for the error)")
    differences = _differences(every)
    refusing = [e for e in every if e["refusal"] is not None]
    if not refusing:
        what = " / ".join(dict.fromkeys(e["what"] for e in every))  # one text on every rank
        raise ValueError(f"{what}: the tensor-parallel ranks (global ranks "
                         f"{[e['rank'] for e in every]}) {differ}: {differences}; {rule}")
    if problem is not None and len(refusing) == len(every) and \
            all(e["refusal"] == mine["refusal"] for e in refusing):
        raise problem  # every rank refused alike: the error a single rank raises
    first = refusing[0]
    fine = [e["rank"] for e in every if e["refusal"] is None]
    others = [e["rank"] for e in refusing[1:] if e["refusal"] != first["refusal"]]
    where = (f"refused on global rank(s) {[e['rank'] for e in refusing]}, not on {fine}"
             if fine else f"global rank {first['rank']}'s refusal; every rank refused")
    where += f" (rank(s) {others} for other reasons)" if others else ""
    text = (f"{first['refusal'][2]} [{where}; raised on every rank of the tensor-parallel "
            f"group, so that none waits in a collective the others never join"
            + (f"; the ranks also differ: {differences}" if differences else "") + "]")
    raise _error_class(first["refusal"])(text) from problem


def _shown(value: Any) -> str:
    """How a compared value reads in the message: ``torch.Size([4, 64])`` as ``(4, 64)``, a
    number as Python's (:func:`_plain`: ``np.int64(16)`` as ``16``)."""
    if isinstance(value, tuple):  # torch.Size too
        return repr(_plain(tuple(value)))
    try:
        return repr(_plain(value))
    except Exception:  # noqa: BLE001
        return f"<unreadable {type(value).__name__}>"


def _differences(every: list) -> str:
    """``name per tensor-parallel rank: [v0, v1, ...]`` for each compared name on which the
    gathered entries differ, ``"; "``-joined (or the layer, where the ranks build or call
    different ones); empty when none does."""
    if len({e["what"] for e in every}) > 1:
        return (f"layer per tensor-parallel rank: {[e['what'] for e in every]} (the ranks build "
                f"or call different layers at the same point)")
    parts = []
    names = list(dict.fromkeys(name for e in every for name in e["facts"]))
    for name in names:  # each fact: (as shown, as compared)
        values = [e["facts"].get(name, ("(absent)", None)) for e in every]
        if len({compared for _, compared in values}) > 1:
            parts.append(f"{name} per tensor-parallel rank: "
                         f"[{', '.join(shown for shown, _ in values)}]")
    return "; ".join(parts)


def _error_class(refusal: tuple) -> type:
    """The refusal's class when it is a built-in exception (ValueError, TypeError,
    IndexError, ...), so that every rank raises what the refusing rank would; else
    ``RuntimeError``."""
    module, qualname, _ = refusal
    found = getattr(builtins, qualname, None) if module == "builtins" else None
    return found if isinstance(found, type) and issubclass(found, Exception) else RuntimeError
