"""Metrics of a quantized causal LM against the unquantized reference.

Pure functions of tensors. Each compares next-token distributions at the
same positions: ``(T, V)`` log-probabilities (natural log, rows summing to
1 in probability), row ``t`` the prediction of the token after position
``t`` by the reference (unquantized) or the test (quantized) model.
`next_token_positions` picks the positions from a batch's attention mask:
those whose next token is a real one, so padding takes no part. Values of
any floating dtype are computed in float64, by chunks of rows.

Bad input raises `ValueError`: shapes that differ or are not ``(T, V)``,
no position (``T = 0``), NaN or +-inf log-probabilities, targets outside
the vocabulary.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "next_token_kl",
    "next_token_positions",
    "perplexity",
    "token_agreement",
]

#: rows converted to float64 at a time (bounds the extra memory)
_CHUNK = 512


def next_token_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """`(B, S - 1)` bool: position `t` predicts a real token `t + 1`.

    Position `t` counts when it and `t + 1` are both real tokens (mask 1),
    whichever side the batch is padded on.

    Raises:
        ValueError: the mask is not `(B, S)`.
    """
    if attention_mask.ndim != 2:
        raise ValueError(
            f"attention_mask must be (B, S); got {tuple(attention_mask.shape)}"
        )
    real = attention_mask.bool()  # (B, S)
    return real[:, :-1] & real[:, 1:]  # (B, S - 1)


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.ndim != 2:
        raise ValueError(
            f"{name} log-probabilities must be (T positions, V tokens); got "
            f"{tuple(x.shape)}"
        )
    if x.shape[0] == 0:
        raise ValueError(f"{name} has no position (T = 0): no next token to score")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} log-probabilities hold NaN or infinite values")


def _pair(reference: torch.Tensor, test: torch.Tensor) -> None:
    _check_rows("reference", reference)
    _check_rows("test", test)
    if reference.shape != test.shape:
        raise ValueError(
            "reference and test log-probabilities differ in shape: "
            f"{tuple(reference.shape)} vs {tuple(test.shape)}"
        )


def next_token_kl(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Mean KL divergence of the test distributions from the reference ones.

    ``mean_t sum_v p_ref[t, v] * (log p_ref[t, v] - log p_test[t, v])`` in
    nats: 0 when the distributions are equal, never negative.

    Args:
        reference: `(T, V)` log-probabilities of the unquantized model.
        test: `(T, V)` log-probabilities of the quantized model.
    """
    _pair(reference, test)
    total = 0.0
    for start in range(0, reference.shape[0], _CHUNK):
        ref = reference[start : start + _CHUNK].double()  # (t, V)
        tst = test[start : start + _CHUNK].double()
        total += float((ref.exp() * (ref - tst)).sum())
    return max(total / reference.shape[0], 0.0)


def token_agreement(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Fraction of positions whose most likely next token (the lowest id on
    a tie) is the same under both models."""
    _pair(reference, test)
    same = reference.argmax(dim=-1) == test.argmax(dim=-1)  # (T,)
    return float(same.double().mean())


def perplexity(logprobs: torch.Tensor, targets: torch.Tensor) -> float:
    """``exp(-mean_t log p[t, targets[t]])``: the perplexity of the tokens
    that followed each position.

    Args:
        logprobs: `(T, V)` log-probabilities.
        targets: `(T,)` the id of the token after each position.
    """
    _check_rows("logprobs", logprobs)
    if targets.shape != (logprobs.shape[0],):
        raise ValueError(
            f"targets must be ({logprobs.shape[0]},), one per position; got "
            f"{tuple(targets.shape)}"
        )
    if bool(((targets < 0) | (targets >= logprobs.shape[1])).any()):
        raise ValueError(
            f"targets hold ids outside the vocabulary of {logprobs.shape[1]}"
        )
    picked = logprobs.gather(1, targets.long().unsqueeze(1)).double()  # (T, 1)
    return math.exp(-float(picked.mean()))
