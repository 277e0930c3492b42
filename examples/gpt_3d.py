"""3D-parallel GPT training on CPU: tensor x pipeline x data parallelism in one loop.

    torchrun --nproc_per_node 8 examples/gpt_3d.py                 # 2 tensor x 2 pipeline x 2 data
    torchrun --nproc_per_node 4 examples/gpt_3d.py --pp 1          # 2 tensor x 2 data
    torchrun --nproc_per_node 8 examples/gpt_3d.py --check         # compare with one process
    torchrun --nproc_per_node 8 examples/gpt_3d.py --zero 3        # FSDP over the replicas
    torchrun --nproc_per_node 8 examples/gpt_3d.py --schedule zero-bubble   # ZB-H1 pipeline

Each rank holds 1/tp of the linear and embedding weights (Megatron-split layers), the layers of
one pipeline stage, and 1/dp of the optimizer state (--zero 1: OSS over the data-parallel group;
2: ShardedDDP + OSS, gradients sharded too; 3: FSDP, parameters sharded too); each
data-parallel replica trains on 1/dp of the global batch, in micro-batches through the stages.
With --check every rank also trains the unsplit GPT on the whole batch and compares the losses.
"""

import argparse

import torch

from shardkit import distributed, recipes
from shardkit.models import GPT, GPTConfig, synthetic_batch
from shardkit.nn import model_parallel as mp
from shardkit.nn import pipe
from shardkit.nn.model_parallel.full_state import load_full_model_state_dict
from shardkit.nn.model_parallel.gpt import TensorParallelGPT, from_reference_state_dict, gpt_loss
from shardkit.optim import OSS


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--chunks", type=int, default=2, help="micro-batches per replica and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--zero", type=int, default=1, choices=(1, 2, 3),
                   help="data-parallel sharding: 1 OSS, 2 ShardedDDP + OSS, 3 FSDP")
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES),
                   help="pipeline schedule (zero-bubble: ZB-H1, backward split into B and W)")
    p.add_argument("--check", action="store_true", help="compare with single-process training")
    return p.parse_args()


SCHEDULES = {"gpipe": pipe.ScheduleGPipe, "1f1b": pipe.Schedule1F1B,
             "zero-bubble": pipe.ScheduleZeroBubble}


def even_balance(layers: int, stages: int) -> list[int]:
    return [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]


def one_unit(module=None, recurse=None, **_):
    """Wrap policy for FSDP: no unit below the stage (the stage is one FSDP unit)."""
    return bool(recurse)


def wrap_data_parallel(part, zero: int, dp_group, lr: float):
    """(module for the stage, optimizer, group the stage itself averages gradients over)."""
    if zero in (2, 3):  # 2: ShardedDDP + OSS, 3: FSDP, over the replicas of this stage
        composition = recipes.compose(part, zero, recipes.adamw(lr), process_group=dp_group,
                                      **({"wrap_policy": one_unit} if zero == 3 else {}))
        return composition.wrapped, composition.optimizer, None
    # ZeRO-1 without torch DDP: the pipeline stage all-reduces the gradients over the replicas
    # itself (data_parallel_group=), and OSS shards the optimizer state.
    optimizer = OSS(part.parameters(), optim=torch.optim.AdamW, group=dp_group, lr=lr)
    return part, optimizer, dp_group


def main():
    args = parse_args()
    if args.zero == 3 and args.sequence_parallel:
        raise SystemExit("--zero 3 with --sequence-parallel: FSDP flattens the LayerNorm "
                         "parameters whose gradients sequence parallelism must sum; use --zero 1/2")
    distributed.init_distributed()
    mp.initialize_model_parallel(args.tp, pipeline_length=args.pp)
    mp.model_parallel_manual_seed(0)
    cfg = GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=64, seq_len=32)

    # model: the unsplit reference weights, Megatron-split; this rank keeps its stage
    model = TensorParallelGPT(cfg, sequence_parallel=args.sequence_parallel)
    load_full_model_state_dict(model, from_reference_state_dict(GPT(cfg, seed=0).state_dict(), cfg))
    stage_index = mp.get_pipeline_parallel_rank()
    part = pipe.split_sequential(model, even_balance(len(model), args.pp))[stage_index]
    is_last = stage_index == args.pp - 1

    # wrap: data parallelism over the replicas of this stage, then the pipeline stage
    dp_group = mp.get_data_parallel_group()
    stage_module, optimizer, stage_dp_group = wrap_data_parallel(part, args.zero, dp_group, args.lr)
    stage = pipe.PipelineStage(stage_module, stage_index, args.pp,
                               group=mp.get_pipeline_parallel_group(),
                               data_parallel_group=stage_dp_group)
    schedule = SCHEDULES[args.schedule](stage, chunks=args.chunks, loss_fn=gpt_loss)

    if args.check:
        reference = GPT(cfg, seed=0)
        reference_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    local = args.batch // mp.get_data_parallel_world_size()
    rows = slice(mp.get_data_parallel_rank() * local, (mp.get_data_parallel_rank() + 1) * local)
    worst = 0.0

    # loop
    for step in range(args.steps):
        idx, target = synthetic_batch(cfg, args.batch, step)
        optimizer.zero_grad()
        loss = schedule.step(idx[rows], target=target[rows])
        mp.reduce_sequence_parallel_grads(part)
        optimizer.step()

        # report: the mean over the replicas of the last stage's loss
        loss = torch.tensor([loss.item() if is_last else 0.0])
        distributed.all_reduce(loss, group=mp.get_data_parallel_group())
        loss = loss.item() / mp.get_data_parallel_world_size()
        if args.check:
            reference_opt.zero_grad()
            expected = reference.loss(idx, target)
            expected.backward()
            reference_opt.step()
            worst = max(worst, abs(loss - expected.item())) if is_last else worst
        if is_last and distributed.get_rank() == distributed.get_world_size() - 1:
            print(f"step {step:3d}  loss {loss:.4f}"
                  + (f"  single-process {expected.item():.4f}" if args.check else ""), flush=True)

    if args.check and is_last and distributed.get_rank() == distributed.get_world_size() - 1:
        print(f"max |loss - single-process loss| over {args.steps} steps: {worst:.2e}")
    mp.destroy_model_parallel()
    distributed.destroy()


if __name__ == "__main__":
    main()
