"""Small shape helpers shared by the tensor-parallel modules: exact division with a clear error,
splitting or joining a tensor along one dimension into tensor-parallel shards, and the range
check of word indices.

FairScale's (and Megatron's) helpers of ``fairscale.nn.model_parallel.utils`` are here under
their names, for model code that imports them: :func:`ensure_divisibility`,
:func:`divide_and_check_no_remainder`, :func:`split_tensor_along_last_dim` and
:class:`VocabUtility`. An inexact division is a ``ValueError`` naming both numbers (FairScale:
an ``AssertionError``)."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["divide", "split_along_dim", "shard_of", "join_shards", "check_indices",
           # FairScale's names
           "ensure_divisibility", "divide_and_check_no_remainder", "split_tensor_along_last_dim",
           "VocabUtility"]


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


# ----------------------------------------------------------------------------- FairScale's names


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Raise ``ValueError`` unless ``numerator`` is a multiple of ``denominator`` (FairScale's
    helper; it asserted). No communication."""
    divide(numerator, denominator, "ensure_divisibility: numerator")


def divide_and_check_no_remainder(numerator: int, denominator: int) -> int:
    """``numerator // denominator``; ``ValueError`` when it is not exact (FairScale's helper)."""
    return divide(numerator, denominator, "divide_and_check_no_remainder: numerator")


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> tuple[torch.Tensor, ...]:
    """``num_partitions`` equal chunks of ``tensor``'s last dimension (views, as ``torch.split``
    gives them, unless ``contiguous_split_chunks``), e.g. a fused q/k/v activation into q, k and
    v. ``ValueError`` when the last dimension does not divide. FairScale's and Megatron's helper.
    """
    size = divide(tensor.shape[-1], num_partitions,
                  f"split_tensor_along_last_dim(num_partitions={num_partitions}): the last "
                  f"dimension of the tensor of shape {tuple(tensor.shape)}")
    chunks = torch.split(tensor, size, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return tuple(chunks)


class VocabUtility:
    """The ``[first, last)`` word indices that tensor-parallel ``rank`` of ``world_size`` holds
    of a vocabulary split into equal contiguous ranges (what
    :class:`~shardkit.nn.model_parallel.VocabParallelEmbedding` and
    :func:`~shardkit.nn.model_parallel.vocab_parallel_cross_entropy` use). FairScale's helper."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> tuple[int, int]:
        """``rank``'s range when each rank holds ``per_partition_vocab_size`` words
        (``world_size`` is unused, kept for FairScale's signature). Local."""
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int,
                                           world_size: int) -> tuple[int, int]:
        """``rank``'s range of a ``global_vocab_size`` vocabulary split over ``world_size``
        ranks; ``ValueError`` when it does not divide. Local."""
        per_partition = divide(global_vocab_size, world_size,
                               "VocabUtility: global_vocab_size")
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank,
                                                                      world_size)
