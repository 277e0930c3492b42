"""shardkit.checkpointing: DeepSpeed's deepspeed.checkpointing (configure, checkpoint,
partition_activations) and the config's activation_checkpointing section.

The one-process cases port DeepSpeed's tests/unit/runtime/activation_checkpointing/
test_activation_checkpointing.py (outputs and gradients against the un-checkpointed call). The
tensor-parallel cases run in one world of 2 ranks (tp=2): partitioned inputs give the same
gradients as whole ones, keep half the bytes, and all-gather (tp-1)/tp of them per recompute.
"""

import copy
import json

import pytest
import torch
import torch.nn as nn

from shardkit import checkpointing as ck
from shardkit import distributed
from shardkit.config import ConfigError, load_config
from shardkit.testing import world_fixture

HIDDEN = 20
TP = 2
world2 = world_fixture(2)


@pytest.fixture(autouse=True)
def _defaults():
    """Every test starts and ends with DeepSpeed's defaults (configure is process-wide)."""
    ck._STATE.__init__(ck.ActivationCheckpointingConfig())
    yield
    ck._STATE.__init__(ck.ActivationCheckpointingConfig())
    ck.reset()


# ---------------------------------------------------------------------- DeepSpeed's modules


class MaskedLinear(nn.Linear):
    def forward(self, x, mask):
        return super().forward(x) * (mask if mask.is_floating_point() else mask.type_as(x))


class MaskedLinearSeq(MaskedLinear):
    def forward(self, x, mask):
        return super().forward(x, mask), mask


class MaskedLinearSeqDup(MaskedLinearSeq):
    def forward(self, x, mask):
        dup = x.clone().detach() * 1.38
        x, mask = super().forward(x, mask)
        return dup, x, mask


class DropMaskLinear(nn.Linear):
    def forward(self, x, mask):
        return super().forward(x)


class LinearNonTensorInput(nn.Linear):
    def forward(self, x, non_tensor_input):
        return super().forward(x)


class LinearNonTensorOutput(nn.Linear):
    def __init__(self, non_tensor_output):
        super().__init__(HIDDEN, HIDDEN)
        self.non_tensor_output = non_tensor_output

    def forward(self, x):
        return super().forward(x), self.non_tensor_output


class DropoutLinear(nn.Linear):
    """Dropout on the default stream and on the tracker's model-parallel stream."""

    def forward(self, x):
        x = nn.functional.dropout(super().forward(x), 0.5)
        with ck.get_cuda_rng_tracker().fork():
            return nn.functional.dropout(x, 0.3)


def _mask(floating: bool):
    mask = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(7)) > 0
    return mask.float() if floating else mask


def _clone(value):
    if torch.is_tensor(value):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return value


def _compute(module, inputs, how):
    inputs = _clone(inputs)
    outputs = how(module, *inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    differentiable = [o.sum() for o in outputs if torch.is_tensor(o) and o.requires_grad]
    if differentiable:
        sum(differentiable).backward()
    return (outputs, [p.grad for p in module.parameters()],
            [i.grad for i in inputs if torch.is_tensor(i)])


def _match(ref, got):
    assert type(ref) is type(got), (ref, got)
    if isinstance(ref, (list, tuple)):
        assert len(ref) == len(got)
        for a, b in zip(ref, got):
            _match(a, b)
    elif torch.is_tensor(ref):
        assert torch.equal(ref, got), (ref, got)
    else:
        assert ref == got


def _check(module_factory, *inputs, how=ck.checkpoint, seed=0):
    torch.manual_seed(seed)
    module = module_factory()
    plain = _compute(module, inputs, lambda m, *a: m(*a))
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    _match(plain, _compute(module, inputs, how))


def _x():
    return torch.rand(HIDDEN, generator=torch.Generator().manual_seed(3)).requires_grad_()


HOWS = [ck.checkpoint, ck.non_reentrant_checkpoint]


@pytest.mark.parametrize("how", HOWS, ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("floating", [False, True], ids=["bool_mask", "float_mask"])
def test_deepspeed_cases_match_plain_call(how, floating):
    mask = _mask(floating)
    _check(lambda: nn.Linear(HIDDEN, HIDDEN), _x(), how=how)
    _check(lambda: MaskedLinear(HIDDEN, HIDDEN), _x(), mask, how=how)
    _check(lambda: MaskedLinearSeq(HIDDEN, HIDDEN), _x(), mask, how=how)
    _check(lambda: DropMaskLinear(HIDDEN, HIDDEN), _x(), None, how=how)
    if how is ck.non_reentrant_checkpoint:  # outputs require grad as without checkpointing
        _check(lambda: MaskedLinearSeqDup(HIDDEN, HIDDEN), _x(), mask, how=how)


def test_output_that_needs_no_grad_behaves_as_deepspeeds():
    """DeepSpeed's reentrant checkpoint marks every floating-point output as requiring grad
    (``dup`` is detached inside), and drops the gradient sent to it; a bool output is not
    differentiable. Gradients equal the plain call's."""
    mask = _mask(False)
    torch.manual_seed(0)
    module = MaskedLinearSeqDup(HIDDEN, HIDDEN)
    dup, out, mask_out = ck.checkpoint(module, _x(), mask)
    assert dup.requires_grad and out.requires_grad and not mask_out.requires_grad
    x = _x()
    (dup, out, _) = ck.checkpoint(module, x, mask)
    (dup.sum() + out.sum()).backward()
    ref_x = _x()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    module(ref_x, mask)[1].sum().backward()
    assert torch.equal(x.grad, ref_x.grad)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, module.parameters()))


@pytest.mark.parametrize("how", HOWS, ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("non_tensor", [None, 2, True, (None, 2.5),
                                        (None, True, torch.randn(HIDDEN))])
def test_non_tensor_inputs_and_outputs(how, non_tensor):
    _check(lambda: LinearNonTensorInput(HIDDEN, HIDDEN), _x(), non_tensor, how=how)
    _check(lambda: LinearNonTensorOutput(non_tensor), _x(), how=how)
    outputs = how(LinearNonTensorOutput(non_tensor), _x())
    assert torch.is_tensor(outputs[0]) and outputs[1] is non_tensor  # order and identity kept


@pytest.mark.parametrize("how", HOWS, ids=["reentrant", "non_reentrant"])
def test_dropout_replays_default_and_tracker_streams(how):
    tracker = ck.get_cuda_rng_tracker()
    states = tracker.get_states()
    tracker.reset()
    tracker.add("model-parallel-rng", 4321)
    try:
        start = (torch.get_rng_state(), tracker.get_states())
        torch.manual_seed(5)
        module = DropoutLinear(HIDDEN, HIDDEN)
        x = _x()
        torch.set_rng_state(start[0])
        tracker.set_states(start[1])
        plain = _compute(module, (x,), lambda m, *a: m(*a))
        after_plain = (torch.get_rng_state(), tracker.get_states()["model-parallel-rng"])
        module.zero_grad(set_to_none=True)
        torch.set_rng_state(start[0])
        tracker.set_states(start[1])
        got = _compute(module, (x,), how)
        # the recomputation consumed no randomness of what follows
        assert torch.equal(after_plain[0], torch.get_rng_state())
        assert torch.equal(after_plain[1], tracker.get_states()["model-parallel-rng"])
        _match(plain, got)
    finally:
        tracker.set_states(states)


@pytest.mark.parametrize("how", HOWS, ids=["reentrant", "non_reentrant"])
def test_batchnorm_statistics_updated_once_per_step(how):
    """The recomputation left BatchNorm's running statistics updated a second time
    (num_batches_tracked 2 per step), for a module and for a function closing over one."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.BatchNorm1d(HIDDEN),
                          nn.Dropout(0.3), nn.Linear(HIDDEN, HIDDEN))
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(1)).requires_grad_()
    for region in (lambda m: m, lambda m: (lambda t: m[3](m[2](m[1](m[0](t)))))):
        runs = []
        for checkpointed in (False, True):
            m, inp = copy.deepcopy(block), _clone(x)
            for step in range(2):
                torch.manual_seed(step)
                out = how(region(m), inp) if checkpointed else m(inp)
                out.pow(2).sum().backward()
            runs.append([inp.grad] + [p.grad for p in m.parameters()] + list(m.buffers()))
        assert runs[1][-1].item() == 2  # num_batches_tracked: one update per step
        for a, b in zip(*runs):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("how", HOWS, ids=["reentrant", "non_reentrant"])
def test_eval_between_forward_and_backward_recomputes_in_train_mode(how):
    """An evaluation callback's model.eval() before the backward made the recomputation run
    dropout in eval mode: silently other gradients (reentrant), a CheckpointError
    (non-reentrant)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Dropout(0.5), nn.Linear(HIDDEN, HIDDEN))
    for region in (lambda m: m, lambda m: (lambda t: m[2](m[1](m[0](t))))):
        grads = []
        for checkpointed in (False, True):
            m, x = copy.deepcopy(block), _x()
            torch.manual_seed(1)
            out = how(region(m), x) if checkpointed else m(x)
            m.eval()
            out.sum().backward()
            assert not m[1].training  # the caller's eval() stays
            grads.append([x.grad] + [p.grad for p in m.parameters()])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("how", HOWS, ids=["reentrant", "non_reentrant"])
def test_tensors_inside_container_arguments_changed_in_place_are_refused(how):
    # were read again by the recomputation: silently other gradients
    lin = nn.Linear(HIDDEN, HIDDEN)

    def block(x, extra, *, scale):
        return lin(x) * extra["mask"] * scale[0]

    mask, scale = torch.rand(HIDDEN), [torch.rand(HIDDEN)]
    out = how(block, _x(), {"mask": mask}, scale=scale)
    scale[0].mul_(2)
    with pytest.raises(RuntimeError, match=r"block's input 'scale'\[0\] \(a tensor inside"):
        out.sum().backward()

    def changing(x, extra):
        extra["mask"].add_(1)
        return lin(x) * extra["mask"]

    with pytest.raises(RuntimeError, match=r"changed its input 'extra'\['mask'\] in place"):
        how(changing, _x(), {"mask": mask})


@pytest.mark.parametrize("how", HOWS, ids=["reentrant", "non_reentrant"])
def test_tensors_inside_container_arguments_replaced_are_refused(how):
    """A slot of a list or dict argument given another tensor (by the forward, or by the
    caller before the backward) was read again by the recomputation: silently other
    gradients, e.g. layers passing one state dict along (`state["h"] = layer(state["h"])`)."""
    lin = nn.Linear(HIDDEN, HIDDEN)

    def reads(x, batch):
        return lin(x) * batch["mask"]

    batch = {"mask": torch.rand(HIDDEN)}
    out = how(reads, _x(), batch)
    batch["mask"] = torch.rand(HIDDEN)  # the caller reuses its dict
    with pytest.raises(RuntimeError, match=r"reads's input 'batch'\['mask'\] \(a tensor inside"):
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    def replaces(state):
        state["h"] = lin(state["h"]).tanh()
        return state["h"]

    with pytest.raises(RuntimeError, match=r"changed its input 'state'\['h'\]"):
        how(replaces, {"h": _x()})


def test_keyword_arguments_and_inputs_without_grad():
    def function(value, scale, *, shift, offset):
        return value * scale + shift + offset

    value, scale = _x(), torch.randn(HIDDEN, requires_grad=True)
    shift = torch.randn(HIDDEN)  # needs no grad
    ref_value, ref_scale = _clone(value), _clone(scale)
    function(ref_value, ref_scale, shift=shift, offset=1.5).sum().backward()
    out = ck.checkpoint(function, value, scale, shift=shift, offset=1.5)
    out.sum().backward()
    assert torch.equal(value.grad, ref_value.grad) and torch.equal(scale.grad, ref_scale.grad)
    assert shift.grad is None


def test_list_output_comes_back_as_a_tuple_with_gradients_as_deepspeed():
    # was a bare StopIteration (DeepSpeed returns the list's items as a tuple)
    w, x = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    out = ck.checkpoint(lambda t: [t * w, (t * w).sin(), 7], x)
    assert isinstance(out, tuple) and out[2] == 7
    (out[0].sum() + out[1].sum()).backward()
    ref_w, ref_x = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    ((ref_x * ref_w).sum() + (ref_x * ref_w).sin().sum()).backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(w.grad, ref_w.grad)


@pytest.mark.parametrize("value", [None, 3, {"h": 1}])
def test_output_neither_tensor_nor_tuple_is_a_clear_type_error(value):
    # was a bare StopIteration, which map() and generators end on silently
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match=f"returned a {type(value).__name__}; expected a tensor"):
        ck.checkpoint(lambda t: value, x)
    with pytest.raises(TypeError):
        list(map(lambda f: ck.checkpoint(f, x), [lambda t: value]))


def test_reentrant_trains_a_block_whose_inputs_need_no_grad():
    """No input requires grad (the raw batch): the reentrant output still does, and the
    parameters get the plain call's gradients (DeepSpeed's and torch's reentrant checkpoints
    leave them silently without), as the non-reentrant one does."""
    x = torch.rand(HIDDEN)
    for region in (ck.checkpoint, ck.non_reentrant_checkpoint):
        lin = nn.Linear(HIDDEN, HIDDEN)
        out = region(lin, x)
        assert out.requires_grad
        out.sum().backward()
        expected = torch.autograd.grad(lin(x).sum(), lin.weight)[0]
        assert torch.equal(lin.weight.grad, expected)


def test_autograd_grad_refused_by_reentrant_works_non_reentrant():
    lin = nn.Linear(HIDDEN, HIDDEN)
    x = _x()
    with pytest.raises(RuntimeError, match="autograd.grad"):
        torch.autograd.grad(ck.checkpoint(lin, x).sum(), x)
    (grad,) = torch.autograd.grad(ck.non_reentrant_checkpoint(lin, x).sum(), x)
    assert torch.allclose(grad, lin.weight.sum(0), atol=1e-6)  # summed in another order


def test_no_grad_just_runs():
    lin = nn.Linear(HIDDEN, HIDDEN)
    x = _x()
    with torch.no_grad():
        assert torch.equal(ck.checkpoint(lin, x), lin(x))


# ---------------------------------------------------------------------- configuration


AC_ON = {"partition_activations": True, "contiguous_memory_optimization": True,
         "cpu_checkpointing": True, "number_checkpoints": 4,
         "synchronize_checkpoint_boundary": True, "profile": True}


def test_config_section_switched_on_loads_and_configures(tmp_path):
    cfg = load_config({"train_batch_size": 8, "activation_checkpointing": AC_ON}, 1)
    assert cfg.activation_checkpointing == ck.ActivationCheckpointingConfig(**AC_ON)
    assert not ck.is_configured()
    fake_mpu = _FakeMpu(size=1)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": AC_ON}))
    for source in (cfg, {"activation_checkpointing": AC_ON}, str(path)):
        ck.configure(fake_mpu, deepspeed_config=source)
        assert ck.is_configured() and ck.get_config() == cfg.activation_checkpointing
        assert ck.PARTITION_ACTIVATIONS and ck.num_layers == 4 and ck.mp_size == 1
    # explicit arguments override the file; each call starts from the defaults
    ck.configure(None, deepspeed_config=cfg, partition_activations=False,
                 contiguous_checkpointing=False, num_checkpoints=2, profile=False)
    assert ck.get_config() == ck.ActivationCheckpointingConfig(
        cpu_checkpointing=True, number_checkpoints=2, synchronize_checkpoint_boundary=True)
    ck.configure(None)
    assert ck.get_config() == ck.ActivationCheckpointingConfig()
    # tp size 1: partition accepted, inputs kept whole (DeepSpeed's behaviour)
    ck.configure(fake_mpu, partition_activations=True, checkpoint_in_cpu=True)
    _check(lambda: MaskedLinearSeq(HIDDEN, HIDDEN), _x(), _mask(True))


class _FakeMpu:
    def __init__(self, size):
        self.size = size

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return self.size

    def get_model_parallel_group(self):
        return None


@pytest.mark.parametrize("section,words", [
    ({"partition_activation": True}, ["activation_checkpointing.partition_activation",
                                      "did you mean 'activation_checkpointing.partition_"
                                      "activations'"]),
    ({"partition_activations": "true"}, ["activation_checkpointing.partition_activations",
                                         "wrong type str"]),
    ({"cpu_checkpointing": 1}, ["activation_checkpointing.cpu_checkpointing", "wrong type"]),
    ({"number_checkpoints": 0}, ["activation_checkpointing.number_checkpoints=0",
                                 "positive integer"]),
    ({"number_checkpoints": 2.0}, ["activation_checkpointing.number_checkpoints"]),
    ({"profile": None}, ["activation_checkpointing.profile"]),
    ({"partition_activations": True, "contiguous_memory_optimization": True},
     ["contiguous_memory_optimization=true needs", "number_checkpoints"]),
    ({"contiguous_memory_optimization": True, "number_checkpoints": 3},
     ["contiguous_memory_optimization=true needs", "partition_activations=true"]),
])
def test_config_errors_name_the_key(section, words):
    for attempt in (lambda: load_config({"train_batch_size": 8,
                                         "activation_checkpointing": section}, 1),
                    lambda: ck.configure(None, deepspeed_config={
                        "activation_checkpointing": section})):
        with pytest.raises(ConfigError) as error:
            attempt()
        for word in words:
            assert word in str(error.value)
    assert not ck.is_configured()


@pytest.mark.parametrize("kwargs,words", [
    ({"partition_activations": "yes"}, ["partition_activations='yes'", "True, False or None"]),
    ({"num_checkpoints": 0}, ["num_checkpoints=0", "positive int"]),
    ({"synchronize": 1}, ["synchronize=1"]),
    ({"contiguous_checkpointing": True, "partition_activations": True,
      "mpu_": _FakeMpu(2)}, ["contiguous_checkpointing=True", "num_checkpoints"]),
    ({"contiguous_checkpointing": True, "num_checkpoints": 2},
     ["contiguous_checkpointing=True", "partition_activations=True"]),
    ({"partition_activations": True}, ["partition_activations=True", "mpu_",
                                       "initialize_model_parallel"]),
])
def test_configure_argument_errors(kwargs, words):
    with pytest.raises(ConfigError) as error:
        ck.configure(**kwargs)
    for word in words:
        assert word in str(error.value)
    assert not ck.is_configured()


def test_bad_mpu_and_function():
    with pytest.raises(TypeError, match="get_model_parallel_rank"):
        ck.configure(object())
    with pytest.raises(TypeError, match="callable"):
        ck.checkpoint(torch.rand(2))
    with pytest.raises(TypeError, match="callable"):
        ck.non_reentrant_checkpoint(torch.rand(2))


# ---------------------------------------------------------------------- tensor parallel, tp=2

BATCH, WIDTH = 6, 8


def _tp_block():
    from shardkit.nn import model_parallel as mp
    torch.manual_seed(0)  # the same master weights on both ranks: each keeps its slices
    column = mp.ColumnParallelLinear(WIDTH, 4 * WIDTH, gather_output=False)
    row = mp.RowParallelLinear(4 * WIDTH, WIDTH, input_is_parallel=True)

    def block(x, odd, mask, scale):
        h = nn.functional.gelu(column(x))
        with ck.get_cuda_rng_tracker().fork():  # a different mask on each shard
            h = nn.functional.dropout(h, 0.2)
        out = nn.functional.dropout(row(h), 0.1) * mask + odd.sum() * scale
        return out, mask

    return block, [column, row]


def _tp_inputs():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(BATCH, WIDTH, generator=g).requires_grad_()  # 48 elements: partitioned
    odd = torch.randn(7, generator=g).requires_grad_()  # 7 elements: kept whole
    mask = torch.randn(BATCH, WIDTH, generator=g) > 0  # bool: kept whole
    return x, odd, mask, 0.5


def _tp_run(how, blocks=1, **options):
    """Outputs, input and parameter gradients, bytes the checkpoints keep (storages seen by a
    saved-tensors hook) and all-gather bytes of the backward, for ``blocks`` stacked calls."""
    from shardkit.nn import model_parallel as mp
    ck.configure(mp.initialize, **options) if options else ck.configure(None)
    ck.model_parallel_cuda_manual_seed(99)
    block, layers = _tp_block()
    x, odd, mask, scale = _tp_inputs()
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hidden = x
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with distributed.CommCounter() as forward_comm:
            for _ in range(blocks):
                hidden, _ = how(block, hidden, odd, mask, scale) if how else block(
                    hidden, odd, mask, scale)
    with distributed.CommCounter() as backward_comm:
        (hidden * torch.arange(hidden.numel()).view_as(hidden)).sum().backward()
    grads = [x.grad, odd.grad] + [p.grad for m in layers for p in m.parameters()]
    return dict(out=hidden.detach(), grads=grads, kept=sum(kept.values()),
                forward_gather=forward_comm.by_op.get("all_gather", 0),
                gather=backward_comm.by_op.get("all_gather", 0))


def _tp_checks():
    from shardkit.nn import model_parallel as mp
    mp.initialize_model_parallel(TP)
    try:
        plain = _tp_run(None, blocks=2)
        whole = _tp_run(ck.checkpoint, blocks=1)
        part = _tp_run(ck.checkpoint, blocks=1, partition_activations=True)
        whole2 = _tp_run(ck.checkpoint, blocks=2)
        part2 = _tp_run(ck.checkpoint, blocks=2, partition_activations=True)
        variants = {
            "cpu": _tp_run(ck.checkpoint, blocks=2, partition_activations=True,
                           checkpoint_in_cpu=True, synchronize=True, profile=True),
            "contiguous": _tp_run(ck.checkpoint, blocks=2, partition_activations=True,
                                  contiguous_checkpointing=True, num_checkpoints=2),
            "non_reentrant": _tp_run(ck.non_reentrant_checkpoint, blocks=2),
        }
        too_many = None
        try:
            _tp_run(ck.checkpoint, blocks=3, partition_activations=True,
                    contiguous_checkpointing=True, num_checkpoints=2)
        except RuntimeError as error:
            too_many = str(error)
        ck.reset()
        refused = None
        ck.configure(mp.initialize, partition_activations=True)
        try:
            ck.non_reentrant_checkpoint(lambda t: t * 2, torch.rand(4, requires_grad=True))
        except RuntimeError as error:
            refused = str(error)
        # what an engine's config leaves: configure(mpu, deepspeed_config=engine.config)
        cfg = load_config({"train_batch_size": 2, "activation_checkpointing": {
            "partition_activations": True}}, 1)
        ck.configure(mp.initialize, deepspeed_config=cfg)
        from_config = (ck.PARTITION_ACTIVATIONS, ck.mp_size, ck.mp_rank)
    finally:
        ck.configure(None)
        mp.destroy_model_parallel()
    return dict(plain=plain, whole=whole, part=part, whole2=whole2, part2=part2,
                variants=variants, too_many=too_many, refused=refused,
                from_config=from_config, rank=distributed.get_rank())


def _same(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a["grads"], b["grads"])) and torch.equal(
        a["out"], b["out"])


def test_tensor_parallel_partition(world2):
    for r in world2.run(_tp_checks):
        plain, whole, part, whole2, part2 = (
            r[k] for k in ("plain", "whole", "part", "whole2", "part2"))
        # recomputed with the same streams: identical to the plain block and to each other
        assert _same(plain, whole2) and _same(whole2, part2), r["rank"]
        for name, run in r["variants"].items():
            assert _same(whole2, run), name
        x_bytes, odd_bytes, mask_bytes = BATCH * WIDTH * 4, 7 * 4, BATCH * WIDTH
        # one checkpoint keeps x, odd and mask: partitioned, x is halved, the others stay
        assert whole["kept"] == x_bytes + odd_bytes + mask_bytes
        assert part["kept"] == x_bytes // TP + odd_bytes + mask_bytes
        assert part2["kept"] == 2 * (x_bytes // TP) + odd_bytes + mask_bytes
        # all-gather of (tp-1)/tp of each partitioned input, per recompute; none in forward
        assert part["gather"] == (TP - 1) / TP * x_bytes
        assert part2["gather"] == 2 * (TP - 1) / TP * x_bytes
        assert whole2["gather"] == 0 and part2["forward_gather"] == 0
        assert r["variants"]["contiguous"]["gather"] == part2["gather"]
        assert "number_checkpoints=2" in r["too_many"]
        assert "partition_activations=True" in r["refused"]
        assert r["from_config"] == (True, TP, r["rank"])


class _TPNet(nn.Module):
    """Two tensor-parallel MLP blocks, checkpointed with shardkit.checkpointing when asked."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        from shardkit.nn import model_parallel as mp
        torch.manual_seed(0)
        self.checkpointed = checkpointed
        self.blocks = nn.ModuleList(nn.Sequential(
            mp.ColumnParallelLinear(WIDTH, 4 * WIDTH, gather_output=False), nn.GELU(),
            mp.RowParallelLinear(4 * WIDTH, WIDTH, input_is_parallel=True)) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = ck.checkpoint(block, x) if self.checkpointed else block(x)
        return x


def _engine_checks():
    """``initialize`` accepts the section switched on and, as DeepSpeed's engine, leaves
    checkpointing unconfigured; ``configure(mpu, deepspeed_config=engine.config)`` applies it,
    and two engine steps then match the un-checkpointed engine's."""
    import shardkit
    from shardkit.nn import model_parallel as mp
    mp.initialize_model_parallel(TP)
    config = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              # torch DDP with find_unused_parameters refuses reentrant checkpoints (the
              # engine's error says so): every parameter gets a gradient here
              "zero_optimization": {"stage": 0, "ignore_unused_parameters": False},
              "activation_checkpointing": {"partition_activations": True,
                                           "contiguous_memory_optimization": True,
                                           "number_checkpoints": 2}}
    ck._STATE.__init__(ck.ActivationCheckpointingConfig())  # unconfigured, as in a new job
    try:
        params, configured_by_initialize = [], []
        for checkpointed in (False, True):
            engine, *_ = shardkit.initialize(model=_TPNet(checkpointed), config=config,
                                             mpu=mp.initialize)
            configured_by_initialize.append(ck.is_configured())
            ck.configure(mp.initialize, deepspeed_config=engine.config)
            for step in range(2):
                x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step))
                x.requires_grad_()  # the reentrant checkpoint needs an input that requires grad
                with distributed.CommCounter() as comm:
                    engine.backward(engine(x).pow(2).mean())
                engine.step()
            params.append([p.detach().clone() for p in engine.module.parameters()])
        return dict(configured_by_initialize=configured_by_initialize[0],
                    options=ck.get_config(), gather=comm.by_op.get("all_gather", 0),
                    same=all(torch.equal(a, b) for a, b in zip(*params)))
    finally:
        ck.configure(None)
        mp.destroy_model_parallel()


def test_initialize_then_configure_from_engine_config(world2):
    for r in world2.run(_engine_checks):
        assert not r["configured_by_initialize"]
        assert r["options"] == ck.ActivationCheckpointingConfig(
            partition_activations=True, contiguous_memory_optimization=True, number_checkpoints=2)
        assert r["same"]
        assert r["gather"] == 2 * (TP - 1) / TP * BATCH * WIDTH * 4  # two blocks' inputs
