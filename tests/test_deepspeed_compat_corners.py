"""Corners of DeepSpeed compatibility outside the engine (``import shardkit as deepspeed``):
``deepspeed.checkpointing``, ``deepspeed.ops.adam``, ``deepspeed.zero``, ``deepspeed.utils``.

Each check compares with the un-wrapped computation (one process, fp32 or the same autocast)
or with DeepSpeed's documented behaviour; one process, and one world of 2 gloo ranks.
"""

import torch
import torch.nn as nn

from shardkit import checkpointing as ck
from shardkit.testing import world_fixture

world2 = world_fixture(2)


def _block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _grads(block, call, autocast_forward, autocast_backward):
    """Input and parameter gradients of ``call(block, x)`` with the forward (and, apart, the
    backward) under CPU bf16 autocast, as shardkit's bf16 engine runs them."""
    block.zero_grad()
    x = torch.linspace(-2, 2, 32).reshape(4, 8).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_forward):
        out = call(block, x)
        loss = out.float().pow(2).sum()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_backward):
        loss.backward()
    return out.dtype, [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]


def test_checkpoint_recomputes_under_the_forwards_autocast():
    """The recomputation runs under the autocast the forward ran under (and not under one the
    backward runs under), so the gradients equal those of the un-checkpointed call exactly.
    Before the fix it ran in fp32: the gradients differed by about 1e-2, and a region whose
    input is another's bf16 output (a bf16 engine's chained blocks) failed in the backward
    with "mat1 and mat2 must have the same dtype"."""
    block = _block()

    def chained(b, x):  # the second region's input is the first's bf16 output (before the
        return ck.checkpoint(b[2], ck.checkpoint(b[:2], x))  # fix: a dtype error, recomputed)

    for forward, backward in ((True, False), (False, True), (True, True)):
        plain_dtype, plain = _grads(block, lambda b, x: b(x), forward, backward)
        for call in (ck.checkpoint, chained):
            dtype, got = _grads(block, call, forward, backward)
            assert dtype == plain_dtype == (torch.bfloat16 if forward else torch.float32)
            for a, b in zip(got, plain):
                assert a.dtype == b.dtype
                torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------- deepspeed.comm


def _comm_as_deepspeed_calls_it():
    """``import shardkit.comm as dist`` called with DeepSpeed's signatures (argument names,
    defaults, torch's list-filling object collectives); every result checked on this rank."""
    import shardkit.comm as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    assert dist.has_all_gather_into_tensor() and dist.has_reduce_scatter_tensor()
    assert dist.get_global_rank(None) == 0 and dist.get_global_rank(group_rank=1) == 1
    assert dist.get_all_ranks_from_group(dist.get_world_group()) == list(range(world))
    out = torch.zeros(2 * world)
    dist.all_gather_into_tensor(output_tensor=out, tensor=torch.full((2,), float(rank)))
    assert out.tolist() == [float(r) for r in range(world) for _ in range(2)]
    part = torch.zeros(2)
    dist.reduce_scatter_tensor(output_tensor=part, tensor=torch.arange(2.0 * world),
                               op=dist.ReduceOp.SUM)
    assert part.tolist() == [world * (2.0 * rank + k) for k in range(2)]
    slots = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(tensor_list=slots, tensor=torch.tensor([float(rank)]))
    assert [s.item() for s in slots] == [float(r) for r in range(world)]
    # uneven all-to-all: rank r sends r + 1 + j rows of width 2 to rank j
    sends = [rank + 1 + j for j in range(world)]
    takes = [r + 1 + rank for r in range(world)]
    rows = torch.arange(2.0 * sum(sends)).reshape(-1, 2) + 100 * rank
    got = torch.zeros(sum(takes), 2)
    dist.all_to_all_single(got, rows, output_split_sizes=takes, input_split_sizes=sends)
    want = []
    for r in range(world):
        theirs = [r + 1 + j for j in range(world)]
        start = sum(theirs[:rank])
        want.append(torch.arange(2.0 * sum(theirs)).reshape(-1, 2)[start:start + theirs[rank]]
                    + 100 * r)
    assert torch.equal(got, torch.cat(want))
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": r} for r in range(world)]
    sent = [rank, "from"]
    dist.broadcast_object_list(sent, src=world - 1)
    assert sent == [world - 1, "from"]
    dist.barrier(group=None, async_op=True, device_ids=None).wait()
    # DeepSpeed's profiling keywords of its timed collectives, accepted and ignored
    total = torch.ones(3)
    dist.all_reduce(total, prof=True, log_name="grads", debug="train_step")
    assert total.tolist() == [float(world)] * 3
    dist.broadcast(total, src=0, log_name="sync")
    dist.barrier(prof=False, log_name="barrier")
    bad = []
    for call in (lambda: dist.all_gather_object([None], rank),
                 lambda: dist.all_to_all_single(got, rows, input_split_sizes=[1])):
        try:
            call()
        except ValueError as error:
            bad.append(str(error).split("(")[0])
    return bad


def test_comm_takes_deepspeeds_signatures(world2):
    """Before the fix: TypeError on DeepSpeed's keyword names (output_tensor=, tensor_list=,
    output_split_sizes=), on barrier(async_op=), get_global_rank(group), and
    all_gather_object(object_list, obj); AttributeError on has_all_gather_into_tensor,
    get_world_group, get_all_ranks_from_group, broadcast_object_list; TypeError on the
    profiling keywords (prof=, log_name=, debug=) of DeepSpeed's timed collectives."""
    bad = world2.run(_comm_as_deepspeed_calls_it)
    assert bad == [["all_gather_object", "all_to_all_single"]] * 2


def _uneven_where_one_rank_is_even():
    """Group rank 0's splits are all equal (1 row each way), rank 1's are not: every rank must
    take the same path (a rank deciding alone took the one-all-to-all path while the other
    all-reduced first: a hang)."""
    import shardkit.comm as dist
    rank = dist.get_rank()
    sends, takes = ([1, 1], [1, 1]) if rank == 0 else ([1, 2], [1, 2])
    rows = torch.arange(float(sum(sends))).reshape(-1, 1) + 100 * rank
    got = torch.full((sum(takes), 1), -1.0)
    dist.all_to_all_single(got, rows, output_split_sizes=takes, input_split_sizes=sends)
    return got.flatten().tolist()


def _error_heads(calls) -> list:
    """Run each call; ``None`` where it returned, else the head of its ValueError (the text
    before its first "(" or ":"), for comparing across ranks."""
    raised = []
    for call in calls:
        try:
            call()
            raised.append(None)
        except ValueError as error:
            raised.append(str(error).split("(")[0].split(":")[0])
    return raised


def _bad_on_one_rank():
    """Bad split sizes on one rank, a list of the wrong length on one rank, and splits the
    ranks disagree on: a ValueError on every rank, none left waiting."""
    import shardkit.comm as dist
    rank = dist.get_rank()
    rows, got = torch.arange(3.0).reshape(-1, 1), torch.zeros(3, 1)
    calls = (
        lambda: dist.all_to_all_single(got, rows, output_split_sizes=[1, 2],
                                       input_split_sizes=[1, 2] if rank else [3]),
        lambda: dist.all_gather_object([None] * (3 if rank == 0 else 2), rank),
        lambda: dist.all_to_all_single(got, rows, output_split_sizes=[1, 2],
                                       input_split_sizes=[2, 1] if rank == 0 else [1, 2]),
    )
    return _error_heads(calls)


def test_comm_splits_and_lists_agree_on_every_rank(world2):
    assert world2.run(_uneven_where_one_rank_is_even) == [[0.0, 100.0], [1.0, 101.0, 102.0]]
    assert world2.run(_bad_on_one_rank) == [["all_to_all_single", "all_gather_object",
                                            "all_to_all_single"]] * 2


def _comm_rooted_list_and_coalesced():
    """DeepSpeed's gather/scatter, recv from any source, monitored_barrier and the coalesced
    and list collectives, each against the values one process computes, with CommCounter's
    records."""
    import datetime

    import shardkit.comm as dist
    from shardkit.distributed import CommCounter
    rank, n = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(6.0).reshape(2, 3) + 10 * rank
    slots = [torch.zeros(2, 3) for _ in range(n)] if rank == n - 1 else None
    with CommCounter() as gathered:  # the argument check's all-gather is not counted
        dist.gather(mine, gather_list=slots, dst=n - 1, async_op=True, log_name="g").wait()
    assert gathered.by_op == {"gather": (n - 1) / n * 24} and gathered.calls == 1
    if slots is not None:
        assert all(torch.equal(s, torch.arange(6.0).reshape(2, 3) + 10 * r)
                   for r, s in enumerate(slots))
    got = torch.zeros(3)
    dist.scatter(got, [torch.full((3,), 5.0 + r) for r in range(n)] if rank == 1 else None,
                 src=1)
    assert got.tolist() == [5.0 + rank] * 3
    if rank == 0:  # from any source: the sender's rank comes back
        box = torch.zeros(2)
        assert dist.recv(box) == 1 and box.tolist() == [1.0, 2.0]
        work = dist.irecv(box, src=None)
        work.wait()
        assert box.tolist() == [3.0, 4.0]
    elif rank == 1:
        dist.send(torch.tensor([1.0, 2.0]), 0)
        dist.isend(torch.tensor([3.0, 4.0]), dst=0).wait()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=60), wait_all_ranks=True)
    # coalesced: mixed dtypes and shapes, one all-reduce per dtype, the sums copied back
    a, b, c = (torch.full((2, 2), rank + 1.0), torch.arange(3) + rank,
               torch.full((3,), 0.5 * rank))
    with CommCounter() as reduced:
        dist.all_reduce_coalesced([a, b, c], async_op=True).wait()
    total = n * (n + 1) / 2
    assert a.tolist() == [[total] * 2] * 2
    assert b.tolist() == [n * k + total - n for k in range(3)]
    assert c.tolist() == [0.5 * (total - n)] * 3 and reduced.calls_by_op == {"all_reduce": 2}
    assert dist.has_all_reduce_coalesced() and not dist.has_coalescing_manager()
    outs = [torch.zeros(n, 2), torch.zeros(3 * n, dtype=torch.int64)]
    dist.all_gather_coalesced(outs, [torch.full((2,), float(rank)), torch.arange(3) + rank])
    assert outs[0].tolist() == [[float(r)] * 2 for r in range(n)]
    assert outs[1].tolist() == [k + r for r in range(n) for k in range(3)]
    part = torch.zeros(2)
    dist.reduce_scatter(part, [torch.full((2,), 10.0 * r + rank) for r in range(n)])
    assert part.tolist() == [10.0 * rank * n + total - n] * 2
    flat = torch.zeros(2 * n)
    dist.allgather_fn(flat, torch.full((2,), float(rank)), group=None, async_op=False)
    dist.reduce_scatter_fn(part, torch.ones(2 * n), op=dist.ReduceOp.SUM, prof=False)
    assert flat.tolist() == [float(r) for r in range(n) for _ in range(2)]
    assert part.tolist() == [float(n)] * 2
    # list all-to-all, items of different sizes: rank r sends r + 1 elements to each rank
    outs = [torch.zeros(r + 1) for r in range(n)]
    dist.all_to_all(outs, [torch.full((rank + 1,), 100.0 * rank + j) for j in range(n)])
    assert [o.tolist() for o in outs] == [[100.0 * r + rank] * (r + 1) for r in range(n)]
    objects = [None] * n
    dist.all_gather_object(objects, rank, log_name="ranks", prof=False)
    return objects


def _comm_bad_on_one_rank():
    """A gather list of the wrong length on the destination only, a scatter list on a rank
    that is not the source, an object list of another length than the source's: a
    ValueError on every rank (before, gather and scatter raised on one rank and left the
    others waiting; broadcast_object_list raised on the receivers and let the source go on)."""
    import shardkit.comm as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    one = torch.ones(2)
    calls = (
        lambda: dist.gather(one, [torch.zeros(2)] * (n - 1) if rank == 0 else None, dst=0),
        lambda: dist.scatter(one, None if rank == 0 else [one] * n, src=0),
        lambda: dist.gather(one, [torch.zeros(2)] * n, dst=n),
        lambda: dist.broadcast_object_list(["a"] if rank == 0 else ["a", "b"], src=0),
    )
    return _error_heads(calls)


def test_comm_rooted_list_and_coalesced_collectives(world2):
    """Before: AttributeError on gather, scatter, monitored_barrier, all_reduce_coalesced,
    all_gather_coalesced, reduce_scatter, all_to_all, allgather_fn, reduce_scatter_fn; recv
    and irecv without src refused; all_gather_object(log_name=) a TypeError."""
    assert world2.run(_comm_rooted_list_and_coalesced) == [[0, 1]] * 2
    assert world2.run(_comm_bad_on_one_rank) == [["shardkit.distributed.gather",
                                                  "shardkit.distributed.scatter",
                                                  "shardkit.distributed.gather",
                                                  "broadcast_object_list"]] * 2


def _comm_layouts_torch_accepts():
    """Tensor layouts torch's documentation accepts: the stacked form of the flat collectives
    (``n x`` the shard's shape), a scatter list of column blocks (non-contiguous views), a
    transposed tensor sent and received point to point."""
    import shardkit.comm as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    stacked = torch.zeros(n, 2, 3)
    dist.all_gather_into_tensor(stacked, torch.arange(6.0).reshape(2, 3) + rank)
    assert torch.equal(stacked, torch.stack([torch.arange(6.0).reshape(2, 3) + r
                                             for r in range(n)]))
    part = torch.zeros(2, 3)
    dist.reduce_scatter_tensor(part, torch.arange(6.0 * n).reshape(n, 2, 3))
    assert torch.equal(part, n * torch.arange(6.0 * n).reshape(n, 2, 3)[rank])
    matrix = torch.arange(6.0 * n).reshape(3, 2 * n)
    got = torch.zeros(3, 2)
    dist.scatter(got, list(matrix.chunk(n, dim=1)) if rank == 0 else None, src=0)
    assert torch.equal(got, matrix.chunk(n, dim=1)[rank])  # before: other elements, silently
    if rank == 0:
        dist.send(matrix.t(), dst=1)
        dist.isend(matrix.t() + 1, dst=1).wait()
    elif rank == 1:
        landing = torch.zeros(3, 2 * n).t()
        dist.recv(landing, src=0)
        assert torch.equal(landing, matrix.t())
        dist.irecv(landing, src=0).wait()
        assert torch.equal(landing, matrix.t() + 1)
    return True


def test_comm_takes_the_layouts_torch_documents(world2):
    """Before: gloo refused the stacked forms (RuntimeError "invalid tensor size", "Check
    failed: outputShape[0] * worldSize == inputShape[0]"), the scatter delivered the wrong
    elements, and a transposed send and receive failed ("input tensor has to be
    contiguous")."""
    assert world2.run(_comm_layouts_torch_accepts) == [True, True]


def _comm_review_corners():
    """A scatter into a transposed tensor; a gather and a scatter whose tensor has another
    size on a non-root rank only; the sender of an any-source receive into a transposed
    tensor; the concatenated all-gather's future holding the caller's tensor shape."""
    import shardkit.comm as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    got = torch.zeros(2, 3).t()
    dist.scatter(got, [torch.arange(6.0).reshape(3, 2) + r for r in range(n)]
                 if rank == 0 else None, src=0)
    assert torch.equal(got, torch.arange(6.0).reshape(3, 2) + rank)  # before: other elements
    raised = []
    for call in (lambda: dist.gather(torch.ones(3 if rank == 1 else 2),
                                     [torch.zeros(2)] * n if rank == 0 else None, dst=0),
                 lambda: dist.scatter(torch.zeros(3 if rank == 1 else 2),
                                      [torch.ones(2)] * n if rank == 0 else None, src=0)):
        try:  # before: gloo aborted rank 0's process; the scatter left a stale tail
            call()
        except ValueError as error:
            raised.append("differ in size" in str(error))
    assert raised == [True, True]
    if rank == 0:
        box = torch.zeros(2, 3).t()
        work = dist.irecv(box, src=None)
        work.wait()
        assert work._source_rank() == 1  # before: AttributeError
    elif rank == 1:
        dist.send(torch.ones(3, 2), 0)
    out = torch.zeros(2 * n, 3)
    work = dist.all_gather_into_tensor(out, torch.ones(2, 3), async_op=True)
    assert work.get_future().wait()[0].dim() == 2  # before: a flat view
    return True


def test_comm_review_corners(world2):
    assert world2.run(_comm_review_corners) == [True, True]


def _comm_lists_bad_on_one_rank():
    """A list of the wrong length on one rank only (all_gather, reduce_scatter, all_to_all,
    all_gather_coalesced), lists whose elements, dtypes or op differ between ranks: the same
    kind of ValueError on every rank, before any data moves, and the world still works."""
    import shardkit.comm as dist
    from shardkit.distributed import CommCounter
    rank, n = dist.get_rank(), dist.get_world_size()
    one, zero = torch.ones(2), torch.zeros(2)
    odd = 3 if rank == 1 else 2  # elements on this rank
    calls = (
        lambda: dist.all_gather([zero] * (n + rank), one),
        lambda: dist.all_gather([torch.zeros(odd)] * n, one),
        lambda: dist.reduce_scatter(zero, [one] * (n - rank)),
        lambda: dist.reduce_scatter(torch.zeros(odd), [torch.ones(odd)] * n),
        lambda: dist.reduce_scatter(zero, [one] * n,
                                    op=dist.ReduceOp.MAX if rank else dist.ReduceOp.SUM),
        lambda: dist.all_to_all([zero] * (n + rank), [one] * n),
        lambda: dist.all_to_all_single(zero, one.double() if rank else one, [1] * n, [1] * n),
        lambda: dist.all_gather_coalesced([torch.zeros(2 * n)] * (1 + rank), [one] * (1 + rank)),
        lambda: dist.all_gather_coalesced([torch.zeros(odd * n)], [torch.ones(odd)]),
        lambda: dist.all_gather_coalesced([torch.zeros(2 * n + rank)], [one]),
    )
    heads = [head and head.rsplit(".", 1)[-1] for head in _error_heads(calls)]
    slots = [torch.zeros(2) for _ in range(n)]
    with CommCounter() as counted:  # the argument check's all-gather is not counted
        dist.all_gather(slots, torch.full((2,), float(rank)))
    assert counted.calls_by_op == {"all_gather": 1} and counted.bytes == (n - 1) / n * 8 * n
    assert [s.tolist() for s in slots] == [[float(r)] * 2 for r in range(n)]
    return heads


def test_comm_list_arguments_agree_on_every_rank(world2):
    """Before: the other rank hung in the collective, or gloo aborted a process ("Received
    data size doesn't match expected size"), or (all_gather_coalesced of one size) the
    gather went on."""
    assert world2.run(_comm_lists_bad_on_one_rank) == [
        ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter", "reduce_scatter",
         "all_to_all", "all_to_all_single", "all_gather_coalesced", "all_gather_coalesced",
         "all_gather_coalesced"]] * 2


def _comm_logger_as_deepspeed_scripts_use_it():
    """deepspeed.comm.configure / log_summary / reset_log and prof= / log_name= on the
    collectives: the per-op counts and bus bytes are CommCounter's; rank 0 alone prints."""
    import contextlib
    import io

    import shardkit.comm as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    t, out = torch.ones(4), torch.zeros(4 * n)
    try:
        dist.configure(enabled=True)  # prof_all: every collective
        dist.all_reduce(t)
        dist.all_reduce(t, prof=True, log_name="grads")
        dist.all_gather_into_tensor(out, torch.ones(4))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            stats = dist.log_summary(return_dict=True)
        summary = {op: {size: (e["count"], e["total_bus_bytes"]) for size, e in sizes.items()}
                   for op, sizes in stats["summary"].items()}
        # keyed as DeepSpeed's: by log_name, an all-gather by its input's size
        assert summary == {"all_reduce": {16: (1, 2 * (n - 1) / n * 16)},
                           "grads": {16: (1, 2 * (n - 1) / n * 16)},
                           "all_gather_into_tensor": {16: (1, (n - 1) / n * 16 * n)}}
        assert ("Count" in printed.getvalue()) == (rank == 0)
        assert dist.get_logged_comm_ops() == ["all_reduce", "grads", "all_gather_into_tensor"]
        dist.reset_log()
        assert not dist.has_comm_data()
        # prof_all off: the calls given prof=True or a log_name in prof_ops (DeepSpeed's
        # default log_name is the call's name)
        dist.configure(prof_all=False, prof_ops=["all_gather_into_tensor", "sync"])
        dist.all_reduce(t)
        dist.all_reduce(t, prof=True)
        dist.all_gather_into_tensor(out, torch.ones(4))
        dist.broadcast(t, 0, log_name="sync")
        dist.broadcast(t, 0)
        logged = dist.get_logged_comm_ops(), dist.get_comm_operation_count()
        dist.configure({"comms_logger": {"enabled": False}})
        dist.all_reduce(t)
    finally:
        dist.configure(enabled=False, prof_all=True, prof_ops=[])
        count = dist.get_comm_operation_count()
        dist.reset_log()
    return logged, count


def test_comm_logger_reports_what_commcounter_counts(world2):
    """Before: AttributeError on deepspeed.comm.configure, log_summary, reset_log,
    has_comm_data, get_comm_operation_count and get_logged_comm_ops."""
    assert world2.run(_comm_logger_as_deepspeed_scripts_use_it) == [
        ((["all_reduce", "all_gather_into_tensor", "sync"], 3), 3)] * 2


def _comm_logger_from_the_config():
    """initialize(config={"comms_logger": {"enabled": true}}) switches the logger on, as
    DeepSpeed's engine does (the section was refused); its step's reduction is logged."""
    import shardkit
    import shardkit.comm as dist
    try:
        engine, *_ = shardkit.initialize(model=torch.nn.Linear(4, 2), config={
            "train_micro_batch_size_per_gpu": 1, "comms_logger": {"enabled": True},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        engine.backward(engine(torch.ones(1, 4)).sum())
        engine.step()
        return dist.get_logged_comm_ops()
    finally:
        dist.configure(enabled=False, prof_all=True, prof_ops=[])
        dist.reset_log()


def test_comm_logger_switched_on_by_initializes_config(world2):
    for logged in world2.run(_comm_logger_from_the_config):
        assert "all_reduce" in logged, logged


def _comm_layouts_of_the_list_and_split_forms():
    """reduce_scatter's list form into a 2-D output, all_to_all_single (with and without
    split sizes) into a transposed output and from a transposed input, against the values
    one process computes."""
    import shardkit.comm as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    part = torch.zeros(2, 3)
    dist.reduce_scatter(part, [torch.arange(6.0).reshape(2, 3) + j for j in range(n)])
    assert torch.equal(part, n * (torch.arange(6.0).reshape(2, 3) + rank))  # before: gloo's
    # "Check failed: outputShape[0] * worldSize == inputShape[0]"
    rows = [torch.arange(4.0 * n).reshape(2 * n, 2) + 100 * r for r in range(n)]
    want = torch.cat([rows[r][2 * rank:2 * rank + 2] for r in range(n)])
    for splits in (None, [2] * n):
        got = torch.zeros(2, 2 * n).t()
        dist.all_to_all_single(got, rows[rank], splits, splits)
        assert torch.equal(got, want)  # before: other elements, silently
        got = torch.zeros(2 * n, 2)
        dist.all_to_all_single(got, rows[rank].t().contiguous().t(), splits, splits)
        assert torch.equal(got, want)  # before: "Tensors must be contiguous"
    got = torch.zeros(2, 2 * n).t()
    dist.all_to_all_single(got, rows[rank], async_op=True).wait()
    assert torch.equal(got, want)
    return True


def test_comm_list_and_split_forms_take_any_layout(world2):
    assert world2.run(_comm_layouts_of_the_list_and_split_forms) == [True, True]


def _poll(handle, seconds: float = 30.0) -> bool:
    """Poll ``handle.is_completed()`` as a user's overlap loop does; ``False`` if it never
    reads ``True`` within ``seconds`` (then the handle is waited for)."""
    import time
    deadline = time.monotonic() + seconds
    while not handle.is_completed():
        if time.monotonic() > deadline:
            handle.wait()
            return False
        time.sleep(0.005)
    return handle.wait() is True and handle.is_completed()


def _comm_async_handles_poll_and_wait_once():
    """Async handles of the reduce-scatters polled with is_completed() (rank 1 joins late:
    reduce_scatter_tensor has no argument agreement, so rank 0's handle cannot have completed
    at once; the list form's agreement would let rank 1 catch up), and a receive into a
    transposed tensor waited for twice."""
    import time

    import shardkit.comm as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 1:
        time.sleep(0.3)
    out = torch.zeros(2)
    handle = dist.reduce_scatter_tensor(out, torch.ones(2 * n), async_op=True)
    early = handle.is_completed() if rank == 0 else False
    polled = [_poll(handle)]  # before: never
    assert out.tolist() == [float(n)] * 2
    polled.append(_poll(dist.reduce_scatter(out, [torch.full((2,), 1.0 + j) for j in range(n)],
                                            async_op=True)))  # before: True at once
    assert out.tolist() == [n * (1.0 + rank)] * 2
    polled.append(_poll(dist.reduce_scatter_fn(out, torch.ones(2 * n), async_op=True)))
    assert out.tolist() == [float(n)] * 2
    if rank == 0:
        box = torch.zeros(3, 2).t()
        work = dist.irecv(box, src=1)
        work.wait()
        work.wait()  # before: blocked forever (gloo's receive waited for twice)
        assert torch.equal(box, torch.ones(2, 3))
    elif rank == 1:
        dist.send(torch.ones(2, 3), 0)
    return early, polled


def test_comm_async_handles_poll_and_wait_once(world2):
    assert world2.run(_comm_async_handles_poll_and_wait_once) == [(False, [True] * 3)] * 2


def _comm_bad_tensor_or_op_on_one_rank():
    """A non-tensor (all_gather) or an op that is not a ReduceOp (reduce_scatter) on one rank
    only: an error on every rank, none left waiting in the agreement."""
    import shardkit.comm as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    raised = []
    for call in (lambda: dist.all_gather([torch.zeros(2)] * n, [1.0] if rank else torch.ones(2)),
                 lambda: dist.reduce_scatter(torch.zeros(2), [torch.ones(2)] * n,
                                             op="sum" if rank else dist.ReduceOp.SUM)):
        try:
            call()
            raised.append(None)
        except (TypeError, ValueError) as error:
            raised.append(type(error).__name__)
    return raised


def test_comm_bad_tensor_or_op_on_one_rank_raises_everywhere(world2):
    """Before: rank 0 waited in the argument agreement's all-gather (gloo's 30 min timeout)."""
    assert world2.run(_comm_bad_tensor_or_op_on_one_rank) == [
        ["ValueError", "ValueError"], ["TypeError", "TypeError"]]
