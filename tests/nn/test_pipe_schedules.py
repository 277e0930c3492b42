"""Multi-process pipeline: GPipe and 1F1B match single-process training; memory; bytes; errors."""

import time

import pytest
import torch
import torch.nn as nn

from shardkit import distributed as dist
from shardkit.nn.pipe import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                              ScheduleInterleaved1F1B, ScheduleZBV, ScheduleZeroBubble,
                              split_sequential)
from shardkit.models import GPT, GPTConfig, synthetic_batch
from shardkit.nn.pipe.p2p import (GRADIENT_FLAGS, SETTLE_ELEMENTS, VERDICT_ELEMENTS,
                                  StepState)
from shardkit.nn.pipe.stage import stage_rank
from shardkit.plan import pipeline_comm_elements
from shardkit.recipes import gpt_as_sequential, token_cross_entropy
from shardkit.testing import world_fixture

WIDTH, BATCH, STEPS = 16, 16, 10


world2 = world_fixture(2, timeout=120)  # a hung step fails its test in two minutes


world4 = world_fixture(4, timeout=120)


def _model(seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 4))


def _batch(step, batch=BATCH):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(batch, WIDTH, generator=g), torch.randn(batch, 4, generator=g)


def _reference(steps, batch=BATCH):
    return _reference_steps([("train", step, batch) for step in range(steps)])


def _reference_steps(kinds):
    """One process through ``kinds`` of ``(kind, seed, rows)``: "train" steps Adam, "eval"
    only computes the loss under no_grad. Returns the model and the losses."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for kind, seed, rows in kinds:
        x, y = _batch(seed, rows)
        if kind == "eval":
            with torch.no_grad():
                losses.append(nn.functional.mse_loss(model(x), y).item())
            continue
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def _balance(num_stages):
    return {2: [5, 4], 4: [2, 2, 2, 3]}[num_stages]


def _train_pipeline(schedule_cls, stage, chunks, steps, rows=slice(None)):
    schedule = schedule_cls(stage, chunks, nn.functional.mse_loss)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        loss = schedule.step(x[rows], target=y[rows])
        opt.step()
        losses.append(None if loss is None else loss.item())
    return losses, schedule


def _max_param_diff(stage_module, ref_stage_module):
    return max((a - b).abs().max().item()
               for a, b in zip(stage_module.parameters(), ref_stage_module.parameters()))


def _check_parity(chunks):
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_model, ref_losses = _reference(STEPS)
    ref_stage = split_sequential(ref_model, _balance(world))[rank]
    out = {}
    for schedule_cls in (ScheduleGPipe, Schedule1F1B):
        module = split_sequential(_model(), _balance(world))[rank]
        stage = PipelineStage(module, rank, world)
        losses, _ = _train_pipeline(schedule_cls, stage, chunks, STEPS)
        loss_diff = (max(abs(a - b) for a, b in zip(losses, ref_losses))
                     if stage.is_last else None)
        out[schedule_cls.__name__] = (loss_diff, _max_param_diff(module, ref_stage),
                                      all(v is None for v in losses) != stage.is_last)
    return out


@pytest.mark.parametrize("world_name", ["world2", "world4"])
def test_schedules_match_single_process_training(world_name, request):
    world = request.getfixturevalue(world_name)
    results = world.run(_check_parity, 4)
    for rank, per_schedule in enumerate(results):
        for name, (loss_diff, param_diff, returns_only_on_last) in per_schedule.items():
            assert returns_only_on_last, (rank, name)
            assert param_diff <= 1e-5, (rank, name, param_diff)
            if rank == len(results) - 1:
                assert loss_diff <= 1e-5, (name, loss_diff)


def _check_two_stages_two_data_parallel():
    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipeline, stage_index = rank // 2, rank % 2
    ref_model, ref_losses = _reference(STEPS)
    ref_stage = split_sequential(ref_model, [5, 4])[stage_index]
    module = split_sequential(_model(), [5, 4])[stage_index]
    stage = PipelineStage(module, stage_index, 2, group=pipelines[pipeline],
                          data_parallel_group=replicas[stage_index])
    half = slice(pipeline * BATCH // 2, (pipeline + 1) * BATCH // 2)  # each pipeline: half batch
    with dist.CommCounter() as comm:
        losses, _ = _train_pipeline(Schedule1F1B, stage, 2, STEPS, rows=half)
    grad_bytes = sum(p.numel() * 4 for p in module.parameters())
    grad_bytes += 4 * sum(1 for _ in module.parameters())  # a presence element per parameter
    reduce_bytes = comm.by_op.get("all_reduce", 0) / STEPS
    return _max_param_diff(module, ref_stage), losses, ref_losses, reduce_bytes, grad_bytes


def test_two_stages_times_two_data_parallel(world4):
    results = world4.run(_check_two_stages_two_data_parallel)
    for rank, (param_diff, losses, ref_losses, reduce_bytes, grad_bytes) in enumerate(results):
        assert param_diff <= 1e-5, (rank, param_diff)
        # one flat all-reduce: the gradients, their presence elements and the step's verdict
        assert reduce_bytes == pytest.approx(2 * (2 - 1) / 2 * (grad_bytes + 4))
    # the two pipelines' half-batch losses average to the full-batch loss
    last0, last1 = results[1][1], results[3][1]
    for a, b, ref in zip(last0, last1, results[1][2]):
        assert (a + b) / 2 == pytest.approx(ref, abs=1e-5)


def _check_memory_and_bytes():
    rank = dist.get_rank()
    chunks, rows = 8, 64
    out = {}
    for schedule_cls in (ScheduleGPipe, Schedule1F1B):
        module = split_sequential(_model(), _balance(2))[rank]
        stage = PipelineStage(module, rank, 2)
        schedule = schedule_cls(stage, chunks, nn.functional.mse_loss,
                                track_activation_memory=True)
        x, y = _batch(0, rows)
        schedule.step(x, target=y)  # first step also sends the shape headers
        with dist.CommCounter() as comm:
            schedule.step(x, target=y)
        out[schedule_cls.__name__] = (schedule.peak_live_microbatches,
                                      schedule.activation_memory.peak_bytes,
                                      schedule.activation_memory.current_bytes,
                                      comm.by_op.get("send", 0), comm.calls_by_op.get("send", 0))
    return out


def test_1f1b_keeps_at_most_num_stages_microbatches_alive(world2):
    results = world2.run(_check_memory_and_bytes)
    for rank, r in enumerate(results):
        gpipe_live, gpipe_bytes, gpipe_left, _, _ = r["ScheduleGPipe"]
        ofob_live, ofob_bytes, ofob_left, _, _ = r["Schedule1F1B"]
        assert gpipe_live == 8  # GPipe holds all 8 micro-batches
        assert ofob_live == 2 - rank  # 1F1B: num_stages - stage_index
        per_microbatch = gpipe_bytes / 8
        assert per_microbatch > 0
        assert ofob_bytes <= (2 - rank) * per_microbatch * 1.01  # at most the 2-micro-batch level
        assert gpipe_left == 0 and ofob_left == 0  # everything released by backward
    # bytes on the wire per step: each stage sends one activation (or its gradient) per
    # micro-batch: 64 rows x 16 features x 4 bytes in all, no shape headers after the first step;
    # stage 0's micro-batch 0 carries the step state, 3 more float32 elements, each of stage
    # 1's 8 gradient messages one presence flag, and the last message each way the step's
    # verdict, 1 more, in the same sends; at the end of a training step rank 1 tells rank 0 its
    # verdict and rank 0 tells it the outcome, one element each way (shardkit.plan's formula)
    for name in ("ScheduleGPipe", "Schedule1F1B"):
        for rank in range(2):
            _, _, _, send_bytes, send_calls = results[rank][name]
            state_bytes = StepState.BITS * 4 if rank == 0 else 0
            flag_bytes = 8 * GRADIENT_FLAGS * 4 if rank == 1 else 0
            assert send_bytes == 64 * WIDTH * 4 + state_bytes + flag_bytes \
                + VERDICT_ELEMENTS * 4 + SETTLE_ELEMENTS * 4
            assert send_bytes == pipeline_comm_elements(64 * WIDTH, rank, 2, chunks=8) * 4
            assert send_calls == 8 + 1


def _mismatched_stage_counts():
    rank = dist.get_rank()
    try:
        PipelineStage(nn.Linear(2, 2), rank, 2 + rank)
    except ValueError as error:
        return str(error)
    return "no error"


def _bad_steps():
    rank = dist.get_rank()
    messages = []
    module = split_sequential(_model(), _balance(2))[rank]
    stage = PipelineStage(module, rank, 2)
    x, y = _batch(0, 4)
    for schedule, kwargs in ((ScheduleGPipe(stage, 8, nn.functional.mse_loss), {"target": y}),
                             (ScheduleGPipe(stage, 2, nn.functional.mse_loss), {}),
                             ((ScheduleGPipe if rank == 0 else Schedule1F1B)(
                                 stage, 2, nn.functional.mse_loss), {"target": y})):
        try:
            schedule.step(x, **kwargs)
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    # the pipeline still works afterwards: nothing was half-sent
    loss = ScheduleGPipe(stage, 2, nn.functional.mse_loss).step(x, target=y)
    messages.append(loss is not None)
    return messages


def test_bad_input_raises_the_same_clear_error_on_every_rank(world2):
    errors = world2.run(_mismatched_stage_counts)
    for message in errors:
        assert "group rank 1: num_stages=3 but the pipeline group has 2 ranks" in message
    chunk_error, target_error, schedule_error, works = zip(*world2.run(_bad_steps))
    assert all("chunks=8 is larger than the batch size 4" in m for m in chunk_error)
    assert all("the last stage needs the target" in m for m in target_error)
    assert all("stage 0 runs ScheduleGPipe(chunks=2), stage 1 runs Schedule1F1B(chunks=2)" in m
               for m in schedule_error)
    assert works == (False, True)  # the loss comes back on the last stage only


def test_split_sequential_bad_balance():
    with pytest.raises(ValueError, match=r"balance=\[4, 4\].*sum to 8.*9 layers"):
        split_sequential(_model(), [4, 4])
    with pytest.raises(TypeError, match=r"module=Linear"):
        split_sequential(nn.Linear(2, 2), [1])
    stages = split_sequential(_model(), [5, 4])
    assert [len(s) for s in stages] == [5, 4] and list(stages[1].state_dict())[0] == "6.weight"


class _Fork(nn.Module):
    """Sends a tuple across the boundary: two float tensors and an int tensor without grad."""

    def forward(self, x):
        return x, torch.sin(x), (x > 0).long().sum(dim=1)


class _Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, 4)

    def forward(self, parts):
        a, b, count = parts
        return self.lin(a * b) + count.unsqueeze(1).float()


def _tuple_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), _Fork(), _Join())


def _check_tuple_activations():
    rank = dist.get_rank()
    x, y = _batch(0)
    ref = _tuple_model()
    nn.functional.mse_loss(ref(x), y).backward()
    out = []
    for schedule_cls in (ScheduleGPipe, Schedule1F1B):
        module = split_sequential(_tuple_model(), [2, 1])[rank]
        schedule = schedule_cls(PipelineStage(module, rank, 2), 4, nn.functional.mse_loss)
        for _ in range(2):  # the second step runs on the cached shapes
            module.zero_grad()
            schedule.step(x, target=y)
        ref_part = split_sequential(ref, [2, 1])[rank]
        out.append(max((a.grad - b.grad).abs().max().item()
                       for a, b in zip(module.parameters(), ref_part.parameters())))
    return out


def test_tuple_activations_with_an_integer_tensor(world2):
    for per_schedule in world2.run(_check_tuple_activations):
        assert max(per_schedule) <= 1e-6


def _merged_weight_grads_match():
    """GPipe and 1F1B with each Linear's weight gradient merged over the micro-batches (one
    product per step, or per pipeline depth) give the per-micro-batch gradients, every stage."""
    rank, world = dist.get_rank(), dist.get_world_size()
    grads = {}
    for name, make in (("per micro-batch", lambda st: ScheduleGPipe(
            st, 4, nn.functional.mse_loss, batch_weight_grads=False)),
                       ("GPipe merged", lambda st: ScheduleGPipe(st, 4, nn.functional.mse_loss)),
                       ("1F1B merged", lambda st: Schedule1F1B(st, 4, nn.functional.mse_loss,
                                                               weight_grad_merge=3))):
        module = split_sequential(_model(), _balance(world))[rank]
        stage = PipelineStage(module, rank, world)
        schedule = make(stage)
        x, y = _batch(0)
        schedule.step(x, target=y)
        grads[name] = ([p.grad.clone() for p in module.parameters()],
                       schedule.weight_grad_merge)
    ref, merge = grads.pop("per micro-batch")
    scale = max(g.abs().max().item() for g in ref)
    out = {"per micro-batch": merge}
    for name, (got, merge) in grads.items():
        out[name] = (max((a - b).abs().max().item() for a, b in zip(ref, got)) / max(1.0, scale),
                     merge)
    return out


def test_merged_weight_grads_match_per_microbatch(world2, world4):
    for world in (world2, world4):
        for r in world.run(_merged_weight_grads_match):
            assert r["per micro-batch"] == 1
            assert r["GPipe merged"][1] == 4 and r["1F1B merged"][1] == 3
            assert r["GPipe merged"][0] <= 1e-6 and r["1F1B merged"][0] <= 1e-6, r


def _bad_merge():
    stage = PipelineStage(nn.Linear(4, 4), dist.get_rank(), dist.get_world_size())
    try:
        Schedule1F1B(stage, 2, nn.functional.mse_loss, weight_grad_merge=0)
    except ValueError as err:
        return str(err)
    return None


def test_a_bad_weight_grad_merge_is_a_clear_error(world2):
    for message in world2.run(_bad_merge):
        assert "Schedule1F1B(weight_grad_merge=0): expected a positive int" in message


def _gradient_hooks_are_honoured():
    """A hook on a stage parameter (as a data-parallel wrapper installs) must still fire: GPipe
    then backpropagates per micro-batch for that step instead of merging weight gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module = split_sequential(_model(), _balance(world))[rank]
    stage = PipelineStage(module, rank, world)
    schedule = ScheduleGPipe(stage, 4, nn.functional.mse_loss)
    fired = []
    first = next(module.parameters())
    first.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    x, y = _batch(0)
    schedule.step(x, target=y)
    return len(fired)


def test_gpipe_keeps_gradient_hooks_working(world2):
    for fired in world2.run(_gradient_hooks_are_honoured):
        assert fired == 4  # once per micro-batch


# training and evaluation interleaved: (kind, batch seed, rows); the 8-row evaluation changes the
# batch size, so its shape headers go again, and again for the 16-row training step after it
STEP_KINDS = (("train", 0, 16), ("eval", 1, 16), ("train", 2, 16), ("eval", 3, 8),
              ("train", 4, 16), ("train", 5, 16))


def _check_train_and_eval():
    """Evaluation steps under no_grad between training steps: forward only, the loss of the
    current parameters, .grad untouched; training goes on as in one process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_model, ref_losses = _reference_steps(STEP_KINDS)
    ref_stage = split_sequential(ref_model, _balance(world))[rank]
    out = {}
    for schedule_cls in (ScheduleGPipe, Schedule1F1B, ScheduleZeroBubble):
        module = split_sequential(_model(), _balance(world))[rank]
        schedule = schedule_cls(PipelineStage(module, rank, world), 4, nn.functional.mse_loss)
        opt = torch.optim.Adam(module.parameters(), lr=1e-2)
        worst, grads_kept = 0.0, True
        for (kind, seed, rows), ref_loss in zip(STEP_KINDS, ref_losses):
            x, y = _batch(seed, rows)
            if kind == "eval":
                before = [p.grad.clone() for p in module.parameters()]
                with torch.no_grad():
                    loss = schedule.step(x, target=y)
                grads_kept &= all(torch.equal(a, p.grad)
                                  for a, p in zip(before, module.parameters()))
            else:
                opt.zero_grad()
                loss = schedule.step(x, target=y)
                opt.step()
            if loss is not None:
                worst = max(worst, abs(loss.item() - ref_loss))
        out[schedule_cls.__name__] = (worst, _max_param_diff(module, ref_stage), grads_kept)
    return out


def test_evaluation_steps_under_no_grad_between_training_steps(world2):
    for rank, per_schedule in enumerate(world2.run(_check_train_and_eval)):
        for name, (loss_diff, param_diff, grads_kept) in per_schedule.items():
            assert loss_diff <= 1e-5 and param_diff <= 1e-5 and grads_kept, (rank, name)


def _bad_later_batches():
    """After a good step, batches the first stage cannot split: the first step's clear error on
    every rank, at once; then the pipeline runs on, with a new batch size too."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    module = split_sequential(model, _balance(world))[rank]
    schedule = Schedule1F1B(PipelineStage(module, rank, world), 4, nn.functional.mse_loss)
    x, y = _batch(0)
    schedule.step(x, target=y)
    errors = []
    for rows in (3, 2):  # fewer rows than chunks (10 rows train since cd8d748, as in torch)
        x, y = _batch(1, rows)
        start = time.monotonic()
        try:
            schedule.step(x, target=y)
            errors.append(("no error", time.monotonic() - start))
        except ValueError as error:
            errors.append((str(error), time.monotonic() - start))
    loss_diffs = []
    for x, y in (_batch(2), _batch(3, 8)):  # the full model is unchanged: no optimizer step
        with torch.no_grad():
            expected = nn.functional.mse_loss(model(x), y).item()
        loss = schedule.step(x, target=y)
        loss_diffs.append(None if loss is None else abs(loss.item() - expected))
    return errors, loss_diffs


@pytest.mark.parametrize("world_name", ["world2", "world4"])
def test_a_later_bad_batch_is_the_same_clear_error_on_every_rank(world_name, request):
    results = request.getfixturevalue(world_name).run(_bad_later_batches)
    for rank, (errors, loss_diffs) in enumerate(results):
        (uneven, uneven_s), (small, small_s) = errors
        assert "stage 0: chunks=4 is larger than the batch size 3" in uneven, (rank, uneven)
        assert "stage 0: chunks=4 is larger than the batch size 2" in small, (rank, small)
        assert uneven_s < 10 and small_s < 10, (rank, uneven_s, small_s)
        if rank == len(results) - 1:
            assert "target of shape (3, 4) cannot be split into chunks=4" in uneven
            assert max(loss_diffs) <= 1e-6, loss_diffs
        else:
            assert loss_diffs == [None, None]


# ---------------------------------------------------------------- what only a later stage sees
class _Narrow(nn.Module):
    """Keeps the first ``width`` features: an output shape that follows the data, not the batch
    shape. A list gives one width per call (per micro-batch)."""

    def __init__(self, stage):
        super().__init__()
        self.stage, self.width = stage, WIDTH

    def forward(self, x):
        width = self.width.pop(0) if isinstance(self.width, list) else self.width
        if width is None:
            raise RuntimeError(f"stage {self.stage} refuses this micro-batch")
        if width == "uint16":  # a dtype no header can name
            return x.to(torch.uint16)
        if width == "backward":  # a gradient this stage refuses
            return _RefusingBackward.apply(x, self.stage)
        return x[:, :width]


class _RefusingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, stage):
        ctx.stage = stage
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(f"stage {ctx.stage} refuses this gradient")


class _Pad(nn.Module):
    def forward(self, x):
        return nn.functional.pad(x, (0, WIDTH - x.shape[1]))


def _narrowing_model(num_stages, narrowing):
    """Linear + Tanh per stage (a final Linear to 4 on the last); each stage in ``narrowing``
    ends with a _Narrow, and the next stage pads back to WIDTH. Returns (model, balance)."""
    torch.manual_seed(0)
    layers, balance = [], []
    for s in range(num_stages):
        part = ([_Pad()] if s - 1 in narrowing else []) + [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        part += [_Narrow(s)] if s in narrowing else []
        part += [nn.Linear(WIDTH, 4)] if s == num_stages - 1 else []
        layers += part
        balance.append(len(part))
    return nn.Sequential(*layers), balance


def _set_widths(module, widths):
    for m in module.modules():
        if isinstance(m, _Narrow):
            width = widths.get(m.stage, WIDTH)
            m.width = list(width) if isinstance(width, list) else width


def _reference_narrowing(num_stages, narrowing, steps):
    """One process through ``steps`` (kind, seed, target rows, widths) as _reference_steps."""
    model, _ = _narrowing_model(num_stages, narrowing)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for kind, seed, _, widths in steps:
        _set_widths(model, widths)
        x, y = _batch(seed)
        with torch.set_grad_enabled(kind == "train"):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if kind == "train":
                loss.backward()
                opt.step()
        losses.append(loss.item())
    return model, losses


SCHEDULES = {"GPipe": (ScheduleGPipe, 1, "loop"), "1F1B": (Schedule1F1B, 1, "loop"),
             "ZB-H1": (ScheduleZeroBubble, 1, "loop"),
             "interleaved": (ScheduleInterleaved1F1B, 2, "loop"), "ZBV": (ScheduleZBV, 2, "v")}


def _my_stages(per_rank, placement):
    rank, world = dist.get_rank(), dist.get_world_size()
    if per_rank == 1:
        return [rank]
    return [rank, rank + world] if placement == "loop" else [rank, 2 * world - 1 - rank]


def _run_faulty_steps(name, steps, narrowing):
    """Train (Adam) and evaluate through ``steps`` with ``name``'s schedule, catching the
    ValueErrors; compare with one process running only the steps that went through."""
    schedule_cls, per_rank, placement = SCHEDULES[name]
    num_stages = per_rank * dist.get_world_size()
    model, balance = _narrowing_model(num_stages, narrowing)
    parts, mine = split_sequential(model, balance), _my_stages(per_rank, placement)
    stages = [PipelineStage(parts[s], s, num_stages, placement=placement) for s in mine]
    schedule = schedule_cls(stages[0] if per_rank == 1 else stages, 4, nn.functional.mse_loss)
    opt = torch.optim.Adam([p for s in mine for p in parts[s].parameters()], lr=1e-2)
    outcomes, causes, slowest = [], [], 0.0
    for kind, seed, target_rows, widths in steps:
        for s in mine:
            _set_widths(parts[s], widths)
        x, y = _batch(seed)[0], _batch(seed, target_rows)[1]
        start = time.monotonic()
        try:
            with torch.set_grad_enabled(kind == "train"):
                opt.zero_grad()
                loss = schedule.step(x, target=y)
                if kind == "train":
                    opt.step()
            outcomes.append(None if loss is None else loss.item())
        except ValueError as error:
            outcomes.append(str(error))
            if " raised " in str(error):  # chained to its own error on the raising rank
                causes.append(type(error.__cause__).__name__)
        slowest = max(slowest, time.monotonic() - start)
    done = [step for step, o in zip(steps, outcomes) if not isinstance(o, str)]
    ref_model, ref_losses = _reference_narrowing(num_stages, narrowing, done)
    ref_parts = split_sequential(ref_model, balance)
    losses = [o for o in outcomes if isinstance(o, float)]
    return ([o if isinstance(o, str) else None for o in outcomes],
            max((abs(a - b) for a, b in zip(losses, ref_losses)), default=None), len(losses),
            max(_max_param_diff(parts[s], ref_parts[s]) for s in mine), slowest, causes)


def _check_faulty_steps(names, steps, narrowing):
    return {name: _run_faulty_steps(name, steps, narrowing) for name in names}


# a target whose rows split but do not fit the output: loss_fn raises on the last stage
TARGET_ROWS = ("(the last), micro-batch 0: loss_fn raised RuntimeError: The size of tensor a (4) "
               "must match the size of tensor b (3)")
# (fewer rows than chunks: a target that chunks only fails to divide is split as torch splits it)
UNSPLITTABLE = "target of shape ({}, 4) cannot be split into chunks=4 micro-batches along dim 0"
RESHAPED = ("stage {}, micro-batch {}: expected an output of float32 (4, {}) requiring grad "
            "(announced to stage {} on an earlier step; the batch's shapes and the grad mode are "
            "unchanged), found float32 (4, {}) requiring grad")
ALONE = "may change from one step to the next only together with micro-batch 0's"
SEVERAL = "with several stages per rank a stage's output shapes must follow from the batch's"

# (kind, batch seed, target rows, {stage: output width}); 16-row batches, chunks=4; a width
# changes after a training step (an evaluation step re-sends the headers anyway). The narrowing
# stage is the last but one: stage 0 with one stage per rank on two ranks ...
ONE_PER_RANK = (("train", 0, 16, {}), ("train", 1, 12, {}), ("train", 2, 3, {}),
                ("eval", 3, 2, {}), ("train", 4, 16, {}), ("train", 5, 16, {0: 10}),
                ("train", 6, 16, {0: [10, 10, 7, 10]}), ("eval", 7, 16, {0: 10}),
                ("train", 8, 16, {0: 10}), ("train", 9, 16, {0: 13}))
ONE_PER_RANK_ERRORS = (None, TARGET_ROWS, UNSPLITTABLE.format(3), UNSPLITTABLE.format(2), None,
                       None, RESHAPED.format(0, 2, 10, 1, 7) + "; a stage's output shapes " + ALONE,
                       None, None, None)
# ... and stage 2 of 4 with two stages per rank (interleaved: rank 0 to 1; ZBV: rank 1 to 0)
TWO_PER_RANK = (("train", 0, 16, {}), ("train", 1, 12, {}), ("train", 2, 3, {}),
                ("eval", 3, 2, {}), ("train", 4, 16, {}), ("train", 5, 16, {2: 10}),
                ("train", 6, 16, {}), ("train", 7, 16, {2: [16, 16, 7, 16]}),
                ("eval", 8, 16, {}), ("train", 9, 16, {}))
TWO_PER_RANK_ERRORS = (None, TARGET_ROWS, UNSPLITTABLE.format(3), UNSPLITTABLE.format(2), None,
                       RESHAPED.format(2, 0, 16, 3, 10) + "; " + SEVERAL, None,
                       RESHAPED.format(2, 2, 16, 3, 7) + "; " + SEVERAL, None, None)


def _assert_faults(results, name, expected, steps):
    errors = [r[name][0] for r in results]
    for k, want in enumerate(expected):
        got = {e[k] for e in errors}
        assert len(got) == 1, (name, k, got)  # the same outcome on every rank
        got = got.pop()
        if want is None:
            assert got is None, (name, k, got)
        else:
            assert got is not None and want in got, (name, k, got)
    finished = sum(want is None for want in expected)
    counts = [r[name][2] for r in results]
    assert sorted(counts) == [0] * (len(results) - 1) + [finished], (name, counts)
    causes = sorted(c for r in results for c in r[name][5])
    raised = sum(want is not None and " raised " in want for want in expected)
    assert causes == ["NoneType"] * (len(results) - 1) * raised \
        + ["RuntimeError"] * raised, (name, causes)  # chained on the raising rank only
    for rank, result in enumerate(r[name] for r in results):
        _, loss_diff, count, param_diff, slowest, _ = result
        assert param_diff <= 1e-5, (name, rank, param_diff)  # training went on correctly
        assert count == 0 or loss_diff <= 1e-5, (name, rank, loss_diff)
        assert slowest < 30, (name, rank, slowest)


def test_later_stage_faults_are_one_clear_error_on_every_rank(world2):
    """A target only the last stage sees (unsplittable, or rows that make loss_fn raise, in
    training and under no_grad), an output shape that changes with the data on the last
    stage but one (re-announced with one stage per rank; an error with two), and one that
    changes on micro-batch 2 alone: every rank raises the same ValueError, and training goes
    on afterwards as in one process over the steps that went through."""
    results = world2.run(_check_faulty_steps, ["GPipe", "1F1B", "ZB-H1"], ONE_PER_RANK, {0})
    for name in ("GPipe", "1F1B", "ZB-H1"):
        _assert_faults(results, name, ONE_PER_RANK_ERRORS, ONE_PER_RANK)
    results = world2.run(_check_faulty_steps, ["interleaved", "ZBV"], TWO_PER_RANK, {2})
    for name in ("interleaved", "ZBV"):
        _assert_faults(results, name, TWO_PER_RANK_ERRORS, TWO_PER_RANK)


# four ranks, 1F1B: the middle stage 1 and the last-but-one stage 2 narrow
FOUR_STAGES = (("train", 0, 16, {}), ("train", 1, 16, {2: 9}),
               ("train", 2, 16, {1: [16, 16, 11, 16], 2: 9}), ("train", 3, 12, {2: 9}),
               ("train", 4, 16, {1: 12, 2: 9}), ("eval", 5, 2, {1: 12, 2: 9}),
               ("train", 6, 16, {1: 12, 2: 9}))
FOUR_STAGES_ERRORS = (None, None, RESHAPED.format(1, 2, 16, 2, 11), TARGET_ROWS, None,
                      UNSPLITTABLE.format(2), None)


# a stage's forward raising (None) or returning what cannot be sent ("uint16"): in the first
# step (no shapes announced: the next stage learns of it from a VOID header), in later steps
# (zeros of the announced shapes go on), in an evaluation step, on the first and the last
# stage; the steps after each one announce their shapes again and train as one process
def _raising(stage, mb):
    return {stage: [WIDTH if k != mb else None for k in range(4)]}


FORWARD_RAISED = "stage {}{}, micro-batch {}: its forward raised RuntimeError: stage {} refuses"
UNSENDABLE = "stage {}, micro-batch {}: its output holds a tensor of dtype torch.uint16"
RAISING_TWO = (("train", 0, 16, _raising(0, 0)), ("train", 1, 16, {}),
               ("train", 2, 16, _raising(1, 2)), ("eval", 3, 16, _raising(0, 1)),
               ("train", 4, 16, {}), ("train", 5, 16, _raising(0, 3)),
               ("train", 6, 16, {0: [WIDTH, "uint16", WIDTH, WIDTH]}), ("train", 7, 16, {}))
RAISING_TWO_ERRORS = (FORWARD_RAISED.format(0, "", 0, 0), None,
                      FORWARD_RAISED.format(1, " (the last)", 2, 1),
                      FORWARD_RAISED.format(0, "", 1, 0), None,
                      FORWARD_RAISED.format(0, "", 3, 0), UNSENDABLE.format(0, 1), None)
# four stages on two ranks: stage 1 raises (interleaved: sends to rank 0; ZBV: hands its
# output to stage 2 on the same rank), then stage 2 (the last but one)
RAISING_FOUR = (("train", 0, 16, _raising(1, 0)), ("train", 1, 16, {}),
                ("train", 2, 16, _raising(2, 1)), ("train", 3, 16, {}))
RAISING_FOUR_ERRORS = (FORWARD_RAISED.format(1, "", 0, 1), None,
                       FORWARD_RAISED.format(2, "", 1, 2), None)


def test_a_stage_forward_raising_is_one_clear_error_on_every_rank(world2):
    results = world2.run(_check_faulty_steps, ["GPipe", "1F1B", "ZB-H1"], RAISING_TWO, {0, 1})
    for name in ("GPipe", "1F1B", "ZB-H1"):
        _assert_faults(results, name, RAISING_TWO_ERRORS, RAISING_TWO)
    results = world2.run(_check_faulty_steps, ["interleaved", "ZBV"], RAISING_FOUR, {1, 2})
    for name in ("interleaved", "ZBV"):
        _assert_faults(results, name, RAISING_FOUR_ERRORS, RAISING_FOUR)


# a stage's backward raising (a custom autograd function refusing its gradient) on one
# micro-batch: the first and the last stage, a middle micro-batch, an evaluation step (no
# backward: it goes through), four stages on two ranks (local hand-off under ZBV)
def _refusing(stage, mb):
    return {stage: [WIDTH if k != mb else "backward" for k in range(4)]}


BACKWARD_RAISED = ("stage {}{}, micro-batch {}: its backward raised RuntimeError: stage {} "
                   "refuses this gradient")
BACKWARD_TWO = (("train", 0, 16, _refusing(0, 1)), ("train", 1, 16, {}),
                ("train", 2, 16, _refusing(1, 3)), ("eval", 3, 16, {0: "backward"}),
                ("train", 4, 16, {}))
BACKWARD_TWO_ERRORS = (BACKWARD_RAISED.format(0, "", 1, 0), None,
                       BACKWARD_RAISED.format(1, " (the last)", 3, 1), None, None)
BACKWARD_FOUR = (("train", 0, 16, _refusing(1, 0)), ("train", 1, 16, {}),
                 ("train", 2, 16, _refusing(2, 2)), ("train", 3, 16, {}))
BACKWARD_FOUR_ERRORS = (BACKWARD_RAISED.format(1, "", 0, 1), None,
                        BACKWARD_RAISED.format(2, "", 2, 2), None)


def test_a_stage_backward_raising_is_one_clear_error_on_every_rank(world2):
    """Without this, the raising rank left the step and its neighbours waited for gradients
    that never came."""
    results = world2.run(_check_faulty_steps, ["GPipe", "1F1B", "ZB-H1"], BACKWARD_TWO, {0, 1})
    for name in ("GPipe", "1F1B", "ZB-H1"):
        _assert_faults(results, name, BACKWARD_TWO_ERRORS, BACKWARD_TWO)
    results = world2.run(_check_faulty_steps, ["interleaved", "ZBV"], BACKWARD_FOUR, {1, 2})
    for name in ("interleaved", "ZBV"):
        _assert_faults(results, name, BACKWARD_FOUR_ERRORS, BACKWARD_FOUR)


def _raising_weight_hook(schedule_cls):
    """A hook on a parameter of the last stage raising on the first step (ZB-H1 runs it when
    it hands the step's weight gradients to the parameters, after that stage's last message):
    what each of 3 steps gave on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module = split_sequential(_model(), _balance(world))[rank]
    stage = PipelineStage(module, rank, world)
    schedule = schedule_cls(stage, 4, nn.functional.mse_loss)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-2)
    armed = [rank == world - 1]

    def refuse(param):
        if armed[0]:
            raise RuntimeError("the hook refuses")

    next(module.parameters()).register_post_accumulate_grad_hook(refuse)
    outcomes = []
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        try:
            loss = schedule.step(x, target=y)
            opt.step()
            outcomes.append(None if loss is None else loss.item())
        except ValueError as error:
            outcomes.append(str(error))
        armed[0] = False
    return outcomes


def test_a_gradient_hook_raising_is_one_clear_error_on_every_rank(world2):
    _, ref_losses = _reference_steps([("train", step, BATCH) for step in (1, 2)])
    for schedule_cls in (ScheduleZeroBubble, Schedule1F1B):
        results = world2.run(_raising_weight_hook, schedule_cls)
        assert results[0][0] == results[1][0], results  # the same error on both ranks
        assert "rank 1: stage 1" in results[0][0] and "RuntimeError: the hook refuses" \
            in results[0][0], results[0][0]
        assert results[0][1:] == [None, None]
        assert results[1][1:] == pytest.approx(ref_losses, abs=1e-5)


def test_later_stage_faults_on_four_ranks(world4):
    results = world4.run(_check_faulty_steps, ["1F1B"], FOUR_STAGES, {1, 2})
    _assert_faults(results, "1F1B", FOUR_STAGES_ERRORS, FOUR_STAGES)


TIED_GPT = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=16, seq_len=8, tie_weights=True)


def _tied_gpt_stages(num_stages, placement):
    """The tied GPT's layers, this rank's stages of it, and those stages' indices."""
    layers = gpt_as_sequential(GPT(TIED_GPT, seed=0))
    parts = split_sequential(layers, [2, 1, 1, 1] if num_stages == 4 else [3, 2])
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [s for s in range(num_stages) if stage_rank(s, num_stages, world, placement) == rank]
    return parts, mine


def _train_tied(name, steps=3, accumulate=False, perturb=False, freeze=False):
    """The tied GPT (token embedding = output head) trained by ``name``'s schedule with SGD
    (momentum and weight decay: every copy's update must match; not Adam, which turns the
    rounding noise of the attention key bias's zero gradient into whole steps), against one
    process: the worst
    parameter difference on this rank and the bytes sent per schedule step. ``accumulate``:
    two schedule steps per optimizer step (only each step's share may cross); ``perturb``:
    the last stage's copy starts off (it takes the first stage's values); ``freeze``: the
    tied weight frozen (nothing of it crosses), in the reference too."""
    schedule_cls, per_rank, placement = SCHEDULES[name]
    num_stages = per_rank * dist.get_world_size()
    parts, mine = _tied_gpt_stages(num_stages, placement)
    parts[0][0].tok.weight.requires_grad_(not freeze)
    if perturb and num_stages - 1 in mine and 0 not in mine:
        with torch.no_grad():
            parts[-1][-1].weight.add_(1.0)
    stages = [PipelineStage(parts[s], s, num_stages, placement=placement) for s in mine]
    schedule = schedule_cls(stages[0] if per_rank == 1 else stages, 2, token_cross_entropy)
    params = list({id(p): p for st in stages for p in st.parameters()}.values())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
    reference = GPT(TIED_GPT, seed=0)
    reference.tok_emb.weight.requires_grad_(not freeze)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    ref_parts = split_sequential(gpt_as_sequential(reference), [2, 1, 1, 1] if num_stages == 4
                                 else [3, 2])
    worst, sent = 0.0, []
    for step in range(steps):
        opt.zero_grad(), ref_opt.zero_grad()
        for half in range(2 if accumulate else 1):
            idx, target = synthetic_batch(TIED_GPT, 4, 2 * step + half)
            with dist.CommCounter() as comm:
                schedule.step(idx, target=target)
            sent.append(comm.by_op.get("send", 0))
            reference.loss(idx, target).backward()
        opt.step(), ref_opt.step()
        worst = max([worst] + [(a - b).abs().max().item() for s in mine for a, b in
                               zip(parts[s].parameters(), ref_parts[s].parameters())])
    return worst, sent


def _tied_gradient_norm():
    """``model_parallel.clip_grad_norm`` over a 2-stage pipeline group, the tied weight on
    both ranks, after one 1F1B step, and one process's norm: the tie counts once."""
    import shardkit.nn.model_parallel as mp

    parts, mine = _tied_gpt_stages(2, "loop")
    stage = PipelineStage(parts[mine[0]], mine[0], 2)
    idx, target = synthetic_batch(TIED_GPT, 4, 0)
    Schedule1F1B(stage, 2, token_cross_entropy).step(idx, target=target)
    mp.initialize_model_parallel(1, pipeline_length=2)
    try:
        norm = mp.clip_grad_norm(stage.parameters(), float("inf")).item()
    finally:
        mp.destroy_model_parallel()
    reference = GPT(TIED_GPT, seed=0)
    reference.loss(idx, target).backward()
    return norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")).item()


def _check_tied_weights():
    """Every schedule at world 2 (ZBV: one rank runs both tied stages), the accumulation and
    perturbed-copy cases, and the tie frozen (for the bytes)."""
    results = {name: _train_tied(name) for name in SCHEDULES}
    results["accumulate"] = _train_tied("1F1B", accumulate=True)
    results["perturb"] = _train_tied("GPipe", perturb=True)
    results["frozen"] = _train_tied("1F1B", freeze=True)
    return results, _tied_gradient_norm()


def test_weights_tied_across_ranks_train_as_one_weight(world2):
    """A GPT's token embedding tied to its head, the first and the last stage on different
    ranks, trains as in one process under every schedule (was refused)."""
    tied_bytes = TIED_GPT.vocab_size * TIED_GPT.d_model * 4
    for rank, (results, norms) in enumerate(world2.run(_check_tied_weights)):
        assert norms[0] == pytest.approx(norms[1], rel=1e-5), (rank, norms)  # the tie once
        for name, (worst, _) in results.items():
            assert worst <= 1e-5, (rank, name, worst)
        # the tie's gradient crosses once each way per training step: the same activations,
        # gradients and values (once, before the first step, frozen or not) as with the tie
        # frozen, plus its bytes
        tied, frozen = results["1F1B"][1], results["frozen"][1]
        assert tied[0] - frozen[0] == tied_bytes, (rank, tied, frozen)
        assert [t - f for t, f in zip(tied[1:], frozen[1:])] == [tied_bytes] * 2, (rank, tied)


def _bad_losses():
    """loss_fn returning per-element losses (``reduction="none"``: backward would sum them)
    or a Python float (``.item()``), then a good one: what each step gave on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(split_sequential(_model(), _balance(world))[rank], rank, world)
    outcomes = []
    for loss_fn in (lambda out, y: nn.functional.mse_loss(out, y, reduction="none"),
                    lambda out, y: nn.functional.mse_loss(out, y).item(),
                    lambda out, y: nn.functional.mse_loss(out, y).detach(),
                    nn.functional.mse_loss):
        schedule = Schedule1F1B(stage, 4, loss_fn)
        x, y = _batch(0)
        try:
            schedule.step(x, target=y)
            outcomes.append("ok")
        except ValueError as err:
            outcomes.append(str(err))
    return outcomes


def test_a_loss_that_is_not_one_element_is_one_clear_error_on_every_rank(world2):
    for vector, number, detached, good in world2.run(_bad_losses):
        assert "stage 1 (the last), micro-batch 0: loss_fn returned a tensor of shape (4, 4); " \
            "expected a one-element tensor" in vector
        assert "loss_fn returned a float; expected a one-element tensor" in number
        # a detached loss trained nothing, silently (torch's loss.backward() refuses it)
        assert "loss_fn returned a tensor that does not require grad" in detached, detached
        assert good == "ok"


def _frozen_tie_after_construction():
    """Both ranks freeze the tied weight after building the stages and train with AdamW
    (weight decay): as in one process, the frozen weight keeps ``.grad`` None and its values."""
    parts, mine = _tied_gpt_stages(2, "loop")
    stage = PipelineStage(parts[mine[0]], mine[0], 2)
    schedule = Schedule1F1B(stage, 2, token_cross_entropy)
    tied = parts[0][0].tok.weight
    tied.requires_grad_(False)
    start = tied.detach().clone()
    opt = torch.optim.AdamW(stage.parameters(), lr=0.1, weight_decay=0.1)
    for step in range(2):
        opt.zero_grad()
        idx, target = synthetic_batch(TIED_GPT, 4, step)
        schedule.step(idx, target=target)
        opt.step()
    return tied.grad is None, (tied - start).abs().max().item()


def test_tied_weight_frozen_after_construction_stays_frozen(world2):
    for rank, (no_grad, moved) in enumerate(world2.run(_frozen_tie_after_construction)):
        assert no_grad and moved == 0.0, (rank, no_grad, moved)


def _tie_unfrozen_after_construction(name):
    """The tied weight frozen when the stages are built, trained frozen for one step, then
    unfrozen on both ranks (and in one process): the worst parameter difference on this rank,
    this rank's copy's distance from one process's tied weight, and the global gradient norms
    (``clip_grad_norm`` over the pipeline, one process's) after each step."""
    import shardkit.nn.model_parallel as mp

    parts, mine = _tied_gpt_stages(2, "loop")
    tied = parts[0][0].tok.weight
    tied.requires_grad_(False)
    stage = PipelineStage(parts[mine[0]], mine[0], 2)
    schedule = SCHEDULES[name][0](stage, 2, token_cross_entropy)
    reference = GPT(TIED_GPT, seed=0)
    reference.tok_emb.weight.requires_grad_(False)
    ref_parts = split_sequential(gpt_as_sequential(reference), [3, 2])
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    norms = []
    mp.initialize_model_parallel(1, pipeline_length=2)
    try:
        for step in range(3):
            if step == 1:
                tied.requires_grad_(True)
                reference.tok_emb.weight.requires_grad_(True)
            opt.zero_grad(), ref_opt.zero_grad()
            idx, target = synthetic_batch(TIED_GPT, 4, step)
            schedule.step(idx, target=target)
            reference.loss(idx, target).backward()
            norms.append((mp.clip_grad_norm(stage.parameters(), float("inf")).item(),
                          torch.nn.utils.clip_grad_norm_(reference.parameters(),
                                                         float("inf")).item()))
            opt.step(), ref_opt.step()
    finally:
        mp.destroy_model_parallel()
    worst = max((a - b).abs().max().item() for s in mine
                for a, b in zip(parts[s].parameters(), ref_parts[s].parameters()))
    return worst, (tied - reference.tok_emb.weight).abs().max().item(), norms


def test_tied_weight_frozen_at_construction_and_unfrozen_trains_as_one_weight(world2):
    """A tied embedding/head frozen when the stages were built and unfrozen later on both
    ranks (gradual unfreezing) trains as one weight, as in one process, and a global norm
    counts it once. Before, a tie frozen at construction was left out of the ties for good:
    once unfrozen, each rank's copy got only its own stage's share of the gradient and the
    copies drifted apart silently (0.04 from one process's weight after two steps here)."""
    for name in ("1F1B", "ZB-H1"):
        for rank, (worst, tie, norms) in enumerate(
                world2.run(_tie_unfrozen_after_construction, name)):
            assert worst <= 1e-5 and tie <= 1e-5, (name, rank, worst, tie)
            for mine, one_process in norms:
                assert mine == pytest.approx(one_process, rel=1e-5), (name, rank, norms)


def _one_copy_frozen():
    """Rank 1 freezes its copy of the tied weight, rank 0 does not: the first step raises."""
    parts, mine = _tied_gpt_stages(2, "loop")
    if dist.get_rank() == 1:
        parts[1][-1].weight.requires_grad_(False)
    stage = PipelineStage(parts[mine[0]], mine[0], 2)
    schedule = Schedule1F1B(stage, 2, token_cross_entropy)
    idx, target = synthetic_batch(TIED_GPT, 4, 0)
    with pytest.raises(ValueError) as info:
        schedule.step(idx, target=target)
    return str(info.value)


def test_tied_weight_frozen_on_one_rank_only_is_one_clear_error(world2):
    """One copy frozen, the other not, used to leave the trainable rank waiting forever."""
    errors = world2.run(_one_copy_frozen)
    assert errors[0] == errors[1], errors
    assert "frozen (requires_grad=False) on group rank 1 and trainable on group rank 0" \
        in errors[0], errors[0]


def _unused_outputs_all_schedules():
    from tests.nn.test_pipe_forward_only import SCHEDULES as FORK_SCHEDULES, _unused_outputs

    return {name: _unused_outputs(name) for name in FORK_SCHEDULES}


def test_an_output_the_next_stage_does_not_use_gets_no_gradient_on_four_ranks(world4):
    """Four ranks (eight stages under the interleaved schedule and ZBV), every schedule: a
    stage output that later stages ignore or detach on some micro-batches leaves ``.grad``
    ``None`` where one process does, and training matches one process (see
    tests/nn/test_pipe_forward_only.py for two ranks)."""
    for rank, results in enumerate(world4.run(_unused_outputs_all_schedules)):
        for name, result in results.items():
            assert result["one_sided"] == [], (rank, name, result)
            assert result["worst"] < 1e-5, (rank, name, result)
