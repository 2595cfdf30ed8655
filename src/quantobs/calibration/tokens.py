"""Real tokens only: the attention mask of the batch being calibrated.

A batch padded to its longest text holds positions that are not tokens of
any text. Observers must not see them, or qparams would depend on how the
texts were grouped into batches. While `calibrate` runs a batch it makes the
batch's `attention_mask` current (`real_tokens`); the hooks then keep only
the real positions of what they observe (`TokenMask.select`):

    layout      observed shape          kept
    "tokens"    (B, S, ...)             (n, ...)       n = real tokens
    "tokens"    (B * S, ...)            (n, ...)       (flattened, e.g. MoE)
    "heads"     (B, heads, S, D)        (1, heads, n, D)
    other shapes                        unchanged

The real positions are found once per batch (one host sync, in the loop);
selecting them in a hook is an `index_select`, which needs none.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["TokenMask", "current_mask", "real_tokens", "using_mask"]

Layout = Literal["tokens", "heads"]


@dataclass(frozen=True)
class TokenMask:
    """The real positions of one batch.

    Attributes:
        shape: `(B, S)`, the batch's token grid.
        index: `(n,)` int64, the real positions in row-major `B * S` order.
        padded: whether any position is padding (else `select` is a no-op).
    """

    shape: tuple[int, int]
    index: torch.Tensor
    padded: bool

    @classmethod
    def of(cls, mask: torch.Tensor) -> TokenMask:
        """From an attention mask `(B, S)` (nonzero = real token)."""
        flat = mask.reshape(-1) != 0
        index = flat.nonzero().reshape(-1)  # (n,): the loop's one host sync
        rows, cols = mask.shape
        return cls((int(rows), int(cols)), index, int(index.numel()) != flat.numel())

    @property
    def count(self) -> int:
        """Real tokens in the batch."""
        return int(self.index.numel())

    def select(self, value: torch.Tensor, layout: Layout = "tokens") -> torch.Tensor:
        """`value`'s real positions (see the module's table); `value` itself
        when nothing is padded or its shape is not the batch's token grid."""
        if not self.padded:
            return value
        rows, cols = self.shape
        index = self.index.to(value.device)
        if layout == "heads":
            if value.ndim != 4 or value.shape[0] != rows or value.shape[2] != cols:
                return value
            # (B, h, S, D) -> (B*S, h, D) -> (n, h, D) -> (1, h, n, D)
            tokens = value.transpose(1, 2).flatten(0, 1).index_select(0, index)
            return tokens.transpose(0, 1).unsqueeze(0)
        if value.ndim >= 2 and tuple(value.shape[:2]) == self.shape:
            # (B, S, ...) -> (n, ...)
            return value.flatten(0, 1).index_select(0, index)
        if value.ndim >= 2 and value.shape[0] == rows * cols:
            # (B*S, ...) -> (n, ...)
            return value.index_select(0, index)
        return value


_CURRENT: ContextVar[TokenMask | None] = ContextVar("quantobs_token_mask", default=None)


def current_mask() -> TokenMask | None:
    """The mask of the batch `calibrate` is running (None outside it, or for
    a batch with no 2-D `attention_mask`)."""
    return _CURRENT.get()


def _attention_mask(batch: Any) -> torch.Tensor | None:
    if not isinstance(batch, Mapping):
        return None
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
        return mask
    return None


@contextmanager
def real_tokens(batch: Any) -> Iterator[TokenMask | None]:
    """Make `batch`'s attention mask current while the block runs."""
    mask = _attention_mask(batch)
    token = _CURRENT.set(None if mask is None else TokenMask.of(mask))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


@contextmanager
def using_mask(mask: TokenMask | None) -> Iterator[TokenMask | None]:
    """Make `mask` (one `real_tokens` gave for a batch) current again while
    the block runs: a cached batch run layer by layer
    (`quantobs.calibration.sequential`)."""
    token = _CURRENT.set(mask)
    try:
        yield mask
    finally:
        _CURRENT.reset(token)
