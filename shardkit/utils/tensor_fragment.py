"""DeepSpeed's tensor-fragment API (``deepspeed.utils.safe_get_full_fp32_param`` and friends)
over shardkit's own sharding, so that ``import shardkit as deepspeed`` scripts that read or
write one parameter's full value, gradient or optimizer state run unchanged.

Each function takes a parameter of an engine's model (``engine.module``'s, an engine built by
:func:`shardkit.initialize`) or of a model wrapped by hand in
:class:`~shardkit.nn.data_parallel.FullyShardedDataParallel`, and works on what the stage keeps:

====== ==================================== ================================ ====================
stage  full fp32 value                      full gradient                    optimizer state
====== ==================================== ================================ ====================
0      the parameter (every rank)           ``.grad`` (every rank, averaged) every rank holds it
1      the parameter (every rank)           on its OSS owner (``reduce_       on its OSS owner:
                                            scatter``, default) or every rank broadcast from it
2      the parameter (every rank)           on its OSS owner: broadcast      as stage 1
3      FSDP rows: one all-gather            rows: one all-gather             rows: one all-gather
====== ==================================== ================================ ====================

With fp16/bf16 at stages 0-2 the model's weights are 16-bit and a parameter's full fp32
value is its master weight: at stage 0 on every rank, at stages 1-2 kept by its OSS owner (a
broadcast of ``Ψ_p`` fp32 elements from it). Full values are returned as new fp32 tensors
shaped like the original parameter (on the parameter's compute device); the ``set`` functions
take the same full value on every rank and keep each rank's part (no communication). The
``*_local_*`` functions read or write this rank's FSDP row block (shape
``(ceil(rows / N), ...)``, zero padded; stage 3 only, as in DeepSpeed).

Collectives: whenever a function communicates, every rank of the data-parallel group must call
it for the same parameter (as DeepSpeed requires). Argument errors (a tensor that is no engine's
parameter, a key that is not a string, a value of the wrong shape, a ``*_local_*`` call below
stage 3) are raised on every rank before any collective. Where only the OSS owner can know the
answer (is there a gradient, an optimizer state, this key?), the owner broadcasts a one-element
verdict first, so every rank returns ``None`` together or raises the same error together.

Gradients (``safe_get/set_full_grad``, ``safe_get/set_local_grad``) exist at stages 1-3 only at
an engine's accumulation boundary: after the ``engine.backward(loss)`` of the window's last
micro-batch and before ``engine.step()``. In the middle of a window they raise ``ValueError``
(each rank would hold its own partial sum). DeepSpeed raises there at stage 2 only: at stages 0-1
it returns each rank's local ``param.grad`` (stage 0 here does the same), at stage 3 the reduced
partial sum of the micro-batches so far, which shardkit's stage 3 does not keep.

Gradients are what the engine holds between the accumulation boundary's ``engine.backward``
and ``engine.step`` (which clears them): averaged over the ranks, divided by the accumulation
steps, and, under fp16, multiplied by the loss scale, as DeepSpeed's are.

Differences from DeepSpeed: at stage 0 the values are returned (DeepSpeed returns ``None``
without its bf16 optimizer); ``None`` also for a frozen parameter's gradient and optimizer
state, and for optimizer state before the first step (shardkit's optimizers build it lazily).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch

from shardkit import distributed
from shardkit.utils.swapped_tensors import swapped_since, tensor_mark

__all__ = ["safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_grad",
           "safe_set_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_optimizer_state", "safe_get_local_fp32_param",
           "safe_set_local_fp32_param", "safe_get_local_grad", "safe_set_local_grad",
           "safe_get_local_optimizer_state", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized", "register_engine", "is_engine", "locate_parameter",
           "ParamLocation"]

# verdicts an OSS owner broadcasts before the value
_OK, _ABSENT, _UNKNOWN_KEY = 0, 1, 2

_ENGINES: "weakref.WeakSet" = weakref.WeakSet()
# id(param) -> (weakref to param, weakref to the engine whose model holds it)
_CACHE: dict = {}


def register_engine(engine) -> None:
    """Make ``engine``'s parameters known to this API (every ``shardkit.initialize`` engine
    registers itself when built). Local; keeps only a weak reference."""
    _ENGINES.add(engine)


def is_engine(obj) -> bool:
    """Whether ``obj`` is a ``shardkit.initialize`` engine (one registered by
    :func:`register_engine`), for mechanism modules that must not import the engine. Local."""
    try:
        return obj in _ENGINES
    except TypeError:  # not weak-referenceable: no engine
        return False


@dataclass
class ParamLocation:
    """Where a parameter lives: ``stage`` (0-3), the ``engine`` (``None`` for a hand-wrapped
    FSDP model), the FSDP ``unit`` and the parameter's ``index`` in its shard (stage 3), the
    ``optimizer`` that steps it (``None`` when frozen or unknown)."""

    param: torch.nn.Parameter
    stage: int
    engine: Any = None
    unit: Any = None
    index: int = -1
    optimizer: Optional[torch.optim.Optimizer] = None

    @property
    def shard(self):
        """The FSDP unit's flat shard (stage 3)."""
        return self.unit._shard

    @property
    def layout(self):
        """The parameter's :class:`~shardkit.checkpoint.resharding.ParamLayout` in its shard
        (stage 3)."""
        return self.shard.layouts[self.index]

    @property
    def oss(self):
        """``optimizer`` when it is an :class:`~shardkit.optim.OSS`, else ``None``."""
        from shardkit.optim import OSS
        return self.optimizer if isinstance(self.optimizer, OSS) else None

    @property
    def owner_global_rank(self) -> int:
        """The global rank whose ``oss`` partition owns (steps) the parameter (needs ``oss``)."""
        oss = self.oss
        return distributed.get_global_rank(oss.group, oss.partition.owner(self.param))

    @property
    def is_owner(self) -> bool:
        """Whether this rank owns the parameter in ``oss`` (needs ``oss``)."""
        return self.owner_global_rank == distributed.get_rank()

    @property
    def trainable(self) -> bool:
        """Whether ``optimizer`` steps the parameter (``False`` without one)."""
        if self.optimizer is None:
            return False
        if self.oss is not None:
            return self.param in self.oss.param_to_rank
        return any(p is self.param for g in self.optimizer.param_groups for p in g["params"])


def _owning_engine(param):
    for engine in list(_ENGINES):
        if any(p is param for p in engine.module.parameters()):
            return engine
    return None


def _unit_of(param) -> tuple:
    """``(unit, index in its shard)`` of a parameter an FSDP unit shards (an engine's at stage
    3, or one wrapped by hand), else ``(None, -1)``. A dictionary lookup."""
    from shardkit.nn.data_parallel.fully_sharded import unit_holding
    unit = unit_holding(param)
    if unit is None or unit._shard is None:
        return None, -1
    return unit, next(i for i, p in enumerate(unit._shard.params) if p is param)


def _engine_of(param):
    """The live engine whose model holds ``param``, else ``None``; a found one is remembered
    per parameter (otherwise every registered engine's parameters are walked)."""
    # Note: the parameter is known by its tensor mark, not a weak reference, which
    # swap_tensors refuses (a swapped load_state_dict after this call)
    hit = _CACHE.get(id(param))
    if hit is not None and not swapped_since(param, hit[0]) and hit[1]() is not None:
        return hit[1]()
    engine = _owning_engine(param)
    if engine is not None:
        _CACHE[id(param)] = (tensor_mark(param), weakref.ref(engine))
    return engine


def locate_parameter(param, what: str) -> ParamLocation:
    """The :class:`ParamLocation` of ``param``; ``ValueError`` naming ``what`` (the caller)
    when it is no parameter of an engine or of an FSDP-wrapped model. Local."""
    if not isinstance(param, torch.nn.Parameter):
        raise ValueError(f"{what}(param=...): expected a torch.nn.Parameter of the engine's model "
                         f"(engine.module.parameters()), got {_describe(param)}")
    engine = _engine_of(param)
    unit, index = _unit_of(param) if engine is None or engine.zero_stage == 3 else (None, -1)
    if engine is None and unit is None:
        raise ValueError(
            f"{what}(param=...): the {_describe(param)} is not a parameter of a model "
            f"built by shardkit.initialize (engine.module.parameters()) nor of a model "
            f"wrapped in shardkit's FullyShardedDataParallel; pass one of the engine's "
            f"model's parameters")
    optimizer = None if engine is None else engine.optimizer
    if unit is not None:
        return ParamLocation(param, 3, engine, unit, index, optimizer)
    return ParamLocation(param, engine.zero_stage, engine, None, -1, optimizer)


def _describe(obj) -> str:
    if isinstance(obj, torch.Tensor):
        return f"{type(obj).__name__} of shape {tuple(obj.shape)}"
    return f"{type(obj).__name__}"


def _check_value(value, shape, what: str, argument: str = "value") -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{what}({argument}=...): expected a tensor of shape {tuple(shape)}, "
                         f"got {_describe(value)}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{what}({argument}=...): shape {tuple(value.shape)} does not match "
                         f"the expected {tuple(shape)}")
    if not (value.is_floating_point() or value.is_complex()):
        raise ValueError(f"{what}({argument}=...): expected a floating-point tensor, got "
                         f"dtype {value.dtype}")


def _check_key(key, what: str) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"{what}(optim_state_key={key!r}): expected the name of a per-element "
                         f"optimizer state, e.g. 'exp_avg' or 'exp_avg_sq' for Adam")


def _full_shape(loc: ParamLocation) -> tuple:
    return tuple(loc.layout.shape) if loc.unit is not None else tuple(loc.param.shape)


def _stored_rows(loc: ParamLocation) -> torch.Tensor:
    """This rank's row block of a stage-3 parameter as the unit stores it: the parameter's
    own data, except inside :class:`~shardkit.zero.GatheredParameters` (or
    ``summon_full_params``), where the parameter holds its full value and the rows wait in
    the unit's flat shard, which the parameter points at again when the block ends. Local."""
    if not loc.unit._summoned:
        return loc.param.data
    shard = loc.shard
    return shard.shard_views(shard.flat_shard)[loc.index]


def _holds_full_value(loc: ParamLocation, rows: torch.Tensor) -> bool:
    """Whether a stage-3 parameter holds its full value now (inside a gathering block), apart
    from its stored ``rows``."""
    return loc.param.data.data_ptr() != rows.data_ptr() or loc.param.shape != rows.shape


def _give_row_gradient(loc: ParamLocation, grad: torch.Tensor) -> None:
    """``loc.param.grad = grad`` for a stage-3 gradient of the stored rows' shape. Inside a
    gathering block the parameter holds its full value and torch refuses a gradient of
    another shape, so the parameter points at its rows while the gradient is attached (the
    block leaves ``.grad`` as it is and re-points the parameter at those rows on exit)."""
    param, rows = loc.param, _stored_rows(loc)
    full = param.data
    param.data = rows
    try:
        param.grad = grad
    finally:
        param.data = full


def _grad_held_full(loc: ParamLocation) -> bool:
    """Whether a stage-3 parameter's ``.grad`` is its full gradient now: inside
    ``summon_full_params(with_grads=True)`` on a rank that holds the full values (every rank,
    or rank 0 alone with ``rank0_only``). Its rows then wait aside until the block ends. Local."""
    return loc.unit._summoned_grads and _holds_full_value(loc, _stored_rows(loc))


def _grad_edit_dropped_by_block(loc: ParamLocation) -> bool:
    """Whether a gradient edit here would be dropped by ``summon_full_params(with_grads=True,
    rank0_only=True)``: this rank is not the first, so ``.grad`` is still its shard's gradient,
    but the first rank holds the full gradient and drops edits to it on exit (``rank0_only``
    needs ``writeback=False``). Writing the shard here would leave the ranks' row blocks of
    one gradient from before and after the edit, so this rank drops it too. Local."""
    return loc.unit._summoned_grads and not _holds_full_value(loc, _stored_rows(loc))


def _grad_rows(loc: ParamLocation) -> Optional[torch.Tensor]:
    """This rank's row block of a stage-3 gradient (``None`` without one): ``.grad`` itself,
    or inside ``summon_full_params(with_grads=True)`` this rank's rows of the full gradient
    the block holds (a new tensor: what the block's writeback keeps). Local."""
    from shardkit.checkpoint.resharding import shard_rows
    grad = loc.param.grad
    if grad is None or not _grad_held_full(loc):
        return grad
    return shard_rows(grad.detach(), loc.layout, loc.shard.rank)


def _write_block_into_full(loc: ParamLocation, full: torch.Tensor, block: torch.Tensor) -> None:
    """Copy this rank's row block ``block`` (padding dropped) over its rows of ``full``, a
    full-shaped tensor a gathering block holds (the parameter's value or gradient), so that
    the block's writeback, which keeps each rank's rows of it, keeps ``block``. Local."""
    start, count = loc.layout.real_rows(loc.shard.rank)
    target = full if full.dim() else full.view(1)
    with torch.no_grad():
        target[start:start + count].copy_(block[:count].to(target.device, target.dtype))


def _param_shape(loc: ParamLocation) -> tuple:
    """The shape of what the optimizer steps for ``loc.param``: its row block at stage 3
    (also inside a gathering block), else the parameter's shape."""
    return tuple(_stored_rows(loc).shape) if loc.unit is not None else tuple(loc.param.shape)


# ----------------------------------------------------------------------------- stage 3 rows


def _gather_rows(loc: ParamLocation, rows: torch.Tensor) -> torch.Tensor:
    """The full fp32 tensor from every rank's row block ``rows`` (shape ``shard_shape``) of
    the unit's shard group: one all-gather of ``N x rows`` fp32 elements."""
    from shardkit.checkpoint.resharding import unshard_rows
    shard = loc.shard
    device = shard.compute_device
    block = rows.detach().to(device=device, dtype=torch.float32).reshape(-1).contiguous()
    out = torch.empty(block.numel() * shard.world_size, dtype=torch.float32, device=device)
    distributed.all_gather_into_tensor(out, block, group=shard.group)
    return unshard_rows(list(out.chunk(shard.world_size)), loc.layout)


def write_rows(loc: ParamLocation, target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy this rank's row block of the full ``value`` into ``target`` (a stage-3
    parameter's rows, its gradient's, or an optimizer state's), in ``target``'s device and
    dtype. Local."""
    from shardkit.checkpoint.resharding import shard_rows
    with torch.no_grad():
        target.copy_(shard_rows(value.detach().to(target.device, target.dtype), loc.layout,
                                loc.shard.rank))


def _agreed_owner_verdict(loc: ParamLocation, verdict: int) -> int:
    """Broadcast the owner's one-element verdict over the OSS group (every rank enters)."""
    flag = torch.tensor([verdict], dtype=torch.int64, device=loc.param.device)
    distributed.broadcast(flag, src=loc.owner_global_rank, group=loc.oss.group)
    return int(flag.item())


def _from_owner(loc: ParamLocation, value: Optional[torch.Tensor]) -> torch.Tensor:
    """The owner's full fp32 ``value`` on every rank: one broadcast of Ψ_p fp32 elements."""
    out = torch.empty(loc.param.shape, dtype=torch.float32, device=loc.param.device)
    if loc.is_owner:  # the state may live elsewhere (offload_optimizer): the wire's device
        out.copy_(value.detach())
    distributed.broadcast(out, src=loc.owner_global_rank, group=loc.oss.group)
    return out


def _oss_state(loc: ParamLocation) -> Optional[dict]:
    oss = loc.oss
    state = oss.optim.state.get(loc.param)
    if state is None:
        state = oss._parked_state.get(loc.param)
    return state


def _elementwise(state: Optional[dict], key: str, shape) -> tuple:
    """``(verdict, tensor)`` for ``state[key]``: absent without state, unknown key when the
    state has no tensor of the parameter's (or shard's) shape under ``key``."""
    from shardkit.optim.master_weights import MASTER_WEIGHT_KEY
    if not state or list(state) == [MASTER_WEIGHT_KEY]:  # a master alone: no step taken yet
        return _ABSENT, None
    value = state.get(key)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
        return _UNKNOWN_KEY, None
    return _OK, value


def _unknown_key_error(loc: ParamLocation, key: str, what: str, state: Optional[dict]):
    known = sorted(k for k, v in (state or {}).items()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)
    optimizer = loc.oss.optim if loc.oss is not None else loc.optimizer
    return ValueError(f"{what}(optim_state_key={key!r}): {type(optimizer).__name__} keeps no "
                      f"per-element state {key!r} for this parameter"
                      + (f"; its keys are {known}" if known else ""))


# ----------------------------------------------------------------------------- full values


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """The full fp32 value of ``param`` (a new tensor of its original shape).

    Stages 0-2 hold every parameter whole on every rank: a local fp32 copy (``Ψ_p`` elements,
    no communication; with fp16/bf16 the fp32 master weight); with fp16/bf16 at stages 1-2 the
    master lives on the OSS owner only, which broadcasts it (``Ψ_p`` fp32 elements; every rank
    must call it). Stage 3
    (and a hand-wrapped FSDP model): one all-gather of the parameter's row blocks over the
    unit's shard group (``N x ceil(rows/N) x cols`` fp32 elements, padding included,
    ``(N-1)/N`` of them on the wire; memory about ``2Ψ_p`` while joining); every rank must
    call it. Inside :class:`~shardkit.zero.GatheredParameters` it
    gives the stored value (edits made in the block are not in it until the block ends)."""
    loc = locate_parameter(param, "safe_get_full_fp32_param")
    masters = _master_weights(loc)
    if masters is not None and loc.oss is None:  # stage 0: every rank holds every master
        return masters.master_weight_of(param).detach().float().clone()
    if masters is not None:  # the fp32 master lives on the owner
        return _from_owner(loc, masters.master_weight_of(param) if loc.is_owner else None)
    if loc.unit is None:
        return param.detach().float().clone()
    return _gather_rows(loc, _stored_rows(loc))


def _master_weights(loc: ParamLocation):
    """Stages 0-2 with fp32 master weights of a 16-bit model: the
    :class:`~shardkit.optim.MasterWeights` holding ``loc.param``'s master (at stages 1-2 the
    OSS local optimizer, on the owner), or ``None`` (the parameter itself is the fp32 value:
    fp32 training, a frozen parameter, stage 3). Local."""
    from shardkit.optim.master_weights import HALF_DTYPES, master_weights_of
    if loc.unit is not None or loc.param.dtype not in HALF_DTYPES:
        return None
    masters = master_weights_of(loc.optimizer)
    if masters is None:
        return None
    # under OSS every rank, not only the owner, takes the master's path (its broadcast)
    held = loc.param in loc.oss.param_to_rank if loc.oss is not None else masters.holds(loc.param)
    return masters if held else None


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the full fp32 value of ``param`` to ``value`` (the same full tensor on every rank,
    of the parameter's original shape). Each rank keeps what it holds (stage 3: its rows;
    fp16/bf16 at stages 0-2: the parameter rounded, and the fp32 master where it is kept);
    no communication, no memory beyond one row block."""
    what = "safe_set_full_fp32_param"
    loc = locate_parameter(param, what)
    _check_value(value, _full_shape(loc), what)
    masters = _master_weights(loc)
    if masters is not None and (loc.oss is None or loc.is_owner):  # the master too: the next
        # step starts from it
        masters.set_master_weight(param, value.detach().to(param.device))
        return
    if loc.unit is None:
        with torch.no_grad():
            param.data.copy_(value.detach().to(param.device, param.dtype))
        return
    rows = _stored_rows(loc)
    write_rows(loc, rows, value)
    if _holds_full_value(loc, rows):  # inside a gathering block: the block sees it too
        with torch.no_grad():
            param.data.copy_(value.detach().to(param.device, param.dtype))


def safe_get_full_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The full gradient of ``param`` (fp32, original shape), ``None`` when it has none (a
    frozen or unused parameter, or after ``engine.step()`` cleared it).

    Stage 0 (and stage 1 with ``reduce_scatter: false``): a local copy. Stages 1-2: the OSS
    owner holds the averaged gradient; a one-element verdict and then ``Ψ_p`` fp32 elements are
    broadcast from it. Stage 3: one all-gather of the row blocks (inside
    ``summon_full_params(with_grads=True)``, of each rank's rows of the full gradient the
    block holds). Every rank must call it at stages 1-3."""
    loc = locate_parameter(param, "safe_get_full_grad")
    _check_grads_reduced(loc, "safe_get_full_grad")
    if loc.unit is not None:
        rows = _grad_rows(loc)
        if rows is None:  # FSDP reduces every unit's gradients on every rank alike
            return None
        return _gather_rows(loc, rows)
    if not _grad_on_owner_only(loc):
        return None if param.grad is None else param.grad.detach().float().clone()
    grad = param.grad if loc.is_owner else None
    if _agreed_owner_verdict(loc, _OK if grad is not None else _ABSENT) == _ABSENT:
        return None
    return _from_owner(loc, grad)


def _check_grads_reduced(loc: ParamLocation, what: str) -> None:
    """ValueError in the middle of an engine's accumulation window at stages 1-3, where the
    gradients are each rank's partial sums (see ``engine._check_full_grads_readable``). Stage 0
    returns each rank's own ``.grad`` there, as DeepSpeed's ``safe_get_full_grad`` does (it
    returns ``param.grad`` whenever there is one). Local."""
    if loc.engine is not None and loc.engine.zero_stage > 0:
        loc.engine._check_full_grads_readable(what)


def _grad_on_owner_only(loc: ParamLocation) -> bool:
    if loc.oss is None or not loc.trainable:
        return False
    return loc.stage == 2 or loc.engine.config.zero.reduce_to_owners


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace the gradient of ``param`` by ``value`` (the same full tensor on every rank).
    Each rank writes what the optimizer step reads there: stages 0-1 the whole gradient, stage
    2 the owner's, stage 3 each rank's rows (inside ``summon_full_params(with_grads=True)``
    the full gradient the block holds, whose writeback keeps those rows; ``writeback=False``
    drops gradient edits made in the block, as in torch, on every rank: with ``rank0_only``
    the ranks without the full gradient drop theirs too). No communication."""
    what = "safe_set_full_grad"
    loc = locate_parameter(param, what)
    _check_value(value, _full_shape(loc), what)
    _check_grads_reduced(loc, what)
    if loc.unit is not None:
        if _grad_held_full(loc):  # the block's full gradient: its writeback keeps the rows
            _set_held_full_grad(param, value)
            return
        if _grad_edit_dropped_by_block(loc):  # as the first rank's edit is
            return
        if param.grad is None:
            _give_row_gradient(loc, torch.zeros_like(_stored_rows(loc)))
        write_rows(loc, param.grad, value)
        return
    if loc.stage == 2 and loc.oss is not None and loc.trainable and not loc.is_owner:
        return
    with torch.no_grad():
        if param.grad is None:
            param.grad = value.detach().to(param.device, param.dtype).clone()
        else:
            param.grad.copy_(value.detach().to(param.grad.device, param.grad.dtype))


def _set_held_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """``param.grad = value`` (a copy) for a parameter holding its full value and gradient
    inside ``summon_full_params(with_grads=True)``. Local."""
    with torch.no_grad():
        if param.grad is None:
            param.grad = value.detach().to(param.device, param.dtype).clone()
        else:
            param.grad.copy_(value.detach().to(param.grad.device, param.grad.dtype))


def safe_update_full_grad_vectorized(param_list: List[torch.nn.Parameter],
                                     update_func: Callable) -> None:
    """DeepSpeed's vectorized form: for each parameter with a gradient, set its full gradient
    to ``update_func(full_grad, param)``. Costs one :func:`safe_get_full_grad` per parameter
    (every rank must call it with the same list)."""
    for p in list(param_list):
        grad = safe_get_full_grad(p)
        if grad is not None:
            safe_set_full_grad(p, update_func(grad, p))


def safe_get_full_optimizer_state(param: torch.nn.Parameter,
                                  optim_state_key: str) -> Optional[torch.Tensor]:
    """The full fp32 optimizer state ``optim_state_key`` (``"exp_avg"``, ``"exp_avg_sq"``,
    ``"momentum_buffer"``...) of ``param``, shaped like the parameter; ``None`` for a frozen
    parameter or before the optimizer's first step.

    Stage 0: a local copy. Stages 1-2: the OSS owner broadcasts a one-element verdict, then
    ``Ψ_p`` fp32 elements (an unknown key raises the same ValueError on every rank after the
    verdict). Stage 3: one all-gather of the state's row blocks. Every rank must call it at
    stages 1-3. Memory: ``Ψ_p`` fp32."""
    what = "safe_get_full_optimizer_state"
    loc = locate_parameter(param, what)
    _check_key(optim_state_key, what)
    _check_optimizer(loc, what)
    if not loc.trainable:
        return None
    if loc.oss is not None:
        state = _oss_state(loc) if loc.is_owner else None
        verdict, value = _elementwise(state, optim_state_key, param.shape)
        verdict = _agreed_owner_verdict(loc, verdict if loc.is_owner else _OK)
        if verdict == _ABSENT:
            return None
        if verdict == _UNKNOWN_KEY:
            raise _unknown_key_error(loc, optim_state_key, what, state)
        return _from_owner(loc, value)
    state = loc.optimizer.state.get(param)
    verdict, value = _elementwise(state, optim_state_key, _param_shape(loc))
    if verdict == _ABSENT:
        return None
    if verdict == _UNKNOWN_KEY:
        raise _unknown_key_error(loc, optim_state_key, what, state)
    if loc.unit is None:
        return value.detach().float().clone()
    return _gather_rows(loc, value)


def _refuse_missing_state(verdict: int, loc, optim_state_key: str, what: str, state) -> None:
    """A setter's ValueError for state not built yet (before the first step) or an unknown
    key; nothing for :data:`_OK`."""
    if verdict == _ABSENT:
        raise ValueError(f"{what}: the optimizer holds no state for this parameter yet; it is "
                         f"built by the first engine.step()")
    if verdict == _UNKNOWN_KEY:
        raise _unknown_key_error(loc, optim_state_key, what, state)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor,
                                  optim_state_key: str) -> None:
    """Set the optimizer state ``optim_state_key`` of ``param`` to the full ``value`` (the
    same tensor on every rank, shaped like the parameter). Stage 0: copied; stage 3: each
    rank copies its rows (no communication); stages 1-2: the owner copies it after a
    one-element verdict broadcast from it (so a missing state or unknown key raises on every
    rank). Raises ValueError when there is no state yet (before the first step)."""
    what = "safe_set_full_optimizer_state"
    loc = locate_parameter(param, what)
    _check_key(optim_state_key, what)
    _check_value(value, _full_shape(loc), what)
    _check_optimizer(loc, what)
    if not loc.trainable:
        raise ValueError(f"{what}(param=...): the parameter is frozen (no optimizer state)")
    if loc.oss is not None:
        state = _oss_state(loc) if loc.is_owner else None
        verdict, target = _elementwise(state, optim_state_key, param.shape)
        verdict = _agreed_owner_verdict(loc, verdict if loc.is_owner else _OK)
    else:
        state = loc.optimizer.state.get(param)
        verdict, target = _elementwise(state, optim_state_key, _param_shape(loc))
    _refuse_missing_state(verdict, loc, optim_state_key, what, state)
    if target is None:  # a stage 1-2 rank that does not own it
        return
    if loc.unit is not None:
        write_rows(loc, target, value)
    else:
        with torch.no_grad():
            target.copy_(value.detach().to(target.device, target.dtype))


def _check_optimizer(loc: ParamLocation, what: str) -> None:
    if loc.optimizer is None and loc.engine is not None:
        raise ValueError(f"{what}(param=...): the parameter's engine has no optimizer "
                         f"(shardkit.initialize was called without one: a forward-only "
                         f"engine), so there is no optimizer state to read or write")
    if loc.optimizer is None:
        raise ValueError(f"{what}(param=...): the parameter belongs to a model wrapped in "
                         f"FullyShardedDataParallel by hand, whose optimizer this API cannot "
                         f"see; read optimizer.state[param] (this rank's rows) or use "
                         f"FullyShardedDataParallel.gather_full_optim_state_dict")


# ----------------------------------------------------------------------------- local rows


def _stage3_only(param, what: str) -> ParamLocation:
    loc = locate_parameter(param, what)
    if loc.unit is None:
        raise ValueError(f"{what}(param=...): defined for ZeRO stage 3 (FSDP-sharded) "
                         f"parameters only, as in DeepSpeed; this engine runs stage "
                         f"{loc.stage}: use the safe_*_full_* functions")
    return loc


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's row block of ``param`` (fp32 copy, shape ``(ceil(rows/N), ...)``, zero
    padded). Stage 3 only; local, no communication."""
    loc = _stage3_only(param, "safe_get_local_fp32_param")
    return _stored_rows(loc).detach().float().clone()


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's row block of ``param`` with ``value`` (its shape). Stage 3 only;
    local. Inside a gathering block (:class:`~shardkit.zero.GatheredParameters`,
    ``summon_full_params``) the full value the block holds gets the same rows, so the block's
    writeback keeps them (with a ``modifier_rank``, as every edit, only that rank's)."""
    what = "safe_set_local_fp32_param"
    loc = _stage3_only(param, what)
    rows = _stored_rows(loc)
    _check_value(value, rows.shape, what)
    with torch.no_grad():
        rows.copy_(value.detach().to(rows.device, rows.dtype))
    if _holds_full_value(loc, rows):
        _write_block_into_full(loc, param.data, rows)


def safe_get_local_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """This rank's row block of the reduced gradient (fp32 copy), ``None`` without one.
    Stage 3 only; local. Inside ``summon_full_params(with_grads=True)``, where ``.grad`` is
    the full gradient, this rank's rows of it."""
    loc = _stage3_only(param, "safe_get_local_grad")
    _check_grads_reduced(loc, "safe_get_local_grad")
    rows = _grad_rows(loc)
    return None if rows is None else rows.detach().float().clone()


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's row block of the gradient. Stage 3 only; local. Inside
    ``summon_full_params(with_grads=True)`` it overwrites this rank's rows of the full
    gradient the block holds, which the block's writeback keeps (``writeback=False`` drops
    gradient edits made in the block, as in torch, on every rank: with ``rank0_only`` the
    ranks without the full gradient drop theirs too)."""
    what = "safe_set_local_grad"
    loc = _stage3_only(param, what)
    _check_value(value, _param_shape(loc), what)
    _check_grads_reduced(loc, what)
    if _grad_held_full(loc):
        if param.grad is None:
            _set_held_full_grad(param, torch.zeros(_full_shape(loc)))
        _write_block_into_full(loc, param.grad, value.detach())
        return
    if _grad_edit_dropped_by_block(loc):  # as the first rank's edit is
        return
    with torch.no_grad():
        if param.grad is None:
            rows = _stored_rows(loc)
            _give_row_gradient(loc, value.detach().to(rows.device, rows.dtype).clone())
        else:
            param.grad.copy_(value.detach())


def safe_get_local_optimizer_state(param: torch.nn.Parameter,
                                   optim_state_key: str) -> Optional[torch.Tensor]:
    """This rank's row block of optimizer state ``optim_state_key`` (fp32 copy), ``None``
    before the first step. Stage 3 only; local."""
    what = "safe_get_local_optimizer_state"
    loc = _stage3_only(param, what)
    _check_key(optim_state_key, what)
    _check_optimizer(loc, what)
    state = loc.optimizer.state.get(param)
    verdict, value = _elementwise(state, optim_state_key, _param_shape(loc))
    if verdict == _UNKNOWN_KEY:
        raise _unknown_key_error(loc, optim_state_key, what, state)
    return None if value is None else value.detach().float().clone()


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor,
                                   optim_state_key: str) -> None:
    """Overwrite this rank's row block of optimizer state ``optim_state_key``. Stage 3 only;
    local. ValueError before the first step (no state yet) or for an unknown key."""
    what = "safe_set_local_optimizer_state"
    loc = _stage3_only(param, what)
    _check_key(optim_state_key, what)
    _check_value(value, _param_shape(loc), what)
    _check_optimizer(loc, what)
    state = loc.optimizer.state.get(param)
    verdict, target = _elementwise(state, optim_state_key, _param_shape(loc))
    _refuse_missing_state(verdict, loc, optim_state_key, what, state)
    with torch.no_grad():
        target.copy_(value.detach().to(target.device, target.dtype))
