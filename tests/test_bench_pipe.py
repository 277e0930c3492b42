"""``benchmarks/bench_pipe.py``'s command line and report, from a made-up result dict (no ranks
are started): default output per launch, bad flags refused by name, the report naming its
launch, link rate and load, failed rows, and the link columns only on the cluster."""

import os

import pytest

from benchmarks import bench_pipe


def test_default_out_depends_on_the_launch():
    local = bench_pipe.parse_args([])
    assert local.out.endswith(os.path.join("results", "pipe.md"))
    assert (local.cluster, local.steps, local.rounds, local.workloads) == (
        None, 4, 2, ["mlp", "gpt"])
    cluster = bench_pipe.parse_args(["--cluster", "1gbit", "--workloads", "mlp"])
    assert cluster.out.endswith(os.path.join("results", "pipe_cluster_1gbit.md"))
    assert bench_pipe.parse_args(["--cluster", "10gbit", "--out", "/tmp/x.md"]).out == "/tmp/x.md"


@pytest.mark.parametrize("argv, named", [
    (["--cluster", "fast"], "--cluster"),
    (["--workloads", "mlp,resnet"], "--workloads"),
    (["--steps", "0"], "--steps"),
])
def test_bad_flags_are_refused_by_name(capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        bench_pipe.parse_args(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def _fake_results(with_link: bool) -> dict:
    """Two rounds of the MLP's configurations: every shardkit row 0.1 s/step against torch's
    0.2; torch's ZBV failed in both rounds."""
    names = list(bench_pipe.configs("mlp"))
    table = {key: {} for key in ("seconds", "cpu", "idle", "link_tx")}
    for name in names:
        failed = name == "torch ZBV"
        step = float("nan") if failed else (0.2 if name.startswith("torch") else 0.1)
        table["seconds"][name] = [step, step]
        table["cpu"][name] = [step, step]
        busy = name.startswith("shardkit")
        table["idle"][name] = (["failed: ValueError: cannot run"] * 2 if failed
                               else [0.25, 0.3] if busy else [None, None])
        table["link_tx"][name] = [250_000.0, 250_000.0] if with_link and not failed else [None] * 2
    return {"mlp": table}


def _row(text: str, name: str) -> list:
    line = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_report_of_the_cluster_launch():
    launch = {"kind": "cluster", "link_rate": "1gbit", "load_start": 1.5, "load_end": 2.5,
              "cpus": 2, "hosts": ["node0", "node1"]}
    text = bench_pipe.report(_fake_results(with_link=True), 4, 2, launch)
    assert "simulated cluster at 1gbit" in text.splitlines()[0]
    assert "node0, node1" in text and "limited to 1gbit" in text
    assert "at the start: 1.5, at the end: 2.5 on 2 CPUs" in text
    row = _row(text, "shardkit 1F1B")
    assert row[4:6] == ["2.00x", "1.00x"]  # against torch's 1F1B, against itself
    assert row[7] == "0.25"                  # the round with the least idle
    assert row[-2:] == ["0.25", "2.0%"]     # 0.25 MB; 250 kB x 8 / 1 Gbit/s / 0.1 s
    assert _row(text, "torch ZBV")[7].startswith("failed: ValueError")
    assert _row(text, "shardkit ZBV")[4] == ""  # nothing to compare with


def test_report_of_the_local_launch_has_no_link_columns():
    launch = {"kind": "local", "link_rate": None, "load_start": 0.5, "load_end": 0.7,
              "cpus": 2}
    text = bench_pipe.report(_fake_results(with_link=False), 4, 2, launch)
    assert "Launch: local" in text and "shardkit.testing.World" in text
    assert "link busy" not in text
    assert len(_row(text, "shardkit 1F1B")) == 9


def test_measure_with_a_fake_launch():
    """measure() takes the slowest rank, the busier node's link bytes, and records a
    configuration that raised on a rank as failed, whichever launch ran it."""
    calls = []

    def run(fn, workload, name, steps):
        calls.append(name)
        if name == "torch ZBV":
            raise RuntimeError("rank 1 raised:\nValueError: cannot run this case")
        if name == bench_pipe.SINGLE:
            return [(0.3, 0.3, None, 10.0), None]
        busy = 0.05 if name.startswith("shardkit") else None
        return [(0.1, 0.08, busy, 100.0), (0.2, 0.09, busy, 300.0)]

    results = bench_pipe.measure(run, ["mlp"], steps=3, rounds=2)["mlp"]
    names = list(bench_pipe.configs("mlp"))
    assert calls == names + names  # interleaved rounds, same order each round
    assert results["seconds"]["shardkit 1F1B"] == [0.2, 0.2]
    assert results["cpu"]["shardkit 1F1B"] == [0.09, 0.09]
    assert results["idle"]["shardkit 1F1B"] == [pytest.approx(0.75)] * 2
    assert results["idle"]["torch 1F1B"] == [None, None]
    assert results["link_tx"]["shardkit 1F1B"] == [300.0, 300.0]
    assert results["link_tx"][bench_pipe.SINGLE] == [10.0, 10.0]
    assert results["idle"]["torch ZBV"] == ["failed: ValueError: cannot run this case"] * 2
    assert results["link_tx"]["torch ZBV"] == [None, None]
