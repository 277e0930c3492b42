"""Checking and normalising what is given to OSS's constructor and ``add_param_group``.

Every check runs before OSS issues any collective (except :func:`check_same_model_on_every_rank`,
which is the one small all-gather of parameter shapes that proves every rank agrees), so bad
input fails on every rank alike with an error naming the argument, its value and what is valid.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Optional

import torch

from shardkit import distributed
from shardkit.optim.local_step import is_named_parameter, of_torch_or_shardkit

__all__ = ["NOT_GIVEN", "place_broadcast_fp16", "check_deprecated_fairscale_arguments",
           "resolve_optimizer", "optimizer_name", "check_built_optimizer",
           "drop_deprecated_fairscale_kwargs", "check_optimizer_class", "check_takeover_arguments",
           "normalize_param_groups", "check_same_model_on_every_rank", "trainable_signature",
           "frozen_with_gradient",
           "optimizer_settings", "groups_of", "constructor_kwargs", "state_key_problem",
           "gradient_step_problem", "fused_kernel_carries_nan_as_loop", "param_group_settings"]

# FairScale OSS arguments that no longer do anything there either; accepted and ignored.
_DEPRECATED_FAIRSCALE_KWARGS = ("broadcast_buffer_size", "force_broadcast_object")


class _NotGiven:
    """The default of FairScale's ignored arguments, so that only an explicit one warns."""

    def __repr__(self) -> str:
        return "<not given>"


NOT_GIVEN = _NotGiven()


def place_broadcast_fp16(fourth, fifth) -> tuple:
    """``(broadcast_buffer_size, broadcast_fp16)`` from OSS's 4th and 5th arguments. FairScale
    puts its ignored int ``broadcast_buffer_size`` fourth and ``broadcast_fp16`` fifth;
    shardkit's DESIGN.md lists ``broadcast_fp16`` fourth. The two never look alike (an int
    against a bool or a dtype), so a bool or a dtype in the 4th place is ``broadcast_fp16``; one
    in both places is a TypeError."""
    if not isinstance(fourth, (bool, torch.dtype)):
        return fourth, fifth
    if fifth is not False:
        raise TypeError(f"OSS(..., {fourth!r}, {fifth!r}): broadcast_fp16 given twice (4th "
                        f"argument as in shardkit's signature, 5th as in FairScale's); give it "
                        f"once, by name: broadcast_fp16={fourth!r}")
    return NOT_GIVEN, fourth


def check_deprecated_fairscale_arguments(broadcast_buffer_size, force_broadcast_object,
                                         defaults: dict) -> None:
    """FairScale's ``broadcast_buffer_size`` (4th) and ``force_broadcast_object`` (6th), given
    by place or by name: checked (an int, a bool) and moved into ``defaults``, where
    :func:`drop_deprecated_fairscale_kwargs` warns about them and drops them."""
    if broadcast_buffer_size is not NOT_GIVEN:
        if isinstance(broadcast_buffer_size, bool) or not isinstance(broadcast_buffer_size, int):
            raise TypeError(f"OSS(broadcast_buffer_size={broadcast_buffer_size!r}): FairScale's "
                            f"argument, an int (accepted and ignored)")
        defaults["broadcast_buffer_size"] = broadcast_buffer_size
    if force_broadcast_object is not NOT_GIVEN:
        if not isinstance(force_broadcast_object, bool):
            raise TypeError(f"OSS(force_broadcast_object={force_broadcast_object!r}): FairScale's "
                            f"sixth argument, True or False (accepted and ignored)")
        defaults["force_broadcast_object"] = force_broadcast_object


def drop_deprecated_fairscale_kwargs(defaults: dict) -> None:
    """Remove FairScale's no-op arguments from ``defaults`` (with a DeprecationWarning); refuse
    ``sync_op``, which shardkit replaced by ``comm=``."""
    for name in _DEPRECATED_FAIRSCALE_KWARGS:
        if name in defaults:
            defaults.pop(name)
            warnings.warn(f"OSS({name}=...) is accepted for FairScale compatibility and ignored: "
                          f"shardkit syncs parameters in flat buckets", DeprecationWarning,
                          stacklevel=3)
    if "sync_op" in defaults:
        raise TypeError("OSS(sync_op=...) was removed: the parameter sync goes through the "
                        "transport given as comm= (default: the process group's collectives; "
                        "shardkit.shm_transport.SharedMemoryTransport() for ranks on one host)")


# torch's ZeroRedundancyOptimizer's keyword arguments -> what OSS takes instead
_ZERO_REDUNDANCY_KWARGS = {
    "optimizer_class": "pass the optimizer class as optim= (OSS(params, optim=torch.optim.AdamW, "
                       "lr=...))",
    "process_group": "pass the group as group=",
    "parameters_as_bucket_view": "OSS always syncs parameters in flat buckets (bucket_numel= "
                                 "sets their size); drop the argument",
    "overlap_with_ddp": "use shardkit.comm_hooks.step_oss_in_ddp_backward(ddp, optimizer) (or "
                        "optimizer.overlap_sync_with(model)); drop the argument",
}


def refuse_zero_redundancy_kwargs(defaults: dict) -> None:
    """torch ``ZeroRedundancyOptimizer``'s own keywords, given to OSS by a script switching
    over: a TypeError naming what OSS takes instead, before they reach the inner optimizer
    (which refused them naming itself: "OSS(optim=SGD): the optimizer refused ...
    'optimizer_class'"). Local."""
    given = [name for name in _ZERO_REDUNDANCY_KWARGS if name in defaults]
    if given:
        raise TypeError("OSS(" + ", ".join(f"{name}=..." for name in given) + "): "
                        "ZeroRedundancyOptimizer's argument(s); " +
                        "; ".join(f"{name}: {_ZERO_REDUNDANCY_KWARGS[name]}" for name in given))


def check_optimizer_class(optim) -> None:
    """``optim`` must be a ``torch.optim.Optimizer`` subclass (the class, not an instance)."""
    if not (isinstance(optim, type) and issubclass(optim, torch.optim.Optimizer)):
        raise TypeError(f"OSS(optim={optim!r}): must be a torch.optim.Optimizer subclass such as "
                        f"torch.optim.AdamW or torch.optim.SGD (the class, not an instance)")


def resolve_optimizer(optim) -> tuple:
    """``(optim, defaults from it, is_factory)`` for what FairScale accepted as ``optim``:
    anything it could call as ``optim(param_groups, **defaults)``.

    - a ``torch.optim.Optimizer`` subclass: itself;
    - ``functools.partial(OptimizerClass, key=value, ...)``: the class, its keywords as defaults
      (the call's own keyword arguments win, as with the partial); positional arguments are
      refused (they would take the place of the parameters);
    - any other callable (a factory function, ClassyVision's trampoline): kept as a factory,
      called with this rank's param groups and the defaults; what it returns is checked when
      OSS builds the local optimizer.

    An optimizer instance, or something not callable, is a TypeError naming ``optim``."""
    if isinstance(optim, type) or isinstance(optim, torch.optim.Optimizer) \
            or not callable(optim):
        check_optimizer_class(optim)
        return optim, {}, False
    if isinstance(optim, functools.partial) and isinstance(optim.func, type) \
            and issubclass(optim.func, torch.optim.Optimizer):
        if optim.args:
            raise TypeError(f"OSS(optim={optim!r}): a functools.partial of an optimizer class "
                            f"may bind keyword arguments only; its positional arguments would "
                            f"take the parameters' place (OSS passes each rank's param groups)")
        return optim.func, dict(optim.keywords), False
    return optim, {}, True


def optimizer_name(optim) -> str:
    """A short name for ``optim`` (a class or a factory) in error messages."""
    return getattr(optim, "__name__", None) or repr(optim)


def check_built_optimizer(optim, built, caller: str):
    """What a factory returned must be a ``torch.optim.Optimizer``; an LBFGS must be given as
    the class (OSS runs it over the whole model, and must know before building it)."""
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(f"{caller}(optim={optimizer_name(optim)}): the factory returned "
                        f"{type(built).__name__}; it must return a torch.optim.Optimizer built "
                        f"over the param groups it is given")
    if isinstance(built, torch.optim.LBFGS):
        raise TypeError(f"{caller}(optim={optimizer_name(optim)}): the factory built an LBFGS, "
                        f"which OSS runs over the whole model on every rank; pass "
                        f"optim=torch.optim.LBFGS (the class) instead")
    return built


def check_takeover_arguments(existing, optim, defaults, already_sharded: bool) -> None:
    """``OSS(existing_optimizer)``: no optimizer class or hyper-parameters beside it, and not an
    OSS (``already_sharded``) inside another."""
    if already_sharded:
        raise TypeError("OSS(existing_optimizer): it is already an OSS; wrap a plain "
                        "torch.optim.Optimizer")
    passed = ([f"optim={optim!r}"] if optim is not torch.optim.SGD else []) + (
        [str(sorted(defaults))] if defaults else [])
    if passed:
        raise TypeError(f"OSS(existing_optimizer, ...): optim and hyper-parameters are taken from "
                        f"the {type(existing).__name__} given; do not pass {' or '.join(passed)} "
                        f"(pass a process group as group=...)")


def normalize_param_groups(params) -> list[dict]:
    """``params`` as a list of group dicts with a ``params`` list, checked: tensors only, each
    parameter in one group only, at least one parameter, no set (unordered).

    The caller's group dicts are kept, not copied (their ``params`` becomes a list in place),
    as torch's ``Optimizer`` keeps them: ``OSS(params=opt.param_groups, ...)`` (Lightning's
    call) then shares its groups with ``opt``, so a scheduler built on ``opt`` still drives OSS's
    learning rate. No communication."""
    if isinstance(params, torch.Tensor):
        raise TypeError("OSS(params=...): got a single tensor; pass an iterable of parameters "
                        "or of param-group dicts (e.g. model.parameters())")
    # an nn.ParameterList iterates over its parameters: torch's optimizers take it, so does OSS
    if isinstance(params, torch.nn.Module) and not isinstance(params, torch.nn.ParameterList):
        raise TypeError(f"OSS(params=...): got a module ({type(params).__name__}); pass its "
                        f"parameters, OSS(model.parameters(), optim=...), or param-group dicts")
    _refuse_set("OSS(params=...)", params)
    items = list(params)
    if not items:
        raise ValueError("OSS(params=[]): got an empty parameter list")
    if not all(isinstance(x, dict) for x in items):
        items = [{"params": items}]
    groups, seen = [], {}
    for g, item in enumerate(items):
        if "params" not in item:
            raise ValueError(f"OSS: param group {g} has no 'params' key")
        ps = item["params"]
        _refuse_set(f"OSS: param group {g}'s 'params'", ps)
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        ps = _names_taken_out(item, ps, g, groups)
        for i, p in enumerate(ps):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"OSS: param group {g} item {i} is a {type(p).__name__}; expected "
                                f"a torch.Tensor or a (name, tensor) pair")
            if not p.is_leaf:
                raise ValueError(f"OSS: param group {g} item {i} is not a leaf tensor; an "
                                 f"optimizer can only update leaf tensors")
            if id(p) in seen:
                raise ValueError(f"OSS: a parameter (shape {tuple(p.shape)}) is in param group "
                                 f"{seen[id(p)][0]} (item {seen[id(p)][1]}) and again in group "
                                 f"{g} (item {i}); each parameter may be in one group only")
            seen[id(p)] = (g, i)
        item["params"] = ps
        groups.append(item)
    return groups


def _names_taken_out(item: dict, ps: list, g: int, earlier: list) -> list:
    """A group given as ``(name, parameter)`` pairs (``model.named_parameters()``, which torch's
    optimizers take): its tensors, with the names written into ``item["param_names"]``, as
    torch's ``add_param_group`` does. Groups must all be named or all unnamed (torch's rule)."""
    named = [is_named_parameter(x) for x in ps]
    if not any(named):
        names = None
    elif not all(named):
        raise ValueError(f"OSS: param group {g} mixes (name, tensor) pairs and bare tensors; "
                         f"give all of a group's parameters with names or all without")
    else:
        names = [n for n, _ in ps]
        ps = [p for _, p in ps]
    for e, other in enumerate(earlier):
        if ("param_names" in other) != (names is not None or "param_names" in item):
            raise ValueError(f"OSS: param group {g} is given "
                             f"{'with' if names is not None else 'without'} parameter names and "
                             f"param group {e} {'with' if 'param_names' in other else 'without'};"
                             f" give every group's parameters with names or all without")
    if names is not None:
        item["param_names"] = names
    return ps


def _refuse_set(what: str, params) -> None:
    """A set's order differs from process to process: each rank would partition the parameters
    differently and the sync would write one parameter's values into another (silently when
    their shapes match). Refused, as torch refuses a set in a param group."""
    if isinstance(params, (set, frozenset)):
        raise TypeError(f"{what}: got a {type(params).__name__}; optimizer parameters must be "
                        f"in an ordered collection (a list, or model.parameters()), the same "
                        f"order on every rank")


# What the construction-time check asks of every rank (refresh_trainable and add_param_group
# pass their own).
SAME_MODEL_ADVICE = ("build OSS over the same model, in the same order, with the same "
                     "parameters frozen")


def check_same_model_on_every_rank(groups: list[dict], group, caller: str = "OSS",
                                   advice: str = SAME_MODEL_ADVICE,
                                   settings: Optional[dict] = None,
                                   refusal: Optional[str] = None) -> list[set]:
    """One small all-gather: every rank must partition the same parameters, the same items of
    the same param groups with the same shapes, or the sync would write one parameter's values
    into another (silently when their shapes match: two layers of one width, one frozen on
    each rank) or abort inside the collective library. With ``settings`` (``{name: text}``,
    from :func:`optimizer_settings`), every rank must also hold the same ones, or each shard
    would be stepped by another rule and the replicas drift apart silently. ``refusal``: this
    rank's own reason to refuse (:func:`tensor_parallel_refusal`), raised on every rank when
    any rank has one. ``caller`` and ``advice`` word the ValueError, raised on every rank alike.

    Returns, per param group, the set of item indices frozen (``requires_grad=False``) that
    still hold a gradient on some rank (:func:`frozen_with_gradient`), the same on every rank:
    torch's optimizers step them (a frozen layer's zeroed gradient still meets weight decay and
    momentum), so OSS partitions them too. Communication: the trainable items' indices and
    shapes (and the settings, and those frozen items' indices) of every rank, once."""
    mine = (trainable_signature(groups), settings or {}, frozen_with_gradient(groups), refusal)
    every = distributed.all_gather_object(mine, group=group)
    me = distributed.get_rank(group)
    refused = [(r, text) for r, (*_, text) in enumerate(every) if text is not None]
    if refused:
        r, text = refused[0]
        raise ValueError(refusal if refusal is not None else
                         f"{caller}: rank {r} of the group refused: {text}")
    for r, (theirs, *_) in enumerate(every):
        if theirs != mine[0]:
            raise ValueError(f"{caller}: rank {r} of the group has different trainable parameters "
                             f"from rank {me}: {_first_difference(theirs, mine[0], r, me)}; every "
                             f"rank must {advice}")
    found = distributed.first_difference([s for _, s, _, _ in every])  # alike on every rank
    if found is not None:
        name, first, r, theirs = found
        raise ValueError(f"{caller}: {name} is {first} on rank 0 of the group and {theirs} on "
                         f"rank {r}; every rank must build {caller} with the same optimizer "
                         f"class and hyper-parameters")
    return [set().union(*(held[g] for _, _, held, _ in every)) for g in range(len(groups))]


def tensor_parallel_refusal(groups: list[dict], group) -> Optional[str]:
    """Why OSS over ``group`` must be refused, or ``None``: ``group`` holds several ranks of one
    tensor-parallel group of the parameters' tensor-parallel layers
    (:func:`shardkit.nn.model_parallel.initialize.tensor_parallel_mates`), which hold different
    slices of the same layers that OSS's sync would copy over each other. Local; the caller
    raises it on every rank through its agreement (:func:`check_same_model_on_every_rank`), as
    a rank of the group without such layers would otherwise wait there."""
    params = [p for g in groups for p in g["params"]]
    if not any(getattr(p, "tensor_model_parallel", False) for p in params):
        return None  # no model-parallel import for plain models
    from shardkit.nn.model_parallel.initialize import tensor_parallel_mates
    return tensor_parallel_mates([group], params, "OSS", "each owner's update would be copied "
                                 "over the other ranks' slices, and gradients of different "
                                 "slices summed", "group")[1]


def optimizer_settings(optim: type, defaults: dict, groups: list[dict]) -> dict:
    """``{name: text}`` of what steps every shard: the optimizer class, its constructor
    arguments and each param group's own hyper-parameters (as ``repr``, so that tensors and
    floats compare exactly; an object's address is left out). Costs nothing."""
    name = getattr(optim, "__qualname__", None) or type(optim).__qualname__
    settings = {"optim": f"{getattr(optim, '__module__', '')}.{name}"}
    settings.update({k: _stable_repr(v) for k, v in defaults.items()})
    for i, g in enumerate(groups):
        settings.update({f"param_groups[{i}][{k!r}]": _stable_repr(v) for k, v in g.items()
                         if k != "params"})
    return settings


def _stable_repr(value) -> str:
    """``repr(value)``, but only the type for an object whose repr holds its address (a
    function, a plain object), which differs between processes for the same thing, and a
    tensor's exact values and dtype, also inside a tuple or list such as Adam's ``betas``
    (its ``repr`` rounds them to 4 digits and names this rank's own device, ``cuda:r``)."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.detach().cpu().tolist()!r}, dtype={value.dtype})"
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        # e.g. Adam's betas given as tensors: each exactly, as a tensor lr
        items = ", ".join(_stable_repr(v) for v in value)
        return f"({items}{',' if len(value) == 1 else ''})" if isinstance(value, tuple) \
            else f"[{items}]"
    text = repr(value)
    return f"<{type(value).__qualname__}>" if " at 0x" in text else text


def param_group_settings(groups: list[dict]) -> dict:
    """``{"param_groups[i]['key']": text}`` of every group's hyper-parameters, and its number of
    parameters, as every rank must hold them alike (``repr``: floats and tensors exactly; the
    parameters' names left out). Costs a ``repr`` of each hyper-parameter."""
    settings = {}
    for i, group in enumerate(groups):
        settings[f"param_groups[{i}] size"] = str(len(group["params"]))
        settings.update({f"param_groups[{i}][{k!r}]": _stable_repr(v)
                         for k, v in sorted(group.items()) if k not in ("params", "param_names")})
    return settings


def trainable_signature(groups: list[dict]) -> list[list[tuple]]:
    """Per param group, ``(item index, shape)`` of each parameter that requires grad: what
    every rank's partition is computed from. Costs nothing."""
    return [[(i, tuple(p.shape)) for i, p in enumerate(g["params"]) if p.requires_grad]
            for g in groups]


def frozen_with_gradient(groups: list[dict]) -> list[list[int]]:
    """Per param group, the indices of the items that do not require grad but hold a gradient
    (frozen after a backward, the gradient kept by ``zero_grad(set_to_none=False)``). Costs
    nothing."""
    return [[i for i, p in enumerate(g["params"]) if not p.requires_grad and p.grad is not None]
            for g in groups]


def _first_difference(theirs: list, mine: list, r: int, me: int) -> str:
    """Where two ranks' trainable signatures first differ, in words (for the error above)."""
    if len(theirs) != len(mine):
        return f"{len(theirs)} param groups on rank {r}, {len(mine)} on rank {me}"
    g, t, m = next((g, t, m) for g, (t, m) in enumerate(zip(theirs, mine)) if t != m)
    for (ti, ts), (mi, ms) in zip(t, m):
        if ti != mi:
            on, off = (r, me) if ti < mi else (me, r)
            return (f"item {min(ti, mi)} of param group {g} is trainable on rank {on} and "
                    f"frozen on rank {off}")
        if ts != ms:
            return (f"trainable parameter {ti} of param group {g} has shape {ts} on rank {r}, "
                    f"{ms} on rank {me}")
    on, off, longer = (r, me, t) if len(t) > len(m) else (me, r, m)
    item = longer[min(len(t), len(m))][0]
    return (f"item {item} of param group {g} is trainable on rank {on} and frozen or absent on "
            f"rank {off}")


def check_no_shared_storage(groups: list[dict], world_size: int) -> None:
    """Two trainable parameters whose memory overlaps (tied through ``.data``, or views of one
    tensor) would be untied by the sync buckets, which give each parameter a place of its own:
    refuse them with the way to tie them that OSS keeps (one Parameter object). No
    communication; nothing to check at world size 1, where OSS keeps the storage as it is."""
    if world_size == 1:
        return
    spans = []
    for g, group in enumerate(groups):
        for i, p in enumerate(group["params"]):
            if not p.requires_grad or p.numel() == 0 or p.device.type == "meta":
                continue
            start = p.untyped_storage().data_ptr() + p.storage_offset() * p.element_size()
            reach = sum((size - 1) * stride for size, stride in zip(p.shape, p.stride())) + 1
            spans.append((start, start + reach * p.element_size(), g, i, tuple(p.shape), id(p)))
    spans.sort()
    for a, b in zip(spans, spans[1:]):
        if b[0] < a[1] and a[5] == b[5]:
            raise ValueError(
                f"OSS: one parameter (shape {a[4]}) is listed twice, as parameter {a[3]} of "
                f"param group {a[2]} and {b[3]} of param group {b[2]}; OSS steps each "
                f"parameter once, on its owner: list it once")
        if b[0] < a[1]:
            raise ValueError(
                f"OSS: trainable parameters {a[3]} of param group {a[2]} (shape {a[4]}) and "
                f"{b[3]} of param group {b[2]} (shape {b[4]}) share memory (tied through "
                f"`.data`?); OSS's sync buffers give each parameter its own storage and would "
                f"untie them. Tie them as one Parameter instead (`b.weight = a.weight`, as "
                f"torch's tie_weights does)")


def groups_of(optimizer: torch.optim.Optimizer) -> list[dict]:
    """``optimizer``'s param-group dicts themselves, not copies: OSS's groups are then the same
    objects, so a learning rate set through the optimizer taken over (or by a scheduler built on
    it) is the one OSS steps with."""
    return list(optimizer.param_groups)


def constructor_kwargs(optim: type, defaults: dict) -> dict:
    """The defaults the optimizer's constructor accepts (some defaults, such as AdamW's
    ``decoupled_weight_decay``, are not constructor arguments)."""
    sig = inspect.signature(optim.__init__)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in sig.parameters and k != "params"}


def without_fixed_defaults(optim: type, defaults: dict) -> dict:
    """``defaults`` minus the keys ``optim``'s constructor does not take but sets itself to the
    same value: ``OSS(params=opt.param_groups, optim=type(opt), **opt.defaults)`` (Lightning's
    call) passes torch AdamW's ``decoupled_weight_decay=True``, which AdamW's constructor
    refuses. A different value stays, so torch's error still names it. Costs one throwaway
    optimizer over a one-element tensor, only when such a key is present."""
    accepted = constructor_kwargs(optim, defaults)
    extra = {k: v for k, v in defaults.items() if k not in accepted}
    if not extra:
        return dict(defaults)
    try:
        fixed = optim([torch.zeros(1, requires_grad=True)], **accepted).defaults
    except Exception:  # noqa: BLE001 - torch's own error comes when the real optimizer is built
        return dict(defaults)
    return {k: v for k, v in defaults.items()
            if k in accepted or k not in fixed or fixed[k] != v}


# ----------------------------------------------------------------------------- loaded state


def state_key_problem(caller: str, optim_cls: type, hyper: dict, param: torch.Tensor, index,
                      state: dict, known: dict) -> Optional[str]:
    """Why the saved per-parameter ``state`` (of the parameter saved at ``index``) cannot be
    loaded into an ``optim_cls`` stepping ``param`` with the group hyper-parameters ``hyper``
    (``None``: it can): a key the optimizer does not keep (another optimizer's, an edited
    dict), or one its step reads that is missing (without this check its owner alone failed
    at the next step, with a ``KeyError``, while the other ranks waited in the parameter
    sync). The keys an optimizer keeps are those a throwaway one of the same class and
    hyper-parameters holds after stepping a one-element stand-in of ``param``'s dimensions,
    dtype and device (:func:`_kept_state_keys`; cached in ``known``). Only torch's and
    shardkit's optimizer classes are checked (another class may add keys later on); one run
    over the whole model (LBFGS) keeps no per-parameter state. Local."""
    # a key saved as None holds nothing (torch <= 2.1's SGD saved momentum_buffer=None without
    # momentum), and a state that holds nothing (an entry a read of ``optimizer.state[p]``
    # made) is started afresh by torch's and shardkit's optimizers, as if it were not saved
    held = {k for k, v in state.items() if v is not None}
    if not held:
        return None
    kept = _kept_state_keys(optim_cls, hyper, param, known)
    if kept is None:
        return None
    optional = {"master_weight"} if getattr(optim_cls, "inner_class", None) else set()
    unknown, missing = sorted(held - kept), sorted(kept - set(state) - optional)
    if not unknown and not missing:
        return None
    what = "; ".join(part for part in (
        f"key(s) {unknown} that {optim_cls.__name__} does not keep" if unknown else "",
        f"no {missing}, which {optim_cls.__name__}'s step reads" if missing else "") if part)
    return (f"{caller}: the saved state of parameter {index!r} (shape {tuple(param.shape)}) has "
            f"{what} (it holds {sorted(state)}, {optim_cls.__name__} with these "
            f"hyper-parameters keeps {sorted(kept)}); the state dict is from another optimizer "
            f"or other settings; the optimizer was left unchanged")


def _kept_state_keys(optim_cls: type, hyper: dict, param: torch.Tensor,
                     known: dict) -> Optional[frozenset]:
    """The per-parameter state keys ``optim_cls`` keeps with ``hyper`` for a parameter like
    ``param``; ``None`` when that cannot be told (see :func:`state_key_problem`). One step of a
    throwaway optimizer over a one-element tensor per (hyper-parameters, dimensions, dtype,
    device), under ``torch.no_grad``; the global RNG is left as it was."""
    module = getattr(optim_cls, "__module__", "") or ""
    if not isinstance(optim_cls, type) or issubclass(optim_cls, torch.optim.LBFGS) \
            or not module.startswith(("torch.optim", "shardkit.optim", "shardkit.ops")):
        return None
    # torch's parameter names (a group built from named_parameters()) are no hyper-parameter:
    # one name per parameter of the group, written out for each would cost N^2
    hyper = {k: v for k, v in hyper.items() if k != "param_names"}
    # each value on its own: one whose repr holds an address must not blur the others
    key = (optim_cls, tuple((k, _stable_repr(v)) for k, v in sorted(hyper.items())),
           param.dim(), param.dtype, param.device)
    if key not in known:
        known[key] = _step_stand_in(optim_cls, hyper, param)
    return known[key]


def _step_stand_in(optim_cls: type, hyper: dict, param: torch.Tensor) -> Optional[frozenset]:
    stand_in = torch.nn.Parameter(torch.zeros((1,) * param.dim(), dtype=param.dtype,
                                              device=param.device))
    stand_in.grad = torch.zeros_like(stand_in)
    try:
        optimizer = _stepped_throwaway(optim_cls, hyper, stand_in)
    except Exception:  # a class that needs more (a closure, sparse gradients): not checked
        return None
    return frozenset(optimizer.state.get(stand_in, {}))


def _stepped_throwaway(optim_cls: type, hyper: dict,
                       stand_in: torch.nn.Parameter) -> torch.optim.Optimizer:
    """A throwaway ``optim_cls`` over ``stand_in`` (its ``.grad`` set) after one step, under
    ``torch.no_grad``; the global RNG is left as it was. Raises what the step raises."""
    # Note: what the throwaway step warns (Adagrad's sparse path warns once per process about
    # sparse invariant checks) concerns no tensor of the caller's: silenced
    with torch.random.fork_rng(devices=[]), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = optim_cls([{**hyper, "params": [stand_in]}])
        step = type(optimizer).step
        # torch's hooked step runs the global step hooks (a user's logging, EMA...) and
        # profiler marks: the trial runs the step under it, which none of them sees
        (step.__wrapped__ if getattr(step, "hooked", False) else step)(optimizer)
    return optimizer


def gradient_step_problem(caller: str, optim_cls: type, hyper: dict, param: torch.Tensor,
                          label: str, layout: Optional[str], known: dict) -> Optional[str]:
    """Why ``optim_cls`` with the group hyper-parameters ``hyper`` cannot step ``param``
    (``label`` says where the parameter is), or ``None`` when it can or that cannot be told.
    ``layout`` is the gradient this rank holds for it: ``"sparse"``
    (``nn.Embedding(sparse=True)``), ``"dense"``, or ``None`` (none here: under
    ``ShardedDataParallel`` only the owner keeps it).

    - a sparse gradient is refused when the optimizer steps a dense one but not a sparse one
      (Adam, AdamW, RMSprop...);
    - a dense gradient is refused when the optimizer steps a sparse one but not a dense one
      (``SparseAdam``);
    - any parameter, with or without a gradient here, is refused when the optimizer can step
      it with neither (``capturable=True`` on CPU); the owner, whatever it holds, finds the
      same, so every rank decides alike even where only the owner holds the gradient.

    Every rank can ask this before the step, so that all raise alike; otherwise only the
    owner's optimizer failed and the other ranks waited in the parameter sync until the
    collective timed out. Told by a throwaway optimizer of the same class and settings
    stepping a two-element stand-in of ``param``'s dimensions (one for a 0-dim parameter),
    dtype and device once with a dense gradient and once with a sparse one; only torch's and
    shardkit's classes are tried (another class's step may do more than update its
    parameters), and LBFGS is not (it needs a closure, and every rank steps the whole model
    anyway). Cached in ``known`` by what chooses a code path (:func:`_step_path_key`:
    ``foreach``, ``fused``, ``capturable``..., whether each number is zero, a tensor's kind),
    not by the numbers a scheduler changes every step. Local."""
    if not _told_by_a_trial(optim_cls):
        return None
    hyper = {k: v for k, v in hyper.items() if k != "param_names"}
    key = ("layouts", optim_cls, _step_path_key(hyper), param.dim(), param.dtype, param.device)
    if key not in known:
        known[key] = {sparse: _step_refusal(optim_cls, hyper, param, sparse)
                      for sparse in (False, True)}
    dense_refusal, sparse_refusal = known[key][False], known[key][True]
    if layout == "sparse" and dense_refusal is None and sparse_refusal is not None:
        return (f"{caller}: {label} (shape {tuple(param.shape)}) has a sparse gradient "
                f"(nn.Embedding(sparse=True)?), which {optim_cls.__name__} with these settings "
                f"does not step ({sparse_refusal}); use an optimizer that takes sparse gradients "
                f"for it (torch.optim.SGD, Adagrad, SparseAdam) or build the embedding with "
                f"sparse=False. No parameter was stepped")
    if layout == "dense" and dense_refusal is not None and sparse_refusal is None:
        return (f"{caller}: {label} (shape {tuple(param.shape)}) has a dense gradient, which "
                f"{optim_cls.__name__} with these settings does not step ({dense_refusal}); "
                f"give it sparse gradients only (nn.Embedding(sparse=True)) or use another "
                f"optimizer for it (torch.optim.Adam). No parameter was stepped")
    if dense_refusal is not None and sparse_refusal is not None:
        return (f"{caller}: {optim_cls.__name__} with these settings cannot step {label} "
                f"(shape {tuple(param.shape)}, {param.dtype}, on {param.device}) with any "
                f"gradient ({dense_refusal}); change the settings of its param group (e.g. "
                f"capturable=False for parameters on CPU). No parameter was stepped")
    return None


def _told_by_a_trial(optim_cls) -> bool:
    """Whether :func:`gradient_step_problem` tries ``optim_cls``: a class of torch's or
    shardkit's, not LBFGS, and for ``MasterWeights.over(X)`` the class ``X`` alike (a client's
    optimizer stepped through masters is copied, its constructor's arguments unknown)."""
    return isinstance(optim_cls, type) and not issubclass(optim_cls, torch.optim.LBFGS) \
        and of_torch_or_shardkit(optim_cls)


def _step_path_key(hyper: dict) -> tuple:
    """What of the hyper-parameters ``hyper`` may choose the code path of a step, and so
    whether it is refused: the switches (None, a bool, a string), whether each number is zero
    (Adagrad steps a sparse gradient with ``weight_decay=0`` only; momentum and weight decay
    are branches), a tensor's dtype, device and dimensions (``lr`` as a tensor), element by
    element in a tuple (``betas``). The same for every value a scheduler moves through, so a
    cache keyed by it stays one entry per setting however many steps it serves."""
    return tuple((k, _path_of(v)) for k, v in sorted(hyper.items()))


def _path_of(value):
    # Note: bool before int (True is an int)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.device, value.dim())
    if isinstance(value, (int, float)):
        return "zero" if value == 0 else "nonzero"
    if isinstance(value, (tuple, list)):
        return tuple(_path_of(v) for v in value)
    return f"<{type(value).__qualname__}>"


def _step_refusal(optim_cls: type, hyper: dict, param: torch.Tensor,
                  sparse: bool) -> Optional[str]:
    """The error ``optim_cls`` raises stepping a stand-in of ``param`` (two elements along its
    first dimension, its dtype and device) with a gradient of ones, sparse or dense; ``None``
    when the step works."""
    # Note: a 0-dim parameter (a learned scale) is stood in for by a 1-dim one, which the
    # optimizers step alike: no sparse gradient has 0 dimensions, and left untold the owner
    # alone raised (SparseAdam given a scalar's dense gradient) while the others hung
    shape = (2,) + (1,) * (param.dim() - 1) if param.dim() else (2,)
    stand_in = torch.nn.Parameter(torch.zeros(shape, dtype=param.dtype, device=param.device))
    grad = torch.ones_like(stand_in)
    stand_in.grad = grad.to_sparse() if sparse else grad
    try:
        _stepped_throwaway(optim_cls, hyper, stand_in)
    except Exception as error:  # noqa: BLE001 - the optimizer's own refusal, quoted
        return f"{type(error).__name__}: {error}"
    return None


# The trial of fused_kernel_carries_nan_as_loop: a few finite steps, then one whose gradient
# holds a NaN in its first and its last element (a step no loss scaler skipped), then a finite
# one again. Note: 37 elements, so that both a kernel's vectorized body (8, 16 or 32 lanes) and
# its scalar tail are tried: torch's fused CPU AdamW keeps the stale AMSGrad max in the tail only
_TRIAL_NUMEL = 37
_TRIAL_STEPS = 5
_TRIAL_NAN_AT_STEP = 3


def fused_kernel_carries_nan_as_loop(optim_cls: type, hyper: dict, device: torch.device,
                                     known: dict) -> bool:
    """Whether torch's fused kernel for ``optim_cls`` with the group hyper-parameters
    ``hyper`` carries a NaN through a step on ``device`` as the default loop does (the
    implementation a caller who leaves ``fused`` unset gets): NaN in the same elements of the
    parameter and of every state tensor.

    Note: they differ with ``amsgrad=True``: after a gradient holding a NaN (a step no loss
    scaler skipped) torch's fused Adam / AdamW kernel keeps the old ``max_exp_avg_sq`` where
    the loop's becomes NaN, so the state (and a consolidated state dict loaded elsewhere)
    differs from the caller's optimizer's. Told by stepping a ``_TRIAL_NUMEL``-element fp32
    stand-in with both, seeded gradients, one of them holding a NaN; a kernel that refuses the
    settings does not agree. Cached in ``known`` by :func:`_step_path_key` (one trial per
    setting, not per learning rate a scheduler moves through); the global RNG is left as it
    was. Local."""
    hyper = {k: v for k, v in hyper.items() if k not in ("params", "param_names")}
    key = ("fused agrees", optim_cls, _step_path_key(hyper), torch.device(device))
    if key not in known:
        known[key] = _trial_steps_agree(optim_cls, hyper, torch.device(device))
    return known[key]


def _trial_steps_agree(optim_cls: type, hyper: dict, device: torch.device) -> bool:
    try:
        loop = _trial_run(optim_cls, {**hyper, "fused": None}, device)
        fused = _trial_run(optim_cls, {**hyper, "fused": True, "foreach": None}, device)
    except Exception:  # noqa: BLE001 - a refusal of the settings: keep the loop
        return False
    return len(loop) == len(fused) and all(_same_nans(a, b) for a, b in zip(loop, fused))


def _trial_run(optim_cls: type, hyper: dict, device: torch.device) -> list[torch.Tensor]:
    """The stand-in and its state tensors (sorted by key) after the trial's steps."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(_TRIAL_NUMEL, generator=gen)
    stand_in = torch.nn.Parameter(start.to(device))
    with torch.random.fork_rng(devices=[]), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = optim_cls([{**hyper, "params": [stand_in]}])
        step = type(optimizer).step
        unhooked = step.__wrapped__ if getattr(step, "hooked", False) else step
        for i in range(_TRIAL_STEPS):
            grad = torch.randn(_TRIAL_NUMEL, generator=gen)
            if i == _TRIAL_NAN_AT_STEP:
                grad[0] = grad[-1] = float("nan")
            stand_in.grad = grad.to(device)
            unhooked(optimizer)
    state = optimizer.state.get(stand_in, {})
    return [stand_in.detach()] + [state[k] for k in sorted(state, key=str)
                                  if torch.is_tensor(state[k])]


def _same_nans(a: torch.Tensor, b: torch.Tensor) -> bool:
    """NaN in the same elements of ``a`` and ``b`` (of one shape)."""
    if a.shape != b.shape:
        return False
    if not (a.is_floating_point() and b.is_floating_point()):
        return True
    return torch.equal(torch.isnan(a.detach()).cpu(), torch.isnan(b.detach()).cpu())
