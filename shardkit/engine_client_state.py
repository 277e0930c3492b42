"""Whether a checkpoint's ``client_state`` loads back with ``torch.load(weights_only=True)``,
tried in memory before anything is written, and the TypeError naming its first key that would
not. Local; memory: one serialized copy of ``client_state``.
"""

from __future__ import annotations

import io
import re
from typing import Optional

import torch


def _client_state_problem(client_state) -> Optional[str]:
    """Why ``client_state`` would not load back from a checkpoint (read with
    ``torch.load(weights_only=True)``), naming the first key that fails; ``None`` when it
    would. A trial save and load in memory: one serialized copy of ``client_state``."""
    if client_state is None:
        return None
    if not isinstance(client_state, dict):
        return f"client_state must be a dict, not {type(client_state).__name__}"
    if _load_back_error(client_state) is None:
        return None
    for key, value in client_state.items():
        error = _load_back_error({key: value})
        if error is not None:
            return f"client_state[{key!r}] ({type(value).__name__}): {error}"
    return f"client_state: {_load_back_error(client_state)}"


def _load_back_error(obj) -> Optional[str]:
    """``None`` when ``obj`` survives ``torch.save`` then ``torch.load(weights_only=True)``,
    else what stopped it (the class the safe loader refuses, when it names one)."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
        return None
    except Exception as error:  # pickling errors and the safe loader's refusal alike
        refused = re.search(r"GLOBAL ([\w.]+)", str(error))
        if refused:
            return f"the checkpoint loader would refuse {refused.group(1)}"
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def _raise_client_state_problem(problem: Optional[str]) -> None:
    if problem is not None:
        raise TypeError(
            f"engine.save_checkpoint: {problem}; checkpoints load with "
            f"torch.load(weights_only=True), so client_state may hold tensors, numbers, "
            f"strings, bools, None and lists/tuples/dicts of them (e.g. vars(args) for an "
            f"argparse.Namespace, float(x) for a NumPy scalar); nothing was written")
