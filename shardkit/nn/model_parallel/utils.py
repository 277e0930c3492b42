"""Small shape helpers shared by the tensor-parallel modules: exact division with a clear error,
and splitting or joining a tensor along one dimension into tensor-parallel shards."""

from __future__ import annotations

import torch

__all__ = ["divide", "split_along_dim", "shard_of", "join_shards"]


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
