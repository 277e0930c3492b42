"""FSDP state-dict keys and refusals around cee8e16 (torch's ``checkpoint_wrapper`` levels,
NO_SHARD / HYBRID units taken for experts or not), as users meet them:

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

world2 = world_fixture(2, timeout=60)
world4 = world_fixture(4, timeout=60)


class Block(nn.Module):
    """Two layers whose attribute names merely contain FSDP's and torch's wrapper levels."""

    def __init__(self):
        super().__init__()
        self.my_checkpoint_wrapped_module = nn.Linear(6, 12)
        self.my_fsdp_wrapped_module = nn.Linear(12, 6)

    def forward(self, x):
        return x + self.my_fsdp_wrapped_module(torch.relu(self.my_checkpoint_wrapped_module(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.blocks = nn.Sequential(Block(), Block())
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
    plain = Net()
    plain_optim = _stepped(plain, slice(None))
    names = dict((id(p), n) for n, p in plain.named_parameters())
    ordered = [p for g in plain_optim.param_groups for p in g["params"]]
    expected_optim = {names[id(ordered[i])]: s
                      for i, s in plain_optim.state_dict()["state"].items()}
    out = {}
    for wrapper in ("none", "torch checkpoint_wrapper"):
        torch.manual_seed(0)
        model = Net()
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
    model = FSDP(Net())
    optim = _stepped(model, slice(None))
    full = FSDP.full_optim_state_dict(model, optim)
    given = torch.optim.Adam(Net().parameters()) if skdist.get_rank() == 1 else optim
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
    assert rank0["then"] == rank1["then"] == list(range(len(list(Net().parameters()))))


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
        model = Net()
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
    model = Net()
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
