/* Entropy (KL-divergence) calibration: the divergences of candidate clip
 * bins and the coarse-to-fine search per histogram row (see qo_kernels.h).
 */
#include "qo_kernels.h"

/* A row's entropy prefix sums (quantobs.solvers.entropy's _prefixes, in
 * float64, torch.cumsum's order): cs (mass below j), nr (non-empty bins
 * below j), pl (sum of h log h below j), each B + 1 long. log_count holds
 * log n for n < masses (see qo_entropy). */
ALWAYS_INLINE void entropy_prefix(const double *hr, int64_t bins, const double *log_count,
                                  int64_t masses, double *cs, double *nr, double *pl) {
    cs[0] = nr[0] = pl[0] = 0.0;
    for (int64_t j = 0; j < bins; ++j) {
        double v = hr[j];
        cs[j + 1] = cs[j] + v;
        nr[j + 1] = nr[j] + (v > 0);
        double log_v = v < (double)masses ? log_count[(int64_t)v] : log(v);
        pl[j + 1] = pl[j] + (v == 0 ? 0.0 : v * log_v); /* xlogy(v, v) */
    }
}

/* The KL divergence of clip bin i (_divergences' arithmetic); +inf where
 * impossible. */
ALWAYS_INLINE double entropy_kl(const double *hr, const double *cs, const double *nr,
                                const double *pl, int64_t bins, int64_t i,
                                int64_t levels, const double *log_count,
                                int64_t masses) {
    const double tiny = 1e-300;
    double total = cs[bins];
    double safe_total = total > 0 ? total : 1.0;
    double below = cs[i], tail = total - below, last = hr[i - 1];
    double kept = last + tail;
    double p_term = pl[i - 1] + (kept > 0 ? kept * log(kept) : 0.0);
    double q_term = 0.0, top_mass = 0.0, top_bins = 0.0;
    int64_t top = (i - 1) * levels / i, lower = 0;
    /* upper = ceil((k + 1) i / levels), stepped without a division:
     * (k + 1) i = quot * levels + rem */
    int64_t step_q = i / levels, step_r = i % levels, quot = 0, rem = 0;
    for (int64_t k = 0; k < levels; ++k) {
        quot += step_q;
        rem += step_r;
        if (rem >= levels) rem -= levels, quot += 1;
        int64_t upper = quot + (rem > 0);
        double mass = cs[upper] - cs[lower], filled = nr[upper] - nr[lower];
        lower = upper;
        /* a level without mass adds 0 * (log 1 - log n) = 0 (no branch:
         * csum never decreases, so mass >= 0) */
        double log_mass = mass < (double)masses ? log_count[(int64_t)mass]
                                                : log(mass > tiny ? mass : tiny);
        q_term += mass * (log_mass - log_count[(int64_t)filled]);
        top_mass = k == top ? mass : top_mass;
        top_bins = k == top ? filled : top_bins;
    }
    double q_last = log(top_bins > 0 ? top_mass / top_bins : 1.0);
    q_term += tail > 0 ? tail * q_last : 0.0;
    double safe_below = below > 0 ? below : 1.0;
    double kl = (p_term - q_term) / safe_total - log(safe_total) + log(safe_below);
    int impossible = below <= 0 || (tail > 0 && last <= 0);
    return impossible ? INFINITY : kl;
}

/* log n for n < size (log 1 for n <= 1): the same doubles log() returns */
static double *log_table(int64_t size) {
    double *table = malloc((size_t)size * sizeof(double));
    if (table)
        for (int64_t n = 0; n < size; ++n) table[n] = log(n > 1 ? (double)n : 1.0);
    return table;
}

/* KL divergence of every candidate clip bin i = cands[r * cand_stride + c]
 * for each histogram row r of h (Q, B) (cand_stride 0: the same candidates
 * for every row; count: per row), from the row's prefix sums (entropy_prefix,
 * made per row in a thread's own buffer). levels: quantized levels; masses:
 * log m of integer level masses m < masses comes from a table (0: masses are
 * not all integers, or too many). */
void qo_entropy(const double *h, int64_t q, int64_t bins, const int64_t *cands,
                int64_t cand_stride, int64_t count, int64_t levels, int64_t masses,
                double *out, int threads) {
    if (levels < 1) return; /* no level: the caller sees NaN (native.entropy) */
    int64_t size = (bins + 1 > masses ? bins + 1 : masses);
    double *log_count = log_table(size);
    if (!log_count) return; /* the caller checks for NaN: see native.entropy */
    double *prefix = malloc((size_t)threads * 3 * (size_t)(bins + 1) * sizeof(double));
    if (!prefix) {
        free(log_count);
        return;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t r = 0; r < q; ++r) {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        const double *hr = h + r * bins;
        const int64_t *rc = cands + r * cand_stride;
        double *cs = prefix + (int64_t)t * 3 * (bins + 1), *nr = cs + bins + 1;
        double *pl = nr + bins + 1;
        entropy_prefix(hr, bins, log_count, masses, cs, nr, pl);
        for (int64_t c = 0; c < count; ++c)
            out[r * count + c] =
                entropy_kl(hr, cs, nr, pl, bins, rc[c], levels, log_count, masses);
    }
    free(log_count);
    free(prefix);
}

#define QO_KEEP_MAX 4
#define QO_CANDS_MAX 64

/* The first `keep` of m[0..n) by (kl ascending, m descending): the
 * coarse-to-fine search's selection (duplicates stay, as in the twin). */
static void keep_best(const int64_t *m, const double *kl, int64_t n, int64_t keep,
                      int64_t *chosen) {
    int used[QO_CANDS_MAX] = {0};
    for (int64_t j = 0; j < keep; ++j) {
        int64_t pick = -1;
        for (int64_t c = 0; c < n; ++c) {
            if (used[c]) continue;
            if (pick < 0 || kl[c] < kl[pick] || (kl[c] == kl[pick] && m[c] > m[pick]))
                pick = c;
        }
        used[pick] = 1;
        chosen[j] = m[pick];
    }
}

/* The coarse-to-fine entropy search of quantobs.solvers.entropy, per row of
 * int64 counts (Q, B): bin 0 takes bin 1's count; the possible candidates
 * are the clip bins i = start_bin + k stride up to the row's stop (one past
 * its last non-empty bin) whose bin i - 1 holds data, indexed m = 0 .. top;
 * `coarse` of them evenly (m = round-half-up(j top / (coarse - 1))), then,
 * while the spacing step > 1, step = ceil(step / reach) and the moves -reach
 * .. reach steps around each of the `keep` best (clamped to 0 .. top); the
 * best is kept by keep_best. best[r]: the chosen clip bin, 0 where the row
 * has no possible candidate. levels: (Q,) quantized levels. Returns 1 when
 * out of memory, or when keep, coarse or reach exceed the kernel's arrays. */
int64_t qo_entropy_search(const int64_t *counts, int64_t q, int64_t bins,
                          const int64_t *levels, int64_t start_bin, int64_t stride,
                          int64_t coarse, int64_t keep, int64_t reach, int64_t masses,
                          int64_t *best, int threads) {
    if (keep < 1 || keep > QO_KEEP_MAX || keep > coarse || coarse < 2 ||
        coarse > QO_CANDS_MAX || reach < 1 || keep * (2 * reach + 1) > QO_CANDS_MAX ||
        start_bin < 1 || stride < 1)
        return 1;
    for (int64_t r = 0; r < q; ++r)
        if (levels[r] < 1) return 1;
    int64_t size = (bins + 1 > masses ? bins + 1 : masses);
    double *log_count = log_table(size);
    int64_t per = 4 * (bins + 1);
    double *buffers = malloc((size_t)threads * (size_t)per * sizeof(double));
    int64_t *possible = malloc((size_t)threads * (size_t)(bins + 1) * sizeof(int64_t));
    if (!log_count || !buffers || !possible) {
        free(log_count);
        free(buffers);
        free(possible);
        return 1;
    }
#pragma omp parallel for schedule(dynamic, 8) num_threads(threads)
    for (int64_t r = 0; r < q; ++r) {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        const int64_t *cr = counts + r * bins;
        double *hr = buffers + (int64_t)t * per, *cs = hr + bins + 1;
        double *nr = cs + bins + 1, *pl = nr + bins + 1;
        int64_t *list = possible + (int64_t)t * (bins + 1), stop = 0;
        for (int64_t j = 0; j < bins; ++j) {
            hr[j] = (double)cr[j];
            stop = cr[j] > 0 ? j + 1 : stop;
        }
        if (bins > 1) hr[0] = hr[1];
        entropy_prefix(hr, bins, log_count, masses, cs, nr, pl);
        int64_t found = 0;
        for (int64_t i = start_bin; i <= stop && i <= bins; i += stride)
            if (hr[i - 1] > 0) list[found++] = i;
        if (found == 0) {
            best[r] = 0;
            continue;
        }
        int64_t top = found - 1, lv = levels[r], n = 0;
        int64_t m[QO_CANDS_MAX], chosen[QO_KEEP_MAX];
        double kl[QO_CANDS_MAX];
        for (int64_t j = 0; j < coarse; ++j, ++n) {
            m[n] = (2 * j * top + (coarse - 1)) / (2 * (coarse - 1));
            kl[n] = entropy_kl(hr, cs, nr, pl, bins, list[m[n]], lv, log_count, masses);
        }
        keep_best(m, kl, n, keep, chosen);
        int64_t step = (top + coarse - 2) / (coarse - 1);
        while (step > 1) {
            step = (step + reach - 1) / reach;
            step = step < 1 ? 1 : step;
            n = 0;
            for (int64_t j = 0; j < keep; ++j)
                for (int64_t d = -reach; d <= reach; ++d, ++n) {
                    int64_t at = chosen[j] + d * step;
                    m[n] = at < 0 ? 0 : (at > top ? top : at);
                    kl[n] = entropy_kl(hr, cs, nr, pl, bins, list[m[n]], lv, log_count,
                                       masses);
                }
            keep_best(m, kl, n, keep, chosen);
        }
        best[r] = list[chosen[0]];
    }
    free(log_count);
    free(buffers);
    free(possible);
    return 0;
}
