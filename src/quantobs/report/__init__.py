"""Metrics and reports of quantized models against the unquantized one."""

from quantobs.report.causal import (
    next_token_kl,
    next_token_positions,
    perplexity,
    token_agreement,
)
from quantobs.report.metrics import (
    cosine_to_reference,
    mean_pool,
    neighbour_agreement,
    pairwise_spearman,
    spearman,
    sqnr_db,
    sqnr_db_from_energies,
)

__all__ = [
    "cosine_to_reference",
    "mean_pool",
    "neighbour_agreement",
    "next_token_kl",
    "next_token_positions",
    "pairwise_spearman",
    "perplexity",
    "spearman",
    "sqnr_db",
    "sqnr_db_from_energies",
    "token_agreement",
]
