"""torch's ``SyncBatchNorm`` on the CPU, under ShardedDataParallel and FSDP.

torch's ``SyncBatchNorm`` synchronises its statistics for CUDA/XPU (or PrivateUse1) inputs only:
its training forward raises on CPU tensors, even with one rank (torch DDP refuses such a module
when it wraps it). In eval mode it is a plain batch norm and runs anywhere. The wrappers refuse
one in training mode when they wrap, and at each forward (one switched to training later),
before any collective, naming it, rather than failing inside torch after their all-gathers.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

__all__ = ["refuse_training_sync_batchnorm", "sync_batchnorm_layers"]


def refuse_training_sync_batchnorm(named_modules: Iterable[tuple[str, nn.Module]], wrapper: str,
                                   compute_device: torch.device) -> None:
    """A ValueError naming the first ``torch.nn.SyncBatchNorm`` of ``named_modules`` that is in
    training mode, when the wrapper computes on the CPU (``compute_device``). Local."""
    if compute_device.type != "cpu":
        return
    for name, module in named_modules:
        if isinstance(module, nn.SyncBatchNorm) and module.training:
            raise ValueError(
                f"{wrapper}: {name or 'the wrapped module'} is a torch.nn.SyncBatchNorm in "
                f"training mode on the CPU, and torch's SyncBatchNorm only runs on CUDA/XPU "
                f"tensors in training (in eval mode it is a plain batch norm; torch DDP "
                f"refuses it on a CPU module). On the CPU keep the plain nn.BatchNorm layers "
                f"(leave out "
                f"SyncBatchNorm.convert_sync_batchnorm), keep this one in eval mode, or put "
                f"the module on its GPU before wrapping")


def sync_batchnorm_layers(holder: nn.Module, root: nn.Module) -> list:
    """The ``SyncBatchNorm`` layers under ``root`` (ignored modules included) by their names
    without FSDP's ``_fsdp_wrapped_module``, found once and kept on ``holder`` (the wrapper),
    for :func:`refuse_training_sync_batchnorm` at each forward. Local."""
    layers = holder.__dict__.get("_sync_batchnorm_layers")
    if layers is None:
        layers = [(".".join(p for p in name.split(".") if p != "_fsdp_wrapped_module"), m)
                  for name, m in root.named_modules() if isinstance(m, nn.SyncBatchNorm)]
        holder.__dict__["_sync_batchnorm_layers"] = layers
    return layers
