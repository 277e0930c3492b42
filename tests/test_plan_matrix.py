"""The planner against measurement, over a seeded random matrix.

Random models (MLPs of odd widths and depths, small GPTs with random shapes, tied or untied,
frozen parameters, a BatchNorm's buffers), ZeRO stages 0-3 built by ``recipes.compose``, on
process groups of 1, 2 and 4 ranks inside one world of 4, fp32 and 16-bit FSDP, CPU offload.
For each case, every rank compares what :mod:`shardkit.plan` predicts from the unwrapped model
(:func:`~shardkit.plan.stage_table` with the model's summary and rank layout, the figures
``python -m shardkit plan --model`` prints) with what it measures:
``model_state_bytes`` from tensor storages after a step, and ``CommCounter`` over the second
step. The documented remainders are allowed and nothing else: Adam's 4-byte ``step`` count per
tensor, OSS's sync-bucket padding (at most 3%), the presence flags and use counts riding on
the reductions (a few elements per parameter tensor).
"""

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed, plan
from shardkit.models import GPT, Block, GPTConfig, MLP
from shardkit.nn.wrap import transformer_auto_wrap_policy
from shardkit.recipes import adamw, compose, count_params
from shardkit.testing import world_fixture
from shardkit.utils.memory import model_state_bytes

world4 = world_fixture(4)

SEED = 20261204
KINDS = ("mlp", "gpt", "frozen", "tied", "buffers")
GLOBAL_BATCH = 8


def _cases():
    """Every (world, stage) pair with two random models, plus 16-bit FSDP, offload and a
    frozen unit; each case a dict of plain values (its id says what it is)."""
    rng = random.Random(SEED)
    cases = []
    for n in (1, 2, 4):
        for stage in range(4):
            for kind in rng.sample(KINDS, 2):
                cases.append({"n": n, "stage": stage, "kind": kind, "seed": rng.randrange(1000)})
        cases.append({"n": n, "stage": 3, "kind": rng.choice(("mlp", "gpt")),
                      "seed": rng.randrange(1000), "mp": rng.choice(("fp16", "bf16"))})
    cases.append({"n": 4, "stage": 3, "kind": "gpt", "seed": 7, "offload": True})
    cases.append({"n": 2, "stage": 3, "kind": "frozen_unit", "seed": 3})
    cases.append({"n": 2, "stage": 1, "kind": "frozen_unit", "seed": 3})
    return cases


CASES = _cases()


def _case_id(case):
    extra = "".join(f"-{k}={case[k]}" for k in ("mp", "offload") if k in case)
    return f"N{case['n']}-stage{case['stage']}-{case['kind']}{case['seed']}{extra}"


# ---------------------------------------------------------------------- rank side


class _WithBuffers(nn.Module):
    """Linear, BatchNorm (running statistics: buffers, not model states), Linear."""

    def __init__(self, width: int, out: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.bn, self.b = nn.Linear(width, width), nn.BatchNorm1d(width), \
            nn.Linear(width, out)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


def _model(case):
    """(model, inputs, targets, loss_fn, FSDP unit class) of ``case``, from its seed."""
    rng = random.Random(case["seed"])
    kind = case["kind"]
    g = torch.Generator().manual_seed(case["seed"])
    if kind in ("gpt", "tied"):
        heads = rng.choice((1, 2, 3))
        cfg = GPTConfig(vocab_size=rng.randint(17, 70), n_layer=rng.randint(1, 3),
                        n_head=heads, d_model=heads * rng.randint(3, 9),
                        seq_len=rng.randint(3, 9), tie_weights=kind == "tied")
        x = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, cfg.seq_len), generator=g)
        y = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, cfg.seq_len), generator=g)

        def loss_fn(out, target):
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
        return GPT(cfg, seed=case["seed"]), x, y, loss_fn, Block
    width, out = rng.randint(3, 37), rng.randint(1, 9)
    if kind == "buffers":
        model = _WithBuffers(width, out, case["seed"])
    else:
        model = MLP(width, rng.randint(2, 4), out, seed=case["seed"])
        linears = [m for m in model if isinstance(m, nn.Linear)]
        if kind == "frozen":  # every other weight frozen, the biases train
            for m in linears[::2]:
                m.weight.requires_grad_(False)
        elif kind == "frozen_unit":  # the first Linear frozen whole: a unit without gradients
            linears[0].requires_grad_(False)
    x = torch.randn(GLOBAL_BATCH, width, generator=g)
    y = torch.randn(GLOBAL_BATCH, out, generator=g)
    return model, x, y, (lambda o, t: (o - t).pow(2).mean()), nn.Linear


_GROUPS = {}


def _group_of(n: int):
    """This rank's process group of ``n`` ranks (made once, by every rank together)."""
    if not _GROUPS:
        _GROUPS[4] = None
        pairs = [distributed.new_group([0, 1]), distributed.new_group([2, 3])]
        _GROUPS[2] = pairs[distributed.get_rank() // 2]
        _GROUPS[1] = distributed.single_rank_group()
    return _GROUPS[n]


def _measure(case):
    """What the planner predicts for ``case`` and what this rank measures."""
    n, stage = case["n"], case["stage"]
    group = _group_of(n)
    rank = distributed.get_rank(group)
    model, x, y, loss_fn, unit_cls = _model(case)
    precision = plan.precision_for("adamw", mixed_precision="mp" in case)
    from shardkit.plan_model import rank_layout
    summary = plan.summarize_model(model, unit_cls.__name__)
    layout = rank_layout(model, n, unit_cls.__name__)
    row = plan.stage_table(summary.params, n, precision, (stage,), summary, 0.0, layout)[0]
    trainable = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    kwargs = {"process_group": group}
    if stage == 3:
        kwargs.update(wrap_policy=transformer_auto_wrap_policy({unit_cls}),
                      offload=case.get("offload", False))
        if "mp" in case:
            from shardkit.nn.data_parallel.mixed_precision import MixedPrecisionPolicy
            dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[case["mp"]]
            kwargs["mixed_precision"] = MixedPrecisionPolicy(param_dtype=dtype,
                                                             reduce_dtype=dtype)
    setup = compose(model, stage, adamw(1e-3), **kwargs).training_setup(loss_fn)
    local = GLOBAL_BATCH // n
    xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    for _ in range(2):  # the second step is counted: the first may build buckets
        with distributed.CommCounter() as comm:
            setup.train_step(xs, ys)
    owned = None
    if stage in (1, 2):
        owned = sum(p.numel() for p in trainable
                    if setup.optimizer.param_to_rank[p] == rank)
    return {"rank": rank, "planned_states": row.model_states,
            "planned_wire": row.comm_per_step, "formula_states": row.formula_model_states,
            "params": summary.params, "trainable": summary.trainable_params,
            "trainable_tensors": len(trainable), "tensors": len(list(dict.fromkeys(
                model.parameters()))), "units": summary.num_units,
            "oss_planned_owned": layout.oss_numel_per_rank, "owned": owned,
            "element_bytes": precision.grads, "padding": layout.padded_params - summary.params,
            "frozen_unit_numel": layout.padded_params - layout.padded_grad_units,
            "measured": model_state_bytes(setup.module, setup.optimizer).as_dict(),
            "wire": comm.bytes, "by_op": comm.by_op}


# ---------------------------------------------------------------------- the checks


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_planner_matches_measurement(world4, case):
    per_rank = world4.run(_measure, case)
    n, stage = case["n"], case["stage"]
    for r in per_rank:
        where = f"{_case_id(case)} rank {r['rank']}: {r}"
        measured = r["measured"]["total"]
        step_counts = 4 * r["trainable_tensors"]  # Adam's per-tensor step, 4 bytes each
        if stage in (1, 2):
            # OSS's owners are what the planner's layout says they are
            assert r["owned"] == r["oss_planned_owned"][r["rank"]], where
        # the planner's row is the most loaded rank: no rank holds more
        assert measured <= r["planned_states"] + step_counts, where
        if stage in (0, 3) or n == 1:  # every rank alike
            assert measured >= r["planned_states"], where
        if stage == 0 or n == 1:
            assert r["planned_states"] == r["formula_states"], where
    if stage in (1, 2):  # the most loaded rank is the planner's figure
        top = max(r["measured"]["total"] for r in per_rank[:n])
        assert per_rank[0]["planned_states"] <= top, per_rank[:n]
    wire = [r["wire"] for r in per_rank]
    first = per_rank[0]
    planned = first["planned_wire"]
    if n == 1:
        assert wire == [0] * len(wire)
        return
    ring = (n - 1) / n * first["element_bytes"]
    extras = ring * n * (first["tensors"] + 2 * first["units"])  # flags, use counts, tags
    if stage == 0:
        assert wire == [planned] * len(wire), wire
    elif stage in (1, 2):  # OSS's sync buckets pad at most 3%
        assert all(planned <= w <= planned * 1.03 + extras for w in wire), (wire, planned)
    else:
        # a rank sends its own unpadded rows of each gather, so the rank holding no padding
        # sends the planned (padded) figure, the one holding all of it up to N x padding less
        # per gather; a unit that is frozen whole and that no
        # gradient crosses (the first layer) is not gathered again in backward
        skipped = ring * first["frozen_unit_numel"]
        assert planned - skipped <= max(wire) <= planned + extras, (wire, planned)
        assert min(wire) >= planned - skipped - 2 * ring * n * first["padding"], (wire, planned)


# ---------------------------------------------------------------------- the command line


def frozen_mlp():
    """A factory for ``plan --model``: an MLP whose first two Linears are frozen."""
    model = MLP(24, 4, 5, seed=0)
    for m in [m for m in model if isinstance(m, nn.Linear)][:2]:
        m.requires_grad_(False)
    return model


def lopsided():
    """A factory for ``plan --model``: one 64x64 matrix beside eight 4x4 ones, so OSS's
    whole-parameter owners cannot balance 4 ranks."""
    return nn.Sequential(nn.Linear(64, 64, bias=False),
                         *[nn.Linear(4, 4, bias=False) for _ in range(8)])


def failing_factory():
    raise RuntimeError("no weights here")


def _plan_json(capsys, *argv):
    code = plan.main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    import json
    return json.loads(out)


def test_frozen_parameters_hold_weights_only(capsys):
    """``plan --model`` with frozen parameters: no gradient, no optimizer state for them (it
    counted (W+G+K) bytes for every parameter), as one process measures it (stage 0)."""
    result = _plan_json(capsys, "--model", "tests.test_plan_matrix:frozen_mlp",
                        "--world-size", "2", "--optimizer", "adamw")
    model = frozen_mlp()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    measured = model_state_bytes(model, optimizer).total - 4 * len(trainable)  # step counts
    rows = {r["stage"]: r for r in result["rows"]}
    assert rows[0]["model_states"] == measured
    assert result["summary"]["trainable_params"] == count_params(trainable)
    psi, psi_t = result["params"], count_params(trainable)
    assert rows[0]["comm_per_step"] == 4 * 2 * psi_t / 2  # DDP reduces trainable grads only
    from shardkit.plan_model import rank_layout
    assert rows[1]["model_states"] == 4 * psi + 4 * psi_t + 8 * max(
        rank_layout(model, 2).oss_numel_per_rank)


def test_stages_1_2_plan_the_most_loaded_owner(capsys):
    """OSS owns whole parameters: at 4 ranks the owner of the 64x64 matrix holds its whole
    optimizer state, not Ψ/4 (the plan used to print the ideal split)."""
    rows = {r["stage"]: r for r in _plan_json(
        capsys, "--model", "tests.test_plan_matrix:lopsided", "--world-size", "4",
        "--optimizer", "adamw")["rows"]}
    psi, big = 64 * 64 + 8 * 16, 64 * 64
    assert rows[1]["model_states"] == 8 * psi + 8 * big
    assert rows[2]["model_states"] == 4 * psi + 12 * big
    assert rows[2]["formula_model_states"] == 4 * psi + 12 * psi / 4


def test_stage3_wire_counts_the_root_unit_once_everywhere(capsys):
    """The table's stage-3 wire/step, the ZeRO++ fp32 figure and the per-link table agree
    (the table and the ZeRO++ line gathered the root unit twice)."""
    result = _plan_json(capsys, "--model", "shardkit.demo:small_gpt", "--world-size", "4",
                        "--wrap-block", "Block")
    stage3 = next(r for r in result["rows"] if r["stage"] == 3)
    links = result["stage3_link_traffic"]["fp32"]
    psi, root, n = result["params"], result["summary"]["root_unit_params"], 4
    assert result["stage3_traffic"]["fp32"] == pytest.approx(links["intra_node"])
    assert links["intra_node"] == pytest.approx(4 * (3 * psi - root) * (n - 1) / n)
    # the table's row counts FSDP's padding on top (the small GPT pads nothing at 4 ranks)
    assert stage3["comm_per_step"] == pytest.approx(links["intra_node"])


@pytest.mark.parametrize("argv, message", [
    (["--model", "tests.test_plan_matrix:failing_factory", "--world-size", "2"],
     "failing_factory() raised RuntimeError: no weights here"),
    (["--params", "1e400", "--world-size", "2"], "--params '1e400' is not a positive number"),
    (["--params", "1e9", "--world-size", "2", "--wrap-block", "Block"],
     "--wrap-block describes a real model: give --model"),
    (["--params", "1e9", "--world-size", "2", "--seq-len", "128"], "--seq-len describes"),
    (["--params", "1e9", "--world-size", "2", "--chart", "/no/such/folder/plan.png"],
     "--chart '/no/such/folder/plan.png': the folder '/no/such/folder' does not exist"),
    (["--params", "1e9", "--world-size", "2", "--seq-len", "-1"], "--seq-len -1 must be 0"),
    (["--model", "torch.nn:Identity", "--world-size", "2"], "the module has no parameters"),
])
def test_plan_bad_input_exits_2_naming_the_argument(capsys, argv, message):
    code = plan.main(argv)
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), (out, err)
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--timeout", "nan"], "--timeout nan must be a positive, finite number"),
    (["--timeout", "inf"], "--timeout inf must be a positive, finite number"),
    (["--out", "/proc/no-such-folder"], "--out '/proc/no-such-folder' cannot be created"),
])
def test_demo_bad_input_exits_2_before_launching(capsys, argv, message):
    from shardkit import demo
    code = demo.main([*argv, "--runs", "ddp", "--steps", "1"])
    out, err = capsys.readouterr()
    assert code == 2 and message in err, (out, err)
    assert out == ""


def test_top_level_help_lists_every_command(capsys):
    from shardkit.__main__ import main
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("cluster", "consolidate", "demo", "plan"):
        assert f"\n    {command} " in out, out
