"""The named qparams rules under one signature, on every available device."""

from __future__ import annotations

import pytest
import torch

from quantobs import QuantizationArgs, fake_quantize, flatten_for_calibration
from quantobs.core.presets import preset_scheme
from quantobs.core.qparams import (
    QPARAMS_RULES,
    CompressedTensorsRule,
    QuarkPow2Rule,
    QuarkRule,
    TorchAORule,
    calculate_qparams,
    range_to_qparams,
)
from quantobs.core.qparams.torch_rule import torch_qparams

RULES = {
    "compressed_tensors": CompressedTensorsRule(QuantizationArgs(num_bits=4)),
    "torch_ao": TorchAORule(torch.qint8, torch.per_channel_affine, -128, 127, 1e-8),
    "quark": QuarkRule("int", -128.0, 127.0, symmetric=False),
    "quark_pow2": QuarkPow2Rule(0.0, 255.0, symmetric=True, middle_zero_point=True),
}


def test_every_rule_is_registered_by_name() -> None:
    assert set(QPARAMS_RULES) == set(RULES)
    for name, rule in RULES.items():
        assert isinstance(rule, QPARAMS_RULES[name]) and rule.name == name


@pytest.mark.parametrize("name", list(RULES))
def test_rules_run_on_every_device(name: str, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    low = -torch.rand(6, generator=gen) * 3
    high = torch.rand(6, generator=gen) * 5
    expected = range_to_qparams(low, high, RULES[name])
    found = range_to_qparams(low.to(device), high.to(device), RULES[name])
    for ours, reference in zip(found, expected, strict=True):
        assert ours.device.type == device.type
        assert torch.equal(ours.cpu(), reference)


def test_rules_are_the_peers_functions() -> None:
    low, high = torch.tensor([-1.0, -2.0]), torch.tensor([3.0, 0.5])
    args = QuantizationArgs(num_bits=8, symmetric=False)
    for ours, theirs in zip(
        CompressedTensorsRule(args)(low, high),
        calculate_qparams(low, high, args),
        strict=True,
    ):
        assert torch.equal(ours, theirs)
    rule = RULES["torch_ao"]
    assert isinstance(rule, TorchAORule)
    direct = torch_qparams(
        low, high, dtype=rule.dtype, qscheme=rule.qscheme, quant_min=-128,
        quant_max=127, eps=1e-8,
    )  # fmt: skip
    for ours, theirs in zip(rule(low, high), direct, strict=True):
        assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match="no global scale"):
        rule(low, high, torch.ones(1))


@pytest.mark.parametrize("preset", ["W4A16", "W8A8", "NVFP4", "MXFP4", "FP8_BLOCK"])
def test_core_math_runs_on_every_device(preset: str, device: torch.device) -> None:
    args = preset_scheme(preset).weights
    assert args is not None
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    results = []
    for where in (torch.device("cpu"), device):
        x = w.to(where)
        x_flat = flatten_for_calibration(x, "weight", args)
        low, high = x_flat.amin(dim=(0, -1)), x_flat.amax(dim=(0, -1))
        gscale = None
        if args.strategy == "tensor_group":
            gscale = torch.tensor([448.0 * 6.0], device=where) / x.abs().max()
        scale, zero_point = calculate_qparams(low, high, args, gscale)
        fq = fake_quantize(x, scale, zero_point, args, global_scale=gscale)
        assert fq.device.type == where.type
        results.append((scale, zero_point, fq))
    for ours, reference in zip(results[1], results[0], strict=True):
        assert torch.equal(ours.cpu(), reference)


# ------------------------------------- torch.ao's rule past float32 (issue 16)

F32_MAX = torch.finfo(torch.float32).max
EPS = torch.finfo(torch.float32).eps


def test_torch_rule_affine_range_wider_than_float32() -> None:
    # torch.ao: max - min overflows, scale inf (MinMaxObserver's qparams of
    # [-max, max] are (inf, 0)); ours: the float64 half-range form
    scale, zero_point = torch_qparams(
        torch.tensor(-F32_MAX), torch.tensor(F32_MAX), dtype=torch.quint8,
        qscheme=torch.per_tensor_affine, quant_min=0, quant_max=255, eps=EPS,
    )  # fmt: skip
    expected = 2 * F32_MAX / 255  # (max - min) / (qmax - qmin), exactly
    assert torch.isfinite(scale).all() and float(scale) == pytest.approx(expected)
    assert int(zero_point) == 128 and zero_point.dtype == torch.int32


def test_torch_rule_float_qparams_range_wider_than_float32() -> None:
    # torch.ao: per_channel_affine_float_qparams scale inf, zero point 0
    scale, zero_point = torch_qparams(
        torch.tensor([-F32_MAX, 1.0]), torch.tensor([F32_MAX, 2.0]),
        dtype=torch.quint8, qscheme=torch.per_channel_affine_float_qparams,
        quant_min=0, quant_max=255, eps=EPS,
    )  # fmt: skip
    assert torch.isfinite(scale).all() and torch.isfinite(zero_point).all()
    assert float(zero_point[0]) == pytest.approx(127.5)
    assert float(scale[1]) == pytest.approx(1 / 255)


def test_torch_rule_qint32_zero_point_does_not_wrap() -> None:
    # torch.ao: round(min / scale) = -2**32 wraps in the int32 cast, zero
    # point 0 (so -3e38 is clipped to about -1.5e38); ours: clamped in float64
    qmin, qmax = -(2**31), 2**31 - 1
    scale, zero_point = torch_qparams(
        torch.tensor(-3e38), torch.tensor(1.0), dtype=torch.qint32,
        qscheme=torch.per_tensor_affine, quant_min=qmin, quant_max=qmax, eps=EPS,
    )  # fmt: skip
    assert zero_point.dtype == torch.int32 and int(zero_point) == qmax
    lowest = (qmin - int(zero_point)) * float(scale)
    assert lowest <= -3e38 * (1 - 1e-6)


def test_torch_rule_ordinary_ranges_keep_torch_bits() -> None:
    observer = torch.ao.quantization.MinMaxObserver(
        dtype=torch.qint32, qscheme=torch.per_tensor_affine
    )
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e3
    observer(x)
    low, high = torch.aminmax(x)
    ours = torch_qparams(
        low, high, dtype=torch.qint32, qscheme=torch.per_tensor_affine,
        quant_min=-(2**31), quant_max=2**31 - 1, eps=EPS,
    )  # fmt: skip
    for mine, theirs in zip(ours, observer.calculate_qparams(), strict=True):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
