"""Reading and checking the inputs of `quantobs calibrate` and `compare`.

Each check raises `UsageError` with one line that says what is wrong and
what to do; the commands print it and exit with code 2. Everything is
checked before any long work starts and before anything is written.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MAX_LENGTH",
    "POOLER_IGNORE",
    "UsageError",
    "add_text_options",
    "check_quantizes",
    "check_tied_head",
    "default_ignore",
    "model_dir",
    "model_failure",
    "observer_name",
    "scheme_name",
    "texts",
]

#: modules ignored when --ignore is not given and the model has them (BERT's
#: pooler: a dense layer outside the encoder, left in full precision)
POOLER_IGNORE = "re:.*pooler.*"


DEFAULT_BATCH_SIZE = 16
DEFAULT_MAX_LENGTH = 128


class UsageError(Exception):
    """A problem with the options or inputs: printed, exit code 2."""


def add_text_options(parser: argparse.ArgumentParser, heldout_use: str) -> None:
    """Add the options both commands take for their texts and model:
    `--data`, `--heldout`, `--batch-size`, `--max-length`, `--ignore`.

    Args:
        parser: the subcommand's parser.
        heldout_use: what the held-out texts are for, e.g. "the metrics are
            computed on (at least 3)".
    """
    from quantobs.cli.arguments import positive_int

    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        metavar="FILE",
        help="calibration texts: .txt (one per line) or .jsonl (a 'text' field "
        "per line); default: quantobs' packaged corpus of 200 sentences",
    )
    parser.add_argument(
        "--heldout",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"held-out texts {heldout_use}, same formats as --data; default: "
        "quantobs' packaged corpus of 100 sentences",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"texts per batch (default: {DEFAULT_BATCH_SIZE})",
    )
    parser.add_argument(
        "--max-length",
        type=positive_int,
        default=DEFAULT_MAX_LENGTH,
        metavar="N",
        help=f"tokens per text, truncated (default: {DEFAULT_MAX_LENGTH})",
    )
    parser.add_argument(
        "--ignore",
        nargs="+",
        default=None,
        metavar="PATTERN",
        help="module names or 're:' expressions left unquantized (default: "
        "the model's output head, a causal LM's lm_head, as llm-compressor's "
        f"examples; {POOLER_IGNORE!r} when the model has a pooler)",
    )


def scheme_name(name: str) -> str:
    """The preset scheme `name` (case-insensitive) in its canonical spelling."""
    from quantobs import PRESET_SCHEMES

    scheme = name.strip().upper()
    if scheme not in PRESET_SCHEMES:
        raise UsageError(
            f"unknown scheme {name!r}; available presets: {', '.join(PRESET_SCHEMES)}"
        )
    return scheme


def observer_name(name: str, extra: Sequence[str] = ()) -> str:
    """A registered observer name (or one of `extra`), normalized."""
    from quantobs.observers.base import Observer

    key = name.strip().lower().replace("-", "_")
    valid = sorted({*Observer.registry.names(), *extra})
    if key not in valid:
        raise UsageError(f"unknown observer {name!r}; valid names: {', '.join(valid)}")
    return key


def model_dir(model: Path | None) -> Path:
    """The model directory: `model`, or the embedded default's.

    Raises:
        UsageError: not a directory, no `config.json`, or no `.safetensors`
            weights.
    """
    if model is None:
        from quantobs.cli.default_model import default_model_path

        try:
            return default_model_path().parent
        except FileNotFoundError as error:
            raise UsageError(str(error)) from None
    if not model.is_dir():
        raise UsageError(
            f"model directory {str(model)!r} does not exist or is not a directory; "
            "pass a Hugging Face model directory (config.json, weights, tokenizer)"
        )
    if not (model / "config.json").is_file():
        raise UsageError(f"{model} has no config.json: not a Hugging Face model")
    if not any(model.glob("*.safetensors")):
        raise UsageError(
            f"{model} holds no .safetensors weights; quantobs reads safetensors "
            "checkpoints only (convert with transformers' save_pretrained)"
        )
    return model


def texts(data: Path | None, default: Sequence[str], what: str) -> list[str]:
    """The texts of `data` (see `quantobs.data.read_texts`), or `default`."""
    from quantobs.data import read_texts

    if data is None:
        return list(default)
    try:
        return read_texts(data)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read the {what} data: {error}") from None


def default_ignore(model: Any) -> list[str]:
    """The modules left unquantized when `--ignore` is not given.

    The model's output head (a causal LM's `lm_head`, as llm-compressor's
    examples leave it; a masked LM's decoder), and `POOLER_IGNORE` when the
    model has a pooler; nothing for a base model without one (MiniLM:
    `[POOLER_IGNORE]`).
    """
    from quantobs.report.tasks import output_head

    head = output_head(model)
    found = [] if head is None else [head]
    names = (name for name, _ in model.named_modules())
    if any("pooler" in name for name in names):
        found.append(POOLER_IGNORE)
    return found


def check_quantizes(model: Any, scheme: str) -> None:
    """Refuse a recipe that attached no observer (nothing to quantize).

    Raises:
        UsageError: the scheme's targets matched no layer outside --ignore.
    """
    from quantobs.calibration.attach import attachment_of

    if not attachment_of(model).entries:
        raise UsageError(
            f"scheme {scheme} quantizes nothing in this model: no layer it "
            "targets (Linear) is left outside --ignore; check --ignore or the "
            "model's layer types"
        )


def check_tied_head(model: Any) -> None:
    """Refuse observers on an output head tied to the input embeddings.

    A tied `lm_head` is one tensor with the embeddings, written once; a
    quantized head would need its own tensor and an untied config.

    Raises:
        UsageError: the recipe quantizes a tied head.
    """
    from quantobs.calibration.attach import attachment_of
    from quantobs.report.tasks import output_head

    head = output_head(model)
    if head is None:
        return
    weight = getattr(model.get_submodule(head), "weight", None)
    embeddings = model.get_input_embeddings()
    if weight is None or weight is not getattr(embeddings, "weight", None):
        return
    if any(entry.name == head for entry in attachment_of(model).entries):
        raise UsageError(
            f"{head} is tied to the input embeddings (tie_word_embeddings) and "
            f"cannot be quantized apart from them; keep it in --ignore ({head})"
        )


def model_failure(error: BaseException, what: str) -> UsageError:
    """The one-line error of a model that fails on the texts (a tokenizer
    whose ids the embeddings lack, a config that does not fit the weights)."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    return UsageError(
        f"the model fails on the {what} texts: {type(error).__name__}: {first}; "
        "check that the tokenizer belongs to the model"
    )
