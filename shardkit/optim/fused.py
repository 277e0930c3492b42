"""FusedAdamW: torch.optim.AdamW semantics, one fused kernel launch per param group."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch

from shardkit.kernels import adamw_step_many

__all__ = ["FusedAdamW"]


@dataclass
class _FlatState:
    """The optimizer state of one param group's tensors sharing a device and dtype, held in
    flat buffers; ``state[p]`` holds views into them (``views[key][i]`` for ``params[i]``)."""

    params: list
    buffers: dict[str, torch.Tensor]
    views: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # Every parameter's step count, as torch keeps it (a float32 CPU scalar): ``state[p]["step"]``
    # is ``steps[i]``, a view, so one add and one read serve the whole bucket.
    steps: torch.Tensor = None
    dtype: torch.dtype = field(init=False)    # the buffers' dtype and device
    device: torch.device = field(init=False)

    def __post_init__(self):
        first = next(iter(self.buffers.values()))
        self.dtype, self.device = first.dtype, first.device
        sizes = [p.numel() for p in self.params]
        for key, buffer in self.buffers.items():
            self.views[key] = [v.view_as(p) for v, p in zip(buffer.split(sizes), self.params)]
        self.steps = torch.zeros(len(self.params), dtype=torch.float32)
        self.views["step"] = list(self.steps.unbind(0))

    @property
    def numel(self) -> int:
        """Elements of each buffer (the parameters' total)."""
        return self.buffers["exp_avg"].numel()

    def outdated(self) -> bool:
        """Whether any parameter was cast, moved or resized since the buffers were built
        (a ``model.to(torch.bfloat16)`` or ``model.cuda()`` after a step, or a conversion of
        one submodule only). Three attribute reads per parameter and step."""
        return any(p.dtype != self.dtype or p.device != self.device or p.shape != view.shape
                   for p, view in zip(self.params, self.views["exp_avg"]))


class FusedAdamW(torch.optim.Optimizer):
    """AdamW whose step is one fused kernel launch per param group.

    Same constructor, update rule and state-dict format as ``torch.optim.AdamW`` (per-parameter
    ``step``, ``exp_avg``, ``exp_avg_sq`` and, with ``amsgrad``, ``max_exp_avg_sq``): a state dict
    of either loads into the other. Parameters without a gradient are skipped, as torch does.

    The state of each param group (per device and dtype) lives in flat buffers; ``state[p]``
    holds views into them, so the step reads and writes each buffer once: on CUDA the Triton
    multi-tensor AdamW kernel (one launch per group), on CPU torch's fused AdamW kernel (one
    call per group). See :mod:`shardkit.kernels` for the dispatch. As with torch, clearing
    ``opt.state`` (or assigning a fresh dict) restarts the moments and step counts, a tensor
    assigned to ``state[p][key]`` is used from the next step on, and ``copy.deepcopy`` or
    ``torch.save`` of the optimizer gives one that trains on.

    Memory: ``K = 8`` bytes of fp32 optimizer state per parameter (12 with ``amsgrad``), as torch:
    only for parameters that have had a gradient (frozen or unused ones cost nothing);
    parameters whose first gradient comes after their group's first step get flat buffers of
    their own, merged with the newest earlier ones as they grow, so a group keeps a few buffers
    (one launch each per step) however its parameters arrive. Traffic: 28 B per fp32 parameter
    per step.
    No communication: wrap it in :class:`shardkit.optim.OSS` to shard it.

    Args:
        params: parameters or param-group dicts, as for any torch optimizer. A parameter that
            is not contiguous (a transposed view, a ``channels_last`` convolution weight) is
            stepped through a contiguous copy: one more read and write of it per step.
            Complex parameters are stepped as their real views, as torch's AdamW does.
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW``; ``lr`` may
            be a one-element tensor, as torch's (a scheduler fills it in place), read on the
            host at each step (on CUDA a synchronisation per param group and device/dtype).
        foreach, fused: accepted, as torch's, kept in the param groups and otherwise ignored
            (the step is always fused); ``capturable`` and ``differentiable`` must stay False
            (a ValueError otherwise). Each group carries every key of a torch AdamW group,
            ``decoupled_weight_decay=True`` included: a group added with it False is stepped
            as ``torch.optim.Adam`` (L2 weight decay), as torch's AdamW does; and as torch's,
            ``load_state_dict`` sets it True in every group (a torch Adam checkpoint resumes
            as AdamW).

    A parameter listed twice in one group is stepped twice per step with one state (its
    ``step`` counts both), as torch's AdamW does after its "duplicate parameters" warning; in
    two groups it is refused, as torch refuses it. Two distinct parameters that share elements
    (overlapping views of one tensor, ``.data`` tied by hand) are a ValueError, at construction
    and ``add_param_group`` (for subclasses, at the first step): one fused step cannot update
    the shared elements as torch's AdamW does (which itself differs between CPU and CUDA
    there); views that share no element (the halves or columns of one tensor) are stepped
    as torch steps them.

    Example::

        opt = FusedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False,
                 maximize: bool = False, *, foreach=None, capturable: bool = False,
                 differentiable: bool = False, fused=None):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                        capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=True)
        _check_modes(defaults)
        _check_hyper_parameters(lr, betas, eps, weight_decay)
        self._flat: dict[int, tuple[tuple, list[_FlatState], dict]] = {}
        self._constructing = True  # the groups are checked for shared memory once, at the end
        super().__init__(params, defaults)
        self._constructing = False
        _refuse_overlapping_params(type(self).__name__, self.param_groups)

    def __setstate__(self, state: dict) -> None:
        # copy.deepcopy and pickle go through torch's __getstate__, which keeps only defaults,
        # state and param_groups: the flat buffers are rebuilt from the state on the next step
        super().__setstate__(state)
        self._flat = {}
        # a state dict saved without these keys (an older torch Adam/AdamW, DeepSpeed's
        # FusedAdam, FusedAdamW before it carried torch's keys) ran without the variant: the
        # values torch.optim.AdamW fills in. The modes describe this optimizer, not the saved
        # training state: a torch AdamW(capturable=True) checkpoint resumes here uncaptured
        for group in self.param_groups:
            for key, value in _TORCH_GROUP_KEYS.items():
                if key in self.defaults:
                    group.setdefault(key, value)
            for key, value in _FIXED_GROUP_KEYS.items():
                if key in self.defaults:
                    group[key] = value
            # DeepSpeed's FusedAdam before per-parameter steps kept one ``group["step"]`` (its
            # own loader falls back to it); a state with moments and no step at all would
            # silently restart the bias correction at step 1 (torch raises KeyError)
            for p in group["params"]:
                p_state = self.state.get(p)
                if p_state and "step" not in p_state and "exp_avg" in p_state:
                    if "step" not in group:
                        raise ValueError(f"FusedAdamW: the state of a parameter of shape "
                                         f"{tuple(p.shape)} has moments but no 'step' (nor "
                                         f"has its param group); cannot resume its bias "
                                         f"correction")
                    p_state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (as torch), checking its hyper-parameters."""
        super().add_param_group(param_group)
        added = self.param_groups[-1]
        try:
            _check_modes(added)
            _check_hyper_parameters(added["lr"], added["betas"], added["eps"],
                                    added["weight_decay"])
            if not self.__dict__.get("_constructing"):
                _refuse_overlapping_params(type(self).__name__, self.param_groups)
        except ValueError:
            self.param_groups.pop()
            raise

    def __getstate__(self) -> dict:
        # pickle / copy.deepcopy of the optimizer: each parameter's state on its own storage
        # (see state_dict), not a copy of the whole flat buffer per view
        state = _compact_state(self.state, {p: p for p in self.state})
        return {**super().__getstate__(), "state": defaultdict(dict, state)}

    def state_dict(self) -> dict:
        """torch's optimizer state dict (``torch.optim.AdamW``'s format and contents).

        Each parameter's state tensors are on storage of their own and in the parameter's
        memory layout, as torch's are: a view into the flat buffers would carry the whole
        buffer wherever it is pickled (an object collective, ``pickle.dumps``, ``torch.save``
        of part of the dict), N times over for N parameters, and a contiguous moment of a
        transposed or channels_last parameter steps the wrong elements in torch's fused AdamW.
        They are copies taken at the call (unlike torch's, which alias the live state): steps
        taken afterwards do not change them, so loading the dict later restores that point.
        Cost: the state is copied (K = 8 bytes per parameter, 12 with ``amsgrad``, on the
        state's device) while the returned dict lives.
        """
        state_dict = super().state_dict()
        state_dict["state"] = _compact_state(
            state_dict["state"], _params_by_index(state_dict["param_groups"], self.param_groups),
            always_copy=True)
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``torch.optim.AdamW`` or ``FusedAdamW`` state dict, copying the state into
        fresh flat buffers (so, unlike torch, it shares no tensor with ``state_dict``)."""
        super().load_state_dict(state_dict)
        self._flat.clear()
        for index, group in enumerate(self.param_groups):
            self._flat_states(index, group)

    def release_flat_buffers(self) -> None:
        """Drop the flat buffers that hold the state, after ``state``'s tensors (views into
        them) were replaced, e.g. by host copies (the engine's ``offload_states``): without
        this the buffers keep the old state alive. The next :meth:`step` builds them again
        from ``state``, as after :meth:`load_state_dict`. Memory: the buffers' bytes go (while
        ``state`` still holds views, nothing does). Local."""
        self._flat.clear()

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _refuse_sparse_gradients(type(self).__name__, self.param_groups)
        # again at the first step and after groups are added: subclasses (shardkit.ops.adam)
        # build and add their groups without FusedAdamW's constructor and add_param_group
        if self.__dict__.get("_overlap_checked_groups") != len(self.param_groups):
            _refuse_overlapping_params(type(self).__name__, self.param_groups)
            self._overlap_checked_groups = len(self.param_groups)
        for index, group in enumerate(self.param_groups):
            flats, repeats = self._flat_states(index, group)
            for flat in flats:
                self._step_flat(group, flat, repeats)
        return loss

    def _flat_states(self, index: int, group: dict) -> tuple[list[_FlatState], dict]:
        """The flat state of the group's stepped parameters (:func:`_stepped_params`), and
        ``{id: count}`` of those listed more than once (each in the buffers once).

        Parameters stepped for the first time get buffers of their own beside the existing
        ones (:meth:`_add_newcomers`); any other change (a parameter removed or cast, moved or
        resized, ``amsgrad`` switched) rebuilds them all, the state cast and moved into new
        buffers as torch's ``load_state_dict`` would."""
        stepped = _stepped_params(group["params"], self.state)
        key = (tuple(map(id, stepped)), bool(group["amsgrad"]))
        cached = self._flat.get(index)
        stale = cached is None or cached[0][1] != key[1] or any(f.outdated() for f in cached[1])
        if not stale and cached[0] == key:
            return cached[1], cached[2]
        repeats = _repeats(stepped)
        if repeats:
            stepped = list(dict.fromkeys(stepped))  # tensors hash by identity
        if stale:
            flats = self._build_flat_states(group, stepped)
        else:
            covered = {id(p) for f in cached[1] for p in f.params}
            if covered <= set(key[0]):  # only newcomers
                newcomers = [p for p in stepped if id(p) not in covered]
                flats = self._add_newcomers(group, cached[1], newcomers)
            else:
                flats = self._build_flat_states(group, stepped)
        self._flat[index] = (key, flats, repeats)
        return flats, repeats

    def _add_newcomers(self, group: dict, flats: list[_FlatState],
                       newcomers: list) -> list[_FlatState]:
        """``flats`` plus buffers for ``newcomers`` (parameters stepped for the first time).

        Note: each device and dtype's new buffer also takes in the newest existing buffers of
        that device and dtype while they hold at most twice what it holds so far (their state
        copied): buffers grow geometrically, so parameters whose first gradients come one at a
        time (MoE experts routed to later, a head used from step N) keep a few buffers, hence a
        few launches per step, not one more per arrival forever; each element is copied a
        logarithmic number of times, and the large old buffers stay as they are.
        """
        kept = list(flats)
        merged = []
        for bucket in _by_device_dtype(newcomers).values():
            size = sum(p.numel() for p in bucket)
            absorbed = []
            for flat in reversed(kept):
                if (flat.device, flat.dtype) != (bucket[0].device, bucket[0].dtype):
                    continue
                if flat.numel > 2 * size:
                    break
                absorbed.insert(0, flat)
                size += flat.numel
            kept = [f for f in kept if all(f is not a for a in absorbed)]
            params = [p for flat in absorbed for p in flat.params] + bucket
            merged += self._build_flat_states(group, params)
        return kept + merged

    def _build_flat_states(self, group: dict, stepped: list) -> list[_FlatState]:
        """Allocate flat buffers for the parameters ``stepped`` of ``group``, one per device
        and dtype; move any existing (loaded or earlier) state into them."""
        flats = []
        for (device, dtype), params in _by_device_dtype(stepped).items():
            total = sum(p.numel() for p in params)
            keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
            flat = _FlatState(params, {key: torch.zeros(total, dtype=dtype, device=device)
                                       for key in keys})
            for i, p in enumerate(params):
                state = self.state.get(p)
                if not state:
                    continue
                # loaded or earlier state: move it into the flat buffers
                for key in keys + ["step"]:
                    if key in state:
                        _check_state_shape(p, key, state[key])
                        flat.views[key][i].copy_(state[key])
                    state[key] = flat.views[key][i]
            flats.append(flat)
        return flats

    def _step_flat(self, group: dict, flat: _FlatState, repeats: dict) -> None:
        """Step the parameters of ``flat`` that have a gradient; one listed ``k`` times in the
        group (``repeats``) is stepped ``k`` times, in ``k`` kernel calls (as torch's loop)."""
        live = [i for i, p in enumerate(flat.params) if p.grad is not None]
        if not live:
            return
        views = flat.views
        params, grads, strided = [], [], []
        for i in live:
            p = flat.params[i]
            _bind_to_views(self.state[p], views, i)
            grad = p.grad
            grads.append(grad if grad.is_contiguous() else grad.contiguous())
            if not p.is_contiguous():  # the kernels step flat memory: go through a copy
                strided.append((p, p.contiguous()))
                p = strided[-1][1]
            params.append(p)
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
        rounds = max(repeats.get(id(flat.params[i]), 1) for i in live) if repeats else 1
        for round_ in range(rounds):  # every live parameter, then the repeated ones again
            picked = range(len(live)) if round_ == 0 else \
                [k for k, i in enumerate(live) if repeats.get(id(flat.params[i]), 1) > round_]
            self._update_picked(group, flat, keys, [live[k] for k in picked],
                                [params[k] for k in picked], [grads[k] for k in picked])
        for p, stepped in strided:
            p.copy_(stepped)

    def _update_picked(self, group: dict, flat: _FlatState, keys: tuple, indices: list,
                       params: list, grads: list) -> None:
        """One update of ``flat.params[i]`` for ``i`` in ``indices`` (``params`` / ``grads``:
        their contiguous tensors), their step counts advanced first."""
        if len(indices) == len(flat.params):
            flat.steps.add_(1.0)
        else:
            flat.steps[indices] += 1.0
        counts = flat.steps.tolist()
        steps = [int(counts[i]) for i in indices]
        exp_avgs, exp_avg_sqs, *maxes = ([_as_real(flat.views[key][i]) for i in indices]
                                         for key in keys)
        self._update(group, [_as_real(p) for p in params], [_as_real(g) for g in grads],
                     exp_avgs, exp_avg_sqs, maxes[0] if maxes else None, steps)

    def _update(self, group: dict, params: list, grads: list, exp_avgs: list,
                exp_avg_sqs: list, max_exp_avg_sqs, steps: list) -> None:
        """The update of one bucket's contiguous tensors (``steps[i]``: tensor ``i``'s step
        number after it): AdamW through the kernels' dispatch. Subclasses with other rules
        (:mod:`shardkit.ops.adam`) replace this and keep the flat state."""
        beta1, beta2 = group["betas"]
        lr = group["lr"]  # a tensor lr read once (the check and the launch both read it)
        adamw_step_many(params, grads, exp_avgs, exp_avg_sqs, steps=steps,
                        lr=float(lr) if isinstance(lr, torch.Tensor) else lr,
                        beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], maximize=group["maximize"],
                        amsgrad=group["amsgrad"], max_exp_avg_sqs=max_exp_avg_sqs,
                        decoupled=group.get("decoupled_weight_decay", True), validate=False)


def _as_real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real view (``(..., 2)``, no copy), as torch's AdamW steps
    complex parameters: each real and imaginary part is one element of Adam; the kernels
    take real dtypes only."""
    return torch.view_as_real(t) if t.is_complex() else t


def _bind_to_views(state: dict, views: dict, i: int) -> None:
    """Make ``state`` (one parameter's) hold the flat views ``views[key][i]``, as torch's
    optimizer would see it: an entry the user cleared (``opt.state.clear()``, a fresh
    ``opt.state`` dict) starts again from zero, and a tensor assigned in its place is copied in.
    """
    for key, entries in views.items():
        view, value = entries[i], state.get(key)
        if value is view:
            continue
        if value is None:
            view.zero_()
        else:
            view.copy_(value)
        state[key] = view


def _compact_state(state: dict, params: dict, always_copy: bool = False) -> dict:
    """``state`` (parameter or index -> {key: value}) in new dicts, each tensor as torch's
    AdamW keeps it (:func:`_as_torch_keeps`); ``params`` maps each key to its parameter."""
    return {key: {name: _as_torch_keeps(value, params.get(key), always_copy)
                  for name, value in entries.items()}
            for key, entries in state.items()}


def _as_torch_keeps(value, param, always_copy: bool = False):
    """``value`` on storage of its own and, for a moment, in ``param``'s memory layout (torch
    allocates them with ``zeros_like(param)``): copied where it is not already, or always with
    ``always_copy``.

    Note: the flat buffers' views are contiguous; torch's fused AdamW pairs the parameter's
    and its state's memory element by element, so a contiguous moment loaded for a transposed
    or channels_last parameter would update the wrong elements. A view that happens to own
    its storage (the only parameter of its buffer) is still the live state: a state dict
    copies it too, or its entries would mix live and copied values."""
    if not isinstance(value, torch.Tensor):
        return value
    own = value.untyped_storage().nbytes() == value.numel() * value.element_size()
    layout = param is None or value.shape != param.shape or value.stride() == param.stride()
    if own and layout and not always_copy:
        return value
    if param is None or value.shape != param.shape:
        return value.clone(memory_format=torch.contiguous_format)
    return torch.empty_like(param, dtype=value.dtype, device=value.device,
                            memory_format=torch.preserve_format).copy_(value)


def _params_by_index(packed_groups: list[dict], groups: list[dict]) -> dict:
    """``{index in a state dict: parameter}``, read from the state dict's own packed groups
    (``packed_groups[g]["params"]`` numbers ``groups[g]["params"]``), so that it numbers
    them as torch's ``state_dict`` did, a parameter repeated in a group included."""
    return {index: p for packed, group in zip(packed_groups, groups)
            for index, p in zip(packed["params"], group["params"])}


def _check_state_shape(param: torch.Tensor, key: str, value) -> None:
    if key != "step" and isinstance(value, torch.Tensor) and value.shape != param.shape:
        raise ValueError(f"FusedAdamW: state[{key!r}] of a parameter has shape "
                         f"{tuple(value.shape)}, the parameter {tuple(param.shape)} (resized "
                         f"after its first step, or a state dict of another model); clear "
                         f"its state (del opt.state[p]) to start it afresh")


def _by_device_dtype(params: list) -> dict[tuple, list]:
    """``params`` by ``(device, dtype)``, each list in the order of ``params``."""
    buckets: dict[tuple, list] = {}
    for p in params:
        buckets.setdefault((p.device, p.dtype), []).append(p)
    return buckets


def _stepped_params(params: list, state: dict) -> list:
    """The parameters of ``params`` that get optimizer state, in order: those with a gradient
    now or with state already (stepped before, or loaded). As in torch, a parameter that never
    had a gradient (a frozen base model beside its adapters, an unused branch) costs no state
    memory; its first gradient allocates its state then."""
    return [p for p in params if p.grad is not None or state.get(p)]


# keys of a torch.optim.AdamW group beside the hyper-parameters, with the values its
# __setstate__ gives a state dict saved without them; and those it always sets
_TORCH_GROUP_KEYS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False,
                         differentiable=False, fused=None)
_FIXED_GROUP_KEYS = dict(capturable=False, differentiable=False, decoupled_weight_decay=True)


def _check_modes(group: dict) -> None:
    """torch AdamW's implementation switches, as this step can honour them."""
    for name in ("capturable", "differentiable"):
        if group.get(name):
            raise ValueError(f"FusedAdamW: {name}={group[name]!r} is not supported (the step "
                             f"runs outside autograd and CUDA graphs); leave it False")
    if group.get("fused") and group.get("foreach"):
        raise ValueError(f"FusedAdamW: fused={group['fused']!r} and foreach="
                         f"{group['foreach']!r}; at most one of them may be True (as torch)")


def _repeats(params: list) -> dict:
    """``{id(p): count}`` of the parameters listed more than once in ``params`` (empty when
    none is: the usual case costs one set)."""
    if len(set(map(id, params))) == len(params):
        return {}
    counts: dict = {}
    for p in params:
        counts[id(p)] = counts.get(id(p), 0) + 1
    return {key: count for key, count in counts.items() if count > 1}


def _refuse_overlapping_params(name: str, groups: list) -> None:
    """A ValueError for two distinct parameters that share memory (views of one tensor that
    share elements, or ``.data`` tied by hand). One step updates them together, each through
    its own copy when not contiguous, so the shared elements ended up with the last copy's
    update (0.3 from ``torch.optim.AdamW``'s after three steps), or, in one kernel launch on
    CUDA, with whichever write landed last; torch itself steps them otherwise on CPU (one
    parameter after the other) than on CUDA (each operation over all of them). Views that
    share no element (the halves, or the columns, of one tensor) are fine. Local: one look
    at each parameter's storage, and a sort of the parameters sharing one."""
    on_storage: dict = {}
    for g, group in enumerate(groups):
        for i, p in enumerate(group["params"]):
            # a sparse (or other storage-less) parameter shares no dense storage; its sparse
            # gradient is refused by name at the step
            if p.numel() and p.device.type != "meta" and p.layout == torch.strided:
                key = (p.device, p.untyped_storage().data_ptr())
                on_storage.setdefault(key, {}).setdefault(id(p), (g, i, p))
    for placed in on_storage.values():
        clash = _first_sharing_pair(list(placed.values())) if len(placed) > 1 else None
        if clash is not None:
            (g0, i0, a), (g1, i1, b) = clash
            raise ValueError(
                f"{name}: parameters {i0} of param group {g0} (shape {tuple(a.shape)}) and {i1} "
                f"of param group {g1} (shape {tuple(b.shape)}) share memory (views of one "
                f"tensor, or tied through `.data`); the fused step would update the shared "
                f"elements otherwise than torch.optim.AdamW. Tie them as one Parameter "
                f"(`b.weight = a.weight`), give each its own tensor, or use torch.optim.AdamW")


def _byte_span(p: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` byte of ``p``'s elements in its storage."""
    start = p.storage_offset() * p.element_size()
    reach = sum((size - 1) * stride for size, stride in zip(p.shape, p.stride())) + 1
    return start, start + reach * p.element_size()


def _first_sharing_pair(placed: list) -> Optional[tuple]:
    """Two of ``placed`` (``(group, index, param)`` on one storage) that share an element, or
    None. Parameters whose byte spans do not overlap (the usual case) are told by a sort;
    overlapping spans of dense views share elements; strided views (columns of one matrix)
    are told exactly by claiming each one's elements in a scratch index over the part of the
    storage they span (CPU memory, 4 bytes an element of that part: 64 MiB for the column
    halves of a 4096 x 4096 matrix, once, at construction)."""
    spans = sorted((_byte_span(entry[2]), k) for k, entry in enumerate(placed))
    furthest, overlapping = spans[0], None
    for span in spans[1:]:
        if span[0][0] < furthest[0][1]:
            overlapping = (placed[furthest[1]], placed[span[1]])
            break
        furthest = max(furthest, span, key=lambda s: s[0][1])
    if overlapping is None:
        return None
    params = [entry[2] for entry in placed]
    if all(p.is_contiguous() for p in params) or len({p.dtype for p in params}) > 1:
        return overlapping
    first = min(p.storage_offset() for p in params)
    end = max(_byte_span(p)[1] // p.element_size() for p in params)
    claimed = torch.full((end - first,), -1, dtype=torch.int32)  # on the CPU, 4 B an element
    for k, p in enumerate(params):
        region = claimed.as_strided(p.shape, p.stride(), p.storage_offset() - first)
        taken = region[region >= 0]
        if taken.numel():
            return placed[int(taken[0])], placed[k]
        region.fill_(k)
    return None


def _refuse_sparse_gradients(name: str, groups: list) -> None:
    """A RuntimeError, before anything is stepped, for a parameter with a sparse gradient."""
    for group in groups:
        for p in group["params"]:
            grad = p.grad
            if grad is not None and grad.is_sparse:
                raise RuntimeError(f"{name}: parameter of shape {tuple(p.shape)} has a "
                                   f"sparse gradient; AdamW needs dense gradients (use "
                                   f"torch.optim.SparseAdam for sparse ones)")


def _check_hyper_parameters(lr, betas, eps, weight_decay) -> None:
    if isinstance(lr, torch.Tensor) and (lr.numel() != 1 or not lr.is_floating_point()):
        raise ValueError(f"FusedAdamW: lr is a {lr.dtype} tensor of {lr.numel()} elements; "
                         f"valid values are floats >= 0 or a one-element float tensor")
    if not lr >= 0.0:
        raise ValueError(f"FusedAdamW: lr={lr!r}; valid values are floats >= 0 (or a "
                         f"one-element float tensor holding one)")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"FusedAdamW: betas={tuple(betas)!r}; valid values are two floats in "
                         f"[0, 1)")
    if not eps >= 0.0:
        raise ValueError(f"FusedAdamW: eps={eps!r}; valid values are floats >= 0")
    if not weight_decay >= 0.0:
        raise ValueError(f"FusedAdamW: weight_decay={weight_decay!r}; valid values are floats "
                         f">= 0")
