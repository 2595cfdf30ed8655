"""Compile `quantobs.native.triton_shrink`'s kernels (and the min/max and
fused qparams kernels, `triton_minmax`, `triton_qparams`) for an sm_90 GPU
without one (Triton's CUDA backend and its bundled ptxas): kernels written
and tested under the interpreter also compile. Run in a fresh process
(`TRITON_INTERPRET` off) by `test_triton_compile.py`; prints one line per
kernel and configuration."""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from quantobs.native import triton_minmax as tm
from quantobs.native import triton_qparams as tq
from quantobs.native import triton_shrink as ts

TARGET = GPUTarget("cuda", 90, 32)
INTS = ["Q", "G", "E", "C", "seg_len", "sxn", "sxq", "sxg", "swn", "swq", "swg",
        "K", "patience"]  # fmt: skip


def compile_kernel(fn, pointers: dict[str, str], consts: dict[str, object]) -> None:
    signature = {}
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "i32" if name in INTS else "fp32"
    constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    triton.compile(source, target=TARGET, options={"enable_fp_fusion": False})
    print("compiled", fn.__name__, consts)


def main() -> None:
    rule_ptrs = {"lo_ptr": "*fp32", "hi_ptr": "*fp32", "f_ptr": "*fp32",
                 "gs_ptr": "*fp32"}  # fmt: skip
    for kind in (0, 1, 2):  # symmetric, asymmetric, MX
        rule = {"KIND": kind, "HAS_GS": kind == 0, "ROUND_SCALE": kind == 0,
                "FLOOR_TINY": kind != 0}  # fmt: skip
        for one_tile in (True, False):
            compile_kernel(
                ts._shrink_kernel,
                {**rule_ptrs, "x_ptr": "*bf16", "w_ptr": "*fp32", "near_ptr": "*i8",
                 "out_ptr": "*fp32" if one_tile else "*fp64"},
                {**rule, "HAS_ZP": kind == 1, "HAS_W": one_tile,
                 "IS_FLOAT": kind != 1, "NORM_KIND": 1, "ROWS": not one_tile,
                 "ONE_TILE": one_tile, "NEAR": one_tile, "EXACT": False,
                 "FAST_POW": False, "BLOCK_Q": 4, "BLOCK_E": 1024},
            )  # fmt: skip
        compile_kernel(ts._near_kernel,
                       {**rule_ptrs, "err_ptr": "*fp64", "near_ptr": "*i8"},
                       {**rule, "BLOCK_Q": 1024})  # fmt: skip
        compile_kernel(ts._qparams_kernel,
                       {**rule_ptrs, "idx_ptr": "*i64", "s_ptr": "*fp32",
                        "z_ptr": "*fp32"}, {**rule, "BLOCK_K": 256})  # fmt: skip
    for mode in (ts.FIRST_BEST, ts.BEST_INDEX):
        out = "*fp32" if mode == ts.FIRST_BEST else "*i64"
        compile_kernel(ts._improved_kernel, {"err_ptr": "*fp32", "imp_ptr": "*i32"},
                       {"MODE": mode, "BLOCK_Q": 1024})  # fmt: skip
        # ints of value 1 are specialised as constants at launch
        compile_kernel(ts._choose_kernel,
                       {"err_ptr": "*fp64", "imp_ptr": "*i32", "f_ptr": "*fp32",
                        "out_ptr": out},
                       {"patience": 1, "STOPS": True, "MODE": mode,
                        "BLOCK_Q": 1024})  # fmt: skip

    for absmax in (True, False):
        compile_kernel(tm._minmax_kernel,
                       {"x_ptr": "*bf16", "min_ptr": "*fp32", "max_ptr": "*fp32",
                        "found_ptr": "*fp64", "amax_ptr": "*i32"},
                       {"ROWS": not absmax, "ABSMAX": absmax, "BLOCK_Q": 4,
                        "BLOCK_E": 1024})  # fmt: skip
    ranges = {"lo_ptr": "*fp32", "hi_ptr": "*fp32", "dlo_ptr": "*fp32",
              "dhi_ptr": "*fp32", "flags_ptr": "*i32"}  # fmt: skip
    # (kind, rounded, global scale, scale out, zero point out)
    for kind, rounded, gs, out, zp in ((0, 1, 2, "*fp32", "*fp8e4nv"),
                                       (0, 2, 1, "*fp16", "*i8"),
                                       (1, 1, 0, "*bf16", "*i8"),
                                       (1, 0, 0, "*fp32", "*u8"),
                                       (2, 0, 0, "*fp32", "*u8")):  # fmt: skip
        compile_kernel(tq._range_qparams_kernel,
                       {**ranges, "gs_ptr": "*fp32", "s_ptr": out, "z_ptr": zp},
                       {"KIND": kind, "ROUNDED": rounded, "GS": gs,
                        "ROUND_SCALE": gs == 2, "FLOOR_TINY": gs == 0,
                        "FINITE_RANGE": kind == 1, "ZP_OUT": zp != "*fp8e4nv",
                        "OUT_BF16": out == "*bf16", "BLOCK": 1024})  # fmt: skip


if __name__ == "__main__":
    main()
