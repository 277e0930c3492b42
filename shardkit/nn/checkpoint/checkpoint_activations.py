"""Activation checkpointing: keep a region's inputs, drop its activations, recompute in backward.

:func:`checkpoint_wrapper` makes any module checkpointed, FairScale style: the module object,
its class, its parameters and its ``state_dict`` keys stay the same; only its ``forward`` now
runs under non-reentrant ``torch.utils.checkpoint``. What that buys and costs:

- memory: of the activations inside the module only its inputs stay alive between forward and
  backward (on CPU with ``offload_to_cpu=True``); everything else is recomputed.
- compute: one extra forward of the module per backward. No communication of its own (an FSDP
  unit inside the region all-gathers its parameters again for the recomputation, as it would
  for its backward anyway).

Layers can ask :func:`is_checkpointing` (inside the first forward of a checkpointed region) and
:func:`is_recomputing` (inside its recomputation) to behave consistently. Dropout needs no help:
the default RNG state and the streams of the model-parallel RNG tracker
(:func:`~shardkit.nn.model_parallel.get_model_parallel_rng_tracker`, entered with ``fork()``)
are saved before the first forward and restored for the recomputation, so both draw the same
mask; afterwards the generators are back where the recomputation found them. BatchNorm running
statistics are updated once, by the first forward: the recomputation normalises with the same
batch statistics but leaves the running ones alone. The recomputation runs every submodule in
the train/eval mode of the first forward, even if ``model.eval()`` was called in between. A
region may be recomputed any number of times (``backward(retain_graph=True)`` then
``backward()``, a pipeline's split weight-gradient pass); every recomputation behaves the same.
Skip connections (:func:`~shardkit.nn.pipe.skip.skippable`) crossing a region's boundary work:
its recomputation pops the tensors its first forward popped (kept alive until then) and stashes
nothing again.

:class:`shardkit.nn.Pipe` checkpoints its micro-batches with :func:`checkpointed_call`, so its
``is_checkpointing``/``is_recomputing`` are these same functions.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import sys
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import CheckpointFunction as _TorchCheckpointFunction
from torch.utils.checkpoint import _recomputation_hook as _TorchRecomputationHook
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from shardkit.nn.model_parallel.random import get_model_parallel_rng_tracker

__all__ = ["checkpoint_wrapper", "disable_checkpointing", "is_checkpointing", "is_recomputing",
           "checkpointed_call", "apply_activation_checkpointing", "is_checkpoint_wrapped",
           "CheckpointImpl"]


class CheckpointImpl(enum.Enum):
    """torch's ``checkpoint_wrapper(checkpoint_impl=...)`` choices. shardkit's checkpointing is
    non-reentrant (torch's default), so ``NO_REENTRANT`` is the one accepted."""

    REENTRANT = enum.auto()
    NO_REENTRANT = enum.auto()


def _check_checkpoint_impl(checkpoint_impl) -> None:
    """``NO_REENTRANT`` (this enum's or torch's member, by name) passes; anything else is a
    ValueError naming the argument. Local."""
    name = getattr(checkpoint_impl, "name", None)
    if isinstance(checkpoint_impl, enum.Enum) and name == "NO_REENTRANT":
        return
    raise ValueError(f"checkpoint_wrapper(checkpoint_impl={checkpoint_impl!r}): shardkit's "
                     f"activation checkpointing is non-reentrant only; pass "
                     f"CheckpointImpl.NO_REENTRANT (torch's default) or leave it unset")


class _CheckpointState(threading.local):
    def __init__(self):
        self.enabled = True
        self.checkpointing = 0  # depth of first forwards of checkpointed regions
        self.recomputing = 0  # depth of recomputations
        # a _Received per region first forward, a _Replay per recomputation, innermost last
        self.outside: list = []


_state = _CheckpointState()


def is_checkpointing() -> bool:
    """True while the first forward of a checkpointed region runs (this thread)."""
    return _state.checkpointing > 0


def is_recomputing() -> bool:
    """True while a checkpointed region is being recomputed during backward (this thread):
    a region of shardkit's (:func:`checkpoint_wrapper`, ``shardkit.checkpointing``, ``Pipe``),
    or one of torch's own ``torch.utils.checkpoint`` (reentrant or not). Any other forward that
    runs during a backward pass (in a gradient hook, in a custom function's backward) is not a
    recomputation: False there, as for torch's BatchNorm, which tracks it."""
    return _state.recomputing > 0 or _inside_torch_checkpoint_recomputation()


def _inside_torch_checkpoint_recomputation() -> bool:
    """Whether this thread is recomputing a ``torch.utils.checkpoint`` region now: the
    reentrant one reruns it from its autograd function's backward (the node autograd is
    running), the non-reentrant one under its recomputation's saved-tensor hooks. Local."""
    if torch._C._current_graph_task_id() == -1:
        return False  # not in a backward pass: the cheap common case
    node = torch._C._current_autograd_node()
    if isinstance(node, _TorchCheckpointFunction._backward_cls):
        return True
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    recomputation = _TorchRecomputationHook.__qualname__ + "."
    return hooks is not None and hooks[0].__qualname__.startswith(recomputation)


@contextlib.contextmanager
def disable_checkpointing() -> Iterator[None]:
    """Context manager: checkpointed modules run a plain forward (activations kept) inside it.

    Useful to compare memory with and without checkpointing, or for a forward whose backward
    will never run twice anyway. Costs nothing.
    """
    previous = _state.enabled
    _state.enabled = False
    try:
        yield
    finally:
        _state.enabled = previous


@contextlib.contextmanager
def _counting(field: str) -> Iterator[None]:
    setattr(_state, field, getattr(_state, field) + 1)
    try:
        yield
    finally:
        setattr(_state, field, getattr(_state, field) - 1)


def _training_modes(modules: tuple[nn.Module, ...]) -> list[tuple[nn.Module, bool]]:
    """Each submodule of ``modules`` with its ``training`` flag, as the first forward saw it."""
    return [(m, m.training) for root in modules for m in root.modules()]


@contextlib.contextmanager
def _as_in_forward(modes: list[tuple[nn.Module, bool]]) -> Iterator[None]:
    # Note: a model switched to eval() (or back) between forward and backward, e.g. by an
    # evaluation callback, must still be recomputed as it ran: otherwise Dropout and BatchNorm
    # save other tensors (torch's "different number of tensors" CheckpointError) or, where
    # the count happens to match, give silently wrong gradients.
    now = [(m, m.training) for m, _ in modes]
    for m, training in modes:
        m.training = training
    try:
        yield
    finally:
        for m, training in now:
            m.training = training


@contextlib.contextmanager
def _modes_recorded(modes: list) -> Iterator[None]:
    """Append to ``modes`` each module called (in this thread) inside the block, with its
    ``training`` flag at its first call, for :func:`_as_in_forward` to replay.

    Note: a region given as a function (``non_reentrant_checkpoint(fn, x)``, the reentrant
    ``shardkit.checkpointing.checkpoint``) names no modules; when ``model.eval()`` ran between
    its forward and its backward, its recomputation ran Dropout in eval mode: torch's
    "different number of tensors" CheckpointError, or, reentrant, silently other gradients.
    Live only during the first forward (:func:`_each_module_called_here`)."""
    seen = set()

    def record(module):
        if id(module) not in seen:
            seen.add(id(module))
            modes.append((module, module.training))

    with _each_module_called_here(record):
        yield


@contextlib.contextmanager
def _each_module_called_here(callback: Callable[[nn.Module], None]) -> Iterator[None]:
    """``callback(module)`` before each module call made in this thread inside the block: a
    process-wide forward pre-hook, live only inside it, that calls from other threads (a
    second model training beside this one) pass through untouched."""
    thread = threading.get_ident()

    def before_call(module, inputs):
        if threading.get_ident() == thread:
            callback(module)

    handle = nn.modules.module.register_module_forward_pre_hook(before_call)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _first_forward(modes: list, record: bool, received: "_Received") -> Iterator[None]:
    """The context of a region's first forward: :func:`is_checkpointing` is True, with
    ``record`` the modules it calls are added to ``modes``, and the values it takes from
    outside its arguments are added to ``received``."""
    with _counting("checkpointing"), _outside_values_recorded(received), \
            (_modes_recorded(modes) if record else contextlib.nullcontext()):
        yield


class _Received:
    """What a checkpointed region took by key from outside its arguments (the tensors its skip
    connections popped), in order; ``keys_stashed`` are the keys stashed inside it, whose pops
    are not taken from outside.

    A ``reentrant`` region (``shardkit.checkpointing.checkpoint``) runs its first forward
    without grad: it refuses to pop a tensor that requires grad from outside (the gradient
    could not flow back to its stash), and ``escaping`` holds what it stashed and did not pop
    itself, by key, until the region hands those tensors to autograd as extra outputs."""

    def __init__(self, reentrant: bool = False):
        self.values: list = []
        self.keys_stashed: set = set()
        self.reentrant = reentrant
        self.escaping: dict = {}


class _Replay:
    """A recomputation's view of :class:`_Received`: the values in turn, and the stashes made
    by the recomputation itself, for pops inside it."""

    def __init__(self, received: _Received):
        self.values = iter(received.values)
        self.stashed: dict = {}


@contextlib.contextmanager
def _outside_values_recorded(received: _Received) -> Iterator[None]:
    """Inside the block (a first forward), :func:`_keyed_pop` adds to ``received``."""
    _state.outside.append(received)
    try:
        yield
    finally:
        _state.outside.pop()


@contextlib.contextmanager
def _outside_values_replayed(received: _Received) -> Iterator["_Replay"]:
    """Inside the block (a recomputation), :func:`_keyed_pop` answers from ``received``; the
    block gets the :class:`_Replay` (what the recomputation stashed is in its ``stashed``)."""
    replay = _Replay(received)
    _state.outside.append(replay)
    try:
        yield replay
    finally:
        _state.outside.pop()


def _innermost_replay() -> tuple[int, Any]:
    """The index in ``_state.outside`` of the innermost recomputation running, and it
    (``-1, None`` when none)."""
    for index in range(len(_state.outside) - 1, -1, -1):
        if isinstance(_state.outside[index], _Replay):
            return index, _state.outside[index]
    return -1, None


def _keyed_stash(key, value: Any, save: Callable[[Any, Any], None]) -> None:
    """Hand ``value`` under ``key`` to a later layer (a skip connection's stash): ``save(key,
    value)``; inside a recomputation it stays there (its first forward saved it already)."""
    index, replay = _innermost_replay()
    if replay is None:
        save(key, value)
    else:
        replay.stashed[key] = value
    for received in _state.outside[index + 1:]:
        received.keys_stashed.add(key)
        if received.reentrant:
            received.escaping[key] = value


def _keyed_pop(key, load: Callable[[Any], Any], what: str) -> Any:
    """Take the value stashed under ``key`` (a skip connection's pop): ``load(key)``; inside a
    recomputation, what its first forward took (or what the recomputation stashed itself).

    Note: torch's checkpoint replays only a region's arguments, but a popped skip tensor comes
    from a table its first forward emptied: the recomputation of a popping layer failed in
    backward ("popped before it was stashed")."""
    index, replay = _innermost_replay()
    if replay is None:
        value = load(key)
    elif key in replay.stashed:
        value = replay.stashed.pop(key)
    else:
        try:
            value = next(replay.values)
        except StopIteration:
            raise RuntimeError(f"activation checkpointing: the recomputation of a checkpointed "
                               f"region popped {what}, which its first forward did not pop; a "
                               f"checkpointed region must run the same way both times") from None
    for received in _state.outside[index + 1:]:
        if key in received.keys_stashed:
            received.escaping.pop(key, None)
        else:
            _check_poppable_into(received, value, what)
            received.values.append(value)
    return value


def _check_poppable_into(received: _Received, value: Any, what: str) -> None:
    """A reentrant region cannot take a tensor that requires grad from outside: its
    recomputation would run a second backward through the graph that made the tensor
    (torch's "Trying to backward through the graph a second time" in backward)."""
    if received.reentrant and isinstance(value, torch.Tensor) and value.requires_grad:
        raise RuntimeError(
            f"shardkit.checkpointing.checkpoint (reentrant) popped {what}, stashed outside the "
            f"checkpointed function, and that tensor requires grad: its gradient cannot flow "
            f"back through a reentrant recomputation. Stash it inside the function, pass it as "
            f"an argument, or use shardkit.checkpointing.non_reentrant_checkpoint (or "
            f"checkpoint_wrapper)")


@contextlib.contextmanager
def _recomputing(modules: tuple[nn.Module, ...], rng_streams: dict,
                 modes: list[tuple[nn.Module, bool]], received: "_Received") -> Iterator[None]:
    """The recomputation replays the first forward: same train/eval flags, same RNG streams
    (torch replays the default generator itself), the values it took from outside its
    arguments (``received``); its BatchNorm updates are undone."""
    # a region given as a function names no modules: the BatchNorms it calls are found as
    # they run
    with _as_in_forward(modes), _stats_restored(modules), \
            (contextlib.nullcontext() if modules else _run_norm_stats_restored()), \
            _rng_streams_replayed(rng_streams), _outside_values_replayed(received), \
            _counting("recomputing"):
        yield


@contextlib.contextmanager
def _stats_restored(modules: tuple[nn.Module, ...]) -> Iterator[None]:
    """BatchNorm running statistics of ``modules`` put back as they were at entry."""
    # Note: the recomputation must save the same tensors as the first forward, so BatchNorm
    # runs unchanged and its running statistics are put back afterwards. Writing through
    # ``.data`` keeps the version counters of tensors the recomputed graph saved unchanged.
    stats = [pair for m in modules for bn in m.modules() if isinstance(bn, _BatchNorm)
             for pair in _running_stats(bn)]
    try:
        yield
    finally:
        for buf, saved in stats:
            buf.data.copy_(saved)


def _running_stats(bn: _BatchNorm) -> list:
    """``(buffer, copy)`` of the running statistics a training-mode forward of ``bn`` updates."""
    if not (bn.training and bn.track_running_stats):
        return []
    return [(buf, buf.clone()) for buf in (bn.running_mean, bn.running_var,
                                           bn.num_batches_tracked) if buf is not None]


@contextlib.contextmanager
def _run_norm_stats_restored() -> Iterator[None]:
    """Running statistics of every BatchNorm called (as a module) in this thread inside the
    block put back, at exit, as they were before its first call there.

    Note: a region given as a function (``non_reentrant_checkpoint(fn, x)``, the reentrant
    ``shardkit.checkpointing.checkpoint``, a closure over layers) names no modules, so
    :func:`_stats_restored` cannot find its BatchNorms; without this the recomputation
    updated their statistics a second time each step (``num_batches_tracked`` counting two per
    step, running means drifting from those of the same training without checkpointing).
    Live only during the recomputation (:func:`_each_module_called_here`)."""
    saved = {}

    def save(module):
        if isinstance(module, _BatchNorm) and id(module) not in saved:
            saved[id(module)] = _running_stats(module)

    try:
        with _each_module_called_here(save):
            yield
    finally:
        for stats in saved.values():
            for buf, value in stats:
                buf.data.copy_(value)


@contextlib.contextmanager
def _rng_streams_replayed(rng_streams: dict) -> Iterator[None]:
    # Tensor-parallel dropout draws inside tracker.fork(): replay the streams as they were at
    # the first forward (torch restores only the default generator), then resume the current
    # ones so the recomputation consumes no randomness of the training that follows.
    # The forks open at the first forward are open again (a fork of one of them inside the
    # region goes on with it, as it did then).
    with get_model_parallel_rng_tracker()._replaying(rng_streams):
        yield


class _EachEntryAnew:
    """A context manager that runs a fresh one from ``factory`` at every entry, so it can be
    entered again (torch.utils.checkpoint enters its recompute context once per recomputation,
    and a region is recomputed once per backward through it)."""

    def __init__(self, factory: Callable[[], contextlib.AbstractContextManager]):
        self._factory = factory
        self._entered = []

    def __enter__(self):
        context = self._factory()
        value = context.__enter__()
        self._entered.append(context)
        return value

    def __exit__(self, *exc_info):
        return self._entered.pop().__exit__(*exc_info)


def _contexts(modules: tuple[nn.Module, ...]):
    def forward_and_recompute_contexts():
        # called by torch_checkpoint right before the region's first forward
        rng_streams = get_model_parallel_rng_tracker()._replay_point()
        modes = _training_modes(modules)
        received = _Received()
        # a region given as a function names no modules: those it calls are recorded
        return (_first_forward(modes, record=not modules, received=received),
                _EachEntryAnew(lambda: _recomputing(modules, rng_streams, modes, received)))

    return forward_and_recompute_contexts


def _device_to_restore(value: Any):
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.device
    return None


def _offloaded(fn: Callable, args: tuple) -> tuple[Callable, tuple]:
    """``fn`` and its arguments rewritten so the tensors the region keeps live on CPU: they are
    copied to CPU before the region and back to their device as the region's first step (which
    the recomputation repeats). The copies are differentiable, so gradients reach the inputs."""
    devices = [_device_to_restore(a) for a in args]

    def on_device(*cpu_args):
        return fn(*[a.to(d) if d is not None else a for a, d in zip(cpu_args, devices)])

    return on_device, tuple(a.to("cpu") if d is not None else a for a, d in zip(args, devices))


def _keywords_as_positions(fn: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple]:
    """``fn`` taking its tensor keyword arguments positionally, after ``args``.

    Note: torch's non-reentrant checkpoint saves (and version-checks) only the positional
    tensors; keyword ones are kept by reference, so a keyword tensor changed in place after the
    first forward (or by it) would silently feed the recomputation other values, and other
    gradients. As positions they are checked like ``args``."""
    names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    if not names:
        return (lambda *a: fn(*a, **kwargs)), args
    n = len(args)

    def with_keywords(*flat):
        given = dict(zip(names, flat[n:]))
        return fn(*flat[:n], **{k: given.get(k, v) for k, v in kwargs.items()})

    return with_keywords, args + tuple(kwargs[k] for k in names)


def _region_name(fn: Callable, modules: tuple[nn.Module, ...]) -> str:
    if modules:
        return type(modules[0]).__name__
    return getattr(fn, "__qualname__", type(fn).__name__)


def _check_inputs_unchanged(name: str, tensors: tuple, versions: list, labels: list,
                            nested: "_NestedInputs" = None) -> None:
    """Raise if the first forward changed one of the region's input tensors in place: the
    recomputation would start from the changed value (torch refuses it later, in backward, with
    "modified by an inplace operation" pointing at neither the module nor the argument)."""
    changed = [label for t, v, label in zip(tensors, versions, labels)
               if v is not None and t._version != v]
    if nested:
        changed += nested.changed()
    if changed:
        raise RuntimeError(
            f"activation checkpointing: {name}.forward changed its input "
            f"{', '.join(changed)} in place (e.g. nn.ReLU(inplace=True) as its first layer, or "
            f"`x += ...`), or replaced it inside a list or dict argument (`batch['x'] = ...`); "
            f"the recomputation in backward would start from the changed value. "
            f"Make that in-place operation out of place, or do not checkpoint {name} "
            f"(checkpoint_wrapper, or a Pipe partition starting with it)")


def checkpointed_call(fn: Callable, *args, modules: tuple[nn.Module, ...] = (),
                      offload_to_cpu: bool = False, **kwargs):
    """Run ``fn(*args, **kwargs)`` as a non-reentrant checkpointed region and return its output.

    ``modules`` are the modules ``fn`` runs: they are recomputed in the train/eval mode of the
    first forward and their BatchNorm running statistics are restored after the
    recomputation; with no ``modules``, the same holds for each module ``fn`` calls. With
    ``offload_to_cpu`` the tensor inputs kept for the recomputation are held on CPU and copied
    back to their device inside the region (tensors inside list, tuple or dict arguments stay
    where they are). Without grad mode, or inside :func:`disable_checkpointing`, ``fn`` simply
    runs. Under ``torch.compile`` the region is compiled as torch's own non-reentrant
    checkpoint: the recomputation happens in the compiled backward, and the flags
    (:func:`is_checkpointing`, :func:`is_recomputing`) stay False there.

    Tensor arguments, positional or keyword, must not be changed in place, by ``fn`` (a
    ``RuntimeError`` naming the argument right after the forward) or before the backward
    (torch's "modified by an inplace operation" error in backward), as the recomputation reads
    them again; so must tensors inside list, tuple and dict arguments, nor be replaced there
    (a ``RuntimeError`` naming the argument and the key, right after the forward or at the
    recomputation).
    Memory: the tensor arguments stay referenced until the backward.
    """
    if not (_state.enabled and torch.is_grad_enabled()):
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        if offload_to_cpu:
            fn, args = _offloaded(functools.partial(fn, **kwargs), args)
            kwargs = {}
        # Dynamo refuses a context_fn built at run time ("checkpoint not implemented for
        # NestedUserFunctionVariable context_fn"); the compiled graph recomputes the region in
        # its backward graph, where buffer updates and RNG draws are handled by the compiler.
        return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                                **kwargs)
    region, inputs = _keywords_as_positions(fn, args, kwargs)
    if offload_to_cpu:
        region, inputs = _offloaded(region, inputs)
    versions = [_version(t) for t in inputs]
    name = _region_name(fn, modules)
    nested = _nested_tensors(fn, args, kwargs)
    if nested:
        region = _nested_checked_at_recompute(region, nested, name)
    out = torch_checkpoint(region, *inputs, use_reentrant=False, preserve_rng_state=True,
                           context_fn=_contexts(modules))
    _check_inputs_unchanged(name, inputs, versions, _input_labels(fn, args, kwargs),
                            nested)
    return out


class _NestedInputs:
    """Where the tensors inside a call's list, tuple and dict arguments sit (at any depth):
    each slot ``(container, key, item)`` holding a tensor or a container, and each tensor's
    in-place version counter, as at the call.

    Note: torch's checkpoint keeps such tensors by reference and checks nothing: one changed
    in place, or a slot given another object (``batch["x"] = batch["x"].clone().add_(1)``,
    by the forward or by the caller before the backward), silently fed the recomputation
    other values (other gradients), where a tensor argument is refused."""

    __slots__ = ("slots", "versions")

    def __init__(self, slots: list, versions: list):
        self.slots, self.versions = slots, versions

    def __bool__(self) -> bool:
        return bool(self.versions)

    def changed(self) -> list:
        """The labels of the tensors changed in place and of the slots now holding another
        object (or gone)."""
        changed = [_path_label(path) for t, v, path in self.versions if t._version != v]
        for container, key, item, path in self.slots:
            try:
                same = container[key] is item
            except (KeyError, IndexError, TypeError):
                same = False
            if not same:
                changed.append(_path_label(path))
        return changed


_CONTAINERS = (list, tuple, dict)


def _path_label(path: tuple) -> str:
    return path[0] + "".join(f"[{key!r}]" for key in path[1:])


def _nested_tensors(fn: Callable, args: tuple, kwargs: dict) -> _NestedInputs:
    """The tensors held inside the list, tuple and dict arguments of ``fn(*args, **kwargs)``
    (:class:`_NestedInputs`; false when there are none), e.g. ``forward(self, batch)`` with
    ``batch = {"x": tensor}``. Iterative (any depth); items that are neither tensors nor
    containers (a list of token ids) cost one type check each."""
    roots = [(a, i, None) for i, a in enumerate(args) if isinstance(a, _CONTAINERS)]
    roots += [(v, k, None) for k, v in kwargs.items() if isinstance(v, _CONTAINERS)]
    if not roots:
        return _NestedInputs([], [])
    names = _positional_names(fn)
    stack = [(value, (f"{names[key]!r}" if key < len(names) else f"#{key}",)
              if isinstance(key, int) else (f"{key!r}",)) for value, key, _ in reversed(roots)]
    slots, versions, seen = [], [], set()
    while stack:
        value, path = stack.pop()
        if id(value) in seen:  # a container met twice (or holding itself)
            continue
        seen.add(id(value))
        mutable = not isinstance(value, tuple)
        children = []
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            if isinstance(item, torch.Tensor):
                if item.is_inference():
                    continue
                versions.append((item, item._version, path + (key,)))
            elif isinstance(item, _CONTAINERS):
                children.append((item, path + (key,)))
            else:
                continue
            if mutable:
                slots.append((value, key, item, path + (key,)))
        stack.extend(reversed(children))
    if not versions:
        return _NestedInputs([], [])
    return _NestedInputs(slots, versions)


def _nested_checked_at_recompute(region: Callable, nested: _NestedInputs,
                                 name: str) -> Callable:
    """``region`` refusing to be recomputed (a ``RuntimeError`` naming the tensor) once a
    tensor of ``nested`` (:func:`_nested_tensors`) has changed in place, or its slot has been
    given another object, since the forward."""
    recomputing = [False]  # the first call is the forward

    def checked(*args, **kwargs):
        if recomputing[0]:
            changed = nested.changed()
            if changed:
                raise RuntimeError(
                    f"activation checkpointing: {name}'s input {', '.join(changed)} (a tensor "
                    f"inside a list, tuple or dict argument) was changed in place or replaced "
                    f"between the forward and the backward; the recomputation would read the "
                    f"new value and give other gradients. Give the region a new container "
                    f"(or a copy of the tensor) instead of changing the one it was given, or "
                    f"do not checkpoint {name}")
        recomputing[0] = True
        return region(*args, **kwargs)

    return checked


def _version(value: Any):
    """A tensor's in-place version counter (None for non-tensors and inference tensors)."""
    if isinstance(value, torch.Tensor) and not value.is_inference():
        return value._version
    return None


def _input_labels(fn: Callable, args: tuple, kwargs: dict) -> list:
    """How an error names each input: positional ones by parameter name where ``fn`` has one."""
    names = _positional_names(fn)
    return [f"{names[i]!r}" if i < len(names) else f"#{i}" for i in range(len(args))] + \
        [f"{k!r}" for k, v in kwargs.items() if isinstance(v, torch.Tensor)]


class _WeakMethod:
    """``func`` bound to ``module`` through a weak reference: what checkpoint_wrapper stores as
    the module's ``forward`` (and its original forward).

    Note: a bound method stored on its own module is a reference cycle (module -> forward ->
    module) that only the cyclic garbage collector breaks, so ``del model`` would not free its
    parameters (GPU memory) until the next collection; FairScale binds weakly for this reason.
    A deep copy binds to the copied module and a pickle (``torch.save(model)``) to the loaded
    one, which a plain weak reference could not do.
    """

    def __init__(self, func: Callable, module: nn.Module):
        self.func = func
        self.module = weakref.ref(module)

    def __call__(self, *args, **kwargs):
        return self.func(self.module(), *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(types.MethodType(self.func, self.module()))

    def __deepcopy__(self, memo: dict) -> "_WeakMethod":
        module = self.module()
        return _WeakMethod(self.func, memo.get(id(module), module))

    def __reduce__(self):
        return _WeakMethod, (self.func, self.module())


def _checkpointed_forward(module: nn.Module, *args, **kwargs):
    if _state.enabled and torch.is_grad_enabled():
        args, kwargs = _without_caches(module, args, kwargs)
    return checkpointed_call(module._shardkit_unwrapped_forward, *args, modules=(module,),
                             offload_to_cpu=module._shardkit_offload_to_cpu, **kwargs)


# Parameter names under which Hugging Face layers receive a key/value cache (transformers'
# own activation checkpointing leaves out the same ones).
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _fills_in_place(value: Any) -> bool:
    """A cache object that layers ``update()`` (transformers' ``Cache``), not a legacy tuple
    of past tensors, a flag or a mapping."""
    return callable(getattr(value, "update", None)) and not isinstance(value, (torch.Tensor,
                                                                               dict))


def _without_caches(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with any key/value cache object replaced by ``None``, as
    transformers does when it checkpoints a layer itself: the forward appends this step's keys
    and values to the cache in place, so the recomputation would attend over them twice (a
    shape error or torch's "different number of tensors" CheckpointError). A layer that sets
    ``_can_checkpoint_with_cache`` (it only reads the cache) keeps its ``cache``."""
    layer = getattr(module, "_fsdp_wrapped_module", module)  # an FSDP unit checkpointed whole
    names = _positional_names(getattr(layer, "_shardkit_unwrapped_forward", layer.forward))
    args, kwargs, dropped = list(args), dict(kwargs), []
    keep = ("cache",) if getattr(layer, "_can_checkpoint_with_cache", False) else ()
    for i, name in enumerate(names[:len(args)]):
        if name in _CACHE_ARGUMENTS and name not in keep and _fills_in_place(args[i]):
            args[i] = None
            dropped.append(name)
    for name in _CACHE_ARGUMENTS:
        if name not in keep and _fills_in_place(kwargs.get(name)):
            kwargs[name] = None
            dropped.append(name)
    if dropped:
        warnings.warn(f"checkpoint_wrapper: {type(module).__name__} was given a key/value cache "
                      f"({', '.join(dropped)}) in a checkpointed forward; it runs without it, "
                      f"as under transformers' own gradient checkpointing (a cache only "
                      f"serves generation, which runs without grad and is not checkpointed)",
                      stacklevel=3)
    return tuple(args), kwargs


def _positional_names(fn: Callable) -> list:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C function: no names to match
        return []
    return [p.name for p in parameters
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False,
                       checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT
                       ) -> nn.Module:
    """Make ``module`` activation-checkpointed in place and return it.

    The module keeps its class, parameters and ``state_dict`` keys; its forward runs as a
    non-reentrant checkpointed region: keyword arguments, several inputs and outputs, inputs
    that do not require grad, and FSDP inside or outside all work. Dropout draws the same mask
    in the recomputation, inside the model-parallel RNG tracker's ``fork()`` too; BatchNorm
    running statistics are updated once per forward, and the recomputation runs in the
    train/eval mode of the forward even if ``eval()`` was called in between. Backward may run
    through it several times. Tensor arguments, positional or keyword, are what the
    recomputation starts from: a forward that changes one in place (``nn.ReLU(inplace=True)``
    as the first layer) raises a ``RuntimeError`` naming it, and one changed by the caller
    before backward is refused by torch in backward, as plain autograd refuses it; the same
    holds, with shardkit's ``RuntimeError`` naming the key, for tensors inside list, tuple and
    dict arguments, changed in place or replaced in their container.
    A key/value cache object handed to a checkpointed forward (a Hugging Face layer's ``cache``,
    ``past_key_values``, ``layer_past``) is replaced by ``None`` with a warning, as transformers'
    own checkpointing does: the forward fills it in place, so the recomputation would not see
    what the forward saw.

    Args:
        module: any ``nn.Module``.
        offload_to_cpu: keep the region's saved inputs on CPU between forward and backward
            (a device-to-host copy in forward, host-to-device in backward; no-op on CPU). Any
            truthy or falsy value, as in FairScale (``1``, ``"yes"``, ``None``...).
        checkpoint_impl: torch's argument: ``CheckpointImpl.NO_REENTRANT`` (this module's or
            torch's member), the only implementation here; ``REENTRANT`` is a ValueError.

    Memory: the module's activations are freed after forward, only its inputs are kept.
    Compute: one more forward per backward. Communication: none of its own.

    Usage::

        model.blocks = nn.Sequential(*[checkpoint_wrapper(b) for b in model.blocks])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_wrapper(module={type(module).__name__}): "
                        f"expected a torch.nn.Module")
    _check_checkpoint_impl(checkpoint_impl)
    offload_to_cpu = bool(offload_to_cpu)
    if is_checkpoint_wrapped(module):
        module._shardkit_offload_to_cpu = offload_to_cpu
        return module
    # A forward set on the instance (not the class's) is kept as it is.
    module._shardkit_unwrapped_forward = module.__dict__.get("forward") or \
        _WeakMethod(type(module).forward, module)
    module._shardkit_offload_to_cpu = offload_to_cpu
    module.forward = _WeakMethod(_checkpointed_forward, module)
    return module


def is_checkpoint_wrapped(module: nn.Module) -> bool:
    """Whether :func:`checkpoint_wrapper` made ``module``'s forward a checkpointed region."""
    # Note: the module's own attributes only. A wrapper that forwards attribute lookups to the
    # module it holds (an FSDP unit) would otherwise look checkpointed when its inner module
    # is, and checkpoint_wrapper(unit) would leave the unit's forward (its all-gather) out of
    # any region and set offload_to_cpu where nothing reads it.
    # A torch.compile'd module (OptimizedModule) forwards attribute writes to the module it
    # compiled, so it is wrapped exactly when that one is. (No compiled module exists before
    # dynamo is imported; looking it up here would import it, seconds, on the first call.)
    compiled = sys.modules.get("torch._dynamo.eval_frame")
    if compiled is not None and isinstance(module, compiled.OptimizedModule):
        module = module._orig_mod
    return "_shardkit_unwrapped_forward" in vars(module)


def _is_a_checkpoint_wrapper(fn) -> bool:
    """Whether ``fn`` is shardkit's or torch's ``checkpoint_wrapper`` (or a partial of it)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) == "checkpoint_wrapper"


def apply_activation_checkpointing(model: nn.Module, policy: Callable = None,
                                   check_fn: Callable[[nn.Module], bool] = None,
                                   offload_to_cpu: bool = False, *,
                                   checkpoint_wrapper_fn: Callable = None,
                                   auto_wrap_policy: Callable = None) -> nn.Module:
    """Checkpoint (in place, with :func:`checkpoint_wrapper`) every submodule of ``model`` that
    ``policy`` would wrap, or for which ``check_fn(module)`` is true, and return ``model``.

    ``policy`` is a wrap policy of :mod:`shardkit.nn.wrap` (e.g.
    ``no_split_modules_policy(hf_model)`` or ``transformer_auto_wrap_policy({Block})``),
    asked with ``recurse=False`` about each submodule; give exactly one of ``policy`` and
    ``check_fn``. A selected module's own submodules are not checkpointed again (nested regions
    would recompute twice). ``model`` itself is never selected. With FSDP it may run before
    wrapping (the block is checkpointed inside its unit) or after (when the selected block is
    an FSDP unit's wrapped module, the unit itself is checkpointed, its all-gather included in
    the region and repeated by the recomputation).

    torch's keywords work too: ``auto_wrap_policy=`` is ``policy`` (torch's
    ``CustomPolicy(fn)`` included: a dict that ``fn`` returns is passed to the wrapper function
    as keyword arguments, e.g. ``{"offload_to_cpu": True}``), and
    ``checkpoint_wrapper_fn=`` (e.g. ``functools.partial(checkpoint_wrapper,
    offload_to_cpu=False, checkpoint_impl=CheckpointImpl.NO_REENTRANT)``, the recipe of
    pytorch/examples' FSDP T5) is called on each selected module instead of
    :func:`checkpoint_wrapper`; a module it returns in place of the one given replaces it in
    its parent, as torch does.

    Memory: each selected module keeps only its inputs between forward and backward. Compute:
    one extra forward per selected module per backward. Communication: none of its own.

    Raises ``ValueError`` when nothing is selected (a policy that matches nothing is a mistake
    that would otherwise silently cost the memory it was meant to save).
    """
    if _is_a_checkpoint_wrapper(policy):  # torch's order: (model, checkpoint_wrapper_fn, ...)
        raise ValueError("apply_activation_checkpointing(model, <a checkpoint wrapper>): the "
                         "second argument here is the wrap policy (torch's is "
                         "checkpoint_wrapper_fn); pass the wrapper as checkpoint_wrapper_fn=... "
                         "and choose the modules with check_fn= or auto_wrap_policy=")
    if auto_wrap_policy is not None:
        if policy is not None:
            raise ValueError("apply_activation_checkpointing: give policy or auto_wrap_policy "
                             "(torch's name for it), not both")
        policy = auto_wrap_policy
    if checkpoint_wrapper_fn is not None:
        if not callable(checkpoint_wrapper_fn):
            raise ValueError(f"apply_activation_checkpointing(checkpoint_wrapper_fn="
                             f"{checkpoint_wrapper_fn!r}): expected a callable(module) -> "
                             f"module, e.g. functools.partial(checkpoint_wrapper, ...)")
        if offload_to_cpu:
            raise ValueError("apply_activation_checkpointing(offload_to_cpu=True, "
                             "checkpoint_wrapper_fn=...): pass offload_to_cpu to the wrapper "
                             "function (functools.partial(checkpoint_wrapper, "
                             "offload_to_cpu=True)), not both")
        checkpoint_wrapper_fn = _from_torch_checkpoint_wrapper(checkpoint_wrapper_fn)
    if (policy is None) == (check_fn is None):
        raise ValueError(f"apply_activation_checkpointing(policy={policy!r}, check_fn="
                         f"{check_fn!r}): give exactly one of them")
    from shardkit.nn.wrap.auto_wrap import _custom_policy_lambda, _policy_caller
    for name, value in (("policy", policy), ("check_fn", check_fn)):
        if value is not None and not callable(value) and _custom_policy_lambda(value) is None:
            raise ValueError(f"apply_activation_checkpointing({name}={value!r}): expected a "
                             f"callable")
    call = None
    if check_fn is None:
        call = _policy_caller(policy)

        def check_fn(m: nn.Module) -> bool:
            numel = sum(p.numel() for p in m.parameters())
            return call(m, False, numel, False)

    selected = _select(model, check_fn)
    if not selected:
        raise ValueError(f"apply_activation_checkpointing: the policy selected no submodule of "
                         f"{type(model).__name__}")
    if checkpoint_wrapper_fn is None:
        checkpoint_wrapper_fn = functools.partial(checkpoint_wrapper,
                                                  offload_to_cpu=offload_to_cpu)
    for parent, name, m in selected:
        # torch's CustomPolicy may answer a dict: keyword arguments for the wrapper function
        own = getattr(call, "kwargs", {})
        own = own.get(id(m)) or own.get(id(getattr(m, "_fsdp_wrapped_module", m))) or {}
        result = checkpoint_wrapper_fn(m, **own)
        if not isinstance(result, nn.Module):
            raise ValueError(f"apply_activation_checkpointing(checkpoint_wrapper_fn="
                             f"{checkpoint_wrapper_fn!r}): returned "
                             f"{type(result).__name__} for {type(m).__name__}, expected a "
                             f"module")
        if result is not m:
            setattr(parent, name, result)
    return model


def _from_torch_checkpoint_wrapper(fn: Callable) -> Callable:
    """torch's ``checkpoint_wrapper`` (``torch.distributed.algorithms._checkpoint.
    checkpoint_wrapper``), alone or in ``functools.partial`` as pytorch/examples' FSDP T5 recipe
    passes it, as this module's :func:`checkpoint_wrapper` with the same ``checkpoint_impl`` and
    ``offload_to_cpu``. torch's ``CheckpointWrapper`` would put an FSDP unit's gather inside
    the checkpointed region, so that the recomputation in backward (the unit already gathered)
    saves other tensors than the forward did. Other torch arguments (``checkpoint_fn``, the
    checkpoint function's keywords) are a ValueError naming them. Anything else is returned
    as given. Local."""
    keywords, inner = {}, fn
    while isinstance(inner, functools.partial):
        if inner.args:
            return fn
        keywords = {**inner.keywords, **keywords}
        inner = inner.func
    if getattr(inner, "__name__", None) != "checkpoint_wrapper" or \
            not getattr(inner, "__module__", "").startswith("torch.distributed"):
        return fn
    other = sorted(set(keywords) - {"checkpoint_impl", "offload_to_cpu"})
    if other or keywords.get("checkpoint_fn") is not None:
        raise ValueError(f"apply_activation_checkpointing(checkpoint_wrapper_fn=torch's "
                         f"checkpoint_wrapper with {other}): shardkit's checkpoint_wrapper "
                         f"takes checkpoint_impl and offload_to_cpu only; use "
                         f"shardkit.nn.checkpoint.checkpoint_wrapper")
    return functools.partial(checkpoint_wrapper, **keywords)


def _select(module: nn.Module, check_fn) -> list:
    """``(parent, attribute name, module)`` of each selected submodule, outermost first."""
    chosen = []
    for name, child in module.named_children():
        wrapped = getattr(child, "_fsdp_wrapped_module", None)  # an FSDP unit
        if check_fn(child) or (wrapped is not None and check_fn(wrapped)):
            chosen.append((module, name, child))
        else:
            chosen.extend(_select(child, check_fn))
    return chosen
