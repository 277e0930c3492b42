"""ShardedDataParallel + OSS checkpoint round trip: save mid-training, load into freshly built
wrappers, and continue exactly as the uninterrupted run."""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import world_fixture


world2 = world_fixture(2)


def _make(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3))
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    return model, optimizer, ShardedDataParallel(model, optimizer, reduce_buffer_size=256)


def _train(wrapped, optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + skdist.get_rank())
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    optimizer.zero_grad()
    F.mse_loss(wrapped(x), y).backward()
    optimizer.step()


def _check_round_trip():
    reference, ref_opt, ref_wrapped = _make(seed=0)
    for step in range(6):
        _train(ref_wrapped, ref_opt, step)

    model, optimizer, wrapped = _make(seed=0)
    for step in range(3):
        _train(wrapped, optimizer, step)
    model_state = copy.deepcopy(wrapped.state_dict())
    optimizer.consolidate_state_dict(recipient_rank=-1)
    optimizer_state = copy.deepcopy(optimizer.state_dict())

    resumed_model, resumed_opt, resumed = _make(seed=123)  # other weights, fresh state
    resumed.load_state_dict(model_state)
    resumed_opt.load_state_dict(optimizer_state)
    for step in range(3, 6):
        _train(resumed, resumed_opt, step)
    diff = max((a - b).abs().max().item()
               for a, b in zip(reference.parameters(), resumed_model.parameters()))
    keys_prefixed = all(k.startswith("module.") for k in model_state)
    plain_keys = set(model.state_dict()) == {k.removeprefix("module.") for k in model_state}
    return diff, keys_prefixed, plain_keys


def test_checkpoint_round_trip_continues_exactly(world2):
    for diff, keys_prefixed, plain_keys in world2.run(_check_round_trip):
        assert diff <= 1e-6
        assert keys_prefixed and plain_keys
