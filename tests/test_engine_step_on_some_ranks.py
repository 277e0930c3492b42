"""DeepSpeed-style engine: a step taken on some ranks only.

``engine.optimizer.step()`` (or ``engine.step()``) called on some ranks only, behind
``if rank == 0`` or a rank-local check of the loss: the stepping ranks waited forever in the
step's agreement while the others went on into their next forward's or backward's
collectives. Now every rank raises a RuntimeError naming the ranks on each side, and no rank
steps; the usual loop (one forward, backward and step a rank) sends nothing more than before.

Review of the step agreement

DeepSpeed-style engine: the step agreement of ranks that did not step, in ordinary loops.

Since a step taken on some ranks only became an error on every rank, a rank that did not step
joined the step's agreement at its next training forward. It was armed by the forward itself,
so:

- a forward that no backward follows, on some ranks only (a rank-0 preview or logging
  forward that forgot ``torch.no_grad()``, which torch DDP at stages 0-1 runs happily) made
  those ranks alone join the agreement at their next forward while the others went on into
  the backward's all-reduce: every rank waited forever;
- a loss of two forwards (GAN discriminators, contrastive pairs) paid one more all-gather a
  step on every rank.

Now a rank owes a step once a backward reaches a reducing training forward's output
(``engine.backward`` or the script's own ``loss.backward()``), so neither happens, and a step
skipped on some ranks is still an error on every rank.

Second review of the step agreement

DeepSpeed-style engine: the step agreement's gradient hooks on a forward's output.

Second review of the step agreement (a rank owes a step once a backward reaches a reducing
training forward's output, found through a gradient hook on each output tensor):

- a forward returning one of its parameters as is (the log-variances of a multi-task loss's
  uncertainty weighting: ``return preds, self.log_vars``) got one more hook on that
  parameter at every step, for the life of the model: memory and one more Python call in
  every backward, step after step. Now one hook a leaf, armed at each forward;
- an output that is a dataclass (not registered with torch's pytree) hid its tensors, so a
  step taken on some ranks only hung instead of raising on every rank.

One world of 2 gloo ranks for the module, and one of 4 for a single test.
"""

import contextlib
import dataclasses

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.testing import run_in_world, world_fixture

world2 = world_fixture(2, timeout=120)


def _engine(stage: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    engine, optimizer, _, _ = shardkit.initialize(model=model, config=config)
    return engine, optimizer


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 * step + distributed.get_rank())
    return torch.randn(2, 4, generator=gen)


def _outcome(call) -> str:
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return "ok"


def _step_on_one_rank(stage: int, how: str) -> dict:
    """Step 0 on every rank, then step 1 on rank 0 only (``how``: the script's direct
    ``optimizer.step()`` after ``engine.backward``, the same after ``loss.backward()``
    (nanoGPT's loop), or ``engine.step()``) while rank 1 goes on to its next forward."""
    engine, optimizer = _engine(stage)
    step_call = engine.step if how == "engine.step" else optimizer.step
    for step in range(2):
        loss = engine(_batch(step)).pow(2).mean()
        if how == "loss.backward":
            loss.backward()
        else:
            engine.backward(loss)
        before = [p.detach().clone() for p in engine.module.parameters()]
        if step == 0:
            step_call()
    if distributed.get_rank() == 0:
        error = _outcome(step_call)
    else:
        error = _outcome(lambda: engine(_batch(2)))  # its next training forward
    unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    return {"error": error, "unchanged": unchanged}


@pytest.mark.parametrize("stage,how", [(0, "optimizer.step"), (1, "loss.backward"),
                                       (2, "optimizer.step"), (3, "optimizer.step"),
                                       (0, "engine.step")])
def test_a_step_on_some_ranks_only_is_an_error_on_every_rank(world2, stage, how):
    # was: rank 0 hung in the step's agreement, rank 1 in its next forward or backward
    outs = world2.run(_step_on_one_rank, stage, how)
    call = "engine.step()" if how == "engine.step" else "engine.optimizer.step()"
    texts = [out["error"] for out in outs]
    assert texts[0].startswith(f"{call}: rank(s) [0] are stepping"), texts
    assert texts[1].startswith("engine forward: rank(s) [0] are stepping"), texts
    for text in texts:
        assert "rank(s) [1] went on" in text and "no rank stepped" in text, text
    assert outs[0]["unchanged"] and outs[1]["unchanged"]


@contextlib.contextmanager
def _counting_agreements():
    """The names of the control all-gathers the engine agrees through, while inside."""
    calls, original = [], distributed.gather_control_rows

    def counted(what, row, group=None, **kwargs):
        if not what.startswith("ShardedDataParallel"):  # its own trainable-set agreement
            calls.append(what)
        return original(what, row, group, **kwargs)
    distributed.gather_control_rows = counted
    try:
        yield calls
    finally:
        distributed.gather_control_rows = original


def _loops_that_step_everywhere(stage: int) -> dict:
    """Every rank steps: a direct step equals engine.step(); one agreement a step; a loss of
    two forwards, and a pass with no step on any rank, agree and go on."""
    with _counting_agreements() as calls:
        results = {}
        for how in ("engine.step", "optimizer.step"):
            engine, optimizer = _engine(stage)
            for step in range(3):
                engine.backward(engine(_batch(step)).pow(2).mean())
                (engine.step if how == "engine.step" else optimizer.step)()
                if how == "optimizer.step":
                    optimizer.zero_grad()
            results[how] = [p.detach().clone() for p in engine.module.parameters()]
        per_three_steps = len(calls)
        engine, _ = _engine(stage)
        pair = engine(_batch(0)).sum() + engine(_batch(1)).sum()  # two forwards, one loss
        engine.backward(pair)
        engine.step()
        engine.backward(engine(_batch(2)).sum())
        engine.zero_grad()  # no rank steps this pass
        engine.backward(engine(_batch(3)).sum())
        engine.step()
        moved = engine.global_steps
    same = all(torch.equal(a, b) for a, b in zip(results["engine.step"],
                                                 results["optimizer.step"]))
    return {"same": same, "per_three_steps": per_three_steps, "steps": moved,
            "extra": len(calls) - per_three_steps}


@pytest.mark.parametrize("stage", [0, 3])
def test_steps_on_every_rank_agree_once_per_step(world2, stage):
    for out in world2.run(_loops_that_step_everywhere, stage):
        assert out["same"]
        assert out["per_three_steps"] == 6  # one agreement a step, as before
        # two steps and the pass that stepped nowhere (not the second forward of the pair)
        assert out["extra"] == 3 and out["steps"] == 2, out


def _step_on_even_ranks() -> dict:
    """World of 4, stage 2: ranks 0 and 2 call optimizer.step(), ranks 1 and 3 go on."""
    engine, optimizer = _engine(2)
    engine.backward(engine(_batch(0)).pow(2).mean())
    if distributed.get_rank() % 2 == 0:
        return {"error": _outcome(optimizer.step)}
    return {"error": _outcome(lambda: engine(_batch(1)))}


def test_a_step_on_half_of_four_ranks_names_both_halves():
    for out in run_in_world(4, _step_on_even_ranks, timeout=120):
        assert "rank(s) [0, 2] are stepping" in out["error"], out
        assert "rank(s) [1, 3] went on" in out["error"], out


def _parameters(engine) -> list:
    return [p.detach().clone() for p in engine.module.parameters()]


def _train(stage: int, preview_on_rank0: bool) -> list:
    """Three steps of the usual loop; with ``preview_on_rank0``, rank 0 alone also runs a
    training-mode forward with gradients on after each step, and no backward of it."""
    engine, _ = _engine(stage)
    for step in range(3):
        engine.backward(engine(_batch(step)).pow(2).mean())
        engine.step()
        if preview_on_rank0 and distributed.get_rank() == 0:
            engine(_batch(100 + step))  # forgot torch.no_grad(): no backward follows
    return _parameters(engine)


def _preview_on_rank0_only(stage: int) -> dict:
    with_preview = _train(stage, preview_on_rank0=True)
    without = _train(stage, preview_on_rank0=False)
    mine = torch.cat([p.flatten() for p in with_preview])
    every = [torch.empty_like(mine) for _ in range(distributed.get_world_size())]
    torch.distributed.all_gather(every, mine)
    return {"same_as_without": all(torch.equal(a, b) for a, b in zip(with_preview, without)),
            "ranks_agree": all(torch.equal(every[0], other) for other in every)}


@pytest.mark.parametrize("stage", [0, 1])
def test_a_forward_without_backward_on_one_rank_does_not_hang(world2, stage):
    # was: rank 0 waited in its next forward's agreement, rank 1 in the backward's all-reduce
    for out in world2.run(_preview_on_rank0_only, stage):
        assert out == {"same_as_without": True, "ranks_agree": True}, out


def _two_forward_loops(stage: int) -> dict:
    """One loss of two engine forwards a step (a discriminator on real and fake samples), three
    steps by ``engine.step()``, then three by the script's ``loss.backward()`` and
    ``engine.optimizer.step()``."""
    with _counting_agreements() as calls:
        engine, optimizer = _engine(stage)
        for step in range(3):
            pair = engine(_batch(step)).pow(2).mean() + engine(-_batch(step)).abs().mean()
            engine.backward(pair)
            engine.step()
        by_engine = len(calls)
        engine, optimizer = _engine(stage)
        for step in range(3):
            x = _batch(step)
            (engine(x).pow(2).mean() + engine(-x).abs().mean()).backward()
            optimizer.step()
            optimizer.zero_grad()
    return {"by_engine": by_engine, "by_script": len(calls) - by_engine}


@pytest.mark.parametrize("stage", [0, 3])
def test_a_loss_of_two_forwards_agrees_once_per_step(world2, stage):
    # was: 6 each, the second forward of every pair joining an agreement of its own
    for out in world2.run(_two_forward_loops, stage):
        assert out == {"by_engine": 3, "by_script": 3}, out


def _step_skipped_on_rank1(stage: int, how: str) -> str:
    """A loss of two forwards and its backward on every rank (``how``: ``engine.backward`` or
    the script's ``loss.backward()``), then rank 0 alone steps; rank 1 goes on to its next
    training forward."""
    engine, optimizer = _engine(stage)
    pair = engine(_batch(0)).pow(2).mean() + engine(-_batch(0)).abs().mean()
    if how == "loss.backward":
        pair.backward()
    else:
        engine.backward(pair)
    try:
        if distributed.get_rank() == 0:
            optimizer.step()
        else:
            engine(_batch(1))
    except RuntimeError as error:
        return str(error)
    return "ok"


@pytest.mark.parametrize("stage,how", [(0, "engine.backward"), (3, "loss.backward")])
def test_a_step_on_one_rank_after_a_loss_of_two_forwards_still_raises(world2, stage, how):
    texts = world2.run(_step_skipped_on_rank1, stage, how)
    assert texts[0].startswith("engine.optimizer.step(): rank(s) [0] are stepping"), texts
    assert texts[1].startswith("engine forward: rank(s) [0] are stepping"), texts
    assert all("rank(s) [1] went on" in text for text in texts), texts


def _preview_between_backward_and_step_on_rank0() -> str:
    engine, _ = _engine(0)
    engine.backward(engine(_batch(0)).pow(2).mean())
    try:
        if distributed.get_rank() == 0:
            engine(_batch(1))  # a preview that forgot torch.no_grad(), before the step
        engine.step()
    except RuntimeError as error:
        return str(error)
    return "ok"


def test_a_forward_between_backward_and_step_on_one_rank_is_named_in_the_error(world2):
    # a rank-local forward with gradients on is indistinguishable from the next pass of a rank
    # that skipped its step: refused on every rank, and the error says how to run it instead
    for text in world2.run(_preview_between_backward_and_step_on_rank0):
        assert "rank(s) [1] are stepping" in text and "rank(s) [0] went on" in text, text
        assert "between backward and step on some ranks only" in text, text
        assert "torch.no_grad()" in text, text


def _config() -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}


class _UncertaintyWeighted(nn.Module):
    """Predictions and the learned log-variances that weight their losses."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 2)
        self.log_vars = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        return self.head(x), self.log_vars


def _weighted_loss(output) -> torch.Tensor:
    preds, log_vars = output
    return (preds.pow(2) * torch.exp(-log_vars)).mean() + log_vars.sum()


def _hooks_on_a_returned_parameter() -> dict:
    """Twenty steps of a model that returns a parameter; then a step on rank 0 only after a
    loss that reaches nothing but that parameter."""
    torch.manual_seed(0)
    engine, optimizer, _, _ = shardkit.initialize(model=_UncertaintyWeighted(),
                                                  config=_config())
    log_vars = engine.module.log_vars
    counts = []
    for step in range(20):
        engine.backward(_weighted_loss(engine(_batch(step))))
        engine.step()
        counts.append(len(log_vars._backward_hooks or {}))
    engine.backward(engine(_batch(20))[1].sum())
    if distributed.get_rank() == 0:
        error = _outcome(optimizer.step)
    else:
        error = _outcome(lambda: engine(_batch(21)))
    return {"first": counts[0], "last": counts[-1], "error": error}


def test_a_returned_parameter_keeps_one_hook_and_still_owes_the_step(world2):
    # was: one more hook on log_vars every step (21 after 20 steps)
    for out in world2.run(_hooks_on_a_returned_parameter):
        assert out["last"] == out["first"], out
        assert "rank(s) [0] are stepping" in out["error"], out
        assert "rank(s) [1] went on" in out["error"], out


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    note: str = "logits"


class _ReturnsDataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return _Output(self.head(x))


def _step_on_rank0_with_dataclass_output() -> str:
    torch.manual_seed(0)
    engine, optimizer, _, _ = shardkit.initialize(model=_ReturnsDataclass(), config=_config())
    engine.backward(engine(_batch(0)).logits.pow(2).mean())
    if distributed.get_rank() == 0:
        return _outcome(optimizer.step)
    return _outcome(lambda: engine.backward(engine(_batch(1)).logits.sum()))


def test_a_step_on_some_ranks_is_an_error_with_a_dataclass_output(world2):
    # was: rank 0 waited in the step's agreement, rank 1 in its next backward, forever
    texts = world2.run(_step_on_rank0_with_dataclass_output)
    assert texts[0].startswith("engine.optimizer.step(): rank(s) [0] are stepping"), texts
    assert texts[1].startswith("engine forward: rank(s) [0] are stepping"), texts


class _ReturnsFirstToken(nn.Module):
    """A pooled output that is a view of the hidden states (BERT's ``hidden[:, 0]``)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 6)

    def forward(self, x):
        return self.encoder(x).view(2, 3, 2)[:, 0]


def _step_on_rank0_after_an_in_place_change_of_a_view_output() -> str:
    torch.manual_seed(0)
    engine, optimizer, _, _ = shardkit.initialize(model=_ReturnsFirstToken(),
                                                  config=_config())
    pooled = engine(_batch(0))
    pooled.div_(0.5)  # a temperature applied in place
    engine.backward(pooled.pow(2).mean())
    if distributed.get_rank() == 0:
        return _outcome(optimizer.step)
    return _outcome(lambda: engine.backward(engine(_batch(1)).sum()))


def test_a_step_on_some_ranks_is_an_error_after_an_in_place_change_of_a_view_output(world2):
    # was: the view's hook never fired, so rank 1 went on into its backward: a hang
    texts = world2.run(_step_on_rank0_after_an_in_place_change_of_a_view_output)
    assert texts[0].startswith("engine.optimizer.step(): rank(s) [0] are stepping"), texts
    assert texts[1].startswith("engine forward: rank(s) [0] are stepping"), texts
