"""Normalisation layers under the data-parallel wrappers, on CPU/gloo.

BatchNorm (running statistics, ``broadcast_buffers``, eval switches), GroupNorm/LayerNorm and
CPU autocast under ShardedDataParallel + OSS, torch DDP + OSS and FSDP are compared with torch
DDP step by step in ``tests/nn/test_fairscale_fsdp_state_suite.py``,
``tests/optim/test_oss_matrix.py`` and ``tests/optim/test_amp_matrix.py``. This module holds
what those grids do not: torch's ``SyncBatchNorm`` trains on CUDA/XPU tensors only (its
training forward raises on CPU tensors, even with one rank, and torch DDP refuses it on a CPU
module at wrap time), so ShardedDataParallel and a FSDP unit computing on the CPU refuse it
when they wrap, on every rank, naming the layer, before any collective.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import world_fixture

world2 = world_fixture(2)


def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                         nn.BatchNorm2d(c_out), nn.ReLU())


def _cnn(sync: bool) -> nn.Module:
    """A tiny ResNet-like CNN: two conv + BatchNorm blocks and a linear head."""
    torch.manual_seed(0)
    model = nn.Sequential(_block(3, 4), _block(4, 4), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 3))
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync else model


def _wrap_sdp(model):
    return ShardedDataParallel(model, OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1))


def _wrap_fsdp_blocks(model):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))


def _wrap_fsdp_bn_units(model):
    from shardkit.nn.wrap import auto_wrap_bn
    return FSDP(auto_wrap_bn(model))


def _initialize(stage: int):
    def wrap(model):
        import shardkit
        config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 2,
                  "steps_per_print": 10 ** 6, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        return shardkit.initialize(model=model, config=config)[0]
    return wrap


WRAPPERS = {
    "sdp": (_wrap_sdp, "ShardedDataParallel(module=...): 0.1 is a torch.nn.SyncBatchNorm"),
    "fsdp": (FSDP, "FullyShardedDataParallel: 0.1 is a torch.nn.SyncBatchNorm"),
    "fsdp_offload": (lambda m: FSDP(m, move_params_to_cpu=True),
                     "FullyShardedDataParallel: 0.1 is a torch.nn.SyncBatchNorm"),
    "fsdp_blocks": (_wrap_fsdp_blocks, "FullyShardedDataParallel: 1 is a torch.nn."),
    "fsdp_bn_units": (_wrap_fsdp_bn_units,
                      "FullyShardedDataParallel: the wrapped module is a torch.nn.SyncBatchNorm"),
    "initialize_stage2": (_initialize(2), "0.1 is a torch.nn.SyncBatchNorm"),
    "initialize_stage3": (_initialize(3), "is a torch.nn.SyncBatchNorm"),
}


def _sync_batchnorm_at_wrap_time():
    """Each wrapper around a CPU model holding SyncBatchNorm: the error it raises (or the one
    the first training step raises if it wrapped), then one training step of each wrapper
    with plain BatchNorm, which pairs its collectives only if no rank was left inside one."""
    errors = {}
    for name, (wrap, _) in WRAPPERS.items():
        try:
            wrapped = wrap(_cnn(sync=True))
        except ValueError as error:
            errors[name] = ("at wrap", str(error))
            continue
        try:  # the old behaviour: torch's error at the first training forward
            wrapped(torch.randn(2, 3, 6, 6)).sum().backward()
            errors[name] = ("trained", "")
        except ValueError as error:
            errors[name] = ("at forward", str(error))
    rank = skdist.get_rank()
    trained = {}
    for name, (wrap, _) in WRAPPERS.items():
        model = wrap(_cnn(sync=False))
        x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(rank))
        F.cross_entropy(model(x), torch.tensor([0, 2])).backward()
        trained[name] = all(torch.isfinite(p.grad).all() for p in model.parameters()
                            if p.grad is not None)
    return errors, trained


def test_sync_batchnorm_on_cpu_is_refused_at_wrap_time(world2):
    """Regression: ShardedDataParallel and FSDP wrapped a CPU model holding torch's
    SyncBatchNorm, and its first training forward failed inside torch ("SyncBatchNorm expected
    input tensor to be on GPU or XPU", under FSDP after the unit's all-gather); torch DDP
    refuses such a module when it wraps it. Now every rank raises a ValueError naming the
    layer at wrap time (shardkit.initialize at stages 2 and 3 too), and the world goes on."""
    for rank, (errors, trained) in enumerate(world2.run(_sync_batchnorm_at_wrap_time)):
        for name, (_, expected) in WRAPPERS.items():
            when, message = errors[name]
            assert when == "at wrap", (rank, name, when, message)
            assert expected in message, (rank, name, message)
            for part in ("CPU", "CUDA/XPU", "nn.BatchNorm", "convert_sync_batchnorm"):
                assert part in message, (rank, name, part, message)
            assert trained[name], (rank, name)


def _eval_only_sync_batchnorm():
    """A frozen SyncBatchNorm backbone kept in eval mode (torch's plain batch norm on the CPU)
    trains under every wrapper; one switched to training after wrapping is refused at the
    forward, naming it, before any collective."""
    out = {}
    for name, (wrap, _) in WRAPPERS.items():
        model = _cnn(sync=True)
        backbone = nn.Sequential(model[0], model[1])
        backbone.requires_grad_(False)
        model.eval()
        model[4].train()
        wrapped = wrap(model)
        wrapped(torch.randn(2, 3, 6, 6)).sum().backward()
        backbone[1][1].train()
        try:
            wrapped(torch.randn(2, 3, 6, 6))
            out[name] = "trained"
        except ValueError as error:
            out[name] = str(error)
    return out


def test_eval_only_sync_batchnorm_is_accepted(world2):
    for out in world2.run(_eval_only_sync_batchnorm):
        for name, message in out.items():
            assert "1.1 is a torch.nn.SyncBatchNorm in training mode" in message, (name, message)
