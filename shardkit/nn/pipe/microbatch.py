"""Splitting a mini-batch into micro-batches along dim 0, and joining outputs back."""

from __future__ import annotations

from typing import Sequence, Union

import torch

__all__ = ["as_tuple", "batch_size", "split_microbatches", "join_microbatches",
           "own_microbatches"]

Tensors = tuple[torch.Tensor, ...]


def as_tuple(value: Union[torch.Tensor, Sequence[torch.Tensor]]) -> Tensors:
    """A tensor as a 1-tuple; a tuple or list of tensors as a tuple."""
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def batch_size(inputs: Tensors, what: str) -> int:
    """The common dim-0 size of ``inputs``; raises naming ``what`` when there is none."""
    if not inputs or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in inputs):
        kinds = [type(t).__name__ if not isinstance(t, torch.Tensor) else f"Tensor{tuple(t.shape)}"
                 for t in inputs]
        raise TypeError(f"{what}: expected one or more tensors with a batch dimension, got {kinds}")
    sizes = {t.shape[0] for t in inputs}
    if len(sizes) != 1:
        raise ValueError(f"{what}: the input tensors disagree on the batch size (dim 0): "
                         f"{[t.shape[0] for t in inputs]}")
    return sizes.pop()


def split_microbatches(inputs: Tensors, chunks: int, what: str) -> list[Tensors]:
    """Split every tensor of ``inputs`` into ``chunks`` nearly equal pieces along dim 0.

    Raises ``ValueError`` when the batch is smaller than ``chunks``. Views, no copies.
    """
    size = batch_size(inputs, what)
    if chunks > size:
        raise ValueError(f"{what}: chunks={chunks} is larger than the batch size {size}; use "
                         f"chunks <= {size}")
    pieces = [torch.tensor_split(t, chunks, dim=0) for t in inputs]
    return [tuple(p[i] for p in pieces) for i in range(chunks)]


def join_microbatches(outputs: list[Tensors], single: bool):
    """Concatenate per-micro-batch outputs along dim 0 (one tensor when ``single``)."""
    joined = tuple(torch.cat(parts, dim=0) for parts in zip(*outputs))
    return joined[0] if single else joined


def own_microbatches(batches: list, recording: bool, device=None) -> list:
    """``batches`` (views of one batch, from :func:`split_microbatches`), moved to ``device``
    (``None``: where they are), each tensor that needs no gradient made a tensor of its own
    when there are several micro-batches in a step that records for backward: views share the
    batch's in-place version counter, so a first layer working in place on micro-batch ``i +
    1`` (``nn.ReLU(inplace=True)``) would make autograd refuse the backward of micro-batch
    ``i``, whose input it saved, although its values never changed. Tensors requiring grad
    stay views (their gradient goes back to the batch). Costs one copy of the batch; the
    caller's batch is then left as it was."""
    copy = recording and len(batches) > 1

    def own(t: torch.Tensor) -> torch.Tensor:
        moved = t if device is None else t.to(device)
        return t.clone() if copy and not t.requires_grad and moved is t else moved

    return [tuple(own(t) for t in mb) for mb in batches]
