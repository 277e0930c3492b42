"""OSS's ownership plan: buckets in forward order, little padding, balanced ranks (no world)."""

import pytest
import torch.nn as nn

from shardkit.models import GPT, MLP, reference_gpt_config
from shardkit.optim.param_sync import build_buckets
from shardkit.optim.partition import MAX_PADDING_FRACTION, plan_ownership


def _params(model: nn.Module):
    return [p for p in model.parameters() if p.requires_grad]


def _padding(plan, world_size):
    buckets = [b for per_kind in build_buckets(plan, 0) for b in per_kind]
    return sum(b.padding_numel for b in buckets) / sum(b.buffer.numel() for b in buckets)


@pytest.mark.parametrize("world_size", [2, 4])
def test_mlp_buckets_follow_the_layers_in_order(world_size):
    params = _params(MLP(1024, 16, seed=0))
    plan = plan_ownership([params], world_size)
    order = [plan.bucket_of[id(p)] for p in params]
    assert order == sorted(order), "buckets must hold consecutive parameters"
    assert plan.num_buckets >= 4  # several buckets: the next forward can start on the first
    assert _padding(plan, world_size) <= MAX_PADDING_FRACTION
    loads = plan.partition.numel_per_rank()
    assert max(loads) <= 1.03 * min(loads)


def test_gpt_first_bucket_is_the_first_layers_at_two_ranks():
    params = _params(GPT(reference_gpt_config(), 0))
    plan = plan_ownership([params], 2)
    order = [plan.bucket_of[id(p)] for p in params]
    assert order == sorted(order)
    assert order[0] == 0 and plan.num_buckets >= 3
    assert _padding(plan, 2) <= MAX_PADDING_FRACTION
    loads = plan.partition.numel_per_rank()
    assert max(loads) <= 1.03 * min(loads)


def test_falls_back_to_largest_first_when_consecutive_buckets_would_pad():
    # two huge parameters at both ends and 4 ranks: consecutive buckets cannot split evenly
    params = _params(GPT(reference_gpt_config(), 0))
    plan = plan_ownership([params], 4)
    assert _padding(plan, 4) <= 0.05
    assert sum(plan.partition.numel_per_rank()) == sum(p.numel() for p in params)


def test_plan_is_deterministic_and_covers_every_parameter():
    params = _params(MLP(256, 7, seed=1))
    a, b = plan_ownership([params], 3), plan_ownership([params], 3)
    assert [a.partition.owner(p) for p in params] == [b.partition.owner(p) for p in params]
    assert set(a.bucket_of) == {id(p) for p in params}
