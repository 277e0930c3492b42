"""The Triton kernels compile for a real GPU (sm_90, through ptxas), checked on a CPU-only machine.

The interpreter tests check the kernels' arithmetic; this checks what the interpreter cannot:
that every kernel type-checks and lowers to PTX/cubin. It runs in a fresh process because the
test process has imported the kernels in interpreter mode (``TRITON_INTERPRET=1``).
"""

import importlib.util
import os
import subprocess
import sys

import pytest

KERNEL_VARIANTS = 11


@pytest.mark.skipif(importlib.util.find_spec("triton") is None
                    or importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="needs triton with its NVIDIA backend (ptxas)")
def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["compiled"] * KERNEL_VARIANTS, result.stdout


def _compile(fn, signature: dict, constexprs: dict) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert kernel.asm.get("cubin"), "no cubin produced"
    print("compiled")


def _compile_all() -> None:
    import triton.language as tl

    from shardkit.kernels import triton_optim, triton_packing, triton_quantize

    f32 = "*fp32"
    scalars = dict(lr="fp32", c1="fp32", beta2="fp32", c2="fp32", eps="fp32", weight_decay="fp32")
    flags = dict(DECOUPLED=True, AMSGRAD=True, MAXIMIZE=True, HAS_SCALE=True, HAS_INF=True)
    for grad, low in (("*fp32", "*bf16"), ("*bf16", "*fp16")):
        signature = dict(p_ptr=f32, g_ptr=grad, m_ptr=f32, v_ptr=f32, vmax_ptr=f32, lp_ptr=low,
                         n="i64", step_size="fp32", bc2_sqrt="fp32", **scalars, scale_ptr=f32,
                         found_inf_ptr=f32)
        constexprs = dict(flags, HAS_LP=True, BLOCK=triton_optim.BLOCK)
        signature.update({k: "constexpr" for k in constexprs})
        _compile(triton_optim._adamw_flat_kernel, signature, constexprs)

    signature = dict(addr_table="*i64", numels="*i64", step_sizes=f32, bc2_sqrts=f32,
                     block_tensor="*i32", block_start="*i64", n_tensors="i32", **scalars,
                     scale_ptr=f32, found_inf_ptr=f32)
    constexprs = dict(P_DTYPE=tl.float32, G_DTYPE=tl.bfloat16, **flags, BLOCK=triton_optim.BLOCK)
    signature.update({k: "constexpr" for k in constexprs})
    _compile(triton_optim._adamw_many_kernel, signature, constexprs)

    signature = dict(p_ptr=f32, g_ptr="*bf16", buf_ptr=f32, n="i64", lr="fp32",
                     momentum="fp32", undamped="fp32", weight_decay="fp32", scale_ptr=f32,
                     found_inf_ptr=f32)
    constexprs = dict(HAS_MOMENTUM=True, FIRST_STEP=False, NESTEROV=True, MAXIMIZE=True,
                      HAS_SCALE=True, HAS_INF=True, BLOCK=triton_optim.BLOCK)
    signature.update({k: "constexpr" for k in constexprs})
    _compile(triton_optim._sgd_flat_kernel, signature, constexprs)

    tables = dict(table="*i64", block_tensor="*i32", block_rank="*i32", block_start="*i64")
    for out, src in (("*bf16", tl.float32), ("*fp32", tl.float16)):
        signature = dict(tables, out_ptr=out, seg_numel="i64", scale="fp32",
                         SRC_DTYPE="constexpr", HAS_SCALE="constexpr", BLOCK="constexpr")
        _compile(triton_packing._pack_kernel, signature,
                 dict(SRC_DTYPE=src, HAS_SCALE=True, BLOCK=triton_packing.BLOCK))
    signature = dict(tables, buf_ptr=f32, seg_numel="i64",
                     DST_DTYPE="constexpr", BLOCK="constexpr")
    _compile(triton_packing._unpack_kernel, signature,
             dict(DST_DTYPE=tl.bfloat16, BLOCK=triton_packing.BLOCK))

    ranges = dict(table="*i64", prog_first="*i32", prog_last="*i32")
    sizes = dict(seg_numel="i64", n_blocks="i64", progs_per_seg="i32", seg_bytes="i64",
                 scale_stride="i64")
    for src, scale, bits, block in ((tl.float32, "*fp32", 8, 256), (tl.bfloat16, "*bf16", 4, 64)):
        constexprs = dict(SRC_DTYPE=src, SCALE_BF16=scale == "*bf16", BITS=bits,
                          QMAX=127.0 if bits == 8 else 7.0, BLOCK=block,
                          GROUP=4096 // block)
        signature = dict(ranges, out_ptr="*u8", scale_ptr=scale, **sizes, node_size="i32",
                         nodes="i32", **{k: "constexpr" for k in constexprs})
        _compile(triton_quantize._quantize_pack_kernel, signature, constexprs)
    constexprs = dict(DST_DTYPE=tl.bfloat16, BITS=4, BLOCK=256, GROUP=16)
    signature = dict(ranges, buf_ptr="*u8", scale_ptr="*fp32", **sizes,
                     **{k: "constexpr" for k in constexprs})
    _compile(triton_quantize._dequantize_unpack_kernel, signature, constexprs)
    constexprs = dict(HAS_MULTIPLIER=True, BITS=8, BLOCK=256, GROUP=16)
    signature = dict(buf_ptr="*u8", scale_ptr="*bf16", out_ptr=f32, **sizes, sources="i32",
                     outputs="i32", multiplier="fp32", **{k: "constexpr" for k in constexprs})
    _compile(triton_quantize._dequantize_sum_kernel, signature, constexprs)


if __name__ == "__main__":
    _compile_all()
