"""examples/gpt_3d.py under torchrun on CPU (world 4) matches single-process training with every
pipeline schedule, each in a different tensor x pipeline x data layout and ZeRO stage; arguments
that cannot run are refused before any communication, naming the flags.

The launches that the selected tests need run in one torchrun job, one after the other
(tests/utils/gpt_3d_launches.py calls the example's ``main`` with each command line): a job of
its own per launch paid torchrun, four torch imports and the first step's warm-up each time."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from shardkit.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "gpt_3d.py")
STEPS = 3
# SGD with a large step: the weight comparison sees a gradient that is off by any factor
SGD = ("--optimizer", "sgd", "--lr", "0.5")

ALL = ("gpipe", "1f1b", "zero-bubble", "interleaved-1f1b", "zbv")
# launch -> (flags, {schedule: pipeline stages} trained): every schedule in
# each layout (one launch trains them one after the other); across the launches tensor
# parallelism with sequence parallelism, data parallelism, ZeRO 1, 2 and 3 (SGD: weights
# compared too; the example's default AdamW takes the same path, losses only)
LAUNCHES = {
    # ZBV re-plans from measured costs at the third step
    "tp2-sequence-parallel-zero1": (
        ("--schedule", "all", "--tp", "2", "--pp", "2", "--zero", "1", "--sequence-parallel",
         *SGD), {"gpipe": 2, "1f1b": 2, "zero-bubble": 2, "interleaved-1f1b": 4, "zbv": 4}),
    # ShardedDDP reduces inside the W passes: ZBV's re-plan must be the same on both replicas
    "dp2-zero2": (
        ("--schedule", "all", "--tp", "1", "--pp", "2", "--zero", "2", *SGD),
        {"gpipe": 2, "1f1b": 2, "zero-bubble": 2, "interleaved-1f1b": 4, "zbv": 4}),
    # FSDP, the split-backward schedules included
    "dp2-zero3-interleaved-v3": (
        ("--schedule", "all", "--tp", "1", "--pp", "2", "--zero", "3", "--virtual-stages", "3",
         *SGD), {"gpipe": 2, "1f1b": 2, "zero-bubble": 2, "interleaved-1f1b": 6, "zbv": 4}),
}


DRIVER = os.path.join(ROOT, "tests", "utils", "gpt_3d_launches.py")


def _load_example():
    spec = importlib.util.spec_from_file_location("gpt_3d_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torchrun(launches):
    """One torchrun job (world 4) that runs the example's ``main`` with each launch's command
    line in turn (tests/utils/gpt_3d_launches.py: torchrun, the torch imports and the first
    step's warm-up are paid once); {launch: (exit status of its main, its stdout lines)}, and
    the job itself."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1")
    specs = [f"{launch}=" + " ".join(("--steps", str(STEPS), "--batch", "8", "--chunks", "2",
                                      "--check", *LAUNCHES[launch][0])) for launch in launches]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           "--master_port", str(free_port()), DRIVER, *specs]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    sections = {}
    for launch in launches:
        section = re.search(rf"^=== {re.escape(launch)} start\n(.*?)^=== {re.escape(launch)} "
                            rf"exit (\d+)$", proc.stdout, re.S | re.M)
        if section:
            sections[launch] = (int(section.group(2)), section.group(1))
    return sections, proc


@pytest.fixture(scope="module")
def launched(request):
    """The launches that this session's selected tests of this module need, in one job."""
    wanted = [item.callspec.params["launch"] for item in request.session.items
              if getattr(getattr(item, "module", None), "__name__", None) == __name__
              and getattr(item, "originalname", None)
              == "test_every_schedule_matches_single_process_training"]
    return _torchrun(list(dict.fromkeys(wanted)))


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_every_schedule_matches_single_process_training(launch, launched):
    flags, trained = LAUNCHES[launch]
    sections, proc = launched
    out = proc.stdout + proc.stderr
    assert launch in sections, out[-4000:]  # its main ran to the end (or exited) on every rank
    status, stdout = sections[launch]
    assert status == 0, out[-4000:]
    # the job itself ends cleanly unless another launch's main failed
    assert proc.returncode == 0 or any(s for s, _ in sections.values()), out[-4000:]
    steps = re.findall(r"step +\d+  loss ([0-9.]+)  single-process ([0-9.]+)", stdout)
    assert len(steps) == STEPS * len(trained), stdout  # one rank prints
    checks = re.findall(r"check: (PASS|FAIL)  --schedule (\S+): (\d+) stages on 2 pipeline "
                        r"ranks; max \|loss - single-process loss\| over \d+ steps (\S+) "
                        r"\(tolerance 1e-04\); (.*)", stdout)
    assert [name for _, name, *_ in checks] == list(trained), stdout
    for verdict, name, stages, loss_difference, weights in checks:
        assert (verdict, int(stages)) == ("PASS", trained[name]), stdout
        assert float(loss_difference) <= 1e-4
        if "sgd" in flags:
            weight = re.match(r"max \|weight - single-process weight\| on every rank (\S+)",
                              weights)
            assert weight and float(weight.group(1)) <= 1e-4, stdout


def test_the_example_has_every_schedule_of_the_library():
    from shardkit.nn import pipe

    example = _load_example()
    offered = {cls for cls, *_ in example.SCHEDULES.values()}
    library = {getattr(pipe, name) for name in pipe.__all__
               if name.startswith("Schedule")}
    assert offered == library
    assert set(ALL) == set(example.SCHEDULES)


@pytest.mark.parametrize("argv, world, expected", [
    (["--schedule", "zbv", "--virtual-stages", "3"], 8,
     "--schedule zbv runs 2 stage(s) per pipeline rank, got --virtual-stages 3"),
    (["--schedule", "1f1b", "--virtual-stages", "2"], 8,
     "or --schedule interleaved-1f1b for several"),
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "4"], 8,
     "(--virtual-stages 4) = 8 pipeline stages, but the GPT has only 6 layers to cut "
     "(embedding, --layers 4 blocks, head); use --layers >= 6"),
    (["--schedule", "zbv", "--pp", "4", "--tp", "1"], 8,
     "--schedule zbv: --pp 4 x 2 stages per rank = 8 pipeline stages"),
    (["--schedule", "interleaved-1f1b", "--pp", "4", "--tp", "1", "--layers", "6"], 8,
     "--schedule interleaved-1f1b needs --chunks to be a multiple of --pp 4"),
    (["--chunks", "3"], 8, "--chunks 3 does not divide the 4 sequences of each replica"),
    (["--batch", "7", "--chunks", "1"], 8, "--batch 7 is not divisible by the 2 data-parallel"),
    (["--tp", "3"], 6, "--tp 3 does not divide the GPT's 4 attention heads"),
    ([], 6, "--tp 2 x --pp 2 = 4 ranks per pipeline does not divide the world size 6"),
    (["--zero", "3", "--sequence-parallel"], 8, "--zero 3 with --sequence-parallel"),
])
def test_arguments_that_cannot_run_are_refused_by_name(argv, world, expected):
    example = _load_example()
    problem = example.argument_problem(example.parse_args(argv), world)
    assert problem is not None and expected in problem, problem


def test_refusal_comes_before_any_communication(monkeypatch):
    example = _load_example()
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(SystemExit, match="--virtual-stages 3"):
        example.main(["--schedule", "zbv", "--virtual-stages", "3"])  # no process group needed


def test_defaults_run_every_schedule_on_eight_ranks():
    example = _load_example()
    for schedule in example.SCHEDULES:
        args = example.parse_args(["--schedule", schedule])
        assert example.argument_problem(args, 8) is None, schedule
        assert example.stages_per_rank(args, schedule) == (
            2 if schedule in ("interleaved-1f1b", "zbv") else 1)


def test_schedule_lists():
    example = _load_example()
    args = example.parse_args(["--schedule", "all", "--zero", "3", "--virtual-stages", "3"])
    assert example.argument_problem(args, 8) is None
    assert args.schedules == ["gpipe", "1f1b", "zero-bubble", "interleaved-1f1b", "zbv"]
    assert example.stages_per_rank(args, "interleaved-1f1b") == 3
    assert example.stages_per_rank(args, "zbv") == 2
    assert example.parse_args(["--schedule", "zbv,1f1b,zbv"]).schedules == ["zbv", "1f1b"]
    with pytest.raises(SystemExit):
        example.parse_args(["--schedule", "1f1b,zb-v"])  # argparse: exit status 2
