"""DeepSpeed's ``deepspeed.checkpointing``: activation checkpointing for Megatron-style models.

Usage, as with DeepSpeed (``mpu``: an object with ``get_model_parallel_{rank,world_size,group}``
or ``get_tensor_model_parallel_*``, e.g. ``shardkit.nn.model_parallel.initialize``; ``None``:
shardkit's own tensor-parallel groups when they exist)::

    import shardkit
    shardkit.checkpointing.configure(mpu, deepspeed_config="ds_config.json")
    for block in blocks:
        hidden = shardkit.checkpointing.checkpoint(block, hidden, mask)

:func:`checkpoint` runs ``function`` without keeping its activations and runs it again in the
backward, with the CPU generator, the CUDA one (when CUDA exists) and the model-parallel
tracker's streams (:func:`get_cuda_rng_tracker`) set back to their state at the first forward,
so dropout draws the same masks, and under the ``torch.autocast`` contexts the forward ran
under (shardkit's bf16/fp16 engines run the forward under autocast and the backward outside
it), so the recomputed activations are the forward's. The recomputation runs each module the
forward called in the train/eval mode the forward saw (``model.eval()`` between forward and
backward changes nothing) and puts back the running statistics of each BatchNorm it runs, so
they are updated once per step, as without checkpointing (DeepSpeed: other dropout masks and
two updates). It is reentrant (a
``torch.autograd.Function``), as DeepSpeed's is, but where no tensor argument requires grad
(the first block fed the raw batch, a frozen embedding's output) its outputs still do, so the
region's parameters get the gradients they get without checkpointing (DeepSpeed's and torch's
reentrant checkpoints give them none, silently or with a warning). A region that then reads no
tensor requiring grad (frozen layers fed the raw batch) keeps nothing and its outputs require
none, as without checkpointing.

Memory, per call: the tensor arguments (not the region's activations) stay until the backward.

- ``partition_activations``: each floating-point tensor argument whose element count divides
  by the tensor-parallel size ``tp`` is kept as this rank's contiguous ``1/tp`` slice (a copy);
  the others are kept whole (DeepSpeed asserts on them). The caller's tensor is left as it is
  (DeepSpeed swaps its ``.data`` for an empty one): it is freed when the caller drops it, as in
  ``hidden = checkpoint(block, hidden)``. A partitioned argument must be the same on every
  tensor-parallel rank (replicated activations, as between Megatron blocks): it is rebuilt from
  the ranks' slices, so a rank-specific one (sequence-parallel activations, a
  ``ColumnParallelLinear`` output with ``gather_output=False``) would come back wrong
  (DeepSpeed's gradients are then silently wrong). Here the rebuilt argument is checked against
  a fingerprint (its sum) taken in the forward, and a mismatch is a RuntimeError in the backward,
  before the recomputation, on every tensor-parallel rank (also one whose own argument came back
  whole), naming the argument (mark it ``no_checkpointing = True`` to keep it whole).
  Communication: one all-gather per partitioned argument before the recomputation,
  ``(tp-1)/tp`` of its bytes on the wire per rank, then one all-reduce of the ranks' verdicts
  (an int32 per partitioned argument) (``shardkit.distributed``, so
  :class:`~shardkit.distributed.CommCounter` counts both); none in the forward.
- ``cpu_checkpointing`` (``checkpoint_in_cpu``): the kept arguments live in CPU memory and are
  copied back to their device for the recomputation; on a CPU run this changes nothing.
- ``contiguous_memory_optimization``: the partitions are copied into one preallocated buffer per
  argument position holding ``number_checkpoints`` partitions (all checkpoints of one forward
  must have the same partition sizes and dtypes there); the buffers are dropped at the first
  backward and by :func:`reset` (call it after forwards without a backward, e.g. evaluation
  under grad mode).
- ``synchronize_checkpoint_boundary``: ``torch.cuda.synchronize()`` around each forward and
  recomputation (nothing without CUDA); ``profile``: each forward's and recomputation's time is
  logged at INFO on the ``shardkit.checkpointing`` logger (:func:`non_reentrant_checkpoint`:
  the forward only).

Without grad mode (evaluation) :func:`checkpoint` just calls ``function``. Inside its first
forward :func:`shardkit.nn.checkpoint.is_checkpointing` is True and inside its recomputation
:func:`~shardkit.nn.checkpoint.is_recomputing` (a ``DeferredBatchNorm`` tracks the first forward
only); skip connections (``@skippable``) in ``function`` pop the same tensors both times, and
a tensor ``function`` stashes for a layer after it gets that layer's gradient (an extra output
of the autograd function). Popping, inside ``function``, a tensor stashed outside it that
requires grad is a RuntimeError in the forward (its gradient cannot flow back through a
reentrant recomputation; :func:`non_reentrant_checkpoint` takes it).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from shardkit.config import (ActivationCheckpointingConfig, ConfigError,
                             activation_checkpointing_config)
from shardkit.nn.checkpoint.checkpoint_activations import (_as_in_forward,
                                                           _check_inputs_unchanged, _counting,
                                                           _keywords_as_positions,
                                                           _modes_recorded,
                                                           _nested_checked_at_recompute,
                                                           _nested_tensors, _Received,
                                                           _outside_values_recorded,
                                                           _outside_values_replayed,
                                                           _region_name,
                                                           _run_norm_stats_restored)
from shardkit.nn.model_parallel.random import (MODEL_PARALLEL_RNG, MODEL_PARALLEL_SEED_OFFSET,
                                               get_cuda_rng_tracker,
                                               model_parallel_cuda_manual_seed as _mp_seed)
from shardkit.nn.model_parallel.random import _as_seed

__all__ = ["configure", "is_configured", "reset", "checkpoint", "non_reentrant_checkpoint",
           "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed",
           "partition_activations_in_checkpoint", "set_num_layers", "get_config"]

logger = logging.getLogger("shardkit.checkpointing")


@dataclass
class _State:
    options: ActivationCheckpointingConfig
    configured: bool = False
    mpu: Any = None
    mp_rank: int = 0
    mp_size: int = 1
    mp_group: Any = None


_STATE = _State(ActivationCheckpointingConfig())
# contiguous_memory_optimization: per argument position, [buffer, partitions written]
_BUFFERS: list = []

# DeepSpeed's module globals, readable under their names (set them with configure)
_DEEPSPEED_NAMES = {
    "PARTITION_ACTIVATIONS": lambda: _STATE.options.partition_activations,
    "CONTIGUOUS_CHECKPOINTING": lambda: _STATE.options.contiguous_memory_optimization,
    "CPU_CHECKPOINT": lambda: _STATE.options.cpu_checkpointing,
    "SYNCHRONIZE": lambda: _STATE.options.synchronize_checkpoint_boundary,
    "PROFILE_TIME": lambda: _STATE.options.profile,
    "num_layers": lambda: _STATE.options.number_checkpoints,
    "mpu": lambda: _STATE.mpu, "mp_rank": lambda: _STATE.mp_rank,
    "mp_size": lambda: _STATE.mp_size, "mp_group": lambda: _STATE.mp_group,
    "deepspeed_checkpointing_enabled": lambda: _STATE.configured,
}


def __getattr__(name):
    if name in _DEEPSPEED_NAMES:
        return _DEEPSPEED_NAMES[name]()
    raise AttributeError(f"module 'shardkit.checkpointing' has no attribute {name!r}")


# ----------------------------------------------------------------------------- configuration

_OVERRIDES = {  # configure()'s argument -> the config key it overrides
    "partition_activations": "partition_activations",
    "contiguous_checkpointing": "contiguous_memory_optimization",
    "num_checkpoints": "number_checkpoints",
    "checkpoint_in_cpu": "cpu_checkpointing",
    "synchronize": "synchronize_checkpoint_boundary",
    "profile": "profile",
}


def configure(mpu_=None, deepspeed_config=None, partition_activations=None,
              contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None,
              synchronize=None, profile=None) -> None:
    """Set the options :func:`checkpoint` uses (DeepSpeed's ``deepspeed.checkpointing.configure``).

    Args:
        mpu_: the model-parallel unit: an object with ``get_tensor_model_parallel_{rank,
            world_size,group}`` or ``get_model_parallel_{rank,world_size,group}`` (DeepSpeed's
            rule). ``None``: the one given before, else shardkit's own tensor-parallel groups
            (``shardkit.nn.model_parallel.initialize_model_parallel``) when they exist.
        deepspeed_config: a DeepSpeed config (dict, JSON file path, or ``engine.config``); only
            its ``activation_checkpointing`` section is read and checked.
        partition_activations, contiguous_checkpointing, num_checkpoints, checkpoint_in_cpu,
        synchronize, profile: override the config's ``partition_activations``,
        ``contiguous_memory_optimization``, ``number_checkpoints``, ``cpu_checkpointing``,
        ``synchronize_checkpoint_boundary``, ``profile``. Options given neither way are off
        (each call starts from DeepSpeed's defaults).

    Raises:
        ConfigError (a ValueError) naming the key: a bad config or argument value,
            ``contiguous_checkpointing`` without ``partition_activations`` or
            ``num_checkpoints``, ``partition_activations`` with no model-parallel group (no
            ``mpu_`` and no shardkit tensor-parallel groups: nothing to partition over).
        TypeError: ``mpu_`` lacks the methods above.

    With a tensor-parallel size of 1, ``partition_activations`` is accepted and keeps every
    input whole (DeepSpeed does the same), so one config serves every tensor-parallel size.
    Local: no collectives; the previous configuration stays when it raises.
    """
    try:
        options = (ActivationCheckpointingConfig() if deepspeed_config is None
                   else activation_checkpointing_config(deepspeed_config))
    except ConfigError as error:
        raise ConfigError(f"configure(deepspeed_config=...): {error} (a dict, a JSON file "
                          f"path or engine.config)") from None
    given = dict(partition_activations=partition_activations,
                 contiguous_checkpointing=contiguous_checkpointing,
                 num_checkpoints=num_checkpoints, checkpoint_in_cpu=checkpoint_in_cpu,
                 synchronize=synchronize, profile=profile)
    changes = {}
    for argument, value in given.items():
        if value is None:
            continue
        key = _OVERRIDES[argument]
        if argument == "num_checkpoints":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"configure(num_checkpoints={value!r}): must be a positive "
                                  f"int (activation_checkpointing.{key})")
        elif not isinstance(value, bool):
            raise ConfigError(f"configure({argument}={value!r}): must be True, False or None "
                              f"(activation_checkpointing.{key})")
        changes[key] = value
    options = replace(options, **changes)
    _check_combination(options)
    mpu = _STATE.mpu if mpu_ is None else mpu_
    rank, size, group = _model_parallel(mpu)
    if options.partition_activations and group is None and size == 1 and mpu is None:
        raise ConfigError(
            "configure: partition_activations=True (activation_checkpointing."
            "partition_activations) needs a model-parallel group to split the inputs over: pass "
            "mpu_ (e.g. shardkit.nn.model_parallel.initialize) or call shardkit.nn."
            "model_parallel.initialize_model_parallel(tp) first; or set it false")
    _BUFFERS.clear()
    _STATE.options, _STATE.configured, _STATE.mpu = options, True, mpu
    _STATE.mp_rank, _STATE.mp_size, _STATE.mp_group = rank, size, group


def _check_combination(options: ActivationCheckpointingConfig) -> None:
    if options.contiguous_memory_optimization and not options.partition_activations:
        raise ConfigError("contiguous_checkpointing=True (activation_checkpointing."
                          "contiguous_memory_optimization) needs partition_activations=True: "
                          "the contiguous buffers hold the partitioned inputs")
    if options.contiguous_memory_optimization and options.number_checkpoints is None:
        raise ConfigError("contiguous_checkpointing=True (activation_checkpointing."
                          "contiguous_memory_optimization) needs num_checkpoints "
                          "(activation_checkpointing.number_checkpoints): the checkpoints one "
                          "forward stores, which sizes the buffers")


def _model_parallel(mpu) -> tuple:
    """(rank, size, group) of the tensor-parallel group: from ``mpu``, else shardkit's own
    groups when initialized, else (0, 1, None)."""
    if mpu is None:
        from shardkit.nn.model_parallel import initialize as shardkit_mpu
        if not shardkit_mpu.model_parallel_is_initialized():
            return 0, 1, None
        mpu = shardkit_mpu
    for prefix in ("get_tensor_model_parallel_", "get_model_parallel_"):
        if all(callable(getattr(mpu, prefix + s, None)) for s in ("rank", "world_size", "group")):
            return (getattr(mpu, prefix + "rank")(), getattr(mpu, prefix + "world_size")(),
                    getattr(mpu, prefix + "group")())
    raise TypeError(f"configure(mpu_={mpu!r}): expected an object with get_model_parallel_rank/"
                    f"world_size/group (or get_tensor_model_parallel_*), such as "
                    f"shardkit.nn.model_parallel.initialize, or None")


def is_configured() -> bool:
    """True once :func:`configure` has run (DeepSpeed's name)."""
    return _STATE.configured


def get_config() -> ActivationCheckpointingConfig:
    """The options in force (DeepSpeed's defaults before :func:`configure`)."""
    return _STATE.options


def reset() -> None:
    """Drop the contiguous buffers (``contiguous_memory_optimization``): needed after forwards
    that had no backward (which drops them otherwise). Partitions still held by pending
    backwards stay alive until those run. The configuration is kept."""
    _BUFFERS.clear()


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's switch for ``partition_activations`` alone (same checks as configure)."""
    if not isinstance(partition_activation, bool):
        raise ConfigError(f"partition_activations_in_checkpoint({partition_activation!r}): "
                          f"must be True or False")
    options = replace(_STATE.options, partition_activations=partition_activation)
    _check_combination(options)
    if partition_activation and _STATE.mp_group is None and _STATE.mpu is None:
        rank, size, group = _model_parallel(None)
        if group is None:
            raise ConfigError("partition_activations_in_checkpoint(True): no model-parallel "
                              "group; call configure(mpu_, ...) or initialize_model_parallel")
        _STATE.mp_rank, _STATE.mp_size, _STATE.mp_group = rank, size, group
    _STATE.options = options


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's setter of ``number_checkpoints``."""
    if isinstance(nlayers, bool) or not isinstance(nlayers, int) or nlayers < 1:
        raise ConfigError(f"set_num_layers({nlayers!r}): must be a positive int "
                          f"(activation_checkpointing.number_checkpoints)")
    _BUFFERS.clear()
    _STATE.options = replace(_STATE.options, number_checkpoints=nlayers)


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generators with ``seed`` and the tracker's model-parallel stream with
    ``seed + 2718 + tensor-parallel rank`` (DeepSpeed's and Megatron's rule). The rank comes
    from the ``mpu_`` given to :func:`configure`, else from shardkit's tensor-parallel groups.
    Seeds the CPU generator too, so it works without CUDA. No communication."""
    if _STATE.mpu is None:
        _mp_seed(seed)
        return
    seed = _as_seed("model_parallel_cuda_manual_seed", seed)  # a NumPy integer too
    torch.manual_seed(seed)
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + _STATE.mp_rank)


# ----------------------------------------------------------------------------- checkpoint


def _rng_states() -> tuple:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    # the tracker's replay point: its streams and the forks open now (a fork of one of them
    # inside the region goes on with it, in the recomputation as in the first forward)
    return torch.get_rng_state(), cuda, get_cuda_rng_tracker()._replay_point()


def _autocast_states() -> tuple:
    """``(device_type, dtype, cache_enabled)`` of each autocast context in force (CPU, and
    CUDA when it exists), for the recomputation to run under the same ones as the forward."""
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    return tuple((device, torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled())
                 for device in devices if torch.is_autocast_enabled(device))


def _autocast_contexts(states: tuple) -> contextlib.ExitStack:
    """The forward's autocast contexts (:func:`_autocast_states`), entered again; any other
    in force now (a backward run under autocast) is switched off, as torch's checkpoint does."""
    stack = contextlib.ExitStack()
    kept = {device for device, _, _ in states}
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    for device in devices:
        if device not in kept and torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device_type=device, enabled=False))
    for device, dtype, cache in states:
        stack.enter_context(torch.autocast(device_type=device, dtype=dtype,
                                           cache_enabled=cache))
    return stack


def _set_generators(states: tuple) -> None:
    cpu, cuda = states[:2]
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


@contextlib.contextmanager
def _boundary(what: str):
    """``synchronize_checkpoint_boundary`` and ``profile`` around a forward or recomputation."""
    options = _STATE.options
    sync = options.synchronize_checkpoint_boundary and torch.cuda.is_available()
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    yield
    if sync:
        torch.cuda.synchronize()
    if options.profile:
        logger.info("activation checkpoint %s: %.3f ms", what,
                    (time.perf_counter() - start) * 1e3)


def _partitioned(arg, options, size: int) -> bool:
    """DeepSpeed's rule (floating point, not marked ``no_checkpointing``), and an element count
    that divides by the tensor-parallel size (DeepSpeed asserts otherwise; kept whole here)."""
    return (options.partition_activations and size > 1 and arg.is_floating_point()
            and not getattr(arg, "no_checkpointing", False) and arg.numel() > 0
            and arg.numel() % size == 0)


def _fingerprint(flat: torch.Tensor) -> torch.Tensor:
    """The sum of a contiguous 1-D tensor (at least in fp32): computed again on the same values
    laid out the same way, the same bits; on other values, other bits (almost surely)."""
    dtype = torch.promote_types(flat.dtype, torch.float32)
    return torch.sum(flat, dtype=dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two fingerprints are equal bit for bit (a NaN equals the same NaN)."""
    return torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def _check_rebuilt_as_kept(differs: list, positions: list, device, group, function) -> None:
    """Raise, on every tensor-parallel rank, unless each argument rebuilt from the ranks'
    slices is, on every rank, the one that rank had in the forward (the same fingerprint, bit
    for bit). A rank-specific argument (sequence-parallel activations, a
    ``ColumnParallelLinear`` output with ``gather_output=False``) comes back as a mix of the
    ranks' tensors: recomputed from it, the gradients would be silently wrong (DeepSpeed's
    are). A rank sees a difference only in the other ranks' slices of its argument, so one
    whose argument differs from another's elsewhere rebuilds its own exactly; one all-reduce
    of an int32 per argument (``differs``: this rank's verdicts) makes every rank raise, where
    a rank going on alone would wait in its next collective for ranks that raised (on
    ``device``, where the all-gathers ran). After the all-gathers, before the recomputation;
    one pass over the argument here and in the forward."""
    from shardkit import distributed
    seen = torch.tensor(differs, dtype=torch.int32, device=device)  # where the gathers ran
    distributed.all_reduce(seen, group=group)
    seen = seen.tolist()
    if not any(seen):
        return
    index = next(i for i, count in enumerate(seen) if count)
    raise RuntimeError(
        f"shardkit.checkpointing.checkpoint({_function_name(function)}): tensor argument "
        f"#{positions[index]} differs across the tensor-parallel ranks (seen on {seen[index]} "
        f"of {_group_size(group)}), so partition_activations=True "
        f"(activation_checkpointing.partition_activations) cannot rebuild it from their "
        f"slices: the recomputation would give wrong gradients. Partitioning needs activations "
        f"replicated over the tensor-parallel group; with sequence parallelism (or any "
        f"rank-specific activation) they are split already: set partition_activations false, "
        f"or mark the argument with `tensor.no_checkpointing = True` to keep it whole")


def _function_name(function) -> str:
    given = getattr(function, "shardkit_region", function)
    return getattr(given, "__qualname__", type(given).__name__)


def _contiguous_slot(position: int, part: torch.Tensor, options) -> torch.Tensor:
    """``part`` copied into the next free slot of position ``position``'s buffer."""
    count = options.number_checkpoints
    while len(_BUFFERS) <= position:
        _BUFFERS.append(None)
    entry = _BUFFERS[position]
    if entry is None:
        entry = _BUFFERS[position] = [torch.empty(count * part.numel(), dtype=part.dtype,
                                                  device=part.device), 0]
    buffer, used = entry
    if buffer.dtype != part.dtype or buffer.numel() != count * part.numel():
        raise RuntimeError(
            f"checkpoint: contiguous_memory_optimization needs the partitioned input #{position} "
            f"of every checkpoint of a forward to have one size and dtype; this one has "
            f"{part.numel()} elements of {part.dtype}, the buffer holds "
            f"{buffer.numel() // count} of {buffer.dtype} (call reset() between models)")
    if used == count:
        raise RuntimeError(
            f"checkpoint: more than number_checkpoints={count} checkpoints in one forward "
            f"(activation_checkpointing.number_checkpoints); raise it, or call reset() after "
            f"forwards that had no backward")
    # a view through a fresh ``.data`` alias: its own version counter, so writing the next slot
    # does not look like an in-place change of this one (saved for backward)
    slot = buffer.data[used * part.numel():(used + 1) * part.numel()]
    slot.copy_(part)
    entry[1] = used + 1
    return slot


class _CheckpointFunction(torch.autograd.Function):
    """The reentrant checkpoint: ``forward(ctx, run_function, layout, anchor, *tensors)``."""

    @staticmethod
    def forward(ctx, run_function, layout, anchor, *tensors):
        # anchor: None, or _grad_anchor()'s tensor, which only makes the outputs require grad
        options, size, rank = _STATE.options, _STATE.mp_size, _STATE.mp_rank
        ctx.run_function, ctx.layout, ctx.group = run_function, layout, _STATE.mp_group
        kept, ctx.how = [], []  # how: (kind, shape, device, requires_grad) per tensor
        ctx.fingerprints = []  # per tensor: _fingerprint of a partitioned one, else None
        position = 0
        for arg in tensors:
            how = ("whole", arg.shape, arg.device, arg.requires_grad)
            fingerprint = None
            if _partitioned(arg, options, size):
                share = arg.numel() // size
                flat = arg.detach().contiguous().view(-1)
                fingerprint = _fingerprint(flat)
                part = flat.narrow(0, share * rank, share)
                moved = options.cpu_checkpointing and part.device.type != "cpu"
                if moved:  # a copy of the slice alone
                    part = part.to("cpu")
                if options.contiguous_memory_optimization:
                    part = _contiguous_slot(position, part, options)
                elif not moved:  # a view of arg (or of its contiguous copy): keep the slice only
                    part = part.clone()
                position += 1
                kept.append(part)
                how = ("part",) + how[1:]
            elif options.cpu_checkpointing and arg.device.type != "cpu":
                kept.append(arg.detach().to("cpu"))
            else:
                kept.append(arg)
            ctx.how.append(how)
            ctx.fingerprints.append(fingerprint)
        ctx.rng = _rng_states()  # after the partitioning, whose errors precede any collective
        ctx.autocast = _autocast_states()  # torch.autocast (shardkit's bf16/fp16 engines)
        ctx.modes = []  # the modules it calls and their train/eval flags, for the recompute
        # what it takes from outside its arguments (skip pops) and stashes for layers after it
        ctx.received = _Received(reentrant=True)
        # is_checkpointing()/is_recomputing() answer here as in checkpoint_wrapper's regions:
        # a DeferredBatchNorm tracks the first forward only
        # anchored, the region needs a backward only when it reads a tensor requiring grad
        watch = _TrainableUse() if anchor is not None else contextlib.nullcontext()
        with _boundary("forward"), torch.no_grad(), _modes_recorded(ctx.modes), \
                _counting("checkpointing"), _outside_values_recorded(ctx.received), watch:
            outputs = run_function(*layout.merge(tensors))
        outs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
        tensor_outs = [o for o in outs if torch.is_tensor(o)]
        if anchor is not None and not watch.seen and not _trainable_module_called(ctx.modes):
            return _without_backward(ctx, tensor_outs)
        ctx.save_for_backward(*kept)
        ctx.from_outside = [_made_outside(o, tensors) for o in tensor_outs]
        ctx.input_positions = [_input_position(o, tensors) for o in tensor_outs]
        # Autograd gives a function's outputs their history in place, so each goes out as a
        # detached alias: a tensor made before the region (a buffer or a detached tensor it
        # closes over) would otherwise become this function's output for good, and its
        # recomputation, the very tensor, would call this backward again without end; one
        # autograd reaches already cannot be an output at all (checkpoint() hands the caller
        # the tensor itself). Arguments handed back (torch aliases them itself) and tensors
        # also stashed for a later layer (which pops the very tensor) go out as they are.
        stashed = {id(value) for value in ctx.received.escaping.values()}
        escaping = _escaping_stashes(ctx.received, tensor_outs)
        tensor_outs = [o if not outside and (given is not None or id(o) in stashed)
                       else o.detach()
                       for o, outside, given in zip(tensor_outs, ctx.from_outside,
                                                    ctx.input_positions)]
        ctx.mark_non_differentiable(*[o for o in tensor_outs if not o.is_floating_point()])
        ctx.escaping_keys = [key for key, _ in escaping]
        # extra outputs (checkpoint() returns only the first len(tensor_outs)): autograd
        # connects the very tensors left in the skip table, so the layers popping them later
        # send their gradients back through this region
        return tuple(tensor_outs) + tuple(value for _, value in escaping)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("shardkit.checkpointing.checkpoint is reentrant and does not work "
                               "with torch.autograd.grad() or backward(inputs=...), which "
                               "shardkit's multi-process pipeline schedules use to split each "
                               "stage's backward into input and weight gradients; use "
                               "shardkit.checkpointing.non_reentrant_checkpoint there (or call "
                               ".backward() yourself)")
        if _STATE.options.contiguous_memory_optimization:
            _BUFFERS.clear()  # the partitions saved below stay alive through ctx
        from shardkit import distributed
        inputs, rebuilt_positions, differs = [], [], []
        for position, (saved, (kind, shape, device, requires_grad), fingerprint) in enumerate(
                zip(ctx.saved_tensors, ctx.how, ctx.fingerprints)):
            if kind == "part":
                part = saved.to(device)
                full = torch.empty(part.numel() * _group_size(ctx.group), dtype=part.dtype,
                                   device=device)
                distributed.all_gather_into_tensor(full, part, group=ctx.group)
                rebuilt_positions.append(position)
                differs.append(not _same_bits(_fingerprint(full), fingerprint))
                value = full.view(shape)
            else:
                value = saved.to(device)
            value = value.detach()
            value.requires_grad_(requires_grad)
            inputs.append(value)
        if rebuilt_positions:
            _check_rebuilt_as_kept(differs, rebuilt_positions, full.device, ctx.group,
                                   ctx.run_function)
        outside = _rng_states()
        _set_generators(ctx.rng)
        try:
            with get_cuda_rng_tracker()._replaying(ctx.rng[2]), _boundary("recomputation"), \
                    torch.enable_grad(), _autocast_contexts(ctx.autocast), \
                    _as_in_forward(ctx.modes), _run_norm_stats_restored(), \
                    _counting("recomputing"), _outside_values_replayed(ctx.received) as replay:
                outputs = ctx.run_function(*ctx.layout.merge(inputs))
        finally:
            _set_generators(outside)
        outs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
        restashed = [replay.stashed.get(key) for key in ctx.escaping_keys]
        recomputed = [o for o in outs if torch.is_tensor(o)]
        pairs = [(o, g) for o, g, outside, given in zip(recomputed, grads, ctx.from_outside,
                                                        ctx.input_positions)
                 if o.requires_grad and not outside and given is None]
        pairs += [(o, g) for o, g in zip(restashed, grads[len(grads) - len(restashed):])
                  if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [t.grad if t.requires_grad else None for t in inputs]
        _add_grads_of_inputs_handed_back(input_grads, inputs, ctx.input_positions, grads)
        return (None, None, None) + tuple(input_grads)


def _grad_anchor(tensors: list):
    """A tensor requiring grad to hand the reentrant function beside ``tensors`` when none of
    them requires grad (in grad mode), else ``None``. Autograd makes a function's outputs
    require grad only when an input does: without it, the outputs of a region fed tensors that
    need no gradient (the raw batch) would leave the graph, and the parameters inside the
    region would get no gradient, silently. Its own gradient is ``None``; it holds no
    elements."""
    if not torch.is_grad_enabled() or any(t.requires_grad for t in tensors):
        return None
    return torch.empty(0, requires_grad=True)


class _TrainableUse(TorchFunctionMode):
    """Inside it, ``seen`` becomes True at the first torch function given a tensor that
    requires grad (in a region whose tensor arguments need none and that runs without grad: a
    trainable parameter or a tensor with history it closes over)."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.seen:
            self.seen = any(torch.is_tensor(value) and value.requires_grad
                            for value in tree_leaves((args, kwargs)))
        return func(*args, **kwargs)


def _trainable_module_called(modes: list) -> bool:
    """Whether a module the first forward called (``modes``: ``(module, training)``) has a
    parameter of its own that requires grad (used by a kernel no torch function sees)."""
    return any(param.requires_grad for module, _ in modes
               for param in module.parameters(recurse=False))


def _without_backward(ctx, tensor_outs: list) -> tuple:
    """The outputs of an anchored region that read nothing requiring grad (frozen layers fed
    the raw batch), none of them requiring grad, as without checkpointing: the anchor would
    otherwise keep the region's arguments until a backward that recomputes it for no
    gradient, and make every layer after it keep its activations too. Nothing is saved."""
    ctx.received.escaping.clear()
    outs = [o.detach() for o in tensor_outs]
    ctx.mark_non_differentiable(*outs)
    return tuple(outs)


def _made_outside(output: torch.Tensor, inputs) -> bool:
    """Whether the region handed back, as ``output``, a tensor made before it that autograd
    reaches: a layer's own parameter (``skip_bias_add=True`` returns its bias) or a tensor
    ``function`` closes over (the caller may use it in the loss too). The first forward runs
    without grad, so no tensor made inside it requires grad. Such an output is handed to the
    caller as it is, and its gradient flows back through the caller's graph, as without
    checkpointing; routed through this function's backward instead, it ran the part of the
    graph before the region twice (once inside the recomputation's backward, once outside:
    "Trying to backward through the graph a second time"), or, for a parameter, made the
    parameter this function's output and its backward recurse without end. (A view the region
    took of such a tensor requires grad too, but reaches nothing: it is the region's own.)"""
    return _in_graph(output) and not any(output is t for t in inputs)


def _input_position(output: torch.Tensor, inputs) -> Any:
    """The position among ``inputs`` of the very tensor ``output`` (the region handed an
    argument back), else None."""
    return next((i for i, t in enumerate(inputs) if output is t), None)


def _add_grads_of_inputs_handed_back(input_grads: list, inputs: list, input_positions: list,
                                     grads) -> None:
    """Add to ``input_grads`` the gradients of the outputs that were arguments handed back as
    they are. They go to the argument directly, not through the recomputation: that may
    return another tensor there (the region's function closing over the caller's tensor that
    was also passed to it), whose graph reaches before the region."""
    for position, grad in zip(input_positions, grads):
        if position is None or grad is None or not inputs[position].requires_grad:
            continue
        held = input_grads[position]
        input_grads[position] = grad if held is None else held + grad


def _escaping_stashes(received: _Received, tensor_outs: list) -> list:
    """``(key, tensor)`` for each floating-point tensor the region stashed for a layer after it
    (not popped inside) that autograd does not reach yet: made without grad in the first
    forward, and not one of the region's outputs (those get its gradient already)."""
    escaping, seen = [], {id(t) for t in tensor_outs}
    for key, value in received.escaping.items():
        if torch.is_tensor(value) and value.is_floating_point() and not _in_graph(value) \
                and id(value) not in seen:
            seen.add(id(value))
            escaping.append((key, value))
    received.escaping.clear()  # the tensors must not live in ctx until the backward
    return escaping


def _in_graph(value: torch.Tensor) -> bool:
    """Whether autograd already reaches ``value``: made with grad (an argument, say), or a
    leaf that requires grad (a parameter). A view of one taken without grad requires grad
    but reaches nothing."""
    if value.grad_fn is not None:
        return True
    return value.requires_grad and not value._is_view()


def _group_size(group) -> int:
    from shardkit import distributed
    return distributed.get_world_size(group)


def _nested_needing_grad_as_arguments(function: Callable, args: tuple,
                                      kwargs: dict) -> tuple[Callable, tuple]:
    """``function`` taking, after ``args``, each tensor that requires grad inside the list,
    tuple and dict arguments of ``function(*args, **kwargs)``, and ``args`` extended with them.

    Note: the reentrant function's gradients reach only its tensor arguments. A tensor that
    requires grad inside a container argument (``checkpoint(block, [hidden, residual])``) had
    no edge to it: its gradient was lost, silently, and the recomputation, reading the
    caller's tensor itself, ran the graph before the region inside this backward (a second
    time, an error, when the caller's backward reaches that graph too). As extra arguments
    (one per container slot holding one) they get their gradients as any argument does; the
    recomputation gets copies of the containers holding the recomputation's own leaves in
    their place (the first forward, the caller's containers). A container held in several
    places (``checkpoint(f, batch, batch)``) is copied once, so every place reads the leaves
    and the places still hold one object."""
    slots, holders = _tensors_needing_grad_inside(args, kwargs)
    if not slots:
        return function, args
    extra = tuple(tensor for _, tensor in slots)
    count = len(args)

    def with_nested_replaced(*flat, **keywords):
        given = flat[count:]
        if all(g is t for g, t in zip(given, extra)):  # the first forward: the caller's own
            return function(*flat[:count], **keywords)
        leaves = {slot: leaf for (slot, _), leaf in zip(slots, given)}
        copies: dict = {}
        positional = [_with_leaves(value, leaves, holders, copies) for value in flat[:count]]
        keywords = {key: _with_leaves(value, leaves, holders, copies)
                    for key, value in keywords.items()}
        return function(*positional, **keywords)

    return with_nested_replaced, args + extra


def _tensors_needing_grad_inside(args: tuple, kwargs: dict) -> tuple[list, set]:
    """``((id(container), key), tensor)`` for each slot of the list, tuple and dict arguments
    (any depth; last argument and last item first) holding a tensor that requires grad, and
    the ids of the containers holding one at some depth. A container met twice (or holding
    itself) is walked once."""
    slots, holders, walked = [], set(), set()

    def holds_one(value) -> bool:
        if not isinstance(value, (list, tuple, dict)):
            return False
        if id(value) in walked:
            return id(value) in holders
        walked.add(id(value))
        items = list(value.items() if isinstance(value, dict) else enumerate(value))
        for key, item in reversed(items):
            if torch.is_tensor(item) and item.requires_grad:
                slots.append(((id(value), key), item))
                holders.add(id(value))
            elif holds_one(item):
                holders.add(id(value))
        return id(value) in holders

    for value in reversed((*args, *kwargs.values())):
        holds_one(value)
    return slots, holders


def _with_leaves(value, leaves: dict, holders: set, copies: dict):
    """``value`` with the tensors of ``leaves`` (keyed by ``(id(container), key)``, their
    slot) in those slots: each container of ``holders`` met is copied (of its type, a named
    tuple too) once (``copies``, by id), the rest shared. The caller's containers are left as
    they are."""
    if id(value) not in holders or not isinstance(value, (list, tuple, dict)):
        return value
    if id(value) in copies:
        return copies[id(value)]

    def item_at(key, item):
        leaf = leaves.get((id(value), key))
        return leaf if leaf is not None else _with_leaves(item, leaves, holders, copies)

    if isinstance(value, tuple):
        items = [item_at(key, item) for key, item in enumerate(value)]
        if id(value) in copies:  # a list inside it held it again and copied it already
            return copies[id(value)]
        copied = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    else:  # copied before its items, which may hold it again
        copied = copies[id(value)] = copy.copy(value)
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            copied[key] = item_at(key, item)
    copies[id(value)] = copied
    return copied


class _Layout:
    """Where the tensors sit among a call's arguments (or a function's outputs)."""

    def __init__(self, values):
        self.flags = tuple(torch.is_tensor(v) for v in values)
        self.others = tuple(v for v in values if not torch.is_tensor(v))

    def merge(self, tensors) -> tuple:
        tensors, others = iter(tensors), iter(self.others)
        return tuple(next(tensors) if flag else next(others) for flag in self.flags)


def checkpoint(function: Callable, *args, **kwargs):
    """``function(*args, **kwargs)``, its activations recomputed in the backward
    (DeepSpeed's ``deepspeed.checkpointing.checkpoint``; see the module docstring for the
    options and their memory and communication).

    Returns what ``function`` returns: a tensor, or a tuple whose non-tensor items come back
    as they are (a list comes back as a tuple, as in DeepSpeed; any other return value is a
    TypeError). As in DeepSpeed, outputs that are not floating point are not differentiable,
    every floating-point output requires grad (whether or not it would without checkpointing;
    a gradient sent to one that does not need it in the recomputation is dropped), also when no
    tensor argument does, so that the region's parameters get their gradients (DeepSpeed's
    outputs then require none, and those parameters silently get no gradient), unless the
    region then reads no tensor requiring grad (frozen layers: outputs requiring none and
    nothing kept, as without checkpointing). An output
    ``function`` did not make comes back with the gradients of the plain call when the caller
    uses it beyond the next layer too (in the loss, say): a parameter or a tensor it closes
    over comes back as that very tensor, and a tensor argument handed back sends its gradient
    straight to the argument. Tensors inside list, tuple and dict arguments get their
    gradients too.
    ``torch.autograd.grad`` through it is a RuntimeError (reentrant). Tensor arguments must not
    be changed in place before the backward (torch's "modified by an inplace operation"
    error), nor tensors inside list, tuple and dict arguments, by ``function`` or before the
    backward, changed in place or replaced in their list or dict (a RuntimeError naming the
    argument and the key; DeepSpeed recomputes from the changed values). Without grad mode,
    ``function`` simply runs.
    """
    if not callable(function):
        raise TypeError(f"checkpoint(function={function!r}): expected the callable to "
                        f"checkpoint first, then its arguments")
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    given = function
    nested = _nested_tensors(given, args, kwargs)  # inside list/tuple/dict arguments
    if nested:
        function = _nested_checked_at_recompute(function, nested, _region_name(given, ()))
        function, args = _nested_needing_grad_as_arguments(function, args, kwargs)
    function, args = _keywords_as_positions(function, args, kwargs)
    layout = _Layout(args)
    tensors = [a for a in args if torch.is_tensor(a)]
    holder = {}

    def run(*values):  # keeps the first forward's outputs (their non-tensor items) for below
        out = function(*values)
        if "done" not in holder:
            holder["out"], holder["done"] = out, True
        return out

    run.shardkit_region = given  # named in errors
    results = iter(_CheckpointFunction.apply(run, layout, _grad_anchor(tensors), *tensors))
    first = holder.pop("out")
    _check_inputs_unchanged(_region_name(given, ()), [], [], [], nested)

    def returned(value):  # the function's output in place of the first forward's value
        output = next(results)
        return value if _made_outside(value, tensors) else output

    if torch.is_tensor(first):
        return returned(first)
    if not isinstance(first, (tuple, list)):
        raise TypeError(f"checkpoint(function={given!r}): it returned a "
                        f"{type(first).__name__}; expected a tensor, or a tuple or list "
                        f"(returned as a tuple, as DeepSpeed does)")
    return tuple(returned(v) if torch.is_tensor(v) else v for v in first)


def non_reentrant_checkpoint(function: Callable, *args, **kwargs):
    """The same contract through torch's non-reentrant checkpoint (DeepSpeed's
    ``non_reentrant_checkpoint``): outputs require grad exactly as without checkpointing,
    gradients reach parameters when no input requires grad, ``torch.autograd.grad`` works, and
    the RNG streams (CPU, CUDA, the tracker's) are replayed. ``cpu_checkpointing`` keeps the
    tensor arguments on CPU until the recomputation. ``partition_activations`` with a
    tensor-parallel size above 1 is refused (a RuntimeError naming it): torch's recomputation
    reads the caller's whole inputs, so no memory would be saved; use :func:`checkpoint`.
    Communication: none of its own."""
    if not callable(function):
        raise TypeError(f"non_reentrant_checkpoint(function={function!r}): expected the "
                        f"callable to checkpoint first, then its arguments")
    options = _STATE.options
    if options.partition_activations and _STATE.mp_size > 1:
        raise RuntimeError("non_reentrant_checkpoint: partition_activations=True "
                           "(activation_checkpointing.partition_activations) is not supported "
                           "here: torch's non-reentrant recomputation keeps the whole inputs; "
                           "use shardkit.checkpointing.checkpoint, or set it false")
    from shardkit.nn.checkpoint.checkpoint_activations import checkpointed_call
    with _boundary("forward"):
        return checkpointed_call(function, *args, offload_to_cpu=options.cpu_checkpointing,
                                 **kwargs)
