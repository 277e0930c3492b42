"""FSDP units sharded over groups other than the root's (FairScale's mixture-of-experts layout):
each expert unit's optimizer state is gathered over its own group and cut back to its own rank's
rows, and an expert alone on its rank is left out of the gather (FairScale's rule), listed under
``uncollected_local_ids``. Local checkpoints reload per rank; consolidating or resharding them
is a clear error (ranks of different groups hold different experts under one name)."""

import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.testing import world_fixture

world2 = world_fixture(2)
world4 = world_fixture(4)


class ExpertModel(nn.Module):
    """A shared trunk and head (sharded over the whole world by the root unit) around an expert
    sharded over ``expert_group``; experts of different groups start from different seeds."""

    def __init__(self, expert_group, expert_seed: int):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        torch.manual_seed(expert_seed)
        self.expert = FSDP(nn.Linear(8, 7), process_group=expert_group)  # 7 rows: padded

    def forward(self, x):
        hidden = torch.relu(self.trunk(x))
        return self.head(torch.cat([self.expert(hidden), hidden[:, :1]], dim=1))


def _expert_groups(size: int):
    """The ``size``-rank block this rank belongs to (every rank creates every group)."""
    world, rank = skdist.get_world_size(), skdist.get_rank()
    blocks = [skdist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
    return blocks[rank // size], rank // size


def _trained(expert_size: int):
    group, index = _expert_groups(expert_size)
    model = FSDP(ExpertModel(group, expert_seed=10 + index))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + skdist.get_rank())
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(5, 8)).pow(2).sum().backward()
        optim.step()
    return model, optim


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys()
        and all(torch.equal(torch.as_tensor(a[i][k]), torch.as_tensor(b[i][k])) for k in a[i])
        for i in a)


def _round_trips(expert_size: int):
    """Each rank in turn receives the full state; cutting it back gives that rank's own."""
    model, optim = _trained(expert_size)
    own = optim.state_dict()["state"]
    out = {"expert_marked": model.expert.no_broadcast_optim_state}
    weights = model.state_dict()
    with model.expert.summon_full_params():
        out["expert_weights"] = torch.equal(weights["expert.weight"],
                                            model.expert.module.weight)
    model.load_state_dict(weights)
    for recipient in range(skdist.get_world_size()):
        full = model.gather_full_optim_state_dict(optim, recipient_rank=recipient)
        if recipient == skdist.get_rank():
            names = full["param_names"]
            out["uncollected"] = sorted(names[i] for i in full["uncollected_local_ids"])
            out["expert_shape"] = tuple(full["state"][names.index("expert.weight")]["exp_avg"]
                                        .shape)
            out["trunk_shape"] = tuple(full["state"][names.index("trunk.weight")]["exp_avg"]
                                       .shape)
            out["round_trip"] = _same_state(model.get_shard_from_optim_state_dict(full)["state"],
                                            own)
    out.update(_local_checkpoint_checks(model))
    return out


def _local_checkpoint_checks(model) -> dict:
    """Local dicts of a model with experts: the own dict reloads at the same world size; every
    rank's dicts cannot be consolidated or resharded (the experts differ under one name), and
    both say so before touching the model."""
    local, meta = model.local_state_dict(), model.local_metadata_dict()
    dicts = [None] * skdist.get_world_size()
    metas = [None] * skdist.get_world_size()
    torch.distributed.all_gather_object(dicts, local)
    torch.distributed.all_gather_object(metas, meta)
    before = {k: v.clone() for k, v in model.local_state_dict().items()}
    model.load_local_state_dict(local)
    out = {"own_group_params": meta["own_group_params"],
           "own_reload": all(torch.equal(before[k], v)
                             for k, v in model.local_state_dict().items())}
    for what, call in (("consolidate", lambda: FSDP.consolidate_shard_weights(dicts, metas)),
                       ("reshard", lambda: model.load_local_state_dict(dicts, metas))):
        try:
            call()
            out[what] = "no error"
        except ValueError as e:
            out[what] = str(e)
    out["untouched"] = all(torch.equal(before[k], v) for k, v in model.local_state_dict().items())
    return out


def _assert_local_checkpoints(r) -> None:
    assert r["own_group_params"] == ["expert.bias", "expert.weight"], r
    assert r["own_reload"] and r["untouched"], r
    for what in ("consolidate", "reshard"):
        assert "expert.bias, expert.weight" in r[what] and "own process groups" in r[what] \
            and "load_local_state_dict(own_dict)" in r[what], r[what]


def test_expert_alone_on_its_rank_is_not_gathered(world2):
    for r in world2.run(_round_trips, 1):
        assert r["expert_marked"], r
        assert r["uncollected"] == ["expert.bias", "expert.weight"], r
        assert r["trunk_shape"] == (8, 8) and r["expert_shape"] == (7, 8), r
        assert r["round_trip"] and r["expert_weights"], r
        _assert_local_checkpoints(r)


def test_expert_groups_gather_over_their_own_group(world4):
    for r in world4.run(_round_trips, 2):
        assert not r["expert_marked"] and r["uncollected"] == [], r
        assert r["trunk_shape"] == (8, 8) and r["expert_shape"] == (7, 8), r
        assert r["round_trip"] and r["expert_weights"], r
        _assert_local_checkpoints(r)
