"""FairScale's own tutorials and benchmark scripts, with the import changed to shardkit.

Small re-expressions of the call patterns of FairScale's docs tutorials (oss.rst, pipe.rst,
activation_checkpointing.rst, the FSDP/auto_wrap snippets) and benchmarks (oss.py, fsdp.py,
pipe.py and their golden configs): each one trains beside a single-process oracle on the same
global batch and must match it step by step, or must fail with a clear error before any
collective. The distributed ones run in one world of 2 gloo ranks.
"""

import copy
import functools
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit import distributed
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff

TOL = 1e-5
STEPS = 3
LOCAL = 4

world2 = world_fixture(2)


# ---------------------------------------------------------------------- rank-side helpers


def _vision_model():
    """benchmarks/oss.py's problem, tiny: a 3-channel image classifier (no BatchNorm, whose
    per-rank statistics would differ from one process's by design)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))


def _vision_batch(step: int, world: int):
    """MNIST-shaped grey images, the grey channel repeated to three as the script's collate."""
    gen = torch.Generator().manual_seed(50 + step)
    x = torch.rand(LOCAL * world, 1, 8, 8, generator=gen).repeat(1, 3, 1, 1)
    return x, torch.randint(0, 10, (LOCAL * world,), generator=gen)


def _oss_benchmark(config: str):
    """One configuration of benchmarks/oss.py (vanilla DDP, OSS + DDP, OSS + ShardedDDP with
    ``reduce_buffer_size=0``; RMSprop with momentum; ``optimizer.step(closure)`` or the AMP
    branch's ``scaler.step``; consolidation every epoch) against one process. Returns the
    largest parameter difference, of the closure's loss, and of the consolidated state."""
    from shardkit.nn.data_parallel import ShardedDataParallel as ShardedDDP
    from shardkit.optim import OSS
    from shardkit.optim.grad_scaler import ShardedGradScaler

    rank, world = distributed.get_rank(), distributed.get_world_size()
    oracle, model = _vision_model(), _vision_model()
    hyper = dict(lr=1e-2, momentum=0.9)
    ref_opt = torch.optim.RMSprop(oracle.parameters(), **hyper)
    if config.startswith("oss_sharded_ddp"):
        optimizer = OSS(params=model.parameters(), optim=torch.optim.RMSprop, **hyper)
        model = ShardedDDP(model, optimizer, reduce_buffer_size=0)
    else:
        model = DDP(model, device_ids=None, find_unused_parameters=False)
        optimizer = (OSS(params=model.parameters(), optim=torch.optim.RMSprop, **hyper)
                     if config.startswith("oss_ddp") else
                     torch.optim.RMSprop(model.parameters(), **hyper))
    scaler = ShardedGradScaler() if config.endswith("_amp") else None
    loss_fn = nn.CrossEntropyLoss()
    worst = {"params": 0.0, "loss": 0.0, "state": 0.0}
    for step in range(STEPS):
        x, y = _vision_batch(step, world)
        local = slice(rank * LOCAL, (rank + 1) * LOCAL)

        def closure(grad_scaler=None):
            model.zero_grad()
            loss = loss_fn(model(x[local]), y[local])
            (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
            return loss

        if scaler is not None:
            loss = closure(grad_scaler=scaler)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss = optimizer.step(closure)
        with torch.no_grad():  # the oracle before its step: the loss the closure computed
            expected = loss_fn(oracle(x[local]), y[local])
        ref_opt.zero_grad()
        loss_fn(oracle(x), y).backward()
        ref_opt.step()
        worst["params"] = max(worst["params"], max_diff(_bare(model), oracle))
        worst["loss"] = max(worst["loss"], abs(loss.item() - expected.item()))
        if isinstance(optimizer, OSS):  # the script checkpoints every epoch
            optimizer.consolidate_state_dict()
            if rank == 0:
                full = optimizer.state_dict()
                ref = ref_opt.state_dict()
                for index, state in ref["state"].items():
                    for key in ("square_avg", "momentum_buffer"):
                        scale = max(1.0, state[key].abs().max().item())  # relative: grows
                        worst["state"] = max(worst["state"], max_diff(
                            [full["state"][index][key]], [state[key]]) / scale)
    return worst


def _bare(model):
    return getattr(model, "module", model)


def _oss_tutorial():
    """docs/tutorials/oss.rst: ``OSS(params=..., optim=SGD, **base_optimizer_arguments)`` then
    ``ShardedDDP(model, optimizer)``, ``model.zero_grad()`` in the loop."""
    from shardkit.nn.data_parallel import ShardedDataParallel as ShardedDDP
    from shardkit.optim.oss import OSS

    rank, world = distributed.get_rank(), distributed.get_world_size()
    oracle, model = _vision_model(), _vision_model()
    ref_opt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    base_optimizer_arguments = {"lr": 0.1}
    optimizer = OSS(params=model.parameters(), optim=torch.optim.SGD, **base_optimizer_arguments)
    model = ShardedDDP(model, optimizer)
    model.train()
    worst = 0.0
    for step in range(STEPS):
        x, y = _vision_batch(step, world)
        local = slice(rank * LOCAL, (rank + 1) * LOCAL)
        model.zero_grad()
        F.cross_entropy(model(x[local]), y[local]).backward()
        optimizer.step()
        ref_opt.zero_grad()
        F.cross_entropy(oracle(x), y).backward()
        ref_opt.step()
        worst = max(worst, max_diff(model.module, oracle))
    return worst


class _Decoder(nn.Module):
    """A small pre-built block standing in for the benchmark's TransformerDecoderLayer."""

    def __init__(self, width: int):
        super().__init__()
        self.attn = nn.Linear(width, width)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))

    def forward(self, x):
        x = x + torch.tanh(self.attn(x))
        return x + self.ff(x)


def _lm(vocab: int = 20, width: int = 8, layers: int = 3):
    """benchmarks/models/transformer_lm.py's shape, tiny: embedding, decoder blocks, head."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(vocab, width), *[_Decoder(width) for _ in range(layers)],
                         nn.Linear(width, vocab))


def _fsdp_benchmark(auto: bool):
    """benchmarks/fsdp.py: ``enable_wrap(wrapper_cls=FSDP)`` + ``auto_wrap(model,
    auto_wrap_policy=...)`` + a root ``FSDP``, an optimizer factory applied to the wrapped
    model's parameters, ``clip_grad_value_`` on them before ``step``. Every rank reads the same
    batch (the script's loader is not sharded). Returns (max difference, number of units)."""
    from shardkit.nn import auto_wrap, default_auto_wrap_policy, enable_wrap
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP

    oracle, model = _lm(), _lm()
    config = {}
    if auto:
        # 350: the blocks (352 parameters each) are wrapped; the root's remainder (embedding
        # 160 and head 180) is not, so the root is left to the script's own FSDP(...)
        policy = functools.partial(default_auto_wrap_policy, min_num_params=350)
        with enable_wrap(wrapper_cls=FSDP, **config):
            fsdp_model = auto_wrap(model, auto_wrap_policy=policy)
            fsdp_model = FSDP(fsdp_model, **config)
    else:
        fsdp_model = FSDP(model, **config)

    def make_adam(params):
        return torch.optim.Adam(params, lr=1e-2)

    optimizer, ref_opt = make_adam(fsdp_model.parameters()), make_adam(oracle.parameters())
    worst = 0.0
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(70 + step)
        batch = torch.randint(0, 20, (6, 4), generator=gen)
        source, target = batch[:-1], batch[1:]
        for net, opt in ((fsdp_model, optimizer), (oracle, ref_opt)):
            opt.zero_grad()
            out = net(source)
            F.cross_entropy(out.view(-1, 20), target.reshape(-1)).backward()
            torch.nn.utils.clip_grad_value_(net.parameters(), 0.05)
            opt.step()
        with fsdp_model.summon_full_params():
            worst = max(worst, max_diff(list(fsdp_model.parameters()), list(oracle.parameters())))
    units = sum(isinstance(m, FSDP) for m in fsdp_model.modules())
    return worst, units


def _wrap_tutorial():
    """The FSDP tutorial's ``enable_wrap(wrapper_cls=FSDP, process_group=group,
    mixed_precision=True, flatten_parameters=True)`` with ``wrap(Linear)`` and ``auto_wrap``
    (its ``DummyProcessGroup`` replaced by a real group)."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.wrap import auto_wrap, default_auto_wrap_policy, enable_wrap, wrap

    group = distributed.new_group([0, 1])
    fsdp_params = dict(mixed_precision=True, flatten_parameters=True)
    with enable_wrap(wrapper_cls=FSDP, process_group=group, **fsdp_params):
        l1 = wrap(nn.Linear(5, 5))
        policy = functools.partial(default_auto_wrap_policy, min_num_params=350)
        lm = auto_wrap(_lm(), auto_wrap_policy=policy)
    blocks = [m for m in lm if isinstance(m, FSDP)]
    return {"l1": (type(l1).__name__, l1.mixed_precision, l1.flatten_parameters),
            "root_kept": type(lm).__name__,
            "blocks": [(b.mixed_precision, b.flatten_parameters) for b in blocks]}


def _policy_argument_to_auto_wrap():
    """The tutorial's ``auto_wrap(tfmr, min_num_params=1e6)``: the size is the policy's, not the
    wrapper's; refused on every rank before any module is wrapped (it used to pass silently
    when the default 1e8 policy wrapped nothing, and then ``FSDP(...)`` to fail on a rank-local
    TypeError mid-model)."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.wrap import auto_wrap, default_auto_wrap_policy, enable_wrap

    errors = []
    for call in (lambda: auto_wrap(_lm(), min_num_params=1e6),
                 lambda: auto_wrap(_lm(), mixed_precison=True)):
        with enable_wrap(wrapper_cls=FSDP):
            try:
                call()
                errors.append(None)
            except TypeError as e:
                errors.append(str(e))
    try:
        with enable_wrap(wrapper_cls=FSDP, reshard_after_fwd=True):
            pass
        errors.append(None)
    except TypeError as e:
        errors.append(str(e))
    # benchmarks/fsdp.py's FSDP(auto_wrap(model)) when the size policy also selects the root
    policy = functools.partial(default_auto_wrap_policy, min_num_params=150)
    with enable_wrap(wrapper_cls=FSDP):
        root = auto_wrap(_lm(), auto_wrap_policy=policy)
    try:
        FSDP(root)
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
    distributed.barrier()  # every rank got here: nothing was left half-collective
    return errors


def _run_all():
    results = {}
    for config in ("vanilla", "oss_ddp", "oss_sharded_ddp", "oss_ddp_amp", "oss_sharded_ddp_amp"):
        results["oss_bench_" + config] = _oss_benchmark(config)
    results["oss_tutorial"] = _oss_tutorial()
    results["fsdp_bench_auto"] = _fsdp_benchmark(True)
    results["fsdp_bench_plain"] = _fsdp_benchmark(False)
    results["wrap_tutorial"] = _wrap_tutorial()
    results["policy_argument"] = _policy_argument_to_auto_wrap()
    return results


# ---------------------------------------------------------------------- tests (world of 2)


@pytest.fixture(scope="module")
def results(world2):
    return world2.run(_run_all)


@pytest.mark.parametrize("config", ["vanilla", "oss_ddp", "oss_sharded_ddp", "oss_ddp_amp",
                                    "oss_sharded_ddp_amp"])
def test_oss_benchmark_matches_one_process(results, config):
    for rank_result in results:
        worst = rank_result["oss_bench_" + config]
        assert worst["params"] < TOL, worst
        assert worst["loss"] < TOL  # step(closure) returned this rank's loss
        assert worst["state"] < TOL, worst  # consolidated RMSprop state == one process's


def test_oss_tutorial_matches_one_process(results):
    assert all(r["oss_tutorial"] < TOL for r in results), [r["oss_tutorial"] for r in results]


@pytest.mark.parametrize("auto", [True, False])
def test_fsdp_benchmark_matches_one_process(results, auto):
    for rank_result in results:
        worst, units = rank_result["fsdp_bench_auto" if auto else "fsdp_bench_plain"]
        assert worst < TOL
        assert units == (4 if auto else 1)  # 3 blocks wrapped, and the root


def test_wrap_tutorial_wraps_with_the_context_arguments(results):
    for rank_result in results:
        got = rank_result["wrap_tutorial"]
        assert got["l1"] == ("FullyShardedDataParallel", True, True)
        assert got["root_kept"] == "Sequential"  # auto_wrap left the root to the caller
        assert got["blocks"] and all(b == (True, True) for b in got["blocks"])


def test_policy_arguments_given_to_auto_wrap_are_refused_on_every_rank(results):
    for rank_result in results:
        size, typo, context, rewrap = rank_result["policy_argument"]
        assert size is not None and "min_num_params" in size and "functools.partial" in size
        assert typo is not None and "mixed_precison" in typo and "mixed_precision" in typo
        assert context is not None and "reshard_after_fwd" in context


def test_wrapping_the_root_auto_wrap_already_wrapped_names_auto_wrap(results):
    """FairScale nests ``FSDP(auto_wrap(model))`` when the policy wrapped the root; shardkit
    refuses a wrapper of a wrapper, and the error says why the root is wrapped and what to do."""
    for rank_result in results:
        rewrap = rank_result["policy_argument"][3]
        assert rewrap is not None and "already a FullyShardedDataParallel" in rewrap
        assert "auto_wrap" in rewrap and "use that result as the root" in rewrap


# ---------------------------------------------------------------------- one process


def test_pipe_tutorial_matches_the_plain_model():
    """docs/tutorials/pipe.rst: ``Pipe(model, balance=[2, 1])``, inputs and targets moved to
    ``model.devices[0]``, nll_loss, SGD."""
    from shardkit.nn import Pipe

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
    model = Pipe(copy.deepcopy(plain), balance=[2, 1])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.001)
    target = torch.randint(0, 2, size=(20, 1)).squeeze()
    data = torch.randn(20, 10)
    device = model.devices[0]
    optimizer.zero_grad()
    outputs = model(data.to(device))
    F.nll_loss(outputs.to(device), target.to(device)).backward()
    optimizer.step()
    F.nll_loss(plain(data), target).backward()
    ref_opt.step()
    assert max_diff(model, plain) < TOL


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_pipe_benchmark_lm_matches_the_plain_model(checkpoint):
    """benchmarks/pipe.py: an LM ``nn.Sequential`` in ``Pipe(model, balance, chunks=2,
    checkpoint=...)``, Adam, ``clip_grad_value_`` before each step."""
    from shardkit.nn import Pipe

    plain = _lm()
    pipe = Pipe(copy.deepcopy(plain), [2, 3], chunks=2, checkpoint=checkpoint)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (pipe, plain))
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(90 + step)
        batch = torch.randint(0, 20, (8, 5), generator=gen)
        source, target = batch[:, :-1], batch[:, 1:]
        for net, o in ((pipe, opt), (plain, ref_opt)):
            o.zero_grad()
            F.cross_entropy(net(source).reshape(-1, 20), target.reshape(-1)).backward()
            torch.nn.utils.clip_grad_value_(net.parameters(), 0.05)
            o.step()
        assert max_diff(pipe, plain) < TOL


@pytest.mark.parametrize("kwargs", [{}, {"offload_to_cpu": True}])
def test_activation_checkpointing_tutorial_matches_without_checkpointing(kwargs):
    """docs/tutorials/activation_checkpointing.rst: ``checkpoint_wrapper`` around an FFN with
    Dropout(0.5); the recomputation draws the same dropout mask, so gradients match the
    unwrapped module's under the same seed, and the state dict keeps the plain keys."""
    from shardkit.nn.checkpoint.checkpoint_activations import checkpoint_wrapper

    class CheckpointModel(nn.Module):
        def __init__(self, wrap: bool, **kw):
            super().__init__()
            torch.manual_seed(0)
            self.ffn_module = nn.Sequential(nn.Linear(32, 128), nn.Dropout(p=0.5),
                                            nn.Linear(128, 32))
            if wrap:
                self.ffn_module = checkpoint_wrapper(self.ffn_module, **kw)
            self.last_linear = nn.Linear(32, 1)

        def forward(self, x):
            return self.last_linear(self.ffn_module(x))

    x = torch.randn(8, 32)
    grads = []
    for model in (CheckpointModel(False), CheckpointModel(True, **kwargs)):
        torch.manual_seed(3)
        model(x).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert max_diff(grads[0], grads[1]) < TOL
    assert CheckpointModel(True, **kwargs).state_dict().keys() == \
        CheckpointModel(False).state_dict().keys()


def test_fairscale_grad_scaler_unscales_fp16_gradients():
    """benchmarks/golden_configs/lm_wikitext2.py builds ``fairscale.optim.GradScaler()``:
    torch's scaler that also unscales fp16 gradients (pure fp16 training), in FairScale's
    argument order; its step matches an unscaled fp16 step."""
    from shardkit.optim.grad_scaler import GradScaler

    torch.manual_seed(0)
    plain = nn.Linear(4, 3).half()
    model = copy.deepcopy(plain)
    x = torch.randn(5, 4).half()
    scaler = GradScaler(2.0 ** 8, 2.0, 0.5, 2000, True)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain))
    scaler.scale(model(x).float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    plain(x).float().sum().backward()
    ref_opt.step()
    assert max_diff(model, plain) < 1e-3
    assert scaler.get_scale() == 2.0 ** 8
    with pytest.raises(ValueError, match="growth_factor"):
        GradScaler(growth_factor=0.5)


def test_import_shardkit_reaches_the_subpackages_and_fairscales_grad_scaler():
    # `import fairscale; fairscale.nn.Pipe(...)` and `from fairscale.optim import GradScaler`
    code = ("import shardkit\n"
            "from shardkit.optim import GradScaler\n"
            "from shardkit.optim.grad_scaler import GradScaler as long_path\n"
            "assert shardkit.nn.Pipe.__name__ == 'Pipe' and GradScaler is long_path\n"
            "assert shardkit.optim.OSS.__name__ == 'OSS'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
