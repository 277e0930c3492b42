"""nanoGPT's train.py patterns under shardkit's wrappers (one world of 2 gloo ranks).

A user who swaps nanoGPT's ``DDP(model)`` for ``ShardedDataParallel`` + ``OSS``, ``OSS`` under torch
DDP or ``FullyShardedDataParallel`` keeps its habits: accumulation through
``model.require_backward_grad_sync``, ``OSS(raw_model.configure_optimizers(...))``, a GradScaler
with ``unscale_`` then clipping, master-only checkpoints, ``model.module`` / ``raw_model``,
``torch.compile`` and ``generate``. Each check trains beside a one-process oracle on the same
global batch (each rank takes its rows) and compares step by step, or expects a clear error.
The GPT below is written the way nanoGPT's model.py is (tied wte/lm_head, SDPA causal
attention, learned positions, decay/no-decay groups by ``dim``).
"""

import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit import distributed
from shardkit.comm_counter import CommCounter
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import world_fixture

VOCAB, BLOCK, LAYERS, HEADS, EMBD = 32, 16, 2, 2, 16
PER_RANK = 2
ACCUM = 3
TOL = 1e-5
KINDS = ("sharded_ddp", "oss_ddp", "fsdp", "fsdp_blocks")

world2 = world_fixture(2)


# ---------------------------------------------------------------------- a nanoGPT-style model


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        # no bias on the key projection's input side: a key bias has an exactly zero gradient,
        # whose rounding noise AdamW would turn into lr-sized steps (nanoGPT's bias=False)
        self.c_attn = nn.Linear(EMBD, 3 * EMBD, bias=False)
        self.c_proj = nn.Linear(EMBD, EMBD)

    def forward(self, x):
        b, t, c = x.shape
        heads = [z.view(b, t, HEADS, c // HEADS).transpose(1, 2)
                 for z in self.c_attn(x).split(c, dim=2)]
        y = F.scaled_dot_product_attention(*heads, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(EMBD)
        self.c_fc = nn.Linear(EMBD, 4 * EMBD)
        self.c_proj = nn.Linear(4 * EMBD, EMBD)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.block_size = BLOCK
        self.wte = nn.Embedding(VOCAB, EMBD)
        self.wpe = nn.Embedding(BLOCK, EMBD)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(EMBD)
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def get_num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None):
        t = idx.size(1)
        if t > self.block_size:
            raise ValueError(f"GPT: sequence of length {t} > block_size {self.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    def crop_block_size(self, block_size: int) -> None:
        self.block_size = block_size
        self.wpe.weight = nn.Parameter(self.wpe.weight[:block_size])

    def configure_optimizers(self, weight_decay=0.1, lr=1e-2, betas=(0.9, 0.95),
                             device_type="cpu", fused=None, foreach=None):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        if fused is None:  # nanoGPT: fused where torch has it and the device is CUDA
            fused = "fused" in inspect.signature(torch.optim.AdamW).parameters \
                and device_type == "cuda"
        extra = {"fused": True} if fused else {}
        if foreach is not None:
            extra["foreach"] = foreach
        return torch.optim.AdamW(groups, lr=lr, betas=betas, **extra)

    def estimate_mfu(self, fwdbwd_per_iter: int, dt: float) -> float:
        flops_per_token = 6 * self.get_num_params() + 12 * LAYERS * EMBD * BLOCK
        return flops_per_token * BLOCK * fwdbwd_per_iter / dt / 312e12

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int):
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.block_size:])
            idx = torch.cat((idx, logits[:, -1, :].argmax(-1, keepdim=True)), dim=1)
        return idx


# ---------------------------------------------------------------------- rank-side helpers


def _batch(step: int, micro: int, seq: int = BLOCK):
    """The global batch of one micro-step, and this rank's rows of it."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    data = torch.randint(0, VOCAB, (PER_RANK * world, seq + 1),
                         generator=torch.Generator().manual_seed(1000 * step + micro))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return (x, y), (x[rows], y[rows])


def _wrap(kind: str, raw: GPT, **opt_kw):
    """nanoGPT's order: the optimizer from the raw model first, then the wrapper."""
    optimizer = raw.configure_optimizers(**opt_kw)
    if kind == "sharded_ddp":
        optimizer = OSS(optimizer)
        return ShardedDataParallel(raw, optimizer), optimizer
    if kind == "oss_ddp":
        optimizer = OSS(optimizer)
        return DDP(raw), optimizer
    if kind == "fsdp_blocks":  # one unit per transformer block inside the root
        for i, block in enumerate(raw.h):
            raw.h[i] = FSDP(block)
    return FSDP(raw), optimizer


def _full_state(kind: str, model) -> dict:
    sd = model.state_dict() if kind.startswith("fsdp") else model.module.state_dict()
    return {k: v.detach().clone() for k, v in sd.items()}


def _diff(oracle: GPT, state: dict) -> float:
    return max((v - state[k]).abs().max().item() for k, v in oracle.state_dict().items())


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts the type and the words
        return f"{type(e).__name__}: {e}"
    return "no error"


def _accumulate(kind: str, how: str, steps: int = 2):
    """nanoGPT's accumulation loop; ``how``: "flag" (``require_backward_grad_sync``),
    "no_sync", or "every" (reduce at every micro-step). Returns the worst parameter
    difference against one process and the bytes counted per step."""
    oracle = GPT()
    ref_opt = oracle.configure_optimizers()
    model, optimizer = _wrap(kind, GPT())
    worst, sent = 0.0, []
    for step in range(steps):
        with CommCounter() as counter:
            for micro in range(ACCUM):
                (x, y), (lx, ly) = _batch(step, micro)
                (oracle(x, y)[1] / ACCUM).backward()
                last = micro == ACCUM - 1
                if how == "flag":
                    model.require_backward_grad_sync = last
                if how == "no_sync" and not last:
                    with model.no_sync():
                        (model(lx, ly)[1] / ACCUM).backward()
                else:
                    (model(lx, ly)[1] / ACCUM).backward()
        sent.append(counter.bytes)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        worst = max(worst, _diff(oracle, _full_state(kind, model)))
    return worst, sent, model.require_backward_grad_sync if how == "flag" else None


def _bad_flag(kind: str):
    model, _ = _wrap(kind, GPT())
    errors = [_error(lambda: setattr(model, "require_backward_grad_sync", 1))]
    if kind == "fsdp":
        inner = GPT()
        inner.h[0] = FSDP(inner.h[0])
        root = FSDP(inner)
        root(_batch(0, 0)[1][0])  # the first forward settles which unit is the root
        errors.append(_error(lambda: setattr(inner.h[0], "require_backward_grad_sync", False)))
    return errors


def _takeover(kind: str, opt_kw: dict, steps: int = 3):
    """``OSS(raw_model.configure_optimizers(fused=/foreach=))`` and FSDP wrapping after the
    optimizer was built: parity with the same torch optimizer in one process."""
    oracle = GPT()
    ref_opt = oracle.configure_optimizers(**opt_kw)
    model, optimizer = _wrap(kind, GPT(), **opt_kw)
    decays = [g["weight_decay"] for g in optimizer.param_groups]
    worst = 0.0
    for step in range(steps):
        (x, y), (lx, ly) = _batch(step, 0)
        oracle(x, y)[1].backward()
        model(lx, ly)[1].backward()
        for opt in (ref_opt, optimizer):
            opt.step()
            opt.zero_grad(set_to_none=True)
        worst = max(worst, _diff(oracle, _full_state(kind, model)))
    return worst, decays


def _scaled_clipped(kind: str, steps: int = 3, clip: float = 0.05):
    """nanoGPT's ``scaler.scale(loss).backward(); scaler.unscale_(optimizer); clip;
    scaler.step(optimizer); scaler.update()`` (a real scale, fp32 weights), clipping with the
    wrapper's global-norm method (torch's own function under OSS + torch DDP, where every rank
    holds every gradient). Returns the worst parameter and norm differences."""
    oracle = GPT()
    ref_opt = oracle.configure_optimizers()
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    model, optimizer = _wrap(kind, GPT())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    worst, worst_norm = 0.0, 0.0
    for step in range(steps):
        (x, y), (lx, ly) = _batch(step, 0)
        ref_scaler.scale(oracle(x, y)[1]).backward()
        ref_scaler.unscale_(ref_opt)
        ref_norm = torch.nn.utils.clip_grad_norm_(oracle.parameters(), clip)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad(set_to_none=True)

        scaler.scale(model(lx, ly)[1]).backward()
        scaler.unscale_(optimizer)
        if kind.startswith("fsdp"):
            norm = model.clip_grad_norm_(clip)
        elif kind == "sharded_ddp":
            norm = optimizer.clip_grad_norm(clip)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        worst_norm = max(worst_norm, abs(float(norm) - float(ref_norm)))
        worst = max(worst, _diff(oracle, _full_state(kind, model)))
    return worst, worst_norm


def _checkpoint_resume(kind: str):
    """Train 2 steps, checkpoint the way each wrapper allows nanoGPT's master-only save, resume
    nanoGPT's way (raw model, ``configure_optimizers``, load, wrap), train one step: it must
    equal the uninterrupted run. Also the errors a verbatim nanoGPT save meets."""
    rank = distributed.get_rank()
    model, optimizer = _wrap(kind, GPT())
    raw_model = model.module
    errors = []
    for step in range(2):
        (_, _), (lx, ly) = _batch(step, 0)
        model(lx, ly)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if kind.startswith("fsdp"):
        errors.append(_error(raw_model.state_dict))  # nanoGPT's raw_model.state_dict()
        model_sd = model.state_dict()  # every rank: a collective
        full_opt = model.gather_full_optim_state_dict(optimizer)
    else:
        errors.append(_error(optimizer.state_dict))  # nanoGPT's call, before consolidating
        model_sd = raw_model.state_dict()  # local: every rank holds the synced weights
        optimizer.consolidate_state_dict(0)
        full_opt = optimizer.state_dict() if rank == 0 else None
    box = [full_opt]  # what every rank would read back from rank 0's file
    torch.distributed.broadcast_object_list(box, src=0)
    full_opt = box[0]

    resumed_raw = GPT(seed=7)
    resumed_raw.load_state_dict(model_sd)
    resumed_opt = resumed_raw.configure_optimizers()
    if kind.startswith("fsdp"):
        # the full state is cut to this rank's rows once wrapped
        resumed, _ = _wrap(kind, resumed_raw)
        resumed_opt.load_state_dict(resumed.get_shard_from_optim_state_dict(full_opt))
    else:
        resumed_opt.load_state_dict(full_opt)  # nanoGPT: into the torch optimizer, then wrap
        resumed_opt = OSS(resumed_opt)
        resumed = ShardedDataParallel(resumed_raw, resumed_opt) if kind == "sharded_ddp" \
            else DDP(resumed_raw)
    (_, _), (lx, ly) = _batch(2, 0)
    for m, opt in ((model, optimizer), (resumed, resumed_opt)):
        m(lx, ly)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    a, b = _full_state(kind, model), _full_state(kind, resumed)
    return max((a[k] - b[k]).abs().max().item() for k in a), errors


def _raw_model_and_generate(kind: str):
    """``raw_model = model.module``, ``crop_block_size`` before wrapping, parameter counting
    and ``generate`` after a step, against one process."""
    oracle = GPT()
    oracle.crop_block_size(12)
    ref_opt = oracle.configure_optimizers()
    raw = GPT()
    raw.crop_block_size(12)
    model, optimizer = _wrap(kind, raw)
    (x, y), (lx, ly) = _batch(0, 0, seq=12)
    oracle(x, y)[1].backward()
    ref_opt.step()
    model(lx, ly)[1].backward()
    optimizer.step()
    raw_model = model.module
    if kind.startswith("fsdp"):
        # the module's parameters are this rank's shards: count inside summon_full_params
        with model.summon_full_params():
            counted = raw_model.get_num_params()
    else:
        counted = raw_model.get_num_params()
    prompt = torch.zeros(1, 1, dtype=torch.long)
    return {"raw_is_gpt": raw_model is raw, "count": counted, "ref_count":
            oracle.get_num_params(), "diff": _diff(oracle, _full_state(kind, model)),
            "generated": model.module.generate(prompt, 14).tolist() if kind == "oss_ddp"
            else model.generate(prompt, 14).tolist(),
            "ref_generated": oracle.generate(prompt, 14).tolist()}


def _compiled_step(kind: str):
    """``torch.compile`` over the wrapper: one step equals one process."""
    oracle = GPT()
    ref_opt = oracle.configure_optimizers()
    model, optimizer = _wrap(kind, GPT())
    compiled = torch.compile(model, backend="aot_eager")
    (x, y), (lx, ly) = _batch(0, 0)
    oracle(x, y)[1].backward()
    ref_opt.step()
    compiled(lx, ly)[1].backward()
    optimizer.step()
    return _diff(oracle, _full_state(kind, model))


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("kind", ["sharded_ddp", "fsdp", "fsdp_blocks"])
def test_require_backward_grad_sync_accumulates_like_no_sync(world2, kind):
    """nanoGPT's ``model.require_backward_grad_sync = (micro_step == last)`` trains like one
    process and moves exactly the bytes of ``no_sync()``: one gradient reduction per window
    instead of one per micro-step (with a single unit, about a third of the bytes here; inner
    FSDP units still gather their weights at each micro-step); the flag stays what the script
    last set, as on torch DDP."""
    flag = world2.run(_accumulate, kind, "flag")
    with_no_sync = world2.run(_accumulate, kind, "no_sync")
    every = world2.run(_accumulate, kind, "every")
    saved = 0.75 if kind == "fsdp_blocks" else 0.5
    for (diff, sent, last_flag), (_, sent_no_sync, _), (_, sent_every, _) in zip(
            flag, with_no_sync, every):
        assert diff < TOL
        assert sent == sent_no_sync
        assert all(s < saved * e for s, e in zip(sent, sent_every))
        assert last_flag is True


def test_require_backward_grad_sync_under_torch_ddp_with_oss(world2):
    for diff, _, _ in world2.run(_accumulate, "oss_ddp", "flag"):
        assert diff < TOL


@pytest.mark.parametrize("kind", ["sharded_ddp", "fsdp"])
def test_require_backward_grad_sync_bad_values(world2, kind):
    for errors in world2.run(_bad_flag, kind):
        assert errors[0].startswith("TypeError") and "require_backward_grad_sync = 1" in \
            errors[0] and "True or False" in errors[0]
        if kind.startswith("fsdp"):
            assert errors[1].startswith("RuntimeError") and "inner" in errors[1] \
                and "root" in errors[1]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("opt_kw", [{}, {"fused": True}, {"foreach": True}],
                         ids=["default", "fused", "foreach"])
def test_optimizer_from_raw_model_then_wrapped(world2, kind, opt_kw):
    for diff, decays in world2.run(_takeover, kind, opt_kw):
        assert diff < TOL
        assert decays == [0.1, 0.0]


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaler_unscale_then_global_clip(world2, kind):
    for diff, norm_diff in world2.run(_scaled_clipped, kind):
        assert diff < TOL
        assert norm_diff < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_master_only_checkpoint_and_resume(world2, kind):
    for diff, errors in world2.run(_checkpoint_resume, kind):
        assert diff < TOL
        if kind.startswith("fsdp"):
            assert errors[0].startswith("RuntimeError") and "FullyShardedDataParallel" in \
                errors[0] and "state_dict() on the FSDP wrapper" in errors[0]
        else:
            assert errors[0].startswith("RuntimeError") and "consolidate_state_dict" in errors[0]


@pytest.mark.parametrize("kind", KINDS)
def test_raw_model_crop_count_and_generate(world2, kind):
    for result in world2.run(_raw_model_and_generate, kind):
        assert result["raw_is_gpt"]
        assert result["count"] == result["ref_count"]
        assert result["diff"] < TOL
        assert result["generated"] == result["ref_generated"]


@pytest.mark.parametrize("kind", KINDS)
def test_torch_compile_over_the_wrapper(world2, kind):
    for diff in world2.run(_compiled_step, kind):
        assert diff < TOL
