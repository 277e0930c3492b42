"""16-bit weights stepped through fp32 master copies: :class:`MasterWeights`, the
mixed-precision optimizer of ZeRO stages 1-2 (DESIGN.md's table: ``2+2`` bytes of 16-bit weights
and gradients, ``K = 12`` bytes of fp32 master weight and Adam moments per parameter).

``MasterWeights.over(torch.optim.AdamW)`` is an optimizer class. Given fp16/bf16 parameters, it
keeps an fp32 copy of each (the master weight), steps that copy with the inner optimizer from the
gradient widened to fp32, and writes the result back rounded to the parameter's dtype. Under
:class:`~shardkit.optim.OSS` (``OSS(params, optim=MasterWeights.over(torch.optim.AdamW), ...)``)
it is each rank's local optimizer, so the fp32 copies and the moments exist for the owned
``1/N`` only and the parameter sync moves 16-bit weights; ``shardkit.initialize`` builds it at
stages 1-2 with ``fp16`` or ``bf16`` enabled.

The master weight is the truth between steps: small updates accumulate there instead of being
rounded away (bf16 AdamW at lr 1e-4 moves a weight of 1.0 only every few steps). A parameter
written from outside (a loaded ``state_dict``, ``p.mul_(0.5)``, ``p.data = ...``) is noticed at
the next step (its version counter moved and it no longer equals its master rounded) and the
master is taken from it again, so such a write behaves as on a plain optimizer's parameter
(a write that leaves the value equal to the master rounded keeps the master). A write into
``p.data`` in place (``p.data.copy_(w)``) moves no version counter and is not seen: call
:meth:`MasterWeights.refresh_master_weights` after it, as DeepSpeed's ``refresh_fp32_params``. Its
state (``state_dict()``) holds the master under ``"master_weight"`` beside the inner optimizer's
entries, so a checkpoint resumes exactly; state saved without it (by a plain optimizer) takes
the master from the parameter.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional

import torch

from shardkit.optim.local_step import (_unhooked_step, copy_over,
                                       refuse_parameters_held_outside_groups)
from shardkit.optim.oss_arguments import without_fixed_defaults
from shardkit.utils.swapped_tensors import swapped_since, tensor_mark

__all__ = ["MasterWeights", "MASTER_WEIGHT_KEY", "HALF_DTYPES", "master_weights_of"]

MASTER_WEIGHT_KEY = "master_weight"
HALF_DTYPES = (torch.float16, torch.bfloat16)
_CLASSES: dict = {}


def master_weights_of(optimizer) -> Optional["MasterWeights"]:
    """The :class:`MasterWeights` ``optimizer`` steps with: itself, or an OSS's local optimizer
    (``optimizer.optim``); ``None`` for any other. Local."""
    for candidate in (optimizer, getattr(optimizer, "optim", None)):
        if isinstance(candidate, MasterWeights):
            return candidate
    return None


def _is_lazy(param: torch.Tensor) -> bool:
    """Whether ``param`` gets a placeholder master: a frozen 16-bit parameter."""
    return param.dtype in HALF_DTYPES and not param.requires_grad


def _master_for(param: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of a trainable 16-bit parameter; for a frozen one (``requires_grad=False``:
    a LoRA base weight) an fp32 placeholder, filled when it first gets a gradient (see
    :meth:`MasterWeights._materialize`): a view of the parameter's shape over one element
    while the inner optimizer is built (so that a constructor reading its parameters' shapes
    or sizes, as Muon's 2-D check, sees the parameter's), then emptied (see
    :meth:`MasterWeights._empty_placeholders`); any other parameter is its own master
    (stepped as a plain optimizer steps it: no copy, no extra memory)."""
    if _is_lazy(param):
        return torch.zeros((), dtype=torch.float32, device=param.device).expand(param.shape)
    if param.dtype in HALF_DTYPES:
        return param.detach().to(torch.float32, copy=True)
    return param


def _stamp(p):
    return p._version, p.data_ptr()


def _as_groups(params) -> list[dict]:
    if isinstance(params, torch.Tensor):
        raise TypeError("MasterWeights: params must be an iterable of tensors or of param-group "
                        f"dicts, not a tensor ({tuple(params.shape)})")
    groups = list(params)
    if not groups:
        raise ValueError("MasterWeights: got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    for group in groups:  # the caller's dicts themselves, as torch keeps them (a scheduler
        # built on an optimizer whose groups these are drives this one's learning rate)
        params = group["params"]
        group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
    return groups


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


class _StateWithMaster(dict):
    """One 16-bit parameter's optimizer state, as a plain dict to read: the inner optimizer's
    state of its master, and the master under ``"master_weight"``. Stores write through: a
    value under a key of the inner state replaces it there, one under ``"master_weight"`` is
    copied into the master."""

    def __init__(self, held: dict, master: torch.Tensor):
        super().__init__(held)
        super().__setitem__(MASTER_WEIGHT_KEY, master)
        self._held, self._master = held, master

    def __setitem__(self, key, value) -> None:
        if key == MASTER_WEIGHT_KEY:
            with torch.no_grad():
                self._master.copy_(value)
            return
        self._held[key] = value
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        if key == MASTER_WEIGHT_KEY:
            raise KeyError(f"{MASTER_WEIGHT_KEY!r} cannot be removed from a 16-bit "
                           f"parameter's state")
        del self._held[key]
        super().__delitem__(key)

    def __reduce__(self):  # pickled, copied: a plain dict of the same entries
        return dict, (dict(self),)


class MasterWeights(torch.optim.Optimizer):
    """An optimizer over 16-bit parameters that steps fp32 master copies of them with
    ``inner_class`` (build the class with :meth:`over`), then writes the result back rounded.

    Memory: 4 bytes per element of each fp16/bf16 parameter it holds (the master; none for a
    frozen one until it gets a gradient, as DeepSpeed keeps no fp32 copy of a frozen weight)
    plus the inner optimizer's state on the masters (Adam: 8 bytes), and, from the gradients'
    conversion to the end of the step, 4 bytes per element of the fp32 gradients; fp32 and
    fp64 parameters are stepped in place with no copy. No communication. Hyper-parameters
    are read from this optimizer's ``param_groups`` (what an LR scheduler or OSS writes) at
    every step.

    ``prepare_master_grads()`` widens the gradients to fp32 before the step, so that unscaling
    a loss scale or clipping happens in fp32 (a 16-bit gradient divided by 65536 flushes to zero);
    the step reuses them while the 16-bit gradients are unchanged."""

    inner_class: Optional[type] = None

    @classmethod
    def over(cls, optim_class: type) -> type:
        """The optimizer class stepping fp32 masters with ``optim_class`` (a
        ``torch.optim.Optimizer`` subclass whose step treats each parameter apart, as torch's
        do), made once per class."""
        if isinstance(optim_class, type) and issubclass(optim_class, MasterWeights):
            return optim_class
        if not (isinstance(optim_class, type) and issubclass(optim_class, torch.optim.Optimizer)):
            raise TypeError(f"MasterWeights.over({optim_class!r}): expected a torch.optim."
                            f"Optimizer subclass, e.g. torch.optim.AdamW")
        if optim_class not in _CLASSES:
            _CLASSES[optim_class] = type(f"MasterWeights{optim_class.__name__}", (cls,),
                                         {"inner_class": optim_class,
                                          "__module__": __name__})
        return _CLASSES[optim_class]

    def __init__(self, params, **defaults):
        if self.inner_class is None:
            raise TypeError("MasterWeights: build the class for an optimizer first, e.g. "
                            "MasterWeights.over(torch.optim.AdamW)(params, lr=1e-3)")
        self._build(_as_groups(params), lambda over_masters: self.inner_class(
            over_masters, **without_fixed_defaults(self.inner_class, defaults)))

    @classmethod
    def around(cls, optimizer: torch.optim.Optimizer) -> "MasterWeights":
        """``optimizer`` (an instance of ``inner_class``, built by a script over 16-bit or
        fp32 parameters) turned into one stepping fp32 masters: its groups (the same dicts,
        so that a scheduler built on it drives this one), a shallow copy of it as the inner
        optimizer over the masters (so that what its constructor stored beside ``defaults``,
        such as a subclass's own arguments, is kept: its constructor is not called again; the
        step hooks registered on it run at each step, given the copy) and the state it holds.
        Memory: the masters and that state."""
        if type(optimizer) is not cls.inner_class:
            raise TypeError(f"{cls.__name__}.around: expected a {cls.inner_class!r} "
                            f"instance, got {type(optimizer)!r}")
        built = cls._copying(optimizer, optimizer.param_groups)
        if optimizer.state:
            built.load_state_dict(optimizer.state_dict())
        return built

    @classmethod
    def copies_of(cls, optimizer: torch.optim.Optimizer) -> Callable:
        """A factory ``(params, **ignored)`` of MasterWeights whose inner optimizer is a copy of
        ``optimizer`` over the masters of ``params`` (as :meth:`around`: its constructor is not
        called again, so a subclass's own arguments are kept; its step hooks are shared). What
        OSS takes as ``optim=`` to shard an optimizer a script built, over ``optimizer``'s own
        group dicts: the hyper-parameters come with the groups, so keyword arguments are
        ignored. A TypeError for an optimizer that holds its parameters beside its groups
        (:func:`~shardkit.optim.local_step.refuse_parameters_held_outside_groups`): the copy
        would step them, not their masters. Memory and communication: none until called."""
        refuse_parameters_held_outside_groups(optimizer, "MasterWeights.copies_of")
        over = cls.over(type(optimizer))

        def build(params, **_hyper_parameters_in_the_groups):
            return over._copying(optimizer, params)

        build.__name__ = build.__qualname__ = over.__name__
        return build

    @classmethod
    def _copying(cls, optimizer: torch.optim.Optimizer, params) -> "MasterWeights":
        built = cls.__new__(cls)
        built._build(_as_groups(params), lambda over_masters: copy_over(optimizer, over_masters))
        return built

    def _build(self, groups: list, build_inner: Callable) -> None:
        self._masters: dict = {}
        self._versions: dict = {}
        self._grad_sources: dict = {}
        self._lazy: set = set()  # frozen 16-bit parameters whose master is a placeholder
        for group in groups:
            for p in group["params"]:
                self._adopt(p)

        def over_masters():
            return [{**g, "params": [self._masters[p] for p in g["params"]]} for g in groups]

        self.inner = build_inner(over_masters())
        if any(self.inner.state.get(self._masters[p]) for p in self._lazy):
            # state built by the constructor (Adagrad's sums) is sized from the masters: every
            # master made whole, and the inner optimizer built again over them
            for p in list(self._lazy):
                self._materialize(p)
            self.inner = build_inner(over_masters())
        self._empty_placeholders()
        for group, inner in zip(groups, self.inner.param_groups):
            for key, value in _hyper(inner).items():  # the inner optimizer's defaults
                group.setdefault(key, value)
        self._building = True
        super().__init__(groups, dict(self.inner.defaults))
        self._building = False

    # ------------------------------------------------------------------ state

    @property
    def state(self):
        """``{param: state}``: the inner optimizer's state of each parameter's master, with the
        master itself under ``"master_weight"`` for 16-bit parameters. Built on each read;
        each entry writes through (a tensor stored under a key replaces the inner state's, a
        value stored under ``"master_weight"`` is copied into the master)."""
        view: defaultdict = defaultdict(dict)
        lazy = self.__dict__.get("_lazy", ())
        for p, master in self.__dict__.get("_masters", {}).items():
            if p in lazy:  # a frozen parameter that never had a gradient: no master, no state
                continue
            held = self.inner.state[master]
            if master is not p:
                view[p] = _StateWithMaster(held, master)
            elif held:
                view[p] = held
        return view

    def state_dict(self) -> dict:
        """torch's ``state_dict()``, each parameter's state a plain dict (its master under
        ``"master_weight"``): it loads into this class, and into a plain torch ``inner_class``
        (which then keeps the extra entry unused; :class:`~shardkit.optim.OSS` over a plain
        optimizer refuses the key it does not step with, naming it)."""
        saved = super().state_dict()
        saved["state"] = {i: dict(entry) for i, entry in saved["state"].items()}
        return saved

    @state.setter
    def state(self, value):  # torch's Optimizer.__init__ assigns an empty dict; none is kept
        pass

    def holds(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of this optimizer's parameters."""
        return param in self._masters

    def master_weight_of(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 tensor stepped for ``param`` (``param`` itself unless it is 16-bit), taken
        from ``param`` first if ``param`` was written from outside since the last step; for a
        frozen 16-bit parameter that never had a gradient (no master kept), a new fp32 copy
        of it."""
        if param in self._lazy:
            return param.detach().to(torch.float32, copy=True)
        self._adopt_outside_write(param, self._masters[param])
        return self._masters[param]

    @torch.no_grad()
    def set_master_weight(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Set ``param``'s master to ``value`` (any dtype, ``param``'s shape) and ``param``
        to it rounded. Local. A frozen parameter that keeps no master gets one only where
        ``value`` is not a 16-bit value (a checkpoint's copy of a frozen weight is one)."""
        if param in self._lazy:
            rounded = value.to(param.dtype)
            if torch.equal(rounded.to(value.dtype), value):
                param.copy_(rounded)
                self._versions[param] = _stamp(param)
                return
            self._materialize(param)
        master = self._masters[param]
        master.copy_(value)
        if master is not param:
            param.copy_(master)
            self._versions[param] = _stamp(param)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by this class or by a plain ``inner_class`` (same groups and
        sizes): the inner optimizer's entries go to the masters in fp32 (torch's own load would
        have cast them to the 16-bit parameter's dtype), each saved master is copied in, and a
        16-bit parameter saved without one takes its master from its current value."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"])
                for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("MasterWeights.load_state_dict: the saved param groups' sizes "
                             f"{[len(s['params']) for s in saved_groups]} differ from this "
                             f"optimizer's {[len(g['params']) for g in self.param_groups]}")
        by_index = {i: p for s, g in zip(saved_groups, self.param_groups)
                    for i, p in zip(s["params"], g["params"])}
        inner_state, saved_masters = {}, {}
        for index, entry in state_dict["state"].items():
            entry = dict(entry)
            saved = entry.pop(MASTER_WEIGHT_KEY, None)
            if index in by_index and saved is not None:
                saved_masters[by_index[index]] = saved
            inner_state[index] = entry
        self.inner.load_state_dict({"state": inner_state, "param_groups": saved_groups})
        with torch.no_grad():
            for p, master in self._masters.items():
                if p in self._lazy and (p in saved_masters or self.inner.state.get(master)):
                    self._materialize(p)  # saved state of a frozen parameter: kept whole
                if master is not p and p not in self._lazy:
                    master.copy_(saved_masters.get(p, p))
                self._versions[p] = _stamp(p)
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            group.update(_hyper(inner))
        self._release_master_grads()

    def refresh_master_weights(self) -> None:
        """Take every master from its 16-bit parameter again (DeepSpeed's
        ``refresh_fp32_params``); needed only where a parameter was changed without its version
        counter moving. Local; a pass over the parameters."""
        with torch.no_grad():
            for p, master in self._masters.items():
                if master is not p and p not in self._lazy:
                    master.copy_(p)
                    self._versions[p] = _stamp(p)

    # ------------------------------------------------------------------ step

    def prepare_master_grads(self) -> list[torch.Tensor]:
        """Widen each 16-bit gradient to fp32 on its master (once per gradient: a gradient
        unchanged since the last call is not converted again, so unscaling and clipping done
        on the returned tensors carry into the step) and return the gradients the step reads:
        those fp32 ones, and the gradients of the parameters stepped in place. Memory: 4 bytes
        per element of the 16-bit gradients, until the step or ``zero_grad``."""
        grads = []
        for p, master in self._masters.items():
            if p in self._lazy and p.grad is not None:  # a frozen parameter's first gradient
                self._materialize(p)
            if master is not p:
                self._widen_grad(p, master)
            if master.grad is not None:
                grads.append(master.grad)
        return grads

    def master_grad_of(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The gradient the step reads for ``param``, after :meth:`prepare_master_grads`."""
        return self._masters[param].grad

    def _widen_grad(self, p: torch.Tensor, master: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            master.grad = None
            self._grad_sources.pop(p, None)
            return
        # Note: a tensor mark, not a weak reference: swap_tensors (.to() under swap mode with
        # live gradients) refuses a tensor that has one, and gives the grad new values under
        # the same id and maybe the same version
        source = self._grad_sources.get(p)
        if source is not None and not swapped_since(grad, source[0]) \
                and source[1] == grad._version:
            return
        master.grad = grad.detach().to(torch.float32)
        self._grad_sources[p] = (tensor_mark(grad), grad._version)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        """One step of the masters from the fp32 gradients, then each stepped 16-bit parameter
        set to its master rounded. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update(_hyper(group))
        self._adopt_outside_writes()
        self.prepare_master_grads()
        _unhooked_step(self.inner)()
        for p, master in self._masters.items():
            if master is not p and master.grad is not None:
                p.copy_(master)
                self._versions[p] = _stamp(p)
        self._release_master_grads()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients and the fp32 ones made from them."""
        super().zero_grad(set_to_none=set_to_none)
        self._release_master_grads()

    def add_param_group(self, param_group: dict) -> None:
        """Add a group: masters for its 16-bit parameters, the inner optimizer's group over
        them (its defaults filled in as torch fills them)."""
        if self.__dict__.get("_building", True):  # torch's __init__ adding the first groups
            super().add_param_group(param_group)
            return
        group = _as_groups([param_group])[0]
        new = [p for p in dict.fromkeys(group["params"]) if p not in self._masters]
        for p in new:
            self._adopt(p)
        try:
            self.inner.add_param_group({**group,
                                        "params": [self._masters[p] for p in group["params"]]})
        except Exception:
            for p in new:
                del self._masters[p], self._versions[p]
                self._lazy.discard(p)
            raise
        self._empty_placeholders()
        for key, value in _hyper(self.inner.param_groups[-1]).items():
            group.setdefault(key, value)
        super().add_param_group(group)

    def _adopt(self, p: torch.Tensor) -> None:
        if p in self._masters:
            return
        self._masters[p] = _master_for(p)
        self._versions[p] = _stamp(p)
        if _is_lazy(p):
            self._lazy.add(p)

    def _empty_placeholders(self) -> None:
        """Each placeholder master still shaped like its parameter (once the inner optimizer
        has read the shapes) made empty: no memory, and a step that writes into parameters
        without a gradient (a custom decay of every parameter) leaves it a no-op, as on a
        frozen parameter's missing master."""
        for p in self._lazy:
            master = self._masters[p]
            if master.numel():
                master.data = torch.empty(0, dtype=torch.float32, device=p.device)

    @torch.no_grad()
    def _materialize(self, p: torch.Tensor) -> None:
        """The placeholder master of a frozen 16-bit parameter filled from it (the same tensor
        object, which the inner optimizer holds). Memory: 4 bytes per element of ``p``."""
        self._masters[p].data = p.detach().to(torch.float32, copy=True)
        self._lazy.discard(p)
        self._versions[p] = _stamp(p)

    def _adopt_outside_writes(self) -> None:
        """A 16-bit parameter written since this optimizer last set it (a loaded weight, an
        in-place change) whose value is no longer its master rounded: the master is taken from
        it. A sync that wrote the same values back (OSS's) changes nothing."""
        for p, master in self._masters.items():
            self._adopt_outside_write(p, master)

    @torch.no_grad()
    def _adopt_outside_write(self, p: torch.Tensor, master: torch.Tensor) -> None:
        if master is p or self._versions.get(p) == _stamp(p):
            return
        if p in self._lazy:  # no master to take from it
            self._versions[p] = _stamp(p)
            return
        if master.shape != p.shape or master.device != p.device:
            raise RuntimeError(f"MasterWeights: a parameter of shape {tuple(master.shape)} on "
                               f"{master.device} became {tuple(p.shape)} on {p.device}; build "
                               f"the optimizer again after changing a parameter's shape or "
                               f"device")
        if not torch.equal(p, master.to(p.dtype)):
            master.copy_(p)
        self._versions[p] = _stamp(p)

    def _release_master_grads(self) -> None:
        for p, master in self._masters.items():
            if master is not p:
                master.grad = None
        self._grad_sources.clear()
