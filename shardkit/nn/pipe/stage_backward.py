"""The backward actions of the pipeline executor (:class:`StageBackward`, mixed into
:class:`~shardkit.nn.pipe.PlanSchedule`): ``BW`` (one plain backward), ``B`` (the input gradient)
and ``W`` (the parameter gradients) of a stage on a micro-batch, which output gradients feed them
(real ones, or zeros where the stage's replicas must reduce alike), the batch's own gradients at the
end of the step, and a backward that raises failing the step on every rank. Memory: what B keeps for
W (see :mod:`~shardkit.nn.pipe.split_backward`); communication: the input gradients sent back
(:mod:`~shardkit.nn.pipe.stage_messages`) and what the stage module's hooks reduce.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from shardkit.nn.data_parallel.flat_param import zeros_only_views
from shardkit.nn.pipe.autograd_graph import _reached, _reaches_a_parameter
from shardkit.nn.pipe.fsdp_weight_sink import stage_is_fully_sharded
from shardkit.nn.pipe.schedules import COMMUNICATION_ERRORS
from shardkit.nn.pipe.split_backward import backward_input
from shardkit.nn.pipe.stage import PipelineStage

_FAILED = object()  # a stage forward or backward that raised (the step fails)


def _reentrant_checkpoint_hint(error: BaseException) -> str:
    """The way out for a reentrant activation checkpoint (torch's ``use_reentrant=True``, the
    ``CheckpointFunction`` of Megatron-LM, DeepSpeed or FairScale) in a stage, whose own error
    asks the caller to use ``.backward()`` without ``inputs``, which the schedules' split
    backward never is: ``""`` for any other error (shardkit's own checkpoint names it). Local."""
    text = str(error)
    if not isinstance(error, RuntimeError) or "shardkit" in text or ".grad()" not in text \
            or "heckpoint" not in text:
        return ""
    return ("; shardkit's pipeline schedules split each stage's backward into input and weight "
            "gradients (torch.autograd.grad), which a reentrant activation checkpoint cannot run "
            "under: checkpoint the stage's layers with torch.utils.checkpoint.checkpoint(..., "
            "use_reentrant=False) (Hugging Face models: gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False})) or "
            "shardkit.checkpointing.non_reentrant_checkpoint")


def _runs_whole_backward(stage: PipelineStage) -> bool:
    """Whether BW stays one plain backward (FSDP's hooks then reduce-scatter as usual); B and W
    of such a stage go through :class:`~shardkit.nn.pipe.fsdp_weight_sink.ShardedGradientSink`."""
    return stage_is_fully_sharded(stage.module)


class StageBackward:
    """The executor's backward actions (see the module); mixed into
    :class:`~shardkit.nn.pipe.PlanSchedule`."""

    def _output_grads(self, s: int, i: int, roots: list,
                      split: bool = False) -> tuple[list, Optional[list], Optional[list]]:
        """The roots of stage ``s``'s backward on micro-batch ``i`` that get a gradient, those
        gradients (``None``: the last stage's loss, ones), and ``None``, or the roots whose
        gradient is real when some fed are zeros. An output the next stage gave no gradient
        (it ignored or detached that tensor) is left out, as one process's backward never
        reaches it: the parameters only it depends on keep ``.grad`` ``None``, and with no
        gradient at all there is no backward.

        A stage whose module reduces gradients inside backward (ShardedDataParallel, FSDP) must
        issue the same reductions as its replicas, whose next stages may have used that output:
        a ShardedDDP stage leaves the output out when the backward still reaches some trainable
        parameter, and otherwise takes zeros for it (those parameters then get zeros, which is
        one process's gradient wherever a replica gave them one). An FSDP stage always takes
        zeros, so that every replica gathers and reduce-scatters the same units in the same
        order (a frozen unit only that output reaches gathers; units both outputs reach may be
        reached in another order): its units get ``None`` for the views only the zeros reached
        (:func:`zeros_only_views`; under B and W,
        :class:`~shardkit.nn.pipe.fsdp_weight_sink.ShardedGradientSink`). The caller reports the
        input gradients only the real roots reach (:func:`_reached`)."""
        if s == self.num_stages - 1:
            return roots, None, None
        if self._remote(s + 1) is None:
            grads = self._handoff.pop(("B", s, i))
        else:
            grads = self.links.take_gradient(s, i, self._remote(s + 1))
        pairs = list(zip(roots, grads))
        real = [(r, g) for r, g in pairs if g is not None]
        if len(real) < len(pairs) and self._feeds_zeros(s, roots, [r for r, _ in real], split):
            return [r for r, _ in pairs], [g if g is not None else torch.zeros_like(r)
                                           for r, g in pairs], [r for r, _ in real]
        return [r for r, _ in real], [g for _, g in real], None

    def _feeds_zeros(self, s: int, roots: list, real: list, split: bool) -> bool:
        """Whether stage ``s`` must backpropagate zeros for its roots without a gradient (see
        :meth:`_output_grads`). Walks the micro-batch's graph; local."""
        if self._whole_backward[s] and (split or self._reducing[s]):
            # FSDP: the replicas' gathers and reduce-scatters follow the graph's units in the
            # order backward reaches them (a frozen unit gathers too), so every replica runs the
            # whole graph; the views only zeros reach get None (zeros_only_views, or W)
            return True
        if not self._reducing[s]:
            return False
        params = {id(p) for p in self.stages[s].module.parameters() if p.requires_grad}
        return _reaches_a_parameter(roots, params) != _reaches_a_parameter(real, params)

    def _run_BW(self, s: int, i: int) -> None:
        if not self._whole_backward[s] and not self._sinks[s].deferred:
            self._run_B(s, i)  # the input gradient goes back first, then W
            self._run_W(s, i, agreed=True)
            return
        # gradient hooks (data-parallel wrappers, FSDP) see one plain backward per micro-batch
        activation, roots = self._live.pop((s, i))
        roots, grads, real = self._output_grads(s, i, roots)
        if not (self._replicas_go_on(s, i) and
                self._replicas_reach_alike(s, i, activation, roots)):
            roots = []
        views = zeros_only_views(roots, real) if real is not None and self._whole_backward[s] \
            else contextlib.nullcontext()

        def run():
            with views:
                torch.autograd.backward(roots, grads)
        failed = roots and self._backward(s, i, run) is _FAILED
        # stage 0 on the batch's own views: the plain backward has already reached the batch
        input_grads = [None] * len(activation) if failed or \
            s == 0 and activation is self._inputs[i] else \
            _reached(real, activation, [a.grad for a in activation])
        self._send_input_grads(s, i, activation, input_grads)
        self._alive -= 1

    def _run_B(self, s: int, i: int) -> None:
        activation, roots = self._live.pop((s, i))
        roots, grads, real = self._output_grads(s, i, roots, split=True)
        if not (self._replicas_go_on(s, i) and
                self._replicas_reach_alike(s, i, activation, roots)):
            roots = []
        result = self._backward(s, i, lambda: backward_input(
            roots, grads, activation, self._sinks[s].weight_targets(roots, real),
            split_at_parameters=self._whole_backward[s])) if roots else None
        if result is None or result is _FAILED:
            result = [None] * len(activation), None
        input_grads, self._weights[(s, i)] = result
        input_grads = _reached(real, activation, input_grads)
        self._send_input_grads(s, i, activation, input_grads)

    def _run_W(self, s: int, i: int, agreed: bool = False) -> None:
        """W of stage ``s`` on micro-batch ``i``; ``agreed``: right after its B, whose
        agreement with the stage's replicas (:meth:`_replicas_go_on`) holds for it too."""
        weight_pass = self._weights.pop((s, i))
        go_on = agreed or self._replicas_go_on(s, i)
        if weight_pass is not None and go_on and s not in self._replicas_stopped:
            self._backward(s, i, lambda: self._sinks[s].run(weight_pass))
        self._alive -= 1

    def _hand_batch_grads(self) -> None:
        """Give the step's batch tensors that require grad their gradient, as one process's
        backward would (B computed each micro-batch's for stage 0; its inputs are views of the
        batch): one autograd call for the step, so a graph that built the batch before the
        pipeline is walked once. Memory: the first stage's input gradients until the step's
        end (the batch's size), only where the batch requires grad."""
        views, grads = zip(*self._batch_grads)
        self._batch_grads = []
        torch.autograd.backward(list(views), list(grads))

    def _backward(self, s: int, i: Optional[int], run: Callable,
                  what: str = "handing the weight gradients to the parameters"):
        """``run()``, a backward part of stage ``s`` on micro-batch ``i`` (``None``: ``what``,
        a part of the step's end); an exception there (a custom autograd
        function or a gradient hook raising, a tensor modified in place) fails the step on
        every rank as a forward's does: the stage sends zero input gradients and gives
        ``_FAILED``. Communication errors propagate at once, and so does any exception in a
        stage that reduces gradients inside backward (see ``_reduces_during_backward``)."""
        try:
            with self._busy():
                return run()
        except COMMUNICATION_ERRORS:
            raise
        except Exception as error:
            if self._reducing[s]:
                raise
            problem = (f"its backward raised {type(error).__name__}: {error}"
                       f"{_reentrant_checkpoint_hint(error)}")
            if i is None:
                self._fail(f"stage {s}: {what}, {problem}", error)
            else:
                self._fail_at(s, i, problem, error)
            return _FAILED
