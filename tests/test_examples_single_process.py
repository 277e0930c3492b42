"""What a user meets first: the example programs run as plain ``python examples/X.py`` (no
torchrun, no RANK/MASTER_* variables) train in one process, as ``shardkit.initialize`` does,
instead of stopping at ``init_distributed``'s missing-variables error; and the main job's
progress bar shows the same step time as its table."""

import os
import re
import subprocess
import sys

import pytest

from shardkit.testing import world_fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
world2 = world_fixture(2)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _run_plain(script, *args):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args], env=env,
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_fairscale_style_runs_without_torchrun_and_matches_one_process():
    out = _run_plain("fairscale_style.py", "--steps", "5", "--check")
    assert len(re.findall(r"Iteration \d+, Loss", out)) == 5
    assert "rank 0 check: PASS" in out, out


def test_gpt_3d_runs_without_torchrun_and_matches_one_process():
    out = _run_plain("gpt_3d.py", "--tp", "1", "--pp", "1", "--steps", "2", "--check")
    assert "check: PASS" in out, out


def test_hf_causal_lm_runs_without_torchrun():
    pytest.importorskip("transformers")
    out = _run_plain("hf_causal_lm.py", "--steps", "2", "--batch-size", "2", "--seq-len", "8")
    losses = [float(x) for x in re.findall(r"step \d+, loss ([0-9.]+)", out)]
    assert len(losses) == 2, out


def _bar_and_table_step_times():
    from unittest import mock

    from shardkit import demo
    drawn = []
    with mock.patch.object(demo, "draw_progress", lambda *a: drawn.append(a[-1])):
        figures = demo.train_and_measure(demo.RUN_BY_NAME["ddp"], demo.MODELS["small"],
                                         steps=4, global_batch=4, seed=0)
    return drawn[-1] if drawn else None, 1e3 * figures["step_time_s"]


def test_demo_progress_bar_ends_at_the_tables_step_time(world2):
    # the bar used to show the last step's time (DDP 35.5 ms in the bar, 17.4 ms in the table)
    (bar_ms, rank0_ms), (no_bar, _) = world2.run(_bar_and_table_step_times)
    assert no_bar is None  # only rank 0 draws
    assert bar_ms == rank0_ms
