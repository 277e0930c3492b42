"""FSDP's ``SHARDED_STATE_DICT`` through torch.distributed.checkpoint (dcp).

pytorch/examples' ``checkpoint_handler.py`` pattern: under
``FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)`` the model's ``state_dict()``
(DTensors of each rank's rows) and ``FSDP.optim_state_dict(model, optim)`` are saved with
``dcp.save`` and loaded back with ``dcp.load`` + ``load_state_dict`` /
``FSDP.optim_state_dict_to_load``. The model has row counts that do not divide 2 or 4 (padded
shards, ranks without rows), nested units, a frozen layer, a 0-dim parameter and a buffer.

One World(4): a checkpoint is written by ranks 0 and 1 (a model sharded over that pair, dcp over
that pair) and loaded at world 2 (the same pair: the resumed run must continue bit-identically),
at world 4 (all ranks) and at world 1 (each rank alone): after resharding, training continues
exactly as after loading the same state through the FULL_STATE_DICT path, and stays within fp32
rounding of the uninterrupted run. Bad input: a SHARDED dict of another model's shapes is refused
on every rank with torch's message, nothing loaded, no rank left in a collective.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from shardkit import distributed as skd
from shardkit.checkpoint.dtensor_state import init_optimizer_state
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel import StateDictType
from shardkit.testing import world_fixture

GLOBAL_BATCH = 4
WIDTH = 6
STEPS_BEFORE, STEPS_AFTER = 2, 2
TOL = 1e-5

world4 = world_fixture(4, timeout=120)


# ---------------------------------------------------------------------- rank-side helpers


class _Scaled(nn.Module):
    """Linear layers with 5 and 7 output rows (padded at 2 and 4 ranks; a rank without rows at
    4), a 0-dim parameter and a buffer."""

    def __init__(self, width: int = WIDTH, hidden: int = 7):
        super().__init__()
        self.l1 = nn.Linear(width, hidden)
        self.l2 = nn.Linear(hidden, 5)
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, 5))

    def forward(self, x):
        return self.frozen(torch.tanh(self.l2(torch.tanh(self.l1(x))))) * self.scale + \
            self.offset


def _model(seed: int, group=None, hidden: int = 7) -> FSDP:
    torch.manual_seed(seed)
    m = _Scaled(hidden=hidden)
    m.l1 = FSDP(m.l1, process_group=group)
    m.l2 = FSDP(m.l2, process_group=group)
    return FSDP(m, process_group=group)


def _optim(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05,
                             weight_decay=0.01)


def _step(model, optim, step: int, group=None) -> None:
    gen = torch.Generator().manual_seed(700 + step)
    x = torch.randn(GLOBAL_BATCH, WIDTH, generator=gen)
    y = torch.randn(GLOBAL_BATCH, 5, generator=gen)
    n, r = skd.get_world_size(group), skd.get_rank(group)
    per = GLOBAL_BATCH // n
    out = model(x[r * per:(r + 1) * per])
    loss = ((out - y[r * per:(r + 1) * per]) ** 2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def _full(model) -> dict:
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return {k: v.clone() for k, v in model.state_dict().items()}


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((x.float() - y.float()).abs().max().item() if x.numel() else 0.0
               for x, y in zip(a.values(), [b[k] for k in a]))


def _save_sharded(model, optim, folder: str, group) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), process_group=group)
    return {k: (type(v).__name__, tuple(v.shape),
                tuple(v.to_local().shape) if isinstance(v, DTensor) else None)
            for k, v in state["model"].items()}


def _load_sharded(model, optim, folder: str, group) -> None:
    import torch.distributed.checkpoint as dcp
    init_optimizer_state(optim)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), process_group=group)
        model.load_state_dict(state["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))


def _load_full(model, optim, full_model: dict, full_optim: dict) -> None:
    model.load_state_dict(full_model)
    optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, full_optim))


def _continue(model, optim, group) -> list:
    fulls = []
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        _step(model, optim, step, group)
        fulls.append(_full(model))
    return fulls


def _resume_and_reshard(folder: str) -> dict:
    """Ranks 0-1 train and save (SHARDED via dcp, FULL via torch.save) at world 2; then each
    world size loads and continues."""
    rank = skd.get_rank()
    pair = skd.new_group([0, 1])
    alone = skd.single_rank_group()
    out = {}
    if rank < 2:
        model = _model(1, pair)
        optim = _optim(model)
        for step in range(STEPS_BEFORE):
            _step(model, optim, step, pair)
        out["saved"] = _save_sharded(model, optim, folder, pair)
        full_model = _full(model)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            full_optim = FSDP.optim_state_dict(model, optim)
        if rank == 0:
            torch.save((full_model, full_optim), folder + "/full.pt")
        out["uninterrupted"] = _continue(model, optim, pair)
        resumed = _model(2, pair)  # other initial values: all must come from the checkpoint
        resumed_optim = _optim(resumed)
        _load_sharded(resumed, resumed_optim, folder, pair)
        out["resumed == saved"] = _diff(_full(resumed), full_model)
        resumed_run = _continue(resumed, resumed_optim, pair)
        out["world 2 resumed vs uninterrupted"] = max(
            _diff(a, b) for a, b in zip(resumed_run, out["uninterrupted"]))
    dist.barrier()
    full_model, full_optim = torch.load(folder + "/full.pt", weights_only=False)
    for world, group in ((4, None), (1, alone)):
        sharded, sharded_optim = _model(3, group), None
        sharded_optim = _optim(sharded)
        _load_sharded(sharded, sharded_optim, folder, group)
        via_full = _model(4, group)
        via_full_optim = _optim(via_full)
        _load_full(via_full, via_full_optim, full_model, full_optim)
        out[f"world {world} loaded vs saved"] = _diff(_full(sharded), full_model)
        a, b = _continue(sharded, sharded_optim, group), _continue(via_full, via_full_optim, group)
        out[f"world {world} sharded vs full path"] = max(_diff(x, y) for x, y in zip(a, b))
        if "uninterrupted" in out:
            out[f"world {world} vs uninterrupted"] = max(
                _diff(x, y) for x, y in zip(a, out["uninterrupted"]))
    out.pop("uninterrupted", None)
    return out


def _hybrid(folder: str) -> dict:
    """HYBRID_SHARD over 2 x 2 saved SHARDED (the replicas' equal chunks written once), loaded
    at world 4 FULL_SHARD and at world 1, then one more step against the FULL path."""
    from shardkit.nn.data_parallel import ShardingStrategy
    rank = skd.get_rank()
    intra = [skd.new_group(r) for r in ([0, 1], [2, 3])][rank // 2]
    inter = [skd.new_group(r) for r in ([0, 2], [1, 3])][rank % 2]
    out = {}
    torch.manual_seed(1)
    m = _Scaled()
    kw = dict(process_group=(intra, inter), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    m.l1, m.l2 = FSDP(m.l1, **kw), FSDP(m.l2, **kw)
    hybrid = FSDP(m, **kw)
    optim = _optim(hybrid)
    for step in range(STEPS_BEFORE):
        _step(hybrid, optim, step)
    _save_sharded(hybrid, optim, folder + "/hybrid", None)
    saved = _full(hybrid)
    for world, group in ((4, None), (1, skd.single_rank_group())):
        model = _model(3, group)
        model_optim = _optim(model)
        _load_sharded(model, model_optim, folder + "/hybrid", group)
        out[f"hybrid -> world {world}"] = _diff(_full(model), saved)
        via_full = _model(4, group)
        via_full_optim = _optim(via_full)
        with FSDP.state_dict_type(hybrid, StateDictType.FULL_STATE_DICT):
            full_optim = FSDP.optim_state_dict(hybrid, optim)
        _load_full(via_full, via_full_optim, saved, full_optim)
        out[f"hybrid -> world {world}, after a step vs full path"] = _diff(
            _continue(model, model_optim, group)[-1], _continue(via_full, via_full_optim,
                                                                group)[-1])
    return out


def _other_shapes_refused(folder: str) -> dict:
    """A SHARDED dict of a model whose l1 has 9 rows loaded into one with 7."""
    import torch.distributed.checkpoint as dcp
    other, model = _model(5, hidden=9), _model(6)
    before = _full(model)
    out = {}
    with FSDP.state_dict_type(other, StateDictType.SHARDED_STATE_DICT):
        other_state = other.state_dict()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        try:
            model.load_state_dict(other_state)
        except RuntimeError as error:
            out["error"] = str(error)
        # the dcp path: the saved metadata does not fit the model's state dict
        dcp.save(other_state, storage_writer=dcp.FileSystemWriter(folder))
        mine = model.state_dict()
        try:
            dcp.load(mine, storage_reader=dcp.FileSystemReader(folder))
            model.load_state_dict(mine)
            out["dcp"] = "loaded"
        except dcp.api.CheckpointException as error:  # dcp's own check, on every rank
            out["dcp"] = str(error)
        other_optim, optim = _optim(other), _optim(model)
        init_optimizer_state(other_optim)
        init_optimizer_state(optim)
        with FSDP.state_dict_type(other, StateDictType.SHARDED_STATE_DICT):
            other_osd = FSDP.optim_state_dict(other, other_optim)
        try:
            FSDP.optim_state_dict_to_load(model, optim, other_osd)
        except ValueError as error:
            out["optim error"] = str(error)
    alive = torch.ones(1)
    dist.all_reduce(alive)
    out["after"] = alive.item()
    out["unchanged"] = _diff(_full(model), before)
    return out


def _dtensor_layout() -> dict:
    """What state_dict gives at world 4: DTensor shapes, local rows, no full parameter."""
    from torch.distributed.tensor import DTensor
    model = _model(7)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = model.state_dict()
    return {k: (type(v).__name__, tuple(v.shape),
                tuple(v.to_local().shape) if isinstance(v, DTensor) else None)
            for k, v in state.items()}


# ---------------------------------------------------------------------- tests


def test_sharded_state_dict_layout(world4):
    results = world4.run(_dtensor_layout)
    for rank, r in enumerate(results):
        assert list(r) == ["scale", "offset", "l1.weight", "l1.bias", "l2.weight", "l2.bias",
                           "frozen.weight", "frozen.bias"] or set(r) == {
            "scale", "offset", "l1.weight", "l1.bias", "l2.weight", "l2.bias",
            "frozen.weight", "frozen.bias"}, r
        assert r["scale"] == ("Tensor", (), None) and r["offset"] == ("Tensor", (5,), None)
        l1_rows = [2, 2, 2, 1][rank]  # 7 rows over 4 ranks
        l2_rows = [2, 2, 1, 0][rank]  # 5 rows: the last rank holds none
        assert r["l1.weight"] == ("DTensor", (7, WIDTH), (l1_rows, WIDTH)), r
        assert r["l2.weight"] == ("DTensor", (5, 7), (l2_rows, 7)), r
        assert r["l2.bias"] == ("DTensor", (5,), (l2_rows,)), r


def test_resume_and_reshard_through_dcp(world4, tmp_path):
    results = world4.run(_resume_and_reshard, str(tmp_path))
    for rank, r in enumerate(results):
        for world in (4, 1):
            assert r[f"world {world} loaded vs saved"] == 0.0, (rank, r)
            assert r[f"world {world} sharded vs full path"] == 0.0, (rank, r)
        if rank < 2:
            assert r["saved"]["l2.weight"] == ("DTensor", (5, 7), (3 - rank, 7)), r
            assert r["resumed == saved"] == 0.0, r
            assert r["world 2 resumed vs uninterrupted"] == 0.0, r
            for world in (4, 1):
                assert r[f"world {world} vs uninterrupted"] < TOL, (rank, r)


def test_hybrid_shard_through_dcp(world4, tmp_path):
    for rank, r in enumerate(world4.run(_hybrid, str(tmp_path))):
        assert all(v == 0.0 for v in r.values()) and len(r) == 4, (rank, r)


def test_other_shapes_refused_on_every_rank(world4, tmp_path):
    for r in world4.run(_other_shapes_refused, str(tmp_path)):
        assert "size mismatch for l1.weight" in r["error"], r
        assert "nothing was loaded" in r["error"], r
        assert "ranks:dict_keys([0, 1, 2, 3])" in r["dcp"], r
        assert "Size mismatch between saved torch.Size([9" in r["dcp"], r
        assert "state 'exp_avg' of l1.weight: the given value has shape (9, 6), the " \
            "model's is (7, 6)" in r["optim error"], r
        assert r["after"] == 4.0 and r["unchanged"] == 0.0, r
