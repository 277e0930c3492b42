"""``benchmarks/run.py`` and ``benchmarks.common.measure_side_by_side`` on the quick workloads in
one world of 2: every configuration timed once per round, shardkit's counted bytes and model
states at their formulas, a configuration that cannot be built reported on its own row, and the
ratios paired round by round. No timing is asserted."""

import dataclasses
import os

import pytest

from benchmarks import bench_phases, common, run
from shardkit.testing import world_fixture

world2 = world_fixture(2)
CONFIGS = ["torch_ddp", "shardkit_oss", "shardkit_sharded", "shardkit_fsdp", "cannot_build"]


def _refuse(workload, model, comm=None):
    raise RuntimeError("this configuration cannot be built")


def _measure():
    common.CONFIG_BY_NAME["cannot_build"] = dataclasses.replace(
        common.CONFIG_BY_NAME["torch_ddp"], name="cannot_build", setup=_refuse)
    return common.measure_side_by_side(CONFIGS, "mlp", quick=True, warmup=1, rounds=3, steps=1)


@pytest.fixture(scope="module")
def measured(world2):
    return world2.run(_measure)


def test_every_configuration_is_timed_once_per_round(measured):
    for per_rank in measured:
        for name in CONFIGS[:-1]:
            times = per_rank[name]["round_times_s"]
            assert len(times) == 3 and all(t > 0 for t in times), (name, times)


def test_counted_bytes_and_states_are_at_the_formulas(measured):
    for per_rank in measured:
        for name in ("shardkit_oss", "shardkit_sharded", "shardkit_fsdp"):
            r = per_rank[name]
            assert r["comm_bytes_per_step"] == pytest.approx(r["comm_formula_bytes"], rel=0.05)
            assert r["model_state_bytes"] == pytest.approx(r["model_state_formula_bytes"],
                                                           rel=0.01)
            assert r["transport"] == "process group (gloo)"


def test_a_configuration_that_cannot_be_built_fails_alone(measured):
    for per_rank in measured:
        assert per_rank["cannot_build"] == {
            "error": "RuntimeError: this configuration cannot be built"}


def test_rows_are_paired_with_their_baselines_round_by_round(measured):
    workload = common.workloads(True)["mlp"]
    rows = [run.summarize_row(workload, common.CONFIG_BY_NAME[name],
                              [per_rank[name] for per_rank in measured])
            for name in CONFIGS[:-1]]
    run.add_ratios(rows)
    by_name = {r["config"]: r for r in rows}
    ddp, oss = by_name["torch_ddp"], by_name["shardkit_oss"]
    assert ddp["ratio_to_ddp"] == 1.0
    expected = sorted(t / b for t, b in zip(oss["round_ms"], ddp["round_ms"]))[1]
    assert oss["ratio_to_ddp"] == pytest.approx(expected)
    per_rank_times = [p["shardkit_oss"]["round_times_s"] for p in measured]
    slowest = [max(ts) * 1e3 for ts in zip(*per_rank_times)]
    assert oss["round_ms"] == pytest.approx(slowest)  # a step lasts as long as the slowest rank


def test_shardkit_bench_command_runs_this_runner(capsys, tmp_path):
    """DESIGN.md's `python -m shardkit bench` is benchmarks.run from a source checkout, and a
    clear exit 2 where the benchmarks are not importable (an installed package)."""
    import subprocess
    import sys
    from shardkit.__main__ import main
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0 and "--repeats" in capsys.readouterr().out
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "shardkit", "bench", "--quick"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "source checkout" in proc.stderr and "Traceback" not in proc.stderr


def test_phases_of_a_step_add_up_on_every_rank(world2):
    """bench_phases: forward, backward and step timed on each rank, summing to the step."""
    per_rank = world2.run(bench_phases.measure, "mlp", ["torch_ddp", "shardkit_oss"], 2, 1,
                          True)
    for results in per_rank:
        assert set(results) == {"torch_ddp", "shardkit_oss"}
        for phases in results.values():
            assert all(phases[p] > 0 for p in bench_phases.PHASES), phases
            parts = phases["forward"] + phases["backward"] + phases["step"]
            assert parts == pytest.approx(phases["total"], rel=0.5), phases


def test_phases_refuse_a_pipeline_configuration_naming_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        bench_phases.main(["--configs", "torch_pipelining"])
    assert "not timed here; valid (data-parallel configurations): torch_ddp" in \
        capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats 0"),  # 0 became the default and a 12-round run started
    (["--steps", "0"], "--steps 0"),
    (["--workloads", "foo"], "--workloads: unknown ['foo']"),
    (["--configs", "nope"], "--configs: unknown ['nope']"),
])
def test_bad_arguments_exit_2_naming_the_argument(capsys, argv, message):
    from benchmarks import run
    with pytest.raises(SystemExit) as exit_info:
        run.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_out_naming_a_file_exits_2(capsys, tmp_path):
    from benchmarks import run
    path = tmp_path / "afile"
    path.write_text("")
    with pytest.raises(SystemExit) as exit_info:  # a FileExistsError traceback before
        run.parse_args(["--quick", "--out", str(path)])
    assert exit_info.value.code == 2 and "a file is there" in capsys.readouterr().err
