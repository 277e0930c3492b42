"""torch.distributed.checkpoint (dcp) with FSDP reached in ways other than ``fsdp.state_dict()``.

- An FSDP root inside a plain module (``nn.Sequential(fsdp)``, a trainer's wrapper): the plain
  module's ``state_dict()`` follows the unit's ``state_dict_type`` as torch FSDP1 does:
  ``SHARDED_STATE_DICT`` DTensors, which dcp saves and loads back into a fresh model (another
  seed) through the plain module; ``FULL_STATE_DICT`` full tensors, which dcp saves too;
  ``LOCAL_STATE_DICT`` the padded shards, which dcp refuses on every rank instead of saving one
  rank's rows as if replicated; ``torch.save`` of the default (full) dict loads into the
  unwrapped model.
- A ``SHARDED_STATE_DICT`` load inside ``summon_full_params`` (the parameters hold full values
  there) is refused on every rank, naming it, with nothing loaded (buffers included).
- The optimizer's per-element state of sharded parameters as ``FSDP.optim_state_dict`` gives it
  under ``LOCAL_STATE_DICT`` (this rank's padded rows under the same keys on every rank):
  refused by dcp on every rank; ``torch.save`` and loading back still work and the optimizer's
  own state is untouched.

One World(2); rows that do not divide 2 (padded shards).
"""

import io

import torch
import torch.nn as nn

from shardkit import distributed as skd
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel import StateDictType
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(6, 7)
        self.l2 = nn.Linear(7, 5)
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, 5))

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x))) + self.offset


def _outer(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    net = _Net()
    net.l1 = FSDP(net.l1)
    return nn.Sequential(FSDP(net))


def _train(outer, optim, steps: int = 2) -> None:
    rank = skd.get_rank()
    for step in range(steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))[2 * rank:2 * rank + 2]
        optim.zero_grad()
        outer(x).square().mean().backward()
        optim.step()


def _full(fsdp) -> dict:
    with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT):
        return {k: v.clone() for k, v in fsdp.state_dict().items()}


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() if a[k].shape == b[k].shape else float("inf")
               for k in a)


def _plain_parent(folder: str) -> dict:
    import os
    import torch.distributed.checkpoint as dcp
    outer = _outer(1)
    _train(outer, torch.optim.SGD(outer.parameters(), lr=0.1))
    out = {}
    for kind in (StateDictType.SHARDED_STATE_DICT, StateDictType.FULL_STATE_DICT,
                 StateDictType.LOCAL_STATE_DICT):
        with FSDP.state_dict_type(outer, kind):
            state = outer.state_dict()
            try:
                dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{folder}/{kind.name}"))
                out[kind.name] = "saved"
            except dcp.api.CheckpointException as error:
                out[kind.name] = str(error)
        out[kind.name + " metadata"] = os.path.exists(f"{folder}/{kind.name}/.metadata")
    fresh = _outer(5)
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        state = fresh.state_dict()
        dcp.load(state, storage_reader=dcp.FileSystemReader(f"{folder}/SHARDED_STATE_DICT"))
        fresh.load_state_dict(state)
    out["dcp round trip"] = _diff(_full(fresh[0]), _full(outer[0]))
    buffer = io.BytesIO()
    torch.save(outer.state_dict(), buffer)
    buffer.seek(0)
    plain = _Net()
    plain.load_state_dict({k[len("0."):]: v for k, v in
                           torch.load(buffer, weights_only=True).items()})
    out["torch.save"] = _diff(plain.state_dict(), _full(outer[0]))
    return out


def _local_optim(folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    outer = _outer(1)
    optim = torch.optim.Adam(outer.parameters(), lr=0.1)
    _train(outer, optim)
    before = {i: {k: v.clone() for k, v in s.items()} for i, s in
              optim.state_dict()["state"].items()}
    out = {}
    with FSDP.state_dict_type(outer[0], StateDictType.LOCAL_STATE_DICT):
        osd = FSDP.optim_state_dict(outer[0], optim)
    for how, state in (("local", osd),):
        try:
            dcp.save({"optim": state},
                     storage_writer=dcp.FileSystemWriter(f"{folder}/{how}"))
            out[how] = "saved"
        except dcp.api.CheckpointException as error:
            out[how] = str(error)
    with FSDP.state_dict_type(outer[0], StateDictType.LOCAL_STATE_DICT):
        buffer = io.BytesIO()
        torch.save(osd, buffer)
        buffer.seek(0)
        optim.load_state_dict(FSDP.optim_state_dict_to_load(
            outer[0], optim, torch.load(buffer, weights_only=True)))
    after = optim.state_dict()["state"]
    out["state unchanged"] = all(torch.equal(after[i][k], v) for i, s in before.items()
                                 for k, v in s.items())
    out["live state unmarked"] = not any(hasattr(v, "__create_write_items__")
                                         for s in optim.state.values() for v in s.values())
    return out


def _load_inside_summon(_folder: str) -> dict:
    fsdp, other = _outer(1)[0], _outer(5)[0]
    with torch.no_grad():
        other.offset.add_(10.0)
    with FSDP.state_dict_type(other, StateDictType.SHARDED_STATE_DICT):
        state = other.state_dict()
    before = _full(fsdp)
    out = {}
    try:
        with fsdp.summon_full_params():
            with FSDP.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT):
                fsdp.load_state_dict(state)
        out["error"] = None
    except RuntimeError as error:
        out["error"] = str(error)
    out["changed"] = _diff(_full(fsdp), before)
    return out


def test_fsdp_inside_a_plain_module_follows_its_state_dict_type_in_dcp(world2, tmp_path):
    for r in world2.run(_plain_parent, str(tmp_path)):
        for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
            assert r[kind] == "saved" and r[kind + " metadata"], r
        assert "cannot save or load" in r["LOCAL_STATE_DICT"], r
        assert "SHARDED_STATE_DICT" in r["LOCAL_STATE_DICT"], r
        assert not r["LOCAL_STATE_DICT metadata"], r
        assert r["dcp round trip"] == 0.0 and r["torch.save"] == 0.0, r


def test_local_optim_state_refused_by_dcp(world2, tmp_path):
    for r in world2.run(_local_optim, str(tmp_path)):
        for how in ("local",):
            assert "cannot save or load" in r[how] and "SHARDED_STATE_DICT" in r[how], (how, r)
        assert r["state unchanged"] and r["live state unmarked"], r


def test_sharded_load_inside_summon_refused(world2, tmp_path):
    for r in world2.run(_load_inside_summon, str(tmp_path)):
        assert "inside summon_full_params" in (r["error"] or ""), r
        assert "nothing was loaded" in r["error"], r
        assert r["changed"] == 0.0, r
