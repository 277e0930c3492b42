"""``python -m shardkit plan --model`` against what the wrappers really hold for Hugging Face
models (built from tiny configs, never downloaded).

- The activation estimate's shape: the attention head count and the vocabulary come from the
  model (Llama's attention keeps its head count in its ``config`` only, T5's is ``n_heads``,
  BERT's ``num_attention_heads``; a small vocabulary is smaller than BERT's 512 positions).
- Stages 1-2: the planned row is the most loaded rank's model states, to the byte, once the
  documented per-tensor remainders are set aside (Adam's 4-byte ``step`` count per owned
  tensor, at stage 2 ShardedDDP's 4-byte presence flag per owned gradient): OSS's sync-bucket
  padding, which every rank holds beside its weights, included (it was missed).
- ``--min-num-params`` plans the FSDP units the size policy really builds.
- ``model_state_bytes(engine)`` counts the optimizer the engine holds (it counted the
  weights only).

From a review:

From a review of 60e8a4a (the planner's FSDP units come from a dry run of ``auto_wrap``).

- ``fsdp_unit_sizes`` / ``rank_layout`` / ``summarize_model`` given both ``wrap_block`` and
  ``min_num_params``: the dry run takes one policy, so the size policy was dropped silently
  (before that commit both applied); it is a :class:`PlanError` naming both arguments, as
  ``--wrap-block`` with ``--min-num-params`` is on the command line.
- The dry run builds no FSDP wrapper and allocates nothing for a model on the meta device.
"""

import pytest
import torch
import torch.nn.functional as F

from shardkit import distributed, plan
from shardkit.models import GPT, GPTConfig
from shardkit.plan_model import (estimate_activation_bytes, rank_layout, summarize_model, PlanError,
                                 fsdp_unit_sizes)
from shardkit.recipes import adamw, compose
from shardkit.testing import world_fixture

from tests.hf.hf_common import SEQ, VOCAB, batch, bert_pretraining, build, tiny_t5

world4 = world_fixture(4)


# ----------------------------------------------------------------------------- model shape

@pytest.mark.parametrize("name, make, block", [
    ("llama", lambda: build("llama", False), "LlamaDecoderLayer"),
    ("t5", tiny_t5, "T5Block"),
    ("bert", bert_pretraining, "BertLayer"),
    ("gpt2", lambda: build("gpt2", True), "GPT2Block")])
def test_heads_and_vocabulary_come_from_the_model(name, make, block):
    model = make()
    summary = summarize_model(model, block)
    assert (summary.hidden, summary.heads, summary.vocab) == (16, 2, VOCAB), name
    # the unfused estimate's score term is 5·a·s/h per token and block: with a = 2 heads
    fused = estimate_activation_bytes(summary, 2, SEQ, False, fused_attention=True)
    unfused = estimate_activation_bytes(summary, 2, SEQ, False, fused_attention=False)
    scores = summary.num_blocks * SEQ * 2 * 16 * (5 * 2 * SEQ / 16) * 2
    assert unfused - fused == pytest.approx(scores), name


# ----------------------------------------------------------------------------- stages 1-2

class _Logits(torch.nn.Module):
    """The HF causal LM as ``ids -> logits`` for :func:`compose`'s plain step."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def _loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


_GROUPS = {}


def _group_of(n: int):
    """This rank's group of ``n`` ranks inside the world of 4 (made once, by every rank)."""
    if not _GROUPS:
        pairs = [distributed.new_group([0, 1]), distributed.new_group([2, 3])]
        _GROUPS.update({4: None, 2: pairs[distributed.get_rank() // 2]})
    return _GROUPS[n]


def _planned_and_measured(kind: str, tied: bool, n: int, stage: int):
    """The planner's row for ``kind`` at ``n`` ranks and ``stage``, and this rank's storages
    after two AdamW steps less the per-tensor remainders (4 bytes per owned tensor for
    Adam's ``step`` count, and 4 more at stage 2 for its gradient's presence flag)."""
    from shardkit.utils.memory import model_state_bytes
    group = _group_of(n)
    rank = distributed.get_rank(group)
    model = build(kind, tied)
    summary = summarize_model(model)
    layout = rank_layout(model, n)
    row = plan.stage_table(summary.params, n, plan.precision_for("adamw"), (stage,), summary,
                           0.0, layout)[0]
    setup = compose(_Logits(model), stage, adamw(1e-3), process_group=group).training_setup(
        _loss)
    local = 4 // n
    for step in range(2):
        ids = batch(step)[rank * local:(rank + 1) * local]
        setup.train_step(ids, ids)
    owned = [p for p in dict.fromkeys(model.parameters())
             if p.requires_grad and setup.optimizer.param_to_rank[p] == rank]
    per_tensor = 4 * (2 if stage == 2 else 1)
    measured = model_state_bytes(setup.module, setup.optimizer).total - per_tensor * len(owned)
    return row.model_states, measured


@pytest.mark.parametrize("kind, tied, n", [("gpt2", True, 2), ("llama", False, 4)])
@pytest.mark.parametrize("stage", [1, 2])
def test_planned_oss_row_is_the_most_loaded_rank_to_the_byte(world4, kind, tied, n, stage):
    results = world4.run(_planned_and_measured, kind, tied, n, stage)[:n]
    planned = results[0][0]
    measured = [m for _, m in results]
    assert max(measured) == planned, (planned, measured)


@pytest.mark.parametrize("kind, tied, n, padding", [
    ("gpt2", True, 2, 16), ("llama", False, 4, 16), ("gpt2", True, 4, 0)])
def test_layout_counts_the_sync_bucket_padding_every_rank_holds(kind, tied, n, padding):
    layout = rank_layout(build(kind, tied), n)
    assert layout.oss_sync_padding == padding


# ----------------------------------------------------------------------------- stage 3 units

def _built_units(kind: str, tied: bool, min_num_params: int):
    """The parameters of each FSDP unit :func:`compose` builds with FSDP's size policy, in
    the order the planner lists them (bottom-up, root last)."""
    import functools
    from shardkit.nn import FullyShardedDataParallel
    from shardkit.nn.wrap import default_auto_wrap_policy
    policy = functools.partial(default_auto_wrap_policy, min_num_params=min_num_params)
    wrapped = compose(build(kind, tied), 3, adamw(1e-3), wrap_policy=policy).wrapped
    units = [m for m in wrapped.modules() if isinstance(m, FullyShardedDataParallel)]
    return [u.unit_numel for u in reversed(units)]


@pytest.mark.parametrize("kind, tied, min_num_params", [
    ("gpt2", True, 4000), ("gpt2", True, 500), ("llama", False, 4000)])
def test_min_num_params_plans_the_units_fsdp_builds(world4, kind, tied, min_num_params):
    """``--min-num-params`` is FSDP's size policy: a ``ModuleList`` is never a unit, tied
    weights stay in one unit (the planner made units of a layer list and of a tied
    embedding, none of which FSDP builds)."""
    built = world4.run(_built_units, kind, tied, min_num_params)[0]
    summary = summarize_model(build(kind, tied), min_num_params=min_num_params)
    assert (summary.num_units, summary.largest_unit_params, summary.root_unit_params) == (
        len(built), max(built), built[-1])


# ----------------------------------------------------------------------------- the engine

def _engine_states(stage: int):
    """This rank's model-state bytes of an engine after one step: counted from the engine
    alone, and from its module and optimizer given apart."""
    import shardkit
    from shardkit.utils.memory import model_state_bytes
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1,
              "steps_per_print": 10 ** 6, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, _, _, _ = shardkit.initialize(model=build("llama", False), config=config)
    ids = batch(0)[distributed.get_rank():distributed.get_rank() + 1]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return (model_state_bytes(engine).as_dict(),
            model_state_bytes(engine.module, engine.optimizer).as_dict())


@pytest.mark.parametrize("stage", [1, 3])
def test_model_state_bytes_of_an_engine_counts_the_optimizer_it_holds(world4, stage):
    for alone, apart in world4.run(_engine_states, stage):
        assert alone == apart
        assert alone["optimizer"] > 0 and alone["params"] > 0


SMALL = GPTConfig(vocab_size=61, n_layer=2, n_head=2, d_model=16, seq_len=8)


@pytest.mark.parametrize("planner", [fsdp_unit_sizes, summarize_model,
                                     lambda model, *a, **k: rank_layout(model, 2, *a, **k)])
def test_both_wrap_policies_are_refused_naming_both(planner):
    with pytest.raises(PlanError, match=r"wrap_block='Block' and min_num_params=100: give at "
                                        r"most one wrap policy"):
        planner(GPT(SMALL), "Block", min_num_params=100)


def test_either_policy_alone_still_plans_the_units_auto_wrap_builds():
    model = GPT(SMALL)
    blocks = fsdp_unit_sizes(model, "Block")
    sized = fsdp_unit_sizes(model, min_num_params=100)
    assert len(blocks) == SMALL.n_layer + 1 and sum(blocks) == sum(
        p.numel() for p in model.parameters())
    assert sum(sized) == sum(blocks) and len(sized) > len(blocks)


def test_dry_run_on_meta_builds_no_wrapper_and_allocates_nothing(monkeypatch):
    from shardkit.nn.data_parallel import FullyShardedDataParallel

    def refuse(*args, **kwargs):
        raise AssertionError("the planner's dry run built an FSDP wrapper")

    monkeypatch.setattr(FullyShardedDataParallel, "__init__", refuse)
    with torch.device("meta"):  # 4 x 67M parameters, never allocated
        model = torch.nn.Sequential(*(torch.nn.Linear(8192, 8192) for _ in range(4)))
    summary = summarize_model(model, min_num_params=10 ** 6)
    layout = rank_layout(model, 8, min_num_params=10 ** 6)
    assert all(p.is_meta for p in model.parameters())
    assert summary.params == sum(p.numel() for p in model.parameters())
    assert (summary.num_units, summary.largest_unit_params) == (5, 8192 * 8192 + 8192)
    assert layout.padded_params >= summary.params
