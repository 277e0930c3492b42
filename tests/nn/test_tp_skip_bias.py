"""Megatron-LM's ``skip_bias_add`` on ColumnParallelLinear / RowParallelLinear, in one world of 4.

A 2-layer MLP written the Megatron way (``h, b = fc(x); h = gelu(h + b); y, b2 = out(h);
y + b2``) trains step by step like the same MLP without the flag and like the unsplit
``nn.Linear`` MLP in one process: forward output, every gradient and the parameters after each
of 3 SGD steps, at tensor-parallel size 2 and 4, with a split or a gathered column output and
with sequence parallelism. The flag costs no communication, except the all-gather of the bias
that a gathered output needs; bad values are a TypeError before any collective; the flag
survives ``torch.save`` and ``copy.deepcopy``.
"""

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit.distributed import CommCounter
from shardkit.nn import model_parallel as mp
from shardkit.nn.model_parallel.utils import shard_of
from shardkit.testing import world_fixture

TOL = 1e-5
STEPS, LR, IN, HIDDEN = 3, 0.1, 8, 16
TP_SIZES = (2, 4)
# name: (column kwargs, row kwargs, column weight stride); every MLP splits the hidden features
CONFIGS = {
    "split": (dict(gather_output=False), dict(input_is_parallel=True), 1),
    "gathered": (dict(gather_output=True, stride=2), dict(input_is_parallel=False), 2),
    "sequence_parallel": (dict(gather_output=False, sequence_parallel=True),
                          dict(input_is_parallel=True, sequence_parallel=True), 1),
}
SEQ_DIM = 1  # activations are [batch, seq, hidden]

world4 = world_fixture(4)


def _maxdiff(a, b):
    return (a.detach() - b.detach()).abs().max().item()


class _MLP(nn.Module):
    """Column -> gelu -> Row; with ``skip_bias_add`` the caller adds both biases itself."""

    def __init__(self, config: str, skip_bias_add: bool, bias: bool = True):
        super().__init__()
        column_kwargs, row_kwargs, _ = CONFIGS[config]
        self.skip = skip_bias_add
        self.fc = mp.ColumnParallelLinear(IN, HIDDEN, bias=bias, skip_bias_add=skip_bias_add,
                                          **column_kwargs)
        self.out = mp.RowParallelLinear(HIDDEN, IN, bias=bias, skip_bias_add=skip_bias_add,
                                        **row_kwargs)

    def forward(self, x):
        if not self.skip:
            return self.out(F.gelu(self.fc(x)))
        h, fc_bias = self.fc(x)
        y, out_bias = self.out(F.gelu(h + fc_bias))
        return y + out_bias


def _reference() -> nn.Sequential:
    """The unsplit MLP, biases random so that a bias left out or added twice shows at step 0."""
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, IN))
    with torch.no_grad():
        for layer in (ref[0], ref[2]):
            layer.bias.normal_()
    return ref


def _batch(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(2, 8, IN, generator=gen), torch.randn(2, 8, IN, generator=gen)


def _local(full: torch.Tensor, config: str, what: str, rank: int, tp: int) -> torch.Tensor:
    """This rank's part of the unsplit ``full`` (a reference gradient or activation)."""
    stride = CONFIGS[config][2]
    split = {"fc.weight": (0, stride), "fc.bias": (0, stride), "out.weight": (1, 1),
             "out.bias": None, "x": None, "y": None}[what]
    if what in ("x", "y") and config == "sequence_parallel":
        split = (SEQ_DIM, 1)
    return full if split is None else shard_of(full, rank, tp, split[0], split[1])


def _step_diffs(config, rank, tp, models, ref, step, diffs):
    """One SGD step of each model on the same batch; record every diff against the reference
    (key ``{config}/skip`` and ``{config}/no_skip``)."""
    x, g = _batch(step)
    ref_x = x.clone().requires_grad_()
    ref_y = ref(ref_x)
    (ref_y * g).sum().backward()
    ref_grads = {"fc.weight": ref[0].weight.grad, "fc.bias": ref[0].bias.grad,
                 "out.weight": ref[2].weight.grad, "out.bias": ref[2].bias.grad}
    for name, model in models.items():
        key = f"{config}/{name}"
        local_x = _local(x, config, "x", rank, tp).clone().requires_grad_()
        y = model(local_x)
        (y * _local(g, config, "y", rank, tp)).sum().backward()
        if config == "sequence_parallel":
            mp.reduce_sequence_parallel_grads(model)
        worst = {"out": _maxdiff(y, _local(ref_y, config, "y", rank, tp)),
                 "dx": _maxdiff(local_x.grad, _local(ref_x.grad, config, "x", rank, tp))}
        for pname, param in model.named_parameters():
            worst[f"d{pname}"] = _maxdiff(param.grad,
                                          _local(ref_grads[pname], config, pname, rank, tp))
        for what, value in worst.items():
            diffs[f"{key}/{what}"] = max(diffs.get(f"{key}/{what}", 0.0), value)
    _sgd_step([ref, *models.values()])


def _sgd_step(models):
    with torch.no_grad():
        for model in models:
            for p in model.parameters():
                p -= LR * p.grad
                p.grad = None


def _training_parity(config, rank, tp, diffs):
    ref = _reference()
    models = {"skip": _MLP(config, True), "no_skip": _MLP(config, False)}
    for model in models.values():
        model.fc.load_full_state_dict(ref[0].state_dict())
        model.out.load_full_state_dict(ref[2].state_dict())
    for step in range(STEPS):
        _step_diffs(config, rank, tp, models, ref, step, diffs)
    expected = {"fc": ref[0].state_dict(), "out": ref[2].state_dict()}
    for name, model in models.items():
        final = {"fc": model.fc.full_state_dict(), "out": model.out.full_state_dict()}
        diffs[f"{config}/{name}/params_after_{STEPS}_steps"] = max(
            _maxdiff(final[layer][k], v) for layer in expected
            for k, v in expected[layer].items())


def _forward_backward_calls(model, config, rank, tp):
    x, g = _batch(0)
    with CommCounter() as comm:
        y = model(_local(x, config, "x", rank, tp))
        (y * _local(g, config, "y", rank, tp)).sum().backward()
    return [(r.op, r.numel, r.group_size) for r in comm.calls]


def _communication(config, rank, tp, facts):
    torch.manual_seed(0)
    facts[f"{config}/calls_skip"] = _forward_backward_calls(_MLP(config, True), config, rank, tp)
    facts[f"{config}/calls_no_skip"] = _forward_backward_calls(_MLP(config, False), config, rank,
                                                               tp)


def _return_values(rank, tp, facts):
    """What forward returns, with and without a bias."""
    torch.manual_seed(1)
    x = torch.randn(3, IN)
    fc = mp.ColumnParallelLinear(IN, HIDDEN, gather_output=False, skip_bias_add=True)
    gathered = mp.ColumnParallelLinear(IN, HIDDEN, gather_output=True, skip_bias_add=True)
    row = mp.RowParallelLinear(HIDDEN, IN, input_is_parallel=True, skip_bias_add=True)
    plain = mp.ColumnParallelLinear(IN, HIDDEN)
    facts["default_returns_tensor"] = (type(plain(x)) is torch.Tensor
                                       and type(mp.RowParallelLinear(HIDDEN, IN)(
                                           torch.randn(3, HIDDEN))) is torch.Tensor)
    facts["column_split_bias_is_parameter"] = fc(x)[1] is fc.bias
    full_bias = gathered.full_state_dict()["bias"]
    facts["column_gathered_bias_is_full"] = torch.equal(gathered(x)[1], full_bias)
    facts["row_bias_is_parameter"] = row(torch.randn(3, HIDDEN // tp))[1] is row.bias
    facts["no_bias"] = [
        (type(layer_out[0]) is torch.Tensor, layer_out[1]) for layer_out in (
            mp.ColumnParallelLinear(IN, HIDDEN, bias=False, gather_output=False,
                                    skip_bias_add=True)(x),
            mp.ColumnParallelLinear(IN, HIDDEN, bias=False, skip_bias_add=True)(x),
            mp.RowParallelLinear(HIDDEN, IN, bias=False, skip_bias_add=True)(
                torch.randn(3, HIDDEN)))]
    facts["repr"] = repr(fc) + repr(row)
    facts["default_repr"] = repr(plain)


def _bad_flag(facts):
    errors = {}
    with CommCounter() as comm:
        for cls in (mp.ColumnParallelLinear, mp.RowParallelLinear):
            for bad in ("yes", 1, None):
                try:
                    cls(IN, IN, skip_bias_add=bad)
                except TypeError as e:
                    errors[f"{cls.__name__}/{bad!r}"] = str(e)
    facts["bad_flag_errors"] = errors
    facts["bad_flag_collectives"] = len(comm.calls)


def _save_and_copy(rank, tp, facts):
    """``torch.save`` / ``torch.load`` and ``copy.deepcopy`` keep the flag; a layer pickled
    before the flag existed (no attribute) loads as adding its bias."""
    torch.manual_seed(2)
    x = torch.randn(3, IN)
    layer = mp.ColumnParallelLinear(IN, HIDDEN, skip_bias_add=True)
    with torch.no_grad():
        layer.bias.normal_()
    expected_y, expected_b = layer(x)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(layer)
    for name, other in (("loaded", loaded), ("deepcopy", twin)):
        y, b = other(x)
        facts[f"{name}_keeps_flag"] = (other.skip_bias_add is True
                                       and torch.equal(y, expected_y)
                                       and torch.equal(b, expected_b))
    old = mp.RowParallelLinear(HIDDEN, IN, input_is_parallel=True)
    del old.__dict__["skip_bias_add"]  # as pickled by a version without the flag
    buffer = io.BytesIO()
    torch.save(old, buffer)
    buffer.seek(0)
    facts["old_pickle_returns_tensor"] = type(
        torch.load(buffer, weights_only=False)(torch.randn(3, HIDDEN // tp))) is torch.Tensor


def _everything(tp):
    mp.initialize_model_parallel(tp)
    try:
        rank, diffs, facts = mp.get_model_parallel_rank(), {}, {}
        for config in CONFIGS:
            _training_parity(config, rank, tp, diffs)
            _communication(config, rank, tp, facts)
        _return_values(rank, tp, facts)
        _bad_flag(facts)
        _save_and_copy(rank, tp, facts)
        return diffs, facts
    finally:
        mp.destroy_model_parallel()


@pytest.fixture(scope="module")
def results(world4):
    return {tp: world4.run(_everything, tp) for tp in TP_SIZES}


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_skip_bias_add_trains_like_unsplit_mlp(results, tp, config):
    worst = {}
    for diffs, _ in results[tp]:
        for key, value in diffs.items():
            if key.startswith(f"{config}/"):
                worst[key] = max(worst.get(key, 0.0), value)
    for name in ("skip", "no_skip"):  # out, dx, 4 gradients, final parameters
        assert sum(k.startswith(f"{config}/{name}/") for k in worst) == 7, sorted(worst)
    assert all(v <= TOL for v in worst.values()), {k: v for k, v in worst.items() if v > TOL}


@pytest.mark.parametrize("tp", TP_SIZES)
def test_skip_bias_add_communicates_as_without_it(results, tp):
    for _, facts in results[tp]:
        for config in ("split", "sequence_parallel"):
            assert facts[f"{config}/calls_skip"] == facts[f"{config}/calls_no_skip"], config
            assert facts[f"{config}/calls_skip"], config
        # a gathered output needs the bias gathered too: one all-gather of HIDDEN elements
        skip, no_skip = facts["gathered/calls_skip"], facts["gathered/calls_no_skip"]
        extra = list(skip)
        for call in no_skip:
            extra.remove(call)
        assert extra == [("all_gather", HIDDEN, tp)], (skip, no_skip)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_forward_returns_output_and_bias(results, tp):
    for _, facts in results[tp]:
        assert facts["default_returns_tensor"]
        assert facts["column_split_bias_is_parameter"]
        assert facts["column_gathered_bias_is_full"]
        assert facts["row_bias_is_parameter"]
        assert facts["no_bias"] == [(True, None)] * 3
        assert facts["repr"].count("skip_bias_add=True") == 2, facts["repr"]
        assert "skip_bias_add" not in facts["default_repr"]


def test_bad_skip_bias_add_is_a_type_error_before_any_collective(results):
    for _, facts in results[2]:
        errors = facts["bad_flag_errors"]
        assert len(errors) == 6, errors
        for key, message in errors.items():
            name, bad = key.split("/")
            assert message.startswith(f"{name}: skip_bias_add={bad} "), message
            assert "it must be a bool, True or False" in message, message
        assert facts["bad_flag_collectives"] == 0


@pytest.mark.parametrize("tp", TP_SIZES)
def test_torch_save_and_deepcopy_keep_the_flag(results, tp):
    for _, facts in results[tp]:
        assert facts["loaded_keeps_flag"]
        assert facts["deepcopy_keeps_flag"]
        assert facts["old_pickle_returns_tensor"]
