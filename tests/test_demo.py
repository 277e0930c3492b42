"""``python -m shardkit demo`` end to end: a tiny run of every live configuration through
torchrun, checked from its JSON (model states against the ZeRO formulas for the measured Ψ and
N, one final loss across the data-parallel stages, DDP's traffic counted exactly), and its
refusals of bad input (exit code 2, one line, no traceback)."""

import json
import os
import subprocess
import sys

import pytest

from shardkit import demo, plan, recipes
from shardkit.models import GPT


_REFUSAL = [sys.executable, "-m", "shardkit", "demo", "--world-size", "64"]


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    """One demo launch for the whole module: world 2, small model, 3 steps. The command-line
    refusal's process runs beside it (both are mostly imports); its result is kept for
    ``test_command_line_refusal_has_no_traceback`` in ``tiny_demo_refusal``."""
    out = tmp_path_factory.mktemp("demo")
    refusal = subprocess.Popen(_REFUSAL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        proc = subprocess.run([sys.executable, "-m", "shardkit", "demo", "--world-size", "2",
                               "--steps", "3", "--model", "small", "--out", str(out)],
                              capture_output=True, text=True, timeout=600)
        stdout, stderr = refusal.communicate(timeout=120)
    finally:
        if refusal.poll() is None:
            refusal.kill()
            refusal.communicate()
    _refusal_result.append(subprocess.CompletedProcess(_REFUSAL, refusal.returncode, stdout,
                                                       stderr))
    with open(out / "demo.json") as f:
        report = json.load(f)
    return proc, report, out


_refusal_result = []  # the refusal run beside tiny_demo, when that fixture ran


def _rows(report, status="ok"):
    return [r for r in report["runs"] if r["status"] == status]


def test_demo_runs_end_to_end_and_writes_its_figures(tiny_demo):
    proc, report, out = tiny_demo
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not _rows(report, "failed")
    # A run skipped because its wrapper does not import is a failure of this test too.
    assert not _rows(report, "skipped"), _rows(report, "skipped")
    assert [r["name"] for r in report["runs"]] == [r.name for r in demo.RUNS]
    assert report["world_size"] == 2 and report["steps"] == 3
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    chart = json.loads((out / "demo.chart.json").read_text())
    assert [g["label"] for g in chart["groups"]] == [r["label"] for r in _rows(report)]
    assert "torch DDP" in proc.stdout and "final loss" in proc.stdout
    ddp = _rows(report)[0]
    assert ddp["name"] == "ddp" and ddp["step_time_ratio_to_ddp"] == 1.0


def test_data_parallel_model_states_follow_the_zero_formulas(tiny_demo):
    _, report, _ = tiny_demo
    psi = sum(p.numel() for p in GPT(demo.MODELS["small"]).parameters())
    n = report["world_size"]
    formula = {s: plan.zero_model_state_bytes(psi, n, s, plan.FP32_ADAMW) for s in range(4)}
    assert formula[1] == 8 * psi + 8 * psi / n  # fp32 AdamW: W = G = 4, K = 8
    checked = set()
    for row in _rows(report):
        if row["stage"] is None:
            continue
        assert row["params_per_rank"] == [psi] * n
        for measured in row["model_state_bytes"]:
            assert measured["total"] == pytest.approx(formula[row["stage"]], rel=0.05), row["name"]
        checked.add(row["stage"])
    assert 0 in checked


def test_final_loss_is_identical_across_data_parallel_stages(tiny_demo):
    _, report, _ = tiny_demo
    dp = [r for r in _rows(report) if r["stage"] is not None]
    ddp_losses = dp[0]["losses"]
    for row in dp[1:]:
        assert row["losses"] == pytest.approx(ddp_losses, rel=1e-5, abs=0), row["name"]
    assert report["final_loss_spread_data_parallel"] <= 1e-5 * ddp_losses[-1]
    for row in _rows(report):
        if row["stage"] is None:  # the pipeline averages micro-batch losses: close, not equal
            assert row["final_loss"] == pytest.approx(ddp_losses[-1], rel=1e-4)


def test_counted_traffic_follows_the_plan_formulas(tiny_demo):
    """CommCounter against shardkit.plan: DDP and the pipeline exactly, the sharded stages
    within their flat buffers' padding (stage 1 is 3Ψ(N-1)/N: all-reduce + parameter sync)."""
    _, report, _ = tiny_demo
    ddp = _rows(report)[0]
    assert ddp["comm_bytes_per_step"] == pytest.approx(ddp["comm_formula_bytes_per_step"])
    checked = set()
    for row in _rows(report):
        exact = row["stage"] in (0, None)
        for counted, formula in zip(row["comm_bytes_per_step"],
                                    row["comm_formula_bytes_per_step"]):
            assert counted > 0, row["name"]
            assert counted == pytest.approx(formula, rel=0 if exact else 0.01), row["name"]
        checked.add(row["stage"])
    assert checked == {0, 1, 2, 3, None}


def _demo(capsys, *argv):
    code = demo.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (["--world-size", str(4 * (os.cpu_count() or 1) + 1)], "larger than this machine allows"),
    (["--world-size", "0"], "--world-size 0"),
    (["--model", "huge"], "--model 'huge' is unknown"),
    (["--runs", "ddp,7"], "'7' is not a known run or stage"),
    (["--world-size", "2", "--batch", "3"], "--batch 3"),
    (["--steps", "0"], "--steps 0"),
    (["--seed", str(2**64)], "--seed 18446744073709551616 is out of range"),
])
def test_bad_input_exits_2_before_launching(capsys, argv, message):
    code, out, err = _demo(capsys, *argv)
    assert code == 2
    assert message in err and "Traceback" not in err and out == ""


def test_command_line_refusal_has_no_traceback():
    proc = _refusal_result[0] if _refusal_result else \
        subprocess.run(_REFUSAL, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "larger than this machine allows" in proc.stderr and "Traceback" not in proc.stderr


def test_pipeline_balance_and_chunks():
    assert recipes.balance_by_params([_Sized(1), _Sized(1), _Sized(1), _Sized(1)], 2) == [2, 2]
    assert recipes.balance_by_params([_Sized(10), _Sized(1), _Sized(1), _Sized(10)], 2) == [2, 2]
    assert sum(recipes.balance_by_params([_Sized(5)] * 5, 4)) == 5
    assert recipes.pipeline_chunks(8, 2) == 4 and recipes.pipeline_chunks(6, 4) == 6
    with pytest.raises(ValueError, match="needs at least 3 layers"):
        recipes.balance_by_params([_Sized(1), _Sized(1)], 3)


class _Sized:
    def __init__(self, n):
        import torch
        self._p = [torch.nn.Parameter(torch.zeros(n))]

    def parameters(self):
        return iter(self._p)


def test_a_failed_run_is_reported_and_the_rest_still_run(tmp_path, monkeypatch):
    """run_all relaunches for the runs after a failure and names the root-cause rank error."""
    launches = []

    def fake_launch(req, names, log):
        launches.append(list(names))
        runs = tmp_path / "runs"
        for name in names:
            if name == "sharded_ddp":
                (runs / "sharded_ddp.rank0.error").write_text(
                    "Traceback\nRuntimeError: Connection closed by peer")
                (runs / "sharded_ddp.rank1.error").write_text("Traceback\nValueError: boom")
                return 1
            (runs / f"{name}.json").write_text(json.dumps([{"rank": 0}]))
        return 0

    monkeypatch.setattr(demo, "launch_workers", fake_launch)
    req = demo.DemoRequest(world_size=2, steps=1, model="small", batch=8,
                           runs=("ddp", "sharded_ddp", "fsdp"), out=str(tmp_path), seed=0,
                           timeout=10.0)
    results = demo.run_all(req, ["ddp", "sharded_ddp", "fsdp"])
    assert launches == [["ddp", "sharded_ddp", "fsdp"], ["fsdp"]]
    assert results["ddp"] == [{"rank": 0}] and results["fsdp"] == [{"rank": 0}]
    assert results["sharded_ddp"] == {"error": "rank1: ValueError: boom"}
