"""Pipe: GPipe pipeline parallelism in one process, over several devices (FairScale's ``Pipe``)."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn as nn

from shardkit.nn.checkpoint import checkpointed_call
from shardkit.nn.pipe.batchnorm import (commit_deferred_batch_norms, convert_deferred_batch_norm,
                                        discard_deferred_batch_norms)
from shardkit.nn.pipe.microbatch import (as_tuple, chunk_microbatches, join_microbatches,
                                         own_microbatches)
from shardkit.nn.pipe.partition import check_balance, split_sequential
from shardkit.nn.pipe.skip import SkipTracker, use_skip_tracker, verify_skippables

__all__ = ["Pipe", "CHECKPOINT_MODES", "clock_cycles"]

CHECKPOINT_MODES = ("always", "except_last", "never")


def clock_cycles(num_microbatches: int, num_partitions: int) -> list[list[tuple[int, int]]]:
    """GPipe's forward order: at tick ``k`` micro-batch ``i`` runs on partition ``k - i``.

    Returns one list of ``(microbatch, partition)`` pairs per tick (``m + n - 1`` ticks).
    """
    return [[(k - j, j) for j in range(num_partitions) if 0 <= k - j < num_microbatches]
            for k in range(num_microbatches + num_partitions - 1)]


class _MicrobatchSkips(SkipTracker):
    """The skip table of one micro-batch, as one partition run sees it.

    The first forward takes stashed tensors from the micro-batch's shared table and remembers
    what it popped; a recomputation (after the first forward finished) ignores its stashes and
    gets the remembered pops, so it saves the same tensors as the first forward did.
    """

    def __init__(self, shared: SkipTracker, device: torch.device):
        super().__init__()
        self.shared = shared
        self.device = device
        self.replaying = False
        self.stashed_grad = False  # whether the first forward stashed a tensor needing grad

    def save(self, key, tensor):
        if not self.replaying:
            self.shared.save(key, tensor)
            self.stashed_grad |= isinstance(tensor, torch.Tensor) and tensor.requires_grad

    def load(self, key):
        if not self.replaying:
            tensor = self.shared.load(key)
            self.tensors[key] = tensor.to(self.device) if tensor is not None else None
        return self.tensors[key]


def _default_devices(count: int) -> list[torch.device]:
    if torch.cuda.is_available() and torch.cuda.device_count() >= count:
        return [torch.device("cuda", i) for i in range(count)]
    return [torch.device("cpu")] * count


def _coerce_chunks(chunks) -> int:
    """``int(chunks)`` as FairScale does (so ``4.0`` or ``"4"`` work), checked to be positive."""
    try:
        count = int(chunks)
    except (TypeError, ValueError):
        count = 0
    if isinstance(chunks, bool) or count < 1:
        raise ValueError(f"Pipe(chunks={chunks!r}): expected a positive int (micro-batches per "
                         f"mini-batch)")
    return count


_BALANCE_HINT = ("shardkit.nn.pipe.balance.balance_by_time or balance_by_size can propose "
                 "one")


def _check_pipe_balance(module: nn.Sequential, balance) -> list[int]:
    """``check_balance``, except that an empty Sequential with ``balance=[]`` is allowed."""
    if isinstance(module, nn.Sequential) and len(module) == 0 and \
            isinstance(balance, (list, tuple)) and len(balance) == 0:
        return []
    return check_balance(module, balance, "Pipe", hint=_BALANCE_HINT)


def _check_no_parameter_on_two_devices(stages: list, devices: list) -> None:
    """A parameter shared by partitions on different devices cannot live on both."""
    first_seen: dict[int, int] = {}
    for j, stage in enumerate(stages):
        for p in stage.parameters():
            i = first_seen.setdefault(id(p), j)
            if devices[i] != devices[j]:
                raise ValueError(f"Pipe: module with duplicate parameters on distinct devices is "
                                 f"not supported: a parameter of shape {tuple(p.shape)} is shared "
                                 f"by partitions {i} ({devices[i]}) and {j} ({devices[j]}); shared "
                                 f"parameters must sit on one device (adjust balance or devices)")


def _check_partition_output(out, j: int, last: bool) -> None:
    """A partition must return a tensor or a tuple of tensors: the next partition gets them
    on its device, and the last one's are concatenated along dim 0 (so they need one)."""
    values = as_tuple(out) if isinstance(out, (torch.Tensor, tuple, list)) else None
    if not values or not all(isinstance(t, torch.Tensor) for t in values):
        kinds = type(out).__name__ if values is None else [type(t).__name__ for t in values]
        raise TypeError(f"Pipe: partition {j} returned {kinds}; each partition must return a "
                        f"tensor or a tuple of tensors")
    if last and any(t.dim() == 0 for t in values):
        raise TypeError("Pipe: the last partition returned a 0-dim tensor; Pipe concatenates "
                        "the micro-batches' outputs along dim 0, so each output needs a batch "
                        "dimension (compute a scalar loss outside the Pipe)")


def _layer_key(key: str) -> str:
    """A state-dict key without its ``partitions.<i>.`` part where it has one."""
    parts = key.split(".", 2)
    if len(parts) == 3 and parts[0] == "partitions" and parts[1].isdigit():
        return parts[2]
    return key


def _version(t: torch.Tensor):
    """A tensor's in-place version counter (None for inference tensors, which have none)."""
    return None if t.is_inference() else t._version


def _needs_backward(partition: nn.Module, inputs: tuple, out, skips: _MicrobatchSkips) -> bool:
    """Whether a partition's forward may have recorded anything for backward, i.e. whether its
    checkpoint could ever be recomputed: some input, parameter, popped or stashed skip tensor
    or output requires grad. When none does, autograd holds nothing of the region."""
    outputs = as_tuple(out) if isinstance(out, (torch.Tensor, tuple, list)) else ()
    tensors = (*inputs, *outputs, *skips.tensors.values())
    return skips.stashed_grad or any(isinstance(t, torch.Tensor) and t.requires_grad
                                     for t in tensors) or \
        any(p.requires_grad for p in partition.parameters())


def _moving_denied(call: str) -> TypeError:
    return TypeError(f"Pipe.{call}: denied, Pipe places each partition on its own device "
                     f"(devices=...); build the Pipe with the devices you want instead")


class Pipe(nn.Module):
    """Run an ``nn.Sequential`` as a GPipe pipeline over ``devices`` in one process.

    The Sequential is cut by ``balance`` into partitions (partition ``j`` on ``devices[j]``; all
    ``"cpu"`` is valid). Each forward splits the batch into ``chunks`` micro-batches along dim 0
    and runs them in GPipe's clock order (micro-batch ``i`` on partition ``j`` at tick ``i+j``);
    the outputs are concatenated on the last device. Backward follows the autograd graph of the
    same micro-batches, so gradients equal those of the unsplit Sequential.

    The partitions are ``self.partitions``, a registered ``nn.ModuleList`` of ``nn.Sequential``
    keeping the layers' names, so parameter names and state-dict keys are FairScale's
    (``partitions.<j>.<layer name>.<param>``) and a FairScale Pipe checkpoint loads, as does
    one saved by a Pipe of another ``balance`` or by the plain Sequential (keys renamed to the
    partition holding each layer; a plain Sequential loads this Pipe's state dict with each
    key's ``partitions.<j>.`` dropped). ``len``,
    indexing and iteration see the original layers in order.

    Args:
        module: the ``nn.Sequential`` to pipeline (its layers are moved onto ``devices``). An
            empty Sequential (with ``balance=[]``) is the identity. The same layer object twice
            is refused (``ValueError``): it would run only once; so is a parameter shared by
            partitions on different devices.
        balance: number of layers of each partition; must sum to ``len(module)`` (required:
            ``ValueError`` when missing; :mod:`shardkit.nn.pipe.balance` can propose one).
        devices: one device per partition (``IndexError`` when there are fewer); default:
            ``cuda:0..`` when there are enough GPUs, else ``"cpu"`` for every partition
            (FairScale: every visible GPU, none on a CPU-only machine).
        chunks: number of micro-batches, taken as ``int(chunks)``. The batch is cut as
            FairScale's Pipe cuts it (``torch.chunk``): micro-batches of ``ceil(rows /
            chunks)`` samples, the last smaller, so fewer than ``chunks`` where the rows run
            out (10 rows, ``chunks=4``: 3, 3, 3, 1; 6 rows: 2, 2, 2); a batch smaller than
            ``chunks`` runs as one micro-batch per sample.
        checkpoint: taken as ``str(checkpoint)``: ``"always"`` (recompute every micro-batch in
            backward), ``"except_last"`` (all but the last, whose backward comes first) or
            ``"never"``. Only in training mode with grad enabled. A checkpointed partition
            that changes its input in place (``nn.ReLU(inplace=True)`` first) is a
            ``RuntimeError`` at forward naming the partition when a gradient flows through it
            (an input, parameter or skip tensor requires grad): its recomputation would read
            the changed value. One through which no gradient flows (an in-place first layer
            alone in its partition, on a batch that needs no gradient) is never recomputed
            and runs as in the plain Sequential.
        deferred_batch_norm: replace BatchNorms by :class:`~shardkit.nn.pipe.DeferredBatchNorm`
            (holding the BatchNorms' own parameters and buffers, as FairScale's), whose running
            statistics are updated once per mini-batch, as if it were unsplit (a forward that
            raises leaves them as they were).

    Memory: each device holds its partition's parameters; activations of the micro-batches
    in flight, and for checkpointed micro-batches only each partition's inputs. Communication:
    one device-to-device copy of each micro-batch's activations per partition boundary (none
    between partitions on the same device).

    ``.cuda()``, ``.cpu()`` and ``.to(device)`` raise ``TypeError`` (``devices`` would go stale);
    ``.to(dtype)`` works.

    Usage::

        model = Pipe(nn.Sequential(a, b, c, d), balance=[2, 2], devices=["cpu", "cpu"], chunks=4)
        model(x).sum().backward()
    """

    def __init__(self, module: nn.Sequential, balance: Optional[Sequence[int]] = None,
                 devices: Optional[Sequence[Union[str, int, torch.device]]] = None,
                 chunks: int = 1, checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False):
        super().__init__()
        chunks, checkpoint = _coerce_chunks(chunks), str(checkpoint)
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"Pipe(checkpoint={checkpoint!r}): checkpoint is not one of "
                             f"'always', 'except_last', or 'never'")
        if balance is None:
            raise ValueError(f"Pipe(balance=None): balance is required, a list with the number "
                             f"of layers of each partition ({_BALANCE_HINT})")
        parts = _check_pipe_balance(module, balance)
        devices = _default_devices(len(parts)) if devices is None else \
            [torch.device(d) for d in devices]
        if len(devices) < len(parts):
            raise IndexError(f"Pipe(devices={[str(d) for d in devices]}): {len(parts)} partitions "
                             f"(balance={parts}) need at least {len(parts)} devices")
        verify_skippables(module)
        if deferred_batch_norm:
            convert_deferred_batch_norm(module)
        self.balance = parts
        self.devices = devices[:len(parts)]
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norm = deferred_batch_norm
        stages = split_sequential(module, parts) if parts else []
        _check_no_parameter_on_two_devices(stages, self.devices)
        # Registered: parameter names and state-dict keys are FairScale's `partitions.<j>.<name>`.
        self.partitions = nn.ModuleList(p.to(d) for p, d in zip(stages, self.devices))
        self._register_load_state_dict_pre_hook(self._keys_of_this_balance)

    def _keys_of_this_balance(self, state_dict, prefix, *_) -> None:
        """Before loading: keys saved by a Pipe of another ``balance``
        (``partitions.<i>.<layer>...``) or by the plain Sequential (``<layer>...``) renamed to
        this Pipe's ``partitions.<j>.<layer>...``, ``j`` the partition holding that layer; a
        key this Pipe has, or naming no layer of it, stays as it is (and is reported as
        unexpected as usual)."""
        partition_of = {name: j for j, partition in enumerate(self.partitions)
                        for name in partition._modules}
        for key in [k for k in state_dict if k.startswith(prefix)]:
            layer_key = _layer_key(key[len(prefix):])
            j = partition_of.get(layer_key.split(".", 1)[0])
            renamed = f"{prefix}partitions.{j}.{layer_key}"
            if j is not None and renamed != key and renamed not in state_dict:
                state_dict[renamed] = state_dict.pop(key)

    def __len__(self) -> int:
        return sum(len(p) for p in self.partitions)

    def __getitem__(self, index: int) -> nn.Module:
        return list(self)[index]

    def __iter__(self):
        for partition in self.partitions:
            yield from partition

    def cuda(self, device=None):
        """Refused: Pipe places each partition on its device; moving them all would leave
        ``devices`` wrong. Raises ``TypeError``."""
        raise _moving_denied("cuda()")

    def cpu(self):
        """Refused, as :meth:`cuda`. Raises ``TypeError``."""
        raise _moving_denied("cpu()")

    def to(self, *args, **kwargs):
        """``to(dtype)`` converts every partition in place; ``to(device)`` and ``to(tensor)``
        raise ``TypeError`` (Pipe owns the placement of its partitions)."""
        if "device" in kwargs or "tensor" in kwargs or (
                args and isinstance(args[0], (torch.device, int, str, torch.Tensor))):
            raise _moving_denied("to(device)")
        return super().to(*args, **kwargs)

    def _checkpoint_stop(self, num_microbatches: int) -> int:
        if not (self.training and torch.is_grad_enabled()):
            return 0
        return {"always": num_microbatches, "except_last": num_microbatches - 1,
                "never": 0}[self.checkpoint]

    def forward(self, *inputs):
        """Run the pipeline on a batch: a tensor, or a tuple of tensors with one batch size
        (several positional tensors are taken as that tuple). As in ``nn.Sequential``, each
        layer gets its predecessor's output (a tensor or a tuple) as its one argument. The
        batch is cut as ``torch.chunk`` cuts it (see ``chunks``); an empty Pipe returns its
        input; an empty batch (dim 0 of size 0) runs as one empty micro-batch."""
        if not inputs:
            raise TypeError("Pipe.forward: expected a tensor or a tuple of tensors, got no "
                            "input")
        packed = len(inputs) > 1 or isinstance(inputs[0], (tuple, list))
        original = inputs if len(inputs) > 1 else inputs[0]
        inputs = as_tuple(inputs[0]) if len(inputs) == 1 and \
            isinstance(inputs[0], (torch.Tensor, tuple, list)) else inputs
        if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise TypeError(f"Pipe.forward: expected a tensor or a tuple of tensors, got "
                            f"{[type(t).__name__ for t in inputs]}")
        if not self.partitions:
            return original
        batches = chunk_microbatches(inputs, self.chunks, "Pipe.forward")
        activations = own_microbatches(batches, torch.is_grad_enabled(), self.devices[0])
        skips = [SkipTracker() for _ in batches]
        packed = [packed] * len(batches)  # whether micro-batch i's activation is a tuple
        stop = self._checkpoint_stop(len(batches))
        try:
            for tick in clock_cycles(len(batches), len(self.partitions)):
                for i, j in tick:
                    out = self._run_partition(j, activations[i], packed[i], skips[i],
                                              checkpointed=i < stop)
                    _check_partition_output(out, j, last=j == len(self.partitions) - 1)
                    packed[i] = not isinstance(out, torch.Tensor)
                    activations[i] = as_tuple(out)
        except BaseException:
            if self.deferred_batch_norm:  # the failed batch must not reach the next one's stats
                discard_deferred_batch_norms(self)
            raise
        if self.deferred_batch_norm and self.training:
            commit_deferred_batch_norms(self)
        return join_microbatches(activations, single=not packed[-1])

    def _run_partition(self, j: int, inputs: tuple, packed: bool, shared_skips: SkipTracker,
                       checkpointed: bool):
        partition, device = self.partitions[j], self.devices[j]
        inputs = tuple(t.to(device) for t in inputs)
        skips = _MicrobatchSkips(shared_skips, device)

        produced = []  # the first forward's output

        def run(*args):
            with use_skip_tracker(skips):
                out = partition(args if packed else args[0])
            if not skips.replaying:
                produced.append(out)
            skips.replaying = True
            return out

        if not checkpointed:
            return run(*inputs)
        versions = [_version(t) for t in inputs]
        try:
            out = checkpointed_call(run, *inputs, modules=(partition,))
            produced.clear()  # run() lives until backward: it must not keep the output alive
            return out
        except RuntimeError as error:
            changed = [k for k, (t, v) in enumerate(zip(inputs, versions))
                       if v is not None and _version(t) != v]
            if not changed:
                raise
            if produced and not _needs_backward(partition, inputs, produced[0], skips):
                # nothing of the region can be recomputed (no gradient flows through it), so
                # the changed input is never read again: the plain Sequential's result
                return produced.pop()
            name, layer = next(iter(partition.named_children()))
            raise RuntimeError(
                f"Pipe(checkpoint={self.checkpoint!r}): partition {j} (first layer {name!r}: "
                f"{type(layer).__name__}) "
                f"changed its input{'s' if len(changed) > 1 else ''} {changed} in place (e.g. "
                f"nn.ReLU(inplace=True) or `x += ...` at the start of the partition); its "
                f"recomputation in backward would start from the changed value. Make that "
                f"operation out of place, move the cut (balance={self.balance}), or use "
                f"checkpoint='never'") from error
