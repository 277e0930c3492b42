"""FairScale-style training with shardkit: the same 10 -> 10 linear model with
ShardedDataParallel (gradient sharding) over OSS (optimizer-state sharding).

    torchrun --nproc_per_node 2 examples/fairscale_style.py
    python examples/fairscale_style.py --check            # one process, no launcher

The FairScale tutorial this mirrors wraps the model first, ``ShardedDDP(model, AdamW(...))``,
then builds ``OSS(optimizer, local_rank=...)``. That order cannot work: ShardedDataParallel
needs the OSS partition to know which rank reduces which gradient, and OSS takes its optimizer
type and hyper-parameters from the optimizer it wraps. Build OSS first, then wrap the model
(``--seed-order`` runs the tutorial's order and prints the errors shardkit gives).

Any number of processes up to 16 trains on the same global batch of 16 rows: ShardedDDP averages
the ranks' gradients, so where 16 rows do not split evenly (3 processes: 5, 5 and 6 rows) each
rank weights its mean loss by its share of the rows, and the step is the one-process step on all
16. ``--check`` also trains the unsplit model in one process beside it and compares the weights
at the end (``check: PASS`` or ``check: FAIL``, exit status 1).
"""

import argparse
import copy
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.nn.data_parallel import ShardedDataParallel as ShardedDDP
from shardkit.optim import OSS


ROWS = 16  # the global batch


class SimpleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, 10)

    def forward(self, x):
        return self.linear(x)


def seed_order_errors(model) -> int:
    """The tutorial's order: each step fails with a message that says what to do instead."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.001)
    for attempt in (lambda: ShardedDDP(model, optimizer),
                    lambda: OSS(optimizer, local_rank=distributed.get_rank())):
        try:
            attempt()
        except (TypeError, ValueError) as e:
            print(f"{type(e).__name__}: {e}", flush=True)
    return 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps (default 50)")
    parser.add_argument("--seed-order", action="store_true",
                        help="run the tutorial's (wrong) order and show the errors")
    parser.add_argument("--check", action="store_true",
                        help="compare the weights with one-process training at the end")
    args = parser.parse_args()
    shardkit.init_distributed()  # torchrun's group; under plain `python`, one rank in memory
    rank, world = distributed.get_rank(), distributed.get_world_size()
    if world > ROWS:  # checked on every rank before any collective
        print(f"fairscale_style.py: {world} processes for a global batch of {ROWS} rows; run "
              f"at most {ROWS} (each rank needs a row)", file=sys.stderr)
        return 2

    torch.manual_seed(0)  # the same model and data on every rank
    model = SimpleModel()
    data, labels = torch.randn(ROWS, 10), torch.randn(ROWS, 10)
    if args.seed_order:
        return seed_order_errors(model)
    alone = copy.deepcopy(model) if args.check else None

    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=0.001)  # shard the state
    model = ShardedDDP(model, optimizer)                                    # shard the grads

    mine = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    share = (mine.stop - mine.start) * world / ROWS  # 1.0 where the rows split evenly
    for i in range(args.steps):
        outputs = model(data[mine])
        loss = F.mse_loss(outputs, labels[mine])
        (loss * share).backward()  # the ranks' average is the mean over all 16 rows
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"Iteration {i}, Loss: {loss.item():.6f}", flush=True)
    code = 0 if alone is None else check(model.module, alone, data, labels, args.steps, rank)
    distributed.destroy()
    return code


def check(trained, alone, data, labels, steps, rank) -> int:
    """Train ``alone`` on the whole batch in this process; compare its weights with
    ``trained``'s."""
    optimizer = torch.optim.AdamW(alone.parameters(), lr=0.001)
    for _ in range(steps):
        F.mse_loss(alone(data), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    worst = max((a - b).abs().max().item()
                for a, b in zip(trained.parameters(), alone.parameters()))
    ok = worst <= 1e-6
    print(f"rank {rank} check: {'PASS' if ok else 'FAIL'} (largest weight difference from "
          f"one-process training {worst:.3g})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
