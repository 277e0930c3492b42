"""Choose which submodules become their own wrapped units: FairScale's ``enable_wrap`` /
``wrap`` / ``auto_wrap`` and the policies they read (implemented in
:mod:`shardkit.nn.wrap.auto_wrap`, FairScale's module path, so both
``from shardkit.nn.wrap import auto_wrap`` and ``from shardkit.nn.wrap.auto_wrap import
auto_wrap`` work)."""

import sys
import types

import torch.nn as nn

from shardkit.nn.wrap.auto_wrap import (auto_wrap, auto_wrap_bn, config_auto_wrap_policy,
                                        default_auto_wrap_policy, enable_wrap,
                                        no_split_module_classes, no_split_modules_policy,
                                        size_based_auto_wrap_policy, split_dtypes_policy,
                                        transformer_auto_wrap_policy, wrap)

__all__ = ["auto_wrap", "enable_wrap", "wrap", "default_auto_wrap_policy",
           "config_auto_wrap_policy", "transformer_auto_wrap_policy",
           "size_based_auto_wrap_policy", "no_split_modules_policy", "no_split_module_classes",
           "auto_wrap_bn", "split_dtypes_policy"]


class _CallableModule(types.ModuleType):
    """This package, callable as :func:`wrap`.

    ``from shardkit.nn import wrap`` (FairScale's spelling) finds the subpackage
    ``shardkit.nn.wrap`` rather than the function once the subpackage is imported, because
    Python binds a package attribute to each imported submodule. Calling the package calls
    :func:`wrap`, so that spelling works while ``shardkit.nn.wrap.<name>`` keeps working too.
    """

    def __call__(self, module: nn.Module, **wrap_overrides) -> nn.Module:
        return wrap(module, **wrap_overrides)


sys.modules[__name__].__class__ = _CallableModule
