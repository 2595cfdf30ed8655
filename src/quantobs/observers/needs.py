"""What an observer needs from the calibration loop, declared as data.

An observer lists its needs in `Observer.needs` (a frozenset, empty by
default); the loop (`quantobs.calibration.lifecycle`) serves each need it
finds and never asks for an observer's class:

    need              the observer provides          the loop
    SHARED_REFERENCE  `has_reference()`               agrees one reference
                                                      range across processes
                                                      before any error is
                                                      accumulated (`static_mse`)
    INPUT_IMPORTANCE  `gathered()`: the engines its   syncs them after the
                      hooks fill during the batches   batches, then observes
                                                      the weight (`imatrix_mse`)
    SECOND_PASS       `begin_second_pass()`           combines the first
                                                      pass across processes,
                                                      calls it, then runs the
                                                      batches again (tokens not
                                                      counted twice)

A second pass starts from the first pass of every process: between the two,
the loop syncs the observer's statistics (every process then holds the
totals) and calls `begin_second_pass()`, which takes from them what the
second pass needs; then every process but the one that keeps the totals
clears its statistics (`clear_data`), so that the sync after the second pass
counts each batch of the first once.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Need"]


class Need(str, Enum):
    """One thing an observer needs from the calibration loop."""

    #: a reference range shared by every process before errors accumulate
    SHARED_REFERENCE = "shared_reference"
    #: its layer's input importance, gathered during the batches; the
    #: weight is observed after them
    INPUT_IMPORTANCE = "input_importance"
    #: the batches run again after `begin_second_pass()`
    SECOND_PASS = "second_pass"
