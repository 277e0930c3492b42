"""Interleaved 1F1B, ZB-H1 and ZBV match single-process training step by step; memory; errors."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.models import GPT, MLP, GPTConfig
from shardkit.nn.pipe import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                              ScheduleInterleaved1F1B, ScheduleZBV, ScheduleZeroBubble,
                              split_sequential)
from shardkit.testing import world_fixture

BATCH, STEPS = 16, 3
GPT_CFG = GPTConfig(vocab_size=64, n_layer=6, n_head=2, d_model=16, seq_len=8)

world2 = world_fixture(2)
world4 = world_fixture(4)


class _Embed(nn.Module):
    def __init__(self, gpt):
        super().__init__()
        self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb

    def forward(self, idx):
        return self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))


def _gpt_layers():
    """The reference GPT as a sequence of 8 layers: embeddings, 6 blocks, final norm + head."""
    gpt = GPT(GPT_CFG, seed=0)
    return nn.Sequential(_Embed(gpt), *gpt.blocks, nn.Sequential(gpt.ln_f, gpt.head))


def _gpt_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _gpt_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, GPT_CFG.vocab_size, (BATCH, GPT_CFG.seq_len + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _mlp_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


MODELS = {
    "gpt": (_gpt_layers, _gpt_batch, _gpt_loss),
    "mlp": (lambda: MLP(16, 8, out=4, seed=0), _mlp_batch, F.mse_loss),
}
# name -> (schedule class, stages per rank, placement)
SCHEDULES = {
    "1F1B": (Schedule1F1B, 1, "loop"),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2, "loop"),
    "ZeroBubble": (ScheduleZeroBubble, 1, "loop"),
    "ZBV": (ScheduleZBV, 2, "v"),
}


def _even(n, parts):
    return [n // parts + (1 if k < n % parts else 0) for k in range(parts)]


def _build(model_name, schedule_name, chunks, **kwargs):
    rank, world = dist.get_rank(), dist.get_world_size()
    make, _, loss_fn = MODELS[model_name]
    cls, per_rank, placement = SCHEDULES[schedule_name]
    num_stages = world * per_rank
    layers = make()
    parts = split_sequential(layers, _even(len(layers), num_stages))
    mine = [s for s in range(num_stages) if _owner(s, world, placement) == rank]
    stages = [PipelineStage(parts[s], s, num_stages, placement=placement) for s in mine]
    arg = stages[0] if cls in (Schedule1F1B, ScheduleGPipe) else stages
    return cls(arg, chunks, loss_fn, **kwargs), stages


def _owner(stage, world, placement):
    if placement == "v" and stage >= world:
        return 2 * world - 1 - stage
    return stage % world


def _check_parity(model_name, schedule_name, chunks):
    """Per step: max |grad - reference grad| and max |weight - reference weight| over this
    rank's parameters, and the loss difference on the rank running the last stage."""
    make, batch, loss_fn = MODELS[model_name]
    reference = make()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_params = dict(reference.named_parameters())
    schedule, stages = _build(model_name, schedule_name, chunks)
    params = [(n, p) for st in stages for n, p in st.module.named_parameters()]
    opt = torch.optim.SGD([p for _, p in params], lr=0.1)
    grad_diff = weight_diff = loss_diff = 0.0
    for step in range(STEPS):
        x, y = batch(step)
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        opt.zero_grad()
        loss = schedule.step(x, target=y)
        grad_diff = max([grad_diff] + [(p.grad - ref_params[n].grad).abs().max().item()
                                       for n, p in params])
        ref_opt.step()
        opt.step()
        weight_diff = max([weight_diff] + [(p - ref_params[n]).abs().max().item()
                                           for n, p in params])
        if loss is not None:
            loss_diff = max(loss_diff, abs(loss.item() - ref_loss.item()))
    return grad_diff, weight_diff, loss_diff


def _parity_grid():
    p = dist.get_world_size()
    return {(model, schedule, m): _check_parity(model, schedule, m)
            for model in MODELS for schedule in SCHEDULES for m in (p, 2 * p, 4 * p)}


@pytest.mark.parametrize("world_name", ["world2", "world4"])
def test_every_schedule_matches_single_process_training(world_name, request):
    results = request.getfixturevalue(world_name).run(_parity_grid)
    for rank, grid in enumerate(results):
        for key, (grad_diff, weight_diff, loss_diff) in grid.items():
            assert grad_diff <= 1e-5, (rank, key, grad_diff)
            assert weight_diff <= 1e-5, (rank, key, weight_diff)
            assert loss_diff <= 1e-5, (rank, key, loss_diff)
