"""Tensor-, pipeline- and data-parallel process groups over the world (FairScale/Megatron order).

The world of ``W`` ranks is viewed as a ``[data, pipeline, tensor]`` grid, tensor-parallel ranks
adjacent (they talk most, so they should share a node), then pipeline, then data::

    rank = data_index * (pipeline_length * tp) + pipeline_index * tp + tensor_index

With ``W = 8``, tensor 2, pipeline 2 (data 2): tensor groups ``[0,1] [2,3] [4,5] [6,7]``,
pipeline groups ``[0,2] [1,3] [4,6] [5,7]``, data groups ``[0,4] [1,5] [2,6] [3,7]``.

The layout itself is a pure value (:class:`ParallelLayout`); :func:`initialize_model_parallel`
creates the groups once, on every rank, and the getters read them back.

.. warning:: :func:`initialize_model_parallel` and :func:`destroy_model_parallel` must be called
   on every rank, in the same order (group creation is collective).
"""

from __future__ import annotations

import datetime
import numbers
from dataclasses import dataclass
from typing import Optional

from shardkit import distributed

__all__ = [
    "ParallelLayout", "initialize_model_parallel", "model_parallel_is_initialized",
    "destroy_model_parallel", "get_parallel_layout",
    "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
    "get_model_parallel_src_rank", "get_model_parallel_ranks",
    "get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
    "get_data_parallel_ranks",
    "get_pipeline_parallel_group", "get_pipeline_parallel_rank",
    "get_pipeline_parallel_world_size", "get_pipeline_parallel_ranks",
    "get_context_parallel_group", "get_context_parallel_rank",
    "get_context_parallel_world_size", "get_context_parallel_ranks",
]


@dataclass(frozen=True)
class ParallelLayout:
    """How ``world_size`` ranks split into tensor (``model_parallel_size``), pipeline and data
    parallelism. Pure arithmetic, identical on every rank; no communication, no memory."""

    world_size: int
    model_parallel_size: int
    pipeline_length: int = 1

    def __post_init__(self):
        for name in ("world_size", "model_parallel_size", "pipeline_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelLayout: {name}={value!r}; it must be an int >= 1")
        tp, pp, world = self.model_parallel_size, self.pipeline_length, self.world_size
        if world % (tp * pp):
            raise ValueError(
                f"world size {world} is not divisible by tensor-parallel size "
                f"(model_parallel_size) {tp} × pipeline size (pipeline_length) {pp} = {tp * pp}; "
                f"choose sizes whose product divides {world}")

    @property
    def data_parallel_size(self) -> int:
        """Replicas: ``world_size / (model_parallel_size * pipeline_length)``."""
        return self.world_size // (self.model_parallel_size * self.pipeline_length)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(data_index, pipeline_index, tensor_index)`` of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={self.world_size})")
        tp, pp = self.model_parallel_size, self.pipeline_length
        return rank // (tp * pp), (rank // tp) % pp, rank % tp

    def rank_at(self, data: int, pipeline: int, tensor: int) -> int:
        """Global rank at grid position ``(data, pipeline, tensor)``."""
        tp, pp = self.model_parallel_size, self.pipeline_length
        return data * tp * pp + pipeline * tp + tensor

    def tensor_groups(self) -> list[list[int]]:
        """Every tensor-parallel group (adjacent ranks), in creation order."""
        return [[self.rank_at(d, p, t) for t in range(self.model_parallel_size)]
                for d in range(self.data_parallel_size) for p in range(self.pipeline_length)]

    def pipeline_groups(self) -> list[list[int]]:
        """Every pipeline group (one rank per stage, same tensor and data index)."""
        return [[self.rank_at(d, p, t) for p in range(self.pipeline_length)]
                for d in range(self.data_parallel_size) for t in range(self.model_parallel_size)]

    def data_groups(self) -> list[list[int]]:
        """Every data-parallel group (same pipeline stage and tensor index)."""
        return [[self.rank_at(d, p, t) for d in range(self.data_parallel_size)]
                for p in range(self.pipeline_length) for t in range(self.model_parallel_size)]


@dataclass(frozen=True)
class _Groups:
    layout: ParallelLayout
    tensor: object
    tensor_ranks: tuple
    pipeline: object
    pipeline_ranks: tuple
    data: object
    data_ranks: tuple
    # FairScale's context-parallel group: only size 1 is provided, this rank alone
    context: object = None

    @property
    def tensor_rank(self) -> int:
        """This rank's index in its tensor-parallel group."""
        return self.tensor_ranks.index(distributed.get_rank())

    def __deepcopy__(self, memo) -> "_Groups":
        return self  # process groups cannot be copied; a copied layer shares them

    def __reduce__(self):
        # A pickled parameter (torch.save of a parameter, or of a state dict with keep_vars)
        # keeps its other marks and loses this one: process groups mean nothing elsewhere.
        return _no_groups, ()


def _no_groups() -> None:
    """What a pickled :class:`_Groups` loads as."""
    return None


# the groups of the current initialize_model_parallel, under "groups": emptied with the world
# they were built in (destroy_process_group, shardkit.distributed.destroy), so a later world
# in the same process never gets groups that point into a torn-down one
_CURRENT = distributed.GroupCache()


def _current_groups() -> Optional[_Groups]:
    """The current groups, ``None`` before :func:`initialize_model_parallel`, after
    :func:`destroy_model_parallel` or once the world they were built in is gone. Local."""
    return _CURRENT.current().get("groups")


def initialize_model_parallel(model_parallel_size: int, pipeline_length: int = 1,
                              context_parallel_size: int = 1, *,
                              model_parallel_backend: Optional[str] = None,
                              pipeline_backend: Optional[str] = None,
                              cp_backend: Optional[str] = None,
                              ddp_backend: Optional[str] = None,
                              timeout: Optional[datetime.timedelta] = None) -> None:
    """Create the tensor-, pipeline- and data-parallel groups for this rank.

    Args:
        model_parallel_size: ranks that split each layer (tensor parallelism); adjacent ranks.
        pipeline_length: pipeline stages; the data-parallel size is what remains,
            ``world_size / (model_parallel_size * pipeline_length)``.
        context_parallel_size: FairScale's newer argument; only ``1`` (no context
            parallelism) is provided.
        model_parallel_backend, pipeline_backend, ddp_backend: the backend of the tensor-,
            pipeline- and data-parallel groups (default: the default group's), as FairScale.
        cp_backend: accepted for FairScale's signature; the context-parallel group
            (:func:`get_context_parallel_group`) is this rank alone, on the default backend.
        timeout: a ``datetime.timedelta`` for every group created (default: torch's).

    Costs one all-gather of the sizes (so that ranks passing different ones fail instead of
    waiting for each other), then ``world/tp + world/pp + world/dp`` group creations (store
    rendezvous, no tensor traffic), plus, the first time in a world, one group of each rank
    alone (the context-parallel groups); no model memory. Must be called on every rank.
    Sizes may be Python or NumPy integers.

    Raises:
        RuntimeError: torch.distributed is not initialised, or the groups already exist.
        ValueError: a size below 1, a world size not divisible by
            ``model_parallel_size * pipeline_length`` (the message has the numbers), or sizes
            that differ between ranks (on every rank).
    """
    _check_fairscale_options(context_parallel_size, timeout, {
        "ddp_backend": ddp_backend, "model_parallel_backend": model_parallel_backend,
        "pipeline_backend": pipeline_backend, "cp_backend": cp_backend})
    backend_of = {"data": ddp_backend, "tensor": model_parallel_backend,
                  "pipeline": pipeline_backend}
    timeout_s = None if timeout is None else timeout.total_seconds()
    distributed.require_initialized("initialize_model_parallel")
    existing = _current_groups()
    if existing is not None:
        raise RuntimeError(
            f"initialize_model_parallel: groups already exist ({existing.layout}); call "
            f"destroy_model_parallel() first")
    model_parallel_size, pipeline_length = _as_int(model_parallel_size), _as_int(pipeline_length)
    _check_same_sizes_on_every_rank(model_parallel_size, pipeline_length)
    layout = ParallelLayout(distributed.get_world_size(), model_parallel_size, pipeline_length)
    rank = distributed.get_rank()
    found = {}
    # Every rank creates every group, in the same order: new_group is collective.
    for kind, groups in (("data", layout.data_groups()), ("tensor", layout.tensor_groups()),
                         ("pipeline", layout.pipeline_groups())):
        for ranks in groups:
            group = distributed.new_group(ranks, backend=backend_of[kind], timeout_s=timeout_s)
            if rank in ranks:
                found[kind] = (group, tuple(ranks))
    context = distributed.single_rank_group()  # collective the first time, then cached
    _CURRENT.current()["groups"] = _Groups(layout, *found["tensor"], *found["pipeline"],
                                           *found["data"], context)


def _as_int(size):
    """A NumPy or other integral size as a Python int (FairScale takes ``int(...)`` of it);
    anything else unchanged, for :class:`ParallelLayout` to refuse by name."""
    if isinstance(size, numbers.Integral) and not isinstance(size, bool):
        return int(size)
    return size


def _check_same_sizes_on_every_rank(model_parallel_size, pipeline_length) -> None:
    """Raise the same ``ValueError`` on every rank when the ranks passed different sizes: they
    would create different groups and wait for each other forever. One all-gather of two
    small objects over the default group."""
    passed = distributed.all_gather_object((model_parallel_size, pipeline_length))
    if len(set(passed)) > 1:
        detail = "; ".join(f"rank {r}: model_parallel_size={tp!r}, pipeline_length={pp!r}"
                           for r, (tp, pp) in enumerate(passed))
        raise ValueError(f"initialize_model_parallel: the ranks passed different sizes "
                         f"({detail}); every rank must pass the same ones")


def _check_fairscale_options(context_parallel_size, timeout, backends: dict) -> None:
    """FairScale's extra arguments of :func:`initialize_model_parallel` (``backends``: argument
    name -> value), checked before any group is created."""
    if context_parallel_size != 1:
        raise ValueError(f"initialize_model_parallel(context_parallel_size="
                         f"{context_parallel_size!r}): context parallelism is not provided; "
                         f"pass 1 (tensor, pipeline and data parallelism are)")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise ValueError(f"initialize_model_parallel(timeout={timeout!r}): expected a "
                         f"datetime.timedelta or None")
    for name, backend in backends.items():
        if backend is not None and not isinstance(backend, str):
            raise ValueError(f"initialize_model_parallel({name}={backend!r}): expected a "
                             f"backend name such as 'gloo' or 'nccl', or None")


def model_parallel_is_initialized() -> bool:
    """True between :func:`initialize_model_parallel` and :func:`destroy_model_parallel`, while
    the default process group they were built under lives."""
    return _current_groups() is not None


def destroy_model_parallel() -> None:
    """Forget the groups so that :func:`initialize_model_parallel` may run again (all ranks).

    The process groups themselves are not torn down (torch frees them with the default group);
    layers built earlier keep the groups they were built with, and so do
    :func:`~shardkit.nn.model_parallel.clip_grad_norm` and
    :func:`~shardkit.nn.model_parallel.reduce_sequence_parallel_grads` given their parameters
    (pass a layer's ``tp_group`` to ``vocab_parallel_cross_entropy``).
    """
    _CURRENT.current().pop("groups", None)


def current_groups(what: str) -> _Groups:
    """The groups of the current :func:`initialize_model_parallel` (a frozen value that stays
    valid after :func:`destroy_model_parallel`; layers keep the one they were built with).
    ``RuntimeError`` naming ``what`` when there are none."""
    return _groups(what)


def groups_of(tagged, what: str) -> _Groups:
    """The groups that the parameters or layers in ``tagged`` were built with (their
    ``model_parallel_groups``; an untagged one, such as a LayerNorm's weight, follows the
    others), else the current ones. No communication.

    Raises:
        ValueError: they come from layers built under different layouts (two models of other
            tensor- or pipeline-parallel sizes mixed in one call).
        RuntimeError: none is tagged and there are no current groups.
    """
    found = {}
    for obj in tagged:
        groups = getattr(obj, "model_parallel_groups", None)
        if groups is not None:
            found.setdefault(groups.layout, groups)
    if len(found) > 1:
        raise ValueError(
            f"{what}: the parameters come from layers built under different model-parallel "
            f"layouts {list(found)}; pass the parameters of one model at a time")
    return next(iter(found.values())) if found else _groups(what)


def tensor_parallel_mates(process_groups: list, params, caller: str, consequence: str,
                          argument: str = "process_group") -> tuple:
    """``(mates, problem)``: how many ranks of this rank's tensor-parallel group the groups in
    ``process_groups`` (``None``: the default group) hold at most, when ``params`` hold
    tensor-parallel parameters (``tensor_model_parallel``, set by shardkit's and Megatron's
    layers; 1 otherwise), and the error to raise when that is more than one: such ranks hold
    different slices of the same layers, and a data-parallel wrapper over them would mix the
    slices silently (``consequence`` says how; ``caller`` and ``argument`` name the wrapper
    and its group argument). Local (the groups the layers were built with): FSDP agrees on
    ``mates`` over its groups before raising and ``compose`` on its refusal; OSS raises at
    once (every rank of such a group holds such layers alike)."""
    split = [p for p in params if getattr(p, "tensor_model_parallel", False)]
    if not split or (_current_groups() is None and
                     not any(hasattr(p, "model_parallel_groups") for p in split)):
        return 1, None  # none split here, or marked by another library with no groups known
    tensor_ranks = set(groups_of(split, caller).tensor_ranks)
    shared = max((sorted(tensor_ranks & set(distributed.group_ranks(group)))
                  for group in process_groups), key=len)
    if len(shared) < 2:
        return 1, None
    return len(shared), (
        f"{caller}: its process group holds ranks {shared} of one tensor-parallel group, and "
        f"the model has tensor-parallel parameters (layers split across those ranks, e.g. "
        f"ColumnParallelLinear): each of them holds a different slice of the same layers, so "
        f"{consequence}. Build it over the data-parallel group instead: {argument}="
        f"shardkit.nn.model_parallel.get_data_parallel_group()")


def _groups(what: str) -> _Groups:
    groups = _current_groups()
    if groups is None:
        raise RuntimeError(
            f"{what} needs the model-parallel groups: call shardkit.nn.model_parallel."
            f"initialize_model_parallel(model_parallel_size, pipeline_length) on every rank first")
    return groups


def get_parallel_layout() -> ParallelLayout:
    """The :class:`ParallelLayout` the groups were built from."""
    return _groups("get_parallel_layout()").layout


def get_model_parallel_group():
    """The tensor-parallel process group of this rank."""
    return _groups("get_model_parallel_group()").tensor


def get_model_parallel_ranks() -> list[int]:
    """Global ranks of this rank's tensor-parallel group, in group order."""
    return list(_groups("get_model_parallel_ranks()").tensor_ranks)


def get_model_parallel_world_size() -> int:
    """Number of ranks in the tensor-parallel group."""
    return len(_groups("get_model_parallel_world_size()").tensor_ranks)


def get_model_parallel_rank() -> int:
    """This rank's index inside its tensor-parallel group."""
    return _groups("get_model_parallel_rank()").tensor_ranks.index(distributed.get_rank())


def get_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel index 0 in this rank's group (the broadcast source)."""
    return _groups("get_model_parallel_src_rank()").tensor_ranks[0]


def get_data_parallel_group():
    """The data-parallel process group of this rank (same stage and tensor index)."""
    return _groups("get_data_parallel_group()").data


def get_data_parallel_ranks() -> list[int]:
    """Global ranks of this rank's data-parallel group, in group order."""
    return list(_groups("get_data_parallel_ranks()").data_ranks)


def get_data_parallel_world_size() -> int:
    """Number of data-parallel replicas."""
    return len(_groups("get_data_parallel_world_size()").data_ranks)


def get_data_parallel_rank() -> int:
    """This rank's index inside its data-parallel group."""
    return _groups("get_data_parallel_rank()").data_ranks.index(distributed.get_rank())


def get_pipeline_parallel_group():
    """The pipeline process group of this rank (one rank per stage)."""
    return _groups("get_pipeline_parallel_group()").pipeline


def get_pipeline_parallel_ranks() -> list[int]:
    """Global ranks of this rank's pipeline, stage order."""
    return list(_groups("get_pipeline_parallel_ranks()").pipeline_ranks)


def get_pipeline_parallel_world_size() -> int:
    """Number of pipeline stages."""
    return len(_groups("get_pipeline_parallel_world_size()").pipeline_ranks)


def get_pipeline_parallel_rank() -> int:
    """This rank's stage index."""
    return _groups("get_pipeline_parallel_rank()").pipeline_ranks.index(distributed.get_rank())


def get_context_parallel_group():
    """FairScale's context-parallel group: this rank alone (only ``context_parallel_size=1``
    is provided)."""
    return _groups("get_context_parallel_group()").context


def get_context_parallel_ranks() -> list[int]:
    """Global ranks of this rank's context-parallel group: ``[this rank]``."""
    _groups("get_context_parallel_ranks()")
    return [distributed.get_rank()]


def get_context_parallel_world_size() -> int:
    """Ranks in the context-parallel group: 1."""
    _groups("get_context_parallel_world_size()")
    return 1


def get_context_parallel_rank() -> int:
    """This rank's index in its context-parallel group: 0."""
    _groups("get_context_parallel_rank()")
    return 0
