"""Errors of the torch.ao face.

torch.ao raises `AssertionError` and `NotImplementedError` for misuse, and
lets a channel-count change surface as a broadcasting `RuntimeError`. Each
class here is also a `ValueError`, so code written against torch
(`except AssertionError`) and code written against quantobs
(`except ValueError`) both catch it::

    class                        also a               torch raised
    InvalidObserverArgument      AssertionError       AssertionError
    UnsupportedObserverConfig    NotImplementedError  NotImplementedError
    ObserverShapeError           RuntimeError         RuntimeError / IndexError
"""

from __future__ import annotations

__all__ = [
    "InvalidObserverArgument",
    "ObserverShapeError",
    "UnsupportedObserverConfig",
]


class InvalidObserverArgument(ValueError, AssertionError):
    """A constructor argument or an observer state torch.ao asserts against."""


class UnsupportedObserverConfig(ValueError, NotImplementedError):
    """A valid argument this observer class does not support (qscheme, dynamic)."""


class ObserverShapeError(ValueError, RuntimeError):
    """An input whose shape does not fit the observer (channel axis or count)."""
