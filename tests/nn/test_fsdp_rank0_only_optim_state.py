"""FSDP's full optimizer state dicts under ``rank0_only``: memory where torch FSDP1 keeps it.

- Loading (``optim_state_dict_to_load`` under ``FullOptimStateDictConfig(rank0_only=True)``,
  ``scatter_full_optim_state_dict``): the dict given on rank 0 used to arrive whole on every
  rank before any rank cut its rows (rank 1's peak: the full state plus its shard); now each
  large tensor is cut as it arrives (its shard plus one tensor in flight, as torch FSDP1's).
- Saving (``FSDP.optim_state_dict`` under ``rank0_only``, ``full_optim_state_dict``,
  FairScale's ``gather_full_optim_state_dict``): the full state used to be all-gathered on
  every rank and dropped off rank 0; now it is gathered to rank 0 alone.
- ``rank0_only`` under NO_SHARD (every rank its own group's rank 0) gave every rank the full
  dict; now rank 0 alone, as torch FSDP1.

Peaks are the process's peak resident memory (``VmHWM``, reset through ``clear_refs``) with
glibc returning every large free block at once (a fixed mmap threshold). One world of 2.
"""

import ctypes
import gc
import os
import re

import pytest
import torch
import torch.nn as nn

from shardkit.testing import world_fixture

world2 = world_fixture(2)

MB = 1 << 20
LAYERS, WIDTH = 8, 1024          # Adam over 8.4M parameters: a 67 MB state, 4 MB tensors
SLACK = 6 * MB                   # the interpreter's own allocations while a call runs

needs_clear_refs = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                                      reason="needs /proc/self/clear_refs to reset the peak RSS")


# ---------------------------------------------------------------------- rank-side helpers


def _return_large_frees_at_once() -> None:
    """glibc keeps freed blocks under its (self-raising) mmap threshold in the heap, which
    then hides later allocations from the peak; a fixed threshold returns them."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


def _resident() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


class _Peak:
    """The peak resident memory above the start of the block, in bytes."""

    def __enter__(self):
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.start = _resident()
        return self

    def __exit__(self, *exc):
        peak = re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)
        self.bytes = int(peak) * 1024 - self.start


def _trained(**fsdp_kwargs):
    """Nested units over ``LAYERS`` square Linears after one Adam step."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(*[FSDP(nn.Linear(WIDTH, WIDTH), **fsdp_kwargs)
                                 for _ in range(LAYERS)]), **fsdp_kwargs)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, WIDTH)).sum().backward()
    optim.step()
    return model, optim


def _rank0_only(model):
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    return FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                FullOptimStateDictConfig(rank0_only=True))


def _state_bytes(osd: dict) -> int:
    return sum(v.numel() * v.element_size() for entry in osd["state"].values()
               for v in entry.values() if torch.is_tensor(v))


def _same_state(optim, expected: dict) -> bool:
    got = optim.state_dict()["state"]
    return sorted(got) == sorted(expected) and all(
        torch.equal(v, got[i][k]) for i, entry in expected.items() for k, v in entry.items())


def _rank0_only_memory() -> dict:
    """Peaks of the rank0_only saves and loads on this rank, with what they must stay under:
    the saves (off rank 0) this rank's shards; the loads its shard plus one tensor in flight.
    The loaded state must be the saved one, bit for bit."""
    import torch.distributed as dist

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    _return_large_frees_at_once()
    rank = dist.get_rank()
    model, optim = _trained()
    saved = {i: {k: v.clone() for k, v in entry.items()}
             for i, entry in optim.state_dict()["state"].items()}
    out = {"shard": _state_bytes(optim.state_dict()), "tensor": WIDTH * WIDTH * 4, "peaks": {}}
    with _rank0_only(model):
        with _Peak() as peak:
            osd = FSDP.optim_state_dict(model, optim)
        out["peaks"]["optim_state_dict"] = peak.bytes
        out["keys"] = len(osd.get("state", {}))
        with _Peak() as peak:
            full = FSDP.full_optim_state_dict(model, optim)
        out["peaks"]["full_optim_state_dict"] = peak.bytes
        with _Peak() as peak:
            gathered = model.gather_full_optim_state_dict(optim)
        out["peaks"]["gather_full_optim_state_dict"] = peak.bytes
        out["gathered on rank 0 alone"] = (gathered is not None) == (rank == 0)
        loaded = torch.optim.Adam(model.parameters(), lr=1e-3)
        with _Peak() as peak:
            FSDP.optim_state_dict_to_load(model, loaded, osd if rank == 0 else {},
                                          load_directly=True)
        out["peaks"]["optim_state_dict_to_load"] = peak.bytes
        out["loaded"] = _same_state(loaded, saved)
        scattered = torch.optim.Adam(model.parameters(), lr=1e-3)
        del osd, gathered
        with _Peak() as peak:
            part = FSDP.scatter_full_optim_state_dict(full if rank == 0 else None, model,
                                                      optim=scattered)
        out["peaks"]["scatter_full_optim_state_dict"] = peak.bytes
        scattered.load_state_dict(part)
        out["scattered"] = _same_state(scattered, saved)
    return out


@needs_clear_refs
def test_rank0_only_saves_and_loads_keep_the_full_state_off_other_ranks(world2):
    rank0, rank1 = world2.run(_rank0_only_memory)
    for out in (rank0, rank1):
        assert out["loaded"] and out["scattered"] and out["gathered on rank 0 alone"], out
    assert rank0["keys"] == 2 * LAYERS and rank1["keys"] == 0, (rank0["keys"], rank1["keys"])
    peaks, shard, tensor = rank1["peaks"], rank1["shard"], rank1["tensor"]
    # saving: rank 1 sends its rows and keeps nothing (was the full state, 2x its shard)
    for call in ("optim_state_dict", "full_optim_state_dict", "gather_full_optim_state_dict"):
        assert peaks[call] < SLACK, (call, peaks[call] / MB)
    # loading: its shard plus one full tensor in flight (was the full state beside its shard)
    for call in ("optim_state_dict_to_load", "scatter_full_optim_state_dict"):
        assert peaks[call] < shard + 2 * tensor + SLACK, (call, peaks[call] / MB, shard / MB)


def _no_shard_rank0_only() -> dict:
    """NO_SHARD (every rank its own shard group's rank 0): rank0_only's dict on rank 0 alone,
    and it loads back on every rank from rank 0's copy; every rank naming itself
    ``gather_full_optim_state_dict``'s recipient gets the full dict (FairScale's
    all-gather allowed it)."""
    import torch.distributed as dist

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import ShardingStrategy
    rank = dist.get_rank()
    model, optim = _trained(sharding_strategy=ShardingStrategy.NO_SHARD)
    saved = optim.state_dict()["state"]
    with _rank0_only(model):
        osd = FSDP.optim_state_dict(model, optim)
        full = FSDP.full_optim_state_dict(model, optim)
        loaded = torch.optim.Adam(model.parameters(), lr=1e-3)
        FSDP.optim_state_dict_to_load(model, loaded, osd if rank == 0 else {},
                                      load_directly=True)
    fsdp = model.sharded_units()[0]  # FairScale's call on the root, every rank its recipient
    mine = fsdp.gather_full_optim_state_dict(optim, recipient_rank=fsdp.rank)
    return {"keys": len(osd.get("state", {})), "full keys": len(full.get("state", {})),
            "loaded": _same_state(loaded, saved),
            "own recipient": mine is not None and len(mine["state"]) == 2 * LAYERS}


def test_rank0_only_under_no_shard_gives_the_dict_to_rank_0_alone(world2):
    rank0, rank1 = world2.run(_no_shard_rank0_only)
    assert (rank0["keys"], rank0["full keys"]) == (2 * LAYERS, 2 * LAYERS), rank0
    assert (rank1["keys"], rank1["full keys"]) == (0, 0), rank1
    for out in (rank0, rank1):
        assert out["loaded"] and out["own recipient"], out


def _refused_on_one_rank() -> dict:
    """``gather_full_optim_state_dict`` with an argument only rank 1 gets wrong (a recipient
    out of range, an LBFGS optimizer): each call's error on this rank, then a good call's
    result (the ranks are still in step)."""
    import torch.distributed as dist

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = FSDP(nn.Linear(4, 3))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    out = {}
    for case, args in (("recipient", (optim, 7 if rank == 1 else 0)),
                       ("optimizer", (torch.optim.LBFGS(model.parameters()) if rank == 1
                                      else optim, 0))):
        try:
            model.gather_full_optim_state_dict(*args)
            out[case] = "no error"
        except (TypeError, ValueError) as error:
            out[case] = f"{type(error).__name__}: {error}"
    lbfgs = torch.optim.LBFGS(model.parameters()) if rank == 1 else optim
    for case, call in (("full_optim_state_dict", lambda: FSDP.full_optim_state_dict(model, lbfgs)),
                       ("not rank0_only", lambda: FSDP.full_optim_state_dict(
                           model, lbfgs, rank0_only=False))):
        try:
            call()
            out[case] = "no error"
        except (TypeError, ValueError) as error:
            out[case] = f"{type(error).__name__}: {error}"
    full = model.gather_full_optim_state_dict(optim, recipient_rank=0)
    out["then"] = None if full is None else sorted(full["state"])
    return out


def test_an_argument_refused_on_one_rank_raises_on_every_rank(world2):
    """Rank 1 alone passing a bad ``recipient_rank`` or optimizer raised there while rank 0
    waited in the gather (until the collective timed out); so did torch FSDP1's
    ``full_optim_state_dict`` given an LBFGS on rank 1 only."""
    rank0, rank1 = world2.run(_refused_on_one_rank)
    assert "recipient_rank=7" in rank1["recipient"] and "0..1" in rank1["recipient"], rank1
    for case in ("optimizer", "full_optim_state_dict", "not rank0_only"):
        assert rank1[case].startswith("TypeError") and "LBFGS" in rank1[case], rank1
    for case in ("recipient", "optimizer", "full_optim_state_dict", "not rank0_only"):
        assert rank0[case].startswith("ValueError") and "group rank(s) [1]" in rank0[case], \
            rank0
    assert rank0["then"] == [0, 1] and rank1["then"] is None, (rank0["then"], rank1["then"])
