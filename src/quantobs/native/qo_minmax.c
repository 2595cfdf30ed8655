/* Min/max per qparam, finiteness, scales from ranges (see qo_kernels.h). */
#include "qo_kernels.h"

/* min and max over rows (r, j), r < n, of g values each; NaN propagates */
ALWAYS_INLINE void qparam_minmax(const float *restrict x, int64_t n, int64_t q,
                                 int64_t g, int64_t j, float *lo, float *hi) {
    float mn = x[j * g], mx = x[j * g];
    int nan = 0;
    for (int64_t r = 0; r < n; ++r) {
        const float *row = x + (r * q + j) * g;
#pragma omp simd reduction(min : mn) reduction(max : mx) reduction(| : nan)
        for (int64_t i = 0; i < g; ++i) {
            float v = row[i];
            mn = v < mn ? v : mn;
            mx = v > mx ? v : mx;
            nan |= v != v;
        }
    }
    *lo = nan ? NAN : mn;
    *hi = nan ? NAN : mx;
}

/* What the caller checks next, learned from the ranges of all qparams: 1
 * if every value was finite, with *absmax = max(-min, max, 0) over them */
static int64_t summarize(float lo, float hi, int nan, float *absmax) {
    if (nan || !isfinite(lo) || !isfinite(hi)) return 0;
    float a = -lo > hi ? -lo : hi;
    *absmax = a > 0.0f ? a : 0.0f;
    return 1;
}

/* rows of 16 (NVFP4 groups), one per qparam: unrolled whole, no reduction.
 * Not cloned: its AVX2 copy measured 1.25x slower than the baseline one. */
static void minmax_rows16(const float *restrict x, int64_t q, float *restrict mins,
                          float *restrict maxs, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < q; ++j) {
        const float *row = x + j * 16;
        float mn = row[0], mx = row[0];
        int nan = 0;
        for (int i = 0; i < 16; ++i) {
            float v = row[i];
            mn = v < mn ? v : mn;
            mx = v > mx ? v : mx;
            nan |= v != v;
        }
        mins[j] = nan ? NAN : mn;
        maxs[j] = nan ? NAN : mx;
    }
}

/* the general case: any rows and group length */
QO_CLONES static void minmax_rows(const float *x, int64_t n, int64_t q, int64_t g,
                                  float *mins, float *maxs, int threads) {
    /* many rows: each thread folds a block of rows (read in order) into its
     * own min/max, then the blocks are folded; one row: qparams split */
    float *part = n > 1 ? malloc((size_t)(threads * 2 * q) * sizeof(float)) : NULL;
    if (!part) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t j = 0; j < q; ++j)
            qparam_minmax(x, n, q, g, j, mins + j, maxs + j);
    } else {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int t = 0; t < threads; ++t) {
            float *lo = part + (int64_t)t * 2 * q, *hi = lo + q;
            int64_t r0 = n * t / threads, r1 = n * (t + 1) / threads;
            for (int64_t j = 0; j < q; ++j) lo[j] = hi[j] = x[j * g];
            for (int64_t r = r0; r < r1; ++r)
                for (int64_t j = 0; j < q; ++j) {
                    float a, b;
                    qparam_minmax(x + r * q * g, 1, q, g, j, &a, &b);
                    lo[j] = (a < lo[j] || a != a) ? a : lo[j];
                    hi[j] = (b > hi[j] || b != b) ? b : hi[j];
                }
        }
        for (int64_t j = 0; j < q; ++j) {
            float lo = part[j], hi = part[q + j];
            for (int t = 1; t < threads; ++t) {
                float a = part[(int64_t)t * 2 * q + j];
                float b = part[(int64_t)t * 2 * q + q + j];
                lo = (a < lo || a != a) ? a : lo;
                hi = (b > hi || b != b) ? b : hi;
            }
            mins[j] = lo;
            maxs[j] = hi;
        }
        free(part);
    }
}

/* min and max per qparam; returns summarize's answer over them */
QO_CLONES int64_t qo_minmax(const float *x, int64_t n, int64_t q, int64_t g,
                            float *mins, float *maxs, float *absmax, int threads) {
    if (n == 1 && g == 16) {
        minmax_rows16(x, q, mins, maxs, threads);
    } else {
        minmax_rows(x, n, q, g, mins, maxs, threads);
    }
    /* the outputs are still in cache: one more pass over them */
    float glo = INFINITY, ghi = -INFINITY;
    int gnan = 0;
#pragma omp parallel for simd schedule(static) num_threads(threads) reduction(min : glo) \
    reduction(max : ghi) reduction(| : gnan)
    for (int64_t j = 0; j < q; ++j) {
        glo = mins[j] < glo ? mins[j] : glo;
        ghi = maxs[j] > ghi ? maxs[j] : ghi;
        gnan |= (mins[j] != mins[j]) | (maxs[j] != maxs[j]);
    }
    return summarize(glo, ghi, gnan, absmax);
}

/* 1 where every value is finite (exponent field not all ones) */
QO_CLONES int64_t qo_all_finite(const float *x, int64_t n, int threads) {
    const uint32_t *u = (const uint32_t *)x;
    uint32_t bad = 0;
#pragma omp parallel for simd schedule(static) num_threads(threads) reduction(| : bad)
    for (int64_t i = 0; i < n; ++i) bad |= (u[i] & 0x7F800000u) == 0x7F800000u;
    return !bad;
}

/* Scales of symmetric args, in calculate_qparams' float32 order:
 *     amax = max(-min, max, 0); s = amax / divisor; s = g * s (has_g);
 *     scale_fp8: s = e4m3(min(s, 448)), round half to even; s <= 0 -> eps.
 * An empty range (min > max) counts as (0, 0) where empty_as_zero is set.
 * Returns 1, with `out` undefined, where the torch path must decide (and
 * raise): a non-finite value, min > max otherwise, an overflowing s. */
QO_CLONES int64_t qo_symmetric_scales(const float *mn, const float *mx, int64_t n,
                                      float divisor, float g, int has_g,
                                      int scale_fp8, float eps, int empty_as_zero,
                                      float *out, int threads) {
    int64_t bad = 0;
#pragma omp parallel for simd schedule(static) num_threads(threads) reduction(| : bad)
    for (int64_t i = 0; i < n; ++i) {
        float lo = mn[i], hi = mx[i];
        int empty = lo > hi;
        lo = empty ? 0.0f : lo;
        hi = empty ? 0.0f : hi;
        bad |= (empty & !empty_as_zero) | !(isfinite(lo) && isfinite(hi));
        float a = -lo > hi ? -lo : hi;
        a = a > 0.0f ? a : 0.0f;
        float s = a / divisor;
        s = has_g ? g * s : s;
        bad |= !isfinite(s);
        s = scale_fp8 ? round_format(s < 448.0f ? s : 448.0f, 1, 3, -6) : s;
        out[i] = s > 0.0f ? s : eps;
    }
    return bad;
}

/* max over i with min[i] <= max[i] of max(-min[i], max[i], 0); returns 1
 * where one of those ranges is not finite (the torch path raises). */
QO_CLONES int64_t qo_range_absmax(const float *mn, const float *mx, int64_t n,
                                  float *out, int threads) {
    int64_t bad = 0;
    float a = 0.0f;
#pragma omp parallel for simd schedule(static) num_threads(threads) \
    reduction(| : bad) reduction(max : a)
    for (int64_t i = 0; i < n; ++i) {
        float lo = mn[i], hi = mx[i];
        int empty = lo > hi;
        lo = empty ? 0.0f : lo;
        hi = empty ? 0.0f : hi;
        bad |= !(isfinite(lo) && isfinite(hi));
        float v = -lo > hi ? -lo : hi;
        a = v > a ? v : a;
    }
    *out = a;
    return bad;
}
