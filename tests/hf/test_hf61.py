"""Reentrant activation checkpoints reading one FSDP unit more than once in a backward: HF's
``gradient_checkpointing_enable(use_reentrant=True)`` on a LoRA-style model (frozen base,
adapters added by hand, ``enable_input_require_grads()``) wrapped as one unit, and a unit
whose forward is two reentrant checkpoints. Each checkpoint is recomputed in a backward of its
own; the first one's backward reduced and freed the unit, and the next recomputation read the
shards (a shape error); also with gradient accumulation (``no_sync``). Against one process
on both ranks of a world of 2, after every AdamW step (fp32, each rank its half of the global
batch, the oracle averaging the two ranks' losses).
"""

import contextlib

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardkit import distributed
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.testing import world_fixture
from tests.hf.hf_common import VOCAB, SEQ, eager_model, transformers as T

STEPS, ROWS, TOL = 3, 4, 2e-5
world2 = world_fixture(2)


class _LoRA(nn.Module):
    """``base(x) + x A^T B^T``, both adapters random so that every step moves them."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def _qwen2_lora_reentrant():
    """A tied 2-layer Qwen2, frozen, LoRA on q_proj and down_proj, HF's reentrant
    checkpointing with ``enable_input_require_grads()`` (what a PEFT script does)."""
    cfg = T.Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=SEQ, tie_word_embeddings=True,
                        bos_token_id=0, eos_token_id=0, pad_token_id=None)
    model = eager_model(T.Qwen2ForCausalLM, cfg, seed=0)
    torch.manual_seed(7)
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = _LoRA(layer.self_attn.q_proj)
        layer.mlp.down_proj = _LoRA(layer.mlp.down_proj)
    model.enable_input_require_grads()
    model.gradient_checkpointing_enable({"use_reentrant": True})
    return model


class _TwoCheckpoints(nn.Module):
    """A forward that uses its parameters only inside two reentrant checkpoints."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(6, 10), nn.Linear(10, 3)

    def forward(self, x):
        h = checkpoint(self.first, x, use_reentrant=True)
        return checkpoint(self.second, h, use_reentrant=True)


def _qwen2_batch(step):
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def _two_checkpoints_batch(step):
    g = torch.Generator().manual_seed(50 + step)
    return {"x": torch.randn(ROWS, 6, generator=g).requires_grad_(True),
            "target": torch.randn(ROWS, 3, generator=g)}


def _loss(model, batch):
    if "x" in batch:
        return nn.functional.mse_loss(model(batch["x"]), batch["target"])
    return model(**batch).loss


def _rows(batch, rank, world):
    per = ROWS // world
    return {k: v[rank * per:(rank + 1) * per].detach().requires_grad_(v.requires_grad)
            for k, v in batch.items()}


def _adamw(params):
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-2, eps=1e-4)


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _max_diff(got, want):
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def _micro_batches(rows, accumulate):
    """``rows`` whole, or split in two micro-batches (gradient accumulation)."""
    if not accumulate:
        return [rows]
    half = ROWS // distributed.get_world_size() // 2
    return [{k: v[:half] for k, v in rows.items()}, {k: v[half:] for k, v in rows.items()}]


def _compare(build, batch_of, accumulate=False):
    """(per step: largest parameter difference, this rank's loss difference) of FSDP(one
    unit) against one process; with ``accumulate``, two micro-batches a step, the first's
    backward inside ``no_sync``."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    plain, net = build(), FSDP(build())
    plain_opt, opt = _adamw(plain.parameters()), _adamw(net.parameters())
    out = []
    for step in range(STEPS):
        batch = batch_of(step)
        losses = [[_loss(plain, m) for m in _micro_batches(_rows(batch, r, world), accumulate)]
                  for r in range(world)]
        (sum(sum(per) for per in losses) / world).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        micro = _micro_batches(_rows(batch, rank, world), accumulate)
        loss_diff = 0.0
        for i, rows in enumerate(micro):
            sync = i == len(micro) - 1
            with contextlib.nullcontext() if sync else net.no_sync():
                loss = _loss(net, rows)
                loss.backward()
            loss_diff = max(loss_diff, abs(float(loss - losses[rank][i])))
        opt.step()
        opt.zero_grad()
        out.append((_max_diff(_state(net), _state(plain)), loss_diff))
    return out


CASES = {"qwen2_lora": (_qwen2_lora_reentrant, _qwen2_batch, False),
         "two_checkpoints": (_TwoCheckpoints, _two_checkpoints_batch, False),
         "two_checkpoints_no_sync": (_TwoCheckpoints, _two_checkpoints_batch, True)}


def _all():
    out = {}
    for name, (build, batch_of, accumulate) in CASES.items():
        try:
            out[name] = _compare(build, batch_of, accumulate)
        except Exception as error:  # noqa: BLE001 - reported per case
            out[name] = f"{type(error).__name__}: {error}"
    return out


@pytest.fixture(scope="module")
def results(world2):
    return world2.run(_all)


@pytest.mark.parametrize("name", list(CASES))
def test_unit_recomputed_by_several_reentrant_checkpoints_trains_like_one_process(
        results, name):
    for rank, per_rank in enumerate(results):
        steps = per_rank[name]
        assert not isinstance(steps, str), (rank, steps)
        assert max(d for d, _ in steps) <= TOL, (rank, steps)
        assert max(loss for _, loss in steps) <= TOL, (rank, steps)
