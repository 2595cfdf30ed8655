"""Deferred checks: any number read in one synchronisation, first error wins."""

from __future__ import annotations

import pytest
import torch

from quantobs.core.checks import Checks
from quantobs.core.syncs import SyncCounter


def test_nothing_to_check_reads_nothing() -> None:
    with SyncCounter() as syncs:
        Checks().raise_first()
    assert syncs.count == 0


def test_all_checks_in_one_read_and_the_first_failure_raised() -> None:
    x = torch.tensor([1.0, float("nan"), -2.0])
    checks = Checks()
    with SyncCounter() as syncs:
        checks.add((x < -5).any(), lambda _: ValueError("too small"))
        checks.add(
            (~torch.isfinite(x)).sum(),
            lambda count, value: ValueError(f"{count:g} bad, first {value:g}"),
            x[2],
        )
        checks.add((x < 0).any(), lambda _: RuntimeError("negative"))
        with pytest.raises(ValueError, match="1 bad, first -2"):
            checks.raise_first()
    assert syncs.count == 1
    assert len(checks) == 0  # read once: cleared


def test_passing_checks_raise_nothing() -> None:
    checks = Checks()
    checks.add(torch.tensor(False), lambda _: ValueError("never"))
    checks.add(torch.zeros(()), lambda _: ValueError("never"))
    checks.raise_first()
