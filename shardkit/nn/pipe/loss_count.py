"""What a pipeline's ``loss_fn`` averages over, so that the micro-batch losses of a step add up
to one process's loss on the whole batch.

A mean over a count the target decides (cross-entropy with ``ignore_index``: its non-ignored
tokens, or their class weights) cannot be rebuilt from micro-batch means weighted alike: each
micro-batch's loss is weighted by its count's share of the whole target's instead. The count
comes from ``loss_denominator=``, from a ``loss_fn`` that declares itself (a ``torch.nn``
class-index loss, ``F.cross_entropy``, ``F.nll_loss``, their ``functools.partial``), or, for a
``loss_fn`` that says nothing (a lambda or a plain ``def``) or only ``reduction="mean"``, from
watching the step's ``loss_fn`` calls (:class:`LossCountWatch`): if the first that averages
by its target's counts computes class-index losses with ``reduction="mean"`` on its
micro-batch's target (reshaped, not cut) and returns their sum, each times a constant
(``0.5 * (ce1 + ce2)``, ``ce1 - 0.5 * ce2``, ``torch.add(ce1, ce2, alpha=0.5)``,
``torch.stack([ce1, ce2]).mean()``), the same count applies to every micro-batch; a mean it
cannot predict (divided by hand, cut targets, a term added) must count alike in every
micro-batch. Local to the rank running the last stage; no communication.
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
from torch.utils._pytree import tree_flatten

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
    otherwise). Also a loss function declaring its count itself (:func:`own_target_count`)."""
    own = own_target_count(loss_fn, loss_kwargs)
    if own is not None:
        return own
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


def own_target_count(loss_fn, loss_kwargs: Optional[dict]) -> Optional[Callable]:
    """For a function that declares what its mean divides by, in a ``target_count`` attribute
    called as ``target_count(target, **keywords)`` with the keywords ``loss_fn`` gets (those of
    its ``functools.partial`` and ``loss_kwargs``), e.g.
    :func:`shardkit.nn.model_parallel.gpt.gpt_loss` (its non-ignored tokens): that count of a
    target; ``None`` for a function declaring none. Local."""
    func, keywords = loss_fn, {}
    if isinstance(loss_fn, functools.partial) and not loss_fn.args:
        func, keywords = loss_fn.func, dict(loss_fn.keywords)
    count = getattr(func, "target_count", None)
    if not inspect.isfunction(func) or not callable(count):
        return None
    keywords.update(loss_kwargs or {})
    return functools.partial(count, **keywords)


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


class _LossCallRecord(TorchFunctionMode):
    """What one ``loss_fn`` call computes, recorded while it runs: every ``F.cross_entropy`` /
    ``F.nll_loss`` call (``nn.CrossEntropyLoss`` and ``nn.NLLLoss`` call these too), defaults
    filled in, with what it returned (``calls``); which tensors are those calls' results added
    together, each times a constant (``covered_calls``: ``0.5 * (ce1 + ce2)``, ``ce1 - ce2``,
    ``torch.add(ce1, ce2, alpha=0.5)``, ``torch.stack([ce1, ce2]).sum()``); and the counts
    taken from the target that it averages by itself (``target_divisors``: a division by a
    one-element tensor computed from the target, or by a number read out of one,
    ``(ce * mask).sum() / mask.sum()``, or the mean of the elements a target-derived mask
    picks, ``ce[mask].mean()``, ``ce[mask].float().mean()``, or its length, ``ce[mask].sum() /
    len(ce[mask])``, or a ``nanmean`` of a target-derived tensor). Operands passed as keywords
    (``torch.div(s, other=mask.sum())``) count as positional ones.

    Note: tensors are followed by ``id`` while the call runs; the record holds them, so no id
    is reused before it is discarded with the call."""

    def __init__(self, target):
        super().__init__()
        self.calls: list[dict] = []
        self.target_divisors: list[float] = []
        self._from_target = {id(t): t for t in tree_flatten(target)[0]
                             if isinstance(t, torch.Tensor)}
        self._picked_by_target: dict = {}
        self._target_numbers: set = set()  # Python numbers read out of target-derived tensors
        self._numbers_read: set = set()  # out of any tensor: a factor that may vary by data
        self._reciprocals: dict = {}  # id -> (tensor, count): ``1 / mask.sum()``
        self._sums: dict = {}  # id -> (tensor, the calls whose results it adds up, scaled)
        self._stacks: dict = {}  # id -> (tensor, the calls whose results it stacks)

    def covered_calls(self, loss) -> frozenset:
        """The calls whose results, each times a constant, ``loss`` is the sum of (empty if
        it is anything else)."""
        tensor, calls = self._sums.get(id(loss), (None, frozenset()))
        return calls if tensor is loss else frozenset()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        operands = _operands(args, kwargs)
        if func in CLASS_INDEX_LOSSES:
            bound = inspect.signature(func).bind(*args, **kwargs)
            bound.apply_defaults()
            self.calls.append({**bound.arguments, "result": result})
            self._sums[id(result)] = result, frozenset({len(self.calls) - 1})
        elif name in _ADDITIONS + _SUBTRACTIONS:
            self._note_sum(operands, kwargs.get("alpha"), result)
        elif name in _MULTIPLICATIONS + _DIVISIONS + _NEGATIONS:
            self._note_scaled(name, operands, kwargs, result)
        elif name == "stack":
            self._note_stack(args, kwargs, result)
        elif name in _STACK_REDUCTIONS:
            self._note_stack_reduced(operands, result)
        self._note_target_divisor(name, operands, result)
        if operands and self._picked(operands[0]):
            self._note_picked_count(func, args, kwargs, result)
        if name in _READ_OUTS and isinstance(result, numbers.Real) \
                and not isinstance(result, bool):
            self._numbers_read.add(result)
        leaves = tree_flatten((args, kwargs))[0]
        self._note_picked(name, operands, leaves, result)
        if any(self._derived(t) for t in leaves):
            self._note_derived(name, operands, result)
        return result

    def _note_target_divisor(self, name: str, operands: tuple, result) -> None:
        """A count taken from the target that the call averages by itself: a division by it
        (``/ mask.sum()``, ``torch.div(s, other=mask.sum())``, ``/ len(ce[mask])``), a
        multiplication by its reciprocal (``* (1 / mask.sum())``, ``torch.mul(s, other=
        mask.sum().reciprocal())``), the mean of the elements a target-derived mask picks
        (``ce[mask].mean()``), or a ``nanmean`` of a tensor computed from the target
        (``torch.where(mask, ce, nan).nanmean()``: its elements that are not NaN)."""
        if name in _DIVISIONS and len(operands) > 1 and self._counts_target(operands[1]):
            self.target_divisors.append(float(operands[1]))
        elif name in _MULTIPLICATIONS and len(operands) > 1 and any(
                self._reciprocal(value) for value in operands):
            self.target_divisors.append(next(self._reciprocals[id(value)][1]
                                             for value in operands if self._reciprocal(value)))
        elif name in _RECIPROCALS and operands and self._counts_target(operands[0]) and (
                name == "reciprocal" or _constant(operands[1])):  # k / count: (count, k)
            self._reciprocals[id(result)] = result, float(operands[0])
        elif name == "mean" and operands and self._picked(operands[0]) \
                and isinstance(result, torch.Tensor) and result.numel() == 1:
            self.target_divisors.append(float(operands[0].numel()))
        elif name == "nanmean" and operands and self._derived(operands[0]) \
                and isinstance(result, torch.Tensor) and result.numel() == 1:
            self.target_divisors.append(float(operands[0].isnan().logical_not().sum()))

    def _note_picked_count(self, func, args: tuple, kwargs: dict, result) -> None:
        """Remember the number of elements a target-derived mask picks (``args[0]``), however
        it is read: ``len(ce[mask])``, ``ce[mask].numel()``, ``ce[mask].size(0)``,
        ``ce[mask].shape[0]``, ``ce[mask].size()[0]``. The picked elements lie along dim 0;
        the other dims are alike in every micro-batch (``h[mask].size(-1)`` counts nothing)."""
        name = getattr(func, "__name__", "")
        if name in ("__len__", "numel") and isinstance(result, int):
            self._target_numbers.add(result)
        elif isinstance(result, torch.Size) and len(result) and (
                name == "size" or getattr(func, "__self__", None) is torch.Tensor.shape):
            self._target_numbers.add(result[0])
        elif name == "size" and isinstance(result, int):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(dim, int) and args[0].dim() and dim % args[0].dim() == 0:
                self._target_numbers.add(result)

    def _note_derived(self, name: str, operands: tuple, result) -> None:
        """``result`` (and, for an in-place write such as ``m[y == -100] = 0``, the tensor
        written) comes from the target; so do numbers read out of a one-element tensor
        (``mask.sum().item()``, ``int(...)``), remembered by value."""
        if name in _READ_OUTS and isinstance(result, numbers.Real) \
                and not isinstance(result, bool):
            self._target_numbers.add(result)
        written = [operands[0]] if operands and isinstance(operands[0], torch.Tensor) and (
            name == "__setitem__" or name.endswith("_") and not name.startswith("__")) else []
        self._from_target.update((id(t), t) for t in tree_flatten(result)[0] + written
                                 if isinstance(t, torch.Tensor))

    def _note_picked(self, name: str, operands: tuple, leaves: list, result) -> None:
        """Follow the elements a target-derived mask picks (``ce[mask]``) through selections
        and through element-wise ops on them alone (``.float()``, ``* 2``), whose mean still
        averages by the picked count."""
        if not isinstance(result, torch.Tensor):
            return
        if name in _SELECTIONS and len(operands) > 1 and self._derived(operands[1]):
            self._picked_by_target[id(result)] = result
            return
        if not self._picked_by_target:
            return
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if len(tensors) == 1 and self._picked(tensors[0]) and result.shape == tensors[0].shape:
            self._picked_by_target[id(result)] = result

    def _reciprocal(self, value) -> bool:
        return isinstance(value, torch.Tensor) and \
            self._reciprocals.get(id(value), (None,))[0] is value

    def _picked(self, value) -> bool:
        return isinstance(value, torch.Tensor) and self._picked_by_target.get(id(value)) is value

    def _derived(self, value) -> bool:
        return isinstance(value, torch.Tensor) and self._from_target.get(id(value)) is value

    def _counts_target(self, divisor) -> bool:
        """Whether ``divisor`` is a one-element tensor computed from the target, or a number
        read out of one (``mask.sum().item()``, also after ``max(..., 1)``)."""
        if isinstance(divisor, numbers.Real) and not isinstance(divisor, bool):
            return divisor in self._target_numbers
        return self._derived(divisor) and divisor.numel() == 1

    def _note_sum(self, operands: tuple, alpha, result) -> None:
        """``result`` adds up (or subtracts, ``ce1 - 0.5 * ce2``, ``torch.add(ce1, ce2,
        alpha=0.5)``) class-index call results where every tensor is such a sum (of other
        calls each) and every number added is zero; ``alpha`` must be a constant."""
        if len(operands) != 2 or alpha is not None and not self._is_constant(alpha):
            return
        covered = []
        for value in operands:
            if isinstance(value, torch.Tensor):
                tensor, calls = self._sums.get(id(value), (None, frozenset()))
                if tensor is not value or not calls:
                    return
                covered.append(calls)
            elif value != 0:
                return
        self._sums[id(result)] = result, frozenset().union(*covered)

    def _note_scaled(self, name: str, operands: tuple, kwargs, result) -> None:
        """``result`` is such a sum times, or divided by, a constant (a Python number not read
        out of a tensor, whose value could differ between micro-batches), or negated:
        weighting it by the counts weighs every term alike, as one process's mean over the
        whole target does."""
        if name in _NEGATIONS:
            summed, factor = operands[0] if operands else None, -1
        elif len(operands) != 2 or kwargs.get("rounding_mode") is not None:
            return
        else:
            summed, factor = operands if name in _DIVISIONS or \
                isinstance(operands[0], torch.Tensor) else operands[::-1]
        tensor, calls = self._sums.get(id(summed), (None, frozenset()))
        if tensor is not summed or not calls or \
                name not in _NEGATIONS and not self._is_constant(factor):
            return
        self._sums[id(result)] = result, calls

    def _note_stack(self, args, kwargs, result) -> None:
        """``torch.stack([ce1, ce2])`` of one-element sums: remembered (as a sum whose
        elements must still be added up) until a sum or mean over all of it."""
        tensors = args[0] if args else kwargs.get("tensors", ())
        covered = []
        for value in tensors:
            tensor, calls = self._sums.get(id(value), (None, frozenset()))
            if tensor is not value or not calls or value.numel() != 1:
                return
            covered.append(calls)
        if covered:
            self._stacks[id(result)] = result, frozenset().union(*covered)

    def _note_stack_reduced(self, operands: tuple, result) -> None:
        """A sum or mean of such a stack down to one element (``torch.stack(...).sum()``,
        ``.mean()``): every element added, each times the same constant."""
        stacked = operands[0] if operands else None
        tensor, calls = self._stacks.get(id(stacked), (None, frozenset()))
        if tensor is stacked and calls and isinstance(result, torch.Tensor) \
                and result.numel() == 1:
            self._sums[id(result)] = result, calls

    def _is_constant(self, factor) -> bool:
        """A finite, non-zero Python number not read out of a tensor, nor counting the
        elements a target-derived mask picks (``len(y[mask])``): either could differ between
        micro-batches."""
        return _constant(factor) and factor not in self._numbers_read \
            and factor not in self._target_numbers


_ADDITIONS = ("add", "add_", "__add__", "__radd__", "__iadd__")
_SUBTRACTIONS = ("sub", "sub_", "subtract", "__sub__", "__rsub__", "__isub__", "rsub")
_NEGATIONS = ("neg", "negative", "__neg__")
_STACK_REDUCTIONS = ("sum", "mean")
_DIVISIONS = ("div", "div_", "true_divide", "__truediv__", "__itruediv__")
_MULTIPLICATIONS = ("mul", "mul_", "__mul__", "__rmul__", "__imul__")
_RECIPROCALS = ("reciprocal", "__rdiv__", "__rtruediv__")
_SELECTIONS = ("__getitem__", "masked_select")
_READ_OUTS = ("item", "__int__", "__float__", "__index__")


def _mean_counts(calls: list) -> list:
    """``(count, target elements, counter)`` of each class-index call with ``reduction=
    "mean"`` on class indices (its mean divides by ``count``; ``counter`` counts another target
    alike). A call on class probabilities averages over rows, not a count its target decides:
    it has none (a distillation term beside a class-index mean)."""
    means = []
    for call in calls:
        reduction = call["reduction"]
        if call["size_average"] is not None or call["reduce"] is not None:
            reduction = legacy_get_string(call["size_average"], call["reduce"],
                                          emit_warning=False)
        if reduction != "mean":
            continue
        counter = functools.partial(class_target_count, ignore_index=call["ignore_index"],
                                    weight=call["weight"])
        try:
            means.append((count_value(counter(call["target"])), call["target"].numel(),
                          counter))
        except NotCounted:
            continue
    return means


def _averages(record: _LossCallRecord) -> Optional[tuple]:
    """What one ``loss_fn`` call averaged by: the counts of its class-index means and the
    target counts it divided by itself, as ``(counts, divisors)``; ``None`` for a call that
    averages by no count its target decides (a sum, a mean over rows, class probabilities)."""
    means = _mean_counts(record.calls)
    if not (means or record.target_divisors):
        return None
    return tuple(count for count, _, _ in means), tuple(record.target_divisors)


def _describe(averages: Optional[tuple]) -> str:
    if averages is None:
        return "a loss that is no longer one class-index mean"
    counts, divisors = averages
    parts = [f"a class-index mean over {count:g} counted targets" for count in counts] + \
        [f"a division by {divisor:g} (a count taken from its target)" for divisor in divisors]
    return " and ".join(parts)


class LossCountWatch:
    """Learns, from a ``loss_fn`` that does not say what its mean divides by (a lambda or a
    ``def`` around ``F.cross_entropy``), that count for one step's micro-batch ``targets``,
    and checks every later micro-batch against it.

    The step's first call that averages by a count its target decides (:meth:`call`, then
    :meth:`observe`) decides. Class-index losses with ``reduction="mean"`` (one, or several
    added up, each times a constant: two heads, ``0.5 * (ce1 + ce2)``) whose targets have the
    micro-batch target's elements and count (the target reshaped, ``t.view(-1)``) give every
    micro-batch's count before any backward (``counts``), where that sum is all ``loss_fn``
    returns. A call whose counts cannot be predicted (a cut or shifted target ``t[:, 1:]``;
    means counting differently; a masked mean the user divides by hand, ``(ce * mask).sum() /
    mask.sum()``), or whose means are not all that ``loss_fn`` returns (an auxiliary term
    added, a class-probability term beside them: weighting the whole loss by the counts would
    weigh that term wrongly), leaves the weights alike and requires every
    micro-batch to average by the same counts as the first (:meth:`observe` says otherwise,
    naming ``loss_denominator``). Calls before it that average by nothing and return zero (a
    guard for a micro-batch whose targets are all ignored) must count nothing. A first call
    averaging by nothing otherwise (a sum, a mean over rows) ends the watch (``watching``
    turns false). Each watched call costs a Python hook per torch function inside
    ``loss_fn``."""

    def __init__(self, targets: list):
        self._targets = targets
        self.watching = True
        self.learnt = False  # whether a call averaging by the target's counts was observed
        self.counts: Optional[list] = None  # every micro-batch's, once predicted
        # (micro-batch, what it averaged by, why no count is predicted) where none is
        self._first: Optional[tuple] = None
        self._guarded: list = []  # earlier micro-batches averaging by nothing, returning zero

    def call(self, loss_fn, output, target, loss_kwargs: dict):
        """``loss_fn(output, target, **loss_kwargs)`` and its :class:`_LossCallRecord`."""
        record = _LossCallRecord(target)
        with record:
            loss = loss_fn(output, target, **loss_kwargs)
        return loss, record

    def observe(self, index: int, record: _LossCallRecord, loss) -> Optional[str]:
        """Micro-batch ``index``'s call: before one averaging by its target's counts, learn
        (:meth:`_learn`) or put off a guard's zero; afterwards, what is wrong with it
        (:meth:`_problem`)."""
        if self.learnt:
            return self._problem(index, record, loss)
        averages = _averages(record)
        if averages is None and _is_zero(loss):
            self._guarded.append(index)
            return None
        if averages is None:
            self.watching = False
            return None
        self.learnt = True
        self._learn(index, record, averages, loss)
        return self._guarded_problem(index)

    def _learn(self, index: int, record: _LossCallRecord, averages: tuple, loss) -> None:
        """Every micro-batch's count (``counts``) where it can be predicted, else the first's
        averages, which every micro-batch must then repeat."""
        means = _mean_counts(record.calls)
        own = self._targets[index]
        whole = record.covered_calls(loss) == frozenset(range(len(record.calls))) \
            and len(means) == len(record.calls)
        predicted = self._predicted_counts(means)
        if record.target_divisors:
            reason = "it divides by a count taken from its target itself (a masked mean)"
        elif not whole:
            reason = "loss_fn returns more than that mean (another term added to it, not a " \
                     "class-index mean times a constant)"
        elif predicted is None or any(count != predicted[index] or elements != own.numel()
                                      for count, elements, _ in means):
            reason = "its target is not the micro-batch's target reshaped"
        else:
            self.counts = predicted
            return
        self._first = index, averages, reason

    def _predicted_counts(self, means: list) -> Optional[list]:
        """Every micro-batch's count where each mean counts the micro-batch targets alike."""
        try:
            predictions = [[count_value(counter(t)) for t in self._targets]
                           for _, _, counter in means]
        except NotCounted:
            return None
        if not predictions or any(p != predictions[0] for p in predictions):
            return None
        return predictions[0]

    def _guarded_problem(self, index: int) -> Optional[str]:
        """A put-off micro-batch (no mean, a zero) that does count targets."""
        for guarded in self._guarded:
            if self.counts is None or self.counts[guarded] != 0:
                expected = "counts " + (f"{self.counts[guarded]:g} targets" if self.counts
                                        else "what it averages by")
                return self._refusal(f"no mean on micro-batch {guarded} (it returned zero)",
                                     expected, f"as micro-batch {index}'s call shows")
        return None

    def _problem(self, index: int, record: _LossCallRecord, loss) -> Optional[str]:
        """What is wrong with micro-batch ``index``'s call, given what the first one taught:
        other counts than predicted (or than the first's, where none were predicted), or,
        where counts were predicted, a loss that is no longer those means alone. A
        micro-batch predicted to count nothing is not checked: its loss is left out of the
        step's loss and gradients (``loss_fn`` may guard such a micro-batch, returning a zero
        instead of the NaN mean)."""
        if self.counts is not None and self.counts[index] == 0:
            return None  # counts nothing: no gradient, whatever it returns (a guard's zero)
        averages = _averages(record)
        if self.counts is not None:
            count = self.counts[index]
            whole = record.covered_calls(loss) == frozenset(range(len(record.calls)))
            if averages is not None and whole and not averages[1] and \
                    len(averages[0]) == len(record.calls) and all(c == count for c in averages[0]):
                return None
            if averages is not None and not whole:
                averages = None  # the means are now one term of the loss: counts do not apply
            return self._refusal(_describe(averages), f"one over {count:g}",
                                 "counted from its target as the first call did")
        first, expected, reason = self._first
        if averages == expected:
            return None
        return self._refusal(_describe(averages), _describe(expected),
                             f"as micro-batch {first}'s call did; no count is predicted, "
                             f"since {reason}")

    @staticmethod
    def _refusal(found: str, expected: str, why: str) -> str:
        return (f"loss_fn (which does not say what its mean divides by) computed {found}, "
                f"expected {expected} ({why}); the mean of micro-batch means would not be "
                f"one process's mean over the whole target. Pass loss_denominator="
                f"lambda target: <the count loss_fn's mean divides by> (e.g. (target != -100)"
                f".sum()), or reduction='sum' with scale_grads=False")


def _operands(args: tuple, kwargs: dict) -> tuple:
    """The (up to two) operands of a call however they were passed: ``torch.div(a, b)``,
    ``a.div(other=b)``, ``torch.mul(input=a, other=b)``, ``torch.masked_select(a, mask=m)``,
    ``torch.reciprocal(input=c)``."""
    first = args[0] if args else kwargs.get("input")
    second = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mask"))
    return tuple(value for value in (first, second) if value is not None) \
        if first is not None else ()


def _constant(value) -> bool:
    """Whether ``value`` is a finite, non-zero Python number (a factor in a ``loss_fn``)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) \
        and math.isfinite(value) and value != 0


def _is_zero(loss) -> bool:
    """Whether ``loss`` is a one-element tensor holding zero (a guard's ``out.sum() * 0``)."""
    return isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.detach().item() == 0
