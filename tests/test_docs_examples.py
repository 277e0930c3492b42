"""The README's Python blocks, run as a user copies them (2 ranks), match single-process torch.

One World for the module; each body follows its README block line by line, with a tiny model and
data standing in for ``model`` and ``data``."""

import copy
import os

import pytest
import torch
import torch.nn as nn

from shardkit.testing import world_fixture

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

world2 = world_fixture(2)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _global_batches(steps=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g))
            for _ in range(steps)]


def _my_share(batches):
    from shardkit import distributed
    rank, n = distributed.get_rank(), distributed.get_world_size()
    return [(x.chunk(n)[rank], y.chunk(n)[rank]) for x, y in batches]


def _trained_alone(model, batches, optimizer_cls, lr):
    opt = optimizer_cls(model.parameters(), lr=lr)
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _worst(state, reference):
    return max((state[k] - v).abs().max().item() for k, v in reference.items())


def _fairscale_block():
    from shardkit.optim import OSS
    from shardkit.nn.data_parallel import ShardedDataParallel as ShardedDDP
    model, loss_fn, batches = _mlp(), nn.functional.mse_loss, _global_batches()
    reference = _trained_alone(copy.deepcopy(model), batches, torch.optim.AdamW, 1e-3)

    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)   # ZeRO-1
    model = ShardedDDP(model, optimizer)                                     # ZeRO-2
    for x, y in _my_share(batches):
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return _worst(model.module.state_dict(), reference)


def _fsdp_block():
    from shardkit.models import GPT, GPTConfig, Block
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
    cfg = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=16, seq_len=8)
    model = GPT(cfg)
    alone = copy.deepcopy(model)
    alone_opt = torch.optim.SGD(alone.parameters(), lr=0.1)

    with enable_wrap(wrapper_cls=FSDP, mixed_precision=False):
        model = auto_wrap(model, auto_wrap_policy=transformer_auto_wrap_policy({Block}))
    model = FSDP(model)                       # the root unit
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)   # built after wrapping

    idx = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(2))
    target = torch.roll(idx, -1, 1)
    (mine_idx, mine_target), = _my_share([(idx, target)])
    for _ in range(2):
        model.loss(mine_idx, mine_target).backward()
        optimizer.step()
        optimizer.zero_grad()
        alone.loss(idx, target).backward()
        alone_opt.step()
        alone_opt.zero_grad()
    return _worst(model.state_dict(), alone.state_dict())


def _deepspeed_block():
    import shardkit
    model, loss_fn = _mlp(), nn.functional.mse_loss
    config = os.path.join(EXAMPLES, "ds_config.json")  # the README's "ds_config.json"
    engine, optimizer, _, scheduler = shardkit.initialize(model=model, config=config)
    for x, y in _my_share(_global_batches(4)):
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
    return engine.global_steps, type(scheduler).__name__


def _pipeline_block():
    from shardkit import distributed
    from shardkit.nn.pipe import PipelineStage, Schedule1F1B, split_sequential
    rank, n = distributed.get_rank(), distributed.get_world_size()
    model, loss_fn, batches = _mlp(), nn.functional.mse_loss, _global_batches()
    reference = _trained_alone(copy.deepcopy(model), batches, torch.optim.SGD, 0.1)

    stage = PipelineStage(split_sequential(model, [2, 1])[rank], rank, n)
    schedule = Schedule1F1B(stage, 4, loss_fn)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    for x, y in batches:
        schedule.step(x, target=y)
        optimizer.step()
        optimizer.zero_grad()
    return _worst({k: v for k, v in model.state_dict().items() if k in stage_keys(rank)},
                  {k: v for k, v in reference.items() if k in stage_keys(rank)})


def stage_keys(rank):
    return {0: {"0.weight", "0.bias"}, 1: {"2.weight", "2.bias"}}[rank]


@pytest.mark.parametrize("block", [_fairscale_block, _fsdp_block, _pipeline_block])
def test_readme_block_matches_single_process_training(world2, block):
    assert max(world2.run(block)) < 1e-6


def test_readme_deepspeed_block_runs_with_the_example_config(world2):
    # 4 micro-batches of 4 per rank, 2 accumulated per step: 2 optimizer steps
    assert world2.run(_deepspeed_block) == [(2, "WarmupDecayLR")] * 2
