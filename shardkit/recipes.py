"""The one place that composes shardkit's wrappers: a model and explicit arguments in, a
:class:`Composition` out.

:func:`compose` builds every ZeRO stage; :func:`shardkit.initialize` (from a DeepSpeed config),
the demo, the benchmark runner and the examples all call it, each passing what it decides
(stage, optimizer, wrap policy, offload, transport, process group, bucket size) as arguments.
:func:`compose_pipeline` builds the 1F1B pipeline the demo and the benchmarks compare with.
This is a policy module: it imports the wrappers (mechanism), never the reverse.

=====================  =====================================  ==================================
stage                  wrappers                               per-rank model states (fp32 Adam)
=====================  =====================================  ==================================
0                      torch DDP + the optimizer              16Ψ
1                      OSS(optimizer) under torch DDP         8Ψ + 8Ψ/N
2                      OSS + ShardedDataParallel              4Ψ + 12Ψ/N (+ one reduce bucket)
3                      FSDP per wrap unit and at the root     16Ψ/N (+ the unit computing)
pipeline               one stage per rank, 1F1B               16Ψ_stage
=====================  =====================================  ==================================

Without an optimizer (``optimizer=None``: a reference, reward or EMA model that only runs
forward, DeepSpeed's optimizer-less ``initialize``) there are no gradients to reduce and no
optimizer state to shard: stages 0-2 keep the model whole and unwrapped (``4Ψ``, rank 0's
weights and buffers broadcast once), stage 3 shards its parameters with FSDP as above
(``4Ψ/N``), and the composition's ``optimizer`` is ``None``.

Memory and traffic formulas live in :mod:`shardkit.plan` (``zero_model_state_bytes``,
``zero_comm_elements_per_step``); this module only builds. Stages 1-3 step with torch's fused
kernel where the optimizer has one and the recipe leaves ``fused``/``foreach`` unset (OSS's
choice for stages 1-2, the same rule for the optimizer built over FSDP's shards); stage 0 and
the pipeline build the optimizer exactly as the recipe says. Every stage starts from rank 0's
weights and buffers, as DeepSpeed's engine does: torch DDP and ShardedDataParallel broadcast
them when they wrap, and stage 3 passes FSDP ``sync_module_states=True`` (a one-time broadcast
of the model), so ranks that initialised the model differently still train one model.
A model built on the meta device is taken at stage 3 only (each FSDP unit materializes its
own part as it is wrapped, see FSDP's ``param_init_fn``); stages 0-2 refuse it, on every
rank even when only some ranks built it on meta (rank 0 the real model, as llama-recipes does).

Usage::

    composition = compose(model, stage=2, optimizer=adamw(lr=1e-3))
    setup = composition.training_setup(loss_fn)
    for x, y in batches:
        setup.train_step(x, y)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed
from shardkit.models import GPT

__all__ = ["OptimizerRecipe", "adamw", "Composition", "TrainingSetup", "STAGES", "compose",
           "torch_ddp", "default_wrap_policy", "block_wrap_policy", "repeated_block_classes",
           "compose_pipeline",
           "gpt_as_sequential", "balance_by_params", "pipeline_chunks", "token_cross_entropy",
           "count_params", "why_not_steppable_on_shards", "why_not_on_row_shards",
           "refuse_meta_tensors", "check_composable", "agree_on_refusal", "model_fingerprint",
           "optimizer_fingerprint", "stable_repr"]

STAGES = (0, 1, 2, 3)


# ----------------------------------------------------------------------------- optimizer


@dataclass(frozen=True)
class OptimizerRecipe:
    """How to build the optimizer: a torch optimizer class, its hyper-parameters and the param
    groups (``None``: every trainable parameter of the model). ``instance`` is an optimizer the
    user built already: stages 0 and 3 step it (FSDP shards the same parameter objects in
    place; it must hold no state yet there), stages 1-2 wrap it in OSS (which shares its param
    groups)."""

    cls: type
    defaults: dict
    param_groups: Optional[list] = None
    instance: Optional[torch.optim.Optimizer] = None

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """A new ``cls`` over ``params`` with ``defaults``."""
        return self.cls(list(params), **self.defaults)

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> "OptimizerRecipe":
        """The recipe of an existing optimizer: its class and its first group's current values
        (a scheduler may have changed them), limited to constructor arguments."""
        hyper = {k: optimizer.param_groups[0].get(k, v) for k, v in optimizer.defaults.items()}
        return cls(type(optimizer), hyper, None, optimizer)


def adamw(lr: float, **kwargs) -> OptimizerRecipe:
    """``torch.optim.AdamW(lr=lr, **kwargs)`` over every trainable parameter."""
    return OptimizerRecipe(torch.optim.AdamW, dict(lr=lr, **kwargs))


# ----------------------------------------------------------------------------- what is built


@dataclass
class TrainingSetup:
    """A wrapped model ready to train.

    ``train_step(inputs, target)`` zeroes the gradients, runs forward, backward and the
    optimizer step, and returns this rank's loss (None on pipeline stages that have none).
    ``module``/``optimizer`` are what :func:`shardkit.utils.memory.model_state_bytes` walks;
    ``params`` is the Ψ this rank's formula uses (the whole model's for data parallelism, the
    stage's for a pipeline); ``data_parallel`` says whether each rank takes a slice of the batch.
    """

    module: nn.Module
    optimizer: torch.optim.Optimizer
    train_step: Callable
    params: int
    data_parallel: bool = True


@dataclass
class Composition:
    """What :func:`compose` builds: the module to call (``wrapped``), the optimizer to step,
    and how to skip a gradient reduction (``no_sync()``, a context), clip gradients
    (``clip_grad_norm(max_norm)``, returning the global norm; ``max_norm=inf`` only measures
    it) and zero them (``zero_grad(set_to_none=True)``) with this
    combination of wrappers. ``params`` is Ψ, the model's parameter count before wrapping."""

    stage: int
    wrapped: nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    no_sync: Callable[[], Any]
    clip_grad_norm: Callable[[float], Any]
    zero_grad: Callable[..., None]
    params: int

    def training_setup(self, loss_fn: Callable) -> TrainingSetup:
        """The plain step over this composition: zero grads, forward, ``loss_fn(output,
        target)``, backward, optimizer step."""
        if self.optimizer is None:
            raise ValueError(f"Composition.training_setup: this stage-{self.stage} composition "
                             f"was built without an optimizer (compose(..., optimizer=None): "
                             f"forward only); compose it with an OptimizerRecipe to train")

        def step(inputs, target):
            self.zero_grad()
            loss = loss_fn(self.wrapped(inputs), target)
            loss.backward()
            self.optimizer.step()
            return loss.detach()
        return TrainingSetup(self.wrapped, self.optimizer, step, self.params)


# ----------------------------------------------------------------------------- composing


def compose(model: nn.Module, stage: int, optimizer: Optional[OptimizerRecipe], *,
            wrap_policy: Optional[Callable] = None, offload: bool = False, comm=None,
            process_group=None, reduce_bucket_bytes: Optional[int] = None,
            sync_bucket_numel: Optional[int] = None,
            count_ddp_comm: bool = True, overlap_param_sync: bool = False,
            step_in_backward: bool = False, reduce_to_owners: bool = False,
            reshard_after_forward: Optional[bool] = None, sharding_strategy=None,
            mixed_precision=False, quantize_weights: bool = False,
            quantize_gradients: bool = False, hpz_partition_size: int = 1,
            reduce_dtype: Optional[torch.dtype] = None,
            find_unused_parameters: bool = False,
            param_init_fn: Optional[Callable] = None,
            agree_across_ranks: bool = True, master_weights: bool = False) -> Composition:
    """Wrap ``model`` for ZeRO ``stage`` (0-3, table in the module docstring) and build its
    optimizer from ``optimizer``.

    ``optimizer=None`` composes a forward-only model (module docstring): stages 0-2 return the
    model itself, its parameters and buffers broadcast from the group's rank 0 (one broadcast
    of ``4Ψ`` bytes), with no gradient reduction; stage 3 wraps it in FSDP as with an optimizer.
    The OSS options (``overlap_param_sync``, ``step_in_backward``, ``reduce_to_owners``,
    ``sync_bucket_numel``) then have nothing to act on and are a ValueError; the gradient
    reduction's (``reduce_bucket_bytes``, ``reduce_dtype`` at stages 0-2,
    ``find_unused_parameters``, ``count_ddp_comm``) are ignored.

    Args:
        wrap_policy: stage 3: which submodules become FSDP units (an ``auto_wrap`` policy);
            ``None`` uses :func:`default_wrap_policy` of the model.
        param_init_fn: stage 3, a model built on the meta device: FSDP's ``param_init_fn``
            (``callable(module)`` materializing a module that holds meta tensors; ``None``:
            each such module's ``reset_parameters()``), run by every unit as it is wrapped.
        offload: stage 3: keep shards and optimizer state in CPU memory (``move_params_to_cpu``).
        comm: the transport of shardkit's wrappers (OSS, ShardedDataParallel, FSDP); ``None`` is
            the process group's own collectives. torch DDP's all-reduce never uses it.
        process_group: the data-parallel group (default: the world).
        reduce_bucket_bytes: stage 2: ShardedDataParallel's reduce bucket, in bytes.
        sync_bucket_numel: stages 1-2: OSS's parameter-sync bucket, elements per rank
            (``None``: OSS's default).
        count_ddp_comm: stages 0-1: route torch DDP's all-reduce through
            :mod:`shardkit.distributed` so that ``CommCounter`` counts it.
        overlap_param_sync: stages 1-2: OSS's parameter sync runs on into the next forward
            (:meth:`shardkit.optim.OSS.overlap_sync_with` the wrapped model).
        reduce_to_owners: stage 1: torch DDP averages each gradient onto its OSS owner only
            (:func:`shardkit.comm_hooks.reduce_to_owners_hook`: stage 2's bytes, other ranks'
            gradients left zero) instead of all-reducing it.
        step_in_backward: stages 1-2: the owners step each sync bucket during backward, as
            soon as its gradients are reduced (stage 2: ``ShardedDataParallel(step_in_backward=
            True)``; stage 1: :func:`shardkit.comm_hooks.step_oss_in_ddp_backward`, which also
            reduces to the owners); the sync then always overlaps the next forward.
        reshard_after_forward, sharding_strategy: stage 3: FSDP's (``None``: its defaults).
        mixed_precision: stage 3: FSDP's ``mixed_precision`` (``True`` or a
            ``MixedPrecisionPolicy``), for every unit.
        quantize_weights, quantize_gradients, hpz_partition_size: stage 3: FSDP's ZeRO++
            options (qwZ, qgZ, hpZ).
        reduce_dtype: the dtype gradients travel and are summed in, divided by N first
            (``torch.bfloat16`` / ``torch.float16``: half an fp32 model's gradient bytes;
            ``torch.float32``: a bf16 / fp16 model's gradients widened for the sum and rounded
            once, twice their bytes; ``None``: each gradient in its own dtype). Stage 0 and
            1: torch DDP's bf16/fp16/fp32 hook (:func:`shardkit.comm_hooks.
            allreduce_hook_for`), or :class:`shardkit.comm_hooks.OwnersHookState` with
            ``reduce_to_owners``; stage 2: ``ShardedDataParallel(reduce_fp16=dtype)``; stage
            3: FSDP's ``MixedPrecisionPolicy(reduce_dtype=dtype)`` (weights stay fp32).
        find_unused_parameters: stages 0-1: torch DDP's option, for models whose forward
            leaves some parameters unused (a pooler, an unused head); a walk of the autograd
            graph after each forward. Stages 2-3 need none. Not with a reentrant activation
            checkpoint (``use_reentrant=True``): torch DDP then fails in backward with
            "Expected to mark a variable ready only once".

        master_weights: stages 0-2: the optimizer steps fp32 master copies of the 16-bit
            parameters (:class:`shardkit.optim.MasterWeights`: DESIGN.md's mixed-precision
            column, ``4 + 8`` bytes of optimizer state per stepped element for Adam; at
            stages 1-2 in OSS's shards, whose parameter sync then moves 16-bit weights), and
            clipping measures the gradients widened to fp32. Ignored at stage 3 (FSDP keeps
            fp32 shards and gathers, computes and reduces in 16 bits through
            ``mixed_precision``, which ``shardkit.initialize`` sets under ``fp16``/``bf16``).
        agree_across_ranks: ``True`` (default): before any wrapper exists, the ranks of
            ``process_group`` exchange what each checked (:func:`agree_on_refusal`), so that a
            refusal only some ranks raise (a model built on the meta device on all ranks but
            rank 0, sparse embeddings on one rank) is raised on every rank, and ranks given a
            different stage, optimizer or model are refused too, instead of some ranks
            waiting in a wrapper's first collective. ``False``: the caller has done that
            exchange already (:func:`shardkit.initialize`, over the world).

    Costs: those of the wrappers (module docstring); building issues each wrapper's
    initial broadcasts. Bad arguments raise before any of them, on every rank: the agreement
    is one small object all-gather over ``process_group`` (a few hundred bytes per rank; one
    per group of a ``(shard, replicate)`` pair; a control message that ``CommCounter`` does
    not count), none in a world of 1.
    """
    refusal = None
    try:
        reduce_dtype = check_composable(
            model, stage, optimizer, comm=comm, wrap_policy=wrap_policy, offload=offload,
            param_init_fn=param_init_fn, mixed_precision=mixed_precision,
            quantize_weights=quantize_weights, quantize_gradients=quantize_gradients,
            hpz_partition_size=hpz_partition_size, reshard_after_forward=reshard_after_forward,
            sharding_strategy=sharding_strategy, overlap_param_sync=overlap_param_sync,
            sync_bucket_numel=sync_bucket_numel, step_in_backward=step_in_backward,
            reduce_to_owners=reduce_to_owners, reduce_dtype=reduce_dtype,
            find_unused_parameters=find_unused_parameters)
        _refuse_group_mixing_tensor_slices(model, stage, process_group)
    except Exception as error:  # every rank must learn of it before any wrapper collective
        refusal = error
    if agree_across_ranks:
        agree_on_refusal(refusal, process_group, f"compose(stage={stage})", {} if refusal else
                         {"stage": repr(stage), "optimizer": optimizer_fingerprint(optimizer),
                          "model": model_fingerprint(model)})
    elif refusal is not None:
        raise refusal
    psi = count_params(model.parameters())
    if optimizer is None and stage < 3:
        return _forward_only(model, stage, process_group, psi)
    if stage == 0:
        return _stage0(model, optimizer, process_group, count_ddp_comm, psi, reduce_dtype,
                       find_unused_parameters, master_weights)
    if stage in (1, 2):
        oss = _oss(model, optimizer, comm, process_group, sync_bucket_numel, master_weights)
        composition = _stage1(model, oss, process_group, count_ddp_comm, psi,
                              reduce_to_owners, step_in_backward, reduce_dtype,
                              find_unused_parameters) if stage == 1 \
            else _stage2(model, oss, comm, process_group, reduce_bucket_bytes, psi,
                         step_in_backward, reduce_dtype)
    else:
        if reduce_dtype is not None:
            from shardkit.nn.data_parallel.mixed_precision import MixedPrecisionPolicy
            mixed_precision = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        fsdp_kwargs = dict(process_group=process_group, comm=comm, move_params_to_cpu=offload,
                           reshard_after_forward=reshard_after_forward,
                           sharding_strategy=sharding_strategy, mixed_precision=mixed_precision,
                           quantize_weights=quantize_weights,
                           quantize_gradients=quantize_gradients,
                           hpz_partition_size=hpz_partition_size, sync_module_states=True,
                           param_init_fn=param_init_fn)
        policy = wrap_policy or default_wrap_policy(model)
        return _stage3(model, optimizer, policy, fsdp_kwargs, psi)
    if overlap_param_sync and not step_in_backward:  # step_in_backward overlaps it already
        composition.optimizer.overlap_sync_with(composition.wrapped)
    return composition


# FSDP's options, with the values that leave them off.
_FSDP_ONLY = {"wrap_policy": None, "offload": False, "mixed_precision": False,
              "reshard_after_forward": None, "sharding_strategy": None,
              "quantize_weights": False, "quantize_gradients": False, "hpz_partition_size": 1,
              "param_init_fn": None}


def _check_arguments(stage, optimizer, comm, overlap_param_sync, sync_bucket_numel,
                     step_in_backward, reduce_to_owners, **fsdp_options) -> None:
    """Refuse what :func:`compose` cannot build, before any wrapper exists."""
    if stage not in STAGES:
        raise ValueError(f"compose(stage={stage!r}): valid stages are {list(STAGES)}")
    if optimizer is None:
        oss_only = [name for name, value in (("overlap_param_sync", overlap_param_sync),
                                             ("step_in_backward", step_in_backward),
                                             ("reduce_to_owners", reduce_to_owners),
                                             ("sync_bucket_numel", sync_bucket_numel))
                    if value not in (None, False)]
        if oss_only:
            raise ValueError(f"compose(stage={stage}, optimizer=None): {', '.join(oss_only)} "
                             f"act(s) on OSS, which a composition without an optimizer does "
                             f"not build; leave them unset or pass an OptimizerRecipe")
    elif not isinstance(optimizer, OptimizerRecipe):
        raise TypeError(f"compose(optimizer={type(optimizer).__name__}): expected an "
                        f"OptimizerRecipe, e.g. recipes.adamw(lr=1e-3) or "
                        f"OptimizerRecipe.of(torch_optimizer)")
    set_here = [name for name, off in _FSDP_ONLY.items() if fsdp_options[name] != off]
    if stage != 3 and set_here:
        what = "is an FSDP option" if len(set_here) == 1 else "are FSDP options"
        raise ValueError(f"compose(stage={stage}): {', '.join(set_here)} {what} (stage 3 only)")
    if overlap_param_sync and stage not in (1, 2):
        raise ValueError(f"compose(stage={stage}, overlap_param_sync=True): only OSS's "
                         f"parameter sync (stages 1 and 2) can overlap the next forward")
    if reduce_to_owners and stage != 1:
        raise ValueError(f"compose(stage={stage}, reduce_to_owners=True): only stage 1 (OSS under "
                         f"torch DDP) takes DDP's reduce-to-owners hook; stage 2 always reduces "
                         f"to the owners")
    from shardkit.optim.local_step import runs_on_whole_model
    if optimizer is not None and (stage == 2 or reduce_to_owners) \
            and runs_on_whole_model(optimizer.cls):
        how = "ShardedDataParallel reduces" if stage == 2 else "reduce_to_owners reduces"
        raise ValueError(f"compose(stage={stage}{', reduce_to_owners=True' if stage == 1 else ''}"
                         f"): {optimizer.cls.__name__} steps the whole model on every rank (OSS "
                         f"runs it unsharded), so every rank needs every averaged gradient, and "
                         f"{how} each gradient onto its owner only: use stage 1 without "
                         f"reduce_to_owners (torch DDP's all-reduce; shardkit.initialize: "
                         f"zero_optimization.stage=1 with reduce_scatter=false), or stage 0")
    if step_in_backward and stage not in (1, 2):
        raise ValueError(f"compose(stage={stage}, step_in_backward=True): only OSS (stages 1 "
                         f"and 2) steps the optimizer during backward")
    if sync_bucket_numel is not None and stage not in (1, 2):
        raise ValueError(f"compose(stage={stage}, sync_bucket_numel={sync_bucket_numel}): only "
                         f"OSS (stages 1 and 2) has a parameter-sync bucket")
    if stage == 0 and comm is not None:
        raise ValueError(f"compose(stage=0, comm={type(comm).__name__}): stage 0 is torch DDP "
                         f"alone, which uses its process group; comm= is the transport of "
                         f"shardkit's wrappers (stages 1-3)")
    problem = stage == 3 and optimizer is not None and (
        why_not_steppable_on_shards(optimizer.instance) if optimizer.instance is not None
        else why_not_on_row_shards(optimizer.cls))
    if problem:
        raise ValueError(f"compose(stage=3): {problem}")


def check_composable(model: nn.Module, stage: int, optimizer: Optional[OptimizerRecipe], *,
                     comm=None, wrap_policy=None, offload=False, param_init_fn=None,
                     mixed_precision=False, quantize_weights=False, quantize_gradients=False,
                     hpz_partition_size=1, reshard_after_forward=None, sharding_strategy=None,
                     overlap_param_sync=False, sync_bucket_numel=None, step_in_backward=False,
                     reduce_to_owners=False, reduce_dtype=None,
                     find_unused_parameters=False,
                     master_weights=False) -> Optional[torch.dtype]:
    """Every refusal of :func:`compose` (same arguments), computed from this rank's model and
    arguments only: raises what ``compose`` would raise before building, else returns the
    gradient-reduction dtype it would use. :func:`shardkit.initialize` runs it before its
    one agreement exchange. Local, no collective."""
    _check_arguments(stage, optimizer, comm, wrap_policy=wrap_policy, offload=offload,
                     param_init_fn=param_init_fn,
                     mixed_precision=mixed_precision, quantize_weights=quantize_weights,
                     quantize_gradients=quantize_gradients,
                     hpz_partition_size=hpz_partition_size,
                     reshard_after_forward=reshard_after_forward,
                     sharding_strategy=sharding_strategy, overlap_param_sync=overlap_param_sync,
                     sync_bucket_numel=sync_bucket_numel, step_in_backward=step_in_backward,
                     reduce_to_owners=reduce_to_owners)
    reduce_dtype = _checked_reduce_dtype(reduce_dtype, stage, mixed_precision,
                                         quantize_gradients, step_in_backward, model)
    refuse_meta_tensors(model, stage, f"compose(stage={stage})")
    # forward only at stages 0-2: the model stays whole and no gradient is ever reduced
    if optimizer is not None or stage == 3:
        _refuse_sparse_gradients(model, stage)
    if stage == 3:
        _refuse_trainable_ignored(model)
    if find_unused_parameters not in (False, True) or (find_unused_parameters and stage > 1):
        raise ValueError(f"compose(stage={stage}, find_unused_parameters="
                         f"{find_unused_parameters!r}): a bool, for stages 0-1 (torch DDP); "
                         f"stages 2-3 reduce per parameter and need no search for unused ones")
    _check_master_weights(master_weights, stage, optimizer, step_in_backward)
    return reduce_dtype


def _refuse_group_mixing_tensor_slices(model: nn.Module, stage: int, process_group) -> None:
    """A ValueError when ``process_group`` holds several ranks of one tensor-parallel group of
    the model's tensor-parallel layers: at stage 0 torch DDP's first broadcast would copy one
    rank's slices over the others', and every stage would sum gradients of different slices.
    Local (the caller agrees on the refusal)."""
    params = [p for p in model.parameters() if getattr(p, "tensor_model_parallel", False)]
    if not params:
        return
    from shardkit.nn.model_parallel.initialize import tensor_parallel_mates
    groups = list(process_group) if isinstance(process_group, tuple) else [process_group]
    _, problem = tensor_parallel_mates(groups, params, f"compose(stage={stage})",
                                       "the wrappers would copy and sum the slices into each "
                                       "other")
    if problem is not None:
        raise ValueError(problem)


def _check_master_weights(master_weights, stage: int, optimizer: Optional[OptimizerRecipe],
                          step_in_backward: bool) -> None:
    """``compose(master_weights=...)``: a bool; at stages 0-2 it needs an optimizer class
    (the masters are stepped by it: a factory function cannot be), and the whole step at once
    (not ``step_in_backward``, which steps bucket by bucket)."""
    if master_weights not in (False, True):
        raise ValueError(f"compose(master_weights={master_weights!r}): expected True or False")
    if not master_weights or stage == 3 or optimizer is None:
        return
    cls = type(optimizer.instance) if optimizer.instance is not None else optimizer.cls
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"compose(stage={stage}, master_weights=True): the fp32 masters are "
                         f"stepped by the optimizer's class, and {cls!r} is not a "
                         f"torch.optim.Optimizer subclass; pass an optimizer class or instance")
    if step_in_backward:
        raise ValueError(f"compose(stage={stage}, master_weights=True, step_in_backward=True): "
                         f"the fp32 masters are stepped whole after backward; pass "
                         f"step_in_backward=False")


def model_fingerprint(model: nn.Module) -> str:
    """A short text that two ranks holding the same model (parameter and buffer names,
    shapes, dtypes, ``requires_grad``, embeddings built with ``sparse=True``) share: counts
    to read and a digest of the rest. Where the tensors live (meta, CPU, GPU) is left out:
    stage 3 takes a model on meta on some ranks. Local."""
    digest = hashlib.sha1()
    params = elements = trainable = buffers = 0
    for name, p in model.named_parameters():
        digest.update(f"{name} {tuple(p.shape)} {p.dtype} {p.requires_grad};".encode())
        params, elements, trainable = params + 1, elements + p.numel(), \
            trainable + int(p.requires_grad)
    for name, b in model.named_buffers():
        digest.update(f"buffer {name} {tuple(b.shape)} {b.dtype};".encode())
        buffers += 1
    sparse = [name for name, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and getattr(m, "sparse", False)]
    digest.update(f"sparse {sparse}".encode())
    return (f"{params} parameters ({elements} elements, {trainable} trainable), {buffers} "
            f"buffers, {len(sparse)} sparse embedding(s), sha1 {digest.hexdigest()[:12]}")


_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def stable_repr(value) -> str:
    """``repr(value)`` without memory addresses (``<Foo object at 0x7f...>``, a function's
    repr), which differ between processes holding equal values: what the ranks compare at
    start-up. Local."""
    return _ADDRESS.sub("0x?", repr(value))


def optimizer_fingerprint(recipe: Optional[OptimizerRecipe]) -> str:
    """A short text of what the optimizer ``recipe`` builds: its class, hyper-parameters and
    the sizes of its param groups (with a digest of each group's settings). Local."""
    if recipe is None:
        return "none (forward only)"
    if recipe.instance is not None:
        groups = recipe.instance.param_groups
    elif recipe.param_groups is not None:
        groups = _as_group_dicts(recipe.param_groups)
    else:
        groups = [{"params": []}]
    settings = [sorted((k, stable_repr(v)) for k, v in g.items() if k != "params")
                for g in groups]
    digest = hashlib.sha1(repr(settings).encode()).hexdigest()[:12]
    defaults = ", ".join(f"{k}={stable_repr(v)}" for k, v in sorted(recipe.defaults.items()))
    if len(defaults) > 200:
        defaults = defaults[:200] + "..."
    layout = f"param groups of {[len(g['params']) for g in groups]} parameters" \
        if recipe.param_groups is not None or recipe.instance is not None \
        else "one param group over the trainable parameters"
    # an optimizer that stepped on one rank only (stage 0 steps it replicated: Adam's moments
    # and step count would differ between the replicas)
    state = "" if recipe.instance is None else \
        f", state for {len(recipe.instance.state)} parameters"
    return f"{_class_name(recipe.cls)}({defaults}), {layout}{state}, settings sha1 {digest}"


def _class_name(cls) -> str:
    """The name of an optimizer class, or of what a ``functools.partial`` of one builds
    (``OSS(optim=partial(...))``'s form, which a recipe may carry too)."""
    while isinstance(cls, functools.partial):
        cls = cls.func
    return getattr(cls, "__name__", repr(cls))


def _error_class(where: tuple) -> type:
    """The class of the refusal ``(module, qualname)`` where this rank has it loaded already
    (builtins, ConfigError, the user's own classes in the modules it imported; nothing is
    imported here), else RuntimeError."""
    import sys
    module, qualname = where
    try:
        found = sys.modules[module]
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:  # a class local to a function or to one rank's code
        return RuntimeError
    return found if isinstance(found, type) and issubclass(found, Exception) else RuntimeError


def agree_on_refusal(refusal: Optional[BaseException], group, where: str,
                     compared: Optional[dict] = None,
                     rule: str = "every rank must compose the same model with the same stage "
                                 "and optimizer",
                     among: Optional[tuple] = None) -> None:
    """Make a refusal that only some ranks raised (``refusal``: this rank's error from its
    local checks, or ``None``) the error of every rank of ``group``, before any wrapper
    collective, so that no rank goes on into a collective the refusing ranks never join.

    Every rank raises: this rank's own ``refusal`` unchanged when every rank refused with the
    same text; else the first refusing rank's error (same class wherever that class is loaded
    on the rank, else RuntimeError) followed by which ranks refused and which did not, the
    same text on every rank. Without any refusal, ``compared`` (``{name: text}``: stage,
    optimizer, model fingerprints, config keys) must be equal on every rank, else a
    ValueError naming the first difference and ``rule``; ``among`` (``(label, {name: text})``,
    optional) is compared only between the ranks that give the same label (a tensor-parallel
    rank's model with its data-parallel replicas').

    ``group``: a process group, ``None`` (the default group) or a ``(shard, replicate)``
    pair, whose ranks must all call this. Communication: one object all-gather of this
    rank's verdict and ``compared`` (a few hundred bytes) over ``group`` (over each group of
    a pair, in turn: the second carries what the first gathered); none in a world of 1. A
    control message, not counted by ``CommCounter``."""
    groups = list(group) if isinstance(group, (tuple, list)) else [group]
    groups = [g for g in groups if distributed.get_world_size(g) > 1]
    if not groups:
        if refusal is not None:
            raise refusal
        return
    mine = {"rank": distributed.get_rank(), "compared": dict(compared or {}),
            "among": among,
            "refusal": None if refusal is None else (
                (type(refusal).__module__, type(refusal).__qualname__), str(refusal))}
    known = [mine]
    for g in groups:
        gathered = distributed.all_gather_object(
            known, g, counted=False, operation="the ranks' agreement before composing")
        merged = {entry["rank"]: entry for entries in gathered for entry in entries}
        known = [merged[r] for r in sorted(merged)]
    refusing = [e for e in known if e["refusal"] is not None]
    if refusing:
        if refusal is not None and len(refusing) == len(known) and all(
                e["refusal"] == mine["refusal"] for e in refusing):
            raise refusal  # every rank refused alike: the error a world of 1 raises
        first = refusing[0]
        others = [e["rank"] for e in refusing[1:] if e["refusal"] != first["refusal"]]
        fine = [e["rank"] for e in known if e["refusal"] is None]
        note = f"; rank(s) {others} refused for other reasons" if others else ""
        if fine:
            text = (f"{first['refusal'][1]} [refused on rank(s) "
                    f"{[e['rank'] for e in refusing]}, not on rank(s) {fine}{note}; {where} "
                    f"raises it on every rank rather than let rank(s) {fine} wait in a "
                    f"collective the others never join]")
        else:  # every rank refused, not all for the same reason: the first rank's, everywhere
            text = (f"{first['refusal'][1]} [rank {first['rank']}'s refusal; every rank "
                    f"refused{note}; {where} raises the same error on every rank]")
        try:
            error = _error_class(first["refusal"][0])(text)
        except Exception:  # a class whose constructor takes other arguments
            error = RuntimeError(text)
        raise error from refusal
    sets = [known] + [[e for e in known if e["among"] and e["among"][0] == label]
                      for label in sorted({e["among"][0] for e in known if e["among"]})]
    for index_set, entries in enumerate(sets):
        found = distributed.first_difference(
            [e["compared"] if index_set == 0 else e["among"][1] for e in entries])
        if found is not None:
            name, theirs0, index, theirs = found
            label = "" if index_set == 0 else f" ({entries[0]['among'][0]})"
            raise ValueError(f"{where}: {name}{label} is {theirs0} on rank {entries[0]['rank']} "
                             f"and {theirs} on rank {entries[index]['rank']}; {rule}")


def refuse_meta_tensors(model: nn.Module, stage: int, where: str) -> None:
    """Stages 0-2 keep the whole model on every rank and start from rank 0's values, so a
    model built on the meta device (no storage, no values) cannot be composed there: a
    ValueError naming the tensors on meta and the two ways out. Local: :func:`compose` and
    :func:`shardkit.initialize` then agree on it (:func:`agree_on_refusal`), so that with the
    llama-recipes pattern (the real model on rank 0, meta elsewhere) every rank raises it
    before any collective, not the meta ranks alone. Stage 3 takes it: each FSDP unit
    materializes its own modules as it is wrapped (FSDP's ``param_init_fn``) and
    ``sync_module_states`` gives every rank rank 0's values. ``where`` starts the message."""
    if stage == 3:
        return
    meta = [f"parameter {name!r}" for name, p in model.named_parameters() if p.is_meta]
    meta += [f"buffer {name!r}" for name, b in model.named_buffers() if b.is_meta]
    if not meta:
        return
    more = f" and {len(meta) - 4} more" if len(meta) > 4 else ""
    raise ValueError(
        f"{where}: the model holds {', '.join(meta[:4])}{more} on the meta device "
        f"(built under torch.device('meta')); stages 0-2 keep the whole model on every rank, "
        f"so materialize it first (model.to_empty(device=...), then initialise it, e.g. each "
        f"module's reset_parameters() or load_state_dict), or use stage 3, where each FSDP "
        f"unit materializes its own part as it is wrapped (one unit's full size at a time; "
        f"param_init_fn= for modules without reset_parameters())")


def _refuse_sparse_gradients(model: nn.Module, stage: int) -> None:
    """Stages 1-3 do not take sparse gradients (``nn.Embedding``/``nn.EmbeddingBag`` built with
    ``sparse=True``), as ``initialize`` refuses them there: stage 1's reduce-to-owners hook,
    ShardedDataParallel's buckets and FSDP's flat shards handle dense tensors only (stages
    2-3 failed in backward with "reshape is not implemented for sparse tensors"). A
    ValueError naming the first such trainable parameter, on every rank, before any wrapper
    exists. Local."""
    if stage == 0:
        return
    for prefix, module in model.named_modules():
        if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)) \
                or not getattr(module, "sparse", False):
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad:
                full = f"{prefix}.{name}" if prefix else name
                raise ValueError(
                    f"compose(stage={stage}): parameter {full!r} ({type(module).__name__} "
                    f"built with sparse=True) gets sparse gradients, which stages 1-3 cannot "
                    f"reduce (OSS, ShardedDataParallel and FSDP take dense gradients); build "
                    f"it with sparse=False, or use stage 0 (torch DDP reduces sparse "
                    f"gradients)")


# What each of these optimizers reads across a whole tensor, which a row shard does not hold.
_LBFGS_READS = ("keeps one history over the flattened parameters and re-evaluates a closure "
                "a number of times that depends on those values")


def why_not_on_row_shards(optimizer_class: type) -> Optional[str]:
    """Why stage 3 cannot step an optimizer of ``optimizer_class`` on FSDP's row shards
    (``None``: it can): one that reads a whole tensor (Adafactor, Muon) or the whole model
    (LBFGS) would compute another update from each rank's rows than one process computes.
    The same classes, told by name, as FSDP's step-time refusal
    (:func:`~shardkit.nn.data_parallel.fsdp_optimizer_checks.whole_tensor_reading`: also
    another library's Adafactor, LAMB or LARS). Local; a look at the class."""
    from shardkit.nn.data_parallel.fsdp_optimizer_checks import whole_tensor_reading
    if not isinstance(optimizer_class, type):
        return None
    what = whole_tensor_reading(optimizer_class)
    if what is None and issubclass(optimizer_class, torch.optim.LBFGS):
        what = _LBFGS_READS
    if what is None:
        return None
    return (f"{optimizer_class.__name__} {what}; FSDP (stage 3) gives each rank only "
            f"its rows of every parameter, so the update would differ from one "
            f"process's: use stages 0-2 (OSS keeps whole parameters) or another "
            f"optimizer")


def why_not_steppable_on_shards(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why stage 3 cannot step ``optimizer``, built over the model before wrapping (``None``:
    it can). FSDP shards each parameter in place (the same ``Parameter`` objects keep their
    dim-0 rows), so the optimizer's groups already hold the shards, and state it holds already
    (Adagrad's sum from its constructor, steps taken before) is cut to the same rows
    (:func:`_state_to_row_shards`); not state shaped unlike its parameter (neither its shape
    nor 0-dim), which has no rows to cut, nor state of a 0-dim parameter (FSDP makes it one
    row; its moments, 0-dim like the step count, cannot be told from it), nor an optimizer
    that reads whole tensors (:func:`why_not_on_row_shards`)."""
    whole = why_not_on_row_shards(type(optimizer))
    if whole:
        return whole
    scalar = next((keys for keys in ([key for key, value in state.items()
                                      if isinstance(value, torch.Tensor)]
                                     for p, state in optimizer.state.items() if p.dim() == 0)
                   if keys), None)
    if scalar:
        return (f"the {type(optimizer).__name__} given already holds state {scalar} for a "
                f"0-dim parameter, which FSDP shards as a 1-row tensor; its per-element "
                f"state, 0-dim like a step count, cannot be told from one to be cut likewise; "
                f"pass a fresh optimizer (or a callable building one) and restore its state "
                f"from a checkpoint")
    odd = [(key, tuple(value.shape)) for p, state in optimizer.state.items()
           for key, value in state.items() if isinstance(value, torch.Tensor)
           and value.dim() > 0 and value.shape != p.shape]
    if odd:
        return (f"the {type(optimizer).__name__} given already holds state shaped unlike its "
                f"parameters (e.g. {odd[0][0]!r} of shape {odd[0][1]}), which FSDP's row "
                f"shards cannot be cut from; pass a fresh optimizer (or a callable building "
                f"one) and restore its state from a checkpoint")
    return None


def torch_ddp(model: nn.Module, process_group=None, count_comm: bool = True,
              reduce_dtype: Optional[torch.dtype] = None,
              find_unused_parameters: bool = False) -> nn.Module:
    """Wrap in torch DDP with gradients as views of its buckets (so the bucket storage is the
    gradient storage and ``model_state_bytes`` counts what DDP really holds); with
    ``count_comm`` its all-reduce goes through :func:`shardkit.comm_hooks.
    counted_allreduce_hook` (each bucket in its dtype, counted by ``CommCounter``); with a
    ``reduce_dtype``, through that dtype's hook (counted too: a 16-bit one half an fp32
    bucket's bytes, fp32 twice a 16-bit bucket's).
    ``find_unused_parameters``: torch DDP's option (parameters a forward does not use are
    marked ready; costs a walk of the autograd graph after each forward)."""
    from torch.nn.parallel import DistributedDataParallel
    device = next(model.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids, process_group=process_group,
                                  gradient_as_bucket_view=True,
                                  find_unused_parameters=find_unused_parameters)
    if reduce_dtype is not None:
        from shardkit.comm_hooks import allreduce_hook_for
        ddp.register_comm_hook(process_group, allreduce_hook_for(reduce_dtype))
    elif count_comm:
        from shardkit.comm_hooks import counted_allreduce_hook
        _register_replaceable_hook(ddp, process_group, counted_allreduce_hook)
    return ddp


def _register_replaceable_hook(ddp, state, hook) -> None:
    """Register ``hook`` (the counting one, which the caller did not ask for) so that the
    caller's own first ``ddp.register_comm_hook(state, hook)`` (PowerSGD, fp16 compression)
    replaces it, as it would on a DDP built without it; torch's reducer takes one hook only,
    and a second registration of the caller's is torch's error as before."""
    slot = {"state": state, "hook": hook, "replaced": False}

    def dispatch(_, bucket):
        return slot["hook"](slot["state"], bucket)

    dispatch.__name__ = getattr(hook, "__name__", "dispatch")
    ddp.register_comm_hook(None, dispatch)
    torch_register = ddp.register_comm_hook

    def register_comm_hook(state, hook):
        if slot["replaced"]:
            return torch_register(state, hook)  # torch's "can only be called once"
        ddp._check_comm_hook(hook)
        slot.update(state=state, hook=hook, replaced=True)
        ddp._comm_hooks[:] = [(hook, state)]

    register_comm_hook.__doc__ = type(ddp).register_comm_hook.__doc__
    ddp.register_comm_hook = register_comm_hook


_REDUCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _checked_reduce_dtype(reduce_dtype, stage, mixed_precision, quantize_gradients,
                          step_in_backward, model: nn.Module) -> Optional[torch.dtype]:
    """``compose``'s ``reduce_dtype``, fp32 read as ``None`` where no trainable parameter of
    ``model`` is 16-bit (fp32 gradients travel as they are; for 16-bit ones fp32 widens the
    reduction, as DeepSpeed's ``communication_data_type``); what it cannot combine with is a
    ValueError before any wrapper exists."""
    if reduce_dtype is not None and reduce_dtype not in _REDUCE_DTYPES:
        raise ValueError(f"compose(reduce_dtype={reduce_dtype!r}): valid values are None, "
                         f"torch.float32, torch.bfloat16 and torch.float16")
    if reduce_dtype is None or (reduce_dtype == torch.float32 and not any(
            p.dtype in (torch.float16, torch.bfloat16) for p in _trainable(model))):
        return None
    clash = ("mixed_precision (set reduce_dtype in its MixedPrecisionPolicy)"
             if stage == 3 and mixed_precision is not False else
             "quantize_gradients (qgZ sends int4 gradients)" if quantize_gradients else
             "step_in_backward" if step_in_backward else None)
    if clash:
        raise ValueError(f"compose(stage={stage}, reduce_dtype={reduce_dtype}): not with "
                         f"{clash}")
    return reduce_dtype


def _trainable(model: nn.Module) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def _zero_grads(*owners) -> Callable[..., None]:
    def zero_grad(set_to_none: bool = True) -> None:
        for owner in owners:
            if isinstance(owner, torch.optim.Optimizer):
                owner.zero_grad(set_to_none=set_to_none)
            else:
                owner.zero_grad()
    return zero_grad


def _oss(model: nn.Module, recipe: OptimizerRecipe, comm, process_group, bucket_numel,
         master_weights: bool = False):
    """OSS over the recipe's parameters; ``master_weights``: each rank's shard steps fp32
    masters of the 16-bit parameters (:class:`shardkit.optim.MasterWeights`), with the recipe's
    optimizer class (an optimizer the user built: its class, hyper-parameters and groups, the
    same group dicts, so that a scheduler built on it still drives the learning rate)."""
    from shardkit.optim import OSS, MasterWeights
    from shardkit.optim import oss_arguments
    from shardkit.optim.local_step import rebuilt_from_class
    instance = recipe.instance
    if instance is None:
        params = recipe.param_groups if recipe.param_groups is not None else _trainable(model)
        optim = MasterWeights.over(recipe.cls) if master_weights else recipe.cls
        return OSS(params, optim=optim, group=process_group, comm=comm,
                   bucket_numel=bucket_numel, **recipe.defaults)
    if not master_weights:
        return OSS(instance, group=process_group, comm=comm, bucket_numel=bucket_numel)
    if rebuilt_from_class(type(instance)):
        oss = OSS(oss_arguments.groups_of(instance), optim=MasterWeights.over(type(instance)),
                  group=process_group, comm=comm, bucket_numel=bucket_numel,
                  **oss_arguments.constructor_kwargs(type(instance), instance.defaults))
    else:  # a copy of it steps each shard's masters: see copies_of
        oss = OSS(oss_arguments.groups_of(instance), optim=MasterWeights.copies_of(instance),
                  group=process_group, comm=comm, bucket_numel=bucket_numel)
    if instance.state:
        oss.load_state_dict(instance.state_dict())
    return oss


def _forward_only(model: nn.Module, stage: int, process_group, psi: int) -> Composition:
    """Stages 0-2 without an optimizer: the model itself, whole (no gradients are reduced and
    there is no optimizer state to shard), starting from the group's rank-0 weights and
    buffers as every stage does. Communication: one broadcast of the parameters and buffers
    (``4Ψ`` bytes in fp32); memory: the model, nothing more."""
    tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    distributed.broadcast_tensors_from_rank0(tensors, group=process_group)
    params = _trainable(model)
    return Composition(stage, model, None, contextlib.nullcontext, _replicated_clip(params),
                       _zero_grads(model), psi)


def _stage0(model, recipe, process_group, count_comm, psi, reduce_dtype,
            find_unused: bool, master_weights: bool = False) -> Composition:
    """torch DDP and a replicated optimizer (``master_weights``: stepping fp32 masters of the
    16-bit parameters, :func:`_with_master_weights`)."""
    ddp = torch_ddp(model, process_group, count_comm, reduce_dtype, find_unused)
    if master_weights:
        optimizer = _with_master_weights(recipe, model)
    else:
        optimizer = recipe.instance or recipe.build(recipe.param_groups or _trainable(model))
    params = _trainable(model)
    return Composition(0, ddp, optimizer, ddp.no_sync, _replicated_clip(params, optimizer),
                       _zero_grads(optimizer), psi)


def _with_master_weights(recipe: OptimizerRecipe, model: nn.Module) -> torch.optim.Optimizer:
    """Stage 0's optimizer over fp32 masters of every 16-bit parameter
    (:class:`shardkit.optim.MasterWeights` of the recipe's class; of an optimizer the user
    built: :meth:`~shardkit.optim.MasterWeights.around` it, so its own attributes, the same
    group dicts and any state it holds are kept, its constructor not called again).
    Memory: 4 bytes per 16-bit element beside the optimizer's state."""
    from shardkit.optim import MasterWeights
    instance = recipe.instance
    if instance is None:
        params = recipe.param_groups or _trainable(model)
        return MasterWeights.over(recipe.cls)(params, **recipe.defaults)
    return MasterWeights.over(type(instance)).around(instance)


def _replicated_clip(params: list, optimizer=None) -> Callable:
    """``clip(max_norm)`` for gradients every rank of the data-parallel group holds in full,
    chosen once: with tensor-parallel layers (DDP over the data-parallel group) the unsplit
    model's norm, each slice and each replicated weight counted once
    (:func:`shardkit.nn.model_parallel.clip_grad_norm`: one more all-reduce of one element,
    over the tensor-parallel group); else :func:`_clip_replicated`. Under a
    :class:`shardkit.optim.MasterWeights` ``optimizer`` the fp32 gradients of the masters are
    measured and scaled (:func:`_clip_master_grads`), which the step reads."""
    from shardkit.optim import MasterWeights
    from shardkit.utils.grad_norm import tensor_parallel_groups
    if isinstance(optimizer, MasterWeights):
        return functools.partial(_clip_master_grads, optimizer, params)
    if tensor_parallel_groups(params, "compose(stage=0) clipping") is not None:
        from shardkit.nn.model_parallel import clip_grad_norm
        return functools.partial(clip_grad_norm, params)
    return functools.partial(_clip_replicated, params)


def _clip_master_grads(optimizer, params: list, max_norm: float) -> torch.Tensor:
    """Stage 0's clip under :class:`shardkit.optim.MasterWeights`: the 16-bit gradients
    widened to fp32 first, then those measured and scaled as :func:`_replicated_clip` does
    the parameters' own (tensor-parallel layers: their marks, one all-reduce of one element
    over the tensor-parallel group; else local)."""
    from shardkit.utils.grad_norm import tensor_parallel_groups
    optimizer.prepare_master_grads()
    held = [p for p in params if optimizer.holds(p)]
    if tensor_parallel_groups(held, "compose(stage=0) clipping") is not None:
        from shardkit.nn.model_parallel.grad_norm import clip_grads_of
        return clip_grads_of(held, optimizer.master_grad_of, max_norm)
    return _clip_replicated_grads([optimizer.master_grad_of(p) for p in held
                                   if optimizer.master_grad_of(p) is not None], max_norm)


def _clip_replicated(params: list, max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` over gradients every rank holds in full; ``max_norm=inf``
    only measures (no pass that multiplies by 1). Sparse gradients (``nn.Embedding(sparse=
    True)``, which torch DDP reduces at stage 0), which torch's norm cannot take, count with
    their coalesced values (repeated rows summed, as they are added to the weight), so the
    norm and the clipped gradients are those of the same gradients held dense. Local."""
    grads = [p.grad for p in params if p.grad is not None]
    if not any(g.is_sparse for g in grads):
        if math.isinf(max_norm):
            return torch.nn.utils.get_total_norm(grads)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    return _clip_replicated_grads(grads, max_norm)


def _clip_replicated_grads(grads: list, max_norm: float) -> torch.Tensor:
    """:func:`_clip_replicated` over the gradient tensors themselves: the norm (sparse ones by
    their coalesced values) and torch's coefficient ``max_norm / (norm + 1e-6)``, at most 1.
    Local."""
    total = torch.nn.utils.get_total_norm(
        [g.coalesce().values() if g.is_sparse else g for g in grads])
    if not math.isinf(max_norm):  # torch's coefficient, at most 1
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for grad in grads:
                grad.mul_(coefficient.item() if grad.is_sparse else coefficient.to(grad.device))
    return total


def _stage1(model, oss, process_group, count_comm, psi, reduce_to_owners,
            step_in_backward, reduce_dtype, find_unused: bool) -> Composition:
    """OSS (optimizer state sharded) over torch DDP (full gradients all-reduced, or with
    ``reduce_to_owners`` averaged onto their owners only; ``step_in_backward``: also stepped
    there)."""
    plain = not reduce_to_owners and not step_in_backward
    ddp = torch_ddp(model, process_group, count_comm and plain, reduce_dtype if plain else None,
                    find_unused)
    if step_in_backward:
        from shardkit.comm_hooks import step_oss_in_ddp_backward
        step_oss_in_ddp_backward(ddp, oss)
    elif reduce_to_owners:
        from shardkit.comm_hooks import OwnersHookState, reduce_to_owners_hook
        stepped = {id(p) for group in oss.param_groups for p in group["params"]}
        outside = [n for n, p in model.named_parameters()
                   if p.requires_grad and id(p) not in stepped]
        if outside:  # the hook would fail in backward, inside DDP's reduction
            raise ValueError(f"compose(stage=1, reduce_to_owners=True): trainable parameter(s) "
                             f"{outside[:6]} are in no param group of the optimizer; the owners' "
                             f"reduction needs every reduced gradient in OSS's partition: pass "
                             f"reduce_to_owners=False (torch DDP's all-reduce), add them to the "
                             f"optimizer, or set requires_grad=False on them")
        ddp.register_comm_hook(OwnersHookState(oss, reduce_dtype), reduce_to_owners_hook)
    return Composition(1, ddp, oss, ddp.no_sync, oss.clip_grad_norm, _zero_grads(oss), psi)


def _stage2(model, oss, comm, process_group, reduce_bucket_bytes, psi,
            step_in_backward, reduce_dtype) -> Composition:
    """OSS plus ShardedDataParallel on the one transport: each gradient is reduced to its
    owner only."""
    from shardkit.nn.data_parallel import ShardedDataParallel
    kwargs = {} if reduce_bucket_bytes is None else {"reduce_buffer_size": reduce_bucket_bytes}
    if reduce_dtype is not None:
        kwargs["reduce_fp16"] = reduce_dtype
    sdp = ShardedDataParallel(model, oss, process_group=process_group, comm=comm,
                              step_in_backward=step_in_backward, **kwargs)
    return Composition(2, sdp, oss, sdp.no_sync, oss.clip_grad_norm, _zero_grads(sdp, oss), psi)


def _stage3(model, recipe, policy, fsdp_kwargs, psi) -> Composition:
    """FSDP around every unit the policy picks and around the root; the optimizer is built
    over FSDP's sharded parameters."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel.fsdp_state_dict import show_original_names
    from shardkit.nn.wrap import auto_wrap
    wrapped = auto_wrap(model, auto_wrap_policy=policy, **fsdp_kwargs)
    if not isinstance(wrapped, FSDP):  # the policy may have wrapped the root already
        wrapped = FSDP(wrapped, **fsdp_kwargs)
    if not isinstance(model, FSDP):  # the engine's module: its names as before wrapping
        show_original_names(model)
    if recipe is None:  # forward only: the shards, no optimizer
        return Composition(3, wrapped, None, wrapped.no_sync, wrapped.clip_grad_norm_,
                           _zero_grads(wrapped), psi)
    optimizer = _build_on_shards(recipe, [p for p in wrapped.parameters() if p.requires_grad])
    # torch's own get_state_dict takes this optimizer's shard state for replicated tensors:
    # marked (per instance) so that dcp.save refuses it instead of writing one rank's rows
    from shardkit.checkpoint.torch_state_dict import mark_sharded_state_for_dcp
    mark_sharded_state_for_dcp(optimizer)
    return Composition(3, wrapped, optimizer, wrapped.no_sync, wrapped.clip_grad_norm_,
                       _zero_grads(wrapped, optimizer), psi)


def _refuse_trainable_ignored(model: nn.Module) -> None:
    """A unit the caller built with torch FSDP1's ``ignored_modules`` / ``ignored_states``
    leaves those gradients unreduced, so the engine's step would move each rank's copy apart,
    silently: trainable ones are refused (frozen ones are fine). Stages 0-2 refuse FSDP
    units altogether. Local."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel.fsdp_state_dict import clean_name
    ignored = {id(p) for u in model.modules() if isinstance(u, FSDP)
               for p in getattr(u, "_ignored_params", ())}
    trainable = [clean_name(n) for n, p in model.named_parameters()
                 if id(p) in ignored and p.requires_grad]
    if trainable:
        raise ValueError(
            f"compose(stage=3): the model holds FullyShardedDataParallel units built with "
            f"ignored_modules/ignored_states whose {len(trainable)} trainable parameter(s) "
            f"({', '.join(trainable[:5])}{', ...' if len(trainable) > 5 else ''}) no wrapper "
            f"reduces, so every rank would step its own copy; freeze them "
            f"(requires_grad_(False)) or build those units without ignoring them")


def _build_on_shards(recipe: OptimizerRecipe, params: list) -> torch.optim.Optimizer:
    """The stage-3 optimizer. FSDP shards each parameter in place, so the caller's optimizer
    (``recipe.instance``) already steps the shards: it is used as built, its groups, settings
    and any scheduler on it unchanged (``fused=None`` is then torch's default loop). Otherwise
    one is built over ``recipe.param_groups`` (default: ``params``, every trainable shard),
    with torch's fused kernel where OSS would choose it for stages 1-2 (same rule,
    :func:`shardkit.optim.local_step.choose_fused`: a torch optimizer that has one, ``fused``
    and ``foreach`` left unset): the same update up to the last bit, so every stage steps
    alike. The param groups then say ``fused=True``. Except SGD with momentum: torch's fused
    SGD fails once some parameters have momentum buffers and others not yet (a unit unused in
    the first step); OSS steps those apart, a plain optimizer cannot, so it keeps torch's
    loop."""
    from shardkit.optim.local_step import choose_fused, fused_first_steps_collide
    if recipe.instance is not None:
        _state_to_row_shards(recipe.instance)
        return recipe.instance
    groups = _as_group_dicts(recipe.param_groups if recipe.param_groups is not None else params)
    defaults = dict(recipe.defaults)
    if (not fused_first_steps_collide(recipe.cls, defaults)
            and choose_fused(recipe.cls, defaults, groups)):
        defaults["fused"] = True
    return recipe.cls(groups, **defaults)


def _state_to_row_shards(optimizer: torch.optim.Optimizer) -> None:
    """State ``optimizer`` held before FSDP sharded its parameters in place (Adagrad's sum
    from its constructor, moments of steps taken before ``initialize``): each tensor shaped
    like its parameter's full tensor becomes this rank's row block of it (zero padded, where
    the shard lives), as FSDP cut the parameter; 0-dim values (step counts) stay. Memory:
    the full-size state is replaced by shards. Local."""
    from shardkit.checkpoint.resharding import shard_rows
    from shardkit.nn.data_parallel.fully_sharded import unit_holding
    for p, state in optimizer.state.items():
        unit = unit_holding(p)
        if unit is None or unit._shard is None:
            continue
        shard = unit._shard
        layout = shard.layouts[next(i for i, q in enumerate(shard.params) if q is p)]
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 \
                    and value.shape == layout.shape:
                state[key] = shard_rows(value, layout, shard.rank).to(p.device)


def _as_group_dicts(params_or_groups) -> list[dict]:
    """Parameters or param-group dicts as group dicts whose ``params`` are lists (torch's
    optimizer accepts either form; the fused-kernel rule reads groups)."""
    items = list(params_or_groups)
    if not all(isinstance(item, dict) for item in items):
        return [{"params": items}]
    return [{**g, "params": [g["params"]] if isinstance(g["params"], torch.Tensor)
             else list(g["params"])} for g in items]


# ----------------------------------------------------------------------------- wrap policy


def repeated_block_classes(model: nn.Module) -> tuple:
    """The transformer blocks of ``model`` found by type: the class repeated most (at least
    twice) among the children of one ``nn.ModuleList``/``nn.Sequential``, weighted by the
    parameters those children hold; ``()`` when no class repeats."""
    best, best_params = (), 0
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict = {}
        for child in container.children():
            by_class.setdefault(type(child), []).append(child)
        for cls, children in by_class.items():
            held = sum(count_params(c.parameters()) for c in children)
            if len(children) >= 2 and held > best_params:
                best, best_params = (cls,), held
    return best


def default_wrap_policy(model: nn.Module) -> Callable:
    """Stage 3's documented default: :func:`block_wrap_policy`, unless a unit it would build
    mixes parameter dtypes (an FSDP unit flattens one dtype: refused), then with each largest
    submodule of one dtype a unit too (:func:`shardkit.nn.wrap.split_dtypes_policy`; an fp64
    head on an fp32 body, bf16 weights beside fp32 adapters under :func:`compose`). A model
    whose units each hold one dtype keeps exactly those units. (``shardkit.initialize`` first
    casts a unit's 16-bit parameters to fp32 where the unit also holds fp32 ones, as PEFT
    models need, so its units stay one per block.) Costs a dry run of the wrapping."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel
    from shardkit.nn.wrap.auto_wrap import planned_units, split_dtypes_policy
    policy = block_wrap_policy(model)
    units = planned_units(model, policy, FullyShardedDataParallel)
    if all(len({p.dtype for p in own}) < 2 for _, own in units):
        return policy
    return split_dtypes_policy(model, policy)


def block_wrap_policy(model: nn.Module) -> Callable:
    """The classes the model names in Hugging Face's ``_no_split_modules``
    (:func:`shardkit.nn.wrap.no_split_modules_policy`); else the transformer blocks found by
    type (:func:`repeated_block_classes`); else FSDP's parameter-count policy
    (:func:`shardkit.nn.wrap.default_auto_wrap_policy`)."""
    from shardkit.nn.wrap import (default_auto_wrap_policy, no_split_modules_policy,
                                  transformer_auto_wrap_policy)
    if any(getattr(m, "_no_split_modules", None) for m in model.modules()):
        try:
            return no_split_modules_policy(model)
        except ValueError:  # declared names of other variants only: fall through
            pass
    blocks = repeated_block_classes(model)
    if blocks:
        return transformer_auto_wrap_policy(set(blocks))
    return default_auto_wrap_policy


# ----------------------------------------------------------------------------- pipeline


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``[batch, seq, vocab]`` logits against ``[batch, seq]`` targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def count_params(params: Iterable[torch.Tensor]) -> int:
    """Elements of the distinct tensors in ``params`` (a tied weight counts once)."""
    seen, total = set(), 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


class Embeddings(nn.Module):
    """A GPT's token + position embedding as one module (the first pipeline layer)."""

    def __init__(self, tok: nn.Embedding, pos: nn.Embedding):
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


def gpt_as_sequential(gpt: GPT) -> nn.Sequential:
    """The GPT as an ``nn.Sequential`` (embeddings, blocks, final norm, head) sharing its
    parameters, so that a pipeline can split it."""
    return nn.Sequential(Embeddings(gpt.tok_emb, gpt.pos_emb), *gpt.blocks, gpt.ln_f, gpt.head)


def balance_by_params(layers, stages: int) -> list[int]:
    """Split ``layers`` into ``stages`` contiguous non-empty runs of about equal parameters."""
    if stages > len(layers):
        raise ValueError(f"a {stages}-stage pipeline needs at least {stages} layers; the model "
                         f"has {len(layers)}")
    sizes = [count_params(layer.parameters()) for layer in layers]
    total, balance, start = sum(sizes), [], 0
    for stage in range(stages):
        stages_after = stages - stage - 1
        end = start + 1
        target = total * (stage + 1) / stages
        while (end < len(layers) - stages_after
               and sum(sizes[:end]) + sizes[end] / 2 <= target):
            end += 1
        if stages_after == 0:
            end = len(layers)
        balance.append(end - start)
        start = end
    return balance


def pipeline_chunks(global_batch: int, stages: int) -> int:
    """Micro-batches per step: the largest divisor of the batch up to twice the stages."""
    return max(c for c in range(1, min(global_batch, 2 * stages) + 1) if global_batch % c == 0)


def compose_pipeline(layers: nn.Sequential, loss_fn: Callable, optimizer: OptimizerRecipe,
                     chunks: int) -> TrainingSetup:
    """A world-size-stage 1F1B pipeline (``shardkit.nn.pipe``) over ``layers``, balanced by
    parameters; every rank trains its own stage with ``optimizer``. ``train_step`` takes the
    whole batch (the first stage reads the inputs, the last the targets). Wire: each boundary's
    activations forward and their gradients back (``shardkit.plan.pipeline_comm_elements``)."""
    from shardkit.nn.pipe import PipelineStage, Schedule1F1B, split_sequential
    rank, stages = distributed.get_rank(), distributed.get_world_size()
    part = split_sequential(layers, balance_by_params(list(layers), stages))[rank]
    schedule = Schedule1F1B(PipelineStage(part, rank, stages), chunks, loss_fn)
    opt = optimizer.build(part.parameters())

    def step(inputs, target):
        opt.zero_grad()
        first = (inputs,) if rank == 0 else ()
        loss = schedule.step(*first, target=target if rank == stages - 1 else None)
        opt.step()
        return None if loss is None else loss.detach()
    return TrainingSetup(part, opt, step, count_params(part.parameters()), data_parallel=False)
