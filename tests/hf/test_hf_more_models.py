"""Hugging Face families whose structure differs from GPT-2/Llama/T5, under every shardkit
wrapper, against one-process training on every rank after every AdamW step (fp32, world 2,
each rank its slice of the same global batch):

* BERT pre-training with the masked-LM loss only: token type ids, right padding masked out,
  a decoder tied to the word embeddings, and a pooler + next-sentence head that the loss never
  reaches (parameters without gradients on every rank);
* Mixtral (top-2 of 4 experts stored as 3-D tensors, router aux loss): experts with no tokens
  on one rank get zero rows of gradient there;
* Qwen2-MoE (top-2 of 4 fused experts beside a gated shared expert, one dense layer);
* Switch Transformers (one module per expert): an expert that receives no tokens on one rank
  has no gradient there while the other rank's tokens reach it (unused on some ranks only);
* ViT image classification (pixel inputs, conv patch embedding, a cls token parameter);
* BERT, ViT and Switch with HF's ``gradient_checkpointing_enable()`` (Switch also reentrant:
  under FSDP's size-based policy its blocks' layer norms belong to the root unit, read again
  by each block's recomputation inside backward).

Wrappers: OSS + torch DDP, ShardedDataParallel + OSS, FullyShardedDataParallel auto-wrapped on
the model's ``_no_split_modules`` blocks and with the size-based default policy, and
``shardkit.initialize`` at ZeRO stages 0-3. The full state dict taken from each wrapped model
loads strictly into a fresh HF model; ``save_pretrained``/``from_pretrained`` round-trips it.
The oracle averages the per-rank losses, as data-parallel training does.
"""

import functools
import os

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import shardkit
from shardkit import distributed
from shardkit.nn import FullyShardedDataParallel as FSDP, ShardedDataParallel
from shardkit.nn.wrap import auto_wrap, default_auto_wrap_policy, no_split_modules_policy
from shardkit.optim import OSS
from shardkit.testing import world_fixture
from tests.hf.hf_common import (SEQ, VOCAB, bert_pretraining, mixtral, qwen2_moe,
                                switch_transformers, vit)

STEPS, LR, EPS, ROWS = 3, 1e-2, 1e-4, 4
world2 = world_fixture(2)


# ----------------------------------------------------------------------------- models, data

def _hf_gc(model, reentrant: bool = False):
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    return model


MODELS = {"bert": bert_pretraining, "mixtral": mixtral, "qwen2_moe": qwen2_moe,
          "switch": switch_transformers,
          "vit": vit, "bert_gc": lambda seed=0: _hf_gc(bert_pretraining(seed)),
          "vit_gc": lambda seed=0: _hf_gc(vit(seed)),
          "switch_gc": lambda seed=0: _hf_gc(switch_transformers(seed)),
          # reentrant: each checkpointed block's backward is an autograd graph task of its own
          "switch_gc_reentrant": lambda seed=0: _hf_gc(switch_transformers(seed), True)}
MASK_ID = 3


def _text_batch(step: int, n: int = ROWS) -> dict:
    """Right-padded rows of different lengths (padding masked out, labelled -100)."""
    g = torch.Generator().manual_seed(3000 + step)
    ids = torch.randint(4, VOCAB, (n, SEQ), generator=g)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    labels = ids.clone()
    for row in range(n):
        length = 4 + (row + step) % (SEQ - 3)
        ids[row, length:], mask[row, length:], labels[row, length:] = 0, 0, -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _mlm_batch(step: int, n: int = ROWS) -> dict:
    """Masked-LM rows: two segments (token type ids 0 then 1), right padding, a third of the
    real tokens replaced by [MASK] and labelled; every row has at least one label."""
    out = _text_batch(step, n)
    g = torch.Generator().manual_seed(4000 + step)
    real = out["attention_mask"].bool()
    chosen = (torch.rand(n, SEQ, generator=g) < 0.34) & real
    chosen[:, 1] = True
    out["labels"] = torch.where(chosen, out["input_ids"], torch.full_like(out["input_ids"], -100))
    out["input_ids"] = torch.where(chosen, torch.full_like(out["input_ids"], MASK_ID),
                                   out["input_ids"])
    out["token_type_ids"] = (torch.arange(SEQ) >= SEQ // 2).long().expand(n, SEQ).clone()
    return out


def _seq2seq_batch(step: int, n: int = ROWS) -> dict:
    out = _text_batch(step, n)
    g = torch.Generator().manual_seed(5000 + step)
    out["labels"] = torch.randint(2, VOCAB, (n, 4), generator=g)
    return out


def _image_batch(step: int, n: int = ROWS) -> dict:
    g = torch.Generator().manual_seed(6000 + step)
    return {"pixel_values": torch.randn(n, 3, 8, 8, generator=g),
            "labels": torch.randint(0, 5, (n,), generator=g)}


BATCHES = {"bert": _mlm_batch, "bert_gc": _mlm_batch, "mixtral": _text_batch,
           "qwen2_moe": _text_batch,
           "switch": _seq2seq_batch, "vit": _image_batch, "vit_gc": _image_batch,
           "switch_gc": _seq2seq_batch, "switch_gc_reentrant": _seq2seq_batch}


def _loss(model, rows: dict):
    """The training loss of one slice of rows; BERT's is the masked-LM loss only (so its
    pooler and next-sentence head get no gradient), the others the model's own loss."""
    if "token_type_ids" in rows:
        inputs = {k: v for k, v in rows.items() if k != "labels"}
        logits = model(**inputs).prediction_logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows["labels"].reshape(-1))
    return model(**rows).loss


def _rows(batch: dict, start: int, stop: int) -> dict:
    return {k: v[start:stop] for k, v in batch.items()}


def _state(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.01)


# ----------------------------------------------------------------------------- training

def _oracle(name, world):
    model = MODELS[name]()
    opt = _adamw(model.parameters())
    per, history = ROWS // world, []
    for step in range(STEPS):
        batch = BATCHES[name](step)
        loss = sum(_loss(model, _rows(batch, r * per, (r + 1) * per)) for r in range(world))
        (loss / world).backward()
        opt.step()
        opt.zero_grad()
        history.append(_state(model))
    return history


def _engine_config(stage, world, **zero):
    return {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": ROWS // world,
            "steps_per_print": 10 ** 6, "zero_optimization": {"stage": stage, **zero},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS,
                                                      "weight_decay": 0.01}}}


# a size that puts several units inside each model, some below a block (an expert, a linear)
DEFAULT_POLICY = functools.partial(default_auto_wrap_policy, min_num_params=600)


def _default_policy(model):
    """The size-based policy; for a model whose experts are modules of their own, those are
    excluded from wrapping (each would be a unit run on some ranks only: see
    test_fsdp_unit_per_expert_is_a_clear_error_in_debug_mode), so the MoE layer that routes
    becomes the unit."""
    experts = {type(m) for name, m in model.named_modules() if ".experts." in name}
    if not experts:
        return DEFAULT_POLICY
    excluded = set(default_auto_wrap_policy.EXCLUDE_WRAP_MODULES) | experts
    return functools.partial(DEFAULT_POLICY, exclude_wrap_modules=excluded)


def _wrapped(model, wrapper, world):
    """(step(rows of this rank), full state dict(), the object to save_pretrained) for one
    wrapper."""
    if wrapper.startswith("stage"):
        stage = int(wrapper[5])
        engine, _, _, _ = shardkit.initialize(model=model, config=_engine_config(stage, world))

        def engine_step(rows):
            engine.backward(_loss(engine, rows))
            engine.step()
        full = engine.wrapped.state_dict if stage == 3 else engine.module.state_dict
        return engine_step, full, engine.module
    if wrapper.startswith("fsdp"):
        policy = _default_policy(model) if wrapper == "fsdp_default" \
            else no_split_modules_policy(model)
        net = auto_wrap(model, policy)
        if not isinstance(net, FSDP):  # the size-based policy may already wrap the root
            net = FSDP(net)
        opt, full = _adamw(net.parameters()), net.state_dict
    else:
        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=LR, eps=EPS,
                  weight_decay=0.01)
        net = DDP(model, find_unused_parameters=True) if wrapper == "oss_ddp" \
            else ShardedDataParallel(model, opt)
        full = model.state_dict

    def step(rows):
        _loss(net, rows).backward()
        opt.step()
        opt.zero_grad()
    return step, full, net


WRAPPERS = ["oss_ddp", "sharded_ddp", "fsdp", "fsdp_default", "stage0", "stage1", "stage2",
            "stage3"]
# a reentrant checkpoint under torch DDP with find_unused_parameters (oss_ddp, stages 0-1 by
# default) cannot work (torch: "mark a variable ready only once"; the engine's clear error is
# tested in test_hf_training_recipes)
REENTRANT_WRAPPERS = ["sharded_ddp", "fsdp", "fsdp_default", "stage2", "stage3"]


def _wrappers_of(name):
    return REENTRANT_WRAPPERS if name.endswith("_reentrant") else WRAPPERS


CASES = [(m, w) for m in MODELS for w in _wrappers_of(m)]


def _max_diff(state: dict, want: dict):
    assert set(state) == set(want), sorted(set(state) ^ set(want))
    return max(float((state[k] - want[k]).abs().max()) for k in want)


def _run_case(name, wrapper, oracle, save_dir):
    rank, world = distributed.get_rank(), distributed.get_world_size()
    step, full, saver = _wrapped(MODELS[name](), wrapper, world)
    per, diffs = ROWS // world, []
    for s in range(STEPS):
        step(_rows(BATCHES[name](s), rank * per, (rank + 1) * per))
        diffs.append(_max_diff(_state_of(full()), oracle[s]))
    # the full state dict loads strictly into a fresh HF model of another seed
    state = full()
    fresh = MODELS[name](seed=123)
    fresh.load_state_dict(state, strict=True)
    loaded = _max_diff(_state(fresh), oracle[-1])
    if save_dir is not None and rank == 0:  # save_pretrained called on the wrapped model
        saver.save_pretrained(save_dir, state_dict=state)
    return diffs, loaded


def _state_of(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


SAVED = ["fsdp", "stage3", "sharded_ddp"]  # save_pretrained through these wrappers


def _all_cases(root):
    world, out = distributed.get_world_size(), {}
    for name in MODELS:
        oracle = _oracle(name, world)
        moved = _max_diff(oracle[-1], _state(MODELS[name]()))
        out[name] = oracle[-1]
        for wrapper in _wrappers_of(name):
            save = os.path.join(root, f"{name}-{wrapper}") if wrapper in SAVED else None
            try:
                out[(name, wrapper)] = _run_case(name, wrapper, oracle, save) + (moved,)
            except Exception as error:  # noqa: BLE001 - reported per case
                out[(name, wrapper)] = f"{type(error).__name__}: {error}"
    return out


@pytest.fixture(scope="module")
def results(world2, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf_more"))
    return root, world2.run(_all_cases, root)


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_hf_model_matches_single_process_on_every_rank(results, case):
    for rank, per_rank in enumerate(results[1]):
        result = per_rank[case]
        assert not isinstance(result, str), (rank, result)
        diffs, loaded, moved = result
        assert max(diffs) <= 2e-5, (rank, diffs)
        assert loaded <= 2e-5, (rank, loaded)  # its full state dict loads strictly
        assert moved > 1e-3  # training really moved the weights


@pytest.mark.parametrize("wrapper", SAVED)
@pytest.mark.parametrize("name", ["bert", "mixtral", "switch", "vit"])
def test_save_pretrained_from_the_wrapped_model_round_trips(results, name, wrapper):
    root, per_rank = results
    loaded = type(MODELS[name]()).from_pretrained(os.path.join(root, f"{name}-{wrapper}"))
    want = per_rank[0][name]
    assert _max_diff(_state(loaded), want) <= 2e-5
    if name == "bert":  # the masked-LM decoder still shares the word embeddings
        assert loaded.cls.predictions.decoder.weight is \
            loaded.bert.embeddings.word_embeddings.weight


# ----------------------------------------------------------------------------- clear errors

def _strict_unused(name, stage):
    """Stage 0/1 with ``"ignore_unused_parameters": false`` (torch DDP without
    find_unused_parameters) on a model whose loss leaves parameters without gradients: the
    first backward raises, before any step (the weights are still the initial ones)."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    model = MODELS[name]()
    before = _state(model)
    engine, _, _, _ = shardkit.initialize(
        model=model, config=_engine_config(stage, world, ignore_unused_parameters=False))
    per = ROWS // world
    message = "no error"
    try:
        for s in range(2):
            rows = _rows(BATCHES[name](s), rank * per, (rank + 1) * per)
            engine.backward(_loss(engine, rows))
            engine.step()
    except RuntimeError as error:
        message = str(error)
    return message, engine.global_steps, _max_diff(_state(model), before)


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("name", ["bert", "switch"])
def test_unused_parameters_without_ignore_unused_parameters_fail_before_any_step(
        world2, name, stage):
    unused = "bert.pooler.dense.weight" if name == "bert" else ".mlp.experts.expert_"
    for rank, (message, steps, moved) in enumerate(world2.run(_strict_unused, name, stage)):
        assert message.startswith(f"engine.backward: zero_optimization.stage={stage} with "
                                  f'"ignore_unused_parameters": false'), message
        assert f"on rank {rank} " in message and unused in message, message
        assert '"ignore_unused_parameters": true in zero_optimization' in message
        assert steps == 0 and moved == 0.0  # nothing stepped on this rank's own gradients


def _frozen_heads_accumulated(stage):
    """The fix the error names, with two micro-batches per step: BERT's pooler and
    next-sentence head frozen before initialize, ``"ignore_unused_parameters": false``; it
    trains as in one process (the arrival check sees only the boundary backward's gradients,
    the first micro-batch's having been kept under no_sync)."""
    rank, world = distributed.get_rank(), distributed.get_world_size()

    def fresh():
        model = bert_pretraining()
        model.bert.pooler.requires_grad_(False)
        model.cls.seq_relationship.requires_grad_(False)
        return model

    oracle = fresh()
    opt = _adamw([p for p in oracle.parameters() if p.requires_grad])
    model = fresh()
    config = _engine_config(stage, world, ignore_unused_parameters=False)
    config["train_batch_size"], config["train_micro_batch_size_per_gpu"] = ROWS, 1
    engine, _, _, _ = shardkit.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config)
    per, diffs = ROWS // world, []
    for s in range(STEPS):
        batch = _mlm_batch(s)
        loss = sum(_loss(oracle, _rows(batch, r, r + 1)) for r in range(ROWS)) / ROWS
        loss.backward()
        opt.step()
        opt.zero_grad()
        for i in range(per):
            row = rank * per + i
            engine.backward(_loss(engine, _rows(batch, row, row + 1)))
            engine.step()
        diffs.append(_max_diff(_state(model), _state(oracle)))
    return diffs, engine.global_steps


@pytest.mark.parametrize("stage", [0, 1])
def test_frozen_unused_heads_train_without_ignore_unused_parameters(world2, stage):
    for diffs, steps in world2.run(_frozen_heads_accumulated, stage):
        assert steps == STEPS and max(diffs) <= 2e-5, diffs


def _unit_per_expert():
    """FSDP with the size-based policy alone: each Switch expert its own unit, run on the
    ranks whose tokens chose it only."""
    from shardkit.collective_check import set_debug_collectives
    rank, world = distributed.get_rank(), distributed.get_world_size()
    model = switch_transformers()
    net = auto_wrap(model, DEFAULT_POLICY)  # the policy wraps the root too
    per = ROWS // world
    set_debug_collectives(True)
    try:
        _loss(net, _rows(_seq2seq_batch(0), rank * per, (rank + 1) * per)).backward()
    except RuntimeError as error:
        return type(error).__name__, str(error)
    finally:
        set_debug_collectives(False)
    return "no error", ""


def test_fsdp_unit_per_expert_is_a_clear_error_in_debug_mode(world2):
    """Units run on some ranks only cannot work (gloo aborts on the mismatched gathers, or
    equal-sized ones pair silently, see FullyShardedDataParallel's docstring); with the
    collective debug mode every rank raises, naming the unit and the fix."""
    for kind, message in world2.run(_unit_per_expert):
        assert kind == "CollectiveMismatchError", message
        assert "parameter all-gathers are out of step at unit" in message, message
        assert "no_split_modules_policy(model)" in message and "exclude_wrap_modules" in message


def _arrival_check_corners(stage):
    """The unused-parameter check of stages 0-1 (``"ignore_unused_parameters": false``): a
    parameter made trainable after ``initialize`` is named as such (DDP never averages it), and
    engines built again over the same model replace the check's hooks instead of adding some."""
    world = distributed.get_world_size()
    model = bert_pretraining()
    config = _engine_config(stage, world, ignore_unused_parameters=False)
    weight = model.cls.predictions.transform.dense.weight
    hooks = []
    for _ in range(3):
        shardkit.initialize(model=model, config=config)
        hooks.append(len(weight._post_accumulate_grad_hooks or {}))
    model.bert.pooler.requires_grad_(False)
    model.cls.seq_relationship.requires_grad_(False)
    engine, _, _, _ = shardkit.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config)
    model.bert.pooler.requires_grad_(True)  # after initialize: DDP's reducer has not got it
    rank, per = distributed.get_rank(), ROWS // world
    try:
        engine.backward(_loss(engine, _rows(_mlm_batch(0), rank * per, (rank + 1) * per)))
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    return hooks, message


@pytest.mark.parametrize("stage", [0, 1])
def test_unused_parameter_check_names_late_trainable_parameters_and_keeps_one_hook(
        world2, stage):
    for hooks, message in world2.run(_arrival_check_corners, stage):
        assert hooks == [1, 1, 1], hooks
        assert "bert.pooler.dense.weight, bert.pooler.dense.bias became trainable after " \
            "shardkit.initialize" in message, message
