"""`quantobs calibrate`: a Hugging Face model directory to a compressed-tensors
checkpoint.

    quantobs calibrate [--model DIR] --scheme NAME
                       [--observer NAME | --weight-observer NAME
                        --input-observer NAME]
                       [--data FILE] [--heldout FILE]
                       [--batch-size 16] [--max-length 128]
                       [--ignore PATTERN ...] [--kv-cache-scheme FP8|INT8]
                       --out DIR [--resume STATE] [--save-state STATE]
                       [--all-experts] [--pipeline auto|model|layer]
                       [--distributed] [--no-progress]
                       [--offload-folder DIR [--max-memory DEVICE=SIZE ...]]
                       [--max-shard-size 5GB]

Loads the model as the class its `config.json` names and its tokenizer (with
a pad token where it has none), offline (`quantobs.cli.model_loading`);
attaches the observers of the preset scheme (and of the k / v attention
states with `--kv-cache-scheme`, `quantobs.cli.kv_cache`); a causal LM's
`lm_head` is left unquantized unless `--ignore` says otherwise. Then it
optionally resumes a saved calibration
state, calibrates on `--data` (or the packaged calibration corpus), optionally
saves the state, writes the checkpoint with `save_compressed` and prints the
report, the held-out metrics of the quantized model against the unquantized
one (`quantobs.report.evaluate`; defined in `quantobs compare --help`) and
the checkpoint's path. `--pipeline layer` calibrates one decoder layer at
a time (`quantobs.calibration.sequential`; the default, `auto`, does for a
model that does not fit its device: offloaded, or its parameters and a
batch's activations beyond the device's free memory), with the same
qparams. With `--distributed` (under `torchrun`),
each process batches and calibrates its contiguous share of the texts and the
statistics are synced (`calibrate(..., sync=True)`); process 0 writes. With
`--offload-folder` the model is loaded with accelerate's offloading
(`quantobs.cli.offloading`); the evaluation quantizes one weight at a time
(nothing copied), the checkpoint is written in place (the model is frozen
after its evaluation) in files of at most `--max-shard-size`, and no file of
quantobs is left under `--offload-folder` when the command ends (succeeding
or not; `quantobs.calibration.offload.release_written`).

Every failure is exit 2 and one `quantobs: error:` line naming the file or
value and what to do. `--out` and `--save-state` are written under hidden
names beside them and renamed into place holding their lock
(`quantobs.calibration.locking`): a second run writing the same one is
refused, not silently replaced, and what killed runs left there is removed.

(Over 500 lines: one command's options, its checks before any long work and
its steps, in the order they run.)
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
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
    scheme_name,
    texts,
)
from quantobs.cli.kv_cache import KV_CACHE_SCHEMES, check_attached, kv_cache_args
from quantobs.cli.model_loading import load_model
from quantobs.cli.offloading import add_offload_options, load_options, shard_size
from quantobs.cli.torchrun import TorchrunGroup

__all__ = ["add_parser", "run_calibrate", "shard"]

_EXIT_OK = 0
_EXIT_USAGE = 2


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Register the `calibrate` subcommand on `commands` (the subparsers)."""
    from quantobs import PRESET_SCHEMES

    parser: argparse.ArgumentParser = commands.add_parser(
        "calibrate",
        help="calibrate a model on text and write a compressed-tensors checkpoint",
        description="Load a Hugging Face model directory (offline), attach the "
        "observers of a preset scheme, run calibration text through it and "
        "write a compressed-tensors checkpoint that transformers and vLLM load.",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="DIR",
        help="a Hugging Face model directory (config.json, weights, tokenizer); "
        "default: the embedded sentence-transformers/all-MiniLM-L6-v2",
    )
    parser.add_argument(
        "--scheme",
        required=True,
        metavar="NAME",
        help="preset scheme name, case-insensitive; one of "
        + ", ".join(PRESET_SCHEMES),
    )
    observers = parser.add_mutually_exclusive_group()
    observers.add_argument(
        "--observer",
        default=None,
        metavar="NAME",
        help="observer of both the weights and the input activations",
    )
    observers.add_argument(
        "--weight-observer",
        default=None,
        metavar="NAME",
        help="observer of the weights (default: the scheme's)",
    )
    parser.add_argument(
        "--input-observer",
        default=None,
        metavar="NAME",
        help="observer of the input activations (default: the scheme's)",
    )
    add_text_options(parser, "the result is evaluated on")
    parser.add_argument(
        "--kv-cache-scheme",
        default=None,
        metavar="NAME",
        help="also quantize the attention's key and value states (the kv "
        "cache), static per tensor, symmetric: "
        + ", ".join(KV_CACHE_SCHEMES)
        + " (FP8: float8_e4m3fn, as llm-compressor's examples); default: none",
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="DIR",
        help="the checkpoint directory to write (must not exist or be empty)",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="STATE",
        help="load the observers' statistics saved by --save-state first",
    )
    parser.add_argument(
        "--save-state",
        type=Path,
        default=None,
        metavar="STATE",
        help="save the observers' statistics after calibration (safetensors); "
        "replaces the file there when the run started, never one another run "
        "wrote meanwhile",
    )
    parser.add_argument(
        "--all-experts",
        action="store_true",
        help="MoE models: feed every calibration token to every expert's "
        "observers (llm-compressor's moe_calibrate_all_experts), not only the "
        "tokens routed to it; the model's outputs are unchanged",
    )
    parser.add_argument(
        "--pipeline",
        choices=("auto", "model", "layer"),
        default="auto",
        help="run each batch through the whole model, or one decoder layer at "
        "a time (the hidden states cached between layers; same qparams); "
        "auto: layer by layer when the model does not fit its device (offloaded, "
        "or its weights and a batch's activations beyond its free memory) "
        "(default: auto)",
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="under torchrun: each process calibrates its share of the texts, "
        "statistics are synced (gloo on CPU, NCCL on CUDA), process 0 writes",
    )
    add_offload_options(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run_calibrate)
    return parser


def shard(count: int, rank: int, world: int) -> range:
    """The contiguous share of `count` items of process `rank` out of `world`:
    sizes differ by at most one, the first processes take the extra ones."""
    base, extra = divmod(count, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


# ------------------------------------------------------------ the steps


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise UsageError(f"--out {out} exists and is not empty; choose a new directory")


def _recipe(options: argparse.Namespace, scheme: str, ignore: list[str]) -> Any:
    from quantobs.calibration import Recipe

    if options.observer is not None and options.input_observer is not None:
        raise UsageError(
            "--observer sets both observers; use it, or --weight-observer and "
            "--input-observer"
        )
    weight = options.observer or options.weight_observer
    inputs = options.observer or options.input_observer
    return Recipe.from_scheme(
        scheme,
        ignore=ignore,
        weight_observer=weight,
        input_observer=inputs,
        kv_cache_scheme=kv_cache_args(options.kv_cache_scheme),
    )


def _check_format(options: argparse.Namespace, scheme: str) -> None:
    """Fail before loading anything when the scheme has no checkpoint format."""
    from quantobs.calibration import checkpoint_formats

    try:
        checkpoint_formats(_recipe(options, scheme, []))
    except ValueError as error:
        raise UsageError(
            f"scheme {scheme} cannot be written as a checkpoint: {error}"
        ) from None


def _calibrate(options: argparse.Namespace, group: TorchrunGroup | None) -> None:
    from quantobs.calibration.offload import release_written
    from quantobs.calibration.tempfiles import stamp
    from quantobs.data import calibration_texts, heldout_texts

    # the state file this run may replace: the one there now (another
    # process's written meanwhile is kept)
    state_seen = None if options.save_state is None else stamp(options.save_state)
    scheme = scheme_name(options.scheme)
    directory = model_dir(options.model)
    calibration = texts(options.data, calibration_texts(), "calibration")
    held_out_texts = texts(options.heldout, heldout_texts(), "held-out")
    if len(held_out_texts) < 3:
        raise UsageError(
            f"--heldout has {len(held_out_texts)} text(s); the metrics need 3"
        )
    out: Path = options.out
    _check_out(out)
    _check_format(options, scheme)
    loading, max_shard_size = load_options(options), shard_size(options)
    if group is not None:
        calibration = _my_texts(calibration, group.rank, group.world)
    saved = None if options.resume is None else _read_resume(options.resume)
    model, tokenizer = load_model(directory, **loading)
    try:
        _calibrate_loaded(
            options,
            group,
            (model, tokenizer),
            (scheme, directory, calibration, held_out_texts),
            (out, max_shard_size, saved, state_seen),
        )
    finally:  # nothing of ours left under --offload-folder, whatever happened
        release_written(model)


def _calibrate_loaded(
    options: argparse.Namespace,
    group: TorchrunGroup | None,
    loaded: tuple[Any, Any],
    inputs: tuple[str, Path, list[str], list[str]],
    outputs: tuple[Path, int, Any, Any],
) -> None:
    """`_calibrate` once the model is loaded: attach, calibrate, evaluate,
    write."""
    from quantobs.calibration import attach, calibrate, text_batches
    from quantobs.report.evaluate import evaluate

    model, tokenizer = loaded
    scheme, directory, calibration, held_out_texts = inputs
    out, max_shard_size, saved, state_seen = outputs
    _refuse_transposed(model, directory)
    if group is not None and group.device is not None:
        model.to(group.device)
    ignore = default_ignore(model) if options.ignore is None else options.ignore
    try:
        attach(model, _recipe(options, scheme, list(ignore)))
    except (KeyError, ValueError, TypeError) as error:
        message = error.args[0] if isinstance(error, KeyError) else error
        raise UsageError(f"cannot attach the observers: {message}") from None
    check_quantizes(model, scheme)
    check_tied_head(model)
    if options.kv_cache_scheme is not None:
        check_attached(model, options.kv_cache_scheme)
    if group is not None:
        _check_same_recipe(model, group)
    if saved is not None:
        _apply_resume(model, saved, options.resume)
    held_out = _held_out(model, tokenizer, held_out_texts, options)
    batches = text_batches(
        tokenizer,
        calibration,
        batch_size=options.batch_size,
        max_length=options.max_length,
    )
    rank = 0 if group is None else group.rank
    try:
        report = calibrate(
            model,
            batches,
            progress=False if options.no_progress else None,
            sync=group is not None,
            all_experts=options.all_experts,
            pipeline=options.pipeline,
        )
    except RuntimeError as error:
        raise UsageError(f"calibration failed: {error}") from None
    except ValueError as error:
        if group is not None:  # the processes' observers differ
            raise UsageError(
                f"--distributed: {_one_line(error)}; give every process the same "
                "model and options"
            ) from None
        if options.resume is None:
            raise
        raise UsageError(
            f"calibration resumed from --resume {options.resume} failed: {error}; "
            "calibrate again without --resume"
        ) from None
    if group is not None:
        # compressed-tensors compresses in parallel over an initialized
        # process group: closed first, process 0 writes the whole checkpoint
        group.close()
    if rank != 0:
        return
    if options.save_state is not None:
        _write_state(model, options.save_state, state_seen)
    summary = evaluate(model, held_out).summary()  # before the export freezes it
    path = _write_checkpoint(model, out, directory, options.save_state, max_shard_size)
    print(report)
    print(summary)
    if options.save_state is not None:
        print(f"state       {options.save_state}")
    print(f"checkpoint  {path}")


def _check_same_recipe(model: Any, group: TorchrunGroup) -> None:
    """Every process attached the same recipe (the same options), checked
    on every process alike before any long work."""
    import torch.distributed as dist

    from quantobs.calibration.attach import attachment_of

    mine = attachment_of(model).recipe.to_json()
    recipes: list[Any] = [None] * group.world
    dist.all_gather_object(recipes, mine)
    differ = [rank for rank, recipe in enumerate(recipes) if recipe != recipes[0]]
    if differ:
        raise UsageError(
            f"--distributed: process(es) {differ} attached another recipe than "
            "process 0 (different --scheme, observers, --ignore or "
            "--kv-cache-scheme?); give every process the same options"
        )


def _my_texts(calibration: list[str], rank: int, world: int) -> list[str]:
    """The contiguous share of the calibration texts of process `rank` (each
    process batches its own share; the masks make the batching irrelevant
    to the statistics)."""
    if len(calibration) < world:
        raise UsageError(
            f"{len(calibration)} calibration text(s) for {world} processes: "
            "every process needs at least one (more texts in --data or fewer "
            "processes)"
        )
    return [calibration[i] for i in shard(len(calibration), rank, world)]


def _read_resume(path: Path) -> Any:
    """The `--resume` file read and checked before the model loads."""
    from quantobs.calibration.state import read_state

    try:
        return read_state(path)
    except FileNotFoundError:
        raise UsageError(
            f"cannot resume from {path}: no such file; give the file --save-state wrote"
        ) from None
    except (OSError, ValueError) as error:
        raise UsageError(
            f"cannot resume from {path}: {_one_line(error)}; give a state file "
            "--save-state wrote for this model, or calibrate without --resume"
        ) from None


def _apply_resume(model: Any, saved: Any, path: Path) -> None:
    """Load the checked `--resume` state into the attached observers."""
    from quantobs.calibration.state import apply_state

    try:
        apply_state(model, saved)
    except (RuntimeError, ValueError) as error:
        raise UsageError(
            f"cannot resume from {path}: {_one_line(error)}; give a state file "
            "--save-state wrote for this model and options"
        ) from None


def _one_line(error: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(error).split())


def _held_out(
    model: Any, tokenizer: Any, held_out_texts: list[str], options: Any
) -> Any:
    """The held-out reference of the unquantized model (observers off)."""
    from quantobs.calibration import text_batches
    from quantobs.calibration.attach import attachment_of
    from quantobs.report.evaluate import HeldOut

    entries = attachment_of(model).entries
    before = [entry.enabled for entry in entries]
    for entry in entries:
        entry.enabled = False
    try:
        return HeldOut.of(
            model,
            text_batches(
                tokenizer,
                held_out_texts,
                batch_size=options.batch_size,
                max_length=options.max_length,
            ),
        )
    except ValueError as error:
        raise UsageError(f"--heldout: {error}") from None
    except (IndexError, RuntimeError, TypeError) as error:
        raise model_failure(error, "held-out") from None
    finally:
        for entry, enabled in zip(entries, before, strict=True):
            entry.enabled = enabled


def _write_failure(error: BaseException) -> str:
    """Why a write failed, on one line (an OSError's reason, or
    safetensors' message)."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return _one_line(error)


def _write_state(model: Any, path: Path, seen: Any) -> None:
    """`--save-state`: replaces only the file that was there when the run
    started (`seen`, a `tempfiles.stamp`); a failed write (full disk, no
    permission), a busy or changed file is one line."""
    from safetensors import SafetensorError

    from quantobs.calibration import save_state
    from quantobs.calibration.locking import DestinationBusy, DestinationChanged

    try:
        save_state(model, path, expected=seen)
    except DestinationBusy as error:
        raise UsageError(f"--save-state {error.strerror}") from None
    except DestinationChanged as error:
        raise UsageError(
            f"--save-state {error}; nothing of this run is written: choose "
            "another --save-state (and --out)"
        ) from None
    except (OSError, SafetensorError) as error:
        raise UsageError(
            f"cannot write --save-state {path}: {_write_failure(error)}; free "
            "space there or choose another path"
        ) from None


def _write_checkpoint(
    model: Any, out: Path, directory: Path, state: Path | None, max_shard_size: int
) -> Path:
    """`--out`: a failed write (full disk, no permission) is one line."""
    from safetensors import SafetensorError

    from quantobs.calibration.lifecycle import Calibration
    from quantobs.calibration.locking import DestinationBusy

    try:
        with _experts_warnings():  # save_compressed, once frozen
            return Calibration.of(model).export(
                out, source_dir=directory, max_shard_size=max_shard_size
            )
    except ValueError as error:
        raise UsageError(_one_line(error)) from None
    except DestinationBusy as error:
        raise UsageError(f"--out {error.strerror}") from None
    except FileExistsError:
        raise UsageError(
            f"--out {out} was written meanwhile by another process; choose a "
            "new directory"
        ) from None
    except (OSError, SafetensorError) as error:
        kept = "" if state is None else f" (the state is saved in {state})"
        raise UsageError(
            f"cannot write the checkpoint --out {out}: {_write_failure(error)}; "
            f"free space there or choose another --out{kept}"
        ) from None


def _refuse_transposed(model: Any, directory: Path) -> None:
    """No checkpoint of a model whose linear layers are transformers'
    `Conv1D` (GPT-2) can be written: no loader reads them quantized."""
    from quantobs.calibration.transposed import transposed_layers

    layers = transposed_layers(model)
    if layers:
        raise UsageError(
            f"{directory}: {type(model).__name__} keeps its {len(layers)} linear "
            f"layers as transformers Conv1D (weight stored transposed, e.g. "
            f"{layers[0]!r}), which no compressed-tensors loader reads quantized, "
            "so no checkpoint can be written; score schemes on it with "
            "`quantobs compare`, or calibrate it through the Python API "
            "(targets 'Conv1D')"
        )


@contextmanager
def _experts_warnings() -> Iterator[None]:
    """Print what transformers cannot reload of MoE experts as one
    `quantobs: warning:` line each (the checkpoint is still written)."""
    from quantobs.calibration.experts import ExpertsReloadWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExpertsReloadWarning)
        yield
    for found in caught:
        if issubclass(found.category, ExpertsReloadWarning):
            print(f"quantobs: warning: {found.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(
                found.message, found.category, found.filename, found.lineno
            )


def run_calibrate(options: argparse.Namespace) -> int:
    """The handler of `quantobs calibrate`; returns the exit code."""
    group: TorchrunGroup | None = None
    try:
        if options.distributed:
            group = TorchrunGroup()
        _calibrate(options, group)
    except UsageError as error:
        print(f"quantobs: error: {error}", file=sys.stderr)
        return _EXIT_USAGE
    finally:
        if group is not None:
            group.close()
    return _EXIT_OK
