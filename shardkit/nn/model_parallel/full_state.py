"""Export and load the unsplit state of a whole model built with tensor-parallel layers.

A model mixes :class:`~shardkit.nn.model_parallel.layers.TensorParallelModule` layers (sharded)
with ordinary ones (replicated on every tensor-parallel rank). Both functions go through the
model's own ``state_dict()`` / ``load_state_dict()``, so they work on the bare model and on the
model inside a wrapper (torch DDP, ShardedDataParallel, FullyShardedDataParallel over the
data-parallel group, whose state dict is already whole over that group): the keys are the
wrapper's own ``state_dict`` keys, the shapes the unsplit ones, so the result is what the same
model at tensor-parallel size 1 would hold. A module registered under several names (a shared
block) is found under each of them.

A parameter of a model's own split layer counts as split when it carries Megatron's marks
(what ``set_tensor_model_parallel_attributes`` sets, and what
:func:`~shardkit.nn.model_parallel.clip_grad_norm` and the data-parallel wrappers already read):
``tensor_model_parallel = True``, ``partition_dim`` (the dimension it is split along) and optionally
``partition_stride`` (default 1); its groups are its ``model_parallel_groups``, else the current
ones. Such a parameter without ``partition_dim`` is a ``ValueError``, as its slices cannot be
joined.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from shardkit import distributed
from shardkit.nn.data_parallel.fsdp_state_dict import state_dict_key
from shardkit.nn.model_parallel.initialize import current_groups, groups_of
from shardkit.nn.model_parallel.layers import TensorParallelModule, join_over_tensor_group
from shardkit.nn.model_parallel.parameter_marks import parameter_marks, restore_parameter_marks
from shardkit.nn.model_parallel.utils import shard_of

__all__ = ["full_model_state_dict", "load_full_model_state_dict", "split_specs",
           "sync_module_states"]


@dataclass(frozen=True)
class _Split:
    """How one ``state_dict`` entry is split over the tensor-parallel ranks: along ``dim``,
    ``stride`` blocks per rank (see :func:`~shardkit.nn.model_parallel.utils.shard_of`), over
    ``groups``' tensor-parallel group."""

    dim: int
    stride: int
    groups: object

    @property
    def size(self) -> int:
        return len(self.groups.tensor_ranks)

    def join(self, local: torch.Tensor) -> torch.Tensor:
        """The unsplit tensor from this rank's slice (one all-gather over the group)."""
        return join_over_tensor_group(local, self.dim, self.stride, self.groups.tensor,
                                      self.size)

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the unsplit ``full``. Local."""
        return shard_of(full, self.groups.tensor_rank, self.size, self.dim, self.stride)


def _split_keys(model: nn.Module, keys) -> dict[str, _Split]:
    """``state_dict`` key -> its :class:`_Split` for every key of ``keys`` that is a split
    parameter: of a tensor-parallel layer, or marked as Megatron marks one (see the module
    docstring). Module names are matched after removing the wrapper prefixes that state dicts
    drop (FSDP's, torch's checkpoint_wrapper's); no communication.

    Raises ``ValueError`` for a parameter marked ``tensor_model_parallel`` without
    ``partition_dim`` (the same on every rank: they hold the same model)."""
    of_layers = {id(getattr(module, pname)): _Split(spec[0], spec[1],
                                                    module.model_parallel_groups)
                 for module in model.modules() if isinstance(module, TensorParallelModule)
                 for pname, spec in module._shard_dims.items()
                 if spec is not None and getattr(module, pname, None) is not None}
    by_key = {}
    for name, module in model.named_modules(remove_duplicate=False):
        # (a module merely named like a wrapper level, my_checkpoint_wrapped_module, keeps it)
        prefix = state_dict_key(name + ".") if name else ""
        layer_own = ()
        if isinstance(module, TensorParallelModule):  # by name: FSDP may hold the tensors
            layer_own = module._shard_dims
            for pname, spec in module._shard_dims.items():
                if spec is not None and prefix + pname in keys:
                    by_key[prefix + pname] = _Split(spec[0], spec[1],
                                                    module.model_parallel_groups)
        for pname, param in module._parameters.items():
            key = prefix + pname
            # a layer's listed parameters go by its split above; a subclass's extra ones by marks
            if pname in layer_own or param is None or key not in keys:
                continue
            if id(param) in of_layers:  # a layer's split weight, tied into another module
                by_key[key] = of_layers[id(param)]
            elif getattr(param, "tensor_model_parallel", False):
                by_key[key] = _marked_split(key, param)
    return by_key


def _marked_split(key: str, param: torch.Tensor) -> _Split:
    """The split of a parameter marked ``tensor_model_parallel`` outside the tensor-parallel
    layers, from Megatron's ``partition_dim`` / ``partition_stride``. Local."""
    dim = getattr(param, "partition_dim", None)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -param.dim() <= dim < param.dim():
        raise ValueError(
            f"{key!r} is marked tensor_model_parallel=True (each tensor-parallel rank holds a "
            f"slice of it) with partition_dim={dim!r}, so its slices cannot be joined or split; "
            f"set param.partition_dim to the dimension it is split along (0..{param.dim() - 1}) "
            f"and param.partition_stride (default 1), as Megatron's "
            f"set_tensor_model_parallel_attributes does")
    stride = getattr(param, "partition_stride", 1)
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise ValueError(f"{key!r} is marked tensor_model_parallel=True with partition_stride="
                         f"{stride!r}; it must be an int >= 1 (1: one contiguous slice per rank)")
    groups = getattr(param, "model_parallel_groups", None) or current_groups(
        f"the tensor-parallel parameter {key!r}")
    return _Split(dim % param.dim(), stride, groups)


def split_specs(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``state_dict`` key -> ``(dim, stride)`` of every split parameter of ``model`` (what
    :func:`shardkit.nn.model_parallel.utils.join_shards` needs to rebuild it from the
    tensor-parallel ranks' slices, e.g. offline from a checkpoint). Local, no communication."""
    keys = model.state_dict().keys()
    return {key: (split.dim, split.stride) for key, split in _split_keys(model, keys).items()}


@torch.no_grad()
def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsplit state of ``model`` (parameters and buffers, keyed as ``model.state_dict()``).
    Call on every rank: collective over the tensor-parallel group (one all-gather per split
    parameter), plus whatever ``model.state_dict()`` itself costs (FSDP: an all-gather over the
    data-parallel group). The result costs the full model's size on every rank.

    The model of a ZeRO stage-3 engine (``engine.module``), whose ``state_dict()`` holds empty
    placeholders for its sharded parameters as in DeepSpeed, is read inside
    :class:`shardkit.zero.GatheredParameters` (one all-gather per FSDP unit over its
    data-parallel group, the unit's full size while it is read), as a DeepSpeed user would."""
    with _gathered_zero3_parameters(model):
        local = model.state_dict()
    split = _split_keys(model, local)
    return {key: split[key].join(tensor) if key in split else tensor.detach().clone()
            for key, tensor in local.items()}


def _gathered_zero3_parameters(model: nn.Module):
    """A context in which the ZeRO-3 parameters of ``model`` that hold only this rank's rows
    (DeepSpeed's ``ds_status`` ``NOT_AVAILABLE``) hold their full values; a no-op context
    when there are none (stages 0-2, a bare model, an FSDP wrapper, whose ``state_dict``
    gathers by itself). Every rank of a data-parallel group finds the same parameters."""
    from shardkit.zero import GatheredParameters, ZeroParamStatus
    sharded = [p for p in model.parameters()
               if getattr(p, "ds_status", None) is ZeroParamStatus.NOT_AVAILABLE]
    return GatheredParameters(sharded, enabled=bool(sharded))


@torch.no_grad()
def load_full_model_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *,
                               assign: bool = False) -> None:
    """Load an unsplit state (as :func:`full_model_state_dict` returns) into ``model``: each rank
    keeps its slices and hands them to ``model.load_state_dict``. No tensor-parallel
    communication (FSDP's ``load_state_dict`` gathers over its data-parallel group; so does the
    model of a ZeRO stage-3 engine, loaded inside :class:`shardkit.zero.GatheredParameters`,
    each rank keeping its rows).

    ``assign``: as ``nn.Module.load_state_dict``'s, for a model built under
    ``torch.device("meta")``: its parameters become this rank's slices (new tensors of the
    state dict's dtype and device; a replicated one is the state dict's own tensor), keeping
    their marks (``tensor_model_parallel``, ``sequence_parallel``). Memory: then only the
    slices, never the unsplit model's size beyond ``state_dict`` itself.

    Raises ``KeyError`` naming missing or unexpected keys and ``ValueError`` naming a key whose
    shape is not the unsplit one, a model holding ``meta`` tensors without ``assign=True``
    (torch would warn and load nothing into them), or ``assign=True`` for a ZeRO stage-3
    model, before loading anything."""
    if not isinstance(assign, bool):
        raise TypeError(f"load_full_model_state_dict(assign={assign!r}): expected True or False")
    gathered = _gathered_zero3_parameters(model)
    if assign and gathered.enabled:
        raise ValueError("load_full_model_state_dict(assign=True): the model's parameters are "
                         "ZeRO stage-3 shards, which must stay the same objects; load with "
                         "assign=False")
    with gathered:
        _load_slices(model, state_dict, assign)


def _load_slices(model: nn.Module, state_dict: dict[str, torch.Tensor], assign: bool) -> None:
    """Check ``state_dict`` against ``model``'s keys and unsplit shapes, then load this rank's
    slices of it. No tensor-parallel communication."""
    own = model.state_dict()
    on_meta = [key for key, tensor in own.items() if tensor.is_meta]
    if on_meta and not assign:
        raise ValueError(f"load_full_model_state_dict: the model holds meta tensors "
                         f"({on_meta[:3]}{' ...' if len(on_meta) > 3 else ''}), into which "
                         f"nothing can be copied; pass assign=True to make this rank's slices "
                         f"its parameters, or materialise it first (model.to_empty(device=...))")
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise KeyError(f"load_full_model_state_dict: missing keys {missing}, unexpected keys "
                       f"{unexpected}")
    split = _split_keys(model, own)
    local = {}
    for key, tensor in state_dict.items():
        expected = list(own[key].shape)
        if key in split:
            expected[split[key].dim] *= split[key].size
        if list(tensor.shape) != expected:
            raise ValueError(f"load_full_model_state_dict: {key!r} has shape "
                             f"{tuple(tensor.shape)}; the unsplit model's is {tuple(expected)}")
        local[key] = split[key].slice_of(tensor) if key in split else tensor
    # assign replaces the parameter objects: the marks of those of a model's own split layer
    # (Megatron's, read above and by clipping) live outside KeepsParameterMarks, so keep them here
    marks = parameter_marks(model) if assign else {}
    model.load_state_dict(local, assign=assign)
    restore_parameter_marks(model, marks)


@torch.no_grad()
def sync_module_states(module: nn.Module) -> int:
    """Make every rank hold the same model, as torch FSDP's ``sync_module_states=True`` does
    for its group: each tensor (parameter or buffer) of ``module`` takes the values of data-
    parallel rank 0's copy of it, then each tensor replicated across the tensor-parallel group
    (LayerNorms, ``RowParallelLinear``'s bias, ordinary layers, buffers) takes the values of
    tensor-parallel rank 0's. A split parameter keeps this tensor-parallel rank's slice: the
    slices together are one full weight (``full_weight()``, :func:`full_model_state_dict`),
    though ranks seeded differently drew them from different master weights.

    For ranks that built the model under different seeds (``torch.manual_seed(rank)``):
    without it, the copies of a replicated layer differ between tensor-parallel ranks and train
    apart silently (torch DDP and ``initialize(mpu=...)`` sync the data-parallel group only).
    Call on every rank of the world, after building the model and before wrapping or training
    it. The groups are those ``module``'s tensor-parallel layers were built with (else the
    current ones). A parameter marked ``tensor_model_parallel`` (a model's own split layer, as
    Megatron marks it) keeps its slice too.

    Returns the number of elements this rank received (0 at world size 1).

    Raises:
        ValueError: before any communication, for a module sharded by FSDP (shardkit's or
            torch's); on every rank, before any broadcast, when the ranks of a data-parallel
            group do not hold the same tensors (names, shapes, dtypes, devices), or those of a
            tensor-parallel group the same replicated ones, naming the first difference (one
            object all-gather of those lists over the world, uncounted).

    Memory: one flat chunk of up to 16 MiB at a time. Wire (``CommCounter``, broadcasts):
    ``(d-1)/d`` of the local tensors' bytes over the data-parallel group of size ``d``, and
    ``(t-1)/t`` of the replicated tensors' bytes over the tensor-parallel group of size ``t``.
    """
    sharded = next((name for name, m in module.named_modules()
                    if type(m).__name__ == "FullyShardedDataParallel"
                    or any(type(p).__name__ == "DTensor" for p in m.parameters(recurse=False))),
                   None)
    problem = None  # found here: every rank must hear of it, or the others wait forever
    if sharded is not None:
        problem = ValueError(f"sync_module_states: module {sharded or '(the root)'!r} is "
                             f"sharded by FSDP, whose ranks hold different shards on purpose; "
                             f"call it on the model before wrapping (FSDP's own "
                             f"sync_module_states=True syncs its group)")
    else:
        try:
            groups = groups_of(module.modules(), "sync_module_states")
        except (ValueError, RuntimeError) as error:
            problem = error
    _raise_everywhere(problem)  # every rank, a problem found here or not
    split = {id(getattr(m, name)) for m in module.modules() if isinstance(m, TensorParallelModule)
             for name, spec in m._shard_dims.items()
             if spec is not None and getattr(m, name, None) is not None}
    # a model's own split layer, marked as Megatron marks one: each rank keeps its slice
    split |= {id(p) for p in module.parameters() if getattr(p, "tensor_model_parallel", False)}
    named = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        named.setdefault(id(tensor), (name, tensor))  # a shared tensor once
    tensors = list(named.values())
    replicated = [(n, t) for n, t in tensors if id(t) not in split]
    _check_same_tensors(groups, tensors, replicated)
    received = 0
    for group, chosen in ((groups.data, tensors), (groups.tensor, replicated)):
        if distributed.get_world_size(group) < 2:
            continue
        distributed.broadcast_tensors_from_rank0([t for _, t in chosen], group)
        if distributed.get_rank(group) != 0:
            received += sum(t.numel() for _, t in chosen)
    return received


def _raise_everywhere(problem) -> None:
    """Raise on every rank when any rank found ``problem`` on its own (one object all-gather
    over the world, uncounted); alone, raise it here."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or \
            distributed.get_world_size() < 2:
        if problem is not None:
            raise problem
        return
    every = distributed.all_gather_object(None if problem is None else str(problem),
                                          counted=False, operation="sync_module_states")
    if problem is not None:
        raise problem
    rank = next((r for r, p in enumerate(every) if p is not None), None)
    if rank is not None:
        raise ValueError(f"sync_module_states: rank {rank} refused its module: {every[rank]}")


def _signature(named: list) -> list:
    return [(n, tuple(t.shape), str(t.dtype), t.device.type) for n, t in named]


def _check_same_tensors(groups, tensors: list, replicated: list) -> None:
    """ValueError on every rank unless the ranks of each data-parallel group hold the same
    tensors (names, shapes, dtypes, devices) and those of each tensor-parallel group the same
    replicated ones: a broadcast of differing tensors would fail on some ranks and leave the
    others waiting. One object all-gather over the whole world (pipeline stages hold other
    modules, so each group is compared within itself), so that every rank decides alike."""
    if distributed.get_world_size() < 2:
        return
    mine = (tuple(groups.data_ranks), tuple(groups.tensor_ranks), _signature(tensors),
            _signature(replicated))
    every = distributed.all_gather_object(mine, counted=False, operation="sync_module_states")
    for what, ranks_at, sig_at in (("data-parallel", 0, 2), ("tensor-parallel", 1, 3)):
        for rank, theirs in enumerate(every):
            ranks = theirs[ranks_at]
            first = every[ranks[0]]
            if theirs[sig_at] == first[sig_at]:
                continue
            diff = next((f"{a} on rank {ranks[0]}, {b} on rank {rank}"
                         for a, b in zip(first[sig_at], theirs[sig_at]) if a != b),
                        f"{len(first[sig_at])} tensors on rank {ranks[0]}, "
                        f"{len(theirs[sig_at])} on rank {rank}")
            raise ValueError(f"sync_module_states: the modules of {what} ranks {list(ranks)} "
                             f"hold different tensors (first difference: {diff}); build the "
                             f"same model on every rank of a group")
