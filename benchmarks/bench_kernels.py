"""Benchmark the kernels of :mod:`shardkit.kernels` against torch baselines measured in the same
run: the AdamW step (shardkit's CPU path vs torch.optim.AdamW for-loop / foreach / fused) and
the rank-major packing (vs ``torch.cat`` + scale + cast), and the block-wise int8/int4
quantize-and-pack of the compressed collectives (vs pack + plain torch quantize ops; written to
``results/quantize.md`` with the block-size sweep behind ``DEFAULT_BLOCK``). On CUDA, the Triton
kernels vs torch's fused AdamW.

Every candidate runs once per round, rounds interleave the candidates (so drifts in machine load
hit all of them alike), and the table reports medians over rounds of the process's CPU time (wall
time on CUDA). Achieved bandwidth counts
28 bytes per parameter per AdamW step (read p, g, m, v; write p, m, v), as a fraction of the
bandwidth of a ``dst.copy_(src)`` moving the same bytes, interleaved in the same rounds.

    python -m benchmarks.bench_kernels            # 4M, 16M, 64M params, 1 thread
    python -m benchmarks.bench_kernels --quick    # 4M, 16M, fewer rounds, no 16M for-loop
    python -m benchmarks.bench_kernels --quantize-only   # only the quantization rows (~1 min)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from shardkit.kernels import (adamw_step, dequantize_sum, dequantize_unpack, pack_rank_major,
                              quant_layout, quantize_pack)
from shardkit.optim import FusedAdamW

ADAMW_BYTES_PER_PARAM = 28
COPY = "copy_ of 28 B/param (bandwidth reference)"
IN_PLACE = "in-place mul_ of 28 B/param (reference)"
RESULTS = Path(__file__).resolve().parent / "results" / "kernels.md"
QUANT_RESULTS = RESULTS.with_name("quantize.md")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(candidates: dict[str, Callable[[], None]], rounds: int,
                        device: torch.device) -> dict[str, float]:
    """Median seconds per call of each candidate; one warm-up call each first.

    Note: on CPU the clock is this process's CPU time, not wall time: the benchmark machine is
    shared, and wall time would add whatever time the scheduler gave to other processes. Memory
    stalls still count (a stalled core is busy). On CUDA it is wall time around a synchronize.
    """
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    for fn in candidates.values():
        fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            sync(device)
            start = clock()
            fn()
            sync(device)
            times[name].append(clock() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def copy_candidate(numel_bytes: int, device: torch.device) -> Callable[[], None]:
    """``dst.copy_(src)`` moving ``numel_bytes`` in total (half read, half written)."""
    src = torch.randn(numel_bytes // 8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def in_place_candidate(numel_bytes: int, device: torch.device) -> Callable[[], None]:
    """``x.mul_(1.0)`` moving ``numel_bytes`` (half read, half written back in place, as the
    optimizer step does; a copy also has to fetch each destination line before writing it)."""
    x = torch.randn(numel_bytes // 8, device=device)
    return lambda: x.mul_(1.0)


def adamw_candidates(numel: int, device: torch.device) -> dict[str, Callable[[], None]]:
    """One flat fp32 parameter of ``numel`` elements with a gradient, stepped by each contender.

    The parameter and gradient are shared; each optimizer keeps its own state (8 B/param),
    except ``adamw_step``, which steps torch fused's state buffers.

    Note: on this (virtualised) machine two identical kernels on different buffers of the same
    size differ by up to ~20% depending on where the buffers landed in physical memory, so the
    flat kernel runs on exactly the memory torch fused runs on: its ratio measures code, not
    placement. FusedAdamW keeps its own flat buffers and carries that placement noise.
    """
    param = torch.nn.Parameter(torch.randn(numel, device=device) * 0.02)
    param.grad = torch.randn(numel, device=device) * 1e-3
    kw = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    torch_opts = {"torch for-loop": torch.optim.AdamW([param], foreach=False, **kw),
                  "torch foreach": torch.optim.AdamW([param], foreach=True, **kw),
                  "torch fused": torch.optim.AdamW([param], fused=True, **kw)}
    torch_opts["torch fused"].step()  # creates the state buffers shared below
    fused_state = torch_opts["torch fused"].state[param]
    exp_avg, exp_avg_sq = fused_state["exp_avg"], fused_state["exp_avg_sq"]
    step = [0]

    def shardkit_flat():
        step[0] += 1
        adamw_step(param.data, param.grad, exp_avg, exp_avg_sq, step=step[0], lr=kw["lr"],
                   beta1=0.9, beta2=0.999, eps=kw["eps"], weight_decay=kw["weight_decay"])

    fused_adamw = FusedAdamW([param], **kw)
    candidates = {name: opt.step for name, opt in torch_opts.items()}
    candidates["shardkit adamw_step (same buffers)"] = shardkit_flat
    candidates["shardkit FusedAdamW"] = fused_adamw.step
    return candidates


SLOW = ("torch for-loop", "torch foreach")


def bench_adamw(sizes, rounds, device, skip_slow) -> list[dict]:
    """Each size, two interleaved sets, each with torch fused as its own baseline:

    * the fused contenders with the copy_ and in-place references, ``rounds`` rounds;
    * torch's for-loop and foreach paths, ``rounds // 3`` rounds (they take 5-10x longer, and
      their big temporaries churn page mappings, which would disturb the close comparison).
    """
    rows = []
    for numel in sizes:
        candidates = adamw_candidates(numel, device)
        slow = {name: candidates.pop(name) for name in SLOW}
        if skip_slow and numel > 4 * 2**20:
            del slow["torch for-loop"]
        slow["torch fused"] = candidates["torch fused"]
        candidates[COPY] = copy_candidate(ADAMW_BYTES_PER_PARAM * numel, device)
        candidates[IN_PLACE] = in_place_candidate(ADAMW_BYTES_PER_PARAM * numel, device)
        medians = interleaved_medians(candidates, rounds, device)
        slow_medians = interleaved_medians(slow, max(3, rounds // 3), device)
        base, copy_seconds, in_place_seconds = medians["torch fused"], medians[COPY], medians[
            IN_PLACE]
        ratios = {name: seconds / base for name, seconds in medians.items()}
        ratios.update({name: seconds / slow_medians["torch fused"]
                       for name, seconds in slow_medians.items() if name in SLOW})
        for name, ratio in sorted(ratios.items(), key=lambda item: item[1], reverse=True):
            seconds = ratio * base  # in the units of the main set
            rows.append(dict(params=numel, candidate=name, ms=seconds * 1e3, ratio=ratio,
                             bw_fraction=copy_seconds / seconds,
                             in_place_fraction=in_place_seconds / seconds,
                             gbps=ADAMW_BYTES_PER_PARAM * numel / seconds / 1e9))
        del candidates, slow
    return rows


def bench_model_params(rounds, device) -> list[dict]:
    """FusedAdamW vs torch's fused AdamW over the reference GPT's parameters (many tensors)."""
    from shardkit.models import GPT, reference_gpt_config
    params = list(GPT(reference_gpt_config(), seed=0).to(device).parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    numel = sum(p.numel() for p in params)
    medians = interleaved_medians({"torch fused": torch.optim.AdamW(params, fused=True).step,
                                   "shardkit FusedAdamW": FusedAdamW(params).step},
                                  rounds, device)
    return [dict(params=numel, tensors=len(params), candidate=name, ms=seconds * 1e3,
                 ratio=seconds / medians["torch fused"]) for name, seconds in medians.items()]


def gradient_like_tensors(numel: int, count: int, device) -> list[torch.Tensor]:
    """``count`` tensors of uneven sizes summing to about ``numel`` (like a model's gradients)."""
    weights = [1 + (i * 7919) % 13 for i in range(count)]
    total = sum(weights)
    return [torch.randn(max(1, numel * w // total), device=device) for w in weights]


def bench_packing(numel, world_size, rounds, device) -> list[dict]:
    tensors = gradient_like_tensors(numel, 48, device)
    scale = 1.0 / world_size
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        def baseline():
            torch.cat([t.reshape(-1) for t in tensors]).mul_(scale).to(dtype)

        def shardkit_pack():
            pack_rank_major(tensors, world_size, scale=scale, dtype=dtype)

        out = pack_rank_major(tensors, world_size, dtype=dtype)

        def shardkit_pack_into_out():
            pack_rank_major(tensors, world_size, scale=scale, dtype=dtype, out=out)

        medians = interleaved_medians({"torch.cat + scale + cast": baseline,
                                       "shardkit pack_rank_major": shardkit_pack,
                                       "shardkit pack_rank_major(out=reused buffer)":
                                           shardkit_pack_into_out}, rounds, device)
        base = medians["torch.cat + scale + cast"]
        for name, seconds in medians.items():
            rows.append(dict(params=sum(t.numel() for t in tensors), candidate=name,
                             dtype=str(dtype).replace("torch.", ""), ms=seconds * 1e3,
                             ratio=seconds / base))
    return rows


def torch_quantize_reference(tensors, world_size, bits, block):
    """The unfused plain-torch way: pack rank-major in fp32, then quantize block by block."""
    qmax = 127 if bits == 8 else 7
    packed = pack_rank_major(tensors, world_size, dtype=torch.float32).view(world_size, -1)
    blocks = torch.nn.functional.pad(packed, (0, -packed.shape[1] % block)).view(
        world_size, -1, block)
    scales = blocks.abs().amax(-1, keepdim=True) / qmax
    codes = torch.round(blocks / torch.where(scales > 0, scales, 1.0)).clamp(-qmax, qmax)
    if bits == 8:
        return codes.to(torch.int8), scales
    nibbles = (codes + 8).to(torch.uint8).view(world_size, -1, 2)
    return nibbles[..., 0] | (nibbles[..., 1] << 4), scales


def bench_quantize(numel, world_size, rounds, device, blocks=(256,),
                   dtypes=(torch.float32, torch.bfloat16)) -> list[dict]:
    """Quantize-and-pack (and the receiving side's dequantize-and-sum) vs the plain-torch
    reference, fp32 and bf16 gradients, int8 and int4. GB/s count bytes read (the values) plus
    bytes written (codes and scales); dequantize-and-sum reads the ``N`` segments' bytes and
    writes fp32. Also reports the bytes ratio against fp32 and the RMS error relative to the
    RMS value."""
    rows = []
    base_tensors = gradient_like_tensors(numel, 48, device)
    for dtype in dtypes:
        tensors = [t.to(dtype) for t in base_tensors]
        total = sum(t.numel() for t in tensors)
        for bits in (8, 4):
            for block in blocks:
                layout = quant_layout([t.numel() for t in tensors], world_size, bits=bits,
                                      block=block)
                out = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
                summed = torch.empty(layout.segment_numel, device=device)

                def fused():
                    quantize_pack(tensors, layout, out=out, check_finite=False)

                def receive():
                    dequantize_sum(out, layout, sources=world_size, out=summed)

                candidates = {"plain torch: pack_rank_major + quantize ops":
                              lambda: torch_quantize_reference(tensors, world_size, bits, block),
                              "shardkit quantize_pack": fused,
                              "shardkit dequantize_sum (receiver, N segments)": receive}
                medians = interleaved_medians(candidates, rounds, device)
                fused()
                exact = torch.cat([t.float() for t in tensors])
                back = [torch.empty(t.shape, device=device) for t in tensors]
                dequantize_unpack(out, layout, back)
                rms = float((torch.cat(back) - exact).pow(2).mean().sqrt()
                            / exact.pow(2).mean().sqrt())
                base = medians["plain torch: pack_rank_major + quantize ops"]
                moved = {"shardkit dequantize_sum (receiver, N segments)":
                         layout.total_bytes + 4 * layout.segment_numel}
                for name, seconds in medians.items():
                    nbytes = moved.get(name, total * dtype.itemsize + layout.total_bytes)
                    rows.append(dict(params=total, dtype=str(dtype).replace("torch.", ""),
                                     bits=bits, block=block, candidate=name, ms=seconds * 1e3,
                                     ratio=seconds / base, gbps=nbytes / seconds / 1e9,
                                     wire=layout.ratio(torch.float32), rms=rms))
    return rows


def format_quantize(env, rows, sweep_rows) -> str:
    lines = ["# Quantize-and-pack benchmarks (ZeRO++ qwZ / qgZ kernels)", "", env, "",
             "48 gradient-like tensors, world size 4 (rank-major layout). GB/s: bytes read + "
             "written", "by the candidate (quantize: values in, codes + scales out; "
             "dequantize_sum: the N", "quantized segments in, fp32 shard out). wire: quantized "
             "bytes / fp32 bytes. rms:", "RMS round-trip error / RMS value.", "",
             "| params | dtype | bits | block | candidate | ms (median) | time / plain torch "
             "| GB/s | wire | rms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['params'] / 2**20:.1f}M | {r['dtype']} | {r['bits']} | "
                     f"{r['block']} | {r['candidate']} | {r['ms']:.2f} | {r['ratio']:.3f} | "
                     f"{r['gbps']:.2f} | {r['wire']:.3f} | {r['rms']:.4f} |")
    if sweep_rows:
        lines += ["", "## Block size (fp32 gradients, CPU path): the measurement behind "
                  "DEFAULT_BLOCK", "",
                  "DEFAULT_BLOCK = 256: the CPU time hardly depends on the block size; the "
                  "scale", "overhead (wire) falls and the error (rms) grows with the block, "
                  "and 256 is where", "the wire is within ~1% (int8) / ~2.5% (int4) of the "
                  "largest blocks' while the error", "stays clearly below theirs.", "",
                  "| bits | block | quantize_pack ms | dequantize_sum ms | wire | rms |",
                  "|---|---|---|---|---|---|"]
        by_key: dict = {}
        for r in sweep_rows:
            if r["dtype"] == "float32":
                by_key.setdefault((r["bits"], r["block"]), {})[r["candidate"]] = r
        for (bits, block), rs in sorted(by_key.items()):
            q = rs["shardkit quantize_pack"]
            d = rs["shardkit dequantize_sum (receiver, N segments)"]
            lines.append(f"| {bits} | {block} | {q['ms']:.2f} | {d['ms']:.2f} | "
                         f"{q['wire']:.3f} | {q['rms']:.4f} |")
    return "\n".join(lines) + "\n"


def small_call_overhead(rounds: int) -> list[dict]:
    """Per-call cost on a 1K-element buffer, where the update itself is negligible."""
    p, g, m, v = (torch.randn(1024) for _ in range(4))
    v.abs_()
    step = torch.tensor(1.0)
    param = torch.nn.Parameter(p.clone())
    param.grad = g.clone()
    opt = torch.optim.AdamW([param], fused=True)

    def raw():
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)

    def many(fn):
        return lambda: [fn() for _ in range(200)]

    medians = interleaved_medians({
        "torch._fused_adamw_ (raw)": many(raw),
        "shardkit adamw_step": many(lambda: adamw_step(p, g, m, v, step=1, lr=1e-3)),
        "torch AdamW(fused).step": many(opt.step)}, rounds, torch.device("cpu"))
    return [dict(candidate=k, us=s / 200 * 1e6) for k, s in medians.items()]


def format_tables(env, adamw_rows, model_rows, pack_rows, overhead_rows, cuda_rows) -> str:
    lines = ["# Kernel benchmarks", "", env, "",
             "## AdamW step (one flat fp32 parameter, CPU)", "",
             "Bandwidth fractions: time of a `dst.copy_(src)` (resp. an in-place `x.mul_(1.0)`)",
             "moving the same 28 B/param (read + write), run in the same rounds, divided by the",
             "candidate's time. A copy also fetches each destination line before writing it, so",
             "an in-place update can beat it. For-loop and foreach run in their own interleaved",
             "rounds with torch fused; their times are scaled to the main rounds' torch fused.", "",
             "| params | candidate | ms (median) | time / torch fused | GB/s at 28 B/param "
             "| fraction of copy_ bandwidth | fraction of in-place bandwidth |",
             "|---|---|---|---|---|---|---|"]
    for r in adamw_rows:
        lines.append(f"| {r['params'] / 2**20:.0f}M | {r['candidate']} | {r['ms']:.2f} | "
                     f"{r['ratio']:.3f} | {r['gbps']:.1f} | {r['bw_fraction']:.2f} | "
                     f"{r['in_place_fraction']:.2f} |")
    lines += ["", "## AdamW over the reference GPT's parameters (CPU)", "",
              "| params | tensors | candidate | ms (median) | time / torch fused |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['params'] / 1e6:.1f}M | {r['tensors']} | {r['candidate']} | {r['ms']:.2f} | "
              f"{r['ratio']:.3f} |" for r in model_rows]
    lines += ["", "## Per-call overhead (1K params, CPU)", "", "| candidate | µs per call |",
              "|---|---|"]
    lines += [f"| {r['candidate']} | {r['us']:.1f} |" for r in overhead_rows]
    lines += ["", "## Rank-major packing (48 gradient-like tensors, world size 4, scale 1/4)",
              "", "| params | out dtype | candidate | ms (median) | time / torch.cat baseline |",
              "|---|---|---|---|---|"]
    for r in pack_rows:
        lines.append(f"| {r['params'] / 2**20:.1f}M | {r['dtype']} | {r['candidate']} | "
                     f"{r['ms']:.2f} | {r['ratio']:.3f} |")
    if cuda_rows:
        lines += ["", "## CUDA: Triton kernels vs torch fused", "",
                  "| params | candidate | ms (median) | time / torch fused |", "|---|---|---|---|"]
        lines += [f"| {r['params'] / 2**20:.0f}M | {r['candidate']} | {r['ms']:.3f} | "
                  f"{r['ratio']:.3f} |" for r in cuda_rows]
    return "\n".join(lines) + "\n"


def bench_cuda(sizes, rounds) -> list[dict]:
    """Triton AdamW (flat) and packing vs torch's fused AdamW / torch.cat on the GPU."""
    device = torch.device("cuda")
    rows = []
    for numel in sizes:
        candidates = adamw_candidates(numel, device)
        candidates.pop("torch for-loop")
        medians = interleaved_medians(candidates, rounds, device)
        for name, seconds in medians.items():
            rows.append(dict(params=numel, candidate=name, ms=seconds * 1e3,
                             ratio=seconds / medians["torch fused"]))
        for r in bench_packing(numel, 8, rounds, device):
            rows.append(dict(params=r["params"], candidate=f"{r['candidate']} ({r['dtype']})",
                             ms=r["ms"], ratio=r["ratio"]))
    return rows


QUANT_SWEEP_BLOCKS = (64, 128, 256, 512, 1024, 2048)


def run_quantize(args) -> str:
    """The quantize-and-pack rows (4M params, world 4), the block-size sweep on CPU, and on
    CUDA the same rows for the Triton kernels; written to ``QUANT_RESULTS``."""
    rounds = args.rounds or (5 if args.quick else 11)
    cpu = torch.device("cpu")
    rows = bench_quantize(4 * 2**20, 4, rounds, cpu)
    sweep = bench_quantize(4 * 2**20, 4, rounds, cpu, blocks=QUANT_SWEEP_BLOCKS,
                           dtypes=(torch.float32,))
    if torch.cuda.is_available():
        rows += bench_quantize(64 * 2**20, 8, rounds, torch.device("cuda"))
    env = (f"torch {torch.__version__}, {args.threads} CPU thread(s), "
           f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, "
           f"{rounds} interleaved rounds, medians of process CPU time (wall time on CUDA)"
           + (f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available()
              else ", no GPU"))
    report = format_quantize(env, rows, sweep)
    print(report)
    if not args.no_write:
        QUANT_RESULTS.parent.mkdir(parents=True, exist_ok=True)
        QUANT_RESULTS.write_text(report)
        print(f"written to {QUANT_RESULTS}")
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4M and 16M params, 7 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (21)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1)")
    parser.add_argument("--no-write", action="store_true", help=f"do not write {RESULTS}")
    parser.add_argument("--quantize-only", action="store_true",
                        help=f"only the quantize-and-pack rows and block sweep ({QUANT_RESULTS})")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("SHARDKIT_KERNELS", "auto")
    run_quantize(args)
    if args.quantize_only:
        return
    sizes = [4 * 2**20, 16 * 2**20] + ([] if args.quick else [64 * 2**20])
    rounds = args.rounds or (7 if args.quick else 21)
    cpu = torch.device("cpu")

    adamw_rows = bench_adamw(sizes, rounds, cpu, skip_slow=args.quick)
    model_rows = bench_model_params(rounds, cpu)
    overhead_rows = small_call_overhead(rounds)
    pack_rows = bench_packing(16 * 2**20, 4, rounds, cpu)
    cuda_rows = []
    if torch.cuda.is_available():
        cuda_rows = bench_cuda(sizes, rounds)
    env = (f"torch {torch.__version__}, {args.threads} CPU thread(s), "
           f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, "
           f"{rounds} interleaved rounds, medians of process CPU time"
           + (f", GPU {torch.cuda.get_device_name()}" if cuda_rows else ", no GPU"))
    report = format_tables(env, adamw_rows, model_rows, pack_rows, overhead_rows, cuda_rows)
    print(report)
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(report)
        print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
