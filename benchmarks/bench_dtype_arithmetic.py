"""Quantization error of bfloat16 / float16 weights under the two arithmetics
of quantobs' llm-compressor observers (issue 25).

"observed" (`arithmetic="observed"`, `search_arithmetic="observed"`)
computes as llm-compressor 0.14 does on values of that dtype: scales rounded
in it, the MSE searches' candidates, fake-quantized values and error sums too
(its rounded errors tie often and the first tied candidate wins). "float32"
(`arithmetic="float32"`) searches the float32 copy. For each observer and
format this prints the mean squared error of the weights fake-quantized
with the scales as a bfloat16 / float16 model stores them (the module's
dtype) and the fraction of qparams whose stored scale differs between the
two arithmetics. Not a test: numbers, never asserted.

    PYTHONPATH=src python benchmarks/bench_dtype_arithmetic.py
    PYTHONPATH=src python benchmarks/bench_dtype_arithmetic.py --rows 1024 --cols 4096
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from quantobs import Observer, QuantizationArgs, fake_quantize

NVFP4 = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "scale_dtype": torch.float8_e4m3fn,
}
FORMATS: dict[str, dict[str, Any]] = {
    "int4-g128": {"num_bits": 4, "strategy": "group", "group_size": 128},
    "int4-g128-asym": {
        "num_bits": 4,
        "strategy": "group",
        "group_size": 128,
        "symmetric": False,
    },
    "int8-channel": {"num_bits": 8, "strategy": "channel"},
    "fp8-channel": {"num_bits": 8, "type": "float", "strategy": "channel"},
    "nvfp4": NVFP4,
    "mxfp4": {
        "num_bits": 4,
        "type": "float",
        "strategy": "group",
        "group_size": 32,
        "scale_dtype": torch.uint8,
        "zp_dtype": torch.uint8,
    },
}


def _weights(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """LLM-like weights: normal rows of varied spread with heavy-tailed
    outliers (Student t, 4 degrees of freedom)."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.rand(rows, 1, generator=gen) * 0.04 + 0.005
    normal = torch.randn(rows, cols, generator=gen)
    tails = torch.distributions.StudentT(4.0).sample((rows, cols))
    pick = torch.rand(rows, cols, generator=gen) < 0.01
    return (torch.where(pick, tails, normal) * spread).to(dtype)


def _error(
    name: str, args: QuantizationArgs, weight: torch.Tensor, arithmetic: str
) -> tuple[float, torch.Tensor]:
    options = {"arithmetic": arithmetic}
    if "mse" in name or "imatrix" in name:  # the search's arithmetic too
        options["search_arithmetic"] = arithmetic
    observer = Observer.load_from_registry(
        name, base_name="weight", args=args, **options
    )
    observer.update(weight)
    scale, zero_point = observer.get_qparams()
    global_scale = (
        observer.get_global_scale() if args.strategy == "tensor_group" else None
    )
    stored = scale if args.scale_dtype is not None else scale.to(weight.dtype)
    fake = fake_quantize(weight, stored, zero_point, args, global_scale=global_scale)
    return float((fake.float() - weight.float()).pow(2).mean()), stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--observers", default="memoryless_minmax,memoryless_mse")
    opts = parser.parse_args()
    print(
        f"{'observer':18} {'format':15} {'dtype':9} {'mse observed':>13} "
        f"{'mse float32':>12} {'f32/obs - 1':>12} {'scales differ':>14}"
    )
    for name in opts.observers.split(","):
        for fmt, kwargs in FORMATS.items():
            args = QuantizationArgs(**kwargs)
            for dtype in (torch.bfloat16, torch.float16):
                errors = {"observed": 0.0, "float32": 0.0}
                differ = total = 0
                for seed in range(opts.seeds):
                    weight = _weights(opts.rows, opts.cols, dtype, seed)
                    found = {a: _error(name, args, weight, a) for a in errors}
                    for a in errors:
                        errors[a] += found[a][0] / opts.seeds
                    a, b = found["observed"][1], found["float32"][1]
                    differ += int((a.float() != b.float()).sum())
                    total += a.numel()
                ratio = errors["float32"] / errors["observed"] - 1
                print(
                    f"{name:18} {fmt:15} {str(dtype)[6:]:9} "
                    f"{errors['observed']:13.4e} {errors['float32']:12.4e} "
                    f"{ratio:+12.3%} {differ / total:14.1%}"
                )


if __name__ == "__main__":
    main()
