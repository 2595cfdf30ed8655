"""`quantobs calibrate` and `compare` on tiny causal LMs (tests/decoders.py):
the class config.json names is loaded and written back (lm_head kept, tied
embeddings tied), a pad-less tokenizer works, compare scores the model's
next-token predictions, and bad models and options are one line, exit 2."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from quantobs.cli import EXIT_OK, EXIT_USAGE, build_parser, main
from quantobs.cli.calibrate_cmd import _recipe
from quantobs.cli.kv_cache import KV_CACHE_SCHEMES
from quantobs.cli.model_loading import ensure_pad_token
from tests.calibration.conftest import load_quantized
from tests.decoders import VOCAB, kv_cache_quantizable, save_decoder, tiny_tokenizer

#: transformers warns that the checkpoint's own quantization_config wins over
#: the one passed to from_pretrained (only `dequantize` is taken from ours).
MERGE_WARNING = "ignore:You passed `quantization_config`:UserWarning"

TEXTS = [
    "The river froze early this winter, and the ferry stopped running.",
    "Quantization maps real numbers to a small set of levels.",
    "She planted tomatoes, basil and three kinds of peppers.",
    "Observers watch tensors during calibration.",
    "Rain.",
]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("causal")


@pytest.fixture(scope="module")
def data(root: Path) -> Path:
    path = root / "texts.txt"
    path.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    return path


def _decoder(root: Path, family: str) -> Path:
    directory = root / family
    if not directory.exists():
        save_decoder(family, directory)
    return directory


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _calibrate(
    capsys: pytest.CaptureFixture[str], model: Path, data: Path, out: Path, *extra: str
) -> tuple[int, str, str]:
    return _cli(
        capsys,
        "calibrate",
        "--model",
        str(model),
        "--data",
        str(data),
        "--heldout",
        str(data),
        "--batch-size",
        "2",
        "--out",
        str(out),
        "--no-progress",
        *extra,
    )


def _keys(checkpoint: Path) -> set[str]:
    with safe_open(checkpoint / "model.safetensors", "pt") as file:
        return set(file.keys())


# ------------------------------------------------------------ checkpoints


@pytest.mark.filterwarnings(MERGE_WARNING)
@pytest.mark.parametrize("family", ["llama", "phi3", "qwen2"])
def test_calibrate_writes_the_causal_lm_back(
    capsys: pytest.CaptureFixture[str], root: Path, data: Path, family: str
) -> None:
    source = _decoder(root, family)
    out = root / f"{family}-fp8"
    code, stdout, err = _calibrate(capsys, source, data, out, "--scheme", "FP8")
    assert code == EXIT_OK, err
    held_out = re.search(
        r"held-out: next-token KL (\d+\.\d{4}) nats, top-1 token agreement "
        r"(\d\.\d{3}), perplexity (\d+\.\d\d) \(unquantized (\d+\.\d\d)\)",
        stdout,
    )
    assert held_out is not None, stdout
    assert float(held_out[1]) < 0.1 and float(held_out[2]) > 0.5
    config = json.loads((out / "config.json").read_text())
    written = json.loads((source / "config.json").read_text())["architectures"]
    assert config["architectures"] == written
    assert config["quantization_config"]["ignore"] == ["lm_head"]  # the default
    loaded, info = load_quantized(out)
    assert type(loaded).__name__ == written[0]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tied = family == "qwen2"  # tie_word_embeddings: one tensor, still tied
    assert ("lm_head.weight" in _keys(out)) is not tied
    assert (loaded.lm_head.weight is loaded.get_input_embeddings().weight) is tied
    reference = transformers.AutoModelForCausalLM.from_pretrained(source)
    assert torch.equal(loaded.lm_head.weight, reference.lm_head.weight)
    ids = tiny_tokenizer()(TEXTS[:1], return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(loaded(**ids).logits).all()


def test_the_pad_token_is_supplied_in_memory() -> None:
    tokenizer = tiny_tokenizer()  # no pad token, like Llama-3's
    assert tokenizer.pad_token is None
    assert ensure_pad_token(tokenizer) == "</s>"  # eos
    assert tokenizer.padding_side == "right"
    assert ensure_pad_token(tokenizer) is None  # kept from now on
    # a pad token the embeddings lack (id 2 of 2 rows): replaced by unk (0)
    assert ensure_pad_token(tokenizer, vocab_size=2) == "<unk>"
    batch = tokenizer(TEXTS[3:5], padding=True, return_tensors="pt")
    assert batch["input_ids"][1, -1] == 0 and batch["attention_mask"][1, -1] == 0


# ------------------------------------------------------------ compare


def test_compare_scores_a_causal_lm_by_its_next_tokens(
    capsys: pytest.CaptureFixture[str], root: Path, data: Path
) -> None:
    code, stdout, err = _cli(
        capsys,
        "compare",
        "--model",
        str(_decoder(root, "llama")),
        "--schemes",
        "FP8",
        "--observers",
        "minmax",
        "mse",
        "--data",
        str(data),
        "--heldout",
        str(data),
        "--batch-size",
        "2",
        "--no-progress",
    )
    assert code == EXIT_OK, err
    for title in ("KL nats", "top-1 token", "perplexity"):
        assert title in stdout
    assert "cos mean" not in stdout
    assert re.search(r"FP8: (use|keep) (minmax|mse) — .*KL", stdout), stdout
    assert re.search(r"unquantized model: held-out perplexity \d+\.\d\d", stdout)


# ------------------------------------------------------------ kv cache


def test_kv_cache_scheme_reaches_the_recipe() -> None:
    options = build_parser().parse_args(
        ["calibrate", "--scheme", "FP8", "--out", "x", "--kv-cache-scheme", "fp8"]
    )
    kv = _recipe(options, "FP8", ["lm_head"]).kv_cache_scheme
    assert kv is not None
    assert (kv.num_bits, kv.type, kv.strategy, kv.dynamic, kv.symmetric) == (
        8,
        "float",
        "tensor",
        False,
        True,
    )
    assert kv.format.name == "float8_e4m3fn"
    options.kv_cache_scheme = "INT8"
    kv = _recipe(options, "FP8", []).kv_cache_scheme
    assert kv is not None and (kv.type, kv.symmetric) == ("int", True)


def test_kv_cache_scheme_end_to_end(
    capsys: pytest.CaptureFixture[str], root: Path, data: Path
) -> None:
    out = root / "llama-kv"
    code, _, err = _calibrate(
        capsys,
        _decoder(root, "llama"),
        data,
        out,
        "--scheme",
        "FP8",
        "--kv-cache-scheme",
        "FP8",
    )
    if not kv_cache_quantizable():  # transformers 5.24: refused in one line
        lines = [line for line in err.splitlines() if line.startswith("quantobs:")]
        assert code == EXIT_USAGE and len(lines) == 1, err
        assert "takes its kv cache as `cache`" in lines[0], err
        assert "remove kv_cache_scheme" in lines[0] and not out.exists(), err
        return
    assert code == EXIT_OK, err
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    kv = quant["kv_cache_scheme"]
    assert {key: kv[key] for key in KV_CACHE_SCHEMES["FP8"]} == KV_CACHE_SCHEMES["FP8"]
    keys = _keys(out)
    assert "model.layers.0.self_attn.k_scale" in keys
    assert "model.layers.1.self_attn.v_scale" in keys
    code, stdout, err = _cli(
        capsys, "compare", "--model", str(_decoder(root, "llama")),
        "--schemes", "FP8", "--observers", "minmax", "--kv-cache-scheme", "FP8",
        "--data", str(data), "--heldout", str(data), "--batch-size", "2",
        "--no-progress",
    )  # fmt: skip
    assert code == EXIT_OK, err
    assert "KL nats" in stdout


# ------------------------------------------------------------ errors


def _edited(root: Path, name: str, **fields: object) -> Path:
    """A copy of the tiny llama whose config.json has `fields` (None: removed)."""
    directory = root / name
    if not directory.exists():
        shutil.copytree(_decoder(root, "llama"), directory)
        config = json.loads((directory / "config.json").read_text())
        for key, value in fields.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def _narrow(root: Path) -> Path:
    """A one-layer llama of 48 features: W4A16's groups of 128 do not fit."""
    directory = root / "narrow"
    if not directory.exists():
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            bos_token_id=1,
            eos_token_id=2,
        )
        transformers.LlamaForCausalLM(config).save_pretrained(directory)
        tiny_tokenizer().save_pretrained(directory)
    return directory


def test_bad_models_and_options_are_one_line(
    capsys: pytest.CaptureFixture[str], root: Path, data: Path
) -> None:
    llama = _decoder(root, "llama")
    no_arch = _edited(root, "no-arch", architectures=None)
    unknown = _edited(root, "unknown", architectures=["LlamaForTelepathy"])
    other = _edited(root, "other", architectures=["LlamaForSequenceClassification"])
    no_tokenizer = _edited(root, "no-tokenizer")
    for path in no_tokenizer.glob("tokenizer*"):
        path.unlink()
    truncated = _edited(root, "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    qwen2 = _decoder(root, "qwen2")  # tied embeddings
    narrow = _narrow(root)
    out = root / "never"
    capsys.readouterr()  # the progress bars of writing the decoders
    cases = [
        (no_arch, ["--scheme", "FP8"], "config.json names no architectures"),
        (unknown, ["--scheme", "FP8"], "names architecture 'LlamaForTelepathy'"),
        (unknown, ["--scheme", "FP8"], "name one of LlamaForCausalLM, "),
        (other, ["--scheme", "FP8"], "fix config.json's architectures"),
        (_edited(root, "bert", architectures=["BertModel"]), ["--scheme", "FP8"],
         "a class of 'bert' models, but its model_type is 'llama'"),
        (no_tokenizer, ["--scheme", "FP8"], "needs the model's tokenizer files"),
        (truncated, ["--scheme", "FP8"], "(its weights): SafetensorError"),
        (narrow, ["--scheme", "W4A16"], "group_size 128 does not divide"),
        (llama, ["--scheme", "FP8", "--ignore", "re:.*"], "quantizes nothing"),
        (qwen2, ["--scheme", "FP8", "--ignore", "re:nothing"],
         "lm_head is tied to the input embeddings"),
        (llama, ["--scheme", "FP8", "--kv-cache-scheme", "int4"],
         "unknown --kv-cache-scheme 'int4'; one of FP8, INT8"),
    ]  # fmt: skip
    for model, extra, message in cases:
        code, _, err = _calibrate(capsys, model, data, out, *extra)
        assert code == EXIT_USAGE, (extra, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("quantobs: error: "), err
        assert message in lines[0], (message, err)
        assert not out.exists()
    code, _, err = _cli(
        capsys, "compare", "--model", str(unknown), "--data", str(data),
        "--heldout", str(data), "--schemes", "FP8", "--observers", "minmax",
    )  # fmt: skip
    assert code == EXIT_USAGE
    assert err.count("\n") == 1 and "LlamaForTelepathy" in err
    code, _, err = _cli(
        capsys, "compare", "--model", str(llama), "--kv-cache-scheme", "fp4",
    )  # fmt: skip
    assert code == EXIT_USAGE
    assert err == "quantobs: error: unknown --kv-cache-scheme 'fp4'; one of FP8, INT8\n"


def test_help_documents_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--help"]) == EXIT_OK
    text = " ".join(capsys.readouterr().out.split())
    assert "the model's output head, a causal LM's lm_head" in text
    assert "--kv-cache-scheme NAME" in text and "FP8, INT8" in text
    assert main(["compare", "--help"]) == EXIT_OK
    text = " ".join(capsys.readouterr().out.split())
    assert "the verdict picks the observer of lowest KL" in text
    for title in ("KL nats", "top-1 token", "perplexity"):
        assert f"{title}: " in text


def test_default_ignore_is_the_output_head_and_the_pooler() -> None:
    from quantobs.cli.inputs import POOLER_IGNORE, default_ignore
    from tests.decoders import build_decoder

    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
    assert default_ignore(build_decoder("llama")) == ["lm_head"]
    assert default_ignore(transformers.BertModel(config)) == [POOLER_IGNORE]
    masked = transformers.BertForMaskedLM(config)
    assert default_ignore(masked) == ["cls.predictions.decoder"]
