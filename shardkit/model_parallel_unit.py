"""DeepSpeed's model-parallel unit (``mpu=``) for :func:`shardkit.initialize`: which
tensor- and data-parallel groups an engine runs over, and where each tensor-parallel rank's
slices go in a checkpoint (``TAG/mp_rank_XX``, as DeepSpeed names them).

Policy only: the groups are read from the ``mpu`` (or from the model's tensor-parallel layers)
and checked locally; the wrappers that run over them are :mod:`shardkit.recipes`'s. No memory,
no communication beyond reading group membership.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from shardkit import distributed
from shardkit.checkpoint.sharded import TENSOR_PARALLEL_LAYOUT
from shardkit.config import ConfigError
from shardkit.utils.grad_norm import tensor_parallel_groups

__all__ = ["MPU_METHODS", "ModelParallelGroups", "model_parallel_groups", "mp_rank_name",
           "checkpoint_location", "TENSOR_PARALLEL_LAYOUT",
           "write_tensor_parallel_layout", "read_tensor_parallel_layout"]


# DeepSpeed's model-parallel unit (``mpu=``): the methods the engine calls on it
MPU_METHODS = ("get_model_parallel_group", "get_model_parallel_rank",
               "get_model_parallel_world_size", "get_data_parallel_group",
               "get_data_parallel_rank", "get_data_parallel_world_size")


@dataclass(frozen=True)
class ModelParallelGroups:
    """The tensor- and data-parallel groups an engine runs over (DeepSpeed's ``mpu``, read once
    by :func:`~shardkit.initialize`): the wrappers, the batch split and the checkpoint's files
    follow ``data_ranks``; each of ``tensor_ranks`` holds other slices of the split weights. A
    value: no memory, no communication."""

    tensor_group: object
    tensor_ranks: tuple
    data_group: object
    data_ranks: tuple

    @property
    def tensor_size(self) -> int:
        """Ranks that split each tensor-parallel layer."""
        return len(self.tensor_ranks)

    @property
    def data_size(self) -> int:
        """Data-parallel replicas (the batch is split over these)."""
        return len(self.data_ranks)

    @property
    def tensor_rank(self) -> int:
        """This rank's index in its tensor-parallel group."""
        return self.tensor_ranks.index(distributed.get_rank())

    @property
    def data_rank(self) -> int:
        """This rank's index in its data-parallel group."""
        return self.data_ranks.index(distributed.get_rank())


def model_parallel_groups(model: nn.Module, mpu=None) -> Optional[ModelParallelGroups]:
    """The groups :func:`~shardkit.initialize` runs over: ``mpu``'s when given, else those the
    model's tensor-parallel layers were built with (``shardkit.nn.model_parallel``); ``None`` for
    plain data parallelism over the world (no split layers and no ``mpu``, or an ``mpu`` of
    tensor-parallel size 1 whose data group is the world).

    Raises :class:`ConfigError` (local, before any collective) for an ``mpu`` missing one of
    :data:`MPU_METHODS` or whose answers contradict each other, groups of the model's layers
    that are not ``mpu``'s, and pipeline-parallel sizes above 1."""
    marked = tensor_parallel_groups(model.parameters(), "initialize(model=...)")
    if marked is not None:
        _refuse_pipeline_stages(len(marked.pipeline_ranks), "the model's tensor-parallel layers")
    if mpu is None:
        if marked is None:
            return None
        return ModelParallelGroups(marked.tensor, tuple(marked.tensor_ranks), marked.data,
                                   tuple(marked.data_ranks))
    groups = _groups_of_mpu(mpu)
    if marked is not None and (tuple(marked.tensor_ranks) != groups.tensor_ranks
                               or tuple(marked.data_ranks) != groups.data_ranks):
        raise ConfigError(
            f"initialize(mpu=...): the model's tensor-parallel layers were built over "
            f"tensor-parallel ranks {list(marked.tensor_ranks)} and data-parallel ranks "
            f"{list(marked.data_ranks)}, but mpu gives tensor-parallel ranks "
            f"{list(groups.tensor_ranks)} and data-parallel ranks {list(groups.data_ranks)} on "
            f"global rank {distributed.get_rank()}; pass the mpu the layers were built with "
            f"(shardkit.nn.model_parallel.initialize), or mpu=None")
    if groups.tensor_size == 1 and groups.data_size == distributed.get_world_size():
        return None
    return groups


def _groups_of_mpu(mpu) -> ModelParallelGroups:
    """Read ``mpu``'s groups and check its answers against them. Local: group membership and
    ranks only."""
    missing = [name for name in MPU_METHODS if not callable(getattr(mpu, name, None))]
    if missing:
        raise ConfigError(
            f"initialize(mpu={type(mpu).__name__}): missing method(s) {missing}; an mpu needs "
            f"{list(MPU_METHODS)} (e.g. shardkit.nn.model_parallel.initialize, after "
            f"initialize_model_parallel(tensor_parallel_size))")
    if not distributed.is_initialized():
        raise ConfigError("initialize(mpu=...): torch.distributed is not initialised; start the "
                          "process group and build the mpu's groups before initialize")
    try:
        pipeline = getattr(mpu, "get_pipeline_parallel_world_size", None)
        _refuse_pipeline_stages(pipeline() if callable(pipeline) else 1, "mpu")
        tensor_group, data_group = mpu.get_model_parallel_group(), mpu.get_data_parallel_group()
        groups = ModelParallelGroups(tensor_group, tuple(distributed.group_ranks(tensor_group)),
                                     data_group, tuple(distributed.group_ranks(data_group)))
        answers = {"get_model_parallel_world_size": (mpu.get_model_parallel_world_size(),
                                                     groups.tensor_size),
                   "get_model_parallel_rank": (mpu.get_model_parallel_rank(),
                                               _index_in(groups.tensor_ranks)),
                   "get_data_parallel_world_size": (mpu.get_data_parallel_world_size(),
                                                    groups.data_size),
                   "get_data_parallel_rank": (mpu.get_data_parallel_rank(),
                                              _index_in(groups.data_ranks))}
    except ConfigError:
        raise
    except Exception as error:  # an mpu whose groups do not exist yet
        raise ConfigError(f"initialize(mpu=...): the mpu could not report its groups: "
                          f"{type(error).__name__}: {error}") from error
    wrong = [f"{name}() = {said}, its group says {real}"
             for name, (said, real) in answers.items() if said != real]
    if wrong:
        raise ConfigError(f"initialize(mpu=...): the mpu contradicts its own groups on global "
                          f"rank {distributed.get_rank()}: {'; '.join(wrong)}")
    world = distributed.get_world_size()
    if groups.tensor_size * groups.data_size != world or \
            set(groups.tensor_ranks) & set(groups.data_ranks) != {distributed.get_rank()}:
        raise ConfigError(
            f"initialize(mpu=...): tensor-parallel size {groups.tensor_size} x data-parallel "
            f"size {groups.data_size} must be the world size {world}, with the groups meeting "
            f"in this rank only (tensor ranks {list(groups.tensor_ranks)}, data ranks "
            f"{list(groups.data_ranks)})")
    return groups


def _index_in(ranks: tuple) -> int:
    rank = distributed.get_rank()
    return ranks.index(rank) if rank in ranks else -1


def _refuse_pipeline_stages(stages: int, source: str) -> None:
    if stages > 1:
        raise ConfigError(
            f"initialize: {source} has pipeline-parallel size {stages}; the engine runs tensor "
            f"and data parallelism only (pipeline size 1). Train pipelines with "
            f"shardkit.nn.pipe (PipelineStage with Schedule1F1B or ScheduleGPipe) and OSS, "
            f"ShardedDataParallel or FullyShardedDataParallel over "
            f"shardkit.nn.model_parallel.get_data_parallel_group(), clipping with "
            f"shardkit.nn.model_parallel.clip_grad_norm")


def mp_rank_name(tensor_rank: int) -> str:
    """The directory of one tensor-parallel rank's slices inside a checkpoint tag."""
    return f"mp_rank_{tensor_rank:02d}"


def _saved_tensor_parallel_size(tag_dir: str) -> Optional[int]:
    """How many tensor-parallel ranks wrote the checkpoint in ``tag_dir`` (``TAG`` directory):
    the size its ``tensor_parallel.json`` records, 1 for a checkpoint written without tensor
    parallelism (its ``metadata.json`` directly in ``tag_dir``), ``None`` when ``tag_dir`` holds
    neither (no such tag, or an interrupted save). Local."""
    from shardkit.checkpoint.sharded import METADATA
    layout = read_tensor_parallel_layout(tag_dir)
    if layout is not None:
        return layout[0]
    return 1 if os.path.isfile(os.path.join(tag_dir, METADATA)) else None


def _why_no_checkpoint(load_dir: str, tag_dir: str) -> str:
    """Why ``tag_dir`` holds no checkpoint that a tensor-parallel engine can read: it does not
    exist (naming the tags ``load_dir`` holds), it holds ``mp_rank_XX`` slices without the
    layout file written after them, or neither. Local."""
    if not os.path.isdir(tag_dir):
        tags = sorted(d for d in os.listdir(load_dir)
                      if _saved_tensor_parallel_size(os.path.join(load_dir, d)) is not None) \
            if os.path.isdir(load_dir) else []
        return f"{tag_dir} does not exist; tags present: {tags}"
    if any(d.startswith("mp_rank_") for d in os.listdir(tag_dir)):
        return (f"{tag_dir} holds mp_rank_XX slices but no {TENSOR_PARALLEL_LAYOUT}, which the "
                f"save writes after them: the save was interrupted; load another tag")
    return f"{tag_dir} is not a shardkit checkpoint (no {TENSOR_PARALLEL_LAYOUT}, no metadata)"


def checkpoint_location(load_dir: str, tag: Optional[str],
                        parallel: Optional[ModelParallelGroups]):
    """``(directory, tag)`` to hand the checkpoint reader: ``(load_dir, tag)`` without tensor
    parallelism, ``(load_dir/TAG, mp_rank_XX)`` with it; unchanged when ``load_dir`` has no
    ``latest`` to follow (the reader agrees over the ranks that there is none). No
    communication.

    Raises :class:`~shardkit.checkpoint.CheckpointError` (the same on every rank: they read the same
    directory) for a checkpoint written at another tensor-parallel size, naming both sizes, and,
    under tensor parallelism, for a tag that holds no complete checkpoint, saying why (no such tag,
    naming those present; an interrupted save). Without tensor parallelism the reader names the
    latter itself."""
    from shardkit.checkpoint import CheckpointError, read_latest_tag
    resolved = tag if tag is not None else read_latest_tag(load_dir)
    if resolved is None:
        return load_dir, tag
    tag_dir = os.path.join(load_dir, resolved)
    saved = _saved_tensor_parallel_size(tag_dir)
    mine = 1 if parallel is None else parallel.tensor_size
    if saved is None and parallel is not None:
        raise CheckpointError(f"load_checkpoint({load_dir!r}, tag={resolved!r}): "
                              f"{_why_no_checkpoint(load_dir, tag_dir)}; nothing was loaded")
    if saved is not None and saved != mine:
        raise CheckpointError(
            f"load_checkpoint({load_dir!r}, tag={resolved!r}): the checkpoint was saved at "
            f"tensor-parallel size {saved}, this engine runs tensor-parallel size {mine}; "
            f"load it at tensor-parallel size {saved} (any data-parallel size and ZeRO stage), "
            f"or export its unsplit weights there (shardkit.nn.model_parallel.full_state."
            f"full_model_state_dict) and load them with load_full_model_state_dict before "
            f"initialize; nothing was loaded")
    if parallel is None:
        return load_dir, tag
    return tag_dir, mp_rank_name(parallel.tensor_rank)


def write_tensor_parallel_layout(tag_dir: str, size: int, splits: dict) -> None:
    """Write ``tag_dir/tensor_parallel.json``: the tensor-parallel size and, per split
    parameter's ``state_dict`` key, its ``[dim, stride]``, through a file renamed into place.
    What :func:`shardkit.checkpoint.consolidate.consolidate_checkpoint` reads to join the
    ``mp_rank_XX`` slices into the unsplit model. A few bytes per split parameter."""
    pending = os.path.join(tag_dir, f".{TENSOR_PARALLEL_LAYOUT}.tmp")
    with open(pending, "w") as f:
        json.dump({"size": size, "splits": {k: list(v) for k, v in sorted(splits.items())}}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(pending, os.path.join(tag_dir, TENSOR_PARALLEL_LAYOUT))


def read_tensor_parallel_layout(tag_dir: str) -> Optional[tuple[int, dict]]:
    """``(size, {key: (dim, stride)})`` of a tensor-parallel checkpoint's ``TAG`` directory,
    ``None`` for a checkpoint written without tensor parallelism."""
    path = os.path.join(tag_dir, TENSOR_PARALLEL_LAYOUT)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        layout = json.load(f)
    return int(layout["size"]), {k: (int(d), int(s)) for k, (d, s) in layout["splits"].items()}
