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

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterable, Optional

import torch.nn as nn

__all__ = ["auto_wrap", "enable_wrap", "wrap", "default_auto_wrap_policy",
           "transformer_auto_wrap_policy", "size_based_auto_wrap_policy"]

_DEFAULT_FORCE_LEAF = (nn.MultiheadAttention,)
_DEFAULT_EXCLUDE = (nn.ModuleList, nn.ModuleDict)
_wrap_contexts: list[tuple[type, dict]] = []


def default_auto_wrap_policy(module: nn.Module = None, recurse: bool = None,
                             unwrapped_params: Optional[int] = None,
                             module_is_root: Optional[bool] = None,
                             min_num_params: int = int(1e8),
                             force_leaf_modules: Optional[Iterable[type]] = None,
                             exclude_wrap_modules: Optional[Iterable[type]] = None,
                             nonwrapped_numel: Optional[int] = None) -> bool:
    """Wrap any module whose not-yet-wrapped parameters number at least ``min_num_params``
    (FairScale's policy; pass ``functools.partial(default_auto_wrap_policy,
    min_num_params=...)``). ``force_leaf_modules`` (default: MultiheadAttention) are never
    looked into; ``exclude_wrap_modules`` (default: ModuleList, ModuleDict) never wrapped."""
    numel = unwrapped_params if unwrapped_params is not None else nonwrapped_numel
    if module is None or recurse is None or numel is None:
        raise ValueError("default_auto_wrap_policy(module=, recurse=, unwrapped_params=): all "
                         "three are needed; to set min_num_params use functools.partial("
                         "default_auto_wrap_policy, min_num_params=...)")
    large = numel >= min_num_params
    if recurse:
        leaf = tuple(force_leaf_modules) if force_leaf_modules is not None else _DEFAULT_FORCE_LEAF
        return large and not isinstance(module, leaf)
    excluded = tuple(exclude_wrap_modules) if exclude_wrap_modules is not None \
        else _DEFAULT_EXCLUDE
    return large and not isinstance(module, excluded)


size_based_auto_wrap_policy = default_auto_wrap_policy  # torch's name for the same rule


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


def _as_class_tuple(transformer_layer_cls) -> tuple:
    if isinstance(transformer_layer_cls, type):
        classes = (transformer_layer_cls,)
    elif transformer_layer_cls is None:
        classes = ()
    else:
        classes = tuple(transformer_layer_cls)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if not classes or bad:
        raise ValueError(f"transformer_auto_wrap_policy(transformer_layer_cls="
                         f"{transformer_layer_cls!r}): expected a non-empty set of nn.Module "
                         f"subclasses, e.g. {{Block}}")
    return classes


@contextlib.contextmanager
def enable_wrap(wrapper_cls: Optional[type] = None, **wrapper_kwargs):
    """Inside the block, :func:`wrap` and :func:`auto_wrap` wrap with
    ``wrapper_cls(module, **wrapper_kwargs)`` (default: FullyShardedDataParallel)."""
    if wrapper_cls is None:
        from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel
        wrapper_cls = FullyShardedDataParallel
    if not callable(wrapper_cls):
        raise ValueError(f"enable_wrap(wrapper_cls={wrapper_cls!r}): expected a wrapper class")
    _wrap_contexts.append((wrapper_cls, dict(wrapper_kwargs)))
    try:
        yield
    finally:
        _wrap_contexts.pop()


def _current_wrapper(overrides: dict) -> Optional[tuple[type, dict]]:
    if not _wrap_contexts:
        return None
    cls, kwargs = _wrap_contexts[-1]
    return cls, {**kwargs, **overrides}


def wrap(module: nn.Module, **wrap_overrides) -> nn.Module:
    """Inside :func:`enable_wrap`, wrap ``module`` (overrides beat the context's kwargs);
    outside, return it unchanged (FairScale semantics)."""
    current = _current_wrapper(wrap_overrides)
    if current is None:
        return module
    cls, kwargs = current
    return cls(module, **kwargs)


def auto_wrap(module: nn.Module, auto_wrap_policy: Optional[Callable] = None,
              **wrapper_kwargs) -> nn.Module:
    """Wrap, bottom-up, every submodule the policy selects (not ``module`` itself: wrap the
    root yourself). Uses the :func:`enable_wrap` context's wrapper, or FullyShardedDataParallel
    with ``wrapper_kwargs`` outside one. Default policy: :func:`default_auto_wrap_policy`."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"auto_wrap(module={type(module).__name__}): expected an nn.Module")
    policy = auto_wrap_policy or default_auto_wrap_policy
    if not callable(policy):
        raise ValueError(f"auto_wrap(auto_wrap_policy={policy!r}): expected a callable "
                         f"policy(module=, recurse=, unwrapped_params=)")
    current = _current_wrapper(wrapper_kwargs)
    if current is None:
        from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel
        current = (FullyShardedDataParallel, dict(wrapper_kwargs))
    wrapper_cls, kwargs = current
    wrapped, _ = _recursive_wrap(module, _policy_caller(policy), wrapper_cls, kwargs,
                                 is_root=True)
    return wrapped


def _policy_caller(policy: Callable) -> Callable[[nn.Module, bool, int], bool]:
    """Call a policy with whichever keyword it names the parameter count by."""
    try:
        params = inspect.signature(policy).parameters
    except (TypeError, ValueError):
        params = {}
    accepts_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    key = "nonwrapped_numel" if "nonwrapped_numel" in params and \
        "unwrapped_params" not in params and not accepts_kwargs else "unwrapped_params"
    return lambda m, recurse, numel: bool(policy(module=m, recurse=recurse, **{key: numel}))


def _recursive_wrap(module: nn.Module, policy, wrapper_cls, kwargs, is_root: bool):
    """Returns (module or its wrapper, number of its parameters now inside wrappers)."""
    if isinstance(module, wrapper_cls):
        return module, 0
    total = sum(p.numel() for p in module.parameters())
    if not policy(module, True, total):
        return module, 0
    wrapped_numel = 0
    for name, child in list(module.named_children()):
        new_child, numel = _recursive_wrap(child, policy, wrapper_cls, kwargs, is_root=False)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped_numel += numel
    if not is_root and policy(module, False, total - wrapped_numel):
        return wrapper_cls(module, **kwargs), total
    return module, wrapped_numel
