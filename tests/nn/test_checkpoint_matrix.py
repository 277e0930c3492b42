"""checkpoint_wrapper under every wrapper, against the same training without checkpointing.

Each case trains two steps with and without checkpointed blocks and compares, on every rank
and step: loss, gradients, weights, buffers (BatchNorm statistics), the default RNG state after
the step, and the bytes autograd saves (lower with checkpointing). The blocks take tensor,
None, int, bool and dict arguments, a tensor keyword argument, return a dict holding tensors
without grad, run dropout and BatchNorm, and one block is called twice per forward. Without
dropout and BatchNorm the result is also compared with one process training on the global
batch. The model is switched to eval() between forward and backward, as an evaluation callback
would, in every case.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.nn.checkpoint import checkpoint_wrapper
from shardkit.testing import world_fixture
from tests.utils.saved_tensors import saved_bytes

world2 = world_fixture(2)
world4 = world_fixture(4)

WIDTH = 8


class Block(nn.Module):
    """An MLP block with the arguments and outputs users give checkpointed blocks."""

    def __init__(self, dropout: float, batchnorm: bool):
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.norm = nn.BatchNorm1d(2 * WIDTH) if batchnorm else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x, extra=None, *, mask, scale=1.0, squash=True, options=None, repeat=1):
        h = self.fc2(self.drop(F.gelu(self.norm(self.fc1(x)))))
        h = h * mask * scale * options["gain"]
        if extra is not None:
            h = h + extra
        if squash:
            h = torch.tanh(h)
        for _ in range(repeat - 1):
            h = h + 0.5 * x
        return {"h": h, "positive": (h.detach() > 0).sum(), "rows": torch.arange(len(h))}


class Net(nn.Module):
    def __init__(self, dropout: float = 0.0, batchnorm: bool = False, blocks: int = 3):
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block(dropout, batchnorm) for _ in range(blocks))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x):
        h = self.embed(x)
        mask = (torch.arange(WIDTH) % 3 != 0).float()
        calls = [0, 0] + list(range(1, len(self.blocks)))  # block 0 is shared: called twice
        for i, b in enumerate(calls):
            out = self.blocks[b](h, None if i % 2 else h.detach() * 0.1, mask=mask,
                                 scale=0.5 + i, squash=i % 2 == 0, options={"gain": 1.5},
                                 repeat=2)
            h = out["h"] + 0.5 * torch.tanh(out["h"])  # an output used twice
        return self.head(h)


def _global_batch(step: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4 * world, WIDTH, generator=g), torch.randn(4 * world, 2, generator=g)


def _local_batch(step: int):
    x, y = _global_batch(step, dist.get_world_size())
    n, rank = len(x) // dist.get_world_size(), dist.get_rank()
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _checkpoint_blocks(blocks, every: int) -> None:
    for i, b in enumerate(blocks):
        if i % every == 0:
            checkpoint_wrapper(b)


def _wrap(net: Net, wrapper: str, checkpointed: bool):
    """``net`` wrapped as ``wrapper`` says (blocks checkpointed when ``checkpointed``), and its
    optimizer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shardkit.nn import FullyShardedDataParallel as FSDP
    from shardkit.nn import ShardedDataParallel
    from shardkit.optim import OSS

    sgd = dict(lr=0.1, momentum=0.9)
    if wrapper.startswith("fsdp"):
        settings = {"fsdp reshard": dict(reshard_after_forward=True),
                    "fsdp no reshard, unit inside checkpoint": dict(reshard_after_forward=False),
                    "fsdp mixed precision": dict(mixed_precision=True)}[wrapper]
        if checkpointed and "unit inside" not in wrapper:
            _checkpoint_blocks(net.blocks, every=1)
        for i, block in enumerate(net.blocks):
            net.blocks[i] = FSDP(block, **settings)
        if checkpointed and "unit inside" in wrapper:
            _checkpoint_blocks(net.blocks, every=2)
        model = FSDP(net, **settings)
        return model, torch.optim.SGD(model.parameters(), **sgd)
    if checkpointed:
        _checkpoint_blocks(net.blocks, every=1 if wrapper != "ddp" else 2)
    if wrapper == "sharded ddp":
        optimizer = OSS(net.parameters(), optim=torch.optim.SGD, **sgd)
        return ShardedDataParallel(net, optimizer), optimizer
    model = DDP(net, find_unused_parameters=wrapper == "ddp find_unused",
                static_graph=wrapper == "ddp static_graph")
    if wrapper == "oss + ddp":
        return model, OSS(model.parameters(), optim=torch.optim.SGD, **sgd)
    return model, torch.optim.SGD(model.parameters(), **sgd)


def _full_state(model, wrapper: str) -> dict:
    if wrapper.startswith("fsdp"):
        with model.summon_full_params():
            state = model.state_dict()
    else:
        state = model.state_dict()
    return {k.replace("module.", ""): v.detach().float().clone() for k, v in state.items()}


def _train(case: dict, checkpointed: bool, steps: int = 2) -> list:
    torch.manual_seed(0)
    net = Net(case["dropout"], case["batchnorm"])
    model, optimizer = _wrap(net, case["wrapper"], checkpointed)
    torch.manual_seed(7)
    record = []
    for step in range(steps):
        x, y = _local_batch(step)
        optimizer.zero_grad()
        saved, out = saved_bytes(lambda: model(x))
        loss = F.mse_loss(out.float(), y)
        model.eval()  # an evaluation callback between forward and backward
        loss.backward()
        model.train()
        grads = [p.grad.float().clone() for p in model.parameters() if p.grad is not None]
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        record.append(dict(loss=mean_loss.item() / dist.get_world_size(), grads=grads,
                           saved=saved, rng=torch.get_rng_state()))
    record.append(_full_state(model, case["wrapper"]))
    return record


def _global_reference(steps: int = 2) -> tuple[list, dict]:
    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = _global_batch(step, dist.get_world_size())
        optimizer.zero_grad()
        loss = F.mse_loss(net(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs() / (1 + b.abs())).max().item()


def _mismatches(case: dict) -> list:
    """What differs between training ``case`` with and without checkpointed blocks (and, for a
    model without dropout and BatchNorm, one process on the global batch)."""
    plain, ckpt = _train(case, False), _train(case, True)
    problems = []
    for step, (a, b) in enumerate(zip(plain[:-1], ckpt[:-1])):
        if abs(a["loss"] - b["loss"]) > 1e-5 * (1 + abs(a["loss"])):
            problems.append(f"step {step}: loss {b['loss']} vs {a['loss']}")
        if len(a["grads"]) != len(b["grads"]) or \
                max(_relative(g, r) for g, r in zip(b["grads"], a["grads"])) > 1e-5:
            problems.append(f"step {step}: gradients differ")
        if not torch.equal(a["rng"], b["rng"]):
            problems.append(f"step {step}: the RNG state after the step differs")
        if b["saved"] >= a["saved"]:
            problems.append(f"step {step}: saved {b['saved']} bytes, {a['saved']} without")
    state, reference = ckpt[-1], plain[-1]
    if max(_relative(state[k], reference[k]) for k in reference) > 1e-5:
        problems.append("weights or buffers differ")
    if not case["dropout"] and not case["batchnorm"] and case["wrapper"] != "fsdp mixed precision":
        losses, single = _global_reference()
        if any(abs(a["loss"] - l) > 1e-4 * (1 + abs(l)) for a, l in zip(ckpt, losses)) or \
                max(_relative(state[k], v) for k, v in single.items()) > 1e-4:
            problems.append("differs from one process on the global batch")
    return problems


WRAPPERS = ["ddp", "ddp find_unused", "ddp static_graph", "oss + ddp", "sharded ddp",
            "fsdp reshard", "fsdp no reshard, unit inside checkpoint", "fsdp mixed precision"]


def _matrix(wrappers: list) -> dict:
    found = {}
    for i, wrapper in enumerate(wrappers):
        for dropout, batchnorm in ((0.0, False), (0.3, True)) if i % 2 else ((0.3, True),):
            case = dict(wrapper=wrapper, dropout=dropout, batchnorm=batchnorm)
            found[f"{wrapper}, dropout={dropout}, batchnorm={batchnorm}"] = _mismatches(case)
    return found


@pytest.mark.parametrize("world_name, wrappers", [("world2", WRAPPERS),
                                                  ("world4", WRAPPERS[::3])])
def test_checkpointed_blocks_train_as_without_checkpointing(request, world_name, wrappers):
    world = request.getfixturevalue(world_name)
    for rank, found in enumerate(world.run(_matrix, wrappers)):
        assert not any(found.values()), (rank, {k: v for k, v in found.items() if v})


# ---------------------------------------------------------------- one process


def _one_process_step(module: nn.Module, x: torch.Tensor, eval_before_backward: bool):
    torch.manual_seed(3)
    out = module(x)
    if eval_before_backward:
        module.eval()
    out.square().sum().backward()
    module.train()
    return ([p.grad.clone() for p in module.parameters()], [b.clone() for b in module.buffers()],
            torch.get_rng_state())


def test_eval_between_forward_and_backward_recomputes_in_train_mode():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 8))
    checkpointed = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(6, 8)
    for want, got in zip(_one_process_step(plain, x, True),
                         _one_process_step(checkpointed, x, True)):
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert checkpointed.training and all(m.training for m in checkpointed.modules())


class ScalesItsMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, *, mask):
        mask.mul_(2)
        return self.fc(x * mask)


def test_an_input_changed_in_place_by_the_forward_is_a_clear_error():
    block = checkpoint_wrapper(ScalesItsMask())
    with pytest.raises(RuntimeError, match=r"ScalesItsMask.forward changed its input 'mask' in "
                                           r"place.*out of place"):
        block(torch.randn(3, 4, requires_grad=True), mask=torch.ones(3, 4))
    first_relu_inplace = checkpoint_wrapper(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4)))
    with pytest.raises(RuntimeError, match=r"Sequential.forward changed its input 'input'"):
        first_relu_inplace(torch.randn(3, 4, requires_grad=True) * 1.0)


class MasksByKeyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, *, mask):
        return torch.tanh(self.fc(x * mask))


def test_a_keyword_tensor_changed_after_forward_is_refused_not_silently_used():
    # torch keeps keyword tensors of a checkpoint by reference: changed after the forward they
    # fed the recomputation other values (silently wrong gradients) where plain autograd refuses
    block = checkpoint_wrapper(MasksByKeyword())
    mask = torch.ones(3, 4)
    out = block(torch.randn(3, 4, requires_grad=True), mask=mask)
    mask.zero_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
