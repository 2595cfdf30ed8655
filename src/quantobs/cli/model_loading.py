"""Loading a model directory as the class its checkpoint names.

`load_model` reads `config.json`, takes the first class its `architectures`
lists (`LlamaForCausalLM`, `BertForMaskedLM`, `BertModel`, ...) from
transformers, offline and without custom code, and loads the weights into
it: every module the checkpoint has is kept (a causal LM keeps its
`lm_head`, tied to the input embeddings where the config says so), and
`save_compressed` writes the same architecture back. A class transformers
does not have, a config naming none, or weights that do not fit the class
(missing or left-over tensors) is a `UsageError` naming the fix.

The tokenizer gets a pad token, in memory only, when it has none (Llama-3,
Mistral) or when its pad token has no row in the model's embeddings: its eos
token, else its unk token, else its bos token, else the token of id 0 (the
first of these the embeddings hold). Batches are padded on the right.
Padding never reaches the observers nor the metrics (both see real tokens
only, by the attention mask), so which token pads does not change any
result; the checkpoint's tokenizer files are copied unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantobs.cli.inputs import UsageError

__all__ = ["architecture_class", "classes_of", "ensure_pad_token", "load_model"]


def architecture_class(config: Any, directory: Path) -> type:
    """The transformers class `config.architectures` names (the first one).

    Raises:
        UsageError: no architecture named, or one transformers does not have.
    """
    import transformers

    names = list(getattr(config, "architectures", None) or [])
    if not names:
        raise UsageError(
            f"{directory / 'config.json'} names no architectures; add the "
            'model class, e.g. "architectures": ["LlamaForCausalLM"]'
        )
    name = names[0]
    found = getattr(transformers, name, None) if name.isidentifier() else None
    if not isinstance(found, type) or not issubclass(
        found, transformers.PreTrainedModel
    ):
        known = classes_of(getattr(config, "model_type", None))
        fix = f"one of {', '.join(known)}" if known else "a transformers model class"
        raise UsageError(
            f"{directory / 'config.json'} names architecture {name!r}, which "
            f"transformers {transformers.__version__} does not have (custom "
            f"code is not run); name {fix}"
        )
    return found


def classes_of(model_type: str | None) -> list[str]:
    """The model classes transformers' auto mappings list for `model_type`
    (`"llama"`: `LlamaForCausalLM`, `LlamaModel`, ...), sorted."""
    from transformers.models.auto import modeling_auto

    found: set[str] = set()
    for name in dir(modeling_auto):
        if not (name.startswith("MODEL_") and name.endswith("_MAPPING_NAMES")):
            continue
        value = getattr(modeling_auto, name).get(model_type)
        if value:
            found.update([value] if isinstance(value, str) else value)
    return sorted(found)


def _fits(tokenizer: Any, token: Any, vocab_size: int | None) -> bool:
    if token is None:
        return False
    token_id = tokenizer.convert_tokens_to_ids(token)
    return isinstance(token_id, int) and (vocab_size is None or token_id < vocab_size)


def ensure_pad_token(tokenizer: Any, vocab_size: int | None = None) -> str | None:
    """Give `tokenizer` a pad token when it has none, and pad on the right.

    The pad token is the eos token, else the unk token, else the bos token,
    else the token of id 0 (see the module docstring: padding is masked).

    Args:
        tokenizer: a transformers tokenizer, changed in place.
        vocab_size: the rows of the model's input embeddings: a pad token
            whose id is not below it is replaced as a missing one.

    Returns:
        The pad token chosen, or None when the tokenizer's own was kept.
    """
    tokenizer.padding_side = "right"
    if _fits(tokenizer, tokenizer.pad_token, vocab_size):
        return None
    for token in (tokenizer.eos_token, tokenizer.unk_token, tokenizer.bos_token):
        if _fits(tokenizer, token, vocab_size):
            tokenizer.pad_token = token
            return str(token)
    token = tokenizer.convert_ids_to_tokens(0)
    tokenizer.pad_token = token
    return str(token)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    first = text.splitlines()[0].rstrip(" :") if text else ""
    return f"{type(error).__name__}: {first}"


def _check_weights(info: dict[str, Any], name: str, directory: Path) -> None:
    """Refuse weights the class would initialize or drop."""
    for key, what in (
        ("missing_keys", "lacks"),
        ("unexpected_keys", "has tensors that"),
        ("mismatched_keys", "has tensors of other shapes than"),
    ):
        keys = sorted(str(k) for k in info.get(key) or ())
        if keys:
            shown = ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")
            raise UsageError(
                f"the checkpoint in {directory} {what} {name} expects "
                f"({shown}); fix config.json's architectures or the weights"
            )


def _check_config_class(cls: Any, config: Any, directory: Path) -> None:
    expected = getattr(cls, "config_class", None)
    if isinstance(expected, type) and not isinstance(config, expected):
        model_type = getattr(config, "model_type", None)
        known = classes_of(model_type)
        fix = f"one of {', '.join(known)}" if known else f"a {model_type} class"
        raise UsageError(
            f"{directory / 'config.json'} names architecture {cls.__name__!r}, "
            f"a class of {getattr(expected, 'model_type', '?')!r} models, but its "
            f"model_type is {model_type!r}; name {fix}"
        )


def _step(what: str, directory: Path, load: Any, **kwargs: Any) -> Any:
    """`load(directory, local_files_only=True, **kwargs)`; any failure (a
    missing or corrupt file, a class that does not fit) is one line."""
    try:
        return load(directory, local_files_only=True, **kwargs)
    except Exception as error:
        hint = ""
        if what == "its tokenizer":
            hint = "; the directory needs the model's tokenizer files"
        raise UsageError(
            f"transformers cannot load the model in {directory} ({what}): "
            f"{_first_line(error)}{hint}"
        ) from None


def load_model(directory: Path, **loading: Any) -> tuple[Any, Any]:
    """`(model, tokenizer)` of `directory`, offline; the model in eval mode
    (`loading`: more `from_pretrained` arguments, e.g. a `device_map`).

    The model's class is the one `config.json`'s `architectures` names
    (`architecture_class`); the tokenizer is `AutoTokenizer`'s, with a pad
    token (`ensure_pad_token`).

    Raises:
        UsageError: transformers cannot read the config, the class, the
            weights or the tokenizer (one line: the error and the fix).
    """
    import logging as std_logging

    # transformers imports torchao where it is installed (the `peers`
    # extra): its CUDA extensions fail to load on a CPU build and torch's
    # pytree warns about its enums, neither of which concerns this run.
    for name in ("torchao", "torch.utils._pytree"):
        std_logging.getLogger(name).setLevel(std_logging.ERROR)
    import transformers
    from transformers.utils import logging

    bar = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # transformers' "Loading weights" bar
    try:
        config = _step("its config", directory, transformers.AutoConfig.from_pretrained)
        cls: Any = architecture_class(config, directory)
        _check_config_class(cls, config, directory)
        tokenizer = _step(
            "its tokenizer", directory, transformers.AutoTokenizer.from_pretrained
        )
        model, info = _step(
            "its weights",
            directory,
            cls.from_pretrained,
            config=config,
            output_loading_info=True,
            **loading,
        )
    finally:
        if bar:
            logging.enable_progress_bar()
    _check_weights(info, cls.__name__, directory)
    try:
        rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    except NotImplementedError:  # a model without input embeddings
        rows = None
    ensure_pad_token(tokenizer, rows if isinstance(rows, int) else None)
    return model.eval(), tokenizer
