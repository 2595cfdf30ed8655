"""The `quantobs` command line.

    quantobs weights [--model PATH] [--scheme NAME] [--limit N]
                     [--format table|json|csv]
    quantobs compare [--model DIR] [--schemes ...] [--observers ...] [--quick]
                     [--report DIR] [...]   (see `quantobs.cli.compare_cmd`)
    quantobs calibrate [--model DIR] --scheme NAME --out DIR [...]
                     (see `quantobs.cli.calibrate_cmd`)
    quantobs info    versions, and which backend runs the kernels

Exit codes: 0 success, 2 a usage error (bad option, unknown scheme or
observer, missing model path, a model transformers cannot load, a config
naming no architecture or one transformers lacks, weights that do not fit
it, unreadable or empty data, a layer the scheme cannot take, a scheme that
quantizes nothing, an existing or unwritable output directory), 1 an
unexpected failure.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from quantobs.cli.arguments import positive_int

__all__ = ["EXIT_OK", "EXIT_USAGE", "build_parser", "main"]

EXIT_OK = 0
EXIT_USAGE = 2
_FORMATS = ("table", "json", "csv")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `quantobs` and its subcommands."""
    from quantobs import PRESET_SCHEMES, __version__

    parser = argparse.ArgumentParser(
        prog="quantobs",
        description="Quantization observers on PyTorch: inspect how a checkpoint "
        "quantizes under a scheme.",
    )
    parser.add_argument(
        "--version", action="version", version=f"quantobs {__version__}"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    weights = commands.add_parser(
        "weights",
        help="min-max fake-quantize every linear weight; report SQNR per layer",
        description="Compute min-max qparams for every linear weight of a "
        ".safetensors checkpoint under a preset scheme's weight args, "
        "fake-quantize, and report the error per layer (SQNR in dB, max abs "
        "error). Linear weights: 2-D floating '.weight' tensors whose name "
        "contains neither 'embed' nor 'norm'.",
    )
    weights.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="PATH",
        help="a .safetensors file or a directory holding one or more (default: "
        "the embedded sentence-transformers/all-MiniLM-L6-v2)",
    )
    weights.add_argument(
        "--scheme",
        default="W4A16",
        metavar="NAME",
        help="preset scheme name, case-insensitive (default: W4A16); one of "
        + ", ".join(PRESET_SCHEMES),
    )
    weights.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        metavar="N",
        help="only the first N linear weights",
    )
    weights.add_argument(
        "--format",
        choices=_FORMATS,
        default="table",
        help="output format (default: table)",
    )
    weights.set_defaults(handler=_run_weights)

    from quantobs.cli.calibrate_cmd import add_parser as add_calibrate
    from quantobs.cli.compare_cmd import add_parser as add_compare

    add_compare(commands)
    add_calibrate(commands)

    info = commands.add_parser(
        "info",
        help="versions, and which backend runs the kernels (native or torch)",
        description="Print the quantobs, Python and torch versions and the "
        "backend of the kernels: the native library (its path, OpenMP, the ISA "
        "its hot loops run with on this CPU) or torch, with the reason.",
    )
    info.set_defaults(handler=_run_info)
    return parser


def _error(message: str) -> int:
    print(f"quantobs: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _run_weights(options: argparse.Namespace) -> int:
    from quantobs import PRESET_SCHEMES
    from quantobs.cli.weights_output import format_csv, format_json, format_table
    from quantobs.cli.weights_report import weights_report

    scheme = options.scheme.strip().upper()
    if scheme not in PRESET_SCHEMES:
        return _error(
            f"unknown scheme {options.scheme!r}; available presets: "
            f"{', '.join(PRESET_SCHEMES)}"
        )
    model: Path | None = options.model
    if model is None:
        from quantobs.cli.default_model import default_model_path

        try:
            model = default_model_path()
        except FileNotFoundError as error:
            return _error(str(error))
    elif not model.exists():
        return _error(
            f"model path {str(model)!r} does not exist; pass a .safetensors file "
            f"or a directory that holds one"
        )
    try:
        report = weights_report(model, scheme, limit=options.limit)
    except (FileNotFoundError, ValueError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) else str(error)
        return _error(str(message))

    formatters = {"table": format_table, "json": format_json, "csv": format_csv}
    sys.stdout.write(formatters[options.format](report))
    return EXIT_OK


def _run_info(options: argparse.Namespace) -> int:
    import platform

    import torch

    from quantobs import __version__, native

    print(f"quantobs {__version__}")
    print(
        f"python {platform.python_version()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), {platform.system()} "
        f"{platform.machine()}"
    )
    for line in native.backend_info().lines():
        print(line)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `quantobs` command line; returns the exit code.

    Args:
        argv: the arguments after the program name (default: `sys.argv[1:]`).
    """
    parser = build_parser()
    try:
        options = parser.parse_args(None if argv is None else list(argv))
    except SystemExit as exit_:  # argparse exits on --help, --version, errors
        return int(exit_.code) if isinstance(exit_.code, int) else EXIT_USAGE
    handler = options.handler
    code: int = handler(options)
    return code
