"""Small utilities shared by the wrappers (memory accounting), and DeepSpeed's
``deepspeed.utils`` tensor-fragment API (``safe_get_full_fp32_param`` and friends, imported on
first use from :mod:`shardkit.utils.tensor_fragment`), with its ``logger`` and ``log_dist``."""

from shardkit._lazy import lazy_exports

_FRAGMENT = "shardkit.utils.tensor_fragment"
_EXPORTS = {name: _FRAGMENT for name in (
    "safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_grad",
    "safe_set_full_grad", "safe_get_full_optimizer_state", "safe_set_full_optimizer_state",
    "safe_get_local_fp32_param", "safe_set_local_fp32_param", "safe_get_local_grad",
    "safe_set_local_grad", "safe_get_local_optimizer_state", "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized")}
# deepspeed.utils' logger and log_dist, for scripts that import them from there
_EXPORTS.update({name: "shardkit.deepspeed_compat" for name in ("logger", "log_dist")})

__all__ = list(_EXPORTS)

_exported = lazy_exports(__name__, _EXPORTS)


def __getattr__(name):
    if name == "zero_to_fp32":  # deepspeed.utils.zero_to_fp32 under `import shardkit as deepspeed`
        import importlib
        return importlib.import_module("shardkit.utils.zero_to_fp32")
    return _exported(name)
