"""Process groups as shardkit uses them: this rank's place in a group, the groups it creates,
the caches that hold groups of the current world, and the checks of a call's group, tensors,
reduce op and peers that every collective makes first. Local, except :func:`new_group` and
:func:`single_rank_group` (group creation). Re-exported by :mod:`shardkit.distributed`."""

from __future__ import annotations

import datetime
import numbers
from typing import Optional, Sequence

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp


def is_initialized() -> bool:
    """True when the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def require_initialized(what: str) -> None:
    """Raise a clear error naming ``what`` when no process group exists yet."""
    if not is_initialized():
        raise RuntimeError(
            f"{what} needs torch.distributed to be initialised first: call "
            f"shardkit.distributed.init_distributed() (under torchrun) or "
            f"torch.distributed.init_process_group(...) before creating it")


def check_group(group, what: str, argument: str = "group", pair_ok: bool = False) -> None:
    """Raise a clear TypeError naming ``what(argument=...)`` unless ``group`` is ``None`` (the
    default group) or a process group (with ``pair_ok``, also a tuple of them, for hybrid
    sharding). torch's marker for a group this rank is not in passes, so that the caller's
    membership check can say so. Local: no collective."""
    if group is None or isinstance(group, dist.ProcessGroup) or _not_a_member(group):
        return
    if pair_ok and isinstance(group, tuple) and all(
            isinstance(g, dist.ProcessGroup) or _not_a_member(g) for g in group):
        return
    pair = " or a pair (intra_node_group, inter_node_group)" if pair_ok else ""
    raise TypeError(f"{what}({argument}={group!r}): must be a torch.distributed ProcessGroup "
                    f"(e.g. from new_group){pair}, or None for the default group")


def check_member(group, what: str, argument: str = "group") -> None:
    """Raise a clear ValueError naming ``what(argument=...)`` when this rank is not a member of
    ``group`` (or of one group of a pair), where torch would only say "Invalid process group
    specified". A wrapper over a sub-group is built on that sub-group's ranks only. Local; no
    communication."""
    groups = group if isinstance(group, tuple) else (group,)
    if any(_not_a_member(g) for g in groups):
        raise ValueError(f"{what}({argument}=...): global rank {get_rank()} is not a member of "
                         f"the given process group; build it on the group's ranks only")


def _not_a_member(group) -> bool:
    """Whether ``group`` is what ``new_group`` returns on a rank outside it (an int marker)."""
    marker = dist.GroupMember.NON_GROUP_MEMBER
    return type(group) is type(marker) and group == marker


def get_rank(group=None) -> int:
    """This process's rank inside ``group`` (``None``: the default group); 0 without a group."""
    if not is_initialized():
        return 0
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    """Number of ranks in ``group`` (``None``: the default group); 1 without a group."""
    if not is_initialized():
        return 1
    return dist.get_world_size(group)


def get_global_rank(group, group_rank: int) -> int:
    """Global rank of ``group_rank`` within ``group`` (identity for the default group)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def group_ranks(group) -> list[int]:
    """The global ranks that make up ``group``, in group-rank order."""
    return [get_global_rank(group, r) for r in range(get_world_size(group))]


def new_group(ranks: Sequence[int], timeout_s: Optional[float] = None,
              backend: Optional[str] = None, members_only: bool = False):
    """Create a process group over ``ranks`` (global ranks); ``backend`` defaults to the default
    group's (``"gloo"`` gives a CPU group beside an NCCL one), ``timeout_s`` to the default
    group's timeout (torch's ``new_group`` would take its backend's 30-minute default, so a rank
    that died left its peers waiting there half an hour instead of the timeout the job set).
    Must be called on every rank, or, with ``members_only``, on the members of ``ranks``
    only."""
    _check_call("new_group", None)
    kwargs = {"use_local_synchronization": True} if members_only else {}
    if timeout_s is None:
        timeout_s = timeout_of(None)
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if backend is not None:
        kwargs["backend"] = backend
    return dist.new_group(ranks=list(ranks), **kwargs)


# id(default group) -> (the default group, this rank's one-member group); the default group is
# held so that its id stays its own after a destroy_process_group and a new init
_SINGLE_RANK_GROUPS: dict = {}
_GROUP_CACHES: list = []  # every GroupCache, emptied by destroy()


class GroupCache(dict):
    """A dict in which a module keeps process groups (or what holds them) that it built for
    the current world, keyed as it likes (e.g. by ranks). Read it through :meth:`current`: the
    cache is emptied whenever the default group is no longer the one it was filled under
    (torch's ``destroy_process_group`` and a new init in the same process), and by
    :func:`~shardkit.distributed.destroy`, so a group of a torn-down world is never handed out
    again. Local."""

    def __init__(self):
        super().__init__()
        self._world = None
        _GROUP_CACHES.append(self)

    def current(self) -> "GroupCache":
        """This cache, emptied first if the world it was filled in is gone."""
        world = dist.group.WORLD if is_initialized() else None
        if world is not self._world:
            self.clear()
            self._world = world
        return self

    def forget(self) -> None:
        """Empty the cache and the world it was filled in (what
        :func:`~shardkit.distributed.destroy` does)."""
        self.clear()
        self._world = None


def single_rank_group():
    """A process group of this rank alone (FairScale's ``single_rank_pg``: nothing sharded or
    reduced over it), created by this rank alone on the first call (no other rank takes part,
    so some ranks may call it and others not), the same group after. Costs one gloo/NCCL
    group.

    Note: made world-wide (every rank creating every rank's group), it advanced the count
    torch names world groups by on the ranks that called it only, and the next group created
    over the whole world got other names on other ranks: every rank hung."""
    world = dist.group.WORLD
    entry = _SINGLE_RANK_GROUPS.get(id(world))
    if entry is None or entry[0] is not world:
        entry = _SINGLE_RANK_GROUPS[id(world)] = (world, new_group([get_rank()],
                                                                   members_only=True))
    return entry[1]


def resolved_group(group=None):
    """``group`` itself, or for ``None`` the default group's object (one key for either way of
    naming it). Local; no communication."""
    return group if group is not None else dist.group.WORLD


def timeout_of(group=None) -> Optional[float]:
    """Seconds after which ``group``'s operations time out, as its backend was created with, or
    ``None`` where the backend does not say. Local; no communication."""
    try:
        return resolved_group(group)._get_backend(
            torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


def backend_of(group=None) -> str:
    """The backend name of ``group`` (``"gloo"``, ``"nccl"``, ...); ``"none"`` without a group.
    Transports read it to choose an algorithm; wrappers never do."""
    if not is_initialized():
        return "none"
    return str(dist.get_backend(group))


# ----------------------------------------------------------------------------- argument checks


def _check_call(name: str, group, *tensors, reduce_op=None, **peers) -> None:
    """Raise a clear error for a bad call of the collective ``name``, on this rank, before
    anything is recorded or sent: no process group yet, a ``group`` that is not one, one of
    ``tensors`` that is not a tensor, a ``reduce_op`` that is not a ReduceOp, a peer (``src=``,
    ``dst=``: global ranks) outside ``group``. gloo crashes the whole process on a send to a
    rank out of range, so peers are checked here. A rank outside ``group`` is not checked
    further: torch skips the op there. Local; no communication."""
    what = f"shardkit.distributed.{name}"
    _require_process_group(what)
    check_group(group, what)
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if reduce_op is not None and not isinstance(reduce_op, (ReduceOp, ReduceOp.RedOpType)):
        raise TypeError(f"{what}(op={reduce_op!r}): must be a shardkit.distributed.ReduceOp "
                        f"(e.g. ReduceOp.SUM, ReduceOp.MAX)")
    if _not_a_member(group):
        return
    for argument, peer in peers.items():
        _check_peer(what, argument, peer, group)


def _require_process_group(what: str) -> None:
    """Raise a RuntimeError naming the collective ``what`` when no process group exists."""
    if not is_initialized():
        raise RuntimeError(f"{what} needs a process group: call "
                           f"shardkit.distributed.init_distributed() (under torchrun) or "
                           f"torch.distributed.init_process_group(...) first")


def _check_peer(what: str, argument: str, peer, group) -> None:
    """Raise ValueError unless ``peer`` is the global rank of a member of ``group``."""
    if group is None or group is dist.group.WORLD:
        ranks, valid = range(get_world_size()), f"an int in [0, {get_world_size()})"
    else:
        ranks = dist.get_process_group_ranks(group)
        valid = f"one of the group's global ranks {ranks}"
    if isinstance(peer, bool) or not isinstance(peer, numbers.Integral) or peer not in ranks:
        raise ValueError(f"{what}({argument}={peer!r}): must be a global rank of the group, "
                         f"{valid}")
