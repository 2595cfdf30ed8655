"""`quantobs.report.compare` and `evaluate`: the rows, and a small end-to-end
comparison on a two-layer BERT."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from quantobs.calibration import Recipe, attach, calibrate, text_batches
from quantobs.report.compare import ROWS, Resolved, compare, resolve_row, spec_text
from quantobs.report.evaluate import HeldOut, evaluate, input_ranges
from quantobs.report.results import Comparison
from tests.tiny_bert import HELDOUT, TEXTS, write_tiny_bert

IGNORE = ["re:.*pooler.*"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, object]:
    directory = write_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModel.from_pretrained(directory).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def comparison(tiny: tuple[torch.nn.Module, object]) -> Comparison:
    model, tokenizer = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = compare(
        model,
        tokenizer,
        TEXTS,
        HELDOUT,
        schemes=["W4A16", "FP8"],
        observers=["minmax", "mse", "static_mse", "imatrix"],
        ignore=IGNORE,
        batch_size=3,
        model_name="tiny",
        progress=False,
    )
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    return result


# ------------------------------------------------------------------- rows


def test_named_rows() -> None:
    assert resolve_row("minmax", "FP8") == Resolved(
        "memoryless_minmax", "static_minmax"
    )
    assert resolve_row("mse", "FP8") == Resolved("memoryless_mse", "mse")
    # W4A16 quantizes no input: only the weight observer runs
    assert resolve_row("static_mse", "W4A16") == Resolved("memoryless_mse", None)
    # W8A8's inputs are dynamic per token: nothing to observe
    assert resolve_row("mse", "W8A8") == Resolved("memoryless_mse", None)
    # NVFP4 observes the inputs' global scale
    assert resolve_row("percentile", "NVFP4").input == "percentile"


def test_histogram_family_runs_at_every_granularity() -> None:
    for row in ("histogram", "percentile", "entropy"):
        assert resolve_row(row, "W8A8") == Resolved(row, None)  # per channel
        assert resolve_row(row, "W4A16") == Resolved(row, None)  # per group
        assert resolve_row(row, "FP8") == Resolved(row, row)  # per tensor


def test_histogram_family_keeps_minmax_on_groups_of_16_and_32() -> None:
    for row in ("histogram", "percentile", "entropy", "histogram_mse"):
        # NVFP4's groups of 16: the inputs (global scale) still run the row
        assert resolve_row(row, "NVFP4") == Resolved("memoryless_minmax", row)
        assert resolve_row(row, "MXFP4") == Resolved("memoryless_minmax", None)


def test_mse_option_rows() -> None:
    refine = resolve_row("mse_refine", "W4A16")
    assert refine == Resolved("memoryless_mse", None, (("search", "refine"),))
    assert isinstance(refine, Resolved)
    assert refine.weight_spec == ("memoryless_mse", {"search": "refine"})
    assert spec_text(refine.weight_spec) == "memoryless_mse(search=refine)"
    # the inputs keep the mse row's observer
    assert resolve_row("mse_fine", "FP8") == Resolved(
        "memoryless_mse", "mse", (("search", "fine"),)
    )
    discrete = resolve_row("mse_discrete", "NVFP4")
    assert isinstance(discrete, Resolved)
    assert discrete.weight_options == (("scale_search", "discrete"),)


@pytest.mark.parametrize(
    ("row", "scheme", "reason"),
    [
        ("mse_discrete", "W4A16", "NVFP4"),
        ("mse_discrete", "FP8", "NVFP4"),
        ("mse_independent", "W4A16", "asymmetric"),
    ],
)
def test_mse_option_rows_skip_with_the_observers_reason(
    row: str, scheme: str, reason: str
) -> None:
    refused = resolve_row(row, scheme)
    assert isinstance(refused, str)
    assert refused.startswith("memoryless_mse(")
    assert reason in refused


def test_mse_independent_runs_on_asymmetric_weights() -> None:
    assert resolve_row("mse_independent", "W4A16_ASYM") == Resolved(
        "memoryless_mse", None, (("independent_bounds", True),)
    )


def test_imatrix_needs_channels_or_groups() -> None:
    assert resolve_row("imatrix", "W4A16") == Resolved("imatrix_mse", None)
    reason = resolve_row("imatrix", "FP8")
    assert isinstance(reason, str) and "per-channel or per-group" in reason


def test_other_registered_names_run_on_both() -> None:
    assert "histogram_mse" not in ROWS
    assert resolve_row("histogram_mse", "FP8") == Resolved(
        "histogram_mse", "histogram_mse"
    )
    assert resolve_row("minmax", "UNQUANTIZED") == "UNQUANTIZED quantizes no weights"


# ---------------------------------------------------------- end to end


def test_cells_and_skipped(comparison: Comparison) -> None:
    ran = [(c.scheme, c.observer) for c in comparison.cells]
    assert ran == [
        ("W4A16", "minmax"),
        ("W4A16", "mse"),
        ("W4A16", "imatrix"),
        ("FP8", "minmax"),
        ("FP8", "mse"),
        ("FP8", "static_mse"),
    ]
    skipped = {(s.scheme, s.observer): s.reason for s in comparison.skipped}
    assert skipped[("W4A16", "static_mse")] == (
        "same observers as mse under W4A16 (no static inputs)"
    )
    assert "per-channel or per-group" in skipped[("FP8", "imatrix")]
    assert comparison.calibration_texts == len(TEXTS)
    assert comparison.heldout_texts == len(HELDOUT)
    assert comparison.seconds > 0


def test_cell_metrics(comparison: Comparison) -> None:
    layers = {
        f"encoder.layer.{i}.{part}"
        for i in range(2)
        for part in (
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
            "intermediate.dense",
            "output.dense",
        )
    }
    for cell in comparison.cells:
        assert -1 <= cell.cosine_worst <= cell.cosine_mean <= 1
        assert 0 <= cell.neighbours <= 1
        assert -1 <= cell.spearman <= 1
        assert set(cell.weight_sqnr) == layers
        assert all(math.isfinite(v) and v > 0 for v in cell.weight_sqnr.values())
        assert cell.calibration_seconds > 0 and cell.evaluation_seconds > 0
        if cell.scheme == "W4A16":
            assert cell.input_sqnr == {} and cell.input_ranges == {}
            assert cell.mean_input_sqnr is None
        else:
            assert set(cell.input_sqnr) == layers == set(cell.input_ranges)
            assert cell.mean_input_sqnr is not None
    by = {(c.scheme, c.observer): c for c in comparison.cells}
    # 8-bit float beats 4-bit int on weights, per layer
    fp8, w4 = by[("FP8", "minmax")], by[("W4A16", "minmax")]
    assert all(fp8.weight_sqnr[k] > w4.weight_sqnr[k] for k in fp8.weight_sqnr)
    # the weights of mse and static_mse are the same observer: same SQNR
    assert by[("FP8", "mse")].weight_sqnr == by[("FP8", "static_mse")].weight_sqnr


def test_worst_layer_histogram(comparison: Comparison) -> None:
    histogram = comparison.histogram
    assert histogram is not None and histogram.scheme == "FP8"
    minmax = comparison.cells_of("FP8")[0]
    assert histogram.layer == min(minmax.input_sqnr, key=minmax.input_sqnr.__getitem__)
    assert set(histogram.ranges) == {"minmax", "mse", "static_mse"}
    assert len(histogram.edges) == len(histogram.counts) + 1
    assert histogram.edges == sorted(histogram.edges)
    assert sum(histogram.counts) > 0
    low, high = histogram.edges[0], histogram.edges[-1]
    for range_low, range_high in histogram.ranges.values():
        assert low <= range_low < 0 < range_high <= high


def test_minmax_range_is_the_calibration_absmax(
    tiny: tuple[torch.nn.Module, object],
) -> None:
    # FP8 (e4m3, max 448), symmetric per tensor: scale = absmax / 448, so the
    # range the qparams represent is +-absmax of the calibration inputs.
    model, tokenizer = tiny
    calibration = text_batches(tokenizer, TEXTS, batch_size=3)
    seen: list[float] = []
    layer = model.get_submodule("encoder.layer.0.intermediate.dense")
    handle = layer.register_forward_pre_hook(
        lambda _, inputs: seen.append(float(inputs[0].abs().max()))
    )
    with torch.no_grad():
        for batch in calibration:
            model(**batch)
    handle.remove()
    import copy

    calibrated = copy.deepcopy(model)
    attach(calibrated, Recipe.from_scheme("FP8", ignore=IGNORE))
    calibrate(calibrated, calibration, progress=False)
    low, high = input_ranges(calibrated)["encoder.layer.0.intermediate.dense"]
    assert high == pytest.approx(max(seen), rel=1e-6)
    assert low == -high


def test_evaluate_quantizes_a_copy(
    tiny: tuple[torch.nn.Module, object],
) -> None:
    # W8A8 on a random model still tracks the reference closely; evaluate
    # leaves the calibrated model as it was (no compressed-tensors state).
    import copy

    model, tokenizer = tiny
    held_out = HeldOut.of(model, text_batches(tokenizer, HELDOUT, batch_size=2))
    assert held_out.reference.shape == (len(HELDOUT), 128)
    calibrated = copy.deepcopy(model)
    attach(calibrated, Recipe.from_scheme("W8A8", ignore=IGNORE))
    calibrate(calibrated, text_batches(tokenizer, TEXTS, batch_size=3), progress=False)
    evaluation = evaluate(calibrated, held_out)
    assert evaluation.cosine_mean > 0.99
    assert set(evaluation.input_sqnr) == set(evaluation.weight_sqnr)
    assert not any(hasattr(m, "quantization_scheme") for m in calibrated.modules()), (
        "evaluate must quantize a copy"
    )
    assert "cos mean" in evaluation.summary()


def test_held_out_needs_three_texts(tiny: tuple[torch.nn.Module, object]) -> None:
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="at least 3"):
        HeldOut.of(model, text_batches(tokenizer, HELDOUT[:2]))


def test_json_ready(comparison: Comparison) -> None:
    import json

    data = comparison.to_dict()
    text = json.dumps(data, allow_nan=False)
    back = json.loads(text)
    assert [c["observer"] for c in back["cells"]] == [
        c.observer for c in comparison.cells
    ]
    assert back["cells"][0]["mean_input_sqnr"] is None  # W4A16: no inputs


def test_evaluation_is_compressed_tensors_forward(
    tiny: tuple[torch.nn.Module, object],
) -> None:
    # evaluate fake-quantizes each weight in every forward of a view sharing
    # the model's tensors; the embeddings are those of compressed-tensors'
    # own quantized forward on a copy
    import copy

    from quantobs.calibration.simulate import compressed_tensors_copy
    from quantobs.report.evaluate import embed
    from quantobs.report.metrics import cosine_to_reference

    model, tokenizer = tiny
    held_out = HeldOut.of(model, text_batches(tokenizer, HELDOUT, batch_size=2))
    calibrated = copy.deepcopy(model)
    attach(calibrated, Recipe.from_scheme("NVFP4", ignore=IGNORE))
    calibrate(calibrated, text_batches(tokenizer, TEXTS, batch_size=3), progress=False)
    theirs = embed(compressed_tensors_copy(calibrated), held_out.batches)
    expected = cosine_to_reference(held_out.reference, theirs)
    assert evaluate(calibrated, held_out).cosine_mean == pytest.approx(
        expected[0], abs=1e-12
    )


def test_fit_warnings_become_the_cells_notes(
    tiny: tuple[torch.nn.Module, object],
) -> None:
    import warnings

    from rich.console import Console

    from quantobs.report.render import footnotes, render_table, to_csv

    model, tokenizer = tiny
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none escapes the cells
        result = compare(
            model,
            tokenizer,
            TEXTS,
            HELDOUT,
            schemes=["FP8", "W8A8"],
            observers=["minmax", "entropy"],
            ignore=IGNORE,
            batch_size=3,
            progress=False,
        )
    by = {(c.scheme, c.observer): c for c in result.cells}
    (note,) = by[("FP8", "entropy")].notes
    assert note.startswith("observer 'entropy' does not fit float8_e4m3fn: ")
    assert by[("FP8", "minmax")].notes == ()
    # int8 inputs (dynamic under W8A8) fit; int8 weights do not
    (weights_note,) = by[("W8A8", "entropy")].notes
    assert weights_note.startswith("observer 'entropy' does not fit weights: ")
    assert by[("W8A8", "minmax")].notes == ()
    assert footnotes(result, "FP8") == [note]
    console = Console(record=True, width=400)
    render_table(result, console)
    text = console.export_text()
    assert "entropy [1]" in text
    assert f"[1] {note}" in text
    assert note in to_csv(result)


def test_compare_runs_in_eval_mode_and_restores_train_mode(
    tiny: tuple[torch.nn.Module, object],
) -> None:
    # A model given in train mode: no dropout in the reference or the cells
    # (the metrics equal an eval-mode run), and its mode is given back.
    model, tokenizer = tiny
    kwargs: dict[str, object] = {
        "schemes": ["W8A8"],
        "observers": ["minmax"],
        "ignore": IGNORE,
        "batch_size": 3,
        "progress": False,
    }
    evaluated = compare(model, tokenizer, TEXTS, HELDOUT, **kwargs)  # type: ignore[arg-type]
    model.train()
    try:
        trained = compare(model, tokenizer, TEXTS, HELDOUT, **kwargs)  # type: ignore[arg-type]
        assert model.training
    finally:
        model.eval()
    (first,), (second,) = evaluated.cells, trained.cells
    assert first.cosine_mean == second.cosine_mean
    assert first.weight_sqnr == second.weight_sqnr
