"""shardkit.recipes: the one composition road. The stage-3 default wrap policy (HF's
``_no_split_modules``, else repeated blocks by type, else by size), refusals of bad arguments
before any wrapper is built, and ``initialize`` outside torchrun (one rank, in a fresh process:
no environment variable written, blocks found without the demo's model)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from shardkit import recipes
from shardkit.models import GPT, MLP, Block, GPTConfig
from shardkit.nn.wrap import default_auto_wrap_policy

TINY = GPTConfig(vocab_size=32, n_layer=3, n_head=2, d_model=16, seq_len=8)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)


class Declared(nn.Module):
    """Declares its block class the way a Hugging Face model does."""

    _no_split_modules = ["Layer"]

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.extra = nn.ModuleList([nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 8)])


def _selected(policy, model):
    return {type(m) for m in model.modules() if policy(module=m, recurse=False,
                                                       unwrapped_params=0)}


def test_repeated_blocks_are_found_by_type():
    assert recipes.repeated_block_classes(GPT(TINY)) == (Block,)
    assert recipes.repeated_block_classes(MLP(16, depth=3)) == (nn.Linear,)
    assert recipes.repeated_block_classes(nn.Linear(4, 4)) == ()
    assert _selected(recipes.default_wrap_policy(GPT(TINY)), GPT(TINY)) == {Block}


def test_no_split_modules_wins_over_the_larger_repeated_class():
    model = Declared()
    assert recipes.repeated_block_classes(model) == (nn.Linear,)  # more parameters
    assert _selected(recipes.default_wrap_policy(model), model) == {Layer}


def test_without_blocks_the_policy_is_by_parameter_count():
    assert recipes.default_wrap_policy(nn.Linear(4, 4)) is default_auto_wrap_policy


@pytest.mark.parametrize("stage, kwargs, error, message", [
    (4, {}, ValueError, "compose(stage=4): valid stages are [0, 1, 2, 3]"),
    (1, {"offload": True}, ValueError,
     "compose(stage=1): offload is an FSDP option (stage 3 only)"),
    (2, {"hpz_partition_size": 2, "mixed_precision": True}, ValueError,
     "mixed_precision, hpz_partition_size are FSDP options (stage 3 only)"),
    (0, {"wrap_policy": default_auto_wrap_policy}, ValueError, "wrap_policy is an FSDP option"),
    (0, {"comm": object()}, ValueError, "stage 0 is torch DDP alone"),
    (3, {"overlap_param_sync": True}, ValueError, "only OSS's parameter sync"),
    (0, {"sync_bucket_numel": 1024}, ValueError, "only OSS (stages 1 and 2) has a parameter-sync"),
    (3, {"step_in_backward": True}, ValueError, "only OSS (stages 1 and 2) steps"),
    (2, {"reduce_to_owners": True}, ValueError, "only stage 1 (OSS under torch DDP)"),
    (1, {"reduce_dtype": torch.int8}, ValueError, "compose(reduce_dtype=torch.int8): valid"),
    (3, {"reduce_dtype": torch.bfloat16, "mixed_precision": True}, ValueError,
     "set reduce_dtype in its MixedPrecisionPolicy"),
    (3, {"reduce_dtype": torch.float16, "quantize_gradients": True}, ValueError,
     "not with quantize_gradients"),
    (1, {"reduce_dtype": torch.bfloat16, "step_in_backward": True}, ValueError,
     "not with step_in_backward"),
])
def test_bad_arguments_fail_before_wrapping(stage, kwargs, error, message):
    with pytest.raises(error) as err:
        recipes.compose(nn.Linear(4, 4), stage, recipes.adamw(1e-3), **kwargs)
    assert message in str(err.value)


def test_optimizer_must_be_a_recipe():
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match="OptimizerRecipe.of"):
        recipes.compose(nn.Linear(2, 2), 0, opt)
    recipe = recipes.OptimizerRecipe.of(opt)
    assert recipe.cls is torch.optim.SGD and recipe.defaults["lr"] == 0.1
    assert recipe.instance is opt


@pytest.mark.parametrize("stage, kwargs", [(2, {}), (1, {"reduce_to_owners": True})])
def test_lbfgs_is_refused_where_gradients_reach_their_owners_only(stage, kwargs):
    """OSS runs LBFGS on the whole model on every rank; ShardedDDP and the owners' hook leave
    other ranks' gradients zero. Before: refused at the first step (stage 2) or backward (the
    hook), after building; now by compose, before anything is built."""
    lbfgs = recipes.OptimizerRecipe(torch.optim.LBFGS, {"lr": 0.1})
    with pytest.raises(ValueError, match=r"LBFGS steps the whole model on every rank .* use "
                                         r"stage 1 without reduce_to_owners"):
        recipes.compose(nn.Linear(4, 4), stage, lbfgs, **kwargs)


@pytest.mark.parametrize("name", ["Adafactor", "Muon", "LBFGS", "other Adafactor", "FusedLamb"])
def test_stage3_refuses_optimizers_that_read_whole_tensors(name):
    """Adafactor's factored moments, Muon's orthogonalization and LBFGS's history read whole
    tensors (or the whole model); on FSDP's row shards each rank's update would differ from
    one process's. Refused before any wrapper is built, as a recipe and as an object; stages
    0-2 (whole parameters) take them. Another library's Adafactor (transformers') and a LAMB
    are told by their class names, as FSDP's step-time check tells them."""
    if name in ("other Adafactor", "FusedLamb"):  # not torch's: a class of that name
        name = name.split()[-1]
        cls = type(name, (torch.optim.SGD,), {})
    else:
        cls = getattr(torch.optim, name)
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=f"compose\\(stage=3\\): {name} .*use stages 0-2"):
        recipes.compose(model, 3, recipes.OptimizerRecipe(cls, {"lr": 0.1}))
    with pytest.raises(ValueError, match=f"{name} .*only its rows"):
        recipes.compose(model, 3, recipes.OptimizerRecipe.of(cls([model.weight], lr=0.1)))
    assert recipes.why_not_on_row_shards(torch.optim.AdamW) is None


SINGLE_PROCESS = """
import json, os, sys, torch
import shardkit
from shardkit.models import GPT, Block, GPTConfig, synthetic_batch
before = dict(os.environ)
cfg = GPTConfig(vocab_size=32, n_layer=3, n_head=2, d_model=16, seq_len=8)
config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3}}
engine, *_ = shardkit.initialize(model=GPT(cfg), config=config, peer_timeout_s=0)
idx, tgt = synthetic_batch(cfg, 2, 0)
logits = engine(idx)
engine.backward(torch.nn.functional.cross_entropy(logits.reshape(-1, 32), tgt.reshape(-1)))
engine.step()
units = engine.wrapped.sharded_units()
config["zero_optimization"] = {"stage": 2, "reduce_bucket_size": 1000}  # elements
stage2, *_ = shardkit.initialize(model=GPT(cfg), config=config, peer_timeout_s=0)
print(json.dumps({"environ_unchanged": dict(os.environ) == before,
                  "units": len(units), "block_units": sum(isinstance(u.module, Block)
                                                          for u in units),
                  "steps": engine.global_steps,
                  "stage3_fused": engine.optimizer.param_groups[0]["fused"],
                  "stage2_bucket_bytes": stage2.wrapped.reduce_buffer_size}))
"""


def test_initialize_outside_torchrun_starts_one_rank_and_writes_no_environment():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", SINGLE_PROCESS], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"environ_unchanged": True, "units": TINY.n_layer + 1,
                   "block_units": TINY.n_layer, "steps": 1, "stage3_fused": True,
                   "stage2_bucket_bytes": 4000}  # DeepSpeed's elements, fp32 bytes


def test_stage3_steps_the_shards_with_the_fused_kernel_where_oss_would():
    """compose's stage-3 optimizer follows OSS's rule: torch's fused kernel when the recipe
    leaves ``fused`` and ``foreach`` unset, the caller's choice otherwise."""
    from shardkit.testing import World
    with World(1) as world:
        got = world.run(_stage3_fused_choices)[0]
    assert got == {"unset": True, "foreach": None, "fused_false": False, "sgd": True,
                   "sgd_momentum": None, "late_unit_steps": True}


def _stage3_fused_choices():
    def fused_of(recipe):
        composition = recipes.compose(nn.Sequential(nn.Linear(4, 4)), 3, recipe)
        return composition.optimizer.param_groups[0]["fused"]
    return {"unset": fused_of(recipes.adamw(1e-3)),
            "foreach": fused_of(recipes.adamw(1e-3, foreach=True)),
            "fused_false": fused_of(recipes.adamw(1e-3, fused=False)),
            "sgd": fused_of(recipes.OptimizerRecipe(torch.optim.SGD, {"lr": 0.1})),
            "sgd_momentum": fused_of(_sgd_momentum()),
            "late_unit_steps": _unit_first_used_at_step_2_steps()}


def _sgd_momentum():
    return recipes.OptimizerRecipe(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_second: bool):
        h = self.first(x)
        return self.second(h) if use_second else h


def _unit_first_used_at_step_2_steps():
    """SGD with momentum at stage 3, one unit without a gradient until step 2: every step
    runs (torch's fused SGD would fail on the mix of units with and without momentum)."""
    composition = recipes.compose(_Branchy(), 3, _sgd_momentum(),
                                  wrap_policy=lambda module, recurse, **kw: recurse or isinstance(
                                      module, nn.Linear))
    for step in range(3):
        composition.zero_grad()
        composition.wrapped(torch.randn(2, 4), use_second=step >= 2).sum().backward()
        composition.optimizer.step()
    return True


MECHANISM = ("distributed.py", "process_groups.py", "broken_links.py", "topology.py",
             "dist_setup.py", "comm_counter.py", "transport.py", "shm_transport.py",
             "quantized_transport.py", "quantized_comm.py", "comm_hooks.py", "fault.py", "nn",
             "optim", "kernels", "checkpoint", "utils")
POLICY = {"shardkit.recipes", "shardkit.engine", "shardkit.demo", "shardkit.plan",
          "shardkit.testing"}


def _imports(path):
    import ast
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_imports_run_from_policy_to_mechanism():
    import pathlib

    import shardkit
    root = pathlib.Path(shardkit.__file__).parent
    files = [f for name in MECHANISM for f in
             ([root / name] if name.endswith(".py") else sorted((root / name).rglob("*.py")))]
    wrong = {str(f.relative_to(root)): sorted(_imports(f) & POLICY) for f in files
             if _imports(f) & POLICY}
    assert not wrong, wrong
    engine = _imports(root / "engine.py")
    assert not engine & {"shardkit.models", "shardkit.testing", "shardkit.demo"}, engine


def test_a_recipe_of_a_partial_optimizer_class_composes():
    """OSS takes ``optim=functools.partial(...)``; a recipe carrying one raised
    ``AttributeError: __name__`` in compose's agreement fingerprint."""
    import functools
    recipe = recipes.OptimizerRecipe(functools.partial(torch.optim.SGD, momentum=0.9), {"lr": 0.1})
    assert recipes.optimizer_fingerprint(recipe).startswith("SGD(lr=0.1)")
    recipes.check_composable(nn.Linear(4, 4), 1, recipe)  # what compose checks first
    assert recipe.build(nn.Linear(4, 4).parameters()).param_groups[0]["momentum"] == 0.9
