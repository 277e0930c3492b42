"""FairScale's FSDP state-dict, summon_full_params and optimizer-state tests, and its ShardedDDP
parity/feature tests, re-expressed for shardkit (the behaviours a FairScale user relies on).

One world per size (1, 2, 4 gloo ranks); each test runs a list of checks inside it. Every FSDP
check compares against the unwrapped model trained in one process on the global batch (the same
seed), and every ShardedDDP check against torch DDP + the same torch optimizer, step by step.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff

TOL = 1e-5
LOCAL_BATCH = 3


# ---------------------------------------------------------------------- models


class Block(nn.Module):
    def __init__(self, width_in: int, width_out: int):
        super().__init__()
        self.lin = nn.Linear(width_in, width_out)
        self.norm = nn.BatchNorm1d(width_out)

    def forward(self, x):
        return torch.tanh(self.norm(self.lin(x)))


class Net(nn.Module):
    """FairScale's ConvolutionalModel in miniature: BatchNorm buffers, odd sizes (padded shards),
    a frozen layer, a layer the forward never uses, and units nested two deep."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.first = Block(5, 7)
        self.middle = nn.Sequential(Block(7, 9), nn.Linear(9, 9))
        self.frozen = nn.Linear(9, 9).requires_grad_(False)
        self.unused = nn.Linear(9, 3)
        self.head = nn.Linear(9, 3)

    def forward(self, x):
        h = self.middle(self.first(x))
        h = h + self.frozen(h)
        return self.head(h)


def wrap_net(net: Net, flatten: bool = True, **kwargs) -> FSDP:
    net.first = FSDP(net.first, flatten_parameters=flatten, **kwargs)
    net.middle[0] = FSDP(net.middle[0], flatten_parameters=not flatten, **kwargs)
    net.middle = FSDP(net.middle, flatten_parameters=flatten, **kwargs)
    net.unused = FSDP(net.unused, **kwargs)
    return FSDP(net, flatten_parameters=flatten, **kwargs)


def global_batch(step: int, world: int):
    gen = torch.Generator().manual_seed(500 + step)
    return (torch.randn(LOCAL_BATCH * world, 5, generator=gen),
            torch.randn(LOCAL_BATCH * world, 3, generator=gen))


def local(t: torch.Tensor) -> torch.Tensor:
    rank = skdist.get_rank()
    return t[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]


def make_optim(kind: str, model: nn.Module, groups: bool = False):
    params = [p for p in model.parameters() if p.requires_grad]
    if groups:  # weights and biases apart, another lr and weight decay for the biases
        # named_parameters keeps the order of parameters(), wrapped or not
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [{"params": [p for n, p in named if n.endswith("weight")]},
                  {"params": [p for n, p in named if n.endswith("bias")], "lr": 0.02,
                   "weight_decay": 0.0}]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01, eps=1e-4)
    if kind == "adadelta":
        return torch.optim.Adadelta(params)
    raise ValueError(kind)


def train(model, optim, steps: int, world: int, start: int = 0, is_ref: bool = False):
    for step in range(start, start + steps):
        x, y = global_batch(step, world)
        if not is_ref:
            x, y = local(x), local(y)
        optim.zero_grad()
        F.mse_loss(model(x), y).backward()
        optim.step()


def ref_train(ref, ref_opt, steps, world, start=0):
    """The single-process oracle: the same loss on the global batch. BatchNorm makes the full
    batch differ from per-rank batches, so the oracle runs each rank's slice and averages."""
    for step in range(start, start + steps):
        x, y = global_batch(step, world)
        ref_opt.zero_grad()
        for r in range(world):
            xs = x[r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH]
            ys = y[r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH]
            (F.mse_loss(ref(xs), ys) / world).backward()
        ref_opt.step()


def pair(**kwargs):
    ref = Net()
    model = wrap_net(Net(), **kwargs)
    return ref, model


def params_only(sd: dict, model: nn.Module) -> dict:
    names = {n for n, _ in model.named_parameters()}
    return {k: v for k, v in sd.items() if k in names}


# ---------------------------------------------------------------------- FSDP state dicts


def _check_state_dict_keys_values_and_round_trip():
    world = skdist.get_world_size()
    ref, model = pair()
    ref_opt, opt = make_optim("sgd", ref), make_optim("sgd", model)
    expected_keys = list(Net().state_dict())
    before = model.state_dict()  # before any forward (FairScale's test_state_dict_before_forward)
    assert list(before) == expected_keys, (list(before), expected_keys)
    assert max_diff(before, Net().state_dict()) == 0
    ref_train(ref, ref_opt, 3, world)
    train(model, opt, 3, world)
    sd = model.state_dict()
    assert list(sd) == expected_keys
    # the oracle's running stats are the last rank's batch; compare parameters
    worst = max_diff(params_only(sd, ref), params_only(ref.state_dict(), ref))
    twice = max_diff(sd, model.state_dict())  # calling it twice changes nothing
    # a fresh FSDP model and a plain one both load it; their forwards agree
    fresh = wrap_net(Net(seed=9))
    fresh.load_state_dict(sd)
    plain = Net(seed=7)
    plain.load_state_dict(sd)
    fresh.eval(), plain.eval(), model.eval()
    x, _ = global_batch(99, 1)
    with torch.no_grad():
        out = max_diff([fresh(x)], [plain(x)]) + max_diff([model(x)], [plain(x)])
    return worst, twice, out


def _check_state_dict_after_forward_and_inside_summon():
    ref, model = pair()
    x, _ = global_batch(0, 1)
    model(x)  # a forward, no backward
    after_forward = model.state_dict()
    with model.summon_full_params():
        inside = model.state_dict()
    return max_diff(params_only(after_forward, ref), params_only(inside, ref))


def _check_local_state_dict_round_trip_and_offline_consolidation():
    world = skdist.get_world_size()
    _, model = pair()
    opt = make_optim("adam", model)
    train(model, opt, 2, world)
    full = model.state_dict()
    local_sd = model.local_state_dict()
    meta = model.local_metadata_dict()
    # round trip into a fresh model of the same world size
    fresh = wrap_net(Net(seed=4))
    fresh.load_local_state_dict(local_sd)
    same = max_diff(fresh.state_dict(), full)
    # every rank's pair, through a file, consolidated offline (FairScale's test_fsdp_metadata)
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, {"weights": local_sd, "meta": meta})
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt.pt")
        torch.save(gathered, path)
        loaded = torch.load(path, weights_only=True)
    consolidated = FSDP.consolidate_shard_weights(
        shard_weights=[c["weights"] for c in loaded], shard_metadata=[c["meta"] for c in loaded])
    assert list(consolidated) == list(full), (list(consolidated), list(full))
    # buffers (BatchNorm running stats differ per rank) are rank 0's, as in FairScale
    offline = max_diff(consolidated if skdist.get_rank() == 0 else params_only(consolidated, fresh),
                       full if skdist.get_rank() == 0 else params_only(full, fresh))
    no_buffers = FSDP.consolidate_shard_weights([c["weights"] for c in loaded],
                                                [c["meta"] for c in loaded],
                                                with_module_buffers=False)
    buffer_names = {n for n, _ in Net().named_buffers()}
    assert set(no_buffers) == set(full) - buffer_names, sorted(no_buffers)
    # the consolidated dict loads into a wrapped model (another seed) and into a plain one
    other = wrap_net(Net(seed=5))
    other.load_state_dict(consolidated)
    return same, offline, max_diff(other.state_dict(), consolidated)


def _check_consolidation_refuses_bad_input():
    """consolidate_shard_weights / load_local_state_dict(list, metadata=) with a rank's block
    of the wrong shape (joined silently into shifted rows before), with one rank's dict where
    the list is expected, and with a rank missing: clear errors naming what is wrong; with
    strict=False a parameter missing from a rank's weights is left out (FairScale's
    test_consolidate_missing_params)."""
    _, model = pair()
    gathered = [None] * skdist.get_world_size()
    torch.distributed.all_gather_object(
        gathered, (model.local_state_dict(), model.local_metadata_dict()))
    weights, metas = [g[0] for g in gathered], [g[1] for g in gathered]
    errors = {}

    def expect(name, fn, *types):
        try:
            fn()
        except types as e:
            errors[name] = str(e)
        else:
            errors[name] = None

    bad = [dict(w) for w in weights]
    block = bad[0]["head.weight"]
    bad[0]["head.weight"] = torch.cat([block, block[:1]])  # one row too many
    expect("shape", lambda: FSDP.consolidate_shard_weights(bad, metas), ValueError)
    fresh = wrap_net(Net(seed=2))
    expect("reshard_shape", lambda: fresh.load_local_state_dict(bad, metadata=metas),
           ValueError, RuntimeError)  # at the saving world size: torch's size mismatch
    expect("one_dict", lambda: FSDP.consolidate_shard_weights(weights[0], metas[0]), TypeError)
    if len(weights) > 1:
        expect("rank_missing",
               lambda: FSDP.consolidate_shard_weights(weights[1:], metas[1:]), ValueError)
    missing = [dict(w) for w in weights]
    missing[-1].pop("head.bias")
    expect("strict", lambda: FSDP.consolidate_shard_weights(missing, metas), KeyError)
    loose = FSDP.consolidate_shard_weights(missing, metas, strict=False)
    return errors, "head.bias" in loose, "head.weight" in loose


def _check_state_dict_rank0_only_and_devices():
    rank = skdist.get_rank()
    _, model = pair(state_dict_on_rank_0_only=True)
    sd = model.state_dict()
    ok_rank0 = (len(sd) > 0) if rank == 0 else (len(sd) == 0)
    _, model = pair(state_dict_device=torch.device("cpu"))
    devices = {v.device.type for v in model.state_dict().values()}
    return ok_rank0, devices


def _check_state_dict_on_a_rank_subset():
    """FSDP over a subgroup (the first two ranks): only its members call state_dict, the others
    go on without it (FairScale's process_group= use; no hang, the right values)."""
    world = skdist.get_world_size()
    members = list(range(min(2, world)))
    group = skdist.new_group(members)
    if skdist.get_rank() not in members:
        return None
    model = wrap_net(Net(), process_group=group)
    model.eval()
    sd = model.state_dict()
    return max_diff(sd, Net().eval().state_dict())


def _param_storage_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages the parameters (and gradients) live in."""
    seen = {}
    for p in model.parameters():
        for t in (p, p.grad):
            if t is not None:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _check_summon_memory():
    """FairScale's TestMemory: the parameters' storages grow inside summon_full_params (and
    state_dict inside it), and come back to what they were once it exits (volatile or not)."""
    world = skdist.get_world_size()
    result = []
    for volatile in (False, True):
        _, model = pair()
        train(model, make_optim("sgd", model), 1, world)
        mems = [_param_storage_bytes(model)]
        with model.summon_full_params(volatile=volatile):
            mems.append(_param_storage_bytes(model))
            state_dict = model.state_dict()
            mems.append(_param_storage_bytes(model))
        del state_dict
        mems.append(_param_storage_bytes(model))
        result.append(mems)
    return result


def _check_summon_full_params():
    world = skdist.get_world_size()
    _, model = pair()
    # writeback: an edit inside the block persists, in every unit
    with model.summon_full_params():
        assert model.module.head.weight.shape == (3, 9)
        assert model.module.first.module.lin.weight.shape == (7, 5)
        model.module.head.weight.data.fill_(0.5)
        model.module.first.module.lin.bias.data.fill_(-1.0)
    sd = model.state_dict()
    written = (bool((sd["head.weight"] == 0.5).all())
               and bool((sd["first.lin.bias"] == -1.0).all()))
    # volatile=True (FairScale) and writeback=False (torch) drop edits
    with model.summon_full_params(volatile=True):
        model.module.head.weight.data.fill_(2.0)
    with model.summon_full_params(writeback=False):
        model.module.head.weight.data.fill_(3.0)
    dropped = bool((model.state_dict()["head.weight"] == 0.5).all())
    # recurse=False: the root's own parameters full, the inner units' still sharded
    with model.summon_full_params(recurse=False):
        root_full = model.module.head.weight.shape == (3, 9)
        inner = model.module.first.module.lin.weight
        inner_sharded = inner.shape != (7, 5) or world == 1
    # nested: the inner block leaves the outer one's units alone; the outer writes back
    with model.summon_full_params():
        with model.module.first.summon_full_params():
            model.module.first.module.lin.weight.data.fill_(0.25)
        still_full = model.module.first.module.lin.weight.shape == (7, 5)
    nested = bool((model.state_dict()["first.lin.weight"] == 0.25).all())
    # rank0_only and offload_to_cpu (torch FSDP1's options)
    with model.summon_full_params(rank0_only=True, writeback=False):
        shape = tuple(model.module.head.weight.shape)
    rank0_ok = shape == (3, 9) if skdist.get_rank() == 0 else (shape != (3, 9) or world == 1)
    with model.summon_full_params(offload_to_cpu=True):
        cpu = model.module.head.weight.device.type == "cpu"
    # shapes return to shards after every block, training goes on
    train(model, make_optim("sgd", model), 1, world)
    return [written, dropped, root_full, inner_sharded, still_full, nested, rank0_ok, cpu]


def _check_state_dict_dtypes():
    """FairScale's TestStateDictDeviceDtype and test_load_local_state_dict: fp32 full and local
    state dicts under mixed precision (before any forward, after training, called twice), and
    fp16 ones for a model cast to fp16 before wrapping (pure fp16)."""
    world = skdist.get_world_size()
    model = wrap_net(Net(), mixed_precision=True)
    dtypes = [{v.dtype for v in model.state_dict().values() if v.is_floating_point()}]
    before, before_full = model.local_state_dict(), model.state_dict()
    train(model, make_optim("sgd", model), 2, world)
    model.state_dict()
    after_full = model.state_dict()
    dtypes.append({v.dtype for v in after_full.values() if v.is_floating_point()})
    after = model.local_state_dict()
    dtypes.append({v.dtype for v in after.values() if v.is_floating_point()})
    # training changed every trainable parameter (a rank's shard may be all padding: compare
    # the full values)
    buffers = {n for n, _ in Net().named_buffers()}
    unchanged = [k for k in after_full if k not in buffers
                 and torch.equal(before_full[k], after_full[k])
                 and k.split(".")[0] not in ("frozen", "unused")]
    model.load_local_state_dict(before)
    restored = max_diff(model.local_state_dict(), before)
    pure = FSDP(Net().half(), compute_dtype=torch.float16, mixed_precision=False)
    pure(torch.randn(LOCAL_BATCH, 5).half()).float().sum().backward()
    fp16 = {v.dtype for k, v in pure.state_dict().items() if v.is_floating_point()}
    return dtypes, unchanged, restored, fp16


class LocalByDefault(FSDP):
    """FairScale's test_local_state_dict_calls_state_dict_recursion: a subclass whose
    state_dict is local_state_dict(*args, **kwargs)."""

    def __init__(self):
        super().__init__(nn.Linear(10, 6))

    def state_dict(self, *args, **kwargs):
        return self.local_state_dict(*args, **kwargs)


def _check_local_state_dict_takes_state_dict_arguments():
    """local_state_dict takes nn.Module.state_dict's arguments (FairScale forwards them): a
    plain module holding the subclass above saves its shards under their prefixed keys."""
    unit = LocalByDefault()
    parent = nn.Sequential(nn.Linear(10, 10), unit)
    keys = list(parent.state_dict())
    destination = {}
    filled = unit.local_state_dict(destination, "p.")
    kept = unit.local_state_dict(keep_vars=True)
    rows = -(-6 // skdist.get_world_size())
    return (keys, filled is destination, sorted(destination),
            {tuple(v.shape) for v in kept.values()} == {(rows, 10), (rows,)},
            list(unit.state_dict(prefix="q.")))


def _check_summon_bad_options():
    _, model = pair()
    errors = []
    for kwargs in ({"rank0_only": True, "writeback": True}, {"with_grads": True},
                   {"volatile": True, "writeback": True}):
        try:
            with model.summon_full_params(**kwargs):
                pass
        except (ValueError, NotImplementedError) as e:
            errors.append(str(e))
        else:
            errors.append(None)
    return errors


# ---------------------------------------------------------------------- optimizer state


def _optim_grid():
    return [("sgd", False), ("adam", False), ("adam", True), ("adadelta", False),
            ("sgd", True)]


def _check_gather_full_optim_state_matches_one_process():
    """gather_full_optim_state_dict == the single-process optimizer's state_dict (same steps),
    for several optimizers and param groups; the frozen and unused layers have no state;
    get_shard_from_optim_state_dict gives back each rank's own optimizer state dict."""
    world, rank = skdist.get_world_size(), skdist.get_rank()
    report = {}
    for kind, groups in _optim_grid():
        ref, model = pair()
        ref_opt, opt = make_optim(kind, ref, groups), make_optim(kind, model, groups)
        # before any step: empty state
        empty = model.gather_full_optim_state_dict(opt)
        if rank == 0:
            assert empty["state"] == {}, empty["state"]
            assert len(empty["param_groups"]) == len(opt.param_groups)
        ref_train(ref, ref_opt, 2, world)
        train(model, opt, 2, world)
        recipient = world - 1
        full = model.gather_full_optim_state_dict(opt, recipient_rank=recipient)
        if rank != recipient:
            assert full is None
            got = [None]
        else:
            got = [full]
        torch.distributed.broadcast_object_list(got, src=recipient)
        full = got[0]
        expected = ref_opt.state_dict()
        assert sorted(full["state"]) == sorted(expected["state"]), (
            kind, sorted(full["state"]), sorted(expected["state"]))
        worst = 0.0
        for i, entry in expected["state"].items():
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    worst = max(worst, max_diff([full["state"][i][key]], [value]))
                else:
                    assert float(full["state"][i][key]) == float(value), (kind, i, key)
        for mine, theirs in zip(full["param_groups"], expected["param_groups"]):
            assert {k: v for k, v in mine.items() if k != "params"} == \
                {k: v for k, v in theirs.items() if k != "params"}, (mine, theirs)
            assert mine["params"] == theirs["params"]
        # a plain optimizer over the unwrapped model loads the full dict and steps alike
        plain = Net()
        plain.load_state_dict(model.state_dict())
        plain_opt = make_optim(kind, plain, groups)
        plain_opt.load_state_dict({k: v for k, v in full.items()
                                   if k in ("state", "param_groups")})
        # get_shard gives back this rank's own shard state; the dict is left as it was
        before = copy.deepcopy(full)
        shard = model.get_shard_from_optim_state_dict(full)
        unchanged = max_diff(*_flat_states(before, full))
        own = opt.state_dict()
        assert sorted(shard["state"]) == sorted(own["state"])
        back = max_diff(*_flat_states(shard, own))
        report[f"{kind}{'_groups' if groups else ''}"] = max(worst, back, unchanged)
    return report


def _flat_states(a: dict, b: dict):
    xs, ys = [], []
    for i in sorted(b["state"]):
        for key in sorted(b["state"][i]):
            x, y = a["state"][i][key], b["state"][i][key]
            if torch.is_tensor(y):
                xs.append(torch.as_tensor(x).reshape(y.shape).float())
                ys.append(y.float())
    return xs, ys


def _check_optim_state_moves_between_world_sizes(path: str):
    """A full optimizer state (from gather_full_optim_state_dict at one world size, or from a
    single-process optimizer) loads at another world size and training continues exactly."""
    world, rank = skdist.get_world_size(), skdist.get_rank()
    if not os.path.exists(path):  # the oracle's checkpoint after 2 steps, written once
        return None
    saved = torch.load(path, weights_only=True)
    ref = Net()
    ref.load_state_dict(saved["model"])
    ref_opt = make_optim("adam", ref, True)
    ref_opt.load_state_dict(saved["optim"])
    model = wrap_net(Net(seed=8))
    model.load_state_dict(saved["model"])
    opt = make_optim("adam", model, True)
    opt.load_state_dict(model.get_shard_from_optim_state_dict(saved["optim"]))
    ref_train(ref, ref_opt, 2, world, start=2)
    train(model, opt, 2, world, start=2)
    worst = max_diff(params_only(model.state_dict(), ref), params_only(ref.state_dict(), ref))
    # and back: gathered at this size equals the oracle's
    full = model.gather_full_optim_state_dict(opt)
    if rank == 0:
        worst = max(worst, max_diff(*_flat_states(full, ref_opt.state_dict())))
    return worst


def _save_oracle_checkpoint(path: str):
    world = 1
    ref = Net()
    ref_opt = make_optim("adam", ref, True)
    ref_train(ref, ref_opt, 2, world)
    torch.save({"model": ref.state_dict(), "optim": ref_opt.state_dict()}, path)


def _check_frozen_only_unit_has_no_state():
    """FairScale's test_model_with_unused_params: a unit whose parameters are frozen and never
    used sits between used units in the optimizer's order."""
    world, rank = skdist.get_world_size(), skdist.get_rank()
    results = []
    for wrap_l2 in (False, True):
        torch.manual_seed(0)
        net = nn.ModuleDict({"l": nn.Linear(4, 4),
                             "not_trained": FSDP(nn.Linear(4, 4).requires_grad_(False)),
                             "l2": nn.Linear(4, 4)})
        if wrap_l2:
            net["l2"] = FSDP(net["l2"])

        class Wrapped(nn.Module):
            def __init__(self):
                super().__init__()
                self.net = net

            def forward(self, x):
                with torch.no_grad():
                    y = self.net["not_trained"](x)
                return self.net["l2"](self.net["l"](x)) - y

        model = FSDP(Wrapped())
        opt = torch.optim.SGD(model.parameters(), momentum=0.9, lr=0.1)
        model(torch.rand(4)).sum().backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        full = model.gather_full_optim_state_dict(opt)
        if rank == 0:
            shard = model.get_shard_from_optim_state_dict(full)
            own = opt.state_dict()
            results.append((sorted(shard["state"]) == sorted(own["state"]),
                            max_diff(*_flat_states(shard, own))))
        else:
            results.append(full is None)
    del world
    return results


def _check_optim_bad_input():
    _, model = pair()
    opt = make_optim("sgd", model)
    other = torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1, momentum=0.9)
    errors = []
    # every rank raises before any collective: the next call still works (no rank hangs)
    for kwargs, error in (({"optim": opt, "recipient_rank": skdist.get_world_size()},
                           ValueError),
                          ({"optim": other}, ValueError),        # another model's optimizer
                          ({"optim": opt.state_dict()}, TypeError)):  # a state dict, not it
        try:
            model.gather_full_optim_state_dict(**kwargs)
        except error as e:
            errors.append(str(e))
        else:
            errors.append(None)
    model.gather_full_optim_state_dict(opt)
    return errors


# ---------------------------------------------------------------------- ShardedDDP vs torch DDP


class BNNet(nn.Module):
    def __init__(self, twice: bool = False):
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(6, 12)
        self.bn = nn.BatchNorm1d(12)
        self.b = nn.Linear(12, 12)
        self.c = nn.Linear(12, 4)
        self.twice = twice  # FairScale's multiple_fw: a layer used twice in one forward

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.bn(self.a(x)))))
        if self.twice:
            h = torch.relu(self.b(h))
        return self.c(h)


def _sdp_batch(step: int, rank: int, micro: int = 0):
    gen = torch.Generator().manual_seed(7000 + 100 * step + 10 * rank + micro)
    return torch.randn(4, 6, generator=gen), torch.randn(4, 4, generator=gen)


def _sdp_optims(kind: str, model: nn.Module, sharded: bool, two: bool, group=None):
    cls, hyper = ((torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}) if kind == "sgd"
                  else (torch.optim.Adam, {"lr": 0.01, "eps": 1e-4}))
    if two:
        parts = [list(model.a.parameters()) + list(model.bn.parameters()),
                 list(model.b.parameters()) + list(model.c.parameters())]
    else:
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        parts = [[{"params": weights}, {"params": biases, "lr": hyper["lr"] / 2}]]
    if sharded:
        return [OSS(part, optim=cls, group=group, **hyper) for part in parts]
    return [cls(part, **hyper) for part in parts]


def _sdp_pair(cfg: dict, group):
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = skdist.get_rank()
    ref_module, module = BNNet(cfg.get("twice", False)), BNNet(cfg.get("twice", False))
    if cfg.get("rank_buffer"):  # FairScale's parity test: one different buffer per rank
        for m in (ref_module, module):
            m.register_buffer("test_buffer", torch.ones(1) * rank)
    bb = cfg.get("broadcast_buffers", True)
    ddp = DDP(ref_module, broadcast_buffers=bb, process_group=group)
    if cfg.get("fp16"):  # FairScale's fp16_reduction: DDP with torch's fp16 compression hook
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
        ddp.register_comm_hook(group, fp16_compress_hook)
    ref_opts = _sdp_optims(cfg.get("optim", "sgd"), ref_module, False, cfg.get("two", False))
    opts = _sdp_optims(cfg.get("optim", "sgd"), module, True, cfg.get("two", False), group)
    sdp = ShardedDataParallel(module, opts if len(opts) > 1 else opts[0], process_group=group,
                              broadcast_buffers=bb,
                              reduce_buffer_size=cfg.get("reduce_buffer_size", 2 ** 20),
                              auto_refresh_trainable=cfg.get("auto_refresh", True),
                              reduce_fp16=cfg.get("fp16", False))
    return ref_module, ddp, ref_opts, module, sdp, opts


def _sdp_backward(model, cfg, step, rank, manual: bool):
    micro = 2 if cfg.get("accumulate") else 1
    for m in range(micro):
        x, y = _sdp_batch(step, rank, m)
        inside = m < micro - 1 or manual
        with model.no_sync() if inside else _null():
            F.mse_loss(model(x), y).backward()
    if manual:
        model.reduce()


def _run_sdp_vs_ddp(cfg: dict) -> float:
    """ShardedDDP + OSS against torch DDP + the same torch optimizer on the same local batches:
    parameters and buffers after every step, and the clipped norms."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    group = None
    if cfg.get("subgroup"):  # FairScale's test_multiple_groups: the odd ranks only
        ranks = [r for r in range(skdist.get_world_size()) if r % 2 == 1]
        group = skdist.new_group(ranks)
        if skdist.get_rank() not in ranks:
            return 0.0
    rank = skdist.get_rank()
    ref_module, ddp, ref_opts, module, sdp, opts = _sdp_pair(cfg, group)
    worst = 0.0
    for step in range(5):
        if cfg.get("freeze_at") == step:
            for m in (ref_module, module):
                m.b.requires_grad_(False)
            if not cfg.get("auto_refresh", True):
                sdp.refresh_trainable()
            # torch DDP needs a new wrapper after a freeze
            ddp = DDP(ref_module, broadcast_buffers=cfg.get("broadcast_buffers", True),
                      process_group=group)
        for model, optims, sharded in ((ddp, ref_opts, False), (sdp, opts, True)):
            manual = sharded and cfg.get("manual_reduce", False)
            for o in optims:
                o.zero_grad()
            if cfg.get("closure"):  # FairScale's two-optimizer test: step(closure)
                def closure(model=model, manual=manual):
                    _sdp_backward(model, cfg, step, rank, manual)
                optims[0].step(closure)
                for o in optims[1:]:
                    o.step()
            else:
                _sdp_backward(model, cfg, step, rank, manual)
                if cfg.get("clip"):
                    if sharded:
                        norm = opts[0].clip_grad_norm(0.3)
                    else:
                        ref_norm = torch.nn.utils.clip_grad_norm_(ref_module.parameters(), 0.3)
                for o in optims:
                    o.step()
            if cfg.get("eval_switch"):
                model.eval()
                with torch.no_grad():
                    model(_sdp_batch(step, rank, 9)[0])
                model.train()
        if cfg.get("clip"):
            worst = max(worst, float((norm - ref_norm).abs()))
        worst = max(worst, max_diff(ref_module.state_dict(), module.state_dict()))
    return worst


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


SDP_CONFIGS = {
    f"{optim}_rbs{rbs}_bb{bb}_acc{acc}": {"optim": optim, "reduce_buffer_size": rbs,
                                          "broadcast_buffers": bb, "accumulate": acc}
    for optim in ("sgd", "adam") for rbs in (0, 2 ** 20) for bb in (True, False)
    for acc in (False, True)
}
SDP_CONFIGS.update({
    "two_optimizers_rbs0": {"two": True, "reduce_buffer_size": 0},
    "two_optimizers_closure": {"two": True, "closure": True},
    "eval_switch": {"eval_switch": True},
    "eval_switch_accumulate": {"eval_switch": True, "accumulate": True},
    "freeze_auto_refresh": {"freeze_at": 2},
    "freeze_manual_refresh": {"freeze_at": 2, "auto_refresh": False},
    "clip_rank_buffer": {"clip": True, "rank_buffer": True},
    "clip_adam_accumulate_rbs0": {"clip": True, "optim": "adam", "accumulate": True,
                                  "reduce_buffer_size": 0},
    "manual_reduce": {"manual_reduce": True, "accumulate": True},
    "multiple_fw": {"twice": True, "rank_buffer": True},
    "multiple_fw_rbs0_accumulate": {"twice": True, "reduce_buffer_size": 0, "accumulate": True},
    "subgroup": {"subgroup": True, "accumulate": True},
    "subgroup_rbs0": {"subgroup": True, "reduce_buffer_size": 0, "two": True},
    # gradients in fp16 on the wire both sides; the rounding order differs (loose tolerance)
    "fp16_reduction": {"fp16": True},
    "fp16_reduction_rbs0_accumulate": {"fp16": True, "reduce_buffer_size": 0,
                                       "accumulate": True},
})
FP16_TOL = 1e-4


def _run_sdp_grid(names):
    return {name: _run_sdp_vs_ddp(SDP_CONFIGS[name]) for name in names}


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.a = nn.Linear(2, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x, y):
        return self.b(self.a(x) + self.a(y))


def _check_sdp_ddp_attributes():
    """FairScale's test_ddp_attributes, test_random_attributes, test_catch_grad_grad and
    test_inputs (two tensors in, both bucket settings, torch DDP's gradients)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = skdist.get_rank()
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3))
    model.banana = "sweet"
    sdp = ShardedDataParallel(model, OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1))
    attrs = all(hasattr(sdp, a) for a in ("is_multi_device_module", "device_type", "module"))
    forwarded = getattr(sdp, "banana", None) == "sweet" and not hasattr(sdp, "orange")
    # a gradient that itself requires grad is refused at the next forward
    model2 = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3))
    chained = torch.zeros_like(model2[0].weight, requires_grad=True)
    model2[0].weight.grad = chained
    sdp2 = ShardedDataParallel(model2, OSS(model2.parameters(), optim=torch.optim.SGD, lr=0.1))
    try:
        sdp2(torch.rand(4, 2))
        caught = None
    except RuntimeError as e:
        caught = str(e)
    worst = 0.0
    for rbs in (0, 2 ** 20):
        ref, mine = TwoInputs(), TwoInputs()
        ddp = DDP(ref)
        wrapped = ShardedDataParallel(mine, OSS(mine.parameters(), optim=torch.optim.SGD,
                                                lr=0.1, momentum=0.9),
                                      reduce_buffer_size=rbs)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            gen = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.rand(5, 2, generator=gen), torch.rand(5, 2, generator=gen)
            for m, o in ((ddp, ref_opt), (wrapped, None)):
                m(x, y).abs().sum().backward()
            ref_opt.step()
            ref_opt.zero_grad()
            wrapped.sharded_optimizers[0].step()
            wrapped.sharded_optimizers[0].zero_grad()
            worst = max(worst, max_diff(ref, mine))
    return attrs, forwarded, caught, worst


# ---------------------------------------------------------------------- tests


world1 = world_fixture(1)
world2 = world_fixture(2)
world4 = world_fixture(4)

FSDP_CHECKS = [_check_state_dict_keys_values_and_round_trip,
               _check_state_dict_after_forward_and_inside_summon,
               _check_local_state_dict_round_trip_and_offline_consolidation,
               _check_state_dict_rank0_only_and_devices,
               _check_consolidation_refuses_bad_input,
               _check_state_dict_on_a_rank_subset,
               _check_summon_full_params,
               _check_summon_memory,
               _check_summon_bad_options,
               _check_state_dict_dtypes,
               _check_gather_full_optim_state_matches_one_process,
               _check_frozen_only_unit_has_no_state,
               _check_optim_bad_input]


def _run_fsdp_checks(path):
    out = {fn.__name__: fn() for fn in FSDP_CHECKS}
    out["between_world_sizes"] = _check_optim_state_moves_between_world_sizes(path)
    return out


def _assert_fsdp(results, world):
    for rank, out in enumerate(results):
        worst, twice, fwd = out["_check_state_dict_keys_values_and_round_trip"]
        assert worst <= TOL and twice == 0 and fwd <= TOL, (worst, twice, fwd)
        assert out["_check_state_dict_after_forward_and_inside_summon"] == 0
        same, offline, reloaded = out[
            "_check_local_state_dict_round_trip_and_offline_consolidation"]
        assert same == 0 and offline == 0 and reloaded == 0
        errors, bias_kept, weight_kept = out["_check_consolidation_refuses_bad_input"]
        assert not bias_kept and weight_kept
        for name, words in (("shape", "'head.weight' has shape"),
                            ("reshard_shape", "head.weight"),
                            ("one_dict", "shard_weights=OrderedDict"),
                            ("rank_missing", "ranks"), ("strict", "head.bias")):
            if name in errors:
                assert errors[name] and words in errors[name], (name, errors[name])
        ok_rank0, devices = out["_check_state_dict_rank0_only_and_devices"]
        assert ok_rank0 and devices == {"cpu"}
        subset = out["_check_state_dict_on_a_rank_subset"]
        assert (subset is None) == (rank >= 2) and (subset is None or subset == 0)
        assert all(out["_check_summon_full_params"]), out["_check_summon_full_params"]
        for mems in out["_check_summon_memory"]:
            assert mems[1] >= mems[0] and mems[2] >= mems[1] and mems[3] == mems[0], mems
            assert world == 1 or mems[1] > mems[0], mems
        assert all(e and ("rank0_only" in e or "with_grads" in e or "volatile" in e)
                   for e in out["_check_summon_bad_options"]), out["_check_summon_bad_options"]
        grid = out["_check_gather_full_optim_state_matches_one_process"]
        assert all(v <= TOL for v in grid.values()), grid
        for r in out["_check_frozen_only_unit_has_no_state"]:
            assert r is True or (r[0] and r[1] == 0), r
        errors = out["_check_optim_bad_input"]
        assert errors[0] and "recipient_rank" in errors[0], errors
        assert errors[1] and "none of the optimizer's 2 parameters" in errors[1], errors
        assert errors[2] and "optim=dict" in errors[2], errors
        assert out["between_world_sizes"] <= TOL, out["between_world_sizes"]
        dtypes, unchanged, restored, fp16 = out["_check_state_dict_dtypes"]
        assert dtypes == [{torch.float32}] * 3 and fp16 == {torch.float16}, (dtypes, fp16)
        assert not unchanged and restored == 0, (unchanged, restored)


@pytest.fixture(scope="module")
def oracle_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("oracle") / "oracle.pt")
    from shardkit.testing import run_in_world  # noqa: F401  (the oracle needs no world)
    _save_oracle_checkpoint(path)
    return path


@pytest.mark.parametrize("size", [1, 2, 4])
def test_fsdp_state_checks(size, request, oracle_path):
    world = request.getfixturevalue(f"world{size}")
    _assert_fsdp(world.run(_run_fsdp_checks, oracle_path), size)


def test_local_state_dict_takes_state_dict_arguments(world2):
    for keys, filled, destination, kept, prefixed in world2.run(
            _check_local_state_dict_takes_state_dict_arguments):
        assert keys == ["0.weight", "0.bias", "1.weight", "1.bias"], keys
        assert filled and destination == ["p.bias", "p.weight"] and kept
        assert prefixed == ["q.weight", "q.bias"], prefixed


def _assert_sdp(results):
    bad = {k: v for out in results for k, v in out.items()
           if not v <= (FP16_TOL if k.startswith("fp16") else TOL)}
    assert not bad, bad


def test_sharded_ddp_matches_torch_ddp_world2(world2):
    _assert_sdp(world2.run(_run_sdp_grid, list(SDP_CONFIGS)))


def test_sharded_ddp_matches_torch_ddp_world4(world4):
    names = ["sgd_rbs0_bbTrue_accTrue", "adam_rbs1048576_bbFalse_accFalse",
             "two_optimizers_closure", "freeze_auto_refresh", "eval_switch_accumulate",
             "clip_rank_buffer", "manual_reduce", "multiple_fw_rbs0_accumulate", "subgroup",
             "subgroup_rbs0", "fp16_reduction_rbs0_accumulate"]
    _assert_sdp(world4.run(_run_sdp_grid, names))


def test_sharded_ddp_matches_torch_ddp_world1(world1):
    names = ["sgd_rbs0_bbTrue_accTrue", "two_optimizers_closure", "manual_reduce",
             "clip_rank_buffer"]
    _assert_sdp(world1.run(_run_sdp_grid, names))


def test_sharded_ddp_attributes(world2):
    for attrs, forwarded, caught, worst in world2.run(_check_sdp_ddp_attributes):
        assert attrs and forwarded
        assert caught and "requires grad" in caught, caught
        assert worst <= TOL, worst
