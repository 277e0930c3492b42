"""Small utilities shared by the wrappers (memory accounting), and DeepSpeed's
``deepspeed.utils`` tensor-fragment API (``safe_get_full_fp32_param`` and friends, imported on
first use from :mod:`shardkit.utils.tensor_fragment`)."""

from shardkit._lazy import lazy_exports

_FRAGMENT = "shardkit.utils.tensor_fragment"
_EXPORTS = {name: _FRAGMENT for name in (
    "safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_grad",
    "safe_set_full_grad", "safe_get_full_optimizer_state", "safe_set_full_optimizer_state",
    "safe_get_local_fp32_param", "safe_set_local_fp32_param", "safe_get_local_grad",
    "safe_set_local_grad", "safe_get_local_optimizer_state", "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized")}

__all__ = list(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
