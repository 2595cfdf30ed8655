"""Checks of device data deferred to one host read.

A check such as "every range is finite" needs a Python bool, and reading one
from a device tensor makes the host wait for every kernel queued before it
(a host-device synchronisation, see `quantobs.core.syncs`). `Checks`
collects such checks as 0-d tensors while the arithmetic goes on, and reads
them all at once in `raise_first`: one synchronisation for any number of
checks, raising the error of the first one that failed, in the order they
were added (as the same checks done one by one would have)::

    checks = Checks()
    checks.add(bad_count, lambda n: ValueError(f"{n:g} non-finite values"))
    ...  # more arithmetic, more checks: nothing is read yet
    checks.raise_first()  # one read; raises the first failed check's error

The arithmetic between the checks must not need their outcome: a failed
check's data flows on (NaN, inf) and is discarded when its error is raised.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["Checks"]

#: Builds the error of a failed check from its value and its extras' values.
ErrorFactory = Callable[..., Exception]


class Checks:
    """Deferred checks: 0-d tensors, nonzero where the check failed."""

    def __init__(self) -> None:
        self._items: list[tuple[torch.Tensor, tuple[torch.Tensor, ...], ErrorFactory]]
        self._items = []

    def __len__(self) -> int:
        return len(self._items)

    def add(
        self, failed: torch.Tensor, error: ErrorFactory, *extras: torch.Tensor
    ) -> None:
        """Add a check.

        Args:
            failed: a one-element tensor (bool or number), nonzero where the
                check failed (e.g. the count of bad values).
            error: called as `error(failed, *extras)` with Python floats
                when the check failed; returns the exception to raise.
            extras: one-element tensors the error message reports (read in
                the same synchronisation).
        """
        self._items.append((failed, extras, error))

    def raise_first(self) -> None:
        """Read every check at once (one host read, none without checks) and
        raise the error of the first that failed."""
        if not self._items:
            return
        values = [item[0] for item in self._items]
        for _, extras, _ in self._items:
            values.extend(extras)
        with torch.no_grad():  # few ops (each a launch on a GPU)
            scalars = [v if v.dim() == 0 else v.reshape(()) for v in values]
            flat = torch.stack([v.to(torch.float64) for v in scalars])
        read = flat.tolist()  # the one synchronisation
        items, self._items = self._items, []
        offset = len(items)
        for index, (_, extras, error) in enumerate(items):
            found = read[offset : offset + len(extras)]
            offset += len(extras)
            if read[index] != 0:
                raise error(read[index], *found)
