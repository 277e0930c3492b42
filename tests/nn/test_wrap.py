"""shardkit.nn.wrap: enable_wrap / wrap / auto_wrap with FairScale- and torch-style policies."""

import functools

import pytest
import torch.nn as nn

from shardkit.models import GPT, Block, GPTConfig
from shardkit.nn.wrap import (auto_wrap, config_auto_wrap_policy, default_auto_wrap_policy,
                              enable_wrap,
                              size_based_auto_wrap_policy, transformer_auto_wrap_policy, wrap)
from shardkit.testing import World


class Tag(nn.Module):
    """A stand-in wrapper recording its kwargs (no process group needed)."""

    def __init__(self, module, **kwargs):
        super().__init__()
        self.module = module
        self.kwargs = kwargs

    def forward(self, *args):
        return self.module(*args)


CFG = GPTConfig(vocab_size=32, n_layer=3, n_head=2, d_model=16, seq_len=8)


def _tags(model):
    return [m for m in model.modules() if isinstance(m, Tag)]


def test_transformer_policy_both_spellings():
    for policy in (transformer_auto_wrap_policy({Block}),
                   functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})):
        with enable_wrap(wrapper_cls=Tag, flag=1):
            model = auto_wrap(GPT(CFG), policy)
        tags = _tags(model)
        assert len(tags) == CFG.n_layer and all(isinstance(t.module, Block) for t in tags)
        assert all(t.kwargs == {"flag": 1} for t in tags)
        assert not isinstance(model, Tag)  # the root is the caller's to wrap


def test_default_policy_min_num_params_and_torch_keyword():
    block_numel = sum(p.numel() for p in Block(CFG).parameters())
    policy = functools.partial(default_auto_wrap_policy, min_num_params=block_numel)
    with enable_wrap(wrapper_cls=Tag):
        model = auto_wrap(GPT(CFG), policy)
    # the blocks; not the root, whose remaining (embedding) parameters are fewer than a block's
    assert all(isinstance(t.module, Block) for t in _tags(model)) and len(_tags(model)) == 3
    assert not isinstance(model, Tag)
    # ModuleList is never wrapped; nothing is large enough with a huge threshold
    with enable_wrap(wrapper_cls=Tag):
        assert _tags(auto_wrap(GPT(CFG))) == []

    def torch_style(module, recurse, nonwrapped_numel):
        return recurse or isinstance(module, nn.Linear) and nonwrapped_numel > 100

    with enable_wrap(wrapper_cls=Tag):
        model = auto_wrap(GPT(CFG), torch_style)
    assert {type(t.module) for t in _tags(model)} == {nn.Linear}
    assert size_based_auto_wrap_policy(module=nn.Linear(4, 4), recurse=False,
                                       nonwrapped_numel=20, min_num_params=10)


def test_root_is_wrapped_when_the_policy_accepts_it_and_policies_see_module_is_root():
    seen = []

    def fairscale_policy(module, recurse, unwrapped_params, module_is_root):
        seen.append((type(module).__name__, recurse, module_is_root))
        return recurse or module_is_root

    with enable_wrap(wrapper_cls=Tag):
        model = auto_wrap(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), fairscale_policy)
    assert isinstance(model, Tag) and not _tags(model.module)
    assert ("Sequential", True, True) in seen and ("Sequential", False, True) in seen
    assert ("Linear", False, False) in seen
    # the default policy: a root whose remainder is small only with skip_params_check_for_root
    # (as in FairScale, the root must still be large enough to be looked into at all)
    small = functools.partial(default_auto_wrap_policy, min_num_params=10)
    forced = functools.partial(small, skip_params_check_for_root=True)
    with enable_wrap(wrapper_cls=Tag):
        plain = auto_wrap(nn.Sequential(nn.Linear(4, 4), nn.Linear(2, 2)), small)
        root = auto_wrap(nn.Sequential(nn.Linear(4, 4), nn.Linear(2, 2)), forced)
        listed = auto_wrap(nn.ModuleList([nn.Linear(4, 4), nn.Linear(2, 2)]), forced)
    assert not isinstance(plain, Tag) and isinstance(plain[0], Tag) and len(_tags(plain)) == 1
    assert isinstance(root, Tag) and len(_tags(root)) == 2
    assert not isinstance(listed, Tag)  # an excluded class is not wrapped, even as the root


def test_default_policy_class_sets_and_enable_wrap_policy():
    assert default_auto_wrap_policy.FORCE_LEAF_MODULES == {nn.MultiheadAttention}
    assert default_auto_wrap_policy.EXCLUDE_WRAP_MODULES == {nn.ModuleList, nn.ModuleDict}
    big = dict(recurse=True, unwrapped_params=10**9, module_is_root=False)
    assert not default_auto_wrap_policy(nn.MultiheadAttention(4, 2), **big)
    default_auto_wrap_policy.FORCE_LEAF_MODULES.add(nn.Linear)  # read at every call
    try:
        assert not default_auto_wrap_policy(nn.Linear(2, 2), **big)
    finally:
        default_auto_wrap_policy.FORCE_LEAF_MODULES.discard(nn.Linear)
    assert default_auto_wrap_policy(nn.Linear(2, 2), **big)
    # enable_wrap(auto_wrap_policy=...) is the policy of auto_wraps without their own
    linears = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})
    with enable_wrap(wrapper_cls=Tag, auto_wrap_policy=linears, flag=2):
        model = auto_wrap(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
        own = auto_wrap(nn.Sequential(nn.Linear(2, 2)), transformer_auto_wrap_policy({nn.ReLU}))
    assert [type(t.module) for t in _tags(model)] == [nn.Linear, nn.Linear]
    assert _tags(model)[0].kwargs == {"flag": 2} and _tags(own) == []
    with pytest.raises(ValueError, match="enable_wrap\\(auto_wrap_policy=3\\)"):
        with enable_wrap(wrapper_cls=Tag, auto_wrap_policy=3):
            pass


def test_config_policy_and_wrapper_config_precedence():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].wrapper_config = {"b": 20}
    model[2].wrapper_config = {}
    with enable_wrap(wrapper_cls=Tag, a=1, b=2):
        model = auto_wrap(model, config_auto_wrap_policy, c=3)
        single = nn.Linear(2, 2)
        single.wrapper_config = {"a": 10}
        tagged = wrap(single, b=30)
    assert isinstance(model[0], Tag) and isinstance(model[2], Tag)
    assert not isinstance(model[1], Tag) and not isinstance(model, Tag)
    # context < the module's wrapper_config < the call's own keyword arguments
    assert model[0].kwargs == {"a": 1, "b": 20, "c": 3}
    assert model[2].kwargs == {"a": 1, "b": 2, "c": 3}
    assert tagged.kwargs == {"a": 10, "b": 30}


def test_wrap_outside_and_inside_context():
    lin = nn.Linear(2, 2)
    assert wrap(lin) is lin
    with enable_wrap(wrapper_cls=Tag, a=1, b=2):
        tagged = wrap(lin, b=3)
    assert isinstance(tagged, Tag) and tagged.kwargs == {"a": 1, "b": 3}
    # FairScale's spelling: shardkit.nn's `wrap` is callable although it is also the submodule
    import shardkit.nn.wrap  # noqa: F401 - the submodule import that used to shadow the function
    from shardkit.nn import wrap as nn_wrap
    with enable_wrap(wrapper_cls=Tag, a=1):
        assert nn_wrap(lin, b=2).kwargs == {"a": 1, "b": 2}
    assert nn_wrap(lin) is lin and callable(shardkit.nn.wrap.auto_wrap)


def test_a_module_whose_parameter_is_used_outside_it_is_left_to_the_enclosing_unit():
    """A size policy on a model with a tied embedding and head: neither becomes a unit of its
    own (the tie would cross units); everything else the policy picks is wrapped."""
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 8)
            self.body = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
            self.head = nn.Linear(8, 40, bias=False)
            self.head.weight = self.emb.weight

    def big(module, recurse, unwrapped_params, module_is_root=False):
        return recurse or (unwrapped_params > 50 and not module_is_root)

    with enable_wrap(wrapper_cls=Tag):
        model = auto_wrap(TiedLM(), auto_wrap_policy=big)
    assert isinstance(model.emb, nn.Embedding) and isinstance(model.head, nn.Linear)
    assert model.head.weight is model.emb.weight
    assert [type(t.module) for t in _tags(model)] == [nn.Linear, nn.Linear]


def test_a_module_registered_under_two_names_is_left_to_the_enclosing_unit():
    """T5/BART register one embedding as ``shared`` and ``encoder.embed_tokens``; a module may
    also sit under two names of one parent. Wrapped where first met, it stayed unwrapped (or got
    a second wrapper) at the other name: FSDP then refused the model."""
    class Encoder(nn.Module):
        def __init__(self, embed_tokens):
            super().__init__()
            self.embed_tokens = embed_tokens
            self.layer = nn.Linear(8, 8)

    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Embedding(40, 8)
            self.encoder = Encoder(self.shared)
            block = nn.Linear(8, 8)
            self.first, self.again = block, block

    policy = functools.partial(default_auto_wrap_policy, min_num_params=50)
    with enable_wrap(wrapper_cls=Tag):
        root = auto_wrap(Seq2Seq(), policy)
    model = root.module if isinstance(root, Tag) else root  # the root takes what is shared
    assert model.encoder.embed_tokens is model.shared and model.first is model.again
    assert isinstance(model.shared, nn.Embedding) and isinstance(model.first, nn.Linear)
    assert [type(t.module) for t in _tags(root)] == [Seq2Seq, nn.Linear]  # + encoder.layer


def test_the_blocks_under_an_aliased_module_list_are_still_units():
    """``self.layers = self.blocks`` (an alias) registers the ModuleList twice, not its
    blocks: each block is wrapped in its one parent, which both names see (as torch does)."""
    block_numel = sum(p.numel() for p in Block(CFG).parameters())
    for policy in (transformer_auto_wrap_policy({Block}),
                   functools.partial(default_auto_wrap_policy, min_num_params=block_numel)):
        model = GPT(CFG)
        model.layers = model.blocks
        with enable_wrap(wrapper_cls=Tag):
            wrapped = auto_wrap(model, policy)
        inner = wrapped.module if isinstance(wrapped, Tag) else wrapped
        assert inner.layers is inner.blocks and all(isinstance(b, Tag) for b in inner.blocks)


def test_torch_custom_policy_selects_with_per_module_kwargs():
    """torch's CustomPolicy(lambda_fn) (not callable itself) was refused as "expected a
    callable"; its lambda_fn may answer a dict of wrapper kwargs for that module."""
    from torch.distributed.fsdp.wrap import CustomPolicy

    from shardkit.nn.checkpoint import apply_activation_checkpointing, is_checkpoint_wrapped
    model = GPT(CFG)
    policy = CustomPolicy(lambda m: {"flag": 2} if m is model.ln_f else isinstance(m, Block))
    with enable_wrap(wrapper_cls=Tag, flag=1):
        wrapped = auto_wrap(model, policy)
    assert [(type(t.module), t.kwargs) for t in _tags(wrapped)] == \
        [(Block, {"flag": 1})] * CFG.n_layer + [(nn.LayerNorm, {"flag": 2})]
    model = GPT(CFG)
    offloads = {"offload_to_cpu": True}
    apply_activation_checkpointing(model, auto_wrap_policy=CustomPolicy(
        lambda m: offloads if isinstance(m, Block) else False))
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert all(is_checkpoint_wrapped(b) and b._shardkit_offload_to_cpu for b in blocks)
    with enable_wrap(wrapper_cls=Tag), \
            pytest.raises(ValueError, match="lambda_fn returned 1 .*True, False or a dict"):
        auto_wrap(GPT(CFG), CustomPolicy(lambda m: 1))


def test_bad_policy_arguments():
    with pytest.raises(ValueError, match="transformer_layer_cls"):
        transformer_auto_wrap_policy({"Block"})
    with pytest.raises(ValueError, match="auto_wrap_policy"):
        auto_wrap(nn.Linear(2, 2), auto_wrap_policy=3)
    with pytest.raises(ValueError, match="min_num_params"):
        default_auto_wrap_policy(nn.Linear(2, 2))
    # these were bare TypeErrors ("'>=' not supported", "'type' object is not iterable")
    with pytest.raises(ValueError, match="transformer_layer_cls=Linear"):
        transformer_auto_wrap_policy(nn.Linear(2, 2))
    for bad, words in [({"min_num_params": "1e6"}, "min_num_params='1e6'.*a number"),
                       ({"force_leaf_modules": {"MultiheadAttention"}}, "force_leaf_modules="),
                       ({"exclude_wrap_modules": [nn.Linear(2, 2)]}, "exclude_wrap_modules=")]:
        policy = functools.partial(default_auto_wrap_policy, **{"min_num_params": 1, **bad})
        with enable_wrap(wrapper_cls=Tag), pytest.raises(ValueError, match=words):
            auto_wrap(nn.Sequential(nn.Linear(2, 2)), policy)
    # NumPy integers are numbers of parameters (they worked before the argument check)
    import numpy as np
    with enable_wrap(wrapper_cls=Tag):
        assert isinstance(auto_wrap(nn.Sequential(nn.Linear(2, 2)), functools.partial(
            default_auto_wrap_policy, min_num_params=np.int64(1)))[0], Tag)
    # one class alone is accepted as the set of it
    policy = functools.partial(default_auto_wrap_policy, min_num_params=1,
                               exclude_wrap_modules=nn.Sequential,
                               force_leaf_modules=nn.MultiheadAttention)
    with enable_wrap(wrapper_cls=Tag):
        assert isinstance(auto_wrap(nn.Sequential(nn.Linear(2, 2)), policy)[0], Tag)


def _default_wrapper_is_fsdp():
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP

    model = auto_wrap(GPT(CFG), transformer_auto_wrap_policy({Block}), reshard_after_forward=False)
    units = [m for m in model.modules() if isinstance(m, FSDP)]
    return len(units), all(u.reshard_after_forward is False for u in units)


def test_auto_wrap_defaults_to_fsdp():
    with World(1) as world:
        assert world.run(_default_wrapper_is_fsdp) == [(CFG.n_layer, True)]
