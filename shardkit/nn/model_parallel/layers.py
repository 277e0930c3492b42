"""Megatron-style tensor-parallel layers: each rank holds ``1/n`` of a weight.

``n`` is the tensor-parallel size (:func:`~shardkit.nn.model_parallel.initialize_model_parallel`),
``S`` the bytes of the layer's full output activation (input for a row-parallel layer's reduce).

================================  ======================  ==========================================
layer                             weight held per rank    communication per forward / backward
================================  ======================  ==========================================
``ColumnParallelLinear``          ``out/n`` rows          none / all-reduce of the input grad;
                                                          + all-gather of the output if gathered
``RowParallelLinear``             ``in/n`` columns        all-reduce of the output (2(n-1)/n·S) /
                                                          none (+ all-gather if input is scattered)
``VocabParallelEmbedding``        ``vocab/n`` rows        all-reduce of the output / none
``ParallelEmbedding``             ``dim/n`` columns       all-gather of the output / none
================================  ======================  ==========================================

Beside these, every construction makes the ranks' agreement on its arguments, and in the
collective debug mode every forward the agreement on its input: 16 int64s per rank each (see
below).

With ``sequence_parallel=True`` the activations outside the layers are split along the sequence:
a column-parallel layer all-gathers its input (backward: reduce-scatter) and a row-parallel layer
(or the vocab-parallel embedding) reduce-scatters its output (backward: all-gather), the same
bytes as the all-reduces they replace.

Initialisation: each layer builds the **full** (master) weight on every rank, applies
``init_method`` to it from the default generator (seed it identically on every rank, e.g. with
:func:`~shardkit.nn.model_parallel.random.model_parallel_manual_seed`), and keeps its slice; so
the concatenation of the shards is exactly what ``init_method`` gives the unsplit weight after
the same seed. The master weight is transient (its full size, during construction only) unless
``keep_master_weight_for_test=True``. Biases start at zero. ``reset_parameters()`` draws them
again the same way: a model built under ``torch.device("meta")``, then ``to_empty`` and each
module's ``reset_parameters()`` in order, holds the eagerly built values (FSDP's default
materialization of a meta model calls it too), and its parameters the same marks
(:class:`~shardkit.nn.model_parallel.parameter_marks.KeepsParameterMarks`).

Every layer communicates over the tensor-parallel group it was built in (``tp_group``), so it
keeps working after :func:`~shardkit.nn.model_parallel.destroy_model_parallel` or a new
:func:`~shardkit.nn.model_parallel.initialize_model_parallel`; its parameters carry those groups
(``model_parallel_groups``) for :func:`~shardkit.nn.model_parallel.clip_grad_norm` and
:func:`~shardkit.nn.model_parallel.reduce_sequence_parallel_grads`. ``copy.deepcopy`` shares the
groups. Inputs of the wrong width raise ``ValueError`` before any collective; so do, at
construction, sizes that are not ints >= 0 or not divisible by the tensor-parallel size (the
message names the argument and the multiple it needs), a ``padding_idx`` outside ``[-V, V)``
and (``TypeError``) flags that are not bools (``gather_output``, ``input_is_parallel``,
``sequence_parallel``, ``skip_bias_add``: a string such as ``"no"`` would be truthy) or an
``init_method`` that is not callable.

The tensor-parallel ranks agree (:mod:`~shardkit.nn.model_parallel.agreement`), so that a
layer built or fed differently on one rank is a clear error on every rank, where gloo aborted
the process, hung, or summed misaligned slices without an error:

- at construction, on the layer's global arguments (sizes, ``bias``, ``gather_output`` /
  ``input_is_parallel``, ``stride``, ``sequence_parallel``, ``sequence_dim``,
  ``skip_bias_add``; an embedding's ``padding_idx``, ``max_norm``, ``norm_type``, ...): a
  ``ValueError`` naming each argument that differs and every rank's value; an argument
  refused on one rank is raised on every rank (that rank's error, its text on every rank);
- at the start of each ``forward``, in the collective debug mode (``SHARDKIT_DEBUG_COLLECTIVES=1``
  or :func:`shardkit.distributed.set_debug_collectives`), on the input's shape and dtype (and
  the local input checks' verdict): another batch or sequence length on one rank is a
  ``ValueError`` with every rank's shape, raised before the layer's first collective. Off (the
  default) a forward exchanges nothing more and a local refusal is its rank's alone.

Each costs one all-gather of 16 int64s per rank over the tensor-parallel group (``128 n``
bytes), a control message that ``CommCounter`` does not count, on the group's control device
(under NCCL the GPU, whose result the host reads: one synchronisation); nothing at
tensor-parallel size 1, nothing in backward (a gradient has its activation's shape).

.. warning:: Building a tensor-parallel layer is collective over its tensor-parallel group:
   build the model on every rank of it, alike. A model built on some ranks only (rank 0
   counting the parameters under ``torch.device("meta")``) goes in
   :func:`local_construction`, whose layers agree at their first forward instead.

``ColumnParallelLinear`` and ``RowParallelLinear`` take Megatron-LM's ``skip_bias_add``:
``forward`` then returns ``(output, bias)`` without adding the bias, for the caller to fuse the
add into the next op (bias-GeLU, bias-dropout-add); see each class.

Every layer can export and load the unsplit weights: ``full_state_dict()`` (an all-gather over the
tensor-parallel group; the keys and shapes of the equivalent ``nn.Linear`` / ``nn.Embedding``)
and ``load_full_state_dict(sd)`` (keeps this rank's slice; no communication).
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
import pickle
import threading
from typing import Callable, Iterator, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed
from shardkit.nn.model_parallel.initialize import current_groups, model_parallel_is_initialized
from shardkit.nn.model_parallel.agreement import (agree_on_arguments, agree_on_input,
                                                  local_problem)
from shardkit.nn.model_parallel.mappings import (
    SEQUENCE_DIM, _copy_to_region_of_own_linear, _gather_from_region,
    _gather_from_sequence_region, _reduce_from_region_of_own_output,
    _reduce_scatter_to_sequence_region, _scatter_to_region, activation_facts)
from shardkit.nn.model_parallel.parameter_marks import KeepsParameterMarks
from shardkit.nn.model_parallel.sequence_parallel import mark_sequence_parallel
from shardkit.nn.model_parallel.utils import check_indices, join_shards, shard_of

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "ParallelEmbedding", "TensorParallelModule", "deepcopy_keeping_parameter_marks",
           "join_over_tensor_group", "local_construction"]

InitMethod = Callable[[torch.Tensor], torch.Tensor]
# what a linear layer built with skip_bias_add=True returns: (output, bias or None)
OutputAndBias = tuple[torch.Tensor, Optional[torch.Tensor]]
# whether this thread builds layers in local_construction()
_construction = threading.local()


@contextlib.contextmanager
def local_construction() -> Iterator[None]:
    """Inside the block, the tensor-parallel layers built on this rank skip the construction
    agreement with the other ranks of their tensor-parallel group (a collective, see the
    module docstring) and make it at the start of their first ``forward`` instead, before any
    collective of theirs; a layer refusing its arguments raises on this rank alone.

    For a model built on some ranks only, which outside the block waits in its first layer
    for ranks that never build it, or pairs with the next layer they build::

        if rank == 0:  # log the model's size: nothing allocated, nothing exchanged
            with torch.device("meta"), model_parallel.local_construction():
                print(sum(p.numel() for p in GPT(config).parameters()))

    Costs nothing: no communication in the block, and later the one agreement a layer
    makes anyway, at its first forward (none for a layer never called). Local (this thread).
    """
    previous = getattr(_construction, "local", False)
    _construction.local = True
    try:
        yield
    finally:
        _construction.local = previous


class TensorParallelModule(KeepsParameterMarks):
    """Base of the tensor-parallel layers: the group it was built for and the unsplit export.

    Subclasses list, in ``_shard_dims``, each parameter's split as ``(dim, stride)``, or
    ``None`` for a parameter replicated on every tensor-parallel rank. Split parameters carry
    Megatron's attributes ``param.tensor_model_parallel = True``, ``partition_dim`` and
    ``partition_stride`` (see :func:`~shardkit.nn.model_parallel.clip_grad_norm` and
    :mod:`~shardkit.nn.model_parallel.full_state`), kept through ``to_empty`` and ``.to()``
    (:class:`KeepsParameterMarks`).
    """

    _shard_dims: dict[str, Optional[tuple[int, int]]] = {}
    # the in-place initialiser of the master weight; None for a layer unpickled without it
    init_method: Optional[InitMethod] = None
    master_weight: Optional[torch.Tensor] = None
    # the global arguments of a layer built in local_construction(), agreed at its first
    # forward (see _agree_on_arguments); None once agreed, or for a layer built outside it
    _arguments_to_agree: Optional[dict] = None

    def __init__(self, what: str):
        super().__init__()
        if not model_parallel_is_initialized():
            raise RuntimeError(
                f"{what} was created before shardkit.nn.model_parallel.initialize_model_parallel"
                f"(model_parallel_size, ...): create the groups on every rank first")
        # the whole snapshot, so that the loss, clipping and sequence-parallel reductions of
        # this layer's parameters can find the groups it was built with
        self.model_parallel_groups = current_groups(what)
        self.tp_group = self.model_parallel_groups.tensor
        self.tp_rank = self.model_parallel_groups.tensor_rank
        self.tp_size = len(self.model_parallel_groups.tensor_ranks)

    def __deepcopy__(self, memo):
        """A deep copy (an EMA or evaluation copy) sharing the process groups; see
        :func:`deepcopy_keeping_parameter_marks`."""
        return deepcopy_keeping_parameter_marks(self, memo)

    def __getstate__(self):
        """Pickling (``torch.save(model)``): the process groups stay behind, since they mean
        nothing outside this process; :meth:`__setstate__` binds the loading process's. So does
        an ``init_method`` that cannot be pickled (a closure such as Megatron's
        ``init_method_normal(0.02)``): the loaded layer then refuses :meth:`reset_parameters`."""
        state = self.__dict__.copy()
        state["tp_group"] = state["model_parallel_groups"] = None
        if not _picklable(state.get("init_method")):
            state["init_method"] = None
        return state

    def __setstate__(self, state):
        """Unpickling: bind the current groups when they are of the saved tensor-parallel size
        and this rank holds the saved slice (``tp_rank``); else the layer refuses to run (a
        forward pre-hook raises) rather than communicate over the wrong group. Local."""
        super().__setstate__(state)
        if model_parallel_is_initialized():
            groups = current_groups(type(self).__name__)
            if len(groups.tensor_ranks) == self.tp_size and groups.tensor_rank == self.tp_rank:
                self.model_parallel_groups, self.tp_group = groups, groups.tensor
                for param in self._parameters.values():
                    if param is not None:
                        param.model_parallel_groups = groups
        if _refuse_unbound_layer not in self._forward_pre_hooks.values():
            self.register_forward_pre_hook(_refuse_unbound_layer)

    def _draw_master(self, shape: tuple[int, ...],
                     device: Optional[torch.device] = None) -> torch.Tensor:
        """The full (master) initial weight of ``shape``: ``init_method`` applied to a new
        tensor of the default dtype, drawn from ``device``'s default generator (default: the
        default device). No communication; memory: the full weight."""
        master = _master(shape, self.init_method, device)
        self._fix_master(master)
        return master

    def _fix_master(self, master: torch.Tensor) -> None:
        """Rows of the full initial weight that ``init_method`` must not decide (an
        embedding's padding row); none here."""

    def _agree_on_arguments(self, problem: Optional[BaseException], **arguments) -> None:
        """At construction, before anything is drawn: the tensor-parallel ranks agree on the
        layer's global ``arguments``, and this rank's ``problem`` (its argument checks' error)
        is raised on every rank that has one, a ValueError on the others (see
        :func:`~shardkit.nn.model_parallel.agreement.agree_on_arguments`: one all-gather of
        16 int64s per rank, not counted by ``CommCounter``; none at size 1).

        Inside :func:`local_construction` the layer agrees at the start of its first
        ``forward`` instead (before any collective of it; the same cost, once; none for a
        layer never called) and raises its ``problem`` on this rank alone, here."""
        if getattr(_construction, "local", False):
            if problem is not None:
                raise problem
            self._arguments_to_agree = dict(arguments)
            return
        agree_on_arguments(type(self).__name__, arguments, problem, self.tp_group, self.tp_size)

    def _agree_on_input(self, x, problem: Optional[BaseException], **facts) -> None:
        """At the start of ``forward``: the tensor-parallel ranks agree on the input ``x``'s
        shape and dtype (and ``facts``), and this rank's ``problem`` (its input check's error)
        is raised on every rank (see
        :func:`~shardkit.nn.model_parallel.agreement.agree_on_input`: in the collective debug
        mode one all-gather of 16 int64s per rank, not counted by ``CommCounter``; none at
        size 1 or with the mode off). First, for a layer built in :func:`local_construction`,
        at its first forward only: the ranks' agreement on its arguments (see
        :meth:`_agree_on_arguments`)."""
        if self._arguments_to_agree is not None:
            agree_on_arguments(type(self).__name__, self._arguments_to_agree, None,
                               self.tp_group, self.tp_size)
            self._arguments_to_agree = None  # agreed: not again (a failed one is asked again)
        agree_on_input(f"{type(self).__name__}.forward", {**activation_facts(x), **facts},
                       problem, self.tp_group, self.tp_size)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise the parameters again, as the constructor did: the full weight drawn with
        ``init_method`` from the default generator (the weight's device's), this rank keeping
        its slice; the bias zero. After the same seed on every tensor-parallel rank the slices
        form the weight ``init_method`` gives the unsplit layer, the same values and the same
        draws as constructing the layer, so that a model built under ``torch.device("meta")``,
        then ``to_empty(device=...)`` and each module's ``reset_parameters()`` (torch FSDP's
        and shardkit FSDP's default materialization), holds what an eagerly built one does.
        In place: the parameter objects stay. No communication; memory: the full weight while
        it runs (kept as ``master_weight`` with ``keep_master_weight_for_test``).

        Raises ``RuntimeError`` for a layer loaded with ``torch.load`` whose ``init_method``
        could not be pickled."""
        if self.init_method is None:
            raise RuntimeError(
                f"{type(self).__name__}.reset_parameters: this layer has no init_method (it was "
                f"unpickled, and its init_method, a closure or lambda, could not be pickled); "
                f"set layer.init_method to the initialiser first")
        master = self._draw_master(self._full_shape("weight"), self.weight.device)
        self.weight.copy_(self._split(master, "weight"))
        bias = getattr(self, "bias", None)
        if bias is not None:
            bias.zero_()
        if self.master_weight is not None:
            self.master_weight = master

    def _mark(self, name: str, param: nn.Parameter) -> None:
        """Tag ``param`` with this layer's groups and, when split, Megatron's
        ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride`` (as its
        ``set_tensor_model_parallel_attributes``; read by
        :func:`~shardkit.nn.model_parallel.clip_grad_norm` and the full-state helpers)."""
        param.model_parallel_groups = self.model_parallel_groups
        spec = self._shard_dims[name]
        if spec is not None:
            param.tensor_model_parallel = True
            # the split travels with the weight: a copy tied into another pipeline stage's
            # module (a GPT's output head) is joined and split without this layer
            param.partition_dim, param.partition_stride = spec

    def _split(self, full: torch.Tensor, name: str) -> torch.Tensor:
        spec = self._shard_dims[name]
        if spec is None:
            return full.clone()
        dim, stride = spec
        return shard_of(full, self.tp_rank, self.tp_size, dim, stride)

    def _param_from_master(self, name: str, master: torch.Tensor) -> nn.Parameter:
        param = nn.Parameter(self._split(master, name))
        self._mark(name, param)
        return param

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit parameters (keys and shapes of the plain torch layer). Collective over the
        tensor-parallel group: one all-gather per sharded parameter (``(n-1)/n`` of its full
        bytes); the result costs the full size on every rank."""
        return {name: self._join(name, param)
                for name, param in self.named_parameters(recurse=False)}

    @torch.no_grad()
    def _join(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The unsplit value of parameter ``name`` from this rank's ``local`` slice of it (a new
        tensor). Collective over the tensor-parallel group for a split parameter (one
        all-gather, ``(n-1)/n`` of the full bytes); a copy for a replicated one."""
        spec = self._shard_dims[name]
        if spec is None:
            return local.detach().clone()
        return join_over_tensor_group(local, spec[0], spec[1], self.tp_group, self.tp_size)

    def full_weight(self) -> torch.Tensor:
        """The unsplit weight (collective; see :meth:`full_state_dict`)."""
        return self.full_state_dict()["weight"]

    def get_master_weight(self) -> torch.Tensor:
        """FairScale's name for :meth:`full_weight` (collective). With ``stride > 1`` the rows
        come in the unsplit layer's order, where FairScale's are rank-major."""
        return self.full_weight()

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load unsplit parameters (e.g. an ``nn.Linear``'s state dict) by keeping this rank's
        slice. No communication. Strict, as ``nn.Module.load_state_dict``: a missing or
        unexpected key (a bias for a ``bias=False`` layer) raises ``KeyError``, a wrong shape
        ``ValueError``, before any parameter is written."""
        own = [name for name, _ in self.named_parameters(recurse=False)]
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise KeyError(f"{type(self).__name__}.load_full_state_dict: missing key(s) {missing}, "
                           f"unexpected key(s) {unexpected}; expected exactly {sorted(own)}")
        for name in own:
            self._check_full_shape(name, state_dict[name])
        for name in own:
            self._load_full_param(name, state_dict[name])

    def load_full_weight(self, weight: torch.Tensor) -> None:
        """Load an unsplit weight by keeping this rank's slice (no communication)."""
        self._load_full_param("weight", weight)

    def _check_full_shape(self, name: str, full: torch.Tensor) -> None:
        expected = self._full_shape(name)
        if tuple(full.shape) != expected:
            raise ValueError(f"{type(self).__name__}: unsplit {name!r} has shape "
                             f"{tuple(full.shape)}; the unsplit layer's is {expected}")

    @torch.no_grad()
    def _load_full_param(self, name: str, full: torch.Tensor) -> None:
        self._check_full_shape(name, full)
        param = getattr(self, name)
        param.copy_(self._split(full.detach().to(param.device, param.dtype), name))

    def _full_shape(self, name: str) -> tuple[int, ...]:
        param = getattr(self, name)
        shape = list(param.shape)
        spec = self._shard_dims[name]
        if spec is not None:
            shape[spec[0]] *= self.tp_size
        return tuple(shape)


@torch.no_grad()
def join_over_tensor_group(local: torch.Tensor, dim: int, stride: int, group,
                           size: int) -> torch.Tensor:
    """The unsplit tensor whose slice along ``dim`` (``stride`` blocks per rank, see
    :func:`~shardkit.nn.model_parallel.utils.shard_of`) this rank of the ``size`` ranks of
    tensor-parallel ``group`` holds as ``local``; a new tensor. Collective over ``group``: one
    all-gather, ``(n-1)/n`` of the full bytes (a copy, no communication, at size 1)."""
    if size == 1:
        return local.detach().clone()
    flat = torch.empty(size * local.numel(), dtype=local.dtype, device=local.device)
    distributed.all_gather_into_tensor(flat, local.detach().reshape(-1), group=group)
    shards = flat.view((size,) + tuple(local.shape)).unbind(0)
    return join_shards(list(shards), dim=dim, stride=stride)


def _refuse_unbound_layer(module: "TensorParallelModule", args) -> None:
    """Forward pre-hook of an unpickled layer: a clear error while it has no groups."""
    if module.tp_group is None:
        raise RuntimeError(
            f"{type(module).__name__} was loaded with torch.load from a pickled model, saved by "
            f"tensor-parallel rank {module.tp_rank} of {module.tp_size}; this process has no "
            f"matching groups. Call shardkit.nn.model_parallel.initialize_model_parallel("
            f"{module.tp_size}, ...) before torch.load on the rank that saved it, or save and "
            f"load state_dict() / full_state_dict() instead")


def deepcopy_keeping_parameter_marks(module: nn.Module, memo: dict) -> nn.Module:
    """``copy.deepcopy(module)`` for a ``__deepcopy__``: the process groups, which cannot be
    copied, are shared, and each copied parameter keeps its original's marks
    (``tensor_model_parallel``, ``sequence_parallel``, its groups), which
    ``nn.Parameter.__deepcopy__`` drops. No communication."""
    clone = type(module).__new__(type(module))
    memo[id(module)] = clone
    state = {key: value for key, value in module.__dict__.items() if key != "tp_group"}
    clone.__dict__.update(copy.deepcopy(state, memo))
    if "tp_group" in module.__dict__:
        clone.tp_group = module.tp_group
    for original, copied in zip(module.parameters(), clone.parameters()):
        for mark, value in original.__dict__.items():
            copied.__dict__.setdefault(mark, value)
    return clone


def _check_padding_idx(what: str, padding_idx, num_embeddings: int) -> None:
    """Raise ``ValueError`` unless ``padding_idx`` is ``None`` or in ``[-V, V)``. Local."""
    if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"{what}: padding_idx={padding_idx} is outside "
                         f"[-{num_embeddings}, {num_embeddings})")


def _padding_row(padding_idx, num_embeddings, problem: Optional[BaseException]):
    """The padding row the ranks compare: ``padding_idx`` as a row in ``[0, V)`` (``-1`` and
    ``V - 1`` are one row), as given where the arguments were refused. Local."""
    if padding_idx is None or problem is not None:
        return padding_idx
    return padding_idx % num_embeddings


def _check_size(what: str, value) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer >= 0 (a Python or NumPy int; torch's
    layers accept 0 and fail on a negative size with a message that names no argument). No
    communication."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{what}={value!r}; it must be an int >= 0")


def _check_init_method(what: str, init_method) -> None:
    """Raise ``TypeError`` unless ``init_method`` can be applied to the master weight (e.g.
    ``torch.nn.init.xavier_normal_``, not its name). No communication."""
    if not callable(init_method):
        raise TypeError(f"{what}: init_method={init_method!r} is not callable; pass an in-place "
                        f"initialiser such as torch.nn.init.xavier_normal_")


def _check_divisible(what: str, value: int, tp_size: int, stride: int = 1) -> None:
    _check_size(what, value)
    parts = tp_size * stride
    if value % parts:
        detail = (f"tensor-parallel size {tp_size}" if stride == 1
                  else f"tensor-parallel size {tp_size} × stride {stride} = {parts}")
        raise ValueError(f"{what}={value} is not divisible by {detail}; use a multiple of {parts}")


def _check_input_width(what: str, x: torch.Tensor, expected: int, meaning: str) -> None:
    """Raise ``ValueError`` before any collective unless ``x``'s last dimension is ``expected``
    (``meaning`` says why). No communication."""
    if x.dim() == 0 or x.shape[-1] != expected:
        raise ValueError(f"{what}: the input has shape {tuple(x.shape)}; its last dimension must "
                         f"be {expected} ({meaning})")


def _check_sequence_dim(what: str, ndim: int, sequence_dim: int) -> None:
    """Raise ``ValueError`` before any collective unless ``sequence_dim`` is a dimension of a
    sequence-parallel activation of ``ndim`` dimensions other than the last (the hidden one).
    No communication."""
    if not -ndim <= sequence_dim < ndim or sequence_dim % ndim == ndim - 1:
        raise ValueError(
            f"{what}: sequence_dim={sequence_dim} is not a sequence dimension of a "
            f"{ndim}-dimensional activation (the last one is the hidden dimension); pass "
            f"sequence_dim=0 for [seq, hidden] or [seq, batch, hidden] activations, 1 for "
            f"[batch, seq, hidden]")


def _check_flag(what: str, name: str, value) -> None:
    """Raise ``TypeError`` unless ``value`` is a ``bool`` (a string such as ``"no"`` would be
    truthy). No communication."""
    if not isinstance(value, bool):
        raise TypeError(f"{what}: {name}={value!r} ({type(value).__name__}); it must be a bool, "
                        f"True or False")


def _bias_for_skip_bias_add(bias: Optional[nn.Parameter]) -> Optional[torch.Tensor]:
    """The bias a ``skip_bias_add=True`` layer returns beside its output. With grad enabled,
    the parameter itself, not a copy: the caller's add must put its gradient on the parameter
    (the one ``reduce_sequence_parallel_grads`` sums when marked ``sequence_parallel``).
    Without grad (``torch.no_grad()``, or the first forward of a reentrant activation
    checkpoint, torch's ``use_reentrant=True`` or DeepSpeed's), a detached alias of it: the
    same memory, but a tensor of its own. The reentrant checkpoint's autograd function would
    otherwise make the parameter itself its output, giving it that function's backward as
    ``grad_fn``; the backward, recomputing, then ran through the parameter into itself again,
    without end."""
    if bias is None or torch.is_grad_enabled():
        return bias
    return bias.detach()


def _skip_bias_add_repr(layer: nn.Module) -> str:
    """``", skip_bias_add=True"`` for :meth:`extra_repr` when set; nothing by default."""
    return ", skip_bias_add=True" if layer.skip_bias_add else ""


def _master(shape: tuple[int, ...], init_method: InitMethod,
            device: Optional[torch.device] = None) -> torch.Tensor:
    weight = torch.empty(shape, dtype=torch.get_default_dtype(), device=device)
    init_method(weight)
    return weight


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - whatever pickling raised: it cannot travel
        return False
    return True


@torch.no_grad()
def _initialize_affine_weight(weight: torch.Tensor, out_features: int, in_features: int,
                              per_partition_size: int, partition_dim: int,
                              init_method: InitMethod, stride: int = 1,
                              return_master_weight: bool = False) -> Optional[torch.Tensor]:
    """FairScale's helper: fill ``weight`` (this rank's ``per_partition_size`` slice along
    ``partition_dim``, 0 for a column-parallel ``[out, in]`` weight, 1 for a row-parallel one)
    with its part of a full ``[out_features, in_features]`` master weight initialised by
    ``init_method`` from the default generator, as the layers do. With ``stride > 1`` the rank
    keeps blocks ``rank, rank + n, ...`` of ``stride * n``. Returns the master weight when
    ``return_master_weight`` (``weight`` itself at tensor-parallel size 1, as FairScale), else
    ``None``. Uses the current tensor-parallel group's size and rank; no communication. Memory:
    the full master weight while it runs.

    Raises ``ValueError`` (before drawing anything) when ``per_partition_size`` times the
    tensor-parallel size is not the master weight's size along ``partition_dim``, or when
    ``weight`` does not have the slice's shape.
    """
    groups = current_groups("_initialize_affine_weight")
    world = len(groups.tensor_ranks)
    if partition_dim not in (0, 1):
        raise ValueError(f"_initialize_affine_weight: partition_dim={partition_dim!r}; it must "
                         f"be 0 (column-parallel) or 1 (row-parallel)")
    full = (out_features, in_features)
    if per_partition_size * world != full[partition_dim]:
        raise ValueError(f"_initialize_affine_weight: per_partition_size={per_partition_size} "
                         f"× tensor-parallel size {world} != {full[partition_dim]}, the master "
                         f"weight's size along partition_dim={partition_dim}")
    local = list(full)
    local[partition_dim] = per_partition_size
    if tuple(weight.shape) != tuple(local):
        raise ValueError(f"_initialize_affine_weight: weight has shape {tuple(weight.shape)}; "
                         f"this rank's slice of the [{out_features}, {in_features}] master "
                         f"weight is {tuple(local)}")
    if world == 1:
        init_method(weight)
        return weight if return_master_weight else None
    master = torch.empty(full, dtype=weight.dtype)
    init_method(master)
    weight.copy_(shard_of(master, groups.tensor_rank, world, partition_dim, stride))
    return master if return_master_weight else None


class ColumnParallelLinear(TensorParallelModule):
    """``y = x A^T + b`` with ``A`` split by rows (output features) over the tensor-parallel group.

    Args:
        in_features, out_features: the unsplit layer's sizes (``out_features`` must divide by
            ``n * stride``).
        bias: add a bias (split like the output; starts at zero).
        gather_output: all-gather the output so every rank has all ``out_features``; ``False``
            leaves ``out_features / n`` per rank for a following :class:`RowParallelLinear`.
        init_method: in-place initialiser applied to the full ``[out, in]`` master weight.
        stride: interleave the split (``3`` for a fused q/k/v projection: each rank keeps its
            heads of q, of k and of v).
        keep_master_weight_for_test: keep the full initial weight as ``self.master_weight``.
        sequence_parallel: the input is split along ``sequence_dim``; all-gather it first
            (backward: reduce-scatter of the input gradient) instead of the identity/all-reduce.
        sequence_dim: the sequence dimension of the input (1 for ``[batch, seq, hidden]``).
        skip_bias_add: Megatron-LM's flag. ``False`` (default): ``forward`` returns the output
            tensor, bias added. ``True``: it returns ``(output, bias)`` with the bias not added,
            for the caller to fuse ``output + bias`` into the next op (bias-GeLU). The bias is
            this rank's ``out_features / n`` slice (the parameter itself) when ``gather_output``
            is ``False``, and all ``out_features`` (all-gathered, so each slice gets its part of
            the gradient back) when it is ``True``; ``None`` for ``bias=False``.

    Memory: ``(in * out / n + out / n)`` parameters per rank. Communication: backward all-reduce
    of the input gradient (``2(n-1)/n`` of its bytes), or with ``sequence_parallel`` an
    all-gather forward and a reduce-scatter backward of the input; plus an all-gather of the
    output forward when ``gather_output``. ``skip_bias_add`` changes neither, except that with
    ``gather_output`` the returned bias is all-gathered too (``out`` more elements forward, a
    ``1/n`` slice kept backward, no communication) and costs its full size per rank while used.
    Plus the ranks' agreement (module docstring): on the arguments once at construction, and in
    the collective debug mode on the input's shape and dtype at each forward (16 int64s per
    rank each, not counted by ``CommCounter``).
    """

    _shard_dims = {"weight": (0, 1), "bias": (0, 1)}
    # the default for a layer pickled before the flag existed: it adds its bias
    skip_bias_add = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = True, init_method: InitMethod = nn.init.xavier_normal_,
                 stride: int = 1, keep_master_weight_for_test: bool = False,
                 sequence_parallel: bool = False, sequence_dim: int = SEQUENCE_DIM, *,
                 skip_bias_add: bool = False):
        super().__init__("ColumnParallelLinear")
        try:
            if not isinstance(stride, int) or stride < 1:
                raise ValueError(f"ColumnParallelLinear: stride={stride!r}; it must be an int "
                                 f">= 1")
            for name, flag in (("gather_output", gather_output),
                               ("skip_bias_add", skip_bias_add),
                               ("sequence_parallel", sequence_parallel)):
                _check_flag("ColumnParallelLinear", name, flag)
            _check_size("ColumnParallelLinear: in_features", in_features)
            _check_divisible("ColumnParallelLinear: out_features", out_features, self.tp_size,
                             stride)
            _check_init_method("ColumnParallelLinear", init_method)
            problem = None
        except Exception as error:  # raised on every rank, after the agreement
            problem = error
        self._agree_on_arguments(problem, in_features=in_features, out_features=out_features,
                                 bias=bias, gather_output=gather_output, stride=stride,
                                 sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                                 skip_bias_add=skip_bias_add)
        self._shard_dims = {"weight": (0, stride), "bias": (0, stride)}
        self.in_features, self.out_features = in_features, out_features
        self.output_size_per_partition = out_features // self.tp_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self.init_method = init_method
        master = self._draw_master((out_features, in_features))
        self.weight = self._param_from_master("weight", master)
        self.bias = (self._param_from_master("bias", torch.zeros(out_features)) if bias
                     else None)
        self.master_weight = master if keep_master_weight_for_test else None

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, OutputAndBias]:
        """The output (``[..., out_features]``, or this rank's ``out_features / n`` without
        ``gather_output``); with ``skip_bias_add``, ``(output, bias)`` with the bias not added.
        First the tensor-parallel ranks agree on ``x``'s shape and dtype (see the class)."""
        problem = local_problem(_check_input_width, "ColumnParallelLinear", x, self.in_features,
                                "in_features")
        if problem is None and self.sequence_parallel:
            problem = local_problem(_check_sequence_dim, "ColumnParallelLinear", x.dim(),
                                    self.sequence_dim)
        self._agree_on_input(x, problem)
        if self.sequence_parallel:
            x = _gather_from_sequence_region(x, self.sequence_dim, self.tp_group)
        else:
            x = _copy_to_region_of_own_linear(x, self.tp_group)
        y = F.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        if self.gather_output:
            y = self._gather_out_features(y)
        if not self.skip_bias_add:
            return y
        return y, self._bias_for_caller()

    def _gather_out_features(self, local: torch.Tensor) -> torch.Tensor:
        """All ranks' ``out_features`` slices of ``local``'s last dimension, in the unsplit
        order (an all-gather; backward keeps this rank's slice of the gradient)."""
        return _gather_from_region(local, self._shard_dims["weight"][1], self.tp_group)

    def _bias_for_caller(self) -> Optional[torch.Tensor]:
        """The bias matching the output that ``forward`` returns with ``skip_bias_add``: the
        parameter itself beside a split output; beside a gathered one, the gathered bias, whose
        backward hands each rank the gradient of its own slice."""
        if self.bias is None or not self.gather_output:
            return _bias_for_skip_bias_add(self.bias)
        return self._gather_out_features(self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.output_size_per_partition} on this rank), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
                f"{_skip_bias_add_repr(self)}")


class RowParallelLinear(TensorParallelModule):
    """``y = x A^T + b`` with ``A`` split by columns (input features) over the tensor-parallel
    group; the partial products are summed across ranks.

    Args:
        in_features, out_features: the unsplit layer's sizes (``in_features`` must divide by n).
        bias: add a bias (replicated, added once after the sum; starts at zero).
        input_is_parallel: the input already holds this rank's ``in_features / n`` slice (the
            output of a ``ColumnParallelLinear(gather_output=False)`` of the same ``stride``);
            otherwise it is sliced here, the same blocks as the weight's columns (backward:
            all-gather of the input gradient).
        init_method: in-place initialiser applied to the full ``[out, in]`` master weight.
        stride, keep_master_weight_for_test: as in :class:`ColumnParallelLinear`.
        sequence_parallel: reduce-scatter the output along ``sequence_dim`` instead of
            all-reducing it (requires ``input_is_parallel``); the bias is then marked
            ``sequence_parallel`` (see
            :func:`~shardkit.nn.model_parallel.reduce_sequence_parallel_grads`).
        skip_bias_add: Megatron-LM's flag. ``False`` (default): ``forward`` returns the output
            tensor, bias added. ``True``: it returns ``(output, bias)``, the summed (or, with
            ``sequence_parallel``, reduce-scattered) output without the bias and the replicated
            bias parameter itself (``None`` for ``bias=False``), for the caller to add after the
            reduction, fused with the next op (bias-dropout-add). With ``sequence_parallel`` the
            caller adds it to this rank's sequence slice, so its gradient still needs
            :func:`~shardkit.nn.model_parallel.reduce_sequence_parallel_grads`, exactly as without
            the flag.

    Memory: ``in * out / n + out`` parameters per rank. Communication: forward all-reduce of the
    output (``2(n-1)/n`` of its bytes), or with ``sequence_parallel`` a reduce-scatter forward and
    an all-gather backward (``(n-1)/n`` each). ``skip_bias_add`` changes neither. Plus the
    ranks' agreement (module docstring): on the arguments once at construction, in the collective
    debug mode on the input's shape and dtype at each forward (16 int64s per rank each, not
    counted by ``CommCounter``).
    """

    _shard_dims = {"weight": (1, 1), "bias": None}
    # the default for a layer pickled before the flag existed: it adds its bias
    skip_bias_add = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = False, init_method: InitMethod = nn.init.xavier_normal_,
                 stride: int = 1, keep_master_weight_for_test: bool = False,
                 sequence_parallel: bool = False, sequence_dim: int = SEQUENCE_DIM, *,
                 skip_bias_add: bool = False):
        super().__init__("RowParallelLinear")
        try:
            if not isinstance(stride, int) or stride < 1:
                raise ValueError(f"RowParallelLinear: stride={stride!r}; it must be an int >= 1")
            for name, flag in (("input_is_parallel", input_is_parallel),
                               ("skip_bias_add", skip_bias_add),
                               ("sequence_parallel", sequence_parallel)):
                _check_flag("RowParallelLinear", name, flag)
            _check_divisible("RowParallelLinear: in_features", in_features, self.tp_size, stride)
            _check_size("RowParallelLinear: out_features", out_features)
            _check_init_method("RowParallelLinear", init_method)
            if sequence_parallel and not input_is_parallel:
                raise ValueError("RowParallelLinear: sequence_parallel=True needs "
                                 "input_is_parallel=True (the input must be the column-parallel "
                                 "output, split on the hidden dimension)")
            problem = None
        except Exception as error:  # raised on every rank, after the agreement
            problem = error
        self._agree_on_arguments(problem, in_features=in_features, out_features=out_features,
                                 bias=bias, input_is_parallel=input_is_parallel, stride=stride,
                                 sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                                 skip_bias_add=skip_bias_add)
        self._shard_dims = {"weight": (1, stride), "bias": None}
        self.in_features, self.out_features = in_features, out_features
        self.input_size_per_partition = in_features // self.tp_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self.init_method = init_method
        master = self._draw_master((out_features, in_features))
        self.weight = self._param_from_master("weight", master)
        self.bias = self._param_from_master("bias", torch.zeros(out_features)) if bias else None
        if self.bias is not None and sequence_parallel:
            mark_sequence_parallel(self.bias)
        self.master_weight = master if keep_master_weight_for_test else None

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, OutputAndBias]:
        """The summed output ``[..., out_features]`` (this rank's sequence slice with
        ``sequence_parallel``); with ``skip_bias_add``, ``(output, bias)``, bias not added.
        First the tensor-parallel ranks agree on ``x``'s shape and dtype (see the class)."""
        if self.input_is_parallel:
            problem = local_problem(
                _check_input_width, "RowParallelLinear", x, self.input_size_per_partition,
                f"input_is_parallel=True: this rank's slice, in_features={self.in_features} / "
                f"tensor-parallel size {self.tp_size}; pass input_is_parallel=False for the "
                f"whole input")
        else:
            problem = local_problem(_check_input_width, "RowParallelLinear", x, self.in_features,
                                    "in_features, the whole input, as input_is_parallel=False")
        if problem is None and self.sequence_parallel:
            problem = local_problem(_check_sequence_dim, "RowParallelLinear", x.dim(),
                                    self.sequence_dim)
        self._agree_on_input(x, problem)
        if not self.input_is_parallel:
            x = _scatter_to_region(x, self._shard_dims["weight"][1], self.tp_group)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = _reduce_scatter_to_sequence_region(partial, self.sequence_dim, self.tp_group)
        else:
            y = _reduce_from_region_of_own_output(partial, self.tp_group)
        if self.skip_bias_add:
            return y, _bias_for_skip_bias_add(self.bias)
        if self.bias is None:
            return y
        # in the output's dtype, as nn.Linear adds it: under autocast an fp32 bias would
        # otherwise promote the bf16/fp16 output (twice the activation memory downstream)
        # in place: y is the layer's own sum (or at size 1 its own F.linear output), which no
        # backward reads
        return y.add_(self.bias.to(y.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.input_size_per_partition} on this rank), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}{_skip_bias_add_repr(self)}")


class VocabParallelEmbedding(TensorParallelModule):
    """An embedding table split by rows (vocabulary) over the tensor-parallel group.

    Rank ``r`` holds rows ``[r*V/n, (r+1)*V/n)``; tokens outside its range look up zeros, and the
    partial results are summed across ranks.

    Args:
        num_embeddings: vocabulary size ``V`` (must divide by n).
        embedding_dim: width of each row.
        padding_idx, max_norm, norm_type, sparse: as ``nn.Embedding`` (``padding_idx`` row
            starts at zero and gets no gradient; ``max_norm`` renormalises only looked-up rows).
        scale_grad_by_freq: as ``nn.Embedding``: each row's gradient is divided by how often
            its token occurs in the batch (every rank sees the whole batch, so the count is
            the unsplit layer's). Not with ``sparse=True`` (a ValueError here; torch's
            backward refuses that pair).
        init_method: in-place initialiser applied to the full ``[V, dim]`` master weight.
        keep_master_weight_for_test: keep the full initial weight as ``self.master_weight``.
        sequence_parallel: reduce-scatter the output along ``sequence_dim`` (each rank keeps
            ``1/n`` of the sequence) instead of all-reducing it.

    Memory: ``V * dim / n`` per rank. Communication: forward all-reduce of the output
    (``2(n-1)/n`` of its bytes), or a reduce-scatter with ``sequence_parallel``; backward none.
    Plus the ranks' agreement (module docstring): on the arguments once at construction, in the
    collective debug mode on the ids' shape at each forward (16 int64s per rank each, not
    counted by ``CommCounter``).
    """

    _shard_dims = {"weight": (0, 1)}

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False,
                 init_method: InitMethod = nn.init.xavier_normal_,
                 keep_master_weight_for_test: bool = False, sequence_parallel: bool = False,
                 sequence_dim: int = SEQUENCE_DIM):
        super().__init__("VocabParallelEmbedding")
        try:
            _check_flag("VocabParallelEmbedding", "scale_grad_by_freq", scale_grad_by_freq)
            _check_flag("VocabParallelEmbedding", "sparse", sparse)
            _check_flag("VocabParallelEmbedding", "sequence_parallel", sequence_parallel)
            _check_not_sparse_and_scaled("VocabParallelEmbedding", scale_grad_by_freq, sparse)
            _check_divisible("VocabParallelEmbedding: num_embeddings (vocabulary)",
                             num_embeddings, self.tp_size)
            _check_size("VocabParallelEmbedding: embedding_dim", embedding_dim)
            _check_init_method("VocabParallelEmbedding", init_method)
            _check_padding_idx("VocabParallelEmbedding", padding_idx, num_embeddings)
            problem = None
        except Exception as error:  # raised on every rank, after the agreement
            problem = error
        self._agree_on_arguments(
            problem, num_embeddings=num_embeddings, embedding_dim=embedding_dim,
            padding_idx=_padding_row(padding_idx, num_embeddings, problem), max_norm=max_norm,
            norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq, sparse=sparse,
            sequence_parallel=sequence_parallel, sequence_dim=sequence_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx % num_embeddings if padding_idx is not None else None
        self.max_norm, self.norm_type = max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        per_rank = num_embeddings // self.tp_size
        self.vocab_start_index = self.tp_rank * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        self.init_method = init_method
        master = self._draw_master((num_embeddings, embedding_dim))
        self.weight = self._param_from_master("weight", master)
        self.master_weight = master if keep_master_weight_for_test else None

    def _fix_master(self, master: torch.Tensor) -> None:
        """The padding row starts at zero, as ``nn.Embedding``'s."""
        if self.padding_idx is not None:
            master[self.padding_idx].zero_()

    @property
    def num_embeddings_per_partition(self) -> int:
        """Rows held by this rank, ``num_embeddings / n`` (FairScale's attribute)."""
        return self.vocab_end_index - self.vocab_start_index

    def _local_padding_idx(self) -> Optional[int]:
        if self.padding_idx is None:
            return None
        if self.vocab_start_index <= self.padding_idx < self.vocab_end_index:
            return self.padding_idx - self.vocab_start_index
        return None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``idx`` (``[..., embedding_dim]``; this rank's sequence slice with
        ``sequence_parallel``). First the tensor-parallel ranks agree on ``idx``'s shape (see
        the class)."""
        # an id outside [0, V) would look up zeros on every rank instead of failing
        problem = local_problem(check_indices, idx, self.num_embeddings,
                                "VocabParallelEmbedding: token id", "num_embeddings")
        if problem is None and self.sequence_parallel:  # the output has one more dimension
            problem = local_problem(_check_sequence_dim, "VocabParallelEmbedding",
                                    idx.dim() + 1, self.sequence_dim)
        self._agree_on_input(idx, problem)
        outside = (idx < self.vocab_start_index) | (idx >= self.vocab_end_index)
        local = (idx - self.vocab_start_index).masked_fill(outside, 0)
        if self.max_norm is not None:  # renormalise only the rows really looked up here
            with torch.no_grad():
                torch.embedding_renorm_(self.weight, local[~outside], self.max_norm,
                                        self.norm_type)
        if self.scale_grad_by_freq:
            partial = self._look_up_own_tokens_only(local, outside)
        else:
            partial = F.embedding(local, self.weight, self._local_padding_idx(), None,
                                  self.norm_type, False, self.sparse)
            # in place: F.embedding's backward does not read its output
            partial = partial.masked_fill_(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return _reduce_scatter_to_sequence_region(partial, self.sequence_dim, self.tp_group)
        return _reduce_from_region_of_own_output(partial, self.tp_group)

    def _look_up_own_tokens_only(self, local: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
        """This rank's partial output with ``scale_grad_by_freq``: only the tokens of its own
        rows are looked up, so each row's count is its token's count in the whole batch (the
        other ranks' tokens, parked on local row 0 by the default path, would inflate row 0's
        count). Memory: one more buffer of the looked-up rows' size."""
        own = ~outside
        partial = self.weight.new_zeros(*local.shape, self.embedding_dim)
        partial[own] = F.embedding(local[own], self.weight, self._local_padding_idx(), None,
                                   self.norm_type, True, self.sparse)
        return partial

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start_index}, "
                f"{self.vocab_end_index}) on this rank, sequence_parallel={self.sequence_parallel}")


def _check_not_sparse_and_scaled(what: str, scale_grad_by_freq, sparse) -> None:
    """Refuse ``scale_grad_by_freq=True`` with ``sparse=True`` at construction: torch's
    embedding backward has no sparse gradient scaled by frequency (``nn.Embedding`` with both
    fails in its first backward, "scale_grad_by_freq not supported with sparse gradients").
    Local."""
    if scale_grad_by_freq and sparse:
        raise ValueError(f"{what}: scale_grad_by_freq=True with sparse=True; "
                         "torch has no sparse gradient scaled by frequency (nn.Embedding with "
                         "both fails in backward); pass sparse=False to scale a dense "
                         "gradient, or scale_grad_by_freq=False")


def _full_row_norms(local: torch.Tensor, norm_type: float, group, tp_size: int) -> torch.Tensor:
    """Norms of whole rows of which each rank holds some columns: one all-reduce of one float
    per row (``norm_type > 0`` or inf)."""
    if norm_type == math.inf:
        norms = local.abs().amax(dim=-1)
        if tp_size > 1:
            distributed.all_reduce(norms, op=distributed.ReduceOp.MAX, group=group)
        return norms
    norms = local.abs().pow(norm_type).sum(dim=-1)
    if tp_size > 1:
        distributed.all_reduce(norms, group=group)
    return norms.pow(1.0 / norm_type)


class ParallelEmbedding(TensorParallelModule):
    """An embedding table split by columns (embedding dimension) over the tensor-parallel group;
    the output is all-gathered so every rank has full rows.

    Args: as :class:`VocabParallelEmbedding` (``embedding_dim`` must divide by n), without
    sequence parallelism; ``scale_grad_by_freq`` is supported (not with ``sparse=True``, a
    ValueError, as for :class:`VocabParallelEmbedding`). With ``max_norm``, each row looked
    up whose norm (over the whole row, all ranks' columns) exceeds ``max_norm`` is rescaled in
    place to ``max_norm``, as ``nn.Embedding`` does; ``norm_type`` must be positive (or inf).

    Memory: ``V * dim / n`` per rank. Communication: forward all-gather of the output
    (``(n-1)/n`` of its bytes), plus with ``max_norm`` an all-reduce of one float per distinct
    token id of the batch (the partial row norms); backward none. Plus the ranks' agreement
    (module docstring): on the arguments once at construction, in the collective debug mode on
    the ids' shape (and, with ``max_norm``, their number of distinct ids) at each forward (16
    int64s per rank each, not counted by ``CommCounter``).
    """

    _shard_dims = {"weight": (1, 1)}

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False,
                 init_method: InitMethod = nn.init.xavier_normal_,
                 keep_master_weight_for_test: bool = False):
        super().__init__("ParallelEmbedding")
        try:
            _check_size("ParallelEmbedding: num_embeddings", num_embeddings)
            _check_divisible("ParallelEmbedding: embedding_dim", embedding_dim, self.tp_size)
            _check_init_method("ParallelEmbedding", init_method)
            _check_flag("ParallelEmbedding", "scale_grad_by_freq", scale_grad_by_freq)
            _check_flag("ParallelEmbedding", "sparse", sparse)
            _check_not_sparse_and_scaled("ParallelEmbedding", scale_grad_by_freq, sparse)
            _check_padding_idx("ParallelEmbedding", padding_idx, num_embeddings)
            if max_norm is not None and not (norm_type > 0):
                raise ValueError(f"ParallelEmbedding: norm_type={norm_type} with max_norm is not "
                                 f"supported; use a positive norm_type (or math.inf)")
            problem = None
        except Exception as error:  # raised on every rank, after the agreement
            problem = error
        self._agree_on_arguments(
            problem, num_embeddings=num_embeddings, embedding_dim=embedding_dim,
            padding_idx=_padding_row(padding_idx, num_embeddings, problem), max_norm=max_norm,
            norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # non-negative, as nn.Embedding stores it
        self.padding_idx = padding_idx % num_embeddings if padding_idx is not None else None
        self.max_norm, self.norm_type = max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        self.init_method = init_method
        master = self._draw_master((num_embeddings, embedding_dim))
        self.weight = self._param_from_master("weight", master)
        self.master_weight = master if keep_master_weight_for_test else None

    def _fix_master(self, master: torch.Tensor) -> None:
        """The padding row starts at zero, as ``nn.Embedding``'s."""
        if self.padding_idx is not None:
            master[self.padding_idx].zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``idx`` (``[..., embedding_dim]``, all-gathered). First the
        tensor-parallel ranks agree on ``idx``'s shape (and, with ``max_norm``, on the number
        of distinct ids, the size of the norms' all-reduce; see the class)."""
        # before renormalising: a negative id would index the weight from its end
        problem = local_problem(check_indices, idx, self.num_embeddings,
                                "ParallelEmbedding: token id", "num_embeddings")
        rows = idx.unique() if self.max_norm is not None and problem is None else None
        facts = {} if rows is None else {"distinct token ids": rows.numel()}
        self._agree_on_input(idx, problem, **facts)
        if rows is not None:
            self._renormalise_rows(rows)
        local = F.embedding(idx, self.weight, self.padding_idx, None, self.norm_type,
                            self.scale_grad_by_freq, self.sparse)
        return _gather_from_region(local, 1, self.tp_group)

    @property
    def embedding_dim_per_partition(self) -> int:
        """Columns held by this rank, ``embedding_dim / n`` (FairScale's attribute)."""
        return self.embedding_dim // self.tp_size

    @torch.no_grad()
    def _renormalise_rows(self, rows: torch.Tensor) -> None:
        """``torch.embedding_renorm_`` of the distinct ids ``rows``, with each row's norm taken
        over all ranks' columns."""
        local = self.weight[rows]
        norms = _full_row_norms(local, self.norm_type, self.tp_group, self.tp_size)
        # the same scale as torch.embedding_renorm_, epsilon included
        scale = torch.where(norms > self.max_norm, self.max_norm / (norms + 1e-7), 1.0)
        self.weight.index_copy_(0, rows, local * scale.unsqueeze(-1))

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} "
                f"({self.embedding_dim // self.tp_size} columns on this rank)")
