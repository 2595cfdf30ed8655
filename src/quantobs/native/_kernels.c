/* Optional native kernels of quantobs (see quantobs/native.py).
 *
 * Compiled on first use with the system C compiler and loaded with ctypes;
 * every kernel has an eager torch twin that gives the same numbers, which is
 * used when no compiler is found. Data are contiguous float32 (histogram
 * tables of the L2 scorer: float64).
 *
 * qo_minmax: min and max per qparam of x viewed as (N, Q, G), reduced over N
 *   and G (the canonical layout of quantobs.layout). NaN propagates like
 *   torch.amin / torch.amax. Also says whether every value was finite, and
 *   the largest |value|: what the caller would otherwise read them again for.
 *
 * qo_all_finite: whether every value is finite.
 *
 * qo_symmetric_scales: scales of symmetric args from min/max ranges, with
 *   calculate_qparams' float32 arithmetic in its order (NVFP4's group scales).
 *
 * qo_range_absmax: the largest |value| of non-empty ranges (global scales).
 *
 * qo_histogram: exact integer counts of x on each qparam's power-of-two grid
 *   (quantobs.histogram's binning).
 *
 * qo_histogram_pass: min/max and counts on a known grid in one pass (a
 *   per-tensor histogram's speculative update), the rest set aside.
 *
 * qo_torch_l2_terms: the per-bin terms of torch.ao's histogram L2 error.
 *
 * qo_histc: torch.histc's float32 bin selection with exact integer counts.
 *
 * qo_entropy: KL divergences of entropy calibration's candidates.
 *
 * qo_l2_errors: exact L2 errors of candidate ranges over a histogram (the
 *   certificate of the global L2 search); qo_l2_survivors: the ranges whose
 *   lower bound leaves them in the running.
 *
 * qo_mse_errors: for each candidate c and qparam q, the error
 *   sum_{n,g} |fake_quant(x[n,q,g]) - x[n,q,g]| ** norm, with fake_quant's
 *   float32 arithmetic in its order:
 *       v = x / s; v += zp; v = clamp(v, qmin, qmax); v = round(v);
 *       v -= zp; d = v * s - x
 *   round is half-to-even to an integer (int formats) or to the grid of a
 *   signed float format (mantissa_bits, emin: the exponent of its smallest
 *   normal). norm 2.4 uses pow24 below (relative error below 3e-7, against
 *   1 ulp for powf) and norm 2 squares; other norms call powf. Sums are
 *   float64.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* a ** 2.4 for a >= 0: a*a * 2**(0.4 k) * m**0.4 with a = m * 2**k, m in
 * [1, 2); 2**(0.4 k) = 4**q * 2**(0.4 r) for k = 5 q + r, and m**0.4 =
 * sqrt(m)**0.8 by a degree-5 polynomial about the middle of [1, sqrt 2). */
ALWAYS_INLINE float pow24(float a) {
    uint32_t u = bits_of(a);
    int32_t field = (int32_t)(u >> 23);
    int32_t k = field - 127;
    float m = float_of((u & 0x7FFFFFu) | 0x3F800000u);
    int32_t q = (int32_t)floorf(((float)k + 0.5f) * 0.2f);
    int32_t r = k - 5 * q;
    /* 2**(0.4 r) from the bits of r (a select chain would become a table) */
    float root = ((r & 1) ? 1.31950791077289f : 1.0f) *
                 ((r & 2) ? 1.74110112659225f : 1.0f) *
                 ((r & 4) ? 3.03143313302079f : 1.0f);
    float t = sqrtf(m) - 1.2071068f;
    float p = 0.005249457433819771f;
    p = p * t - 0.009831152856349945f;
    p = p * t + 0.021146923303604126f;
    p = p * t - 0.06382248550653458f;
    p = p * t + 0.7704436182975769f;
    p = p * t + 1.1625096797943115f;
    float four_q = float_of((uint32_t)(2 * q + 127) << 23);
    float out = (a * a) * (p * root * four_q);
    return field == 0 ? 0.0f : out; /* zero or subnormal: below 2**-300 */
}

ALWAYS_INLINE float round_format(float v, int is_float, int mantissa_bits, int emin) {
    if (!is_float) return rintf(v);
    /* quantum of v's binade, subnormals sharing the smallest normal one */
    int32_t e = (int32_t)((bits_of(v) >> 23) & 0xFFu) - 127;
    e = e < emin ? emin : e;
    /* powers of two: v * (1 / quantum) is exact, and cheaper than v / quantum */
    float quantum = float_of((uint32_t)(e - mantissa_bits + 127) << 23);
    float inverse = float_of((uint32_t)(127 - (e - mantissa_bits)) << 23);
    return rintf(v * inverse) * quantum;
}

ALWAYS_INLINE float error_power(float a, int kind, float norm) {
    if (kind == 1) return pow24(a);
    if (kind == 2) return a * a;
    return powf(a, norm);
}

typedef struct {
    float qmin, qmax, norm;
    int mantissa_bits, emin;
} Format;

ALWAYS_INLINE float element_error(float x, float s, float zp, Format f, int kind,
                                  int has_zp, int is_float) {
    float v = x / s;
    if (has_zp) v = v + zp;
    v = v < f.qmin ? f.qmin : v;
    v = v > f.qmax ? f.qmax : v;
    v = round_format(v, is_float, f.mantissa_bits, f.emin);
    if (has_zp) v = v - zp;
    float d = v * s - x;
    return error_power(fabsf(d), kind, f.norm);
}

/* sum over one row x[0..g) of the error of candidate (s, zp) */
ALWAYS_INLINE double row_error(const float *restrict x, int64_t g, float s, float zp,
                               Format f, int kind, int has_zp, int is_float) {
    double total = 0.0;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < g; ++i)
        total += (double)element_error(x[i], s, zp, f, kind, has_zp, is_float);
    return total;
}

/* out[k, j] += errors of rows (r, j) for r in [r0, r1), j in [j0, j1) */
ALWAYS_INLINE void score_block(const float *x, int64_t q, int64_t g, int64_t c,
                               const float *scale, const float *zero_point,
                               const Format *f, double *out, int64_t r0, int64_t r1,
                               int64_t j0, int64_t j1, int kind, int has_zp,
                               int is_float) {
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t j = j0; j < j1; ++j) {
            const float *row = x + (r * q + j) * g;
            for (int64_t k = 0; k < c; ++k) {
                float zp = has_zp ? zero_point[k * q + j] : 0.0f;
                out[k * q + j] +=
                    row_error(row, g, scale[k * q + j], zp, *f, kind, has_zp, is_float);
            }
        }
}

typedef void (*Scorer)(const float *, int64_t, int64_t, int64_t, const float *,
                       const float *, const Format *, double *, int64_t, int64_t,
                       int64_t, int64_t);

/* one copy of score_block per (error power, zero point, float format) */
#define SCORER(KIND, ZP, FLOAT)                                                      \
    static void score_##KIND##_##ZP##_##FLOAT(                                       \
        const float *x, int64_t q, int64_t g, int64_t c, const float *scale,        \
        const float *zero_point, const Format *f, double *out, int64_t r0,          \
        int64_t r1, int64_t j0, int64_t j1) {                                        \
        score_block(x, q, g, c, scale, zero_point, f, out, r0, r1, j0, j1, KIND, ZP, \
                    FLOAT);                                                          \
    }
SCORER(0, 0, 0) SCORER(0, 0, 1) SCORER(0, 1, 0) SCORER(0, 1, 1)
SCORER(1, 0, 0) SCORER(1, 0, 1) SCORER(1, 1, 0) SCORER(1, 1, 1)
SCORER(2, 0, 0) SCORER(2, 0, 1) SCORER(2, 1, 0) SCORER(2, 1, 1)

static const Scorer SCORERS[12] = {
    score_0_0_0, score_0_0_1, score_0_1_0, score_0_1_1,
    score_1_0_0, score_1_0_1, score_1_1_0, score_1_1_1,
    score_2_0_0, score_2_0_1, score_2_1_0, score_2_1_1,
};

void qo_mse_errors(const float *x, int64_t n, int64_t q, int64_t g, int64_t c,
                   const float *scale, const float *zero_point, float qmin,
                   float qmax, int is_float, int mantissa_bits, int emin,
                   float norm, double *out, int threads) {
    Format f = {qmin, qmax, norm, mantissa_bits, emin};
    int kind = norm == 2.4f ? 1 : (norm == 2.0f ? 2 : 0);
    int has_zp = zero_point != NULL;
    Scorer score = SCORERS[kind * 4 + has_zp * 2 + (is_float != 0)];
    memset(out, 0, sizeof(double) * (size_t)(c * q));
    if (n == 1 || c * q > (1 << 22)) {
        /* one row, or tables too large to copy per thread: split qparams */
#pragma omp parallel for schedule(dynamic, 64) num_threads(threads)
        for (int64_t j = 0; j < q; ++j) score(x, q, g, c, scale, zero_point, &f, out, 0, n, j, j + 1);
        return;
    }
    /* many rows: split them (read in order), one partial table per thread */
#pragma omp parallel num_threads(threads)
    {
        double *mine = calloc((size_t)(c * q), sizeof(double));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; ++r) {
            if (mine) {
                score(x, q, g, c, scale, zero_point, &f, mine, r, r + 1, 0, q);
                continue;
            }
#pragma omp critical
            score(x, q, g, c, scale, zero_point, &f, out, r, r + 1, 0, q);
        }
        if (mine) {
#pragma omp critical
            for (int64_t i = 0; i < c * q; ++i) out[i] += mine[i];
            free(mine);
        }
    }
}

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

/* rows of 16 (NVFP4 groups), one per qparam: unrolled whole, no reduction */
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
static void minmax_rows(const float *x, int64_t n, int64_t q, int64_t g, float *mins,
                        float *maxs, int threads) {
    /* many rows: each thread folds a block of rows (read in order) into its
     * own min/max, then the blocks are folded; one row: qparams split */
    float *part = n > 1 ? malloc((size_t)(threads * 2 * q) * sizeof(float)) : NULL;
    if (!part) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t j = 0; j < q; ++j) qparam_minmax(x, n, q, g, j, mins + j, maxs + j);
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
int64_t qo_minmax(const float *x, int64_t n, int64_t q, int64_t g, float *mins,
                  float *maxs, float *absmax, int threads) {
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
int64_t qo_all_finite(const float *x, int64_t n, int threads) {
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
int64_t qo_symmetric_scales(const float *mn, const float *mx, int64_t n, float divisor,
                            float g, int has_g, int scale_fp8, float eps,
                            int empty_as_zero, float *out, int threads) {
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
int64_t qo_range_absmax(const float *mn, const float *mx, int64_t n, float *out,
                        int threads) {
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
static void count_rows(const float *restrict x, int64_t len, float inv, float off,
                       int64_t bins, int absolute, int64_t *restrict counts) {
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
int64_t qo_histogram_pass(const float *x, int64_t len, float inv, float off,
                          int64_t bins, int absolute, int64_t *counts, float *minmax,
                          float *side, int64_t cap, int64_t *side_count, int threads) {
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
void qo_histc(const float *x, int64_t n, float lo, float hi, int64_t bins,
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

/* Moments int_0^u x^p rho, p = 0, 1, 2, at u (bin units, x centered on the
 * histogram's middle) from the (bins, 4) table A0, A1, A2, h of
 * quantobs.solvers.histogram_l2._prefix_moments, in its arithmetic. */
static void moments_at(const double *table, int64_t bins, double u, double m[3]) {
    u = u < 0.0 ? 0.0 : (u > (double)bins ? (double)bins : u);
    int64_t j = (int64_t)u;
    j = j > bins - 1 ? bins - 1 : j;
    const double *row = table + 4 * j;
    double uc = u - (double)bins / 2;
    double hu = row[3] * uc;
    m[0] = row[0] + hu;
    hu = hu * uc;
    m[1] = row[1] + hu / 2;
    m[2] = row[2] + hu * uc / 3;
}

/* The exact L2 error of each range [lo[i], hi[i]] (bin units) with `levels`
 * destination bins, values beyond the range going to the end centers:
 * histogram_l2._exact_units for one histogram. */
void qo_l2_errors(const double *table, int64_t bins, const double *lo,
                  const double *hi, int64_t count, int64_t levels, double *out,
                  int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < count; ++i) {
        double width = (hi[i] - lo[i]) / (double)levels, total = 0.0;
        double prev[3], next[3];
        moments_at(table, bins, 0.0, prev); /* tails clip to the ends */
        for (int64_t k = 0; k < levels; ++k) {
            double edge = k + 1 == levels ? (double)bins : lo[i] + (double)(k + 1) * width;
            moments_at(table, bins, edge, next);
            double center = lo[i] + ((double)k + 0.5) * width - (double)bins / 2;
            double d0 = next[0] - prev[0], d1 = next[1] - prev[1], d2 = next[2] - prev[2];
            total += d2 - 2 * center * d1 + center * center * d0;
            prev[0] = next[0], prev[1] = next[1], prev[2] = next[2];
        }
        out[i] = total;
    }
}

/* KL divergence of every candidate clip bin i = cands[c] for each histogram
 * row of h (Q, B), from the row's prefix sums (quantobs.solvers.entropy's
 * _prefixes and _divergences, in float64): csum (mass below j), nz
 * (non-empty bins below j), plogp (sum of h log h below j), each B + 1 long,
 * made per row in a thread's own buffer. levels: quantized levels. */
void qo_entropy(const double *h, int64_t q, int64_t bins, const int64_t *cands,
                int64_t count, int64_t levels, int64_t masses, double *out,
                int threads) {
    const double tiny = 1e-300;
    /* log n for bin counts n <= bins, and log m for integer level masses
     * m < masses (0: masses are not all integers, or too many): the same
     * doubles log() returns, looked up */
    int64_t size = (bins + 1 > masses ? bins + 1 : masses);
    double *log_count = malloc((size_t)size * sizeof(double));
    if (!log_count) return; /* the caller checks for NaN: see native.entropy */
    for (int64_t n = 0; n < size; ++n) log_count[n] = log(n > 1 ? (double)n : 1.0);
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
        double *cs = prefix + (int64_t)t * 3 * (bins + 1), *nr = cs + bins + 1;
        double *pl = nr + bins + 1;
        cs[0] = nr[0] = pl[0] = 0.0;
        for (int64_t j = 0; j < bins; ++j) { /* torch.cumsum's order */
            double v = hr[j];
            cs[j + 1] = cs[j] + v;
            nr[j + 1] = nr[j] + (v > 0);
            double log_v = v < (double)masses ? log_count[(int64_t)v] : log(v);
            pl[j + 1] = pl[j] + (v == 0 ? 0.0 : v * log_v); /* xlogy(v, v) */
        }
        double total = cs[bins];
        double safe_total = total > 0 ? total : 1.0;
        for (int64_t c = 0; c < count; ++c) {
            int64_t i = cands[c];
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
            out[r * count + c] = impossible ? INFINITY : kl;
        }
    }
    free(log_count);
    free(prefix);
}

/* The bin-edge ranges [a, b] (a < na, b0 <= b <= bins, b > a) whose lower
 * bound on the L2 error (histogram_l2._Bounds, same formulas in float64) is
 * below `limit`, as (a, b - b0) pairs in (a, b) order; at most `cap` (the
 * return value is then cap + 1). at: (3, bins + 1) moments at each bin edge;
 * start, total: the 3 moments at 0 and at bins; jumps: (bins + 1) total
 * variation left of each bin, weighted by jump_weight. */
int64_t qo_l2_survivors(const double *at, const double *start, const double *total,
                        const double *jumps, double jump_weight, int64_t bins,
                        int64_t levels, int64_t na, int64_t b0, double limit,
                        int64_t *out, int64_t cap, int threads) {
    const int64_t stride = bins + 1;
    const double half = (double)bins / 2;
    int64_t *found = calloc((size_t)threads + 1, sizeof(int64_t));
    int64_t *buffer = malloc((size_t)threads * (size_t)(cap + 1) * 2 * sizeof(int64_t));
    if (!found || !buffer) {
        free(found);
        free(buffer);
        return cap + 1; /* no memory: the caller keeps its heuristic result */
    }
#pragma omp parallel num_threads(threads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        int64_t *mine = buffer + (int64_t)t * (cap + 1) * 2, count = 0;
        for (int64_t a = na * t / nt; a < na * (t + 1) / nt && count <= cap; ++a) {
            double below0 = at[a] - start[0], below1 = at[stride + a] - start[1];
            double below2 = at[2 * stride + a] - start[2];
            for (int64_t b = (b0 > a + 1 ? b0 : a + 1); b <= bins; ++b) {
                double w = (double)(b - a) / (double)levels;
                double first = ((double)a - half) + w / 2;
                double last = ((double)b - half) - w / 2;
                double above0 = total[0] - at[b], above1 = total[1] - at[stride + b];
                double above2 = total[2] - at[2 * stride + b];
                double clip = below2 - 2 * first * below1 + first * first * below0;
                clip = clip + above2 - 2 * last * above1 + last * last * above0;
                double mass = at[b] - at[a];
                double jump = jumps[b - 1 > 0 ? b - 1 : 0] - jumps[a];
                jump = jump > 0 ? jump : 0;
                double periods = w >= 1 ? 0.0 : floor(1.0 / w);
                double rest = w >= 1 ? 1.0 : 1.0 - periods * w;
                double saw = (periods * (w * w * w) + rest * rest * rest) / 12;
                double floor_ = mass * saw;
                double smooth = mass * (w * w) / 12 - jump_weight * (w * w * w) * jump;
                double bound = clip + (floor_ > smooth ? floor_ : smooth);
                if (!(bound < limit)) continue;
                if (count < cap + 1) mine[2 * count] = a, mine[2 * count + 1] = b - b0;
                count += 1;
                if (count > cap) break;
            }
        }
        found[t + 1] = count;
    }
    int64_t total_found = 0;
    for (int t = 1; t <= threads; ++t) {
        int64_t count = found[t] < cap + 1 ? found[t] : cap + 1;
        for (int64_t k = 0; k < count && total_found < cap + 1; ++k, ++total_found) {
            const int64_t *pair = buffer + (int64_t)(t - 1) * (cap + 1) * 2 + 2 * k;
            if (total_found < cap) {
                out[2 * total_found] = pair[0];
                out[2 * total_found + 1] = pair[1];
            }
        }
    }
    free(found);
    free(buffer);
    return total_found;
}

/* fmod(a, b) for finite a and b > 0, exactly (as std::fmod): with |a| and b
 * floats, q * b is exact in double for the truncated quotient q < 2**29
 * (rounding never takes x / y below an integer it reaches, only up to one,
 * which the correction undoes). */
ALWAYS_INLINE float fmod_exact(float a, float b) {
    double x = fabs((double)a), y = (double)b;
    double q = floor(x / y);
    double r = x - q * y;
    r = r < 0.0 ? r + y : r; /* x / y rounded up to an integer */
    return a < 0.0f ? -(float)r : (float)r;
}

/* torch's div(a, b, rounding_mode="floor") for floats, b > 0, in its order
 * (the sign of a / b is the sign of a) */
ALWAYS_INLINE float div_floor(float a, float b) {
    float mod = fmod_exact(a, b);
    float div = (a - mod) / b;
    div = (mod != 0.0f) & (mod < 0.0f) ? div - 1.0f : div; /* b > 0 */
    float floordiv = floorf(div);
    floordiv = div - floordiv > 0.5f ? floordiv + 1.0f : floordiv;
    return div == 0.0f ? copysignf(0.0f, a) : floordiv;
}

/* The terms of torch.ao HistogramObserver._compute_quantization_error, per
 * proposal p (start and end bins, float64 source bin width) and source bin j,
 * with torch's arithmetic in its order: the destination width in double,
 * dst = bin_width * (end - start + 1) / dst_nbins, then float32 elementwise
 * with bw = f32(bin_width), dw = f32(dst), half = f32(dst / 2) and
 * neg_half = f32(-dst / 2). A row with dst == 0 is zeros (torch returns 0).
 * The caller sums each row with torch, as torch does. Returns 1, computing
 * nothing, if some dst > 0 rounds to a float32 zero (torch then divides by
 * zero: left to the eager twin). */
int64_t qo_torch_l2_terms(const float *hist, int64_t bins, int64_t shared,
                          int64_t count, const int64_t *starts, const int64_t *ends,
                          const double *bin_width, int64_t dst_nbins, float *out,
                          int threads) {
    const float top = (float)(dst_nbins - 1);
    int same_width = 1;
    for (int64_t p = 0; p < count; ++p) {
        double dst = bin_width[p] * (double)(ends[p] - starts[p] + 1) / (double)dst_nbins;
        if (dst != 0.0 && (float)dst == 0.0f) return 1;
        same_width &= (float)bin_width[p] == (float)bin_width[0];
    }
    /* one histogram, one bin width (torch's walk): the densities once */
    float *dens = shared && same_width ? malloc((size_t)bins * sizeof(float)) : NULL;
    if (dens)
        for (int64_t j = 0; j < bins; ++j) dens[j] = hist[j] / (float)bin_width[0];
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < count; ++p) {
        const float *h = hist + (shared ? 0 : p * bins);
        float *o = out + p * bins;
        double dst = bin_width[p] * (double)(ends[p] - starts[p] + 1) / (double)dst_nbins;
        if (dst == 0.0) {
            memset(o, 0, (size_t)bins * sizeof(float));
            continue;
        }
        float w = (float)bin_width[p], d = (float)dst;
        float hf = (float)(dst / 2), nh = (float)(-dst / 2);
        float half3 = hf * hf * hf, neg3 = nh * nh * nh;
        float inner_c = (half3 - neg3) / 3.0f;
        int64_t start = starts[p];
#pragma omp simd
        for (int64_t j = 0; j < bins; ++j) {
            float begin = (float)(j - start) * w;
            float end = begin + w;
            float db = div_floor(begin, d);
            db = db < 0.0f ? 0.0f : (db > top ? top : db);
            float de = div_floor(end, d);
            de = de < 0.0f ? 0.0f : (de > top ? top : de);
            float density = dens ? dens[j] : h[j] / w;
            float delta_begin = begin - (db + 0.5f) * d;
            float n = 0.0f + density * ((half3 - delta_begin * delta_begin * delta_begin) /
                                        3.0f);
            n = n + ((de - db) - 1.0f) * (density * inner_c);
            float delta_end = end - (de * d + hf);
            n = n + density * ((delta_end * delta_end * delta_end - neg3) / 3.0f);
            o[j] = n;
        }
    }
    free(dens);
    return 0;
}

/* pow24 over an array: for the tests */
void qo_pow24(const float *a, float *out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = pow24(a[i]);
}
