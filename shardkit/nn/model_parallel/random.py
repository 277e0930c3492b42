"""Random-number streams for tensor-parallel training.

Two streams per rank:

- the **default** torch generators (CPU, and CUDA when present), seeded identically on every
  tensor-parallel rank, so dropout on replicated activations (outside parallel regions) draws
  the same mask everywhere and the replicas stay equal;
- a **model-parallel** stream, seeded differently per tensor-parallel rank, entered with
  ``get_model_parallel_rng_tracker().fork()``, so dropout on sharded activations (attention
  heads, MLP columns) draws independent masks on each shard, as one unsplit layer would.

Usage::

    model_parallel_manual_seed(1234)            # every rank, after initialize_model_parallel
    x = dropout(x)                              # same mask on every tensor-parallel rank
    with get_model_parallel_rng_tracker().fork():
        h = dropout(h_shard)                    # a different mask on each tensor-parallel rank

Activation checkpointing replays both streams: the recomputation of a region of
:func:`checkpoint`, :mod:`shardkit.nn.checkpoint` or ``torch.utils.checkpoint`` (reentrant or
not, with ``preserve_rng_state=True``, its default) draws the first forward's dropout masks, and
leaves the streams where it found them.

Memory: one generator state per stream (a few KB; per ``torch.utils.checkpoint`` region that
forks, one more copy of the streams until the region's graph is freed); no communication.
Each ``fork()`` walks the Python call stack once to find ``torch.utils.checkpoint`` regions.
"""

from __future__ import annotations

import contextlib
import inspect
import numbers
import sys
import threading
from typing import Iterator

import torch

from shardkit.nn.model_parallel.initialize import get_model_parallel_rank

__all__ = ["RNGStatesTracker", "get_model_parallel_rng_tracker", "model_parallel_manual_seed",
           "MODEL_PARALLEL_RNG", "MODEL_PARALLEL_SEED_OFFSET",
           # FairScale's (and Megatron's) names for the same objects
           "CudaRNGStatesTracker", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed",
           "checkpoint", "CheckpointFunction"]
# FairScale's private helper ``_set_cuda_rng_state`` is provided too (see its docstring).

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Keeps the tensor-parallel streams away from the default stream's seed.
MODEL_PARALLEL_SEED_OFFSET = 2718


class _GeneratorState:
    """The CPU state and, when CUDA is present, the current device's CUDA state."""

    def __init__(self, cpu: torch.Tensor, cuda: torch.Tensor | None):
        self.cpu, self.cuda = cpu, cuda

    @classmethod
    def capture(cls) -> "_GeneratorState":
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        return cls(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)

    def packed(self) -> torch.Tensor:
        """One uint8 tensor: the CPU state, then the CUDA state when there is one (a plain
        tensor, as Megatron's and FairScale's trackers give, so a checkpoint holding it loads
        under ``torch.load(weights_only=True)``)."""
        return self.cpu.clone() if self.cuda is None else torch.cat([self.cpu, self.cuda.cpu()])

    @classmethod
    def unpacked(cls, name: str, value,
                 call: str = "RNGStatesTracker.set_states") -> "_GeneratorState":
        """The state ``value`` holds: a :meth:`packed` tensor (or one from an earlier
        ``get_states``). TypeError / ValueError naming ``call`` and stream ``name`` for
        anything else."""
        if isinstance(value, _GeneratorState):
            return value
        cpu_bytes = torch.get_rng_state().numel()
        if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or \
                value.dim() != 1 or value.numel() < cpu_bytes:
            raise TypeError(f"{call}: stream {name!r} holds "
                            f"{_described(value)}; expected the uint8 tensor get_states() gave "
                            f"(at least {cpu_bytes} bytes: the CPU generator's state, then the "
                            f"CUDA generator's)")
        value = value.cpu()
        rest = value[cpu_bytes:]
        if rest.numel() and not torch.cuda.is_available():
            raise ValueError(f"{call}: stream {name!r} holds a CUDA "
                             f"generator state, and this process has no CUDA")
        if not rest.numel() and torch.cuda.is_available():
            # without one, a fork would leave the CUDA generator on the default stream: the
            # same dropout masks on every tensor-parallel rank, drawn again after the fork
            raise ValueError(f"{call}: stream {name!r} holds no CUDA "
                             f"generator state (saved without CUDA), and this process has CUDA")
        cpu = value[:cpu_bytes].clone()
        try:  # checked here, so that set_states refuses it and changes nothing
            torch.Generator().set_state(cpu)
        except RuntimeError as error:
            raise ValueError(f"{call}: stream {name!r} holds no valid CPU "
                             f"generator state ({error})") from None
        return cls(cpu, rest.clone() if rest.numel() else None)


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


class RNGStatesTracker:
    """Named generator states that can be swapped in for a block with :meth:`fork`.

    Each state covers the CPU generator and the current CUDA device's generator (when CUDA is
    available). A fork draws from the named stream and leaves the default stream exactly where
    it was, so code outside forks is unaffected by how much randomness forks consumed.
    """

    def __init__(self):
        self._shared_states: dict[str, _GeneratorState] = {}
        # per thread: its open forks, its recomputations, and the copy of the streams a
        # recomputation swapped in (threads that fork at once must not see each other's)
        self._local = threading.local()
        self._seeds: set[int] = set()

    def _thread(self):
        """This thread's ``open`` forks (outermost first: [stream name, the generators' state
        at its entry]), the ``torch.utils.checkpoint`` recomputations whose copies of the
        streams are swapped in (``recomputing``), and those copies (``states``; ``None``: the
        shared streams)."""
        local = self._local
        if not hasattr(local, "open"):
            local.open, local.recomputing, local.states = [], [], None
        return local

    @property
    def _states(self) -> dict:
        local = self._thread()
        return self._shared_states if local.states is None else local.states

    @_states.setter
    def _states(self, value: dict) -> None:
        local = self._thread()
        if local.states is None:
            self._shared_states = value
        else:
            local.states = value

    @property
    def _open(self) -> list:
        return self._thread().open

    @property
    def _recomputing(self) -> list:
        return self._thread().recomputing

    def _swap(self, states: dict, open_forks: list) -> tuple:
        """Swap this thread's view of the streams for ``states`` and ``open_forks``; returns
        what :meth:`_unswap` puts back."""
        local = self._thread()
        saved = local.states, local.open
        local.states, local.open = states, open_forks
        return saved

    def _unswap(self, saved: tuple) -> None:
        local = self._thread()
        local.states, local.open = saved

    def reset(self) -> None:
        """Forget every stream."""
        self._states.clear()
        self._seeds.clear()

    def names(self) -> list[str]:
        """Names of the streams tracked."""
        return list(self._states)

    def get_states(self) -> dict:
        """A new dict of the streams' current states, each a uint8 tensor (the CPU generator's
        state, then the CUDA generator's when CUDA is present) for :meth:`set_states`: e.g. to
        replay the same draws in an activation recomputation, or to save in a checkpoint as
        Megatron does (plain tensors: ``torch.load(weights_only=True)`` reads them). Inside a
        :meth:`fork`, that stream's state is where its draws have got to, not where the fork
        started."""
        return {name: self._live(name).packed() for name in self._states}

    def set_states(self, states: dict) -> None:
        """Replace the streams' states by ``states`` from :meth:`get_states` (checked first:
        a value that is not such a tensor is a TypeError naming its stream, and nothing
        changes)."""
        if not isinstance(states, dict):
            raise TypeError(f"RNGStatesTracker.set_states(states={_described(states)}): "
                            f"expected the dict get_states() gave")
        self._states = {name: _GeneratorState.unpacked(name, value)
                        for name, value in states.items()}

    def resume_states(self, saved: dict) -> None:
        """Continue the streams a checkpoint saved (``saved``: the saving process's
        :meth:`get_states`, as Megatron's ``rng_tracker_states``): each saved stream takes its
        saved state; a stream this tracker holds that the checkpoint lacks keeps its own.
        Checked first (see :meth:`states_to_resume`): on error nothing changes. Local."""
        self._states = {**self._states, **self.states_to_resume(saved)}

    def states_to_resume(self, saved: dict) -> dict:
        """What :meth:`resume_states` would set, changing nothing. Unlike :meth:`set_states`,
        the saving process's devices may differ from this one's, as a resume may run elsewhere
        (the default generators' checkpoint states load the same way): a saved CUDA state is
        dropped where this process has no CUDA; where it has CUDA and the checkpoint holds none
        (saved on CPU), the stream keeps this tracker's CUDA state of it. ``TypeError`` /
        ``ValueError`` naming the stream for a value that is no generator state, or for a
        CPU-saved stream this tracker does not hold in a process with CUDA (seed it first with
        :func:`model_parallel_manual_seed`)."""
        if not isinstance(saved, dict):
            raise TypeError(f"RNGStatesTracker.resume_states(saved={_described(saved)}): "
                            f"expected the dict get_states() gave")
        cpu_bytes = torch.get_rng_state().numel()
        resumed = {}
        for name, value in saved.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 \
                    and value.numel() >= cpu_bytes:
                value = self._on_this_process_devices(name, value.cpu(), cpu_bytes)
            resumed[name] = _GeneratorState.unpacked(name, value,
                                                     "RNGStatesTracker.resume_states")
        return resumed

    def _on_this_process_devices(self, name: str, packed: torch.Tensor,
                                 cpu_bytes: int) -> torch.Tensor:
        """``packed`` (a saved stream) with the CUDA part this process can take (see
        :meth:`states_to_resume`)."""
        has_cuda = torch.cuda.is_available()
        if packed.numel() > cpu_bytes and not has_cuda:
            return packed[:cpu_bytes]
        if packed.numel() == cpu_bytes and has_cuda:
            current = self._states.get(name)
            if current is None or current.cuda is None:
                raise ValueError(
                    f"RNGStatesTracker.resume_states: stream {name!r} was saved without a CUDA "
                    f"generator state (on CPU) and this tracker does not hold it; call "
                    f"model_parallel_manual_seed(seed) before loading, so that its CUDA draws "
                    f"start from the seed")
            return torch.cat([packed, current.cuda.cpu()])
        return packed

    def add(self, name: str, seed: int) -> None:
        """Start stream ``name`` from ``seed`` (both must be new to this tracker; the seed a
        Python or NumPy integer)."""
        seed = _as_seed("RNGStatesTracker.add", seed)
        if name in self._states:
            raise ValueError(f"RNGStatesTracker.add: stream name={name!r} already exists; "
                             f"existing streams are {self.names()}")
        if seed in self._seeds:
            raise ValueError(f"RNGStatesTracker.add: seed={seed} is already used by another "
                             f"stream; each stream needs its own seed")
        outside = _GeneratorState.capture()
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed(seed)  # the current device only, like the captured state
        self._states[name] = _GeneratorState.capture()
        outside.restore()
        self._seeds.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream is left untouched.
        A fork of a stream that is already forked (a layer that forks, called inside a fork of
        the same stream) goes on from where that stream's draws have got to, rather than
        repeating them. Inside a region of ``torch.utils.checkpoint`` (reentrant or not, with
        ``preserve_rng_state=True``, its default) the recomputation's forks draw what the first
        forward's drew, and the recomputation leaves the streams where it found them."""
        if name not in self._states:
            raise KeyError(f"RNGStatesTracker.fork: no stream named {name!r} (streams: "
                           f"{self.names()}); call model_parallel_manual_seed(seed) first")
        replay = self._torch_checkpoint_replay(name)
        try:
            start = self._live(name)
            outside = _GeneratorState.capture()
            start.restore()  # may raise (a bad state given to set_states): nothing is open yet
            self._open.append([name, outside])
            try:
                yield
            finally:
                # the state to go back to is read at exit: a nested fork of an outer stream may
                # have moved it on (see _set_live)
                _, outside = self._open.pop()
                if not self._set_live(name, _GeneratorState.capture()):
                    outside.restore()
        finally:
            if replay is not None:
                replay()

    def _torch_checkpoint_replay(self, name: str):
        """Make ``torch.utils.checkpoint`` replay the streams (it restores only the default
        generators). Each first forward of one of its regions that encloses this fork records
        the streams as they were at the region's entry (:meth:`_replay_point`; nothing forks
        between the entry and the region's first fork, so its first fork sees them unchanged);
        inside that region's recomputation the streams are swapped for the recomputation's own
        copy of them, started from that record and kept per backward pass, so its forks draw
        the first forward's masks and the streams outside stay where they were. Returns the
        call that swaps the streams back at the fork's exit, ``None`` when nothing was swapped."""
        regions = _torch_checkpoint_regions()
        if not regions:
            return None
        pending, inner = self._pending_recompute(regions)
        swap_back = None
        if pending is not None and name in pending[2]:
            key, copies, states, open_forks = pending
            saved = self._swap(states, open_forks)
            self._recomputing.append(key)

            def leave():
                self._recomputing.pop()
                copies[key[1]] = self._states, self._open
                self._unswap(saved)

            swap_back = leave
        for kind, region, preserved in regions[:inner]:  # first forwards (inside that one)
            if not hasattr(region, _REPLAY_POINT):
                setattr(region, _REPLAY_POINT, self._replay_point() if preserved else None)
        return swap_back

    def _pending_recompute(self, regions: list) -> tuple:
        """``(pending, inner)``: ``inner`` the index in ``regions`` of the innermost
        ``torch.utils.checkpoint`` recomputation running (``len(regions)`` if none);
        ``pending`` its ``(key, copies, states, open forks)`` to swap in, or ``None`` when there
        is none, its first forward recorded nothing, or it is swapped in already or a
        :meth:`_replaying` entered inside it replays the streams itself."""
        inner = next((i for i, (kind, _, _) in enumerate(regions) if kind == "recompute"),
                     len(regions))
        if inner == len(regions):
            return None, inner
        _, region, graph = regions[inner]
        point = getattr(region, _REPLAY_POINT, None)
        key = (id(region), graph)
        if point is None or (self._recomputing and self._recomputing[-1] in
                             (key, ("replaying", key))):
            return None, inner
        copies = getattr(region, _REPLAY_COPIES, None)
        if copies is None:
            copies = {}
            setattr(region, _REPLAY_COPIES, copies)
        states, open_forks = copies.get(graph) or (
            dict(point[0]), [list(entry) for entry in point[1]])
        return (key, copies, states, open_forks), inner

    def _replay_point(self) -> tuple:
        """What a recomputation of the code that runs from here needs in order to draw what
        it drew (see :meth:`_replaying`): the saved states and the open forks (inside a
        ``torch.utils.checkpoint`` recomputation, those it replays)."""
        pending, _ = self._pending_recompute(_torch_checkpoint_regions())
        states, open_forks = (self._states, self._open) if pending is None else pending[2:]
        return dict(states), [list(entry) for entry in open_forks]

    @contextlib.contextmanager
    def _replaying(self, point: tuple) -> Iterator[None]:
        """Run the block as if at ``point`` (from :meth:`_replay_point`): the forks open then are
        open again, so a nested fork of one of them goes on with it as in the first forward.
        The caller restores the generators themselves; the tracker is put back at exit."""
        saved = self._swap(dict(point[0]), [list(entry) for entry in point[1]])
        # a torch.utils.checkpoint recomputation running around this one leaves it alone
        regions = _torch_checkpoint_regions()
        inner = next((r for r in regions if r[0] == "recompute"), None)
        self._recomputing.append(("replaying", None if inner is None else
                                  (id(inner[1]), inner[2])))
        try:
            yield
        finally:
            self._recomputing.pop()
            self._unswap(saved)

    def _innermost_fork_of(self, name: str):
        """Index in the open forks of stream ``name``'s innermost fork, ``None`` if none."""
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][0] == name:
                return i
        return None

    def _live(self, name: str) -> _GeneratorState:
        """Where stream ``name``'s draws have got to: the generators' state if its fork is the
        innermost open one, the state at the entry of the next fork if an outer one is open,
        else the saved state."""
        i = self._innermost_fork_of(name)
        if i is None:
            return self._states[name]
        return _GeneratorState.capture() if i == len(self._open) - 1 else self._open[i + 1][1]

    def _set_live(self, name: str, state: _GeneratorState) -> bool:
        """Record ``state`` as where stream ``name`` has got to (see :meth:`_live`); True when
        that stream's fork is the innermost open one, so the generators now continue it."""
        i = self._innermost_fork_of(name)
        if i is None:
            self._states[name] = state
            return False
        if i == len(self._open) - 1:
            state.restore()
            return True
        self._open[i + 1][1] = state
        return False


# Attributes set on a torch.utils.checkpoint region (its autograd ctx or its _CheckpointFrame).
_REPLAY_POINT = "_shardkit_rng_replay_point"
_REPLAY_COPIES = "_shardkit_rng_replay_copies"
_TORCH_CHECKPOINT_CODES: dict | None = None


def _torch_checkpoint_codes() -> dict:
    """The code objects of torch.utils.checkpoint that run around a region's first forward and
    its recomputation (empty where this torch version's differ: no replay, torch's own
    behaviour)."""
    global _TORCH_CHECKPOINT_CODES
    if _TORCH_CHECKPOINT_CODES is None:
        codes = {}
        try:
            import torch.utils.checkpoint as tuc

            codes[inspect.unwrap(tuc.checkpoint).__code__] = "checkpoint"
            codes[tuc.CheckpointFunction.forward.__code__] = "reentrant forward"
            codes[tuc.CheckpointFunction.backward.__code__] = "reentrant backward"
            try:  # torch's composable checkpoint keeps its generator on the module's state
                from torch.distributed._composable import checkpoint as composable

                codes[torch.nn.Module._call_impl.__code__] = ("module", composable.state)
            except (ImportError, AttributeError):
                pass
            for const in tuc._checkpoint_hook.__init__.__code__.co_consts:
                if getattr(const, "co_name", None) == "unpack_hook":
                    codes[const] = "unpack"
                elif getattr(const, "co_name", None) == "pack_hook":
                    codes[const] = "pack"
        except (ImportError, AttributeError):
            codes = {}
        _TORCH_CHECKPOINT_CODES = codes
    return _TORCH_CHECKPOINT_CODES


def _torch_checkpoint_regions() -> list[tuple]:
    """The torch.utils.checkpoint regions running around the caller, innermost first: a first
    forward as ``("forward", region, preserve_rng_state)``, a recomputation as
    ``("recompute", region, graph task)``; ``region`` is the same object in both (the reentrant
    Function's ctx, or the non-reentrant _CheckpointFrame). Local; one walk over the stack."""
    codes = _torch_checkpoint_codes()
    if not codes:
        return []
    found = []
    try:  # a non-reentrant first forward run by hooks (torch's composable checkpoint)
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError):
        hooks = None
    if hooks is not None and codes.get(getattr(hooks[0], "__code__", None)) == "pack":
        cells = dict(zip(hooks[0].__code__.co_freevars, hooks[0].__closure__ or ()))
        if "frame" in cells:
            region = cells["frame"].cell_contents
            found.append(("forward", region, _preserves(region)))
    frame = sys._getframe(2)
    while frame is not None:
        kind = codes.get(frame.f_code)
        if kind is not None:
            local = frame.f_locals
            if kind == "checkpoint":
                gen = local.get("gen")
                inner = getattr(gen, "gi_frame", None)
                if inner is not None and "new_frame" in inner.f_locals:
                    region = inner.f_locals["new_frame"]
                    if not any(region is r for _, r, _ in found):
                        found.append(("forward", region,
                                      bool(inner.f_locals.get("preserve_rng_state"))))
            elif isinstance(kind, tuple):  # a module call: is it a composable region?
                try:
                    state = kind[1](local["self"])
                except Exception:
                    state = None
                inner = getattr(getattr(state, "_ac_generator", None), "gi_frame", None)
                if inner is not None and "new_frame" in inner.f_locals:
                    region = inner.f_locals["new_frame"]
                    if not any(region is r for _, r, _ in found):
                        found.append(("forward", region, _preserves(region)))
            elif kind == "reentrant forward":
                found.append(("forward", local["ctx"], bool(local.get("preserve_rng_state"))))
            elif kind == "reentrant backward":
                found.append(("recompute", local["ctx"], torch._C._current_graph_task_id()))
            elif kind == "unpack" and "frame" in local and "gid" in local:
                found.append(("recompute", local["frame"], local["gid"]))
        frame = frame.f_back
    return found


def _preserves(region) -> bool:
    """Whether non-reentrant region ``region`` (a _CheckpointFrame) replays the default
    generators: its recompute function closes over ``preserve_rng_state``."""
    fn = getattr(region, "recompute_fn", None)
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return False
    cells = dict(zip(code.co_freevars, fn.__closure__))
    return "preserve_rng_state" in cells and bool(cells["preserve_rng_state"].cell_contents)


def _as_seed(what: str, seed) -> int:
    """``seed`` as a Python int (a NumPy integer too, as ``torch.manual_seed`` takes it);
    ``TypeError`` naming ``what`` for anything else (a bool, a float, a string)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{what}(seed={seed!r}): seed must be an int ({type(seed).__name__} "
                        f"given)")
    return int(seed)


_TRACKER = RNGStatesTracker()


def _set_cuda_rng_state(new_state: torch.Tensor, device=-1) -> None:
    """FairScale's helper (its tests and Megatron-derived recomputation code call it): set the
    state of ``device``'s CUDA generator (``-1``: the current device; an int index, a string or a
    ``torch.device``). Without CUDA a ``RuntimeError`` that names ``torch.set_rng_state``, the
    CPU generator's equivalent. No communication."""
    if not torch.cuda.is_available():
        raise RuntimeError("_set_cuda_rng_state: CUDA is not available; set the CPU generator's "
                           "state with torch.set_rng_state(state) (shardkit's tracker forks the "
                           "CPU and CUDA generators together)")
    if device == -1:
        device = torch.device("cuda", torch.cuda.current_device())
    elif isinstance(device, (int, str)):
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    torch.cuda.set_rng_state(new_state, device)


def get_model_parallel_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker holding the model-parallel stream."""
    return _TRACKER


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """FairScale's name for :func:`get_model_parallel_rng_tracker` (the tracker covers the CPU
    generator too, so it works without CUDA)."""
    return _TRACKER


#: FairScale's name for :class:`RNGStatesTracker` (CPU and CUDA states, not only CUDA's).
CudaRNGStatesTracker = RNGStatesTracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """FairScale's name for :func:`model_parallel_manual_seed`. Unlike FairScale's, which seeds
    only CUDA (and does nothing without it), it seeds the CPU generator too and works on CPU."""
    model_parallel_manual_seed(seed)


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default generators with ``seed`` and the model-parallel stream with
    ``seed + 2718 + tensor_parallel_rank``. Call on every rank after
    :func:`~shardkit.nn.model_parallel.initialize.initialize_model_parallel`.

    Data-parallel replicas get the same streams (they hold the same shards); give pipeline
    stages or replicas different seeds yourself if you want them to differ.
    """
    seed = _as_seed("model_parallel_manual_seed", seed)
    tensor_rank = get_model_parallel_rank()
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tensor_rank)


def checkpoint(function, *args):
    """FairScale's (Megatron's) activation checkpointing of ``function(*args)``: the output
    now, the activations recomputed in backward, with the default generators and the
    model-parallel tracker's streams replayed as they were at the first forward, so dropout
    inside ``tracker.fork()`` draws the same masks in the recomputation; the recomputation
    consumes no randomness of the training that follows. shardkit's
    :func:`~shardkit.nn.checkpoint.checkpointed_call` (non-reentrant: gradients also reach
    parameters when no input requires grad; FairScale's reentrant one needs an input that
    does). Memory: ``args`` are kept until backward instead of the region's activations.
    No communication of its own (``function``'s collectives run again in the recomputation).
    """
    from shardkit.nn.checkpoint.checkpoint_activations import checkpointed_call

    return checkpointed_call(function, *args)


class CheckpointFunction:
    """FairScale's (Megatron's) spelling of :func:`checkpoint`:
    ``CheckpointFunction.apply(function, *args)`` is ``checkpoint(function, *args)``, same
    outputs, gradients, replayed generators, memory and communication. FairScale's is a
    reentrant ``torch.autograd.Function``; this one is not a Function (it cannot be
    subclassed to change ``forward``/``backward``), and, being non-reentrant, it also sends
    gradients to parameters when no input requires grad."""

    def __init__(self):
        raise TypeError("CheckpointFunction is not instantiated: call "
                        "CheckpointFunction.apply(function, *args)")

    @staticmethod
    def apply(function, *args):
        """``checkpoint(function, *args)`` (see :func:`checkpoint` for memory and
        communication)."""
        if not callable(function):
            raise TypeError(f"CheckpointFunction.apply(function={function!r}): expected the "
                            f"callable to checkpoint first, then its arguments")
        return checkpoint(function, *args)
