"""Bad input across the public API (DESIGN.md principle 8): a clear error naming the argument,
the value and what is valid, raised before any collective starts, on every rank alike, and the
world still works afterwards. Plain tests without a process group, then one world of 2 ranks
that runs a table of probes: each probe is one bad call; what it raised, the collectives
CommCounter saw during it, and one all-reduce after it come back per rank."""

import warnings

import pytest
import torch
import torch.nn as nn

import shardkit.distributed as skdist
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn import ShardedDataParallel as SDP
from shardkit.nn import model_parallel as mp
from shardkit.nn import pipe
from shardkit.optim import OSS, DynamicLossScaler
from shardkit.quantized_transport import QuantizedTransport
from shardkit.testing import world_fixture
from shardkit.transport import ProcessGroupTransport

world2 = world_fixture(2)

# ----------------------------------------------------------------------------- no process group

# label -> (the collective named in the error, the call)
_NO_GROUP_CALLS = {
    "all_reduce": ("all_reduce", lambda: skdist.all_reduce(torch.ones(2))),
    "broadcast": ("broadcast", lambda: skdist.broadcast(torch.ones(2), src=0)),
    "send": ("send", lambda: skdist.send(torch.ones(2), dst=1)),
    "barrier": ("barrier", lambda: skdist.barrier()),
    "all_gather_object": ("all_gather_object", lambda: skdist.all_gather_object(1)),
    "new_group": ("new_group", lambda: skdist.new_group([0])),
    "batch_isend_irecv": ("batch_isend_irecv(send)", lambda: skdist.batch_isend_irecv(
        [skdist.P2POp("send", torch.ones(2), 1)])),
    "ProcessGroupTransport": ("all_reduce", lambda: ProcessGroupTransport().all_reduce(
        torch.ones(2), None).wait()),
    "QuantizedTransport": ("all_gather_into_tensor", lambda: QuantizedTransport()
                           .all_gather_chunks([torch.ones(4)], [torch.ones(4)], None).wait()),
}


def _counted_all_reduce():
    with skdist.CommCounter():
        skdist.all_reduce(torch.ones(2))


@pytest.mark.parametrize("name", sorted(_NO_GROUP_CALLS))
def test_collectives_without_a_process_group_say_what_to_call(name):
    """Was torch's "Default process group has not been initialized" (a ValueError that names
    neither shardkit nor what to call)."""
    if skdist.is_initialized():
        pytest.skip("a process group exists in this test process")
    op, call = _NO_GROUP_CALLS[name]
    with pytest.raises(RuntimeError) as info:
        call()
    text = str(info.value)
    assert f"shardkit.distributed.{op} needs a process group" in text, text
    assert "init_distributed()" in text and "torchrun" in text, text


def test_counted_collective_without_a_process_group():
    if skdist.is_initialized():
        pytest.skip("a process group exists in this test process")
    with pytest.raises(RuntimeError, match="all_reduce needs a process group"):
        _counted_all_reduce()


def test_wrappers_without_a_process_group_say_what_to_call():
    if skdist.is_initialized():
        pytest.skip("a process group exists in this test process")
    model = nn.Linear(4, 4)
    for build, name in ((lambda: OSS(model.parameters(), lr=0.1), "OSS"),
                        (lambda: FSDP(nn.Linear(4, 4)), "FullyShardedDataParallel"),
                        (lambda: pipe.PipelineStage(model, 0, 2), "PipelineStage")):
        with pytest.raises(RuntimeError, match=f"{name} needs torch.distributed to be "
                                               f"initialised first.*init_distributed"):
            build()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        mp.ColumnParallelLinear(4, 4)


# ----------------------------------------------------------------------------- probes in a world


def _lin():
    torch.manual_seed(0)
    return nn.Linear(4, 4)


def _mlp(width):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 4))


def _lin_with_int_param():
    module = _lin()
    module.steps = nn.Parameter(torch.ones(2, dtype=torch.int64), requires_grad=False)
    return module


def _oss(module, **kwargs):
    return OSS(module.parameters(), lr=0.1, **kwargs)


def _sdp(module, **kwargs):
    return SDP(module, _oss(module), **kwargs)


def _with_tp2(fn):
    def run(_, rank):
        mp.initialize_model_parallel(2)
        try:
            return fn(rank)
        finally:
            mp.destroy_model_parallel()
    return run


def _step(module):
    module(torch.ones(2, 4)).sum().backward()


# name -> (setup(rank) or None, bad call(obj, rank), exception, fragments of the message,
# collectives allowed during the bad call). Setup runs outside the counter. Rank-dependent
# arguments ("ranks differ") must raise the same text on every rank.
_PROBES = {
    # shardkit.distributed: peers out of range made gloo kill both processes (SIGSEGV)
    "send(dst=9)": (None, lambda _, r: skdist.send(torch.ones(2), dst=9), ValueError,
                    ["send(dst=9)", "[0, 2)"], 0),
    "recv(src=-1)": (None, lambda _, r: skdist.recv(torch.ones(2), src=-1), ValueError,
                     ["recv(src=-1)", "[0, 2)"], 0),
    "batch_isend_irecv(peer=7)": (
        None, lambda _, r: skdist.batch_isend_irecv([skdist.P2POp("recv", torch.ones(2), 1 - r),
                                                     skdist.P2POp("send", torch.ones(2), 7)]),
        ValueError, ["dst=7", "[0, 2)"], 0),
    "broadcast(src=5)": (None, lambda _, r: skdist.broadcast(torch.ones(2), src=5), ValueError,
                         ["broadcast(src=5)", "[0, 2)"], 0),
    "broadcast_object(src=5)": (None, lambda _, r: skdist.broadcast_object(1, src=5), ValueError,
                                ["broadcast_object(src=5)"], 0),
    "all_reduce(list)": (None, lambda _, r: skdist.all_reduce([1.0]), TypeError,
                         ["all_reduce", "torch.Tensor", "list"], 0),
    "all_reduce(op='sum')": (None, lambda _, r: skdist.all_reduce(torch.ones(2), op="sum"),
                             TypeError, ["op='sum'", "ReduceOp.SUM"], 0),
    "all_reduce(group='x')": (None, lambda _, r: skdist.all_reduce(torch.ones(2), group="x"),
                              TypeError, ["group='x'", "ProcessGroup"], 0),
    "all_gather(1 of 2 tensors)": (
        None, lambda _, r: skdist.all_gather([torch.ones(2)], torch.ones(2)), ValueError,
        ["all_gather(tensors=...)", "2 tensors", "got 1"], 0),
    # a data-parallel wrapper inside another: silently wrong updates before
    "SDP(SDP(m))": (lambda r: (lambda m: (lambda o: (SDP(m, o), o))(_oss(m)))(_lin()),
                    lambda wo, r: SDP(*wo), ValueError,
                    ["module is already a ShardedDataParallel"], 0),
    "SDP(FSDP(m))": (lambda r: FSDP(_lin()), lambda m, r: SDP(m, _oss(m)), ValueError,
                     ["module is already a FullyShardedDataParallel"], 1),  # OSS's check
    "FSDP(SDP(m))": (lambda r: _sdp(_lin()), lambda m, r: FSDP(m), ValueError,
                     ["module is already a ShardedDataParallel"], 0),
    "FSDP(DDP(m))": (lambda r: nn.parallel.DistributedDataParallel(_lin()),
                     lambda m, r: FSDP(m), ValueError,
                     ["module is already a DistributedDataParallel"], 0),
    # arguments that differ between ranks: a gloo abort, or silent drift, before
    "OSS optim class, ranks differ": (
        None, lambda _, r: OSS(_lin().parameters(), optim=[torch.optim.SGD, torch.optim.Adam][r],
                               lr=0.1),
        ValueError, ["optim is torch.optim.sgd.SGD on rank 0", "torch.optim.adam.Adam on rank 1"],
        1),
    "OSS lr, ranks differ": (None, lambda _, r: OSS(_lin().parameters(), lr=0.1 * (r + 1)),
                             ValueError, ["lr is 0.1 on rank 0", "0.2 on rank 1"], 1),
    "SDP reduce_fp16, ranks differ": (
        lambda r: (lambda m: (m, _oss(m)))(_lin()),
        lambda mo, r: SDP(mo[0], mo[1], reduce_fp16=bool(r)), ValueError,
        ["reduce_fp16 is False on rank 0", "True on rank 1"], 1),
    "SDP reduce_buffer_size, ranks differ": (
        lambda r: (lambda m: (m, _oss(m)))(_mlp(8)),
        lambda mo, r: SDP(mo[0], mo[1], reduce_buffer_size=[0, 2 ** 20][r]), ValueError,
        ["reduce_buffer_size is 0 on rank 0", "1048576 on rank 1"], 1),
    "FSDP model, ranks differ": (None, lambda _, r: FSDP(_mlp(4 + r)), ValueError,
                                 ["parameter 0.weight is (4, 4)", "(5, 4) torch.float32 on rank 1"],
                                 1),
    # before: NO_SHARD's one-rank groups were created on rank 0 only: a hang
    "FSDP sharding_strategy, ranks differ": (
        None, lambda _, r: FSDP(_mlp(4), sharding_strategy=["NO_SHARD", "FULL_SHARD"][r]),
        ValueError, ["sharding_strategy is 'NO_SHARD' on rank 0", "'FULL_SHARD' on rank 1"], 1),
    "FSDP mixed_precision, ranks differ": (
        None, lambda _, r: FSDP(_mlp(4), mixed_precision=bool(r)), ValueError,
        ["mixed_precision is", "param_dtype=torch.float16", "on rank 1"], 1),
    # representative probes of checks that were already right
    "OSS(params=[])": (None, lambda _, r: OSS([], lr=0.1), ValueError,
                       ["OSS(params=[])", "empty"], 0),
    "OSS(duplicate across groups)": (
        lambda r: _lin(),
        lambda m, r: OSS([{"params": [m.weight]}, {"params": [m.weight, m.bias]}], lr=0.1),
        ValueError, ["in param group 0", "again in group 1"], 0),
    "OSS.consolidate_state_dict(recipient_rank=5)": (
        lambda r: _oss(_lin()), lambda o, r: o.consolidate_state_dict(recipient_rank=5),
        ValueError, ["recipient_rank=5", "[0, 2)"], 0),
    "SDP(torch optimizer)": (lambda r: _lin(),
                             lambda m, r: SDP(m, torch.optim.SGD(m.parameters(), lr=0.1)),
                             TypeError, ["sharded_optimizer=", "shardkit.optim.OSS"], 0),
    "FSDP(sharding_strategy='nope')": (None, lambda _, r: FSDP(_lin(), sharding_strategy="nope"),
                                       ValueError, ["sharding_strategy='nope'", "FULL_SHARD"], 0),
    "FSDP(FSDP(m))": (lambda r: FSDP(_lin()), lambda m, r: FSDP(m), ValueError,
                      ["already a FullyShardedDataParallel"], 0),
    "FSDP(int64 and float32 in one unit)": (
        lambda r: _lin_with_int_param(), lambda m, r: FSDP(m), ValueError,
        ["one unit's parameters must share a dtype"], 0),
    "FSDP(hpz_partition_size=3)": (None, lambda _, r: FSDP(_lin(), hpz_partition_size=3),
                                   ValueError, ["hpz_partition_size=3", "must divide"], 0),
    "PipelineStage(stage_index=2)": (None, lambda _, r: pipe.PipelineStage(_lin(), 2, 2),
                                     ValueError, ["stage_index=2 is not in [0, 2)"], 1),
    "ScheduleGPipe(chunks=0)": (lambda r: pipe.PipelineStage(_lin(), r, 2),
                                lambda s, r: pipe.ScheduleGPipe(s, 0, nn.MSELoss()), ValueError,
                                ["chunks=0", "positive int"], 0),
    "initialize_model_parallel(3)": (None, lambda _, r: mp.initialize_model_parallel(3),
                                     ValueError, ["world size 2 is not divisible", "3"], 1),
    "ColumnParallelLinear(4, 3) at TP 2": (
        None, _with_tp2(lambda r: mp.ColumnParallelLinear(4, 3)), ValueError,
        ["out_features=3 is not divisible by tensor-parallel size 2"], 1),  # the groups' own
    "vocab_parallel_cross_entropy(int64 logits)": (
        None, _with_tp2(lambda r: mp.vocab_parallel_cross_entropy(
            torch.ones(2, 4, dtype=torch.long), torch.ones(2, dtype=torch.long))),
        TypeError, ["logits dtype torch.int64", "floating-point"], 1),
    "DynamicLossScaler(scale_window=0)": (None, lambda _, r: DynamicLossScaler(scale_window=0),
                                          ValueError, ["scale_window=0", ">= 1"], 0),
    "QuantizedTransport(weight_bits=3)": (None, lambda _, r: QuantizedTransport(weight_bits=3),
                                          ValueError, ["weight_bits=3", "[8, 4]"], 0),
}


def _run_probe(name):
    setup, call = _PROBES[name][:2]
    rank = skdist.get_rank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obj = None if setup is None else setup(rank)
        with skdist.CommCounter() as comm:
            try:
                call(obj, rank)
                raised = (None, "")
            except Exception as e:  # what the user would see
                raised = (type(e).__name__, str(e))
    after = torch.ones(1)
    skdist.all_reduce(after)  # the world still works
    return (*raised, len(comm.calls), after.item())


def _run_probes():
    return {name: _run_probe(name) for name in _PROBES}


def test_bad_input_probes(world2):
    per_rank = world2.run(_run_probes)
    problems = []
    for name, (_, _, exc, fragments, allowed_calls) in _PROBES.items():
        results = [ranks[name] for ranks in per_rank]
        kind, text, calls, after = results[0]
        if kind != exc.__name__:
            problems.append(f"{name}: raised {kind} ({text[:200]}), expected {exc.__name__}")
            continue
        missing = [f for f in fragments if f not in text]
        if missing:
            problems.append(f"{name}: message lacks {missing}: {text}")
        if any(r[:2] != (kind, text) for r in results):
            problems.append(f"{name}: ranks raised different errors: {results}")
        if any(r[2] > allowed_calls for r in results):
            problems.append(f"{name}: {[r[2] for r in results]} collectives before the error, "
                            f"{allowed_calls} allowed")
        if any(r[3] != 2.0 for r in results):
            problems.append(f"{name}: the world did not work afterwards")
    assert not problems, "\n".join(problems)


def _wrap_fsdp_on_a_group_without_this_rank():
    only_rank0 = skdist.new_group([0])
    try:
        FSDP(_lin(), process_group=only_rank0)
    except ValueError as e:
        return str(e)
    return None


def test_fsdp_on_a_group_without_this_rank_names_it(world2):
    """Rank 1 is outside the group: it said torch's "Invalid process group specified"."""
    outside = world2.run(_wrap_fsdp_on_a_group_without_this_rank)[1]
    assert outside is not None, "FSDP on a group without rank 1 was accepted there"
    assert "FullyShardedDataParallel(process_group=...): global rank 1 is not a member" \
        in outside, outside
