"""FSDP state and optimizer-state paths as torch FSDP1 users drive them:

- blocks wrapped by torch's own ``checkpoint_wrapper`` (inside a unit or around one): the full
  state dict held this rank's padded rows under their names (silently: a ``torch.save`` of a
  wrong model), the sharded one saved them as replicated tensors, and the optimizer state was
  keyed with torch's ``_checkpoint_wrapped_module.`` level (not the model's keys, so it did not
  load into the same model without activation checkpointing);
- a NO_SHARD unit inside a FULL_SHARD model (its parameters replicated, the same on every
  rank) was refused as an expert by ``rank0_only`` and ``SHARDED_STATE_DICT``;
- ``FSDP.optim_state_dict`` refusing one rank's optimizer (a parameter outside the model)
  raised there while the other ranks waited in the gather.

Their review (around cee8e16: torch's ``checkpoint_wrapper`` levels, NO_SHARD / HYBRID units
taken for experts or not) found:

- a module whose name merely contains a wrapper level (``my_checkpoint_wrapped_module``,
  ``my_fsdp_wrapped_module``) lost part of its name in the keys (``blocks.0.myweight``): the
  optimizer state and local metadata were keyed so (consolidation failed), and under torch's
  ``checkpoint_wrapper`` the full state dict held this rank's padded rows, silently;
- a unit over as many ranks as the model but other ones (model over ``[0, 1]``, unit over
  ``[0, 2]``: experts on the other axis of a grid) was taken for a replicated one: ``rank0_only``
  and a plain parent's optimizer-state calls hung in the gather;
- ``scatter_full_optim_state_dict`` refusing one rank's optimizer (another model's) raised
  there while the other ranks waited in the broadcast.

One world of 2 and one of 4.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world2 = world_fixture(2)
world4 = world_fixture(4, timeout=60)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 12)
        self.b = nn.Linear(12, 6)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def _local(t: torch.Tensor) -> torch.Tensor:
    per = t.shape[0] // skdist.get_world_size()
    return t[skdist.get_rank() * per:(skdist.get_rank() + 1) * per]


def _trained(layout: str, seed: int = 0):
    """``Net`` wrapped per ``layout`` (the same values whatever the layout) after one Adam
    step on the global batch of ``seed``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import \
        checkpoint_wrapper as torch_checkpoint_wrapper

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import ShardingStrategy
    torch.manual_seed(seed)
    model = Net()
    for i, block in enumerate(model.blocks):
        if layout == "torch checkpoint_wrapper inside units":
            model.blocks[i] = FSDP(torch_checkpoint_wrapper(block))
        elif layout == "torch checkpoint_wrapper around units":
            model.blocks[i] = torch_checkpoint_wrapper(FSDP(block))
        elif layout.startswith("NO_SHARD units"):
            model.blocks[i] = FSDP(block, sharding_strategy=ShardingStrategy.NO_SHARD)
        else:
            model.blocks[i] = FSDP(block)
    if layout == "NO_SHARD units in a plain parent":  # no root: FULL_SHARD units beside them
        model.inp, model.head = FSDP(model.inp), FSDP(model.head)
    else:
        model = FSDP(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    F.mse_loss(model(_local(x)), _local(y)).backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _full(model, optim, rank0_only: bool = False) -> tuple:
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                              FullOptimStateDictConfig(rank0_only=rank0_only)):
        return model.state_dict(), FSDP.optim_state_dict(model, optim)


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(
        _same(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a)


def _load_full(layout: str, state: dict, osd: dict, rank0_only: bool = False) -> tuple:
    """A model of ``layout`` (other values) loaded with the full dicts, then saved again."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    model, optim = _trained(layout, seed=7)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                              FullOptimStateDictConfig(rank0_only=rank0_only)):
        model.load_state_dict(state)
        FSDP.optim_state_dict_to_load(model, optim, osd, load_directly=True)
    return _full(model, optim)


def _through_dcp(source, target: str, path: str) -> tuple:
    """``SHARDED_STATE_DICT`` of ``source`` (model, optim) saved with
    torch.distributed.checkpoint and loaded into a model of layout ``target`` (other values);
    that model's full dicts."""
    import torch.distributed.checkpoint as dcp

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    model, optim = source
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)},
                 checkpoint_id=path)
    model, optim = _trained(target, seed=7)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        FSDP.optim_state_dict_to_load(model, optim, state["optim"], load_directly=True)
    return _full(model, optim)


def _consolidated(model) -> dict:
    """FairScale's offline consolidation of every rank's ``local_state_dict`` with its
    ``local_metadata_dict``."""
    import torch.distributed as dist

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    local = [None] * skdist.get_world_size()
    metadata = [None] * skdist.get_world_size()
    dist.all_gather_object(local, {k: v.clone() for k, v in model.local_state_dict().items()})
    dist.all_gather_object(metadata, model.local_metadata_dict())
    return FSDP.consolidate_shard_weights(local, metadata)


def _torch_checkpoint_wrapper_states(path: str) -> dict:
    expected_model, expected_optim = _full(*_trained("plain units"))
    out = {}
    for where in ("inside", "around"):
        layout = f"torch checkpoint_wrapper {where} units"
        trained = _trained(layout)
        state, osd = _full(*trained)
        out[f"{where}: full state"] = _same(state, expected_model)
        out[f"{where}: optimizer keys"] = sorted(osd["state"]) == sorted(expected_optim["state"])
        out[f"{where}: full optimizer state"] = _same(osd["state"], expected_optim["state"])
        out[f"{where}: consolidated local dicts"] = _same(_consolidated(trained[0]),
                                                          expected_model)
        for target in ("plain units", layout):  # resumed without checkpointing, or with it
            loaded = _load_full(target, state, osd)
            out[f"{where}: full into {target}"] = _same(loaded[0], expected_model) and \
                _same(loaded[1]["state"], expected_optim["state"])
            loaded = _through_dcp(trained, target, f"{path}/{where}-{target.split()[0]}")
            out[f"{where}: dcp into {target}"] = _same(loaded[0], expected_model) and \
                _same(loaded[1]["state"], expected_optim["state"])
    return out


def test_blocks_in_torchs_checkpoint_wrapper_save_full_values_under_the_models_keys(
        world2, tmp_path):
    """Regression: with torch's ``checkpoint_wrapper`` inside or around the units, the full
    state dict held each rank's padded rows ((6, 6) for a (12, 6) weight), the sharded one
    saved them as replicated tensors, and the optimizer state was keyed
    ``blocks.0._checkpoint_wrapped_module.a.weight``, as were the local metadata's names
    (``consolidate_shard_weights`` refused every parameter as missing); now they are the plain
    model's, and load into it with or without the wrapper."""
    for out in world2.run(_torch_checkpoint_wrapper_states, str(tmp_path)):
        assert all(out.values()), {k: v for k, v in out.items() if not v}


def _replicated_unit_states(layout: str, path: str) -> dict:
    from torch.distributed.fsdp import FullOptimStateDictConfig

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    rank = skdist.get_rank()
    trained = _trained(layout)
    state, osd = _full(*trained)
    out = {}
    _, rank0 = _full(*trained, rank0_only=True)
    out["rank0_only"] = _same(rank0["state"], osd["state"]) if rank == 0 else rank0 == {}
    model, optim = _trained(layout, seed=7)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              optim_state_dict_config=FullOptimStateDictConfig(rank0_only=True)):
        FSDP.optim_state_dict_to_load(model, optim, rank0 if rank == 0 else {},
                                      load_directly=True)
    out["rank0_only load"] = _same(_full(model, optim)[1]["state"], osd["state"])
    loaded = _through_dcp(trained, layout, path)
    out["dcp"] = _same(loaded[0], state) and _same(loaded[1]["state"], osd["state"])
    return out


def test_a_no_shard_unit_inside_a_sharded_model_saves_under_rank0_only_and_sharded(world2,
                                                                                   tmp_path):
    """Regression: a NO_SHARD unit inside a FULL_SHARD one (its parameters the same on every
    rank) was refused as an expert ("sharded over other ranks than the model's group") by
    ``FullOptimStateDictConfig(rank0_only=True)`` and by ``SHARDED_STATE_DICT`` (model and
    optimizer), and a plain module holding it beside FULL_SHARD units was refused by every
    optimizer-state function ("units are sharded over different groups"); rank 0's dict now
    stands for every rank and dcp round-trips it."""
    for layout in ("NO_SHARD units", "NO_SHARD units in a plain parent"):
        for out in world2.run(_replicated_unit_states, layout, f"{tmp_path}/{layout[-5:]}"):
            assert all(out.values()), (layout, out)


def _expert_still_refused() -> str:
    """An expert (a unit over this rank alone, no replicas) holds values of its own: one
    rank's dict cannot stand for it, so ``rank0_only`` still refuses it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullOptimStateDictConfig

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    own = [dist.new_group([r]) for r in range(skdist.get_world_size())][skdist.get_rank()]
    model = Net()
    model.blocks[1] = FSDP(model.blocks[1], process_group=own)
    model = FSDP(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    try:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  optim_state_dict_config=FullOptimStateDictConfig(
                                      rank0_only=True)):
            FSDP.optim_state_dict(model, optim)
    except ValueError as error:
        return str(error)
    return "no error"


def test_an_expert_is_still_refused_under_rank0_only(world2):
    for message in world2.run(_expert_still_refused):
        assert "blocks.1.a.weight" in message and "rank0_only=False" in message, message


class Scaled(nn.Module):
    """A layer with a 0-dim parameter (CLIP's ``logit_scale``), whose sharded optimizer state
    is broadcast over the unit's group."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return self.proj(x) * self.scale


def _optimizer_refused_on_one_rank() -> dict:
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    full = _trained("plain units")
    torch.manual_seed(0)
    scaled = FSDP(Scaled())
    sharded = (scaled, torch.optim.Adam(scaled.parameters(), lr=0.1))
    scaled(torch.randn(2, 6)).sum().backward()
    sharded[1].step()
    plain = _trained("plain units")  # no 0-dim parameter: dcp.save hung after a lone refusal
    out = {}
    for kind, (model, optim) in (("FULL", full), ("SHARDED", sharded),
                                 ("SHARDED no 0-dim", plain)):
        if skdist.get_rank() == 1:  # a parameter outside the model, on this rank only
            optim.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
        try:
            with FSDP.state_dict_type(model, StateDictType[f"{kind.split()[0]}_STATE_DICT"]):
                FSDP.optim_state_dict(model, optim)
            out[kind] = "no error"
        except ValueError as error:
            out[kind] = str(error)
    model, optim = _trained("plain units")
    out["then"] = sorted(FSDP.optim_state_dict(model, optim)["state"])
    return out


def test_optim_state_dict_refusing_one_ranks_optimizer_raises_on_every_rank(world2):
    """Regression: the name check (a parameter outside the model cannot be keyed by a name)
    ran before the ranks agreed, so rank 1 raised while rank 0 waited in the gather (FULL), or
    in the broadcast of a 0-dim parameter's state (SHARDED), until the collective timed out.
    Now every rank raises, and the ranks stay in step."""
    rank0, rank1 = world2.run(_optimizer_refused_on_one_rank)
    for kind, outcome in (("FULL", "nothing was gathered"), ("SHARDED", "nothing was sent"),
                          ("SHARDED no 0-dim", "nothing was sent")):
        assert "are not parameters of this model" in rank1[kind], rank1
        assert "group rank(s) [1]" in rank0[kind] and outcome in rank0[kind], rank0
    assert rank0["then"] == rank1["then"] and len(rank0["then"]) == 12, (rank0, rank1)


class LevelNamedBlock(nn.Module):
    """Two layers whose attribute names merely contain FSDP's and torch's wrapper levels."""

    def __init__(self):
        super().__init__()
        self.my_checkpoint_wrapped_module = nn.Linear(6, 12)
        self.my_fsdp_wrapped_module = nn.Linear(12, 6)

    def forward(self, x):
        return x + self.my_fsdp_wrapped_module(torch.relu(self.my_checkpoint_wrapped_module(x)))


class LevelNamedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.blocks = nn.Sequential(LevelNamedBlock(), LevelNamedBlock())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def _stepped(model: nn.Module, rows: slice) -> torch.optim.Optimizer:
    """One Adam step of ``model`` on ``rows`` of a fixed batch (the mean over the ranks'
    halves of the batch is the whole batch's: the same step as the plain model's)."""
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    F.mse_loss(model(x[rows]), y[rows]).backward()
    optim.step()
    return optim


def _differences(got: dict, expected: dict) -> list:
    if sorted(got) != sorted(expected):
        return [f"keys {sorted(set(got) ^ set(expected))}"]
    return [k for k in got if not (_differences(got[k], expected[k]) == [] if isinstance(
        got[k], dict) else got[k].shape == expected[k].shape and torch.allclose(
            got[k], expected[k], atol=1e-6))]


def _keys_of_names_holding_a_level() -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import \
        checkpoint_wrapper as torch_checkpoint_wrapper

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    torch.manual_seed(0)
    plain = LevelNamedNet()
    plain_optim = _stepped(plain, slice(None))
    names = dict((id(p), n) for n, p in plain.named_parameters())
    ordered = [p for g in plain_optim.param_groups for p in g["params"]]
    expected_optim = {names[id(ordered[i])]: s
                      for i, s in plain_optim.state_dict()["state"].items()}
    out = {}
    for wrapper in ("none", "torch checkpoint_wrapper"):
        torch.manual_seed(0)
        model = LevelNamedNet()
        for i, block in enumerate(model.blocks):
            model.blocks[i] = FSDP(block if wrapper == "none" else torch_checkpoint_wrapper(block))
        model = FSDP(model)
        per = 8 // skdist.get_world_size()
        optim = _stepped(model, slice(skdist.get_rank() * per, (skdist.get_rank() + 1) * per))
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            state, osd = model.state_dict(), FSDP.optim_state_dict(model, optim)
        out[f"{wrapper}: full state"] = _differences(state, plain.state_dict())
        out[f"{wrapper}: optimizer state"] = _differences(osd["state"], expected_optim)
        local = [None] * skdist.get_world_size()
        metadata = [None] * skdist.get_world_size()
        dist.all_gather_object(local, {k: v.clone() for k, v in model.local_state_dict().items()})
        dist.all_gather_object(metadata, model.local_metadata_dict())
        out[f"{wrapper}: consolidated"] = _differences(
            FSDP.consolidate_shard_weights(local, metadata), plain.state_dict())
    return out


def test_names_that_merely_contain_a_wrapper_level_keep_it(world2):
    """Regression: the levels were dropped with ``str.replace``, so ``my_checkpoint_wrapped_module``
    became ``my`` + the rest (optimizer keys ``blocks.0.myweight``, consolidation refused,
    and under torch's ``checkpoint_wrapper`` the full dict held (6, 6) padded rows of a
    (12, 6) weight); ``my_fsdp_wrapped_module`` lost its name in every state dict. Now only
    whole levels are dropped, as torch's state-dict hooks drop them."""
    for out in world2.run(_keys_of_names_holding_a_level):
        assert not any(out.values()), {k: v for k, v in out.items() if v}


def _scatter_with_another_models_optimizer_on_one_rank() -> dict:
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    torch.manual_seed(0)
    model = FSDP(LevelNamedNet())
    optim = _stepped(model, slice(None))
    full = FSDP.full_optim_state_dict(model, optim)
    given = torch.optim.Adam(LevelNamedNet().parameters()) if skdist.get_rank() == 1 else optim
    out = {}
    try:
        FSDP.scatter_full_optim_state_dict(full, model, optim=given)
        out["scatter"] = "no error"
    except ValueError as error:
        out["scatter"] = str(error)
    part = FSDP.scatter_full_optim_state_dict(full, model, optim=optim)  # still in step
    out["then"] = sorted(part["state"])
    return out


def test_scatter_refusing_one_ranks_optimizer_raises_on_every_rank(world2):
    """Regression: rank 1 refused its optimizer (another model's) and raised while rank 0
    waited in the broadcast of the dict until the collective timed out; now every rank
    raises before anything is sent and the ranks stay in step."""
    rank0, rank1 = world2.run(_scatter_with_another_models_optimizer_on_one_rank)
    assert "none of the optimizer's" in rank1["scatter"], rank1
    assert "group rank(s) [1]" in rank0["scatter"] and "nothing was sent" in rank0["scatter"]
    assert rank0["then"] == rank1["then"] == list(range(len(list(LevelNamedNet().parameters()))))


def _grid_groups():
    """This rank's row ([0, 1] or [2, 3]) and column ([0, 2] or [1, 3]) groups of a 2 x 2
    grid (every rank creates every group, in the same order)."""
    import torch.distributed as dist
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return rows[skdist.get_rank() // 2], columns[skdist.get_rank() % 2]


def _experts_over_the_other_axis() -> dict:
    """Model over its row, block 1 over its column (each column its own expert): as many
    ranks as the model's, but not the model's ranks."""
    from torch.distributed.fsdp import FullOptimStateDictConfig

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    row, column = _grid_groups()
    out = {}
    for form in ("root", "plain parent"):
        torch.manual_seed(0)
        model = LevelNamedNet()
        model.blocks[1] = FSDP(model.blocks[1], process_group=column)
        if form == "root":
            model = FSDP(model, process_group=row)
        else:
            model.inp, model.head = (FSDP(m, process_group=row) for m in (model.inp, model.head))
            model.blocks[0] = FSDP(model.blocks[0], process_group=row)
        optim = _stepped(model, slice(skdist.get_rank() * 2, skdist.get_rank() * 2 + 2))
        calls = {
            "full_optim_state_dict": lambda: FSDP.full_optim_state_dict(model, optim),
            "scatter": lambda: FSDP.scatter_full_optim_state_dict(None, model, optim=optim)}
        if form == "root":
            def rank0_only():
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                          optim_state_dict_config=FullOptimStateDictConfig(
                                              rank0_only=True)):
                    return FSDP.optim_state_dict(model, optim)

            def sharded():
                with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                    return model.state_dict()
            calls.update({"optim_state_dict rank0_only": rank0_only, "sharded": sharded})
        for name, call in calls.items():
            try:
                call()
                out[f"{form}: {name}"] = "no error"
            except ValueError as error:
                out[f"{form}: {name}"] = str(error)
    return out


def test_units_over_as_many_but_other_ranks_are_still_experts(world4):
    """Regression: a unit was taken for a replicated one when its parameters were copied to
    as many ranks as the model's, whichever ranks: experts over the grid's columns inside a
    model over its rows were accepted by ``rank0_only`` (which hung in the gather) and by a
    plain parent (units over rows and over columns, which hung too). Now they are refused,
    on every rank, before any collective."""
    for out in world4.run(_experts_over_the_other_axis):
        for call, message in out.items():
            if call.startswith("root"):
                assert "blocks.1." in message and "sharded over other" in message, (call, out)
            else:
                assert "sharded over different groups" in message, (call, out)


def _hybrid_units_in_a_full_shard_model() -> dict:
    """HYBRID_SHARD units (shard over the row, replicas over the column) inside a FULL_SHARD
    model over the world hold the same values on every rank: ``rank0_only`` keeps them."""
    from torch.distributed.fsdp import FullOptimStateDictConfig

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import ShardingStrategy, StateDictType
    row, column = _grid_groups()
    torch.manual_seed(0)
    model = LevelNamedNet()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, process_group=(row, column),
                               sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    model = FSDP(model)
    optim = _stepped(model, slice(skdist.get_rank() * 2, skdist.get_rank() * 2 + 2))
    everywhere = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              optim_state_dict_config=FullOptimStateDictConfig(rank0_only=True)):
        rank0 = FSDP.optim_state_dict(model, optim)
    keyed = FSDP.rekey_optim_state_dict(everywhere, "PARAM_NAME", model, optim=optim)
    return {"rank0_only": _differences(rank0["state"], keyed["state"])
            if skdist.get_rank() == 0 else rank0}


def test_hybrid_units_inside_a_full_shard_model_still_save_under_rank0_only(world4):
    for out in world4.run(_hybrid_units_in_a_full_shard_model):
        assert out["rank0_only"] in ([], {}), out
