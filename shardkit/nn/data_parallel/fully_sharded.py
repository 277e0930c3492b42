"""FullyShardedDataParallel (ZeRO-3): parameters, gradients and optimizer state sharded.

Usage::

    from shardkit.nn import FullyShardedDataParallel as FSDP, auto_wrap, enable_wrap
    from shardkit.nn.wrap import transformer_auto_wrap_policy

    with enable_wrap(wrapper_cls=FSDP):
        model = FSDP(auto_wrap(GPT(cfg), transformer_auto_wrap_policy({Block})))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)   # sees this rank's shards
    for idx, target in batches:
        loss = model.loss(idx, target); loss.backward()
        model.clip_grad_norm_(1.0); optim.step(); optim.zero_grad()

Each wrapped unit owns the parameters of its module that no inner unit owns. A parameter keeps
its identity and name; its ``.data`` becomes this rank's dim-0 row block (padded to a multiple
of ``N``), so any elementwise torch optimizer, ``FusedAdamW`` and schedulers work unchanged, and
an optimizer built before wrapping trains correctly. The mechanism is in :mod:`.flat_param`.

Per-rank model state (fp32 Adam, Ψ parameters, N ranks): ``16Ψ/N`` + padding, plus the unit
being computed (its gathered parameters) and, with prefetch, the next one; in backward also
the unsharded gradients of at most two units (a unit's reduce-scatter is finished once the next
unit's is issued; three under hybrid sharding, see ``_finish_reduces_in_flight``). Communication per
step per rank: ``3Ψ(N-1)/N`` elements with ``reshard_after_forward=True`` (all-gather in forward,
again in backward, reduce-scatter; the root unit is not re-gathered for backward), ``2Ψ(N-1)/N``
with ``False``; the reduce-scatters add ``(P+2)(N-1)`` elements per unit of P parameter tensors
(use counts, an overflow flag and a tag, see the warning below). Construction checks, with
one small object all-gather per unit (and per replica group), that every rank wraps the same
parameters with the same arguments: a ValueError on every rank otherwise.

An inf or NaN in any rank's gradients of a unit reaches every rank's gradient shard of that
unit, so ``torch.amp.GradScaler`` (which checks only this rank's gradients) skips an overflowing
step on every rank, as :class:`shardkit.optim.ShardedGradScaler` does with one more all-reduce.
Cost: one min/max pass over the local gradients per unit and step, and the flag's element.

A module may run several times before one backward (two views of a batch, a block shared by
several layers): a unit stays gathered until every use has delivered its gradient, then
reduce-scatters once. Units kept gathered by a forward that no backward followed (the root;
every unit with ``reshard_after_forward=False``) are reused by the next forward unless their
shard changed in between (an optimizer step), which the root checks as a forward starts (a
checksum of the kept shards and a one-element all-reduce; nothing when no unit is kept, as after
every backward). Kept or not, a unit's ``module.weight`` outside its forward is the parameter
(``backward(inputs=[model.emb.weight])`` and ``requires_grad_(False)`` reach it, as in one
process), i.e. this rank's row shard, as under torch's FSDP and FairScale: a loss term made
from it between the forward and the backward gets the one-process gradient only when it sums
elementwise terms (``loss + c * model.head.weight.pow(2).sum()``, an L1 or L2 penalty over
``model.parameters()``); any other function of the whole weight (``w.sum() ** 2``, a norm, a
product with a full-shape tensor) reads this rank's rows. Compute such terms inside the root's
forward, where a parent's read is gathered (below). A backward with ``create_graph=True`` (a
gradient penalty: ``torch.autograd.grad(out, x, create_graph=True)``, then a backward through
the penalty) leaves the units it reached gathered for the backward through the graph it built,
which frees them; one that reaches the parameters themselves
(``loss.backward(create_graph=True)``) is refused, as torch's FSDP refuses gradients of
gradients: the reduce-scatter is not differentiable.

The user's hooks see what they see in one process: forward (pre-)hooks on a wrapped module run
with its parameters gathered (as under torch's FSDP), so do full backward pre-hooks on a wrapped
module or on a unit (the unit gathers for backward just before them), and post-accumulate-grad
hooks on the parameters run once the reduced shard is in ``.grad`` (as under FSDP2).
Full backward (post-)hooks (``register_full_backward_hook``) differ from one process: on a
wrapped module they see its parameters gathered (full shapes; measured with torch 2.x, where
they run before the unit frees them), but as views whose ``.grad`` is ``None``; on the FSDP unit
itself they run after the unit freed them and see ``unit.module.weight`` as this rank's row
shard, and ``.grad`` as it was before this backward: the reduced gradient reaches ``.grad``
once the next unit's reduce-scatter has been issued, or at the root's end of backward. Read
gradients after backward or in a post-accumulate-grad hook.
Tensor hooks on a parameter (``p.register_hook(fn)``: gradient masks of pruned weights, logging
hooks) run once per backward on this rank's whole gradient of the parameter (full shape, every
use of the unit summed, compute dtype) before the reduce-scatter, as under torch DDP (the local
gradient, before the all-reduce); a returned tensor replaces the gradient.
A parent reading a unit's parameters in the root's forward without calling the unit
(``F.linear(h, self.embed.weight)``, ``h + self.embed.cls``, ``self.embed.proj.weight``) gets
them gathered, as in one process, and the unit stays gathered until its backward; a module
outside every unit that holds one of a unit's parameters (a weight tied across the unit's
boundary, no FSDP root around both) is refused at the first forward when that forward runs
inside the forward of a plain module holding both (a tie reached from plain code, outside any
module's forward, is not seen). Such a read is a collective (an all-gather of the unit, and
the unit then skips its backward gather): every rank must make it, a read on one rank only
(``if rank == 0: print(self.block.weight.norm())`` in a forward) pairs the collectives of
different units across ranks (gloo aborts the job, or the ranks hang); log such values on
every rank, or after the step inside ``summon_full_params``.
``loss.backward(inputs=params)`` fills the ``.grad`` of exactly those parameters (not those with
a tensor hook of the user's, which autograd would call with ``None``); ``torch.autograd.grad``
over a unit's parameters is refused (they are row shards). ``.to()``/``.half()``/
``.cuda()`` after wrapping that would change the shards' dtype or device raise (cast or move
the module before wrapping; ``compute_dtype`` for low-precision compute). So does the next
forward after a parameter was registered inside a unit after wrapping (an adapter, a bias, a
tie to another unit's parameter): nothing would shard or reduce it, and each rank would train
its own copy (see :meth:`FullyShardedDataParallel._refuse_parameters_registered_after_wrapping`).

``sharding_strategy`` picks FairScale / torch FSDP1's strategies (:mod:`.sharding_strategy`
has each one's groups and spanning-link bytes): ``HYBRID_SHARD`` shards inside a node and
replicates across nodes, all-reducing the gradient shard across them (``2(Ψ/n)(k-1)/k``
elements on inter-node links, n ranks per node, k nodes); ``hpz_partition_size=n`` (DeepSpeed's
hpZ) keeps a node-sized secondary partition after the forward gather so that backward gathers
inside the node (``2Ψ(nk-1)/nk`` on inter-node links instead of ``3Ψ(nk-1)/nk``).

The units' all-gathers and reduce-scatters go through the ``comm`` transport
(:mod:`shardkit.transport`): the process group's own collectives unless another transport is
given (e.g. :class:`~shardkit.shm_transport.SharedMemoryTransport` for ranks on one host).

.. warning:: every method that communicates (forward/backward, ``state_dict``,
   ``load_state_dict``, ``summon_full_params``, ``clip_grad_norm_``,
   ``gather_full_optim_state_dict``), and ``reshard()``, must be called on all ranks of the
   group, in the same order. So every rank's forward must run the same units: a branch that
   skips a whole unit on some ranks only leaves their collectives unmatched. Each unit's
   reduce-scatter carries the unit's tag, so that a reduce-scatter paired with another unit's
   raises on every rank that reaches it, naming the unit (checked on CPU only: on an
   accelerator reading the tag would synchronise with the host once per unit; measured: a
   unit run on one rank of two, after a first step on both, with
   ``reshard_after_forward=False``). A gather paired
   with a reduce-scatter (the default ``reshard_after_forward=True``) makes gloo abort both
   processes ("Is there a distributed collective mismatch in your code?"; measured, where
   before one rank hung and the other trained on); gathers paired with another unit's of the
   same size are not detected (wrong weights until a later mismatch, or a hang); with
   ``SHARDKIT_DEBUG_COLLECTIVES=1`` every rank raises at the first unmatched gather, naming
   the unit and the fix (measured: a size-based policy that made each expert of a Hugging
   Face Switch Transformer a unit). Inside
   a unit, parameters may go unused on some ranks (their gradient there counts as zero, and
   every rank gets its shard of the mean, zeros included, as in one process) or on all
   (their ``.grad`` stays ``None``, as in one process): the reduce-scatter also carries one
   use count per parameter to tell the two apart. Together ``(P+2)(N-1)`` more elements per
   unit and step, P its parameter tensors; under ``quantize_gradients`` they go in a second,
   lossless reduce-scatter of their own (see :meth:`.FlatParamShard.start_reduce`).
   A backward gathers a unit when it
   reaches the unit's outputs: one that reaches a unit freed after its forward only through a
   value the module kept (an MoE layer's ``self.aux_loss`` backpropagated alone) gets its
   gradients, but fails if that path needs the unit's weights (an input gradient through them);
   give such a unit ``reshard_after_forward=False``. Tensors held in the attributes of objects
   in a unit's output (a ``torch.distributions.Normal`` from an actor network) get the unit's
   pre-backward gather like any output tensor; a unit whose output holds an object FSDP
   cannot look into (no ``__dict__``), or such an object holding a view of the gathered
   parameters, stays gathered from its forward until its backward, as with
   ``reshard_after_forward=False`` (``Ψ_u`` more memory meanwhile).

This module holds the unit itself (construction, forward, backward, gradients); its concepts
live beside it: :mod:`.fsdp_unit_modules` (what a unit owns), :mod:`.fsdp_meta_init`,
:mod:`.fsdp_wrap_checks` and :mod:`.fsdp_after_wrap_checks` (refusals at and after wrapping),
:mod:`.fsdp_forward_values`, :mod:`.fsdp_hook_control`, :mod:`.fsdp_reentrant_checkpoints`,
:mod:`.fsdp_summon` (``summon_full_params``), :mod:`.fsdp_comm_hook_checks`,
:mod:`.fsdp_optimizer_checks` and :mod:`.fsdp_state_dict`.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable, Iterator, Optional, Union

import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit.nn.checkpoint.checkpoint_activations import is_recomputing
from shardkit.nn.data_parallel.flat_param import (SWAPPED_TENSOR_ADVICE, FlatParamShard,
                                                  GatheredParamBytes, check_one_dtype,
                                                  gathered_param_bytes,
                                                  refuse_gradients_of_gradients)
from shardkit.nn.data_parallel.fsdp_after_wrap_checks import (
    _TO_EMPTY_AFTER_WRAPPING, _parameter_registered_after_wrapping, _refuse_changing_shards,
    _refuse_external_parameters_of_other_units, _refuse_parameters_held_outside,
    _refusing_shards_as_full_state, _registered_after_wrapping)
from shardkit.nn.data_parallel.fsdp_arguments import (IgnoredStates, check_bool,
                                                      check_compute_device,
                                                      check_divide_factor,
                                                      check_reduce_scatter_group,
                                                      check_same_unit_on_every_rank,
                                                      check_torch_scheduling_options,
                                                      move_to_device_id,
                                                      resolve_cpu_offload,
                                                      resolve_fairscale_options,
                                                      resolve_ignored_states, shard_devices,
                                                      tensor_parallel_mates)
from shardkit.nn.data_parallel.fsdp_comm_hook_checks import (_check_comm_hook_allowed,
                                                             _check_comm_hook_arity,
                                                             _RefusedCommHook)
from shardkit.nn.data_parallel.fsdp_forward_values import (_cast_floating, _copy_what_aliases,
                                                           _map_tensors, _tensors_in_objects,
                                                           _widen_to_fp32)
from shardkit.nn.data_parallel.fsdp_meta_init import _materialize_meta_unit, _outcome
from shardkit.nn.data_parallel.fsdp_optimizer_checks import \
    _watch_optimizer_states_of_whole_params
from shardkit.nn.data_parallel.fsdp_hook_control import _BACKWARD_HOOKS_PAUSED, _eager
from shardkit.nn.data_parallel.fsdp_hook_control import \
    backward_hooks_paused  # noqa: F401 - its old home, imported from here
from shardkit.nn.data_parallel.fsdp_reentrant_checkpoints import (FSDPReentrantCheckpointMixin,
                                                                  _FORWARD_SPAN,
                                                                  _gather_before_recomputations)
from shardkit.nn.data_parallel.fsdp_reentrant_checkpoints import \
    _GatheredWhenRecomputed  # noqa: F401 - so that modules pickled before the split still load
from shardkit.nn.data_parallel.fsdp_state_dict import (FSDPStateDictMixin, add_wrapper_prefix,
                                                       clean_name)
from shardkit.nn.data_parallel.fsdp_state_names import wrapped_name
from shardkit.nn.data_parallel.fsdp_summon import (FSDPSummonMixin, _check_summoned_alike,
                                                   _refuse_backward_while_summoned)
from shardkit.nn.data_parallel.fsdp_unit_modules import (_MANAGED_PARAMS, _UNIT_OF,
                                                         _WRAPPED_MODULES, _cast_unit_buffers,
                                                         _collect_unit_params,
                                                         _holders_inside,
                                                         _ignored_param_places, _inner_units,
                                                         _is_managed, _is_unit,
                                                         _module_name_in, _named_unit_modules,
                                                         _unit_buffers_described,
                                                         _unit_modules)
from shardkit.nn.data_parallel.fsdp_unit_modules import unit_holding  # noqa: F401 - its old home
from shardkit.nn.data_parallel.fsdp_wrap_checks import (
    _check_wrappable, _refuse_batchnorm_with_other_buffer_dtype, _refuse_embedding_max_norm,
    _refuse_other_data_parallel)
from shardkit.nn.data_parallel.mixed_precision import (MixedPrecisionPolicy,
                                                       resolve_mixed_precision,
                                                       torch_full_precision_classes)
from shardkit.nn.data_parallel.sharding_strategy import (ShardingStrategy, check_group_arguments,
                                                         check_quantization,
                                                         groups_of_mesh, resolve_groups,
                                                         resolve_sharding_strategy,
                                                         warn_quantization_without_effect)
from shardkit.nn.data_parallel.sync_batchnorm import (refuse_training_sync_batchnorm,
                                                      sync_batchnorm_layers)
from shardkit.nn.data_parallel.training_state import TrainingState, check_state
from shardkit.nn.wrap import auto_wrap_bn  # noqa: F401 - FairScale's FSDP module has it
from shardkit.quantized_transport import quantized_transport_for
from shardkit.utils.grad_norm import (check_clip_arguments, clip_grad_norm_across_ranks,
                                      count_once_over_tensor_parallel)
from shardkit.utils.nested import tensors_in
from shardkit.utils.wrapped_attributes import attribute_through

__all__ = ["FullyShardedDataParallel", "FSDP", "MixedPrecisionPolicy", "ShardingStrategy",
           "TrainingState", "get_fsdp_instances", "gathered_param_bytes", "GatheredParamBytes"]


# Note: parameters registered after wrapping. A parameter registered on a module inside a unit
# after the unit was built (an adapter or head added to a wrapped model) is not sharded: it
# would train on each rank's own gradient, never reduced, and the ranks' copies drift apart
# silently. torch calls global hooks at every registration of a parameter and of a submodule
# (a module built earlier, its parameters counted then, and attached to a unit later); they
# only count them, so that a root looks through its units' modules again (at its next forward)
# only when some registration happened since its last look.
_REGISTRATIONS = [0]


def _count_registration(module: nn.Module, name: str, value) -> None:
    _REGISTRATIONS[0] += 1


nn.modules.module.register_module_parameter_registration_hook(_count_registration)
nn.modules.module.register_module_module_registration_hook(_count_registration)


def _tensor_set_on_the_unit(wrapped: nn.Module, name: str) -> str:
    """Why a tensor set as ``unit.<name>`` (a parameter of the wrapped module, which reads show
    through the unit) is refused."""
    return (f"FullyShardedDataParallel: setting {name!r} on an FSDP unit to a tensor: it is a "
            f"parameter of the wrapped {type(wrapped).__name__}, which the unit shards and "
            f"gathers, so the unit would go on computing with its own. {SWAPPED_TENSOR_ADVICE}")


@_eager
def _run_pre_forward_first_eagerly(unit: "FullyShardedDataParallel") -> None:
    """:meth:`FullyShardedDataParallel._run_pre_forward_first` from a compiled forward (a
    graph break: Dynamo then traces the wrapped module's call with the hooks in order)."""
    unit._run_pre_forward_first()


class FullyShardedDataParallel(FSDPStateDictMixin, FSDPSummonMixin, FSDPReentrantCheckpointMixin,
                               nn.Module):
    """Shard ``module``'s parameters over ``process_group`` (ZeRO-3); gather them per unit only
    while the unit computes.

    Args:
        module: the module to wrap. Inner FSDP units (built first, e.g. with
            :func:`shardkit.nn.wrap.auto_wrap`) keep their own parameters; this unit owns the rest.
        process_group: group to shard over (default: the world); for ``HYBRID_SHARD`` /
            ``_HYBRID_SHARD_ZERO2`` a pair ``(intra_node, inter_node)`` (shard over the first,
            replicate over the second) or ``None`` for
            :func:`shardkit.distributed.node_groups`; for ``NO_SHARD`` the group to replicate
            over.
        reshard_after_forward: free this unit's gathered parameters after its forward and gather
            again for backward (3Ψ communication, lowest memory); ``False`` keeps them until the
            end of backward (2Ψ communication, one more unit of memory per unit). Unset: what
            ``sharding_strategy`` implies (True for FULL_SHARD).
        sharding_strategy: a :class:`ShardingStrategy` (or its name): ``FULL_SHARD`` (default),
            ``SHARD_GRAD_OP`` (= ``reshard_after_forward=False``), ``NO_SHARD`` (every rank
            keeps the whole unit, gradients all-reduced: DDP's ``2Ψ(N-1)/N``),
            ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2`` (FULL_SHARD / SHARD_GRAD_OP inside the
            shard group, gradient shards all-reduced across the replica group).
        hpz_partition_size: DeepSpeed's hpZ (FULL_SHARD only; 1 = off): after the forward
            gather each rank keeps its rows of a partition over blocks of this many ranks
            of one node (whatever the launcher's numbering, when ``h`` divides the ranks per
            node; else consecutive ranks): ``Ψ_u/h`` per unit, compute dtype, until backward;
            the backward gather runs inside the block (a node when ``h`` is the ranks per
            node).
        device_mesh: instead of ``process_group``, a torch ``DeviceMesh``: 2-D
            ``(replicate, shard)`` for the hybrid strategies, 1-D otherwise.
        mixed_precision: compute in ``compute_dtype`` (default fp16) with fp32 master shards;
            or a :class:`MixedPrecisionPolicy`. Scale fp16 losses with
            :class:`shardkit.optim.ShardedGradScaler` or ``torch.amp.GradScaler``: an overflow
            in any rank's gradients reaches every rank's shard of the unit, so both skip the
            step on every rank.
        fp32_reduce_scatter: reduce-scatter gradients in fp32 under mixed precision.
        flatten_parameters: accepted for FairScale compatibility; communication is always one
            transport operation per unit and direction.
        move_params_to_cpu: keep the shards (and so the optimizer state) in CPU memory, pinned
            when CUDA exists, copying them to the GPU for compute. On a CPU-only machine it
            changes nothing.
        compute_dtype: dtype of gathered parameters and compute; any dtype but fp32 (bf16,
            fp16, fp64) enables mixed precision.
        buffer_dtype: dtype floating-point buffers are kept in (default: ``compute_dtype``).
        comm: the :class:`~shardkit.transport.Transport` for the unit's all-gathers and
            reduce-scatters (default: the process group's own collectives; not in FairScale's
            signature). Inner units built by :func:`~shardkit.nn.wrap.auto_wrap` get it through
            ``enable_wrap(..., comm=...)``.
        quantize_weights: ZeRO++'s qwZ: the forward/backward weight all-gathers move int8
            blocks plus one fp32 scale per 256 elements (about 0.25x the fp32 bytes), dequantized
            into the compute dtype; the master shard stays in its dtype and checkpoints
            (``state_dict``) stay exact.
        quantize_gradients: ZeRO++'s qgZ: the gradient reduce-scatter moves int4 blocks (about
            0.13x the fp32 bytes), summed in fp32; hierarchical (inside the node, then across
            nodes) when torchrun's ``LOCAL_WORLD_SIZE`` says the group spans several nodes.
            Either option wraps ``comm`` (or the default transport) in one shared
            :class:`~shardkit.quantized_transport.QuantizedTransport`; a ``comm`` that already
            is one together with either option is an error, and so is either option with
            ``NO_SHARD`` (it gathers nothing and all-reduces its gradients exactly); a hybrid
            strategy whose shard group has one rank (one rank per node) is in the same case and
            says so with a RuntimeWarning. Under the hybrid strategies the gradient all-reduce
            across the replicas stays exact. Not in
            FairScale's signature; inner units get them through ``enable_wrap`` like the other
            arguments.
        process_group_reduce_scatter, disable_reshard_on_root, move_grads_to_cpu,
        bucket_cap_mb, compute_device, no_broadcast_optim_state, state_dict_device,
        clear_autocast_cache, force_input_to_fp32, verbose, cpu_offload,
        state_dict_on_rank_0_only, gradient_predivide_factor, allow_reset_parameters:
            FairScale's other arguments, with its defaults and meaning, so that its users'
            calls run unchanged; :mod:`.fsdp_arguments` says what each does here (e.g.
            ``disable_reshard_on_root=False`` re-gathers the root for backward, ``Ψ_root(N-1)/N``
            more elements; ``bucket_cap_mb`` is only checked: each unit's gradients are already
            one flat reduce-scatter).
        sync_module_states: first overwrite this unit's parameters and buffers with those of
            rank 0 (of the replicas, then of the shard group), so ranks that built the module
            differently (unseeded initialisation) train one model (torch FSDP's argument; a
            one-time broadcast of the unit by ``comm``, ``Ψ_u(N-1)/N``). Off by default, as in
            FairScale: each rank's rows are then taken from its own copy.
        param_init_fn: for a module built on the ``meta`` device (``with torch.device("meta"):
            model = Model()``, for a model too large for one rank): torch FSDP's argument, a
            ``callable(module)`` that materializes the module it is given. The unit
            materializes its own modules as it is built: those reachable from ``module``
            without entering inner units (which materialized theirs when they were built),
            each that holds a parameter or buffer on ``meta``, parents before children
            (breadth-first). With ``param_init_fn`` it is called on each such module, with
            grad off; then, parents first, on each module above one it left on ``meta`` with
            no inner unit below it, and again on each module below that such a call replaced
            tensors of (a recursive ``to_empty``). So a function that materializes and
            initialises the whole model when given its root and leaves the modules below
            alone when given them works as under torch FSDP1 (which calls it on every module
            of the unit, parents first); one that initialises a module both from its parent
            and on its own keeps the module's own values here (children run first), the
            parent's under torch. No tensor may stay on ``meta`` (a ValueError naming it
            otherwise). Without it (``None``), each such module's meta
            tensors get storage on the unit's compute device (``compute_device``, else the
            device of the model's other tensors, else the current CUDA device, else the CPU)
            and its ``reset_parameters()`` runs; a module without one is a ValueError naming
            it and its tensors (torch raises an AttributeError there). Unlike torch's
            ``to_empty``, materializing keeps each ``Parameter`` object (an optimizer built
            over the meta model steps the shards) and a parameter shared by several modules
            stays one parameter (a ``param_init_fn`` that replaced it in each holder gets the
            last holder's tensor in all of them). Then the unit shards as usual; with
            ``sync_module_states=True`` every rank takes rank 0's values. Memory: one unit's
            full parameters at a time beside the shards already made, when units are built
            innermost first (:func:`~shardkit.nn.wrap.auto_wrap`). The initial values differ
            from an eagerly built model's under the same seed (as under torch's FSDP): the
            random draws happen unit by unit, innermost first, each module's
            ``reset_parameters()`` once more after its constructor's draws were skipped, and
            a tied parameter is initialised by its last holder. Start the comparison from
            the wrapped model's ``state_dict()``, not from an eager copy. Materializing after
            wrapping (FSDP2's ``model.to_empty(device=...)``) is refused: pass the meta module
            to FSDP instead. Local, no communication.
        auto_wrap_policy, device_id: torch FSDP1's. ``auto_wrap_policy`` first wraps every
            submodule the policy selects in a unit of its own, with this call's other
            arguments (:func:`~shardkit.nn.wrap.auto_wrap.wrap_below_root`; the root is this
            unit whatever the policy says of it). ``device_id`` moves a module on the CPU to
            that device before sharding (a module on another accelerator is a ValueError).
            ``cpu_offload`` also takes torch's ``CPUOffload(offload_params=...)``.
            A unit computing on the CPU that holds a ``torch.nn.SyncBatchNorm`` in training
            mode is a ValueError naming it (torch's SyncBatchNorm trains on CUDA/XPU tensors
            only); one in eval mode is accepted (torch runs a plain batch norm), and refused
            at the root's forward, before any gather, if it is training by then.
        use_orig_params, forward_prefetch, backward_prefetch, limit_all_gathers: torch
            FSDP1's, checked and accepted (:func:`.fsdp_arguments.check_torch_scheduling_options`):
            the parameters are always the module's own (torch's ``use_orig_params=True``),
            and the units prefetch one unit ahead whatever the others say;
            ``summon_full_params(with_grads=True)`` needs ``use_orig_params=True``, as in
            torch.

        ignored_modules, ignored_states: torch FSDP1's (one of the two; ``ignored_states``
            takes modules or parameters): the modules given and everything inside them, and
            the parameters given, are left alone (:func:`.fsdp_arguments.resolve_ignored_states`
            checks them): not sharded, gathered or reduced, so each rank keeps its own full
            tensors and its local gradients (freeze them, or synchronise them yourself, e.g. an
            all-reduce after backward); they are ordinary tensors in ``parameters()`` and every
            state dict type (FULL, SHARDED, LOCAL, the optimizer's), and ``load_state_dict``
            loads them. ``auto_wrap_policy`` wraps nothing inside them and does not count
            their parameters; inner units it builds get the same argument. Their buffers are
            not cast by ``buffer_dtype``; ``sync_module_states`` broadcasts their buffers but
            not their parameters (as torch). ``clip_grad_norm_`` adds this rank's norm of their
            gradients to the shards' reduced norm and clips them too (torch FSDP1's formula:
            ranks whose ignored gradients differ get different norms). Ranks may ignore
            different modules (each its own experts) as long as what the units shard agrees.

    FairScale's attributes hold the resolved values: ``compute_dtype``, ``buffer_dtype``,
    ``fp32_reduce_scatter`` and ``compute_device`` as well as the other arguments' names
    (``mixed_precision`` is a bool; the whole policy is ``mixed_precision_policy``).
    ``training_state`` is the unit's :class:`TrainingState` (FairScale's), checked with
    :meth:`assert_state`.

    Hooks: forward (pre-)hooks and full backward pre-hooks see the gathered parameters, as in
    one process; full backward hooks do not (shards on the unit, ``.grad`` not yet reduced:
    see the module docstring).

    Memory: ``Ψ_u/N`` + padding of master weights per unit, grads and optimizer state likewise;
    the gathered unit (``Ψ_u`` in compute dtype) only around its forward/backward.
    Communication: see the module docstring.
    """

    def __init__(self, module: nn.Module, process_group=None,
                 reshard_after_forward: Optional[bool] = None,
                 mixed_precision: Union[bool, MixedPrecisionPolicy] = False,
                 fp32_reduce_scatter: bool = False, flatten_parameters: bool = True,
                 move_params_to_cpu: bool = False, compute_dtype: Optional[torch.dtype] = None,
                 buffer_dtype: Optional[torch.dtype] = None, comm=None,
                 sharding_strategy: Union[ShardingStrategy, str, None] = None,
                 hpz_partition_size: int = 1, device_mesh=None,
                 quantize_weights: bool = False, quantize_gradients: bool = False,
                 process_group_reduce_scatter=None, disable_reshard_on_root: bool = True,
                 move_grads_to_cpu: Optional[bool] = None, bucket_cap_mb: float = 25,
                 compute_device=None, no_broadcast_optim_state: bool = False,
                 state_dict_device=None, clear_autocast_cache: bool = False,
                 force_input_to_fp32: bool = False, verbose: bool = False,
                 cpu_offload: bool = False, state_dict_on_rank_0_only: bool = False,
                 gradient_predivide_factor: Optional[float] = None,
                 allow_reset_parameters: bool = False, sync_module_states: bool = False,
                 param_init_fn=None, auto_wrap_policy=None, device_id=None,
                 use_orig_params: bool = False, forward_prefetch: bool = False,
                 backward_prefetch=None, limit_all_gathers: bool = True,
                 ignored_modules=None, ignored_states=None):
        # locals() here are exactly this call's arguments (nothing else is bound yet)
        same = {k: v for k, v in locals().items()
                if k not in ("self", "module", "auto_wrap_policy", "__class__")}
        _check_wrappable(module)
        ignored = resolve_ignored_states(module, ignored_modules, ignored_states,
                                         is_unit=_is_unit, is_wrapped=_WRAPPED_MODULES.__contains__,
                                         is_sharded=_is_managed)
        _refuse_other_data_parallel(module, ignored)
        if ignored_states is not None or ignored_modules is not None:  # for the inner units
            key = "ignored_states" if ignored_states is not None else "ignored_modules"
            same[key] = list(ignored.modules) if ignored.modules else list(ignored.params)
        check_torch_scheduling_options(use_orig_params, forward_prefetch, backward_prefetch,
                                       limit_all_gathers)
        move_to_device_id(device_id, module)
        if auto_wrap_policy is not None:  # torch FSDP1: wrap the selected submodules first
            from shardkit.nn.wrap.auto_wrap import wrap_below_root
            module = wrap_below_root(  # it leaves the ignored modules and parameters out
                module, auto_wrap_policy, type(self),
                full_precision_classes=torch_full_precision_classes(mixed_precision), **same)
        if param_init_fn is not None and not callable(param_init_fn):
            raise ValueError(f"FullyShardedDataParallel(param_init_fn={param_init_fn!r}): "
                             f"must be a callable(module) that materializes a module built on "
                             f"the meta device, or None (reset_parameters() of each such "
                             f"module)")
        transport = quantized_transport_for(comm, quantize_weights, quantize_gradients)
        if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
            raise ValueError(f"FullyShardedDataParallel(reshard_after_forward="
                             f"{reshard_after_forward!r}): must be True or False (or None: what "
                             f"sharding_strategy implies)")
        strategy, reshard_after_forward = resolve_sharding_strategy(sharding_strategy,
                                                                    reshard_after_forward)
        check_quantization(strategy, quantize_weights, quantize_gradients, comm)
        for name, value in (("flatten_parameters", flatten_parameters),
                            ("move_params_to_cpu", move_params_to_cpu),
                            ("fp32_reduce_scatter", fp32_reduce_scatter),
                            ("sync_module_states", sync_module_states)):
            check_bool(name, value)
        move_params_to_cpu = resolve_cpu_offload(move_params_to_cpu, cpu_offload)
        # a rank that cannot materialize (say rank 1 built on meta without param_init_fn,
        # rank 0 built for real) tells every rank at the unit's first collective below,
        # instead of leaving the others waiting in it
        meta_error: Optional[Exception] = None
        try:
            _materialize_meta_unit(module, param_init_fn, compute_device, ignored)
        except Exception as error:  # param_init_fn is the user's code
            meta_error = error
        # the unit's own: an ignored parameter (another dtype, another device) says nothing
        first_param = next((p for p in module.parameters() if not ignored.has_param(p)), None)
        module_device = torch.device("cpu") if first_param is None else first_param.device
        options = resolve_fairscale_options(
            move_params_to_cpu=move_params_to_cpu, module_device=module_device,
            disable_reshard_on_root=disable_reshard_on_root, move_grads_to_cpu=move_grads_to_cpu,
            bucket_cap_mb=bucket_cap_mb, no_broadcast_optim_state=no_broadcast_optim_state,
            state_dict_device=state_dict_device, clear_autocast_cache=clear_autocast_cache,
            force_input_to_fp32=force_input_to_fp32, verbose=verbose,
            state_dict_on_rank_0_only=state_dict_on_rank_0_only,
            gradient_predivide_factor=gradient_predivide_factor,
            allow_reset_parameters=allow_reset_parameters)
        skdist.require_initialized("FullyShardedDataParallel")
        skdist.check_group(process_group, "FullyShardedDataParallel", "process_group",
                           pair_ok=True)
        skdist.check_member(process_group, "FullyShardedDataParallel", "process_group")
        policy = resolve_mixed_precision(mixed_precision, compute_dtype, buffer_dtype,
                                         fp32_reduce_scatter)
        _refuse_batchnorm_with_other_buffer_dtype(module, policy, ignored)
        _refuse_embedding_max_norm(module, ignored)
        refuse_training_sync_batchnorm(_named_unit_modules(module, ignored),
                                       "FullyShardedDataParallel",
                                       shard_devices(module_device, move_params_to_cpu)[0])
        if device_mesh is not None:
            if process_group is not None:
                raise ValueError("FullyShardedDataParallel: pass process_group or device_mesh, "
                                 "not both")
            process_group = groups_of_mesh(device_mesh, strategy)
        check_group_arguments(strategy, process_group, hpz_partition_size)
        params, locations = _collect_unit_params(module, ignored)
        check_one_dtype(params, locations)
        # before resolve_groups, whose sub-groups (hybrid, hpZ, NO_SHARD) are collectives that
        # ranks with other strategies would not join
        given_groups = list(process_group) if isinstance(process_group, tuple) \
            else [process_group]
        mates, mixed_slices = tensor_parallel_mates(given_groups, params)
        try:
            check_same_unit_on_every_rank(
                given_groups, module, params, meta_materialization=_outcome(meta_error),
                tensor_parallel_ranks_in_group=mates,
                sharding_strategy=strategy.name,
                reshard_after_forward=reshard_after_forward, mixed_precision=policy,
                hpz_partition_size=hpz_partition_size, quantize_weights=quantize_weights,
                quantize_gradients=quantize_gradients, comm=type(transport).__name__,
                sync_module_states=sync_module_states,
                **({} if device_mesh is None else {"device_mesh": device_mesh.mesh.tolist()}),
                broadcast_buffers=_unit_buffers_described(module)
                if sync_module_states else [])
        except ValueError:  # the others name it; the rank that failed raises its own error
            if meta_error is None:
                raise
        if meta_error is not None:
            raise meta_error
        if mixed_slices is not None:  # agreed above: every rank of the groups raises it
            raise ValueError(mixed_slices)
        groups = resolve_groups(strategy, process_group, hpz_partition_size)
        warn_quantization_without_effect(strategy, groups.shard, transport, quantize_weights,
                                         quantize_gradients)
        reduce_group = check_reduce_scatter_group(process_group_reduce_scatter, groups.shard,
                                                  strategy)
        unit_compute_device = shard_devices(module_device, move_params_to_cpu)[0]
        if first_param is not None:
            check_compute_device(compute_device, unit_compute_device)
        super().__init__()
        self._fsdp_wrapped_module = module
        # torch FSDP1's attribute names: what this unit and the units inside it leave alone
        self._ignored_modules = set(ignored.modules).union(
            *(u._ignored_modules for u in _inner_units(module)))
        self._ignored_params = set(ignored.params).union(
            *(u._ignored_params for u in _inner_units(module)))
        # (module, name) where this unit found an ignored parameter (ignored_states): the
        # user's place, which may be given another parameter after wrapping
        self._ignored_param_places = _ignored_param_places(module, ignored)
        self.sharding_strategy = strategy
        self.process_group = groups.shard  # what the shards are cut over
        self.replicate_group = groups.replicate
        self.hpz_partition_size = hpz_partition_size
        self.world_size = skdist.get_world_size(groups.shard)
        self.rank = skdist.get_rank(groups.shard)
        self.reshard_after_forward = reshard_after_forward
        self.mixed_precision = policy.enabled  # a bool, as in FairScale
        self.mixed_precision_policy = policy
        master_dtype = torch.float32 if first_param is None else first_param.dtype
        self._set_fairscale_dtypes(policy, master_dtype, unit_compute_device)
        self.move_params_to_cpu = move_params_to_cpu
        self.flatten_parameters = flatten_parameters
        self.comm = transport
        self.quantize_weights = quantize_weights
        self.quantize_gradients = quantize_gradients
        self._set_fairscale_options(options, reduce_group)
        transport.prepare(groups.shard)
        separate_reduce = reduce_group if reduce_group is not groups.shard else None
        for group in (groups.replicate, groups.hpz, separate_reduce):
            if group is not None:
                transport.prepare(group)
        if sync_module_states:
            _sync_unit_states(module, params, groups, transport)
        self._buffer_dtypes = _cast_unit_buffers(module, policy.buffer_cast_dtype(), ignored)
        self._shard: Optional[FlatParamShard] = None
        if params:
            self._shard = _build_shard(params, locations, groups, policy,
                                       move_params_to_cpu, self._on_grad_ready, transport,
                                       reduce_group)
            self._shard.set_divide_factors(self.gradient_predivide_factor,
                                           self.gradient_postdivide_factor)
            _MANAGED_PARAMS.update((id(p), weakref.ref(p)) for p in params)
            _UNIT_OF.update((id(p), (weakref.ref(p), weakref.ref(self))) for p in params)
            _watch_optimizer_states_of_whole_params()
        _WRAPPED_MODULES.add(module)
        _mark_fsdp_managed(module)
        if self._shard is not None:
            _gather_before_recomputations(self, _unit_modules(module, ignored))
        module.register_state_dict_pre_hook(_refusing_shards_as_full_state(self))
        self._register_load_state_dict_pre_hook(add_wrapper_prefix)
        # ids of the wrapped module's children holding some of this unit's parameters (their
        # reads through the unit in the root's forward gather it: _read_in_the_roots_forward)
        own = {id(p) for p in params}
        self._children_holding_params = {
            id(c) for c in module.children()
            if not _is_unit(c) and any(id(p) in own for p in c.parameters())}
        self._enclosing: Optional[weakref.ref] = None  # the unit built around this one
        for inner in _inner_units(module):
            inner._is_root = False
            if inner._enclosing is None:
                inner._enclosing = weakref.ref(self)
        self._is_root: Optional[bool] = None
        self._root: Optional[FullyShardedDataParallel] = None
        self._require_backward_grad_sync = True
        # root: _REGISTRATIONS when its units' modules were last found to hold only
        # their own parameters (see _refuse_parameters_registered_after_wrapping)
        self._registrations_checked = -1
        self._pre_backward_done = False
        self._pre_backward_task = -1  # the graph task that set _pre_backward_done
        # whether the running backward's own graph reads the parameters a forward exposed
        # (None: not known yet in this backward); see _on_grad_ready
        self._backward_reads_forward_views: Optional[bool] = None
        self._summoned = False  # inside summon_full_params: parameters hold full values
        self._summoned_grads = False  # ... and .grad the full gradients (with_grads=True)
        # torch FSDP1's flag: summon_full_params(with_grads=True) needs it, as in torch
        self._use_orig_params = use_orig_params
        # torch FSDP1's: the communication hook and its state (see register_comm_hook)
        self._comm_hook = None
        self._comm_hook_state = None
        self._gathers_before_hooks_of: set = set()  # ids of modules (see _gather_for_hooks)
        self._regathers_for_recomputations = False  # see _regather_for_later_recomputations
        # the (pre-hook, post-hook) handles this backward put on the unit's own reentrant
        # checkpoints' nodes, by the node's id (see _gather_before_later_checkpoints)
        self._checkpoint_gathers: dict = {}
        self._checkpoint_backwards_running = 0  # of those checkpoints (see _free_after_checkpoint)
        self._free_owed = False
        # ids of those checkpoints' nodes whose backward has not begun yet, and whether the
        # gradients of earlier ones wait for them (see _hold_for_later_checkpoints)
        self._checkpoints_to_run: set = set()
        self._grads_held_for_checkpoints = False
        self._forward_began = 0  # the autograd sequence number as the last forward began
        self.training_state = TrainingState.IDLE
        # root-only iteration state (see "Note: prefetch order")
        self._forward_order: list = []
        self._backward_order: list = []
        self._orders_final = False
        self._final_callback_queued = False
        self._backward_task = -1  # root: the autograd graph task of the running backward
        self._backward_builds_graph = False  # root: the running backward has create_graph=True
        self._replicas_pending: list = []  # root: shards whose replica all-reduce is not issued
        self._reduces_in_flight: list = []  # root: shards whose reduce-scatter is not finished
        # root: units gathered by a read under no_grad in this forward (_read_in_the_roots_forward)
        self._read_without_grad: list = []
        # Note: torch.compile of the wrapped block. The hooks sit on the wrapped module (so
        # that ``root.loss(...)``, reached through ``__getattr__``, still gathers), which puts
        # them inside a compiled ``block.compile()``; Dynamo runs them eagerly, outside the
        # block's graph, instead of tracing collectives into it.
        # Note: the user's own hooks on the wrapped module (a forward hook reading
        # ``module.weight``, torch.nn.utils.prune's pre-hook registered before wrapping) must see
        # the gathered parameters, as they do under torch's FSDP: the gather runs before every
        # pre-hook, and the free after every forward hook (see _run_post_forward_last).
        self._pre_forward_handle = module.register_forward_pre_hook(
            _eager(self._pre_forward), with_kwargs=True, prepend=True)
        self._post_forward_handle = module.register_forward_hook(_eager(self._post_forward))
        for holder in _holders_inside(module, locations):
            holder.register_forward_pre_hook(self._before_a_direct_call, prepend=True)
        if module._backward_pre_hooks:  # the user's, registered before wrapping
            self._gather_before_backward_pre_hooks_of(module)

    def _set_fairscale_dtypes(self, policy: MixedPrecisionPolicy, master: torch.dtype,
                              compute_device: torch.device) -> None:
        """FairScale's read-only attributes of the resolved precision and device:
        ``compute_dtype`` (what the unit gathers and computes in), ``buffer_dtype``,
        ``fp32_reduce_scatter`` (gradients reduced in fp32 under mixed precision) and
        ``compute_device``."""
        self.compute_dtype = policy.compute_dtype(master)
        self.buffer_dtype = policy.buffer_cast_dtype() or (
            master if policy.keep_buffer_dtypes else self.compute_dtype)
        self.fp32_reduce_scatter = policy.enabled and \
            policy.gradient_reduce_dtype(master) == torch.float32
        self.compute_device = compute_device

    def _set_fairscale_options(self, options, reduce_group) -> None:
        """FairScale's attributes of the same names (see :mod:`.fsdp_arguments`)."""
        self.process_group_reduce_scatter = reduce_group
        self.disable_reshard_on_root = options.disable_reshard_on_root
        self.move_grads_to_cpu = options.move_grads_to_cpu
        self.bucket_cap_mb = options.bucket_cap_mb
        self.no_broadcast_optim_state = options.no_broadcast_optim_state
        self.state_dict_device = options.state_dict_device
        self.clear_autocast_cache = options.clear_autocast_cache
        self.force_input_to_fp32 = options.force_input_to_fp32
        self.verbose = options.verbose
        self.state_dict_on_rank_0_only = options.state_dict_on_rank_0_only
        self.allow_reset_parameters = options.allow_reset_parameters
        data_parallel = self.world_size * (1 if self.replicate_group is None
                                           else skdist.get_world_size(self.replicate_group))
        pre = options.gradient_predivide_factor
        self.gradient_predivide_factor = float(data_parallel) if pre is None else pre
        self.gradient_postdivide_factor = data_parallel / self.gradient_predivide_factor

    # ------------------------------------------------------------------ module plumbing

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    @property
    def flatten_parameters(self):
        """FairScale's flag (a bool; a unit is always one flat buffer here). Where the wrapped
        module has a method of this name (torch's RNNs: cuDNN's weight packing, which RNN code
        calls in ``forward``), that call instead, as a no-op: the unit owns its weights'
        storage (views of the gathered buffer) and cuDNN's repacking would move them out."""
        own = getattr(type(self._fsdp_wrapped_module), "flatten_parameters", None)
        if callable(own):
            return _keep_unit_storage
        return self._flatten_parameters_flag

    @flatten_parameters.setter
    def flatten_parameters(self, value: bool) -> None:
        self._flatten_parameters_flag = value

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, torch.Tensor):
            wrapped = self.__dict__.get("_modules", {}).get("_fsdp_wrapped_module")
            if wrapped is not None and name in wrapped._parameters:
                raise RuntimeError(_tensor_set_on_the_unit(wrapped, name))
        super().__setattr__(name, value)

    def __getattr__(self, name: str):
        value = attribute_through(self, name, "_fsdp_wrapped_module")
        shard = self.__dict__.get("_shard")
        if shard is None:
            return value
        if isinstance(value, nn.Parameter) or (isinstance(value, nn.Module) and id(value) in
                                               self.__dict__.get("_children_holding_params", ())):
            return self._read_in_the_roots_forward(name, value)
        if isinstance(value, torch.Tensor) and shard._exposed and not shard.exposed_with_grad \
                and shard.full.requires_grad and torch.is_grad_enabled():
            # exposed by a read under no_grad earlier in this forward: views without history
            return self._read_in_the_roots_forward(name, value)
        return value

    def _read_in_the_roots_forward(self, name: str, value):
        """``unit.weight`` read outside the unit's own forward but inside its root's (a parent's
        tied output projection ``F.linear(h, self.embed.weight)``, a position embedding or
        ``cls_token`` a parent adds), or ``unit.sub`` for a submodule holding some of the
        unit's parameters (``self.embed.proj.weight``): the unit is gathered and exposed as
        if it were computing, so the parent computes with the whole parameter (before, it
        read this rank's row block: a shape error, or, for a parameter of one row, the right
        shape and zero padding rows on every rank but 0; a call ``self.embed.proj(x)`` then
        runs on the gathered weights too). With gradients enabled the view's gradient joins
        the unit's reduce-scatter, and the unit stays gathered until its backward (``Ψ_u``
        more memory meanwhile, as with ``reshard_after_forward=False``); under ``no_grad`` it
        is freed at the end of the root's forward (outputs that are views of it are copied
        first, as a unit's own outputs are). Every other read (between steps: an optimizer's
        parameter list, inspecting the shard) gets the sharded parameter, as before. Reads
        that do not pass through the unit (``unit.module.weight``, a reference to the inner
        module kept before wrapping) are not seen; a module outside every unit holding one
        of its parameters is refused at the first forward
        (:func:`_refuse_parameters_held_outside`). A read in a forward recomputed during
        backward (a reentrant checkpoint of the parent's code) gathers too. A collective: every
        rank must make the same reads (see the module docstring). Communication:
        one all-gather of the unit unless it is gathered already. Local otherwise."""
        root = self._root
        shard = self._shard
        if root is None or self._summoned or root._summoned or torch.compiler.is_compiling():
            return value
        grad = torch.is_grad_enabled()
        # a forward recomputed in backward (a reentrant activation checkpoint around the
        # parent's code) reads it again, with gradients: gathered too, freed at the end of
        # backward at the latest
        recompute = grad and root._final_callback_queued \
            and torch._C._current_graph_task_id() != -1
        if (root.training_state is not TrainingState.FORWARD and not recompute) \
                or (isinstance(value, nn.Parameter)
                    and not any(p is value for p in shard.params)):
            return value
        if not shard.gathered:
            shard.start_gather()
            shard.finish_gather()
        if not shard._exposed or (grad and not shard.exposed_with_grad):
            shard.expose()
        if not grad:
            if not shard.held_for_a_read and all(u is not self for u in root._read_without_grad):
                root._read_without_grad.append(self)  # freed at the end of the root's forward
        elif not shard.held_for_a_read:
            shard.held_for_a_read = True
            shard.remember_source()
            self._kept_for_backward = True
        return getattr(self._fsdp_wrapped_module, name)

    def __getstate__(self):
        # A copy would keep hooks bound to the original unit and fail later with a shape error
        # far from the cause. pickle, torch.save(model) and copy.deepcopy all come here.
        raise TypeError(
            "FullyShardedDataParallel cannot be pickled or copied (pickle, torch.save(model), "
            "copy.deepcopy): its parameters are this rank's shards, tied to process groups and "
            "autograd hooks. Save model.state_dict() (full, loadable at any world size) or "
            "local_state_dict() with local_metadata_dict(), and copy the module before wrapping "
            "it")

    def forward(self, *args, **kwargs):
        """The wrapped module's forward with this unit's full parameters: all-gathers the
        unit's flat shard (``(N-1)/N`` of the unit's bytes on the wire, the full unit in
        memory until the unit's forward ends, or until backward without
        ``reshard_after_forward``) and prefetches the next unit's. A forward that raises
        frees, at the root, every unit it gathered."""
        if torch.compiler.is_compiling():
            # Dynamo cannot resume after a graph break inside a try block (the unit hooks are
            # such breaks): it would run the whole forward eagerly. A compiled forward that
            # raises leaves its units to the next forward to free, as before.
            _run_pre_forward_first_eagerly(self)  # before the call Dynamo traces
            # read past __getattr__, whose look at the unit's state Dynamo would guard: one
            # resumed frame then serves every unit instead of a recompile per unit
            return self.__dict__["_modules"]["_fsdp_wrapped_module"](*args, **kwargs)
        self._run_pre_forward_first()
        try:
            return self._fsdp_wrapped_module(*args, **kwargs)
        except BaseException:
            if self._is_root:
                self._free_units_gathered_by_a_raised_forward()
            raise

    def _free_units_gathered_by_a_raised_forward(self) -> None:
        """Root, when its forward raised (a bad batch, an out-of-memory error the training loop
        catches and skips): free the units that forward gathered and left so (their
        post-forward never ran), at once rather than at the next forward, which may never
        come (the loop moves on to evaluation, or the caller keeps the model for inference
        with another module): otherwise up to two units' full parameters, the root's
        included, stay held. Not inside a backward (a recompute that raised: the backward's
        own recovery handles it) nor inside ``summon_full_params``. Local: a wait for a gather
        every rank issued, no communication."""
        if self._final_callback_queued or self._summoned or \
                torch._C._current_graph_task_id() != -1:
            return
        self._free_units_left_by_an_unfinished_forward()
        self.training_state = TrainingState.IDLE

    def __getitem__(self, key):
        """Indexing reaches the wrapped module (``FSDP(nn.Sequential(...))[0]``, ``[-1]``,
        ``[1:]``), as in FairScale and torch FSDP1; a ``TypeError`` when that module is not
        subscriptable. Local."""
        module = self._fsdp_wrapped_module
        if not hasattr(type(module), "__getitem__"):
            raise TypeError(f"'{type(self).__name__}' object is not subscriptable: indexing "
                            f"reaches the wrapped module (an nn.Sequential, nn.ModuleList, ...), "
                            f"and {type(module).__name__} is not subscriptable")
        return module[key]

    def __iter__(self):
        """Iterating reaches the wrapped module (``for layer in FSDP(nn.Sequential(...))``,
        ``"key" in FSDP(nn.ModuleDict(...))``); a ``TypeError`` when it is not iterable."""
        module = self._fsdp_wrapped_module
        if not hasattr(type(module), "__iter__"):
            raise TypeError(f"'{type(self).__name__}' object is not iterable: iteration reaches "
                            f"the wrapped module, and {type(module).__name__} is not iterable")
        return iter(module)

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (behind ``.to()``, ``.half()``, ``.cuda()``, ``.float()``),
        refused with a clear error, before anything changes, when it would change the dtype or
        device of a unit's shards: the flat shard, its gathers and the optimizer state keep
        what the module had when wrapped, so such a change would be undone at the next gather
        while the buffers kept it. A call that changes nothing (``.to("cpu")`` on CPU,
        ``.float()`` on fp32) passes. ``to_empty`` (FSDP2's way to materialize a meta model
        after wrapping), here or from a module around this one, is refused too: it would
        replace the shards with uninitialised memory. Local, no communication."""
        if getattr(fn, "__qualname__", "").startswith("Module.to_empty."):
            raise RuntimeError(_TO_EMPTY_AFTER_WRAPPING)
        for unit in self.sharded_units():
            if unit._shard is not None:
                _refuse_changing_shards(unit._shard, fn)
        return super()._apply(fn, recurse)

    def to_empty(self, *, device, recurse: bool = True) -> "FullyShardedDataParallel":
        """Refused (``RuntimeError``, nothing changed): a unit materializes a module built on
        the meta device when it is wrapped (``param_init_fn``), so its shards already hold
        initialised values, which ``to_empty`` would replace with uninitialised memory."""
        raise RuntimeError(_TO_EMPTY_AFTER_WRAPPING)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The original parameter names (no wrapper prefixes); values are this rank's shards."""
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            yield clean_name(name), p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The buffers under their original names (no wrapper prefixes); buffers are not
        sharded, so each is the whole buffer."""
        for name, b in super().named_buffers(prefix, recurse, remove_duplicate):
            yield clean_name(name), b

    def get_buffer(self, target: str) -> torch.Tensor:
        """The buffer ``target`` names, by the name :meth:`named_buffers` gives (no wrapper
        levels) or by its module path (``nn.Module``'s lookup alone stops at a unit, whose own
        ``_buffers`` do not hold its module's buffers). Local: one walk over the buffers'
        names, no communication, no copy."""
        return super().get_buffer(wrapped_name(target, super().named_buffers))

    def sharded_units(self) -> list["FullyShardedDataParallel"]:
        """This unit and every FSDP unit nested in it, outermost first."""
        return [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]

    @staticmethod
    def fsdp_modules(module: nn.Module,
                     root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """torch FSDP1's: the FSDP units in ``module`` (``module`` itself included), in
        ``module.modules()`` order; with ``root_only``, only those inside no other unit (the
        roots of their trees). Local."""
        units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not root_only:
            return units
        inner = {id(u) for unit in units for u in unit.sharded_units() if u is not unit}
        return [u for u in units if id(u) not in inner]

    def check_is_root(self) -> bool:
        """torch FSDP1's: whether this unit is the root of its tree, the outermost unit, whose
        forward runs the others (torch decides it at the first forward; here the wrapping
        does). Local."""
        return self._outermost() is self

    @property
    def padded_numel(self) -> int:
        """Elements this unit all-gathers (and reduce-scatters) per collective: ``N x shard``."""
        return self._shard.padded_numel if self._shard is not None else 0

    @property
    def local_numel(self) -> int:
        """Unpadded parameter elements of this unit held by this rank (what it sends per
        gather to each peer on CPU)."""
        return self._shard.local_numel if self._shard is not None else 0

    @property
    def unit_numel(self) -> int:
        """Parameters owned by this unit (unpadded)."""
        return sum(self._shard.numels) if self._shard is not None else 0

    def _comm_device(self) -> torch.device:
        """Where this tree's small collectives run (the compute device: NCCL needs CUDA)."""
        for unit in self.sharded_units():
            if unit._shard is not None:
                return unit._shard.compute_device
        return torch.device("cpu")

    @staticmethod
    def gathered_param_bytes() -> GatheredParamBytes:
        """Process-wide counter of gathered parameter bytes (``.live``, ``.peak``)."""
        return gathered_param_bytes()

    def model_state_tensors(self):
        """Gathered parameters and unsharded gradients held outside ``parameters()``."""
        if self._shard is not None:
            yield from self._shard.model_state_tensors()

    @property
    def cpu_offload(self) -> bool:
        """FairScale's name: whether the shards are kept on the CPU (``move_params_to_cpu``)."""
        return self.move_params_to_cpu

    @property
    def params(self) -> list[nn.Parameter]:
        """FairScale's attribute: the parameters this unit shards itself (not those of nested
        units), each holding this rank's rows. Empty for a unit with none of its own. No
        communication; a new list of the same parameter objects, no tensor copied."""
        return [] if self._shard is None else list(self._shard.params)

    @property
    def params_with_grad(self) -> list[nn.Parameter]:
        """This rank's shards that hold a gradient (FairScale's property)."""
        return [p for p in self.parameters() if p.grad is not None]

    def extra_repr(self) -> str:
        text = (f"sharding_strategy={self.sharding_strategy.name}, "
                f"world_size={self.world_size}, reshard_after_forward="
                f"{self.reshard_after_forward}, unit_numel={self.unit_numel}, "
                f"mixed_precision={self.mixed_precision_policy}")
        if self.verbose:
            text += (f", rank={self.rank}, padded_numel={self.padded_numel}, "
                     f"move_params_to_cpu={self.move_params_to_cpu}, move_grads_to_cpu="
                     f"{self.move_grads_to_cpu}, disable_reshard_on_root="
                     f"{self.disable_reshard_on_root}, transport={self.comm.describe()}, "
                     f"gradient_predivide_factor={self.gradient_predivide_factor}, "
                     f"gradient_postdivide_factor={self.gradient_postdivide_factor}, "
                     f"force_input_to_fp32={self.force_input_to_fp32}, clear_autocast_cache="
                     f"{self.clear_autocast_cache}, state_dict_device={self.state_dict_device}, "
                     f"state_dict_on_rank_0_only={self.state_dict_on_rank_0_only}, "
                     f"quantize_weights={self.quantize_weights}, quantize_gradients="
                     f"{self.quantize_gradients}")
        return text

    # ------------------------------------------------------------------ forward

    def _lazy_init_root(self) -> None:
        if self._is_root is not None:
            return
        _refuse_parameters_held_outside(self)  # before anything is set: raised at each forward
        _refuse_external_parameters_of_other_units(self)
        self._is_root = True
        for unit in self.sharded_units():
            object.__setattr__(unit, "_root", self)  # not a submodule: no cycle in the tree
            if unit is not self:
                unit._is_root = False
        self._label_units()
        self._mark_units_in_their_own_world()

    def _label_units(self) -> None:
        """Give each unit's shard a tag (1 to its ``tag_count()``, up to 4096, by position in
        the model, alike on every rank; 0 where no tag fits) and a name, which its
        reduce-scatter carries to check that every rank reduced the same unit
        (:meth:`.FlatParamShard._check_every_rank_reduced_this`). Local."""
        units = [(name, m) for name, m in self.named_modules()
                 if isinstance(m, FullyShardedDataParallel)]
        for position, (name, unit) in enumerate(units):
            if unit._shard is not None:
                described = f"{clean_name(name) or '(the root)'} ({type(unit.module).__name__})"
                tags = unit._shard.tag_count()
                unit._shard.label = (position % tags + 1 if tags > 1 else 0, described)

    def _reset_lazy_init(self) -> None:
        """Forget which unit is the root and the recorded gather order; the next forward
        finds them again (FairScale's private method, which its users' code calls after
        loading a checkpoint). Call it on the outermost unit, between steps. Local."""
        if self._is_root is False:
            raise RuntimeError("_reset_lazy_init() was called on an inner "
                               "FullyShardedDataParallel unit; call it on the root (outermost) "
                               "instance, which resets every unit")
        self._check_idle("_reset_lazy_init")
        units = self.sharded_units()
        for unit in units:
            object.__setattr__(unit, "_root", None)
            unit._is_root = False
        self._is_root = None
        self._forward_order, self._backward_order = [], []
        self._orders_final = False

    def _outermost(self) -> "FullyShardedDataParallel":
        """The unit built around all the others that contain this one (the root to be)."""
        unit = self
        while unit._enclosing is not None and unit._enclosing() is not None:
            unit = unit._enclosing()
        return unit

    def _pre_forward(self, module, args, kwargs):
        if self._root is None:  # the first forward, possibly an inner unit called directly
            self._outermost()._lazy_init_root()
        root = self._root
        if root is None:
            raise RuntimeError("FullyShardedDataParallel: an inner unit ran forward without its "
                               "root; call the outermost FSDP instance, not the inner one")
        self._run_post_forward_last(module)
        if self.mixed_precision_policy.enabled and (self._summoned or root._summoned):
            _check_summoned_alike(root)
        if self._summoned:  # inside summon_full_params: compute with the summoned fp32 values
            return args, kwargs
        if self._shard is not None and self._shard.gathered:  # kept: no gather checks them
            self._shard.refuse_parameters_no_longer_registered()
        root._recover_from_a_failed_backward()
        in_backward = root._final_callback_queued  # a recompute (activation checkpointing)
        if not in_backward:
            self._forward_began = torch._C._autograd._get_sequence_nr()
        if self is root and not in_backward:
            root._refuse_parameters_registered_after_wrapping()
        if not in_backward:
            self.training_state = TrainingState.FORWARD
        if self is root and not in_backward:
            refuse_training_sync_batchnorm(sync_batchnorm_layers(self, self),
                                           "FullyShardedDataParallel", self._comm_device())
            root._free_units_left_by_an_unfinished_forward()
            root._drop_stale_kept_units()
            root._gather_before_users_backward_pre_hooks()
        if not root._orders_final and self not in root._forward_order:
            root._forward_order.append(self)
        self._pre_backward_done = False
        # a recompute prefetches the unit backward reaches next, not the one that followed in
        # forward (backward is done with that one: it would be gathered for nothing)
        self._gather_with_next(root._backward_order if in_backward else root._forward_order,
                               backward=in_backward)
        policy = self.mixed_precision_policy
        if policy.enabled and policy.cast_inputs:
            dtype = policy.param_dtype
            args, kwargs = _map_tensors(lambda t: _cast_floating(t, dtype), (args, kwargs))
        elif self.force_input_to_fp32 and not policy.enabled:
            args, kwargs = _map_tensors(_widen_to_fp32, (args, kwargs))
        return args, kwargs

    def _refuse_parameters_registered_after_wrapping(self) -> None:
        """Root, as a forward starts (before any collective): a ``RuntimeError`` when a module
        inside one of its units holds a parameter that the unit did not find there when it was
        built: one registered after wrapping (``block.adapter = nn.Parameter(...)``, a bias
        set on a layer built without one), which nothing would shard or reduce, so each rank
        would train its own copy; or a unit's parameter registered at a new place (a tie made
        after wrapping), which would read this rank's rows there. Parameters of ignored
        modules (``ignored_modules`` / ``ignored_states``) are the user's and pass. Every rank
        makes the same registrations, so every rank raises. Cost: nothing unless some
        parameter or submodule was registered (anywhere in the process) since the last
        forward, then one walk over the units' modules."""
        if self._registrations_checked == _REGISTRATIONS[0]:
            return
        for unit in self.sharded_units():
            found = _parameter_registered_after_wrapping(unit)
            if found is not None:
                raise RuntimeError(_registered_after_wrapping(self, unit, *found))
        self._registrations_checked = _REGISTRATIONS[0]

    def _run_pre_forward_first(self) -> None:
        """Move the unit's pre-forward hook (the gather) before the pre-hooks registered on the
        wrapped module with ``prepend=True`` after it, so that those see the gathered
        parameters too, as under FairScale's and torch FSDP1's wrappers, which gather before
        calling the module."""
        hooks = self._fsdp_wrapped_module._forward_pre_hooks
        hook_id = self._pre_forward_handle.id
        if hook_id in hooks and next(iter(hooks)) != hook_id:
            hooks.move_to_end(hook_id, last=False)

    def _run_post_forward_last(self, module: nn.Module) -> None:
        """Move the unit's post-forward hook behind the forward hooks registered after it, so
        that those still see the gathered parameters (torch runs forward hooks in order)."""
        hooks = module._forward_hooks
        hook_id = self._post_forward_handle.id
        if hook_id in hooks and next(reversed(hooks)) != hook_id:
            hooks.move_to_end(hook_id)

    def _post_forward(self, module, args, output):
        grad_enabled = torch.is_grad_enabled()
        if self._summoned:
            if grad_enabled:
                for t in tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(_refuse_backward_while_summoned)
            return output
        hidden, opaque = _tensors_in_objects(output) if grad_enabled and \
            self._shard is not None else ([], False)
        # an object FSDP cannot look into, or one holding a view of the gathered parameters
        # (freed after forward), or a parent's read of its parameters (see
        # _read_in_the_roots_forward), keeps the unit gathered until its backward
        held_for_a_read = self._shard is not None and self._shard.held_for_a_read
        keep_for_backward = grad_enabled and (
            self._stays_gathered_for_backward() or opaque or held_for_a_read or (
                bool(hidden) and self._shard.gathered and any(
                    t.untyped_storage().data_ptr()
                    == self._shard.full.untyped_storage().data_ptr()
                    for t in hidden if t.layout == torch.strided and not t.is_nested)))
        if self._shard is not None:
            # also when kept gathered (the root, reshard_after_forward=False): the end of
            # backward, or the next forward after a step, frees ``full`` while the caller may
            # still hold the output (read after backward: a segfault)
            output = _copy_what_aliases(output, self._shard, module)
        if self._is_root and self._read_without_grad:
            output = self._free_units_read_without_grad(output)
        if self._shard is not None and not keep_for_backward:
            self._shard.free_full(keep_secondary=grad_enabled)
        elif self._shard is not None:
            self._shard.remember_source()
            self._kept_for_backward = grad_enabled
            # gathered, but ``module.weight`` reads the parameter again, as in one process: a
            # view left there caught what the user did with it before the backward or the
            # next forward (``backward(inputs=[model.emb.weight])`` filled the view's .grad,
            # not the parameter's; a ``requires_grad_(False)`` after a forward without
            # backward raised, as the view is no leaf). The graph holds its own views;
            # the next forward, backward or read in the root's forward exposes them again.
            self._shard.hide()
        if self.clear_autocast_cache:
            torch.clear_autocast_cache()
        if self.training_state is TrainingState.FORWARD:
            self.training_state = TrainingState.IDLE
        if grad_enabled:
            span = self._forward_span()
            for t in [*tensors_in(output), *hidden]:
                if t.requires_grad:
                    if span is not None and t.grad_fn is not None:
                        t.grad_fn.metadata[(_FORWARD_SPAN, id(self))] = span
                    t.register_hook(_eager(self._pre_backward_hook))
                    # an output that is a view, then changed in place by the caller (HF
                    # Wav2Vec2's hidden_states[~mask] = 0), sends its gradient to its base
                    # through CopySlices: the view's own hook never runs, the base's does. Not
                    # on a leaf base (a parameter's slice): its hooks would outlive the graph
                    if t._base is not None and t._base.grad_fn is not None:
                        t._base.register_hook(_eager(self._pre_backward_hook))
        return output

    def _free_units_read_without_grad(self, output):
        """Root, at the end of its forward: free the units that a read under ``no_grad``
        gathered (:meth:`_read_in_the_roots_forward`), unless a read with gradients since
        keeps them for backward; ``output`` with its views of them copied. Local."""
        read, self._read_without_grad = self._read_without_grad, []
        for unit in read:
            if unit._shard.gathered and not unit._shard.held_for_a_read:
                output = _copy_what_aliases(output, unit._shard, unit.module)
                unit._shard.free_full()
        return output

    def _before_a_direct_call(self, module, args) -> None:
        """A submodule holding this unit's parameters is about to run. Inside the unit's own
        forward (or a backward, or ``summon_full_params``) nothing is done. Outside it, the
        code calls that submodule directly (HF ``generate()`` on an encoder-decoder runs
        ``model.get_encoder()``, which reads the root's shared embedding): under ``no_grad``
        the unit is gathered and kept as after a forward (its next forward reuses it unless a
        step changed the shard, then frees it; :meth:`reshard` frees it too); with gradients
        that would compute on shards, so it is refused. A unit kept gathered since a forward is
        reused unless its shard changed since (then gathered afresh, as the next forward would).
        Memory: the unit, gathered. Communication: one all-gather of the unit, unless it is
        gathered already; with units kept gathered, the root's one-element staleness
        all-reduce."""
        if torch.compiler.is_compiling():
            # Note: inside a compiled block this hook is traced and must add no graph break,
            # so a direct call from compiled code is not detected (call the unit there).
            return
        root = self._root or self._outermost()
        # outside any backward, a backward that raised left its flags up: clear them first, so
        # that the call is taken for the direct call it is (not one from a gradient hook)
        root._recover_from_a_failed_backward()
        if self.training_state is TrainingState.IDLE and root._final_callback_queued:
            self._refuse_a_call_on_shards_in_backward(module)
        if self.training_state is not TrainingState.IDLE or root._final_callback_queued:
            return
        if self._shard.kept_from_forward:
            # kept since a forward that no backward followed: stale if a step came in between
            # (the root's check, as a forward would run it; frees the changed units)
            root._drop_stale_kept_units()
        grad_enabled = torch.is_grad_enabled()
        # kept gathered by a no_grad call: no backward of the unit follows to reduce-scatter
        # the gradients such a call would compute, so they would be dropped silently (a module
        # whose parameters are all frozen computes none: it may run)
        kept_without_backward = self._shard.kept_from_forward and \
            not getattr(self, "_kept_for_backward", False) and \
            any(p.requires_grad for p in module.parameters())
        if self._shard.gathered and not (grad_enabled and kept_without_backward):
            if not self._shard._exposed:  # kept since a forward, hidden at its end
                self._shard.expose()
            return
        if grad_enabled and self._shard.gathered:
            raise RuntimeError(
                f"FullyShardedDataParallel: a {type(module).__name__} holding parameters of an "
                f"FSDP unit ran outside that unit's forward, with gradients enabled, while the "
                f"unit is gathered only since a call under torch.no_grad() (e.g. generate()): "
                f"no backward of the unit would reduce-scatter its gradients, so they would be "
                f"dropped; call the unit (or the engine / outermost FSDP instance) for a "
                f"gradient, or run this call under torch.no_grad() too")
        if grad_enabled:
            raise RuntimeError(
                f"FullyShardedDataParallel: a {type(module).__name__} holding parameters of an "
                f"FSDP unit ran outside that unit's forward, with gradients enabled, while the "
                f"parameters are sharded; call the unit (or the outermost FSDP instance), or "
                f"run it under torch.no_grad() or inside summon_full_params()")
        self._shard.start_gather()
        self._shard.finish_gather()
        self._shard.remember_source()
        self._kept_for_backward = False
        self._shard.expose()

    def _refuse_a_call_on_shards_in_backward(self, module: nn.Module) -> None:
        """A submodule holding this unit's parameters runs during the root's backward, outside
        an activation checkpoint's recomputation (a module called in a gradient hook, for
        logging or a penalty), while the unit is not gathered: it would read this rank's
        shards (a shape error, or wrong numbers where the shapes happen to fit), so raise
        ``RuntimeError`` naming the module. Gathering there is no way out: such hooks often
        run on some ranks only, and an all-gather the other ranks never join hangs.
        Recomputations gather (see :meth:`_gather_if_recomputing`); a unit gathered at that
        point (exposed) is read as it is. Local, no communication."""
        if self._shard is None or self._shard._exposed or self._summoned \
                or _BACKWARD_HOOKS_PAUSED[0] or is_recomputing():
            return
        name = _module_name_in(self, module)
        raise RuntimeError(
            f"FullyShardedDataParallel: {name} ({type(module).__name__}) of the unit "
            f"{self._shard.label[1]!r} was called during backward "
            f"outside an activation checkpoint's recomputation (from a gradient hook?) while "
            f"the unit is sharded: it would compute with this rank's shards (at any world "
            f"size, so that a script behaves alike at every one). Call it after backward, "
            f"where it gathers the unit under torch.no_grad()")

    def _free_units_left_by_an_unfinished_forward(self) -> None:
        """Root only, as a forward starts: free the units an earlier forward gathered and never
        finished with, those gathered (or with a gather in flight) that no forward, read or
        backward kept (:meth:`FlatParamShard.remember_source`): a forward that raised
        (an out-of-memory error or a bad batch the training loop caught and skipped) before
        the unit's post-forward ran, or a prefetch that forward issued for a unit it did not
        run (a skipped expert, under ``no_grad``, where no backward frees it). Their
        ``full`` holds the weights of that forward; an optimizer step since left it stale,
        and the next forward computed with it (a kept unit's staleness check knew nothing of
        them). Units stuck in ``FORWARD`` go back to idle. Local: a wait for a gather every
        rank issued, no communication."""
        self._read_without_grad = []
        for unit in self.sharded_units():
            shard = unit._shard
            if shard is not None and (shard.gathered or shard._pending_gather is not None) \
                    and shard._kept_from is None:
                shard.free_full()
            if unit is not self and unit.training_state is TrainingState.FORWARD:
                unit.training_state = TrainingState.IDLE

    def _drop_stale_kept_units(self) -> None:
        """Root only, as a forward starts: units kept gathered by an earlier forward that no
        backward followed (the root, ``reshard_after_forward=False``) are reused, unless a shard
        changed since (an optimizer step in between), then they are freed and gathered afresh.

        Note: without this, a forward with gradients but no backward (a metric on the training
        batch, a skipped micro-batch), then ``optimizer.step()``, made the next forward compute
        with the old weights. The decision is all-reduced (one element) because a rank whose
        own rows did not change must still gather with the others."""
        kept = [u._shard for u in self.sharded_units()
                if u._shard is not None and u._shard.kept_from_forward]
        if not kept:
            return
        if skdist.any_rank(any(s.source_changed() for s in kept), self.process_group,
                           self._comm_device()):
            for shard in kept:
                shard.free_full()

    def reshard(self) -> None:
        """Free every unit's gathered parameters now (torch FSDP2's method): e.g. after a
        forward that no backward follows, to give the memory back before the next step. The
        next forward (or backward) gathers them again. Local; call it on every rank, like the
        forward it precedes."""
        self._check_idle("reshard")
        for unit in self.sharded_units():
            if unit._shard is not None:
                unit._shard.free_full()

    def _gather_with_next(self, order: list, backward: bool = False) -> None:
        """Gather this unit (unless prefetched), issue the next unit's gather in ``order``
        before waiting, so it overlaps this one's wait and compute, then expose this unit.
        In ``backward``, a unit that kept an hpZ partition gathers from it."""
        if self._shard is not None:
            self._shard.start_gather(from_secondary=backward)
        self._root._prefetch_after(self, order, backward)
        if self._shard is not None:
            self._shard.finish_gather()
            self._shard.expose()

    def _prefetch_after(self, unit, order: list, backward: bool = False) -> None:
        """Note: prefetch order. The first iteration records the order in which units run
        forward and backward; later iterations issue the next unit's all-gather asynchronously
        as soon as the current unit's parameters are ready, so it overlaps the current unit's
        compute. Every rank records the same order, so collectives stay matched."""
        if not self._orders_final:
            return
        try:
            position = order.index(unit)
        except ValueError:
            return
        if position + 1 < len(order):
            following = order[position + 1]
            if following._shard is not None:
                following._shard.start_gather(prefetch=True, from_secondary=backward)

    # ------------------------------------------------------------------ backward

    def register_full_backward_pre_hook(self, hook, prepend: bool = False):
        """``nn.Module.register_full_backward_pre_hook``; the hook sees this unit's gathered
        parameters (``unit.module.weight`` in its full shape), as a hook on the module does in
        one process: the unit gathers for backward just before the hooks run."""
        self._gather_before_backward_pre_hooks_of(self)
        return super().register_full_backward_pre_hook(hook, prepend=prepend)

    def _gather_before_users_backward_pre_hooks(self) -> None:
        """Root, as a forward starts: every unit whose wrapped module has a full backward
        pre-hook of the user's gets the unit's gather registered before it (the unit otherwise
        gathers when backward reaches the module's outputs, after those hooks ran, which then
        read the shards). Local; a look at each unit's hook dicts."""
        for unit in self.sharded_units():
            if unit.module._backward_pre_hooks:
                unit._gather_before_backward_pre_hooks_of(unit.module)

    def _gather_before_backward_pre_hooks_of(self, target: nn.Module) -> None:
        """Prepend this unit's backward gather to ``target``'s full backward pre-hooks (once).
        Note: only while some hook is there, since a module with full backward hooks wraps its
        outputs (torch's BackwardHookFunction: a warning when no input requires grad, and no
        in-place edits of the outputs)."""
        if id(target) in self._gathers_before_hooks_of:
            return
        self._gathers_before_hooks_of.add(id(target))
        nn.Module.register_full_backward_pre_hook(target, _eager(self._gather_for_hooks),
                                                  prepend=True)

    def _gather_for_hooks(self, module, grad_output) -> None:
        if not self._summoned and self._root is not None and not _BACKWARD_HOOKS_PAUSED[0]:
            self._pre_backward_hook(None)

    def _pre_backward_hook(self, grad):
        if _BACKWARD_HOOKS_PAUSED[0]:
            return grad
        root = self._root
        root._queue_final_callback()
        task = torch._C._current_graph_task_id()
        # done already, unless in another graph task and freed since: a unit run once plainly
        # and once inside a reentrant checkpoint, whose backward (a task of its own) gathered,
        # reduced and freed it; the plain use's backward, later in the outer task, needs its
        # weights again (before: "setStorage: ... out of bounds for storage of size 0")
        if self._pre_backward_done and (self._shard is None or self._shard.gathered
                                        or self._pre_backward_task == task):
            if grad is not None:  # another of the unit's outputs
                self._gather_before_later_checkpoints(task)
            return grad
        self._pre_backward_done = True
        self._pre_backward_task = task
        if task == root._backward_task and self._shard is not None:
            self._backward_reads_forward_views = self._shard.forward_views_in_this_backward()
            if root._backward_builds_graph and self._backward_reads_forward_views:
                # before this unit's gather and reduce-scatter: every rank refuses here alike
                refuse_gradients_of_gradients(self._shard.label[1])
            if grad is not None:
                self._gather_before_later_checkpoints(task)
        self.training_state = TrainingState.BACKWARD_PRE
        if not root._orders_final and self not in root._backward_order:
            root._backward_order.append(self)
        # an activation-checkpointed forward is recomputed during backward and reads
        # module.weight again: _gather_with_next exposes the gathered parameters for it. The
        # engine runs hooks with grad mode off; the exposed views must still be views of
        # ``full`` with autograd history, or the recomputation computes no weight gradient.
        with torch.enable_grad():
            self._gather_with_next(root._backward_order, backward=True)
        return grad

    def _queue_final_callback(self) -> None:
        if not self._final_callback_queued:
            self._final_callback_queued = True
            self._backward_task = torch._C._current_graph_task_id()
            # the engine runs a backward's hooks with grad mode on exactly when create_graph=True
            self._backward_builds_graph = torch.is_grad_enabled()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_grad_ready(self, shard: FlatParamShard) -> None:
        """All of this unit's gradient has arrived: reduce-scatter it (async) unless
        inside ``no_sync``, finish the reduce-scatter issued before it, and free the gathered
        parameters. Not yet inside a reentrant activation checkpoint's backward (a graph task
        of its own) that delivered gradients through parameters exposed elsewhere (in the
        forward), unless the outer backward uses none of them: it may still use them (a layer
        norm of a checkpointed block held by an enclosing unit, the embedding beside it); the
        gradients stay held, and the outer backward's delivery, or the root's end of backward,
        reduces them all in one reduce-scatter."""
        task = torch._C._current_graph_task_id()
        recomputed_only = False
        if task != -1:
            # Note: a backward may reach the unit's parameters without passing its outputs'
            # hooks (a loss from a value the module stored, such as an MoE router's
            # ``self.aux_loss``, backpropagated alone): the root's end-of-backward must still
            # run, or the reduce-scatter just issued is never waited for and the gradient
            # lands in .grad one step late
            self._root._queue_final_callback()
            if task != self._root._backward_task and shard.exposed_in_task != task:
                # Note: a reentrant checkpoint inside the unit's own forward (``checkpoint(
                # self.attn, x, use_reentrant=True)`` in a wrapped block) is the unit's only
                # use (one of them, if several checkpoints) when the outer backward, as it
                # reached the unit's outputs, would run none of the splits its forwards made:
                # reduce this checkpoint's gradient now (a further checkpoint over the unit
                # gathers it again and reduces its own part, see
                # _regather_for_later_recomputations).
                # Held until the root's end of backward, every unit stayed gathered and kept
                # its unsharded gradient: twice the model, unsharded, at the peak.
                if self._backward_reads_forward_views is not False:
                    return  # a reentrant checkpoint's backward: held for later (see above)
                if self._checkpoints_to_run:
                    self._hold_for_later_checkpoints(shard)
                    return
                recomputed_only = True
        self._reduce_and_release(shard, recomputed_only)

    def _reduce_and_release(self, shard: FlatParamShard, recomputed_only: bool) -> None:
        """The end of :meth:`_on_grad_ready`: reduce-scatter the unit's gradients (or keep
        them inside ``no_sync``) and free or keep the gathered parameters; ``recomputed_only``
        when they came from reentrant checkpoints' recomputations alone."""
        self._grads_held_for_checkpoints = False
        self.training_state = TrainingState.BACKWARD_POST
        if self._require_backward_grad_sync:
            root = self._root
            # hybrid: the previous unit's reduce-scatter has had this unit's backward to
            # finish; its all-reduce across replicas now overlaps the rest of backward
            replicating = root._replicas_pending
            for earlier in replicating:
                earlier.replicate_reduce()
            shard.start_reduce()
            root._finish_reduces_in_flight(keep=[shard, *replicating])
            if not any(shard is s for s in root._reduces_in_flight):
                root._reduces_in_flight.append(shard)
            root._replicas_pending = [shard] if shard.replicate_group is not None else []
        else:
            shard.seal_held_grads()
        if recomputed_only and self._stays_gathered_for_backward():
            self._expose_for_later_recomputations(shard)
        elif recomputed_only and self._checkpoint_backwards_running:
            # Note: a checkpoint nested in the checkpoint whose backward runs (``checkpoint(
            # self.outer, x)`` whose code calls ``checkpoint(self.inner, t * self.scale)``)
            # ends its own backward first: the outer one still holds views of the gathered
            # parameters (``self.scale``); freed now, it read freed memory (a segfault).
            # The outer checkpoint's node frees the unit as its backward ends.
            self._free_owed = True
        else:
            self._release_after_backward(shard)
        if recomputed_only:  # a later use's backward (a block shared by two layers) gathers
            self._pre_backward_done = False
            self._regather_for_later_recomputations(shard)

    def _forward_span(self) -> Optional[tuple]:
        """At the end of a forward outside backward, for a unit with parameters (a reentrant
        checkpoint inside its forward may recompute them, see
        :meth:`_gather_before_later_checkpoints`): the sequence numbers of the autograd nodes
        this forward made, ``[first, end)``; kept on its outputs' nodes (their ``metadata``),
        so it lives as long as the graph. Local."""
        root = self._root
        if root is None or root._final_callback_queued or self._shard is None:
            return None
        return self._forward_began, torch._C._autograd._get_sequence_nr()

    def _finish_reduces_in_flight(self, keep: list) -> None:
        """Root: finish the reduce-scatters in flight but those of the shards in ``keep``.

        Note: a reduce-scatter holds its unit's whole gradient (``Ψ_u``, compute dtype) until
        it completes. Left in flight until the end of backward, they added up to the whole
        model's gradient, unsharded, at the backward's peak. Each unit's reduction is instead
        finished once the next unit's has been issued (it overlapped that unit's backward), as
        FSDP2 does: at most two units' gradients are held at once (three under hybrid
        sharding, whose replica all-reduce gets a unit's backward of its own). They are
        finished in the order they were issued, the same on every rank."""
        kept = []
        for shard in self._reduces_in_flight:
            if any(shard is k for k in keep):
                kept.append(shard)
            else:
                shard.finish_reduce()
        self._reduces_in_flight = kept

    def _stays_gathered_for_backward(self) -> bool:
        """Whether the forward leaves this unit gathered for its backward: the root (unless
        ``disable_reshard_on_root=False``) and units with ``reshard_after_forward=False``."""
        root_keeps = self._is_root and self.disable_reshard_on_root
        return root_keeps or not self.reshard_after_forward

    def _release_after_backward(self, shard: FlatParamShard) -> None:
        """Free the gathered parameters once backward is done with them, except, inside
        ``no_sync``, in units that stay gathered from forward to backward: the parameters do
        not change before the next forward, which then reuses them (FairScale's behaviour:
        one all-gather of such a unit per accumulation cycle instead of one per micro-batch,
        for ``Ψ_u`` held between the micro-batches)."""
        if self._keeps_gathered_for_the_built_graph(shard):
            return
        if not self._require_backward_grad_sync and self._stays_gathered_for_backward():
            shard.hide()
        else:
            shard.free_full()

    def _keeps_gathered_for_the_built_graph(self, shard: FlatParamShard) -> bool:
        """A backward with ``create_graph=True`` (a gradient penalty: ``torch.autograd.grad(out,
        x, create_graph=True)``, then ``(loss + penalty).backward()``) builds a graph that reads
        the gathered parameters: keep the unit gathered, as after a forward, so the later
        backward through that graph finds them (it frees them; so does the next forward if a
        step changed the shard, see :meth:`_drop_stale_kept_units`). Memory: every unit that
        backward reached stays gathered until then."""
        root = self._root
        if root is None or not (root._final_callback_queued and root._backward_builds_graph) \
                or not shard.gathered:
            return False
        shard.remember_source()
        return True

    def _finish_backward(self) -> None:
        """Root only, at the end of backward: wait for every reduce-scatter, hand the shards
        their gradients, free whatever is still gathered, close the first iteration's order."""
        self._reduce_units_left_out()
        for shard in self._reduces_in_flight:  # every replica all-reduce in flight first
            shard.replicate_reduce()
        # in the order they were issued, as every rank issued them: the first reduce-scatter
        # paired with another unit's on some rank then raises on every rank (a rank waiting
        # for one issued later would wait for a peer that raised: a hang)
        self._finish_reduces_in_flight(keep=[])
        for unit in reversed(self.sharded_units()):
            if unit._shard is not None:
                unit._shard.finish_reduce()
                unit._release_after_backward(unit._shard)
            unit._pre_backward_done = False
            unit._backward_reads_forward_views = None
            unit._drop_checkpoint_gathers()
            unit.training_state = TrainingState.IDLE
        self._final_callback_queued = False
        self._backward_builds_graph = False
        self._replicas_pending = []
        self._reduces_in_flight = []
        self._orders_final = True

    def _reduce_units_left_out(self) -> None:
        """Reduce-scatter, in unit order, the gradients that earlier backwards inside
        ``no_sync`` accumulated in units this (synchronising) backward did not reach (a branch
        taken in an earlier micro-batch only); they would otherwise be dropped. Every rank takes
        the same branches (as FSDP requires of every unit's use), so the calls match. The
        gradients held for the user's tensor hooks of a unit whose uses were not all delivered
        (``backward(inputs=...)`` leaving the unit's count out) go through the hooks first."""
        for unit in self.sharded_units():
            shard = unit._shard
            if shard is not None:
                shard.run_tensor_hooks()
            if shard is not None and shard.has_full_grad() and unit._require_backward_grad_sync:
                shard.start_reduce()
                self._finish_reduces_in_flight(keep=[shard])
                self._reduces_in_flight.append(shard)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (unsharded, ``Ψ`` per unit in compute dtype) and skip
        the reduce-scatter; the first backward outside the block reduces everything once.

        Units that stay gathered from forward to backward (the root, and those with
        ``reshard_after_forward=False``) also stay gathered from one micro-batch to the next
        inside the block, as in FairScale: their parameters are all-gathered once per
        accumulation cycle (``Ψ_u`` more memory between micro-batches). Should a shard change
        in between (an optimizer step inside the block), the next forward gathers afresh.

        Between the block's backwards each trainable parameter the gradients reached shows
        this rank's accumulated, unreduced gradient as its ``.grad``, in the parameter's full
        shape (as torch FSDP1 does): what is done to it in place (a scaling, an unscale,
        ``zero_()``) reaches what the next synchronising backward reduces, and
        ``model.zero_grad()`` / ``optimizer.zero_grad()`` discard it, as in one process. A
        ``.grad`` kept from before the cycle (no ``zero_grad`` since the last step's backward)
        is folded into it (in this rank's rows) where that is exact, so scalings reach it
        too. Replacing ``.grad`` (``p.grad = p.grad * f``) works at world size 1; at larger
        ones torch itself refuses it at that line, on every rank and before any collective
        ("attempting to assign a gradient of size ...": the parameter holds its shard, as
        under torch FSDP1): scale in place instead (``p.grad.mul_(f)``). After that
        backward ``.grad`` is this rank's shard of the reduced gradient again."""
        if self._is_root is False:
            raise RuntimeError("no_sync() was called on an inner FullyShardedDataParallel unit; "
                               "call it on the root (outermost) instance, which applies it to "
                               "every unit")
        units = self.sharded_units()
        previous = [u._require_backward_grad_sync for u in units]
        for u in units:
            u._require_backward_grad_sync = False
        try:
            yield
        finally:
            for u, flag in zip(units, previous):
                u._require_backward_grad_sync = flag

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag, which training scripts set instead of entering :meth:`no_sync`
        (nanoGPT: ``model.require_backward_grad_sync = (micro_step == last)``): ``False``
        inside ``no_sync``. Setting it on the root applies it to every unit, as ``no_sync``
        does until set back: with ``False`` the following backward passes accumulate
        locally, the first with ``True`` reduce-scatters the sum. Set it alike on every rank.
        Local; a non-bool is a TypeError, and so is setting it on an inner unit."""
        return self._require_backward_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"FullyShardedDataParallel.require_backward_grad_sync = {value!r}: "
                            f"expected True or False")
        if self._is_root is False:
            raise RuntimeError("require_backward_grad_sync was set on an inner "
                               "FullyShardedDataParallel unit; set it on the root (outermost) "
                               "instance, which applies it to every unit")
        for unit in self.sharded_units():
            unit._require_backward_grad_sync = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, which also drops what backwards inside :meth:`no_sync`
        accumulated and no synchronising backward has reduced yet (shown unsharded in
        ``.grad``), as under torch's and FairScale's FSDP; without it, those gradients would be
        added to the next step's. ``optimizer.zero_grad()``
        discards them too (see :meth:`no_sync`). Local."""
        if self._root is not None:
            self._root._recover_from_a_failed_backward()
        for unit in self.sharded_units():
            if unit._shard is not None:
                unit._shard.drop_unreduced_grads()
        super().zero_grad(set_to_none)

    def assert_state(self, state) -> None:
        """Raise ``ValueError`` unless this unit's :attr:`training_state` is ``state`` (a
        :class:`TrainingState` or a list of them): FairScale's check, for code that asserts
        where in the step it is. Local, costs nothing."""
        check_state(self, state)

    # ------------------------------------------------------------------ full parameters

    def _recover_from_a_failed_backward(self) -> None:
        """Root: a backward that raised (a hook's error, an out-of-memory error caught by the
        training loop, which then skips the batch) never ran :meth:`_finish_backward`, so the
        units still looked mid-backward: the next forward was taken for a recompute and no
        gradient reached ``.grad`` again. Outside any backward, put every unit back to idle:
        wait for the reduce-scatters in flight and drop their results and the gradients held
        (also what ``no_sync`` accumulated before: the failed backward may have added part of
        its own to them); free the gathered parameters. Only a flag is read otherwise.
        A unit whose reduce-scatter was finished before the error (once the next unit's was
        issued) already added the failed backward's gradient to its shards' ``.grad``, as
        autograd does in one process for the parameters it reached: call ``zero_grad`` after
        the error to skip the batch, as in one process.

        Note: every rank must have raised in the same backward (as with any error inside a
        collective step); a rank whose backward finished while another's raised hangs in a
        collective whatever is done here."""
        if not self._final_callback_queued or torch._C._current_graph_task_id() != -1:
            return
        for unit in self.sharded_units():
            if unit._shard is not None:
                unit._shard.abandon_reduce()
                unit._shard.free_full()
            unit._pre_backward_done = False
            unit._backward_reads_forward_views = None
            unit._drop_checkpoint_gathers()
            unit.training_state = TrainingState.IDLE
        self._final_callback_queued = False
        self._backward_builds_graph = False
        self._replicas_pending = []
        self._reduces_in_flight = []

    def _check_idle(self, what: str) -> None:
        root = self._root
        if root is not None:
            root._recover_from_a_failed_backward()
        for unit in self.sharded_units():
            if unit._shard is not None and unit._shard.gathered and unit._root is not None \
                    and unit._root._final_callback_queued:
                raise RuntimeError(f"FullyShardedDataParallel.{what}() was called during "
                                   f"backward; call it between steps")

    def apply(self, fn) -> "FullyShardedDataParallel":
        """``nn.Module.apply`` with this unit's full parameters summoned around it (inner units
        summon their own as the recursion reaches them), so ``fn`` may initialise weights in
        their original shapes; the result is written back into the shards. FairScale's
        behaviour. Communication: two all-gathers per unit; all ranks must call it."""
        with self.summon_full_params(recurse=False):
            return super().apply(fn)

    def reset_parameters(self) -> None:
        """Call the wrapped module's ``reset_parameters()`` on its full parameters (written back
        into the shards), when constructed with ``allow_reset_parameters=True``; otherwise
        ``RuntimeError``, as in FairScale (a module's own initialiser run on the shards would
        see the wrong shapes). Memory: the full parameters while it runs. Communication: one
        all-gather per unit (``summon_full_params``); all ranks must call it."""
        if not self.allow_reset_parameters:
            raise RuntimeError("FullyShardedDataParallel.reset_parameters(): construct the unit "
                               "with allow_reset_parameters=True to let it reach the wrapped "
                               "module (it then runs on the full parameters)")
        reset = getattr(self.module, "reset_parameters", None)
        if not callable(reset):
            raise RuntimeError(f"FullyShardedDataParallel.reset_parameters(): the wrapped "
                               f"{type(self.module).__name__} has no reset_parameters()")
        with self.summon_full_params(recurse=True):
            reset()

    def append_shared_param(self, p: nn.Parameter) -> None:
        """FairScale's way of tying a parameter of another unit to this one (with
        ``flatten_parameters=False``) is not supported: ``NotImplementedError`` naming the
        alternative, raised locally (no collective). A parameter shared by two units is
        refused when the second unit is built; wrap the lowest module that holds every use of
        the parameter as one unit, where the tie trains as in one process."""
        raise NotImplementedError(
            "FullyShardedDataParallel.append_shared_param(): a parameter shared by two "
            "units is not supported (FairScale's flatten_parameters=False tie). Wrap the "
            "lowest module that holds every use of the parameter as one unit (for example "
            "leave the layers that share it unwrapped inside the root): the tie then trains "
            "as in one process")

    def set_gradient_divide_factors(self, pre: float, post: float, recursive: bool) -> None:
        """Divide the gradients by ``pre`` before the reduce-scatter and by ``post`` after
        (their product is the data-parallel size for a mean, FairScale's default split).
        ``recursive`` sets every inner unit too. Local; call it between steps on all ranks."""
        call = "FullyShardedDataParallel.set_gradient_divide_factors"
        pre, post = check_divide_factor(call, "pre", pre), check_divide_factor(call, "post", post)
        self._check_idle("set_gradient_divide_factors")
        for unit in self.sharded_units() if recursive else [self]:
            unit.gradient_predivide_factor, unit.gradient_postdivide_factor = pre, post
            if unit._shard is not None:
                unit._shard.set_divide_factors(pre, post)

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """torch FSDP1's: reduce every unit's gradients with ``hook`` instead of the unit's
        own reduce-scatter. Call it on the root, once, before the first forward, on every rank.

        ``hook(state, grad, output)`` for the sharded strategies: ``grad`` is the unit's
        flat gradient (this rank's, zero padded to ``N x shard`` elements, rank-major: rank
        ``r``'s rows of every parameter are the ``r``-th block, so
        ``dist.reduce_scatter_tensor(output, grad)`` hands each rank its shard) and ``output``
        the ``shard`` elements to fill; ``hook(state, grad)`` for ``NO_SHARD``, reducing
        ``grad`` in place. Both in the reduce dtype (torch's fp16 / bf16 compress hooks get
        the gradient in the compute dtype and cast it themselves). The hook does its own
        division, e.g. torch's ``default_hooks`` by ``DefaultState(group)``'s pre/post factors
        (the mean over the group): ``gradient_predivide_factor`` and
        :meth:`set_gradient_divide_factors` no longer apply. ``state`` is the hook's, passed
        as is. The use counts and the non-finite flag of each unit travel in a small
        reduce-scatter of their own (``P + 2`` elements per rank), and the hook's result is
        checked for an inf or NaN (one all-reduce of one element per unit), so unused
        parameters keep ``.grad`` as in one process and a loss scaler skips an overflowing
        step on every rank. The hook runs synchronously, as under torch. The hook's own
        collectives (``torch.distributed`` calls in torch's hooks) are not seen by
        :class:`~shardkit.distributed.CommCounter`, which counts only the side values and the
        flag then; a hook that raises on some ranks leaves the others in its collective until
        the process group's timeout (as under torch).

        Refused (before any collective, on every rank: the checks read only the wrapping):
        on an inner unit, a second time, after a forward, a ``hook`` that is not callable
        or cannot take the arguments a unit's strategy hands it (``allreduce_hook`` under
        FULL_SHARD),
        under ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2`` (as torch) and with
        ``quantize_gradients`` (qgZ's compressed reduce-scatter would be bypassed). Local.
        """
        call = "FullyShardedDataParallel.register_comm_hook"
        if not self.check_is_root():
            raise _RefusedCommHook(f"{call}() was called on an inner unit; call it on the "
                                   f"root (outermost) instance, which registers it on every "
                                   f"unit")
        if not callable(hook):
            raise ValueError(f"{call}(hook={hook!r}): the hook must be a callable "
                             f"hook(state, grad, output) (NO_SHARD: hook(state, grad))")
        if self._is_root:
            raise _RefusedCommHook(f"{call}() was called after the model's first forward; "
                                   f"register the hook right after wrapping, before any "
                                   f"forward, on every rank")
        units = self.sharded_units()
        for unit in units:
            _check_comm_hook_allowed(call, unit)
            _check_comm_hook_arity(call, unit, state, hook)
        for unit in units:
            unit._comm_hook, unit._comm_hook_state = hook, state
            if unit._shard is not None:
                no_shard = unit.sharding_strategy is ShardingStrategy.NO_SHARD
                unit._shard.set_comm_hook(state, hook, all_reduces=no_shard)

    # ------------------------------------------------------------------ gradients

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every shard's gradient so the global norm (over all ranks) is at most
        ``max_norm``; returns that global norm (``torch.nn.utils.clip_grad_norm_`` semantics;
        a 0-dim tensor in the widest dtype of the gradients, as torch FSDP1 returns it: bf16
        for an all-bf16 model, computed in fp32), each gradient element counted once, also
        when units use different strategies (e.g. ``NO_SHARD`` or hybrid units under a
        ``FULL_SHARD`` root, as torch FSDP1 allows).
        Communication: one all-reduce of one element over the root's shard group; when some
        unit's replicas or shard group differ from the root's, one more over the root's replica
        group (if it has one); for a model with tensor-parallel layers (FSDP over the
        data-parallel group, 2D/3D parallelism), one more over the tensor-parallel group, so
        that split weights count once per slice and replicated ones once in all (see
        :func:`~shardkit.utils.grad_norm.count_once_over_tensor_parallel`). Call it on the root,
        on all ranks.

        Parameters no unit shards (``ignored_modules`` / ``ignored_states``) count as torch
        FSDP1 counts them: this rank's gradients added to the all-reduced norm of the shards,
        not summed over the ranks (equal gradients on every rank count once; if they differ,
        so does the returned norm), and they are clipped with the same coefficient."""
        if self._is_root is False:
            raise RuntimeError("`clip_grad_norm_()` should only be called on the root FSDP "
                               "instance (torch FSDP1's words): it was called on an inner "
                               "FullyShardedDataParallel unit; call it on the outermost one")
        max_norm, norm_type = check_clip_arguments("clip_grad_norm_", max_norm, norm_type)
        self._check_idle("clip_grad_norm_")
        self._refuse_unreduced_grads("clip_grad_norm_")
        sharded = {id(p) for u in self.sharded_units() if u._shard is not None
                   for p in u._shard.params}
        grads = [p.grad for p in self.parameters() if p.grad is not None and id(p) in sharded]
        unsharded = [p.grad for p in self.parameters()
                     if p.grad is not None and id(p) not in sharded]
        measured, also_over = self._gradients_counted_once(sharded)
        total = clip_grad_norm_across_ranks(grads, max_norm, norm_type, self.process_group,
                                            comm_device=self._comm_device(),
                                            measured=measured, also_over=also_over,
                                            local_only=unsharded)
        grads = grads + unsharded
        # torch FSDP1's dtype: the widest of the gradients' (computed in fp32 all the same)
        widest = functools.reduce(torch.promote_types, [g.dtype for g in grads],
                                  grads[0].dtype) if grads else total.dtype
        return total.to(widest)

    def _refuse_unreduced_grads(self, what: str) -> None:
        """Raise if backwards inside :meth:`no_sync` left gradients that no synchronising
        backward has reduced yet: ``.grad`` shows each rank's unreduced gradient, so a norm of
        the shards cannot be taken. Those whose ``.grad`` was cleared since
        (``optimizer.zero_grad()``) are discarded, as by ``optimizer.step()``'s check, and do
        not count. Every rank ran the same backwards, so every rank raises here, before any
        collective. Local; one device sync per unit holding such gradients."""
        held = [unit for unit in self.sharded_units()
                if unit._shard is not None and unit._shard.holds_unreduced_grads()]
        if held:
            names = sorted({unit._shard.label[1] for unit in held})
            raise RuntimeError(
                f"FullyShardedDataParallel.{what}(): the gradients of {len(held)} unit(s) "
                f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) were accumulated "
                f"inside no_sync() and are not reduced yet; run the last backward of the "
                f"accumulation cycle outside no_sync() (it reduces everything), or call "
                f"model.zero_grad() to discard them")

    def _gradients_counted_once(self, sharded: set) -> tuple:
        """``(measured, also_over)`` for :func:`clip_grad_norm_across_ranks`: which of this
        rank's gradients enter the norm and which groups the partial norm is summed over after
        the root's shard group, so that every gradient element is counted exactly once.

        When every unit replicates over the root's replica group and shards inside the root's
        shard group (one strategy throughout, experts on their own groups), summing all of this
        rank's gradients over the root's shard group already counts each once: ``(None, ())``.
        Otherwise (units of another strategy than the root's) each unit's gradients count on
        the first rank of its replica group only, and the sum runs over the root's shard group
        and then its replica group. Tensor-parallel layers in the model then narrow the counted
        gradients and add the tensor-parallel group (``count_once_over_tensor_parallel``).
        ``sharded``: the ids of the parameters units shard (the others, ignored, are counted
        apart). Local, no communication."""
        def ranks(group):
            return None if group is None else tuple(skdist.group_ranks(group))

        units = [u for u in self.sharded_units() if u._shard is not None]
        root_shard, root_replicas = set(skdist.group_ranks(self.process_group)), \
            ranks(self.replicate_group)
        uniform = all(ranks(u.replicate_group) == root_replicas
                      and set(skdist.group_ranks(u.process_group)) <= root_shard for u in units)
        if uniform:
            counted = [p for p in self.params_with_grad if id(p) in sharded]
            also_over = ()
        else:
            counted = [p for u in units
                       if u.replicate_group is None or skdist.get_rank(u.replicate_group) == 0
                       for p in u.params if p.grad is not None]
            also_over = () if self.replicate_group is None else (self.replicate_group,)
        counted, over_tensor = count_once_over_tensor_parallel(
            self.parameters(), counted, "clip_grad_norm_",
            data_groups=[g for g in (self.process_group, self.replicate_group) if g is not None])
        if uniform and not over_tensor:
            return None, ()
        return [p.grad for p in counted], also_over + over_tensor


FSDP = FullyShardedDataParallel


def get_fsdp_instances(module: nn.Module, skip_empty: bool = False) -> list:
    """Every :class:`FullyShardedDataParallel` unit in ``module`` (itself included), in
    ``module.modules()`` order; ``skip_empty`` leaves out units that own no parameter of their
    own (FairScale's function). Local, no communication."""
    units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
    return [u for u in units if u._shard is not None] if skip_empty else units


def _sync_unit_states(module: nn.Module, params: list, groups, transport) -> None:
    """Give every rank rank 0's values of the unit's parameters and of the buffers outside
    its inner units (ignored modules' too: an ignored module inside an inner unit is that
    unit's), by the unit's ``transport``: across the replicas first, so that each shard
    group's rank 0 holds global rank 0's values, then inside the shard group."""
    # ignored modules' buffers too (torch FSDP1 broadcasts them)
    buffers = [b for m in _unit_modules(module, IgnoredStates())
               for b in m._buffers.values() if b is not None]
    tensors = list(params) + list({id(b): b for b in buffers}.values())
    if groups.replicate is not None:  # None: no replicas
        skdist.broadcast_tensors_from_rank0(tensors, groups.replicate, transport=transport)
    skdist.broadcast_tensors_from_rank0(tensors, groups.shard, transport=transport)  # None: world


def _mark_fsdp_managed(module: nn.Module) -> None:
    """Mark ``module`` as torch's FSDP marks the modules it manages. Hugging Face's
    ``generate()`` reads ``_is_fsdp_managed_module`` to default to ``synced_gpus=True``
    (ranks whose sequences ended keep running forwards, so every rank issues the same
    all-gathers); without it, ranks that stop at different lengths hang. Dynamo reads both
    flags too: such a module is traced without guards on its parameters, as under torch's
    FSDP with ``use_orig_params=True`` (the parameters here are the module's own)."""
    module._is_fsdp_managed_module = True
    module._fsdp_use_orig_params = True


def _keep_unit_storage() -> None:
    """What ``unit.flatten_parameters()`` runs for a wrapped RNN: nothing (see the property)."""


def _build_shard(params, locations, groups, policy: MixedPrecisionPolicy,
                 move_params_to_cpu: bool, on_grad_ready, transport,
                 reduce_group) -> FlatParamShard:
    master = params[0].dtype
    compute, storage = shard_devices(params[0].device, move_params_to_cpu)
    return FlatParamShard(params, locations, groups.shard,
                          compute_dtype=policy.compute_dtype(master),
                          reduce_dtype=policy.gradient_reduce_dtype(master),
                          compute_device=compute, storage_device=storage,
                          on_grad_ready=on_grad_ready, transport=transport,
                          replicate_group=groups.replicate, hpz_group=groups.hpz,
                          reduce_group=reduce_group)
