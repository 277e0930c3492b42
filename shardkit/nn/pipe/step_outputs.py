"""What the last stage of a pipeline step makes of its outputs (:class:`StepOutputs`, mixed
into :class:`~shardkit.nn.pipe.PlanSchedule`): whether the step computes a loss or returns the
merged outputs (``return_outputs``, a forward-only step without ``target`` or ``loss_fn``), and the
detached outputs kept for that. Local; memory: the last stage's outputs of every micro-batch, only
where the step returns them.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from shardkit.nn.pipe.microbatch import mergeable_output_problem


class StepOutputs:
    """The executor's choice between a step's loss and its outputs, and the outputs
    it keeps (see the module); mixed into :class:`~shardkit.nn.pipe.PlanSchedule`."""

    def _outputs_only(self, target) -> bool:
        """Whether the last stage computes no loss this step: a forward-only step asked for its
        outputs (``return_outputs=True``) without a ``loss_fn`` or without a ``target``, or
        one without a ``target`` and ``return_outputs`` unset (there is no loss to return: the
        outputs are returned, as torch's inference with a schedule built without
        ``loss_fn``)."""
        if torch.is_grad_enabled() or self._return_outputs is False:
            return False
        if self._return_outputs is None:
            return target is None
        return self.loss_fn is None or target is None

    def _returns_outputs(self, target) -> bool:
        """Whether this step returns the last stage's merged outputs rather than the loss."""
        return self._return_outputs is True or self._outputs_only(target)

    def _keep_output(self, s: int, i: int, output) -> None:
        """Keep the last stage's output of micro-batch ``i`` (detached) for ``return_outputs``;
        one that cannot be concatenated along dim 0 fails the step on every rank."""
        problem = mergeable_output_problem(output, self._outputs[0] if self._outputs else None)
        if problem:
            self._fail_at(s, i, f"step(return_outputs=True) concatenates the last stage's "
                                f"outputs along dim 0, but {problem}; or leave return_outputs "
                                f"unset (step returns the loss)")
            return
        self._outputs.append(tree_map(lambda t: t.detach(), output))
