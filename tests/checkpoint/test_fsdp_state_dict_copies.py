"""State dicts of FSDP as users keep, copy and save them.

- ``best = copy.deepcopy(model.state_dict())`` under ``SHARDED_STATE_DICT``, and ``torch.save``
  / ``torch.load(weights_only=True)`` of it: the DTensors of every parameter but a unit's first
  (local tensors inside the flat shard) used to fail inside torch ("invalid python storage").
- ``LOCAL_STATE_DICT`` (and ``local_state_dict()``) of a model with a module's extra state
  (``get_extra_state``) used to crash (``'dict' object has no attribute 'clone'``).
- Module versions (``_metadata``, which a module's ``_load_from_state_dict`` reads to convert
  checkpoints of an older format) were dropped by FSDP's state dicts and by its loads: a
  current checkpoint went through the old-format conversion, silently (here a transpose).

One World(2) for the module.
"""

import copy
import io

import torch
import torch.nn as nn

from shardkit import distributed
from shardkit.testing import world_fixture
from tests.utils.factored_moments import FactoredMoments

world2 = world_fixture(2)


# ---------------------------------------------------------------------- rank-side helpers


class _Counted(nn.Module):
    """A Linear with extra state (as TransformerEngine's modules keep their fp8 metadata)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.counter = 3

    def get_extra_state(self):
        return {"counter": self.counter}

    def set_extra_state(self, state):
        self.counter = state["counter"]

    def forward(self, x):
        return self.lin(x)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(6, 7)    # 7 rows over 2 ranks: padded
        self.l2 = nn.Linear(7, 5)
        self.ex = _Counted()
        self.register_buffer("offset", torch.arange(5.0))

    def forward(self, x):
        return self.ex(self.l2(torch.tanh(self.l1(x)))) + self.offset


def _model(seed: int):
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    torch.manual_seed(seed)
    net = _Net()
    net.l1 = FSDP(net.l1)
    return FSDP(net)


def _diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a if torch.is_tensor(a[k]))


def _bump(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def _sharded_copies_restore():
    """deepcopy and torch.save round trips of a SHARDED_STATE_DICT; largest difference to the
    full state at the time of the copy after loading the copy back."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    model = _model(0)
    reference = model.state_dict()
    diffs = []
    for how in ("deepcopy", "torch.save"):
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            kept = model.state_dict()
        if how == "deepcopy":
            kept = copy.deepcopy(kept)
        else:
            buffer = io.BytesIO()
            torch.save(kept, buffer)
            buffer.seek(0)
            kept = torch.load(buffer, weights_only=True)
        _bump(model)
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            model.load_state_dict(kept)
        diffs.append(_diff(reference, model.state_dict()))
    return diffs


def _local_state_with_extra_state():
    """LOCAL_STATE_DICT of a model holding a module's extra state: the extra state as the
    module gives it, and a load into another model restores tensors and extra state."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    model = _model(0)
    model.ex.counter = 9
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        local = model.state_dict()
    other = _model(1)
    with FSDP.state_dict_type(other, StateDictType.LOCAL_STATE_DICT):
        other.load_state_dict(local)
    diff = _diff(model.state_dict(), other.state_dict())
    return local["ex._extra_state"], other.ex.counter, diff


class _Migrating(nn.Module):
    """Version 2 stores ``weight`` as (out, in); a checkpoint without a version (version 1)
    stored it transposed and is converted on load, as libraries convert old formats."""

    _version = 2

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        if local_metadata.get("version", 1) < 2 and prefix + "weight" in state_dict:
            state_dict[prefix + "weight"] = state_dict[prefix + "weight"].t()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)

    def forward(self, x):
        return x @ self.weight.t()


def _versions_kept():
    """A plain model's state dict into FSDP and FSDP's (full, sharded, local) back into a
    plain model or FSDP: the differences to the saved weights (0: no conversion applied)."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType

    saved, model = _migrating_model_loaded()
    diffs = [_diff(saved, model.state_dict())]
    plain = _migrating_model(2)
    plain.load_state_dict(model.state_dict())
    diffs.append(_diff(saved, plain.state_dict()))
    for kind in (StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT):
        with FSDP.state_dict_type(model, kind):
            kept = model.state_dict()
            if kind is StateDictType.LOCAL_STATE_DICT:  # copies (SHARDED: views)
                kept = copy.deepcopy(kept)
                _bump(model)
            model.load_state_dict(kept)
        diffs.append(_diff(saved, model.state_dict()))
    return diffs


def _migrating_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), _Migrating())


def _migrating_model_loaded() -> tuple:
    """(a plain model's state dict, another model wrapped in FSDP with its ``_Migrating``
    module a unit of its own, loaded from that dict)."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    saved = _migrating_model(0).state_dict()
    model = _migrating_model(1)
    model[1] = FSDP(model[1])
    model = FSDP(model)
    model.load_state_dict(saved)
    return saved, model


# ---------------------------------------------------------------------- tests


def test_sharded_state_dict_deepcopies_and_torch_saves(world2):
    for diffs in world2.run(_sharded_copies_restore):
        assert diffs == [0.0, 0.0]


def test_local_state_dict_keeps_a_modules_extra_state(world2):
    for extra, counter, diff in world2.run(_local_state_with_extra_state):
        assert extra == {"counter": 9} and counter == 9
        assert diff == 0.0


def test_module_versions_go_through_fsdp_state_dicts(world2):
    for diffs in world2.run(_versions_kept):
        assert diffs == [0.0] * 4


def _old_batchnorm_checkpoints():
    """A BatchNorm checkpoint of version 1 (no ``num_batches_tracked``) loads strictly into
    FSDP under every kind, as into the plain model (BatchNorm adds the key itself)."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType

    def build(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    def wrapped(seed):
        model = build(seed)
        model[1] = FSDP(model[1])
        return FSDP(model)

    def old(sd):
        sd = copy.deepcopy(sd)
        del sd["1.num_batches_tracked"]
        sd._metadata["1"] = {"version": 1}
        return sd

    saved = old(build(0).state_dict())
    plain = build(1)
    plain.load_state_dict(copy.deepcopy(saved))
    model = wrapped(1)
    model.load_state_dict(saved)
    diffs = [_diff(plain.state_dict(), model.state_dict())]
    for kind in (StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT):
        with FSDP.state_dict_type(model, kind):
            model.load_state_dict(old(model.state_dict()))
        diffs.append(_diff(plain.state_dict(), model.state_dict()))
    return diffs


def _consolidated_keeps_versions():
    """consolidate_shard_weights of every rank's local_state_dict keeps the module versions,
    so the plain model loads it without converting it again."""
    import torch.distributed as dist
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP

    saved, model = _migrating_model_loaded()
    weights, metas = [None, None], [None, None]
    dist.all_gather_object(weights, model.local_state_dict())
    dist.all_gather_object(metas, model.local_metadata_dict())
    plain = _migrating_model(2)
    plain.load_state_dict(FSDP.consolidate_shard_weights(weights, metas))
    return _diff(saved, plain.state_dict())


def _local_offload_with_extra_state():
    from torch.distributed.fsdp import LocalStateDictConfig
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    model = _model(0)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT,
                              LocalStateDictConfig(offload_to_cpu=True)):
        local = model.state_dict()
    return local["ex._extra_state"]


def test_old_batchnorm_checkpoints_load_as_in_one_process(world2):
    for diffs in world2.run(_old_batchnorm_checkpoints):
        assert diffs == [0.0] * 3


def test_consolidated_local_state_keeps_module_versions(world2):
    assert world2.run(_consolidated_keeps_versions) == [0.0, 0.0]


def test_local_state_dict_offloaded_with_extra_state(world2):
    assert world2.run(_local_offload_with_extra_state) == [{"counter": 3}] * 2


def _sharded_values_compile():
    """torch.compile of an op on every DTensor of a SHARDED_STATE_DICT (rows inside a flat
    shard included) gives the eager result."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    model = _model(0)
    full = model.state_dict()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
    double = torch.compile(lambda t: t * 2 + 1, backend="aot_eager")
    return [k for k, v in sharded.items() if hasattr(v, "full_tensor")
            and not torch.equal(double(v).full_tensor(), full[k] * 2 + 1)]


def test_sharded_state_dict_values_compile(world2):
    assert world2.run(_sharded_values_compile) == [[], []]


def _torch_dsd_over_a_users_optimizer(path: str) -> dict:
    """torch's own get_state_dict over shardkit FSDP and an Adam the user built over it (never
    seen by shardkit): dcp.save of its optimizer state (this rank's rows as plain tensors)
    used to write rank 0's rows as if replicated; it is refused on every rank, nothing
    written. With full_state_dict=True those rows were returned as the full state: refused
    before any collective. The model's keys are the unwrapped model's."""
    import os
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    model = _model(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    optim.step()
    out = {}
    try:
        get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
        out["full"] = "accepted"
    except ValueError as error:
        out["full"] = str(error)
    model_state, optim_state = get_state_dict(model, optim)
    out["keys"] = sorted(model_state) == sorted(_model(0).state_dict())
    try:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        out["save"] = "saved"
    except dcp.api.CheckpointException as error:  # on every rank
        out["save"] = repr(error)
    out["written"] = sorted(os.listdir(path)) if os.path.isdir(path) else []
    return out


def test_torch_get_state_dict_over_a_users_optimizer_is_refused_by_dcp(world2, tmp_path):
    for rank, r in enumerate(world2.run(_torch_dsd_over_a_users_optimizer, str(tmp_path))):
        assert "shardkit.checkpoint.get_state_dict" in r["full"], (rank, r)
        assert r["keys"], (rank, r)
        assert "shardkit.checkpoint.get_state_dict" in r["save"], (rank, r)
        assert r["written"] == [], (rank, r)


def _versions_under_a_plain_parent() -> list:
    """A plain parent holding a unit whose ``_Migrating`` module sits below the unit's wrapped
    module: the parent's load_state_dict used to hand that module no version (torch's walk
    gives the unit its own entry only), so a current checkpoint was converted as an old one
    (transposed), silently. Differences to the saved weights, under each kind."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), _Migrating()))
        model[1] = FSDP(model[1])
        return model

    source = build(0)
    diffs = []
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
        with FSDP.state_dict_type(source[1], StateDictType[kind]):
            saved = source.state_dict()
        model = build(1)
        with FSDP.state_dict_type(model[1], StateDictType[kind]):
            model.load_state_dict(saved)
        diffs.append(_diff(source.state_dict(), model.state_dict()))
    return diffs


def test_module_versions_reach_modules_inside_a_unit_under_a_plain_parent(world2):
    for diffs in world2.run(_versions_under_a_plain_parent):
        assert diffs == [0.0] * 3, diffs


def _optim_dicts_bad_on_one_rank() -> dict:
    """FSDP.optim_state_dict_to_load given a dict that fits on rank 0 but not on rank 1 (state
    missing for one parameter, a plain tensor of neither the full nor the shard shape): rank 1
    used to raise (or load silently) while rank 0 went on to its next collective and hung.
    Under FULL_STATE_DICT with ``FullOptimStateDictConfig(rank0_only=True)`` only rank 0's
    dict counts, as in torch FSDP1: ``{}`` on rank 1 used to be refused; rank 0's ``{}`` is
    refused naming rank 0 only. A dict missing a parameter's state on rank 0 only used to be
    blamed on rank 1 (rank 0's dict was taken as the reference)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    model = _model(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 6)).sum().backward()
    optim.step()
    before = copy.deepcopy(optim.state_dict())
    rank, out = dist.get_rank(), {}
    fresh = torch.optim.Adam(model.parameters(), lr=0.01)
    for kind in ("local", "sharded", "full", "full rank 0", "full unequal"):
        if kind.startswith("full"):
            settings = (StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                        FullOptimStateDictConfig(rank0_only=kind != "full unequal"))
        else:
            settings = (getattr(StateDictType, f"{kind.upper()}_STATE_DICT"),)
        with FSDP.state_dict_type(model, *settings):
            osd = FSDP.optim_state_dict(model, optim)
            target = fresh if kind == "full" else optim
            if rank == 1 and kind == "local":
                del osd["state"][0]
            elif rank == 1 and kind == "sharded":
                osd["state"]["l1.weight"]["exp_avg"] = torch.zeros(2, 6)
            elif rank == 0 and kind == "full rank 0":
                osd = {}
            elif rank == 0 and kind == "full unequal":
                del osd["state"]["l1.bias"]
            try:
                FSDP.optim_state_dict_to_load(model, target, osd, load_directly=True)
                out[kind] = "loaded"
            except ValueError as error:
                out[kind] = str(error)
    alive = torch.ones(1)
    dist.all_reduce(alive)
    out["alive"] = alive.item()
    out["unchanged"] = all(
        torch.equal(v, before["state"][i][k]) for i, s in optim.state_dict()["state"].items()
        for k, v in s.items())
    got = fresh.state_dict()["state"]  # rank 0's dict, each rank's rows
    out["rank0_only loaded"] = sorted(got) == sorted(before["state"]) and all(
        torch.equal(v, got[i][k]) for i, s in before["state"].items() for k, v in s.items())
    # rank 0's dict with every tensor sent by its own broadcast (a real model's moments), not
    # inside the pickled skeleton (this model's are all small)
    from shardkit.nn.data_parallel import fsdp_optim_state_from_first_rank as from_first_rank
    threshold, from_first_rank._PICKLED_NUMEL = from_first_rank._PICKLED_NUMEL, 1
    try:
        one_by_one = torch.optim.Adam(model.parameters(), lr=0.01)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                  FullOptimStateDictConfig(rank0_only=True)):
            osd = FSDP.optim_state_dict(model, optim)  # a collective; {} off rank 0 (rank0_only)
            with distributed.CommCounter() as counter:
                FSDP.optim_state_dict_to_load(model, one_by_one, osd, load_directly=True)
    finally:
        from_first_rank._PICKLED_NUMEL = threshold
    got = one_by_one.state_dict()["state"]
    out["sent one by one"] = counter.calls_by_op.get("broadcast", 0) - 3 * len(got), all(
        torch.equal(v, got[i][k]) for i, s in before["state"].items() for k, v in s.items())
    return out


def test_optim_state_dict_bad_on_one_rank_raises_on_every_rank(world2):
    for out in world2.run(_optim_dicts_bad_on_one_rank):
        assert out["alive"] == 2.0 and out["unchanged"], out
        assert "on rank 1: parameter l1.weight has state []" in out["local"], out
        assert "on rank 1:" in out["sharded"] and "'exp_avg' of l1.weight has shape (2, 6)" \
            in out["sharded"], out
        assert out["full"] == "loaded" and out["rank0_only loaded"], out
        # one broadcast of the skeleton, then each parameter's exp_avg, exp_avg_sq and step
        assert out["sent one by one"] == (1, True), out
        assert "on rank 0:" in out["full rank 0"] and "on rank 1" not in out["full rank 0"] \
            and "expected a full optimizer state dict" in out["full rank 0"], out
        assert "on rank 0: parameter l1.bias has state []" in out["full unequal"] \
            and "on rank 1:" not in out["full unequal"], out


def _optim_dicts_other_shapes_and_malformed() -> dict:
    """Adafactor's factored state (row_var (rows, 1), col_var (1, cols): not per-element)
    round-trips under SHARDED_STATE_DICT; a malformed state entry on rank 1 only (a list, an
    AttributeError inside) raises on every rank instead of hanging rank 0."""
    import torch.distributed as dist

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    model = _model(0)
    optim = FactoredMoments(model.parameters(), lr=0.01)  # torch's Adafactor, renamed
    model(torch.randn(3, 6)).sum().backward()
    optim.step()
    out = {}
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        FSDP.optim_state_dict_to_load(model, optim, FSDP.optim_state_dict(model, optim),
                                      load_directly=True)
        out["adafactor"] = "loaded"
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        osd = FSDP.optim_state_dict(model, optim)
        if dist.get_rank() == 1:
            osd["state"][0] = [1, 2]
        try:
            FSDP.optim_state_dict_to_load(model, optim, osd, load_directly=True)
            out["malformed"] = "loaded"
        except ValueError as error:
            out["malformed"] = str(error)
    return out


def test_optim_state_dict_other_shapes_load_and_malformed_raises_on_every_rank(world2):
    for out in world2.run(_optim_dicts_other_shapes_and_malformed):
        assert out["adafactor"] == "loaded", out
        assert "on rank 1: AttributeError" in out["malformed"], out


def _rekeyed_optim_state() -> dict:
    """torch FSDP1's ``FSDP.rekey_optim_state_dict`` (was missing: AttributeError) between a
    plain optimizer's id-keyed dict and the name-keyed one, with a frozen parameter (the
    optimizer's ids are not ``model.parameters()``' positions): the plain state goes into the
    wrapped model's optimizer and comes back equal."""
    from torch.distributed.fsdp import OptimStateKeyType

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP

    def build():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        net[0].bias.requires_grad_(False)
        return net

    plain = build()
    plain_optim = torch.optim.Adam([p for p in plain.parameters() if p.requires_grad], lr=0.01)
    plain(torch.randn(4, 6)).sum().backward()
    plain_optim.step()
    saved = plain_optim.state_dict()
    by_name = FSDP.rekey_optim_state_dict(saved, OptimStateKeyType.PARAM_NAME, plain,
                                          optim=plain_optim)
    net = build()
    net[2] = FSDP(net[2])
    model = FSDP(net)
    model.load_state_dict(plain.state_dict())
    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    optim.load_state_dict(FSDP.shard_full_optim_state_dict(by_name, model))
    full = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    back = FSDP.rekey_optim_state_dict(
        FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_NAME, model, optim=optim),
        OptimStateKeyType.PARAM_ID, plain, optim=plain_optim)
    try:
        FSDP.rekey_optim_state_dict(saved, "PARAM_INDEX", plain)
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {"names": sorted(by_name["state"]), "groups": back["param_groups"][0]["params"],
            "equal": all(torch.equal(v, back["state"][i][k])
                         for i, s in saved["state"].items() for k, v in s.items()),
            "refused": refused}


def test_rekey_optim_state_dict_round_trips_through_a_wrapped_model(world2):
    for out in world2.run(_rekeyed_optim_state):
        assert out["names"] == ["0.weight", "2.bias", "2.weight"], out
        assert out["groups"] == [0, 1, 2] and out["equal"], out
        assert "optim_state_key_type='PARAM_INDEX'" in out["refused"], out


def _optimizer_with_outside_params() -> dict:
    """An optimizer over the model's parameters and two outside it (a temperature): under
    FULL_STATE_DICT ``FSDP.optim_state_dict`` used to key both ``None`` (one's state silently
    kept for both) and its load failed with ``invalid literal for int()``; it is refused by
    name before gathering, as under SHARDED, and ``full_optim_state_dict`` /
    ``shard_full_optim_state_dict`` (ids) carry the outside state."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    model = _model(0)
    outside = [nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(2, 2))]
    optim = torch.optim.Adam([{"params": list(model.parameters())},
                              {"params": outside, "lr": 0.1}], lr=0.01)
    ((model(torch.randn(3, 6)) * outside[0]).sum() + outside[1].sum()).backward()
    optim.step()
    out = {"n": len(list(model.parameters()))}
    try:
        FSDP.optim_state_dict(model, optim)
        out["full"] = "saved"
    except ValueError as error:
        out["full"] = str(error)
    saved = optim.state_dict()
    optim.load_state_dict(FSDP.shard_full_optim_state_dict(
        FSDP.full_optim_state_dict(model, optim, rank0_only=False), model))
    out["ids"] = all(torch.equal(v, optim.state_dict()["state"][i][k])
                     for i, s in saved["state"].items() for k, v in s.items())
    named = {"state": {}, "param_groups": [{"params": ["l1.weight", None]}]}
    try:
        FSDP.shard_full_optim_state_dict(named, model)
    except ValueError as error:
        out["mixed"] = str(error)
    return out


def test_optimizer_with_parameters_outside_the_model(world2):
    for out in world2.run(_optimizer_with_outside_params):
        n = out["n"]
        assert f"parameters [{n}, {n + 1}] (in param-group order) are not parameters of this " \
            "model" in out["full"], out
        assert out["ids"], out
        assert "mix parameter names and other keys ([None]" in out["mixed"], out


def _rank0_only_with_experts() -> dict:
    """A model with an expert (a unit over a group of its own rank): a full optimizer state
    dict on rank 0 alone cannot hold the other rank's expert state. ``optim_state_dict`` under
    ``rank0_only`` used to drop it silently, and rank 0's dict loaded everywhere would give
    rank 1 rank 0's expert state: refused by name, on every rank, before any collective."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullOptimStateDictConfig

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    torch.manual_seed(dist.get_rank())
    net = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    net[1] = FSDP(net[1], process_group=groups[dist.get_rank()])
    model = FSDP(net)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 6)).sum().backward()
    optim.step()
    out = {}
    for call in ("save", "load", "full", "scatter"):
        try:
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, None,
                                      FullOptimStateDictConfig(rank0_only=True)):
                if call == "save":
                    FSDP.optim_state_dict(model, optim)
                elif call == "load":
                    FSDP.optim_state_dict_to_load(model, optim, {})
                elif call == "full":
                    FSDP.full_optim_state_dict(model, optim)
                else:
                    FSDP.scatter_full_optim_state_dict(None, model)
            out[call] = "no error"
        except ValueError as error:
            out[call] = str(error)
    return out


def test_rank0_only_optimizer_state_of_a_model_with_experts_is_refused(world2):
    for out in world2.run(_rank0_only_with_experts):
        for call, error in out.items():
            assert "the parameters ['1.weight', '1.bias'] are sharded over other ranks" \
                in error and "rank0_only=False" in error, (call, error)


def _named_dict_in_another_order() -> dict:
    """A full optimizer state dict keyed by names whose param group lists the names in another
    order than the optimizer's (sorted, as torch's ``rekey_optim_state_dict`` writes them):
    ``optim_state_dict_to_load`` and ``shard_full_optim_state_dict(..., optim=)`` used to give
    each parameter the state at its position (another parameter's), where torch FSDP1 matches
    names; now each gets its own."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    model = _model(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 6)).pow(2).sum().backward()
    optim.step()
    saved = copy.deepcopy(optim.state_dict())
    out = {}
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                              FullOptimStateDictConfig()):
        named = FSDP.optim_state_dict(model, optim)
    named["param_groups"][0]["params"] = sorted(named["param_groups"][0]["params"])
    for how in ("to_load", "shard"):
        fresh = torch.optim.Adam(model.parameters(), lr=0.01)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            fresh.load_state_dict(
                FSDP.optim_state_dict_to_load(model, fresh, named) if how == "to_load" else
                FSDP.shard_full_optim_state_dict(named, model, optim=fresh))
        got = fresh.state_dict()["state"]
        out[how] = all(got[i][k].shape == v.shape and torch.equal(got[i][k], v)
                       for i, s in saved["state"].items() for k, v in s.items())
    return out


def test_named_optimizer_state_loads_by_name_in_any_order(world2):
    for out in world2.run(_named_dict_in_another_order):
        assert out == {"to_load": True, "shard": True}, out


def _optimizer_state_through_a_plain_parent() -> dict:
    """torch FSDP1's optimizer-state functions take a plain module holding the units (here
    beside a Linear no unit holds): they raised AttributeError ('Sequential' object has no
    attribute '_state_dict_settings'). Each kind round-trips, keyed by the module's names."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))
    model[0] = FSDP(model[0])
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 6)).pow(2).sum().backward()
    optim.step()
    saved = copy.deepcopy(optim.state_dict())
    out = {}
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT", "ids"):
        fresh = torch.optim.Adam(model.parameters(), lr=0.01)
        if kind == "ids":
            fresh.load_state_dict(FSDP.shard_full_optim_state_dict(
                FSDP.full_optim_state_dict(model, optim, rank0_only=False), model))
        else:
            with FSDP.state_dict_type(model, getattr(StateDictType, kind)):
                osd = FSDP.optim_state_dict(model, optim)
                out[kind, "keys"] = sorted(map(str, osd["state"]))
                FSDP.optim_state_dict_to_load(model, fresh, osd, load_directly=True)
        got = fresh.state_dict()["state"]
        out[kind] = all(torch.equal(got[i][k], v)
                        for i, s in saved["state"].items() for k, v in s.items())
    return out


def test_optimizer_state_functions_take_a_plain_module_holding_units(world2):
    for out in world2.run(_optimizer_state_through_a_plain_parent):
        names = ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert out["FULL_STATE_DICT", "keys"] == names == out["SHARDED_STATE_DICT", "keys"], out
        assert all(out[k] for k in ("FULL_STATE_DICT", "SHARDED_STATE_DICT",
                                    "LOCAL_STATE_DICT", "ids")), out


def test_rekey_to_ids_sorts_each_group_as_torch():
    """A dict keyed by names in another order than the optimizer's (torch's rekey sorts the
    names) rekeyed to ids loads each parameter's own state into a plain optimizer (the ids
    were listed in the names' order, which optim.load_state_dict pairs by position)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import OptimStateKeyType

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    optim = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.randn(3, 4)).pow(2).sum().backward()
    optim.step()
    by_name = TorchFSDP.rekey_optim_state_dict(optim.state_dict(), OptimStateKeyType.PARAM_NAME,
                                               net, optim=optim)
    fresh = torch.optim.Adam(net.parameters(), lr=0.1)
    fresh.load_state_dict(FSDP.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_ID, net,
                                                      optim=optim))
    for p in net.parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], optim.state[p]["exp_avg"])


def _named_dict_in_other_groups() -> dict:
    """Names listed in other param groups than the optimizer's (same sizes): loaded each
    parameter another's state silently (torch FSDP1 fails an assertion); and a rank0_only
    dict that cannot be pickled on rank 0: rank 0 raised, rank 1 hung in the broadcast."""
    from torch.distributed.fsdp import FullOptimStateDictConfig

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    p = dict(model.named_parameters())

    def adam():
        return torch.optim.Adam([{"params": [p["0.weight"], p["0.bias"]]},
                                 {"params": [p["1.weight"], p["1.bias"]], "lr": 0.1}], lr=0.01)
    optim = adam()
    model(torch.randn(3, 4)).pow(2).sum().backward()
    optim.step()
    out = {}
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, None,
                              FullOptimStateDictConfig(rank0_only=True)):
        osd = FSDP.optim_state_dict(model, optim)
        if osd:
            moved = copy.deepcopy(osd)
            moved["param_groups"][0]["params"] = ["1.weight", "0.bias"]
            moved["param_groups"][1]["params"] = ["0.weight", "1.bias"]
            osd["param_groups"][0]["schedule"] = lambda step: 0.1
        else:
            moved = {}
        for case, given in (("moved", moved), ("unpicklable", osd)):
            try:
                FSDP.optim_state_dict_to_load(model, adam(), given, load_directly=True)
                out[case] = "loaded"
            except ValueError as error:
                out[case] = str(error)
    return out


def test_named_dict_in_other_groups_and_unpicklable_dict_are_refused(world2):
    for out in world2.run(_named_dict_in_other_groups):
        assert "its parameters are in other param groups" in out["moved"], out
        assert "on rank 0:" in out["unpicklable"] and "pickle" in out["unpicklable"], out
