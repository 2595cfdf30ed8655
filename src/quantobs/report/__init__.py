"""Metrics and reports of quantized models against the unquantized one."""

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
    "pairwise_spearman",
    "spearman",
    "sqnr_db",
    "sqnr_db_from_energies",
]
