"""FSDP mixed precision: bf16 compute with fp32 master shards tracks the fp32 run's loss within
2% over 20 steps; collectives run in the policy's dtypes; buffers follow buffer_dtype and come
back in their own dtype in the state dict; ShardedGradScaler works on the shards."""

import pytest
import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit.distributed import CommCounter
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel.mixed_precision import MixedPrecisionPolicy
from shardkit.testing import world_fixture
from tests.nn.fsdp_common import build_gpt, make_optimizer, train_step, wrap_gpt

STEPS = 20


world2 = world_fixture(2)


def _global_loss(loss: torch.Tensor) -> float:
    t = torch.tensor([float(loss)])
    skdist.all_reduce(t)
    return t.item() / skdist.get_world_size()


def _loss_curve(**fsdp_kwargs):
    model = wrap_gpt(build_gpt(), **fsdp_kwargs)
    optim = make_optimizer(model)
    losses = [_global_loss(train_step(model, optim, step)[0]) for step in range(STEPS)]
    return model, losses


def _bf16_tracks_fp32():
    _, fp32 = _loss_curve()
    model, bf16 = _loss_curve(compute_dtype=torch.bfloat16)
    _, bf16_fp32_rs = _loss_curve(mixed_precision=True, compute_dtype=torch.bfloat16,
                                  fp32_reduce_scatter=True)
    with CommCounter() as comm:
        train_step(model, make_optimizer(model), STEPS)
    dtypes = {(r.op, r.dtype) for r in comm.calls}
    master = {p.dtype for p in model.parameters()}
    rs_model = wrap_gpt(build_gpt(), mixed_precision=True, compute_dtype=torch.bfloat16,
                        fp32_reduce_scatter=True)
    with CommCounter() as rs_comm:
        train_step(rs_model, make_optimizer(rs_model), 0)
    rs_dtypes = {(r.op, r.dtype) for r in rs_comm.calls}
    return {"fp32": fp32, "bf16": bf16, "bf16_fp32_rs": bf16_fp32_rs, "dtypes": dtypes,
            "rs_dtypes": rs_dtypes, "master": master}


def test_bf16_tracks_fp32(world2):
    for r in world2.run(_bf16_tracks_fp32):
        for curve in (r["bf16"], r["bf16_fp32_rs"]):
            worst = max(abs(a - b) / b for a, b in zip(curve, r["fp32"]))
            assert worst <= 0.02, (worst, curve, r["fp32"])
        assert r["fp32"][-1] < r["fp32"][0]  # it trains
        assert r["master"] == {torch.float32}
        # the default transport over gloo: counted as the all-gather / reduce-scatter asked
        # for, in the dtypes the policy asks for
        gather = {("all_gather", torch.bfloat16)}
        assert r["dtypes"] == gather | {("reduce_scatter", torch.bfloat16)}
        assert r["rs_dtypes"] == gather | {("reduce_scatter", torch.float32)}


class ScaledLinear(nn.Module):
    """A Linear times a registered floating buffer (to check buffer_dtype)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("scale", torch.full((6,), 0.5))

    def forward(self, x):
        return self.lin(x) * self.scale


def _buffers_and_scaler():
    from shardkit.optim.grad_scaler import ShardedGradScaler

    torch.manual_seed(0)
    model = FSDP(ScaledLinear(), compute_dtype=torch.bfloat16, buffer_dtype=torch.float32)
    default_buffers = FSDP(ScaledLinear(), compute_dtype=torch.bfloat16)
    out = {"buffer_dtype": model.module.scale.dtype,
           "default_buffer_dtype": default_buffers.module.scale.dtype,
           "state_dict_buffer_dtype": default_buffers.state_dict()["scale"].dtype,
           "local_buffer_dtype": default_buffers.local_state_dict()["scale"].dtype,
           "buffer_after_local": default_buffers.module.scale.dtype}
    # a local checkpoint reloads into a mixed-precision unit (buffer cast back on copy)
    default_buffers.load_local_state_dict(default_buffers.local_state_dict())
    out["buffer_after_load_local"] = default_buffers.module.scale.dtype
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0 ** 8)
    x = torch.randn(4, 6)
    before = [p.detach().clone() for p in model.parameters()]
    poisoned = x.clone()
    if skdist.get_rank() == 1:
        poisoned[0, 0] = float("inf")
    scaler.scale(model(poisoned).float().pow(2).mean()).backward()
    scaler.step(optim)
    scaler.update()
    out["skipped_everywhere"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    out["scale_after_inf"] = scaler.get_scale()
    optim.zero_grad()
    scaler.scale(model(x).float().pow(2).mean()).backward()
    scaler.step(optim)
    scaler.update()
    out["stepped"] = not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return out


def test_buffers_and_sharded_grad_scaler(world2):
    for r in world2.run(_buffers_and_scaler):
        assert r["buffer_dtype"] == torch.float32
        assert r["default_buffer_dtype"] == torch.bfloat16
        assert r["state_dict_buffer_dtype"] == torch.float32
        # local checkpoints keep buffers in their own dtype too (FairScale's), so that
        # consolidate_shard_weights gives what state_dict() gives; the unit keeps computing in bf16
        assert r["local_buffer_dtype"] == torch.float32, r
        assert r["buffer_after_local"] == r["buffer_after_load_local"] == torch.bfloat16, r
        assert r["skipped_everywhere"] and r["scale_after_inf"] == 2.0 ** 7, r
        assert r["stepped"], r


def test_policy_resolution():
    from shardkit.nn.data_parallel.mixed_precision import resolve_mixed_precision

    assert resolve_mixed_precision(False, None, None, False) == MixedPrecisionPolicy()
    assert resolve_mixed_precision(True, None, None, False).param_dtype == torch.float16
    policy = resolve_mixed_precision(True, torch.bfloat16, None, True)
    assert policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert policy.buffer_cast_dtype() == torch.bfloat16
    with pytest.raises(ValueError, match="compute_dtype=torch.int8"):
        resolve_mixed_precision(True, torch.int8, None, False)
    with pytest.raises(ValueError, match="not both"):
        resolve_mixed_precision(MixedPrecisionPolicy(torch.bfloat16), torch.float16, None, False)


class _PositionalNet(nn.Module):
    """A floating buffer added to activations between two Linears of one unit."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 4)
        self.register_buffer("pos", torch.randn(8))

    def forward(self, x):
        return self.l2(self.l1(x) + self.pos)


class _NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.l1(x))


def _bf16_model_under_torch_policy(which: str) -> dict:
    """A model in bf16 (buffers too) under torch's MixedPrecision(param_dtype=bf16,
    reduce_dtype=bf16), buffer_dtype left None: torch leaves the buffers as they are (and
    shardkit takes the call as torch's, cpu_offload=None included)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    rank, out = skdist.get_rank(), {}
    for cls in (_PositionalNet, _NormNet):
        module = cls().to(torch.bfloat16)
        model = TorchFSDP(module, mixed_precision=policy, cpu_offload=None,
                          device_id=torch.device("cpu")) \
            if which == "torch" else FSDP(module, mixed_precision=policy, cpu_offload=None)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = model(x.to(torch.bfloat16)).float().pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        buffers = {n.replace("_fsdp_wrapped_module.", ""): b.dtype
                   for n, b in model.named_buffers()}
        out[cls.__name__] = {"losses": losses, "buffers": buffers,
                             "state_dict": {k: v.dtype for k, v in model.state_dict().items()}}
    return out


def test_torch_policy_leaves_buffers_in_their_own_dtype_as_torch(world2):
    # Regression: buffer_dtype=None of torch's MixedPrecision was read as fp32, so a bf16
    # model's buffers were cast up: its BatchNorm was refused ("buffer_dtype=torch.float32")
    # and a buffer added to activations made the next Linear fail (Float and BFloat16)
    theirs = world2.run(_bf16_model_under_torch_policy, "torch")
    ours = world2.run(_bf16_model_under_torch_policy, "shardkit")
    for mine, torch_run in zip(ours, theirs):
        for net, got in mine.items():
            want = torch_run[net]
            assert got["buffers"] == want["buffers"], (net, got, want)
            assert got["state_dict"] == want["state_dict"], (net, got, want)
            # the second step differs only by the rounding of the bf16 gradient reduction
            assert got["losses"] == pytest.approx(want["losses"], rel=2e-3), (net, got, want)
    assert ours[0]["_NormNet"]["buffers"]["bn.running_mean"] == torch.bfloat16


def test_compute_dtype_torch_policy_and_cpu_offload_resolution():
    from torch.distributed.fsdp import CPUOffload, MixedPrecision

    from shardkit.nn.data_parallel.fsdp_arguments import resolve_cpu_offload
    from shardkit.nn.data_parallel.mixed_precision import resolve_mixed_precision

    # torch FSDP1's default cpu_offload=None (was "must be True or False")
    assert resolve_cpu_offload(False, None) is False and resolve_cpu_offload(True, None) is True
    assert resolve_cpu_offload(False, CPUOffload(offload_params=True)) is True

    # an explicit fp64 compute dtype is honoured (it was silently dropped: fp32 compute)
    assert resolve_mixed_precision(False, torch.float64, None, False).param_dtype == \
        torch.float64
    assert not resolve_mixed_precision(False, torch.float32, None, False).enabled
    with pytest.raises(ValueError, match=r"FullyShardedDataParallel\(buffer_dtype=torch.int8"):
        resolve_mixed_precision(False, None, torch.int8, False)
    kept = resolve_mixed_precision(MixedPrecision(param_dtype=torch.bfloat16), None, None, False)
    assert kept.buffer_cast_dtype() is None and kept.param_dtype == torch.bfloat16
    cast = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.float16)
    assert resolve_mixed_precision(cast, None, None, False).buffer_cast_dtype() == torch.float16
    with pytest.raises(ValueError, match="keep_buffer_dtypes=True"):
        MixedPrecisionPolicy(buffer_dtype=torch.float32, keep_buffer_dtypes=True)


def _forward_inside_summon(kwargs: dict) -> list:
    module = _NormNet()
    model = FSDP(module, **kwargs)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(skdist.get_rank()))
    model(x).float().pow(2).mean().backward()
    with torch.no_grad(), model.summon_full_params():
        inside = model(x)
        buffer_inside = model.module.bn.running_mean.dtype
    model(x)  # the buffers are back in the compute dtype afterwards
    return [inside.dtype, buffer_inside, model.module.bn.running_mean.dtype]


def test_forward_inside_summon_full_params_with_buffers_cast(world2):
    # Regression: BatchNorm statistics stayed in the compute dtype beside the summoned fp32
    # weight ("expected scalar type Float but found BFloat16"/"... Double")
    for dtype in (torch.bfloat16, torch.float64):
        for r in world2.run(_forward_inside_summon, {"compute_dtype": dtype}):
            assert r == [torch.float32, torch.float32, dtype]


def _torch_policy_bn_message() -> str:
    from torch.distributed.fsdp import MixedPrecision
    with pytest.raises(ValueError) as info:
        FSDP(_NormNet(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    return str(info.value)


def test_torch_policy_batchnorm_refusal_names_torchs_arguments(world2):
    message = world2.run(_torch_policy_bn_message)[0]
    assert "MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=None)" in message
    assert "auto_wrap_policy" in message
    assert "MixedPrecision(..., buffer_dtype=torch.bfloat16)" in message
