"""Optimizer state that FSDP cannot reshard: Adafactor's factored moments.

Under FullyShardedDataParallel each rank steps its own rows of a parameter, so Adafactor's
``row_var`` (rows, 1) and ``col_var`` (1, cols) are computed from that rank's rows only: they
are neither a full tensor nor a row block of one. A full optimizer state dict
(``full_optim_state_dict``, ``optim_state_dict`` under FULL_STATE_DICT,
``gather_full_optim_state_dict``) and ``dcp.save`` of the SHARDED_STATE_DICT one must refuse
them on every rank before anything moves or is written; a single-process Adafactor's full dict
must be refused where it would be cut into row shards; and the way the messages point to
(LOCAL_STATE_DICT, one file per rank, at the same world size) must resume exactly as the run
that never stopped. One world of 2 gloo ranks.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff

world2 = world_fixture(2)

GLOBAL_BATCH = 8


def _net(seed: int) -> nn.Module:
    """Uneven rows over 2 ranks (7 and 3) and a nested unit."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))
    net[2] = FSDP(net[2])
    return FSDP(net)


def _train(model, optim, first: int, steps: int) -> list:
    """``steps`` steps on global batches ``first, ...`` (this rank's half); each step's
    local state (this rank's shards)."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    history = []
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(GLOBAL_BATCH, 6, generator=gen), torch.randn(GLOBAL_BATCH, 3,
                                                                        generator=gen)
        optim.zero_grad()
        F.mse_loss(model(x[mine]), y[mine]).backward()
        optim.step()
        history.append({k: v.detach().clone() for k, v in model.local_state_dict().items()})
    return history


def _outcome(fn) -> str:
    """``"accepted"``, or the error's type and message (dcp's CheckpointException is a
    BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        fn()
        return "accepted"
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - the test reads it
        return f"{type(error).__name__}: {error}"


def _adafactor_checkpoints(directory: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    from shardkit.nn.data_parallel.fsdp_state_dict_type import (FullOptimStateDictConfig,
                                                                FullStateDictConfig)
    model = _net(0)
    optim = torch.optim.Adafactor(model.parameters(), lr=0.01)
    _train(model, optim, 0, 2)
    out = {
        "full rank0": _outcome(lambda: FSDP.full_optim_state_dict(model, optim)),
        "full all": _outcome(lambda: FSDP.full_optim_state_dict(model, optim, rank0_only=False)),
        "gather": _outcome(lambda: model.gather_full_optim_state_dict(optim)),
    }
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(rank0_only=True),
                              FullOptimStateDictConfig(rank0_only=True)):
        out["optim_state_dict full"] = _outcome(lambda: FSDP.optim_state_dict(model, optim))
    sharded_dir = os.path.join(directory, "sharded")
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        out["dcp.save"] = _outcome(lambda: dcp.save(state, checkpoint_id=sharded_dir))
    distributed.barrier()
    out["dcp wrote metadata"] = os.path.exists(os.path.join(sharded_dir, ".metadata"))

    # a single-process Adafactor's full dict, cut into this world's row shards
    plain = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))
    plain_optim = torch.optim.Adafactor(plain.parameters(), lr=0.01)
    plain(torch.randn(4, 6)).sum().backward()
    plain_optim.step()
    fresh = _net(1)
    fresh_optim = torch.optim.Adafactor(fresh.parameters(), lr=0.01)
    out["shard plain"] = _outcome(lambda: fresh_optim.load_state_dict(
        FSDP.shard_full_optim_state_dict(plain_optim.state_dict(), fresh)))
    out["fresh untouched"] = not fresh_optim.state

    # what the messages advise: each rank's own state, loaded at the same world size
    path = os.path.join(directory, f"local.{distributed.get_rank()}.pt")
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        torch.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)},
                   path)
    reference = _train(model, optim, 2, 2)
    resumed = _net(2)
    resumed_optim = torch.optim.Adafactor(resumed.parameters(), lr=0.01)
    saved = torch.load(path, weights_only=True)
    with FSDP.state_dict_type(resumed, StateDictType.LOCAL_STATE_DICT):
        resumed.load_state_dict(saved["model"])
        FSDP.optim_state_dict_to_load(resumed, resumed_optim, saved["optim"], load_directly=True)
    out["local resume"] = [max_diff(got, want) for got, want
                           in zip(_train(resumed, resumed_optim, 2, 2), reference)]
    return out


def test_adafactor_factored_state_is_refused_by_full_and_dcp_checkpoints(world2, tmp_path):
    # Before: the full dicts held the receiving rank's row_var / col_var alone (labelled as
    # full); loaded at the same world size every rank stepped with rank 0's moments (off by
    # 1.5e-2 after two steps, silently), at another one the next step() raised "The size of
    # tensor a (4) must match the size of tensor b (2)"; dcp.save wrote rank 0's as replicated
    # (the same silent error after dcp.load); a single-process Adafactor's dict was cut into
    # shards keeping its (7, 1) row_var whole, failing at step().
    for out in world2.run(_adafactor_checkpoints, str(tmp_path)):
        for what in ("full rank0", "full all", "gather", "optim_state_dict full"):
            assert out[what].startswith("ValueError: ") and "0.weight 'row_var' (4, 1) " \
                "(shard (4, 6))" in out[what] and "LOCAL_STATE_DICT" in out[what], (what, out)
        assert "cannot save or load '0.weight.row_var'" in out["dcp.save"], out
        assert "shape (4, 1), neither the parameter's nor its shard's" in out["dcp.save"], out
        assert not out["dcp wrote metadata"], out
        assert "state 'row_var' of parameter 0 has shape (7, 1), neither the parameter's " \
            "full shape (7, 6)" in out["shard plain"], out
        assert out["fresh untouched"], out
        assert max(out["local resume"]) == 0, out
