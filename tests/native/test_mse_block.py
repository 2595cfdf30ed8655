"""The native steps of the MSE grid search over one errors table
(`mse_block`, `mse_rows`, `mse_marks`) against loops written here.

Skipped where no C compiler builds the kernels.
"""

from __future__ import annotations

import pytest
import torch

from quantobs import QuantizationArgs, native
from quantobs.core.scoring import candidate_qparams, shrink_factors

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no C compiler: the native kernels are not built"
)

_TOL = 2.0**-16


def _table(
    shape: tuple[int, int, int], kwargs: dict[str, object], seed: int = 0
) -> tuple[torch.Tensor, QuantizationArgs, torch.Tensor, torch.Tensor | None]:
    """Values `(N, Q, G)` and the float32 qparams `(20, Q)` of their shrink grid."""
    args = QuantizationArgs(**kwargs)
    gen = torch.Generator().manual_seed(seed)
    x3 = torch.randn(shape, generator=gen) * torch.rand(shape[1], 1, generator=gen)
    factors = shrink_factors(0.2, 100.0)
    low, high = x3.amin(dim=(0, -1)), x3.amax(dim=(0, -1))
    scale, zero_point = candidate_qparams(
        low[None] * factors[:, None], high[None] * factors[:, None], args
    )
    scale = scale.float().contiguous()
    if zero_point is not None:
        zero_point = zero_point.float().contiguous()
    return x3, args, scale, zero_point


@pytest.mark.parametrize(
    "shape", [(1, 24, 32), (3, 8, 16)], ids=["one-row", "many-rows"]
)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_bits": 4},
        {"num_bits": 4, "symmetric": False},
        {"num_bits": 8, "type": "float"},
    ],
    ids=["int4", "int4-asym", "fp8"],
)
def test_block_scores_skip_exact_qparams_and_copy_repeats(
    shape: tuple[int, int, int], kwargs: dict[str, object]
) -> None:
    x3, args, scale, zero_point = _table(shape, kwargs)
    num_c, num_q = scale.shape
    # candidates 5 and 6 repeat the qparams of 4 where j is even
    even = torch.arange(num_q) % 2 == 0
    for i in (5, 6):
        scale[i, even] = scale[4, even]
        if zero_point is not None:
            zero_point[i, even] = zero_point[4, even]
    exact = torch.zeros(num_q, dtype=torch.bool)
    exact[[1, 6]] = True
    table = torch.full((num_c, num_q), -1.0, dtype=torch.float64)
    for start, stop in ((0, 3), (3, 11), (11, num_c)):
        native.mse_block(
            x3, scale, zero_point, args.format, 2.4, exact, table, start, stop
        )
    assert bool((table[:, exact] == -1.0).all())  # left to the caller's torch
    # the searches' fast division: within the errors' float32 roundings
    want = native.mse_errors(x3, scale, zero_point, args.format, 2.4)
    assert want is not None
    scored = ~exact
    assert torch.allclose(table[:, scored], want[:, scored], rtol=2e-6, atol=0)
    # repeated candidates: exactly their predecessor's error, not scored
    for i in (5, 6):
        copied = even & scored
        assert torch.equal(table[i, copied], table[4, copied])


def _rows_loop(
    errors: torch.Tensor,
    scale: torch.Tensor,
    exact: torch.Tensor,
) -> tuple[torch.Tensor, list[int]]:
    """llm-compressor's comparisons, as mse_rows describes them."""
    least, flags = errors[0].clone(), [3]
    for i in range(1, errors.shape[0]):
        e = errors[i]
        repeat = scale[i] == scale[i - 1]
        below = e < least
        near = (e - least).abs() <= torch.maximum(e, least) * _TOL
        tight = near & ~exact & ~repeat
        improved = bool(below.any())
        decided = bool((below & ~tight).any()) or not bool(tight.any())
        flags.append(int(improved) | int(decided) << 1)
        least = torch.where(below | e.isnan(), e, least)
    return least, flags


def _marks_loop(
    errors: torch.Tensor,
    scale: torch.Tensor,
    exact: torch.Tensor,
    flags: list[int],
    end: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    scored = errors[:end]
    best = torch.argmin(scored, dim=0)
    columns = torch.arange(errors.shape[1])
    least, won = scored[best, columns], scale[best, columns]

    def near(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a - b).abs() <= torch.maximum(a, b) * _TOL

    marks = torch.zeros(errors.shape[1], dtype=torch.bool)
    running = scored[0].clone()
    for i in range(1, end):
        if not flags[i] & 2:
            marks |= near(scored[i], running) & (scale[i] != scale[i - 1])
        running = torch.minimum(running, scored[i])
    for i in range(end):
        marks |= near(scored[i], least) & (scale[i] != won)
    return best, marks & ~exact


def _near_table(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A (12, 40) errors table with exact ties, near errors (within the
    tolerance), repeated qparams and torch-scored (exact) columns."""
    gen = torch.Generator().manual_seed(seed)
    errors = torch.rand(12, 40, generator=gen, dtype=torch.float64) + 1.0
    scale = torch.rand(12, 40, generator=gen)
    pick = torch.rand(12, 40, generator=gen)
    close = errors[:-1] * (1 + (torch.rand(11, 40, generator=gen) - 0.5) * 4 * _TOL)
    errors[1:] = torch.where(pick[1:] < 0.3, close, errors[1:])  # near the last
    errors[1:] = torch.where(pick[1:] > 0.9, errors[:-1], errors[1:])  # equal
    repeat = pick[1:] > 0.95
    scale[1:] = torch.where(repeat, scale[:-1], scale[1:])
    errors[1:] = torch.where(repeat, errors[:-1], errors[1:])
    # candidate 3 improves nothing clearly: undecided
    errors[3, :8] = errors[:3, :8].min(dim=0).values * (1 - _TOL / 4)
    errors[3, 8:] = 10.0
    scale[3] = scale[3] + 1.0  # no repeat
    exact = torch.rand(40, generator=gen) < 0.2
    exact[:8] = False
    return errors, scale, exact


@pytest.mark.parametrize("seed", range(6))
def test_rows_and_marks_are_the_loops(seed: int) -> None:
    errors, scale, exact = _near_table(seed)
    least = torch.empty(errors.shape[1], dtype=torch.float64)
    running = torch.empty(errors.shape[1], dtype=torch.int64)
    flags = torch.zeros(errors.shape[0], dtype=torch.uint8)
    for start, stop in ((0, 5), (5, 12)):
        native.mse_rows(
            errors, scale, None, exact, _TOL, least, running, flags, start, stop
        )
    want_least, want_flags = _rows_loop(errors, scale, exact)
    assert torch.equal(least, want_least)
    assert torch.equal(running, torch.argmin(errors, dim=0))
    assert flags.tolist() == want_flags
    assert any(not f & 2 for f in want_flags)  # the table has undecided rows
    for end in (1, 4, 12):
        best, marks = native.mse_marks(errors, scale, None, exact, _TOL, flags, end)
        want_best, want_marks = _marks_loop(errors, scale, exact, want_flags, end)
        assert torch.equal(best, want_best)
        assert torch.equal(marks, want_marks)
    assert bool(marks.any()) and not bool(marks[exact].any())
    # the winners of mse_rows given: the same marks
    _, given = native.mse_marks(errors, scale, None, exact, _TOL, flags, 12, running)
    assert torch.equal(given, marks)


def test_comparisons_split_across_threads_are_one_pass() -> None:
    # more qparams than one piece of the kernels' work (2048 columns)
    gen = torch.Generator().manual_seed(7)
    errors = torch.rand(6, 5000, generator=gen, dtype=torch.float64) + 1.0
    errors[1:] = torch.where(
        torch.rand(5, 5000, generator=gen) < 0.5,
        errors[:-1] * (1 + _TOL / 4),
        errors[1:],
    )
    errors[2, :4900] = 9.0  # the improvements of candidate 2: in the last piece
    scale = torch.rand(6, 5000, generator=gen)
    exact = torch.zeros(5000, dtype=torch.bool)
    least = torch.empty(5000, dtype=torch.float64)
    running = torch.empty(5000, dtype=torch.int64)
    flags = torch.zeros(6, dtype=torch.uint8)
    native.mse_rows(errors, scale, None, exact, _TOL, least, running, flags, 0, 6)
    want_least, want_flags = _rows_loop(errors, scale, exact)
    assert torch.equal(least, want_least) and flags.tolist() == want_flags
    best, marks = native.mse_marks(errors, scale, None, exact, _TOL, flags, 6)
    want_best, want_marks = _marks_loop(errors, scale, exact, want_flags, 6)
    assert torch.equal(best, want_best) and torch.equal(marks, want_marks)


def test_an_undecided_candidate_marks_its_near_qparams() -> None:
    # candidate 2 improves nothing clearly: its one improvement (qparam 0)
    # is within the tolerance, so the early stop may depend on its order
    errors = torch.tensor(
        [[4.0, 4.0], [3.0, 5.0], [3.0 * (1 - _TOL / 2), 6.0], [9.0, 9.0]],
        dtype=torch.float64,
    )
    scale = torch.arange(8.0).reshape(4, 2)
    exact = torch.zeros(2, dtype=torch.bool)
    least = torch.empty(2, dtype=torch.float64)
    running = torch.empty(2, dtype=torch.int64)
    flags = torch.zeros(4, dtype=torch.uint8)
    native.mse_rows(errors, scale, None, exact, _TOL, least, running, flags, 0, 4)
    assert flags.tolist() == [3, 3, 1, 2]  # 2 improves, undecided; 3 does not
    best, marks = native.mse_marks(errors, scale, None, exact, _TOL, flags, 4)
    assert best.tolist() == [2, 0]
    assert marks.tolist() == [True, False]
    # torch's errors for qparam 0 decide it
    exact[0] = True
    native.mse_rows(errors, scale, None, exact, _TOL, least, running, flags, 0, 4)
    assert flags.tolist() == [3, 3, 3, 2]
    _, marks = native.mse_marks(errors, scale, None, exact, _TOL, flags, 4)
    assert not bool(marks.any())


def test_table_shapes_are_checked() -> None:
    x3, args, scale, _ = _table((1, 4, 16), {"num_bits": 4})
    exact = torch.zeros(4, dtype=torch.bool)
    table = torch.zeros(20, 4, dtype=torch.float64)
    with pytest.raises(ValueError):
        native.mse_block(x3, scale, None, args.format, 2.4, exact, table, 0, 21)
    with pytest.raises(ValueError):
        native.mse_block(x3, scale, None, args.format, 2.4, exact[:3], table, 0, 5)
    with pytest.raises(ValueError):
        native.mse_block(x3, scale, None, args.format, 3.0, exact, table, 0, 5)
    with pytest.raises(ValueError):
        native.mse_rows(
            table.float(), scale, None, exact, _TOL, table[0],
            torch.zeros(4, dtype=torch.int64), table[:, 0], 0, 5,
        )  # fmt: skip
    assert not native.mse_block_supported(x3[..., :4], args.format, 2.4)
