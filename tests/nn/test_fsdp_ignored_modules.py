"""torch FSDP1's ``ignored_modules=`` / ``ignored_states=`` on shardkit's FSDP.

What an ignored module (or parameter) is: not sharded, not gathered, its gradients not reduced
(each rank keeps its local gradient; the user syncs or freezes it), a full ordinary tensor in
``parameters()`` and every state dict. torch FSDP1 runs on CPU with
``device_id=torch.device("cpu")``, so it is the oracle for the state dicts, the optimizer
state dicts, ``clip_grad_norm_`` and auto-wrapping; one process on the global batch is the
oracle for training. One world of 2 gloo ranks for the module.
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardkit import distributed as skd
from shardkit.distributed import CommCounter
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import auto_wrap, enable_wrap, wrap
from shardkit.testing import world_fixture
from shardkit.utils.memory import model_state_bytes

world2 = world_fixture(2, timeout=240)


class Scale(nn.Module):
    """A parameter-free layer with a buffer (what an ignored module's buffers do)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("factor", torch.full((6,), 0.5))

    def forward(self, x):
        return x * self.factor


class Net(nn.Module):
    def __init__(self, tower: bool = True, batchnorm: bool = False):
        super().__init__()
        self.a = nn.Linear(4, 6)
        norm = nn.BatchNorm1d(6) if batchnorm else Scale()
        self.tower = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), norm) if tower else nn.Identity()
        self.b = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))

    def forward(self, x):
        return self.b(self.tower(self.a(x)))


def _net(seed: int = 0, **kwargs) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def _batch(step: int, world: int):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(4 * world, 4, generator=gen), torch.randn(4 * world, 2, generator=gen)


def _units(model) -> list:
    return sorted(n.replace("_fsdp_wrapped_module.", "") for n, m in model.named_modules()
                  if type(m).__name__ == "FullyShardedDataParallel")


def _linear_policy():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return ModuleWrapPolicy({nn.Linear})


# ---------------------------------------------------------------------- training parity


def _train_run(frozen: bool, policy: bool) -> dict:
    """3 SGD steps with the tower ignored: frozen, or trained with its gradients all-reduced
    by hand; against one process on the global batch. Each rank's ignored gradient, before the
    user's all-reduce, is its own batch's gradient (FSDP did not reduce it)."""
    rank, world = skd.get_rank(), skd.get_world_size()
    oracle, net = _net(), _net()
    for m in (oracle, net):
        m.tower.requires_grad_(not frozen)
    model = FSDP(net, ignored_modules=[net.tower],
                 auto_wrap_policy=_linear_policy() if policy else None)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    oracle_optim = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    diffs, local_grad_diffs = [], []
    mine = slice(rank * 4, (rank + 1) * 4)
    for step in range(3):
        x, y = _batch(step, world)
        if not frozen:  # the one-process gradient of this rank's own batch
            oracle.zero_grad()
            nn.functional.mse_loss(oracle(x[mine]), y[mine]).backward()
            local = oracle.tower[0].weight.grad.clone()
        optim.zero_grad()
        loss = nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        if not frozen:
            local_grad_diffs.append((net.tower[0].weight.grad - local).abs().max().item())
            for p in net.tower.parameters():  # the user's own sync of the ignored module
                dist.all_reduce(p.grad)
                p.grad /= world
        optim.step()
        oracle_optim.zero_grad()
        oracle_loss = nn.functional.mse_loss(oracle(x), y)
        oracle_loss.backward()
        oracle_optim.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        diffs.append(abs(mean.item() / world - oracle_loss.item()))
    full = model.state_dict()
    diffs.append(max((full[k] - v).abs().max().item() for k, v in oracle.state_dict().items()))
    return {"diffs": diffs, "local_grad_diffs": local_grad_diffs, "units": _units(model),
            "tower_is_plain": all(type(p) is nn.Parameter and p.shape == q.shape for p, q in
                                  zip(net.tower.parameters(), oracle.tower.parameters()))}


@pytest.mark.parametrize("frozen, policy", [(False, False), (True, False), (False, True)],
                         ids=["synced-by-hand", "frozen", "synced-ModuleWrapPolicy"])
def test_ignored_module_trains_like_one_process(world2, frozen, policy):
    for r in world2.run(_train_run, frozen, policy):
        assert max(r["diffs"]) < 1e-5, r
        assert r["tower_is_plain"]
        if not frozen:  # FSDP left each rank's gradient of the ignored module as it was
            assert max(r["local_grad_diffs"]) < 1e-6, r
        if policy:  # the ignored tower's Linear is not a unit
            assert r["units"] == ["", "a", "b.0", "b.2"], r


# ---------------------------------------------------------------------- against torch FSDP1


def _against_torch_run(which: str) -> dict:
    """One step with a trainable ignored tower (gradients not synced: they differ by rank),
    then clip_grad_norm_, every state dict type, and the optimizer state dicts, under torch
    FSDP1 or shardkit's FSDP with the same arguments."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType
    rank, world = skd.get_rank(), skd.get_world_size()
    net = _net()
    kwargs = {"ignored_modules": [net.tower], "auto_wrap_policy": _linear_policy()}
    cls = TorchFSDP if which == "torch" else FSDP
    if which == "torch":
        model = TorchFSDP(net, device_id=torch.device("cpu"), **kwargs)
    else:
        model = FSDP(net, **kwargs)
    x, y = _batch(0, world)
    mine = slice(rank * 4, (rank + 1) * 4)
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    out = {"units": _units(model), "norm": model.clip_grad_norm_(0.05).item(),
           "tower_grad": net.tower[0].weight.grad.clone()}
    kinds = {}
    for kind in ("FULL", "SHARDED", "LOCAL"):
        with cls.state_dict_type(model, getattr(StateDictType, kind + "_STATE_DICT")):
            sd = model.state_dict()
            kinds[kind] = {k: type(v) is torch.Tensor for k, v in sd.items()
                           if k.startswith("tower.")}
            out[kind + "_tower"] = {k: sd[k].clone() for k in kinds[kind]}
            if which == "shardkit":  # loads them: an edited ignored weight comes back
                sd["tower.0.weight"] = sd["tower.0.weight"] + 1
                model.load_state_dict(sd)
                out[kind + "_loaded"] = (net.tower[0].weight - out[kind + "_tower"][
                    "tower.0.weight"]).sub(1).abs().max().item()
                with torch.no_grad():
                    net.tower[0].weight.sub_(1)
    out["kinds"] = kinds
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    optim.step()
    osd = cls.optim_state_dict(model, optim)
    out["osd_tower"] = {k: {s: t.clone() for s, t in v.items()}
                        for k, v in osd["state"].items() if k.startswith("tower.")}
    full = cls.full_optim_state_dict(model, optim)
    if which == "shardkit":  # and loads back: every state, the ignored ones included
        fresh = torch.optim.Adam(model.parameters(), lr=0.01)
        saved = copy.deepcopy(osd)  # the dict holds the live state tensors: load a copy
        expected = {p: {k: v.clone() for k, v in st.items()} for p, st in optim.state.items()}
        with torch.no_grad():
            for state in optim.state.values():
                state["exp_avg"].zero_()  # what must come back is the saved value, not this
        fresh.load_state_dict(cls.optim_state_dict_to_load(model, fresh, saved))
        out["osd_reloaded"] = len(fresh.state) == len(expected) and all(
            torch.equal(v, expected[p][k]) for p, st in fresh.state.items()
            for k, v in st.items())
        with torch.no_grad():
            for p, state in optim.state.items():
                state["exp_avg"].copy_(expected[p]["exp_avg"])
    names = [n.replace("_fsdp_wrapped_module.", "") for n, _ in model.named_parameters()]
    out["full_osd_tower"] = None if not full else {  # shardkit's keys: parameter ids
        key: state for k, state in full["state"].items()
        for key in [names[k] if isinstance(k, int) else k] if key.startswith("tower.")}
    return out


def test_state_dicts_norm_and_wrapping_match_torch_fsdp1(world2):
    theirs = world2.run(_against_torch_run, "torch")
    ours = world2.run(_against_torch_run, "shardkit")
    for rank, (t, o) in enumerate(zip(theirs, ours)):
        assert o["units"] == t["units"] == ["", "a", "b.0", "b.2"]
        # this rank's ignored gradients join the shards' all-reduced norm, as in torch
        assert o["norm"] == pytest.approx(t["norm"], rel=1e-5)
        torch.testing.assert_close(o["tower_grad"], t["tower_grad"])
        for kind in ("FULL", "SHARDED", "LOCAL"):
            assert o["kinds"][kind] == t["kinds"][kind], kind  # the same keys, plain tensors
            assert all(o["kinds"][kind].values())
            for k, v in t[kind + "_tower"].items():
                torch.testing.assert_close(o[kind + "_tower"][k], v)
            assert o[kind + "_loaded"] < 1e-6, kind
        assert o["osd_tower"].keys() == t["osd_tower"].keys() and o["osd_reloaded"]
        for k, state in t["osd_tower"].items():
            for s, v in state.items():
                torch.testing.assert_close(o["osd_tower"][k][s], v)
        if rank:
            assert o["full_osd_tower"] is t["full_osd_tower"] is None
            continue
        assert o["full_osd_tower"].keys() == t["full_osd_tower"].keys() == t["osd_tower"].keys()
        for k, state in t["full_osd_tower"].items():  # rank 0's own state of them
            for s, v in state.items():
                torch.testing.assert_close(o["full_osd_tower"][k][s], v)
    assert theirs[0]["norm"] != theirs[1]["norm"]  # the ranks' ignored gradients differ


def _auto_wrap_run(which: str, case: str) -> list:
    """The units torch FSDP1 and shardkit build under auto_wrap_policy with ignored states:
    torch's MixedPrecision (which wraps BatchNorm on its own) with a tower holding one, and
    a size policy with ignored parameters (not counted towards a module's size)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
    net = _net(batchnorm=True)
    if case == "mixed-precision":
        kwargs = {"ignored_modules": [net.tower], "auto_wrap_policy": _linear_policy(),
                  "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)}
    else:  # b holds 42 + 14 parameters, 14 without b.0's (ignored); the tower 54
        kwargs = {"ignored_states": list(net.b[0].parameters()),
                  "auto_wrap_policy": functools.partial(size_based_auto_wrap_policy,
                                                        min_num_params=50)}
    if which == "torch":
        model = TorchFSDP(net, device_id=torch.device("cpu"), **kwargs)
    elif which == "enable_wrap":  # shardkit's FairScale-style wrapping, the same units
        policy = kwargs.pop("auto_wrap_policy")
        with enable_wrap(wrapper_cls=FSDP, **kwargs):
            inner = auto_wrap(net, policy)
            assert "ignored_modules" not in kwargs or wrap(net.tower) is net.tower
        model = FSDP(inner, **kwargs)
    else:
        model = FSDP(net, **kwargs)
    return _units(model)


@pytest.mark.parametrize("case", ["mixed-precision", "size-policy-ignored-params"])
def test_auto_wrap_policy_skips_ignored_states_as_torch_fsdp1(world2, case):
    theirs = world2.run(_auto_wrap_run, "torch", case)
    ours = world2.run(_auto_wrap_run, "shardkit", case)
    assert ours == theirs
    assert world2.run(_auto_wrap_run, "enable_wrap", case) == theirs
    assert ours[0] == (["", "a", "b.0", "b.2"] if case == "mixed-precision" else ["", "tower"])


# ---------------------------------------------------------------------- other behaviour


def _sync_costs_and_summon_run() -> dict:
    """sync_module_states (torch: rank 0's managed parameters and every buffer, not the
    ignored parameters), the memory and communication accounting, summon_full_params."""
    rank, world = skd.get_rank(), skd.get_world_size()
    net = _net(seed=rank)  # each rank built its own values
    with torch.no_grad():
        net.tower[2].factor.fill_(rank + 1.0)
    model = FSDP(net, ignored_modules=[net.tower], sync_module_states=True)
    full = model.state_dict()
    seen = [None] * world
    dist.all_gather_object(seen, {k: v for k, v in full.items()})
    out = {"managed_same": all(torch.equal(seen[0][k], seen[1][k]) for k in full
                               if not k.startswith("tower.")),
           "tower_weight_own": torch.equal(full["tower.0.weight"], _net(seed=rank).tower[0].weight),
           "tower_buffer": full["tower.2.factor"][0].item()}
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ignored_bytes = 4 * sum(p.numel() for p in net.tower.parameters())
    shard_bytes = 4 * model.padded_numel // world
    out["param_bytes"] = (model_state_bytes(model, optim).params, shard_bytes + ignored_bytes)
    x, y = _batch(0, world)
    plain = FSDP(_net(tower=False))  # the same units without the tower
    counted = []
    for m in (model, plain):
        with CommCounter() as counter:
            nn.functional.mse_loss(m(x[:4]), y[:4]).backward()
        counted.append(counter.bytes)
    out["comm_bytes"] = counted
    before = net.tower[0].weight
    with model.summon_full_params():
        out["summoned_shapes"] = (tuple(net.a.weight.shape), tuple(net.tower[0].weight.shape))
        out["same_object"] = net.tower[0].weight is before
        with torch.no_grad():
            net.tower[0].weight.fill_(2.0)
            net.a.weight.fill_(3.0)
    out["after_summon"] = (net.tower[0].weight.unique().tolist(), net.a.weight.unique().tolist())
    wrong = model.state_dict()  # an ignored weight of another shape: refused, nothing loaded
    wrong["tower.0.weight"] = torch.zeros(5, 6)
    wrong["a.weight"] = torch.zeros(6, 4)
    try:
        model.load_state_dict(wrong)
        out["wrong_shape"] = "loaded"
    except RuntimeError as error:
        out["wrong_shape"] = str(error)
    out["a_kept"] = model.state_dict()["a.weight"].unique().tolist()
    other = _net()
    other.a.double()  # the first parameters, ignored, in another dtype than the unit's
    out["compute_dtype"] = FSDP(other, ignored_modules=[other.a]).compute_dtype
    return out


def test_sync_module_states_costs_and_summon_full_params(world2):
    for rank, r in enumerate(world2.run(_sync_costs_and_summon_run)):
        assert r["managed_same"] and r["tower_weight_own"], r
        assert r["tower_buffer"] == 1.0  # buffers broadcast from rank 0, as torch does
        assert r["param_bytes"][0] == r["param_bytes"][1], r
        assert r["comm_bytes"][0] == r["comm_bytes"][1] > 0, r
        assert r["summoned_shapes"] == ((6, 4), (6, 6)) and r["same_object"]
        assert r["after_summon"] == ([2.0], [3.0])
        assert "size mismatch for tower.0.weight" in r["wrong_shape"]
        assert "nothing was loaded" in r["wrong_shape"] and r["a_kept"] == [3.0]
        assert r["compute_dtype"] == torch.float32


class WithExperts(nn.Module):
    """``rank + 1`` experts on each rank, ignored (another scheme trains them), around a
    shared trunk that FSDP shards; ``buffer`` gives each expert a buffer too."""

    def __init__(self, experts: int, buffer: bool = False):
        super().__init__()
        self.trunk = nn.Linear(4, 6)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(6, 6), Scale() if buffer else nn.Identity())
            for _ in range(experts))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        h = self.trunk(x)
        return self.head(sum(e(h) for e in self.experts))


def _experts_run() -> dict:
    """torch FSDP1's test_diff_ignored_modules_across_ranks: each rank ignores a different
    number of experts; the shared trunk and head train as one data-parallel model (equal on
    every rank), each rank's experts with its own gradients."""
    rank, world = skd.get_rank(), skd.get_world_size()
    torch.manual_seed(0)
    net = WithExperts(rank + 1)
    model = FSDP(net, ignored_modules=net.experts)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(0, world)
    nn.functional.mse_loss(model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]) \
        .backward()
    optim.step()
    shared = {k: v for k, v in model.state_dict().items() if not k.startswith("experts.")}
    seen = [None] * world
    dist.all_gather_object(seen, shared)
    out = {"shared_equal": all(torch.equal(seen[0][k], seen[1][k]) for k in shared),
           "experts": len([k for k in model.state_dict() if k.startswith("experts.")
                           and k.endswith(".weight")])}
    for kwargs, key in (({}, "differ"), ({"sync_module_states": True}, "differ_synced")):
        net = WithExperts(1) if rank == 0 else Net()  # the units would shard other parameters
        if key == "differ_synced":  # same shards, other broadcast buffers
            net = WithExperts(rank + 1, buffer=True)
        try:
            FSDP(net, ignored_modules=net.experts if isinstance(net, WithExperts) else None,
                 **kwargs)
            out[key] = "no error"
        except ValueError as error:
            out[key] = str(error)
    return out


def test_ranks_may_ignore_different_modules_but_must_shard_the_same(world2):
    for rank, r in enumerate(world2.run(_experts_run)):
        assert r["shared_equal"] and r["experts"] == rank + 1, r
        assert "every rank must wrap the same module" in r["differ"]
        assert "parameter" in r["differ"]
        assert "every rank must wrap the same module" in r["differ_synced"]
        assert "broadcast_buffers" in r["differ_synced"]


def _bad(kwargs_of):
    net = _net()
    return kwargs_of(net)


@pytest.mark.parametrize("kwargs_of, expected", [
    (lambda n: {"ignored_modules": [n.tower], "ignored_states": [n.tower]},
     "pass one of them, not both"),
    (lambda n: {"ignored_modules": 3}, "ignored_modules=3): expected an iterable"),
    (lambda n: {"ignored_modules": n.a}, "ignored_modules=Linear): expected"),
    (lambda n: {"ignored_states": n.a.weight}, "ignored_states=Parameter): expected"),
    (lambda n: {"ignored_modules": [n.a.weight]}, "ignored_modules=...): expected an iterable"),
    (lambda n: {"ignored_states": [n.a, n.a.weight]}, "all of one kind"),
    (lambda n: {"ignored_modules": [n]}, "the module being wrapped (Net) is itself ignored"),
    (lambda n: {"ignored_states": [n.tower, n]}, "the module being wrapped (Net) is itself"),
], ids=["both", "int", "one-module", "one-parameter", "parameter-in-modules", "mixed",
        "root", "root-in-states"])
def test_bad_ignored_arguments_name_the_argument_before_any_collective(kwargs_of, expected):
    net = _net()  # no process group here: the error comes before any collective
    with pytest.raises(ValueError, match=None) as info:
        FSDP(net, auto_wrap_policy=_linear_policy(), **kwargs_of(net))
    assert expected in str(info.value)


def _unit_in_ignored_run() -> list:
    net = _net()
    net.b[0] = FSDP(net.b[0])
    messages = []
    for kwargs in ({"ignored_modules": [net.b]}, {"ignored_modules": [net.b[0]]},
                   {"ignored_states": [net.b[0].module]},
                   {"ignored_states": [net.b[0].module.weight]}):
        try:
            FSDP(net, **kwargs)
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_fsdp_unit_in_the_ignored_set_is_refused(world2):
    for messages in world2.run(_unit_in_ignored_run):
        assert "'0' inside the Sequential given is a FullyShardedDataParallel unit" \
            in messages[0]
        assert "the FullyShardedDataParallel given is a FullyShardedDataParallel unit" \
            in messages[1]
        assert "the module of a FullyShardedDataParallel unit" in messages[2]
        assert "parameter 'b.0.weight' is already sharded by an inner " \
            "FullyShardedDataParallel unit" in messages[3]


# ---------------------------------------------------------------------- review findings


def _sync_buffers_in_policy_units_run() -> list:
    """torch FSDP1 broadcasts every buffer under sync_module_states, those of ignored modules
    inside units that auto_wrap_policy builds too."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    net = _net(batchnorm=True)
    net.b = nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    norm = net.b[0]
    norm.running_mean.fill_(skd.get_rank() + 1.0)
    FSDP(net, ignored_modules=[norm], auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
         sync_module_states=True)
    return norm.running_mean.tolist()


def test_sync_module_states_reaches_ignored_buffers_inside_policy_units(world2):
    means = world2.run(_sync_buffers_in_policy_units_run)
    assert means[0] == means[1] == [1.0] * 6


def _ignored_module_sharded_by_inner_unit_run() -> list:
    messages = []
    net = _net()
    b0 = net.b[0]
    net.b = FSDP(net.b)
    try:
        FSDP(net, ignored_modules=[b0])
        messages.append("no error")
    except ValueError as error:
        messages.append(str(error))
    net = _net()  # a generator given to enable_wrap reaches every unit it builds
    b0 = net.b[0]
    with enable_wrap(wrapper_cls=FSDP, ignored_modules=(m for m in [b0])):
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        FSDP(auto_wrap(net, ModuleWrapPolicy({nn.Sequential})), ignored_modules=[b0])
    messages.append(tuple(b0.weight.shape))
    return messages


def test_ignored_module_already_sharded_is_refused_and_generators_reach_every_unit(world2):
    for messages in world2.run(_ignored_module_sharded_by_inner_unit_run):
        assert "parameter 'b.0.weight' is already sharded by an inner " \
            "FullyShardedDataParallel unit" in messages[0]
        assert messages[1] == (6, 6)  # b.0 stays whole in the unit b


def _stage3_with_ignored_run() -> list:
    import shardkit
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    out = []
    for frozen in (False, True):
        net = _net()
        if frozen:
            net.tower.requires_grad_(False)
        try:
            shardkit.initialize(model=FSDP(net, ignored_modules=[net.tower]), config=config)
            out.append("built")
        except ValueError as error:
            out.append(str(error))
    return out


def test_stage3_refuses_trainable_ignored_parameters(world2):
    """No wrapper of the engine reduces ignored gradients: trainable ones are refused on
    every rank before any wrapper collective, frozen ones pass."""
    for trainable, frozen in world2.run(_stage3_with_ignored_run):
        assert "ignored_modules/ignored_states whose 2 trainable parameter(s)" in trainable
        assert frozen == "built"


class _MetaA(nn.Module):
    def __init__(self):
        super().__init__()
        with torch.device("meta"):
            self.a = nn.Linear(4, 4)
        self.tower = nn.Linear(4, 4)


def _param_init_fn_calls() -> list:
    """A param_init_fn that materializes the model from its root, with the tower ignored."""
    calls = []

    def init_fn(m):
        calls.append(m)
        if isinstance(m, _MetaA):
            m.to_empty(device="cpu")  # recursive, as scripts written for torch FSDP1 do
            m.a.reset_parameters()

    net = _MetaA()
    FSDP(net, ignored_modules=[net.tower], param_init_fn=init_fn)
    return [type(m).__name__ + (" (ignored)" if m is net.tower else "") for m in calls]


def test_param_init_fn_never_called_on_an_ignored_module(world2):
    """torch FSDP1 leaves ignored modules out of the modules param_init_fn is given."""
    for calls in world2.run(_param_init_fn_calls):
        assert "Linear (ignored)" not in calls and "_MetaA" in calls, calls
