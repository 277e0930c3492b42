"""Review of the per-step fused-kernel choice and FusedAdamW's shared-memory check (one world
of 1 gloo rank; FusedAdamW's test runs in this process).

Regressions:

- at world size 1, ``OSS._settle_fused_choice`` read the dtypes from the sync buckets, but a
  world of one lays no bucket out (nothing to synchronise) and never lays them out again: a
  model cast to 16 bits (or 64) after OSS was built kept torch's fused kernel, which steps
  16-bit parameters otherwise than the caller's optimizer (0.42 off ``torch.optim.SGD`` in
  fp16 after three steps; inf for Adam). The stepped parameters' dtypes are read at world 1
  again, as before the buckets were used;
- ``FusedAdamW`` over a sparse parameter failed at construction with torch's
  ``NotImplementedError: Cannot access storage of SparseTensorImpl`` in the shared-memory
  check; such a parameter shares no dense storage: it is built as before and its sparse
  gradient refused by name at the step (as DeepSpeed-style ``FusedAdam`` already did, its
  gradient check running before the shared-memory one).
"""

import copy

import pytest
import torch
import torch.nn as nn

from shardkit.ops.adam import FusedAdam
from shardkit.optim import OSS, FusedAdamW
from shardkit.testing import world_fixture

world1 = world_fixture(1, timeout=120)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _seeded_grads(model, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _cast(model: nn.Module, how: str) -> None:
    if how == "half":
        model.half()
    elif how == "bfloat16":
        model.bfloat16()
    else:  # "data_double": the storage replaced by hand
        for p in model.parameters():
            p.data = p.data.double()


def _cast_after_construction(optim_class, how: str) -> dict:
    """OSS and torch's default loop over one model, cast after OSS was built, stepped 3 times."""
    model = _mlp()
    reference = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=optim_class, lr=0.1)
    oracle = optim_class(reference.parameters(), lr=0.1, foreach=False)
    chose_fused = opt.fused
    _cast(model, how)
    _cast(reference, how)
    for step in range(3):
        _seeded_grads(model, step)
        _seeded_grads(reference, step)
        opt.step()
        oracle.step()
    difference = max((p.double() - q.double()).abs().max().item()
                     for p, q in zip(model.parameters(), reference.parameters()))
    return {"chose_fused": chose_fused, "fused_after": opt.fused, "difference": difference}


def _every_cast_at_world_one() -> dict:
    cases = [(torch.optim.SGD, "half"), (torch.optim.Adam, "bfloat16"),
             (torch.optim.AdamW, "data_double")]
    return {f"{cls.__name__}/{how}": _cast_after_construction(cls, how) for cls, how in cases}


def test_a_cast_after_construction_turns_the_fused_kernel_off_at_world_one(world1):
    (results,) = world1.run(_every_cast_at_world_one)
    for case, got in results.items():
        assert got["chose_fused"], (case, got)
        assert got["fused_after"] is False, (case, got)
        assert got["difference"] == 0.0, (case, got)


@pytest.mark.parametrize("cls", [FusedAdamW, FusedAdam])
def test_a_sparse_parameter_is_refused_by_its_gradient_not_its_storage(cls):
    param = nn.Parameter(torch.randn(4, 4).to_sparse())
    opt = cls([param, nn.Parameter(torch.randn(3))], lr=0.1)
    param.grad = torch.randn(4, 4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradient"):
        opt.step()


def test_strided_views_at_a_storage_offset_are_told_apart_exactly():
    """Column blocks of the lower rows of one matrix (views at a storage offset): disjoint
    ones are accepted, overlapping ones refused (the scratch index spans only their part)."""
    whole = torch.randn(8, 10)

    def view(columns: slice) -> nn.Parameter:
        p = nn.Parameter(whole[2:, columns])
        p.data = whole[2:, columns]  # share the matrix's storage
        return p

    FusedAdamW([view(slice(1, 5)), view(slice(5, 9))])
    with pytest.raises(ValueError, match="share memory"):
        FusedAdamW([view(slice(1, 5)), view(slice(4, 8))])
