"""The one resharding code path: how a tensor sharded on dim 0 is cut into row blocks and
joined again.

A parameter of shape ``(rows, ...)`` sharded over ``N`` ranks is cut into ``N`` blocks of
``ceil(rows / N)`` rows, the last ones zero padded (:class:`ParamLayout`). FSDP's runtime shards,
its local state dicts and optimizer state, and the row blocks in the engine's on-disk
checkpoints all use this cut, so a checkpoint written by ``N`` ranks is resharded for ``M`` by
joining the blocks (:func:`unshard_rows`) and cutting again (:func:`shard_rows`). Everything
here takes plain arguments and never communicates; callers bring the blocks (from files, or by
their own collectives).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["ParamLayout", "shard_rows", "unshard_rows", "join_row_blocks", "join_row_state",
           "shape_mismatches", "copy_rows_into"]


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter of shape ``shape`` is cut into ``world_size`` dim-0 row blocks."""

    shape: torch.Size
    world_size: int

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        """Rows of the full parameter (dim 0; 1 for a 0-d parameter)."""
        return self.shape[0] if len(self.shape) else 1

    @property
    def row_numel(self) -> int:
        """Elements in one row (the product of the dims after dim 0)."""
        return math.prod(self.shape[1:]) if len(self.shape) else 1

    @property
    def rows_per_shard(self) -> int:
        """Rows in each rank's block, padding included: ``ceil(rows / world_size)``."""
        return -(-self.rows // self.world_size)

    @property
    def chunk_numel(self) -> int:
        """Elements in each rank's block, padding included."""
        return self.rows_per_shard * self.row_numel

    @property
    def shard_shape(self) -> tuple:
        """Shape of each rank's block: ``(rows_per_shard, *shape[1:])``."""
        return (self.rows_per_shard, *self.shape[1:])

    def real_rows(self, rank: int) -> tuple[int, int]:
        """``(first row, number of rows)`` of the full tensor that ``rank``'s block holds
        (padding excluded; torch.chunk's and DTensor ``Shard(0)``'s uneven cut)."""
        start = min(rank * self.rows_per_shard, self.rows)
        return start, min(start + self.rows_per_shard, self.rows) - start


def shard_rows(full: torch.Tensor, layout: ParamLayout, rank: int) -> torch.Tensor:
    """Rank ``rank``'s row block of ``full`` (a new ``layout.shard_shape`` tensor, zero padded)."""
    out = torch.zeros(layout.shard_shape, dtype=full.dtype, device=full.device)
    copy_rows_into(out, full, 0, layout, rank)
    return out


def copy_rows_into(block: torch.Tensor, piece: torch.Tensor, first_row: int,
                   layout: ParamLayout, rank: int) -> None:
    """Copy into ``block`` (rank ``rank``'s ``layout.shard_shape`` block) the rows of ``piece``
    that fall into it; ``piece`` holds the full tensor's rows ``first_row`` on (the whole tensor,
    or another world's block of it). Rows of ``block`` outside ``piece`` are left as they are
    (padding stays zero). No allocation."""
    rows = piece.reshape(-1, *layout.shape[1:])
    start, count = layout.real_rows(rank)
    stop = start + count
    low, high = max(start, first_row), min(stop, first_row + rows.shape[0])
    if high > low:
        block[low - start:high - start].copy_(rows[low - first_row:high - first_row])


def unshard_rows(shards: Sequence[torch.Tensor], layout: ParamLayout) -> torch.Tensor:
    """Inverse of :func:`shard_rows`: concatenate every rank's block, drop padding, reshape."""
    rows = torch.cat([s.reshape(-1, *layout.shape[1:]) for s in shards])[:layout.rows]
    return rows.reshape(layout.shape)


def join_row_blocks(blocks: Sequence[torch.Tensor], shape) -> torch.Tensor:
    """The full tensor of ``shape`` from every rank's block, in rank order (memory: one copy
    of the full tensor)."""
    return unshard_rows(blocks, ParamLayout(torch.Size(shape), len(blocks)))


def join_row_state(parts: Sequence[tuple], shape) -> dict:
    """Optimizer state of a row-sharded parameter from ``[(param block, state block)]`` in rank
    order: tensors shaped like the parameter's block are joined like the parameter; the rest
    (Adam's ``step``) is the same on every rank and taken from the first."""
    block0, state0 = parts[0]
    joined = {}
    for key, value in state0.items():
        if isinstance(value, torch.Tensor) and value.shape == block0.shape:
            joined[key] = join_row_blocks([state[key] for _, state in parts], shape)
        else:
            joined[key] = value
    return joined


def shape_mismatches(tensors: dict, full_shapes: dict) -> list[tuple]:
    """``(name, given shape, expected shape)`` for each tensor of ``tensors`` whose shape is
    not its entry in ``full_shapes`` (names missing there are not this check's business).
    Local; copies nothing."""
    return [(name, tuple(value.shape), tuple(full_shapes[name]))
            for name, value in tensors.items()
            if isinstance(value, torch.Tensor) and name in full_shapes
            and tuple(value.shape) != tuple(full_shapes[name])]
