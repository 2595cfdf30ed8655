"""Metrics of a quantized embedding model against the unquantized reference.

Pure functions of tensors. Inputs of any floating dtype are computed in
float64, so the metrics measure the model's error and not the metric's own
rounding. The embedding metrics take ``reference`` and ``test``, both
``(N, H)``: row ``i`` of each is sentence ``i`` embedded by the reference
(unquantized) and the test (quantized) model.

Bad input raises `ValueError`:

================================  ============================================
input                             why it is refused
================================  ============================================
shapes differ, or not ``(N, H)``  the rows would not pair sentence to sentence
NaN or +-inf anywhere             every metric would silently be NaN
a zero embedding row              its cosine similarity is undefined
``N < 2`` (neighbours)            a sentence has no other sentence
``N < 3`` (Spearman)              one pair gives no ranking to correlate
================================  ============================================
"""

import math

import torch

__all__ = [
    "cosine_to_reference",
    "mean_pool",
    "neighbour_agreement",
    "pairwise_spearman",
    "spearman",
    "sqnr_db",
    "sqnr_db_from_energies",
]


def _check_finite(name: str, x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} holds NaN or infinite values")


def _embeddings_pair(
    reference: torch.Tensor, test: torch.Tensor, min_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate two `(N, H)` embedding sets; return them in float64."""
    if reference.ndim != 2 or test.ndim != 2:
        raise ValueError(
            "embeddings must be 2-D (N sentences, H features); got "
            f"reference {tuple(reference.shape)} and test {tuple(test.shape)}"
        )
    if reference.shape != test.shape:
        raise ValueError(
            "reference and test embeddings differ in shape: "
            f"{tuple(reference.shape)} vs {tuple(test.shape)}"
        )
    n, h = reference.shape
    if n < min_rows:
        raise ValueError(f"this metric needs at least {min_rows} sentences; got {n}")
    if h == 0:
        raise ValueError("embeddings have no features (H = 0)")
    reference_64 = reference.to(torch.float64)
    test_64 = test.to(torch.float64)
    _check_finite("reference", reference_64)
    _check_finite("test", test_64)
    return reference_64, test_64


def _unit_rows(name: str, x: torch.Tensor) -> torch.Tensor:
    """Rows of float64 `x` (N, H) scaled to unit L2 norm; zero rows refused."""
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)  # (N, 1)
    zero = (norms == 0).squeeze(1)  # (N,)
    if bool(zero.any()):
        rows = zero.nonzero().squeeze(1).tolist()
        raise ValueError(
            f"{name} has zero embeddings (rows {rows[:10]}): cosine is undefined"
        )
    unit: torch.Tensor = x / norms  # (N, H)
    return unit


def mean_pool(
    last_hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    normalize: bool = False,
) -> torch.Tensor:
    """Sentence embeddings: the mean of the token states over non-padding tokens.

    As sentence-transformers' mean pooling: ``e_b = sum_s m_bs * h_bs /
    max(sum_s m_bs, 1e-9)``, with ``m`` the attention mask (1 for a token, 0
    for padding); a sentence with no tokens gets the zero vector. With
    ``normalize``, each ``e_b`` is then divided by ``max(||e_b||_2, 1e-12)``
    (unit length; a zero vector stays zero).

    Args:
        last_hidden: `(B, S, H)` token states of the model's last layer.
        attention_mask: `(B, S)`, 1 (or True) for tokens, 0 for padding.
        normalize: scale each embedding to unit L2 norm.

    Returns:
        `(B, H)` float64 sentence embeddings.

    Raises:
        ValueError: on a shape mismatch or non-finite token states.
    """
    if last_hidden.ndim != 3:
        raise ValueError(
            f"last_hidden must be (B, S, H); got shape {tuple(last_hidden.shape)}"
        )
    if attention_mask.shape != last_hidden.shape[:2]:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} does not match "
            f"last_hidden's (B, S) = {tuple(last_hidden.shape[:2])}"
        )
    hidden = last_hidden.to(torch.float64)  # (B, S, H)
    _check_finite("last_hidden", hidden)
    mask = attention_mask.to(torch.float64).unsqueeze(-1)  # (B, S, 1)
    summed = (hidden * mask).sum(dim=1)  # (B, H)
    counts = mask.sum(dim=1).clamp(min=1e-9)  # (B, 1)
    pooled = summed / counts  # (B, H)
    if normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=1, eps=1e-12)
    return pooled


def cosine_to_reference(
    reference: torch.Tensor, test: torch.Tensor
) -> tuple[float, float]:
    """How closely each test embedding points along its reference embedding.

    ``c_i = <r_i, t_i> / (||r_i||_2 * ||t_i||_2)`` for each sentence ``i``;
    1 means the same direction.

    Args:
        reference: `(N, H)` reference embeddings, ``N >= 1``.
        test: `(N, H)` test embeddings of the same sentences.

    Returns:
        ``(mean_i c_i, min_i c_i)``: the mean and the worst sentence.

    Raises:
        ValueError: on bad shapes, non-finite values or a zero embedding.
    """
    reference_64, test_64 = _embeddings_pair(reference, test, min_rows=1)
    cosines = (_unit_rows("reference", reference_64) * _unit_rows("test", test_64)).sum(
        dim=1
    )  # (N,)
    return float(cosines.mean()), float(cosines.min())


#: cosine similarities this close count as tied (float64 rounding of unit rows)
_TIE = 1e-12


def _nearest_other(unit: torch.Tensor) -> torch.Tensor:
    """For unit rows `(N, H)`, the index of each row's most similar other row.

    Ties go to the lowest index, and so do similarities within `_TIE` of the
    row's best: float64 rounding of the unit rows (e.g. `[1, 1]` and
    `[1.5, 1.5]` normalized) must not decide between equal directions.
    """
    similarity = unit @ unit.T  # (N, N)
    similarity.fill_diagonal_(-math.inf)  # a sentence is not its own neighbour
    best = similarity.amax(dim=1, keepdim=True)  # (N, 1)
    near = similarity >= best - _TIE  # (N, N)
    return near.to(torch.int8).argmax(dim=1)  # (N,) the first near one


def neighbour_agreement(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Top-1 retrieval agreement between the reference and test embeddings.

    For each sentence ``i``, its nearest neighbour is the other sentence
    ``j != i`` of highest cosine similarity to it (ties: the lowest ``j``),
    found once among the reference embeddings and once among the test
    embeddings. The metric is the fraction of sentences whose two nearest
    neighbours are the same sentence: 1 means retrieval by the test model
    returns what the reference model returns.

    Args:
        reference: `(N, H)` reference embeddings, ``N >= 2``.
        test: `(N, H)` test embeddings of the same sentences.

    Returns:
        The agreement, in ``[0, 1]``.

    Raises:
        ValueError: on bad shapes, ``N < 2``, non-finite values or a zero
            embedding.
    """
    reference_64, test_64 = _embeddings_pair(reference, test, min_rows=2)
    nearest_reference = _nearest_other(_unit_rows("reference", reference_64))
    nearest_test = _nearest_other(_unit_rows("test", test_64))
    return float((nearest_reference == nearest_test).to(torch.float64).mean())


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks of the float64 vector `x` (M,); equal values share the
    mean of the ranks they span ([1, 2, 2, 3] -> [1, 2.5, 2.5, 4])."""
    _, inverse, counts = torch.unique(
        x, sorted=True, return_inverse=True, return_counts=True
    )  # (U,) distinct values ascending; inverse (M,); counts (U,)
    last = counts.cumsum(0).to(torch.float64)  # (U,) rank of each run's last
    first = last - counts.to(torch.float64) + 1  # (U,) rank of each run's first
    ranks: torch.Tensor = ((first + last) / 2)[inverse]  # (M,)
    return ranks


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman rank correlation of two paired 1-D samples.

    The Pearson correlation of the ranks of ``x`` and the ranks of ``y``,
    where tied values get the average of the ranks they span.

    Args:
        x: `(M,)` values, ``M >= 2``.
        y: `(M,)` values paired with ``x``.

    Returns:
        The correlation, in ``[-1, 1]``.

    Raises:
        ValueError: on shapes that are not one `(M,)`, ``M < 2``, non-finite
            values, or a sample whose values are all equal (no ranking).
    """
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(
            "spearman needs two 1-D samples of one length; got "
            f"{tuple(x.shape)} and {tuple(y.shape)}"
        )
    if x.numel() < 2:
        raise ValueError(f"spearman needs at least 2 pairs; got {x.numel()}")
    x_64 = x.to(torch.float64)
    y_64 = y.to(torch.float64)
    _check_finite("x", x_64)
    _check_finite("y", y_64)
    x_rank = _average_ranks(x_64)
    y_rank = _average_ranks(y_64)
    x_centred = x_rank - x_rank.mean()  # (M,)
    y_centred = y_rank - y_rank.mean()  # (M,)
    x_norm = torch.linalg.vector_norm(x_centred)
    y_norm = torch.linalg.vector_norm(y_centred)
    if x_norm == 0 or y_norm == 0:
        raise ValueError("spearman is undefined: all values of a sample are equal")
    rho = (x_centred * y_centred).sum() / (x_norm * y_norm)
    # Rounding can step just outside [-1, 1]; the correlation cannot.
    return float(rho.clamp(-1.0, 1.0))


def pairwise_spearman(reference: torch.Tensor, test: torch.Tensor) -> float:
    """How well the test embeddings preserve the ranking of sentence similarities.

    The cosine similarity of every pair of sentences ``i < j`` (the upper
    triangle, ``N (N - 1) / 2`` pairs) is computed among the reference
    embeddings and among the test embeddings; the metric is the Spearman rank
    correlation of these two lists (see `spearman`: average ranks for ties).
    1 means the test model orders every pair of sentences as the reference does.

    Args:
        reference: `(N, H)` reference embeddings, ``N >= 3``.
        test: `(N, H)` test embeddings of the same sentences.

    Returns:
        The correlation, in ``[-1, 1]``.

    Raises:
        ValueError: on bad shapes, ``N < 3`` (two sentences make one pair),
            non-finite values, a zero embedding, or pairwise similarities
            that are all equal.
    """
    reference_64, test_64 = _embeddings_pair(reference, test, min_rows=3)
    n = reference_64.shape[0]
    rows, cols = torch.triu_indices(n, n, offset=1, device=reference_64.device)
    unit_reference = _unit_rows("reference", reference_64)  # (N, H)
    unit_test = _unit_rows("test", test_64)  # (N, H)
    reference_pairs = (unit_reference[rows] * unit_reference[cols]).sum(dim=1)
    test_pairs = (unit_test[rows] * unit_test[cols]).sum(dim=1)  # (N (N-1) / 2,)
    return spearman(reference_pairs, test_pairs)


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``x_hat`` as an estimate of ``x``.

    ``10 * log10(sum x^2 / sum (x - x_hat)^2)`` in decibels, over all
    elements; each 6.02 dB is about one bit of precision.

    ==========  ============  ==========
    sum x^2     sum noise^2   result
    ==========  ============  ==========
    > 0         > 0           finite
    any         0             +inf (exact)
    0           > 0           -inf
    ==========  ============  ==========

    Args:
        x: the reference tensor, any shape with at least one element.
        x_hat: its estimate (e.g. the quantized model's output), same shape.

    Returns:
        The SQNR in dB.

    Raises:
        ValueError: on a shape mismatch, empty tensors or non-finite values.
    """
    if x.shape != x_hat.shape:
        raise ValueError(
            f"x and x_hat differ in shape: {tuple(x.shape)} vs {tuple(x_hat.shape)}"
        )
    if x.numel() == 0:
        raise ValueError("sqnr_db of empty tensors is undefined")
    x_64 = x.to(torch.float64)
    x_hat_64 = x_hat.to(torch.float64)
    _check_finite("x", x_64)
    _check_finite("x_hat", x_hat_64)
    error = x_64 - x_hat_64
    # Both divided by their largest magnitude first: the squares then
    # underflow alike at every scale, so the ratio is scale-invariant (an
    # error below 1e-154 of the peak is exact, +inf, whatever the units).
    peak = float(torch.maximum(x_64.abs().max(), error.abs().max()))
    if peak > 0:
        x_64, error = x_64 / peak, error / peak
    signal = float(x_64.square().sum())
    noise = float(error.square().sum())
    return sqnr_db_from_energies(signal, noise)


def sqnr_db_from_energies(signal: float, noise: float) -> float:
    """`sqnr_db` from the summed energies ``sum x^2`` and ``sum (x - x_hat)^2``
    (accumulated over batches): ``10 * log10(signal / noise)``, with the
    same table of edge cases.

    Raises:
        ValueError: a negative or non-finite energy.
    """
    for name, energy in (("signal", signal), ("noise", noise)):
        if not math.isfinite(energy) or energy < 0:
            raise ValueError(f"{name} energy must be finite and >= 0, got {energy}")
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
