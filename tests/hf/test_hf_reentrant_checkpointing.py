"""Reentrant activation checkpoints reading one FSDP unit more than once in a backward: HF's
``gradient_checkpointing_enable(use_reentrant=True)`` on a LoRA-style model (frozen base,
adapters added by hand, ``enable_input_require_grads()``) wrapped as one unit, and a unit
whose forward is two reentrant checkpoints. Each checkpoint is recomputed in a backward of its
own; the first one's backward reduced and freed the unit, and the next recomputation read the
shards (a shape error); also with gradient accumulation (``no_sync``). Against one process
on both ranks of a world of 2, after every AdamW step (fp32, each rank its half of the global
batch, the oracle averaging the two ranks' losses).

review

Review of hunt 61's last commits.

FSDP's re-gather for later reentrant recomputations (a forward pre-hook on the unit's modules,
installed once a reentrant checkpoint's backward reduced and freed the unit) also gathered for
a module called in a user's gradient hook during backward, under ``no_grad``: an all-gather
inside the hook, which hangs when only one rank runs it (rank 0 logging a layer's output).
Only activation checkpoints' recomputations gather now; the recomputations themselves still
train as one process does. The optimizer kernels' shared-memory check lets views of one flat
buffer, side by side, through.
"""

import contextlib

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardkit import distributed
from shardkit.comm_counter import CommCounter
from shardkit.kernels.optim_step import adamw_step_many
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


class _TwoCheckpoints_rev(nn.Module):
    """A unit whose parameters are used only inside two reentrant checkpoints."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return checkpoint(self.second, checkpoint(self.first, x, use_reentrant=True),
                          use_reentrant=True)


def _batch(step: int, rank: int) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    return x[2 * rank:2 * rank + 2].clone().requires_grad_(True)


def _module_called_in_a_gradient_hook() -> dict:
    """Two steps of SGD (the first installs the re-gather hooks); in the second backward a
    gradient hook on the input runs the unit's first layer under no_grad. Returns the
    collectives the hook issued, and the largest gap to one process after the two steps."""
    rank = torch.distributed.get_rank()
    plain, net = _TwoCheckpoints_rev(), FSDP(_TwoCheckpoints_rev(), use_orig_params=True)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    in_hook = CommCounter()

    def log_first_layer(grad):
        with torch.no_grad(), in_hook:
            net.module.first(torch.zeros(1, 8))
        return grad

    for step in range(2):
        both = torch.cat([_batch(step, r).detach() for r in range(2)]).requires_grad_(True)
        plain(both).pow(2).mean().backward()
        plain_opt.step()
        plain_opt.zero_grad()
        x = _batch(step, rank)
        if step == 1:
            x.register_hook(log_first_layer)
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with FSDP.summon_full_params(net):
        gap = max(float((p - q).abs().max())
                  for p, q in zip(net.module.parameters(), plain.parameters()))
    return {"hook_calls": dict(in_hook.calls_by_op), "gap": gap}


def test_module_called_in_a_gradient_hook_issues_no_collective(world2):
    for rank, got in enumerate(world2.run(_module_called_in_a_gradient_hook)):
        assert got["hook_calls"] == {}, (rank, got)
        assert got["gap"] <= 1e-6, (rank, got)  # the recomputations still re-gather


def test_kernel_steps_views_of_one_flat_buffer_side_by_side():
    flat, grads = torch.randn(20), torch.randn(20)
    exp_avg, exp_avg_sq = torch.zeros(20), torch.zeros(20)
    cut = [slice(0, 8), slice(8, 20)]
    want = [flat[c].clone() for c in cut]
    for w, c in zip(want, cut):  # one tensor at a time: the reference
        adamw_step_many([w], [grads[c]], [torch.zeros_like(w)], [torch.zeros_like(w)],
                        steps=[1], lr=1e-2)
    adamw_step_many([flat[c] for c in cut], [grads[c] for c in cut],
                    [exp_avg[c] for c in cut], [exp_avg_sq[c] for c in cut], steps=[1, 1],
                    lr=1e-2, grad_scale=torch.tensor(1.0))
    assert torch.equal(flat, torch.cat(want))
