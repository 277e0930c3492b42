"""ShardedDataParallel and OSS at world 2: a forward rank 0 runs alone, and torch's GradScaler
whose private record OSS cannot find.

Regressions:

- With a module holding buffers (BatchNorm) and ``broadcast_buffers=True``, a forward rank 0
  ran alone after a step (a sample in training mode under ``torch.no_grad()``, a validation
  pass in evaluation mode) hung: the first forward after a reducing backward broadcast the
  buffers, a collective the other ranks never joined (torch DDP and FairScale's ShardedDDP do
  the same). The buffers now travel at the end of the reducing backward and the next forward
  takes them locally: training matches one process step by step, and every rank still
  evaluates with rank 0's statistics.
- OSS writes what every rank agreed about inf/nan into the record of the calling
  ``torch.amp.GradScaler.step``, found by torch's private names. Under a torch that names it
  otherwise, a rank owning no gradient recorded no inf check and its ``update()`` alone
  raised (the other rank went on). Now every rank raises the same RuntimeError naming
  ShardedGradScaler before stepping, and ShardedGradScaler, which needs no such record,
  still trains as one process does.

From a review:

ShardedDataParallel's ``broadcast_buffers`` against torch DDP (gloo) at world 2, around the
end-of-backward broadcast (review of 64eaae0).

Regressions:

- Rank 0's buffers received at the end of a reducing backward were held aside and written at
  the next forward only into buffers not written since. What every rank did to its buffers in
  between therefore started from its own statistics: after ``ddp.double()`` (a cast replaces
  the buffers) or a write relative to the current value (``running_mean.mul_(0.5)``), ranks
  other than 0 evaluated with their own statistics, where torch DDP (and the code before) used
  rank 0's; ``state_dict()`` on rank 1 after the last backward held rank 1's. The buffers are now
  overwritten with rank 0's at the end of the reducing backward, version counters kept (as
  torch DDP's broadcast), so a retained graph still backwards.
- An evaluation-mode forward after a training forward of the same step (before their
  backward) took nothing: ranks other than 0 ran it with their own statistics, so the
  gradients, and the parameters after the step, differed from torch DDP's. Such a forward
  broadcasts again, as torch DDP's.
"""

import inspect
import re
import textwrap

import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world2 = world_fixture(2)

STEPS = 3


def _batchnorm_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _batch(step: int, world: int) -> torch.Tensor:
    return torch.randn(4 * world, 4, generator=torch.Generator().manual_seed(step))


def _lone_input(step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 + step)) * 3


def _rank0_alone(model: nn.Module, step: int) -> None:
    """What rank 0 alone runs after a step: a sample in training mode without grad (it moves
    the running statistics), then an evaluation pass with grad enabled."""
    with torch.no_grad():
        model(_lone_input(step))
    model.eval()
    model(_lone_input(step)).sum().item()
    model.train()


def _one_process(world: int) -> dict:
    """The oracle: each rank's micro-batch in turn, gradients averaged; the buffers follow
    rank 0's path (its micro-batches and its lone forwards)."""
    model = _batchnorm_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = []
    for step in range(STEPS):
        x = _batch(step, world)
        start = [b.clone() for b in model.buffers()]
        rank0_after = None
        for r, chunk in enumerate(x.chunk(world)):
            with torch.no_grad():
                for b, s in zip(model.buffers(), start):
                    b.copy_(s)
            (model(chunk).square().mean() / world).backward()
            rank0_after = rank0_after or [b.clone() for b in model.buffers()]
        with torch.no_grad():
            for b, s in zip(model.buffers(), rank0_after):
                b.copy_(s)
        optimizer.step()
        optimizer.zero_grad()
        _rank0_alone(model, step)
        params.append([p.detach().clone() for p in model.parameters()])
    model.eval()
    with torch.no_grad():
        evaluated = model(_lone_input(-1))
    return dict(params=params, buffers=[b.clone() for b in model.buffers()],
                evaluated=evaluated)


def _check_rank0_forwards_alone():
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS

    rank, world = skdist.get_rank(), skdist.get_world_size()
    oracle = _one_process(world)
    model = _batchnorm_net()
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    ddp = ShardedDataParallel(model, optimizer, broadcast_buffers=True)
    param_errors = []
    for step in range(STEPS):
        ddp(_batch(step, world).chunk(world)[rank]).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            _rank0_alone(ddp, step)
        param_errors.append(max((p - q).abs().max().item() for p, q in
                                zip(model.parameters(), oracle["params"][step])))
    rank0_buffer_error = max((b - q).abs().max().item()
                             for b, q in zip(model.buffers(), oracle["buffers"]))
    # every rank together, after a reducing backward: every rank evaluates with rank 0's
    # statistics, its lone forwards' included
    ddp(_batch(STEPS, world).chunk(world)[rank]).square().mean().backward()
    optimizer.zero_grad()
    expected_statistics = [b.clone() for b in model.buffers()]
    ddp.eval()
    with torch.no_grad():
        ddp(_lone_input(-1))
    taken = skdist.all_gather_object([b.clone() for b in model.buffers()])
    # a checkpoint every rank loads between backward and forward is what every rank uses
    ddp.train()
    ddp(_batch(STEPS, world).chunk(world)[rank]).square().mean().backward()
    checkpoint = _batchnorm_net().state_dict()
    ddp.module.load_state_dict(checkpoint)
    ddp.eval()
    with torch.no_grad():
        ddp(_lone_input(-1))
    return dict(param_errors=param_errors, rank0_buffer_error=rank0_buffer_error,
                same_statistics=all(torch.equal(a, b) for a, b in zip(*taken)),
                rank0_statistics_taken=all(torch.equal(a, b) for a, b in
                                           zip(taken[0], expected_statistics)) or rank != 0,
                loaded_kept=all(torch.equal(b, checkpoint[name])
                                for name, b in model.named_buffers()))


def test_a_forward_rank0_runs_alone_does_not_hang_and_training_matches(world2):
    for rank, result in enumerate(world2.run(_check_rank0_forwards_alone)):
        assert max(result["param_errors"]) < 1e-5, (rank, result["param_errors"])
        assert result["same_statistics"] and result["rank0_statistics_taken"], (rank, result)
        assert result["loaded_kept"], (rank, result)
        if rank == 0:
            assert result["rank0_buffer_error"] < 1e-5, result


def _step_with_renamed_record():
    """torch.amp.GradScaler.step as this torch has it, its per-optimizer record renamed: what
    a torch release that renames that private local would look like to OSS."""
    source = textwrap.dedent(inspect.getsource(torch.amp.GradScaler.step))
    namespace = dict(vars(inspect.getmodule(torch.amp.GradScaler)))
    exec(compile(re.sub(r"\boptimizer_state\b", "per_optimizer_record", source),
                 "<renamed GradScaler.step>", "exec"), namespace)
    return namespace["step"]


def _scaled_steps(model, optimizer, scaler, world, rank, reference=False):
    for step in range(2):
        x = _batch(step, world)
        chunks = [x] if reference else [x.chunk(world)[rank]]
        scaler.scale(model(chunks[0]).square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def _check_torch_scaler_record_renamed():
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS, ShardedGradScaler

    rank, world = skdist.get_rank(), skdist.get_world_size()
    original = torch.amp.GradScaler.step
    torch.amp.GradScaler.step = _step_with_renamed_record()
    try:
        # one parameter: rank 1 owns no gradient, so torch's scaler records no check there
        torch.manual_seed(0)
        model = nn.Linear(4, 1, bias=False)
        before = model.weight.detach().clone()
        optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        ddp = ShardedDataParallel(model, optimizer)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        scaler.scale(ddp(_batch(0, world).chunk(world)[rank]).sum()).backward()
        try:
            scaler.step(optimizer)
            scaler.update()
            refusal = None
        except (RuntimeError, AssertionError) as e:
            refusal = f"{type(e).__name__}: {e}"
        unchanged = torch.equal(model.weight, before)
        optimizer.zero_grad()

        torch.manual_seed(0)
        reference = nn.Linear(4, 1, bias=False)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        _scaled_steps(reference, reference_optimizer,
                      torch.amp.GradScaler("cpu", init_scale=2.0 ** 8), world, rank, True)
        sharded_scaler = ShardedGradScaler("cpu", init_scale=2.0 ** 8)
        _scaled_steps(ddp, optimizer, sharded_scaler, world, rank)
        error = (model.weight - reference.weight).abs().max().item()
    finally:
        torch.amp.GradScaler.step = original
    return dict(refusal=refusal, unchanged=unchanged, error=error,
                scale=sharded_scaler.get_scale())


def test_torch_scaler_whose_record_oss_cannot_find_is_refused_on_every_rank(world2):
    results = world2.run(_check_torch_scaler_record_renamed)
    for result in results:
        assert result["refusal"] is not None and result["refusal"].startswith(
            "RuntimeError: OSS.step: torch.amp.GradScaler.step is stepping this OSS, but this "
            "torch"), result
        assert "per_optimizer" not in result["refusal"] and \
            "'optimizer_state'" in result["refusal"], result
        assert "shardkit.optim.ShardedGradScaler" in result["refusal"], result
        assert result["unchanged"], result
        assert result["error"] < 1e-6 and result["scale"] == 2.0 ** 8, result


def _micro_batch(step: int, rank: int, world: int) -> torch.Tensor:
    """Each rank's share of the step's batch, scaled by rank so the statistics differ."""
    x = torch.randn(4 * world, 4, generator=torch.Generator().manual_seed(step))
    return x.chunk(world)[rank] * (1 + rank)


def _evaluation_input() -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(99))


def _wrapped(kind: str):
    """(wrapper, module, optimizer): torch DDP with SGD, or ShardedDataParallel with OSS."""
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS

    model = _batchnorm_net()
    if kind == "torch":
        return (nn.parallel.DistributedDataParallel(model, broadcast_buffers=True), model,
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    return ShardedDataParallel(model, optimizer, broadcast_buffers=True), model, optimizer


def _train_step(wrapper, optimizer, step: int, rank: int, world: int) -> None:
    wrapper(_micro_batch(step, rank, world)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _evaluate(wrapper, dtype=torch.float32) -> torch.Tensor:
    wrapper.eval()
    with torch.no_grad():
        out = wrapper(_evaluation_input().to(dtype))
    wrapper.train()
    return out.double()


def _changes_between_steps(kind: str) -> dict:
    """What every rank evaluates after a relative write and after a cast, and the buffers
    each rank holds right after the last backward."""
    rank, world = skdist.get_rank(), skdist.get_world_size()
    wrapper, model, optimizer = _wrapped(kind)
    _train_step(wrapper, optimizer, 0, rank, world)
    with torch.no_grad():
        model[1].running_mean.mul_(0.5)  # every rank, relative to its current value
    after_write = _evaluate(wrapper)
    _train_step(wrapper, optimizer, 1, rank, world)
    after_last_backward = {k: v.clone() for k, v in model.state_dict().items()}
    wrapper.double()
    after_cast = _evaluate(wrapper, torch.float64)
    return dict(after_write=after_write, after_cast=after_cast,
                after_last_backward=after_last_backward)


def _check_changes_between_steps():
    torch_ddp, sharded = _changes_between_steps("torch"), _changes_between_steps("sharded")
    rank0_state = skdist.all_gather_object(sharded["after_last_backward"])[0]
    return dict(
        write_error=(torch_ddp["after_write"] - sharded["after_write"]).abs().max().item(),
        cast_error=(torch_ddp["after_cast"] - sharded["after_cast"]).abs().max().item(),
        state_is_rank0s=all(torch.equal(v, rank0_state[k])
                            for k, v in sharded["after_last_backward"].items()))


def test_every_rank_casts_writes_and_saves_rank0_buffers_after_a_step(world2):
    for rank, result in enumerate(world2.run(_check_changes_between_steps)):
        assert result["write_error"] < 1e-6, (rank, result)
        assert result["cast_error"] < 1e-6, (rank, result)
        assert result["state_is_rank0s"], (rank, result)


def _forwards_before_one_backward(kind: str, eval_second: bool, retain: bool) -> list:
    """Three steps of two forwards (the second in evaluation mode or not) and one loss,
    backwarded once, or twice with ``retain_graph=True`` (torch DDP: the loss doubled)."""
    rank, world = skdist.get_rank(), skdist.get_world_size()
    wrapper, model, optimizer = _wrapped(kind)
    params = []
    for step in range(3):
        loss = wrapper(_micro_batch(step, rank, world)).sum()
        wrapper.train(not eval_second)
        loss = loss + wrapper(_micro_batch(step + 50, rank, world)).square().sum()
        wrapper.train()
        if not retain:
            loss.backward()
        elif kind == "torch":
            (2 * loss).backward()
        else:
            loss.backward(retain_graph=True)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    return params + [_evaluate(wrapper)]


def _check_forwards_before_one_backward():
    errors = {}
    for eval_second, retain in ((True, False), (False, False), (True, True), (False, True)):
        expected = _forwards_before_one_backward("torch", eval_second, retain)
        got = _forwards_before_one_backward("sharded", eval_second, retain)
        errors[(eval_second, retain)] = max(
            _relative_error(a, b) for xs, ys in zip(expected, got)
            for a, b in zip(xs if isinstance(xs, list) else [xs], ys if isinstance(ys, list)
                            else [ys]))
    return errors


def _relative_error(expected: torch.Tensor, got: torch.Tensor) -> float:
    return ((expected - got).abs().max() / (1 + expected.abs().max())).item()


def test_forwards_before_one_backward_match_torch_ddp(world2):
    for rank, errors in enumerate(world2.run(_check_forwards_before_one_backward)):
        assert max(errors.values()) < 1e-5, (rank, errors)
