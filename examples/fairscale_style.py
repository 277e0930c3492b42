"""FairScale-style training with shardkit: the same 10 -> 10 linear model with
ShardedDataParallel (gradient sharding) over OSS (optimizer-state sharding).

    torchrun --nproc_per_node 2 examples/fairscale_style.py

The FairScale tutorial this mirrors wraps the model first, ``ShardedDDP(model, AdamW(...))``,
then builds ``OSS(optimizer, local_rank=...)``. That order cannot work: ShardedDataParallel
needs the OSS partition to know which rank reduces which gradient, and OSS takes its optimizer
type and hyper-parameters from the optimizer it wraps. Build OSS first, then wrap the model
(``--seed-order`` runs the tutorial's order and prints the errors shardkit gives).
"""

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed
from shardkit.nn.data_parallel import ShardedDataParallel as ShardedDDP
from shardkit.optim import OSS


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
    args = parser.parse_args()
    distributed.init_distributed()

    torch.manual_seed(0)  # the same model and data on every rank
    model = SimpleModel()
    data, labels = torch.randn(16, 10), torch.randn(16, 10)
    if args.seed_order:
        return seed_order_errors(model)

    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=0.001)  # shard the state
    model = ShardedDDP(model, optimizer)                                    # shard the grads

    rank, world = distributed.get_rank(), distributed.get_world_size()
    mine = slice(rank * 16 // world, (rank + 1) * 16 // world)
    for i in range(args.steps):
        outputs = model(data[mine])
        loss = F.mse_loss(outputs, labels[mine])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"Iteration {i}, Loss: {loss.item():.6f}", flush=True)
    distributed.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
