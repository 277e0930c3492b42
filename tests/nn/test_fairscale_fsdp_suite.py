"""FairScale's own FSDP behaviour tests (tests/nn/data_parallel/test_fsdp*.py), re-expressed for
shardkit on CPU/gloo at worlds 1, 2 and 4.

A FairScale user changes ``fairscale`` to ``shardkit`` in the imports; what their code relies on
must hold: FSDP trains exactly as torch DDP over test_fsdp.py's option grid
(``reshard_after_forward`` x ``mixed_precision`` x ``flatten_parameters``, with FairScale's
``compute_dtype=float32`` under mixed precision, so the comparison stays exact), nested and
all-wrapped models, activation checkpointing inside the units, a tied embedding; ``no_sync``
accumulation equals one large batch; uneven shards (a 1x1 weight over 4 ranks); list, dict,
keyword and non-tensor inputs; ``apply()``; a unit run twice per forward; two forwards then two
backwards; frozen weights inside a unit and whole frozen units; ``checkpoint_wrapper`` inside or
outside a unit; BatchNorm models (rank 0's statistics as DDP's); memory per rank going down with
the world size. Where shardkit refuses on purpose (a parameter shared by two units, wrapping a
module already inside a unit), the error must be clear, on every rank, before any collective.

Each check runs many cases on every rank and returns the cases that failed, so one run shows
every difference. One World per world size serves the module.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit import distributed as skdist
from shardkit.comm_counter import CommCounter
from shardkit.nn.checkpoint import checkpoint_wrapper
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel import TrainingState, auto_wrap_bn
from shardkit.nn.wrap import enable_wrap, wrap
from shardkit.testing import world_fixture

world1 = world_fixture(1)
world2 = world_fixture(2)
world4 = world_fixture(4)

TOL = 1e-5
GRID = [dict(reshard_after_forward=r, mixed_precision=m, flatten_parameters=f)
        for r in (True, False) for m in (True, False) for f in (True, False)]


def _failures(cases) -> list:
    """Run ``(name, fn)`` cases; return ``"name: error"`` for each that raised. A case runs
    all its collectives before it compares anything, so a rank that fails a comparison never
    leaves the others waiting."""
    failed = []
    for name, fn in cases:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported, the test asserts the list is empty
            failed.append(f"{name}: {type(exc).__name__}: {str(exc)[:400]}")
    return failed


def _close(a, b, what: str, tol: float = TOL) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
        for k in a:
            _close(a[k], b[k], f"{what}[{k}]", tol)
        return
    a, b = torch.as_tensor(a).detach().cpu(), torch.as_tensor(b).detach().cpu()
    assert a.shape == b.shape, (what, tuple(a.shape), tuple(b.shape))
    assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
    if a.numel():  # relative to the reference's size (sum losses grow some weights to 1e4)
        worst = (a.double() - b.double()).abs().max().item()
        scale = max(1.0, b.double().abs().max().item())
        assert worst <= tol * scale, f"{what}: differs by {worst:.3g} (largest value {scale:.3g})"


# ----------------------------------------------------------------------------- models


class Nested(nn.Module):
    """test_fsdp.py's NestedWrappedModule: units inside units, and a root that owns params
    (``wrap_everything``: a root without parameters; ``checkpoint``: every unit checkpointed)."""

    def __init__(self, config=None, wrap_everything=False, checkpoint=False):
        super().__init__()

        def unit(layer):
            return layer if config is None else FSDP(layer, **config)

        torch.manual_seed(0)
        if wrap_everything:
            ckpt = checkpoint_wrapper if checkpoint else (lambda m: m)
            self.module = nn.Sequential(*[unit(ckpt(nn.Linear(i, o)))
                                          for i, o in ((8, 4), (4, 16), (16, 4), (4, 8))])
        else:
            self.module = nn.Sequential(nn.Linear(8, 4),
                                        unit(nn.Sequential(unit(nn.Linear(4, 16)),
                                                           nn.Linear(16, 16))),
                                        unit(nn.Linear(16, 4)), nn.Linear(4, 8))

    def get_input(self):
        gen = torch.Generator().manual_seed(1 + skdist.get_rank())
        return (torch.rand(4, 8, generator=gen),)

    def forward(self, x):
        return self.module(x)

    def get_loss(self, inputs, output):
        return output.sum()


class TiedTransformer(nn.Module):
    """test_fsdp.py's TransformerWithSharedParams: embedding tied to the output projection,
    dropout, a float and a long buffer, a BatchNorm1d."""

    def __init__(self, config=None, add_bn=True):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(23, 16)
        self.transformer = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2,
                                          num_decoder_layers=2, dim_feedforward=8, dropout=0.1)
        self.output_proj = nn.Linear(16, 23)
        self.output_proj.weight = self.embed_tokens.weight
        self.register_buffer("vocab_bias", torch.ones(16))
        self.register_buffer("long_buffer", torch.zeros(16, dtype=torch.long))
        self.bn = nn.BatchNorm1d(2) if add_bn else nn.Identity()

    def get_input(self):
        torch.manual_seed(1 + skdist.get_rank())  # dropout draws from here, as in FairScale
        return torch.arange(12).view(6, 2), torch.arange(8).view(4, 2)

    def forward(self, src_ids, tgt_ids):
        src = self.embed_tokens(src_ids) + self.vocab_bias + self.long_buffer.type_as(src_ids)
        tgt = self.bn(self.embed_tokens(tgt_ids))
        return self.output_proj(self.transformer(src, tgt))

    def get_loss(self, inputs, output):
        return F.cross_entropy(output.reshape(-1, output.size(-1)), inputs[1].reshape(-1),
                               reduction="sum")


def _train(model, steps: int, lr: float = 0.01, norm_type=2, autocast: bool = False):
    """test_fsdp.py's _train_for_several_steps: SGD with momentum, clipping at 0.3, forward
    and loss under CPU autocast (bf16) when asked."""
    inner = model.module
    optim = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss = None
    for _ in range(steps):
        optim.zero_grad()
        inputs = inner.get_input()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = inner.get_loss(inputs, model(*inputs)).float()
        loss.backward()
        if norm_type is not None:
            if isinstance(model, FSDP):
                model.clip_grad_norm_(0.3, norm_type)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3, norm_type)
        optim.step()
    if isinstance(model, FSDP):
        model.assert_state(TrainingState.IDLE)
    return loss.detach()


def _identical_outputs(model_fn, config, steps=2, norm_type=2, lr=0.01):
    """FSDP(model_fn(config), **config) trains as DDP(model_fn(None)): loss and state dict.
    Under mixed precision both run under autocast and FSDP computes in fp32 (FairScale's
    setting, which makes the comparison exact)."""
    config = dict(config)
    autocast = bool(config.get("mixed_precision"))
    if autocast:
        config["compute_dtype"] = torch.float32
    ref = DDP(model_fn(None))
    ref_loss = _train(ref, steps, lr, norm_type, autocast)
    ref_sd = {k: v.detach().clone() for k, v in ref.module.state_dict().items()}
    model = FSDP(model_fn(config), **config)
    loss = _train(model, steps, lr, norm_type, autocast)
    sd = model.state_dict()
    if config.get("state_dict_on_rank_0_only") and skdist.get_rank() != 0:
        assert sd == {}, sorted(sd)
        return
    _close(loss, ref_loss, "loss")
    _close({k: v.cpu() for k, v in sd.items()}, ref_sd, "state_dict")


# ----------------------------------------------------------------------------- checks


def _grid(models: tuple):
    """test_fsdp.py TestComparisonToPyTorchDDP and test_fsdp_apply.py over the option grid."""
    builders = {
        "nested": Nested,
        "all_wrapped": lambda c: Nested(c, wrap_everything=True),
        "all_wrapped_ckpt": lambda c: Nested(c, wrap_everything=True, checkpoint=True),
        "transformer": TiedTransformer,
        "nested_apply": lambda c: Nested(c).apply(_init_bert_params),
        "transformer_apply": lambda c: TiedTransformer(c).apply(_init_bert_params),
    }
    cases = []
    for name in models:
        for config in GRID:
            tag = ",".join(f"{k[:7]}={int(v)}" for k, v in config.items())
            cases.append((f"{name}[{tag}]", lambda b=builders[name], c=config:
                          _identical_outputs(b, c)))
    return _failures(cases)


def _init_bert_params(module):
    """test_fsdp_apply.py's initialiser: normal(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        module.weight.data.normal_(mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            module.bias.data.zero_()
    if isinstance(module, nn.MultiheadAttention):
        module.in_proj_weight.data.normal_(mean=0.0, std=0.02)


def _other_configs():
    """test_fsdp.py's single cases: cpu offload with cpu grads, clipping by the 1- and inf-norm,
    state_dict_on_rank_0_only, the reduce-scatter group's size, parameter change after init,
    eval with and without no_grad, named parameters, reset_parameters."""
    cases = [
        ("cpu_offload", lambda: _identical_outputs(TiedTransformer, {"cpu_offload": True})),
        ("cpu_offload_mp", lambda: _identical_outputs(
            TiedTransformer, {"cpu_offload": True, "mixed_precision": True})),
        ("move_grads_to_cpu", lambda: _identical_outputs(
            TiedTransformer, {"move_params_to_cpu": True, "move_grads_to_cpu": True})),
        ("clip_norm_1", lambda: _identical_outputs(TiedTransformer, {"mixed_precision": True},
                                                   norm_type=1)),
        ("clip_norm_inf", lambda: _identical_outputs(TiedTransformer, {"mixed_precision": True},
                                                     norm_type=math.inf)),
        ("rank0_only_sd", lambda: _identical_outputs(TiedTransformer,
                                                     {"state_dict_on_rank_0_only": True})),
        ("rank0_only_sd_off", lambda: _identical_outputs(TiedTransformer,
                                                         {"state_dict_on_rank_0_only": False})),
        ("reduce_scatter_group", _reduce_scatter_group),
        ("param_change_after_init", _param_change_after_init),
        ("no_grad_eval", _no_grad_eval),
        ("named_parameters", _named_parameters),
        ("reset_parameters", _reset_parameters),
        ("apply_after_wrapping", _apply_after_wrapping),
        ("train_after_local_state_round_trip", _train_after_local_round_trip),
        ("mixture_of_experts", lambda: _mixture_of_experts({})),
        ("mixture_of_experts_mp", lambda: _mixture_of_experts(
            {"mixed_precision": True, "compute_dtype": torch.float32})),
        ("mixture_of_experts_ckpt", lambda: _mixture_of_experts({}, checkpoint=True)),
    ]
    return _failures(cases)


def _apply_after_wrapping():
    """model.apply(init) on the wrapped root initialises as on the plain model."""
    ref = Nested()
    torch.manual_seed(5)
    ref.apply(_init_bert_params)
    model = FSDP(Nested({}))
    torch.manual_seed(5)
    model.apply(_init_bert_params)
    _close(model.state_dict(), ref.state_dict(), "state_dict", tol=0)


def _train_after_local_round_trip():
    """test_fsdp.py test_backward_hooks_after_save: local_state_dict, load_local_state_dict,
    then training goes on as DDP's does from the same point."""
    model = FSDP(Nested({}))
    ref = DDP(Nested())
    _train(model, 2)
    _train(ref, 2)
    model.load_local_state_dict(model.local_state_dict())
    loss, ref_loss = _train(model, 1), _train(ref, 1)
    sd = model.state_dict()
    _close(loss, ref_loss, "loss")
    _close(sd, ref.module.state_dict(), "state_dict")


class _MoE(nn.Module):
    """test_fsdp.py's MixtureOfExperts: an expert Linear different on every rank, sharded over
    that rank alone (its own process_group and process_group_reduce_scatter), beside shared
    layers."""

    def __init__(self, config, expert_group=None, checkpoint=False):
        super().__init__()
        torch.manual_seed(42 + skdist.get_rank())
        expert = nn.Linear(23, 12)
        for p in expert.parameters():
            p.expert = True
        torch.manual_seed(0)
        shared = nn.Linear(12, 23)
        if checkpoint:
            expert, shared = checkpoint_wrapper(expert), checkpoint_wrapper(shared)
        if config is not None:
            expert = FSDP(expert, process_group=expert_group,
                          process_group_reduce_scatter=expert_group, **config)
            shared = FSDP(shared, **config)
        self.module = nn.Sequential(nn.Linear(8, 12), shared, expert, nn.Linear(12, 8))

    def get_input(self):
        gen = torch.Generator().manual_seed(1 + skdist.get_rank())
        return (torch.rand(4, 8, generator=gen),)

    def forward(self, x):
        return self.module(x)

    def get_loss(self, inputs, output):
        return output.sum()


class _HandReduced(nn.Module):
    """test_fsdp.py's DummyDDP: the reference averages every non-expert gradient by hand."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)

    def average(self):
        for p in self.module.parameters():
            if not hasattr(p, "expert"):
                p.grad /= skdist.get_world_size()
                skdist.all_reduce(p.grad)


def _mixture_of_experts(config, checkpoint=False):
    n, r = skdist.get_world_size(), skdist.get_rank()
    groups = [torch.distributed.new_group([i]) for i in range(n)]  # every rank creates each
    ref = _HandReduced(_MoE(None, checkpoint=checkpoint))
    model = FSDP(_MoE(config, groups[r], checkpoint), **config)
    losses = []
    for m in (ref, model):
        optim = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        for _ in range(2):
            optim.zero_grad()
            inputs = m.module.get_input()
            loss = m.module.get_loss(inputs, m(*inputs))
            loss.backward()
            if m is ref:
                ref.average()
            optim.step()
        losses.append(loss.detach())
    sd = model.state_dict()
    _close(losses[1], losses[0], "loss")
    _close(sd, ref.module.state_dict(), "state_dict")


def _reduce_scatter_group():
    model = FSDP(Nested({}))
    assert skdist.get_world_size(model.process_group_reduce_scatter) == model.world_size


def _param_change_after_init():
    config = {"mixed_precision": True}
    model = FSDP(TiedTransformer(config), **config).eval()
    ref = model(*model.module.get_input())
    model = FSDP(TiedTransformer(config), **config).eval()
    nn.init.normal_(next(model.parameters()).data)
    new = model(*model.module.get_input())
    assert not torch.equal(ref, new), "output did not follow a parameter changed after init"


def _no_grad_eval():
    for config in GRID:
        model = FSDP(TiedTransformer(config), **config)
        _train(model, 1)
        model.eval()
        inputs = model.module.get_input()
        out = model(*inputs)
        with torch.no_grad():
            out_ng = model(*inputs)
        _close(out, out_ng, f"no_grad output {config}", tol=0)


def _named_parameters():
    for flatten in (True, False):
        before = [(n, p.shape) for n, p in TiedTransformer().named_parameters()]
        model = FSDP(TiedTransformer({"flatten_parameters": flatten}),
                     flatten_parameters=flatten)
        _train(model, 1)
        with model.summon_full_params():
            after = [(n, p.shape) for n, p in model.named_parameters()]
        assert before == after, (before, after)


def _reset_parameters():
    model = FSDP(nn.Linear(10, 10), allow_reset_parameters=True)
    with model.summon_full_params():
        model.reset_parameters()


def _dtypes():
    """test_fsdp.py TestMixedPrecision (without autocast): the dtypes the wrapped module sees,
    and the dtype its gradients are reduce-scattered in."""
    half = torch.float16
    cases = [  # config, input, param, buffer, reduce
        ({"mixed_precision": False}, torch.float32, torch.float32, torch.float32, torch.float32),
        ({"mixed_precision": True}, half, half, half, half),
        ({"mixed_precision": True, "buffer_dtype": torch.float32}, half, half, torch.float32,
         half),
        ({"mixed_precision": True, "compute_dtype": torch.float32}, torch.float32,
         torch.float32, torch.float32, torch.float32),
        ({"mixed_precision": True, "fp32_reduce_scatter": True}, half, half, half,
         torch.float32),
    ]

    def one(config, in_dtype, p_dtype, b_dtype, r_dtype):
        seen = {}
        probe = _DtypeProbe(seen)
        model = FSDP(probe, **config)
        with CommCounter() as comm:
            loss = model(torch.rand(2, 5))
            loss.backward()
        expected = {"input": in_dtype, "param": p_dtype, "buffer": b_dtype}
        assert seen == expected, (seen, expected)
        reduced = {c.dtype for c in comm.calls if "reduce_scatter" in c.op}
        if skdist.get_world_size() > 1:
            assert reduced == {r_dtype}, (reduced, r_dtype, [c.op for c in comm.calls])
        assert model.module.lin.weight.grad is None or \
            model.module.lin.weight.grad.dtype == torch.float32
        assert next(model.parameters()).grad.dtype == torch.float32

    return _failures([(str(c[0]), lambda c=c: one(*c)) for c in cases])


class _DtypeProbe(nn.Module):
    def __init__(self, seen):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(5, 5)
        self.register_buffer("buf", torch.ones(5))
        self.seen = seen

    def forward(self, x):
        self.seen.update(input=x.dtype, param=self.lin.weight.dtype, buffer=self.buf.dtype)
        return (self.lin(x) + self.buf).sum()


def _autocast():
    """FairScale runs forward (and test_fsdp_multiple_forward_checkpoint.py backward too) under
    autocast with ``mixed_precision=True``. On CPU torch's autocast is bf16: a unit computing
    in fp16 (FairScale's default) or bf16 under either autocast must compute as the same
    module in its compute dtype under that autocast, and its own packing of the all-gather
    and reduce-scatter must not follow autocast (it raised "Unexpected floating ScalarType in
    at::autocast::prioritize" at world 1 in forward, at world > 1 when backward ran inside the
    autocast block)."""
    def one(config, compute, autocast_dtype, backward_inside):
        torch.manual_seed(0)
        layers = [nn.Linear(3, 5), nn.Linear(5, 3)]
        ref = nn.Sequential(*[nn.Linear(3, 5), nn.Linear(5, 3)]).to(compute)
        ref.load_state_dict(nn.Sequential(*layers).state_dict())
        model = FSDP(nn.Sequential(layers[0], FSDP(layers[1], **config)), **config)
        outputs = []
        for step in range(2):
            x = torch.randn(2, 3, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=autocast_dtype):
                out = model(x)
                # every unit casts its floating inputs to its compute dtype (FairScale: the
                # root only; they differ where autocast retyped an activation in between)
                expected = ref[1](ref[0](x.to(compute)).to(compute))
                loss = out.float().sum()
                if backward_inside:
                    loss.backward()
            if not backward_inside:
                loss.backward()
            grads = [p.grad for p in model.parameters()]
            model.zero_grad()
            ref.load_state_dict({k: v.to(compute) for k, v in model.state_dict().items()})
            outputs.append((out, expected, grads))
        model.assert_state(TrainingState.IDLE)
        for out, expected, grads in outputs:  # after every collective of the case
            _close(out, expected, "output", tol=0)
            assert all(g is not None and g.dtype == torch.float32 and g.isfinite().all()
                       for g in grads), grads

    cases = []
    for config, compute in (({"mixed_precision": True}, torch.float16),
                            ({"mixed_precision": True, "fp32_reduce_scatter": True},
                             torch.float16),
                            ({"compute_dtype": torch.bfloat16}, torch.bfloat16)):
        for autocast_dtype in (torch.bfloat16, torch.float16):
            for inside in (False, True):
                cases.append((f"{config},autocast={autocast_dtype},backward_inside={inside}",
                              lambda a=config, b=compute, c=autocast_dtype, d=inside:
                              one(a, b, c, d)))
    return _failures(cases)


def _grad_acc():
    """test_fsdp_grad_acc.py: two batches accumulated (inside no_sync or not) give the grads of
    their concatenation; no_sync before the first forward; communication inside no_sync."""
    def transformer(config):
        model = FSDP(TiedTransformer(config, add_bn=False), **config).eval()  # no dropout
        return model, 1

    def nested(config):
        return FSDP(Nested(config), **config), 0

    def one(build, config, use_no_sync):
        model, dim = build(config)
        batch1 = model.module.get_input()
        gen = torch.Generator().manual_seed(7)
        batch2 = tuple(x.reshape(-1)[torch.randperm(x.numel(), generator=gen)].view_as(x)
                       for x in batch1)
        both = tuple(torch.cat((x, y), dim=dim) for x, y in zip(batch1, batch2))
        model.zero_grad()
        ref_loss = model.module.get_loss(both, model(*both))
        ref_loss.backward()
        ref = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        with model.no_sync() if use_no_sync else contextlib.nullcontext():
            loss1 = model.module.get_loss(batch1, model(*batch1))
            loss1.backward()
        loss2 = model.module.get_loss(batch2, model(*batch2))
        loss2.backward()
        _close(loss1 + loss2, ref_loss, "loss", tol=1e-4)
        for i, (p, g) in enumerate(zip(model.parameters(), ref)):
            _close(p.grad, g, f"grad {i}", tol=1e-4)
        model.assert_state(TrainingState.IDLE)

    def no_sync_first():
        model = FSDP(Nested({}))
        batch = model.module.get_input()
        with model.no_sync():
            model.module.get_loss(batch, model(*batch)).backward()
        model.module.get_loss(batch, model(*batch)).backward()
        assert all(p.grad is not None for p in model.parameters())

    cases = [("transformer", lambda: one(transformer, {}, True)),
             ("transformer_without_no_sync", lambda: one(transformer, {}, False)),
             ("transformer_no_flat",
              lambda: one(transformer, {"flatten_parameters": False}, True)),
             ("nested", lambda: one(nested, {}, True)),
             ("no_sync_before_first_forward", no_sync_first)]
    for reshard in (True, False):
        for mp in (True, False):
            config = {"reshard_after_forward": reshard, "mixed_precision": mp}
            cases.append((f"comm{config}", lambda c=config: _no_sync_comm(c)))
    return _failures(cases)


def _no_sync_comm(config):
    """test_fsdp_grad_acc.py TestGradAccCommunication: no reduce-scatter inside no_sync, one per
    unit after; FairScale's all-gather counts (the root stays gathered from the no_sync
    backward into the next forward)."""
    model = FSDP(Nested(config), **config)
    units = sum(1 for m in model.modules() if isinstance(m, FSDP) and m.params)
    batch = model.module.get_input()
    with CommCounter() as inside:
        with model.no_sync():
            model.module.get_loss(batch, model(*batch)).backward()
    with CommCounter() as after:
        model.module.get_loss(batch, model(*batch)).backward()
    if skdist.get_world_size() == 1:
        return
    ops = lambda c, word: sum(1 for r in c.calls if word in r.op)  # noqa: E731
    if config["reshard_after_forward"]:
        gathers1, gathers2 = 2 * units - 1, 2 * units - 2
    else:
        gathers1, gathers2 = units, 0
    assert ops(inside, "reduce_scatter") == 0, inside.calls_by_op
    assert ops(after, "reduce_scatter") == units, (units, after.calls_by_op)
    assert ops(inside, "all_gather") == gathers1, (gathers1, inside.calls_by_op)
    assert ops(after, "all_gather") == gathers2, (gathers2, after.calls_by_op)


def _uneven():
    """test_fsdp_uneven.py: one step of Linear(3, 3) against the analytic result; a chain whose
    last weight (1 element) is smaller than the world; flat, non-flat, mixed precision."""
    def one_step(config):
        config = dict(config)
        dtype = torch.float32
        if config.get("mixed_precision"):
            dtype, config["fp32_reduce_scatter"] = torch.float16, True
        torch.manual_seed(0)
        lin = nn.Linear(3, 3, bias=False)
        inputs = torch.rand(8, 3, generator=torch.Generator().manual_seed(5))
        n, r = skdist.get_world_size(), skdist.get_rank()
        w = lin.weight.detach().T.clone()
        ref_out = inputs[r].to(dtype) @ w.to(dtype)
        grad = inputs[:n].float().sum(0).repeat(3, 1).div(n)
        ref_w = w - grad.T * 0.1
        model = FSDP(lin, **config)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        out = model(inputs[r].to(dtype))
        out.float().sum().backward()
        optim.step()
        optim.zero_grad()
        with model.summon_full_params():
            w_out = model.module.weight.detach().T.clone()
        model(inputs[r].to(dtype)).sum().backward()  # more forward/backward work
        tol = 1e-3 if dtype == torch.float16 else TOL
        _close(out.float(), ref_out.float(), "output", tol)
        _close(w_out, ref_w, "weight", tol)
        model.assert_state(TrainingState.IDLE)

    def chain(config):
        torch.manual_seed(0)
        dims = [3, 3, 4, 5, 4, 3, 1, 1]
        seq = nn.Sequential(*[nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:])])
        ref = nn.Sequential(*[nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:])])
        ref.load_state_dict(seq.state_dict())
        model = FSDP(seq, **config)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
        n, r = skdist.get_world_size(), skdist.get_rank()
        for step in range(2):
            data = torch.rand(8, 3, generator=torch.Generator().manual_seed(step))
            model(data[r:r + 1]).sum().backward()
            optim.step()
            optim.zero_grad()
            (ref(data[:n]).sum() / n).backward()
            ref_optim.step()
            ref_optim.zero_grad()
        _close(model.state_dict(), ref.state_dict(), "state_dict")
        model.assert_state(TrainingState.IDLE)

    cases = []
    for config in ({}, {"flatten_parameters": False}, {"mixed_precision": True}):
        cases.append((f"one_iteration{config}", lambda c=config: one_step(c)))
    for config in ({}, {"flatten_parameters": False}):
        cases.append((f"smaller_than_world{config}", lambda c=config: chain(c)))
    return _failures(cases)


class _InputModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 4)

    def forward(self, inputs, scale=1.0, *, tag: str = "", extra=None):
        if isinstance(inputs, list):
            x = inputs[0]
        elif isinstance(inputs, dict):
            x = inputs["in"]
        else:
            x = inputs
        assert isinstance(tag, str)
        y = self.layer(x) * scale
        if extra is not None:
            y = y + extra["nested"][0]
        return y


def _inputs():
    """test_fsdp_input.py: list and dict inputs (mixed precision too); plus keyword, non-tensor
    and nested inputs, checked against the same module in one process."""
    def one(config, kind):
        model = FSDP(_InputModel(), **config)
        ref = _InputModel()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
        n, r = skdist.get_world_size(), skdist.get_rank()
        for step in range(5):
            data = torch.rand(8 * n, 4, generator=torch.Generator().manual_seed(step))
            extra = {"nested": [torch.full((4,), 0.5)]}

            def call(m, x):
                if kind == "list":
                    return m([x])
                if kind == "dict":
                    return m({"in": x})
                return m(x, 2.0, tag="t", extra=extra)

            x = data[8 * r:8 * (r + 1)].clone().requires_grad_(True)
            call(model, x).float().sum().backward()
            optim.step()
            optim.zero_grad()
            (call(ref, data).sum() / n).backward()
            ref_optim.step()
            ref_optim.zero_grad()
            assert x.grad is not None
        model.assert_state(TrainingState.IDLE)
        if not config.get("mixed_precision"):
            _close(model.state_dict(), ref.state_dict(), "state_dict")

    cases = []
    for config in ({}, {"mixed_precision": True}):
        for kind in ("list", "dict", "kwargs"):
            cases.append((f"{kind}{config}", lambda c=config, k=kind: one(c, k)))
    return _failures(cases)


class _TwiceInner(nn.Module):
    def __init__(self, config):
        super().__init__()
        torch.manual_seed(0)
        lin = nn.Linear(4, 4)
        self.inner = lin if config is None else FSDP(lin, **config)
        self.outer = nn.Linear(4, 5)

    def forward(self, x):
        return self.outer(self.inner(x) + self.inner(x))


def _train_like_ddp(build, config, steps=3, batch=(8, 4), micro=None):
    """FSDP(build(config)) against DDP(build(None)) on each rank's own batch; parameters after
    every step. ``micro`` forwards before the backwards (fwd-fwd-bwd-bwd, no_sync for all but
    the last backward)."""
    # DDP decides in forward whether a backward reduces, so several forwards before their
    # backwards are checked against gradients averaged by hand instead
    ref = DDP(build(None)) if micro is None else _HandAveraged(build(None))
    model = FSDP(build(config), **config)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    r = skdist.get_rank()
    for step in range(steps):
        data = torch.rand(*batch, generator=torch.Generator().manual_seed(10 * step + r))
        for m, opt in zip((ref, model), opts):
            if micro is None:
                m(data.clone().requires_grad_(True)).sum().backward()
            else:
                losses = [m(data * (k + 1)).sum() for k in range(micro)]
                with m.no_sync():
                    for loss in losses[:-1]:
                        loss.backward()
                losses[-1].backward()
                if isinstance(m, _HandAveraged):
                    m.average()
            opt.step()
            opt.zero_grad()
    model.assert_state(TrainingState.IDLE)
    _close(model.state_dict(), ref.module.state_dict(), "state_dict")


class _HandAveraged(nn.Module):
    """The reference for several forwards per backward: gradients averaged over the ranks by
    hand after the backward that leaves ``no_sync``."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self._sync = True

    def forward(self, *args):
        return self.module(*args)

    @contextlib.contextmanager
    def no_sync(self):
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def zero_grad(self, set_to_none=True):
        self.module.zero_grad(set_to_none)

    def average(self):
        for p in self.module.parameters():
            if p.grad is not None:
                skdist.all_reduce(p.grad)
                p.grad /= skdist.get_world_size()


class _FFN(nn.Module):
    def __init__(self, config=None):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(10, 10), nn.Linear(10, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _multiple_forward():
    """test_fsdp_multiple_forward.py (a unit called twice per forward) and
    test_fsdp_fwd_fwd_bwd_bwd.py (three forwards, then backwards, the first two in no_sync),
    both against DDP."""
    cases = []
    for mp in (False, True):
        for flat in (True, False):
            config = {"mixed_precision": mp, "flatten_parameters": flat}
            if mp:
                config["compute_dtype"] = torch.float32
            cases.append((f"twice{config}", lambda c=config: _train_like_ddp(
                _TwiceInner, c, batch=(64, 4))))
    for reshard in (True, False):
        config = {"reshard_after_forward": reshard}
        cases.append((f"fwd_fwd_bwd_bwd{config}", lambda c=config: _train_like_ddp(
            _FFN, c, batch=(10, 10), micro=3)))

    def fp16_wrap():  # the FairScale test's own setup: fp16 model, wrap() with compute fp16
        ffn = _FFN().half()
        with enable_wrap(wrapper_cls=FSDP):
            model = wrap(ffn, flatten_parameters=True, compute_dtype=torch.float16)
        losses = [model(torch.rand(10, 10).half()).sum() for _ in range(3)]
        with model.no_sync():
            losses[0].backward()
            losses[1].backward()
        losses[2].backward()
        assert all(p.grad is not None for p in model.parameters())
        model.assert_state(TrainingState.IDLE)

    cases.append(("fwd_fwd_bwd_bwd_fp16_wrap", fp16_wrap))
    return _failures(cases)


class _SharedModel(nn.Module):
    """test_fsdp_shared_weights.py's Model: l1 and l3 share a weight or a bias."""

    def __init__(self, sharing):
        super().__init__()
        torch.manual_seed(0)
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(4, 4) for _ in range(4))
        if sharing == "weight":
            self.l1.weight = self.l3.weight
        elif sharing == "bias":
            self.l1.bias = self.l3.bias

    def forward(self, x):
        return self.l3(self.l2(self.l1(self.l0(x))))


def _shared_weights():
    """test_fsdp_shared_weights.py: FairScale wraps l1 and l3 as two units and ties them with
    append_shared_param; shardkit refuses a parameter shared by two units (clear ValueError,
    every rank) and trains it when the unit holding every use is the root."""
    def refused(sharing):
        model = _SharedModel(sharing)
        model.l1 = FSDP(model.l1, flatten_parameters=False)
        model.l2 = FSDP(model.l2)
        try:
            model.l3 = FSDP(model.l3, flatten_parameters=False)
            FSDP(model)
        except ValueError as exc:
            assert "shared" in str(exc) or "tied" in str(exc), str(exc)
            return
        raise AssertionError("a parameter shared by two units was accepted")

    def trains(sharing, inner_flat, outer_flat):
        def build(config):
            model = _SharedModel(sharing)
            if config is not None:
                model.l2 = FSDP(model.l2, flatten_parameters=inner_flat)
            return model
        _train_like_ddp(build, {"flatten_parameters": outer_flat}, batch=(1, 4))

    def append_shared_param():
        model = FSDP(nn.Sequential(nn.Linear(4, 4)), flatten_parameters=False)
        try:
            model.append_shared_param(nn.Parameter(torch.ones(4)))
        except NotImplementedError as exc:
            assert "append_shared_param" in str(exc) and "one unit" in str(exc), str(exc)
            return
        raise AssertionError("append_shared_param was accepted")

    cases = [(f"refused_{s}", lambda s=s: refused(s)) for s in ("weight", "bias")]
    cases.append(("append_shared_param_refused", append_shared_param))
    for sharing in ("none", "weight", "bias"):
        for inner in (True, False):
            for outer in (True, False):
                cases.append((f"trains_{sharing}_{inner}_{outer}",
                              lambda s=sharing, i=inner, o=outer: trains(s, i, o)))
    return _failures(cases)


class _Freeze(nn.Module):
    """test_fsdp_freezing_weights.py's models (a Linear trunk instead of a conv, for speed)."""

    def __init__(self, nested: bool):
        super().__init__()
        torch.manual_seed(0)
        if nested:
            self.trunk = nn.Sequential(nn.Sequential(nn.Linear(6, 8), nn.ReLU()),
                                       nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
        else:
            self.trunk = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        self.head = nn.Linear(8, 10)
        self.nested = nested

    def fsdp_wrap(self):
        if self.nested:
            for name, child in self.trunk.named_children():
                setattr(self.trunk, name, FSDP(child))
        self.trunk = FSDP(self.trunk)
        self.head = FSDP(self.head)

    def forward(self, x):
        return self.head(self.trunk(x))


def _freezing():
    """test_fsdp_freezing_weights.py: the trunk frozen by requires_grad (before or after
    wrapping) or by setting its grads to None, against DDP with a frozen trunk; and a root
    whose own weights are frozen while its inner unit trains."""
    target = torch.tensor([0, 1])
    criterion = nn.CrossEntropyLoss()

    def run(model, method, is_fsdp):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        r = skdist.get_rank()
        inner = model.module
        for step in range(3):
            batch = torch.randn(2, 6, generator=torch.Generator().manual_seed(step + 10 * r))
            loss = criterion(model(batch), target)
            opt.zero_grad()
            loss.backward()
            if method == "grad_to_none":
                for p in inner.trunk.parameters():
                    p.grad = None
            opt.step()
        return loss

    def one(nested, method, freeze_after_wrap):
        ref = _Freeze(nested)
        for p in ref.trunk.parameters():
            p.requires_grad_(False)
        ref = DDP(ref)
        run(ref, "requires_grad", False)
        model = _Freeze(nested)
        if freeze_after_wrap:
            model.fsdp_wrap()
        if method == "requires_grad":
            for p in model.trunk.parameters():
                p.requires_grad_(False)
        if not freeze_after_wrap:
            model.fsdp_wrap()
        model = FSDP(model)
        run(model, method, True)
        _close(model.state_dict(), ref.module.state_dict(), "state_dict")

    def frozen_root_head():
        def build(config):
            model = _Freeze(False)
            if config is not None:
                model.trunk = FSDP(model.trunk)
            for p in model.head.parameters():
                p.requires_grad_(False)
            return model
        _train_like_ddp(build, {}, batch=(2, 6))

    cases = [("frozen_root_head", frozen_root_head)]
    for nested in (False, True):
        for method in ("requires_grad", "grad_to_none"):
            for after in (True, False):
                cases.append((f"{'nested' if nested else 'simple'}_{method}_after={after}",
                              lambda n=nested, m=method, a=after: one(n, m, a)))
    return _failures(cases)


def _multiple_wrapping():
    """test_fsdp_multiple_wrapping.py: after training, FairScale wraps the same inner model in a
    second FSDP for inference. shardkit refuses (a module already inside another unit): the
    error must be a clear ValueError on every rank, and the first model must still work."""
    def one(config):
        class Inner(nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.layers = nn.Sequential(FSDP(nn.Linear(5, 5), **config))

            def forward(self, x):
                return self.layers(x)

        inner = Inner()
        model = FSDP(inner, **config)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            x = torch.rand(1, 5).requires_grad_(True)
            model(x).sum().backward()
            optim.step()
            optim.zero_grad()
        x = torch.rand(1, 5)
        out = model(x)
        model.assert_state(TrainingState.IDLE)
        try:
            FSDP(inner, **config)
        except ValueError as exc:
            assert "FullyShardedDataParallel" in str(exc), str(exc)
        else:
            raise AssertionError("re-wrapping a wrapped module was accepted")
        _close(model(x), out, "output after the refused re-wrap", tol=0)

    cases = []
    for mp in (False, True):
        for flat in (True, False):
            config = {"mixed_precision": mp, "flatten_parameters": flat}
            cases.append((str(config), lambda c=config: one(c)))
    return _failures(cases)


def _pre_backward_hook():
    """test_fsdp_pre_backward_hook.py: the root returns an inner unit's output beside the loss
    output; three iterations, every parameter gets a gradient each time."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.l1, self.l2, self.l3 = nn.Linear(4, 4), FSDP(nn.Linear(4, 4)), nn.Linear(4, 4)

        def forward(self, x):
            inner = self.l2(self.l1(x))
            return self.l3(inner), inner

    def one():
        model = FSDP(Model(), flatten_parameters=False)
        for _ in range(3):
            out, _ = model(torch.rand(1, 4))
            out.sum().backward()
            for p in model.parameters():
                assert p.grad is not None
                p.grad = None
        model.assert_state(TrainingState.IDLE)

    return _failures([("pre_backward_hook", one)])


class _CkptModule(nn.Module):
    def __init__(self, config, fsdp_outside_ckpt: bool):
        super().__init__()
        torch.manual_seed(0)
        first, middle, last = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
        if config is None:
            middle = checkpoint_wrapper(middle)
        elif fsdp_outside_ckpt:
            middle = FSDP(checkpoint_wrapper(middle), **config)
        else:
            middle = checkpoint_wrapper(FSDP(middle, **config))
        self.ffn = nn.Sequential(first, middle, last)

    def forward(self, x):
        return self.ffn(x)


def _with_checkpoint_wrapper():
    """test_fsdp_with_checkpoint_wrapper.py: FSDP(checkpoint_wrapper(m)) and
    checkpoint_wrapper(FSDP(m)) inside a root; train, eval under no_grad, train; the
    parameter names and shapes never change; fp32 cases also match DDP."""
    def one(flat, mp, f_outside, amp, half):
        config = {"flatten_parameters": flat, "mixed_precision": mp}
        model = FSDP(_CkptModule(config, f_outside), **config)
        optim = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}

        def check():
            assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes

        for phase in ("train", "eval", "train"):
            optim.zero_grad()
            x = torch.randn(2, 3)
            if half:  # FairScale: .half() under autocast or mixed precision (CPU: bf16)
                x = x.to(torch.bfloat16 if amp else torch.float16)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                if phase == "eval":
                    model.eval()
                    with torch.no_grad():
                        model(x).sum()
                    check()
                    continue
                model.train()
                loss = model(x).float().sum()
            check()
            loss.backward()
            check()
            optim.step()
            check()
        model.assert_state(TrainingState.IDLE)
        if not mp and not amp:
            _train_like_ddp(lambda c: _CkptModule(c, f_outside), config, batch=(2, 3))

    cases = []
    for flat in (True, False):
        for mp in (False, True):
            for f_outside in (True, False):
                for amp in (False, True):
                    for half in (False, True):
                        if half and not (amp or mp):
                            continue
                        cases.append((f"flat={flat},mp={mp},{'F->C' if f_outside else 'C->F'},"
                                      f"amp={amp},half={half}",
                                      lambda a=flat, b=mp, c=f_outside, d=amp, e=half:
                                      one(a, b, c, d, e)))
    return _failures(cases)


class _ConvBN(nn.Module):
    """test_fsdp_multiple_forward_checkpoint.py's Model: conv + BatchNorm blocks, a list input
    runs every element through the model (several forwards before one backward)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block1 = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.block2 = nn.Sequential(nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                                    nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        if isinstance(x, list):
            return torch.cat([self(e) for e in x], dim=0)
        return self.head(self.block2(self.block1(x)))


def _batchnorm(flat_options=(True, False)):
    """test_fsdp_multiple_forward_checkpoint.py and test_fsdp_regnet.py: BatchNorm models with
    auto_wrap_bn, checkpoint_wrapper, units built by enable_wrap/wrap, several forwards per
    backward, set_gradient_divide_factors(1, 2), autocast (bf16 on CPU) with compute in fp32
    under mixed precision; losses, parameters and rank 0's running statistics as DDP's
    (broadcast_buffers=True)."""
    target = torch.arange(6)
    criterion = nn.CrossEntropyLoss()

    def build(fsdp, ckpt, wrap_bn, flat, mp):
        model = _ConvBN()
        if fsdp and wrap_bn:
            model.block1 = auto_wrap_bn(model.block1)
            model.block2 = auto_wrap_bn(model.block2)
        if ckpt:
            model.block2 = checkpoint_wrapper(model.block2)
        if not fsdp:
            return DDP(model)
        config = dict(flatten_parameters=flat, mixed_precision=mp, compute_dtype=torch.float32,
                      fp32_reduce_scatter=mp)
        with enable_wrap(wrapper_cls=FSDP, **config):
            model.block1, model.block2, model.head = (wrap(model.block1), wrap(model.block2),
                                                      wrap(model.head))
        return FSDP(model, **config)

    def run(model, sum_grads, autocast=False):
        r = skdist.get_rank()
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(3):
            gen = torch.Generator().manual_seed(10 * step + r)
            batch = [torch.randn(2, 3, 8, 8, generator=gen), torch.randn(2, 3, 7, 7,
                                                                         generator=gen),
                     torch.randn(2, 3, 7, 7, generator=gen)]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = criterion(model(batch).float(), target)
            losses.append(loss.detach())
            optim.zero_grad()
            loss.backward()
            if sum_grads:  # FairScale's DDP side: sum over ranks then halve (1 and 2 factors)
                for p in model.parameters():
                    p.grad.mul_(skdist.get_world_size() / 2.0)
            optim.step()
        return torch.stack(losses)

    refs = {}
    for autocast in (False, True):
        ref = build(False, False, False, True, False)
        refs[autocast] = (ref, run(ref, True, autocast), ref.module.state_dict())

    def one(ckpt, wrap_bn, flat, mp):
        ref, ref_losses, ref_sd = refs[mp]
        model = build(True, ckpt, wrap_bn, flat, mp)
        model.set_gradient_divide_factors(1.0, 2.0, True)
        losses = run(model, False, mp)
        sd = model.state_dict()  # collective: before any comparison may raise
        # under autocast DDP's leaf weights are cast once per forward (autocast's cache) and
        # the three uses' gradients are summed in bf16 before the cast back; FSDP's gathered
        # weights are cast per use and summed in fp32: a bf16-rounding difference (~1e-3)
        tol = 3e-3 if mp else 1e-4
        _close(losses, ref_losses, "losses", tol)
        if skdist.get_rank() == 0:
            _close(sd, ref_sd, "state_dict", tol)
        else:  # parameters only: DDP's other ranks hold rank 0's statistics plus their own
            params = {k for k, _ in ref.module.named_parameters()}
            _close({k: sd[k] for k in params}, {k: ref_sd[k] for k in params}, "params", tol)

    cases = []
    for ckpt in (False, True):
        for wrap_bn in (False, True):
            for flat in flat_options:
                for mp in (False, True):
                    cases.append((f"ckpt={ckpt},wrap_bn={wrap_bn},flat={flat},mp={mp}",
                                  lambda a=ckpt, b=wrap_bn, c=flat, d=mp: one(a, b, c, d)))
    return _failures(cases)


def _gathered_bytes():
    """test_fsdp_memory.py's other half: with reshard_after_forward, at most one unit is
    gathered at a time in forward and nothing stays gathered after forward or backward."""
    counter = FSDP.gathered_param_bytes()
    model = FSDP(nn.Sequential(*[FSDP(nn.Linear(64, 64)) for _ in range(4)]))
    unit = (64 * 64 + 64) * 4
    base = counter.live
    counter.reset_peak()
    out = model(torch.rand(2, 64))
    after_forward, forward_peak = counter.live - base, counter.peak - base
    out.sum().backward()
    return {"after_forward": after_forward, "forward_peak": forward_peak,
            "after_backward": counter.live - base, "unit": unit}


def _memory():
    """test_fsdp_memory.py's idea: the parameters a rank holds shrink as 1/N (plus padding),
    and so do the gradients and optimizer state that follow them."""
    torch.manual_seed(0)
    dims = [64, 64, 64, 64, 64]
    layers = [nn.Linear(a, b) for a, b in zip(dims, dims[1:])]
    full = sum(p.numel() for m in layers for p in m.parameters())
    model = FSDP(nn.Sequential(*[FSDP(m) for m in layers]))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.rand(4, 64)).sum().backward()
    optim.step()
    n = skdist.get_world_size()
    held = sum(p.numel() for p in model.parameters())
    grads = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
    state = sum(t.numel() for s in optim.state.values() for t in s.values() if t.dim())
    rows = 64 + 1  # per unit: a weight of 64 rows and a bias, each padded to a multiple of N
    bound = full / n + len(layers) * rows
    return {"held": held, "grads": grads, "state": state, "full": full, "bound": bound,
            "ok": held <= bound and grads <= bound and state <= 2 * bound}


# ----------------------------------------------------------------------------- tests


def _all_checks(grid_models, full: bool = True):
    """Every check; ``full=False`` (world 4, 2 cores) runs the BatchNorm grid with flat units
    only (the non-flat half of it runs at worlds 1 and 2)."""
    return {"grid": _grid(grid_models), "other": _other_configs(), "dtypes": _dtypes(),
            "grad_acc": _grad_acc(), "uneven": _uneven(), "inputs": _inputs(),
            "multiple_forward": _multiple_forward(), "shared": _shared_weights(),
            "freezing": _freezing(), "rewrap": _multiple_wrapping(),
            "pre_backward": _pre_backward_hook(), "ckpt": _with_checkpoint_wrapper(),
            "batchnorm": _batchnorm() if full else _batchnorm((True,))}


ALL_MODELS = ("nested", "all_wrapped", "all_wrapped_ckpt", "transformer", "nested_apply",
              "transformer_apply")


def _assert_clean(results):
    for rank, found in enumerate(results):
        bad = {k: v for k, v in found.items() if v}
        assert not bad, f"rank {rank}: {bad}"


def test_fairscale_suite_world1(world1):
    # one rank: nothing is sharded apart; half of the models (all six run at world 2)
    _assert_clean(world1.run(_all_checks, ("nested", "all_wrapped_ckpt", "transformer_apply")))


def test_fairscale_suite_world2(world2):
    _assert_clean(world2.run(_all_checks, ALL_MODELS))


def test_fairscale_suite_world4(world4):
    _assert_clean(world4.run(_all_checks, ("nested", "all_wrapped_ckpt", "transformer"), False))


@pytest.mark.parametrize("world", ["world1", "world2", "world4"])
def test_autocast_does_not_reach_the_units_own_packing(world, request):
    """Regression: fp16 units under CPU autocast (bf16), and bf16 units under fp16 autocast,
    raised in the all-gather's packing (world 1) or the reduce-scatter's (backward inside the
    autocast block); flat_param.outside_autocast."""
    _assert_clean([{"autocast": f} for f in request.getfixturevalue(world).run(_autocast)])


@pytest.mark.parametrize("world", ["world1", "world2", "world4"])
def test_memory_goes_down_with_the_world(world, request):
    w = request.getfixturevalue(world)
    results = w.run(_memory)
    assert all(r["ok"] for r in results), results
    for r in w.run(_gathered_bytes):
        # one unit at a time in forward, none left after forward or after backward
        assert r["after_forward"] == 0 and r["after_backward"] == 0, r
        assert r["forward_peak"] <= r["unit"], r
