"""torch.compile inside the wrappers: compiled blocks (``block.compile()``) in FSDP units, under
ShardedDataParallel and under OSS + DDP train exactly like eager code (fp32, CPU, Inductor), and
the wrappers' hooks add no graph break inside a block; compiling the whole FSDP model works too
(Dynamo breaks at each unit's hooks, which run eagerly). A Hugging Face Llama with its decoder
layers compiled inside FSDP units does the same.

Inductor compiles are slow on a small machine: one tiny GPT, three steps per wrapper, one world.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit import distributed
from shardkit.models import GPT, Block, GPTConfig, synthetic_batch
from shardkit.nn import FullyShardedDataParallel as FSDP, ShardedDataParallel
from shardkit.nn.wrap import auto_wrap, no_split_modules_policy, transformer_auto_wrap_policy
from shardkit.optim import OSS
from shardkit.testing import world_fixture

dynamo = pytest.importorskip("torch._dynamo")

CFG = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=16, seq_len=8, tie_weights=True)
GLOBAL_BATCH, STEPS = 4, 3
WRAPPERS = ["fsdp", "fsdp_keep_full", "sharded_ddp", "oss_ddp", "fsdp_whole_model"]

world2 = world_fixture(2)


def _build(wrapper, compiled):
    model = GPT(CFG, seed=3)
    if compiled and wrapper != "fsdp_whole_model":
        for block in model.blocks:
            block.compile()  # in place: names and state_dict keys unchanged
    if wrapper.startswith("fsdp"):
        keep = wrapper == "fsdp_keep_full"
        wrapped = FSDP(auto_wrap(model, transformer_auto_wrap_policy({Block}),
                                 reshard_after_forward=not keep), reshard_after_forward=not keep)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, eps=1e-4)
        full = wrapped.state_dict
        if compiled and wrapper == "fsdp_whole_model":
            wrapped = torch.compile(wrapped)
        return wrapped, opt, full
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, eps=1e-4)
    wrapped = ShardedDataParallel(model, opt) if wrapper == "sharded_ddp" else DDP(model)
    return wrapped, opt, model.state_dict


def _train(wrapper, compiled):
    wrapped, opt, full = _build(wrapper, compiled)
    rank, per = distributed.get_rank(), GLOBAL_BATCH // distributed.get_world_size()
    history = []
    for step in range(STEPS):
        x, y = synthetic_batch(CFG, GLOBAL_BATCH, step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        logits = wrapped(x)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
        history.append({k: v.detach().clone() for k, v in full().items()})
    return history


def _train_hf_llama(compiled):
    """A tied-embedding HF Llama, decoder layers compiled in place, one FSDP unit each."""
    from tests.hf.hf_common import batch, build
    model = build("llama", tied=True)
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    wrapped = FSDP(auto_wrap(model, no_split_modules_policy(model)))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, eps=1e-4)
    rank, per = distributed.get_rank(), GLOBAL_BATCH // distributed.get_world_size()
    history = []
    for step in range(STEPS):
        ids = batch(step, GLOBAL_BATCH)[rank * per:(rank + 1) * per]
        wrapped(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        history.append({k: v.detach().clone() for k, v in wrapped.state_dict().items()})
    return history


def _compare_all():
    out = {}
    for wrapper in WRAPPERS + ["fsdp_hf_llama"]:
        train = _train_hf_llama if wrapper == "fsdp_hf_llama" else \
            (lambda compiled, w=wrapper: _train(w, compiled))
        eager = train(compiled=False)
        dynamo.reset()
        dynamo.utils.counters.clear()
        compiled = train(compiled=True)
        counters = dynamo.utils.counters
        out[wrapper] = {
            "diffs": [max(float((c[k] - e[k]).abs().max()) for k in e)
                      for c, e in zip(compiled, eager)],
            "breaks": sum(counters["graph_break"].values()),
            "break_reasons": list(counters["graph_break"]),
            "graphs": counters["stats"]["unique_graphs"],
            "recompiles": counters["recompiles"] and dict(counters["recompiles"]),
        }
    return out


@pytest.fixture(scope="module")
def results(world2):
    return world2.run(_compare_all)


@pytest.mark.parametrize("wrapper", WRAPPERS + ["fsdp_hf_llama"])
def test_compiled_blocks_train_like_eager_on_every_rank(results, wrapper):
    for rank, r in enumerate(results):
        assert len(r[wrapper]["diffs"]) == STEPS
        assert max(r[wrapper]["diffs"]) <= 1e-5, (rank, r[wrapper]["diffs"])


@pytest.mark.parametrize("wrapper",
                         ["fsdp", "fsdp_keep_full", "sharded_ddp", "oss_ddp", "fsdp_hf_llama"])
def test_wrapper_hooks_add_no_graph_break_inside_a_block(results, wrapper):
    for r in results:
        got = r[wrapper]
        # both blocks share one graph: no break, no recompilation across steps or blocks
        assert got["breaks"] == 0, got["break_reasons"]
        assert got["graphs"] == 1 and not got["recompiles"], got


def test_whole_fsdp_model_compiles_with_breaks_only_at_unit_hooks(results):
    for r in results:
        got = r["fsdp_whole_model"]
        assert got["breaks"] >= 1
        # the only breaks: FSDP's forward hooks, which Dynamo runs eagerly by design
        assert all("torch.compiler.disable" in reason and "FullyShardedDataParallel" in reason
                   for reason in got["break_reasons"]), got["break_reasons"]
