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


def _t5(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.T5Config(d_model=16, d_ff=32, num_layers=2, num_decoder_layers=2,
                                num_heads=2, d_kv=8, vocab_size=61, decoder_start_token_id=0,
                                pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(cfg)


def _with_cache(kind):
    """A model as from_pretrained gives it: ``use_cache=True`` (the configs' default), so its
    layers are handed a key/value cache in training forwards too (T5's decoder always is)."""
    model = _t5() if kind == "t5" else build(kind, True)
    model.config.use_cache = True
    return model


@pytest.mark.parametrize("kind", ["gpt2", "llama", "t5"])
def test_activation_checkpointing_of_layers_given_a_kv_cache_keeps_gradients(kind):
    ids = batch(0)
    ref = _with_cache(kind)
    ref(input_ids=ids, labels=ids).loss.backward()
    model = _with_cache(kind)
    apply_activation_checkpointing(model, no_split_modules_policy(model))
    # the layers fill the cache in place: recomputed with it, they would attend over the keys
    # and values twice; they run without it, as under transformers' own checkpointing
    with pytest.warns(UserWarning, match="key/value cache"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():  # no checkpointing without grad: generation keeps its cache
        prompt = ids[:1, :3]
        torch.testing.assert_close(model.generate(prompt, max_new_tokens=3, do_sample=False),
                                   ref.generate(prompt, max_new_tokens=3, do_sample=False))
