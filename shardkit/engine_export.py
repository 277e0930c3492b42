"""How ``engine.save_16bit_model`` tells every rank whether rank 0's write succeeded, without a
collective, so that a script may call it on rank 0 alone where nothing must be gathered.

DeepSpeed documents that every process calls ``save_16bit_model``, but at ZeRO stages 0-2 its
call on rank 0 alone works (the model is whole on every rank; only rank 0 writes), and scripts
rely on it (``if rank == 0: engine.save_16bit_model(dir)``). A broadcast of rank 0's outcome
then waited forever for the ranks that never called. Here rank 0 posts the outcome on the
default group's store under a key naming the engine, the version of its weights (bumped on
every rank by each step and each checkpoint load) and which call this is at that version
(:class:`SaveCalls`), and never waits; a rank that does call waits (at most the group's
timeout) for that key and raises rank 0's error as its own.

The call number pairs each rank's n-th call at a version with rank 0's n-th write: a second
save of the same weights (a retry once the directory is fixed, the file written again after
``load_module_state_dict``, or with other ``exclude_frozen_parameters``) reads rank 0's
outcome of that second write, not of the first (which made a rank raise an old error while
rank 0 went on, return before rank 0 had written, or return True while rank 0 raised). The
file is not part of the key, so ranks that name it differently (a time stamp computed on each
rank) still read rank 0's outcome at once. Where rank 0 alone also saved at the same version
(``if rank == 0:``), the others' later calls pair with its earlier writes of those same
weights.
"""

from __future__ import annotations

import datetime
import itertools
from typing import Optional

import torch.distributed as dist

from shardkit import distributed

# engines are built by every rank in the same order (initialize is collective): the n-th
# engine of each rank carries the same serial, which keeps keys of different engines apart
_ENGINE_SERIALS = itertools.count()
_DEFAULT_WAIT_S = 1800.0
_SUCCEEDED = "ok"
_FAILED = "error:"


def next_engine_serial() -> int:
    """The serial of an engine being built (the same on every rank)."""
    return next(_ENGINE_SERIALS)


class SaveCalls:
    """One engine's count of this rank's ``save_16bit_model`` calls at the current weights
    version (an older version's count is forgotten)."""

    def __init__(self):
        self._version: Optional[int] = None
        self._calls = 0

    def count(self, weights_version: int) -> int:
        """Count a call at ``weights_version``; returns its number (1 first)."""
        if weights_version != self._version:
            self._version, self._calls = weights_version, 0
        self._calls += 1
        return self._calls


def outcome_key(engine_serial: int, weights_version: int, call: int) -> str:
    """The store key of rank 0's outcome of its ``call``-th write at ``weights_version``
    (:meth:`SaveCalls.count`)."""
    return distributed.per_attempt_store_key(
        f"shardkit/save_16bit_model/{engine_serial}/{weights_version}/{call}")


def post_outcome(key: str, error: Optional[str]) -> None:
    """Rank 0: publish ``error`` (``None``: written) under ``key``. Never waits."""
    dist.distributed_c10d._get_default_store().set(
        key, _SUCCEEDED if error is None else _FAILED + error)


def await_outcome(key: str, path: str) -> Optional[str]:
    """A rank other than 0: rank 0's error text for ``key`` (``None``: written), waiting at
    most the default group's timeout for rank 0 to post it; a RuntimeError after that."""
    wait_s = distributed.timeout_of() or _DEFAULT_WAIT_S
    store = dist.distributed_c10d._get_default_store()
    try:
        store.wait([key], datetime.timedelta(seconds=wait_s))
    except (RuntimeError, dist.DistStoreError) as error:
        raise RuntimeError(
            f"engine.save_16bit_model: rank 0 did not report writing {path} within {wait_s:g} s "
            f"(the group's timeout); rank 0 writes the file, so it must call "
            f"save_16bit_model too (every rank, or rank 0 alone at ZeRO stages 0-2 without "
            f"tensor parallelism). The store said: {error}") from error
    outcome = store.get(key).decode()
    return None if outcome == _SUCCEEDED else outcome[len(_FAILED):]
