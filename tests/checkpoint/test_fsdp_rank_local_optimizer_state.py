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

From a review:

Adafactor's factored moments of a parameter whose FSDP shard is (1, 1).

An (n, 1) parameter (``nn.Linear(1, n).weight``) over n ranks or more has shards of one
element: Adafactor's ``row_var`` and ``col_var`` of such a shard are (1, 1) too, shaped as the
shard, yet ``col_var`` is a mean over this rank's rows, not one value per element. The full
optimizer state dicts and ``dcp.save`` of the SHARDED one must refuse them as they refuse other
shards' factored moments, and reshard_local_optim_state_dicts must not join them as rows, while
per-element state (Adam's) of the same (1, 1) shards is still saved. One world of 2 gloo ranks.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed
from shardkit.testing import world_fixture
from tests.utils.factored_moments import FactoredMoments

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
    optim = FactoredMoments(model.parameters(), lr=0.01)  # Adafactor's update, stepped
    # over shards (FSDP refuses torch's Adafactor by name at step())
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
    resumed_optim = FactoredMoments(resumed.parameters(), lr=0.01)
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


def _narrow_model():
    """``Linear(1, 2).weight`` (2, 1) under FSDP at world 2: each rank's shard is (1, 1)."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    torch.manual_seed(0)
    return FSDP(nn.Linear(1, 2, bias=False), use_orig_params=True)


def _with_factored_state(model) -> torch.optim.Optimizer:
    """An Adafactor holding each rank's own factored moments of its (1, 1) shard, as one
    resumed from each rank's LOCAL_STATE_DICT would (set through load_state_dict, not by
    stepping: the values differ per rank as the rows do)."""
    optim = torch.optim.Adafactor(model.parameters(), lr=0.01)
    moment = torch.full((1, 1), 1.0 + distributed.get_rank())
    optim.load_state_dict({"state": {0: {"step": torch.tensor(1.0), "row_var": moment,
                                         "col_var": moment.clone()}},
                           "param_groups": optim.state_dict()["param_groups"]})
    return optim


def _dcp_save(model, optim, directory: str) -> tuple:
    """``dcp.save`` of the SHARDED optimizer state dict: its outcome, and whether ``.metadata``
    was written (after every rank is done)."""
    import torch.distributed.checkpoint as dcp

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"optim": FSDP.optim_state_dict(model, optim)}
        outcome = _outcome(lambda: dcp.save(state, checkpoint_id=directory))
    distributed.barrier()
    return outcome, os.path.exists(os.path.join(directory, ".metadata"))


def _reshard_to_one_rank(model, optim, directory: str) -> None:
    """Each rank's LOCAL optimizer state and metadata, resharded for a model that one rank
    holds whole (FSDP over a group of one) and loaded into its Adafactor."""
    from shardkit.checkpoint import reshard_local_optim_state_dicts
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    rank = distributed.get_rank()
    torch.save((optim.state_dict(), model.local_metadata_dict()),
               os.path.join(directory, f"local_{rank}.pt"))
    alone = [distributed.new_group([r]) for r in range(2)][rank]
    distributed.barrier()
    saved = [torch.load(os.path.join(directory, f"local_{r}.pt"), weights_only=True)
             for r in range(2)]
    torch.manual_seed(0)
    whole = FSDP(nn.Linear(1, 2, bias=False), process_group=alone, use_orig_params=True)
    whole_optim = torch.optim.Adafactor(whole.parameters(), lr=0.01)
    whole_optim.load_state_dict(reshard_local_optim_state_dicts(
        [osd for osd, _ in saved], [meta for _, meta in saved], whole, whole_optim))


def _one_element_shards(directory: str) -> dict:
    from shardkit.checkpoint import get_optimizer_state_dict
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    out = {}
    model = _narrow_model()
    optim = _with_factored_state(model)
    out["full"] = _outcome(lambda: FSDP.full_optim_state_dict(model, optim, rank0_only=False))
    out["gather"] = _outcome(lambda: model.gather_full_optim_state_dict(optim))
    out["get_optimizer_state_dict"] = _outcome(lambda: get_optimizer_state_dict(model, optim))
    out["dcp"], out["dcp wrote metadata"] = _dcp_save(model, optim,
                                                      os.path.join(directory, "factored"))
    out["reshard to 1 rank"] = _outcome(lambda: _reshard_to_one_rank(model, optim, directory))

    # Adam's per-element moments of the same (1, 1) shards stay fine
    model = _narrow_model()
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(8, 1, generator=torch.Generator().manual_seed(0))
    mine = slice(4 * distributed.get_rank(), 4 * distributed.get_rank() + 4)
    F.mse_loss(model(x[mine]), x[mine].repeat(1, 2)).backward()
    adam.step()
    full = FSDP.full_optim_state_dict(model, adam, rank0_only=False)
    out["adam full shapes"] = {key: tuple(value.shape) for key, value in full["state"][0].items()}
    out["adam dcp"], out["adam dcp wrote metadata"] = _dcp_save(model, adam,
                                                                os.path.join(directory, "adam"))
    return out


def test_factored_moments_of_one_element_shards_are_refused(world2, tmp_path):
    # Before: both moments of a (1, 1) shard were taken for per-element state; the full dict
    # held col_var (2, 1) where a single-process Adafactor keeps (1, 1) (loaded into one, its
    # next step() raised "mat1 and mat2 shapes cannot be multiplied (2x1 and 2x1)"), dcp.save
    # wrote it as a row-sharded tensor, and reshard_local_optim_state_dicts joined the ranks'
    # col_var as rows (the same (2, 1) handed to a rank holding the whole parameter).
    for out in world2.run(_one_element_shards, str(tmp_path)):
        for what in ("full", "gather"):
            assert out[what].startswith("ValueError: ") and \
                "weight 'col_var' (1, 1) (shard (1, 1))" in out[what], (what, out)
        assert "'row_var' of a parameter sharded by FullyShardedDataParallel (shard (1, 1)) " \
            "has shape (1, 1), its shard's, but it is a factored moment" \
            in out["get_optimizer_state_dict"], out
        assert "cannot save or load 'weight.row_var'" in out["dcp"], out
        assert "shape (1, 1), its shard's, but it is a factored moment" in out["dcp"], out
        assert not out["dcp wrote metadata"], out
        assert out["reshard to 1 rank"].startswith("ValueError: ") and "state 'row_var' of " \
            "parameter weight (shape (1, 1)) differs between the saving ranks" \
            in out["reshard to 1 rank"], out
        assert out["adam full shapes"] == {"step": (), "exp_avg": (2, 1),
                                           "exp_avg_sq": (2, 1)}, out
        assert out["adam dcp"] == "accepted" and out["adam dcp wrote metadata"], out
