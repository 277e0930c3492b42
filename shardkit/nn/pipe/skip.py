"""Skip connections between non-adjacent layers of a Sequential, FairScale's API.

A layer declares what it stashes and pops; its ``forward`` is a generator that yields
``stash(name, tensor)`` to leave a tensor for a later layer and ``x = yield pop(name)`` to take
one::

    @skippable(stash=["1to3"])
    class Layer1(nn.Module):
        def forward(self, x):
            yield stash("1to3", x)
            return f1(x)

    @skippable(pop=["1to3"])
    class Layer3(nn.Module):
        def forward(self, x):
            skip = yield pop("1to3")
            return f3(x) + skip

The decorated class is a subclass of the original (same parameters and ``state_dict`` keys)
whose ``forward`` drives the generator; a FairScale checkpoint, whose skippable layers hold the
original as ``.module`` (keys ``<layer>.module.<name>``), loads too. Outside a
:class:`~shardkit.nn.Pipe` the stashed tensors go through a per-thread table, so the Sequential
runs as an ordinary module; inside a Pipe each
micro-batch has its own table and a popped tensor is moved to the popping partition's device.
Two copies of a layer that use the same names are told apart with a :class:`Namespace`
(``layer.isolate(ns)``). :func:`verify_skippables` checks a Sequential's stashes and pops pair up.
Skippable layers may sit in activation-checkpointed regions (``checkpoint_wrapper``, a Pipe's
checkpointed partitions, ``shardkit.checkpointing.checkpoint``): the recomputation pops what
the first forward popped and stashes nothing again.

Memory: a stashed tensor stays alive until popped (and, for backward, as long as autograd needs
it). Communication: none.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import uuid
from typing import Iterable, Iterator, Optional

import torch
import torch.nn as nn

from shardkit.nn.checkpoint.checkpoint_activations import _keyed_pop, _keyed_stash

__all__ = ["skippable", "stash", "pop", "Namespace", "verify_skippables", "Skippable",
           "SkipTracker", "use_skip_tracker"]


@functools.total_ordering
class Namespace:
    """A name scope for skip names: equal names in different namespaces do not collide.

    A namespace is a random UUID: copies (``copy.deepcopy`` of one layer, a pickled model in
    another process) are equal to the original and hash alike; namespaces sort by that UUID
    (any fixed order will do, as in FairScale).
    """

    __slots__ = ("id",)

    def __init__(self):
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace '{self.id}'>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other) -> bool:
        return isinstance(other, Namespace) and self.id == other.id

    def __lt__(self, other) -> bool:
        if not isinstance(other, Namespace):
            return NotImplemented
        return self.id < other.id


_DEFAULT_NAMESPACE = Namespace()


class stash:  # noqa: N801 - FairScale's name
    """``yield stash(name, tensor)`` inside a skippable forward: leave ``tensor`` under ``name``."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Optional[torch.Tensor]):
        self.name = name
        self.tensor = tensor


class pop:  # noqa: N801 - FairScale's name
    """``tensor = yield pop(name)`` inside a skippable forward: take the tensor stashed as
    ``name``."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class SkipTracker:
    """Where stashed tensors wait for their pop: a table keyed by ``(namespace, name)``."""

    def __init__(self):
        self.tensors: dict = {}

    def save(self, key, tensor: Optional[torch.Tensor]) -> None:
        """Keep ``tensor`` (a reference, no copy) under ``key`` until it is popped."""
        self.tensors[key] = tensor

    def load(self, key) -> Optional[torch.Tensor]:
        """Remove and return the tensor saved under ``key``; a RuntimeError when none was."""
        if key not in self.tensors:
            raise RuntimeError(f"skip connection {key[1]!r} ({key[0]}) is popped before it was "
                               f"stashed; stash it in an earlier layer of the same Sequential")
        return self.tensors.pop(key)


class _ThreadTracker(threading.local):
    def __init__(self):
        self.current: SkipTracker = SkipTracker()


_tracker = _ThreadTracker()


@contextlib.contextmanager
def use_skip_tracker(tracker: SkipTracker) -> Iterator[None]:
    """Route the stashes and pops of this thread to ``tracker`` inside the block."""
    previous = _tracker.current
    _tracker.current = tracker
    try:
        yield
    finally:
        _tracker.current = previous


class Skippable(nn.Module):
    """Base of the classes :func:`skippable` makes. Class attributes: ``stashable_names``,
    ``poppable_names``; instances map names to namespaces with :meth:`isolate`."""

    stashable_names: frozenset = frozenset()
    poppable_names: frozenset = frozenset()

    def isolate(self, ns: Namespace, *, only: Optional[Iterable[str]] = None) -> "Skippable":
        """Put this layer's skip names (or only those in ``only``) into namespace ``ns``."""
        names = self.stashable_names | self.poppable_names
        chosen = set(names if only is None else only)
        unknown = chosen - names
        if unknown:
            raise ValueError(f"isolate(only={sorted(unknown)}): {type(self).__name__} declares "
                             f"only the skip names {sorted(names)}")
        table = dict(self.__dict__.get("_skip_namespaces", {}))
        table.update({name: ns for name in chosen})
        self.__dict__["_skip_namespaces"] = table
        return self

    def namespaced(self, name: str) -> tuple:
        """The ``(namespace, name)`` key this layer uses for ``name``."""
        return (self.__dict__.get("_skip_namespaces", {}).get(name, _DEFAULT_NAMESPACE), name)

    def stashable(self) -> Iterator[tuple]:
        """The keys this layer stashes."""
        return (self.namespaced(n) for n in sorted(self.stashable_names))

    def poppable(self) -> Iterator[tuple]:
        """The keys this layer pops."""
        return (self.namespaced(n) for n in sorted(self.poppable_names))

    def _drive(self, generator_forward, *args, **kwargs):
        result = generator_forward(self, *args, **kwargs)
        stashed: set = set()
        popped: set = set()
        if not inspect.isgenerator(result):
            self._check_all_used(stashed, popped)
            return result
        tracker = _tracker.current
        reply = None
        while True:
            try:
                op = result.send(reply)
            except StopIteration as stop:
                self._check_all_used(stashed, popped)
                return stop.value
            reply = None
            if isinstance(op, stash):
                self._check_declared(op.name, self.stashable_names, "stash")
                # in a checkpointed region's recomputation it is not stashed again
                _keyed_stash(self.namespaced(op.name), op.tensor, tracker.save)
                stashed.add(op.name)
            elif isinstance(op, pop):
                self._check_declared(op.name, self.poppable_names, "pop")
                # in a checkpointed region's recomputation: what its first forward popped
                reply = _keyed_pop(self.namespaced(op.name), tracker.load,
                                   f"the skip connection {op.name!r}")
                popped.add(op.name)
            else:
                raise TypeError(f"{type(self).__name__}.forward yielded {op!r}; a skippable "
                                f"forward may only yield stash(name, tensor) or pop(name)")

    def _check_all_used(self, stashed: set, popped: set) -> None:
        """Every declared name must be stashed and popped by each forward (FairScale's rule: a
        skip the next layer waits for, or a stashed tensor nobody takes, is a bug)."""
        for verb, declared, done in (("stashed", self.stashable_names, stashed),
                                     ("popped", self.poppable_names, popped)):
            missing = sorted(declared - done)
            if missing:
                names = ", ".join(repr(n) for n in missing)
                raise RuntimeError(f"{names} must be {verb} but have not: "
                                   f"{type(self).__name__}.forward returned without it, though "
                                   f"@skippable declares it")

    def _check_declared(self, name: str, declared: frozenset, verb: str) -> None:
        if name not in declared:
            raise RuntimeError(f"{type(self).__name__}.forward yielded {verb}({name!r}) but the "
                               f"class declares @skippable({verb}={sorted(declared)})")


def _accept_fairscale_keys(layer: nn.Module, state_dict: dict, prefix: str) -> None:
    """FairScale's skippable wraps the original module as ``.module``, so its checkpoints hold
    ``<prefix>module.<name>``; here the layer *is* the original module (``<prefix><name>``).
    Rename such keys in the (private) dict being loaded, except keys the layer has itself (its
    own child called ``module``, whose FairScale keys read ``<prefix>module.module.<name>``)
    and keys whose renamed form is already there."""
    wrapped = prefix + "module."
    # a key the layer itself has (its own child called `module`) is kept; FairScale's
    # spelling of that child's keys is `<prefix>module.module.<name>`
    own_keys = {prefix + name for name, _ in (
        *layer.named_parameters(remove_duplicate=False),
        *layer.named_buffers(remove_duplicate=False))}
    for key in [k for k in state_dict if k.startswith(wrapped) and k not in own_keys]:
        own = prefix + key[len(wrapped):]
        if own not in state_dict:
            state_dict[own] = state_dict.pop(key)


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()):  # noqa: F811 - FairScale
    """Class decorator declaring the skip names a layer stashes and pops.

    Returns a subclass of the decorated class (same name, parameters and ``state_dict`` keys)
    whose ``forward`` runs the original generator forward and serves its stashes and pops.
    """
    stash_names, pop_names = frozenset(stash), frozenset(pop)
    for arg, names in (("stash", stash_names), ("pop", pop_names)):
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise TypeError(f"skippable({arg}={bad!r}): skip names must be strings")

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@skippable decorates nn.Module classes, not {cls!r}")
        generator_forward = cls.forward

        def forward(self, *args, **kwargs):
            return Skippable._drive(self, generator_forward, *args, **kwargs)

        def __repr__(self):  # FairScale's form: @skippable(<the module's own repr>)
            return f"@skippable({cls.__repr__(self)})"

        def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
            _accept_fairscale_keys(self, state_dict, prefix)
            return cls._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)

        body = {"forward": forward, "__repr__": __repr__,
                "_load_from_state_dict": _load_from_state_dict,
                "stashable_names": stash_names, "poppable_names": pop_names,
                "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__}
        return type(cls.__name__, (cls, Skippable), body)

    return decorate


def verify_skippables(module: nn.Sequential) -> None:
    """Check that every skip name stashed by a layer of ``module`` is popped once by a later
    layer, that nothing is popped before it is stashed, and that no layer both stashes and pops
    the same name.

    Raises:
        TypeError: listing every problem, with the layer indices involved.
    """
    stashed: dict = {}
    popped: dict = {}
    problems: list[str] = []
    # Note: the wording starts as FairScale's ("'<layer name>' declared ..."), so code matching
    # its messages still does; what follows names the other layer involved and the fix.
    for name, layer in module.named_children():
        if not isinstance(layer, Skippable):
            continue
        for skip in sorted(layer.stashable_names & layer.poppable_names):
            problems.append(f"'{name}' declared '{skip}' both as stashable and as poppable "
                            f"({type(layer).__name__}; a layer may only do one of them)")
        for key in layer.stashable():
            if key in stashed:
                problems.append(f"'{name}' redeclared '{key[1]}' as stashable (already stashed "
                                f"by layer '{stashed[key]}'; isolate one of them with a "
                                f"Namespace)")
            stashed.setdefault(key, name)
        for key in layer.poppable():
            if key in popped:
                problems.append(f"'{name}' redeclared '{key[1]}' as poppable (already popped "
                                f"by layer '{popped[key]}'; isolate one of them with a "
                                f"Namespace)")
            elif key not in stashed:
                problems.append(f"'{name}' declared '{key[1]}' as poppable but it was not "
                                f"stashed (by an earlier layer)")
            popped.setdefault(key, name)
    for key, name in stashed.items():
        if key not in popped:
            problems.append(f"no module declared '{key[1]}' as poppable but stashed (stashed by "
                            f"layer '{name}', never popped)")
    if problems:
        raise TypeError("skip connections do not pair up:\n  " + "\n  ".join(problems))
