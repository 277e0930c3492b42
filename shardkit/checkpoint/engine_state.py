"""Turn a :class:`~shardkit.engine.ShardedEngine` into the stage-independent checkpoint form
and back.

Every stage reduces to the same picture: whole fp32 tensors and per-parameter optimizer state
keyed by the parameter's name in the unwrapped model. How a rank finds its part differs:

- stages 0-2: parameters are whole on every rank. The owner of a parameter (OSS's partition at
  stages 1-2, a balanced partition at stage 0) writes it and its optimizer state, which it holds
  locally; nothing crosses the wire.
- stage 3: FSDP holds every parameter as a dim-0 row block per rank. Each rank writes its
  blocks (``local_state_dict()``) and the matching blocks of its optimizer state; a reader at
  stages 0-2 joins them, a stage-3 reader cuts its own rows out of them. Nothing crosses the
  wire either.

Loading at stages 0-2 builds a full torch-format optimizer state dict in the engine's own
parameter order and gives it to the optimizer's public ``load_state_dict`` (OSS reshards it).
Loading at stage 3 keeps, from each file as it is read, only this rank's FSDP row block of every
parameter and of its optimizer state (:func:`read_checkpoint`'s ``keep_rows``), and loads them
with ``load_local_state_dict`` and a torch-format state dict of those blocks: no full tensor is
built. Either way any saved stage/world size loads into any other.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import warnings
import zlib
from typing import Optional

import torch

from shardkit import distributed
from shardkit.checkpoint.consolidate import is_tag_directory, tags_found
from shardkit.checkpoint.fsdp_state import param_cut
from shardkit.checkpoint.resharding import ParamLayout
from shardkit.checkpoint.sharded import (FORMAT, CheckpointError, RankShard,
                                         agreement_device, check_loads_back, check_tag,
                                         commit_checkpoint, plain_numbers, read_checkpoint,
                                         remove_abandoned_parts, remove_own_staging,
                                         resolve_checkpoint_dir,
                                         staging_dir)
from shardkit.nn.model_parallel.random import get_model_parallel_rng_tracker
from shardkit.optim.local_step import without_fused_choice
from shardkit.optim.lr_scheduler import loads_position_only
from shardkit.optim.master_weights import MASTER_WEIGHT_KEY, MasterWeights, master_weights_of
from shardkit.optim.partition import ParameterPartition

__all__ = ["save_engine_checkpoint", "load_engine_checkpoint", "rng_state", "set_rng_state"]

logger = logging.getLogger("shardkit")

_EXTRA_STATE = "_extra_state"  # the state_dict key of a module's get_extra_state(), as torch's
_MODEL_PARALLEL_STREAMS = "model_parallel"  # rng_state()'s key of the tracker's streams
_TORCH_GENERATORS = ("torch", "cuda", _MODEL_PARALLEL_STREAMS)  # rng_state()'s torch parts


# ----------------------------------------------------------------------------- save


def save_engine_checkpoint(engine, save_dir: str, tag: Optional[str],
                           client_state: Optional[dict], save_latest: bool = True,
                           async_save: bool = False, exclude_frozen_parameters: bool = False):
    """Save ``engine`` (see ``ShardedEngine.save_checkpoint``). Returns the checkpoint
    directory, or with ``async_save`` an :class:`~shardkit.checkpoint.async_save.AsyncSave`
    whose background thread writes the host copies made here. ``exclude_frozen_parameters``
    (DeepSpeed's) leaves the parameters that do not require grad out of the saved weights; the
    metadata lists them, and loading such a checkpoint keeps the model's own values for them."""
    tag = f"global_step{engine.global_steps}" if tag is None else tag
    check_tag(tag)  # before the stage-3 gathers: a bad tag fails on every rank, no traffic
    shard, metadata, payload, error = RankShard(), None, None, None
    try:
        shard, metadata, payload = _checkpoint_parts(
            engine, tag, client_state,
            _frozen_state_names(engine) if exclude_frozen_parameters else frozenset())
        if async_save:
            payload = copy.deepcopy(payload)  # the training loop goes on changing the originals
    except Exception as e:  # e.g. rank 0's scheduler state: raised on every rank by the commit
        error = e
    script_dir = _recovery_script_dir(engine, save_dir)
    group = getattr(engine, "checkpoint_group", None)
    if getattr(engine, "model_parallel", None) is not None \
            and distributed.get_rank(group) == 0:  # what killed saves left of this part
        remove_abandoned_parts(os.path.dirname(os.path.abspath(save_dir)), tag)
    if not async_save:
        return commit_checkpoint(save_dir, tag, shard, metadata, payload, save_latest,
                                 group=group,
                                 prepare_error=error, recovery_script_dir=script_dir)
    from shardkit.checkpoint.async_save import AsyncSave, checkpoint_group
    group = checkpoint_group()
    makes_staging = distributed.get_rank(group) == 0  # read now: the group may be gone later
    return AsyncSave(os.path.join(save_dir, tag), lambda: _committed_or_cleaned_up(
        lambda: commit_checkpoint(save_dir, tag, shard, metadata, payload, save_latest,
                                  group=group, prepare_error=error,
                                  recovery_script_dir=script_dir),
        staging_dir(save_dir, tag) if makes_staging else None))


def _committed_or_cleaned_up(commit, staging: Optional[str]) -> str:
    """``commit()``; where it fails outside the commit's own agreement (whose
    :class:`CheckpointError` comes after the staging directory is removed), e.g. its process
    group destroyed under it by ``torch.distributed.destroy_process_group()``, nothing was
    published, and the rank that made ``staging`` (``None`` on the others) removes it rather
    than leaving a full-size hidden copy behind."""
    try:
        return commit()
    except CheckpointError:
        raise
    except BaseException:
        if staging is not None:
            remove_own_staging(staging)
        raise


def _recovery_script_dir(engine, save_dir: str) -> Optional[str]:
    """Where this rank writes DeepSpeed's ``zero_to_fp32.py``: beside ``latest``, on global
    rank 0 only (``None`` elsewhere). Under tensor parallelism the engine saves each
    ``mp_rank_XX`` part with ``save_dir`` = ``DIR/TAG``: the script goes to ``DIR``."""
    if distributed.get_rank() != 0:
        return None
    if getattr(engine, "model_parallel", None) is not None:
        return os.path.dirname(os.path.abspath(save_dir))
    return save_dir


def _rank_and_world(engine) -> tuple[int, int]:
    """This rank's index among the ranks writing one checkpoint, and their number: the
    engine's ``checkpoint_group`` (its data-parallel group under tensor parallelism, whose
    slices each tensor-parallel rank writes apart), else the world. Local."""
    group = getattr(engine, "checkpoint_group", None)
    return distributed.get_rank(group), distributed.get_world_size(group)


def _frozen_state_names(engine) -> frozenset:
    """The unwrapped model's ``state_dict`` keys that hold a parameter not requiring grad (a
    tied alias of one included). Stage 3: the names recorded before wrapping. Local."""
    if engine.zero_stage == 3:
        return frozenset(engine.frozen_param_names)
    return frozenset(k for k, v in engine.module.state_dict(keep_vars=True).items()
                     if isinstance(v, torch.nn.Parameter) and not v.requires_grad)


def _checkpoint_parts(engine, tag: str, client_state: Optional[dict],
                      excluded: frozenset = frozenset()):
    """This rank's :class:`RankShard`, and on rank 0 the metadata and the engine payload
    (``None`` elsewhere), the payload checked to load back with ``weights_only=True``; the
    ``excluded`` state names (frozen parameters) are left out. Local: no communication (a
    failure here is agreed on by the commit's first all-reduce)."""
    if engine.zero_stage == 3:
        shard, groups, row_sharded = _row_sharded_shard(engine)
    else:
        (shard, groups), row_sharded = _replicated_param_shard(engine), {}
    if excluded:
        shard.params = {k: v for k, v in shard.params.items() if k not in excluded}
        shard.row_blocks = {k: v for k, v in shard.row_blocks.items() if k not in excluded}
        row_sharded = {k: v for k, v in row_sharded.items() if k not in excluded}
    shard.optim = plain_numbers(shard.optim)
    shard.rng = rng_state()
    rank, world = _rank_and_world(engine)
    if rank != 0:
        return shard, None, None
    metadata = {
        "format": FORMAT, "tag": tag, "world_size": world,
        "zero_stage": engine.zero_stage, "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps, "global_samples": engine.global_samples,
        "param_names": sorted(set(engine.module_state_names()) - excluded),
        "excluded_frozen": sorted(excluded),
        # zero_to_fp32: which names were frozen, and which share one tensor (alias -> name)
        "frozen": sorted(_frozen_state_names(engine)),
        "tied": _tied_state_names(engine, excluded),
        "row_sharded": row_sharded,
        "optimizer_class": type(_inner_optimizer_class(engine)).__name__,
        "scheduler_class": type(engine.lr_scheduler).__name__ if engine.lr_scheduler else None,
        "scheduler_structure": _scheduler_structure(engine.lr_scheduler)
        if engine.lr_scheduler else None,
        "precision": engine.config.precision.dtype,
    }
    payload = plain_numbers({
        "param_groups": groups,
        "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler else None,
    })
    check_loads_back(payload, "engine.save_checkpoint")
    payload["client_state"] = client_state or {}  # checked by the engine, before any traffic
    return shard, metadata, payload


def _tied_state_names(engine, excluded: frozenset) -> dict:
    """``{alias: name}`` for every ``state_dict`` key of the unwrapped model that holds the
    same tensor as an earlier key (tied weights), the excluded names left out. Local."""
    source = engine.wrapped.local_state_dict(keep_vars=True) if engine.zero_stage == 3 \
        else engine.module.state_dict(keep_vars=True)
    first, tied = {}, {}
    for name, value in source.items():
        name_of = first.setdefault(id(value), name)
        if name_of != name and name not in excluded and name_of not in excluded:
            tied[name] = name_of
    return tied


def _inner_optimizer_class(engine):
    """The optimizer instance whose class a checkpoint names: OSS's local one, and the one a
    :class:`~shardkit.optim.MasterWeights` steps the masters with (fp16/bf16 at stages 0-2),
    so that a checkpoint loads across precisions as across stages."""
    inner = getattr(engine.optimizer, "optim", None)
    inner = inner if isinstance(inner, torch.optim.Optimizer) else engine.optimizer
    return inner.inner if isinstance(inner, MasterWeights) else inner


def _owner_of(engine):
    """Which rank writes each parameter: OSS's owner when there is one, else a balanced
    split of the model's parameters (identical on every rank)."""
    param_to_rank = getattr(engine.optimizer, "param_to_rank", None)
    params = [p for _, p in engine.module.named_parameters()]
    fallback = ParameterPartition.balanced([params], _rank_and_world(engine)[1])
    if param_to_rank is None:
        return fallback.owner
    return lambda p: param_to_rank[p] if p in param_to_rank else fallback.owner(p)


def _local_optimizer_state(engine, param) -> Optional[dict]:
    """The optimizer state of ``param`` held on this rank (OSS: its local optimizer), without
    a :class:`~shardkit.optim.MasterWeights` master (written as the parameter's value)."""
    inner = getattr(engine.optimizer, "optim", None)
    source = inner if isinstance(inner, torch.optim.Optimizer) else engine.optimizer
    state = source.state.get(param)
    if state and isinstance(source, MasterWeights):
        state = {k: v for k, v in state.items() if k != MASTER_WEIGHT_KEY}
    return state or None


def _saved_value(engine, param) -> torch.Tensor:
    """What a checkpoint stores for ``param``: its fp32 value (the fp32 master of a 16-bit
    weight where the owner keeps one, so that fp16/bf16 checkpoints hold the exact fp32
    weights DeepSpeed's masters hold), as a CPU copy."""
    masters = master_weights_of(engine.optimizer)
    if masters is not None and masters.holds(param):
        param = masters.master_weight_of(param)
    return param.detach().to("cpu", torch.float32, copy=True)


def _load_master_weights(engine, weights: dict) -> None:
    """Stages 0-2 with fp16/bf16: each fp32 master this rank keeps set to the checkpoint's
    fp32 value of its parameter (the 16-bit weight just loaded is that value rounded; the
    master taken from it, or from an optimizer state that carries none, would have lost the
    low bits). Local."""
    masters = master_weights_of(engine.optimizer)
    if masters is None:
        return
    for name, param in engine.module.named_parameters():
        if name in weights and masters.holds(param):
            masters.set_master_weight(param, weights[name].to(param.device))


def _replicated_param_shard(engine):
    rank = _rank_and_world(engine)[0]
    owner = _owner_of(engine)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    shard = RankShard()
    # every name of a tied parameter (an output layer sharing the embedding) is written by
    # its owner from its fp32 value: rank 0's state_dict() would give the 16-bit copy
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if owner(p) != rank:
            continue
        if name != names[id(p)]:  # an alias: the same CPU tensor (saved once by torch.save)
            shard.params[name] = shard.params[names[id(p)]]
            continue
        shard.params[name] = _saved_value(engine, p)
        state = _local_optimizer_state(engine, p)
        if state:
            shard.optim[name] = {k: _cpu(v) for k, v in state.items()}
    if rank == 0:  # buffers: everything in state_dict that is not a parameter
        param_names = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
        for key, value in engine.module.state_dict().items():
            if key not in param_names:
                shard.params[key] = _cpu(value)
    groups = _groups_by_name(engine.optimizer, lambda p: names[id(p)])
    return shard, groups


def _row_sharded_shard(engine):
    """Stage 3: this rank's row block of every parameter and of its optimizer state, from
    FSDP's ``local_state_dict()`` and ``local_metadata_dict()`` (no communication; memory: one
    shard copy)."""
    local = engine.wrapped.local_state_dict()
    shapes = {name: list(shape)
              for name, shape in engine.wrapped.local_metadata_dict()["shapes"].items()}
    rank = _rank_and_world(engine)[0]
    shard = RankShard()
    for name, value in local.items():
        if name in shapes:
            shard.row_blocks[name] = value.detach().to("cpu", torch.float32, copy=True)
        elif rank == 0:  # buffers: the same on every rank
            shard.params[name] = _cpu(value)
    names = {id(p): n for n, p in engine.wrapped.named_parameters()}
    for name, p in engine.wrapped.named_parameters():
        state = engine.optimizer.state.get(p)
        if state and name in shapes:
            shard.optim[name] = {k: _cpu(v) for k, v in state.items()}
    groups = _groups_by_name(engine.optimizer, lambda p: names[id(p)])
    return shard, groups, shapes


def _groups_by_name(optimizer, name_of) -> list[dict]:
    """The optimizer's param groups with parameter names, and the implementation the caller
    asked for (``fused=None`` where OSS chose torch's fused kernel itself), so that the
    checkpoint loads into any optimizer as it would from that optimizer's own state dict."""
    fused = getattr(optimizer, "fused", False) is True
    return [{**without_fused_choice({k: v for k, v in g.items() if k != "params"}, fused),
             "params": [name_of(p) for p in g["params"]]} for g in optimizer.param_groups]


def _cpu(value):
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


# ----------------------------------------------------------------------------- load


def load_engine_checkpoint(engine, load_dir: str, tag: Optional[str],
                           load_optimizer_states: bool = True,
                           load_lr_scheduler_states: bool = True, strict: bool = True,
                           load_rng_state: bool = True):
    """What ``engine.load_checkpoint`` does: read the tag's checkpoint (verified), check its
    tensor names and shapes against the engine's model (and, with the optimizer states, that
    the same optimizer class saved them; with the scheduler's state, that a scheduler restoring
    its whole state, as torch's do, gets its own class's; a mismatch is a ``CheckpointError`` on
    every rank before anything is written), load the weights, optionally the optimizer and
    LR-scheduler state (resharded from any saved world size or stage), the loss scaler, the
    step counters and this rank's RNG state, whatever else is loaded or not (with the
    scheduler's state but not the optimizer's, the optimizer's lrs are set to the loaded
    position's, as the uninterrupted run holds them). The RNG state is the default
    generators', Python's, NumPy's and the model-parallel tracker's streams (those of a
    checkpoint written without them keep their state, with a warning); rank ``r`` of the
    checkpoint group takes saved rank ``r % saved_world``'s, exact at any world size when the
    saved ranks' torch states are equal, with a warning when they differ and the world size
    changed. ``load_rng_state=False`` (for ``load_module_only``, which keeps this process's
    RNG) neither restores nor warns about it.
    Returns ``(path, client_state)``, or
    ``(None, None)`` with a warning when ``load_dir`` has no checkpoint. Memory, on each
    rank's CPU: every rank reads all rank files one by one and keeps of each what it needs:
    stage 0 the full fp32 model and optimizer state, stages 1-2 the full fp32 model and its OSS
    share of the optimizer state, stage 3 only its row blocks (``1/N`` of the fp32 model and of
    the optimizer state, plus padding), the file being read memory-mapped. Communication: one
    six-element all-reduce (every rank agrees it read the checkpoint before any loads), then
    what loading into the wrappers costs (stage 3: nothing; stages 0-2: see the optimizer's
    ``load_state_dict``)."""
    ckpt = _read_and_check_on_every_rank(engine, load_dir, tag, load_optimizer_states,
                                         load_lr_scheduler_states, strict, load_rng_state)
    if ckpt is None:
        logger.warning("%s", _nothing_to_load(load_dir))
        return None, None
    weights = _with_excluded_kept(engine, ckpt)
    _load_model(engine, weights)
    if load_optimizer_states:
        _load_optimizer(engine, ckpt.optim, ckpt.engine["param_groups"])
    _load_master_weights(engine, weights)
    if load_lr_scheduler_states and engine.lr_scheduler is not None \
            and ckpt.engine["scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(ckpt.engine["scheduler"])
        if not load_optimizer_states:
            _set_scheduled_values(engine.lr_scheduler, engine.optimizer)
    if engine.loss_scaler is not None and ckpt.engine["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(ckpt.engine["loss_scaler"])
    engine.global_steps = int(ckpt.metadata["global_steps"])
    engine.skipped_steps = int(ckpt.metadata.get("skipped_steps", 0))
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    # DeepSpeed's: the samples as counted when saved (a run that changed its batch size);
    # the steps after this one count at this run's batch size. Older checkpoints: steps x batch
    samples = ckpt.metadata.get("global_samples")
    engine._steps_before_resize = engine.global_steps
    engine._samples_before_resize = int(samples) if samples is not None \
        else engine.global_steps * engine.config.train_batch_size
    if load_rng_state:
        rng = _saved_rng_state_of(engine, ckpt)  # checked before any load: cannot fail here
        _warn_about_rng_not_continued(engine, ckpt, rng)
        set_rng_state(rng)
    return ckpt.path, ckpt.engine["client_state"]


def _set_scheduled_values(scheduler, optimizer) -> None:
    """The optimizer's lrs (and the cycled momentum, ``beta1``, of OneCycle and of torch's
    ``OneCycleLR`` / ``CyclicLR``) at the scheduler's loaded position.

    Without the optimizer's state its param groups still hold the values a fresh schedule
    starts from (WarmupLR's ``warmup_min_lr``, WarmupCosineLR's 0), so the first step after
    the load would run at them; the uninterrupted run holds the loaded position's. Local."""
    last_lrs = getattr(scheduler, "get_last_lr", None)
    if last_lrs is None:
        return
    for group, lr in zip(optimizer.param_groups, last_lrs()):
        if isinstance(group["lr"], torch.Tensor):  # a tensor lr keeps its identity
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    if not getattr(scheduler, "cycle_momentum", False):
        return
    if hasattr(scheduler, "momenta_at"):
        momenta = scheduler.momenta_at(scheduler.last_batch_iteration)
        for group, beta1 in zip(optimizer.param_groups, momenta):  # one per group
            group["betas"] = (beta1, group["betas"][1])
    elif isinstance(scheduler, (torch.optim.lr_scheduler.OneCycleLR,
                                torch.optim.lr_scheduler.CyclicLR)):
        # torch's compute the momentum of their position in get_lr() and set it on the
        # param groups as they do (its lrs are dropped: set above)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "use get_last_lr()": meant for other callers
            scheduler.get_lr()


def _read_and_check_on_every_rank(engine, load_dir: str, tag: Optional[str],
                                  with_optimizer: bool, with_scheduler: bool = False,
                                  strict: bool = True, with_rng: bool = True):
    """The checked checkpoint (``None`` when ``load_dir`` has none), read by every rank, which
    then agree before any loads: a rank that cannot read it, or finds none while others do (a
    directory that is not shared, a damaged file one node sees), makes every rank raise a
    :class:`CheckpointError` rather than go on with other weights or wait in a collective; so
    do ranks that read different checkpoints (another ``tag`` passed on some rank, a node-local
    ``latest`` that names another tag), which would each load their own weights and steps.
    Communication: one six-element all-reduce."""
    ckpt, error = None, None
    try:
        path = resolve_checkpoint_dir(load_dir, tag)
        if path is not None:
            ckpt = read_checkpoint(path, with_optimizer=with_optimizer,
                                   keep_optim=_optimizer_state_kept_here(engine),
                                   keep_rows=_rows_kept_here(engine))
            if strict:
                _check_names(engine, ckpt)
            else:
                _keep_common_names(engine, ckpt, with_optimizer)
            _check_shapes(engine, ckpt)  # before anything is written: a mismatch changes nothing
            if with_optimizer:
                _check_optimizer_class(engine, ckpt)
                _check_regrouped_hyper_parameters(engine, ckpt)
                _check_optimizer_state(engine, ckpt)
            if with_scheduler:
                _check_scheduler_class(engine, ckpt)
            if with_rng:
                _saved_rng_state_of(engine, ckpt)
    except Exception as e:  # raised on every rank below
        error = e
    which = _checkpoint_identity(engine, ckpt) if ckpt is not None else None
    crc = 0 if which is None else zlib.crc32(which.encode())
    low, high = crc & 0xFFFF, crc >> 16  # two 16-bit halves: sums of squares stay exact
    failed, found, lows, low_squares, highs, high_squares = _count_over_ranks(
        error is not None, ckpt is not None, low, low * low, high, high * high)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"load_checkpoint({load_dir!r}, tag={tag!r}) failed on {failed} "
                              f"other rank(s) (see their errors); nothing was loaded")
    world = distributed.get_world_size()
    if 0 < found < world:
        raise CheckpointError(
            f"load_checkpoint({load_dir!r}, tag={tag!r}): {found} of "
            f"{world} ranks found a checkpoint there, "
            f"{'this one' if ckpt is not None else 'not this one'}; every rank must see the "
            f"same directory (a filesystem shared by the nodes); nothing was loaded")
    if found and (low_squares * world != lows * lows  # equal codes on every rank, and only then
                  or high_squares * world != highs * highs):
        raise CheckpointError(
            f"load_checkpoint({load_dir!r}, tag={tag!r}): the ranks resolved different "
            f"checkpoints (this rank: {which}); pass the same tag on every rank (and let "
            f"every rank read the same 'latest'); nothing was loaded")
    return ckpt


def _checkpoint_identity(engine, ckpt) -> str:
    """What every rank loading one checkpoint has in common: its tag (under tensor
    parallelism the ``TAG`` above the ``mp_rank_XX`` parts; a re-save's retired copy under the
    tag's own name) and the saved step counters. Names only, not paths: nodes may mount the
    shared directory at other paths. Local."""
    path = os.path.normpath(ckpt.path)
    if getattr(engine, "model_parallel", None) is not None:
        path = os.path.dirname(path)
    name = os.path.basename(path)
    name = name[len(".old-"):] if name.startswith(".old-") else name
    return (f"tag {name!r} at global step {ckpt.metadata['global_steps']} "
            f"({ckpt.metadata.get('skipped_steps', 0)} skipped)")


def _optimizer_state_kept_here(engine):
    """Stages 1-2: which parameters' optimizer state this rank's OSS keeps (those it owns, and
    those outside its partition, which it parks by index), as a predicate on names, so that
    reading the checkpoint drops the other ranks' state file by file; ``None`` (all) at stages
    0 and 3, whose optimizer takes the full state. Local."""
    param_to_rank = getattr(engine.optimizer, "param_to_rank", None)
    if engine.zero_stage == 3 or param_to_rank is None:
        return None
    rank = _rank_and_world(engine)[0]
    owned = {name for name, p in engine.module.named_parameters()
             if param_to_rank.get(p, rank) == rank}
    return owned.__contains__


def _rows_kept_here(engine):
    """Stage 3: for each parameter name of the unwrapped model, the FSDP layout it is sharded
    by and this rank's index in it, as read_checkpoint's ``keep_rows`` (buffers: ``None``, kept
    whole); ``None`` at stages 0-2, whose parameters are whole. From
    ``local_metadata_dict()``: local, no communication."""
    if engine.zero_stage != 3:
        return None
    meta = engine.wrapped.local_metadata_dict()
    if meta["own_group_params"]:
        raise CheckpointError(
            f"load_checkpoint: parameter(s) {meta['own_group_params'][:4]} belong to FSDP units "
            f"sharded over process groups of their own (experts), which an engine checkpoint "
            f"cannot reshard; nothing was loaded")
    cuts = {name: param_cut(meta, name)[:2] for name in meta["shapes"]}
    layouts = {name: (ParamLayout(torch.Size(shape), cuts[name][0]), cuts[name][1])
               for name, shape in meta["shapes"].items()}
    return layouts.get


def _count_over_ranks(*flags) -> list[int]:
    """The sums over the world of small integers (flags and 16-bit codes, and their squares:
    exact in float64 up to 2**21 ranks)."""
    counts = torch.tensor([float(f) for f in flags], dtype=torch.float64,
                          device=agreement_device())
    distributed.all_reduce(counts)
    return [int(c) for c in counts.tolist()]


def _nothing_to_load(load_dir: str) -> str:
    """The warning of a ``load_checkpoint`` that found no ``latest`` file (DeepSpeed's
    behaviour: nothing loaded, ``(None, None)`` returned), with what to pass instead where the
    directory shows it: one tag's own directory (the easy slip, ``ckpt/global_step3`` for
    ``ckpt``) or tags present without a ``latest`` file."""
    if is_tag_directory(load_dir):
        parent, tag = os.path.split(os.path.normpath(load_dir))
        return (f"load_checkpoint: {load_dir} is one checkpoint's own directory, not the "
                f"directory given to save_checkpoint: pass {parent or '.'!r} with tag={tag!r}; "
                f"nothing loaded")
    tags = tags_found(load_dir)
    if tags:
        return (f"load_checkpoint: no 'latest' file in {load_dir}; pass tag= to load one of "
                f"the checkpoints there ({', '.join(tags)}); nothing loaded")
    return f"load_checkpoint: no 'latest' file in {load_dir}; nothing loaded"


def _with_excluded_kept(engine, ckpt) -> dict:
    """``ckpt``'s weights, plus this model's own values of the frozen parameters the save left
    out (``exclude_frozen_parameters=True``): stage 3 this rank's row blocks, else the full
    tensors. Local."""
    excluded = set(ckpt.metadata.get("excluded_frozen", ())) - set(ckpt.params)
    if not excluded:
        return ckpt.params
    source = engine.wrapped.local_state_dict() if engine.zero_stage == 3 \
        else engine.module.state_dict()
    kept = {k: v for k, v in source.items() if k in excluded}
    # a kept name of a parameter tied to a loaded one (one tensor, two names) would write the
    # old value back over the loaded one: it takes the loaded value, as torch's load leaves it
    for name, loaded in _tied_to_loaded(engine, kept, ckpt.params).items():
        kept[name] = ckpt.params[loaded]
    return {**kept, **ckpt.params}


def _tied_to_loaded(engine, kept: dict, loaded: dict) -> dict:
    """For each name in ``kept`` whose parameter is also the model's parameter under a name in
    ``loaded`` (tied weights, as an embedding and its output layer), that name. Local."""
    names_of: dict = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    tied = {}
    for names in names_of.values():
        source = next((n for n in names if n in loaded), None)
        if source is not None:
            tied.update({n: source for n in names if n in kept})
    return tied


def _check_names(engine, ckpt) -> None:
    expected = set(engine.module_state_names())
    # frozen parameters a save with exclude_frozen_parameters=True left out keep their values
    expected -= set(ckpt.metadata.get("excluded_frozen", ()))
    saved = set(ckpt.metadata["param_names"])
    if expected != saved:
        raise CheckpointError(
            f"load_checkpoint({ckpt.path}): the model does not match the checkpoint; missing "
            f"in the checkpoint: {sorted(expected - saved)[:5]}, unexpected: "
            f"{sorted(saved - expected)[:5]}")


def _keep_common_names(engine, ckpt, with_optimizer: bool) -> None:
    """``load_checkpoint(load_module_strict=False)`` (torch's ``strict=False``, which Hugging
    Face's Trainer passes when resuming a PEFT model): the model's tensors the checkpoint lacks
    keep their values (as the frozen ones a save left out), and the checkpoint's tensors the
    model lacks are dropped; shapes of the common names are still checked. Optimizer state
    is matched by the names of the parameters the optimizers step: when those differ it cannot
    be loaded, a :class:`CheckpointError` naming ``load_optimizer_states=False`` (buffers or
    frozen parameters that differ do not stop it). Local."""
    expected = set(engine.module_state_names())
    saved = set(ckpt.metadata["param_names"]) | set(ckpt.metadata.get("excluded_frozen", ()))
    missing, unexpected = sorted(expected - saved), sorted(saved - expected)
    if not missing and not unexpected:
        return
    if with_optimizer:
        _check_same_optimized_names(engine, ckpt)
    for name in unexpected:
        ckpt.params.pop(name, None)
        ckpt.shapes.pop(name, None)
    ckpt.metadata = {**ckpt.metadata,
                     "param_names": sorted(set(ckpt.metadata["param_names"]) - set(unexpected)),
                     "excluded_frozen": sorted(set(ckpt.metadata.get("excluded_frozen", ()))
                                               | set(missing))}


def _check_same_optimized_names(engine, ckpt) -> None:
    """A :class:`CheckpointError` when the parameters the saving optimizer stepped (its param
    groups, by name) are not this engine's optimizer's: its state cannot be matched. Local."""
    mine = set(_optimizer_param_order(engine))
    theirs = {name for group in ckpt.engine["param_groups"] for name in group["params"]}
    if mine != theirs:
        raise CheckpointError(
            f"load_checkpoint({ckpt.path}, load_module_strict=False): the optimizer state is of "
            f"other parameters than this engine's optimizer steps (missing in the checkpoint: "
            f"{sorted(mine - theirs)[:5]}, unexpected: {sorted(theirs - mine)[:5]}), so it "
            f"cannot be matched to them; pass load_optimizer_states=False (or "
            f"load_module_only=True); nothing was loaded")


def _model_shapes(engine) -> dict:
    """The full shape of every tensor in the unwrapped model's ``state_dict``, by name (stage 3:
    FSDP's :meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel.full_shapes`, no gather). A
    module's ``_extra_state`` (``get_extra_state``: any object, or a tensor of serialized bytes
    whose length varies) is left out, as torch's ``load_state_dict`` hands it to ``set_extra_state``
    unchecked. No communication."""
    if engine.zero_stage == 3:
        return {name: shape for name, shape in engine.wrapped.full_shapes().items()
                if not name.endswith(_EXTRA_STATE)}
    return {name: tuple(v.shape) for name, v in engine.module.state_dict().items()
            if isinstance(v, torch.Tensor) and not name.endswith(_EXTRA_STATE)}


def _check_shapes(engine, ckpt) -> None:
    """A :class:`CheckpointError` naming the tensors whose saved shape is not the model's (the
    checkpoint of another configuration of the same model), raised on every rank before any
    weight is written or any collective starts. Local: no communication."""
    model = _model_shapes(engine)
    wrong = [f"{name}: {saved} in the checkpoint, {tuple(model[name])} in the model"
             for name, saved in ckpt.shapes.items()
             if name in model and tuple(saved) != tuple(model[name])]
    if wrong:
        raise CheckpointError(
            f"load_checkpoint({ckpt.path}): size mismatch, the checkpoint is of another model "
            f"configuration ({len(wrong)} tensor(s)): {'; '.join(wrong[:5])}; nothing was loaded")


def _check_optimizer_class(engine, ckpt) -> None:
    """Optimizer state loads only into the optimizer class that saved it (its param groups
    replace the engine's, whose step would then miss its own hyper-parameters). Local."""
    saved = ckpt.metadata.get("optimizer_class")
    mine = type(_inner_optimizer_class(engine)).__name__
    if saved == "NoOptimizer" and mine != saved:
        raise CheckpointError(
            f"load_checkpoint({ckpt.path}): the checkpoint was saved by an engine without an "
            f"optimizer (forward only) and holds no optimizer state for this engine's {mine}; "
            f"load its weights with load_checkpoint(..., load_optimizer_states=False) (or "
            f"load_module_only=True); nothing was loaded")
    if saved is not None and saved != mine:
        raise CheckpointError(
            f"load_checkpoint({ckpt.path}): the optimizer state was saved by {saved}, this "
            f"engine's optimizer is {mine}; load the weights only with "
            f"load_checkpoint(..., load_optimizer_states=False) (or load_module_only=True), or "
            f"use {saved}; nothing was loaded")


def _check_regrouped_hyper_parameters(engine, ckpt) -> None:
    """A :class:`CheckpointError` when one of this engine's param groups holds parameters
    that the saving optimizer kept in groups with different hyper-parameters (saved: weights
    at one lr, biases at another; now one group): the load gives a group one saved group's
    hyper-parameters (see :func:`_torch_format`), so the others' parameters would go on
    silently at values they were never trained with. torch's ``load_state_dict`` refuses any
    other grouping; a regrouping whose saved groups agree loads. Local."""
    saved_groups = ckpt.engine["param_groups"]
    saved_index = {name: i for i, g in enumerate(saved_groups) for name in g["params"]}
    order, start = _optimizer_param_order(engine), 0
    for index, group in enumerate(engine.optimizer.param_groups):
        names = order[start:start + len(group["params"])]
        start += len(group["params"])
        drawn = sorted({saved_index[n] for n in names if n in saved_index})
        differing = _differing_hyper_parameters([saved_groups[i] for i in drawn])
        if differing:
            raise CheckpointError(
                f"load_checkpoint({ckpt.path}): param group {index} of this engine's optimizer "
                f"holds parameters of {len(drawn)} saved param groups ({drawn}) whose "
                f"hyper-parameters differ ({differing}), e.g. "
                f"{[next(n for n in names if saved_index.get(n) == i) for i in drawn]}; its "
                f"optimizer state can be loaded only into param groups that keep those apart "
                f"(as the saving optimizer's {len(saved_groups)}), or pass "
                f"load_optimizer_states=False; nothing was loaded")


def _differing_hyper_parameters(groups: list) -> str:
    """``'key': [value of each group]`` for the hyper-parameters (not ``params`` nor torch's
    ``param_names``) on which ``groups`` disagree, joined; empty when they agree. Local."""
    keys = sorted({k for g in groups for k in g if k not in ("params", "param_names")})
    differing = []
    for key in keys:
        values = [_comparable(g.get(key)) for g in groups]
        if any(v != values[0] for v in values[1:]):
            differing.append(f"{key!r}: {values}")
    return ", ".join(differing)


def _comparable(value):
    """A hyper-parameter as a plain value (a tensor lr or beta as its list). Local."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_comparable(v) for v in value]
    return value


def _check_scheduler_class(engine, ckpt) -> None:
    """A scheduler that restores its whole state (torch's, a script's own) loads only the
    state its own class saved: torch's ``load_state_dict`` copies every saved attribute onto
    the scheduler, so another class's state (WarmupLR's into StepLR) leaves a hybrid stepping
    by neither schedule. The same holds inside ``SequentialLR`` / ``ChainedScheduler``, which
    load each saved inner state into the inner scheduler at its index: their inner classes
    must match too (checkpoints without ``scheduler_structure`` are checked by class only).
    shardkit's DeepSpeed schedules take the saved position only, from any scheduler (as
    DeepSpeed's do), so only a saved state without a position (a script's own scheduler's)
    is refused for them. Local."""
    saved = ckpt.metadata.get("scheduler_class")
    scheduler, state = engine.lr_scheduler, ckpt.engine["scheduler"]
    if saved is None or scheduler is None or state is None:
        return
    if loads_position_only(scheduler):
        if not {"last_batch_iteration", "last_epoch"} & set(state):
            raise CheckpointError(
                f"load_checkpoint({ckpt.path}): the LR scheduler state was saved by {saved} "
                f"and holds no position ('last_batch_iteration' or 'last_epoch'; its keys: "
                f"{sorted(state)[:8]}), which this engine's {type(scheduler).__name__} takes; "
                f"start it fresh with load_checkpoint(..., load_lr_scheduler_states=False); "
                f"nothing was loaded")
        return
    saved_structure = ckpt.metadata.get("scheduler_structure")
    mine, theirs = (_scheduler_structure(scheduler), saved_structure) \
        if saved_structure is not None else (type(scheduler).__name__, saved)
    if mine == theirs:
        return
    raise CheckpointError(
        f"load_checkpoint({ckpt.path}): the LR scheduler state was saved by {theirs}, this "
        f"engine's scheduler is {mine}, which cannot take it; start the new schedule fresh "
        f"with load_checkpoint(..., load_lr_scheduler_states=False), or use {theirs}; "
        f"nothing was loaded")


def _scheduler_structure(scheduler) -> str:
    """The scheduler's class name, with the inner schedulers' structures in brackets for one
    that loads saved inner states by index (``SequentialLR(LinearLR, StepLR)``). Local."""
    inner = getattr(scheduler, "_schedulers", None)
    name = type(scheduler).__name__
    if not isinstance(inner, (list, tuple)):
        return name
    return f"{name}({', '.join(_scheduler_structure(s) for s in inner)})"


def _load_model(engine, params: dict) -> None:
    """Stage 3: ``params`` holds this rank's row blocks (and the buffers), loaded as FSDP's
    local state dict, into the shards (units kept gathered since a forward are freed first:
    their parameters are then the shards again); else the full tensors. No communication."""
    if engine.zero_stage == 3:
        engine.wrapped.reshard()
        engine.wrapped.load_local_state_dict(params)
    else:
        engine.module.load_state_dict(params, strict=True)


def _load_optimizer(engine, optim_by_name: dict, saved_groups: list) -> None:
    """Give the optimizer a torch-format state dict in its own parameter order: at stages
    0-2 of full tensors (OSS keeps its owned part), at stage 3 of this rank's row blocks, as
    read (its optimizer's parameters are those blocks)."""
    engine.optimizer.load_state_dict(_state_dict_in_order(engine, optim_by_name,
                                                          saved_groups)[0])


def _state_dict_in_order(engine, optim_by_name: dict, saved_groups: list) -> tuple:
    """``(torch-format state dict, parameter names in its index order)`` for the engine's
    optimizer (see :func:`_load_optimizer`). Local, no copy."""
    order = _optimizer_param_order(engine)
    groups, start = [], 0
    for g in engine.optimizer.param_groups:
        groups.append(list(range(start, start + len(g["params"]))))
        start += len(g["params"])
    return _torch_format(optim_by_name, order, groups, saved_groups), order


def _optimizer_param_order(engine) -> list:
    """The names (the unwrapped model's) of the optimizer's parameters, group after group.
    Local."""
    source = engine.wrapped if engine.zero_stage == 3 else engine.module
    name_of = {id(p): n for n, p in source.named_parameters()}
    return [name_of[id(p)] for g in engine.optimizer.param_groups for p in g["params"]]


def _check_optimizer_state(engine, ckpt) -> None:
    """Stages 1-2: the optimizer state this rank kept (its OSS share) must load into its OSS
    (:meth:`shardkit.optim.OSS.check_state_dict`: each state tensor's size, each parameter's
    state keys against those its optimizer keeps). Checked before the agreement, so that a
    bad key makes every rank raise before anything is written: the rank that kept that
    state names the parameter and the key, the others that a rank failed. Local."""
    check = getattr(engine.optimizer, "check_state_dict", None)
    if engine.zero_stage not in (1, 2) or check is None:
        return
    state_dict, order = _state_dict_in_order(engine, ckpt.optim, ckpt.engine["param_groups"])
    try:
        check(state_dict, labels=order)
    except ValueError as error:
        raise CheckpointError(f"load_checkpoint({ckpt.path}): {error}") from error


def _torch_format(optim_by_name: dict, order: list, groups: list, saved_groups: list) -> dict:
    """A torch ``Optimizer.state_dict()`` over ``order`` (index i = parameter ``order[i]``).

    Hyper-parameters come from the saved groups when the grouping matches; otherwise from the
    saved group that held the group's first parameter (the load refused before, where a group
    draws on saved groups that disagree: :func:`_check_regrouped_hyper_parameters`)."""
    state = {i: optim_by_name[name] for i, name in enumerate(order) if name in optim_by_name}
    group_of_name = {n: g for g in saved_groups for n in g["params"]}
    param_groups = []
    for indices in groups:
        saved = group_of_name.get(order[indices[0]]) if indices else None
        hyper = {k: v for k, v in (saved or saved_groups[0]).items() if k != "params"}
        param_groups.append({**hyper, "params": list(indices)})
    return {"state": state, "param_groups": param_groups}


# ----------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    """This process's RNG states (torch CPU, CUDA when present, Python, NumPy, and the
    model-parallel streams of :func:`~shardkit.nn.model_parallel.get_cuda_rng_tracker`, as
    Megatron saves its ``rng_tracker_states``), made only of tensors, numbers and tuples so
    that the checkpoint loads with ``weights_only=True``. Local."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             _MODEL_PARALLEL_STREAMS: get_model_parallel_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)}
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned (the model-parallel streams with
    ``RNGStatesTracker.resume_states``: streams the state lacks, as in checkpoints written
    before they were saved, keep theirs). Local."""
    if _MODEL_PARALLEL_STREAMS in state:  # first: the one part that checks what it is given
        get_model_parallel_rng_tracker().resume_states(state[_MODEL_PARALLEL_STREAMS])
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np
        s = state["numpy"]
        np.random.set_state((s["name"], s["keys"].numpy().astype(np.uint32), s["pos"],
                             s["has_gauss"], s["cached_gaussian"]))


def _saved_rng_state_of(engine, ckpt) -> dict:
    """The RNG state this rank resumes from: that of the saving rank of the same index in
    the checkpoint group modulo the saved world size (under tensor parallelism, of the same
    data-parallel index in this tensor-parallel rank's ``mp_rank_XX``). Checked, changing
    nothing: a model-parallel stream this process cannot take raises (see
    ``RNGStatesTracker.states_to_resume``). Local."""
    saved = ckpt.rng_by_rank[_rank_and_world(engine)[0] % ckpt.metadata["world_size"]]
    if _MODEL_PARALLEL_STREAMS in saved:
        try:
            get_model_parallel_rng_tracker().states_to_resume(saved[_MODEL_PARALLEL_STREAMS])
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"load_checkpoint({ckpt.path}): its model-parallel RNG "
                                  f"streams cannot be restored: {error}; nothing was "
                                  f"loaded") from error
    return saved


def _warn_about_rng_not_continued(engine, ckpt, saved: dict) -> None:
    """On global rank 0, one warning for each way the RNG states loaded cannot continue the
    saving run's draws: a checkpoint written before the model-parallel streams were saved,
    loaded where the tracker holds streams (they go on from the seed); a checkpoint whose
    ranks saved different torch generator states (default or model-parallel), loaded at
    another world size (rank ``r`` takes saved rank ``r % saved_world``'s: some ranks repeat
    another's draws, or some states are dropped). States equal on every saved rank (one seed
    everywhere, as the data-parallel replicas of a tensor-parallel run) continue exactly at any
    world size. Python's and NumPy's states are restored the same way, but not compared.
    Local."""
    if distributed.get_rank() != 0:
        return
    tracker = get_model_parallel_rng_tracker()
    if _MODEL_PARALLEL_STREAMS not in saved and tracker.names():
        warnings.warn(
            f"load_checkpoint({ckpt.path}): the checkpoint holds no model-parallel RNG streams "
            f"(written by an older shardkit); the tracker's streams {tracker.names()} keep "
            f"their current state, so dropout inside get_cuda_rng_tracker().fork() draws "
            f"other masks than the run that saved it would have", stacklevel=4)
    saved_world, world = ckpt.metadata["world_size"], _rank_and_world(engine)[1]
    # torch's generators only: Python's and NumPy's start from OS entropy in each process
    # that does not seed them, so they differ on the ranks of almost every run
    states = [{k: v for k, v in ckpt.rng_by_rank[r].items() if k in _TORCH_GENERATORS}
              for r in range(saved_world)]
    if saved_world != world and not all(_same(states[0], s) for s in states[1:]):
        warnings.warn(
            f"load_checkpoint({ckpt.path}): its {saved_world} ranks saved different torch RNG "
            f"states (seeded apart) and {world} ranks load it: rank r resumes saved rank "
            f"r % {saved_world}'s states, so {_rng_lost_by_resizing(saved_world, world)}; "
            f"reseed after load_checkpoint if the ranks must draw apart", stacklevel=4)


def _rng_lost_by_resizing(saved_world: int, world: int) -> str:
    """What loading rank ``r`` with saved rank ``r % saved_world``'s RNG states loses when
    ``world != saved_world``: the ranks that repeat other ranks' draws (those of saved ranks
    ``0..saved_world-1`` at most, however many ranks load), or the saved ranks whose draws are
    not continued."""
    if world < saved_world:
        return f"the draws of saved ranks {world}..{saved_world - 1} are not continued"
    repeated = min(saved_world, world - saved_world)
    return (f"ranks {saved_world}..{world - 1} repeat the draws (dropout masks) of ranks "
            f"0..{repeated - 1}")


def _same(a, b) -> bool:
    """Whether two saved RNG states (nested dicts, tuples, tensors, numbers) are equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() \
            and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) \
            and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
