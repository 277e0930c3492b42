"""shardkit: wrappers that make ordinary nn.Modules train across many processes.

OSS (ZeRO-1), ShardedDataParallel (ZeRO-2), FullyShardedDataParallel (ZeRO-3), Pipe and
pipeline schedules, Megatron-style tensor-parallel layers, and a DeepSpeed-style
``shardkit.initialize`` that composes them from a JSON config. See DESIGN.md.
"""

__version__ = "0.1.0"

__all__ = ["initialize", "add_config_arguments", "init_distributed", "comm", "get_accelerator",
           "__version__"]

# zero: DeepSpeed's deepspeed.zero (GatheredParameters, Init)
_SUBPACKAGES = ("nn", "optim", "distributed", "checkpoint", "utils", "kernels", "accelerator",
                "zero", "checkpointing", "ops")


def __getattr__(name):
    # initialize pulls in every wrapper; import it only when asked for.
    if name == "initialize":
        from shardkit.engine import initialize
        return initialize
    if name in ("add_config_arguments", "init_distributed", "comm", "get_accelerator",
                "runtime"):
        from shardkit import deepspeed_compat  # DeepSpeed's script helpers
        return getattr(deepspeed_compat, name)
    if name in _SUBPACKAGES:  # `import shardkit; shardkit.nn.Pipe(...)`, as with FairScale
        import importlib
        return importlib.import_module(f"shardkit.{name}")
    raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
