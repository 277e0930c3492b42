"""Wrap policies and activation checkpointing taken from a model's ``_no_split_modules``."""

import pytest
import torch
import torch.nn as nn

from tests.hf.hf_common import batch, build, transformers
from shardkit.nn.checkpoint import apply_activation_checkpointing
from shardkit.nn.wrap import (no_split_module_classes, no_split_modules_policy,
                              transformer_auto_wrap_policy)


def test_block_classes_come_from_no_split_modules():
    gpt2, llama = build("gpt2", True), build("llama", False)
    assert no_split_module_classes(gpt2) == (transformers.models.gpt2.modeling_gpt2.GPT2Block,)
    assert no_split_module_classes(llama) == (
        transformers.models.llama.modeling_llama.LlamaDecoderLayer,)
    policy = no_split_modules_policy(llama)
    chosen = [m for m in llama.modules() if policy(module=m, recurse=False, unwrapped_params=0)]
    assert chosen == list(llama.model.layers)


class _Block(nn.Linear):
    pass


class _Plain(nn.Module):
    _no_split_modules = ["_Block", "SomeOtherVariantsBlock"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(_Block(4, 4), nn.ReLU(), _Block(4, 4))


def test_any_module_declaring_the_attribute_works_and_missing_is_a_clear_error():
    assert no_split_module_classes(_Plain()) == (_Block,)
    with pytest.raises(ValueError, match="_no_split_modules.*transformer_auto_wrap_policy"):
        no_split_modules_policy(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_activation_checkpointing_from_policy_keeps_gradients(kind):
    ids = batch(0)
    ref = build(kind, True)
    ref(input_ids=ids, labels=ids).loss.backward()
    model = build(kind, True)
    blocks = list(no_split_module_classes(model))
    apply_activation_checkpointing(model, no_split_modules_policy(model))
    wrapped = [m for m in model.modules() if hasattr(m, "_shardkit_unwrapped_forward")]
    assert wrapped and all(isinstance(m, tuple(blocks)) for m in wrapped)
    assert len(wrapped) == model.config.num_hidden_layers
    assert set(model.state_dict()) == set(ref.state_dict())
    model(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_apply_activation_checkpointing_errors():
    model = _Plain()
    with pytest.raises(ValueError, match="exactly one"):
        apply_activation_checkpointing(model)
    with pytest.raises(ValueError, match="selected no submodule"):
        apply_activation_checkpointing(model, transformer_auto_wrap_policy({nn.Conv1d}))
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, _Block))
    assert sum(hasattr(m, "_shardkit_unwrapped_forward") for m in model.modules()) == 2
