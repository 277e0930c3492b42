"""``shardkit.initialize`` with fp16/bf16 at ZeRO stages 0-2 on models whose structure the cast
to 16-bit weights must respect: an output layer tied to the embedding (GPT-style
``lm_head.weight = wte.weight``), whose checkpoint must hold the fp32 master under both names,
and normalization layers (BatchNorm beside its fp32 running statistics, LayerNorm and GroupNorm
given fp32 activations), whose CPU kernels refuse 16-bit weights beside an fp32 operand."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.checkpoint.consolidate import consolidate_checkpoint
from shardkit.testing import world_fixture
from tests.utils.master_weights import fp32_weights

HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


world2 = world_fixture(2)


def _config(stage: int, precision: str, optimizer: str = "AdamW", lr: float = 1e-2) -> dict:
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage},
              "optimizer": {"type": optimizer, "params": {"lr": lr}}}
    if precision in HALF:
        config[precision] = {"enabled": True, **({"initial_scale_power": 8}
                                                 if precision == "fp16" else {})}
    return config


class _TiedLM(nn.Module):
    """An embedding, a block and an output layer sharing the embedding's weight."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(20, 16)
        self.mid = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 20, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens):
        return self.lm_head(torch.relu(self.mid(self.wte(tokens))))


def _tied_lm():
    torch.manual_seed(0)
    return _TiedLM()


def _train_tied(engine, steps: int) -> None:
    rank, world = distributed.get_rank(), distributed.get_world_size()
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 20, (4 * world, 5), generator=gen)
        mine = tokens[4 * rank:4 * rank + 4]
        logits = engine(mine).float()
        engine.backward(F.cross_entropy(logits[:, :-1].reshape(-1, 20), mine[:, 1:].reshape(-1)))
        engine.step()


def _save_tied(stage: int, precision: str, path: str) -> dict:
    engine, *_ = shardkit.initialize(model=_tied_lm(), config=_config(stage, precision))
    _train_tied(engine, 2)
    engine.save_checkpoint(path, tag="t")
    return fp32_weights(engine)


def _load_tied(stage: int, precision: str, path: str) -> tuple:
    engine, *_ = shardkit.initialize(model=_tied_lm(), config=_config(stage, precision))
    engine.load_checkpoint(path, tag="t")
    return fp32_weights(engine), engine.module.lm_head.weight is engine.module.wte.weight


@pytest.mark.parametrize("saved", [(1, "bf16"), (2, "fp16"), (0, "bf16")])
def test_a_tied_weight_is_checkpointed_as_its_fp32_master(world2, tmp_path, saved):
    """The output layer's name of a tied weight holds the fp32 master in the checkpoint, as
    the embedding's does: an fp32 engine loading it, and the consolidated state dict, get the
    exact masters, not rank 0's 16-bit copy (which ``load_state_dict`` wrote last)."""
    path = str(tmp_path / "ckpt")
    masters = world2.run(_save_tied, *saved, path)[0]
    for loaded, tied in world2.run(_load_tied, 2, "fp32", path):
        assert tied
        for name, value in masters.items():
            assert torch.equal(loaded[name], value), (saved, name)
    state = consolidate_checkpoint(path, "t")
    for name in ("wte.weight", "lm_head.weight"):
        assert state[name].dtype == torch.float32, (saved, name, state[name].dtype)
        assert torch.equal(state[name], masters["wte.weight"]), (saved, name)


class _PositionTableNet(nn.Module):
    """PyTorch's transformer tutorial's pattern: a sinusoidal position table (an fp32 buffer)
    added to the 16-bit embedding gives fp32 activations (type promotion), which a LayerNorm
    and a GroupNorm then normalize."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.register_buffer("pe", torch.sin(torch.arange(16.0)).repeat(8, 1))
        self.ln, self.gn = nn.LayerNorm(16), nn.GroupNorm(4, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, tokens):
        h = (self.emb(tokens) + self.pe).flatten(0, 1)
        return self.head(self.ln(h) + self.gn(h))


def _position_table_net():
    torch.manual_seed(0)
    return _PositionTableNet()


def _batch_norm_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Linear(16, 4))


MODELS = {"batch_norm": (_batch_norm_net, ("1.weight", "1.bias"), ("0.weight", "3.weight")),
          "position_table": (_position_table_net, ("ln.weight", "ln.bias", "gn.weight",
                                                   "gn.bias"), ("emb.weight", "head.weight"))}


def _inputs(model: str, step: int, rows: int) -> tuple:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(rows, 8, generator=gen) if model == "batch_norm" \
        else torch.randint(0, 20, (rows, 8), generator=gen)
    return x, torch.randn(rows * (1 if model == "batch_norm" else 8), 4, generator=gen)


def _train_normalized(model: str, stage: int, precision: str, rounded_to=None) -> dict:
    """Three steps, then an eval forward; returns the masters, the dtypes and the output.
    ``rounded_to``: the weights first rounded to that dtype (an fp32 run starting where the
    16-bit one does)."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    net = MODELS[model][0]()
    if rounded_to is not None:
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(p.to(rounded_to))
    engine, *_ = shardkit.initialize(model=net, config=_config(stage, precision, "SGD", 0.1))
    for step in range(3):
        x, y = _inputs(model, step, 4 * world)
        per = len(y) // world
        engine.backward(F.mse_loss(engine(x[4 * rank:4 * rank + 4]).float(),
                                   y[per * rank:per * (rank + 1)]))
        engine.step()
    engine.eval()
    with torch.no_grad():
        out = engine(_inputs(model, 9, 4)[0]).float()
    return {"weights": fp32_weights(engine), "out": out,
            "dtypes": {n: t.dtype for n, t in engine.module.state_dict().items()}}


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_normalization_layers_keep_fp32_weights_and_train_in_16_bit(world2, model, stage):
    """The weights of BatchNorm layers (beside their fp32 running statistics, which buffers
    keep), LayerNorms and GroupNorms stay fp32: their CPU kernels refuse 16-bit weights beside
    an fp32 operand, and the first forward raised ("expected scalar type BFloat16 but found
    Float", "mixed dtype (CPU): expect parameter to have scalar type of Float"). The other
    weights are 16-bit, and training follows the fp32 engine's."""
    _, kept, cast = MODELS[model]
    # measured: fp16 5e-5 (weights) and 7e-4 (output), bf16 4e-4 and 6e-3 (one bf16 ulp)
    for precision, tolerance, out_tolerance in (("fp16", 2.5e-4, 5e-3), ("bf16", 2e-3, 3e-2)):
        reference = world2.run(_train_normalized, model, stage, "fp32", HALF[precision])[0]
        for r in world2.run(_train_normalized, model, stage, precision):
            dtypes = r["dtypes"]
            assert all(dtypes[name] == HALF[precision] for name in cast), dtypes
            assert all(dtypes[name] == torch.float32 for name in kept), dtypes
            for name, value in r["weights"].items():
                diff = (value - reference["weights"][name]).abs().max().item()
                assert diff < tolerance, (model, stage, precision, name, diff)
            assert (r["out"] - reference["out"]).abs().max().item() < out_tolerance
