"""Next-token metrics of causal LMs (`quantobs.report.causal`) and the
task of a model (`quantobs.report.tasks`), on hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from quantobs.report.causal import (
    next_token_kl,
    next_token_positions,
    perplexity,
    token_agreement,
)
from quantobs.report.tasks import (
    CAUSAL_LM,
    EMBEDDING,
    main_metric,
    output_head,
    quality_metrics,
    task_of,
)


def _log(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log()


def test_positions_whose_next_token_is_real() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1]])
    expected = torch.tensor(
        [[True, True, False], [True, False, False], [False, True, True]]
    )
    assert torch.equal(next_token_positions(mask), expected)


def test_kl_by_hand() -> None:
    p = [[0.5, 0.5], [0.9, 0.1]]
    q = [[0.25, 0.75], [0.9, 0.1]]
    # row 0: 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln(4/3); row 1: 0
    expected = 0.5 * math.log(4 / 3) / 2
    assert next_token_kl(_log(p), _log(q)) == pytest.approx(expected, rel=1e-12)
    assert next_token_kl(_log(p), _log(p)) == 0.0


def test_kl_is_the_mean_over_chunks() -> None:
    torch.manual_seed(0)
    ref = torch.log_softmax(torch.randn(1300, 7), dim=-1)  # 3 chunks of 512
    test = torch.log_softmax(torch.randn(1300, 7), dim=-1)
    whole = (ref.double().exp() * (ref.double() - test.double())).sum(-1).mean()
    assert next_token_kl(ref, test) == pytest.approx(float(whole), rel=1e-12)


def test_top1_agreement_by_hand() -> None:
    ref = _log([[0.6, 0.4], [0.2, 0.8], [0.5, 0.5], [0.1, 0.9]])
    test = _log([[0.7, 0.3], [0.9, 0.1], [0.5, 0.5], [0.3, 0.7]])
    assert token_agreement(ref, test) == 0.75  # row 1 differs; ties: lowest id


def test_perplexity_by_hand() -> None:
    logprobs = _log([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]])
    targets = torch.tensor([0, 1])
    # exp(-(ln 0.5 + ln 0.8) / 2) = 1 / sqrt(0.4)
    assert perplexity(logprobs, targets) == pytest.approx(1 / math.sqrt(0.4))


@pytest.mark.parametrize(
    ("ref", "test", "message"),
    [
        (torch.zeros(2, 3), torch.zeros(3, 3), "differ in shape"),
        (torch.zeros(3), torch.zeros(3), "must be (T positions, V tokens)"),
        (torch.zeros(0, 3), torch.zeros(0, 3), "no position"),
        (torch.full((1, 2), -math.inf), torch.zeros(1, 2), "NaN or infinite"),
    ],
)
def test_bad_log_probabilities(
    ref: torch.Tensor, test: torch.Tensor, message: str
) -> None:
    with pytest.raises(
        ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        next_token_kl(ref, test)


def test_bad_targets() -> None:
    with pytest.raises(ValueError, match="one per position"):
        perplexity(torch.zeros(2, 3), torch.tensor([0]))
    with pytest.raises(ValueError, match="outside the vocabulary of 3"):
        perplexity(torch.zeros(2, 3), torch.tensor([0, 3]))


def test_tasks_of_models() -> None:
    import transformers

    from tests.decoders import build_decoder

    llama = build_decoder("llama")
    assert task_of(llama) == CAUSAL_LM
    assert output_head(llama) == "lm_head"
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
    assert task_of(transformers.BertModel(config)) == EMBEDDING
    assert task_of(transformers.BertForMaskedLM(config)) == EMBEDDING
    assert main_metric(CAUSAL_LM).key == "kl_divergence"
    assert main_metric(CAUSAL_LM).lower_is_better
    assert main_metric(EMBEDDING).key == "cosine_mean"
    with pytest.raises(ValueError, match="unknown task 'vision'"):
        quality_metrics("vision")
