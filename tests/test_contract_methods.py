"""DESIGN.md's "Public API" block, the parts ``test_contract.py`` leaves out: the documented
methods' arguments and defaults, the documented argument names of functions checked there only
for importability, and what ``CommCounter`` exposes. Signatures only; no world is started."""

import importlib
import inspect

import pytest

_EMPTY = inspect.Parameter.empty

# (import path of a function or method, {argument: documented default}); ``_EMPTY``: required
DOCUMENTED_METHOD_SIGNATURES = [
    ("shardkit.optim.OSS.step", {"closure": None}),
    ("shardkit.optim.OSS.clip_grad_norm", {"max_norm": _EMPTY, "norm_type": 2.0}),
    ("shardkit.optim.OSS.consolidate_state_dict", {"recipient_rank": 0}),
    ("shardkit.optim.OSS.load_state_dict", {"state_dict": _EMPTY}),
    ("shardkit.optim.OSS.add_param_group", {"param_group": _EMPTY}),
    ("shardkit.optim.FusedAdamW", {"params": _EMPTY, "lr": 1e-3, "betas": (0.9, 0.999),
                                   "eps": 1e-8, "weight_decay": 1e-2}),
    ("shardkit.nn.data_parallel.FullyShardedDataParallel.clip_grad_norm_",
     {"max_norm": _EMPTY, "norm_type": 2.0}),
    ("shardkit.nn.data_parallel.FullyShardedDataParallel.gather_full_optim_state_dict",
     {"optim": _EMPTY, "recipient_rank": 0}),
    ("shardkit.nn.data_parallel.FullyShardedDataParallel.get_shard_from_optim_state_dict", {}),
    ("shardkit.nn.wrap.auto_wrap", {"module": _EMPTY, "auto_wrap_policy": None}),
    ("shardkit.nn.wrap.enable_wrap", {"wrapper_cls": None}),
    ("shardkit.nn.wrap.default_auto_wrap_policy", {"min_num_params": 100_000_000}),
    ("shardkit.nn.Pipe", {"module": _EMPTY, "balance": None}),
    ("shardkit.nn.pipe.ScheduleGPipe", {"loss_fn": None}),
    ("shardkit.nn.pipe.Schedule1F1B", {"loss_fn": None}),
    ("shardkit.nn.pipe.ScheduleGPipe.step", {"target": None}),
    ("shardkit.nn.pipe.Schedule1F1B.step", {"target": None}),
    ("shardkit.nn.pipe.split_sequential", {"module": _EMPTY, "balance": _EMPTY}),
    ("shardkit.nn.model_parallel.layers.ColumnParallelLinear",
     {"in_features": _EMPTY, "out_features": _EMPTY}),
    ("shardkit.nn.model_parallel.layers.RowParallelLinear",
     {"in_features": _EMPTY, "out_features": _EMPTY}),
    ("shardkit.nn.model_parallel.layers.VocabParallelEmbedding",
     {"num_embeddings": _EMPTY, "embedding_dim": _EMPTY}),
    ("shardkit.nn.model_parallel.cross_entropy.vocab_parallel_cross_entropy",
     {"vocab_parallel_logits": _EMPTY, "target": _EMPTY}),
    ("shardkit.nn.model_parallel.random.model_parallel_manual_seed", {"seed": _EMPTY}),
    ("shardkit.engine.ShardedEngine.save_checkpoint", {"tag": None, "client_state": None}),
    ("shardkit.engine.ShardedEngine.load_checkpoint", {"tag": None}),
]


def _resolve(path: str):
    """The object at a dotted path whose head is a module and whose tail is attributes."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


@pytest.mark.parametrize("path,defaults", DOCUMENTED_METHOD_SIGNATURES,
                         ids=[p for p, _ in DOCUMENTED_METHOD_SIGNATURES])
def test_documented_method_arguments_and_defaults(path, defaults):
    parameters = inspect.signature(_resolve(path)).parameters
    for name, default in defaults.items():
        assert name in parameters, f"{path} lacks the documented argument {name!r}"
        assert parameters[name].default == default, (
            f"{path}({name}=...) defaults to {parameters[name].default!r}, documented {default!r}")


def test_engine_checkpoint_directory_is_the_first_argument():
    """DESIGN.md writes ``save_checkpoint(dir, ...)`` / ``load_checkpoint(dir, ...)``: the
    directory is the first, required argument (DeepSpeed's ``save_dir`` / ``load_dir``)."""
    from shardkit.engine import ShardedEngine
    for method in (ShardedEngine.save_checkpoint, ShardedEngine.load_checkpoint):
        first = list(inspect.signature(method).parameters.values())[1]
        assert first.default is _EMPTY, f"{method.__name__}: the directory must be required"


def test_comm_counter_exposes_bytes_by_op_and_calls():
    from shardkit.distributed import CommCounter
    with CommCounter() as comm:
        pass
    assert comm.bytes == 0 and comm.by_op == {} and len(comm.calls) == 0


def test_transformer_auto_wrap_policy_takes_the_block_classes():
    """``transformer_auto_wrap_policy({BlockCls})`` is a policy: it wraps exactly the blocks."""
    import torch.nn as nn
    from shardkit.nn.wrap import transformer_auto_wrap_policy
    policy = transformer_auto_wrap_policy({nn.Linear})
    assert policy(module=nn.Linear(2, 2), recurse=False, nonwrapped_numel=6)
    assert not policy(module=nn.ReLU(), recurse=False, nonwrapped_numel=0)
