"""Small shape helpers shared by the tensor-parallel modules: exact division with a clear error,
splitting or joining a tensor along one dimension into tensor-parallel shards, and the range
check of word indices."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["divide", "split_along_dim", "shard_of", "join_shards", "check_indices"]


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, raising ``ValueError`` naming ``what`` when it is not exact."""
    if denominator < 1 or numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by {denominator}; it must be a "
                         f"multiple of {denominator}")
    return numerator // denominator


def split_along_dim(tensor: torch.Tensor, parts: int, dim: int) -> list[torch.Tensor]:
    """``parts`` equal views of ``tensor`` along ``dim`` (the size must divide exactly)."""
    size = divide(tensor.shape[dim], parts,
                  f"tensor dimension {dim} of shape {tuple(tensor.shape)}")
    return list(torch.split(tensor, size, dim=dim))


def shard_of(full: torch.Tensor, rank: int, world: int, dim: int, stride: int = 1) -> torch.Tensor:
    """The slice of ``full`` that tensor-parallel ``rank`` of ``world`` keeps along ``dim``.

    With ``stride > 1`` the dimension is cut into ``stride * world`` equal blocks and the rank
    keeps blocks ``rank, rank + world, ...`` (e.g. the q, k and v rows of a fused projection).
    Returns a new contiguous tensor.
    """
    blocks = split_along_dim(full, stride * world, dim)
    return torch.cat(blocks[rank::world], dim=dim).contiguous()


def join_shards(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_of`: the full tensor from every rank's shard, in rank order."""
    world = len(shards)
    per_rank = [split_along_dim(s, stride, dim) for s in shards]
    ordered = [per_rank[r][k] for k in range(stride) for r in range(world)]
    return torch.cat(ordered, dim=dim)


def check_indices(indices: torch.Tensor, size: int, what: str, size_name: str = "size",
                  ignore_index: Optional[int] = None) -> None:
    """Raise ``IndexError`` unless every entry of ``indices`` is in ``[0, size)`` or equals
    ``ignore_index``. No communication. On CPU the message names the first bad value; on an
    accelerator the check is a device-side assert (no host synchronisation), which names
    ``size`` only and fails at a later synchronisation."""
    bad = (indices < 0) | (indices >= size)
    if ignore_index is not None:
        bad &= indices != ignore_index
    allowed = f"[0, {size_name}={size})"
    if ignore_index is not None:
        allowed += f" and is not ignore_index={ignore_index}"
    if indices.device.type != "cpu":
        torch._assert_async(~bad.any(), f"{what}: an index is outside {allowed}")
    elif bad.any():
        raise IndexError(f"{what} {indices[bad][0].item()} is outside {allowed}")
