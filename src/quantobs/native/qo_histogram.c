/* Histogram counting (see qo_kernels.h). */
#include "qo_kernels.h"

/* Histograms count a block of bin indices at a time; indices >= bins are
 * dropped. With `ways`, into WAYS interleaved copies (row stride `stride`,
 * wide enough for every index), so that repeats of one bin do not wait on
 * each other; `fold_ways` then adds the copies into the counts. */
enum { BLOCK = 512, WAYS = 4 };

ALWAYS_INLINE void count_block(const int32_t *index, int64_t m, int64_t *ways,
                               int64_t stride, int64_t *counts, int64_t bins) {
    if (ways) {
        for (int64_t i = 0; i < m; ++i) ways[(i % WAYS) * stride + index[i]] += 1;
        return;
    }
    for (int64_t i = 0; i < m; ++i)
        if (index[i] < bins) counts[index[i]] += 1;
}

static void fold_ways(int64_t *ways, int64_t stride, int64_t *counts, int64_t bins) {
    for (int w = 0; w < WAYS; ++w)
        for (int64_t k = 0; k < bins; ++k) counts[k] += ways[w * stride + k];
    free(ways);
}

/* counts[j, b] += #{x in qparam j : floor(x * inv[j]) - off[j] == b}, with b
 * clamped to [0, bins) and NaN skipped; |x| when absolute. inv[j] is a power
 * of two and off[j] an integer, so every step is exact (see histogram.py).
 * Bins are found a block at a time (vectorized), then counted (count_block). */
QO_CLONES static void count_rows(const float *restrict x, int64_t len, float inv,
                                 float off, int64_t bins, int absolute,
                                 int64_t *restrict counts) {
    int32_t index[BLOCK];
    int64_t stride = bins + 1; /* bin `bins`: NaN */
    int64_t *ways = len >= 8 * WAYS * bins ? calloc((size_t)(WAYS * stride), 8) : NULL;
    const float top = (float)(bins - 1), nan_bin = (float)bins;
    for (int64_t start = 0; start < len; start += BLOCK) {
        int64_t m = len - start < BLOCK ? len - start : BLOCK;
        for (int64_t i = 0; i < m; ++i) {
            float v = x[start + i] * inv;
            if (absolute) v = fabsf(v);
            float b = floorf(v) - off;
            b = b < 0.0f ? 0.0f : b;
            b = b > top ? top : b;
            index[i] = (int32_t)(v != v ? nan_bin : b);
        }
        count_block(index, m, ways, stride, counts, bins);
    }
    if (ways) fold_ways(ways, stride, counts, bins);
}

void qo_histogram(const float *x, int64_t n, int64_t q, int64_t g, const float *inv,
                  const float *off, int64_t bins, int absolute, int64_t *counts,
                  int threads) {
    if (q >= threads) {
        /* qparams are independent: each histogram row has one writer */
#pragma omp parallel for schedule(dynamic, 8) num_threads(threads)
        for (int64_t j = 0; j < q; ++j)
            for (int64_t r = 0; r < n; ++r)
                count_rows(x + (r * q + j) * g, g, inv[j], off[j], bins, absolute,
                           counts + j * bins);
        return;
    }
    /* few qparams: pieces of rows go to threads, each with its own counts */
    enum { PIECE = 1 << 16 };
    int64_t pieces = (g + PIECE - 1) / PIECE;
#pragma omp parallel num_threads(threads)
    {
        int64_t *mine = calloc((size_t)(q * bins), sizeof(int64_t));
#pragma omp for schedule(static)
        for (int64_t u = 0; u < n * pieces; ++u) {
            int64_t r = u / pieces, start = (u % pieces) * PIECE;
            int64_t len = g - start < PIECE ? g - start : PIECE;
            for (int64_t j = 0; j < q; ++j) {
                const float *piece = x + (r * q + j) * g + start;
                if (mine) {
                    count_rows(piece, len, inv[j], off[j], bins, absolute,
                               mine + j * bins);
                    continue;
                }
#pragma omp critical
                count_rows(piece, len, inv[j], off[j], bins, absolute, counts + j * bins);
            }
        }
        if (mine) {
#pragma omp critical
            for (int64_t i = 0; i < q * bins; ++i) counts[i] += mine[i];
            free(mine);
        }
    }
}

/* One pass over the values of a per-tensor histogram whose grid (inv, off)
 * is already known (histogram.py's speculative update): their min and max,
 * NaN ignored, into minmax[0..1]; counts of the values whose bin on that
 * grid lies in [0, bins) added to `counts`; every other value (outside the
 * window, NaN, or negative with |x| < 2**-100, where a coarser grid's
 * x * inv may underflow to -0.0) copied to `side`: thread t's at
 * side + t * cap, side_count[t] of them. Returns 1 if a thread found more
 * than `cap` such values (then nothing is meaningful). */
QO_CLONES int64_t qo_histogram_pass(const float *x, int64_t len, float inv, float off,
                                    int64_t bins, int absolute, int64_t *counts,
                                    float *minmax, float *side, int64_t cap,
                                    int64_t *side_count, int threads) {
    const float tiny = 0x1p-100f, window = (float)bins;
    const uint32_t keep = absolute ? 0x7FFFFFFFu : 0xFFFFFFFFu;
    int64_t overflow = 0;
    float lo = INFINITY, hi = -INFINITY;
#pragma omp parallel num_threads(threads) reduction(| : overflow) reduction(min : lo) \
    reduction(max : hi)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        int64_t start = len * t / nt, stop = len * (t + 1) / nt, found = 0;
        int64_t stride = bins + 1; /* bin `bins`: the values for `side` */
        int64_t *ways = calloc((size_t)(WAYS * stride), sizeof(int64_t));
        int64_t *trash = ways ? ways + bins : NULL, seen = 0; /* bin `bins` */
        float *mine = side + (int64_t)t * cap;
        int32_t index[BLOCK];
        for (int64_t b0 = start; b0 < stop && ways; b0 += BLOCK) {
            int64_t m = stop - b0 < BLOCK ? stop - b0 : BLOCK;
            const float *xb = x + b0;
            float blo = INFINITY, bhi = -INFINITY;
#pragma omp simd reduction(min : blo) reduction(max : bhi)
            for (int64_t i = 0; i < m; ++i) {
                float u = xb[i];
                blo = u < blo ? u : blo;
                bhi = u > bhi ? u : bhi;
                float b = floorf(float_of(bits_of(u * inv) & keep)) - off; /* |.| */
                int32_t in = (b >= 0.0f) & (b < window) & !((u < 0.0f) & (u > -tiny));
                index[i] = in ? (int32_t)b : (int32_t)bins;
            }
            lo = blo < lo ? blo : lo;
            hi = bhi > hi ? bhi : hi;
            int64_t i = 0;
            for (; i + WAYS <= m; i += WAYS) {
                ways[index[i]] += 1;
                ways[stride + index[i + 1]] += 1;
                ways[2 * stride + index[i + 2]] += 1;
                ways[3 * stride + index[i + 3]] += 1;
            }
            for (; i < m; ++i) ways[index[i]] += 1;
            int64_t aside = trash[0] + trash[stride] + trash[2 * stride];
            aside += trash[3 * stride];
            if (aside == seen) continue;
            seen = aside;
            for (i = 0; i < m && found <= cap; ++i)
                if (index[i] == bins) {
                    if (found < cap) mine[found] = xb[i];
                    found += 1;
                }
        }
        if (!ways || found > cap) {
            overflow |= 1;
            found = 0;
        }
        side_count[t] = found;
        if (ways) {
#pragma omp critical
            for (int w = 0; w < WAYS; ++w)
                for (int64_t k = 0; k < bins; ++k) counts[k] += ways[w * stride + k];
            free(ways);
        }
    }
    minmax[0] = lo;
    minmax[1] = hi;
    return overflow;
}

/* torch.histc's binning of float32 x over [lo, hi] (lo < hi, hi - lo finite):
 * pos = (int)(((v - lo) * bins) / (hi - lo)) in float32, the last bin closed,
 * values outside [lo, hi] and NaN skipped; exact integer counts. */
QO_CLONES void qo_histc(const float *x, int64_t n, float lo, float hi, int64_t bins,
                        int64_t *counts, int threads) {
    const float span = hi - lo, scale = (float)bins, skip = (float)(bins + 1);
    int64_t stride = bins + 2; /* bins + 1: skipped values */
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(threads)
    {
        int64_t *ways = calloc((size_t)(WAYS * stride), sizeof(int64_t));
        int32_t index[BLOCK];
#pragma omp for schedule(static)
        for (int64_t k = 0; k < blocks; ++k) {
            const float *block = x + k * BLOCK;
            int64_t m = n - k * BLOCK < BLOCK ? n - k * BLOCK : BLOCK;
            for (int64_t i = 0; i < m; ++i) {
                float v = block[i];
                float t = ((v - lo) * scale) / span;
                t = t >= scale ? scale - 1.0f : t; /* hi: the last bin */
                index[i] = (int32_t)((v >= lo && v <= hi) ? t : skip);
            }
            if (ways) {
                count_block(index, m, ways, stride, counts, bins);
                continue;
            }
#pragma omp critical
            count_block(index, m, NULL, stride, counts, bins);
        }
        if (ways) {
#pragma omp critical
            fold_ways(ways, stride, counts, bins);
        }
    }
}
