"""FairScale's import paths, with ``fairscale`` replaced by ``shardkit``, name the same objects
as shardkit's own short paths (what real FairScale code imports: fairseq, Lightning 1.x and
Transformers' ``sharded_ddp`` use the long module paths)."""

import subprocess
import sys

# (FairScale's path with "fairscale" -> "shardkit", name, shardkit's short path)
PATHS = [
    ("shardkit.optim.oss", "OSS", "shardkit.optim"),
    ("shardkit.optim.grad_scaler", "ShardedGradScaler", "shardkit.optim"),
    ("shardkit.nn.data_parallel.sharded_ddp", "ShardedDataParallel", "shardkit.nn"),
    ("shardkit.nn.data_parallel.fully_sharded_data_parallel", "FullyShardedDataParallel",
     "shardkit.nn"),
    ("shardkit.nn.data_parallel.fully_sharded_data_parallel", "TrainingState",
     "shardkit.nn.data_parallel"),
    ("shardkit.nn.wrap.auto_wrap", "auto_wrap", "shardkit.nn"),
    ("shardkit.nn.wrap.auto_wrap", "enable_wrap", "shardkit.nn"),
    ("shardkit.nn.wrap.auto_wrap", "wrap", "shardkit.nn.wrap"),
    ("shardkit.nn.wrap.auto_wrap", "config_auto_wrap_policy", "shardkit.nn"),
    ("shardkit.nn.wrap.auto_wrap", "default_auto_wrap_policy", "shardkit.nn"),
    ("shardkit.nn.checkpoint.checkpoint_activations", "checkpoint_wrapper", "shardkit.nn"),
    ("shardkit.nn.checkpoint.checkpoint_activations", "disable_checkpointing",
     "shardkit.nn.checkpoint"),
    ("shardkit.nn.misc", "checkpoint_wrapper", "shardkit.nn"),
    ("shardkit.nn.pipe", "Pipe", "shardkit.nn"),
    ("shardkit.nn.model_parallel.layers", "ColumnParallelLinear", "shardkit.nn.model_parallel"),
]


def test_fairscale_module_paths_name_the_same_objects():
    # a fresh interpreter that imports every long path first: none may shadow a short name
    # (importing a submodule rebinds its package's attribute of the same name)
    code = "\n".join(
        [f"from {long_path} import {name} as long_{i}" for i, (long_path, name, _)
         in enumerate(PATHS)]
        + ["import importlib, shardkit.nn, shardkit.nn.wrap",
           f"paths = {PATHS!r}",
           "for i, (long_path, name, short_path) in enumerate(paths):",
           "    short = getattr(importlib.import_module(short_path), name)",
           "    same = short is globals()[f'long_{i}'] or name == 'wrap' and callable(short)",
           "    assert same, (long_path, short_path, name, short)",
           "assert callable(shardkit.nn.wrap.auto_wrap) and callable(shardkit.nn.wrap)"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
