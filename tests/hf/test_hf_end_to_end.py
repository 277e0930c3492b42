"""Hugging Face GPT-2 and Llama models (tiny configs, built here, never downloaded) train under
every shardkit wrapper exactly as in one process, tied embeddings included, and their
consolidated checkpoints load back into a fresh HF model and ``save_pretrained``.

Every rank runs the single-process oracle itself (full global batch, same seed) and compares its
full parameters after every step, so a rank whose tied weight drifts fails on that rank.
"""

import os
import subprocess
import sys

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import shardkit
from shardkit.__main__ import main as shardkit_main
from shardkit import distributed
from shardkit.checkpoint.consolidate import consolidate_checkpoint
from shardkit.nn import FullyShardedDataParallel as FSDP, ShardedDataParallel
from shardkit.nn.checkpoint import apply_activation_checkpointing
from shardkit.nn.wrap import auto_wrap, no_split_modules_policy
from shardkit.optim import OSS
from shardkit.testing import world_fixture
from tests.hf.hf_common import batch, build

GLOBAL_BATCH, MICRO, STEPS, LR = 4, 2, 3, 1e-2
# A token seen only at the last position gets a mathematically zero embedding gradient whose
# rounding noise (~1e-9) AdamW with a tiny eps would turn into lr-sized steps: moderate eps.
EPS = 1e-4
MODELS = [("gpt2", True), ("gpt2", False), ("llama", False), ("llama", True)]
WRAPPERS = ["fsdp", "fsdp_keep_full", "fsdp_checkpointed", "fsdp_checkpoint_inside",
            "fsdp_no_shard", "fsdp_hybrid", "fsdp_hybrid_zero2", "oss_ddp",
            "sharded_ddp_oss", "stage0", "stage1", "stage2", "stage3"]
# the sharding strategies beside FULL_SHARD / SHARD_GRAD_OP ("fsdp", "fsdp_keep_full"); in this
# world of 2 on one node, HYBRID shards over the node and replicates over a group of one
STRATEGIES = {"fsdp_no_shard": "NO_SHARD", "fsdp_hybrid": "HYBRID_SHARD",
              "fsdp_hybrid_zero2": "_HYBRID_SHARD_ZERO2"}

world2 = world_fixture(2)


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.01)


def _oracle(kind, tied):
    model = build(kind, tied)
    opt = _adamw(model.parameters())
    history = []
    for step in range(STEPS):
        ids = batch(step, GLOBAL_BATCH)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return history


def _engine_config(stage):
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 10 ** 6,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS,
                                                      "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}}


def _build_wrapped(kind, tied, wrapper):
    """(step_fn(ids), full_state_fn(), engine or None) for one wrapper."""
    model = build(kind, tied)
    if wrapper.startswith("stage"):
        engine, _, _, _ = shardkit.initialize(model=model, config=_engine_config(int(wrapper[5:])))

        def step(ids):
            for x in ids.split(MICRO):
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()

        def full():
            if engine.zero_stage == 3:
                return engine.wrapped.state_dict()
            return engine.module.state_dict()
        return step, full, engine
    if wrapper.startswith("fsdp"):
        policy = no_split_modules_policy(model)
        if wrapper == "fsdp_checkpoint_inside":  # blocks checkpointed, then wrapped
            apply_activation_checkpointing(model, policy)
        if wrapper in STRATEGIES:
            kwargs = {"sharding_strategy": STRATEGIES[wrapper]}
        else:
            kwargs = {"reshard_after_forward": wrapper != "fsdp_keep_full"}
        wrapped = FSDP(auto_wrap(model, policy, **kwargs), **kwargs)
        if wrapper == "fsdp_checkpointed":
            apply_activation_checkpointing(wrapped, policy)
            units = [m for m in wrapped.modules() if hasattr(m, "_shardkit_unwrapped_forward")]
            assert len(units) == model.config.num_hidden_layers
            assert all(isinstance(u, FSDP) for u in units)
        opt = _adamw(wrapped.parameters())
        full = wrapped.state_dict
    elif wrapper == "oss_ddp":
        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=LR, eps=EPS,
                  weight_decay=0.01)
        wrapped = DDP(model)
        full = model.state_dict
    else:
        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=LR, eps=EPS,
                  weight_decay=0.01)
        wrapped = ShardedDataParallel(model, opt)
        full = model.state_dict

    def step(ids):
        wrapped(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return step, full, None


def _embedding_names(kind):
    return ("transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight",
            "lm_head.weight")


def _train_and_compare(kind, tied, wrapper, save_dir=None):
    """Max parameter difference to the oracle per step, the tied pair's checks, and (with
    ``save_dir``) the engine checkpoint path."""
    oracle = _oracle(kind, tied)
    step, full, engine = _build_wrapped(kind, tied, wrapper)
    rank, world = distributed.get_rank(), distributed.get_world_size()
    per = GLOBAL_BATCH // world
    diffs, tied_ok, tied_moved, worst = [], [], [], []
    emb, head = _embedding_names(kind)
    for s in range(STEPS):
        ids = batch(s, GLOBAL_BATCH)[rank * per:(rank + 1) * per]
        step(ids)
        state = {k: v.detach().clone() for k, v in full().items()}
        want = oracle[s]
        assert set(state) == set(want), (wrapper, sorted(set(want) ^ set(state)))
        diffs.append(max(float((state[k] - want[k]).abs().max()) for k in want))
        worst.append(max(want, key=lambda k: float((state[k] - want[k]).abs().max())))
        if tied:
            tied_ok.append(torch.equal(state[head], state[emb]) and
                           float((state[emb] - want[emb]).abs().max()) <= 1e-5)
    if tied:
        tied_moved.append(float((oracle[-1][emb] - build(kind, tied).state_dict()[emb])
                                .abs().max()))
    path = engine.save_checkpoint(save_dir) if (engine is not None and save_dir) else None
    return {"worst": worst, "diffs": diffs, "tied_ok": tied_ok, "tied_moved": tied_moved,
            "path": path}


def _matrix(save_root):
    out = {}
    for kind, tied in MODELS:
        for wrapper in WRAPPERS:
            save = os.path.join(save_root, f"{kind}-{tied}-{wrapper}") \
                if wrapper.startswith("stage") else None
            out[(kind, tied, wrapper)] = _train_and_compare(kind, tied, wrapper, save)
    return out


@pytest.fixture(scope="module")
def matrix(world2, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf_ckpt"))
    return root, world2.run(_matrix, root)


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("kind,tied", MODELS)
def test_matches_single_process_on_every_rank(matrix, kind, tied, wrapper):
    for rank, results in enumerate(matrix[1]):
        r = results[(kind, tied, wrapper)]
        assert max(r["diffs"]) <= 1e-5, (rank, r["diffs"], r["worst"])
        if tied:
            # the shared weight equals its oracle and its alias on every rank at every step
            assert r["tied_ok"] == [True] * STEPS, (rank, r["tied_ok"])
            assert r["tied_moved"][0] > 1e-3  # and training really moved it


@pytest.mark.parametrize("kind,tied", MODELS)
def test_consolidated_checkpoint_of_every_stage_loads_strictly_and_saves_pretrained(
        matrix, kind, tied, tmp_path):
    from safetensors.torch import load_file
    root, results = matrix
    final = _oracle(kind, tied)[-1]
    config_dir = tmp_path / "config"
    build(kind, tied).config.save_pretrained(config_dir)
    for stage in range(4):
        ckpt = os.path.dirname(results[0][(kind, tied, f"stage{stage}")]["path"])
        fresh = build(kind, tied, seed=123)
        fresh.load_state_dict(consolidate_checkpoint(ckpt), strict=True)
        for k, v in fresh.state_dict().items():
            torch.testing.assert_close(v, final[k], rtol=0, atol=1e-5, msg=k)
        out = tmp_path / f"pretrained-{stage}"
        argv = [ckpt, str(out), "--hf-config", str(config_dir), "--hf-model-class",
                type(fresh).__name__]
        if stage == 3 and kind == "llama":  # once through a real `python -m shardkit`
            run = subprocess.run([sys.executable, "-m", "shardkit", "consolidate", *argv],
                                 capture_output=True, text=True)
            assert run.returncode == 0, run.stderr
        else:  # the same entry point in-process (importing transformers costs seconds)
            assert shardkit_main(["consolidate", *argv]) == 0
        assert (out / "model.safetensors").exists() and (out / "config.json").exists()
        loaded = type(fresh).from_pretrained(out)
        for k, v in loaded.state_dict().items():
            torch.testing.assert_close(v, final[k], rtol=0, atol=1e-5, msg=k)
        if tied:
            emb, head = _embedding_names(kind)
            assert loaded.get_parameter(head) is loaded.get_parameter(emb)
            assert head not in load_file(out / "model.safetensors")  # stored once


def test_consolidate_hf_errors(matrix, tmp_path, capsys):
    ckpt = os.path.dirname(matrix[1][0][("gpt2", True, "stage1")]["path"])
    build("llama", False).config.save_pretrained(tmp_path / "llama")
    code = shardkit_main(["consolidate", ckpt, str(tmp_path / "out"), "--hf-config",
                          str(tmp_path / "llama"), "--hf-model-class", "LlamaForCausalLM"])
    assert code == 2 and "does not match LlamaForCausalLM" in capsys.readouterr().err
    code = shardkit_main(["consolidate", ckpt, str(tmp_path / "out"), "--hf-config",
                          str(tmp_path / "llama"), "--hf-model-class", "NoSuchModel"])
    assert code == 2 and "transformers has no class" in capsys.readouterr().err
    # a folder without config.json, and a config.json that is not JSON: a transformers
    # traceback and exit 1 before
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    for folder in ("empty", "broken"):
        code = shardkit_main(["consolidate", ckpt, str(tmp_path / "out"), "--hf-config",
                              str(tmp_path / folder)])
        err = capsys.readouterr().err
        assert code == 2 and "no usable Hugging Face config there" in err, err
