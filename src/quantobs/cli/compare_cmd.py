"""`quantobs compare`: which scheme and which observer for my model?

    quantobs compare [--model DIR] [--schemes NAME ...] [--observers NAME ...]
                     [--quick] [--data FILE] [--heldout FILE]
                     [--batch-size 16] [--max-length 128] [--ignore PATTERN ...]
                     [--kv-cache-scheme FP8|INT8]
                     [--format table|json|csv]
                     [--report DIR] [--report-format html|markdown]
                     [--overwrite] [--no-progress]

Loads the model as the class its `config.json` names
(`quantobs.cli.model_loading`), calibrates it under each scheme x observer
row on the calibration texts, evaluates each against the unquantized model
on the held-out texts (`quantobs.report.compare`; a causal LM by its
next-token KL, top-1 agreement and perplexity, other models by their
embeddings) and prints a table per scheme with the best of
each column marked and a verdict; `--report DIR` also writes an HTML (or
Markdown) report with plots.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from quantobs.cli.inputs import (
    UsageError,
    add_text_options,
    check_quantizes,
    check_tied_head,
    default_ignore,
    model_dir,
    model_failure,
    observer_name,
    scheme_name,
    texts,
)
from quantobs.cli.kv_cache import KV_CACHE_SCHEMES, check_attached, kv_cache_args
from quantobs.cli.model_loading import load_model

__all__ = ["add_parser", "run_compare"]

_EXIT_OK = 0
_EXIT_USAGE = 2
_FORMATS = ("table", "json", "csv")
_REPORT_FORMATS = ("html", "markdown")
#: table width when stdout is not a terminal (rich would assume 80 columns)
_PIPED_WIDTH = 150


def _epilog() -> str:
    from quantobs.report.compare import ROWS, spec_text
    from quantobs.report.render import CAUSAL_METRIC_DEFINITIONS, METRIC_DEFINITIONS

    rows = "\n".join(
        f"  {row:<16} weights: {spec_text(weight)}, static inputs: {inputs}"
        for row, (weight, inputs) in ROWS.items()
    )
    metrics = "\n".join(
        f"  {name}: {text}" for name, text in METRIC_DEFINITIONS.items()
    )
    causal = "\n".join(
        f"  {name}: {text}" for name, text in CAUSAL_METRIC_DEFINITIONS.items()
    )
    return (
        f"observer rows:\n{rows}\n  any other registered observer name runs "
        "that observer on both.\n  imatrix needs per-channel or per-group "
        "weights; mse_independent asymmetric\n  weights; mse_discrete NVFP4 or "
        "MX weights. A row with the same observers\n  as an earlier one is "
        "skipped. Warnings an observer gives (entropy or\n  percentile on a "
        "float format) are footnotes [k] of its row.\n\n"
        f"metrics (held-out texts, quantized vs unquantized model):\n{metrics}"
        "\n\ncausal LMs (the class config.json names maps to a causal LM) are "
        "scored by\ntheir own next-token predictions instead of the four "
        "embedding metrics;\nthe verdict picks the observer of lowest KL "
        f"(within 0.001 nats: keep minmax):\n{causal}"
    )


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Register the `compare` subcommand on `commands` (the subparsers)."""
    from quantobs.report.compare import (
        DEFAULT_OBSERVERS,
        DEFAULT_SCHEMES,
        QUICK_OBSERVERS,
        QUICK_SCHEMES,
    )

    parser: argparse.ArgumentParser = commands.add_parser(
        "compare",
        help="which scheme and observer for a model: calibrate each, compare "
        "with the unquantized model on held-out text",
        description="Calibrate a Hugging Face model (default: the embedded "
        "all-MiniLM-L6-v2) under several schemes x observers and evaluate each "
        "against the unquantized model on held-out texts: a table per scheme "
        "(best per column marked, a verdict), JSON or CSV for scripts, and an "
        "HTML or Markdown report with plots.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="DIR",
        help="a Hugging Face model directory with .safetensors weights (default: "
        "the embedded sentence-transformers/all-MiniLM-L6-v2)",
    )
    parser.add_argument(
        "--schemes",
        nargs="+",
        default=None,
        metavar="NAME",
        help=f"preset schemes (default: {' '.join(DEFAULT_SCHEMES)}; --quick: "
        f"{' '.join(QUICK_SCHEMES)})",
    )
    parser.add_argument(
        "--observers",
        nargs="+",
        default=None,
        metavar="NAME",
        help=f"observer rows (default: {' '.join(DEFAULT_OBSERVERS)}; --quick: "
        f"{' '.join(QUICK_OBSERVERS)})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the smaller default matrix (schemes and observers not given)",
    )
    add_text_options(parser, "the metrics are computed on (at least 3)")
    parser.add_argument(
        "--kv-cache-scheme",
        default=None,
        metavar="NAME",
        help="also quantize the attention's key and value states in every "
        "cell, static per tensor, symmetric: "
        + ", ".join(KV_CACHE_SCHEMES)
        + " (FP8: float8_e4m3fn); default: none",
    )
    parser.add_argument(
        "--format",
        choices=_FORMATS,
        default="table",
        help="output on stdout (default: table)",
    )
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write a report with plots into DIR (must not exist or be empty)",
    )
    parser.add_argument(
        "--report-format",
        choices=_REPORT_FORMATS,
        default="html",
        help="report.html, self-contained (default), or report.md beside the PNGs",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --report directory (once the new one is written)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run_compare)
    return parser


def _check_report_dir(report: Path, overwrite: bool) -> None:
    """Refuse a report directory that could not be written, before any work."""
    if report.exists() and not report.is_dir():
        raise UsageError(f"--report {report} exists and is not a directory")
    if not overwrite and report.is_dir() and any(report.iterdir()):
        raise UsageError(
            f"--report {report} exists and is not empty; choose a new one or "
            "pass --overwrite"
        )
    parent = report.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--report {report}: cannot write in {parent}")


def _matrix(options: argparse.Namespace) -> tuple[list[str], list[str]]:
    from quantobs.report.compare import (
        DEFAULT_OBSERVERS,
        DEFAULT_SCHEMES,
        QUICK_OBSERVERS,
        QUICK_SCHEMES,
        ROWS,
    )

    schemes = options.schemes or (QUICK_SCHEMES if options.quick else DEFAULT_SCHEMES)
    rows = options.observers or (
        QUICK_OBSERVERS if options.quick else DEFAULT_OBSERVERS
    )
    names = [scheme_name(s) for s in schemes]
    observers = [observer_name(o, extra=tuple(ROWS)) for o in rows]
    return list(dict.fromkeys(names)), list(dict.fromkeys(observers))


def _check_schemes(
    model: Any, schemes: list[str], ignore: list[str], kv_cache: str | None
) -> None:
    """Attach (and detach) each scheme's observers: a layer a scheme cannot
    take, a recipe that quantizes nothing, a kv-cache scheme no attention
    takes are reported before the long work."""
    from quantobs.calibration import Recipe, attach, detach
    from quantobs.calibration.transposed import linear_targets

    kv = kv_cache_args(kv_cache)
    targets = linear_targets(model)  # GPT-2's Conv1D layers too
    for scheme in schemes:
        try:
            recipe = Recipe.from_scheme(
                scheme, targets=targets, ignore=ignore, kv_cache_scheme=kv
            )
            attach(model, recipe)
        except (KeyError, ValueError, TypeError) as error:
            message = error.args[0] if isinstance(error, KeyError) else error
            raise UsageError(
                f"scheme {scheme}: {message} (on the command line: --ignore "
                "NAME_OR_RE ...)"
            ) from None
        try:
            check_quantizes(model, scheme)
            check_tied_head(model)
            if kv_cache is not None:
                check_attached(model, kv_cache)
        finally:
            detach(model)


def _compare(options: argparse.Namespace) -> None:
    from quantobs.core.peer_versions import COMPARE_TASK, check_fp6_schemes
    from quantobs.data import calibration_texts, heldout_texts
    from quantobs.report.compare import compare

    schemes, observers = _matrix(options)
    kv_cache_args(options.kv_cache_scheme)  # a bad name: before any loading
    try:  # FP6 schemes without compressed-tensors >= 0.20: before any loading
        check_fp6_schemes(schemes, kv_cache_args(options.kv_cache_scheme), COMPARE_TASK)
    except ValueError as error:
        raise UsageError(str(error)) from None
    directory = model_dir(options.model)
    calibration = texts(options.data, calibration_texts(), "calibration")
    held_out = texts(options.heldout, heldout_texts(), "held-out")
    if len(held_out) < 3:
        raise UsageError(f"--heldout has {len(held_out)} text(s); the metrics need 3")
    if options.report is not None:
        _check_report_dir(options.report, options.overwrite)
    model, tokenizer = load_model(directory)
    ignore = default_ignore(model) if options.ignore is None else list(options.ignore)
    _check_schemes(model, schemes, ignore, options.kv_cache_scheme)
    try:
        comparison = compare(
            model,
            tokenizer,
            calibration,
            held_out,
            schemes=schemes,
            observers=observers,
            ignore=ignore,
            batch_size=options.batch_size,
            max_length=options.max_length,
            model_name=str(directory),
            progress=False if options.no_progress else None,
            kv_cache_scheme=kv_cache_args(options.kv_cache_scheme),
        )
    except (IndexError, RuntimeError, TypeError) as error:
        raise model_failure(error, "calibration or held-out") from None
    _print(comparison, options.format)
    if options.report is not None:
        from quantobs.report.document import write_report

        try:
            path = write_report(
                comparison,
                options.report,
                format=options.report_format,
                overwrite=options.overwrite,
            )
        except OSError as error:
            raise UsageError(f"cannot write the report: {error}") from None
        # json and csv keep stdout for the data
        stream = sys.stdout if options.format == "table" else sys.stderr
        print(f"report: {path}", file=stream)


def _print(comparison: Any, format: str) -> None:
    from quantobs.report.render import render_table, to_csv, to_json

    if format == "json":
        sys.stdout.write(to_json(comparison) + "\n")
    elif format == "csv":
        sys.stdout.write(to_csv(comparison))
    else:
        from rich.console import Console

        console = Console()
        if not console.is_terminal:  # piped or captured: no terminal width
            console = Console(width=_PIPED_WIDTH)
        render_table(comparison, console)


def run_compare(options: argparse.Namespace) -> int:
    """The handler of `quantobs compare`; returns the exit code."""
    try:
        _compare(options)
    except UsageError as error:
        print(f"quantobs: error: {error}", file=sys.stderr)
        return _EXIT_USAGE
    return _EXIT_OK
