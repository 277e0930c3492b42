"""Interleaved 1F1B, ZB-H1 and ZBV match single-process training step by step; memory; errors."""

import pytest
import torch
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.models import GPT, MLP, GPTConfig
from shardkit.nn.pipe import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                              ScheduleInterleaved1F1B, ScheduleZBV, ScheduleZeroBubble,
                              split_sequential)
from shardkit.recipes import gpt_as_sequential, token_cross_entropy
from shardkit.testing import world_fixture

BATCH, STEPS = 16, 2
GPT_CFG = GPTConfig(vocab_size=64, n_layer=6, n_head=2, d_model=16, seq_len=8)

world2 = world_fixture(2)
world4 = world_fixture(4)


def _gpt_layers():
    """The reference GPT as 9 layers: embeddings, 6 blocks, final norm, head."""
    return gpt_as_sequential(GPT(GPT_CFG, seed=0))


def _gpt_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, GPT_CFG.vocab_size, (BATCH, GPT_CFG.seq_len + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _mlp_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


MODELS = {
    "gpt": (_gpt_layers, _gpt_batch, token_cross_entropy),
    "mlp": (lambda: MLP(16, 8, out=4, seed=0), _mlp_batch, F.mse_loss),
}
# name -> (schedule class, stages per rank, placement)
SCHEDULES = {
    "1F1B": (Schedule1F1B, 1, "loop"),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2, "loop"),
    "ZeroBubble": (ScheduleZeroBubble, 1, "loop"),
    "ZBV": (ScheduleZBV, 2, "v"),
}


def _even(n, parts):
    return [n // parts + (1 if k < n % parts else 0) for k in range(parts)]


def _build(model_name, schedule_name, chunks, **kwargs):
    rank, world = dist.get_rank(), dist.get_world_size()
    make, _, loss_fn = MODELS[model_name]
    cls, per_rank, placement = SCHEDULES[schedule_name]
    num_stages = world * per_rank
    layers = make()
    parts = split_sequential(layers, _even(len(layers), num_stages))
    mine = [s for s in range(num_stages) if _owner(s, world, placement) == rank]
    stages = [PipelineStage(parts[s], s, num_stages, placement=placement) for s in mine]
    arg = stages[0] if cls in (Schedule1F1B, ScheduleGPipe) else stages
    return cls(arg, chunks, loss_fn, **kwargs), stages


def _owner(stage, world, placement):
    if placement == "v" and stage >= world:
        return 2 * world - 1 - stage
    return stage % world


def _check_parity(model_name, schedule_name, chunks, rows=BATCH):
    """Per step: max |grad - reference grad| and max |weight - reference weight| over this
    rank's parameters, and the loss difference on the rank running the last stage (on the
    first ``rows`` samples of each batch)."""
    make, batch, loss_fn = MODELS[model_name]
    reference = make()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_params = dict(reference.named_parameters())
    schedule, stages = _build(model_name, schedule_name, chunks)
    params = [(n, p) for st in stages for n, p in st.module.named_parameters()]
    opt = torch.optim.SGD([p for _, p in params], lr=0.1)
    grad_diff = weight_diff = loss_diff = 0.0
    for step in range(STEPS):
        x, y = (t[:rows] for t in batch(step))
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        opt.zero_grad()
        loss = schedule.step(x, target=y)
        grad_diff = max([grad_diff] + [(p.grad - ref_params[n].grad).abs().max().item()
                                       for n, p in params])
        ref_opt.step()
        opt.step()
        weight_diff = max([weight_diff] + [(p - ref_params[n]).abs().max().item()
                                           for n, p in params])
        if loss is not None:
            loss_diff = max(loss_diff, abs(loss.item() - ref_loss.item()))
    return grad_diff, weight_diff, loss_diff


def _parity_grid():
    p = dist.get_world_size()
    grid = {(model, schedule, m): _check_parity(model, schedule, m)
            for model in MODELS for schedule in SCHEDULES for m in (p, 2 * p, 4 * p)}
    # interleaved 1F1B with chunks that are not a multiple of the ranks: rounds of m / (m // p)
    # micro-batches (fewer chunks than ranks: one round of m)
    for m in {2: (1, 3), 4: (2, 3, 6)}[p]:
        grid[("mlp", "Interleaved1F1B", m)] = _check_parity("mlp", "Interleaved1F1B", m, rows=12)
    return grid


@pytest.mark.parametrize("world_name", ["world2", "world4"])
def test_every_schedule_matches_single_process_training(world_name, request):
    results = request.getfixturevalue(world_name).run(_parity_grid)
    for rank, grid in enumerate(results):
        for key, (grad_diff, weight_diff, loss_diff) in grid.items():
            assert grad_diff <= 1e-5, (rank, key, grad_diff)
            assert weight_diff <= 1e-5, (rank, key, weight_diff)
            assert loss_diff <= 1e-5, (rank, key, loss_diff)


def _mean_loss(output, _target):
    return output.mean()  # saves nothing: the bytes measured are the layers' activations


def _memory(schedule_name, chunks=8, rows=64):
    """Peak bytes saved for backward on this rank, peak live (stage, micro-batch) pairs, and
    bytes still saved after the step, for one step of a 32-wide MLP."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layers = MLP(32, 8, seed=0)
    if schedule_name == "GPipe":
        stage = PipelineStage(split_sequential(layers, _even(16, world))[rank], rank, world)
        schedule = ScheduleGPipe(stage, chunks, _mean_loss, track_activation_memory=True,
                                 batch_weight_grads=False)
    else:
        cls, per_rank, placement = SCHEDULES[schedule_name]
        parts = split_sequential(layers, _even(16, world * per_rank))
        stages = [PipelineStage(parts[s], s, world * per_rank, placement=placement)
                  for s in range(world * per_rank) if _owner(s, world, placement) == rank]
        schedule = cls(stages[0] if per_rank == 1 and cls is Schedule1F1B else stages, chunks,
                       _mean_loss, track_activation_memory=True)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(rows, 32, generator=g), torch.randn(rows, 32, generator=g)
    for _ in range(2):  # the second step runs on cached shapes
        schedule.step(x, target=y)
    meter = schedule.activation_memory
    return meter.peak_bytes, schedule.peak_live_microbatches, meter.current_bytes


def _memory_grid():
    return {name: _memory(name) for name in ("GPipe", *SCHEDULES)}


def test_activation_memory_stays_within_each_schedules_bound(world2):
    p, m, v = 2, 8, 2
    results = world2.run(_memory_grid)
    for rank, r in enumerate(results):
        per_microbatch = r["GPipe"][0] / m  # GPipe holds all m micro-batches of the stage
        assert r["GPipe"][1] == m
        for name, (peak, live, left) in r.items():
            assert left == 0, (name, rank)  # everything released by the end of the step
        assert r["1F1B"][1] == p - rank
        assert r["ZeroBubble"][1] <= p  # at most p micro-batches, like 1F1B's first stage
        assert r["ZeroBubble"][0] <= p * per_microbatch * 1.01, (rank, r)
        assert r["Interleaved1F1B"][1] <= (v - 1) * p + 2 * (p - 1 - rank) + 1
        assert r["ZBV"][1] <= 2 * p  # half-size stages
    one_f_one_b_peak = max(r["1F1B"][0] for r in results)
    assert max(r["ZBV"][0] for r in results) <= one_f_one_b_peak * 1.01


def _bad_inputs():
    rank, world = dist.get_rank(), dist.get_world_size()
    messages = []
    schedule, _ = _build("mlp", "ZeroBubble", 4)
    x, y = _mlp_batch(0)
    try:
        schedule.step(x[:3], target=y[:3])  # fewer rows than chunks (10 would be split)
        messages.append("no error")
    except ValueError as error:
        messages.append(str(error))
    loss = schedule.step(x, target=y)  # nothing was half-sent: the pipeline still works
    messages.append(loss is not None)
    try:
        _build("mlp", "Interleaved1F1B", 5)
        messages.append("no error")
    except ValueError as error:
        messages.append(str(error))
    parts = split_sequential(MLP(16, 8, out=4, seed=0), _even(17, 2 * world))
    looped = [PipelineStage(parts[s], s, 2 * world) for s in (rank, rank + world)]
    try:
        ScheduleZBV(looped, 2, F.mse_loss).step(x, target=y)
        messages.append("no error")
    except ValueError as error:
        messages.append(str(error))
    try:
        Schedule1F1B(looped[0], 2, F.mse_loss)
        messages.append("no error")
    except ValueError as error:
        messages.append(str(error))
    from shardkit.nn.checkpoint import checkpoint_wrapper
    from shardkit.nn.data_parallel import FullyShardedDataParallel

    alone = [dist.new_group([r]) for r in range(world)][rank]
    part = split_sequential(MLP(16, 8, out=4, seed=0), _even(17, world))[rank]
    part[0] = checkpoint_wrapper(part[0])
    stage = PipelineStage(FullyShardedDataParallel(part, process_group=alone), rank, world)
    try:
        ScheduleZeroBubble(stage, 2, F.mse_loss).step(x, target=y)
        messages.append("no error")
    except ValueError as error:
        messages.append(str(error))
    mixed = split_sequential(MLP(16, 8, out=4, seed=0), _even(17, world))[rank]
    mixed[0] = FullyShardedDataParallel(mixed[0], process_group=alone)
    try:
        ScheduleZeroBubble(PipelineStage(mixed, rank, world), 2, F.mse_loss).step(x, target=y)
        messages.append("no error")
    except ValueError as error:
        messages.append(str(error))
    return messages


def test_bad_input_raises_a_clear_error_on_every_rank(world2):
    uneven, works, interleaved, zbv, one_stage, fsdp, mixed = zip(*world2.run(_bad_inputs))
    assert all("rank 0: chunks=4 is larger than the batch size 3" in m for m in uneven)
    assert all("rank 1: target of shape (3, 4) cannot be split into chunks=4 micro-batches" in m
               for m in uneven)
    assert works == (False, True)
    assert all("chunks=5 on ranks=2 gives 2 rounds, which do not divide the chunks; use "
               "chunks=4 or 6" in m for m in interleaved)
    assert all("rank 0: this rank must pass stages [0, 3] (the plan's placement), got [0, 2]"
               in m for m in zbv)
    assert all("runs one stage per rank, but the pipeline has 4 stages on 2 ranks" in m
               for m in one_stage)
    assert all("rank 1: stage 1 is wrapped in FullyShardedDataParallel and holds a "
               "checkpoint_wrapper module" in m for m in fsdp)
    assert all("rank 0: stage 0 holds FullyShardedDataParallel units and 8 trainable "
               "parameters outside them (e.g. '2.weight')" in m for m in mixed)


def _hooks_fire_once_per_step():
    schedule, stages = _build("mlp", "ZeroBubble", 4)
    fired = []
    for p in stages[0].module.parameters():
        p.register_post_accumulate_grad_hook(lambda param: fired.append(param))
    x, y = _mlp_batch(0)
    schedule.step(x, target=y)
    reference = MLP(16, 8, out=4, seed=0)
    F.mse_loss(reference(x), y).backward()
    ref = split_sequential(reference, _even(17, dist.get_world_size()))[dist.get_rank()]
    diff = max((a.grad - b.grad).abs().max().item()
               for a, b in zip(stages[0].module.parameters(), ref.parameters()))
    count = sum(1 for _ in stages[0].module.parameters())
    return len(fired), len({id(p) for p in fired}), count, diff


def test_zero_bubble_fires_gradient_hooks_once_per_parameter_per_step(world2):
    for fired, distinct, count, diff in world2.run(_hooks_fire_once_per_step):
        assert fired == distinct == count  # 4 micro-batches, one call per parameter
        assert diff <= 1e-6


def _zero_bubble_under_sharded_ddp(schedule_name):
    """2 stages x 2 data-parallel replicas: each stage wrapped in ShardedDDP + OSS over its
    replica group; each pipeline trains on half the batch. Parity with one process, per step."""
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS

    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipeline, stage_index = rank // 2, rank % 2
    reference = MLP(16, 8, out=4, seed=0)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_part = split_sequential(reference, _even(17, 2))[stage_index]
    part = split_sequential(MLP(16, 8, out=4, seed=0), _even(17, 2))[stage_index]
    opt = OSS(part.parameters(), optim=torch.optim.SGD, group=replicas[stage_index], lr=0.1)
    module = ShardedDataParallel(part, opt, process_group=replicas[stage_index])
    stage = PipelineStage(module, stage_index, 2, group=pipelines[pipeline])
    schedule = SCHEDULES[schedule_name][0](stage, 4, F.mse_loss)
    half = slice(pipeline * BATCH // 2, (pipeline + 1) * BATCH // 2)
    worst = 0.0
    for step in range(STEPS):
        x, y = _mlp_batch(step)
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        schedule.step(x[half], target=y[half])
        opt.step()
        worst = max([worst] + [(a - b).abs().max().item()
                               for a, b in zip(part.parameters(), ref_part.parameters())])
    return worst


def test_zero_bubble_composes_with_sharded_ddp_on_the_stage_replicas(world4):
    for name in ("ZeroBubble", "1F1B"):
        for rank, worst in enumerate(world4.run(_zero_bubble_under_sharded_ddp, name)):
            assert worst <= 1e-5, (name, rank, worst)


def _zbv_replanned():
    """ZBV re-plans from measured costs at its third step: the new lists are well formed, keep
    the live bound and still match one process, step by step."""
    reference = MLP(16, 8, out=4, seed=0)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_params = dict(reference.named_parameters())
    schedule, stages = _build("mlp", "ZBV", 8)
    first = schedule.plan
    params = [(n, p) for st in stages for n, p in st.module.named_parameters()]
    opt = torch.optim.SGD([p for _, p in params], lr=0.1)
    worst = 0.0
    for step in range(4):
        x, y = _mlp_batch(step)
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        schedule.step(x, target=y)
        opt.step()
        worst = max([worst] + [(p - ref_params[n]).abs().max().item() for n, p in params])
    return (worst, schedule.plan is not first, schedule.plan.problems(),
            schedule.peak_live_microbatches, sorted(schedule.action_seconds))


def test_zbv_replans_from_measured_costs_and_still_matches(world2):
    for worst, replanned, problems, live, kinds in world2.run(_zbv_replanned):
        assert worst <= 1e-5 and replanned and problems == [] and kinds == ["B", "F", "W"]
        assert live <= 2 * 2  # 2p half-size stage-micro-batches
