"""Every 2-node check in one torchrun job (each launch costs seconds): run by
tests/cluster/test_two_nodes.py as ``run_cluster([this file, OUT_DIR], nodes=2,
nproc_per_node=2)``. Each rank runs every check in order and rewrites ``OUT_DIR/rank<R>.json``
after each one, so a check that fails (or hangs until the gloo timeout) loses only its own
result; the test module asserts on the files.

The checks reuse the one-machine parity tests' bodies (same models, oracles and tolerances);
what is new here is that ranks 0-1 and 2-3 are on different nodes, with their own addresses and
``/dev/shm``, talking over a rate-limited link.
"""

import contextlib
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F

import shardkit
from shardkit import distributed as skd
from shardkit.distributed import CommCounter
from shardkit.models import GPT, GPTConfig, synthetic_batch

CKPT_TINY = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=8)
CKPT_GLOBAL_BATCH, CKPT_MICRO = 24, 2       # divides into 4 ranks (gas 3) and 3 ranks (gas 4)
CKPT_STEPS_BEFORE, CKPT_STEPS_AFTER = 2, 3
# Steps of the parity checks that reuse a one-machine test whose STEPS is 10 (OSS, ShardedDDP,
# FSDP, initialize; those tests still take 10 steps on one machine). What two nodes add, the
# link and the node groups, is in every step; 4 steps (test_fsdp_hybrid's parity takes 4 too)
# still carry optimizer state, clipping and no_sync over several steps, and cost the launch
# (4 ranks on 2 cores) about 40% of its time less than 10.
STEPS = 4


@contextlib.contextmanager
def _steps(module):
    """``module.STEPS`` is :data:`STEPS` inside the block (in this rank's process only)."""
    saved, module.STEPS = module.STEPS, STEPS
    try:
        yield
    finally:
        module.STEPS = saved


def _where():
    """Where this rank runs, and whether it sees a file rank 0 put in its /dev/shm."""
    marker = "/dev/shm/shardkit-cluster-marker"
    if skd.get_rank() == 0:
        open(marker, "w").close()
    skd.barrier()
    sees_marker = os.path.exists(marker)
    skd.barrier()
    if skd.get_rank() == 0:
        os.unlink(marker)
    intra, inter = skd.node_groups()
    return {"rank": skd.get_rank(), "node": skd.node_of(skd.get_rank()),
            "ranks_per_node": skd.ranks_per_node(), "host": os.uname().nodename,
            "sees_rank0_shm": sees_marker, "node_groups": [skd.group_ranks(intra),
                                                           skd.group_ranks(inter)],
            "processes_visible": sum(name.isdigit() for name in os.listdir("/proc"))}


def _oss_ddp():
    from tests.optim import test_oss_parity as oss
    with _steps(oss):
        return oss._run_grid(["adamw", "adamw_clip_l2", "sgd_momentum"])


def _sharded_ddp_oss():
    from tests.nn import test_sharded_ddp as sddp
    with _steps(sddp):
        return sddp._run_grid(["plain", "no_sync_4_micro_batches", "two_param_groups"])


def _overlapped_sync():
    from tests.optim import test_oss_overlap as overlap
    return {wrapper: overlap._train(wrapper)
            for wrapper in ("ddp", "sharded", "sharded_step_in_backward",
                            "ddp_step_in_backward")}


def _reduce_to_owners_hook():
    from tests import test_comm_hooks as hooks
    return hooks._train_reduced_to_owners()


def _fsdp():
    from tests.nn import test_fsdp_parity as fsdp
    with _steps(fsdp):
        return fsdp._parity_grid()


def _pipeline_one_stage_per_node():
    """Stage 0 on node 0, stage 1 on node 1; the two pipelines ([0, 2], [1, 3]) each take half
    of the batch, and each stage's replicas ([0, 1] or [2, 3]) average gradients inside the
    node."""
    from tests.nn import test_pipe_schedules as pipe
    from shardkit.nn.pipe import PipelineStage, Schedule1F1B, ScheduleGPipe, split_sequential
    rank = skd.get_rank()
    pipelines = [skd.new_group([0, 2]), skd.new_group([1, 3])]
    replicas = [skd.new_group([0, 1]), skd.new_group([2, 3])]
    pipeline, stage_index = rank % 2, rank // 2
    ref_model, ref_losses = pipe._reference(pipe.STEPS)
    ref_stage = split_sequential(ref_model, [5, 4])[stage_index]
    half = slice(pipeline * pipe.BATCH // 2, (pipeline + 1) * pipe.BATCH // 2)
    out = {}
    for schedule_cls in (ScheduleGPipe, Schedule1F1B):
        module = split_sequential(pipe._model(), [5, 4])[stage_index]
        stage = PipelineStage(module, stage_index, 2, group=pipelines[pipeline],
                              data_parallel_group=replicas[stage_index])
        with CommCounter() as comm:
            losses, _ = pipe._train_pipeline(schedule_cls, stage, 2, pipe.STEPS, rows=half)
        out[schedule_cls.__name__] = {
            "param_diff": pipe._max_param_diff(module, ref_stage), "losses": losses,
            "ref_losses": ref_losses,
            "grad_bytes": sum(p.numel() * 4 for p in module.parameters()),
            "param_tensors": sum(1 for p in module.parameters() if p.requires_grad),
            "intra_per_step": comm.intra_node_bytes / pipe.STEPS,
            "inter_per_step": comm.inter_node_bytes / pipe.STEPS}
    return out


def _tensor_parallel_in_node():
    """2-way tensor parallel inside each node ([0, 1], [2, 3]: FairScale's layout puts
    consecutive ranks together) x 2-way data parallel across the nodes, ZeRO-1 and ZeRO-3."""
    from tests.nn import test_model_parallel as tp
    from shardkit.nn import model_parallel as mp
    out = {}
    for zero in (1, 3):
        with CommCounter() as comm:
            result = tp._gpt_tensor_and_data_parallel_training(zero)
        out[f"zero{zero}"] = {"param_diff": result["param_diff"],
                              "intra": comm.intra_node_bytes, "inter": comm.inter_node_bytes}
    mp.initialize_model_parallel(2)
    out["tp_ranks"] = skd.group_ranks(mp.get_model_parallel_group())
    mp.destroy_model_parallel()
    return out


def _initialize_zero_stages():
    from tests import test_engine as engine
    out = {}
    for stage in (0, 1, 2, 3):
        with _steps(engine):
            r = engine._parity(stage)
        out[f"stage{stage}"] = {"vs_oracle": max(r["vs_oracle"]), "vs_hand": max(r["vs_hand"]),
                                "global_steps": r["global_steps"],
                                "comm_equal": r["comm"] == r["hand_comm"]}
    return out


def _full_shard_bytes():
    """FULL_SHARD FSDP on the world group, one unit per Linear: elements per step on groups
    that span nodes, next to 3M(nk-1)/nk (M the unpadded parameter count)."""
    from tests.nn import test_fsdp_costs as costs
    model = costs._mlp_16_units()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, costs.WIDTH)
    costs._mlp_step(model, optim, x)  # the first step records the order
    with CommCounter() as comm:
        costs._mlp_step(model, optim, x)
    psi = sum(u.unit_numel for u in model.sharded_units())
    return {"psi": psi, "inter_elements": comm.inter_node_elements,
            "intra_bytes": comm.intra_node_bytes, "world": skd.get_world_size()}


def _hybrid_and_hpz():
    """HYBRID_SHARD (node groups), _HYBRID_SHARD_ZERO2 and FULL_SHARD + hpZ over the two real
    nodes: parity step by step on every rank, and elements per step on spanning groups."""
    from tests.nn import test_fsdp_hybrid as hybrid
    names = ("full_shard", "hybrid", "hybrid_zero2", "hpz")
    return {"parity": hybrid._parity(names), "bytes": hybrid._inter_node_per_step(names)}


def _engine_config(stage):
    return {"train_batch_size": CKPT_GLOBAL_BATCH, "train_micro_batch_size_per_gpu": CKPT_MICRO,
            "gradient_clipping": 0.05, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "eps": 1e-6}},
            "zero_optimization": {"stage": stage}}


def engine_steps(engine, first_step, steps):
    """``steps`` optimizer steps on global batches ``first_step, ...``; the full fp32 state
    after each (collective at stage 3). Shared with the 3-rank load side of the test."""
    rank, world = skd.get_rank(), skd.get_world_size()
    per_rank = CKPT_GLOBAL_BATCH // world
    history = []
    for step in range(first_step, first_step + steps):
        idx, tgt = synthetic_batch(CKPT_TINY, CKPT_GLOBAL_BATCH, step)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        for x, y in zip(idx[mine].split(CKPT_MICRO), tgt[mine].split(CKPT_MICRO)):
            logits = engine(x)
            engine.backward(F.cross_entropy(logits.reshape(-1, CKPT_TINY.vocab_size),
                                            y.reshape(-1)))
            engine.step()
        if engine.zero_stage == 3:
            history.append({k: v.clone() for k, v in engine.wrapped.state_dict().items()})
        else:
            history.append({k: v.detach().clone() for k, v in engine.module.state_dict().items()})
    return history


def _save_checkpoint(out_dir):
    """ZeRO-3 engine on 2 nodes x 2 ranks: train, save, train on; rank 0 keeps the states after
    the save for the 3-rank resume to match."""
    engine, _, _, _ = shardkit.initialize(model=GPT(CKPT_TINY, seed=0), config=_engine_config(3))
    engine_steps(engine, 0, CKPT_STEPS_BEFORE)
    path = engine.save_checkpoint(os.path.join(out_dir, "ckpt"), client_state={"nodes": 2})
    after = engine_steps(engine, CKPT_STEPS_BEFORE, CKPT_STEPS_AFTER)
    if skd.get_rank() == 0:
        torch.save(after, os.path.join(out_dir, "ckpt_reference_after.pt"))
    return {"path": path}


def main(out_dir: str) -> int:
    skd.init_distributed(backend="gloo", timeout_s=float(os.environ.get("CHECK_TIMEOUT", "120")))
    torch.set_num_threads(1)
    rank = skd.get_rank()
    checks = [("where", _where), ("oss_ddp", _oss_ddp), ("sharded_ddp_oss", _sharded_ddp_oss),
              ("overlapped_sync", _overlapped_sync),
              ("reduce_to_owners_hook", _reduce_to_owners_hook),
              ("fsdp", _fsdp), ("pipeline", _pipeline_one_stage_per_node),
              ("tensor_parallel", _tensor_parallel_in_node),
              ("initialize", _initialize_zero_stages), ("full_shard_bytes", _full_shard_bytes),
              ("hybrid_and_hpz", _hybrid_and_hpz),
              ("save_checkpoint", lambda: _save_checkpoint(out_dir))]
    only = os.environ.get("CHECKS")
    results = {}
    for name, check in checks:
        if only and name not in only.split(","):
            continue
        try:
            results[name] = {"ok": True, "value": check()}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        with open(os.path.join(out_dir, f"rank{rank}.json.tmp"), "w") as f:
            json.dump(results, f, default=repr)
        os.replace(os.path.join(out_dir, f"rank{rank}.json.tmp"),
                   os.path.join(out_dir, f"rank{rank}.json"))
    skd.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
