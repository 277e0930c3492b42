"""FullyShardedDataParallel on a model built on the meta device (deferred initialisation).

Each unit materializes its own modules as it is wrapped (``reset_parameters()`` or
``param_init_fn``), innermost first, then shards them. Checked here, in one world of 2 gloo
ranks (and the default path's parity at 4): training parity against one process started from
the wrapped model's full state dict (every rank, every step); identical weights on every rank
(also from rank-dependent seeds with ``sync_module_states``); the bytes of materialized
parameter storage while units are built; ties, buffers and a root's own parameters; the stage-3
engine from a meta model and the refusal of stages 0-2; bad input, on every rank before any
collective.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed as skdist
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel.fully_sharded import unit_holding
from shardkit.nn.wrap import auto_wrap, transformer_auto_wrap_policy
from shardkit.recipes import adamw, compose
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff

VOCAB, D, BLOCKS, SEQ = 11, 8, 3, 5
LOCAL_BATCH, STEPS, LR = 2, 3, 1e-2
TOL = 1e-5

world2 = world_fixture(2)
world4 = world_fixture(4)

# what Scale.reset_parameters reports to (the memory test sets it on the ranks)
_RECORDER = []


class Scale(nn.Module):
    """A gain (parameter) and a persistent shift (buffer), both set by reset_parameters."""

    def __init__(self, d: int):
        super().__init__()
        self.gain = nn.Parameter(torch.empty(d))
        self.register_buffer("shift", torch.empty(d))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.gain.fill_(1.5)
            self.shift.copy_(torch.arange(self.shift.numel(), dtype=self.shift.dtype,
                                          device=self.shift.device) / 10)
        for record in _RECORDER:
            record(self)

    def forward(self, x):
        return x * self.gain + self.shift


class Masked(nn.Module):
    """A buffer and no reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ones", torch.ones(D))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.scale = Scale(D)

    def forward(self, x):
        return x + self.scale(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class Net(nn.Module):
    """Tied embedding and head, a buffer in every block, a parameter of the root's own."""

    def __init__(self, blocks: int = BLOCKS, root_reset: bool = True):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.blocks = nn.Sequential(*[Block() for _ in range(blocks)])
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        self.temp = nn.Parameter(torch.empty(1))
        if root_reset:
            self.reset_parameters = self._reset_own
            self.reset_parameters()

    def _reset_own(self) -> None:
        with torch.no_grad():
            self.temp.fill_(0.5)

    def forward(self, idx):
        return self.head(self.ln_f(self.blocks(self.tok(idx)))) * self.temp


def _meta_net(seed: int = 0, **kwargs) -> Net:
    torch.manual_seed(seed)
    with torch.device("meta"):
        return Net(**kwargs)


def _wrap(model: nn.Module, **kwargs) -> FSDP:
    inner = auto_wrap(model, transformer_auto_wrap_policy({Block}), **kwargs)
    return FSDP(inner, **kwargs)


def _materialize_like_torch(module: nn.Module) -> None:
    """A param_init_fn as torch's docs show it: to_empty (new tensors), then the module's own
    initialiser."""
    module.to_empty(device="cpu", recurse=False)
    module.reset_parameters()


def _batch(step: int, world: int):
    gen = torch.Generator().manual_seed(50 + step)
    idx = torch.randint(0, VOCAB, (LOCAL_BATCH * world, SEQ), generator=gen)
    target = torch.randint(0, VOCAB, (LOCAL_BATCH * world, SEQ), generator=gen)
    return idx, target


def _loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _mine(t: torch.Tensor) -> torch.Tensor:
    rank = skdist.get_rank()
    return t[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]


def _same_on_every_rank(state: dict) -> float:
    """Largest difference between this rank's full state and rank 0's."""
    return max_diff(state, skdist.broadcast_object(state, src=0))


def _oracle(state: dict):
    oracle = Net()
    oracle.load_state_dict(state)
    return oracle


def _oracle_step(oracle, ref_opt, step: int, world: int) -> tuple:
    """One step of the one-process model on the whole batch; this rank's part of the batch."""
    idx, target = _batch(step, world)
    _loss(oracle(idx), target).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return _mine(idx), _mine(target)


# ---------------------------------------------------------------------- rank bodies: parity


def _parity(variant: str) -> dict:
    rank, world = skdist.get_rank(), skdist.get_world_size()
    kwargs = {}
    seed = 0
    if variant == "param_init_fn":
        kwargs["param_init_fn"] = _materialize_like_torch
    if variant == "sync_rank_seeds":
        kwargs["sync_module_states"] = True
        seed = 100 + rank
    meta = _meta_net(seed)
    built_before = torch.optim.AdamW(meta.parameters(), lr=LR)  # over the meta parameters
    model = _wrap(meta, **kwargs)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())
    root = model.module
    assert root.head.weight is root.tok.weight, "the tie did not survive materialization"
    state = model.state_dict()
    assert torch.equal(state["head.weight"], state["tok.weight"])
    # reset_parameters() ran on every module: the values a fresh eager module would get
    assert torch.equal(state["blocks.1.scale.shift"], torch.arange(D) / 10)
    assert torch.equal(state["blocks.2.scale.gain"], torch.full((D,), 1.5))
    assert torch.equal(state["temp"], torch.tensor([0.5]))
    assert torch.equal(state["blocks.0.ln.weight"], torch.ones(D))
    initial_spread = _same_on_every_rank(state)
    oracle = _oracle(state)
    ref_opt = torch.optim.AdamW(oracle.parameters(), lr=LR)
    opt = built_before if variant == "param_init_fn" else torch.optim.AdamW(
        model.parameters(), lr=LR)
    worst = 0.0
    for step in range(STEPS):
        idx, target = _oracle_step(oracle, ref_opt, step, world)
        _loss(model(idx), target).backward()
        opt.step()
        opt.zero_grad()
        worst = max(worst, max_diff(model.state_dict(), oracle.state_dict()))
    return {"initial_spread": initial_spread, "worst": worst,
            "changed": max_diff(model.state_dict(), state)}


# ---------------------------------------------------------------------- rank bodies: memory


def _storage_bytes(tensors) -> int:
    storages = {}
    for t in tensors:
        if not t.is_meta:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _own_bytes(module: nn.Module) -> int:
    """Bytes of the parameters a unit around ``module`` owns (4 bytes each, a tie once)."""
    seen = {}
    for m in module.modules():
        if isinstance(m, Block) and m is not module:
            continue
        for p in m.parameters(recurse=False):
            seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


def _memory(use_init_fn: bool) -> dict:
    world = skdist.get_world_size()
    meta = _meta_net(blocks=4)
    units = [b for b in meta.blocks] + [meta]
    largest = max(_own_bytes(u) for u in units)
    total = sum(p.numel() * p.element_size() for p in meta.parameters())
    samples = []

    def record(module):
        params = list(meta.parameters())  # the inner units' shards once they are wrapped
        shards = [p for p in params if unit_holding(p) is not None]
        samples.append((_storage_bytes(params), _storage_bytes(shards)))

    kwargs = {}
    if use_init_fn:
        def init_fn(module):
            _materialize_like_torch(module)
            record(module)
        kwargs["param_init_fn"] = init_fn
    else:
        _RECORDER.append(record)  # Scale.reset_parameters reports each block's point
    try:
        model = _wrap(meta, **kwargs)
    finally:
        _RECORDER.clear()
    final = _storage_bytes(model.parameters())
    return {"samples": samples, "largest": largest, "total": total, "final": final,
            "world": world}


# ---------------------------------------------------------------------- rank bodies: engine


def _engine_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": LOCAL_BATCH, "gradient_accumulation_steps": 1,
            "steps_per_print": 1000,
            "optimizer": {"type": "AdamW",
                          "params": {"lr": LR, "eps": 1e-6, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}}


def _engine_stage3(user_optimizer: bool) -> dict:
    rank, world = skdist.get_rank(), skdist.get_world_size()
    meta = _meta_net(seed=7 + rank)  # rank 0's values must reach every rank
    config = _engine_config(3)
    optimizer = None
    if user_optimizer:  # built over the meta parameters: it steps the shards
        config.pop("optimizer")
        optimizer = torch.optim.AdamW(meta.parameters(), lr=LR, eps=1e-6, weight_decay=0.01)
    engine, _, _, _ = shardkit.initialize(model=meta, optimizer=optimizer, config=config)
    state = engine.wrapped.state_dict()
    spread = _same_on_every_rank(state)
    oracle = _oracle(state)
    ref_opt = torch.optim.AdamW(oracle.parameters(), lr=LR, eps=1e-6, weight_decay=0.01)
    worst = 0.0
    for step in range(STEPS):
        idx, target = _oracle_step(oracle, ref_opt, step, world)
        engine.backward(_loss(engine(idx), target))
        engine.step()
        worst = max(worst, max_diff(engine.wrapped.state_dict(), oracle.state_dict()))
    return {"spread": spread, "worst": worst}


def _engine_refuses_low_stages() -> list:
    messages = []
    for stage in (0, 1, 2):
        with pytest.raises(ValueError, match="meta device") as caught:
            shardkit.initialize(model=_meta_net(), config=_engine_config(stage))
        messages.append(str(caught.value))
    with pytest.raises(ValueError, match=r"compose\(stage=1\)"):
        compose(_meta_net(), 1, adamw(lr=LR))
    with pytest.raises(ValueError, match="forward"):  # a forward-only stage 2 too
        try:
            compose(_meta_net(), 2, None)
        except ValueError as error:
            raise ValueError(f"forward: {error}") from None
    skdist.barrier()  # every rank got here: no rank waits in a collective
    return messages


# ---------------------------------------------------------------------- rank bodies: bad input


def _bad_input() -> dict:
    found = {}
    with pytest.raises(ValueError, match=r"param_init_fn=3\): must be a callable"):
        FSDP(_meta_net(), param_init_fn=3)
    with pytest.raises(ValueError, match=r"param_init_fn='init'\)"):
        auto_wrap(_meta_net(), transformer_auto_wrap_policy({Block}), param_init_fn="init")

    # a param_init_fn that leaves meta tensors: named, parameter or buffer
    with pytest.raises(ValueError, match=r"'ln' \(LayerNorm\) in the wrapped Block still holds "
                                         r"parameter 'weight', parameter 'bias'") as caught:
        _wrap(_meta_net(), param_init_fn=lambda m: None)
    found["leaves_meta"] = str(caught.value)

    def params_only(module):
        for name, p in module.named_parameters(recurse=False):
            setattr(module, name, nn.Parameter(torch.zeros_like(p, device="cpu")))
    with pytest.raises(ValueError, match=r"'scale' \(Scale\) in the wrapped Block still holds "
                                         r"buffer 'shift'"):
        _wrap(_meta_net(), param_init_fn=params_only)

    # a module (here the root itself) with meta parameters and no reset_parameters()
    with pytest.raises(ValueError, match=r"the wrapped Net holds parameter 'temp' on the meta "
                                         r"device and has no reset_parameters\(\)") as caught:
        _wrap(_meta_net(root_reset=False))
    found["no_reset"] = str(caught.value)

    # a buffer-only module without reset_parameters(): named before anything is materialized
    meta = _meta_net()
    with torch.device("meta"):
        meta.blocks[0].mask = Masked()
    with pytest.raises(ValueError, match=r"'mask' \(Masked\) in the wrapped Block holds buffer "
                                         r"'ones' on the meta device and has no reset"):
        _wrap(meta)
    assert meta.blocks[0].fc1.weight.is_meta and meta.blocks[0].scale.shift.is_meta

    # a tie across two units stays a tie, so it is refused as in an eager model (torch's
    # to_empty would have untied it silently)
    meta = _meta_net()
    meta.tok = FSDP(meta.tok)
    with pytest.raises(ValueError, match="already sharded by another"):
        FSDP(meta)

    # FSDP2's flow after wrapping: refused, the shards untouched
    model = _wrap(_meta_net())
    before = model.state_dict()
    with pytest.raises(RuntimeError, match="to_empty.*pass the meta module.*param_init_fn"):
        model.to_empty(device="cpu")
    holder = nn.Sequential(FSDP(_meta_net()))  # a plain module around a unit
    with pytest.raises(RuntimeError, match="to_empty"):
        holder.to_empty(device="cpu")
    assert max_diff(model.state_dict(), before) == 0.0

    # a partly materialized model: only the modules on meta are initialised
    meta = _meta_net()
    torch.manual_seed(5)
    real = Block()
    with torch.no_grad():
        real.scale.gain.fill_(-2.0)
        real.fc1.weight.fill_(0.25)
    meta.blocks[1] = real
    state = _wrap(meta).state_dict()
    assert torch.equal(state["blocks.1.scale.gain"], torch.full((D,), -2.0))
    assert torch.equal(state["blocks.1.fc1.weight"], torch.full((2 * D, D), 0.25))
    assert torch.equal(state["blocks.0.scale.gain"], torch.full((D,), 1.5))

    skdist.barrier()  # every rank raised locally and is still in step
    return found


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("variant", ["reset_parameters", "param_init_fn", "sync_rank_seeds"])
def test_meta_model_trains_like_one_process(world2, variant):
    for result in world2.run(_parity, variant):
        assert result["initial_spread"] == 0.0
        assert result["worst"] < TOL
        assert result["changed"] > 1e-3  # it trained


def test_meta_model_trains_like_one_process_at_world4(world4):
    for result in world4.run(_parity, "reset_parameters"):
        assert result["initial_spread"] == 0.0 and result["worst"] < TOL


@pytest.mark.parametrize("use_init_fn", [True, False], ids=["param_init_fn", "reset_parameters"])
def test_construction_holds_one_unit_beside_the_shards(world2, use_init_fn):
    for result in world2.run(_memory, use_init_fn):
        samples = result["samples"]
        # a point per unit: 4 blocks and the root (param_init_fn), or the Scale of each block
        assert len(samples) >= (5 if use_init_fn else 4)
        slack = 4 * result["world"] * 5  # padding: under N elements per unit
        for materialized, shards in samples:
            assert shards <= result["total"] / result["world"] + slack
            assert materialized - shards <= result["largest"], samples
        assert result["final"] <= result["total"] / result["world"] + slack


@pytest.mark.parametrize("user_optimizer", [False, True], ids=["config", "user_optimizer"])
def test_engine_stage3_from_a_meta_model(world2, user_optimizer):
    for result in world2.run(_engine_stage3, user_optimizer):
        assert result["spread"] == 0.0
        assert result["worst"] < TOL


def test_engine_refuses_a_meta_model_at_stages_0_to_2(world2):
    for messages in world2.run(_engine_refuses_low_stages):
        for stage, message in enumerate(messages):
            assert f"zero_optimization.stage={stage}" in message
            assert "parameter 'tok.weight'" in message and "stage 3" in message


def test_bad_input_is_named(world2):
    for found in world2.run(_bad_input):
        assert "param_init_fn=<callable" in found["no_reset"]
        assert "to_empty" in found["leaves_meta"]
