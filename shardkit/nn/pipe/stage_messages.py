"""Where a pipeline stage's activations and gradients go (:class:`StageMessages`, mixed into
:class:`~shardkit.nn.pipe.PlanSchedule`): to a stage of the same rank by a local hand-off, to
another rank through :class:`~shardkit.nn.pipe.p2p.TaggedLinks`; the receives posted ahead of the
actions; what a failed micro-batch passes on; and which message across each boundary carries the
step's verdict (:func:`last_messages`). Communication: each activation and gradient that crosses
ranks, once (see :class:`~shardkit.nn.pipe.p2p.TaggedLinks`).
"""

from __future__ import annotations

from typing import Optional

import torch

from shardkit.nn.pipe.p2p import ACTIVATION, GRADIENT
from shardkit.nn.pipe.plan import PipelinePlan


def last_messages(plan: PipelinePlan) -> dict:
    """Which micro-batch's message crosses each stage boundary last, each way (the step's
    verdict rides on it): ``(ACTIVATION, b)``: stage ``b``'s last F; ``(GRADIENT, b)``: stage
    ``b + 1``'s last B or BW."""
    last = {}
    for order in plan.orders:
        for action in order:
            if action.kind == "F":
                last[(ACTIVATION, action.stage)] = action.microbatch
            elif action.kind in ("B", "BW"):
                last[(GRADIENT, action.stage - 1)] = action.microbatch
    return last


class StageMessages:
    """The executor's routing of messages between stages (see the module); mixed
    into :class:`~shardkit.nn.pipe.PlanSchedule`."""

    def _remote(self, stage: int) -> Optional[int]:
        """The global rank of ``stage`` if another rank runs it, else ``None``."""
        if stage in self.stages or not 0 <= stage < self.num_stages:
            return None
        return next(iter(self.stages.values())).global_rank_of(stage)

    def _post_ahead(self, action) -> None:
        s, i = action.stage, action.microbatch
        if action.kind == "F" and s > 0 and self._remote(s - 1) is not None:
            self.links.post_activation(s - 1, i, self._remote(s - 1))
        elif action.kind in ("B", "BW") and (s, i) in self._live \
                and self._remote(s + 1) is not None:
            self.links.post_gradient(s, i, self._remote(s + 1))

    def _skip_forward(self, s: int, i: int, activation) -> None:
        """Micro-batch ``i`` of a failed step at stage ``s``: no forward (no loss, zero input
        gradients on the way back), and the next stage gets what it expects."""
        if s < self.num_stages - 1:
            if self._remote(s + 1) is None:
                self._handoff[("F", s, i)] = ((torch.zeros(1, dtype=torch.uint8),), False)
            else:
                self.links.send_no_output(s, i, self._remote(s + 1))
        self._keep_live(s, i, activation, [])

    def _send_input_grads(self, s: int, i: int, activation, grads) -> None:
        """Hand the gradients of stage ``s``'s inputs back (one per input requiring grad,
        ``None`` where the backward did not reach it: the previous stage leaves that output
        out of its backward)."""
        if s == 0:  # to the batch's views (the stage may have run on leaves standing in)
            self._batch_grads += [(a, g) for a, g in zip(self._inputs[i], grads)
                                  if a.requires_grad and g is not None]
            return
        grads = [g for a, g in zip(activation, grads) if a.requires_grad]
        if self._remote(s - 1) is None:
            self._handoff[("B", s - 1, i)] = grads
        else:
            self.links.send_gradient(s - 1, i, grads, self._remote(s - 1))
