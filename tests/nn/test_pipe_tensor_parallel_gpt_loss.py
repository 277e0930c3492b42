"""``gpt_loss`` (the vocabulary-parallel GPT's loss, documented as a pipeline ``loss_fn``) in a
2-stage x 2-way tensor-parallel pipeline (world 4) on padded batches: micro-batches holding
different numbers of padding tokens (``ignore_index``) give one process's loss and gradients
on the whole batch, as ``F.cross_entropy`` does there.

Before: the schedules watched ``gpt_loss`` as an undeclared masked mean and failed every such
step on every rank ("expected a division by 11 ... Pass loss_denominator=..."), though
``gpt_loss`` divides by the non-ignored tokens exactly as ``F.cross_entropy`` does.
"""

import functools

import pytest
import torch

from shardkit.models import GPT, GPTConfig
from shardkit.nn import model_parallel as mp
from shardkit.nn import pipe
from shardkit.nn.model_parallel.full_state import load_full_model_state_dict, split_specs
from shardkit.nn.model_parallel.gpt import TensorParallelGPT, from_reference_state_dict, gpt_loss
from shardkit.nn.model_parallel.utils import shard_of
from shardkit.testing import world_fixture

CFG = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=16, seq_len=8)
world4 = world_fixture(4, timeout=120)


def _padded_batch():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len), generator=g)
    target = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len), generator=g)
    target[0, 3:] = -100  # micro-batch 0 counts 11 tokens, micro-batch 1 counts 16
    return idx, target


def _step_against_one_process(schedule_name: str, as_partial: bool) -> dict:
    mp.initialize_model_parallel(2, pipeline_length=2)
    try:
        reference = GPT(CFG, seed=0)
        model = TensorParallelGPT(CFG)
        load_full_model_state_dict(model, from_reference_state_dict(reference.state_dict(), CFG))
        parts = pipe.split_sequential(model, [2, 2])
        stage_index = mp.get_pipeline_parallel_rank()
        stage = pipe.PipelineStage(parts[stage_index], stage_index, 2,
                                   group=mp.get_pipeline_parallel_group())
        loss_fn = functools.partial(gpt_loss, ignore_index=-100) if as_partial else gpt_loss
        schedule = getattr(pipe, schedule_name)(stage, chunks=2, loss_fn=loss_fn)
        idx, target = _padded_batch()
        try:
            loss = schedule.step(idx, target=target)
        except ValueError as error:
            return {"error": str(error)}
        expected = reference.loss(idx, target)
        expected.backward()
        return {"loss": None if loss is None else loss.item(), "expected": expected.item(),
                "grads_off": _grads_off(parts[stage_index], reference)}
    finally:
        mp.destroy_model_parallel()


def _grads_off(stage_module, reference) -> float:
    """Largest |this rank's gradient - its slice of one process's|."""
    expected = from_reference_state_dict({name: p.grad for name, p in
                                          reference.named_parameters()}, CFG)
    specs = split_specs(stage_module)
    worst = 0.0
    for name, param in stage_module.named_parameters():
        want = expected[name]
        if name in specs:
            want = shard_of(want, mp.get_model_parallel_rank(), 2, *specs[name])
        worst = max(worst, (param.grad - want).abs().max().item())
    return worst


@pytest.mark.parametrize("schedule_name,as_partial", [("Schedule1F1B", False),
                                                      ("ScheduleZeroBubble", True)])
def test_gpt_loss_on_unequally_padded_micro_batches_is_one_process_loss(world4, schedule_name,
                                                                        as_partial):
    results = world4.run(_step_against_one_process, schedule_name, as_partial)
    for rank, result in enumerate(results):
        assert "error" not in result, (rank, result)
        assert result["grads_off"] <= 1e-6, (rank, result)
        if result["loss"] is not None:  # the ranks running the last stage
            assert abs(result["loss"] - result["expected"]) <= 1e-5, (rank, result)
    assert sum(r["loss"] is not None for r in results) == 2
