"""Legacy face on bfloat16 / float16 / float32 values: the dtype and bits of
llm-compressor 0.7.1's own `MinMaxObserver` / `MovingAverageMSEObserver`
(issue 25).

The expected numbers were recorded from the real llm-compressor 0.7.1 with
compressed-tensors 0.11 (`record_legacy.py`; neither installs beside
today's stack) into `legacy_0_7_1.safetensors`. The legacy code computes in
the input's dtype: asymmetric scales and zero points rounded at each step,
and the MSE search's candidates, fake-quantized values and error sums in
bfloat16 / float16; the face's default `arithmetic="observed"` does the
same, `arithmetic="float32"` does not.

Compared: every batch of the min-max cases; the first batch of the MSE
cases. From the second batch on, the legacy MSE observer's moving average
is one the face deliberately does not copy (llm-compressor 0.5 - 0.7 read
the running range under `tensor_id` but wrote it under `tensor_id or
"default"`, so non-group ranges and group 0 never averaged; see the
package docstring), which float32 shows as well.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantobs import QuantizationArgs
from quantobs.faces.llmcompressor_legacy import MinMaxObserver, MovingAverageMSEObserver

from .low_precision_cases import BATCHES, CASES, DTYPES, batches

RECORDED = load_file(str(Path(__file__).with_name("legacy_0_7_1.safetensors")))
CLASSES = {"minmax": MinMaxObserver, "mse": MovingAverageMSEObserver}


def _compared(kind: str) -> range:
    return range(BATCHES if kind == "minmax" else 1)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_scales_equal_llm_compressor_0_7_1(case: str, dtype_name: str) -> None:
    kind, kwargs, options = CASES[case]
    observer = CLASSES[kind](QuantizationArgs(**kwargs), **options)
    for i, x in enumerate(batches(DTYPES[dtype_name])):
        scale, zero_point = observer(x)
        if i not in _compared(kind):
            continue
        expected = RECORDED[f"{case}/{dtype_name}/{i}/scale"]
        expected_zp = RECORDED[f"{case}/{dtype_name}/{i}/zero_point"]
        assert scale.dtype == expected.dtype == DTYPES[dtype_name]
        assert torch.equal(scale, expected), f"batch {i}"
        assert zero_point.dtype == expected_zp.dtype
        assert torch.equal(zero_point, expected_zp), f"batch {i}"


@pytest.mark.parametrize(
    "case", ["minmax-tensor-asym", "minmax-group-asym", "mse-group", "mse-channel"]
)
def test_float32_arithmetic_option(case: str) -> None:
    # float32 arithmetic on bfloat16 values: the input's dtype kept, the
    # legacy code's numbers not (asymmetric roundings, the MSE errors)
    kind, kwargs, options = CASES[case]
    observer = CLASSES[kind](
        QuantizationArgs(**kwargs), arithmetic="float32", **options
    )
    scale, zero_point = observer(batches(torch.bfloat16)[0])
    expected = RECORDED[f"{case}/bfloat16/0/scale"]
    expected_zp = RECORDED[f"{case}/bfloat16/0/zero_point"]
    assert scale.dtype == torch.bfloat16
    assert not (torch.equal(scale, expected) and torch.equal(zero_point, expected_zp))
