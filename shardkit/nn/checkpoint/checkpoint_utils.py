"""FairScale's ``fairscale.nn.checkpoint.checkpoint_utils`` path: :func:`patch_batchnorm`.

:func:`~shardkit.nn.checkpoint.checkpoint_wrapper` does not need it (its first forward runs
with grad enabled and it restores BatchNorm statistics after the recomputation itself). It is
for hand-written checkpoint functions in FairScale's style (Megatron's, torch's reentrant
``checkpoint``) that run the first forward under ``torch.no_grad()`` and recompute it with
grad enabled: patched, a BatchNorm updates its running statistics only in the forward that
runs with grad, so once per step.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

__all__ = ["patch_batchnorm"]


def _stop_tracking_without_grad(bn: _BatchNorm, inputs) -> None:
    if hasattr(bn, "_track_running_stats_backup"):
        # a second patch's hook in this forward (the first one saved the flag), or a
        # forward that raised before _resume_tracking ran: never save False over the flag
        if not torch.is_grad_enabled():
            return
        bn.track_running_stats = bn._track_running_stats_backup
        del bn._track_running_stats_backup
        return
    if torch.is_grad_enabled():
        return
    bn._track_running_stats_backup = bn.track_running_stats
    bn.track_running_stats = False


def _resume_tracking(bn: _BatchNorm, inputs, output) -> None:
    if torch.is_grad_enabled() or not hasattr(bn, "_track_running_stats_backup"):
        return
    bn.track_running_stats = bn._track_running_stats_backup
    del bn._track_running_stats_backup


def patch_batchnorm(module: nn.Module) -> list[RemovableHandle]:
    """Make every BatchNorm under ``module`` (any ``_BatchNorm`` subclass, SyncBatchNorm
    included) leave its running statistics alone in a training-mode forward run without grad,
    as FairScale's function does; one that has a ``disable_patch_batchnorm`` attribute is
    skipped. Returns the hook handles (``handle.remove()`` undoes the patch).

    Note: in training mode such a forward then normalises with the batch statistics and
    updates nothing, so a plain ``torch.no_grad()`` forward of a patched model in training mode
    no longer moves the statistics either; in eval mode nothing changes.

    Costs two hooks per BatchNorm; no memory or communication.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"patch_batchnorm(module={type(module).__name__}): expected a "
                        f"torch.nn.Module")
    handles = []
    for m in module.modules():
        if isinstance(m, _BatchNorm) and not hasattr(m, "disable_patch_batchnorm"):
            handles.append(m.register_forward_pre_hook(_stop_tracking_without_grad))
            handles.append(m.register_forward_hook(_resume_tracking))
    return handles
