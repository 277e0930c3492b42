"""``python -m shardkit plan``: the ZeRO paper's figures, real models through --model, the
recommendation, agreement with measured model states, and exit code 2 on bad input."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from shardkit import demo, plan
from shardkit.demo import small_gpt
from shardkit.testing import World
from shardkit.utils.memory import model_state_bytes


def _plan(capsys, *argv):
    code = plan.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _stage_figures(text):
    """{stage: printed per-rank model states} from plan's table."""
    found = {}
    for line in text.splitlines():
        m = re.match(r"^([0-3])\s+.*?([0-9.]+ [kMGT]?B)\s*$", line)
        if m:
            found[int(m.group(1))] = m.group(2)
    return found


def test_zero_paper_example_to_printed_precision(capsys):
    code, out, _ = _plan(capsys, "--params", "7.5e9", "--world-size", "64", "--optimizer",
                         "adam", "--mixed-precision")
    assert code == 0
    assert _stage_figures(out) == {0: "120.0 GB", 1: "31.4 GB", 2: "16.6 GB", 3: "1.9 GB"}
    assert "K=12" in out
    assert "stage 1 wire/step with reduce_to_owners_hook (what initialize builds under " \
        "zero_optimization.reduce_scatter: true, DeepSpeed's default): 29.5 GB" in out


def test_json_figures_are_the_formulas(capsys):
    code, out, _ = _plan(capsys, "--params", "7.5B", "--world-size", "64", "--mixed-precision",
                         "--json")
    assert code == 0
    rows = {r["stage"]: r["model_states"] for r in json.loads(out)["rows"]}
    psi, n = 7.5e9, 64
    assert rows == pytest.approx({0: 16 * psi, 1: 4 * psi + 12 * psi / n,
                                  2: 2 * psi + 14 * psi / n, 3: 16 * psi / n})
    wire = {r["stage"]: r["comm_per_step"] for r in json.loads(out)["rows"]}
    assert wire == pytest.approx({0: 2 * 2 * psi * (n - 1) / n, 1: 2 * 3 * psi * (n - 1) / n,
                                  2: 2 * 2 * psi * (n - 1) / n, 3: 2 * 3 * psi * (n - 1) / n})
    # initialize's stage 1 (reduce_scatter: true) reduces onto the owners: stage 2's elements,
    # 16-bit (initialize keeps 16-bit weights and gradients under fp16/bf16 at stages 0-2)
    assert json.loads(out)["stage1_owners_traffic"] == pytest.approx(2 * 2 * psi * (n - 1) / n)


def test_fp32_and_sgd_bytes_per_parameter():
    fp32 = plan.precision_for("adamw")
    assert (fp32.weights, fp32.grads, fp32.optimizer) == (4, 4, 8)
    sgd_mixed = plan.precision_for("sgd", mixed_precision=True)
    assert (sgd_mixed.weights, sgd_mixed.grads, sgd_mixed.optimizer) == (2, 2, 8)
    assert plan.zero_model_state_bytes(1000, 4, 2, fp32) == 4 * 1000 + 12 * 1000 / 4
    assert plan.zero_comm_elements_per_step(1000, 4, 3) == 3 * 1000 * 3 / 4


def tiny_model():
    """A factory for --model: two blocks of 10x10 linears plus a 10x3 head."""
    return nn.Sequential(TinyBlock(), TinyBlock(), nn.Linear(10, 3))


class TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(10, 10), nn.Linear(10, 10)

    def forward(self, x):
        return self.b(self.a(x))


def test_model_factory_counts_parameters_and_units(capsys):
    code, out, _ = _plan(capsys, "--model", "tests.test_plan:tiny_model", "--world-size", "2",
                         "--wrap-block", "TinyBlock", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["params"] == 2 * 220 + 33
    assert result["summary"]["largest_unit_params"] == 220
    assert result["summary"]["num_units"] == 3  # two blocks and the root
    by_size = json.loads(_plan(capsys, "--model", "tests.test_plan:tiny_model",
                               "--world-size", "2", "--min-num-params", "150", "--json")[1])
    assert by_size["summary"]["largest_unit_params"] == 220


def test_gpt_summary_and_recommendation(capsys):
    code, out, _ = _plan(capsys, "--model", "shardkit.demo:small_gpt", "--world-size", "2",
                         "--wrap-block", "Block", "--batch", "4", "--seq-len", "32",
                         "--gpu-memory", "10MB", "--json")
    assert code == 0
    result = json.loads(out)
    model = small_gpt()
    assert result["params"] == sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert result["summary"]["largest_unit_params"] == block
    assert (result["summary"]["num_blocks"], result["summary"]["hidden"],
            result["summary"]["heads"], result["summary"]["vocab"]) == (2, 128, 4, 512)
    assert result["activations_bytes"] > 0
    totals = {r["stage"]: r["total"] for r in result["rows"]}
    fitting = [s for s in sorted(totals) if totals[s] <= 10e6]
    assert result["recommended_stage"] == fitting[0]
    text = _plan(capsys, "--model", "shardkit.demo:small_gpt", "--world-size", "2",
                 "--wrap-block", "Block", "--seq-len", "32", "--gpu-memory", "1kB")[1]
    assert "no stage fits" in text


def _demo_model_states(run_names):
    """What the demo measures for the reference GPT: one step of each run, per-rank totals."""
    return {name: demo.train_and_measure(demo.RUN_BY_NAME[name], demo.MODELS["reference"],
                                         steps=1, global_batch=2, seed=0)
            ["model_state_bytes"]["total"] for name in run_names}


def test_plan_matches_what_the_demo_measures_for_reference_gpt(capsys):
    """plan's per-rank figure for the reference GPT at world 2 is within 5% of the model
    states the demo measures, stage by stage."""
    result = json.loads(_plan(capsys, "--model", "shardkit.demo:reference_gpt",
                              "--world-size", "2", "--optimizer", "adamw", "--wrap-block",
                              "Block", "--json")[1])
    planned = {r["stage"]: r["model_states"] for r in result["rows"]}
    stage_of = {"oss": 1, "sharded_ddp": 2, "fsdp": 3}
    live = [n for n in stage_of if demo.unavailable_reason(demo.RUN_BY_NAME[n], 2,
                                                           demo.MODELS["reference"]) is None]
    with World(2) as world:
        measured = world.run(_demo_model_states, live)
    for name in live:
        for per_rank in measured:
            assert per_rank[name] == pytest.approx(planned[stage_of[name]], rel=0.05), name
    model = demo.reference_gpt()  # stage 0 needs no world: a plain AdamW step
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    assert model_state_bytes(model, optimizer).total == pytest.approx(planned[0], rel=0.05)
    assert result["params"] == sum(p.numel() for p in model.parameters())
    assert result["summary"]["largest_unit_params"] == max(
        sum(p.numel() for p in model.blocks[0].parameters()),
        sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks.")))


@pytest.mark.parametrize("argv, message", [
    (["--params", "7.5e9", "--world-size", "64", "--stages", "0,4"], "stage '4' is unknown"),
    (["--params", "lots", "--world-size", "64"], "--params 'lots' is not a positive number"),
    (["--params", "1e9", "--world-size", "0"], "--world-size 0"),
    (["--params", "1e9", "--world-size", "8", "--optimizer", "lamb"], "'lamb' is unknown"),
    (["--world-size", "8"], "exactly one of --params"),
    (["--params", "1e9", "--world-size", "2", "--chart", "out.txt"],
     ".txt is not an image format"),  # a matplotlib traceback after the plan, exit 1
    (["--model", "no_such_pkg.models:build", "--world-size", "2"],
     "module 'no_such_pkg.models' does not import"),
    (["--model", "shardkit.demo", "--world-size", "2"], "not of the form"),
    (["--model", "shardkit.demo:nothing_here", "--world-size", "2"], "no callable"),
    (["--model", "tests.test_plan:tiny_model", "--world-size", "2", "--wrap-block", "Nope"],
     "matches no submodule"),
])
def test_bad_input_exits_2_with_a_message(capsys, argv, message):
    code, out, err = _plan(capsys, *argv)
    assert code == 2
    assert message in err and out == ""


def test_command_line_errors_have_no_traceback():
    for argv in (["--params", "7.5e9", "--world-size", "64", "--stages", "9"],
                 ["--model", "no_such_pkg:f", "--world-size", "2"]):
        proc = subprocess.run([sys.executable, "-m", "shardkit", "plan", *argv],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and "python -m shardkit plan:" in proc.stderr


def test_model_factory_in_the_working_directory_under_the_installed_command(tmp_path):
    """The ``shardkit`` console script (pyproject's ``[project.scripts]``) runs with its own
    folder, not the working directory, first on ``sys.path``; ``--model mymodel:build`` beside
    the user failed there ("module 'mymodel' does not import") while ``python -m shardkit
    plan`` found it. Emulated with a launcher script in another folder."""
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bin_dir.mkdir()
    (work / "mymodel_d.py").write_text("import torch.nn as nn\n\n\n"
                                       "def build():\n    return nn.Linear(8, 8)\n")
    (bin_dir / "shardkit_cmd.py").write_text("import sys\nfrom shardkit.__main__ import main\n"
                                             "sys.exit(main())\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo}
    proc = subprocess.run([sys.executable, str(bin_dir / "shardkit_cmd.py"), "plan", "--model",
                           "mymodel_d:build", "--world-size", "2"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "model mymodel_d:build: 72 parameters" in proc.stdout


def test_model_file_that_shares_an_installed_module_name_is_the_one_planned(tmp_path):
    """``python -m shardkit plan`` puts the working directory first on ``sys.path``, so the
    user's ``mymodel_s.py`` is planned even where a module of that name is installed; the
    installed ``shardkit`` command planned the installed one instead (it searched the working
    directory last), silently where that one had a ``build`` too. Both commands agree now."""
    work, bin_dir, site = tmp_path / "work", tmp_path / "bin", tmp_path / "site"
    for folder in (work, bin_dir, site):
        folder.mkdir()
    factory = "import torch.nn as nn\n\n\ndef build():\n    return nn.Linear({0}, {0})\n"
    (work / "mymodel_s.py").write_text(factory.format(8))   # 72 parameters
    (site / "mymodel_s.py").write_text(factory.format(4))   # 20: the "installed" one
    (bin_dir / "shardkit_cmd.py").write_text("import sys\nfrom shardkit.__main__ import main\n"
                                             "sys.exit(main())\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, str(site)])}
    args = ["plan", "--model", "mymodel_s:build", "--world-size", "2"]
    for command in ([str(bin_dir / "shardkit_cmd.py")], ["-m", "shardkit"]):
        proc = subprocess.run([sys.executable, *command, *args], cwd=work, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "model mymodel_s:build: 72 parameters" in proc.stdout, (command, proc.stdout)


def _saved_activation_bytes(model, idx, target):
    """Bytes of the distinct non-parameter tensors autograd saves for backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[(s.data_ptr(), s.nbytes())] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(idx, target)
    return sum(saved.values())


def test_activation_estimate_is_a_modest_over_estimate(capsys):
    """The documented estimate covers what autograd really saves, without wild excess."""
    from shardkit.models import synthetic_batch
    result = json.loads(_plan(capsys, "--model", "shardkit.demo:small_gpt", "--world-size", "2",
                              "--wrap-block", "Block", "--batch", "4", "--seq-len", "32",
                              "--json")[1])
    model = small_gpt()
    idx, target = synthetic_batch(demo.MODELS["small"], 4, 0)
    measured = _saved_activation_bytes(model, idx, target)
    assert measured <= result["activations_bytes"] <= 1.3 * measured


def test_stage3_traffic_per_zeropp_option(capsys):
    code, out, _ = _plan(capsys, "--params", "1e9", "--world-size", "8", "--json")
    assert code == 0
    traffic = json.loads(out)["stage3_traffic"]
    elements = 1e9 * 7 / 8
    assert traffic == pytest.approx({"fp32": 12 * elements,
                                     "qwZ": (2 * (1 + 4 / 256) + 4) * elements,
                                     "qgZ": (8 + 0.5 + 4 / 256) * elements,
                                     "qwZ+qgZ": (2 * (1 + 4 / 256) + 0.5 + 4 / 256) * elements})
    code, out, _ = _plan(capsys, "--params", "1e9", "--world-size", "8")
    assert "qwZ+qgZ 2.2 GB (0.21x)" in out
    code, out, _ = _plan(capsys, "--params", "1e9", "--world-size", "8", "--stages", "1", "--json")
    assert json.loads(out)["stage3_traffic"] is None


def test_chart_draws_every_stage_with_its_figures(capsys, tmp_path):
    png = tmp_path / "plan.png"
    code, out, _ = _plan(capsys, "--params", "7.5B", "--world-size", "64", "--mixed-precision",
                         "--chart", str(png))
    assert code == 0 and str(png) in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    chart = json.loads((tmp_path / "plan.chart.json").read_text())
    states = [g["values"]["model states (GB)"] for g in chart["groups"]]
    mixed = plan.precision_for("adam", mixed_precision=True)
    assert states == pytest.approx([plan.zero_model_state_bytes(7.5e9, 64, s, mixed) / 1e9
                                    for s in range(4)])
    assert states[0] == pytest.approx(120.0) and states[3] == pytest.approx(1.875)
    # a path without a suffix: the PNG is written at path + ".png", and the line says so
    # (it named the path without the suffix, where nothing was)
    code, out, _ = _plan(capsys, "--params", "1e9", "--world-size", "2", "--chart",
                         str(tmp_path / "bare"))
    assert code == 0 and f"chart: {tmp_path / 'bare.png'} " in out
    assert (tmp_path / "bare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_state_bytes_of_sparse_gradients_and_meta_parameters():
    # a sparse gradient (nn.Embedding(sparse=True), as DDP trains it) is its index and value
    # storages; this used to raise NotImplementedError ("Cannot access storage of
    # SparseTensorImpl")
    emb = nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2, 2])).sum().backward()
    optimizer = torch.optim.SparseAdam(emb.parameters())
    optimizer.step()
    got = model_state_bytes(emb, optimizer)
    assert got.params == 10 * 4 * 4
    assert got.grads == 3 * 8 + 3 * 4 * 4  # uncoalesced: 3 int64 indices, 3 rows of values
    assert got.optimizer == 2 * 10 * 4 * 4  # two dense moments (SparseAdam's step is an int)
    # a model on the meta device (before FSDP's param_init_fn) holds nothing; parameters of
    # equal sizes used to be merged as one storage (all at address 0) and counted
    with torch.device("meta"):
        deferred = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(4, 4))
    assert model_state_bytes(deferred).total == 0


def test_comm_counter_entered_twice_records_each_op_once():
    # a helper that opens ``with comm:`` on the caller's counter used to record every op of
    # its block twice in that counter
    from shardkit.comm_counter import CommCounter, CommRecord, add_record
    record = CommRecord(op="all_reduce", numel=4, dtype=torch.float32, bytes=16.0, group_size=2)
    outer, comm = CommCounter(), CommCounter()
    with outer, comm:
        with comm:
            add_record(record)
        add_record(record)
    assert len(comm.calls) == 2 and comm.bytes == 32.0 and comm.calls_by_op == {"all_reduce": 2}
    assert len(outer.calls) == 2
