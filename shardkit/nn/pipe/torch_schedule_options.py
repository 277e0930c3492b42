"""``torch.distributed.pipelining``'s schedule constructor options as shardkit's schedules
take them: the micro-batch count as ``chunks`` or ``n_microbatches``, torch's other options at
the values that mean what shardkit does, any other value refused by name. Local, before any
collective.
"""

from __future__ import annotations

from shardkit.nn.pipe.microbatch import positional_chunk_spec_problem

# torch.distributed.pipelining's constructor options, with the values that mean what shardkit
# does (tensors split along dim 0 into equal chunks, outputs concatenated along dim 0 by
# step(return_outputs=True), the split backward run by the schedule itself)
_TORCH_DEFAULTS = {"args_chunk_spec": None, "output_merge_spec": None,
                   "use_full_backward": None, "backward_requires_autograd": True,
                   "defer_pp_recv": False}


def _microbatch_count(name: str, chunks, n_microbatches):
    """The micro-batches per step, given as ``chunks`` (shardkit's and FairScale's name) or
    ``n_microbatches=`` (torch's). Local, before any collective."""
    if n_microbatches is None:
        if chunks is None:
            raise TypeError(f"{name}() needs the number of micro-batches per step: chunks "
                            f"(2nd argument) or n_microbatches=... (torch's name)")
        return chunks
    if chunks is not None:
        raise TypeError(f"{name}(chunks={chunks!r}, n_microbatches={n_microbatches!r}): the "
                        f"number of micro-batches is given twice (n_microbatches is torch's "
                        f"name for chunks); pass it once")
    return n_microbatches


def _check_torch_options(name: str, options: dict) -> None:
    """Accept torch's schedule options at their defaults (code written for torch's schedules
    often spells them out), and an ``args_chunk_spec`` that splits along dim 0 as shardkit does;
    refuse any other value by name, and unknown names as Python would. Local, before any
    collective."""
    for option, value in options.items():
        if option not in _TORCH_DEFAULTS:
            raise TypeError(f"{name}.__init__() got an unexpected keyword argument {option!r}")
        if option == "args_chunk_spec":
            problem = positional_chunk_spec_problem(value)
            if problem:
                raise ValueError(f"{name}(args_chunk_spec={value!r}): {problem}")
            continue
        default = _TORCH_DEFAULTS[option]
        if value is default or (default is not None and value == default
                                and isinstance(value, bool)):
            continue
        raise ValueError(
            f"{name}({option}={value!r}): shardkit's schedules take only torch's default "
            f"({default!r}): they split every tensor argument along dim 0 into equal chunks, "
            f"concatenate the last stage's outputs along dim 0 (step(return_outputs=True)) and "
            f"run the backward themselves; split or merge other dimensions in the stage module")
