"""FullyShardedDataParallel's FairScale arguments beyond the core ones: checks and meaning.

FairScale's ``FullyShardedDataParallel`` takes more constructor arguments than the core set in
DESIGN.md, and its users pass them. Each one is honoured here, with FairScale's default:

- ``cpu_offload``: FairScale's older name for ``move_params_to_cpu`` (DeprecationWarning).
- ``move_grads_to_cpu`` (default: ``move_params_to_cpu``): gradient shards live where the
  parameter shards live, so it must agree with where they are (an error otherwise).
- ``disable_reshard_on_root``: the outermost unit keeps its gathered parameters from forward
  into backward (``True``, default) or frees and re-gathers them like any other unit.
- ``compute_device``: checked against the device the unit computes on.
- ``state_dict_device``, ``state_dict_on_rank_0_only``: where ``state_dict()``'s tensors go and
  whether ranks other than 0 get an empty dict.
- ``force_input_to_fp32``, ``clear_autocast_cache``: forward input casting and autocast's
  weight cache, as in FairScale.
- ``gradient_predivide_factor``: gradients are divided by it before the reduce-scatter and by
  ``world / factor`` after (``set_gradient_divide_factors`` changes both).
- ``process_group_reduce_scatter``: a process group over the same ranks that carries the
  reduce-scatters (FairScale's way to let them run beside the all-gathers; over gloo on one
  host it measured no faster: MLP 16x1024 at world 2, 1.27-1.31x torch DDP with the shared
  group, 1.31-1.41x with a group of its own, three interleaved rounds).
- ``no_broadcast_optim_state``: ``gather_full_optim_state_dict`` leaves this unit's parameters'
  state as this rank holds it (FairScale: for experts that every rank fills in itself).
- ``allow_reset_parameters``: lets ``reset_parameters()`` reach the wrapped module.
- ``bucket_cap_mb``: FairScale batches small reduce-scatters into buckets of this size; here
  each unit's gradients already go as one flat reduce-scatter, so the value is only checked.
- ``verbose``: ``repr`` lists every setting.

torch FSDP1's ``ignored_modules`` / ``ignored_states`` are resolved by
:func:`resolve_ignored_states` (see there for their meaning here).

Every check raises ``ValueError`` naming the argument before any collective. No communication.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from shardkit import distributed as skdist

__all__ = ["FairScaleOptions", "resolve_fairscale_options", "resolve_cpu_offload",
           "check_reduce_scatter_group", "check_compute_device", "check_divide_factor",
           "check_bool", "shard_devices", "meta_init_device", "check_torch_scheduling_options",
           "IgnoredStates", "resolve_ignored_states"]


@dataclass(frozen=True)
class FairScaleOptions:
    """The resolved FairScale-only settings of one FSDP unit (see the module docstring)."""

    disable_reshard_on_root: bool = True
    move_grads_to_cpu: bool = False
    bucket_cap_mb: float = 25
    no_broadcast_optim_state: bool = False
    state_dict_device: Optional[torch.device] = None
    clear_autocast_cache: bool = False
    force_input_to_fp32: bool = False
    verbose: bool = False
    state_dict_on_rank_0_only: bool = False
    gradient_predivide_factor: Optional[float] = None
    allow_reset_parameters: bool = False


def resolve_cpu_offload(move_params_to_cpu: bool, cpu_offload: bool) -> bool:
    """``move_params_to_cpu`` or FairScale's older ``cpu_offload`` (which warns), or torch
    FSDP1's ``CPUOffload(offload_params=...)`` there (no warning: torch's current name), or
    ``None`` (torch FSDP1's default: no offload)."""
    if cpu_offload is None:
        return bool(move_params_to_cpu)
    if type(cpu_offload).__name__ == "CPUOffload" and hasattr(cpu_offload, "offload_params"):
        check_bool("cpu_offload=CPUOffload(offload_params", cpu_offload.offload_params)
        return bool(move_params_to_cpu or cpu_offload.offload_params)
    check_bool("cpu_offload", cpu_offload)
    if cpu_offload:
        warnings.warn("FullyShardedDataParallel(cpu_offload=True) is FairScale's older name for "
                      "move_params_to_cpu=True; use that", DeprecationWarning, stacklevel=3)
    return bool(move_params_to_cpu or cpu_offload)


def resolve_fairscale_options(*, move_params_to_cpu: bool, module_device: torch.device,
                              disable_reshard_on_root, move_grads_to_cpu, bucket_cap_mb,
                              no_broadcast_optim_state, state_dict_device, clear_autocast_cache,
                              force_input_to_fp32, verbose, state_dict_on_rank_0_only,
                              gradient_predivide_factor,
                              allow_reset_parameters) -> FairScaleOptions:
    """Check FairScale's extra arguments and resolve their defaults."""
    for name, value in (("disable_reshard_on_root", disable_reshard_on_root),
                        ("no_broadcast_optim_state", no_broadcast_optim_state),
                        ("clear_autocast_cache", clear_autocast_cache),
                        ("force_input_to_fp32", force_input_to_fp32), ("verbose", verbose),
                        ("state_dict_on_rank_0_only", state_dict_on_rank_0_only),
                        ("allow_reset_parameters", allow_reset_parameters)):
        check_bool(name, value)
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise ValueError(f"FullyShardedDataParallel(bucket_cap_mb={bucket_cap_mb!r}): must be a "
                         f"number of MB (FairScale's reduce-scatter bucket; <= 0 turns it off)")
    if gradient_predivide_factor is not None:
        check_divide_factor("FullyShardedDataParallel", "gradient_predivide_factor",
                            gradient_predivide_factor)
    return FairScaleOptions(
        disable_reshard_on_root=disable_reshard_on_root,
        move_grads_to_cpu=_resolve_move_grads(move_grads_to_cpu, move_params_to_cpu,
                                              *shard_devices(module_device, move_params_to_cpu)),
        bucket_cap_mb=bucket_cap_mb, no_broadcast_optim_state=no_broadcast_optim_state,
        state_dict_device=_as_device("state_dict_device", state_dict_device),
        clear_autocast_cache=clear_autocast_cache, force_input_to_fp32=force_input_to_fp32,
        verbose=verbose, state_dict_on_rank_0_only=state_dict_on_rank_0_only,
        gradient_predivide_factor=(None if gradient_predivide_factor is None
                                   else float(gradient_predivide_factor)),
        allow_reset_parameters=allow_reset_parameters)


def check_same_unit_on_every_rank(process_groups: list, module, params, **settings) -> None:
    """One small all-gather per group of ``process_groups`` that has several ranks (the
    ``process_group`` given, ``None``: the default group; both groups of a (shard, replicate)
    pair), before any sub-group is created from them: every rank must wrap the same
    parameters (names, shapes, dtypes) with the same ``settings`` (the arguments that shape
    the unit's collectives: strategy, precision, quantization, transport). Otherwise the ranks
    gather and reduce buffers of different sizes or dtypes, and gloo aborts every process
    ("Received data size doesn't match expected size"). The ValueError names the first
    difference between the group's rank 0 and the first rank that differs from it, the same
    text on every rank. Communication: names, shapes and settings, once per unit."""
    mine = {name: repr(value) for name, value in settings.items()}
    names = {id(p): name for name, p in module.named_parameters()}
    for p in params:
        mine[f"parameter {names.get(id(p), '?')}"] = f"{tuple(p.shape)} {p.dtype}"
    for group in process_groups:
        if skdist.get_world_size(group) < 2:
            continue
        skdist.raise_on_disagreement(mine, group, "FullyShardedDataParallel",
                                     "every rank must wrap the same module with the same "
                                     "arguments")


def check_divide_factor(call: str, name: str, value) -> float:
    """A gradient divide factor (argument ``name`` of ``call``): a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not \
            0 < float(value) < float("inf"):
        raise ValueError(f"{call}({name}={value!r}): must be a positive number (gradients are "
                         f"divided by it)")
    return float(value)


def check_reduce_scatter_group(process_group_reduce_scatter, shard_group, sharding_strategy):
    """The group that carries the reduce-scatters: ``shard_group`` unless another group over
    exactly its ranks is given (only for strategies that shard over one group)."""
    if process_group_reduce_scatter is None:
        return shard_group
    if sharding_strategy.name not in ("FULL_SHARD", "SHARD_GRAD_OP"):
        raise ValueError(f"FullyShardedDataParallel(process_group_reduce_scatter=...): only with "
                         f"FULL_SHARD or SHARD_GRAD_OP, not {sharding_strategy.name} (its "
                         f"gradients are not reduce-scattered over one group)")
    try:
        given = skdist.group_ranks(process_group_reduce_scatter)
    except Exception as error:
        raise ValueError(f"FullyShardedDataParallel(process_group_reduce_scatter="
                         f"{process_group_reduce_scatter!r}): expected a process group over the "
                         f"same ranks as process_group ({error})") from None
    wanted = skdist.group_ranks(shard_group)
    if sorted(given) != sorted(wanted):
        raise ValueError(f"FullyShardedDataParallel(process_group_reduce_scatter=...): its ranks "
                         f"{sorted(given)} differ from process_group's {sorted(wanted)}; give a "
                         f"group over the same ranks (or None)")
    return process_group_reduce_scatter


def check_compute_device(compute_device, actual: Optional[torch.device]) -> None:
    """FairScale's ``compute_device`` must be where the unit computes (its parameters'
    device, or the current CUDA device when they are offloaded)."""
    if compute_device is None or actual is None:
        return
    wanted = _as_device("compute_device", compute_device)
    same = wanted.type == actual.type and (wanted.index is None or actual.index is None
                                           or wanted.index == actual.index)
    if not same:
        raise ValueError(f"FullyShardedDataParallel(compute_device={compute_device!r}): this unit "
                         f"computes on {actual} (where its parameters are); move the module "
                         f"there first, or pass compute_device={str(actual)!r} or None")


def meta_init_device(compute_device, module: torch.nn.Module) -> torch.device:
    """Where a unit gives its meta tensors storage (``param_init_fn=None``): FairScale's
    ``compute_device`` when given, else the device of the first of ``module``'s tensors that
    is not on meta (an inner unit's shards), else the current CUDA device, else the CPU."""
    if compute_device is not None:
        return _as_device("compute_device", compute_device)
    for t in itertools.chain(module.parameters(), module.buffers()):
        if not t.is_meta:
            return t.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard_devices(module_device: torch.device, move_params_to_cpu: bool) -> tuple:
    """``(compute device, storage device)`` of a unit whose parameters are on
    ``module_device``: offloaded shards are stored on the CPU and computed with on the module's
    CUDA device (or the current one; the CPU where there is no CUDA)."""
    if not move_params_to_cpu:
        return module_device, module_device
    if module_device.type == "cuda":
        compute = module_device
    elif torch.cuda.is_available():
        compute = torch.device("cuda", torch.cuda.current_device())
    else:
        compute = torch.device("cpu")
    return compute, torch.device("cpu")


def _resolve_move_grads(move_grads_to_cpu, move_params_to_cpu: bool, compute: torch.device,
                        storage: torch.device) -> bool:
    if move_grads_to_cpu is None:
        return move_params_to_cpu
    check_bool("move_grads_to_cpu", move_grads_to_cpu)
    if move_grads_to_cpu and storage.type != "cpu":
        raise ValueError(f"FullyShardedDataParallel(move_grads_to_cpu=True): the parameter shards "
                         f"stay on {storage} and their gradients live beside them; pass "
                         f"move_params_to_cpu=True to keep both (and the optimizer) on the CPU")
    if not move_grads_to_cpu and storage.type == "cpu" and compute.type != "cpu":
        raise ValueError("FullyShardedDataParallel(move_grads_to_cpu=False, "
                         "move_params_to_cpu=True): the offloaded shards need their gradients "
                         "on the CPU for the optimizer step; leave move_grads_to_cpu unset")
    return move_grads_to_cpu


def _as_device(name: str, value) -> Optional[torch.device]:
    if value is None:
        return None
    try:
        return torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"FullyShardedDataParallel({name}={value!r}): expected a torch.device, "
                         f"a device string such as 'cpu' or 'cuda:0', or None") from None


def check_bool(name: str, value) -> None:
    """``FullyShardedDataParallel(name=value)`` must be True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"FullyShardedDataParallel({name}={value!r}): must be True or False")


def move_to_device_id(device_id, module: torch.nn.Module) -> None:
    """torch FSDP1's ``device_id`` (a CUDA index, a device or a string; ``None``: leave the
    module where it is): a module on the CPU is moved there before it is sharded, as torch
    does; one already on another accelerator is a ValueError. Local."""
    if device_id is None:
        return
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        if device_id < 0:
            raise ValueError(f"FullyShardedDataParallel(device_id={device_id}): a CUDA device "
                             f"index must be 0 or more")
        wanted = torch.device("cuda", device_id)
    else:
        wanted = _as_device("device_id", device_id)
    if wanted.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"FullyShardedDataParallel(device_id={device_id!r}): CUDA is not "
                         f"available on this machine; pass torch.device('cpu') or leave "
                         f"device_id unset")
    first = next(module.parameters(), None)
    if first is None or first.is_meta or first.device == wanted:
        return
    if first.device.type == "cpu":
        module.to(wanted)
    elif first.device.type != wanted.type or wanted.index not in (None, first.device.index):
        raise ValueError(f"FullyShardedDataParallel(device_id={device_id!r}): the module is on "
                         f"{first.device}; move it to {wanted} first, or leave device_id unset")


def check_torch_scheduling_options(use_orig_params, forward_prefetch, backward_prefetch,
                                   limit_all_gathers) -> None:
    """torch FSDP1's arguments that choose how its flat parameters are exposed and when its
    collectives are issued, accepted so that a torch FSDP1 call runs unchanged:

    - ``use_orig_params``: True or False. A unit here always exposes the original parameters
      (its ``parameters()`` are the module's own, holding this rank's rows), which is what
      torch's ``True`` gives; ``False`` changes nothing either (no flat parameter is exposed)
      but that ``summon_full_params(with_grads=True)`` needs ``True``, as in torch.
    - ``forward_prefetch``, ``limit_all_gathers``: True or False; the units gather in the
      order the root recorded, one unit ahead, whatever they say.
    - ``backward_prefetch``: ``None`` or a member of torch's ``BackwardPrefetch``
      (``BACKWARD_PRE``, ``BACKWARD_POST``); accepted, the backward gathers as it does.

    A value of another kind is a ValueError naming the argument. Local."""
    for name, value in (("use_orig_params", use_orig_params),
                        ("forward_prefetch", forward_prefetch),
                        ("limit_all_gathers", limit_all_gathers)):
        check_bool(name, value)
    if backward_prefetch is None:
        return
    name = getattr(backward_prefetch, "name", None)
    if type(backward_prefetch).__name__ != "BackwardPrefetch" or \
            name not in ("BACKWARD_PRE", "BACKWARD_POST"):
        raise ValueError(f"FullyShardedDataParallel(backward_prefetch={backward_prefetch!r}): "
                         f"expected None or torch's BackwardPrefetch.BACKWARD_PRE / "
                         f"BackwardPrefetch.BACKWARD_POST")


@dataclass(frozen=True)
class IgnoredStates:
    """What one FSDP unit leaves alone (torch FSDP1's ``ignored_modules`` / ``ignored_states``):
    ``modules``, every ignored module (those given and all their submodules); ``params``,
    every ignored parameter (the modules' and those given). Identity, not equality, decides
    membership (:meth:`has_module`, :meth:`has_param`)."""

    modules: tuple = ()
    params: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "_module_ids", frozenset(id(m) for m in self.modules))
        object.__setattr__(self, "_param_ids", frozenset(id(p) for p in self.params))

    def __bool__(self) -> bool:
        return bool(self.modules or self.params)

    def has_module(self, module) -> bool:
        """Whether ``module`` itself (by identity) is ignored. Local."""
        return id(module) in self._module_ids

    def has_param(self, param) -> bool:
        """Whether ``param`` itself (by identity) is ignored. Local."""
        return id(param) in self._param_ids

    @classmethod
    def of(cls, given) -> "IgnoredStates":
        """What ``given`` (modules and/or parameters, as ``ignored_modules`` /
        ``ignored_states`` take them) leaves alone: every module inside the modules given,
        their parameters, and the parameters given. Unchecked (:func:`resolve_ignored_states`
        checks). Local."""
        modules = {id(sub): sub for m in given if isinstance(m, torch.nn.Module)
                   for sub in m.modules()}
        params = {id(p): p for p in given if isinstance(p, torch.nn.Parameter)}
        params.update((id(p), p) for m in modules.values() for p in m.parameters(recurse=False))
        return cls(tuple(modules.values()), tuple(params.values()))


def resolve_ignored_states(module: torch.nn.Module, ignored_modules, ignored_states, *,
                           is_unit, is_wrapped, is_sharded) -> IgnoredStates:
    """Check torch FSDP1's ``ignored_modules`` / ``ignored_states`` of a unit wrapping
    ``module`` and return what it ignores. The predicates say whether a module is an FSDP unit
    (``is_unit``) or the module of one (``is_wrapped``), and whether a parameter is already a
    unit's shard (``is_sharded``).

    The ignored modules (those given and everything inside them) and parameters are not
    sharded, gathered or reduced: each rank keeps them as ordinary full tensors, trains them
    with its local gradient (synchronise them yourself, or freeze them) and finds them as they
    are in every state dict. As in torch, at most one of the two arguments may be given;
    ``ignored_states`` takes parameters or modules (all of one kind), ``ignored_modules``
    modules. Refused (``ValueError`` naming the argument): both given; something that is not
    an iterable of such objects (a single module or tensor included); an FSDP unit, or the
    module of one, given or inside one given (ignore it before wrapping: torch refuses FSDP
    modules there); the module being wrapped itself ignored, which would leave the unit
    nothing (torch only warns that it is not well-supported); a parameter an inner unit
    already shards. Local, before any collective."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("FullyShardedDataParallel(ignored_modules=..., ignored_states=...): "
                         "pass one of them, not both (torch FSDP1: \"Cannot pass both "
                         "ignored_modules and ignored_states at the same time. Please just "
                         "pass ignored_states.\"); ignored_states takes the same modules, or "
                         "parameters")
    name = "ignored_states" if ignored_states is not None else "ignored_modules"
    given = ignored_states if ignored_states is not None else ignored_modules
    valid = ("an iterable of torch.nn.Module or of torch.nn.Parameter (all of one kind)"
             if name == "ignored_states" else "an iterable of torch.nn.Module")
    if given is None:
        return IgnoredStates()
    if isinstance(given, torch.Tensor) or (isinstance(given, torch.nn.Module)
                                           and not hasattr(type(given), "__iter__")):
        raise ValueError(f"FullyShardedDataParallel({name}={type(given).__name__}): expected "
                         f"{valid} (or None); put a single one in a list")
    try:
        items = list(given)
    except TypeError:
        raise ValueError(f"FullyShardedDataParallel({name}={given!r}): expected {valid} "
                         f"(or None)") from None
    kinds = {type(item) for item in items}
    all_modules = all(isinstance(item, torch.nn.Module) for item in items)
    all_params = name == "ignored_states" and \
        all(isinstance(item, torch.nn.Parameter) for item in items)
    if not (all_modules or all_params):
        raise ValueError(f"FullyShardedDataParallel({name}=...): expected {valid}, got "
                         f"elements of types {sorted(k.__name__ for k in kinds)}")
    if not (all_params and items):
        _refuse_units(name, items, is_unit, is_wrapped)
    ignored = IgnoredStates.of(items)
    if ignored.has_module(module):
        raise ValueError(f"FullyShardedDataParallel({name}=...): the module being wrapped "
                         f"({type(module).__name__}) is itself ignored (given, or inside a "
                         f"module given), which leaves this unit nothing to shard; ignore some "
                         f"of its submodules instead, or do not wrap it")
    _refuse_sharded(name, ignored.params, is_sharded, module)
    return ignored


def _refuse_units(name: str, modules: list, is_unit, is_wrapped) -> None:
    """An FSDP unit, or the module of one, among the ``modules`` given or inside one of them:
    refused as torch refuses FSDP modules there. Local."""
    for given_module in modules:
        for sub_name, sub in given_module.named_modules():
            if is_unit(sub) or is_wrapped(sub):
                where = f"{sub_name!r} inside the {type(given_module).__name__} given" \
                    if sub_name else f"{type(sub).__name__} given"
                what = "a FullyShardedDataParallel unit" if is_unit(sub) else \
                    "the module of a FullyShardedDataParallel unit"
                raise ValueError(
                    f"FullyShardedDataParallel({name}=...): the {where} is {what}; ignored "
                    f"modules must be plain modules (torch: \"`ignored_modules` should not "
                    f"include FSDP modules\"): pass the module before wrapping it, or do not "
                    f"wrap what you ignore")


def _refuse_sharded(name: str, params, is_sharded, module: torch.nn.Module) -> None:
    """An ignored parameter that an inner unit already shards would stay sharded and reduced
    (the ignoring silently a no-op): refused, for modules as for parameters, naming it as
    ``module`` names it. Local."""
    sharded = next((p for p in params if is_sharded(p)), None)
    if sharded is not None:
        where = next((n.replace("_fsdp_wrapped_module.", "") for n, q in
                      module.named_parameters(remove_duplicate=False) if q is sharded), "?")
        raise ValueError(f"FullyShardedDataParallel({name}=...): parameter {where!r} is "
                         f"already sharded by an inner "
                         f"FullyShardedDataParallel unit; pass {name} to that unit (or to "
                         f"the root with auto_wrap_policy, which hands it to the units it "
                         f"builds)")


def tensor_parallel_mates(process_groups: list, params) -> tuple:
    """FSDP's ``(mates, problem)`` (:func:`shardkit.nn.model_parallel.initialize.
    tensor_parallel_mates`): its shards would mix the slices of ranks of one tensor-parallel
    group. Local."""
    from shardkit.nn.model_parallel.initialize import tensor_parallel_mates as mates_in
    return mates_in(process_groups, params, "FullyShardedDataParallel",
                    "the shards would mix them")
