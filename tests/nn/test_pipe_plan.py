"""Schedules as action lists: well formed, deadlock found on a broken list, bubble vs formula."""

import pytest

from shardkit.nn.pipe.plan import (Action, PipelineDeadlock, PipelinePlan, gpipe_plan,
                                   interleaved_1f1b_plan, loop_placement, one_f_one_b_plan,
                                   v_placement, zb_h1_plan, zbv_plan)

GRID = [(p, m) for p in (2, 4) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("p,m", GRID)
def test_bubble_matches_the_formulas(p, m):
    # unit costs F = B = W = 1 (BW = 2): the classic formulas hold exactly
    for plan in (gpipe_plan(p, m), one_f_one_b_plan(p, m)):
        run = plan.dry_run()
        assert run.idle_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert run.makespan == 3 * (m + p - 1)
    for v in (2, 3):
        run = interleaved_1f1b_plan(p, m, v).dry_run()  # a chunk is 1/v of a stage
        assert run.idle_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    zb = zb_h1_plan(p, m).dry_run()
    assert zb.makespan == 3 * m + p - 1  # bubble (p-1)(F+B-W): a third of 1F1B's
    assert zb.idle_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    zbv = zbv_plan(p, m).dry_run()  # half-size stages: 6m units of work per rank
    assert zbv.idle_fraction < zb.idle_fraction
    assert zbv.makespan - 6 * m <= 3 * (p - 1) / 2 + 1  # below half of ZB-H1's (p-1) bubble, in
    # half-stage units (p-1 full-stage units), plus one unit of slack


@pytest.mark.parametrize("p,m", GRID)
def test_live_microbatches_stay_within_the_stated_bounds(p, m):
    assert one_f_one_b_plan(p, m).dry_run().peak_live == [min(p - r, m) for r in range(p)]
    assert gpipe_plan(p, m).dry_run().peak_live == [m] * p
    assert max(zb_h1_plan(p, m).dry_run().peak_live) <= p
    assert max(zbv_plan(p, m).dry_run().peak_live) <= 2 * p  # half-size: 1F1B's bytes
    v = 2
    peaks = interleaved_1f1b_plan(p, m, v).dry_run().peak_live
    assert all(peaks[r] <= (v - 1) * p + 2 * (p - 1 - r) + 1 for r in range(p))


def test_interleaved_1f1b_takes_chunks_that_are_not_a_multiple_of_the_ranks():
    # rounds of g = m / max(1, m // p) micro-batches (torch's flexible rule): every such plan is
    # well formed, runs without deadlock and keeps (v-1)*g + 2*(p-1-r) + 1 alive at most
    for p in (2, 3, 4, 8):
        for m in range(1, 3 * p + 1):
            g = m // max(1, m // p)
            if m % max(1, m // p):
                continue
            for v in (2, 3):
                plan = interleaved_1f1b_plan(p, m, v)
                assert plan.problems() == [], (p, m, v)
                peaks = plan.dry_run().peak_live
                assert all(peaks[r] <= (v - 1) * g + 2 * (p - 1 - r) + 1 for r in range(p))
    assert interleaved_1f1b_plan(4, 6, 2).format().splitlines()[1].startswith(
        "rank 0: F0.0 F0.1 F0.2 F0.3 F0.4 F0.5 F4.0")  # one round of 6


def test_a_broken_list_is_reported_as_a_deadlock():
    good = one_f_one_b_plan(2, 2)
    # rank 0 runs a backward before the forward it belongs to: malformed, found before running
    rank0 = (Action("BW", 0, 0), Action("F", 0, 0), Action("F", 0, 1), Action("BW", 0, 1))
    broken = PipelinePlan("broken", good.placement, 2, (rank0, good.orders[1]))
    assert broken.problems() == ["stage 0, micro-batch 0: F before BW is not respected"]
    reordered = (Action("F", 0, 0), Action("BW", 0, 1), Action("F", 0, 1), Action("BW", 0, 0))
    with pytest.raises(ValueError, match="F before BW"):
        PipelinePlan("bad", good.placement, 2, (reordered, good.orders[1])).dry_run()
    # a real cross-rank deadlock: rank 1 insists on micro-batch 1 first, rank 0 waits on 0's grad
    rank0 = (Action("F", 0, 0), Action("BW", 0, 0), Action("F", 0, 1), Action("BW", 0, 1))
    rank1 = (Action("F", 1, 1), Action("BW", 1, 1), Action("F", 1, 0), Action("BW", 1, 0))
    with pytest.raises(PipelineDeadlock) as err:
        PipelinePlan("crossed", good.placement, 2, (rank0, rank1)).dry_run()
    assert "rank 0 stops at BW0.0, waiting for BW1.0 on rank 1" in str(err.value)
    assert "rank 1 stops at F1.1, waiting for F0.1 on rank 0" in str(err.value)


def test_plans_are_printable_with_their_communication():
    text = zbv_plan(2, 2).format(communication=True)
    assert text.splitlines()[0] == "ZBV: 4 stages on 2 ranks, 2 micro-batches"
    assert "send_F0.0>r1" in text and "recv_B0.0<r1" in text
    assert "send_F1.0" not in text  # stages 1 and 2 share rank 1: handed over locally
    assert one_f_one_b_plan(2, 2).format() == ("1F1B: 2 stages on 2 ranks, 2 micro-batches\n"
                                               "rank 0: F0.0 F0.1 BW0.0 BW0.1\n"
                                               "rank 1: F1.0 BW1.0 F1.1 BW1.1")


def test_placements_and_bad_sizes():
    assert loop_placement(4, 2) == (0, 1, 0, 1)
    assert v_placement(3) == (0, 1, 2, 2, 1, 0)
    with pytest.raises(ValueError, match=r"chunks=9 on ranks=4 gives 2 rounds, which do not "
                                         r"divide the chunks; use chunks=8 or 10"):
        interleaved_1f1b_plan(4, 9, 2)
    with pytest.raises(ValueError, match=r"zb_h1_plan\(chunks=0\)"):
        zb_h1_plan(2, 0)


def test_the_classic_schedules_are_plans():
    from shardkit.nn.pipe.plan_schedules import Schedule1F1B, ScheduleGPipe

    for cls, make in ((ScheduleGPipe, gpipe_plan), (Schedule1F1B, one_f_one_b_plan)):
        for p, m in GRID:
            schedule = cls.__new__(cls)
            schedule.num_stages = p
            assert schedule.build_plan(p, m) == make(p, m)
