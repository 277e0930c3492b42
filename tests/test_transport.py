"""The transports behind the wrappers' collectives: the process group (default) and the opt-in
shared-memory plugin. Results against plain torch.distributed, CommCounter records, mismatched
ops, the wrappers' start-up broadcasts on their transport, dead peers (mid-operation and
mid-setup, with errors that name the operation), fixed footprint, nothing left behind."""

import os
import signal
import time

import pytest
import torch

from shardkit import distributed as skdist
from shardkit.testing import World, world_fixture
from shardkit.transport import ProcessGroupTransport, Transport, resolve_transport

world2 = world_fixture(2)
world4 = world_fixture(4)


def _make(kind, **kw):
    if kind == "shared_memory":
        from shardkit.shm_transport import SharedMemoryTransport
        return SharedMemoryTransport(part_bytes=kw.get("part_bytes", 4096))
    return ProcessGroupTransport()


def _every_op(kind):
    """Each operation of the interface, sizes that take several rounds and odd remainders,
    fp32 and bf16, compared with the exact result; plus what CommCounter recorded."""
    t = _make(kind)
    t.prepare(None)
    rank, n = skdist.get_rank(), skdist.get_world_size()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        numel = 3001  # not a multiple of a part
        mine = (torch.arange(numel) % 97 + rank).to(dtype)
        every = [(torch.arange(numel) % 97 + r).to(dtype) for r in range(n)]
        gathered = torch.empty(n * numel, dtype=dtype)
        with skdist.CommCounter() as c:
            t.all_gather(gathered, mine, None).wait()
        out[f"all_gather_{dtype}"] = (torch.equal(gathered, torch.cat(every)), c.calls_by_op,
                                      c.bytes)
        packed = torch.cat([(torch.arange(numel) % 13 * (r + 1) + rank).to(dtype)
                            for r in range(n)])
        expect = sum((torch.arange(numel) % 13 * (rank + 1) + q).double() for q in range(n))
        with skdist.CommCounter() as c:
            got = t.reduce_scatter(packed, None).wait()
        out[f"reduce_scatter_{dtype}"] = (torch.allclose(got.double(), expect, rtol=1e-2),
                                          c.calls_by_op, c.bytes)
        tensor = torch.full((5000,), float(rank + 1), dtype=dtype)
        with skdist.CommCounter() as c:
            t.all_reduce(tensor, None).wait()
        out[f"all_reduce_{dtype}"] = bool((tensor == n * (n + 1) / 2).all())
        out[f"all_reduce_bytes_{dtype}"] = c.bytes
        b = torch.full((4099,), float(rank), dtype=dtype)
        with skdist.CommCounter() as c:
            t.broadcast(b, n - 1, None).wait()
        out[f"broadcast_{dtype}"] = bool((b == n - 1).all())
        out[f"broadcast_bytes_{dtype}"] = c.bytes
        a2a_in = torch.cat([torch.full((700,), float(10 * rank + j), dtype=dtype)
                            for j in range(n)])
        a2a_out = torch.empty_like(a2a_in)
        with skdist.CommCounter() as c:
            t.all_to_all(a2a_out, a2a_in, None).wait()
        out[f"all_to_all_bytes_{dtype}"] = c.bytes
        out[f"all_to_all_{dtype}"] = all(bool((a2a_out[j * 700:(j + 1) * 700] == 10 * j + rank)
                                              .all()) for j in range(n))
    segs = [torch.full((7 + 3 * r,), float(rank + 1)) if r != 1 else None for r in range(n)]
    sizes = [(3001 if r == 0 else 5 * r) for r in range(n)]  # unequal, one much larger
    flat = torch.full((sum(sizes),), -1.0)
    start = sum(sizes[:rank])
    flat[start:start + sizes[rank]] = rank + 1.0
    with skdist.CommCounter() as c:
        t.all_gather_segments(flat, sizes, None).wait()
    expected = torch.cat([torch.full((size,), r + 1.0) for r, size in enumerate(sizes)])
    out["segments"] = (torch.equal(flat, expected), c.calls_by_op, c.bytes, sizes)
    flat[:] = -1.0
    flat[start:start + sizes[rank]] = rank + 1.0
    Transport.all_gather_segments(t, flat, sizes, None).wait()  # the interface's default
    out["segments_default"] = torch.equal(flat, expected)
    with skdist.CommCounter() as c:
        own = t.reduce_to_owners(segs, None).wait()
    out["reduce_to_owners"] = None if own is None else (own.numel(), own[0].item())
    out["reduce_to_owners_bytes"] = c.bytes
    fulls = [torch.empty(10), torch.empty(5)]
    chunks = [torch.arange(5.) + 100 * rank, torch.arange(3.) + 100 * rank]  # 5 rows, 3 per rank
    t.all_gather_chunks([f[:5 * n] if i == 0 else f for i, f in enumerate(fulls)]
                        if n == 2 else [torch.empty(5 * n), torch.empty(5)], chunks, None).wait()
    if n == 2:
        out["chunks"] = (fulls[0].tolist(), fulls[1].tolist())
    if kind == "process_group":
        out["lanes"] = _lanes_in_use(t)
    return out


def _lanes_in_use(t):
    """On gloo, prepare opened two lanes over the group's ranks with its timeout, once (a second
    prepare creates no group), and each direction of an exchange travels on its own lane."""
    import torch.distributed as dist
    from shardkit import transport as T
    up, down = T._lane(None, True), T._lane(None, False)
    groups_before = dist.distributed_c10d.get_pg_count()
    t.prepare(None)
    ProcessGroupTransport().prepare(None)  # lanes belong to the group, not to one transport
    rank, n = skdist.get_rank(), skdist.get_world_size()
    ops = T._own_segment_to_every_peer([torch.zeros(2) for _ in range(n)], rank, None)
    on_lane = all(op.group is (up if (rank < op.peer) == (op.op == "send") else down)
                  for op in ops)
    return {"distinct": up is not down and dist.group.WORLD not in (up, down),
            "same_ranks": skdist.group_ranks(up) == skdist.group_ranks(down) == list(range(n)),
            "timeout": skdist.timeout_of(up) == skdist.timeout_of(down) == skdist.timeout_of(),
            "no_new_groups": dist.distributed_c10d.get_pg_count() == groups_before,
            "each_direction_on_its_lane": on_lane and len(ops) == 2 * (n - 1)}


@pytest.mark.parametrize("kind", ["process_group", "shared_memory"])
@pytest.mark.parametrize("n", [2, 4])
def test_every_operation_is_exact(world2, world4, kind, n):
    world = world2 if n == 2 else world4
    for rank, r in enumerate(world.run(_every_op, kind)):
        for key, value in r.items():
            if "_bytes" in key:
                continue  # test_shared_memory_counts_what_each_rank_receives
            if key.startswith(("all_reduce", "broadcast", "all_to_all")):
                assert value, key
            elif key.startswith(("all_gather", "reduce_scatter")):
                assert value[0], key
                op = key.rsplit("_", 1)[0]
                assert value[1] == {op: 1}, (key, value)  # one record, under the op asked for
        exact, calls, _bytes, _sizes = r["segments"]
        assert exact and calls == {"all_gather": 1}, r["segments"]
        assert r["segments_default"]  # one broadcast per segment
        if rank == 1:
            assert r["reduce_to_owners"] is None
        else:
            assert r["reduce_to_owners"] == (7 + 3 * rank, n * (n + 1) / 2)
        if n == 2:
            assert r["chunks"] == ([0, 1, 2, 3, 4, 100, 101, 102, 103, 104],
                                   [0, 1, 2, 100, 101])
        if kind == "process_group":
            assert all(r["lanes"].values()), r["lanes"]


def _chunk_of_sum(tensors, c: int, rank: int, n: int) -> torch.Tensor:
    """Chunk ``rank`` (``c`` elements) of the sum of ``tensors``, zero padded to ``n x c``."""
    total = sum(t.double().reshape(-1) for t in tensors)
    padded = torch.zeros(n * c, dtype=torch.float64)
    padded[:total.numel()] = total
    return padded[rank * c:(rank + 1) * c]


def _chunked_reduce_scatter(kind):
    """``reduce_scatter_chunks`` on tensors whose chunks are whole, padded and (at world 4)
    wholly padding, fp32 (gloo: sent straight from the tensors) and bf16 (packed first), against
    the exact sum; with what CommCounter recorded."""
    t = _make(kind)
    t.prepare(None)
    rank, n = skdist.get_rank(), skdist.get_world_size()
    shapes = [(8, 3), (9,), (5, 2), (0,)]  # 9 rows at world 4: chunks of 3, the last all padding
    chunks = [-(-shape[0] // n) * (shape[1] if len(shape) > 1 else 1) for shape in shapes]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        def values(r):  # small integers: exact in both dtypes, and after the scale by 1/n
            return [(torch.arange(torch.Size(s).numel()) % 7 + 2 * r).reshape(s).to(dtype)
                    for s in shapes]
        every = [values(r) for r in range(n)]
        expect = torch.cat([_chunk_of_sum([v[i] for v in every], c, rank, n)
                            for i, c in enumerate(chunks)]) / n
        with skdist.CommCounter() as c:
            got = t.reduce_scatter_chunks(values(rank), chunks, None, scale=1.0 / n,
                                          dtype=dtype).wait()
        out[str(dtype)] = (got.dtype == dtype and torch.equal(got.double(), expect),
                           c.calls_by_op, c.bytes, sum(chunks))
    try:
        t.reduce_scatter_chunks([torch.ones(9)], [1], None)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    return out


@pytest.mark.parametrize("kind", ["process_group", "shared_memory"])
@pytest.mark.parametrize("n", [2, 4])
def test_reduce_scatter_of_chunks_is_exact_with_padded_bytes(world2, world4, kind, n):
    world = world2 if n == 2 else world4
    for r in world.run(_chunked_reduce_scatter, kind):
        for dtype in ("torch.float32", "torch.bfloat16"):
            exact, calls, nbytes, segment = r[dtype]
            assert exact, (dtype, r)
            assert calls == {"reduce_scatter": 1}, (dtype, r)
            # the padded layout's (N-1)/N of N segments, padding included, as when packed
            assert nbytes == (n - 1) * segment * (4 if dtype == "torch.float32" else 2), r
        assert "chunk_numels[0]=1" in r["error"] and "ceil(9 / " in r["error"], r["error"]


def _what_wait_returns(kind):
    """Each operation's ``wait()`` result, against what the interface documents."""
    t = _make(kind)
    t.prepare(None)
    rank, n = skdist.get_rank(), skdist.get_world_size()
    x = torch.full((6,), float(rank))
    out = torch.empty(6 * n)
    got = {"all_gather": t.all_gather(out, x, None).wait() is out}
    segments = torch.zeros(3 * n + 1)
    sizes = [3] * n
    sizes[-1] += 1  # unequal
    got["all_gather_segments"] = t.all_gather_segments(segments, sizes, None).wait() is segments
    b = torch.full((5,), float(rank))
    got["broadcast"] = t.broadcast(b, 0, None).wait() is b
    a = torch.ones(5)
    got["all_reduce"] = t.all_reduce(a, None).wait() is a
    o = torch.empty(2 * n)
    got["all_to_all"] = t.all_to_all(o, torch.ones(2 * n), None).wait() is o
    part = t.reduce_scatter(torch.ones(2 * n), None).wait()
    got["reduce_scatter"] = isinstance(part, torch.Tensor) and part.numel() == 2
    t.close()
    return got


def _lanes_after_groups_only_some_ranks_made():
    """Ranks 1 and 3 open lanes on a group of theirs (so they hold two process groups more than
    ranks 0 and 2); then each half of the world opens lanes on its own group and gathers."""
    rank = skdist.get_rank()
    odd = skdist.new_group([1, 3])
    transport = ProcessGroupTransport()
    if rank in (1, 3):
        transport.prepare(odd)
    # a short timeout: without agreement on the lanes' names this fails instead of hanging
    halves = [skdist.new_group([0, 1], timeout_s=20), skdist.new_group([2, 3], timeout_s=20)]
    mine = halves[rank // 2]
    transport.prepare(mine)
    out = torch.empty(2)
    transport.all_gather(out, torch.tensor([float(rank)]), mine).wait()
    return out.tolist()


def test_lanes_of_a_sub_group_open_whatever_groups_other_ranks_made(world4):
    """A wrapper on a sub-group after a wrapper on another sub-group (so the members hold
    different numbers of process groups) used to wait forever opening its lanes."""
    assert world4.run(_lanes_after_groups_only_some_ranks_made) == \
        [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]


def _dropped_handles_then_a_gather(kind):
    """Gathers and reduce-scatters whose handles are dropped unwaited, then one waited for."""
    import gc
    t = _make(kind)
    t.prepare(None)
    rank, n = skdist.get_rank(), skdist.get_world_size()
    for _ in range(3):
        t.all_gather(torch.empty(n * 100), torch.full((100,), float(rank)), None)
        t.reduce_scatter(torch.ones(n * 50), None)
    gc.collect()
    out = torch.empty(n * 4)
    t.all_gather(out, torch.full((4,), float(rank)), None).wait()
    total = t.reduce_scatter(torch.ones(n * 2), None).wait()
    t.close()
    return out.view(n, -1)[:, 0].tolist(), total.tolist()


@pytest.mark.parametrize("kind", ["process_group", "shared_memory"])
def test_a_handle_dropped_unwaited_does_not_stall_later_operations(world2, kind):
    """On gloo, the sends and receives of a dropped handle used to be lost with it, and the
    next gather between the same ranks waited forever."""
    assert world2.run(_dropped_handles_then_a_gather, kind) == [([0.0, 1.0], [2.0, 2.0])] * 2


@pytest.mark.parametrize("kind", ["process_group", "shared_memory"])
def test_wait_returns_what_the_interface_documents(world2, kind):
    for got in world2.run(_what_wait_returns, kind):
        assert all(got.values()), got


def test_bytes_recorded_are_what_moves(world2):
    r = world2.run(_every_op, "process_group")[0]
    numel, fp32 = 3001, 4
    # gloo: the gather is one batch of sends of this rank's input to its peer
    assert r["all_gather_torch.float32"][2] == numel * fp32
    # the reduce-scatter is an all_to_all: (N-1)/N of the input
    assert r["reduce_scatter_torch.float32"][2] == numel * fp32
    shm = world2.run(_every_op, "shared_memory")[0]
    assert shm["all_gather_torch.float32"][2] == numel * fp32  # read from the peer's slot


@pytest.mark.parametrize("n", [2, 4])
def test_shared_memory_counts_what_each_rank_receives(world2, world4, n):
    """Shared memory records an op's bytes as the process group records the same op: for the
    all-gather, reduce-scatter and all-to-all what a rank reads from its peers' slots (the
    ring's bytes), for rooted ops and unequal gathers (N-1)/N of the tensor on every rank;
    its all-reduce is counted as the ring's 2(N-1)/N, as the process group's."""
    world = world2 if n == 2 else world4
    for rank, (shm, pg) in enumerate(zip(world.run(_every_op, "shared_memory"),
                                         world.run(_every_op, "process_group"))):
        for dtype, size in (("torch.float32", 4), ("torch.bfloat16", 2)):
            for op in ("all_gather", "reduce_scatter"):
                assert shm[f"{op}_{dtype}"][2] == pg[f"{op}_{dtype}"][2], (rank, op, dtype)
            assert shm[f"all_gather_{dtype}"][2] == (n - 1) * 3001 * size
            assert shm[f"all_to_all_bytes_{dtype}"] == pg[f"all_to_all_bytes_{dtype}"] \
                == (n - 1) * 700 * size
            # counted by DESIGN.md's ring convention, as the process group counts it (every
            # rank really reads its N-1 peers' copies: the module docstring says so)
            assert shm[f"all_reduce_bytes_{dtype}"] == pg[f"all_reduce_bytes_{dtype}"] \
                == 2 * (n - 1) / n * 5000 * size
            # a rooted op: (N-1)/N on every rank, as the process group counts the same bytes
            assert shm[f"broadcast_bytes_{dtype}"] == pg[f"broadcast_bytes_{dtype}"] \
                == 4099 * size * (n - 1) / n
        segments = [0 if r == 1 else 7 + 3 * r for r in range(n)]  # rank 1 owns no segment
        assert shm["reduce_to_owners_bytes"] == pg["reduce_to_owners_bytes"] \
            == 4 * sum(segments) * (n - 1) / n, (rank, shm)
        # unequal segments: DESIGN.md's (N-1)/N of the output on every rank, on both
        sizes = shm["segments"][3]
        assert shm["segments"][2] == pg["segments"][2] == 4 * sum(sizes) * (n - 1) / n


@pytest.mark.parametrize("value", ["x", 0, -1.0, True])
def test_shared_memory_timeout_must_be_positive_seconds(value):
    from shardkit.shm_transport import SharedMemoryTransport
    with pytest.raises(ValueError, match=r"timeout_s=.*must be a number of seconds > 0"):
        SharedMemoryTransport(timeout_s=value)


def test_shared_memory_needs_a_process_group():
    from shardkit.shm_transport import SharedMemoryTransport
    assert not skdist.is_initialized()
    with pytest.raises(RuntimeError, match="SharedMemoryTransport.prepare needs torch.distri"):
        SharedMemoryTransport().prepare(None)


def test_resolve_transport_rejects_non_transports():
    assert isinstance(resolve_transport(None, "X"), ProcessGroupTransport)
    with pytest.raises(TypeError, match=r"X\(comm='nccl'\)"):
        resolve_transport("nccl", "X")
    assert isinstance(_make("process_group"), Transport)


# ---------------------------------------------------------------- mismatched operations


def _mismatched_ops():
    t = _make("shared_memory")
    t.prepare(None)
    x = torch.ones(64)
    try:
        if skdist.get_rank() == 0:
            t.all_gather(torch.empty(128), x, None).wait()
        else:
            t.reduce_scatter(torch.ones(128), None).wait()
    except RuntimeError as err:
        # the transport is broken from then on: a later op fails at once with the same error
        try:
            t.all_reduce(torch.ones(4), None).wait()
        except RuntimeError as again:
            return str(err), str(again) == str(err)
    return "no error", False


def _same_op_other_shape():
    """Ranks that agree on the op but not on its shape: a broadcast from different sources, a
    reduce-to-owners of different segment layouts with the same total, an all-reduce with
    different reductions. Each raises (one transport per case: an error breaks a transport
    for good)."""
    rank = skdist.get_rank()
    cases = {"broadcast": lambda t: t.broadcast(torch.ones(8), rank, None),
             "reduce": lambda t: t.reduce_to_owners(
                 [torch.ones(3), torch.ones(5)] if rank == 0 else [torch.ones(5), torch.ones(3)],
                 None),
             "all_reduce": lambda t: t.all_reduce(
                 torch.full((4,), rank + 1.0), None,
                 skdist.ReduceOp.SUM if rank == 0 else skdist.ReduceOp.MAX)}
    out = {}
    for name, issue in cases.items():
        t = _make("shared_memory")
        t.prepare(None)
        try:
            issue(t).wait()
            out[name] = "no error"
        except RuntimeError as err:
            out[name] = str(err)
        t.close()
    return out


def test_same_op_with_another_source_or_layout_raises(world2):
    for r in world2.run(_same_op_other_shape):
        assert "broadcast from group rank 0" in r["broadcast"], r
        assert "broadcast from group rank 1" in r["broadcast"], r
        assert r["reduce"].count("reduce (segment layout #") == 2, r
        # they used to finish with 3.0 on rank 0 and 2.0 on rank 1, and no error
        assert "all_reduce (SUM) of 16 bytes" in r["all_reduce"], r
        assert "all_reduce (MAX) of 16 bytes" in r["all_reduce"], r


def test_mismatched_operations_raise_on_every_rank_naming_both(world2):
    for message, sticky in world2.run(_mismatched_ops):
        assert "all_gather of 256 bytes of torch.float32" in message, message
        assert "reduce_scatter of 512 bytes of torch.float32" in message, message
        assert sticky


# ---------------------------------------------------------------- footprint and fallback


def _footprint():
    from shardkit.shm_transport import SharedMemoryTransport
    sizes = []
    for part in (4096, 1 << 16):
        t = SharedMemoryTransport(part_bytes=part)
        t.prepare(None)
        sizes.append(sum(x.numel() for x in t.footprint_tensors()))
        t.all_gather(torch.empty(2 * 100_000), torch.ones(100_000), None).wait()  # big op
        sizes.append(sum(x.numel() for x in t.footprint_tensors()))  # no growth
        t.close()
    maps = open("/proc/self/maps").read()
    return sizes, "/dev/shm/shardkit" in maps, "memfd:shardkit-transport" in maps


def test_footprint_is_fixed_and_nothing_lives_in_dev_shm(world2):
    for sizes, in_dev_shm, memfd in world2.run(_footprint):
        small, small_after, big, big_after = sizes
        assert small == small_after and big == big_after
        assert 3 * 2 * 4096 <= small <= 3 * 2 * 4096 + 8192
        assert 3 * 2 * (1 << 16) <= big <= 3 * 2 * (1 << 16) + 8192
        assert not in_dev_shm  # this rank maps no file of shardkit's from /dev/shm
        assert memfd


def _fallback_warns_once():
    import warnings
    from shardkit.shm_transport import SharedMemoryTransport
    t = SharedMemoryTransport()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.prepare(None)
        other = skdist.new_group([0])
        t.prepare(other)
        SharedMemoryTransport().prepare(None)  # another transport, the same reason: silent
    x = torch.arange(4.)
    out = torch.empty(4)
    t.all_gather(out, x, None).wait()  # a world of one: through the process group
    return [str(w.message) for w in caught], torch.equal(out, x), t.describe(None)


def test_unusable_shared_memory_warns_once_and_falls_back():
    with World(1) as world:
        messages, correct, described = world.run(_fallback_warns_once)[0]
    assert len(messages) == 1 and "process group" in messages[0], messages
    assert correct
    assert "shared memory unavailable" in described


def _no_memfd_on_rank0():
    """Rank 0 cannot create anonymous shared memory: every rank falls back, and the warning
    gives that reason (not a pid-namespace one)."""
    import os
    import warnings
    from shardkit.shm_transport import SharedMemoryTransport
    saved = os.memfd_create
    if skdist.get_rank() == 0:
        del os.memfd_create
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = SharedMemoryTransport(part_bytes=4096)
            t.prepare(None)
    finally:
        os.memfd_create = saved
    out = torch.empty(4)
    t.all_gather(out, torch.full((2,), float(skdist.get_rank())), None).wait()
    return [str(w.message) for w in caught], out.tolist(), t.describe(None)


def test_fallback_names_its_reason(world2):
    for messages, out, described in world2.run(_no_memfd_on_rank0):
        assert len(messages) == 1 and "no os.memfd_create" in messages[0], messages
        assert out == [0.0, 0.0, 1.0, 1.0] and "shared memory unavailable" in described


def _released():
    """close(), or dropping the transport, stops its worker and unmaps its slots; a tensor of
    the slots kept by the caller keeps them mapped (never dangling) until it goes."""
    import gc
    import threading
    from shardkit.shm_transport import SharedMemoryTransport

    def state():
        maps = open("/proc/self/maps").read().count("memfd:shardkit-transport")
        return maps, threading.active_count()

    gc.collect()  # what earlier checks in this rank left behind
    before = state()
    for _ in range(3):
        t = SharedMemoryTransport(part_bytes=4096)
        t.prepare(None)
        t.all_gather(torch.empty(8), torch.ones(4), None).wait()
    del t
    gc.collect()
    dropped = state()
    t = SharedMemoryTransport(part_bytes=4096)
    t.prepare(None)
    held = t.footprint_tensors()[0]
    t.close()
    t.close()
    closed_held = state() + (int(held[32:40].sum()),)
    del held
    gc.collect()
    return {"before": before, "dropped": dropped, "closed_held": closed_held,
            "after": state()}


def test_close_and_garbage_collection_release_the_slots(world2):
    for r in world2.run(_released):
        maps, threads = r["before"]
        assert r["dropped"] == (maps, threads), r
        assert r["closed_held"][:2] == (maps + 1, threads), r  # still mapped, worker stopped
        assert r["after"] == (maps, threads), r


def _used_after_close():
    """An operation after close() raises naming close(); prepare() again makes it work."""
    from shardkit.shm_transport import SharedMemoryTransport
    t = SharedMemoryTransport(part_bytes=4096, timeout_s=30)
    t.prepare(None)
    t.close()
    try:
        t.all_reduce(torch.ones(2), None)
        error = "no error"
    except RuntimeError as raised:
        error = str(raised)
    t.prepare(None)
    summed = t.all_reduce(torch.ones(2), None).wait().tolist()
    t.close()
    return error, summed


def test_an_operation_after_close_says_so_and_prepare_reopens(world2):
    """Before: "used on a process group it was not prepared for; the wrapper must call
    transport.prepare(group)", blaming the wrapper for the user's close()."""
    for error, summed in world2.run(_used_after_close):
        assert "after close()" in error and "prepare(group) again" in error, error
        assert summed == [2.0, 2.0]


# ---------------------------------------------------------------- one road


def _recording(kind):
    """A transport of ``kind`` that counts the broadcasts that went through it."""
    if kind == "shared_memory":
        from shardkit.shm_transport import SharedMemoryTransport as base
    else:
        base = ProcessGroupTransport

    class Recording(base):
        broadcasts = 0

        def broadcast(self, tensor, src, group):
            self.broadcasts += 1
            return super().broadcast(tensor, src, group)
    return Recording()


def _differing_model(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    model[1].running_mean.fill_(float(rank))
    return model


def _start_up_syncs_take_the_transport(kind):
    """Ranks built differently: ShardedDDP's start-up broadcast and sync_buffers(), and FSDP's
    sync_module_states, move rank 0's values through the wrapper's ``comm=``."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS
    rank = skdist.get_rank()
    expected = _differing_model(0).state_dict()
    out = {}
    comm = _recording(kind)
    model = _differing_model(rank)
    sdp = ShardedDataParallel(model, OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1,
                                         comm=comm), comm=comm)
    out["sharded_start"] = (comm.broadcasts, all(torch.equal(v, expected[k])
                                                 for k, v in model.state_dict().items()))
    model[1].running_mean.fill_(float(rank) + 5)
    before = comm.broadcasts
    sdp.sync_buffers()
    out["sharded_buffers"] = (comm.broadcasts - before,
                              bool((model[1].running_mean == 5.0).all()))
    comm.close()
    comm = _recording(kind)
    fsdp = FSDP(_differing_model(rank), comm=comm, sync_module_states=True)
    state = fsdp.state_dict()
    out["fsdp"] = (comm.broadcasts, all(torch.equal(state[k], v) for k, v in expected.items()))
    comm.close()
    return out


@pytest.mark.parametrize("kind", ["process_group", "shared_memory"])
def test_start_up_syncs_take_the_wrappers_transport(world2, kind):
    for out in world2.run(_start_up_syncs_take_the_transport, kind):
        for what, (broadcasts, synced) in out.items():
            assert broadcasts > 0 and synced, (what, out)


# ---------------------------------------------------------------- dead peers


def _killed_mid_step(kind):
    """Rank 1 SIGKILLs itself inside the second FSDP forward; rank 0 must raise quickly."""
    from shardkit.models import MLP
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.wrap import auto_wrap, transformer_auto_wrap_policy
    comm = _make(kind, part_bytes=1 << 16)
    model = FSDP(auto_wrap(MLP(64, 4, seed=0), transformer_auto_wrap_policy({torch.nn.Linear}),
                           comm=comm), comm=comm)
    calls = []

    def maybe_die(module, args):
        calls.append(1)
        if skdist.get_rank() == 1 and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    linears[2].register_forward_pre_hook(maybe_die)  # inside the third unit's forward
    start = time.monotonic()
    try:
        for _ in range(4):
            model(torch.randn(2, 64)).sum().backward()
    except Exception as err:  # noqa: BLE001 - what the survivor sees
        return f"{type(err).__name__}: {err}", time.monotonic() - start
    return "no error", time.monotonic() - start


def _killed_mid_setup():
    """Rank 1 SIGKILLs itself while mapping rank 0's shared memory."""
    from shardkit import shm_transport
    if skdist.get_rank() == 1:
        shm_transport._attach = lambda offer, size: os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        _make("shared_memory").prepare(None)
    except Exception as err:  # noqa: BLE001
        maps = open("/proc/self/maps").read()
        return f"{type(err).__name__}: {err}", time.monotonic() - start, \
            "/dev/shm/shardkit" in maps
    return "no error", time.monotonic() - start, False


def _pipeline_stage_killed_mid_step(phase):
    """A 1F1B pipeline of two stages; stage 1 SIGKILLs itself in its second step's forward
    (its peer waits for a gradient) or its first (its peer has sent, the header unread)."""
    from shardkit.nn.pipe import PipelineStage, Schedule1F1B, split_sequential
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    part = split_sequential(model, [2, 1])[skdist.get_rank()]
    schedule = Schedule1F1B(PipelineStage(part, skdist.get_rank(), 2), 2,
                            torch.nn.functional.mse_loss)
    steps = {"first": 0, "second": 1}[phase]
    if skdist.get_rank() == 1:
        calls = {"n": 0}

        def die_at_step(module, inputs):
            calls["n"] += 1
            if calls["n"] > 2 * steps:
                os.kill(os.getpid(), signal.SIGKILL)
        part.register_forward_pre_hook(die_at_step)
    try:
        for _ in range(3):
            schedule.step(torch.randn(4, 8), target=torch.randn(4, 4))
    except Exception as err:  # noqa: BLE001 - what the survivor sees
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize("phase", ["first", "second"])
def test_a_pipeline_stage_killed_is_an_error_naming_the_message(phase):
    text = _survivor_report(_pipeline_stage_killed_mid_step, phase)
    assert "rank 1 exited with code -9" in text, text
    survivor = text.split("--- rank 0 returned:")[1].split("--- rank 1")[0]
    assert "CollectiveError: pipeline receive of the gradient of stage 0's output" in survivor \
        and "from rank 1" in survivor and "a peer rank died" in survivor, survivor


def _killed_during_wrapper_setup(kind):
    """Rank 1 SIGKILLs itself while OSS is being built over the given transport."""
    from shardkit.models import MLP
    from shardkit.optim import OSS
    from shardkit.optim import oss_arguments
    if skdist.get_rank() == 1:  # dies at OSS's first collective, the cross-rank model check
        oss_arguments.check_same_model_on_every_rank = \
            lambda groups, group, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    try:
        OSS(MLP(16, 2).parameters(), optim=torch.optim.SGD, lr=0.1, comm=_make(kind))
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return "no error"


def _killed_while_lanes_open():
    """Rank 1 SIGKILLs itself instead of opening the lanes of a group with a 5 s timeout."""
    from shardkit import transport as T
    group = skdist.new_group([0, 1], timeout_s=5)
    if skdist.get_rank() == 1:
        T._open_lanes = lambda g: os.kill(os.getpid(), signal.SIGKILL)
    try:
        ProcessGroupTransport().prepare(group)
    except Exception as err:  # noqa: BLE001 - what the survivor sees
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_a_rank_killed_while_lanes_open_is_an_error_naming_the_call():
    """The survivor used to get only torch's DistStoreError naming the store keys it waited
    for ("wait timeout after 5000ms, keys: /default_pg/0//3d1e...")."""
    text = _survivor_report(_killed_while_lanes_open)
    survivor = text.split("--- rank 0 returned:")[1].split("--- rank 1")[0]
    assert "CollectiveError: new_group(ranks=[0, 1]) over process group (gloo), on rank 0 of 2" \
        in survivor and "a peer rank died" in survivor, survivor


def test_only_broken_links_become_collective_errors():
    from shardkit.distributed import CollectiveError, is_broken_link, reporting_broken_links
    from shardkit.transport import CommHandle
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    assert is_broken_link(reset) and is_broken_link(TimeoutError("timed out after 30 s"))
    assert not is_broken_link(RuntimeError("[gloo] tensors must have the same size"))
    with pytest.raises(CollectiveError, match="barrier over .*a peer rank died") as info:
        with reporting_broken_links("barrier"):
            raise reset
    assert info.value.__cause__ is reset
    with pytest.raises(ValueError, match="bad size"):  # a wrong call is not reworded
        with reporting_broken_links("barrier"):
            raise ValueError("bad size")

    class Broken:
        def wait(self):
            raise reset
    handle = CommHandle([Broken()])
    handle.describe = lambda: "all_gather over process group (gloo), on rank 0 of 2,"
    with pytest.raises(CollectiveError, match="^all_gather over process group"):
        handle.wait()


def _survivor_report(fn, *args) -> str:
    """Run ``fn`` in a fresh world of 2 in which rank 1 is killed; return the harness's report,
    which holds what rank 0 returned (it has 5 s after rank 1's death to do so)."""
    with World(2, timeout=120) as world:
        with pytest.raises(Exception) as info:
            world.run(fn, *args)
    return str(info.value)


@pytest.mark.parametrize("kind", ["process_group", "shared_memory"])
def test_a_rank_killed_mid_step_is_an_error_on_its_peer(kind):
    text = _survivor_report(_killed_mid_step, kind)
    assert "rank 1 exited with code -9" in text, text
    assert "--- rank 0 returned" in text, text  # rank 0 raised and returned, no hang
    survivor = text.split("--- rank 0 returned:")[1].split("--- rank 1")[0]
    assert "no error" not in survivor, survivor
    if kind == "shared_memory":
        assert "rank(s) [1]" in survivor and "exited" in survivor, survivor
    else:  # gloo says only "Connection reset by peer": the error names shardkit's operation
        assert "CollectiveError: all_gather" in survivor and "a peer rank died" in survivor, \
            survivor


def test_a_rank_killed_mid_setup_is_an_error_on_its_peer():
    text = _survivor_report(_killed_mid_setup)
    assert "rank 1 exited with code -9" in text, text
    survivor = text.split("--- rank 0 returned:")[1].split("--- rank 1")[0]
    assert "no error" not in survivor and "True)" not in survivor, survivor


@pytest.mark.parametrize("kind", ["process_group", "shared_memory"])
def test_a_rank_killed_while_a_wrapper_is_built_is_an_error_on_its_peer(kind):
    text = _survivor_report(_killed_during_wrapper_setup, kind)
    assert "rank 1 exited with code -9" in text, text
    survivor = text.split("--- rank 0 returned:")[1].split("--- rank 1")[0]
    assert "no error" not in survivor, survivor
    # OSS's first collective, the cross-rank model check, is the process group's on either kind
    assert "CollectiveError: all_gather_object over process group" in survivor, survivor
