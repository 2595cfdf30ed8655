"""The calibration lifecycle: one object, its status as data, one method a step.

`Calibration.of(model)` is the calibration of a model with observers
attached (kept on its `Attachment`, created on first use). Its `status`
moves through the steps, as compressed-tensors' `QuantizationStatus` does::

    ATTACHED -observe-> OBSERVING -sync-> SYNCED -freeze-> FROZEN -export-> EXPORTED
       ^                                                      |
       +------------------------reopen------------------------+

- `observe(batches)`: observe the weights this process owns, run the
  batches (whole model, or one decoder layer at a time:
  `quantobs.calibration.sequential`), then the weights whose search needs
  their inputs' importance. Continues while OBSERVING.
- `sync()`: combine the activation statistics across processes (the
  strategy's: nothing for `Local`).
- `freeze(on_empty)`: compute every qparam, share the weights' from their
  owners, write them onto the model; only process 0 keeps the combined
  statistics afterwards (so a later sync counts every batch once).
- `export(out_dir)`: `save_compressed`, once frozen.
- `reopen()`: continue calibrating a frozen model (the statistics keep
  accumulating; `calibrate` does it).

Anything else is refused with a `RuntimeError` naming the status and the
step to take. Distribution is one `Strategy` (`quantobs.calibration.strategy`);
what observers need beyond their hooks they declare (`Observer.needs`,
`quantobs.observers.needs`) and this loop serves: shared references, input
importance, a second pass (its first pass combined across processes
before it starts). The loop knows no observer class.

(Over 500 lines: the one calibration object and its steps; splitting the
steps apart would scatter the status checks they share.)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import torch

from quantobs.calibration import sequential
from quantobs.calibration.attach import (
    ATTACHMENT_ATTR,
    Attachment,
    Entry,
    attachment_of,
)
from quantobs.calibration.experts import (
    loaded_together,
    observe_all_experts,
    routed_tokens,
    uncounted,
)
from quantobs.calibration.export import save_compressed
from quantobs.calibration.freeze import freed_after_each, give_back_freed_memory
from quantobs.calibration.outcome import CalibrationReport
from quantobs.calibration.qparams import (
    EmptyPolicy,
    QParams,
    compute_qparams,
    empty_experts,
    fused_groups,
    set_qparams,
)
from quantobs.calibration.running import (
    peek,
    progress_bar,
    run_batch,
    unobserved_head,
)
from quantobs.calibration.segment import Only, Segment
from quantobs.calibration.strategy import Local, Strategy
from quantobs.observers.needs import Need

__all__ = [
    "Calibration",
    "CalibrationReport",
    "Pipeline",
    "Propagate",
    "Status",
    "needs_data",
]

#: How the batches run: `"model"` whole, `"layer"` one decoder layer at a
#: time, `"auto"` layer by layer for models that do not fit their device
#: (`sequential.choose`).
Pipeline = Literal["auto", "model", "layer"]
#: What a layer passes on to the next, layer by layer (`sequential`).
Propagate = Literal["unquantized", "quantized"]


class Status(str, Enum):
    """Where a calibration stands (compressed-tensors' `QuantizationStatus`
    for calibration): each step moves it one status on."""

    ATTACHED = "attached"
    OBSERVING = "observing"
    SYNCED = "synced"
    FROZEN = "frozen"
    EXPORTED = "exported"


def _needs(entry: Entry, need: Need) -> bool:
    return need in entry.observer.needs


def needs_data(attachment: Attachment) -> bool:
    """Whether any attached observer needs the calibration batches: one of
    activations or attention states, or a weight search weighted by its
    inputs' importance. Weight-only schemes with memoryless weight observers
    need none, and `calibrate` then runs no batch."""
    return any(
        e.base_name != "weight" or _needs(e, Need.INPUT_IMPORTANCE)
        for e in attachment.entries
    )


class Calibration:
    """The calibration of one model with observers attached.

    Use `Calibration.of(model)`; `calibrate` drives it. Attributes:
    `model`, `attachment`, `status`, `strategy` (`Local` unless `use`d),
    `batches` (run by the current pass), `pipeline` (`"model"` or `"layer"`:
    how the last `observe` ran), `tokens` (after `freeze`), `fell_back`
    (observers that fell back at `freeze`).
    """

    def __init__(self, model: torch.nn.Module, attachment: Attachment) -> None:
        self.model = model
        self.attachment = attachment
        self.status = Status.ATTACHED
        self.strategy: Strategy = Local()
        self.groups = fused_groups(attachment.entries)  # fused weight groups
        self.batches = 0
        self.pipeline = "model"
        self.tokens: dict[str, int] = {}
        self.fell_back: list[str] = []
        self._owners: list[int] = [0] * len(self.groups)
        self._frozen: set[int] = set()  # indices of groups written this pass
        self._synced_across = False

    @classmethod
    def of(cls, model: torch.nn.Module) -> Calibration:
        """The model's calibration (created on first use).

        Raises:
            RuntimeError: no observers are attached.
        """
        attachment = attachment_of(model)
        found = attachment.calibration
        if not isinstance(found, Calibration):
            found = cls(model, attachment)
            attachment.calibration = found
        return found

    # ------------------------------------------------------------ status

    def _require(self, step: str, *allowed: Status) -> None:
        if self.status in allowed:
            return
        hints = {
            Status.ATTACHED: "observe() the batches first",
            Status.OBSERVING: "sync() and freeze() it first",
            Status.SYNCED: "freeze() it first; observing more would count "
            "every process's batches again",
            Status.FROZEN: "reopen() it to continue calibrating (calibrate() "
            "does), or export() it",
            Status.EXPORTED: "it was exported in place (its weights are "
            "compressed); load the model again to calibrate anew",
        }
        raise RuntimeError(
            f"cannot {step}: the calibration is {self.status.value} "
            f"(allowed when {' or '.join(s.value for s in allowed)}); "
            f"{hints[self.status]}"
        )

    def use(self, strategy: Strategy) -> None:
        """Calibrate under `strategy` from now on (`Local` or `ProcessGroup`).

        Raises:
            RuntimeError: while observing or synced (mid-pass).
        """
        self._require("change the strategy", Status.ATTACHED, Status.FROZEN)
        self.strategy = strategy

    def reopen(self) -> None:
        """Continue calibrating: the next `observe` adds to the statistics.

        Raises:
            RuntimeError: not frozen (or synced by a local strategy, whose
                statistics were combined with nothing), or exported.
        """
        if self.status is Status.SYNCED and not self._synced_across:
            self.status = Status.ATTACHED
            return
        self._require("reopen", Status.FROZEN)
        self.status = Status.ATTACHED

    # ------------------------------------------------------------- steps

    def observe(
        self,
        batches: Iterable[Any],
        *,
        progress: bool | None = None,
        pipeline: Pipeline = "auto",
        propagate: Propagate = "unquantized",
        all_experts: bool = False,
        device_memory: int | None = None,
    ) -> int:
        """Observe the weights and run the batches (see the module).

        Args:
            batches: each a dict of keyword arguments, a tuple of positional
                ones, or one tensor; streamed (held only layer by layer, or
                for a second pass).
            progress: show a progress bar (None: when stderr is a terminal).
            pipeline: `"model"`, `"layer"` or `"auto"` (`sequential`).
            propagate: layer by layer, what a layer passes on (`sequential`).
            all_experts: every real token to every MoE expert's observers.
            device_memory: under `pipeline="auto"`, the bytes the model may
                take on its device (None: its free memory, measured;
                `sequential.choose`). Across processes, layer by layer when
                any process needs it.

        Returns:
            The batches run (0 when no observer needs data).

        Raises:
            RuntimeError: synced, frozen or exported; ValueError: an unknown
                pipeline or propagation, or a model with no decoder layers
                under `pipeline="layer"`.
        """
        self._require("observe", Status.ATTACHED, Status.OBSERVING)
        if (
            self.status is Status.OBSERVING
            and not isinstance(self.strategy, Local)
            and any(_needs(e, Need.INPUT_IMPORTANCE) for e in self.attachment.entries)
        ):  # each observe() sums the processes' importance once
            raise RuntimeError(
                "cannot observe again in this pass: across processes the "
                "input importance of the weights was summed already; freeze() "
                "and reopen() (as calibrate() does) to observe more batches"
            )
        data = needs_data(self.attachment)
        first = None
        if pipeline == "auto" and data:  # its activations are estimated
            batches, first = peek(batches)
        chosen = sequential.choose(
            self.model, pipeline, data, batch=first, device_memory=device_memory
        )
        if pipeline == "auto" and data:  # every process runs the same way
            chosen = "layer" if self.strategy.any(chosen == "layer") else "model"
        sequential.check_propagate(propagate, self.attachment.entries)
        if self.status is Status.ATTACHED:
            self.batches = 0
            self._frozen = set()
            self._owners = self.strategy.owners(self.groups)
        self.status = Status.OBSERVING
        self.pipeline = chosen
        with torch.no_grad(), observe_all_experts(all_experts):
            if chosen == "layer":
                count = sequential.observe_layers(
                    self, batches, progress=progress, propagate=propagate
                )
            else:
                count = self._observe_model(batches, progress)
        self.batches += count
        return count

    def sync(self) -> None:
        """Combine the activation statistics across processes.

        Raises:
            RuntimeError: not observing.
        """
        self._require("sync", Status.OBSERVING)
        self.strategy.sync([e.observer for e in self._activations()])
        self._synced_across = self.strategy.world > 1
        self.status = Status.SYNCED

    def freeze(self, on_empty: EmptyPolicy = "raise") -> list[str]:
        """Compute and write every qparam (syncing first when observing).

        Args:
            on_empty: `"raise"` when an observer saw no data, or
                `"fallback"` (`quantobs.calibration.qparams`).

        Returns:
            The observers that fell back to a default range.

        Raises:
            RuntimeError: nothing observed yet, already frozen or exported,
                or an observer with no data under `on_empty="raise"`.
        """
        if self.status is Status.OBSERVING:
            self.sync()
        self._require("freeze", Status.SYNCED)
        pending = [i for i in range(len(self.groups)) if i not in self._frozen]
        self.freeze_weights(pending)
        acts = Attachment(self.attachment.recipe, entries=self._activations())
        qparams, self.fell_back = compute_qparams(acts, on_empty=on_empty, weights=[])
        self._write(qparams)
        give_back_freed_memory()  # the qparams' temporaries
        tokens = {e.key: e.tokens for e in self._activations()}
        self.tokens = self.strategy.summed(tokens)
        self._keep_totals()
        self.status = Status.FROZEN
        return self.fell_back

    def export(self, out_dir: str | os.PathLike[str], **options: Any) -> Path:
        """`save_compressed(model, out_dir, **options)` once frozen. The
        model itself is compressed (exported) unless `copy=True`, which
        leaves it frozen and able to continue.

        Raises:
            RuntimeError: not frozen (calibrate first), or exported in place.
        """
        self._require("export", Status.FROZEN)
        try:
            path: Path = save_compressed(self.model, out_dir, **options)
        finally:  # a failure once the model was frozen in place leaves it so
            if getattr(self.model, ATTACHMENT_ATTR, None) is not self.attachment:
                self.status = Status.EXPORTED
        return path

    def report(self, seconds: float = 0.0) -> CalibrationReport:
        """The `CalibrationReport` of the last pass (after `freeze`)."""
        self._require("report", Status.FROZEN, Status.EXPORTED)
        by_key = self.attachment.by_key()
        experts = routed_tokens(self.model)
        return CalibrationReport(
            modules=list(dict.fromkeys(e.name for e in self.attachment.entries)),
            tokens=dict(self.tokens),
            empty=list(self.fell_back),
            batches=self.batches,
            seconds=seconds,
            experts=experts,
            unrouted=[name for name, n in experts.items() if not n],
            fallen_back=empty_experts(by_key[k] for k in self.fell_back),
        )

    # --------------------------------------------------- segment serving

    def observe_segment(
        self, segment: Segment, progress: bool | None = None, desc: str = ""
    ) -> int:
        """Observe one segment: its owned weights, references agreed, its
        batches, a second pass where declared, then the weights weighted by
        their inputs' importance. Returns the items run."""
        entries = segment.entries
        inside = {id(e) for e in entries}
        mine = [
            e for i in self._owned_indices() for e in self.groups[i] if id(e) in inside
        ]
        late = [e for e in mine if _needs(e, Need.INPUT_IMPORTANCE)]
        self._observe_weights(
            e for e in mine if e not in late and not e.observer.has_statistics
        )
        self._agree_references(segment)
        count = 0
        items = segment.items
        if self._second_pass_entries(entries) and not isinstance(items, Sequence):
            items = list(items)  # run twice
        bar = progress_bar(items, progress, desc) if desc else items
        for item in bar:
            segment.run(item)
            count += 1
        self._second_pass(segment, items)
        importance = [
            engine
            for e in entries
            if e.base_name == "weight" and _needs(e, Need.INPUT_IMPORTANCE)
            for engine in e.observer.gathered()
        ]
        self.strategy.sync(importance)
        self._observe_weights(late)  # weighted by the importance of their inputs
        return count

    def segment_groups(self, entries: Iterable[Entry]) -> list[int]:
        """The indices of the fused weight groups within `entries`."""
        inside = {id(e) for e in entries}
        return [i for i, g in enumerate(self.groups) if id(g[0]) in inside]

    def freeze_weights(self, indices: Sequence[int]) -> None:
        """Compute the owned weight groups among `indices`, share them from
        their owners, write them (the weights of one layer, or all)."""
        groups = [self.groups[i] for i in indices]
        owners = [self._owners[i] for i in indices]
        rank = self.strategy.rank
        mine = [g for g, o in zip(groups, owners, strict=True) if o == rank]
        # an attachment of the owned weights alone: compute_qparams then
        # computes no activation
        view = Attachment(self.attachment.recipe, entries=[e for g in mine for e in g])
        qparams, _ = compute_qparams(view, weights=mine)
        self.strategy.share_weights(groups, owners, qparams)
        self._write(qparams)
        self._frozen.update(indices)

    # ----------------------------------------------------------- helpers

    def _owned_indices(self) -> list[int]:
        rank = self.strategy.rank
        return [i for i, o in enumerate(self._owners) if o == rank]

    def _activations(self) -> list[Entry]:
        return [e for e in self.attachment.entries if e.base_name != "weight"]

    def _write(self, qparams: dict[str, QParams]) -> None:
        by_key = self.attachment.by_key()
        for key, values in qparams.items():
            set_qparams(by_key[key], values)

    def _observe_weights(self, entries: Iterable[Entry]) -> None:
        """Observe the entries' weights; those of one offloaded MoE experts
        module with their fused tensors read once (`loaded_together`)."""
        for loaded, group in loaded_together(self.model, entries):
            with loaded:
                for entry in group:
                    entry.observer.update(entry.weight.detach())

    def _observe_model(self, batches: Iterable[Any], progress: bool | None) -> int:
        """The whole model as one segment."""
        first = None
        if self.strategy.agrees_references:  # its first batch fixes them
            batches, first = peek(batches)
        if not needs_data(self.attachment):
            batches = []
        # the logits are never computed where no observer follows the base model
        head = unobserved_head(self.model, (e.module for e in self.attachment.entries))

        def run(batch: Any) -> Any:
            try:
                return run_batch(self.model, batch, stop_before=head)
            finally:
                give_back_freed_memory()  # the batch's activations

        segment = Segment(
            entries=list(self.attachment.entries),
            run=run,
            items=batches,
            first=first,
        )
        layers = sequential.decoder_layers(self.model)
        with freed_after_each(layers[1] if layers is not None else ()):
            return self.observe_segment(segment, progress, "calibrating")

    def only(self, entries: Iterable[Entry]) -> Only:
        """A context in which the hooks feed only `entries`."""
        return Only(self.attachment.entries, entries)

    def _agree_references(self, segment: Segment) -> None:
        """Give every process's shared-reference observers of the segment
        the reference range of the first item of the lowest process with
        data (the global first batch), before any error is accumulated."""
        if not self.strategy.agrees_references:
            return  # one process: the first batch fixes them as it runs
        entries = [
            e
            for e in segment.entries
            if e.base_name != "weight"
            and _needs(e, Need.SHARED_REFERENCE)
            and not e.observer.has_reference()
        ]
        if not self.strategy.any(bool(entries)):
            return
        if entries and segment.first is not None:
            tokens = {e.key: e.tokens for e in entries}
            with self.only(entries), uncounted():  # it runs again with the others
                segment.run(segment.first)  # each reference from the first item
            for entry in entries:  # keep the reference, drop that item's errors
                entry.tokens = tokens[entry.key]
                entry.observer.clear_data()
        self.strategy.agree_references([e.observer for e in entries])

    @staticmethod
    def _second_pass_entries(entries: Iterable[Entry]) -> list[Entry]:
        return [e for e in entries if _needs(e, Need.SECOND_PASS)]

    def _second_pass(self, segment: Segment, items: Iterable[Any]) -> None:
        """Run the items again for the observers that declare a second pass
        (the others off; tokens and routing counted once). Across processes
        their first pass is combined before `begin_second_pass()` (every
        process starts the second pass from the totals), and afterwards
        kept by the process that keeps totals only (the final sync counts
        each batch once)."""
        entries = self._second_pass_entries(segment.entries)
        if not entries:
            return
        batched = [e.observer for e in entries if e.base_name != "weight"]
        self.strategy.sync(batched)  # weights: observed whole by their owner
        for entry in entries:
            entry.observer.begin_second_pass()
        if not self.strategy.keeps_totals():
            for observer in batched:
                observer.clear_data()
        tokens = {e.key: e.tokens for e in entries}
        with self.only(entries), uncounted():
            for item in items:
                segment.run(item)
        for entry in entries:
            entry.tokens = tokens[entry.key]

    def _keep_totals(self) -> None:
        """After a sync every process holds the combined statistics; keep
        them (and the token totals) on process 0 only and empty the others,
        so that a later synced pass (or `save_state` on process 0) counts
        every batch once."""
        keep = self.strategy.keeps_totals()
        for entry in self._activations():
            if keep:
                entry.tokens = self.tokens[entry.key]
            else:
                entry.tokens = 0
                entry.observer.clear_data()
        if keep:
            return
        for entry in self.attachment.entries:
            if entry.base_name == "weight" and _needs(entry, Need.INPUT_IMPORTANCE):
                for engine in entry.observer.gathered():
                    engine.clear_data()
