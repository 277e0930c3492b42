"""How the hooks of :class:`~shardkit.nn.data_parallel.fully_sharded.FullyShardedDataParallel`
units run: never traced by ``torch.compile`` (they gather and reduce-scatter eagerly), and,
inside :func:`backward_hooks_paused`, their pre-backward hooks do nothing (for a caller that
gathers what it needs itself). Local: no communication."""

from __future__ import annotations

import contextlib

import torch


_EAGER_HOOK_REASON = (
    "shardkit FullyShardedDataParallel's hooks gather and reduce-scatter parameters and run "
    "eagerly, so torch.compile breaks the graph at each FSDP unit's hooks: fullgraph=True cannot "
    "compile a model holding FSDP units; compile the blocks inside the units instead "
    "(block.compile(fullgraph=True) before wrapping), or the whole model without fullgraph")


def _eager(hook):
    """``hook`` never traced by torch.compile (Dynamo calls it as plain Python). The reason
    is what Dynamo prints for the graph break (and, under ``fullgraph=True``, in its error)."""
    return torch._dynamo.disable(hook, recursive=True, reason=_EAGER_HOOK_REASON)


# How many backward_hooks_paused blocks are open. Not per thread: autograd runs the nodes of
# CUDA tensors (and their hooks) on its own device threads, not on the thread that called it
_BACKWARD_HOOKS_PAUSED = [0]


@contextlib.contextmanager
def backward_hooks_paused():
    """Inside the block, the pre-backward hooks of every unit do nothing (no gather, no
    end-of-backward callback): for a caller that runs a part of backward which needs no unit's
    weights, or gathers the units it needs itself and frees them after (the weight-gradient
    pass of a zero-bubble pipeline schedule,
    :class:`~shardkit.nn.pipe.fsdp_weight_sink.ShardedGradientSink`). It holds for the whole
    process while open (autograd may run the hooks on its device threads), so no other
    thread's FSDP backward may run meanwhile. Local."""
    _BACKWARD_HOOKS_PAUSED[0] += 1
    try:
        yield
    finally:
        _BACKWARD_HOOKS_PAUSED[0] -= 1
