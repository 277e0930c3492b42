"""The wrapper matrix that the real-model suites share (tests/test_torch_blocks.py,
tests/hf/test_hf_families4.py): a model trained for a few AdamW steps under every wrapper
(OSS + torch DDP, ShardedDataParallel + OSS, FSDP one unit / per block / per module with a
parameter / per Linear, ``shardkit.initialize`` stages 0-3), each rank on its rows of the
global batch, against one process on the whole batch (the mean of the per-rank losses): the
parameters after every step, each rank's loss, a fresh model loaded from the full state dict.
Run on the ranks of a World; ``check_case`` on the driver.
"""

import functools

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import shardkit
from shardkit import distributed
from shardkit.nn import FullyShardedDataParallel as FSDP, ShardedDataParallel
from shardkit.nn.wrap import auto_wrap, default_auto_wrap_policy, transformer_auto_wrap_policy
from shardkit.optim import OSS

STEPS, LR, EPS, ROWS = 3, 1e-2, 1e-4, 4
TOL = 2e-5


WRAPPERS = ["oss_ddp", "sharded_ddp", "fsdp", "fsdp_blocks", "fsdp_size", "fsdp_linear",
            "stage0", "stage1", "stage2", "stage3"]


def rows_of(batch, start, stop):
    """Rows ``start:stop`` of every tensor in ``batch`` (other values as they are)."""
    return {k: v[start:stop] if torch.is_tensor(v) else v for k, v in batch.items()}


def snapshot(state_or_module):
    state = state_or_module.state_dict() if isinstance(state_or_module, nn.Module) \
        else state_or_module
    return {k: v.detach().clone() for k, v in state.items()}


def max_diff(state, want):
    assert set(state) == set(want), sorted(set(state) ^ set(want))
    return max(float((state[k].float() - want[k].float()).abs().max()) for k in want)


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.01)


def oracle(build, batch, loss_of, world, steps=STEPS):
    """One-process training on the global batch, the loss the mean of the per-rank losses
    (each part's forward from the step's starting buffers):
    (state after each step, [per-rank losses] of each step, the trained model)."""
    model = build()
    opt = adamw(model.parameters())
    per, history, losses = ROWS // world, [], []
    for step in range(steps):
        full, buffers, parts = batch(step), snapshot(dict(model.named_buffers())), []
        for r in range(world):
            # each rank runs one forward a step: buffers a forward updates (spectral_norm's
            # power iteration) start every rank's part from the same values
            with torch.no_grad():
                for name, buffer in model.named_buffers():
                    if not torch.equal(buffer, buffers[name]):  # others may be in the graph
                        buffer.copy_(buffers[name])
            parts.append(loss_of(model(**rows_of(full, r * per, (r + 1) * per))))
        losses.append([float(p) for p in parts])
        (sum(parts) / world).backward()
        opt.step()
        opt.zero_grad()
        history.append(snapshot(model))
    return history, losses, model


def engine_config(stage, world):
    return {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": ROWS // world,
            "steps_per_print": 10 ** 6, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS,
                                                      "weight_decay": 0.01}}}


def wrapped(model, wrapper, blocks, world, loss_of, policies=None):
    """(step(rows) -> loss, full state dict(), the wrapped model to call). ``policies``: FSDP
    wrapper names mapped to ``f(model)`` giving that wrapper's auto_wrap policy (beside the
    built-in ``fsdp*`` wrappers)."""
    if wrapper.startswith("stage"):
        stage = int(wrapper[5])
        engine, _, _, _ = shardkit.initialize(model=model, config=engine_config(stage, world))

        def engine_step(rows):
            loss = loss_of(engine(**rows))
            engine.backward(loss)
            engine.step()
            return float(loss)
        full = engine.wrapped.state_dict if stage == 3 else engine.module.state_dict
        return engine_step, full, engine
    if wrapper.startswith("fsdp"):
        if policies and wrapper in policies:
            net = auto_wrap(model, policies[wrapper](model))
        elif wrapper == "fsdp_blocks":
            net = auto_wrap(model, transformer_auto_wrap_policy(set(blocks)))
        elif wrapper == "fsdp_size":  # every module with a parameter its own unit
            net = auto_wrap(model, functools.partial(default_auto_wrap_policy,
                                                     min_num_params=1))
        elif wrapper == "fsdp_linear":  # every Linear: nn.MultiheadAttention's out_proj too
            net = auto_wrap(model, transformer_auto_wrap_policy({nn.Linear}))
        else:
            net = model
        net = net if isinstance(net, FSDP) else FSDP(net)
        opt, full = adamw(net.parameters()), net.state_dict
    else:
        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=LR, eps=EPS,
                  weight_decay=0.01)
        net = DDP(model) if wrapper == "oss_ddp" else ShardedDataParallel(model, opt)
        full = model.state_dict

    def step(rows):
        loss = loss_of(net(**rows))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)
    return step, full, net


def run_case(build, batch, loss_of, blocks, wrapper, history, losses, after=None):
    """Train ``build()`` under ``wrapper``: (parameter diffs per step, loss diffs per step,
    diff of a fresh model loaded from the full state dict, ``after(net, plain)``'s result)."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    plain_keys = set(build().state_dict())
    step, full, net = wrapped(build(), wrapper, blocks, world, loss_of)
    per, diffs, loss_diffs = ROWS // world, [], []
    for s in range(len(history)):
        loss = step(rows_of(batch(s), rank * per, (rank + 1) * per))
        loss_diffs.append(abs(loss - losses[s][rank]))
        diffs.append(max_diff(snapshot(full()), history[s]))
    state = full()
    assert set(state) == plain_keys, sorted(set(state) ^ plain_keys)
    fresh = build(seed=123)
    fresh.load_state_dict(state, strict=True)
    loaded = max_diff(snapshot(fresh), history[-1])
    extra = after(net, fresh) if after is not None else None
    return diffs, loss_diffs, loaded, extra


def all_cases(models, batches, loss_of, blocks, wrappers, after):
    """Every (model, wrapper) case; a failing case is reported as its error's text."""
    world, out = distributed.get_world_size(), {}
    for name, build in models.items():
        history, losses, _ = oracle(build, batches[name], loss_of, world)
        out[name] = max_diff(history[-1], snapshot(build()))
        for wrapper in wrappers:
            try:
                out[(name, wrapper)] = run_case(build, batches[name], loss_of, blocks[name],
                                                wrapper, history, losses, after.get(name))
            except Exception as error:  # noqa: BLE001 - reported per case
                out[(name, wrapper)] = f"{type(error).__name__}: {error}"
    return out


def check_case(per_rank_results, case, tol=TOL):
    for rank, per_rank in enumerate(per_rank_results):
        result = per_rank[case]
        assert not isinstance(result, str), (rank, result)
        diffs, loss_diffs, loaded, _ = result
        assert max(loss_diffs) <= tol, (rank, loss_diffs)
        assert max(diffs) <= tol, (rank, diffs)
        assert loaded <= tol, (rank, loaded)
        assert per_rank[case[0]] > 1e-3  # training really moved the weights
