"""DeepSpeed-style training with shardkit: a 10 -> 10 linear model, ZeRO stage 2, fp16.

    torchrun --nproc_per_node 2 examples/deepspeed_style.py
    torchrun --nproc_per_node 2 examples/deepspeed_style.py --config examples/ds_config.json

The DeepSpeed tutorial this mirrors passes an optimizer object *and* a config "optimizer"
section; shardkit refuses that ambiguity, so the optimizer comes from the config here. Each rank
trains on its own slice of the global batch of 16, in micro-batches of 4 (16 = 4 x 2 ranks x 2
accumulation steps). fp16 starts at a loss scale of 2**32, so the first steps overflow and are
skipped while the scale falls; then the loss goes down. On CPU the "offload" settings change
nothing (everything already lives in CPU memory); offload_param only applies at stage 3.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed

CONFIG = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
    },
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 32, "hysteresis": 2, "min_loss_scale": 1},
}


class SimpleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, 10)

    def forward(self, x):
        return self.linear(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="a DeepSpeed JSON config (default: inline)")
    parser.add_argument("--steps", type=int, default=60,
                        help="steps of the global batch of 16 (default 60)")
    args = parser.parse_args()

    torch.manual_seed(0)  # the same model and data on every rank
    model = SimpleModel()
    data, labels = torch.randn(16, 10), torch.randn(16, 10)

    engine, optimizer, _, _ = shardkit.initialize(
        model=model, model_parameters=model.parameters(),
        config=args.config if args.config else CONFIG)

    rank, world = distributed.get_rank(), distributed.get_world_size()
    per_rank = engine.train_batch_size() // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    micro = engine.train_micro_batch_size_per_gpu()
    for i in range(args.steps):
        for x, y in zip(data[mine].split(micro), labels[mine].split(micro)):
            loss = F.mse_loss(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
        if rank == 0:
            print(f"Iteration {i}, Loss: {loss.item():.6f}, loss scale: {engine.loss_scale:g}",
                  flush=True)


if __name__ == "__main__":
    main()
