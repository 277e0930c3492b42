"""Everything on two nodes: 2 nodes x 2 ranks on the simulated cluster (network namespaces, own
/dev/shm per node, a 10 Gbit/s link), parity with single-process training step by step for OSS
(+DDP), ShardedDDP + OSS, FSDP, a 2-stage pipeline with one stage per node, tensor parallel inside
a node, `shardkit.initialize` at ZeRO stages 0-3; FULL_SHARD's bytes on spanning groups;
HYBRID_SHARD, _HYBRID_SHARD_ZERO2 and hpZ parity and spanning elements at their formulas; a
checkpoint saved on 2 x 2 resumes on 1 node x 3 ranks.

All the 2-node checks run in one torchrun launch (tests/cluster/two_node_checks.py); each test
here asserts on its part of the per-rank results."""

import json
import os

import pytest
import torch

import shardkit
from shardkit.models import GPT
from shardkit.testing import World, cluster_unavailable_reason, run_cluster
from tests.cluster import two_node_checks as checks

_REASON = cluster_unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
TOL = 1e-5
OVERLAP_STEPS = 6  # tests/optim/test_oss_overlap.py's STEPS


@pytest.fixture(scope="module")
def cluster_results(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("two_nodes"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        TRITON_INTERPRET="1")
    log = open(os.path.join(out_dir, "launch.log"), "w")
    rc = run_cluster([checks.__file__, out_dir], nodes=2, nproc_per_node=2, link_rate="10gbit",
                     env=env, timeout=400, out=log)
    log.close()
    with open(os.path.join(out_dir, "launch.log")) as f:
        tail = f.read()[-4000:]
    ranks = []
    for r in range(4):
        path = os.path.join(out_dir, f"rank{r}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path) else {})
    return {"rc": rc, "log": tail, "ranks": ranks, "dir": out_dir}


def _values(cluster_results, name):
    """The check's value on every rank; fails with the rank's traceback (or the launch log)."""
    values = []
    for rank, results in enumerate(cluster_results["ranks"]):
        entry = results.get(name)
        assert entry is not None, (f"check {name!r} left no result on rank {rank} (launch status "
                                   f"{cluster_results['rc']}):\n{cluster_results['log']}")
        assert entry["ok"], f"check {name!r} failed on rank {rank}:\n{entry['error']}"
        values.append(entry["value"])
    return values


def test_launch_succeeds_and_nodes_are_separate(cluster_results):
    where = _values(cluster_results, "where")
    assert cluster_results["rc"] == 0, cluster_results["log"]
    assert [(w["node"], w["ranks_per_node"], w["host"]) for w in where] == [
        (0, 2, "node0"), (0, 2, "node0"), (1, 2, "node1"), (1, 2, "node1")]
    assert [w["sees_rank0_shm"] for w in where] == [True, True, False, False]
    assert [w["node_groups"] for w in where] == [[[0, 1], [0, 2]], [[0, 1], [1, 3]],
                                                 [[2, 3], [0, 2]], [[2, 3], [1, 3]]]
    # each node has its own process ids: torchrun, its 2 ranks and little else
    assert all(w["processes_visible"] < 10 for w in where), where


def test_oss_with_ddp_matches_single_process(cluster_results):
    for v in _values(cluster_results, "oss_ddp"):
        for name in ("adamw", "adamw_clip_l2", "sgd_momentum", "fused_adamw"):
            assert v[name] <= TOL, (name, v)
        assert v["broadcast_fp16"] <= 5e-3 and v["inf_skips_everywhere"], v


def test_sharded_ddp_with_oss_matches_single_process(cluster_results):
    for v in _values(cluster_results, "sharded_ddp_oss"):
        assert all(diff <= TOL for diff in v.values()), v


def test_overlapped_parameter_sync_matches_single_process(cluster_results):
    # OSS's sync left in flight into the next forward, across the link, under torch DDP and
    # ShardedDDP; evaluation, state_dict() and direct reads between steps see fresh weights
    for per_wrapper in _values(cluster_results, "overlapped_sync"):
        for wrapper, (worst, pending_seen) in per_wrapper.items():
            assert pending_seen == OVERLAP_STEPS, wrapper  # really left in flight
            assert all(diff <= TOL for diff in worst.values()), (wrapper, worst)


def test_reduce_to_owners_hook_matches_single_process(cluster_results):
    # torch DDP + OSS with gradients averaged onto their owners only, across the link
    for worst, sent, zero_elsewhere in _values(cluster_results, "reduce_to_owners_hook"):
        assert worst <= TOL and all(zero_elsewhere), (worst, zero_elsewhere)
        assert all(counted == expected for counted, expected in sent), sent


def test_fsdp_matches_single_process(cluster_results):
    for per_config in _values(cluster_results, "fsdp"):
        for r in per_config:
            assert r["param_diff"] <= TOL and r["loss_diff"] <= TOL, r
            assert r["norm_diff"] <= TOL and r["frozen_grad_is_none"] and r["tied"], r


def test_pipeline_one_stage_per_node_matches_single_process(cluster_results):
    values = _values(cluster_results, "pipeline")
    for rank, v in enumerate(values):
        for name, r in v.items():
            assert r["param_diff"] <= TOL, (rank, name, r["param_diff"])
            # each stage's gradient all-reduce stays inside the node: 2(2-1)/2 x its bytes,
            # the 4-byte element saying whether the step failed in some pipeline and one
            # 4-byte presence element per trainable parameter
            assert r["intra_per_step"] == pytest.approx(
                r["grad_bytes"] + 4 + 4 * r["param_tensors"]), (rank, name)
            # activations forward and gradients backward cross the link (the sender counts)
            assert r["inter_per_step"] > 0, (rank, name)
    for name in values[0]:  # the two pipelines' half-batch losses average to the oracle's
        for a, b, ref in zip(values[2][name]["losses"], values[3][name]["losses"],
                             values[2][name]["ref_losses"]):
            assert (a + b) / 2 == pytest.approx(ref, abs=TOL), name


def test_tensor_parallel_inside_a_node(cluster_results):
    values = _values(cluster_results, "tensor_parallel")
    assert [v["tp_ranks"] for v in values] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for v in values:
        for zero in ("zero1", "zero3"):
            r = v[zero]
            assert r["param_diff"] <= TOL, (zero, r)
            # tensor-parallel all-reduces on the node's group, data parallel across the link
            assert r["intra"] > 0 and r["inter"] > 0, (zero, r)


def test_initialize_every_zero_stage_matches_single_process(cluster_results):
    for v in _values(cluster_results, "initialize"):
        for stage, r in v.items():
            assert r["vs_oracle"] <= TOL and r["vs_hand"] <= 1e-6, (stage, r)
            assert r["global_steps"] == checks.STEPS and r["comm_equal"], (stage, r)


def test_full_shard_puts_3m_on_spanning_groups(cluster_results):
    # n = 2 ranks per node, k = 2 nodes: 3M(nk-1)/nk elements per step per rank, within 5%
    for v in _values(cluster_results, "full_shard_bytes"):
        nk = v["world"]
        assert v["inter_elements"] == pytest.approx(3 * v["psi"] * (nk - 1) / nk, rel=0.05), v
        assert v["intra_bytes"] == 0, v  # the world group spans both nodes


def test_hybrid_and_hpz_parity_and_spanning_elements(cluster_results):
    from tests.nn.test_fsdp_hybrid import inter_node_formulas
    for rank, v in enumerate(_values(cluster_results, "hybrid_and_hpz")):
        for name, r in v["parity"].items():
            assert r["shards"] <= TOL and r["state_dict"] <= TOL and r["loss"] <= TOL, (rank, r)
        counted = v["bytes"]
        expected = inter_node_formulas(counted["full_shard"]["psi"], 2, 2)
        for name, r in counted.items():
            assert r["inter"] == pytest.approx(expected[name], rel=0.05), (rank, name, r)
        assert counted["hybrid"]["inter_bytes"] <= 0.25 * counted["full_shard"]["inter_bytes"]


def _resume_on_three_ranks(ckpt_dir, stage):
    engine, _, _, _ = shardkit.initialize(model=GPT(checks.CKPT_TINY, seed=99),
                                          config=checks._engine_config(stage))
    path, client_state = engine.load_checkpoint(ckpt_dir)
    after = checks.engine_steps(engine, checks.CKPT_STEPS_BEFORE, checks.CKPT_STEPS_AFTER)
    return {"path": path, "client_state": client_state, "global_steps": engine.global_steps,
            "after": after if shardkit.distributed.get_rank() == 0 else None}


def test_checkpoint_from_two_nodes_resumes_on_three_ranks(cluster_results):
    saved = _values(cluster_results, "save_checkpoint")
    reference = torch.load(os.path.join(cluster_results["dir"], "ckpt_reference_after.pt"))
    ckpt_dir = os.path.join(cluster_results["dir"], "ckpt")
    with World(3) as world:
        for stage in (3, 1):
            results = world.run(_resume_on_three_ranks, ckpt_dir, stage)
            for r in results:
                assert r["path"] == saved[0]["path"] and r["client_state"] == {"nodes": 2}
                assert r["global_steps"] == checks.CKPT_STEPS_BEFORE + checks.CKPT_STEPS_AFTER
            for got, want in zip(results[0]["after"], reference):
                assert got.keys() == want.keys()
                diff = max(float((got[k] - want[k]).abs().max()) for k in want)
                assert diff <= TOL, (stage, diff)
