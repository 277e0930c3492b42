"""Collective debug mode: catch ranks that issue collectives in different orders.

Ranks that disagree about which collective comes next (a data-dependent branch, a module called
a different number of times on one rank, a rank that skips a step) hang, or worse, exchange the
wrong tensors without an error. With the debug mode on, every collective that goes through
:mod:`shardkit.distributed` is preceded by a check: the ranks of its group exchange a fingerprint
of the call (op, its reduction or root, per-group sequence number, shape, dtype, the layout a
transport declares with :func:`checking_layout`, a digest of the group's ranks, and the call
site, which is reported but not compared, shortened to fit the fixed-size fingerprint) and, if
any two differ, every rank raises :class:`CollectiveMismatchError` naming each rank's op and
call site, before the real collective runs. Turn it on with
``SHARDKIT_DEBUG_COLLECTIVES=1`` in the environment or :func:`set_debug_collectives`
(``shardkit.distributed.set_debug_collectives`` is the same function).

Cost: off by default, then one boolean test per collective. On: one extra all-gather of
``FINGERPRINT_BYTES`` bytes per rank on the collective's own group before each collective (a
synchronous round trip, so it also serialises asynchronous collectives), plus a stack walk;
``benchmarks/bench_collective_check.py`` measures it.

Collectives that :mod:`shardkit.transport` builds from point-to-point sends (its all-gathers,
reduce-scatters and reduces on gloo) are checked as the collective they stand for, with its
logical shape (the all-gather's output, the reduce-scatter's input) and dtype, once per batch.

Limits: plain point-to-point ops (send/recv) are not checked (only two ranks take part, in orders
that legitimately differ between pipeline stages); a rank that never reaches a collective of
the group (it waits in another group, or died) is not a mismatch but a hang, which the
process-group timeout or :mod:`shardkit.fault`'s watchdog reports. Sequence numbers are kept per
process group (its ``group_name``), so a group used from another thread (an asynchronous
checkpoint's) has its own; they start again at 0 with each new default process group.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["set_debug_collectives", "debug_collectives_enabled", "enabled_by_environment",
           "CollectiveMismatchError",
           "check_collective", "FINGERPRINT_BYTES", "encode_fingerprint", "checking_layout"]

FINGERPRINT_BYTES = 512
# Only these are checked: every rank of the group takes part in them.
CHECKED_OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                         "reduce", "barrier", "broadcast_object", "all_gather_object"})


def enabled_by_environment() -> bool:
    """Whether ``SHARDKIT_DEBUG_COLLECTIVES`` (read at import) asks for the debug mode."""
    return os.environ.get("SHARDKIT_DEBUG_COLLECTIVES", "0") not in ("", "0", "false", "False")


_enabled = enabled_by_environment()
_sequence: dict[str, int] = {}
_sequence_world = None  # the default group the counts in _sequence belong to
_state = threading.local()  # re-entry guard: the check's own all-gather is not checked
_HERE = os.path.dirname(os.path.abspath(__file__))
_SKIP_FILES = {os.path.join(_HERE, "distributed.py"), os.path.abspath(__file__)}


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group were about to issue different collectives; the message lists each
    rank's op, shape, dtype and call site."""


def set_debug_collectives(enabled: bool = True) -> None:
    """Turn the collective debug mode on or off in this process (call it on every rank, at the
    same point, e.g. right after ``init_distributed``). See the module docstring for its cost."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_debug_collectives(enabled={enabled!r}): expected True or False")
    _enabled = enabled


def debug_collectives_enabled() -> bool:
    """True when collectives are checked before they run."""
    return _enabled


@contextlib.contextmanager
def checking_layout(layout: Optional[tuple]):
    """Inside the block, the collectives checked on this thread also compare ``layout``: how
    the logical tensor is cut between ranks or tensors (an uneven all-gather's per-rank sizes,
    a chunked reduce-scatter's chunk sizes), plain values alike on every rank that issues the
    same collective. For a transport that builds a collective from sends and receives. Costs
    nothing with the mode off (the caller need not enter it then)."""
    previous = getattr(_state, "layout", None)
    _state.layout = None if layout is None else _plain(layout)
    try:
        yield
    finally:
        _state.layout = previous


def _plain(value):
    """``value`` with its tuples as lists (as JSON decodes them), for comparing fingerprints."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _call_site() -> str:
    """The innermost frame outside shardkit.distributed, and the first frame outside shardkit
    when that is a different one (the user's line that led to the collective)."""
    frame = sys._getframe(1)
    inner = user = None
    package = os.path.dirname(_HERE)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path not in _SKIP_FILES:
            where = f"{os.path.relpath(path) if path.startswith(os.getcwd()) else path}:" \
                    f"{frame.f_lineno} in {frame.f_code.co_name}"
            if inner is None:
                inner = where
            if not path.startswith(package + os.sep):
                user = where
                break
        frame = frame.f_back
    if user is None or user == inner:
        return inner or "?"
    return f"{inner} (from {user})"


def _group_key(group) -> tuple:
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _device_for(group) -> torch.device:
    """Where the fingerprints travel: :func:`shardkit.distributed._control_device`'s choice
    (CUDA under NCCL, else the CPU), as every control message of shardkit."""
    from shardkit import distributed  # it imports this module
    return distributed._control_device(group)


def check_collective(op: str, shape: Optional[tuple], dtype: Optional[torch.dtype],
                     group, detail: Optional[str] = None) -> None:
    """Compare this collective's fingerprint with every rank of ``group``; raise
    :class:`CollectiveMismatchError` on every rank if they differ. ``detail``: what else the
    ranks must agree on, as text (the reduction, ``"op=SUM"``; the root, ``"src=0"``). No-op
    when the mode is off, for unchecked ops, and for the check's own all-gather."""
    if not _enabled or op not in CHECKED_OPS or getattr(_state, "busy", False):
        return
    if not (dist.is_available() and dist.is_initialized()):
        return
    global _sequence_world
    if dist.group.WORLD is not _sequence_world:
        # Note: a new default group (after destroy_process_group and init_distributed, e.g.
        # re-forming the job around a replacement process) starts every count at 0 on every
        # rank; carrying on the old world's counts reads as a mismatch on every collective.
        _sequence.clear()
        _sequence_world = dist.group.WORLD
    ranks = _group_key(group)
    # Note: None and dist.group.WORLD are one group, so one count (two counts read as a
    # mismatch when one rank passed None and another WORLD to the same collective).
    key = "default" if group is None or group is dist.group.WORLD else \
        (getattr(group, "group_name", None) or f"ranks {ranks}")
    seq = _sequence.get(key, 0)
    _sequence[key] = seq + 1
    mine = {"op": op, "detail": detail, "seq": seq,
            "shape": None if shape is None else list(shape),
            "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
            "layout": getattr(_state, "layout", None),
            "ranks": _ranks_digest(ranks), "rank": dist.get_rank(), "site": _call_site()}
    _state.busy = True
    try:
        everyone = _exchange(mine, group, len(ranks))
    finally:
        _state.busy = False
    compared = ("op", "detail", "seq", "shape", "dtype", "layout", "ranks")
    if all(all(fp.get(k) == everyone[0].get(k) for k in compared) for fp in everyone):
        return
    lines = [f"  rank {fp['rank']}: {fp['op']}("
             + ("" if fp.get("detail") is None else f"{fp['detail']}, ")
             + f"shape={fp['shape']}, dtype={fp['dtype']}"
             + ("" if fp.get("layout") is None else f", layout={fp['layout']}")
             + f") #{fp['seq']} at {fp['site']}" for fp in everyone]
    raise CollectiveMismatchError(
        f"collective mismatch in the group of ranks {list(ranks)}: the ranks were about to issue "
        f"different collectives (compared: op, its reduction or root, sequence number, shape, "
        f"dtype, layout):\n"
        + "\n".join(lines))


def _ranks_digest(ranks: tuple) -> str:
    """The group's ranks in a few bytes (their number, first and last, and a hash of the list):
    a list of every rank would not fit in :data:`FINGERPRINT_BYTES` for a large group."""
    text = ",".join(map(str, ranks))
    return f"{len(ranks)}:{ranks[0]}-{ranks[-1]}:{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def encode_fingerprint(fingerprint: dict) -> bytes:
    """``fingerprint`` as JSON of at most :data:`FINGERPRINT_BYTES` bytes that decodes back with
    every compared field whole: only the reported call site is shortened (keeping its end), and
    a shape too long to fit is replaced by its digest. UTF-8, so a call site under a non-ASCII
    path costs its bytes, not six per character."""
    fingerprint = dict(fingerprint)
    raw = json.dumps(fingerprint, ensure_ascii=False).encode()
    for field, unit in (("layout", "sizes"), ("shape", "dims")):
        value = fingerprint.get(field)
        if len(raw) > FINGERPRINT_BYTES and value is not None \
                and len(json.dumps(value)) > FINGERPRINT_BYTES // 4:
            digest = hashlib.sha1(json.dumps(value).encode()).hexdigest()[:12]
            fingerprint[field] = f"{len(value)} {unit}, sha1 {digest}"
            raw = json.dumps(fingerprint, ensure_ascii=False).encode()
    site = str(fingerprint.get("site", "")).encode()
    while len(raw) > FINGERPRINT_BYTES and site:
        # keep the site's last bytes (its file, line and function), cut on a character boundary
        site = site[len(raw) - FINGERPRINT_BYTES + 3:].decode(errors="ignore").encode()
        fingerprint["site"] = "..." + site.decode()
        raw = json.dumps(fingerprint, ensure_ascii=False).encode()
    if len(raw) > FINGERPRINT_BYTES:  # only a caller's own oversized fields get here
        raise ValueError(f"collective fingerprint of {len(raw)} bytes does not fit in "
                         f"{FINGERPRINT_BYTES}: {raw[:120]!r}...")
    return raw


def _exchange(fingerprint: dict, group, n: int) -> list[dict]:
    """One all-gather of a fixed-size encoded fingerprint per rank."""
    raw = encode_fingerprint(fingerprint)
    from shardkit.distributed import _all_gather_tensor  # torch's, uncounted and unchecked
    device = _device_for(group)
    mine = torch.zeros(FINGERPRINT_BYTES, dtype=torch.uint8)
    mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = torch.empty(n * FINGERPRINT_BYTES, dtype=torch.uint8, device=device)
    _all_gather_tensor(out, mine.to(device), group=group)
    out = out.cpu().view(n, FINGERPRINT_BYTES)
    decoded = []
    for index, row in enumerate(out):
        text = bytes(row.tolist()).rstrip(b"\0").decode(errors="replace")
        try:
            decoded.append(json.loads(text))
        except json.JSONDecodeError:  # never equal to a decoded one, nor to another broken one
            decoded.append({"op": "?", "seq": -1 - index, "shape": None, "dtype": None,
                            "layout": None, "ranks": [], "rank": "?", "site": text[:120]})
    return decoded
