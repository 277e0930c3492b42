"""What a pipeline's ``loss_fn`` averages over, so that the micro-batch losses of a step add up
to one process's loss on the whole batch.

A mean over a count the target decides (cross-entropy with ``ignore_index``: its non-ignored
tokens, or their class weights) cannot be rebuilt from micro-batch means weighted alike: each
micro-batch's loss is weighted by its count's share of the whole target's instead. The count
comes from ``loss_denominator=``, from a ``loss_fn`` that declares itself (a ``torch.nn``
class-index loss, ``F.cross_entropy``, ``F.nll_loss``, their ``functools.partial``), or, for a
``loss_fn`` that says nothing (a lambda or a plain ``def``) or only ``reduction="mean"``, from
watching the step's first ``loss_fn`` call (:class:`LossCountWatch`): if it computes one
class-index loss with ``reduction="mean"`` on its micro-batch's target (reshaped, not cut),
the same count applies to every micro-batch. Local to the rank running the last stage; no
communication.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from typing import Callable, Optional

import torch
from torch.nn._reduction import legacy_get_string
from torch.overrides import TorchFunctionMode

CLASS_INDEX_LOSSES = (torch.nn.functional.cross_entropy, torch.nn.functional.nll_loss)
_CLASS_INDEX_MODULES = (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)


def declared_reduction(loss_fn, loss_kwargs: Optional[dict]) -> Optional[str]:
    """The reduction ``loss_fn`` says it applies, where it says one: ``loss_kwargs``'
    ``reduction``, else that keyword of a ``functools.partial``, else the ``reduction``
    attribute of a ``torch.nn`` loss module (or of any callable), else the default of the
    function's own ``reduction`` parameter (``F.mse_loss``, ``F.cross_entropy``: ``"mean"``);
    ``None`` for a function that says nothing (a lambda or a plain ``def``)."""
    if loss_kwargs and "reduction" in loss_kwargs:
        return loss_kwargs["reduction"]
    if isinstance(loss_fn, functools.partial) and "reduction" in loss_fn.keywords:
        return loss_fn.keywords["reduction"]
    reduction = getattr(loss_fn, "reduction", None)
    if isinstance(reduction, str):
        return reduction
    try:
        parameter = inspect.signature(loss_fn).parameters.get("reduction")
    except (TypeError, ValueError):  # a builtin or another callable without a signature
        return None
    default = None if parameter is None else parameter.default
    return default if isinstance(default, str) else None


class NotCounted(Exception):
    """A declared loss's target that its count does not apply to (class probabilities)."""


def count_value(value) -> float:
    """A ``loss_denominator`` result (a real number, NumPy's too, or a one-element tensor) as
    a float; raises a ValueError for anything else, a negative or non-finite count included
    (an infinite one would turn every micro-batch's weight into NaN)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not 0 <= value < math.inf:
        raise ValueError(f"it returned {value!r}")
    return float(value)


def declared_denominator(loss_fn, loss_kwargs: Optional[dict]) -> Optional[Callable]:
    """For a class-index loss averaging over its non-ignored targets (``nn.CrossEntropyLoss``,
    ``nn.NLLLoss``, ``F.cross_entropy``, ``F.nll_loss``, or a ``functools.partial`` of these,
    with ``reduction="mean"``), the function counting a target as its mean does: the targets
    that are not ``ignore_index``, each weighted by its class's ``weight`` where one is given.
    A subclass keeping the module's ``forward`` (one that only sets defaults) averages alike;
    ``None`` for any other ``loss_fn`` (a subclass with its own ``forward`` may average
    otherwise)."""
    if declared_reduction(loss_fn, loss_kwargs) != "mean":
        return None
    if _keeps_class_index_forward(loss_fn):
        settings = {"ignore_index": loss_fn.ignore_index, "weight": loss_fn.weight}
    elif isinstance(loss_fn, functools.partial) and not loss_fn.args \
            and loss_fn.func in CLASS_INDEX_LOSSES:
        settings = dict(loss_fn.keywords)
    elif loss_fn in CLASS_INDEX_LOSSES:
        settings = {}
    else:
        return None
    settings.update(loss_kwargs or {})
    return functools.partial(class_target_count, ignore_index=settings.get("ignore_index", -100),
                             weight=settings.get("weight"))


def _keeps_class_index_forward(loss_fn) -> bool:
    """Whether ``loss_fn`` is an ``nn.CrossEntropyLoss`` or ``nn.NLLLoss``, or an instance of
    a subclass that does not override its ``forward`` (so it averages as the module does)."""
    return any(isinstance(loss_fn, module) and type(loss_fn).forward is module.forward
               for module in _CLASS_INDEX_MODULES)


def class_target_count(target, ignore_index: int, weight: Optional[torch.Tensor]):
    """What ``F.cross_entropy`` / ``F.nll_loss`` (``reduction="mean"``) divide by for
    ``target``: its entries that are not ``ignore_index``, or their classes' ``weight`` summed.
    Raises :class:`NotCounted` for a target that is not a tensor of class indices."""
    if not isinstance(target, torch.Tensor) or target.is_floating_point() \
            or target.is_complex() or target.dtype == torch.bool:
        raise NotCounted
    kept = target[target != ignore_index]
    if weight is None:
        return kept.numel()
    return weight.to(kept.device)[kept].sum()


class _ClassIndexLossCalls(TorchFunctionMode):
    """Records the arguments of every ``F.cross_entropy`` / ``F.nll_loss`` call made inside it
    (``nn.CrossEntropyLoss`` and ``nn.NLLLoss`` call these too), defaults filled in, and what
    it returned (``"result"``)."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in CLASS_INDEX_LOSSES:
            bound = inspect.signature(func).bind(*args, **kwargs)
            bound.apply_defaults()
            self.calls.append({**bound.arguments, "result": result})
        return result


def _masked_mean(calls: list, loss) -> Optional[tuple]:
    """``(count, target elements, counter, whole)`` where ``calls`` is one class-index loss
    with ``reduction="mean"`` on class indices (its mean divides by ``count``; ``counter``
    counts another target alike; ``whole``: ``loss``, what ``loss_fn`` returned, is that mean
    itself, not a sum with other terms or a multiple of it); ``None`` for anything else (no
    such call, several, another reduction, class probabilities)."""
    if len(calls) != 1:
        return None
    call = calls[0]
    reduction = call["reduction"]
    if call["size_average"] is not None or call["reduce"] is not None:
        reduction = legacy_get_string(call["size_average"], call["reduce"], emit_warning=False)
    if reduction != "mean":
        return None
    counter = functools.partial(class_target_count, ignore_index=call["ignore_index"],
                                weight=call["weight"])
    try:
        count = count_value(counter(call["target"]))
    except NotCounted:
        return None
    return count, call["target"].numel(), counter, loss is call["result"]


class LossCountWatch:
    """Learns, from a ``loss_fn`` that does not say what its mean divides by (a lambda or a
    ``def`` around ``F.cross_entropy``), that count for one step's micro-batch ``targets``,
    and checks every later micro-batch against it.

    The first call (:meth:`call`, then :meth:`observe`) decides: a single class-index loss with
    ``reduction="mean"`` whose target has the micro-batch target's elements and count (the
    target reshaped, ``t.view(-1)``) gives every micro-batch's count before any backward
    (``counts``); one whose target the count cannot be predicted from (cut, shifted: ``t[:,
    1:]``), or whose mean is not all that ``loss_fn`` returns (an auxiliary or distillation
    term added to it, or a multiple of it: weighting the whole loss by the counts would weigh
    those terms wrongly), leaves the weights alike and requires every micro-batch to count as
    many targets as the first (:meth:`observe` says otherwise, naming ``loss_denominator``);
    anything else
    (a sum, a mean over rows) is left alone (``watching`` turns false). Each watched call
    costs a Python hook per torch function inside ``loss_fn``."""

    def __init__(self, targets: list):
        self._targets = targets
        self.watching = True
        self.learnt = False  # whether the step's first call was observed
        self.counts: Optional[list] = None  # every micro-batch's, once predicted
        # (micro-batch, count, why no count is predicted) where none is
        self._first: Optional[tuple] = None

    def call(self, loss_fn, output, target, loss_kwargs: dict):
        """``loss_fn(output, target, **loss_kwargs)`` and its class-index loss calls."""
        recorder = _ClassIndexLossCalls()
        with recorder:
            loss = loss_fn(output, target, **loss_kwargs)
        return loss, recorder.calls

    def observe(self, index: int, calls: list, loss) -> Optional[str]:
        """Micro-batch ``index``'s class-index loss ``calls`` and the ``loss`` ``loss_fn``
        returned: at the step's first, learn (:meth:`_learn`); at later ones, what is wrong
        with them (:meth:`_problem`)."""
        if self.learnt:
            return self._problem(index, calls, loss)
        self.learnt = True
        self._learn(index, calls, loss)
        return None

    def _learn(self, index: int, calls: list, loss) -> None:
        """Every micro-batch's count (``counts``) where it can be predicted, else the first's."""
        seen = _masked_mean(calls, loss)
        if seen is None:
            self.watching = False
            return
        count, elements, counter, whole = seen
        try:
            counts = [count_value(counter(t)) for t in self._targets]
        except NotCounted:
            counts = None
        own = self._targets[index]
        if not whole:
            self._first = index, count, "loss_fn returns more than that mean (another term " \
                                        "added to it, or a multiple of it)"
        elif counts is None or counts[index] != count or own.numel() != elements:
            self._first = index, count, "its target is not the micro-batch's target reshaped"
        else:
            self.counts = counts

    def _problem(self, index: int, calls: list, loss) -> Optional[str]:
        """What is wrong with micro-batch ``index``'s call, given what the first one taught:
        a count other than predicted (or than the first's, where none was predicted), or,
        where counts were predicted, a loss that is no longer that mean alone. A micro-batch
        predicted to count nothing is not checked: its loss is left out of the step's loss
        and gradients (``loss_fn`` may guard such a micro-batch, returning a zero instead of
        the NaN mean)."""
        if self.counts is not None and self.counts[index] == 0:
            return None  # counts nothing: no gradient, whatever it returns (a guard's zero)
        seen = _masked_mean(calls, loss)
        count = None if seen is None else seen[0]
        if self.counts is not None:
            expected, why = self.counts[index], "counted from its target as the first call did"
            if seen is not None and not seen[3]:
                count = None  # the mean is now one term of the loss: the counts do not apply
        else:
            first, expected, reason = self._first
            why = f"as micro-batch {first}'s call did; no count is predicted, since {reason}"
        if count == expected:
            return None
        found = "a loss that is no longer one class-index mean" if count is None else \
            f"a class-index mean over {count:g} counted targets"
        return (f"loss_fn (which does not say what its mean divides by) computed {found}, "
                f"expected one over {expected:g} ({why}); the mean of micro-batch means would "
                f"not be one process's mean over the whole target. Pass loss_denominator="
                f"lambda target: <the count loss_fn's mean divides by> (e.g. (target != -100)"
                f".sum()), or reduction='sum' with scale_grads=False")
