"""The calibration loop: observe weights once, run the batches, write qparams.

`calibrate(model, batches)` runs the forward passes under `torch.no_grad()`
with the attached observers' hooks, then writes every qparam onto the model
(`quantobs.calibration.qparams`) and returns a `CalibrationReport`. Calling
it again continues the calibration (the statistics accumulate); so does it
after `load_state` (`quantobs.calibration.state`). It drives the model's
`Calibration` (`quantobs.calibration.lifecycle`: observe, sync, freeze),
whole or one decoder layer at a time (`pipeline`,
`quantobs.calibration.sequential`).

Under `torch.distributed` (`sync=True`), each process passes its own shard
of the batches: each observes a share of the weights (balanced by size,
fused layers together) and broadcasts their qparams; the activation
statistics are all-reduced as each statistic declares
(`quantobs.calibration.distributed`), so every process ends with the qparams
one process would compute from all the batches (the `ProcessGroup` strategy,
`quantobs.calibration.strategy`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from quantobs.calibration.attach import attachment_of
from quantobs.calibration.distributed import sync_observers
from quantobs.calibration.lifecycle import (
    Calibration,
    CalibrationReport,
    Pipeline,
    Propagate,
    Status,
    needs_data,
)
from quantobs.calibration.qparams import (
    EmptyPolicy,
    QParams,
    compute_qparams,
    set_qparams,
)
from quantobs.calibration.running import to_model_device
from quantobs.calibration.strategy import strategy_for

__all__ = [
    "CalibrationReport",
    "calibrate",
    "needs_data",
    "sync",
    "text_batches",
    "to_model_device",
    "write_qparams",
]


def text_batches(
    tokenizer: Any,
    texts: Sequence[str],
    *,
    batch_size: int = 16,
    max_length: int = 256,
) -> list[dict[str, torch.Tensor]]:
    """Tokenized batches of `texts` for `calibrate` (padded, truncated).

    Raises:
        ValueError: no texts, or a batch size below 1.
    """
    if isinstance(texts, str) or not texts:
        raise ValueError("texts must be a non-empty sequence of strings")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [
        dict(
            tokenizer(
                list(texts[i : i + batch_size]),
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
        )
        for i in range(0, len(texts), batch_size)
    ]


def write_qparams(
    model: torch.nn.Module,
    *,
    on_empty: EmptyPolicy = "raise",
    qparams: Mapping[str, QParams] | None = None,
) -> list[str]:
    """Write every attached observer's qparams onto its module.

    Returns:
        The observers that fell back to a default range.
    """
    attachment = attachment_of(model)
    fell_back: list[str] = []
    if qparams is None:
        qparams, fell_back = compute_qparams(attachment, on_empty=on_empty)
    by_key = attachment.by_key()
    for key, values in qparams.items():
        set_qparams(by_key[key], values)
    return fell_back


def calibrate(
    model: torch.nn.Module,
    batches: Iterable[Any],
    *,
    progress: bool | None = None,
    on_empty: EmptyPolicy = "raise",
    sync: bool = False,
    process_group: Any = None,
    all_experts: bool = False,
    pipeline: Pipeline = "auto",
    propagate: Propagate = "unquantized",
    device_memory: int | None = None,
) -> CalibrationReport:
    """Run the batches through the model with its observers, write the qparams.

    Activation observers see the real tokens of each batch only (its
    `attention_mask`), so qparams do not depend on how texts were batched.
    When no observer needs data (`needs_data`), no batch is run.

    Args:
        model: a model with observers attached (`attach`).
        batches: each a dict of keyword arguments (`model(**batch)`), a tuple
            of positional ones, or one tensor; moved to the model's device.
        progress: show a progress bar (None: when stderr is a terminal).
        on_empty: `"raise"` when an observer saw no data, or `"fallback"`
            (see `quantobs.calibration.qparams`).
        sync: all-reduce the statistics across the processes of
            `torch.distributed` (each process passes its shard of batches).
        process_group: the process group to sync over (default: world).
        all_experts: feed every real token to every MoE expert's observers
            (llm-compressor's `moe_calibrate_all_experts`), not only the
            tokens routed to it; the model's outputs are unchanged (only the
            routed experts' outputs are summed). Off by default: an expert's
            inputs are then those it sees at inference.
        pipeline: `"model"` runs each batch through the whole model;
            `"layer"` one decoder layer at a time, the batches' hidden states
            cached at the layer boundary (`quantobs.calibration.sequential`);
            `"auto"` (default): `"layer"` when the model does not fit its
            device (accelerate offloads it, or its parameters plus an
            estimate of a batch's activations exceed `device_memory`:
            `sequential.choose`), else `"model"`. With the default
            `propagate` both give the same qparams bit for bit.
        propagate: layer by layer, what a layer passes on to the next:
            `"unquantized"` (default: its outputs, as in a whole-model pass)
            or `"quantized"` (its outputs with its weights fake-quantized, as
            GPTQ-style pipelines need; later layers' qparams then differ).
        device_memory: the bytes `pipeline="auto"` lets the model take on
            its device; None (default): its free memory (CUDA's, or the
            available RAM) plus what its tensors take there already.

    Returns:
        The `CalibrationReport`.

    Raises:
        RuntimeError: no observers attached, `sync=True` outside an
            initialized process group, an observer with no data under
            `on_empty="raise"`, a model already exported, or an earlier
            call that stopped partway.
        ValueError: an unknown `pipeline` / `propagate`, or
            `pipeline="layer"` for a model without decoder layers.
    """
    start = time.perf_counter()
    calibration = Calibration.of(model)
    if calibration.status is Status.OBSERVING:
        raise RuntimeError(
            "an earlier calibrate() stopped partway (an error or an interrupt) "
            "and the observers hold part of its batches; attach them again "
            "(or load_state a saved state) to start over"
        )
    if calibration.status in (Status.FROZEN, Status.SYNCED):
        calibration.reopen()  # continue: the statistics accumulate
    if calibration.status is Status.ATTACHED:
        calibration.use(strategy_for(sync, process_group))
    calibration.observe(
        batches,
        progress=progress,
        pipeline=pipeline,
        propagate=propagate,
        all_experts=all_experts,
        device_memory=device_memory,
    )
    calibration.sync()
    calibration.freeze(on_empty=on_empty)
    return calibration.report(seconds=time.perf_counter() - start)


def sync(model: torch.nn.Module, process_group: Any = None) -> None:
    """All-reduce the attached activation / attention observers' statistics
    across the processes of `torch.distributed`, as each statistic declares
    (what `calibrate(..., sync=True)` does after its batches; weights are
    observed whole by their owner instead).

    Raises:
        RuntimeError: no observers attached.
    """
    entries = [e for e in attachment_of(model).entries if e.base_name != "weight"]
    sync_observers([e.observer for e in entries], process_group)
