"""FairScale's activation-checkpoint and wrap test suites, re-expressed for shardkit.

FairScale's tests/nn/checkpoint/test_checkpoint_activations.py, ..._norm.py and
tests/nn/wrap/test_wrap.py: what a FairScale user relies on, with only the import changed.
Single-process checks use a recording wrapper (``Tag``); the FSDP checks run in one world of
two gloo ranks and compare with one process training on the same data.
"""

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from shardkit import distributed as dist
from shardkit.nn.checkpoint import (apply_activation_checkpointing, checkpoint_wrapper,
                                    disable_checkpointing, is_checkpoint_wrapped,
                                    is_checkpointing, is_recomputing)
from shardkit.nn.wrap import (auto_wrap, config_auto_wrap_policy, default_auto_wrap_policy,
                              enable_wrap, transformer_auto_wrap_policy, wrap)
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff
from tests.utils.saved_tensors import saved_bytes

world2 = world_fixture(2)
P = functools.partial


# ------------------------------------------------------------------ checkpoint_wrapper


class BasicModel(nn.Module):
    """An FFN with dropout (checkpointed by shardkit, by torch, or not) and a head."""

    def __init__(self, how=None, **kwargs):
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.ffn = nn.Sequential(nn.Linear(32, 128), nn.Dropout(0.5), nn.Linear(128, 32))
        if how == "shardkit":
            self.ffn = checkpoint_wrapper(self.ffn, **kwargs)
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        x = torch_checkpoint(self.ffn, x, use_reentrant=False) if self.how == "torch" \
            else self.ffn(x)
        return self.out(x)


def _loss_and_grads(model, *inputs, seed=5, **kwargs):
    torch.manual_seed(seed)
    model.zero_grad()
    out = model(*inputs, **kwargs)
    out = torch.cat([o.flatten() for o in out]) if isinstance(out, tuple) else out
    loss = out.square().sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kwargs", [{}, {"offload_to_cpu": True}])
def test_basic_model_with_dropout_equals_plain_and_torch_checkpoint(kwargs):
    x = torch.rand(2, 16, 32).requires_grad_(True)
    ref_loss, ref_grads = _loss_and_grads(BasicModel(), x)
    for model in (BasicModel("torch"), BasicModel("shardkit", **kwargs)):
        loss, grads = _loss_and_grads(model, x)
        assert torch.equal(loss, ref_loss)
        assert max_diff(grads, ref_grads) == 0.0


class MultiInMultiOut(nn.Module):
    def __init__(self, multiout, config):
        super().__init__()
        torch.manual_seed(0)
        self.multiout = multiout
        self.conv1 = nn.Sequential(nn.Conv2d(1, 5, 3), nn.ReLU(), nn.Conv2d(5, 5, 3))
        self.conv2 = nn.Sequential(nn.Conv2d(3, 5, 3), nn.ReLU(), nn.Conv2d(5, 5, 3))
        if config & 1:
            self.conv1 = checkpoint_wrapper(self.conv1)
        if config & 2:
            self.conv2 = checkpoint_wrapper(self.conv2)

    def forward(self, x1, x2=None):
        out1, out2 = self.conv1(x1), self.conv2(x2)
        return (out1, out2) if self.multiout else out1 + out2


@pytest.mark.parametrize("multiout", [True, False])
def test_multi_input_keyword_input_multi_output(multiout):
    in1, in2 = torch.rand(4, 1, 12, 12), torch.rand(4, 3, 12, 12).requires_grad_(True)
    ref = _loss_and_grads(MultiInMultiOut(multiout, 0), in1, x2=in2)
    for config in (1, 2, 3):
        loss, grads = _loss_and_grads(MultiInMultiOut(multiout, config), in1, x2=in2)
        assert torch.equal(loss, ref[0]) and max_diff(grads, ref[1]) == 0.0, config


def test_import_paths_positional_offload_and_in_place_return():
    from shardkit.nn import checkpoint_wrapper as from_nn
    from shardkit.nn.checkpoint.checkpoint_activations import checkpoint_wrapper as full_path
    from shardkit.nn.misc import checkpoint_wrapper as deprecated
    for fn in (from_nn, deprecated, full_path):
        ffn = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 4))
        keys = list(ffn.state_dict())
        assert fn(ffn, {}) is ffn  # FairScale's tests pass a dict as offload_to_cpu
        assert list(ffn.state_dict()) == keys and type(ffn) is nn.Sequential


class Counting(nn.Module):
    """FairScale's TestModel: counts forwards; takes one tensor or a list of them."""

    def __init__(self):
        super().__init__()
        self.cnt = 0
        self.linear = nn.Linear(2, 2)

    def forward(self, x):
        self.cnt += 1
        return [self.linear(i) for i in x] if isinstance(x, list) else self.linear(x)


class CountingMany(nn.Module):
    """Several inputs and outputs, some of them not tensors."""

    def __init__(self):
        super().__init__()
        self.cnt = 0
        self.linear = nn.Linear(2, 2)

    def forward(self, x, y, z):
        self.cnt += 1
        return self.linear(x + y), z + [self.cnt], ["hi"]


def test_list_input_and_disable_checkpointing_forward_counts():
    first, second = checkpoint_wrapper(Counting()), Counting()
    out = nn.Sequential(first, second)([torch.rand(4, 2), torch.rand(4, 2)])
    assert (first.cnt, second.cnt) == (1, 1)
    sum(o.sum() for o in out).backward()
    assert (first.cnt, second.cnt) == (2, 1)  # the recomputation
    model = checkpoint_wrapper(Counting())
    with disable_checkpointing():
        sum(o.sum() for o in model(list(torch.rand(4, 2)))).backward()
    assert model.cnt == 1


@pytest.mark.parametrize("trainable", [(False, False, False, True), (True, False, False, False)])
def test_only_regions_backward_reaches_are_recomputed(trainable):
    model = nn.Sequential(*[checkpoint_wrapper(Counting()) for _ in range(4)])
    for m, flag in zip(model, trainable):
        m.requires_grad_(flag)
    model(torch.rand(4, 2)).sum().backward()
    first_trainable = trainable.index(True)
    assert [m.cnt for m in model] == [1 if i < first_trainable else 2 for i in range(4)]


@pytest.mark.parametrize("m1_trainable", [False, True])
def test_non_tensor_inputs_and_outputs(m1_trainable):
    m1, m2, m4 = (checkpoint_wrapper(Counting()) for _ in range(3))
    m3 = checkpoint_wrapper(CountingMany())
    m1.requires_grad_(m1_trainable)
    m2.requires_grad_(False)
    out, z, hi = m3(m1(torch.rand(4, 2)), m2(torch.rand(4, 2)), ["bye"])
    assert z == ["bye", 1] and hi == ["hi"]
    m4(out).sum().backward()
    assert [m.cnt for m in (m1, m2, m3, m4)] == [2 if m1_trainable else 1, 1, 2, 2]


class KeywordsAndDict(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)
        self.drop = nn.Dropout(0.3)

    def forward(self, x, scale, *, bias=None, name="a"):
        h = self.drop(self.bn(self.lin(x))) * scale
        return {"out": h + bias, "pair": (h.sum(1), name)}


@pytest.mark.parametrize("offload", [False, True])
def test_keyword_tensors_non_tensor_arguments_and_dict_outputs(offload):
    plain = KeywordsAndDict()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain), offload_to_cpu=offload)
    x = torch.randn(6, 3)
    results = []
    for model in (plain, wrapped):
        bias = torch.ones(6, 3, requires_grad=True)
        torch.manual_seed(3)
        out = model(x, 2.0, bias=bias, name="b")
        assert out["pair"][1] == "b"
        (out["out"].square().sum() + out["pair"][0].sum()).backward()
        results.append([out["out"].detach(), bias.grad] + [p.grad for p in model.parameters()]
                       + list(model.state_dict().values()))
    assert max_diff(*results) == 0.0


def test_module_run_twice_in_one_forward_with_batchnorm():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.2))
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(8, 4)
    results = []
    for model in (plain, wrapped):
        torch.manual_seed(9)
        model(model(x)).square().sum().backward()
        results.append([p.grad for p in model.parameters()] + list(model.state_dict().values()))
    assert max_diff(*results) == 0.0
    assert wrapped[1].num_batches_tracked.item() == 2  # twice per forward, not per recompute


def test_no_grad_forward_runs_plain_without_saving_or_recomputing():
    model = checkpoint_wrapper(Counting())
    with torch.no_grad():
        nbytes, out = saved_bytes(lambda: model(torch.rand(3, 2)))
    assert (model.cnt, nbytes, out.requires_grad) == (1, 0, False)
    frozen = checkpoint_wrapper(Counting()).requires_grad_(False)
    out = frozen(torch.rand(3, 2))  # grad mode on, nothing requires grad: no error
    assert (frozen.cnt, out.requires_grad) == (1, False)


class FlagProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append((is_checkpointing(), is_recomputing()))
        return self.lin(x)


def test_is_checkpointing_and_is_recomputing_inside_forward():
    probe = checkpoint_wrapper(FlagProbe())
    probe(torch.rand(2, 4)).sum().backward()
    assert probe.seen == [(True, False), (False, True)]
    assert (is_checkpointing(), is_recomputing()) == (False, False)
    probe.seen.clear()
    with disable_checkpointing():
        probe(torch.rand(2, 4)).sum().backward()
    with torch.no_grad():
        probe(torch.rand(2, 4))
    assert probe.seen == [(False, False), (False, False)]


def _norm_model(norm, checkpointed, precision):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), norm(2))
    if precision == "fp16":  # parameters and buffers fp16 by hand
        for p in model.parameters():
            p.data = p.data.half()
        for m in model:
            for name, buf in m.named_buffers():
                setattr(m, name, buf.half())
    elif precision == "call_half":
        model.half()
    return checkpoint_wrapper(model) if checkpointed else model


@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.BatchNorm2d])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "call_half"])
def test_norm_layers_state_after_steps_equals_plain(norm, precision):
    """FairScale's _norm test: BatchNorm statistics are updated once per step, as without
    checkpointing (FairScale: patch_batchnorm), in every precision the CPU can run."""
    ref, cpt = _norm_model(norm, False, precision), _norm_model(norm, True, precision)
    cpt.load_state_dict(ref.state_dict())
    assert max_diff(ref.state_dict(), cpt.state_dict()) == 0.0
    x = torch.rand(2, 2, 3, 3)
    x = (x if precision == "fp32" else x.half()).requires_grad_(True)
    for model in (ref, cpt):
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            optim.zero_grad()
            model(x).float().sum().backward()
            optim.step()
    assert max_diff(ref.state_dict(), cpt.state_dict()) == 0.0
    for a, b in zip(ref.state_dict().values(), cpt.state_dict().values()):
        assert a.dtype == b.dtype


def test_patch_batchnorm_for_hand_written_reentrant_checkpointing():
    """FairScale's checkpoint_utils.patch_batchnorm (imported by Megatron-style checkpoint
    functions): a BatchNorm run first under no_grad, then recomputed with grad, updates its
    statistics once, as without checkpointing."""
    from shardkit.nn.checkpoint.checkpoint_utils import patch_batchnorm

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Sequential(nn.BatchNorm1d(4)))

    x = torch.randn(8, 4, requires_grad=True)
    plain, patched, skipped = build(), build(), build()
    skipped[1].disable_patch_batchnorm = True
    plain(x).sum().backward()
    assert len(patch_batchnorm(patched)) == 4 and len(patch_batchnorm(skipped)) == 2
    for model in (patched, skipped):
        torch_checkpoint(model, x, use_reentrant=True).sum().backward()
    assert max_diff(plain.state_dict(), patched.state_dict()) == 0.0
    assert patched[1].num_batches_tracked.item() == 1 and patched[1].track_running_stats
    assert skipped[1].num_batches_tracked.item() == 2  # not patched: counted twice
    assert skipped[2][0].num_batches_tracked.item() == 1
    with pytest.raises(TypeError, match="patch_batchnorm.*nn.Module"):
        patch_batchnorm([nn.BatchNorm1d(2)])


def test_activation_memory_is_saved():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(32, 64, requires_grad=True)
    plain, _ = saved_bytes(lambda: block(x))
    wrapped = checkpoint_wrapper(copy.deepcopy(block))
    kept, out = saved_bytes(lambda: wrapped(x))
    assert kept <= x.numel() * x.element_size() < plain / 4, (kept, plain)
    out.sum().backward()
    assert x.grad is not None


def test_nested_checkpoint_regions_with_batchnorm_and_dropout():
    def build():
        torch.manual_seed(0)
        inner = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.ReLU())
        return nn.Sequential(nn.Linear(4, 4), inner, nn.Linear(8, 4), nn.Dropout(0.3))

    plain, nested = build(), build()
    checkpoint_wrapper(nested[1])
    checkpoint_wrapper(nested)
    results = []
    for model in (plain, nested):
        for step in range(2):
            torch.manual_seed(step)
            model(torch.ones(6, 4) * step).square().sum().backward()
        results.append([p.grad for p in model.parameters()] + list(model.state_dict().values()))
    assert max_diff(*results) == 0.0


class Forwarding(nn.Module):
    """A wrapper that forwards attribute lookups to the module it holds, as FSDP does."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls = 0

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)

    def forward(self, x):
        self.calls += 1
        return self.module(x)


def test_checkpointing_a_wrapper_of_a_checkpointed_module():
    """The wrapper's own forward becomes a region (it used to look wrapped already through
    attribute forwarding: not checkpointed, its offload_to_cpu set where nothing reads it)."""
    inner = checkpoint_wrapper(nn.Linear(3, 3))
    assert not is_checkpoint_wrapped(Forwarding(inner))
    outer = checkpoint_wrapper(Forwarding(inner), offload_to_cpu=True)
    assert is_checkpoint_wrapped(outer) and is_checkpoint_wrapped(inner)
    outer(torch.randn(2, 3)).sum().backward()
    assert outer.calls == 2  # forward and recomputation
    plain = nn.Linear(3, 3)
    plain.load_state_dict(inner.state_dict())
    x = torch.randn(2, 3)
    plain(x).square().sum().backward()
    inner.zero_grad()
    outer(x).square().sum().backward()
    assert max_diff([p.grad for p in plain.parameters()],
                    [p.grad for p in inner.parameters()]) == 0.0


# ------------------------------------------------------------------ wrap (single process)


class Tag(nn.Module):
    """A wrapper class that records the keyword arguments it was built with."""

    def __init__(self, module, flatten_parameters=True, **kwargs):
        super().__init__()
        self.module = module
        self.flatten_parameters = flatten_parameters
        self.kwargs = kwargs

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _shape(module):
    """A structure string: W[...] for a wrapper, Class(children...) otherwise."""
    if isinstance(module, Tag) or hasattr(module, "_fsdp_wrapped_module"):
        return f"W[{_shape(module.module)}]"
    children = [_shape(c) for c in module.children()]
    return type(module).__name__ + (f"({','.join(children)})" if children else "")


def _auto(model, policy=None, context_policy=None, **kwargs):
    with enable_wrap(wrapper_cls=Tag, auto_wrap_policy=context_policy, **kwargs):
        return auto_wrap(model, auto_wrap_policy=policy)


def _three_linears():
    return nn.Sequential(nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5)))


def test_wrap_in_and_outside_enable_wrap():
    assert type(wrap(nn.Linear(5, 5))) is nn.Linear
    with enable_wrap(wrapper_cls=Tag, flatten_parameters=False, extra=1):
        layer = wrap(nn.Linear(5, 5))
        overridden = wrap(nn.Linear(5, 5), flatten_parameters=True)
    assert isinstance(layer, Tag) and layer.flatten_parameters is False
    assert layer.kwargs == {"extra": 1} and overridden.flatten_parameters is True
    assert type(wrap(nn.Linear(5, 5))) is nn.Linear  # the context is gone


@pytest.mark.parametrize("case, model, policy, expected", [
    ("min_num_params", _three_linears, P(default_auto_wrap_policy, min_num_params=60),
     "Sequential(Linear,W[Sequential(Linear,Linear)])"),
    ("skip_params_check_for_root", _three_linears,
     P(default_auto_wrap_policy, min_num_params=60, skip_params_check_for_root=True),
     "W[Sequential(Linear,W[Sequential(Linear,Linear)])]"),
    ("ModuleList excluded", lambda: nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)]),
     P(default_auto_wrap_policy, min_num_params=40), "ModuleList(Linear,Linear)"),
    ("excluded, children wrapped", lambda: nn.ModuleList([nn.Linear(10, 10)]),
     P(default_auto_wrap_policy, min_num_params=40), "ModuleList(W[Linear])"),
    ("ModuleDict", lambda: nn.ModuleDict({"a": nn.Linear(10, 10), "b": nn.Linear(2, 2)}),
     P(default_auto_wrap_policy, min_num_params=40), "ModuleDict(W[Linear],Linear)"),
    ("MultiheadAttention a leaf",
     lambda: nn.Sequential(nn.Linear(10, 10), nn.MultiheadAttention(100, 1)),
     P(default_auto_wrap_policy, min_num_params=40),
     "W[Sequential(W[Linear],MultiheadAttention(NonDynamicallyQuantizableLinear))]"),
    ("custom exclude", lambda: nn.Sequential(nn.Linear(10, 10), nn.Sequential(nn.Linear(10, 10))),
     P(default_auto_wrap_policy, min_num_params=40, exclude_wrap_modules={nn.Linear}),
     "W[Sequential(Linear,W[Sequential(Linear)])]"),
    ("float min_num_params", lambda: nn.Sequential(nn.Linear(10, 10), nn.ReLU()),
     P(default_auto_wrap_policy, min_num_params=1e2), "Sequential(W[Linear],ReLU)"),
])
def test_auto_wrap_default_policy_cases(case, model, policy, expected):
    assert _shape(_auto(model(), policy)) == expected, case


def test_force_leaf_custom_policy_from_the_context():
    policy = P(default_auto_wrap_policy, min_num_params=40,
               force_leaf_modules=default_auto_wrap_policy.FORCE_LEAF_MODULES | {nn.Linear})
    model = nn.Sequential(nn.Linear(10, 10), nn.ModuleList([nn.Linear(10, 10)]))
    assert _shape(_auto(model, context_policy=policy)) == "W[Sequential(Linear,ModuleList(Linear))]"


def test_already_wrapped_submodules_are_left_alone_and_count_as_wrapped():
    """FairScale asserts there is none; shardkit leaves them. Their parameters are already in a
    unit: a parent with few parameters of its own is not wrapped for them."""
    policy = P(default_auto_wrap_policy, min_num_params=40)
    with enable_wrap(wrapper_cls=Tag):
        root = nn.Sequential(wrap(nn.Linear(10, 10)), nn.Linear(2, 2))
        deep = nn.Sequential(nn.Sequential(wrap(nn.Linear(10, 10)), nn.Linear(2, 2)),
                             nn.Linear(3, 3))
        assert _shape(auto_wrap(root, policy)) == "Sequential(W[Linear],Linear)"
        assert _shape(auto_wrap(deep, policy)) == "Sequential(Sequential(W[Linear],Linear),Linear)"
        big = nn.Sequential(wrap(nn.Linear(10, 10)), nn.Linear(4, 4), nn.Linear(4, 4))
        assert _shape(auto_wrap(big, policy)) == "W[Sequential(W[Linear],Linear,Linear)]"


@pytest.mark.parametrize("factory", ["partial", "function"])
def test_wrapper_cls_may_be_a_partial_or_a_factory(factory):
    build = P(Tag, flatten_parameters=False) if factory == "partial" else \
        (lambda module, **kwargs: Tag(module, flatten_parameters=False, **kwargs))
    with enable_wrap(wrapper_cls=build, extra=2):
        model = auto_wrap(_three_linears(), P(default_auto_wrap_policy, min_num_params=60))
        again = auto_wrap(model, P(default_auto_wrap_policy, min_num_params=60))
    assert _shape(again) == "Sequential(Linear,W[Sequential(Linear,Linear)])"
    assert again[1].kwargs == {"extra": 2} and again[1].flatten_parameters is False
    if factory == "partial":
        assert _shape(again[1].module) == "Sequential(Linear,Linear)"


def test_config_policy_wrapper_config_precedence_and_several_passes():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(3, 3), nn.Sequential(nn.Linear(4, 4)))
    model[1].wrapper_config = {"a": 1, "b": 1}
    with enable_wrap(wrapper_cls=Tag, auto_wrap_policy=config_auto_wrap_policy, b=0, c=0):
        model = auto_wrap(model, c=2)  # auto_wrap's kwargs override the module's config
        assert _shape(model) == "Sequential(Linear,W[Linear],Sequential(Linear))"
        assert model[1].kwargs == {"a": 1, "b": 1, "c": 2}
        model[2][0].wrapper_config = {}  # a second pass with one more module tagged
        model = auto_wrap(model)
    assert _shape(model) == "Sequential(Linear,W[Linear],Sequential(W[Linear]))"
    assert model[2][0].kwargs == {"b": 0, "c": 0}


def test_policies_as_partials_positional_functions_and_objects():
    def positional(module, recurse, unwrapped_params, module_is_root, cls=nn.Linear):
        return recurse or isinstance(module, cls)

    class AsObject:
        def __call__(self, module, recurse, unwrapped_params, module_is_root):
            return recurse or isinstance(module, nn.Linear)

    for policy in (positional, P(positional, cls=nn.Linear), AsObject(),
                   transformer_auto_wrap_policy({nn.Linear}),
                   P(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})):
        assert _shape(_auto(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), policy)) == \
            "Sequential(W[Linear],ReLU)", policy
    seen = []
    _auto(nn.Sequential(nn.Linear(2, 2)),
          lambda module, recurse, unwrapped_params, module_is_root:
          seen.append((type(module).__name__, recurse, unwrapped_params, module_is_root)))
    assert seen == [("Sequential", True, 6, True)]  # "do not recurse" stops at the root


def test_enable_wrap_nesting_and_errors():
    with enable_wrap(wrapper_cls=Tag, outer=1):
        with enable_wrap(wrapper_cls=P(Tag, flatten_parameters=False), inner=1):
            inner = wrap(nn.Linear(2, 2))
        outer = wrap(nn.Linear(2, 2))
    assert inner.kwargs == {"inner": 1} and outer.kwargs == {"outer": 1}
    with pytest.raises(RuntimeError, match="boom"):
        with enable_wrap(wrapper_cls=Tag):
            raise RuntimeError("boom")
    assert type(wrap(nn.Linear(2, 2))) is nn.Linear  # left on an exception too

    class Strict(nn.Module):
        def __init__(self, module, process_group=None):
            super().__init__()
            self.module = module

    with pytest.raises(ValueError, match="move_module_cuda_half=True.*before wrapping"):
        with enable_wrap(wrapper_cls=Tag, move_module_cuda_half=True):
            pass
    with pytest.raises(ValueError, match="move_module_cuda_half='yes'.*only False"):
        with enable_wrap(wrapper_cls=Tag, move_module_cuda_half="yes"):
            pass
    with enable_wrap(wrapper_cls=Strict, move_module_cuda_half=False):
        assert isinstance(wrap(nn.Linear(2, 2)), Strict)  # FairScale's default, accepted
    with pytest.raises(TypeError, match="bogus.*not an argument of Strict.*process_group"):
        with enable_wrap(wrapper_cls=Strict, bogus=1):
            pass
    with pytest.raises(TypeError, match="min_num_params.*functools.partial"):
        with enable_wrap(wrapper_cls=Strict):
            auto_wrap(nn.Linear(2, 2), min_num_params=1)
    with pytest.raises(ValueError, match="wrap policy.*auto_wrap_policy=... by keyword"):
        with enable_wrap(P(default_auto_wrap_policy, min_num_params=10)):  # FairScale's order
            pass
    with pytest.raises(ValueError, match="wrapper_cls=3"):
        with enable_wrap(wrapper_cls=3):
            pass
    with pytest.raises(ValueError, match="auto_wrap_policy=5"):
        _auto(nn.Linear(2, 2), policy=5)
    bad = nn.Linear(2, 2)
    bad.wrapper_config = ["a"]
    with pytest.raises(ValueError, match="wrapper_config"):
        with enable_wrap(wrapper_cls=Tag):
            wrap(bad)


# ------------------------------------------------------------------ with FSDP, world of 2


WIDTH = 8


def _blocks(seed=0, dropout=0.25):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, 16), nn.GELU(), nn.Dropout(dropout),
                                         nn.Linear(16, WIDTH)) for _ in range(3)],
                         nn.Linear(WIDTH, 2))


def _variant(name):
    from shardkit.nn import FullyShardedDataParallel as FSDP
    model = _blocks()
    blocks = list(model)[:3]
    if name == "checkpoint inside units":
        for i, b in enumerate(blocks):
            model[i] = FSDP(checkpoint_wrapper(b, offload_to_cpu=(i == 1)))
    elif name == "checkpoint outside units":
        for i, b in enumerate(blocks):
            model[i] = checkpoint_wrapper(FSDP(b))
    elif name == "checkpoint inside and outside units":
        for i, b in enumerate(blocks):
            model[i] = checkpoint_wrapper(FSDP(checkpoint_wrapper(b)), offload_to_cpu=True)
    elif name == "auto_wrap of checkpointed blocks":
        for b in blocks:
            checkpoint_wrapper(b)
        with enable_wrap(wrapper_cls=FSDP):
            model = auto_wrap(model, transformer_auto_wrap_policy({nn.Sequential}))
    elif name == "checkpointing applied after wrapping":
        with enable_wrap(wrapper_cls=FSDP):
            model = auto_wrap(model, P(default_auto_wrap_policy, min_num_params=200))
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, FSDP))
    elif name == "checkpointed root":
        model[1] = FSDP(blocks[1])
        return checkpoint_wrapper(FSDP(model))
    return model if isinstance(model, FSDP) else FSDP(model)


def _seed(step, rank):
    return 1000 * step + rank


def _batch(step, rank):
    g = torch.Generator().manual_seed(_seed(step, rank))
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, 2, generator=g)


def _fsdp_against_one_process(name):
    """Three SGD steps of the variant against one process running each rank's batch with that
    rank's dropout seed and averaging the losses (what the ranks' averaged gradients are)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, oracle = _variant(name), _blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ref_opt = torch.optim.SGD(oracle.parameters(), lr=0.2)
    worst = 0.0
    for step in range(3):
        x, y = _batch(step, rank)
        torch.manual_seed(_seed(step, rank))
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        ref_losses = []
        for r in range(world):
            xr, yr = _batch(step, r)
            torch.manual_seed(_seed(step, r))
            ref_losses.append(F.mse_loss(oracle(xr), yr))
        (sum(ref_losses) / world).backward()
        ref_opt.step()
        worst = max(worst, abs(loss.item() - ref_losses[rank].item()))
    state = model.state_dict()
    keys_match = list(state) == list(oracle.state_dict())
    regions = sum(is_checkpoint_wrapped(m) for m in model.modules())
    return regions, keys_match, max(worst, max_diff(dict(state), oracle.state_dict()))


@pytest.mark.parametrize("name, regions", [
    ("checkpoint inside units", 3), ("checkpoint outside units", 3),
    ("checkpoint inside and outside units", 6),
    ("auto_wrap of checkpointed blocks", 3), ("checkpointing applied after wrapping", 3),
    ("checkpointed root", 1)])
def test_checkpoint_with_fsdp_trains_as_one_process(world2, name, regions):
    for result in world2.run(_fsdp_against_one_process, name):
        assert result[0] == regions and result[1] and result[2] < 1e-5, (name, result)


def _fsdp_wrap_cases():
    from shardkit.nn import FullyShardedDataParallel as FSDP
    out = {}
    with enable_wrap(wrapper_cls=FSDP, flatten_parameters=False):
        layer = wrap(nn.Linear(5, 5))
        overridden = wrap(nn.Linear(5, 5), flatten_parameters=True)
        model = auto_wrap(_three_linears(), P(default_auto_wrap_policy, min_num_params=60))
        root = auto_wrap(_three_linears(), P(default_auto_wrap_policy, min_num_params=60,
                                             skip_params_check_for_root=True))
        leaf = auto_wrap(nn.Sequential(nn.Linear(10, 10), nn.MultiheadAttention(100, 1)),
                         P(default_auto_wrap_policy, min_num_params=40))
        half_done = nn.Sequential(wrap(nn.Linear(10, 10)), nn.Linear(2, 2))
        half_done = auto_wrap(half_done, P(default_auto_wrap_policy, min_num_params=40))
    out["wrap"] = (isinstance(layer, FSDP), layer.flatten_parameters,
                   overridden.flatten_parameters)
    out["auto_wrap"] = (_shape(model), isinstance(model[1].module[0], nn.Linear))
    out["root"] = (isinstance(root, FSDP), _shape(root), isinstance(root.module[1], FSDP))
    out["leaf"] = (_shape(leaf), isinstance(leaf.module[1].out_proj, nn.Linear))
    out["already"] = _shape(half_done)
    return out


def test_fsdp_wrap_and_auto_wrap_as_fairscale(world2):
    for out in world2.run(_fsdp_wrap_cases):
        assert out["wrap"] == (True, False, True)
        assert out["auto_wrap"] == ("Sequential(Linear,W[Sequential(Linear,Linear)])", True)
        assert out["root"] == (True, "W[Sequential(Linear,W[Sequential(Linear,Linear)])]", True)
        assert out["leaf"] == (
            "W[Sequential(W[Linear],MultiheadAttention(NonDynamicallyQuantizableLinear))]", True)
        assert out["already"] == "Sequential(W[Linear],Linear)"


# ------------------------------------------------------------------ second-reading findings

def test_patch_batchnorm_twice_or_after_a_failed_forward_keeps_tracking():
    """Patched twice, or after a no-grad forward that raised, a BatchNorm still updates its
    running statistics in grad-mode forwards (its flag is never saved as False)."""
    from shardkit.nn.checkpoint.checkpoint_utils import patch_batchnorm

    def moves(bn):
        before = bn.running_mean.clone()
        bn(torch.randn(4, 3) + 5)
        return not torch.equal(before, bn.running_mean) and bn.track_running_stats

    twice = nn.BatchNorm1d(3)
    patch_batchnorm(twice)
    patch_batchnorm(twice)
    with torch.no_grad():
        twice(torch.randn(4, 3))
    assert twice.track_running_stats and moves(twice)
    for then_no_grad in (False, True):
        failed = nn.BatchNorm1d(3)
        patch_batchnorm(failed)
        with torch.no_grad(), pytest.raises(RuntimeError):
            failed(torch.randn(4, 5))  # wrong width
        if then_no_grad:
            with torch.no_grad():
                failed(torch.randn(4, 3))
        assert moves(failed)


def test_checkpoint_wrapper_of_a_compiled_wrapped_module_keeps_it_working():
    """``torch.compile(checkpoint_wrapper(m))`` is already wrapped: wrapping it again changes
    nothing and it still trains (it replaced the inner module's saved forward)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, requires_grad=True)
    plain = nn.Linear(3, 3)
    compiled = torch.compile(checkpoint_wrapper(copy.deepcopy(plain)), backend="eager")
    assert is_checkpoint_wrapped(compiled)
    checkpoint_wrapper(compiled)
    compiled(x).sum().backward()
    want = x.grad.clone()
    x.grad = None
    plain(x).sum().backward()
    assert torch.allclose(x.grad, want)


def test_auto_wrap_looks_inside_a_wrapper_another_kind_of_wrap_built():
    """A wrapper an earlier ``wrap()`` built under another wrapper class does not count as
    already wrapped for this one: the block inside still gets its own unit (as in FairScale)."""
    class Tag(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    class Unit(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.inner = module

    class Block(nn.Sequential):
        pass

    model = nn.Sequential(Block(nn.Linear(4, 4)), Block(nn.Linear(4, 4)))
    with enable_wrap(wrapper_cls=Tag):
        model[0] = wrap(model[0])
    with enable_wrap(wrapper_cls=Unit):
        model = auto_wrap(model, transformer_auto_wrap_policy({Block}))
        again = auto_wrap(model, transformer_auto_wrap_policy({Block}))
    assert isinstance(model[0], Tag) and isinstance(model[0].module, Unit)
    assert isinstance(model[1], Unit)
    assert again[1] is model[1] and not isinstance(model[1].inner, Unit)  # not twice
