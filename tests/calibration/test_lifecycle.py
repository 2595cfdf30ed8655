"""The calibration lifecycle (`quantobs.calibration.lifecycle`): its status
moves one step at a time, a step out of order is refused with a message
naming the status and the way on; `calibrate` drives it; the strategies;
observers' declared needs served by a loop that knows no observer class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from quantobs.calibration import (
    Recipe,
    attach,
    attachment_of,
    calibrate,
    detach,
    lifecycle,
    sequential,
    strategy,
)
from quantobs.calibration import calibrate as calibrate_module
from quantobs.calibration.lifecycle import Calibration, Status, needs_data
from quantobs.calibration.strategy import Local, ProcessGroup, strategy_for
from quantobs.observers import (
    IMatrixMSEObserver,
    MinMaxObserver,
    StaticMinMaxObserver,
    StaticMSEObserver,
)
from quantobs.observers.needs import Need
from tests.calibration.conftest import tiny_llama, token_batches

_INPUTS = {"num_bits": 8, "strategy": "tensor"}


def _recipe(observer: str = "static_minmax", weights: str = "minmax") -> Recipe:
    group = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "strategy": "channel", "observer": weights},
        "input_activations": {**_INPUTS, "observer": observer},
    }
    return Recipe(config_groups={"g": group}, ignore=["lm_head"])


def _qparams(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if n.endswith(("_scale", "_zero_point"))
    }


def test_steps_move_the_status_one_at_a_time() -> None:
    model = tiny_llama()
    attach(model, _recipe())
    calibration = Calibration.of(model)
    assert calibration is Calibration.of(model)  # kept on the attachment
    assert calibration.status is Status.ATTACHED
    assert isinstance(calibration.strategy, Local)
    assert calibration.observe(token_batches(2), progress=False) == 2
    assert calibration.status is Status.OBSERVING
    calibration.observe(token_batches(1, seed=5), progress=False)  # continues
    assert calibration.batches == 3
    calibration.sync()
    assert calibration.status is Status.SYNCED
    assert calibration.freeze() == []
    assert calibration.status is Status.FROZEN
    report = calibration.report()
    assert report.batches == 3
    assert report.tokens["model.layers.0.self_attn.q_proj.input"] == 3 * 2 * 16
    assert "model.layers.1.mlp.down_proj.weight_scale" in _qparams(model)
    calibration.reopen()
    assert calibration.status is Status.ATTACHED


def test_the_steps_equal_calibrate() -> None:
    stepped, whole = tiny_llama(), tiny_llama()
    for model in (stepped, whole):
        attach(model, _recipe("static_mse"))
    calibration = Calibration.of(stepped)
    calibration.observe(token_batches(3), progress=False)
    calibration.freeze()  # syncs first (nothing to combine locally)
    report = calibrate(whole, token_batches(3), progress=False)
    assert calibration.report().tokens == report.tokens
    expected = _qparams(whole)
    found = _qparams(stepped)
    assert found.keys() == expected.keys()
    assert all(torch.equal(found[k], v) for k, v in expected.items())


@pytest.mark.parametrize(
    ("steps", "step", "message"),
    [
        ([], "freeze", r"cannot freeze: the calibration is attached .*observe\(\)"),
        ([], "sync", r"cannot sync: the calibration is attached"),
        ([], "export", r"cannot export: the calibration is attached"),
        ([], "reopen", r"cannot reopen: the calibration is attached"),
        (["observe"], "export", r"cannot export: the calibration is observing"),
        (["observe"], "use", r"cannot change the strategy: .* observing"),
        (["observe", "freeze"], "observe", r"cannot observe: .* frozen.*reopen\(\)"),
        (["observe", "freeze"], "freeze", r"cannot freeze: .* frozen"),
        (["observe", "freeze"], "sync", r"cannot sync: .* frozen"),
    ],
)
def test_steps_out_of_order_are_refused(
    steps: list[str], step: str, message: str
) -> None:
    model = tiny_llama()
    attach(model, _recipe())
    calibration = Calibration.of(model)
    actions: dict[str, Any] = {
        "observe": lambda: calibration.observe(token_batches(1), progress=False),
        "sync": calibration.sync,
        "freeze": calibration.freeze,
        "export": lambda: calibration.export("unused-dir"),
        "reopen": calibration.reopen,
        "use": lambda: calibration.use(Local()),
    }
    for done in steps:
        actions[done]()
    before = calibration.status
    with pytest.raises(RuntimeError, match=message):
        actions[step]()
    assert calibration.status is before


def test_an_exported_calibration_is_final(tmp_path: Path) -> None:
    pytest.importorskip("compressed_tensors")
    model = tiny_llama()
    attach(model, _recipe())
    calibrate(model, token_batches(1), progress=False)
    calibration = Calibration.of(model)
    path = calibration.export(tmp_path / "out")
    assert (path / "config.json").is_file()
    assert calibration.status is Status.EXPORTED
    with pytest.raises(RuntimeError, match=r"exported in place.*load the model again"):
        calibrate(model, token_batches(1), progress=False)
    with pytest.raises(RuntimeError, match=r"cannot export: .*exported in place"):
        calibration.export(tmp_path / "again")


def test_calibrate_continues_a_frozen_calibration() -> None:
    """Two calls accumulate as one on every batch (the calibration reopened)."""
    twice, once = tiny_llama(), tiny_llama()
    for model in (twice, once):
        attach(model, _recipe("static_mse"))
    data = token_batches(4)
    calibrate(twice, data[:2], progress=False)
    assert Calibration.of(twice).status is Status.FROZEN
    report = calibrate(twice, data[2:], progress=False)
    calibrate(once, data, progress=False)
    assert report.batches == 2
    found, expected = _qparams(twice), _qparams(once)
    assert all(torch.equal(found[k], v) for k, v in expected.items())


def test_a_new_attachment_starts_a_new_calibration() -> None:
    model = tiny_llama()
    attach(model, _recipe())
    calibrate(model, token_batches(1), progress=False)
    first = Calibration.of(model)
    detach(model)
    attach(model, _recipe())
    assert Calibration.of(model) is not first
    assert Calibration.of(model).status is Status.ATTACHED
    assert attachment_of(model).calibration is Calibration.of(model)


def test_strategies() -> None:
    assert isinstance(strategy_for(False), Local)
    with pytest.raises(RuntimeError, match=r"needs an initialized torch\.distributed"):
        strategy_for(True)
    with pytest.raises(RuntimeError, match=r"needs an initialized torch\.distributed"):
        ProcessGroup()
    local = Local()
    assert (local.rank, local.world, local.agrees_references) == (0, 1, False)
    assert local.summed({"a": 3}) == {"a": 3}
    assert local.keeps_totals()


# ------------------------------------------------------------------- needs


def test_observers_declare_their_needs() -> None:
    assert StaticMSEObserver.needs == {Need.SHARED_REFERENCE}
    assert IMatrixMSEObserver.needs == {Need.INPUT_IMPORTANCE}
    assert MinMaxObserver.needs == frozenset()
    model = tiny_llama()
    attach(model, _recipe("static_mse", weights="imatrix_mse"))
    entries = attachment_of(model).entries
    inputs = next(e for e in entries if e.base_name == "input").observer
    weight = next(e for e in entries if e.base_name == "weight").observer
    assert not inputs.has_reference()
    assert weight.gathered() == [weight.importance]  # type: ignore[attr-defined]
    calibrate(model, token_batches(1), progress=False)
    assert inputs.has_reference()
    assert StaticMinMaxObserver(base_name="input", args=inputs.args).has_reference()


def test_an_imatrix_weight_needs_data() -> None:
    model = tiny_llama()
    weights = {"num_bits": 4, "strategy": "channel", "observer": "imatrix_mse"}
    group = {"targets": ["Linear"], "weights": weights}
    attach(model, Recipe(config_groups={"g": group}))
    assert needs_data(attachment_of(model))
    assert calibrate(model, token_batches(2), progress=False).batches == 2


class _TwoPasses(StaticMinMaxObserver):
    """Counts the calls of each pass; keeps the first pass's range."""

    needs = frozenset({Need.SECOND_PASS})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = [0, 0]
        self.second = False

    def begin_second_pass(self) -> None:
        self.second = True

    def update(self, observed: torch.Tensor) -> None:
        self.calls[self.second] += 1
        if not self.second:
            super().update(observed)


@pytest.mark.parametrize("pipeline", ["model", "layer"])
def test_a_second_pass_runs_the_batches_again(pipeline: str) -> None:
    model, plain = tiny_llama(), tiny_llama()
    attach(model, _recipe())
    attach(plain, _recipe())
    chosen = [e for e in attachment_of(model).entries if e.base_name == "input"][:3]
    for entry in chosen:  # the observer replaced: no registry entry needed
        entry.module.register_module(
            "input_observer", _TwoPasses("input", entry.args, entry.module)
        )
    data = iter(token_batches(3))  # streamed: held for the second pass
    report = calibrate(model, data, progress=False, pipeline=pipeline)
    expected = calibrate(plain, token_batches(3), progress=False)
    for entry in chosen:
        assert entry.observer.calls == [3, 3]  # type: ignore[attr-defined]
    assert report.tokens == expected.tokens  # counted once
    found = _qparams(model)
    assert all(torch.equal(found[k], v) for k, v in _qparams(plain).items())


def test_the_loop_knows_no_observer_class() -> None:
    """The lifecycle, its strategies, the layer pipeline and `calibrate`
    serve declarations: no observer class or statistic among their names."""
    for module in (lifecycle, strategy, sequential, calibrate_module):
        names = set(vars(module))
        classes = {"StaticMSEObserver", "CandidateErrors", "IMatrixMSEObserver"}
        assert not names & classes
        assert "ObserverEngine" not in names or module is strategy


def test_a_pass_stopped_partway_is_not_continued() -> None:
    """A batch that fails leaves part of a pass in the observers: the next
    calibrate() refuses instead of adding every batch again."""
    model = tiny_llama()
    attach(model, _recipe())
    good = token_batches(2)
    with pytest.raises(Exception):  # noqa: B017 - whatever the model raises
        calibrate(model, [good[0], {"input_ids": "not a tensor"}], progress=False)
    assert Calibration.of(model).status is Status.OBSERVING
    with pytest.raises(RuntimeError, match=r"stopped partway.*attach them again"):
        calibrate(model, good, progress=False)


def test_an_in_place_export_failing_after_the_freeze_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of disk space while writing: no file is left, and the model (its
    weights compressed by then) is reported as exported, not as frozen."""
    pytest.importorskip("compressed_tensors")
    from quantobs.calibration import export

    model = tiny_llama()
    attach(model, _recipe())
    calibrate(model, token_batches(1), progress=False)

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "sorted_state", full)
    calibration = Calibration.of(model)
    with pytest.raises(OSError, match="No space left"):
        calibration.export(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == []
    assert calibration.status is Status.EXPORTED
    with pytest.raises(RuntimeError, match="exported in place"):
        calibrate(model, token_batches(1), progress=False)


def _counting_calls(module: torch.nn.Module) -> list[int]:
    calls: list[int] = []
    forward = module.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return forward(*args, **kwargs)

    module.forward = counted  # type: ignore[method-assign]
    return calls


def test_the_pass_stops_before_an_unobserved_head(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # lm_head ignored: every observation is made inside the base model, so
    # the logits are never computed, and the qparams are those of full passes
    batches = token_batches(3)
    cut, whole = tiny_llama(), tiny_llama()
    calls = _counting_calls(cut.lm_head)
    attach(cut, _recipe())
    attach(whole, _recipe())
    observed = [e.module for e in attachment_of(cut).entries]
    assert lifecycle.unobserved_head(cut, observed) is cut.lm_head
    calibrate(cut, batches, progress=False)
    assert calls == []
    monkeypatch.setattr(lifecycle, "unobserved_head", lambda *_: None)
    calibrate(whole, batches, progress=False)
    ours, reference = _qparams(cut), _qparams(whole)
    assert ours.keys() == reference.keys() and ours
    assert all(torch.equal(ours[k], reference[k]) for k in ours)
    assert cut.lm_head(torch.ones(1, cut.config.hidden_size)).shape[-1] > 0  # hook gone


def test_an_observed_head_runs() -> None:
    model = tiny_llama()
    calls = _counting_calls(model.lm_head)
    attach(model, Recipe(config_groups=_recipe().config_groups))  # lm_head too
    calibrate(model, token_batches(2), progress=False)
    assert calls and "lm_head.input_scale" in _qparams(model)
