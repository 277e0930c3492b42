"""Splitting a mini-batch into micro-batches along dim 0, and joining outputs back.

Keyword arguments and the multi-process schedules' merged outputs are nested structures
(tuples, lists, dicts) whose tensors are split or concatenated one by one, as
``torch.distributed.pipelining`` does by default.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch.utils._pytree import (keystr, tree_flatten, tree_flatten_with_path, tree_map,
                                 tree_unflatten)

__all__ = ["as_tuple", "batch_size", "split_microbatches", "chunk_microbatches",
           "join_microbatches", "own_microbatches", "split_keyword_arguments",
           "keyword_argument_problems", "keyword_chunk_dims", "positional_chunk_spec_problem",
           "keyword_signature", "mergeable_output_problem", "merge_outputs", "part_rows",
           "splits_alike", "split_target", "target_chunk_dims", "target_rows",
           "target_split_problems"]

Tensors = tuple[torch.Tensor, ...]


def as_tuple(value: Union[torch.Tensor, Sequence[torch.Tensor]]) -> Tensors:
    """A tensor as a 1-tuple; a tuple or list of tensors as a tuple."""
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def batch_size(inputs: Tensors, what: str) -> int:
    """The common dim-0 size of ``inputs``; raises naming ``what`` when there is none."""
    if not inputs or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in inputs):
        kinds = [type(t).__name__ if not isinstance(t, torch.Tensor) else f"Tensor{tuple(t.shape)}"
                 for t in inputs]
        raise TypeError(f"{what}: expected one or more tensors with a batch dimension, got {kinds}")
    sizes = {t.shape[0] for t in inputs}
    if len(sizes) != 1:
        raise ValueError(f"{what}: the input tensors disagree on the batch size (dim 0): "
                         f"{[t.shape[0] for t in inputs]}")
    return sizes.pop()


def split_microbatches(inputs: Tensors, chunks: int, what: str) -> list[Tensors]:
    """Split every tensor of ``inputs`` into ``chunks`` nearly equal pieces along dim 0.

    Raises ``ValueError`` when the batch is smaller than ``chunks``. Views, no copies.
    """
    size = batch_size(inputs, what)
    if chunks > size:
        raise ValueError(f"{what}: chunks={chunks} is larger than the batch size {size}; use "
                         f"chunks <= {size}")
    pieces = [torch.tensor_split(t, chunks, dim=0) for t in inputs]
    return [tuple(p[i] for p in pieces) for i in range(chunks)]


def chunk_microbatches(inputs: Tensors, chunks: int, what: str) -> list[Tensors]:
    """Cut every tensor of ``inputs`` along dim 0 as FairScale's Pipe does (``torch.chunk``):
    pieces of ``ceil(rows / chunks)`` samples, the last one smaller, so fewer than ``chunks``
    pieces where the rows run out (10 rows in 4: 3, 3, 3, 1; 6 rows in 4: 2, 2, 2). A layer
    whose output depends on its micro-batch (BatchNorm in training) then gives FairScale's
    result. An empty batch is one empty piece. Views, no copies."""
    size = batch_size(inputs, what)
    if size == 0:
        return [tuple(inputs)]
    pieces = [t.chunk(chunks, dim=0) for t in inputs]
    return [tuple(p[i] for p in pieces) for i in range(len(pieces[0]))]


def join_microbatches(outputs: list[Tensors], single: bool):
    """Concatenate per-micro-batch outputs along dim 0 (one tensor when ``single``)."""
    joined = tuple(torch.cat(parts, dim=0) for parts in zip(*outputs))
    return joined[0] if single else joined


def own_microbatches(batches: list, recording: bool, device=None) -> list:
    """``batches`` (views of one batch, from :func:`split_microbatches`), moved to ``device``
    (``None``: where they are), each tensor that needs no gradient made a tensor of its own
    when there are several micro-batches in a step that records for backward: views share the
    batch's in-place version counter, so a first layer working in place on micro-batch ``i +
    1`` (``nn.ReLU(inplace=True)``) would make autograd refuse the backward of micro-batch
    ``i``, whose input it saved, although its values never changed. Tensors requiring grad
    stay views (their gradient goes back to the batch). Costs one copy of the batch; the
    caller's batch is then left as it was."""
    copy = recording and len(batches) > 1

    def own(t: torch.Tensor) -> torch.Tensor:
        moved = t if device is None else t.to(device)
        return t.clone() if copy and not t.requires_grad and moved is t else moved

    return [tuple(own(t) for t in mb) for mb in batches]


def _has_batch_dim(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _is_dim_leaf(value) -> bool:
    return value is None or isinstance(value, int)


def _spec_dims(spec):
    """One of torch's chunk specs as a split dimension: ``TensorChunkSpec(dim)`` as ``dim``
    (negative counts from the end, as in ``torch.tensor_split``), ``_Replicate`` as ``None``;
    anything else raises a TypeError. Nested tuples, lists and dicts of specs keep their
    structure."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    if spec is _Replicate or isinstance(spec, _Replicate):
        return None
    if isinstance(spec, TensorChunkSpec) and isinstance(spec.split_dim, int) \
            and not isinstance(spec.split_dim, bool):
        return spec.split_dim
    if isinstance(spec, (tuple, list)):
        return [_spec_dims(s) for s in spec] if isinstance(spec, list) else \
            tuple(_spec_dims(s) for s in spec)
    if isinstance(spec, dict):
        return {key: _spec_dims(s) for key, s in spec.items()}
    raise TypeError(repr(spec))


def keyword_chunk_dims(kwargs_chunk_spec, what: str) -> dict:
    """torch's ``kwargs_chunk_spec`` (``{name: TensorChunkSpec(dim)}`` or ``{name:
    _Replicate()}``, as ``TensorChunkSpec.from_dict`` builds, or for a keyword holding a
    tuple, list or dict of tensors the same structure of specs) as ``{name: dims}``: ``dims``
    an int (the split dimension, negative counting from the end), ``None`` (passed whole to
    every micro-batch), or a tuple, list or dict of these matching the keyword's value.
    ``None`` (torch's default) is ``{}``: every tensor with a batch dimension split along dim
    0. Raises a ValueError naming an entry that is none of these. Local."""
    if kwargs_chunk_spec is None:
        return {}
    if not isinstance(kwargs_chunk_spec, dict):
        raise ValueError(f"{what}(kwargs_chunk_spec={kwargs_chunk_spec!r}): expected a dict "
                         f"{{keyword: TensorChunkSpec(dim) or _Replicate()}} or None")
    dims = {}
    for name, spec in kwargs_chunk_spec.items():
        try:
            dims[name] = _spec_dims(spec)
        except TypeError as error:
            raise ValueError(f"{what}(kwargs_chunk_spec={{{name!r}: {spec!r}}}): {error} is "
                             f"not a chunk spec; expected TensorChunkSpec(dim) (the keyword's "
                             f"tensors split along dim) or _Replicate() (passed whole to every "
                             f"micro-batch), or a tuple, list or dict of them matching the "
                             f"keyword's value") from None
    return dims


def _leaf_dims(value, dims) -> Optional[list]:
    """The split dimension of each leaf of ``value`` (in ``tree_flatten``'s order): one int or
    ``None`` for all of them, or, where ``dims`` is a structure of them, the entry at each
    leaf's place (tuples and lists by position, dicts by key); ``None`` when that structure
    is not ``value``'s."""
    if _is_dim_leaf(dims):
        return [dims] * len(tree_flatten(value)[0])
    if isinstance(value, (tuple, list)) and isinstance(dims, (tuple, list)) \
            and len(value) == len(dims):
        pairs = zip(value, dims)
    elif isinstance(value, dict) and isinstance(dims, dict) and set(value) == set(dims):
        pairs = ((v, dims[key]) for key, v in value.items())
    else:
        return None
    found = []
    for part, part_dims in pairs:
        part_found = _leaf_dims(part, part_dims)
        if part_found is None:
            return None
        found += part_found
    return found


def _splits(value, dim: Optional[int]) -> bool:
    return dim is not None and _has_batch_dim(value)


def split_keyword_arguments(kwargs: dict, chunks: int, dims: Optional[dict] = None
                            ) -> Optional[list[dict]]:
    """Per micro-batch, ``kwargs`` with every tensor that has a batch dimension cut into
    ``chunks`` views along dim 0 (``torch.tensor_split``: the first ``rows % chunks`` parts
    one row longer, like the batch), inside tuples, lists and dicts too (as
    ``torch.distributed.pipelining`` splits them); other values (0-dim tensors included) go to
    every micro-batch as they are. ``dims`` (:func:`keyword_chunk_dims`) names another
    dimension for a keyword's tensors, or ``None`` to pass them whole, per keyword or per
    leaf of its value. ``None`` when there are no keyword arguments. Views, no copies."""
    if not kwargs:
        return None
    dims = dims or {}
    per_key = {key: _split_value(value, chunks, dims.get(key, 0)) for key, value in kwargs.items()}
    return [{key: parts[i] for key, parts in per_key.items()} for i in range(chunks)]


def _split_value(value, chunks: int, dims) -> list:
    leaves, spec = tree_flatten(value)
    pieces = [torch.tensor_split(v, chunks, dim) if _splits(v, dim) else [v] * chunks
              for v, dim in zip(leaves, _leaf_dims(value, dims))]
    return [tree_unflatten([p[i] for p in pieces], spec) for i in range(chunks)]


def keyword_argument_problems(what: str, kwargs: dict, chunks: int,
                              dims: Optional[dict] = None,
                              batch_rows: Optional[int] = None) -> list[str]:
    """What keeps :func:`split_keyword_arguments` from splitting ``kwargs`` as the batch: a
    tensor with a batch dimension with fewer rows than ``chunks`` (along the dimension ``dims``
    names) or without that dimension, or one that requires grad (only the positional inputs
    get their gradient back); a keyword ``dims`` names that ``kwargs`` (when there are any)
    lacks, or whose value's structure is not that of its nested spec. Given the batch's rows
    (``batch_rows``, known where the batch is), also a tensor whose micro-batches would not
    hold the batch's micro-batches' rows (:func:`splits_alike`). ``what`` names the call
    (``"ScheduleGPipe.step"``)."""
    dims = dims or {}
    missing = [key for key in dims if key not in kwargs]
    problems = [f"{what}(...): kwargs_chunk_spec names {missing}, but the keyword arguments "
                f"given are {sorted(kwargs)}; name the same keywords"] if kwargs and missing \
        else []
    for key, value in kwargs.items():
        leaf_dims = _leaf_dims(value, dims.get(key, 0))
        if leaf_dims is None:
            problems.append(f"{what}({key}=...): kwargs_chunk_spec gives it a structure of "
                            f"specs {dims[key]!r} that is not its value's "
                            f"({_structure(value)}); give one spec per tensor, nested as "
                            f"the value is, or one spec for all of them")
            continue
        for (path, leaf), dim in zip(tree_flatten_with_path(value)[0], leaf_dims):
            problem = _keyword_leaf_problem(leaf, dim, chunks, batch_rows)
            if problem:
                problems.append(f"{what}({key}{keystr(path)}=...): {problem}")
    return problems


def _structure(value) -> str:
    """``value``'s nesting with each leaf named by its type (``{'a': Tensor, 'b': [int]}``)."""
    return repr(tree_map(lambda v: _TypeName(type(v).__name__), value))


class _TypeName(str):
    def __repr__(self) -> str:
        return str(self)


def part_rows(rows: int, chunks: int) -> list[int]:
    """The rows of each of ``chunks`` parts ``torch.tensor_split`` cuts ``rows`` into: the
    first ``rows % chunks`` one longer."""
    return [rows // chunks + (i < rows % chunks) for i in range(chunks)]


def splits_alike(rows: int, batch_rows: int, chunks: int) -> bool:
    """Whether ``rows`` cut into ``chunks`` parts give each micro-batch the same share as the
    batch's ``batch_rows`` (part ``i`` holding ``rows / batch_rows`` rows per batch row, as
    ``batch_rows`` itself, or any multiple of ``chunks`` where ``chunks`` divides the batch)."""
    return all(part * batch_rows == batch_part * rows for part, batch_part in
               zip(part_rows(rows, chunks), part_rows(batch_rows, chunks)))


def _keyword_leaf_problem(value, dim: Optional[int], chunks: int,
                          batch_rows: Optional[int] = None) -> Optional[str]:
    if not _has_batch_dim(value):
        return None
    if dim is not None and not -value.dim() <= dim < value.dim():
        return (f"kwargs_chunk_spec splits it along dim {dim}, but it has shape "
                f"{tuple(value.shape)}")
    if dim is not None and value.shape[dim] < chunks:
        return (f"a tensor passed by keyword is split along dim {dim} into chunks={chunks} "
                f"micro-batches, but it has {value.shape[dim]} there; pass at least {chunks} "
                f"(or a 0-dim tensor or a non-tensor, given to every micro-batch as it is, or "
                f"name it _Replicate() in kwargs_chunk_spec)")
    if dim is not None and batch_rows is not None and not splits_alike(
            value.shape[dim], batch_rows, chunks):
        return (f"a tensor passed by keyword is split along dim {dim} into chunks={chunks} "
                f"micro-batches of {part_rows(value.shape[dim], chunks)} rows, but the batch's "
                f"{batch_rows} rows into {part_rows(batch_rows, chunks)}: its micro-batches "
                f"would not hold the batch's samples; give it {batch_rows} there (or name it "
                f"_Replicate() in kwargs_chunk_spec, passed whole to every micro-batch)")
    if value.requires_grad:
        return ("a tensor passed by keyword must not require grad (only the positional inputs "
                "get their gradient back); pass it positionally or detach it")
    return None


def target_chunk_dims(target_chunk_spec, what: str):
    """``target_chunk_spec`` (a schedule's option, in the form of torch's chunk specs:
    ``TensorChunkSpec(dim)``, ``_Replicate()``, or a tuple, list or dict of them matching the
    target's structure) as split dimensions: an int, ``None`` (passed whole to every
    micro-batch) or the same structure of these. ``None`` (the default) is ``0``: every
    tensor of the target split along dim 0 with the batch. Raises a ValueError naming an
    entry that is none of these. Local."""
    if target_chunk_spec is None:
        return 0
    try:
        return _spec_dims(target_chunk_spec)
    except TypeError as error:
        raise ValueError(f"{what}(target_chunk_spec={target_chunk_spec!r}): {error} is not a "
                         f"chunk spec; expected TensorChunkSpec(dim) (the target's tensors "
                         f"split along dim with the batch) or _Replicate() (passed whole to "
                         f"every micro-batch: a class-weight tensor, a lookup table), or a "
                         f"tuple, list or dict of them matching the target's structure"
                         ) from None


def split_target(target, chunks: int, dims=0) -> list:
    """``target`` per micro-batch, as ``torch.distributed.pipelining`` splits a tensor target:
    each tensor with a batch dimension cut into ``chunks`` views along dim 0 (inside tuples,
    lists and dicts too, as keyword arguments are), or along the dimension ``dims``
    (:func:`target_chunk_dims`) gives it, or passed whole where ``dims`` gives ``None``; other
    values go to every micro-batch as they are. Views, no copies."""
    return _split_value(target, chunks, dims)


def target_rows(target, dims=0) -> Optional[int]:
    """The size, along its split dimension, of ``target``'s first tensor that is split
    (``None``: none is)."""
    leaf_dims = _leaf_dims(target, dims) or []
    rows = [leaf.shape[dim] for leaf, dim in zip(tree_flatten(target)[0], leaf_dims)
            if _splits(leaf, dim) and -leaf.dim() <= dim < leaf.dim()]
    return rows[0] if rows else None


def target_split_problems(target, chunks: int, batch_rows: Optional[int] = None,
                          dims=0) -> list[str]:
    """What keeps :func:`split_target` from cutting ``target`` as the batch is cut: a tensor
    target without a batch dimension, a tensor (nested ones too) with fewer rows than
    ``chunks`` along its split dimension, or, given the batch's rows, one whose micro-batches
    would not hold the targets of the batch's micro-batches' samples (:func:`splits_alike`: a
    target flattened over the batch's rows, ``(batch * seq,)``, fits only where ``chunks``
    divides the batch); a ``dims`` structure that is not the target's. Tensors ``dims``
    passes whole are not checked."""
    leaf_dims = _leaf_dims(target, dims)
    if leaf_dims is None:
        return [f"target_chunk_spec gives the target a structure of specs {dims!r} that is not "
                f"its value's ({_structure(target)}); give one spec per tensor, nested as the "
                f"target is, or one spec for all of them"]
    if isinstance(target, torch.Tensor) and target.dim() == 0 and dims is not None:
        return [f"target of shape () cannot be split into chunks={chunks} micro-batches along "
                f"dim 0 (it needs at least {chunks} rows; or pass it whole with "
                f"target_chunk_spec=_Replicate())"]
    problems = []
    for (path, leaf), dim in zip(tree_flatten_with_path(target)[0], leaf_dims):
        if _splits(leaf, dim):
            problem = _target_leaf_problem(leaf, dim, chunks, batch_rows)
            if problem:
                problems.append(f"target{keystr(path)} of shape {tuple(leaf.shape)} {problem}")
    return problems


_WHOLE_HINT = ("; a tensor that is not per-sample (a class-weight tensor) goes whole to every "
               "micro-batch with target_chunk_spec=_Replicate() at its place")


def _target_leaf_problem(leaf: torch.Tensor, dim: int, chunks: int,
                         batch_rows: Optional[int]) -> Optional[str]:
    if not -leaf.dim() <= dim < leaf.dim():
        return f"has no dim {dim}, along which target_chunk_spec splits it"
    rows = leaf.shape[dim]
    if rows < chunks:
        return (f"cannot be split into chunks={chunks} micro-batches along dim {dim} (it needs "
                f"at least {chunks} rows there){_WHOLE_HINT}")
    if batch_rows is not None and not splits_alike(rows, batch_rows, chunks):
        return (f"is cut along dim {dim} into chunks={chunks} micro-batches of "
                f"{part_rows(rows, chunks)} rows, but the batch's {batch_rows} rows into "
                f"{part_rows(batch_rows, chunks)}: its micro-batches would not hold the targets "
                f"of the batch's samples; give it the batch's {batch_rows} rows (keep a "
                f"(batch, seq) target whole and flatten it inside loss_fn){_WHOLE_HINT}")
    return None


def positional_chunk_spec_problem(args_chunk_spec) -> Optional[str]:
    """Why torch's ``args_chunk_spec`` does not describe what shardkit does with the batch
    (every positional tensor split along dim 0): ``None`` for ``None`` or a tuple of
    ``TensorChunkSpec(0)``. Local."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

    if args_chunk_spec is None:
        return None
    leaves, _ = tree_flatten(args_chunk_spec)
    if isinstance(args_chunk_spec, (tuple, list)) and leaves and all(
            isinstance(spec, TensorChunkSpec) and spec.split_dim == 0 for spec in leaves):
        return None
    return ("shardkit's schedules split every tensor argument along dim 0 into equal chunks "
            "(a tuple of TensorChunkSpec(0), or None); split along another dimension, or "
            "pass a tensor whole to every micro-batch by keyword (kwargs_chunk_spec="
            "{name: _Replicate()})")


_PLAIN_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _leaf_signature(value, by_value: bool):
    if _has_batch_dim(value):
        return value.dtype, tuple(value.shape), value.requires_grad
    if not by_value:
        return type(value)
    if isinstance(value, _PLAIN_VALUES):
        return type(value), value
    # a 0-dim tensor or another object: reading or comparing its value may cost a device
    # sync or be undefined, and it may decide shapes (`x[:, :keep]`): never the same
    return object()


def keyword_signature(kwargs: dict, by_value: bool = True) -> tuple:
    """What a stage's output shapes may follow from in ``kwargs``: their structure, each
    tensor's dtype, shape and ``requires_grad``, and each plain value (``None``, numbers,
    strings) itself. Two signatures are equal (``==``) only when all of these are; one with a
    0-dim tensor or another kind of object equals no other. ``by_value=False`` (stages that
    announce output shapes that change with the data themselves): each value's type instead
    of the value, so such a signature stays equal from step to step."""
    leaves, spec = tree_flatten({key: kwargs[key] for key in sorted(kwargs)})
    return spec, tuple(_leaf_signature(v, by_value) for v in leaves)


def mergeable_output_problem(output, first) -> Optional[str]:
    """Why :func:`merge_outputs` cannot concatenate ``output`` with micro-batch 0's output
    ``first`` (``None``: ``output`` is micro-batch 0's): a leaf that is not a tensor with a
    batch dimension, another structure than ``first``'s, or a tensor whose dimensions after
    the first differ from ``first``'s. ``None`` when it can."""
    leaves, spec = tree_flatten(output)
    if not leaves or not all(_has_batch_dim(v) for v in leaves):
        kinds = [type(v).__name__ if not isinstance(v, torch.Tensor) else "0-dim tensor"
                 if v.dim() == 0 else "tensor" for v in leaves]
        return (f"it returned {type(output).__name__} holding {kinds}; return a tensor, or "
                f"tuples, lists or dicts of tensors with a batch dimension")
    if first is None:
        return None
    if spec != tree_flatten(first)[1]:
        return "its structure differs from micro-batch 0's output"
    named = tree_flatten_with_path(output)[0]
    for (path, leaf), earlier in zip(named, tree_flatten(first)[0]):
        if leaf.shape[1:] != earlier.shape[1:]:
            return (f"its tensor output{keystr(path)} has shape {tuple(leaf.shape)}, micro-batch "
                    f"0's {tuple(earlier.shape)}: only dim 0 may differ")
    return None


def merge_outputs(outputs: list):
    """The micro-batches' outputs concatenated along dim 0, tensor by tensor, in the structure
    of each output (a tensor, or tuples, lists and dicts of tensors), as
    ``torch.distributed.pipelining``'s default ``merge_chunks``."""
    flat = [tree_flatten(output)[0] for output in outputs]
    return tree_unflatten([torch.cat(parts) for parts in zip(*flat)],
                          tree_flatten(outputs[0])[1])
