"""FSDP's row blocks as ``torch.distributed.checkpoint`` (dcp) sees sharded tensors.

FullyShardedDataParallel cuts each parameter on dim 0 into ``N`` blocks of ``ceil(rows / N)``
rows, the last ones zero padded (:class:`~shardkit.checkpoint.resharding.ParamLayout`). That is
exactly ``torch.chunk``'s cut, which a DTensor with ``Shard(0)`` placement uses for uneven sizes
(rank ``r`` holds rows ``[r*c, min((r+1)*c, rows))``, the last ranks possibly none), so this
rank's *real* rows (padding dropped) are its local tensor of a DTensor of the full shape over a
1-D device mesh of the unit's shard group. The shape and stride are given to
``DTensor.from_local``, so nothing is communicated and no full tensor is ever built. Ranks that
hold the same rows (replicas of hybrid sharding) produce the same dcp chunk (same key, same
offset), which dcp's save planner writes once.

- :func:`rows_as_dtensor`: a padded row block as that DTensor (a view: no copy). So, as with
  torch's ``fully_shard``, ``dcp.load`` into a ``SHARDED_STATE_DICT`` fills the live shards in
  place: a ``dcp.load`` that fails part way (a missing ``.distcp`` file) has already changed
  some of them; load a good checkpoint again before training on.
- :func:`rows_from_value`: the inverse, checked: a DTensor (e.g. filled by ``dcp.load``) or a
  full-shape plain tensor back to this rank's padded block.
- :func:`refuse_in_dcp`: a plain padded block (``LOCAL_STATE_DICT``, FairScale's contract:
  plain tensors of the shard's shape, for ``torch.save``) marked so that dcp refuses it with a
  clear error instead of silently saving one rank's rows as if replicated. (dcp's load planner
  compares a plain tensor's own size with the saved size, so a plain shard cannot be loaded as
  a chunk of a larger tensor; torch FSDP1 gives ShardedTensors there, which would change the
  shapes ``LOCAL_STATE_DICT`` users and tests rely on.)
- :func:`init_optimizer_state`: torch's zero-step that gives a fresh optimizer its state
  tensors, so that ``dcp.load`` has a state dict to load the saved state into.

Everything here is local (no communication).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from shardkit.checkpoint.resharding import ParamLayout, copy_rows_into, shard_rows

__all__ = ["device_mesh_of", "rows_as_dtensor", "rows_from_value",
           "refuse_in_dcp", "init_optimizer_state", "is_dtensor"]

_MESHES: dict = {}


def is_dtensor(value) -> bool:
    """Whether ``value`` is a ``DTensor``. Local."""
    from torch.distributed.tensor import DTensor
    return isinstance(value, DTensor)


def device_mesh_of(group, device_type: str):
    """The 1-D ``DeviceMesh`` over ``group`` (``DeviceMesh.from_group``: no communication),
    one per group and device type."""
    from torch.distributed.device_mesh import DeviceMesh
    import torch.distributed as dist
    group = dist.group.WORLD if group is None else group
    key = (id(group), device_type)
    entry = _MESHES.get(key)
    if entry is None or entry[0] is not group:
        entry = _MESHES[key] = (group, DeviceMesh.from_group(group, device_type))
    return entry[1]


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for size in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def rows_as_dtensor(block: torch.Tensor, layout: ParamLayout, rank: int, group):
    """This rank's block (``layout.shard_shape``, padded) as a ``Shard(0)`` DTensor of
    ``layout.shape`` over ``group``: its local tensor is a view of the block's real rows.
    ``layout.shape`` must have at least one dimension (a 0-dim tensor cannot be row-sharded).
    No communication, no copy.

    Where the rows start inside a unit's flat shard (every parameter but the unit's first),
    the local tensor is a tensor at offset 0 of a slice of the shard's storage (the same
    memory: ``dcp.load`` writes into the shard): torch gives a wrapper DTensor its local
    tensor's offset, which on the wrapper's empty storage made ``copy.deepcopy`` /
    ``torch.save`` fail ("invalid python storage"); a local tensor swapped in after
    construction breaks ``torch.compile``."""
    from torch.distributed.tensor import DTensor, Shard
    if not len(layout.shape):
        raise ValueError("rows_as_dtensor: a 0-dim tensor cannot be a Shard(0) DTensor")
    _, count = layout.real_rows(rank)
    local = block.reshape(-1, *layout.shape[1:])[:count]
    mesh = device_mesh_of(group, local.device.type)
    if local.storage_offset():
        # the same memory as a tensor of its own storage at offset 0 (a slice of the block's
        # storage, which keeps that alive): torch gives a wrapper DTensor its local tensor's
        # offset, which would be invalid on the wrapper's empty storage
        start = local.storage_offset() * local.element_size()
        piece = local.untyped_storage()[start:start + local.numel() * local.element_size()]
        local = torch.empty(0, dtype=local.dtype, device=local.device).set_(
            piece, 0, local.shape, local.stride())
    value = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                               shape=torch.Size(layout.shape),
                               stride=_contiguous_stride(layout.shape))
    return value


def rows_from_value(value, layout: ParamLayout, rank: int, what: str,
                    current: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's padded block (``layout.shard_shape``) from ``value``: a DTensor of the full
    shape whose local tensor is this rank's rows (what :func:`rows_as_dtensor` gives and
    ``dcp.load`` fills), a ``ShardedTensor`` of the full shape holding this rank's rows (what
    torch's ``load_sharded_optimizer_state_dict`` fills), or a plain tensor of the full shape
    (its rows are cut). Padding rows
    come from ``current`` (the block held now) or are zero. A ``ValueError`` naming ``what``
    otherwise. Local; memory: one block."""
    shape = tuple(layout.shape)
    if not torch.is_tensor(value) or tuple(value.shape) != shape:
        given = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise ValueError(f"{what}: the given value has shape {given}, the model's is {shape}")
    if is_sharded_tensor(value):
        local = _rows_of_sharded_tensor(value, layout, rank, what)
    elif not is_dtensor(value):
        block = shard_rows(value.detach(), layout, rank)
        return block if current is None else block.to(current.dtype)
    else:
        local = _rows_of_dtensor(value, layout, rank, what)
    first, _ = layout.real_rows(rank)
    if current is not None:
        block = current.detach().clone()
    else:
        block = torch.zeros(layout.shard_shape, dtype=local.dtype, device=local.device)
    copy_rows_into(block, local, first, layout, rank)
    return block


def is_sharded_tensor(value) -> bool:
    """Whether ``value`` is torch's (deprecated) ``ShardedTensor``, what torch's
    ``load_sharded_optimizer_state_dict`` fills."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    return isinstance(value, ShardedTensor)


def _rows_of_sharded_tensor(value, layout: ParamLayout, rank: int, what: str) -> torch.Tensor:
    """This rank's real rows of the full tensor from the local shards of ShardedTensor
    ``value`` (torch's ``load_sharded_optimizer_state_dict`` cuts dim 0 as torch.chunk does,
    over the default group: the rows this rank's FSDP shard holds when the unit shards over
    the whole world). A ValueError naming ``what`` when they do not cover those rows. Local;
    memory: one copy of the rows."""
    first, count = layout.real_rows(rank)
    rows = torch.empty((count, *layout.shape[1:]), dtype=value.dtype)
    covered = 0
    for shard in value.local_shards():
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        if any(offsets[1:]) or tuple(sizes[1:]) != tuple(layout.shape[1:]):
            continue
        low, high = max(first, offsets[0]), min(first + count, offsets[0] + sizes[0])
        if high > low:
            piece = shard.tensor.reshape(sizes)[low - offsets[0]:high - offsets[0]]
            rows = rows.to(piece.device)
            rows[low - first:high - first].copy_(piece)
            covered += high - low
    if covered != count:
        held = [(s.metadata.shard_offsets, s.metadata.shard_sizes) for s in value.local_shards()]
        raise ValueError(f"{what}: the ShardedTensor's local shards here (offsets, sizes) "
                         f"{held} do not hold this rank's shard of the model, rows "
                         f"[{first}, +{count}); load the optimizer state with "
                         f"torch.distributed.checkpoint into FSDP.optim_state_dict(model, optim) "
                         f"taken under StateDictType.SHARDED_STATE_DICT (after "
                         f"shardkit.checkpoint.dtensor_state.init_optimizer_state(optim))")
    return rows


def _rows_of_dtensor(value, layout: ParamLayout, rank: int, what: str) -> torch.Tensor:
    """The local tensor of DTensor ``value``, checked to be this rank's real rows."""
    shape = tuple(layout.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    sizes, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh,
                                                           value.placements)
    first, count = layout.real_rows(rank)
    expected = (count, *shape[1:])
    if tuple(sizes) != expected or tuple(offsets) != (first,) + (0,) * (len(shape) - 1):
        raise ValueError(f"{what}: the DTensor holds rows [{offsets[0] if len(offsets) else 0}, "
                         f"+{sizes[0] if len(sizes) else 0}) here (placements "
                         f"{tuple(value.placements)}), this rank's shard of the model is rows "
                         f"[{first}, +{count}); load the checkpoint with "
                         f"torch.distributed.checkpoint into the state dict the model gives "
                         f"under StateDictType.SHARDED_STATE_DICT")
    return value.to_local()


def refuse_in_dcp(block: torch.Tensor, name: str, source: str = "a LOCAL_STATE_DICT",
                  reason: Optional[str] = None) -> torch.Tensor:
    """Mark ``block`` (a plain tensor holding only this rank's rows of parameter ``name``, e.g.
    a ``LOCAL_STATE_DICT`` value) so that torch.distributed.checkpoint refuses it instead of
    taking it for a replicated tensor (it would write one rank's rows and load them on every
    rank): its save and load planners call the ``__create_write_items__`` /
    ``__create_chunk_list__`` hooks set here on the tensor object, which raise a
    ``RuntimeError`` naming the way that works (not a ``ValueError``: dcp's load planner
    replaces those with a message of its own); dcp raises it on every rank (as its
    ``CheckpointException``) before anything is written or loaded. The tensor itself, its
    shape and values are unchanged, ``torch.save`` writes it as a plain tensor (the hooks are
    left out of its pickled state), and a copy (``clone``) is a plain tensor. ``source``
    says in the message where the value comes from; ``reason`` replaces the message's
    explanation of a LOCAL_STATE_DICT's rows (why the value is this rank's alone, and what
    works instead). Local."""
    if reason is None:
        reason = ("its values are plain tensors of this rank's padded rows "
                  "under the same keys on every rank, which dcp would take for replicated "
                  "tensors (one rank's rows written, loaded on every rank). For dcp use "
                  "FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT) (DTensors, "
                  "reshardable to any world size); keep LOCAL_STATE_DICT for torch.save, one "
                  "file per rank, with local_metadata_dict() beside it")
    message = f"torch.distributed.checkpoint cannot save or load {name!r} of {source}: {reason}"

    def refuse(*_args):
        raise RuntimeError(message)

    block.__create_write_items__ = refuse
    block.__create_chunk_list__ = refuse
    block.__getstate__ = _no_python_state
    return block


def _no_python_state() -> dict:
    """The pickled Python state of a tensor marked by :func:`refuse_in_dcp`: none, so that
    ``torch.save`` writes it as a plain tensor (loadable with ``weights_only=True``)."""
    return {}


def init_optimizer_state(optim: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors without changing any parameter (torch's
    ``torch.distributed.checkpoint.state_dict`` does the same before loading): every trainable
    parameter gets a zero gradient and one ``step()`` runs with ``lr`` 0; gradients are then
    set to ``None``. Use it before ``FSDP.optim_state_dict(model, optim)`` on the loading side,
    so that ``dcp.load`` finds the state tensors (``exp_avg``...) to load into; the loaded
    state replaces everything the step created (``step`` included). Nothing is done when the
    optimizer has state already or any parameter has a gradient. Local.

    Note: the step runs without the optimizer's step hooks (torch's global ones and those on
    the instance): it is no training step. A hook that counts steps or updates an EMA would
    count it, and the hook a ``shardkit.initialize`` engine puts on its optimizer to refuse
    direct steps under gradient accumulation refused it, so ``get_state_dict(engine,
    engine.optimizer)`` failed before ``dcp.load`` with an error about a step the user never
    took."""
    if optim.state or any(p.grad is not None for g in optim.param_groups for p in g["params"]):
        return
    lrs = []
    for group in optim.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        lrs.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if torch.is_tensor(group["lr"]) else 0.0
    try:
        _step_without_hooks(optim)
    finally:
        for group, lr in zip(optim.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        optim.zero_grad(set_to_none=True)


def _step_without_hooks(optim: torch.optim.Optimizer) -> None:
    """``optim.step()`` with its step hooks (torch's global ones and the instance's) silenced
    for ``optim`` only. A ``step`` replaced on the instance runs as it is, except the one a
    torch ``LRScheduler`` puts there: it only notes that the optimizer stepped (which would
    hide torch's warning about ``scheduler.step()`` before the first real ``optimizer.step()``),
    so the class's ``step`` runs instead. Local.

    Note: silencing the hooks, rather than calling the function torch's hook-running wrapper
    wraps, also covers a subclass whose ``step`` calls ``super().step()``: that call goes
    through the parent class's wrapper, which runs every hook again."""
    replaced = vars(optim).get("step")
    with _step_hooks_silenced(optim):
        if replaced is not None and getattr(replaced, "_wrapped_by_lr_sched", False):
            type(optim).step(optim)
        else:
            optim.step()


@contextlib.contextmanager
def _step_hooks_silenced(optim: torch.optim.Optimizer):
    """Inside: no step pre/post hook runs for ``optim``; the global hooks still run for every
    other optimizer (another thread may be stepping one). The hook dicts are changed in place
    and restored, so the handles that remove hooks keep working. Local."""
    from torch.optim import optimizer as torch_optimizer
    own = [optim._optimizer_step_pre_hooks, optim._optimizer_step_post_hooks]
    shared = [torch_optimizer._global_optimizer_pre_hooks,
              torch_optimizer._global_optimizer_post_hooks]
    own_saved = [dict(hooks) for hooks in own]
    shared_saved = [dict(hooks) for hooks in shared]
    for hooks in own:
        hooks.clear()
    for hooks in shared:
        for key, hook in list(hooks.items()):
            hooks[key] = _skipping(hook, optim)
    try:
        yield
    finally:
        for hooks, before in zip(own, own_saved):
            hooks.update(before)
        for hooks, before in zip(shared, shared_saved):
            for key in before.keys() & hooks.keys():  # one removed meanwhile stays removed
                hooks[key] = before[key]


def _skipping(hook, optim: torch.optim.Optimizer):
    """``hook`` (a global step hook), not called for ``optim``."""
    def call(stepping, args, kwargs):
        return None if stepping is optim else hook(stepping, args, kwargs)
    return call
