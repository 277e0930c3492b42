"""The main job: a small multi-process CPU training run launched with torchrun.

``python -m shardkit demo [--world-size 2] [--steps 30]`` starts ``world-size`` processes with
torchrun; each trains the reference GPT (small by default) on a synthetic next-token task with
torch DDP, rank 0 printing a progress bar and the loss going down.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m shardkit demo")
    p.add_argument("--world-size", type=int, default=2, choices=(1, 2, 4))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return _worker(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.world_size}", "-m", "shardkit.demo", "--worker",
           f"--world-size={args.world_size}", f"--steps={args.steps}", f"--batch={args.batch}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.call(cmd, env=env)


def _progress(step, total, loss, width=30):
    done = int(width * step / total)
    bar = "#" * done + "-" * (width - done)
    print(f"\r[{bar}] {step:>4}/{total} loss {loss:.4f}", end="", flush=True)


def _worker(args) -> int:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shardkit import distributed
    from shardkit.models import GPT, GPTConfig, synthetic_batch

    distributed.init_distributed()
    rank, world = distributed.get_rank(), distributed.get_world_size()
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=512, n_layer=2, n_head=4, d_model=128, seq_len=32)
    model = DDP(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    local = args.batch // world
    t0 = time.time()
    for step in range(args.steps):
        idx, tgt = synthetic_batch(cfg, args.batch, step)
        idx, tgt = idx[rank * local:(rank + 1) * local], tgt[rank * local:(rank + 1) * local]
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        distributed.all_reduce(mean)
        if rank == 0:
            _progress(step + 1, args.steps, mean.item() / world)
    if rank == 0:
        print(f"\n{world} ranks, {args.steps} steps in {time.time() - t0:.1f}s")
    distributed.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
