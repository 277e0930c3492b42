"""What Hugging Face fine-tuning scripts do beside the plain loop of test_hf_end_to_end, under
every wrapper, against single-process training on every rank after every step: HF's own
activation checkpointing (``gradient_checkpointing_enable``, reentrant or not), right-padded
batches with ``labels=-100``, frozen input embeddings, LoRA-style adapters on a frozen model,
``resize_token_embeddings`` before wrapping, T5's shared embeddings, FSDP ``no_sync``
accumulation, shardkit's activation checkpointing of layers handed a key/value cache
(``use_cache=True``); and the clear errors for what cannot work (a reentrant checkpoint under
the engine's torch DDP with ``find_unused_parameters``, resizing an embedding after FSDP wrapped
it).

The oracle averages the per-rank losses (each the mean over that rank's unpadded tokens), as
data-parallel training does.
"""

import functools

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import shardkit
from shardkit import distributed
from shardkit.nn import FullyShardedDataParallel as FSDP, ShardedDataParallel
from shardkit.nn.checkpoint import apply_activation_checkpointing
from shardkit.nn.wrap import auto_wrap, no_split_modules_policy
from shardkit.optim import OSS
from shardkit.testing import world_fixture
from tests.hf.hf_common import SEQ, VOCAB, build, tiny_t5, transformers

STEPS, LR, EPS = 3, 1e-2, 1e-4
world2 = world_fixture(2)


# ----------------------------------------------------------------------------- models, data

MODELS = {"gpt2": functools.partial(build, "gpt2", True),
          "llama": functools.partial(build, "llama", False),
          "llama_tied": functools.partial(build, "llama", True), "t5": tiny_t5}


def _padded_batch(step: int, n: int = 4) -> dict:
    """Right-padded rows of different lengths; padding is masked and labelled -100."""
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(2, VOCAB, (n, SEQ), generator=g)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    labels = ids.clone()
    for row in range(n):
        length = 3 + (row + step) % (SEQ - 3)
        ids[row, length:], mask[row, length:], labels[row, length:] = 0, 0, -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _rows(batch: dict, start: int, stop: int) -> dict:
    return {k: v[start:stop] for k, v in batch.items()}


# ----------------------------------------------------------------------------- preparations

def _hf_checkpointing(model, reentrant: bool = False):
    """HF's own activation checkpointing, as a training script enables it."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:  # transformers >= 5: the new name of the same switch
        enable({"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})


class _LoRA(nn.Module):
    """``base(x) + x A^T B^T`` with ``B`` zero at start: the adapter a PEFT script adds."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def _lora(model):
    torch.manual_seed(7)
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = _LoRA(layer.self_attn.q_proj)
        layer.self_attn.v_proj = _LoRA(layer.self_attn.v_proj)


PREPARE = {
    "plain": lambda m: None,
    "hf_gc": _hf_checkpointing,
    "hf_gc_reentrant": functools.partial(_hf_checkpointing, reentrant=True),
    "frozen_embedding": lambda m: m.get_input_embeddings().requires_grad_(False),
    "lora_hf_gc": lambda m: (_lora(m), _hf_checkpointing(m)),
    "resized": lambda m: m.resize_token_embeddings(VOCAB + 6),
    # as from_pretrained gives a model: its layers get a key/value cache in training forwards
    "use_cache": lambda m: setattr(m.config, "use_cache", True),
    "use_cache_checkpointed": lambda m: (setattr(m.config, "use_cache", True),
                                         apply_activation_checkpointing(
                                             m, no_split_modules_policy(m))),
}


# ----------------------------------------------------------------------------- training

def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.01)


def _fresh(model_name: str, prepare: str):
    model = MODELS[model_name]()
    PREPARE[prepare](model)
    return model


def _state(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _oracle(model_name, prepare, world, micro):
    """Per step: the full state after one step on the global batch, each rank's rows a
    separate mean loss (and ``micro`` accumulation slices of those rows), averaged."""
    model = _fresh(model_name, prepare)
    opt = _adamw([p for p in model.parameters() if p.requires_grad])
    per, history = 4 * micro // world, []
    for step in range(STEPS):
        batch = _padded_batch(step, 4 * micro)
        slices = [(r * per + i * per // micro, r * per + (i + 1) * per // micro)
                  for r in range(world) for i in range(micro)]
        loss = sum(model(**_rows(batch, *s)).loss for s in slices) / len(slices)
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append(_state(model))
    return history


def _engine_config(stage, micro, world, **zero):
    return {"train_batch_size": 4 * micro, "train_micro_batch_size_per_gpu": 4 // world,
            "steps_per_print": 10 ** 6, "zero_optimization": {"stage": stage, **zero},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS,
                                                      "weight_decay": 0.01}}}


def _wrapped(model, wrapper, micro, world):
    """(step(rows of this rank), full state()) for one wrapper."""
    if wrapper.startswith("stage"):
        zero = {"ignore_unused_parameters": False} if wrapper.endswith("_all_used") else {}
        stage = int(wrapper[5])
        engine, _, _, _ = shardkit.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=_engine_config(stage, micro, world, **zero))

        def engine_step(rows):
            per = rows["input_ids"].shape[0] // micro
            for i in range(micro):
                engine.backward(engine(**_rows(rows, i * per, (i + 1) * per)).loss)
                engine.step()
        return engine_step, lambda: _state(engine.wrapped if stage == 3 else engine.module)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if wrapper.startswith("fsdp"):
        kwargs = {"reshard_after_forward": wrapper != "fsdp_zero2"}
        if wrapper == "fsdp_hybrid":
            kwargs = {"sharding_strategy": "HYBRID_SHARD"}
        policy = no_split_modules_policy(model)
        net = FSDP(auto_wrap(model, policy, **kwargs), **kwargs)
        if wrapper == "fsdp_checkpointed":  # the units themselves checkpointed
            apply_activation_checkpointing(net, policy)
        opt, state = _adamw([p for p in net.parameters() if p.requires_grad]), net
    else:
        opt = OSS(trainable, optim=torch.optim.AdamW, lr=LR, eps=EPS, weight_decay=0.01)
        net = DDP(model) if wrapper == "oss_ddp" else ShardedDataParallel(model, opt)
        state = model

    def step(rows):
        per = rows["input_ids"].shape[0] // micro
        for i in range(micro):
            context = net.no_sync() if i < micro - 1 else _nothing()
            with context:
                (net(**_rows(rows, i * per, (i + 1) * per)).loss / micro).backward()
        opt.step()
        opt.zero_grad()
    return step, lambda: _state(state)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# (model, preparation, wrapper, micro-batches per step)
CASES = [
    ("gpt2", "hf_gc", "fsdp", 1), ("gpt2", "hf_gc", "fsdp_zero2", 1),
    ("llama_tied", "hf_gc", "fsdp_hybrid", 1), ("llama", "hf_gc_reentrant", "fsdp", 1),
    ("gpt2", "hf_gc", "fsdp", 2),
    ("gpt2", "hf_gc_reentrant", "oss_ddp", 1), ("gpt2", "hf_gc_reentrant", "sharded_ddp", 1),
    ("gpt2", "hf_gc_reentrant", "stage0_all_used", 1),
    ("gpt2", "hf_gc_reentrant", "stage1_all_used", 1),
    ("gpt2", "hf_gc_reentrant", "stage2", 1), ("gpt2", "hf_gc_reentrant", "stage3", 1),
    ("llama", "plain", "fsdp", 1), ("llama", "plain", "sharded_ddp", 1),
    ("llama", "plain", "stage1", 2), ("llama", "plain", "stage3", 2),
    ("llama", "frozen_embedding", "fsdp", 1), ("gpt2", "frozen_embedding", "stage2", 1),
    ("llama", "lora_hf_gc", "fsdp", 1), ("llama", "lora_hf_gc", "sharded_ddp", 1),
    ("llama", "lora_hf_gc", "stage1", 1), ("llama", "lora_hf_gc", "stage3", 1),
    ("gpt2", "resized", "fsdp", 1), ("llama_tied", "resized", "stage3", 1),
    ("t5", "plain", "fsdp", 1), ("t5", "hf_gc", "stage2", 1), ("t5", "plain", "stage3", 1),
    ("gpt2", "use_cache", "fsdp_checkpointed", 1), ("t5", "use_cache", "fsdp_checkpointed", 1),
    ("llama", "use_cache_checkpointed", "fsdp", 1),
    ("t5", "use_cache_checkpointed", "sharded_ddp", 1),
]


def _max_diff(state: dict, want: dict):
    assert set(state) == set(want), sorted(set(state) ^ set(want))
    return max(float((state[k] - want[k]).abs().max()) for k in want)


def _run_case(model_name, prepare, wrapper, micro):
    rank, world = distributed.get_rank(), distributed.get_world_size()
    history = _oracle(model_name, prepare, world, micro)
    step, state = _wrapped(_fresh(model_name, prepare), wrapper, micro, world)
    per, diffs = 4 * micro // world, []
    for s in range(STEPS):
        step(_rows(_padded_batch(s, 4 * micro), rank * per, (rank + 1) * per))
        diffs.append(_max_diff(state(), history[s]))
    moved = _max_diff(history[-1], _state(_fresh(model_name, prepare)))
    return diffs, moved


def _all_cases():
    return {case: _run_case(*case) for case in CASES}


@pytest.fixture(scope="module")
def results(world2):
    return world2.run(_all_cases)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_hf_recipe_matches_single_process_on_every_rank(results, case):
    for rank, per_rank in enumerate(results):
        diffs, moved = per_rank[case]
        assert max(diffs) <= 2e-5, (rank, diffs)
        assert moved > 1e-3  # training really moved the weights


# ----------------------------------------------------------------------------- clear errors

def _reentrant_under_find_unused(stage):
    model = _fresh("gpt2", "hf_gc_reentrant")
    engine, _, _, _ = shardkit.initialize(model=model, config=_engine_config(stage, 1, 2))
    rows = _rows(_padded_batch(0), 0, 2)
    try:
        engine.backward(engine(**rows).loss)
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("stage", [0, 1])
def test_reentrant_checkpoint_under_find_unused_parameters_names_the_config_key(world2, stage):
    for message in world2.run(_reentrant_under_find_unused, stage):
        assert f"zero_optimization.stage={stage} with ignore_unused_parameters=true" in message
        assert '"ignore_unused_parameters": false' in message and "use_reentrant=False" in message


def _resize_after_wrapping():
    model = build("gpt2", True)
    wrapped = FSDP(auto_wrap(model, no_split_modules_policy(model)))
    wrapped.resize_token_embeddings(VOCAB + 9)
    try:
        wrapped(**_padded_batch(0))
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_resizing_an_embedding_after_fsdp_wrapped_it_is_a_clear_error(world2):
    for message in world2.run(_resize_after_wrapping):
        assert "Embedding.weight" in message and f"({VOCAB + 9}, 16) after wrapping" in message
        assert "resize_token_embeddings) before wrapping" in message


def _save_pretrained(directory):
    """``save_pretrained`` on the FSDP-wrapped model: refused without a state dict (it would
    write this rank's row shards); with the wrapper's full state dict, loadable as saved."""
    model = build("llama", True)
    wrapped = FSDP(auto_wrap(model, no_split_modules_policy(model)))
    try:
        wrapped.save_pretrained(directory)
        refusal = "no error"
    except RuntimeError as error:
        refusal = str(error)
    state = wrapped.state_dict()
    if distributed.get_rank() == 0:
        wrapped.save_pretrained(directory, state_dict=state)
    return refusal, {k: v.clone() for k, v in state.items()}


def test_save_pretrained_of_the_wrapped_model_needs_its_full_state_dict(world2, tmp_path):
    results = world2.run(_save_pretrained, str(tmp_path))
    for refusal, _ in results:
        assert refusal.startswith("LlamaForCausalLM.state_dict(): its parameters are "
                                  "FullyShardedDataParallel row shards"), refusal
        assert "save_pretrained(dir, state_dict=fsdp_model.state_dict())" in refusal
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    want = build("llama", True).state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, want[k]) and torch.equal(results[1][1][k], want[k]), k
