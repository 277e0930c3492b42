"""FairScale's FullyShardedDataParallel arguments and methods beyond the core set: a FairScale
user's constructor call and training loop run unchanged, each option does what FairScale's did,
and bad values raise before any collective."""

import warnings

import pytest
import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit.distributed import CommCounter
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.testing import world_fixture
from tests.nn.fsdp_common import (GLOBAL_BATCH, TINY, build_gpt, make_optimizer, max_diff,
                                  train_step, wrap_gpt)

world2 = world_fixture(2)

STEPS = 3

# every FairScale-only argument, at a value that changes something where it can on CPU
FAIRSCALE_KWARGS = dict(disable_reshard_on_root=False, move_grads_to_cpu=False, bucket_cap_mb=0,
                        compute_device="cpu", no_broadcast_optim_state=False,
                        state_dict_device="cpu", clear_autocast_cache=True,
                        force_input_to_fp32=True, verbose=True, state_dict_on_rank_0_only=False,
                        gradient_predivide_factor=2.0, allow_reset_parameters=True)


def _parity_with_every_fairscale_argument():
    """Parity with single-process training, step by step, with all the extra arguments set
    (a reduce-scatter group of its own, the root resharded, gradients pre-divided by 2)."""
    reduce_group = skdist.new_group(list(range(skdist.get_world_size())))
    reference = build_gpt()
    ref_optim = make_optimizer(reference)
    model = wrap_gpt(build_gpt(), process_group_reduce_scatter=reduce_group, **FAIRSCALE_KWARGS)
    optim = make_optimizer(model)
    worst = 0.0
    for step in range(STEPS):
        train_step(reference, ref_optim, step, local=False, clip=1.0)
        train_step(model, optim, step, clip=1.0)
        worst = max(worst, max_diff(model.state_dict(), reference.state_dict()))
    units = model.sharded_units()
    return {"worst": worst,
            "repr": sum("gradient_postdivide_factor=1.0" in u.extra_repr() for u in units),
            "units": len(units),
            "uses_group": all(u._shard is None or u._shard.reduce_group is reduce_group
                              for u in units)}


def _root_bytes(disable_reshard_on_root: bool):
    model = wrap_gpt(build_gpt(), disable_reshard_on_root=disable_reshard_on_root)
    optim = make_optimizer(model)
    train_step(model, optim, 0)
    with CommCounter() as counter:
        train_step(model, optim, 1)
    root = model.sharded_units()[0]
    return counter.calls_by_op["all_gather"], root.local_numel, counter.by_op["all_gather"]


def _root_reshard_bytes():
    kept_calls, root_local, kept = _root_bytes(True)
    freed_calls, _, freed = _root_bytes(False)
    return {"extra_calls": freed_calls - kept_calls, "extra_bytes": freed - kept,
            "root_bytes": root_local * (skdist.get_world_size() - 1) * 4}


def _state_dict_options():
    out = {}
    model = wrap_gpt(build_gpt(), state_dict_on_rank_0_only=True)
    sd = model.state_dict()
    out["rank0_only_keys"] = len(sd)
    out["full_keys"] = len(build_gpt().state_dict())
    moved = wrap_gpt(build_gpt(), state_dict_device=torch.device("meta"))
    out["devices"] = sorted({v.device.type for v in moved.state_dict().values()})
    return out


class _DtypeProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append(x.dtype)
        return self.lin(x.to(self.lin.weight.dtype))


def _inputs_and_summon():
    out = {}
    forced = FSDP(_DtypeProbe(), force_input_to_fp32=True)
    plain = FSDP(_DtypeProbe())
    x = torch.randn(2, 4).to(torch.bfloat16)
    forced(x)
    plain(x)
    out["forced"], out["plain"] = str(forced.module.seen[0]), str(plain.module.seen[0])
    model = FSDP(nn.Linear(4, 6))
    with model.summon_full_params(volatile=True), torch.no_grad():
        model.module.weight.fill_(3.0)
    with model.summon_full_params(volatile=False), torch.no_grad():
        out["volatile_dropped"] = not bool((model.module.weight == 3.0).any())
        model.module.weight.fill_(5.0)
    with model.summon_full_params():
        out["kept"] = bool((model.module.weight == 5.0).all())
    try:
        with model.summon_full_params(volatile=True, writeback=True):
            pass
        out["contradiction"] = "accepted"
    except ValueError as error:
        out["contradiction"] = str(error)
    return out


def _divide_factors_and_apply():
    out = {}
    torch.manual_seed(0)
    x = torch.randn(GLOBAL_BATCH, 4)
    mine = x.chunk(skdist.get_world_size())[skdist.get_rank()]

    mean_model = FSDP(_seeded_linear())
    sum_model = FSDP(_seeded_linear())
    sum_model.set_gradient_divide_factors(1.0, 1.0, recursive=True)
    for m in (mean_model, sum_model):
        m(mine).pow(2).sum().backward()
    out["sum_over_mean"] = (sum_model.module.weight.grad
                            / mean_model.module.weight.grad).flatten().tolist()
    out["params_with_grad"] = len(sum_model.params_with_grad)
    out["cpu_offload"] = sum_model.cpu_offload

    model = FSDP(nn.Sequential(FSDP(nn.Linear(4, 6)), nn.Linear(6, 2)))
    # FairScale's .params: each unit's own parameters (rows of), not its nested units'
    out["own_params"] = [[tuple(p.shape) for p in unit.params] for unit in model.sharded_units()]
    out["no_own_params"] = FSDP(nn.Sequential(FSDP(nn.Linear(4, 6)))).params
    shapes = []

    def init(module):
        if isinstance(module, nn.Linear):
            shapes.append(tuple(module.weight.shape))
            with torch.no_grad():
                module.weight.fill_(0.5)
    assert model.apply(init) is model
    out["apply_shapes"] = shapes
    with model.summon_full_params():
        out["apply_written"] = all(bool((m.weight == 0.5).all())
                                   for m in model.modules() if isinstance(m, nn.Linear))

    try:
        FSDP(nn.Linear(4, 6)).reset_parameters()
        out["reset_refused"] = "accepted"
    except RuntimeError as error:
        out["reset_refused"] = str(error)
    allowed = FSDP(nn.Linear(4, 6), allow_reset_parameters=True)
    with allowed.summon_full_params(), torch.no_grad():
        allowed.module.weight.fill_(9.0)
    allowed.reset_parameters()
    with allowed.summon_full_params():
        out["reset_shape"] = tuple(allowed.module.weight.shape)
        out["reset_changed"] = not bool((allowed.module.weight == 9.0).any())
        weight = allowed.module.weight.detach().clone()
    everyone = [torch.empty_like(weight) for _ in range(skdist.get_world_size())]
    skdist.all_gather(everyone, weight)
    out["reset_same_everywhere"] = all(torch.equal(w, weight) for w in everyone)
    return out


def _seeded_linear():
    torch.manual_seed(1)
    return nn.Linear(4, 6)


def _no_broadcast_optim_state():
    model = wrap_gpt(build_gpt(), nested=False, no_broadcast_optim_state=True)
    optim = make_optimizer(model)
    train_step(model, optim, 0)
    full = model.gather_full_optim_state_dict(optim)
    gathered = wrap_gpt(build_gpt(), nested=False)
    gathered_optim = make_optimizer(gathered)
    train_step(gathered, gathered_optim, 0)
    reference = gathered.gather_full_optim_state_dict(gathered_optim)
    if full is None:
        return None
    index = full["param_names"].index("blocks.0.fc.weight")
    return {"kept": tuple(full["state"][index]["exp_avg"].shape),
            "full": tuple(reference["state"][index]["exp_avg"].shape)}


def _sync_module_states():
    """Ranks that initialised differently: with sync_module_states (and through compose at
    stage 3) every rank trains rank 0's model; without, each rank's rows come from its own."""
    from shardkit.recipes import adamw, compose

    def differing():
        torch.manual_seed(100 + skdist.get_rank())  # unseeded in effect: another init per rank
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
        model[1].running_mean.fill_(float(skdist.get_rank()))
        return model

    def full_state(wrapped):
        with wrapped.summon_full_params():
            params = torch.cat([p.detach().reshape(-1) for p in wrapped.parameters()])
        return torch.cat([params, wrapped.module[1].running_mean])

    torch.manual_seed(100)
    rank0_model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    rank0_state = torch.cat([torch.cat([p.detach().reshape(-1)
                                        for p in rank0_model.parameters()]), torch.zeros(6)])
    with CommCounter() as counter:
        synced = FSDP(differing(), sync_module_states=True)
    composed = compose(differing(), 3, adamw(1e-3)).wrapped
    return {"synced": torch.equal(full_state(synced), rank0_state),
            "composed": torch.equal(full_state(composed), rank0_state),
            "plain": torch.equal(full_state(FSDP(differing())), rank0_state),
            "broadcast_bytes": counter.by_op.get("broadcast", 0)}


def _resolved_attributes():
    """FairScale's attributes of the resolved precision and device, per argument combination."""
    def attrs(**kwargs):
        unit = FSDP(nn.Linear(4, 4), **kwargs)
        return (unit.compute_dtype, unit.buffer_dtype, unit.fp32_reduce_scatter,
                str(unit.compute_device), unit.mixed_precision)
    from shardkit.nn.data_parallel.mixed_precision import MixedPrecisionPolicy
    return {
        "plain": attrs(),
        "mixed": attrs(mixed_precision=True),
        "bf16_fp32_reduce": attrs(compute_dtype=torch.bfloat16, fp32_reduce_scatter=True,
                                  buffer_dtype=torch.float32),
        "policy": attrs(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                             reduce_dtype=torch.float32)),
        "offloaded": attrs(move_params_to_cpu=True),
        "double": FSDP(nn.Linear(4, 4).double()).compute_dtype,
    }


class _StateProbe(nn.Module):
    """Records every unit's training_state as the forward, and later the backward, pass it."""

    def __init__(self, name: str, log: list):
        super().__init__()
        self.name, self.log, self.units = name, log, []

    def _states(self) -> dict:
        return {which: u.training_state.name for which, u in self.units}

    def forward(self, x):
        self.log.append((self.name, "forward", self._states()))
        if x.requires_grad:
            x.register_hook(lambda g: self.log.append((self.name, "backward", self._states())))
        return x


def _training_states():
    """FairScale's TrainingState through forward, backward, summon_full_params and assert_state;
    get_fsdp_instances; auto_wrap_bn."""
    from shardkit.nn.data_parallel import TrainingState, auto_wrap_bn, get_fsdp_instances
    log: list = []
    first, middle = _StateProbe("first", log), _StateProbe("middle", log)
    inner = FSDP(nn.Linear(4, 6))
    model = FSDP(nn.Sequential(first, inner, middle, nn.Linear(6, 2)))
    for probe in (first, middle):
        probe.units = [("root", model), ("inner", inner)]
    out = {"before": [u.training_state.name for u in (model, inner)]}
    x = torch.randn(GLOBAL_BATCH, 4, requires_grad=True)
    model(x).sum().backward()
    out["log"] = log
    out["after"] = [u.training_state.name for u in (model, inner)]
    model.assert_state(TrainingState.IDLE)
    model.assert_state([TrainingState.IDLE, TrainingState.FORWARD])
    with model.summon_full_params():
        out["summoned"] = [u.training_state.name for u in (model, inner)]
        try:
            inner.assert_state(TrainingState.IDLE)
            out["wrong_state"] = "accepted"
        except ValueError as error:
            out["wrong_state"] = str(error)
    out["after_summon"] = [u.training_state.name for u in (model, inner)]
    try:
        model.assert_state("IDLE")
        out["not_a_state"] = "accepted"
    except TypeError as error:
        out["not_a_state"] = str(error)
    with torch.no_grad():
        probe_x = torch.randn(2, 4)
        before_reset = model(probe_x)
    out["after_no_grad"] = model.training_state.name
    # FairScale's checkpoint reload: load_state_dict, then _reset_lazy_init, then train on
    model.load_state_dict(model.state_dict())
    model._reset_lazy_init()
    model(x).sum().backward()
    with torch.no_grad():
        out["reset_lazy"] = (model(probe_x) - before_reset).abs().max().item()
    out["reset_root"] = (model._is_root, inner._is_root, inner._root is model)
    out["instances"] = [u is v for u, v in zip(get_fsdp_instances(model), (model, inner))]
    empty = FSDP(nn.Sequential(FSDP(nn.Linear(4, 4))))
    out["skip_empty"] = (len(get_fsdp_instances(empty)),
                         len(get_fsdp_instances(empty, skip_empty=True)))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    wrapped = FSDP(auto_wrap_bn(net), mixed_precision=True)
    bn_units = [u for u in get_fsdp_instances(wrapped) if u is not wrapped]
    out["bn_units"] = [(type(u.module).__name__, u.mixed_precision, u.reshard_after_forward,
                        u.compute_dtype) for u in bn_units]
    out["root_dtype"] = wrapped.compute_dtype
    output = wrapped(torch.randn(GLOBAL_BATCH, 4))
    output.float().sum().backward()
    norm = bn_units[0].module
    out["bn_trained"] = (output.dtype, norm.running_mean.dtype, norm.weight.grad.dtype,
                         bool(norm.running_mean.abs().sum() > 0))
    tagged = nn.BatchNorm1d(3)
    tagged.wrapper_config = {"reshard_after_forward": True}  # as another policy would
    try:
        auto_wrap_bn(nn.Sequential(tagged))
        out["collision"] = "accepted"
    except ValueError as error:
        out["collision"] = str(error)
    single = auto_wrap_bn(nn.Sequential(nn.BatchNorm1d(3)), single_rank_pg=True)
    out["single_rank_world"] = single[0].world_size
    out["conv_bn_losses"] = _conv_bn_losses()
    return out


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 4, kernel_size=3), nn.BatchNorm2d(4), nn.ReLU()),
        nn.Sequential(nn.Conv2d(4, 8, kernel_size=3), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten()),
        nn.Linear(8, 10))


def _conv_bn_losses():
    """FairScale's FSDP(checkpoint(FSDP(BatchNorm))) pattern: BatchNorms wrapped by auto_wrap_bn,
    a checkpointed block, several forwards (images of two sizes) before one backward; the
    losses of the FSDP model and of the plain one, step by step (every rank has the same batch,
    so the mean gradient is the local one)."""
    from shardkit.nn import checkpoint_wrapper
    from shardkit.nn.data_parallel import auto_wrap_bn
    from shardkit.nn.wrap import enable_wrap, wrap
    torch.manual_seed(1)
    images = [torch.randn(2, 3, 12, 12), torch.randn(2, 3, 9, 9)]
    plain = _conv_net()
    sharded = _conv_net()
    sharded[0] = auto_wrap_bn(sharded[0])
    sharded[1] = checkpoint_wrapper(auto_wrap_bn(sharded[1]))
    with enable_wrap(wrapper_cls=FSDP):
        for i in range(3):
            sharded[i] = wrap(sharded[i])
    sharded = FSDP(sharded)
    losses = []
    for model in (sharded, plain):
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses.append([])
        for _ in range(3):
            loss = torch.cat([model(x) for x in images]).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses[-1].append(loss.item())
    return losses


def _errors():
    out = {}
    cases = {
        "bucket_cap_mb": dict(bucket_cap_mb="25"),
        "compute_device": dict(compute_device="cuda:0"),
        "gradient_predivide_factor": dict(gradient_predivide_factor=0),
        "state_dict_device": dict(state_dict_device="no-such-device"),
        "verbose": dict(verbose="yes"),
        "process_group_reduce_scatter": dict(process_group_reduce_scatter=skdist.new_group([0])),
    }
    for name, kwargs in cases.items():
        try:
            FSDP(nn.Linear(4, 4), **kwargs)
            out[name] = "accepted"
        except ValueError as error:
            out[name] = str(error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offloaded = FSDP(nn.Linear(4, 4), cpu_offload=True)
    out["cpu_offload_warns"] = any(issubclass(w.category, DeprecationWarning) for w in caught)
    out["cpu_offload_sets"] = offloaded.move_params_to_cpu and offloaded.move_grads_to_cpu
    # FairScale's flag reads back as given, except on a wrapped RNN, whose own
    # flatten_parameters() (called in RNN forwards) becomes a no-op
    out["flatten_flag"] = (FSDP(nn.Linear(4, 4), flatten_parameters=False).flatten_parameters,
                           FSDP(nn.Linear(4, 4)).flatten_parameters,
                           FSDP(nn.GRU(4, 4)).flatten_parameters())
    return out


def test_fairscale_arguments(world2):
    for r in world2.run(_parity_with_every_fairscale_argument):
        assert r["worst"] <= 1e-5, r
        assert r["uses_group"], r
        # verbose repr: every unit shows its post-divide factor (2 ranks / pre-divide 2)
        assert r["repr"] == r["units"], r
    for r in world2.run(_root_reshard_bytes):
        # the root re-gathers for backward: one more all-gather of its rows
        assert r["extra_calls"] == 1, r
        assert r["extra_bytes"] == pytest.approx(r["root_bytes"]), r
    rank0, rank1 = world2.run(_state_dict_options)
    assert rank0["rank0_only_keys"] == rank0["full_keys"] and rank1["rank0_only_keys"] == 0
    assert rank0["devices"] == rank1["devices"] == ["meta"]
    for r in world2.run(_inputs_and_summon):
        assert (r["forced"], r["plain"]) == ("torch.float32", "torch.bfloat16"), r
        assert r["volatile_dropped"] and r["kept"], r
        assert "volatile" in r["contradiction"] and "writeback" in r["contradiction"], r
    for r in world2.run(_divide_factors_and_apply):
        # pre=1, post=1: the sum over 2 ranks instead of the mean
        assert r["sum_over_mean"] == pytest.approx([2.0] * len(r["sum_over_mean"])), r
        assert r["params_with_grad"] == 2 and r["cpu_offload"] is False, r
        assert r["own_params"] == [[(1, 6), (1,)], [(3, 4), (3,)]], r
        assert r["no_own_params"] == [], r
        assert sorted(r["apply_shapes"]) == [(2, 6), (6, 4)] and r["apply_written"], r
        assert "allow_reset_parameters=True" in r["reset_refused"], r
        assert r["reset_shape"] == (6, 4) and r["reset_changed"], r
        assert r["reset_same_everywhere"], r
    rank0, rank1 = world2.run(_no_broadcast_optim_state)
    assert rank1 is None
    assert rank0["kept"][0] * 2 == rank0["full"][0] and rank0["full"][1] == TINY.d_model, rank0
    synced = world2.run(_sync_module_states)
    assert all(r["synced"] and r["composed"] for r in synced), synced
    assert not synced[1]["plain"], synced  # FairScale's default: no sync, each rank's own rows
    assert synced[0]["broadcast_bytes"] > 0, synced
    for r in world2.run(_resolved_attributes):
        f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
        assert r["plain"] == (f32, f32, False, "cpu", False), r
        assert r["mixed"] == (f16, f16, False, "cpu", True), r
        assert r["bf16_fp32_reduce"] == (bf16, f32, True, "cpu", True), r
        assert r["policy"] == (bf16, bf16, True, "cpu", True), r
        assert r["offloaded"] == (f32, f32, False, "cpu", False), r
        assert r["double"] == torch.float64, r
    for r in world2.run(_training_states):
        assert r["before"] == r["after"] == r["after_summon"] == ["IDLE", "IDLE"], r
        forward = {name: states for name, when, states in r["log"] if when == "forward"}
        backward = {name: states for name, when, states in r["log"] if when == "backward"}
        assert forward["first"] == {"root": "FORWARD", "inner": "IDLE"}, r["log"]
        assert forward["middle"] == {"root": "FORWARD", "inner": "IDLE"}, r["log"]
        # backward reached the inner unit (its parameters gathered again), not yet its gradient
        assert backward["middle"]["inner"] == "BACKWARD_PRE", r["log"]
        assert backward["middle"]["root"] in ("BACKWARD_PRE", "BACKWARD_POST"), r["log"]
        assert backward["first"]["inner"] in ("BACKWARD_PRE", "BACKWARD_POST"), r["log"]
        assert r["summoned"] == ["SUMMON_FULL_PARAMS", "SUMMON_FULL_PARAMS"], r
        assert "IDLE" in r["wrong_state"] and "SUMMON_FULL_PARAMS" in r["wrong_state"], r
        assert "TrainingState" in r["not_a_state"], r
        assert r["after_no_grad"] == "IDLE" and r["instances"] == [True, True], r
        assert r["reset_lazy"] == 0.0 and r["reset_root"] == (True, False, True), r
        assert r["skip_empty"] == (2, 1), r
        # the BatchNorm is its own fp32 unit inside a 16-bit model, kept gathered after forward
        assert r["bn_units"] == [("BatchNorm1d", False, False, torch.float32)], r
        assert r["root_dtype"] == torch.float16, r
        # fp16 activations through an fp32 BatchNorm: statistics and gradients stay fp32
        assert r["bn_trained"] == (torch.float16, torch.float32, torch.float32, True), r
        assert "wrapper_config" in r["collision"] and "assert_on_collision" in r["collision"], r
        assert r["single_rank_world"] == 1, r
        sharded, plain = r["conv_bn_losses"]
        assert sharded == pytest.approx(plain, rel=1e-5) and plain[-1] < plain[0], r
    for r in world2.run(_errors):
        for name in ("bucket_cap_mb", "compute_device", "gradient_predivide_factor",
                     "state_dict_device", "verbose", "process_group_reduce_scatter"):
            assert r[name] != "accepted" and name in r[name], (name, r[name])
        assert r["cpu_offload_warns"] and r["cpu_offload_sets"], r
        assert r["flatten_flag"] == (False, True, None), r
