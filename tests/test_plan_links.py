"""``python -m shardkit plan --ranks-per-node n``: stage 3's bytes per step on intra-node and
inter-node links for every FSDP communication option (fp32, qwZ, qgZ, hpZ, their combinations,
HYBRID_SHARD), checked against what ``CommCounter`` counts on a world of 4 ranks labelled 2
nodes x 2 (``LOCAL_WORLD_SIZE=2``, ``GROUP_RANK``), plus the formulas' edge cases and the
command line."""

import json

import pytest
import torch
import torch.nn as nn

from shardkit import plan
from shardkit.distributed import CommCounter
from shardkit.models import MLP
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import auto_wrap, transformer_auto_wrap_policy
from shardkit.testing import World

# Linear(256, 256) units: each rank's chunk of a weight is 64 whole blocks of 256, so the
# quantized layouts' padding (the bias's 64 elements per rank) stays near 1%.
WIDTH, DEPTH = 256, 4
FSDP_KWARGS = {
    "fp32": {},
    "qwZ": {"quantize_weights": True},
    "qgZ": {"quantize_gradients": True},
    "hpZ": {"hpz_partition_size": 2},
    "qwZ+qgZ": {"quantize_weights": True, "quantize_gradients": True},
    "qwZ+hpZ": {"quantize_weights": True, "hpz_partition_size": 2},
    "hpZ+qgZ": {"quantize_gradients": True, "hpz_partition_size": 2},
    "qwZ+hpZ+qgZ": {"quantize_weights": True, "quantize_gradients": True,
                    "hpz_partition_size": 2},
    "HYBRID": {"sharding_strategy": "HYBRID_SHARD"},
    "HYBRID+qwZ+qgZ": {"sharding_strategy": "HYBRID_SHARD", "quantize_weights": True,
                       "quantize_gradients": True},
}
FP32_ADAMW = plan.precision_for("adamw")


def _measure_links() -> dict:
    """Per option: the second step's intra-/inter-node bytes (the first records the order)."""
    out = {}
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0))
    for name, kwargs in FSDP_KWARGS.items():
        # every Linear a unit and the root owns nothing: every unit reshards after forward
        model = FSDP(auto_wrap(MLP(WIDTH, DEPTH, seed=1), transformer_auto_wrap_policy(
            {nn.Linear}), **kwargs), **kwargs)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            with CommCounter() as comm:
                model(x).pow(2).mean().backward()
                optim.step()
                optim.zero_grad()
        out[name] = {"intra": comm.intra_node_bytes, "inter": comm.inter_node_bytes,
                     "psi": sum(u.unit_numel for u in model.sharded_units())}
    return out


@pytest.fixture(scope="module")
def measured():
    with World(4, ranks_per_node=2) as world:
        return world.run(_measure_links)


def test_planned_bytes_per_link_match_comm_counter_2x2(measured):
    """Every option's planned intra- and inter-node bytes within 5% of the counted ones."""
    assert set(plan.COMM_OPTIONS) == set(FSDP_KWARGS)
    for rank, per_option in enumerate(measured):
        for name, got in per_option.items():
            want = plan.link_traffic(got["psi"], 2, 2, FP32_ADAMW, plan.COMM_OPTIONS[name])
            assert got["intra"] == pytest.approx(want.intra_node, rel=0.05, abs=1.0), (
                rank, name, got, want)
            assert got["inter"] == pytest.approx(want.inter_node, rel=0.05, abs=1.0), (
                rank, name, got, want)
        # ZeRO++'s claim on spanning links, by the planner and by the counter
        ratio = per_option["qwZ+hpZ+qgZ"]["inter"] / per_option["fp32"]["inter"]
        assert ratio <= 0.3, (rank, ratio)


def test_formula_edge_cases():
    psi, p = 1e9, FP32_ADAMW
    # one node: everything stays inside it, and each option's total is the flat formula's
    one_node = plan.link_traffic_table(psi, 8, 1, p)
    assert all(t.inter_node == 0 for t in one_node.values())
    assert one_node["fp32"].intra_node == pytest.approx(12 * psi * 7 / 8)
    flat = plan.zeropp_traffic(psi, 8, p)
    for name in ("qwZ", "qgZ", "qwZ+qgZ"):
        assert one_node[name].total == pytest.approx(flat[name])
    # one rank per node: hpZ has nothing to keep, qgZ nothing to reduce first
    spread = plan.link_traffic_table(psi, 1, 8, p)
    assert spread["hpZ"] == spread["fp32"] and spread["qwZ+hpZ+qgZ"] == spread["qwZ+qgZ"]
    assert all(t.intra_node == 0 for t in spread.values())
    # HYBRID at n x k: 2(Ψ/n)(k-1)/k gradient elements across nodes, DESIGN.md's formula
    hybrid = plan.link_traffic(psi, 8, 4, p, plan.COMM_OPTIONS["HYBRID"])
    assert hybrid.inter_node == pytest.approx(4 * 2 * (psi / 8) * 3 / 4)
    # the root unit is gathered once per step, the others twice
    rooted = plan.link_traffic(psi, 2, 2, p, plan.COMM_OPTIONS["fp32"], root_params=psi / 4)
    assert rooted.inter_node == pytest.approx(4 * (2 * 0.75 * psi + 0.25 * psi + psi) * 3 / 4)


def test_command_line_prints_the_per_link_table(capsys):
    code = plan.main(["--params", "1e9", "--world-size", "8", "--ranks-per-node", "4",
                      "--json"])
    data = json.loads(capsys.readouterr()[0])
    assert code == 0 and data["ranks_per_node"] == 4
    expected = plan.link_traffic_table(1e9, 4, 2, plan.precision_for("adam"))
    assert data["stage3_link_traffic"] == {
        name: pytest.approx({"intra_node": t.intra_node, "inter_node": t.inter_node})
        for name, t in expected.items()}
    code = plan.main(["--params", "1e9", "--world-size", "8", "--ranks-per-node", "4"])
    text = capsys.readouterr()[0]
    assert code == 0 and "2 nodes x 4 ranks" in text
    row = next(line for line in text.splitlines() if line.startswith("qwZ+hpZ+qgZ"))
    # by hand, N = 8, n = 4: intra 3/4 Ψ x 4 (hpZ's backward gather stays fp32) + 3/4 Ψ (0.5 +
    # 4/256) = 3.39 GB; inter 7/8 Ψ (1 + 4/256) + Ψ/4 x 1/2 x (0.5 + 4/256) = 953.1 MB,
    # against fp32's 12 x 7/8 Ψ
    assert row.split()[1:] == ["3.4", "GB", "953.1", "MB", "0.09x"], row


@pytest.mark.parametrize("value", ["3", "0"])
def test_ranks_per_node_must_divide_the_world(capsys, value):
    code = plan.main(["--params", "1e9", "--world-size", "8", "--ranks-per-node", value])
    err = capsys.readouterr()[1]
    assert code == 2 and f"--ranks-per-node {value} must be a positive divisor" in err
