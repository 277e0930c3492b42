"""Choose which submodules become their own wrapped units (FairScale's ``enable_wrap`` /
``wrap`` / ``auto_wrap`` and torch's policy callables).

Usage::

    from shardkit.nn import FullyShardedDataParallel as FSDP
    from shardkit.nn.wrap import enable_wrap, auto_wrap, transformer_auto_wrap_policy

    with enable_wrap(wrapper_cls=FSDP, reshard_after_forward=True):
        model = FSDP(auto_wrap(GPT(cfg), transformer_auto_wrap_policy({Block})))

A policy is a callable ``policy(module=, recurse=, unwrapped_params=)`` (torch's spelling
``nonwrapped_numel=`` works too): with ``recurse=True`` it answers "look inside this module?",
with ``recurse=False`` "wrap this module as a unit?". The policy is data the mechanism reads; it
never decides anything itself. Wrapping costs nothing here; the wrapper's own costs apply.
"""

from __future__ import annotations

import collections.abc
import contextlib
import functools
import inspect
import numbers
import weakref
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn as nn

__all__ = ["auto_wrap", "enable_wrap", "wrap", "default_auto_wrap_policy",
           "config_auto_wrap_policy", "transformer_auto_wrap_policy",
           "size_based_auto_wrap_policy", "no_split_modules_policy", "no_split_module_classes",
           "auto_wrap_bn", "split_dtypes_policy"]

_wrap_contexts: list[tuple[type, dict, Optional[Callable]]] = []


def default_auto_wrap_policy(module: nn.Module = None, recurse: bool = None,
                             unwrapped_params: Optional[int] = None,
                             module_is_root: Optional[bool] = None,
                             min_num_params: int = int(1e8),
                             force_leaf_modules: Optional[Iterable[type]] = None,
                             exclude_wrap_modules: Optional[Iterable[type]] = None,
                             skip_params_check_for_root: bool = False,
                             nonwrapped_numel: Optional[int] = None) -> bool:
    """Wrap any module whose not-yet-wrapped parameters number at least ``min_num_params``
    (FairScale's policy; pass ``functools.partial(default_auto_wrap_policy,
    min_num_params=...)``).

    Args:
        force_leaf_modules: classes never looked into (default:
            ``default_auto_wrap_policy.FORCE_LEAF_MODULES``, ``{nn.MultiheadAttention}``).
        exclude_wrap_modules: classes never wrapped (default:
            ``default_auto_wrap_policy.EXCLUDE_WRAP_MODULES``, ``{nn.ModuleList,
            nn.ModuleDict}``). Both defaults are read at each call, so editing the sets works.
        skip_params_check_for_root: wrap the root (``module_is_root=True``) whatever its size.

    A size policy looks at sizes only: in a mixture-of-experts model whose experts are modules
    of their own (Hugging Face's Switch Transformers), each expert may become a unit, and an
    expert that receives no tokens on some rank skips its unit's collectives there (the ranks
    fall out of step). Add the experts' class to ``exclude_wrap_modules`` (beside the default
    ``nn.ModuleList`` and ``nn.ModuleDict``: the argument replaces the defaults), or wrap with
    :func:`no_split_modules_policy` of the model.
    """
    numel = unwrapped_params if unwrapped_params is not None else nonwrapped_numel
    if module is None or recurse is None or numel is None:
        raise ValueError("default_auto_wrap_policy(module=, recurse=, unwrapped_params=): all "
                         "three are needed; to set min_num_params use functools.partial("
                         "default_auto_wrap_policy, min_num_params=...)")
    if isinstance(min_num_params, bool) or not isinstance(min_num_params, numbers.Real):
        raise ValueError(f"default_auto_wrap_policy(min_num_params={min_num_params!r}): "
                         f"expected a number of parameters, e.g. int(1e8)")
    large = numel >= min_num_params
    if recurse:
        leaf = default_auto_wrap_policy.FORCE_LEAF_MODULES if force_leaf_modules is None \
            else force_leaf_modules
        return large and not isinstance(module, _module_classes(leaf, "force_leaf_modules"))
    excluded = default_auto_wrap_policy.EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None \
        else exclude_wrap_modules
    root_forced = bool(module_is_root) and skip_params_check_for_root
    return (large or root_forced) and \
        not isinstance(module, _module_classes(excluded, "exclude_wrap_modules"))


def _module_classes(classes, name: str) -> tuple:
    """``classes`` (one nn.Module subclass, or an iterable of them) as a tuple; anything else
    (class names, module instances) is a ValueError naming the size policy's argument."""
    given = classes
    if isinstance(classes, type):
        classes = (classes,)
    try:
        classes = tuple(classes) if not isinstance(classes, str) else (classes,)
    except TypeError:
        classes = (classes,)
    if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise ValueError(f"default_auto_wrap_policy({name}={given!r}): expected a set of "
                         f"nn.Module subclasses, e.g. {{nn.MultiheadAttention}}")
    return classes


default_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}
default_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}


size_based_auto_wrap_policy = default_auto_wrap_policy  # torch's name for the same rule


def config_auto_wrap_policy(module: nn.Module = None, recurse: bool = None,
                            unwrapped_params: Optional[int] = None,
                            module_is_root: Optional[bool] = None, **_ignored) -> bool:
    """Wrap exactly the modules that carry a ``wrapper_config`` attribute (FairScale's policy
    for tagging units by hand, possibly over several passes); always look inside."""
    return True if recurse else hasattr(module, "wrapper_config")


def transformer_auto_wrap_policy(transformer_layer_cls=None, module: nn.Module = None,
                                 recurse: Optional[bool] = None, unwrapped_params=None,
                                 nonwrapped_numel=None, **_ignored) -> Any:
    """Wrap every instance of the given block classes (e.g. ``{Block}``) as a unit.

    ``transformer_auto_wrap_policy({Block})`` returns the policy; torch/FairScale style
    ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})`` is the
    policy itself.
    """
    classes = _as_class_tuple(transformer_layer_cls)
    if module is None and recurse is None:
        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)
    if recurse:
        return True
    return isinstance(module, classes)


def no_split_module_classes(model: nn.Module) -> tuple:
    """The block classes a model declares in ``_no_split_modules`` (Hugging Face's attribute:
    class names that must stay on one device), gathered from every submodule and resolved to the
    classes found in ``model`` (every class of that name: a name matches classes, as in
    Hugging Face's ``device_map``). Any module may declare the attribute; a name that names no
    submodule's class is ignored (HF lists classes of other model variants too).

    Raises ``ValueError`` when no submodule declares a class that ``model`` contains.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"no_split_module_classes(model={type(model).__name__}): expected an "
                         f"nn.Module")
    names: set = set()
    for m in model.modules():
        declared = getattr(m, "_no_split_modules", None)
        if isinstance(declared, str):
            declared = [declared]
        names.update(declared or ())
    # every class carrying a declared name: two classes may share one (a vision tower's and
    # a text model's ``Block``), and Hugging Face matches these names, not the classes
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not found:
        raise ValueError(f"no_split_module_classes(model={type(model).__name__}): no submodule "
                         f"declares _no_split_modules naming a class it contains (declared: "
                         f"{sorted(names)}); pass the block classes to "
                         f"transformer_auto_wrap_policy({{Block}}) instead")
    return tuple(sorted(found, key=lambda c: (c.__name__, c.__module__, c.__qualname__)))


def no_split_modules_policy(model: nn.Module) -> Callable:
    """A wrap policy selecting every instance of the block classes ``model`` declares in
    ``_no_split_modules`` (see :func:`no_split_module_classes`): one FSDP unit, or one
    checkpointed region, per transformer block of a Hugging Face model.

    Usage::

        policy = no_split_modules_policy(hf_model)  # e.g. {GPT2Block}, {LlamaDecoderLayer}
        model = FSDP(auto_wrap(hf_model, policy))
        apply_activation_checkpointing(hf_model, policy)

    Costs nothing; the wrapper's own costs apply per unit.
    """
    return transformer_auto_wrap_policy(no_split_module_classes(model))


def planned_units(model: nn.Module, policy: Callable, wrapper_cls) -> list:
    """The units :func:`auto_wrap` would build over ``model`` with ``policy`` and
    ``wrapper_cls``, and ``model`` itself (wrapped last, as :func:`shardkit.recipes.compose`
    does), bottom-up, each as ``(module, the parameters it would own)`` (those no inner unit
    took). A dry run: nothing is wrapped. Local."""
    planned: list = []

    def record(module: nn.Module) -> nn.Module:
        planned.append(module)
        return module

    _recursive_wrap(model, _policy_caller(policy), _wrapper_key(wrapper_cls), record, True,
                    _registering_modules(model))
    if not planned or planned[-1] is not model:
        planned.append(model)
    taken, units = set(), []
    for module in planned:
        own = [p for p in module.parameters() if id(p) not in taken]
        taken.update(id(p) for p in own)
        units.append((module, own))
    return units


def split_dtypes_policy(model: nn.Module, policy: Callable) -> Callable:
    """``policy``, plus a unit of its own for each largest submodule of ``model`` whose
    parameters share one dtype inside a parent whose parameters mix dtypes (an fp64 head on
    an fp32 body, a bf16 adapter): an FSDP unit flattens its parameters into one buffer of
    one dtype, so a unit mixing them is refused. A submodule that mixes dtypes below it but
    whose own parameters (those its one-dtype submodules leave it) share one dtype is a unit
    too (an fp64 scale beside an fp32 Linear), so that they do not fall into a parent
    holding another dtype. ``policy`` itself when every parameter has one dtype. Containers
    without a forward of their own (``nn.ModuleList``, ``nn.ModuleDict``,
    ``nn.ParameterList``, ``nn.ParameterDict``) are never units: their children are looked
    at instead. A module mixing dtypes in its own parameters stays mixed (FSDP refuses the
    unit holding them). A torch ``CustomPolicy`` stays one: the wrapper keyword arguments
    its ``lambda_fn`` gives a module still apply. Costs one walk over the modules."""
    islands = {id(m) for m in _one_dtype_submodules(model)}
    if not islands:
        return policy
    if _custom_policy_lambda(policy) is not None:
        return _split_custom_policy(policy, islands)
    holds_island = {id(m) for m in model.modules()
                    if any(id(sub) in islands for sub in m.modules())}
    call = _policy_caller(policy)

    def split(module=None, recurse=None, unwrapped_params=None, module_is_root=None,
              **_ignored) -> bool:
        if recurse:
            return id(module) in holds_island or call(module, True, unwrapped_params,
                                                      bool(module_is_root))
        return id(module) in islands or call(module, False, unwrapped_params,
                                             bool(module_is_root))
    return split


def _split_custom_policy(policy, islands: set):
    """torch's ``CustomPolicy`` ``policy`` that also selects the modules in ``islands``,
    kept a ``CustomPolicy`` so that the wrapper keyword arguments its ``lambda_fn`` gives
    a module still reach that module's unit."""
    from torch.distributed.fsdp.wrap import CustomPolicy
    lambda_fn = _custom_policy_lambda(policy)

    def select(module: nn.Module):
        answer = lambda_fn(module)
        if id(module) in islands and (answer is False or answer == {}):
            return True
        return answer
    return CustomPolicy(select)


_NO_FORWARD = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _one_dtype_submodules(model: nn.Module) -> list:
    """The submodules of ``model`` that become units of one dtype under an ancestor holding
    several (none when ``model``'s parameters share one dtype): the largest ones whose
    parameters share one dtype, and each one mixing dtypes whose leftover parameters (not
    in such a unit below it) share one dtype."""
    found = []

    def leftover_dtypes(module: nn.Module) -> set:
        """The dtypes of ``module``'s parameters that no unit found below it holds."""
        left = {p.dtype for p in module.parameters(recurse=False)}
        for child in module.children():
            dtypes = {p.dtype for p in child.parameters()}
            if not dtypes:
                continue
            if len(dtypes) == 1 and not isinstance(child, _NO_FORWARD):
                found.append(child)
                continue
            below = leftover_dtypes(child)
            if len(below) == 1 and not isinstance(child, _NO_FORWARD):
                found.append(child)
            else:
                left |= below
        return left

    if len({p.dtype for p in model.parameters()}) > 1:
        leftover_dtypes(model)
    return found


def _as_class_tuple(transformer_layer_cls) -> tuple:
    if isinstance(transformer_layer_cls, type):
        classes = (transformer_layer_cls,)
    elif transformer_layer_cls is None:
        classes = ()
    else:
        try:
            classes = tuple(transformer_layer_cls)
        except TypeError:  # one module instance, a number...: named below
            classes = (transformer_layer_cls,)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if not classes or bad:
        raise ValueError(f"transformer_auto_wrap_policy(transformer_layer_cls="
                         f"{transformer_layer_cls!r}): expected a non-empty set of nn.Module "
                         f"subclasses, e.g. {{Block}}")
    return classes


@contextlib.contextmanager
def enable_wrap(wrapper_cls: Optional[type] = None, auto_wrap_policy: Optional[Callable] = None,
                **wrapper_kwargs):
    """Inside the block, :func:`wrap` and :func:`auto_wrap` wrap with
    ``wrapper_cls(module, **wrapper_kwargs)`` (default: FullyShardedDataParallel), and
    :func:`auto_wrap` without a policy of its own uses ``auto_wrap_policy`` (default:
    :func:`default_auto_wrap_policy`). ``wrapper_cls`` may also be a ``functools.partial`` of
    a class or a factory ``f(module, **kwargs)``. Contexts nest: the innermost one applies
    (FairScale refuses nesting). FairScale's ``move_module_cuda_half=True`` is a ValueError
    (cast the model before wrapping it); ``False``, its default, is accepted."""
    if wrapper_cls is None:
        from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel
        wrapper_cls = FullyShardedDataParallel
    if not callable(wrapper_cls):
        raise ValueError(f"enable_wrap(wrapper_cls={wrapper_cls!r}): expected a wrapper class")
    if _looks_like_policy(wrapper_cls):
        raise ValueError(f"enable_wrap(wrapper_cls={wrapper_cls!r}): this is a wrap policy (it "
                         f"takes recurse=), not a wrapper; FairScale's first positional "
                         f"argument is the policy, shardkit's is wrapper_cls: pass "
                         f"auto_wrap_policy=... by keyword")
    # FairScale's flag for wrap() (never a wrapper argument): False is its default, True asks
    # wrap() to call module.cuda().half() first, which shardkit leaves to the caller.
    cuda_half = wrapper_kwargs.pop("move_module_cuda_half", False)
    if cuda_half is not False:
        raise ValueError(f"enable_wrap(move_module_cuda_half={cuda_half!r}): only False (its "
                         f"default) is supported; move and cast the model before wrapping it "
                         f"(model.cuda().half(), or model.to(device, dtype)); FSDP's "
                         f"mixed_precision=True computes in fp16 from fp32 shards")
    _check_policy(auto_wrap_policy, "enable_wrap")
    _check_wrapper_kwargs(wrapper_cls, wrapper_kwargs, "enable_wrap")
    _wrap_contexts.append((wrapper_cls, _ignored_listed(wrapper_kwargs), auto_wrap_policy))
    try:
        yield
    finally:
        _wrap_contexts.pop()


def _looks_like_policy(candidate) -> bool:
    """A callable (not a class) whose signature names ``recurse``: a wrap policy."""
    if isinstance(candidate, type) or isinstance(_wrapper_type(candidate), type):
        return False
    try:
        return "recurse" in inspect.signature(candidate).parameters
    except (TypeError, ValueError):
        return False


def _custom_policy_lambda(policy) -> Optional[Callable]:
    """The ``lambda_fn`` of torch's ``CustomPolicy(lambda_fn)`` (a policy object that is not
    callable itself), else None. Local."""
    lambda_fn = getattr(policy, "_lambda_fn", None)
    return None if callable(policy) or not callable(lambda_fn) else lambda_fn


def _check_policy(policy, what: str) -> None:
    if policy is not None and not callable(policy) and _custom_policy_lambda(policy) is None:
        raise ValueError(f"{what}(auto_wrap_policy={policy!r}): expected a callable "
                         f"policy(module=, recurse=, unwrapped_params=)")


# the size policy's arguments, which FairScale's tutorial passes to auto_wrap itself
_POLICY_ARGUMENTS = ("min_num_params", "force_leaf_modules", "exclude_wrap_modules")


def _check_wrapper_kwargs(wrapper_cls, kwargs: dict, what: str) -> None:
    """Raise a TypeError naming a keyword argument ``wrapper_cls`` does not take, before any
    module is wrapped: otherwise it surfaces only when the policy first selects a module, and
    never when it selects none (``auto_wrap(model, min_num_params=...)`` wrapped nothing)."""
    if not kwargs:
        return
    try:
        params = inspect.signature(wrapper_cls).parameters
    except (TypeError, ValueError):  # no signature to read: let the wrapper judge
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    name = getattr(wrapper_cls, "__name__", repr(wrapper_cls))
    for key in kwargs:
        if key in valid[1:]:  # the first one is the module itself
            continue
        if key in _POLICY_ARGUMENTS:
            raise TypeError(f"{what}({key}=...): {key} is an argument of the size policy, not "
                            f"of {name}; pass auto_wrap_policy=functools.partial("
                            f"default_auto_wrap_policy, {key}=...)")
        raise TypeError(f"{what}({key}=...): not an argument of {name}; valid ones are "
                        f"{', '.join(valid[1:])}")


def _current_wrapper() -> Optional[tuple[type, dict, Optional[Callable]]]:
    return _wrap_contexts[-1] if _wrap_contexts else None


def _wrap_one(module: nn.Module, wrapper_cls, context_kwargs: dict, overrides: dict):
    """``wrapper_cls(module, ...)`` with the context's kwargs, then the module's own
    ``wrapper_config`` dict (FairScale's per-module settings), then ``overrides``."""
    own = getattr(module, "wrapper_config", None) or {}
    if not isinstance(own, dict):
        raise ValueError(f"{type(module).__name__}.wrapper_config={own!r}: expected a dict of "
                         f"wrapper keyword arguments")
    wrapped = wrapper_cls(module, **{**context_kwargs, **own, **overrides})
    if isinstance(wrapped, nn.Module) and wrapped is not module:
        _built_by_wrap[wrapped] = _wrapper_key(wrapper_cls)
    return wrapped


# every wrapper wrap()/auto_wrap() built -> its kind (_wrapper_key), so that a later auto_wrap
# with the same kind leaves it alone even when wrapper_cls is a factory function (no class to
# test against), while one with another kind looks inside it
_built_by_wrap: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()


def _wrapper_key(wrapper_cls):
    """What identifies a wrapper kind: its class where known, else the factory itself."""
    return _wrapper_type(wrapper_cls) or wrapper_cls


def wrap(module: nn.Module, **wrap_overrides) -> nn.Module:
    """Inside :func:`enable_wrap`, wrap ``module`` (the context's kwargs, overridden by the
    module's ``wrapper_config`` dict if it has one, overridden by ``wrap_overrides``);
    outside, return it unchanged (FairScale semantics)."""
    current = _current_wrapper()
    if current is None:
        return module
    cls, kwargs, _ = current
    _check_wrapper_kwargs(cls, wrap_overrides, "wrap")
    if _ignored_by({**kwargs, **wrap_overrides}).has_module(module):
        return module  # torch FSDP1's ignored_modules: left as it is
    return _wrap_one(module, cls, kwargs, wrap_overrides)


def _ignored_listed(kwargs: dict) -> dict:
    """``kwargs`` with an iterator given as ``ignored_modules`` / ``ignored_states`` made a
    list, so that every unit built from them (and :func:`_ignored_by`) sees all of it, not
    what an earlier one left. Local."""
    return {key: list(value) if key in ("ignored_modules", "ignored_states")
            and isinstance(value, collections.abc.Iterator) else value
            for key, value in kwargs.items()}


def _ignored_by(kwargs: dict):
    """The :class:`~shardkit.nn.data_parallel.fsdp_arguments.IgnoredStates` that the wrapper
    kwargs' ``ignored_modules`` / ``ignored_states`` leave alone; empty when neither is given
    or the value is not iterable (the wrapper's own checks name that). Local."""
    from shardkit.nn.data_parallel.fsdp_arguments import IgnoredStates
    given = kwargs.get("ignored_modules") or kwargs.get("ignored_states") or ()
    try:
        return IgnoredStates.of(list(given))
    except TypeError:
        return IgnoredStates()


def auto_wrap(module: nn.Module, auto_wrap_policy: Optional[Callable] = None,
              **wrapper_kwargs) -> nn.Module:
    """Wrap, bottom-up, every submodule the policy selects, and ``module`` itself when the
    policy selects it as the root (``module_is_root=True``): then the result is already a
    wrapper and needs no ``FSDP(...)`` around it.

    Inside :func:`enable_wrap` the context's wrapper and kwargs are used; a module's own
    ``wrapper_config`` dict overrides them, and ``wrapper_kwargs`` override both.

    .. warning:: unlike FairScale, where ``auto_wrap`` outside ``enable_wrap`` returns the
        module unchanged, shardkit wraps there too, with FullyShardedDataParallel and
        ``wrapper_kwargs`` (so ``FSDP(auto_wrap(model, policy))`` needs no context); build an
        unwrapped model by not calling ``auto_wrap`` (:func:`wrap` does follow FairScale).

    The policy: ``auto_wrap_policy``, else the context's, else
    :func:`default_auto_wrap_policy`. It is called as ``policy(module=, recurse=,
    unwrapped_params=, module_is_root=)``; ``module_is_root`` only when its signature names it
    (or takes ``**kwargs``), and torch's ``nonwrapped_numel=`` when it names that instead.
    torch's policy objects work too: ``ModuleWrapPolicy({Block})``, and ``CustomPolicy(fn)``,
    which selects every module (the root included) for which ``fn(module)`` is True or a
    dict, that dict overriding the wrapper's keyword arguments for that module.
    Modules already wrapped (instances of the wrapper class, FSDP units, wrappers built by an
    earlier :func:`wrap`/:func:`auto_wrap`) are left as they are, their parameters counted as
    wrapped (FairScale asserts there are none), and so is a module whose parameter is also
    used outside it (a tied embedding or head) or that is registered under several names
    (T5's ``shared`` embedding, also ``encoder.embed_tokens``): the enclosing unit takes it,
    so that a size policy on a model with tied weights or shared modules still gives a valid
    wrapping.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"auto_wrap(module={type(module).__name__}): expected an nn.Module")
    _check_policy(auto_wrap_policy, "auto_wrap")
    current = _current_wrapper()
    if current is None:
        from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel
        current = (FullyShardedDataParallel, {}, None)
    wrapper_cls, context_kwargs, context_policy = current
    _check_wrapper_kwargs(wrapper_cls, wrapper_kwargs, "auto_wrap")
    wrapper_kwargs = _ignored_listed(wrapper_kwargs)
    policy = auto_wrap_policy or context_policy or default_auto_wrap_policy
    call = _policy_caller(policy)

    def wrap_one(m: nn.Module) -> nn.Module:
        own = _policy_kwargs(call, m, wrapper_cls, "CustomPolicy")
        return _wrap_one(m, wrapper_cls, context_kwargs, {**wrapper_kwargs, **own})

    wrapped, _ = _recursive_wrap(module, call, _wrapper_key(wrapper_cls),
                                 wrap_one, is_root=True, owners=_registering_modules(module),
                                 ignored=_ignored_by({**context_kwargs, **wrapper_kwargs}))
    return wrapped


def _wrapper_type(wrapper_cls) -> Optional[type]:
    """The class ``wrapper_cls`` builds where that can be known: the class itself, or the one
    a ``functools.partial`` of it calls; None for any other factory callable."""
    while isinstance(wrapper_cls, functools.partial):
        wrapper_cls = wrapper_cls.func
    return wrapper_cls if isinstance(wrapper_cls, type) else None


def _already_wrapped(module: nn.Module, wrapper_kind) -> bool:
    """An instance of the wrapper class, any FSDP unit (shardkit's or torch's: both hold
    their module as ``_fsdp_wrapped_module``) whatever wrapper the context builds, or a wrapper
    of the same kind (:func:`_wrapper_key`) that wrap()/auto_wrap() built before."""
    return (isinstance(wrapper_kind, type) and isinstance(module, wrapper_kind)) or \
        "_fsdp_wrapped_module" in module._modules or _built_by_wrap.get(module) is wrapper_kind


def auto_wrap_bn(module: nn.Module, single_rank_pg: bool = False, process_group=None,
                 fsdp_config: Optional[dict] = None, wrap_it: bool = True,
                 assert_on_collision: bool = True) -> nn.Module:
    """Give every BatchNorm layer of ``module`` its own FullyShardedDataParallel unit that keeps
    its weights and statistics in fp32 (FairScale's function, for models whose other units
    compute in 16 bits): each BatchNorm gets ``fsdp_config`` as its ``wrapper_config``
    (default: ``mixed_precision=False``, ``reshard_after_forward=False``, over
    ``process_group``, or over this rank alone with ``single_rank_pg=True``), then, with
    ``wrap_it``, :func:`auto_wrap` wraps exactly those layers. Inputs are not cast: a 16-bit
    activation reaches the layer as it is, as in FairScale.

    A BatchNorm that already carries a ``wrapper_config`` is a ValueError with
    ``assert_on_collision`` (another policy tagged it), else it is given the new one. Wrapping
    costs what each unit costs (one unit per BatchNorm: its parameters are gathered in forward,
    its gradients reduce-scattered); ``single_rank_pg=True`` creates one single-rank group per
    rank, collectively, on first use (:func:`shardkit.distributed.single_rank_group`).
    """
    from shardkit import distributed as skdist
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel
    if not isinstance(module, nn.Module):
        raise ValueError(f"auto_wrap_bn(module={type(module).__name__}): expected an nn.Module")
    if fsdp_config is not None and not isinstance(fsdp_config, dict):
        raise ValueError(f"auto_wrap_bn(fsdp_config={fsdp_config!r}): expected a dict of "
                         f"FullyShardedDataParallel keyword arguments")
    if fsdp_config is None:
        group = skdist.single_rank_group() if single_rank_pg else process_group
        fsdp_config = {"process_group": group, "mixed_precision": False,
                       "reshard_after_forward": False, "bucket_cap_mb": 0}
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            if assert_on_collision and hasattr(m, "wrapper_config"):
                raise ValueError(f"auto_wrap_bn: a {type(m).__name__} already has a "
                                 f"wrapper_config ({m.wrapper_config!r}); another policy tagged "
                                 f"it. Pass assert_on_collision=False to replace it")
            m.wrapper_config = dict(fsdp_config)
    if not wrap_it:
        return module
    with enable_wrap(wrapper_cls=FullyShardedDataParallel,
                     auto_wrap_policy=config_auto_wrap_policy):
        return auto_wrap(module)


def _registering_modules(root: nn.Module) -> dict:
    """``{id(parameter) or ("module", id(module)): the (id(parent), name) registrations of it
    under root}``: a parameter registered by several modules (a tied embedding and output
    head) or a module registered under several names (T5's ``shared`` embedding, also
    ``encoder.embed_tokens``) is shared. A module below a shared one is registered once (by
    its own parent), so it may still be wrapped: the wrapper replaces it in that one parent,
    which every alias of the shared module sees."""
    owners: dict = {}
    for m in root.modules():
        for name, child in m._modules.items():
            if child is not None:
                owners.setdefault(("module", id(child)), set()).add((id(m), name))
        for name, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), set()).add((id(m), name))
    return owners


def _shares_parameters_outside(module: nn.Module, owners: dict) -> bool:
    """Whether ``module`` is registered under several names, or a parameter or submodule of
    it is also registered by a module outside it.

    Note: such a module cannot be a unit of its own (a unit shards what it holds, and the other
    user would read the shard; a module registered under two names would be wrapped at one
    only), so auto_wrap leaves it to the enclosing unit, which holds every use: a tied
    embedding and head end up in the unit that contains both."""
    if len(owners.get(("module", id(module)), ())) > 1:
        return True
    inside = {id(m) for m in module.modules()}
    keys = [("module", id(m)) for m in module.modules() if m is not module] + \
        [id(p) for p in module.parameters()]
    return any(parent not in inside for key in keys for parent, _ in owners.get(key, ()))


def _policy_caller(policy: Callable) -> Callable[[nn.Module, bool, int, bool], bool]:
    """Call a policy with whichever keywords it takes (parameter count: FairScale's
    ``unwrapped_params`` or torch's ``nonwrapped_numel``; ``module_is_root`` if named).
    torch's ``CustomPolicy(lambda_fn)`` looks inside every module and selects those for which
    ``lambda_fn(module)`` is True or a non-empty dict (see :func:`_policy_kwargs`)."""
    lambda_fn = _custom_policy_lambda(policy)
    if lambda_fn is not None:
        return _CustomPolicyCaller(lambda_fn)
    try:
        params = inspect.signature(policy).parameters
    except (TypeError, ValueError):
        params = {}
    accepts_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    key = "nonwrapped_numel" if "nonwrapped_numel" in params and \
        "unwrapped_params" not in params and not accepts_kwargs else "unwrapped_params"
    pass_root = accepts_kwargs or "module_is_root" in params

    def call(m: nn.Module, recurse: bool, numel: int, is_root: bool) -> bool:
        extra = {"module_is_root": is_root} if pass_root else {}
        return bool(policy(module=m, recurse=recurse, **{key: numel}, **extra))

    return call


class _CustomPolicyCaller:
    """torch's ``CustomPolicy``: its ``lambda_fn`` answers True/False, or a dict of wrapper
    keyword arguments that override the others for that module (remembered for
    :func:`_policy_kwargs`). Local."""

    def __init__(self, lambda_fn: Callable):
        self.lambda_fn = lambda_fn
        self.kwargs: dict[int, dict] = {}

    def __call__(self, m: nn.Module, recurse: bool, numel: int, is_root: bool) -> bool:
        if recurse:
            return True
        answer = self.lambda_fn(m)
        if not isinstance(answer, (bool, dict)):
            raise ValueError(f"CustomPolicy: its lambda_fn returned {answer!r} for a "
                             f"{type(m).__name__}; expected True, False or a dict of wrapper "
                             f"keyword arguments")
        self.kwargs[id(m)] = answer if isinstance(answer, dict) else {}
        return bool(answer)


def _policy_kwargs(caller: Callable, module: nn.Module, wrapper_cls, what: str) -> dict:
    """The wrapper keyword arguments a ``CustomPolicy`` gave ``module`` (``{}`` for any other
    policy), checked against ``wrapper_cls``. Local."""
    if not isinstance(caller, _CustomPolicyCaller):
        return {}
    kwargs = caller.kwargs.get(id(module), {})
    _check_wrapper_kwargs(wrapper_cls, kwargs, what)
    return kwargs


def wrap_below_root(module: nn.Module, auto_wrap_policy: Callable, wrapper_cls=None, *,
                    full_precision_classes: tuple = (), **wrapper_kwargs) -> nn.Module:
    """torch FSDP1's ``FSDP(module, auto_wrap_policy=policy, **kwargs)`` before its root is
    built: every submodule the policy selects is wrapped with ``wrapper_cls(sub, **kwargs)``
    (default FullyShardedDataParallel; the enclosing :func:`enable_wrap` context is not read),
    and ``module`` itself never is, whatever the policy says about it (the caller's
    constructor is its wrapper). Every submodule of a ``full_precision_classes`` type (torch's
    ``MixedPrecision._module_classes_to_ignore``) is also wrapped, with
    ``mixed_precision=False``, its floating inputs cast to fp32 and its outputs back to the
    input's dtype, as torch does. The modules and parameters that ``wrapper_kwargs``'
    ``ignored_modules`` / ``ignored_states`` name are left out: nothing inside an ignored
    module is wrapped and ignored parameters are not counted (torch FSDP1's auto-wrapping).
    Returns ``module``, changed in place. Local; each wrapper's own costs apply."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"auto_wrap_policy: expected an nn.Module to wrap, got "
                         f"{type(module).__name__}")
    _check_policy(auto_wrap_policy, "FullyShardedDataParallel")
    if wrapper_cls is None:
        from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel
        wrapper_cls = FullyShardedDataParallel
    _check_wrapper_kwargs(wrapper_cls, wrapper_kwargs, "FullyShardedDataParallel")
    classes = tuple(full_precision_classes)
    policy = call = _policy_caller(auto_wrap_policy)

    def wrap_sub(m: nn.Module) -> nn.Module:
        own = _policy_kwargs(call, m, wrapper_cls, "CustomPolicy")
        return _wrap_one(m, wrapper_cls, {}, {**wrapper_kwargs, **own})

    if classes:
        selected = policy

        def policy(m: nn.Module, recurse: bool, numel: int, is_root: bool) -> bool:
            return recurse or isinstance(m, classes) or selected(m, recurse, numel, is_root)

    def wrap_one(m: nn.Module) -> nn.Module:
        if m is module:
            return m
        if classes and isinstance(m, classes):
            _cast_through_fp32(m)
            return _wrap_one(m, wrapper_cls, {}, {**wrapper_kwargs, "mixed_precision": False})
        return wrap_sub(m)

    _recursive_wrap(module, policy, _wrapper_key(wrapper_cls), wrap_one, is_root=True,
                    owners=_registering_modules(module), ignored=_ignored_by(wrapper_kwargs))
    return module


def _cast_through_fp32(module: nn.Module) -> None:
    """Hooks that run ``module`` in fp32 inside a mixed-precision model: floating inputs are
    cast to fp32 before its forward, and floating outputs back to the inputs' dtype after."""
    seen = {}

    def cast(dtype, t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            seen.setdefault("dtype", t.dtype)
            return t.to(dtype)
        return t

    def before(m, args):
        seen.clear()
        return torch.utils._pytree.tree_map(functools.partial(cast, torch.float32), args)

    def after(m, args, output):
        if "dtype" not in seen:
            return output
        return torch.utils._pytree.tree_map(functools.partial(cast, seen["dtype"]), output)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


# Modules that read their children's parameters as tensors instead of calling the children:
# nn.MultiheadAttention hands ``out_proj.weight``/``.bias`` to F.multi_head_attention_forward
# (and to its fused fast path), so an ``out_proj`` unit would never gather its shard.
_READS_CHILDREN_DIRECTLY = (nn.MultiheadAttention,)


def _recursive_wrap(module: nn.Module, policy, wrapper_kind, wrap_one, is_root: bool,
                    owners: dict, ignored=None):
    """Returns (module or its wrapper, number of its parameters now inside wrappers).

    The children of a module in ``_READS_CHILDREN_DIRECTLY`` are never wrapped, whatever the
    policy says (``transformer_auto_wrap_policy({nn.Linear})`` would select
    ``nn.MultiheadAttention.out_proj``): the module itself may still be a unit."""
    if ignored is not None and ignored.has_module(module):  # not wrapped, nor counted
        return module, 0
    total = sum(p.numel() for p in module.parameters()
                if ignored is None or not ignored.has_param(p))
    if _already_wrapped(module, wrapper_kind):
        # Note: its parameters are already inside a wrapper, so they do not count towards
        # the enclosing modules' unwrapped parameters (counted as unwrapped, a parent with
        # few parameters of its own was wrapped by a size policy).
        return module, total
    if not policy(module, True, total, is_root):
        return module, 0
    wrapped_numel = 0
    children = [] if isinstance(module, _READS_CHILDREN_DIRECTLY) else module.named_children()
    for name, child in list(children):
        new_child, numel = _recursive_wrap(child, policy, wrapper_kind, wrap_one, False, owners,
                                           ignored)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped_numel += numel
    if policy(module, False, total - wrapped_numel, is_root) and (
            is_root or not _shares_parameters_outside(module, owners)):
        return wrap_one(module), total
    return module, wrapped_numel
