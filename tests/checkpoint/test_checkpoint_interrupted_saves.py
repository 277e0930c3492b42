"""Checkpoints as a user saving and resuming meets them:

- an asynchronous ``engine.save_checkpoint`` followed by torch's own last line,
  ``torch.distributed.destroy_process_group()``: the save is published before the groups go
  (before: it failed under the destroyed group, exit status 0, no checkpoint), and a save
  that fails makes the script fail (exit status 1) rather than only printing at exit;
- a rank killed while a save writes its file: the others raise a ``CheckpointError`` saying
  so, and the staging directory is removed (before: gloo's "Connection reset by peer", and a
  full-size ``DIR/.tmp-TAG`` left behind);
- what a killed save leaves (``DIR/.tmp-TAG``, a retired ``DIR/.old-TAG`` whose re-save was
  published) is named by a warning when the directory is loaded, and removed by the next save
  (before: never reported nor removed, a full-size hidden copy each);
- FSDP local state dicts of models whose units use another sharding strategy than the root
  (a NO_SHARD unit under FULL_SHARD, a hybrid unit, FULL_SHARD under a NO_SHARD or hybrid
  root) consolidate and reshard across world sizes, optimizer state included (before:
  refused as if they were experts); units over groups of their own (experts) stay refused.

One world of 4 gloo ranks on 2 "nodes" (hybrid units shard within a node) for the last two;
the first two start 2-rank jobs as plain processes.
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed as skdist
from shardkit.checkpoint import reshard_local_optim_state_dicts
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel import ShardingStrategy as S
from shardkit.nn.data_parallel import StateDictType
from shardkit.testing import World, free_port

SCRIPT = r'''
import sys
import torch
import torch.distributed as dist
import torch.nn as nn
import shardkit

save_dir, mode = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
engine, *_ = shardkit.initialize(model=model, model_parameters=model.parameters(), config={
    "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
engine.backward(engine(torch.randn(2, 64)).sum())
engine.step()
if mode == "rank 1 dies mid-save":
    import os
    from shardkit.checkpoint import sharded
    engine.save_checkpoint(save_dir, tag="first")
    write = sharded._write_rank_file

    def half_written_then_killed(path, shard):
        if dist.get_rank() == 1:
            with open(path, "wb") as f:
                f.write(b"half")
            os._exit(9)
        write(path, shard)

    sharded._write_rank_file = half_written_then_killed
    try:
        engine.save_checkpoint(save_dir, tag="last")
    except shardkit.checkpoint.CheckpointError as error:
        print(f"CheckpointError: {error}", file=sys.stderr, flush=True)
        os._exit(3)
else:
    engine.save_checkpoint(save_dir, tag="last", async_save=True)
    dist.destroy_process_group()
'''


def _run_job(tmp_path, save_dir: str, mode: str = "destroy") -> tuple:
    """A 2-rank job of SCRIPT (plain processes): (exit statuses, stderr of both)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(shardkit.__file__)))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), save_dir, mode],
                              env=dict(env, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                       OMP_NUM_THREADS="1"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    try:
        errors = [proc.communicate(timeout=300)[1] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [proc.returncode for proc in procs], "".join(errors)


def test_torch_destroy_process_group_waits_for_the_async_save(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    codes, errors = _run_job(tmp_path, save_dir)
    assert codes == [0, 0] and "failed" not in errors, errors[-3000:]
    listing = sorted(os.listdir(save_dir))
    assert {"last", "latest"} <= set(listing) and not any(n.startswith(".") for n in listing), \
        listing
    with open(os.path.join(save_dir, "latest")) as f:
        assert f.read().strip() == "last"
    # a save that fails in the background: torch's destroy raises it, the job fails
    not_a_dir = tmp_path / "a_file"
    not_a_dir.write_text("")
    codes, errors = _run_job(tmp_path, str(not_a_dir))
    assert codes == [1, 1] and errors.count("CheckpointError") >= 2, errors[-3000:]


def test_a_rank_killed_mid_save_leaves_nothing_half_written(tmp_path):
    # Before: rank 0 raised gloo's "Connection reset by peer" and left DIR/.tmp-last, a
    # full-size hidden copy with rank 1's half-written file, behind.
    save_dir = str(tmp_path / "ckpt")
    codes, errors = _run_job(tmp_path, save_dir, "rank 1 dies mid-save")
    assert codes == [3, 9], (codes, errors[-3000:])
    assert "CheckpointError: save_checkpoint of" in errors and "another rank died" in errors \
        and "'latest' still names the previous checkpoint" in errors, errors[-3000:]
    assert sorted(os.listdir(save_dir)) == ["first", "latest", "zero_to_fp32.py"]
    with open(os.path.join(save_dir, "latest")) as f:
        assert f.read().strip() == "first"


@pytest.fixture(scope="module")
def nodes2x2():
    with World(4, ranks_per_node=2, timeout=120) as w:
        yield w


def _engine():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    engine, *_ = shardkit.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
    return engine


def _messages(caught) -> list:
    return [str(w.message) for w in caught if "killed midway" in str(w.message)]


def _leftovers_of_killed_saves(save_dir: str) -> dict:
    """Save "a"; then what saves killed midway leave: ``.tmp-b`` (rank files of an unpublished
    save), ``.old-a`` (a re-save of "a" published, its retired copy not yet removed) and
    ``.old-gone`` (a re-save of "gone" killed between its two renames: the retired copy IS
    that checkpoint). Load (warned of the first two), then save "c" (removes them)."""
    engine = _engine()
    engine.backward(engine(torch.randn(1, 6)).sum())
    engine.step()
    engine.save_checkpoint(save_dir, tag="a")
    if skdist.get_rank() == 0:
        os.makedirs(os.path.join(save_dir, ".tmp-b"))
        torch.save({"params": {}}, os.path.join(save_dir, ".tmp-b", "rank_00000.pt"))
        os.makedirs(os.path.join(save_dir, ".old-a"))
        os.makedirs(os.path.join(save_dir, ".old-gone"))
    skdist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded, _ = engine.load_checkpoint(save_dir)
    at_load = _messages(caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.save_checkpoint(save_dir, tag="c")
    at_save = _messages(caught)
    skdist.barrier()
    return {"loaded": os.path.basename(loaded), "at_load": at_load, "at_save": at_save,
            "listing": sorted(os.listdir(save_dir))}


def test_what_killed_saves_leave_is_reported_and_removed(nodes2x2, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    for rank, r in enumerate(nodes2x2.run(_leftovers_of_killed_saves, save_dir)):
        assert r["loaded"] == "a", r
        assert r["listing"] == [".old-gone", "a", "c", "latest", "zero_to_fp32.py"], r
        if rank:  # reported once, by rank 0, which removes them
            assert r["at_load"] == r["at_save"] == [], r
            continue
        assert len(r["at_load"]) == 1 and ".old-a, .tmp-b" in r["at_load"][0], r
        assert "load_checkpoint" in r["at_load"][0], r
        assert len(r["at_save"]) == 1 and "removed .old-a, .tmp-b" in r["at_save"][0], r


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3), nn.Linear(3, 2))


def _wrapped(root, inner, group=None):
    """The MLP with its middle layer a unit of strategy ``inner`` under a ``root`` unit."""
    m = _mlp()
    over = {} if group is None else {"process_group": group}
    return FSDP(nn.Sequential(m[0], FSDP(m[1], sharding_strategy=inner, **over), m[2]),
                sharding_strategy=root, **over)


def _full_weights(model) -> dict:
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return {k: v.clone() for k, v in model.state_dict().items()}


def _full_moments(model, optim) -> dict:
    """Every parameter's full Adam ``exp_avg_sq``, by name (on every rank)."""
    full = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    names = full.get("param_names") or [n for n, _ in model.named_parameters()]
    return {names[int(i)]: s["exp_avg_sq"] for i, s in full["state"].items()}


def _all_gathered(obj) -> list:
    out = [None] * skdist.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return [o for o in out if o is not None]


def _differences(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _mixed_strategies_round_trip(savers, root, inner, new_root, new_inner) -> dict:
    """The ranks ``savers`` train one step of a ``root``/``inner`` model and save local state
    dicts; every rank consolidates them (a world of one) and loads them, weights and Adam
    state, into a ``new_root``/``new_inner`` model over all 4 ranks."""
    group = torch.distributed.new_group(savers)
    saved = None
    if skdist.get_rank() in savers:
        model = _wrapped(root, inner, group if len(savers) < 4 else None)
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(skdist.get_rank()))
        model(x).pow(2).sum().backward()
        optim.step()
        saved = (model.local_state_dict(), model.local_metadata_dict(), optim.state_dict(),
                 _full_weights(model), _full_moments(model, optim))
    saved = _all_gathered(saved)
    dicts, metas, optims = ([s[i] for s in saved] for i in range(3))
    weights, moments = saved[0][3], saved[0][4]
    target = _wrapped(new_root, new_inner)
    optim = torch.optim.Adam(target.parameters(), lr=0.1)
    target.load_local_state_dict(dicts, metas)
    optim.load_state_dict(reshard_local_optim_state_dicts(optims, metas, target, optim))
    return {"consolidated": _differences(FSDP.consolidate_shard_weights(dicts, metas), weights),
            "resharded": _differences(_full_weights(target), weights),
            "moments": _differences(_full_moments(target, optim), moments),
            "own_group_params": metas[0]["own_group_params"]}


MIXED = [  # (saving ranks, root, inner unit) -> (new root, new inner unit) over 4 ranks
    ([0, 1], S.FULL_SHARD, S.NO_SHARD, S.FULL_SHARD, S.FULL_SHARD),
    ([0, 1], S.FULL_SHARD, S.NO_SHARD, S.HYBRID_SHARD, S.NO_SHARD),
    ([0, 1, 2, 3], S.FULL_SHARD, S.HYBRID_SHARD, S.FULL_SHARD, S.NO_SHARD),
    ([0, 1, 2, 3], S.NO_SHARD, S.FULL_SHARD, S.FULL_SHARD, S.HYBRID_SHARD),
    ([0, 1, 2, 3], S.HYBRID_SHARD, S.NO_SHARD, S.FULL_SHARD, S.FULL_SHARD),
]


@pytest.mark.parametrize("case", MIXED, ids=lambda c: "-".join(
    str(len(x)) if isinstance(x, list) else x.name for x in c))
def test_local_state_dicts_of_mixed_strategies_reshard(nodes2x2, case):
    for r in nodes2x2.run(_mixed_strategies_round_trip, *case):
        assert r["own_group_params"] == [], r
        assert r["consolidated"] == r["resharded"] == r["moments"] == 0.0, r
