"""Collective debug mode: ranks about to issue different collectives raise on every rank, with
both call sites, instead of hanging or exchanging the wrong tensors; correct programs give the
same results and the same counted traffic with the mode on."""

import os
import subprocess
import sys

import torch

from shardkit import distributed
from shardkit.collective_check import CollectiveMismatchError, set_debug_collectives
from shardkit.testing import world_fixture

world2 = world_fixture(2)


def _with_debug(body):
    set_debug_collectives(True)
    try:
        return body()
    except CollectiveMismatchError as e:
        return str(e)
    finally:
        set_debug_collectives(False)


def _extra_all_gather():
    def body():
        x = torch.ones(4)
        if distributed.get_rank() == 0:
            out = torch.empty(8)
            distributed.all_gather_into_tensor(out, x)  # EXTRA-ALL-GATHER
        distributed.all_reduce(x)  # EVERYONE-ALL-REDUCE
        return "no error"
    return _with_debug(body)


def _line_of(marker):
    with open(__file__) as f:
        for number, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return number


def test_extra_all_gather_is_caught_on_every_rank_naming_both_call_sites(world2):
    gather_site = f"test_collective_check.py:{_line_of('# EXTRA-ALL-GATHER')}"
    reduce_site = f"test_collective_check.py:{_line_of('# EVERYONE-ALL-REDUCE')}"
    for message in world2.run(_extra_all_gather):
        assert "collective mismatch in the group of ranks [0, 1]" in message
        assert "rank 0: all_gather(shape=[8], dtype=float32) #0 at" in message
        assert "rank 1: all_reduce(op=SUM, shape=[4], dtype=float32) #0 at" in message
        assert gather_site in message and reduce_site in message
    # The check ran before the real collectives: the world is still in step.
    assert world2.run(_matching_program) == [_expected_matching()] * 2


def _shape_mismatch():
    return _with_debug(lambda: distributed.all_reduce(torch.ones(3 + distributed.get_rank())))


def test_same_op_with_different_shapes_is_caught(world2):
    for message in world2.run(_shape_mismatch):
        assert "rank 0: all_reduce(op=SUM, shape=[3]" in message
        assert "rank 1: all_reduce(op=SUM, shape=[4]" in message


def _reduction_or_root_mismatch(case):
    """Same op, shape and dtype on both ranks; only the reduction or the root differs (gloo
    would reduce with each rank's own op, or hang with two sources, without an error)."""
    from torch.distributed import ReduceOp

    def body():
        rank = distributed.get_rank()
        x = torch.full((4,), float(rank + 1))
        op = ReduceOp.MAX if rank else ReduceOp.SUM
        if case == "all_reduce":
            distributed.all_reduce(x, op=op)
        elif case == "reduce_scatter":
            distributed.reduce_scatter_tensor(torch.empty(2), x, op=op)
        elif case == "reduce":
            distributed.reduce(x, dst=rank)
        elif case == "broadcast":
            distributed.broadcast(x, src=rank)
        else:
            distributed.broadcast_object({"rank": rank}, src=rank)
        return "no error"
    return _with_debug(body)


def test_a_different_reduction_or_root_is_caught_before_the_collective(world2):
    expected = {"all_reduce": ("all_reduce(op=SUM,", "all_reduce(op=MAX,"),
                "reduce_scatter": ("reduce_scatter(op=SUM,", "reduce_scatter(op=MAX,"),
                "reduce": ("reduce(op=SUM, dst=0,", "reduce(op=SUM, dst=1,"),
                "broadcast": ("broadcast(src=0,", "broadcast(src=1,"),
                "broadcast_object": ("broadcast(src=0,", "broadcast(src=1,")}
    for case, (first, second) in expected.items():
        for message in world2.run(_reduction_or_root_mismatch, case):
            assert "its reduction or root" in message, (case, message)
            assert f"rank 0: {first}" in message and f"rank 1: {second}" in message, message
        # nothing was sent: the world is still in step
        assert world2.run(_matching_program) == [_expected_matching()] * 2


def _matching_program():
    def body():
        rank = distributed.get_rank()
        with distributed.CommCounter() as comm:
            x = torch.full((4,), float(rank + 1))
            distributed.all_reduce(x)
            out = torch.empty(8)
            distributed.all_gather_into_tensor(out, torch.full((4,), float(rank)))
            distributed.broadcast(x, src=1)
            objs = distributed.all_gather_object({"rank": rank})
            distributed.barrier()
        return x.tolist(), out.tolist(), objs, comm.calls_by_op
    return _with_debug(body)


def _expected_matching():
    return ([3.0] * 4, [0.0] * 4 + [1.0] * 4, [{"rank": 0}, {"rank": 1}],
            {"all_reduce": 1, "all_gather": 2, "broadcast": 1, "barrier": 1})


def test_matching_collectives_give_the_same_results_and_counted_traffic(world2):
    assert world2.run(_matching_program) == [_expected_matching()] * 2


def test_environment_variable_turns_the_mode_on():
    code = ("from shardkit import collective_check as c, distributed as d; "
            "print(c.debug_collectives_enabled(), "
            "d.set_debug_collectives is c.set_debug_collectives)")
    for value, expected in (("1", "True True"), ("0", "False True")):
        env = dict(os.environ, SHARDKIT_DEBUG_COLLECTIVES=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.stdout.strip() == expected, out.stderr


# The default transport builds its collectives from point-to-point sends on gloo; the debug
# mode compares their logical shape and dtype too (a batch's own send sizes legitimately differ).

def _transport_mismatch(case):
    from shardkit.transport import ProcessGroupTransport
    comm = ProcessGroupTransport()
    rank = distributed.get_rank()
    extra = 2 * rank  # rank 1's tensors are larger than rank 0's

    def body():
        if case == "all_gather":
            comm.all_gather(torch.empty(2 * (4 + extra)), torch.ones(4 + extra), None).wait()
        elif case == "all_gather_chunks":
            fulls = [torch.empty(6 + extra), torch.empty(4)]
            comm.all_gather_chunks(fulls, [torch.ones(3 + extra // 2), torch.ones(2)],
                                   None).wait()
        elif case == "reduce_scatter":
            comm.reduce_scatter(torch.ones(4 + extra), None).wait()
        elif case == "reduce_scatter_chunks":
            comm.reduce_scatter_chunks([torch.ones(6 + extra)], [3 + extra // 2], None).wait()
        elif case == "reduce_to_owners":
            comm.reduce_to_owners([torch.ones(3), torch.ones(3 + extra)], None).wait()
        elif case == "dtype":
            dtype = torch.float32 if rank == 0 else torch.float64
            comm.all_gather(torch.empty(8, dtype=dtype), torch.ones(4, dtype=dtype), None).wait()
        return "no error"
    return _with_debug(body)


def test_transport_collectives_of_different_sizes_are_caught_before_any_send(world2):
    expected = {"all_gather": ("all_gather(shape=[8]", "all_gather(shape=[12]"),
                "all_gather_chunks": ("all_gather(shape=[10]", "all_gather(shape=[12]"),
                "reduce_scatter": ("reduce_scatter(shape=[4]", "reduce_scatter(shape=[6]"),
                "reduce_scatter_chunks": ("reduce_scatter(shape=[6]",
                                          "reduce_scatter(shape=[8]"),
                "reduce_to_owners": ("reduce(shape=[6]", "reduce(shape=[8]"),
                "dtype": ("all_gather(shape=[8], dtype=float32)",
                          "all_gather(shape=[8], dtype=float64)")}
    for case, (rank0, rank1) in expected.items():
        for message in world2.run(_transport_mismatch, case):
            assert f"rank 0: {rank0}" in message, (case, message)
            assert f"rank 1: {rank1}" in message, (case, message)
    # every check ran before its sends: the world is still in step
    assert world2.run(_matching_program) == [_expected_matching()] * 2


def _transport_matching():
    from shardkit.transport import ProcessGroupTransport
    comm = ProcessGroupTransport()
    rank = distributed.get_rank()

    def body():
        out = comm.all_gather(torch.empty(6), torch.full((3,), float(rank)), None).wait()
        fulls = [torch.empty(5), torch.empty(2)]  # uneven: rank 1 sends 2 of its 3, and 1
        comm.all_gather_chunks(fulls, [torch.full((3,), float(rank)),
                                       torch.full((1,), float(rank))], None).wait()
        reduced = comm.reduce_scatter_chunks([torch.arange(5.0)], [3], None, scale=0.5).wait()
        owned = comm.reduce_to_owners([torch.ones(2), torch.ones(3)], None).wait()
        return out.tolist(), [f.tolist() for f in fulls], reduced.tolist(), owned.tolist()
    return _with_debug(body)


def test_matching_transport_collectives_pass_the_check_with_uneven_chunks(world2):
    results = world2.run(_transport_matching)
    assert results[0] == ([0.0] * 3 + [1.0] * 3, [[0.0] * 3 + [1.0] * 2, [0.0, 1.0]],
                          [0.0, 1.0, 2.0], [2.0, 2.0])
    assert results[1][:2] == results[0][:2]
    assert results[1][2] == [3.0, 4.0, 0.0] and results[1][3] == [2.0, 2.0, 2.0]
