"""3D-parallel GPT training on CPU: tensor x pipeline x data parallelism in one loop.

    torchrun --nproc_per_node 8 examples/gpt_3d.py                 # 2 tensor x 2 pipeline x 2 data
    torchrun --nproc_per_node 4 examples/gpt_3d.py --pp 1          # 2 tensor x 2 data
    torchrun --nproc_per_node 8 examples/gpt_3d.py --check         # compare with one process
    torchrun --nproc_per_node 8 examples/gpt_3d.py --zero 3        # FSDP over the replicas
    torchrun --nproc_per_node 8 examples/gpt_3d.py --schedule zero-bubble   # ZB-H1 pipeline
    torchrun --nproc_per_node 8 examples/gpt_3d.py --schedule interleaved-1f1b --virtual-stages 3
    torchrun --nproc_per_node 8 examples/gpt_3d.py --schedule zbv  # two stages per rank in a V
    torchrun --nproc_per_node 8 examples/gpt_3d.py --schedule all --check --steps 5   # each in turn

Each rank holds 1/tp of the linear and embedding weights (Megatron-split layers), the layers of
its pipeline stages, and 1/dp of the optimizer state (--zero 1: OSS over the data-parallel group;
2: ShardedDDP + OSS, gradients sharded too; 3: FSDP, parameters sharded too); each
data-parallel replica trains on 1/dp of the global batch, in micro-batches through the stages.

Schedules (--schedule): gpipe, 1f1b and zero-bubble (ZB-H1) run one stage per pipeline rank;
interleaved-1f1b runs --virtual-stages v stages per rank (default 2; stage s on pipeline rank
s mod pp) and zbv two per rank in a V (rank r runs stages r and 2pp-1-r). The GPT's layers
(embedding, --layers blocks, head) are cut into pp x v consecutive stages, as evenly as they go.
Several schedules (--schedule zbv,1f1b or all) train one after the other, each from the same
weights.

With --check every rank also trains the unsplit GPT on the whole batch; the last line of each
schedule compares the losses of every step with it and, with --optimizer sgd, every rank's
weights at the end, and says ``check: PASS`` or ``check: FAIL`` (exit status 1 if any failed).
Weights are not compared under AdamW: gradients that are zero in exact arithmetic (the attention
key bias's) come out as rounding noise that differs between the split and the unsplit model, and
Adam turns any such noise into steps of about lr, so the weights part by ~lr per step while the
training is the same.
"""

import argparse
import os
import sys

import torch

import shardkit
from shardkit import distributed, recipes
from shardkit.models import GPT, GPTConfig, synthetic_batch
from shardkit.nn import model_parallel as mp
from shardkit.nn import pipe
from shardkit.nn.model_parallel.full_state import load_full_model_state_dict
from shardkit.nn.model_parallel.gpt import TensorParallelGPT, from_reference_state_dict, gpt_loss
from shardkit.nn.pipe.stage import stage_rank
from shardkit.optim import OSS

# --schedule -> (schedule class, stage placement, stages per pipeline rank: default, allowed)
SCHEDULES = {
    "gpipe": (pipe.ScheduleGPipe, "loop", 1, (1,)),
    "1f1b": (pipe.Schedule1F1B, "loop", 1, (1,)),
    "zero-bubble": (pipe.ScheduleZeroBubble, "loop", 1, (1,)),
    "interleaved-1f1b": (pipe.ScheduleInterleaved1F1B, "loop", 2, None),  # None: any v >= 1
    "zbv": (pipe.ScheduleZBV, "v", 2, (2,)),
}
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
# fp32 parity with one process (micro-batches, tensor-parallel sums and the data-parallel mean
# round differently; measured differences are around 1e-6)
LOSS_TOLERANCE = 1e-4
WEIGHT_TOLERANCE = 1e-4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--chunks", type=int, default=2, help="micro-batches per replica and step")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    p.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS),
                   help="--check compares the weights under sgd only (see the module docstring)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks of the GPT")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism in the tensor-parallel regions")
    p.add_argument("--zero", type=int, default=1, choices=(1, 2, 3),
                   help="data-parallel sharding: 1 OSS, 2 ShardedDDP + OSS, 3 FSDP")
    p.add_argument("--schedule", default="1f1b",
                   help=f"pipeline schedule: one of {', '.join(SCHEDULES)}; several separated "
                        f"by commas, or all (every schedule), train one after "
                        f"the other from the same weights. zero-bubble: ZB-H1, backward split "
                        f"into B and W; interleaved-1f1b: several stages per rank, "
                        f"round-robin; zbv: two stages per rank in a V, backward split")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="pipeline stages per pipeline rank for interleaved-1f1b (default 2); "
                        "zbv runs 2, the others 1")
    p.add_argument("--check", action="store_true", help="compare with single-process training")
    args = p.parse_args(argv)
    names = list(SCHEDULES) if args.schedule == "all" else args.schedule.split(",")
    for name in names:
        if name not in SCHEDULES:
            p.error(f"--schedule {args.schedule}: {name!r} is not one of {list(SCHEDULES)} "
                    f"(or all)")
    args.schedules = list(dict.fromkeys(names))
    return args


def config(args) -> GPTConfig:
    return GPTConfig(vocab_size=256, n_layer=args.layers, n_head=4, d_model=64, seq_len=32)


def stages_per_rank(args, name: str) -> int:
    """How many pipeline stages each pipeline rank runs under schedule ``name``."""
    _, _, default, allowed = SCHEDULES[name]
    if allowed is None:
        return default if args.virtual_stages is None else args.virtual_stages
    return allowed[0]


def schedule_problem(args, name: str):
    """Why schedule ``name`` cannot run with these arguments (naming the flags), or None."""
    allowed = SCHEDULES[name][3]
    v = stages_per_rank(args, name)
    given = args.virtual_stages
    if given is not None and allowed is not None and given not in allowed \
            and args.schedule != "all":
        return (f"--schedule {name} runs {allowed[0]} stage(s) per pipeline rank, got "
                f"--virtual-stages {given}; use --virtual-stages {allowed[0]}"
                + (" or --schedule interleaved-1f1b for several" if allowed == (1,) else ""))
    stages, layers = args.pp * v, args.layers + 2
    if stages > layers:
        return (f"--schedule {name}: --pp {args.pp} x {v} stages per rank"
                + (f" (--virtual-stages {v})" if allowed is None else "")
                + f" = {stages} pipeline stages, but the GPT has only {layers} layers to cut "
                f"(embedding, --layers {args.layers} blocks, head); use --layers >= {stages - 2}"
                f" or fewer stages")
    if name == "interleaved-1f1b" and args.chunks % args.pp:
        return (f"--schedule interleaved-1f1b needs --chunks to be a multiple of --pp {args.pp} "
                f"(micro-batches go round in groups of pp), got --chunks {args.chunks}")
    return None


def argument_problem(args, world_size: int):
    """Why these arguments cannot run on ``world_size`` ranks (a message naming the flags), or
    None. Checked on every rank before any communication."""
    cfg = config(args)
    for flag, value in (("--tp", args.tp), ("--pp", args.pp), ("--steps", args.steps),
                        ("--batch", args.batch), ("--chunks", args.chunks),
                        ("--layers", args.layers), ("--virtual-stages", args.virtual_stages)):
        if value is not None and value < 1:
            return f"{flag} {value}: expected a positive number"
    if world_size % (args.tp * args.pp):
        return (f"--tp {args.tp} x --pp {args.pp} = {args.tp * args.pp} ranks per pipeline does "
                f"not divide the world size {world_size}; use a world size that is a multiple")
    if cfg.n_head % args.tp:
        return f"--tp {args.tp} does not divide the GPT's {cfg.n_head} attention heads"
    dp = world_size // (args.tp * args.pp)
    if args.batch % dp:
        return (f"--batch {args.batch} is not divisible by the {dp} data-parallel replicas "
                f"(world {world_size} / (--tp {args.tp} x --pp {args.pp}))")
    if (args.batch // dp) % args.chunks:
        return (f"--chunks {args.chunks} does not divide the {args.batch // dp} sequences of "
                f"each replica (--batch {args.batch} / {dp} replicas): micro-batches must be equal")
    if args.zero == 3 and args.sequence_parallel:
        return ("--zero 3 with --sequence-parallel: FSDP flattens the LayerNorm parameters whose "
                "gradients sequence parallelism must sum; use --zero 1/2")
    for name in args.schedules:
        problem = schedule_problem(args, name)
        if problem:
            return problem
    return None


def even_balance(layers: int, stages: int) -> list[int]:
    return [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]


def one_unit(module=None, recurse=None, **_):
    """Wrap policy for FSDP: no unit below the stage (the stage is one FSDP unit)."""
    return bool(recurse)


def wrap_data_parallel(part, zero: int, dp_group, optimizer_cls, lr: float):
    """(module for the stage, optimizer, group the stage itself averages gradients over)."""
    if zero in (2, 3):  # 2: ShardedDDP + OSS, 3: FSDP, over the replicas of this stage
        composition = recipes.compose(part, zero, recipes.OptimizerRecipe(optimizer_cls,
                                                                          {"lr": lr}),
                                      process_group=dp_group,
                                      **({"wrap_policy": one_unit} if zero == 3 else {}))
        return composition.wrapped, composition.optimizer, None
    # ZeRO-1 without torch DDP: the pipeline stage all-reduces the gradients over the replicas
    # itself (data_parallel_group=), and OSS shards the optimizer state.
    optimizer = OSS(part.parameters(), optim=optimizer_cls, group=dp_group, lr=lr)
    return part, optimizer, dp_group


def build_stages(model, args, name: str):
    """This rank's pipeline stages under schedule ``name``: [(stage index, layers,
    PipelineStage, optimizer)], in stage order. Stage s of pp x v runs on the pipeline rank the
    schedule's placement gives it."""
    _, placement, _, _ = SCHEDULES[name]
    num_stages = args.pp * stages_per_rank(args, name)
    parts = pipe.split_sequential(model, even_balance(len(model), num_stages))
    pipeline_rank, dp_group = mp.get_pipeline_parallel_rank(), mp.get_data_parallel_group()
    built = []
    for s in range(num_stages):
        if stage_rank(s, num_stages, args.pp, placement) != pipeline_rank:
            continue
        # data parallelism over the replicas of this stage, then the pipeline stage
        module, optimizer, stage_dp_group = wrap_data_parallel(
            parts[s], args.zero, dp_group, OPTIMIZERS[args.optimizer], args.lr)
        stage = pipe.PipelineStage(module, s, num_stages, group=mp.get_pipeline_parallel_group(),
                                   data_parallel_group=stage_dp_group, placement=placement)
        built.append((s, parts[s], stage, optimizer))
    return built


def stage_weights(part, stage) -> dict:
    """The stage's parameters under the full model's names (FSDP: gathered, a collective over
    the stage's replicas; the others hold them whole)."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel

    if isinstance(stage.module, FullyShardedDataParallel):
        return dict(stage.module.state_dict())
    return {name: p.detach() for name, p in part.named_parameters()}


def weight_difference(cfg, reference, built, sequence_parallel: bool) -> float:
    """Largest |this rank's weight - the single-process weight| over this rank's stages."""
    expected = TensorParallelGPT(cfg, sequence_parallel=sequence_parallel)
    load_full_model_state_dict(expected, from_reference_state_dict(reference.state_dict(), cfg))
    expected = expected.state_dict()
    worst = 0.0
    for _, part, stage, _ in built:
        for name, tensor in stage_weights(part, stage).items():
            worst = max(worst, (tensor - expected[name]).abs().max().item())
    return worst


def report_check(args, name, cfg, reference, built, worst_loss: float, printer: bool) -> bool:
    """Share the worst loss and weight differences over the world (one all-reduce; FSDP stages
    gather their weights first), print the ``check:`` line on ``printer``, return whether the
    run matched single-process training."""
    compare_weights = args.optimizer == "sgd"
    worst_weight = weight_difference(cfg, reference, built, args.sequence_parallel) \
        if compare_weights else 0.0
    worst = torch.tensor([worst_loss, worst_weight])
    distributed.all_reduce(worst, op=distributed.ReduceOp.MAX)
    worst_loss, worst_weight = worst.tolist()
    passed = worst_loss <= LOSS_TOLERANCE and worst_weight <= WEIGHT_TOLERANCE
    if printer:
        weights = (f"max |weight - single-process weight| on every rank {worst_weight:.2e} "
                   f"(tolerance {WEIGHT_TOLERANCE:.0e})" if compare_weights else
                   "weights not compared under adamw (use --optimizer sgd)")
        print(f"check: {'PASS' if passed else 'FAIL'}  --schedule {name}: "
              f"{args.pp * stages_per_rank(args, name)} stages on {args.pp} pipeline ranks; "
              f"max |loss - "
              f"single-process loss| over {args.steps} steps {worst_loss:.2e} (tolerance "
              f"{LOSS_TOLERANCE:.0e}); {weights}", flush=True)
    return passed


def train(args, name: str) -> bool:
    """Train ``args.steps`` steps under schedule ``name`` from the reference weights; with
    ``--check`` compare with one process and return whether it matched (else True)."""
    mp.model_parallel_manual_seed(0)
    cfg = config(args)

    # model: the unsplit reference weights, Megatron-split; this rank keeps its stages
    model = TensorParallelGPT(cfg, sequence_parallel=args.sequence_parallel)
    load_full_model_state_dict(model, from_reference_state_dict(GPT(cfg, seed=0).state_dict(), cfg))
    built = build_stages(model, args, name)
    num_stages = args.pp * stages_per_rank(args, name)
    is_last = any(s == num_stages - 1 for s, *_ in built)
    stages = [stage for _, _, stage, _ in built]
    schedule = SCHEDULES[name][0](stages[0] if len(stages) == 1 else stages,
                                  chunks=args.chunks, loss_fn=gpt_loss)
    optimizers = [optimizer for *_, optimizer in built]
    # one rank prints: the last stage's, first of its tensor- and data-parallel groups
    printer = is_last and mp.get_model_parallel_rank() == 0 and mp.get_data_parallel_rank() == 0
    if printer and len(args.schedules) > 1:
        print(f"--schedule {name}: {num_stages} stages on {args.pp} pipeline ranks", flush=True)

    if args.check:
        reference = GPT(cfg, seed=0)
        reference_opt = OPTIMIZERS[args.optimizer](reference.parameters(), lr=args.lr)
    local = args.batch // mp.get_data_parallel_world_size()
    rows = slice(mp.get_data_parallel_rank() * local, (mp.get_data_parallel_rank() + 1) * local)
    worst_loss = 0.0

    # loop
    for step in range(args.steps):
        idx, target = synthetic_batch(cfg, args.batch, step)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = schedule.step(idx[rows], target=target[rows])
        for _, part, _, _ in built:
            mp.reduce_sequence_parallel_grads(part)
        for optimizer in optimizers:
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
            worst_loss = max(worst_loss, abs(loss - expected.item())) if is_last else worst_loss
        if printer:
            print(f"step {step:3d}  loss {loss:.4f}"
                  + (f"  single-process {expected.item():.4f}" if args.check else ""), flush=True)

    if not args.check:
        return True
    return report_check(args, name, cfg, reference, built, worst_loss, printer)


def main(argv=None):
    args = parse_args(argv)
    problem = argument_problem(args, int(os.environ.get("WORLD_SIZE", "1")))
    if problem:
        raise SystemExit(problem)
    shardkit.init_distributed()  # torchrun's group; under plain `python`, one rank in memory
    mp.initialize_model_parallel(args.tp, pipeline_length=args.pp)
    passed = [train(args, name) for name in args.schedules]
    mp.destroy_model_parallel()
    distributed.destroy()
    if not all(passed):
        sys.exit(1)


if __name__ == "__main__":
    main()
