"""FSDP with optimizers that read whole tensors, and torch FSDP1's keep_low_precision_grads.

- ``torch.optim.Adafactor`` over FSDP's row shards averaged its column statistic over this
  rank's rows only and scaled each step by the shard's norm, and ``torch.optim.Muon``
  orthogonalized each rank's rows instead of the matrix: weights 6e-3 / 1.5e-2 off one process
  after three steps of lr 1e-2 at world size 2, with no error. Both are now refused at the first
  ``step()`` on every rank, before anything changes (also another library's optimizer of the
  same name, such as transformers' Adafactor); at world size 1 and under ``NO_SHARD`` (whole
  parameters on every rank) Adafactor steps as in one process.
- ``MixedPrecision(keep_low_precision_grads=True)`` was refused even without a ``param_dtype``
  (where torch leaves the gradients as they are); with one, the refusal now says why (torch's
  Adam / AdamW cannot step fp32 parameters with low-precision gradients) and what to use.

From a review:

False refusals of FSDP's whole-tensor optimizer check, and of keep_low_precision_grads.

- ``Adafactor(model.parameters())`` over a model whose FSDP unit is frozen (a frozen backbone,
  a trainable head outside it) was refused at ``step()``, although Adafactor never steps a
  parameter without a gradient; likewise an Adafactor or Muon over a parameter of one row (a
  ``(1, d)`` token or position embedding), which the first rank holds whole and the others as
  zero padding. Both now step as one process does; a trainable parameter cut into row shards
  is still refused.
- ``MixedPrecision(param_dtype=torch.float32, keep_low_precision_grads=True)`` was refused with
  a message about fp32 gradients Adam cannot step; with fp32 compute there is nothing lower to
  keep, as in torch, so it is accepted. A 16-bit ``param_dtype`` is still refused.

One world of 4; worlds of 1 and 2 are its sub-groups.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

from tests.nn.fsdp_common import first_ranks_groups, TwoBlockNet

world4 = world_fixture(4)

STEPS = 3


def _batch(i: int) -> tuple:
    g = torch.Generator().manual_seed(650 + i)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _wrapped(reference, group, **kwargs):
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    model = copy.deepcopy(reference)
    for i in range(len(model.blocks)):
        model.blocks[i] = FSDP(model.blocks[i], process_group=group, **kwargs)
    return FSDP(model, process_group=group, **kwargs)


def _full_params(model) -> dict:
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    with FSDP.summon_full_params(model):
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for n, p in model.named_parameters()}


def _optimizer(name: str, params):
    params = list(params)
    if name == "other Adafactor":  # another library's, by name (transformers', fairseq's)
        return type("Adafactor", (torch.optim.SGD,), {})(params, lr=1e-2)
    if name == "FusedLamb":  # a LAMB (trust ratio per parameter), by name (DeepSpeed's, apex's)
        return type("FusedLamb", (torch.optim.SGD,), {})(params, lr=1e-2)
    if name == "Muon":
        return torch.optim.Muon([p for p in params if p.dim() == 2], lr=1e-2)
    return getattr(torch.optim, name)(params, lr=1e-2)


def _train_against_one_process(name: str, group, **kwargs):
    """``STEPS`` steps of optimizer ``name`` on one process and on FSDP over ``group``: the
    error raised by FSDP's step (None), whether FSDP's shards and optimizer state were left
    untouched, and the largest weight gap from one process."""
    torch.manual_seed(0)
    reference = TwoBlockNet()
    model = _wrapped(reference, group, **kwargs)
    optims = [_optimizer(name, m.parameters()) for m in (reference, model)]
    rank, per = skdist.get_rank(group), 8 // skdist.get_world_size(group)
    before = [p.detach().clone() for p in model.parameters()]
    error = None
    for step in range(STEPS):
        x, y = _batch(step)
        F.cross_entropy(reference(x), y).backward()
        optims[0].step()
        optims[0].zero_grad()
        mine = slice(rank * per, (rank + 1) * per)
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        try:
            optims[1].step()
        except RuntimeError as e:
            error = str(e)
            break
        optims[1].zero_grad()
    untouched = all(torch.equal(b, p) for b, p in zip(before, model.parameters())) \
        and len(optims[1].state) == 0
    full = _full_params(model)
    gap = max((full[n] - p).abs().max().item() for n, p in reference.named_parameters())
    return error, untouched, gap


def _whole_tensor_optimizers() -> dict:
    from shardkit.nn.data_parallel import ShardingStrategy
    out = {}
    for size, group in first_ranks_groups().items():
        if skdist.get_rank() >= size:
            continue
        for name in ("Adafactor", "Muon"):
            out[(name, size)] = _train_against_one_process(name, group)
        if size == 2:
            out[("Adafactor", "NO_SHARD")] = _train_against_one_process(
                "Adafactor", group, sharding_strategy=ShardingStrategy.NO_SHARD)
            out[("Adam", size)] = _train_against_one_process("Adam", group)
            out[("other Adafactor", size)] = _train_against_one_process("other Adafactor", group)
            out[("FusedLamb", size)] = _train_against_one_process("FusedLamb", group)
    return out


def test_whole_tensor_optimizers_over_row_shards_are_refused(world4):
    """Regression: Adafactor and Muon over FSDP's row shards trained to other weights than one
    process (6e-3 and 1.5e-2 after three steps at world size 2), silently. Now every rank
    raises at the first step, naming the optimizer, the parameter and what to use, with the
    shards and the optimizer state untouched (also for an optimizer of another library named
    Adafactor); world size 1 and NO_SHARD match one process."""
    for rank, out in enumerate(world4.run(_whole_tensor_optimizers)):
        for name in ("Adafactor", "Muon"):
            if rank == 0:
                error, _, gap = out[(name, 1)]
                assert error is None and gap < 1e-6, (name, out[(name, 1)])
            for size in [s for s in (2, 4) if rank < s]:
                error, untouched, _ = out[(name, size)]
                assert error is not None, (rank, name, size)
                assert f"{name}.step()" in error and "Linear.weight" in error, error
                assert f"row shards over {size} ranks" in error and "NO_SHARD" in error, error
                assert untouched, (rank, name, size)
        if rank < 2:
            assert out[("Adafactor", "NO_SHARD")][0] is None, out
            assert out[("Adafactor", "NO_SHARD")][2] < 1e-6, out
            assert out[("Adam", 2)][0] is None and out[("Adam", 2)][2] < 1e-6, out
            error, untouched, _ = out[("other Adafactor", 2)]
            assert "Adafactor.step()" in error and "row shards over 2 ranks" in error, error
            assert untouched, out
            error, untouched, _ = out[("FusedLamb", 2)]
            assert "FusedLamb.step()" in error and "trust ratio" in error, error
            assert untouched, out


def test_keep_low_precision_grads():
    """Regression: ``MixedPrecision(keep_low_precision_grads=True)`` was refused even without
    a ``param_dtype`` (torch FSDP1 then keeps the gradients in the parameters' dtype: nothing
    to keep low), and with one the message gave no reason nor alternative. Now the former is
    accepted as torch does, and the latter names what torch would do, why torch's Adam cannot
    step it, and what to use instead. Local: the policy is resolved before any collective."""
    from torch.distributed.fsdp import MixedPrecision
    from shardkit.nn.data_parallel.mixed_precision import resolve_mixed_precision

    policy = resolve_mixed_precision(
        MixedPrecision(reduce_dtype=torch.bfloat16, keep_low_precision_grads=True),
        None, None, False)
    assert policy.param_dtype is None and policy.reduce_dtype == torch.bfloat16
    with pytest.raises(ValueError) as caught:
        resolve_mixed_precision(
            MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True),
            None, None, False)
    message = str(caught.value)
    assert "keep_low_precision_grads=True" in message and "torch.bfloat16" in message
    assert "Adam" in message and "keep_low_precision_grads=False" in message
    assert "cast the model to torch.bfloat16" in message


world2 = world_fixture(2)

STEPS_rev = 3


class _EmbeddedNet(nn.Module):
    """A body, a one-row learned offset (``(1, 6)``, as a position embedding) and a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
        self.offset = nn.Parameter(torch.randn(1, 6) * 0.1)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.body(x) + self.offset)


def _batch_rev(i: int) -> tuple:
    g = torch.Generator().manual_seed(6500 + i)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _train(model, optimizers) -> str:
    """``STEPS_rev`` steps on the whole batch; the error a ``step()`` raised, else ''."""
    for step in range(STEPS_rev):
        x, y = _batch_rev(step)
        F.cross_entropy(model(x), y).backward()
        try:
            for optimizer in optimizers:
                optimizer.step()
        except RuntimeError as e:
            return str(e)
        for optimizer in optimizers:
            optimizer.zero_grad()
    return ""


def _gap_from_one_process(wrap, make_optimizers, frozen_body: bool = False) -> tuple:
    """(error of the FSDP run, largest weight gap from one process) for the model ``wrap``
    returns and the optimizers ``make_optimizers(model)`` builds (over a frozen body when
    ``frozen_body``)."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    reference = _EmbeddedNet()
    if frozen_body:
        reference.body.requires_grad_(False)
    model = wrap(copy.deepcopy(reference))
    assert _train(reference, make_optimizers(reference)) == ""
    error = _train(model, make_optimizers(model))
    with FSDP.summon_full_params(model):
        full = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for n, p in model.named_parameters()}
    return error, max((full[n] - p).abs().max().item() for n, p in reference.named_parameters())


def _fsdp_body(model):
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    model.body = FSDP(model.body)
    return model


def _by_name(model, keep) -> list:
    return [p for n, p in model.named_parameters() if keep(n)]


def _one_row_optimizers(name: str):
    """``name`` over the one-row offset, Adam over the rest."""
    return lambda m: [getattr(torch.optim, name)(_by_name(m, lambda n: "offset" in n), lr=1e-2),
                      torch.optim.Adam(_by_name(m, lambda n: "offset" not in n), lr=1e-2)]


def _cases() -> dict:
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    out = {"frozen FSDP body, Adafactor over all": _gap_from_one_process(
        _fsdp_body, lambda m: [torch.optim.Adafactor(m.parameters(), lr=1e-2)],
        frozen_body=True)}
    for name in ("Adafactor", "Muon"):
        out[f"{name} over a one-row parameter"] = _gap_from_one_process(
            FSDP, _one_row_optimizers(name))
    model = _EmbeddedNet()
    model.body.requires_grad_(False)
    model.body[0].bias.requires_grad_(True)
    model = _fsdp_body(model)
    out["trainable sharded bias"] = _train(model, [torch.optim.Adafactor(model.parameters(),
                                                                         lr=1e-2)])
    return out


def test_whole_tensor_optimizers_not_refused_over_what_they_step_whole(world2):
    """Regression: an Adafactor over a frozen FSDP unit (it steps only the trainable head
    outside it) and an Adafactor or Muon over a one-row parameter were refused at ``step()``
    ("cut into row shards over 2 ranks"), although each steps as one process does. Now they
    match one process; a trainable parameter cut into row shards is still refused."""
    for out in world2.run(_cases):
        for case in ("frozen FSDP body, Adafactor over all", "Adafactor over a one-row parameter",
                     "Muon over a one-row parameter"):
            error, gap = out[case]
            assert error == "" and gap < 1e-6, (case, out[case])
        error = out["trainable sharded bias"]
        assert "Adafactor.step() over Linear.bias" in error, error
        assert "row shards over 2 ranks" in error, error


def test_keep_low_precision_grads_with_fp32_compute():
    """Regression: ``MixedPrecision(param_dtype=torch.float32, keep_low_precision_grads=True)``
    was refused ("would leave each fp32 parameter shard's .grad in torch.float32, which torch's
    Adam and AdamW refuse"); fp32 compute has no lower precision to keep, so torch changes
    nothing and neither does shardkit now. A bf16 ``param_dtype`` is still refused."""
    from torch.distributed.fsdp import MixedPrecision
    from shardkit.nn.data_parallel.mixed_precision import resolve_mixed_precision

    policy = resolve_mixed_precision(
        MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.bfloat16,
                       keep_low_precision_grads=True), None, None, False)
    assert policy.param_dtype == torch.float32 and policy.reduce_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="keep_low_precision_grads=True"):
        resolve_mixed_precision(MixedPrecision(param_dtype=torch.bfloat16,
                                               keep_low_precision_grads=True), None, None, False)
