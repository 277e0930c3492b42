"""shardkit.initialize corners a DeepSpeed user reaches: an optimizer over only some of the
trainable parameters (stages 1 and 2), ``engine.deepspeed_io`` and ``engine.training_dataloader``,
the engine's own AttributeError, an fp16 loss scale starting below its floor, Hugging Face's
"auto" values, a model handed over in fp16/bf16 (fp32 master weights), ``lr_kwargs`` the
scheduler does not take, DeepSpeed's ``module_state_dict`` arguments, ``load_module_state_dict``
and ``was_step_applied`` inside an accumulation window.

One world of 2 gloo ranks for the module; each check trains a few steps against one process.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.config import ConfigError, load_config
from shardkit.testing import world_fixture
from tests.utils.master_weights import fp32_weights, master_dtype

world2 = world_fixture(2)

WIDTH = 8


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def _batch(step: int, world: int):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(2 * world, WIDTH, generator=gen), torch.randn(2 * world, 4, generator=gen)


def _head_only(stage: int, how: str):
    """The optimizer steps only the head (``model_parameters=`` the head, or an optimizer built
    over it), the body still requires grad: DeepSpeed trains the head and leaves the body.
    Returns the largest difference from one process doing the same, or the refusal's text."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": stage}, "gradient_clipping": 0.5,
              "steps_per_print": 1000}
    model, reference = _model(), _model()
    kwargs = {}
    if how == "config":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}
        kwargs["model_parameters"] = list(model[4].parameters())
    else:
        kwargs["optimizer"] = torch.optim.AdamW(model[4].parameters(), lr=0.01)
    try:
        engine, *_ = shardkit.initialize(model=model, config=config, **kwargs)
    except ConfigError as error:
        return str(error)
    oracle = torch.optim.AdamW(reference[4].parameters(), lr=0.01, weight_decay=0.01)
    for step in range(3):
        batches = [_batch(2 * step + k, world) for k in range(2)]
        for x, y in batches:
            engine.backward(F.mse_loss(engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]))
            engine.step()
        oracle.zero_grad()
        (sum(F.mse_loss(reference(x), y) for x, y in batches) / 2).backward()
        torch.nn.utils.clip_grad_norm_(reference[4].parameters(), 0.5)
        oracle.step()
    full = engine.module_state_dict()
    return max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())


@pytest.mark.parametrize("how", ["config", "object"])
def test_optimizer_over_some_trainable_parameters(world2, how):
    # stage 1 (reduce_scatter on by default) trained until its backward failed in the
    # owners' hook ("a DDP parameter ... is not in the OSS optimizer"); stages 0 and 3 clipped
    # by a norm that counted the body's gradients too (at stage 0 never cleared, so growing)
    for stage in (0, 1, 3):
        for diff in world2.run(_head_only, stage, how):
            assert diff < 1e-6, (stage, diff)
    # stage 2 cannot: refused before any collective, naming the parameters and the way out
    for message in world2.run(_head_only, 2, how):
        assert "zero_optimization.stage=2" in message
        assert "'0.weight'" in message and "requires_grad=False" in message


class _Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 11

    def __getitem__(self, index):
        return {"x": torch.full((WIDTH,), float(index)), "index": index}


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


def _collate(items):
    return {"x": torch.stack([item["x"] for item in items]),
            "index": [item["index"] for item in items]}


def _data_loaders():
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, loader, _ = shardkit.initialize(model=_model(), config=config,
                                               training_data=_Numbers(), collate_fn=_collate)
    evaluation = engine.deepspeed_io(_Numbers(), batch_size=3, route="eval")
    errors = []
    for bad in ({"route": "test"}, {"batch_size": 0}):
        try:
            engine.deepspeed_io(_Numbers(), **bad)
        except ValueError as error:
            errors.append(str(error))
    try:
        engine.no_such_method()
    except AttributeError as error:
        errors.append(str(error))
    try:  # refused before any wrapper is built (it was DistributedSampler's TypeError after)
        shardkit.initialize(model=_model(), config=config, training_data=_Stream())
    except ValueError as error:
        errors.append(str(error))
    try:  # DeepSpeed's argument, refused before anything is read (it was a TypeError)
        engine.load_checkpoint("/nonexistent", custom_load_fn=lambda src, dst: None)
    except ValueError as error:
        errors.append(str(error))
    return (engine.training_dataloader is loader, len(loader),
            [batch["index"] for batch in evaluation], errors)


def test_deepspeed_io_and_training_dataloader(world2):
    shares = []
    for same, batches, evaluation, errors in world2.run(_data_loaders):
        assert same and batches == 3  # 11 samples: 6 a rank (padded), micro-batches of 2
        assert all(len(b) == 3 for b in evaluation[:-1])  # the given batch size and collate_fn
        shares.append([i for batch in evaluation for i in batch])
        assert "route='test'" in errors[0] and "'eval'" in errors[0]
        assert "batch_size=0" in errors[1]
        assert "'ShardedEngine' object has no attribute 'no_such_method'" in errors[2]
        assert "initialize(training_data=<_Stream>): an IterableDataset" in errors[3]
        assert "load_checkpoint(custom_load_fn=...): not supported" in errors[4]
    # route "eval": in order, each rank its DistributedSampler share (no shuffle)
    assert shares == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 0]]


def test_fp16_scale_starting_below_its_floor_is_a_config_error():
    config = {"train_batch_size": 2, "fp16": {"enabled": True, "initial_scale_power": 1,
                                              "min_loss_scale": 4}}
    with pytest.raises(ConfigError, match="initial_scale_power=1.*min_loss_scale=4"):
        load_config(config, 1)
    config["fp16"]["initial_scale_power"] = 2  # 4: at the floor, valid
    assert load_config(config, 1).precision.min_loss_scale == 4


def test_hugging_face_auto_values_are_all_named_at_once():
    # a Trainer-style config passed as it is: each "auto" key is named in one ConfigError
    # (it named the first, as a wrong type, one run at a time); a string field keeps "auto"
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
              "tensorboard": {"enabled": False, "output_path": "auto"}}
    with pytest.raises(ConfigError) as caught:
        load_config(config, 2)
    message = str(caught.value)
    for key in ("train_micro_batch_size_per_gpu", "gradient_clipping", "optimizer.params.lr"):
        assert f"'{key}'" in message, message
    # a bucket size only tunes: "auto" takes DeepSpeed's default there, as in DeepSpeed
    assert "Hugging Face" in message and "tensorboard" not in message
    assert "reduce_bucket_size" not in message


def _scheduler_refusals():
    model = _model()
    object_on_other = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters()), 2)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    out = []
    for scheduler, section in ((object_on_other, True), (5, True), (5, False)):
        kwargs = {} if section else {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
        try:
            shardkit.initialize(model=model, lr_scheduler=scheduler, config={
                k: v for k, v in config.items() if section or k != "optimizer"}, **kwargs)
            out.append("accepted")
        except (TypeError, ValueError) as error:
            out.append(str(error))
    return out


def test_lr_scheduler_refusals_say_what_to_pass(world2):
    for built_from_config, number, number_beside_object in world2.run(_scheduler_refusals):
        # it said "attached to the optimizer passed as optimizer=...", which was not passed
        assert "the config's 'optimizer' section" in built_from_config
        assert "lr_scheduler=lambda opt: StepLR(opt, ...)" in built_from_config
        # it was "'int' object is not callable", after the wrappers were built
        for message in (number, number_beside_object):
            assert "initialize(lr_scheduler=5): expected a scheduler" in message


def _left_out_then_added(stage: int):
    """The body left out of the optimizer at initialize, added later by add_param_group
    (gradual unfreezing): it trains from then on (the left-out list is read at each step)."""
    rank = distributed.get_rank()
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "steps_per_print": 1000}
    engine, optimizer, *_ = shardkit.initialize(
        model=model, config=config, optimizer=torch.optim.SGD(model[4].parameters(), lr=0.1))
    start = engine.module_state_dict()["0.weight"].clone()
    optimizer.add_param_group({"params": [model[0].weight, model[0].bias]})
    x, y = _batch(0, distributed.get_world_size())
    engine.backward(F.mse_loss(engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]))
    engine.step()
    return (engine.module_state_dict()["0.weight"] - start).abs().max().item()


def test_parameters_added_to_the_optimizer_later_train(world2):
    for stage in (0, 1, 3):
        for moved in world2.run(_left_out_then_added, stage):
            assert moved > 0, stage  # it was cleared at every step: never trained


def _named_groups(stage: int):
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "steps_per_print": 1000, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = shardkit.initialize(model=model, config=config,
                                     model_parameters=[{"params": model.named_parameters()}])
    return engine.composition.stage


def test_named_parameters_in_param_groups_leave_nothing_out(world2):
    # torch's optimizers take (name, parameter) pairs: they were all read as left out
    # (stage 2 refused, stage 1 fell back to the all-reduce; a generator was consumed)
    for stage in (1, 2):
        assert world2.run(_named_groups, stage) == [stage, stage]


class _Times10(nn.Module):
    def forward(self, items):
        return _collate(items)["x"] * 10


def _module_collate():
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, loader, _ = shardkit.initialize(model=_model(), config=config,
                                               training_data=_Numbers(), collate_fn=_Times10())
    try:
        engine.deepspeed_io(_Stream(), data_sampler=torch.utils.data.SequentialSampler(range(4)))
        refused = ""
    except ValueError as error:
        refused = str(error)
    evaluation = engine.deepspeed_io(_Numbers(), route="eval")
    return (next(iter(evaluation))[:, 0].tolist(), "collate_fn" in engine._modules, refused,
            next(iter(loader)).abs().max().item() % 10)


def test_collate_fn_module_and_iterable_dataset_with_sampler(world2):
    for first, registered, refused, remainder in world2.run(_module_collate):
        assert not registered and remainder == 0
        assert first in ([0.0, 20.0], [10.0, 30.0])  # eval: in order, the collate module's
        assert "engine.deepspeed_io(dataset=<_Stream>): an IterableDataset" in refused


def _sixteen_bit_model(stage: int, precision: str, how: str):
    """A model handed over in fp16/bf16 (``from_pretrained(torch_dtype=...)``) trained with
    that precision: against one process stepping fp32 master weights under autocast, the way
    DeepSpeed trains it. Returns the largest difference of the engine's fp32 weights (the
    optimizer's masters at stages 0-2, FSDP's shards at stage 3), the parameters' dtypes and
    the dtype the optimizer steps."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    reference = _model()
    with torch.no_grad():  # the values a 16-bit checkpoint holds
        for p in reference.parameters():
            p.copy_(p.to(half).float())
    model = _model().to(half)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "steps_per_print": 1000, precision: {"enabled": True}}
    kwargs = {"optimizer": torch.optim.Adam(model.parameters(), lr=1e-4)} if how == "object" \
        else {}
    if how == "config":
        config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False}}
    engine, *_ = shardkit.initialize(model=model, config=config, **kwargs)
    oracle = torch.optim.Adam(reference.parameters(), lr=1e-4)
    scale = engine.loss_scale
    for step in range(3):
        x, y = _batch(step, world)
        engine.backward(F.mse_loss(engine(x[2 * rank:2 * rank + 2]).float(),
                                   y[2 * rank:2 * rank + 2]))
        engine.step()
        with torch.autocast("cpu", dtype=half):
            out = reference(x)
        (F.mse_loss(out.float(), y) * scale).backward()
        for p in reference.parameters():
            p.grad /= scale
        oracle.step()
        oracle.zero_grad()
    full = fp32_weights(engine)
    diff = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return diff, sorted({str(p.dtype) for p in model.parameters()}), \
        str(master_dtype(engine)), engine.skipped_steps


def _frozen_16_bit_base(stage: int):
    """A LoRA-style model: a frozen bf16 body, a trainable bf16 head. Only the head (what the
    optimizer steps) gets fp32 weights: at stages 0-2 the optimizer's fp32 masters of the bf16
    head, at stage 3 the head itself becomes fp32; the frozen body keeps its 16-bit memory, as
    in DeepSpeed. Returns the body's and the head's dtypes and the dtype the optimizer steps."""
    model = _model().to(torch.bfloat16)
    for p in model[:4].parameters():
        p.requires_grad_(False)
    engine, *_ = shardkit.initialize(
        model=model, model_parameters=list(model[4].parameters()),
        config={"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                "zero_optimization": {"stage": stage}, "steps_per_print": 1000,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}})
    return sorted({str(p.dtype) for p in model[:4].parameters()}), \
        sorted({str(p.dtype) for p in model[4].parameters()}), str(master_dtype(engine))


def _frozen_and_trained_in_one_unit(stage: int, adapters_fp32: bool = False):
    """Stage 3: a frozen bf16 weight beside a trainable bias in one FSDP unit (BitFit; a LoRA
    block is the same) trains, and so the frozen weights become fp32 too: a unit holds one
    dtype. Before, initialize raised FSDP's "one unit's parameters must share a dtype"."""
    model = _model().to(torch.bfloat16)
    for layer in (model[0], model[2], model[4]):
        layer.weight.requires_grad_(False)
        if adapters_fp32:  # PEFT keeps its adapters fp32 beside a 16-bit base
            layer.bias.data = layer.bias.data.float()
    engine, *_ = shardkit.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config={"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                "zero_optimization": {"stage": stage}, "steps_per_print": 1000,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    rank, world = distributed.get_rank(), distributed.get_world_size()
    x, y = _batch(0, world)
    before = engine.module_state_dict()
    engine.backward(F.mse_loss(engine(x[2 * rank:2 * rank + 2]).float(),
                               y[2 * rank:2 * rank + 2]))
    engine.step()
    after = engine.module_state_dict()
    return sorted({str(v.dtype) for v in after.values()}), \
        [k for k in before if not torch.equal(before[k], after[k])]


def test_a_frozen_16_bit_body_stays_16_bit(world2):
    # at stage 3 too while the frozen weights have units of their own; only a unit that
    # mixes them with fp32 ones (an FSDP unit holds one dtype) makes them fp32
    for stage in (0, 3):
        for frozen, trained, stepped in world2.run(_frozen_16_bit_base, stage):
            # the head: bf16 weights with fp32 masters at stages 0-2, fp32 itself at stage 3
            head = "torch.float32" if stage == 3 else "torch.bfloat16"
            assert frozen == ["torch.bfloat16"] and trained == [head], (stage, trained)
            assert stepped == "torch.float32", (stage, stepped)
    for dtypes, moved in world2.run(_frozen_and_trained_in_one_unit, 3):
        assert dtypes == ["torch.float32"] and moved == ["0.bias", "2.bias", "4.bias"], moved
    for dtypes, moved in world2.run(_frozen_and_trained_in_one_unit, 3, adapters_fp32=True):
        assert dtypes == ["torch.float32"] and moved == ["0.bias", "2.bias", "4.bias"], moved


_HALF_NAMES = {"bf16": "bfloat16", "fp16": "float16"}


def test_a_16_bit_model_trains_on_fp32_master_weights(world2):
    # the 16-bit weights were stepped in place: bf16 lost the lr-1e-4 updates (3.0e-4 off
    # after 3 steps), fp16 Adam's eps underflowed and the weights became inf (the next steps
    # skipped); now 9e-7 (bf16: the ranks' halves of the batch round apart). At stages 0-2
    # the weights stay 16-bit and the optimizer's fp32 masters are compared; at stage 3 FSDP's
    # fp32 shards are the masters
    for stage, precision, how in ((0, "bf16", "object"), (3, "bf16", "config"),
                                  (2, "fp16", "config"), (1, "fp16", "object")):
        for diff, dtypes, stepped, skipped in world2.run(_sixteen_bit_model, stage, precision,
                                                         how):
            weights = "torch.float32" if stage == 3 else f"torch.{_HALF_NAMES[precision]}"
            assert dtypes == [weights] and stepped == "torch.float32" and skipped == 0, \
                (stage, precision, dtypes, stepped)
            assert diff < 1e-5, (stage, precision, how, diff)


def _bad_lr_kwargs():
    rank, world = distributed.get_rank(), distributed.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "zero_optimization": {"stage": 2},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.05,
                                                           "warmup_num_steps": 4}}}
    engine, *_ = shardkit.initialize(model=_model(), config=config)
    start = engine.module_state_dict()["0.weight"].clone()
    x, y = _batch(0, world)
    engine.backward(F.mse_loss(engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]))
    try:
        engine.step(lr_kwargs={"epoch": 3})
        refused = "accepted"
    except ValueError as error:
        refused = str(error)
    unchanged = torch.equal(engine.module_state_dict()["0.weight"], start)
    engine.step(lr_kwargs={"last_batch_iteration": 3})  # the same step, with a valid argument
    moved = not torch.equal(engine.module_state_dict()["0.weight"], start)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau, *_ = shardkit.initialize(
        model=model, optimizer=optimizer, config={"train_micro_batch_size_per_gpu": 2},
        lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer))
    plateau.backward(F.mse_loss(plateau(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]))
    try:
        plateau.step()  # torch's ReduceLROnPlateau needs lr_kwargs={"metrics": ...}
        missing = "accepted"
    except ValueError as error:
        missing = str(error)
    plateau.step(lr_kwargs={"metrics": 1.0})
    # with accumulation the scheduler steps at the boundary only: the micro-steps before it
    # take no lr_kwargs (DeepSpeed ignores them there)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulating, *_ = shardkit.initialize(
        model=model, optimizer=optimizer, config={"train_micro_batch_size_per_gpu": 2,
                                                  "gradient_accumulation_steps": 2},
        lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer))
    for micro in range(2):
        accumulating.backward(F.mse_loss(accumulating(x[2 * rank:2 * rank + 2]),
                                         y[2 * rank:2 * rank + 2]))
        accumulating.step(lr_kwargs={"metrics": 1.0} if micro == 1 else None)
    return refused, unchanged, moved, engine.global_steps, engine.get_lr(), missing, \
        plateau.global_steps + accumulating.global_steps - 1


def test_lr_kwargs_the_scheduler_does_not_take_are_refused_before_the_step(world2):
    # the scheduler's TypeError came after the optimizer had stepped (a retry stepped twice)
    for refused, unchanged, moved, steps, lrs, missing, plateau_steps in \
            world2.run(_bad_lr_kwargs):
        assert "engine.step(lr_kwargs={'epoch': 3})" in refused, refused
        assert "WarmupLR.step(last_batch_iteration)" in refused, refused
        assert unchanged and moved and steps == 1 and lrs == [pytest.approx(0.1)]
        assert "ReduceLROnPlateau.step(metrics, epoch)" in missing, missing
        assert "'metrics'" in missing and plateau_steps == 1, missing


def _module_state_round_trip(stage: int):
    """DeepSpeed's ``was_step_applied()`` after each ``step()`` of a 2-micro-batch window,
    ``module_state_dict(prefix=, exclude_frozen_parameters=)`` and
    ``load_module_state_dict({"module": ...})``: the engine trains a step, is loaded back
    to its starting weights, and then trains like one process from those."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    model, reference = _model(), _model()
    model[0].bias.requires_grad_(False)
    reference[0].bias.requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    engine, *_ = shardkit.initialize(
        model=model, optimizer=torch.optim.SGD([p for p in model.parameters()
                                                if p.requires_grad], lr=0.1), config=config)
    oracle = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    start = {k: v.clone() for k, v in engine.module_state_dict().items()}
    keys = (sorted(engine.module_state_dict(prefix="model.")),
            sorted(engine.module_state_dict(exclude_frozen_parameters=True)))
    applied = []
    for step in range(3):
        if step == 1:  # back to the start: the one process never took step 0
            engine.load_module_state_dict({"module": start})
        batches = [_batch(2 * step + k, world) for k in range(2)]
        for x, y in batches:
            engine.backward(F.mse_loss(engine(x[2 * rank:2 * rank + 2]),
                                       y[2 * rank:2 * rank + 2]))
            engine.step()
            applied.append(engine.was_step_applied())
        if step:
            oracle.zero_grad()
            (sum(F.mse_loss(reference(x), y) for x, y in batches) / 2).backward()
            oracle.step()
    try:
        engine.load_module_state_dict({"module": {"0.weight": start["0.weight"]}})
        refused = "accepted"
    except RuntimeError as error:
        refused = str(error)
    full = engine.module_state_dict()
    diff = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return applied, keys, diff, refused


def test_module_state_dict_arguments_load_and_was_step_applied(world2):
    # module_state_dict() took no DeepSpeed arguments (TypeError), load_module_state_dict was
    # missing (AttributeError), and was_step_applied() stayed True after the step() of a
    # micro-batch inside the window, which DeepSpeed reports False (no update)
    names = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    for stage in (0, 1, 2, 3):
        for applied, (prefixed, unfrozen), diff, refused in \
                world2.run(_module_state_round_trip, stage):
            assert applied == [False, True] * 3, (stage, applied)
            assert prefixed == sorted("model." + k for k in names), prefixed
            assert unfrozen == sorted(k for k in names if k != "0.bias"), unfrozen
            assert diff < 1e-6, (stage, diff)
            assert "missing keys ['0.bias', '2.bias'" in refused, refused


def _optimizer_of_another_model(stage: int, how: str):
    """An optimizer (or ``model_parameters=``) over another model's parameters: no stage
    averages their gradients, and the model itself would never train (stages 0, 1 and 3 ran
    and left it unchanged, silently)."""
    model, other = _model(), _model()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "steps_per_print": 1000}
    if how == "optimizer":
        kwargs = {"optimizer": torch.optim.SGD(other.parameters(), lr=0.1)}
    else:
        config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
        kwargs = {"model_parameters": list(model[4].parameters()) + [other[0].weight]}
    try:
        shardkit.initialize(model=model, config=config, **kwargs)
    except ConfigError as error:
        return str(error)
    return "accepted"


def test_an_optimizer_over_tensors_outside_the_model_is_refused_at_every_stage(world2):
    for stage in (0, 1, 2, 3):
        for message in world2.run(_optimizer_of_another_model, stage, "optimizer"):
            assert "holds 6 of 6 tensors that are not parameters of model" in message, message
        for message in world2.run(_optimizer_of_another_model, stage, "model_parameters"):
            assert "holds 1 of 3 tensors that are not parameters of model" in message, message


def _flat_named_parameters(stage: int):
    """``model_parameters=model.named_parameters()`` (a flat list of pairs, as torch's
    optimizers take): every parameter trains (the pairs' names were read as tensors outside
    the model, and initialize failed on their missing shape)."""
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "steps_per_print": 1000, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = shardkit.initialize(model=model, config=config,
                                     model_parameters=model.named_parameters())
    before = {k: v.clone() for k, v in engine.module_state_dict().items()}
    rank = distributed.get_rank()
    x, y = _batch(0, distributed.get_world_size())
    engine.backward(F.mse_loss(engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]))
    engine.step()
    after = engine.module_state_dict()
    return sorted(k for k in before if not torch.equal(before[k], after[k]))


def test_flat_named_parameters_train_every_parameter(world2):
    names = [n for n, _ in _model().named_parameters()]
    for stage in (0, 1, 2, 3):
        for moved in world2.run(_flat_named_parameters, stage):
            assert moved == sorted(names), stage
