"""One batch for every rank of a tensor-parallel group: FairScale's and Megatron-LM's
``broadcast_data``.

The ranks of a tensor-parallel group must compute on the same batch (each holds a slice of
every layer): a training loop reads it on tensor-parallel rank 0 only and broadcasts it, as
FairScale's and Megatron-LM's ``get_batch`` do::

    data = next(loader) if mp.get_model_parallel_rank() == 0 else None
    batch = broadcast_data(["text", "labels"], data, torch.int64)
    loss = model.loss(batch["text"], batch["labels"])

Communication over the tensor-parallel group: one broadcast of the shapes (a small pickled
object; an error found on rank 0 travels in its place, so every rank raises it), then one of
the tensors packed into one flat buffer, sent as its bytes (any dtype). Memory: that flat
buffer, which the returned tensors are views of.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from shardkit import distributed
from shardkit.nn.model_parallel.initialize import get_model_parallel_group

__all__ = ["broadcast_data"]


def broadcast_data(keys: Sequence[str], data: Optional[dict], datatype: torch.dtype, *,
                   group=None) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank 0's ``data[key]`` for each of ``keys``, on every rank of its group.

    Args:
        keys: the entries of ``data`` to send, in order.
        data: on tensor-parallel rank 0, a dict holding a tensor of dtype ``datatype`` under
            each key (on any device); on the other ranks it is not read (pass ``None``).
        datatype: the dtype of every tensor sent (e.g. ``torch.int64`` for token ids).
        group: the tensor-parallel group (default: the current one's,
            :func:`~shardkit.nn.model_parallel.initialize.get_model_parallel_group`).

    Returns ``{key: tensor}`` with rank 0's shapes and values, on the device the group
    communicates on (the current CUDA device under NCCL, else the CPU), each a view of one
    flat buffer. Collective over the tensor-parallel group; call it on every rank.

    Raises, before any collective: ``TypeError`` for ``keys`` that are not a list or tuple of
    strings, or a ``datatype`` that is not a ``torch.dtype`` (every rank checks its own).
    On every rank of the group, after the shapes' broadcast: ``KeyError`` when rank 0's
    ``data`` lacks a key, ``TypeError`` when an entry is not a tensor of ``datatype``.
    """
    _check_arguments(keys, datatype)
    group = get_model_parallel_group() if group is None else group
    device = _device_of(group)
    source = distributed.get_rank(group) == 0
    header = _shapes_or_problem(keys, data, datatype) if source else None
    if distributed.get_world_size(group) > 1:
        header = distributed.broadcast_object(header, src=distributed.get_global_rank(group, 0),
                                              group=group)
    if isinstance(header, str):
        raise (KeyError if header.startswith("missing") else TypeError)(
            f"broadcast_data: tensor-parallel rank 0's data {header}")
    shapes = [torch.Size(shape) for shape in header]
    if source:
        flat = torch.cat([data[key].detach().reshape(-1).to(device) for key in keys]) if keys \
            else torch.empty(0, dtype=datatype, device=device)
    else:
        flat = torch.empty(sum(shape.numel() for shape in shapes), dtype=datatype,
                           device=device)
    if distributed.get_world_size(group) > 1:
        # as bytes: gloo and NCCL have no int16 (or uint16/32/64) collectives
        distributed.broadcast(flat.view(torch.uint8), src=distributed.get_global_rank(group, 0),
                              group=group)
    out, offset = {}, 0
    for key, shape in zip(keys, shapes):
        out[key] = flat[offset:offset + shape.numel()].view(shape)
        offset += shape.numel()
    return out


def _check_arguments(keys, datatype) -> None:
    """What every rank can check alone, before any collective."""
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
        raise TypeError(f"broadcast_data(keys={keys!r}): expected a list or tuple of the data "
                        f"dict's keys (strings)")
    if not isinstance(datatype, torch.dtype):
        raise TypeError(f"broadcast_data(datatype={datatype!r}): expected a torch.dtype, such "
                        f"as torch.int64")


def _shapes_or_problem(keys, data, datatype):
    """On rank 0: each key's shape, or the text of what is wrong with ``data`` (sent to every
    rank in place of the shapes, so that all of them raise). Local."""
    if not isinstance(data, dict):
        return f"is {type(data).__name__}, not a dict holding the keys {list(keys)}"
    missing = [key for key in keys if key not in data]
    if missing:
        return f"missing key(s) {missing}; it holds {sorted(data)}"
    for key in keys:
        value = data[key]
        if not isinstance(value, torch.Tensor):
            return f"[{key!r}] is a {type(value).__name__}, not a tensor"
        if value.dtype != datatype:
            return (f"[{key!r}] has dtype {value.dtype}, not datatype={datatype}; convert it or "
                    f"broadcast it in a call of its own")
    return [tuple(data[key].shape) for key in keys]


def _device_of(group) -> torch.device:
    """Where ``group``'s collectives take tensors: the current CUDA device under NCCL."""
    if "nccl" in distributed.backend_of(group) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
