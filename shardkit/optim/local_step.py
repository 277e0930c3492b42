"""OSS's local step: which implementation the shard's optimizer runs and how one step is taken.

Note on the fused kernel: for ``SGD``, ``Adam``, ``AdamW`` and ``Adagrad`` given with ``fused``
and ``foreach`` both unset (``None``, torch's "you choose"), fp32 parameters on CPU or CUDA and
no ``differentiable``, OSS chooses torch's own fused kernel for the local step, several times
faster on CPU. It computes the same update in another order, so it is not bit-identical to
torch's default loop: results differ by rounding, one or a few units in the last place of some
elements (Adam, AdamW and Adagrad from the first step; SGD with momentum on some tensor sizes),
and later steps carry those differences on. Measured on CPU (torch 2.13, unit-scale fp32
weights): up to about 1e-7 absolute after 200 steps, within the parity contract's tight
tolerance but not bit for bit. Pass ``fused=False`` (to OSS, or in a group) for the default
loop's exact bits. Parameters cast to another dtype later (``model.to(torch.bfloat16)``) turn
the choice off at the next step, for good: in 16 bits the fused kernel rounds differently from
torch's default loop by whole 16-bit units. ``OSS.fused`` reports the choice; it is written
into the local optimizer's groups only. The public param groups and a consolidated state dict
keep the caller's ``fused=None``, so they read (and load into a plain torch optimizer) exactly
as that optimizer's own would (FairScale's tests compare the two). Set ``group["fused"] =
False`` to step that group with torch's default loop from the next step on, or pass
``fused=False`` to OSS. The kernel pairs each parameter's elements with its state's in memory
order, so OSS first lays out any state tensor whose memory layout differs from its parameter's
(state loaded from a contiguous state dict for a ``channels_last`` model, or made before
``p.data = w.t()``) as the parameter is: the default loop's update, not another element's.

The local optimizer's ``step`` is called without torch's step-hook wrapper: global step hooks
(``torch.optim.optimizer.register_optimizer_step_pre_hook``/``_post_hook``) and hooks on the OSS
run once per OSS step, as for a plain optimizer, not once more per sync bucket. Hooks registered
on the local optimizer itself (by an ``optim=`` factory) still run around each of its calls, and
a ``step`` replaced on that instance is still the one called.

A step is taken whole, or, for optimizers that update each parameter independently, bucket by
bucket: stepping the parameters of bucket ``k`` only, then starting its all-gather while bucket
``k+1`` is stepped (:meth:`~shardkit.optim.param_sync.ParamSync.step_and_sync`).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

__all__ = ["choose_fused", "all_fp32", "with_fused_choice", "without_fused_choice",
           "build_local_optimizer", "rebuilt_from_class", "of_torch_or_shardkit", "copy_over",
           "refuse_parameters_held_outside_groups",
           "steps_each_parameter_alone", "step_only", "fused_sgd_calls",
           "fused_first_steps_collide", "whole_step", "runs_on_whole_model", "agreed_closure"]

# Optimizers whose step treats each parameter independently (state per parameter, nothing
# shared across the group). Only these are stepped bucket by bucket.
_PER_PARAMETER_OPTIMIZERS = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
    torch.optim.Adadelta,
})
# torch optimizers with a fused multi-tensor kernel on CPU and CUDA.
_FUSED_OPTIMIZERS = frozenset({torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                               torch.optim.Adagrad})


def runs_on_whole_model(optim_class: type) -> bool:
    """Whether OSS must run ``optim_class`` over every parameter on every rank instead of over
    this rank's shard: LBFGS (and subclasses), whose one state (the curvature history, kept under
    its first parameter) and whose line search are over the flattened model, so that a step over
    a shard is another algorithm, and whose closure is called a data-dependent number of times
    (ranks stepping their own shards called it a different number of times and hung in the
    closure's collectives, or mixed gradients taken at different points and diverged)."""
    return isinstance(optim_class, type) and issubclass(optim_class, torch.optim.LBFGS)


def agreed_closure(closure: Callable, params: list, group, world_size: int,
                   what: str) -> Callable:
    """``closure`` for an optimizer run on the whole model on every rank (see
    :func:`runs_on_whole_model`): its loss is averaged over the ranks (the loss of the global
    batch, as DDP's averaged gradients are its gradients), so that every rank takes the same
    decisions (convergence tests, line search) and calls the closure as often as the others.
    The ranks must also hold gradients of the same parameters (every reduced gradient, as under
    DDP): checked in the same all-reduce, a RuntimeError on every rank otherwise (under
    ShardedDataParallel only the owners keep them). Communication: one all-reduce of
    ``1 + len(params)`` float64 elements (the loss, then which parameters hold a gradient) per
    call of the closure."""
    from shardkit import distributed

    def closure_on_every_rank():
        with torch.enable_grad():
            loss = closure()
        value = float(loss.detach() if torch.is_tensor(loss) else loss) if loss is not None \
            else 0.0
        # the loss, then a 1 for each parameter holding a gradient: summed over the ranks, each
        # flag must be 0 or world_size (every rank holds that gradient, or none does)
        agreed = torch.tensor([value] + [float(p.grad is not None) for p in params],
                              dtype=torch.float64)
        distributed.all_reduce(agreed, group=group)
        total, flags = agreed[0].item(), agreed[1:]
        mixed = ((flags != 0) & (flags != world_size)).nonzero().flatten().tolist()
        if mixed:
            held = sum(1 for p in params if p.grad is not None)
            raise RuntimeError(
                f"{what}: runs over the whole model on every rank (it steps the flattened "
                f"model, not a shard), so every rank must hold every reduced gradient, as under "
                f"DistributedDataParallel; {len(mixed)} of {len(params)} parameters (the first "
                f"is parameter {mixed[0]}) have a gradient on some ranks only, this rank holds "
                f"{held} (under ShardedDataParallel only the owners keep them: use "
                f"DistributedDataParallel, or a per-parameter optimizer)")
        if loss is None:
            return None
        mean = torch.tensor(total / world_size, dtype=torch.float64)
        return mean.to(loss.dtype) if torch.is_tensor(loss) else type(loss)(mean.item())
    return closure_on_every_rank


def is_named_parameter(x) -> bool:
    """Whether ``x`` is a ``(name, parameter)`` pair, as ``model.named_parameters()`` yields
    and torch's optimizers take. Local."""
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) \
        and isinstance(x[1], torch.Tensor)


def choose_fused(optim_class: type, kwargs: dict, groups: list[dict]) -> bool:
    """Whether OSS runs the local step with torch's fused kernel: a torch optimizer that has
    one, ``fused`` and ``foreach`` left unset (``None``) in the constructor arguments and in
    every group, not differentiable, and floating-point parameters on CPU or CUDA."""
    if optim_class not in _FUSED_OPTIMIZERS or kwargs.get("differentiable"):
        return False
    if kwargs.get("fused") is not None or kwargs.get("foreach") is not None:
        return False
    if any(g.get("fused") is not None or g.get("foreach") is not None for g in groups):
        return False
    # torch's optimizers also take (name, parameter) pairs (model.named_parameters())
    params = [p[1] if is_named_parameter(p) else p for g in groups for p in g["params"]]
    return all_fp32(params) and all(p.device.type in ("cpu", "cuda") for p in params)


def all_fp32(params) -> bool:
    """Whether every parameter is fp32: only there does the fused kernel's update stay within
    rounding of the default loop's (a few units in the last place per step; see the module's
    note). In 16-bit it computes in fp32 and rounds once, where the loop rounds after every
    operation: a difference of whole 16-bit units."""
    return all(p.dtype == torch.float32 for p in params)


def with_fused_choice(group: dict, fused: bool) -> dict:
    """``group`` with ``fused=True`` written in where OSS chose the fused kernel and the group
    leaves the implementation to torch (a state dict saved by a plain optimizer, or by OSS)."""
    if fused and group.get("fused") is None and group.get("foreach") is None:
        return {**group, "fused": True}
    return dict(group)


def without_fused_choice(group: dict, fused: bool) -> dict:
    """``group`` as the caller asked for it: ``fused=None`` where OSS wrote in its own choice
    (what a consolidated state dict records)."""
    if fused and group.get("fused") is True and group.get("foreach") is None:
        return {**group, "fused": None}
    return dict(group)


def build_local_optimizer(optim_class: type, kwargs: dict, groups: list[dict], owned: set,
                          fused: bool, template: Optional[torch.optim.Optimizer] = None
                          ) -> torch.optim.Optimizer:
    """The optimizer over this rank's parameters: one group per public group (same
    hyper-parameters, only the parameters whose ``id`` is in ``owned``), a new ``optim_class``
    or, given ``template`` (an optimizer OSS took over, see :func:`rebuilt_from_class`), a copy
    of it (:func:`copy_over`). Memory: the state of the owned parameters only, allocated lazily
    by the optimizer's first step."""
    local_groups = [_local_group(g, owned, fused) for g in groups]
    if template is not None:
        return copy_over(template, local_groups)
    kwargs = dict(kwargs)
    if fused:
        kwargs["fused"] = True
    return optim_class(local_groups, **kwargs)


def rebuilt_from_class(optim_class: type) -> bool:
    """Whether an optimizer of this class, taken over by OSS (``OSS(existing)``, the engine's
    stages 1-2 given an optimizer instance), is built again from its class and ``defaults`` on
    each rank's shard: torch's own optimizers and shardkit's (``FusedAdamW``, ``shardkit.ops``'
    DeepSpeed optimizers, ``MasterWeights.over(X)`` for such an ``X``), whose constructors keep
    nothing beside ``defaults`` but what they rebuild (torch's may then take the fused kernel;
    a copy of a ``MasterWeights`` would share its masters). Any other class's constructor may
    keep its own arguments as attributes (``self.factor = factor``) that ``defaults`` does not
    hold, or take required arguments that ``defaults`` cannot supply: such an optimizer is
    copied instead (:func:`copy_over`), as DeepSpeed steps the client's optimizer itself."""
    return of_torch_or_shardkit(optim_class)


def of_torch_or_shardkit(optim_class: type) -> bool:
    """Whether ``optim_class`` is one of torch's or shardkit's optimizer classes (for
    ``MasterWeights.over(X)``: whether ``X`` is), whose behaviour shardkit knows: its
    constructor keeps nothing beside ``defaults`` but what it rebuilds, and its step only
    updates its parameters."""
    module = getattr(optim_class, "__module__", "") or ""
    if not module.startswith(("torch.optim", "shardkit.optim", "shardkit.ops")):
        return False
    inner = getattr(optim_class, "inner_class", None)
    return inner is None or of_torch_or_shardkit(inner)


def copy_over(optimizer: torch.optim.Optimizer, groups: list) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` whose groups are ``groups`` and whose state is empty
    (torch's ``Optimizer.__init__`` run again on it; the subclass's constructor is not, so what
    it stored beside ``defaults`` is kept, shared with ``optimizer``). Not ``copy.copy``:
    torch's ``__getstate__`` keeps only defaults, state and groups. Methods set on the instance
    (a torch LR scheduler wraps ``optimizer.step`` so, around ``optimizer`` itself) are not
    copied: the copy steps with its class's. The step hooks registered on ``optimizer``
    (``register_step_pre_hook`` / ``register_step_post_hook``) are shared with the copy (the
    same dicts: a handle removes a hook from both), so they run at each step of the copy, given
    the copy, as they ran given ``optimizer``. An attribute holding ``optimizer``'s own
    parameter list (rather than reading ``param_groups``) still names every parameter: such an
    optimizer would not step a shard: see :func:`refuse_parameters_held_outside_groups`.
    Memory: the group lists only."""
    cls = type(optimizer)
    copied = cls.__new__(cls)
    copied.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                            if not callable(getattr(cls, k, None))})
    torch.optim.Optimizer.__init__(copied, groups, dict(optimizer.defaults))
    for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        if hooks in optimizer.__dict__:  # torch's __init__ gave the copy empty ones
            setattr(copied, hooks, optimizer.__dict__[hooks])
    return copied


def refuse_parameters_held_outside_groups(optimizer: torch.optim.Optimizer,
                                          caller: str) -> None:
    """A TypeError naming ``optimizer``'s instance attributes that hold its parameters beside
    ``param_groups`` (:func:`_attributes_holding_parameters`): a copy of it (:func:`copy_over`)
    shares them, so each rank's copy would still step every parameter through them and keep
    their state where no checkpoint reads it (a Lookahead's base optimizer: its moments
    silently left out of every consolidated state dict). Local: one pass over the attributes,
    alike on every rank."""
    held = _attributes_holding_parameters(optimizer)
    if held:
        name = type(optimizer).__name__
        raise TypeError(
            f"{caller}: the {name} given also holds its parameters outside its param_groups "
            f"(attribute{'s' if len(held) > 1 else ''} {', '.join(map(repr, held))}); each "
            f"rank steps a copy of it over its own shard, which would still step every "
            f"parameter through {'them' if len(held) > 1 else 'it'}, their optimizer state "
            f"left out of the checkpoints. Pass a callable that builds the {name} over the "
            f"parameters it is given instead (OSS(params, optim=lambda groups, **hyper: ...), "
            f"shardkit.initialize(optimizer=lambda params: ...))")


def _attributes_holding_parameters(optimizer: torch.optim.Optimizer) -> list:
    """Names of ``optimizer``'s instance attributes other than torch's ``defaults``, ``state``
    and ``param_groups`` that hold one of its parameters: the tensor itself, in a list, tuple,
    set or dict (key or value), or in another optimizer's param groups."""
    own = {id(p) for g in optimizer.param_groups for p in g["params"]}
    held = []
    for name, value in vars(optimizer).items():
        if name in ("defaults", "state", "param_groups") or value is optimizer:
            continue
        if own & {id(t) for t in _tensors_in(value)}:
            held.append(name)
    return held


def _tensors_in(value) -> list:
    """The tensors ``value`` holds one level down (an optimizer, or a param-group dict such as
    those of ``self.groups = self.param_groups``: its parameters)."""
    if isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        items = [value]
    tensors = []
    for item in items:
        if torch.is_tensor(item):
            tensors.append(item)
        elif isinstance(item, torch.optim.Optimizer):
            tensors += [p for g in item.param_groups for p in g["params"]]
        elif isinstance(item, dict) and isinstance(item.get("params"), (list, tuple)):
            tensors += [p for p in item["params"] if torch.is_tensor(p)]
    return tensors


def _local_group(group: dict, owned: set, fused: bool) -> dict:
    """``group`` narrowed to the owned parameters (and their names, for a named group)."""
    keep = [i for i, p in enumerate(group["params"]) if id(p) in owned]
    local = with_fused_choice({k: v for k, v in group.items() if k != "params"}, fused)
    if "param_names" in local:
        local["param_names"] = [group["param_names"][i] for i in keep]
    local["params"] = [group["params"][i] for i in keep]
    return local


def steps_each_parameter_alone(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step updates each parameter from its own gradient and state only
    (so stepping a subset, then the rest, is exactly one step)."""
    return type(optimizer) in _PER_PARAMETER_OPTIMIZERS


def step_only(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
              step_kwargs: dict) -> None:
    """Step ``params`` only: each param group's list is narrowed to them for the call and put
    back after. No parameter or gradient is touched beyond the step itself, so another thread
    may go on using the others (ShardedDDP / DDP backward while a bucket is stepped). No copy.
    Fused SGD with momentum takes its first-time parameters in a call of their own
    (:func:`fused_sgd_calls`)."""
    for subset in fused_sgd_calls(optimizer, params):
        _step_narrowed(optimizer, subset, step_kwargs)


def fused_sgd_calls(optimizer: torch.optim.Optimizer,
                    params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` split into the calls a step must make: one, except for torch's fused SGD
    with momentum, whose kernel treats a call as a first step only when *no* parameter in it
    has a momentum buffer yet, and fails on a mix. A parameter that gets its first gradient
    after the others' first step (unused until now, or made trainable later) is then stepped
    in a call of its own, as torch's default loop steps each parameter: same update."""
    groups = _fused_momentum_groups(optimizer)
    if not groups:
        return [params]
    fused_momentum = {id(p) for g in groups for p in g["params"]}
    first, other = [], []
    for p in params:
        new = (id(p) in fused_momentum and p.grad is not None
               and optimizer.state.get(p, {}).get("momentum_buffer") is None)
        (first if new else other).append(p)
    return [subset for subset in (first, other) if subset] if first else [params]


def fused_first_steps_collide(optim_class: type, hyper: dict) -> bool:
    """Whether torch's fused kernel for ``optim_class`` with these hyper-parameters fails on a
    call where some parameters step for the first time and others not (SGD with momentum:
    see :func:`fused_sgd_calls`). A plain torch optimizer given such a kernel cannot recover;
    OSS's local step splits the call."""
    return issubclass(optim_class, torch.optim.SGD) and hyper.get("momentum", 0) != 0


def _fused_momentum_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [g for g in optimizer.param_groups
            if g.get("fused") and fused_first_steps_collide(type(optimizer), g)]


def _step_narrowed(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                   step_kwargs: dict) -> None:
    keep = {id(p) for p in params}
    saved = [g["params"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["params"] = [p for p in g["params"] if id(p) in keep]
    try:
        _unhooked_step(optimizer)(**step_kwargs)
    finally:
        for g, group_params in zip(optimizer.param_groups, saved):
            g["params"] = group_params


def whole_step(optimizer: torch.optim.Optimizer, closure: Optional[Callable],
               step_kwargs: dict):
    """One ordinary step of every owned parameter; returns what the optimizer returns.
    Fused SGD (whose step calls the closure once, first) evaluates the closure here and then
    steps as :func:`step_only` does, so that first-time parameters are stepped apart."""
    if _fused_momentum_groups(optimizer):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step_only(optimizer, [p for g in optimizer.param_groups for p in g["params"]],
                  step_kwargs)
        return loss
    if closure is not None:
        return _unhooked_step(optimizer)(closure=_with_grad(closure), **step_kwargs)
    return _unhooked_step(optimizer)(**step_kwargs)


def _unhooked_step(optimizer: torch.optim.Optimizer) -> Callable:
    """``optimizer.step`` without the wrapper torch's ``Optimizer`` puts around every
    subclass's ``step`` (the global and per-instance step hooks, a profiler mark).

    Note: the local optimizer is OSS's implementation: the OSS's own ``step`` runs those hooks
    once per step, as a plain optimizer's does. Through the wrapper, a hook registered with
    ``torch.optim.optimizer.register_optimizer_step_post_hook`` (a step counter, an EMA update)
    also ran for the local optimizer, once per sync bucket: several times per step."""
    if "step" in vars(optimizer):  # replaced on the instance (a factory's wrapper): honour it
        return optimizer.step
    step = type(optimizer).step
    if not (getattr(step, "hooked", False) and hasattr(step, "__wrapped__")):
        return optimizer.step
    raw = functools.partial(step.__wrapped__, optimizer)
    pre, post = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    if not pre and not post:
        return raw

    def with_own_hooks(*args, **kwargs):  # the instance's hooks, as torch's wrapper runs them
        full = (optimizer, *args)
        for hook in list(pre.values()):
            result = hook(optimizer, full, kwargs)
            if result is not None:
                full, kwargs = result
        out = step.__wrapped__(*full, **kwargs)
        for hook in list(post.values()):
            hook(optimizer, full, kwargs)
        return out
    return with_own_hooks


def _with_grad(closure: Callable) -> Callable:
    """``closure`` run with autograd on. OSS's step runs under ``torch.no_grad``; torch's own
    optimizers enable grad around the closure themselves, but an optimizer whose ``step`` just
    calls ``closure()`` (apex-style, or written before torch 1.5) would otherwise run the
    forward without a graph and fail in backward, where a plain torch optimizer (and FairScale's
    OSS, which steps in the caller's grad mode) works. Lightning's automatic optimization always
    passes a closure. Costs nothing."""
    def closure_with_grad():
        with torch.enable_grad():
            return closure()
    return closure_with_grad
