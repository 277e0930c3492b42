"""Users' own model shapes through the wrappers, against one process training on the global batch.

Small models with what real ones have (BatchNorm running statistics and its int counter, a
residual add, a tied input/output embedding, ``nn.MultiheadAttention``'s packed in-projection, a
0-dim learned temperature, a transposed (non-contiguous) parameter, an LSTM that calls
``flatten_parameters()`` in forward, a Hugging Face BERT masked LM) train for 3 steps under
torch DDP + OSS, ShardedDataParallel + OSS, FullyShardedDataParallel (size and class auto-wrap
policies, activation checkpointing) and ``shardkit.initialize`` stages 0 and 3, each rank on
its own slice of the global batch. After every step each rank compares its loss, every
parameter and every persistent buffer with the reference; at the end, the state_dict's keys and
shapes with the unwrapped model's, and checks that the discarded wrapper and model are
collected. One world per size for the module.

Reference: the single-process model runs the slices one after another and steps once on the mean
loss, which is the global-batch step for every sample-independent layer; BatchNorm's running
statistics follow what each wrapper does with buffers: DDP, ShardedDDP and ZeRO stages 0-2
broadcast rank 0's at each forward, FSDP and stage 3 keep each rank's own.
"""

import copy
import functools
import gc
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.engine import ShardedEngine
from shardkit.testing import world_fixture

world2 = world_fixture(2)
world4 = world_fixture(4)

GLOBAL_BATCH, STEPS, D, VOCAB, SEQ = 8, 3, 8, 13, 6
SGD = {"lr": 0.05, "momentum": 0.9}
ADAMW = {"lr": 1e-2, "eps": 1e-4, "weight_decay": 0.01}
RTOL = 1e-5


# ----------------------------------------------------------------------------- the models

class TemperatureProjection(nn.Module):
    """A 0-dim learned temperature and a transposed (non-contiguous) projection weight."""

    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(0.7))
        self.proj = nn.Parameter(torch.randn(5, D).t())
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return (torch.tanh(self.lin(x)) @ self.proj) / self.temperature


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class SmallResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.layers = nn.Sequential(ResBlock(4), ResBlock(4))
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


class TiedTransformer(nn.Module):
    """Tied input/output embedding around two ``nn.TransformerEncoderLayer`` blocks."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(SEQ, D) * 0.1)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
            for _ in range(2))
        self.out = nn.Linear(D, VOCAB, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class LSTMLanguageModel(nn.Module):
    """An embedding, a 2-layer LSTM whose forward calls ``flatten_parameters()`` (what RNN code
    does for cuDNN) and an output head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.rnn = nn.LSTM(D, D, num_layers=2, batch_first=True)
        self.out = nn.Linear(D, VOCAB)

    def forward(self, x):
        self.rnn.flatten_parameters()
        h, _ = self.rnn(self.emb(x))
        return self.out(h)


def _bert():
    import transformers
    cfg = transformers.BertConfig(vocab_size=VOCAB + 4, hidden_size=D, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=16,
                                  max_position_embeddings=SEQ + 2, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    return transformers.BertForMaskedLM(cfg)


def _bert_layer():
    from transformers.models.bert.modeling_bert import BertLayer
    return BertLayer


def _generator(step):
    return torch.Generator().manual_seed(1000 + step)


def _features_batch(step):
    x = torch.randn(GLOBAL_BATCH, D, generator=_generator(step))
    return x, (x.sum(1) * 7).long().remainder(5)


def _image_batch(step):
    x = torch.randn(GLOBAL_BATCH, 3, 6, 6, generator=_generator(step))
    return x, (x.sum((1, 2, 3)) * 7).long().remainder(5)


def _token_batch(step):
    x = torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ), generator=_generator(step))
    return x, torch.roll(x, -1, 1)


def _cross_entropy(out, y):
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# name: (build, batch, block class for the class policy, submodules to checkpoint)
MODELS = {
    "temperature_transposed": (TemperatureProjection, _features_batch, lambda: nn.Linear,
                               ("lin",)),
    "resnet_batchnorm": (SmallResNet, _image_batch, lambda: ResBlock, ("layers.0", "layers.1")),
    "tied_transformer": (TiedTransformer, _token_batch, lambda: nn.TransformerEncoderLayer,
                         ("blocks.0", "blocks.1")),
    "lstm_lm": (LSTMLanguageModel, _token_batch, lambda: nn.LSTM, ()),
    "hf_bert_mlm": (_bert, _token_batch, _bert_layer,
                    ("bert.encoder.layer.0", "bert.encoder.layer.1")),
}


# ----------------------------------------------------------------------------- the wrappers

def _optimizer(kind, params):
    return torch.optim.SGD(params, **SGD) if kind == "sgd" else torch.optim.AdamW(params, **ADAMW)


def _fsdp(model, policy, checkpointed=()):
    from shardkit.nn.checkpoint import checkpoint_wrapper
    from shardkit.nn.data_parallel import FullyShardedDataParallel
    from shardkit.nn.wrap import auto_wrap
    for name in checkpointed:
        checkpoint_wrapper(model.get_submodule(name))
    wrapped = auto_wrap(model, policy)
    return wrapped if isinstance(wrapped, FullyShardedDataParallel) \
        else FullyShardedDataParallel(wrapped)


def _wrap(wrapper, opt_kind, model, block, checkpointed):
    """(what forward calls, optimizer or engine, full state_dict callable)."""
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.nn.wrap import default_auto_wrap_policy, transformer_auto_wrap_policy
    from shardkit.optim import OSS
    optim_cls = torch.optim.SGD if opt_kind == "sgd" else torch.optim.AdamW
    hyper = SGD if opt_kind == "sgd" else ADAMW
    if wrapper == "ddp_oss":  # FairScale's order: the model is wrapped first
        ddp = nn.parallel.DistributedDataParallel(model)
        return ddp, OSS(model.parameters(), optim=optim_cls, **hyper), model.state_dict
    if wrapper == "sdp_oss":
        opt = OSS(model.parameters(), optim=optim_cls, **hyper)
        return ShardedDataParallel(model, opt), opt, model.state_dict
    if wrapper.startswith("fsdp"):
        policy = functools.partial(default_auto_wrap_policy, min_num_params=100)
        if wrapper != "fsdp_size":
            policy = transformer_auto_wrap_policy({block()})
        fsdp = _fsdp(model, policy, checkpointed if wrapper == "fsdp_checkpoint" else ())
        return fsdp, _optimizer(opt_kind, fsdp.parameters()), fsdp.state_dict
    config = {"zero_optimization": {"stage": int(wrapper[-1])}, "steps_per_print": 10 ** 6,
              "train_batch_size": GLOBAL_BATCH,
              "optimizer": {"type": "SGD" if opt_kind == "sgd" else "AdamW", "params": hyper}}
    engine, _, _, _ = shardkit.initialize(model=model, config=config)
    return engine, engine, engine.module_state_dict


def _step(wrapped, opt, loss):
    if isinstance(wrapped, ShardedEngine):
        wrapped.backward(loss)
        wrapped.step()
    else:
        opt.zero_grad()
        loss.backward()
        opt.step()


# ----------------------------------------------------------------------------- the reference

def _persistent_buffers(model):
    keys = model.state_dict().keys()
    return {k: v.detach().clone() for k, v in model.named_buffers() if k in keys}


def _reference(build, batch, opt_kind, world, broadcast_buffers):
    """Per step: (each slice's loss, parameters, each rank's persistent buffers)."""
    torch.manual_seed(0)
    model = build()
    opt = _optimizer(opt_kind, model.parameters())
    buffers = [_persistent_buffers(model)] * world
    n, history = GLOBAL_BATCH // world, []
    for step in range(STEPS):
        x, y = batch(step)
        if broadcast_buffers:
            buffers = [buffers[0]] * world
        opt.zero_grad()
        losses, after = [], []
        for r in range(world):
            model.load_state_dict(buffers[r], strict=False)
            loss = _cross_entropy(model(x[r * n:(r + 1) * n]), y[r * n:(r + 1) * n])
            (loss / world).backward()
            losses.append(loss.item())
            after.append(_persistent_buffers(model))
        buffers = after
        opt.step()
        params = {k: p.detach().clone() for k, p in model.named_parameters()}
        history.append((losses, params, copy.deepcopy(buffers)))
    return history


def _mismatches(full, expected, where):
    bad = []
    for name, want in expected.items():
        got = full[name].detach().float()
        scale = max(want.abs().max().item(), 1e-3) if want.numel() else 1.0
        if got.shape != want.shape or (got - want.float()).abs().max().item() > RTOL * scale:
            bad.append(f"{where}: {name} differs by "
                       f"{(got - want.float()).abs().max().item():.2e} (scale {scale:.2e})")
    return bad


def _train_beside_reference(model_name, wrapper, opt_kind="sgd"):
    """Train ``model_name`` under ``wrapper``; every mismatch with the reference, as text."""
    build, batch, block, checkpointed = MODELS[model_name]
    world, rank = distributed.get_world_size(), distributed.get_rank()
    shares_buffers = wrapper in ("ddp_oss", "sdp_oss", "zero0")
    reference = _reference(build, batch, opt_kind, world, shares_buffers)
    torch.manual_seed(0)
    model = build()
    plain_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrapped, opt, full_state_dict = _wrap(wrapper, opt_kind, model, block, checkpointed)
    refs = (weakref.ref(model), weakref.ref(wrapped))
    n, bad = GLOBAL_BATCH // world, []
    for step in range(STEPS):
        x, y = batch(step)
        loss = _cross_entropy(wrapped(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n])
        _step(wrapped, opt, loss)
        losses, params, buffers = reference[step]
        if abs(loss.item() - losses[rank]) > RTOL * abs(losses[rank]):
            bad.append(f"step {step}: loss {loss.item()} != {losses[rank]}")
        full = full_state_dict()
        bad += _mismatches(full, {**params, **buffers[rank]}, f"step {step}")
    shapes = {k: tuple(v.shape) for k, v in full.items()}
    if shapes != plain_shapes:
        differ = set(shapes.items()) ^ set(plain_shapes.items())
        bad.append(f"state_dict keys/shapes differ: {sorted(differ)}")
    del model, wrapped, opt, full_state_dict, full, loss
    gc.collect()
    if any(ref() is not None for ref in refs):
        bad.append("the discarded model or wrapper was not collected")
    return bad


# ----------------------------------------------------------------------------- the checks

# (model, wrapper, optimizer): the transposed parameter under DDP + OSS is the regression (OSS
# made it contiguous under DDP's gradient buckets: weights 0.3 off after one step)
ZOO_WORLD2 = [
    ("temperature_transposed", "ddp_oss", "sgd"),
    ("temperature_transposed", "ddp_oss", "adamw"),
    ("temperature_transposed", "sdp_oss", "adamw"),
    ("temperature_transposed", "fsdp_size", "sgd"),
    ("resnet_batchnorm", "ddp_oss", "sgd"),
    ("resnet_batchnorm", "fsdp_class", "sgd"),
    ("resnet_batchnorm", "zero0", "sgd"),
    ("tied_transformer", "sdp_oss", "sgd"),
    ("tied_transformer", "fsdp_checkpoint", "sgd"),
    ("hf_bert_mlm", "fsdp_class", "sgd"),
    ("hf_bert_mlm", "zero3", "sgd"),
    # the LSTM is a unit: its forward's flatten_parameters() used to meet FSDP's bool flag
    # ("'bool' object is not callable")
    ("lstm_lm", "fsdp_size", "sgd"),
]
ZOO_WORLD4 = [
    ("temperature_transposed", "ddp_oss", "sgd"),
    ("resnet_batchnorm", "sdp_oss", "sgd"),
    ("resnet_batchnorm", "fsdp_checkpoint", "sgd"),
    ("tied_transformer", "ddp_oss", "sgd"),
    ("tied_transformer", "zero3", "sgd"),
]


def _zoo(cases):
    return {f"{m}/{w}/{o}": _train_beside_reference(m, w, o) for m, w, o in cases}


def test_model_zoo_world2(world2):
    for rank, results in enumerate(world2.run(_zoo, ZOO_WORLD2)):
        assert results == {k: [] for k in results}, f"rank {rank}: {results}"


def test_model_zoo_world4(world4):
    for rank, results in enumerate(world4.run(_zoo, ZOO_WORLD4)):
        assert results == {k: [] for k in results}, f"rank {rank}: {results}"


def _transposed_parameter_layout():
    """OSS keeps a transposed parameter's strides (DDP's gradient buckets were laid out for
    them): the parameter's stride after wrapping, and its largest difference from the
    single-process model after one step."""
    torch.manual_seed(0)
    model = TemperatureProjection()
    torch.manual_seed(0)
    reference = TemperatureProjection()
    from shardkit.optim import OSS
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    world, rank = distributed.get_world_size(), distributed.get_rank()
    x, y = _features_batch(0)
    n = GLOBAL_BATCH // world
    _cross_entropy(ddp(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
    opt.step()
    for r in range(world):
        (_cross_entropy(reference(x[r * n:(r + 1) * n]), y[r * n:(r + 1) * n]) / world).backward()
    ref_opt.step()
    return tuple(model.proj.stride()), (model.proj - reference.proj).abs().max().item()


def test_oss_keeps_transposed_parameter_layout(world2):
    for stride, diff in world2.run(_transposed_parameter_layout):
        assert stride == (1, D)
        assert diff < 1e-6
