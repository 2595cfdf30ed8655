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

/* min and max of one row of 16 (scalar, the order of qparam_minmax) */
ALWAYS_INLINE void row16_minmax(const float *restrict row, float *lo, float *hi) {
    float mn = row[0], mx = row[0];
    int nan = 0;
    for (int i = 0; i < 16; ++i) {
        float v = row[i];
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
        nan |= v != v;
    }
    *lo = nan ? NAN : mn;
    *hi = nan ? NAN : mx;
}

/* The ranges' summary (summarize's input) folded in as rows are done: the
 * least min, the largest max, and whether a range was NaN. */
typedef struct {
    float lo, hi;
    int nan;
} Summary;

ALWAYS_INLINE void fold_range(Summary *s, float lo, float hi) {
    s->nan |= (lo != lo) | (hi != hi);
    s->lo = lo < s->lo ? lo : s->lo;
    s->hi = hi > s->hi ? hi : s->hi;
}

/* rows [j0, j1) of 16 (NVFP4 groups), one per qparam, scalar */
static void rows16_scalar(const float *restrict x, int64_t j0, int64_t j1,
                          float *restrict mins, float *restrict maxs, Summary *s) {
    for (int64_t j = j0; j < j1; ++j) {
        row16_minmax(x + j * 16, mins + j, maxs + j);
        fold_range(s, mins[j], maxs[j]);
    }
}

#if QO_HAS_CLONES
#include <immintrin.h>
#define QO_ROWS16_AVX2 1
#ifndef QO_STREAM_ROWS
#define QO_STREAM_ROWS (1 << 17)
#endif

/* OP over each of 8 vectors' lanes: lane r of the result is OP over m[r]
 * (a transposing reduction: 4 + 2 + 1 OPs, 14 shuffles) */
#define QO_FOLD_PAIRS(OP, a, b) OP(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b))
#define QO_FOLD_QUADS(OP, a, b)                                                   \
    OP(_mm256_shuffle_ps(a, b, 0x44), _mm256_shuffle_ps(a, b, 0xEE))
#define QO_FOLD_HALVES(OP, a, b)                                                  \
    OP(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31))
#define QO_REDUCE8(OP, m)                                                         \
    QO_FOLD_HALVES(OP,                                                            \
                   QO_FOLD_QUADS(OP, QO_FOLD_PAIRS(OP, m[0], m[1]),               \
                                 QO_FOLD_PAIRS(OP, m[2], m[3])),                  \
                   QO_FOLD_QUADS(OP, QO_FOLD_PAIRS(OP, m[4], m[5]),               \
                                 QO_FOLD_PAIRS(OP, m[6], m[7])))

/* rows of 16 with AVX2, 8 rows at a time: the two halves of each row folded
 * lane by lane, then the 8 rows' lanes folded across in one transposing
 * reduction; a block holding a NaN is redone by the scalar loop (NaN
 * propagates there). Outputs past the caches' share (8 MB for NVFP4's 1M
 * groups) go around the cache (streaming stores: no read of the lines
 * first) where both are 32-byte aligned. On an AMD EPYC (Zen 4), 1 thread,
 * 1M rows: the scalar loop (per-row shuffles) 6.9 ms, this one 4.5 ms with
 * plain stores and 2.7 ms streamed, against 2.8 ms for torch.aminmax over
 * the same 64 MB. Ties of +0 and -0 may keep the other zero than the scalar
 * loop (as torch's own reductions differ in it); every other value is the
 * same. */
__attribute__((target("avx2"))) static void
rows16_avx2(const float *restrict x, int64_t q, float *restrict mins,
            float *restrict maxs, Summary *out, int threads) {
    int64_t blocks = q / 8;
    int stream = q >= QO_STREAM_ROWS && !(((uintptr_t)mins | (uintptr_t)maxs) & 31);
    float glo = INFINITY, ghi = -INFINITY;
    int gnan = 0;
#pragma omp parallel num_threads(threads) reduction(min : glo) reduction(max : ghi) \
    reduction(| : gnan)
    {
        Summary s = {INFINITY, -INFINITY, 0};
        __m256 vlo = _mm256_set1_ps(INFINITY), vhi = _mm256_set1_ps(-INFINITY);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const float *row = x + b * 128;
            __m256 lo[8], hi[8], bad = _mm256_setzero_ps();
            for (int r = 0; r < 8; ++r) {
                __m256 a = _mm256_loadu_ps(row + r * 16);
                __m256 c = _mm256_loadu_ps(row + r * 16 + 8);
                lo[r] = _mm256_min_ps(a, c);
                hi[r] = _mm256_max_ps(a, c);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, c, _CMP_UNORD_Q));
            }
            if (_mm256_movemask_ps(bad)) {
                rows16_scalar(x, b * 8, b * 8 + 8, mins, maxs, &s);
                continue;
            }
            __m256 mn = QO_REDUCE8(_mm256_min_ps, lo);
            __m256 mx = QO_REDUCE8(_mm256_max_ps, hi);
            if (stream) {
                _mm256_stream_ps(mins + b * 8, mn);
                _mm256_stream_ps(maxs + b * 8, mx);
            } else {
                _mm256_storeu_ps(mins + b * 8, mn);
                _mm256_storeu_ps(maxs + b * 8, mx);
            }
            vlo = _mm256_min_ps(vlo, mn);
            vhi = _mm256_max_ps(vhi, mx);
        }
        if (stream) _mm_sfence(); /* streamed lines visible to the others */
        float l[8], h[8];
        _mm256_storeu_ps(l, vlo);
        _mm256_storeu_ps(h, vhi);
        for (int i = 0; i < 8; ++i) fold_range(&s, l[i], h[i]);
        glo = s.lo < glo ? s.lo : glo;
        ghi = s.hi > ghi ? s.hi : ghi;
        gnan |= s.nan;
    }
    Summary s = {glo, ghi, gnan};
    rows16_scalar(x, blocks * 8, q, mins, maxs, &s); /* the last q % 8 rows */
    *out = s;
}
#else
#define QO_ROWS16_AVX2 0
#endif

/* rows of 16 (NVFP4 groups), one per qparam, with their summary: AVX2 where
 * the CPU has it, else the scalar loop (its AVX2 clone measured 1.25x
 * slower than the baseline one: not cloned) */
static Summary minmax_rows16(const float *restrict x, int64_t q, float *restrict mins,
                             float *restrict maxs, int threads) {
#if QO_ROWS16_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        Summary s;
        rows16_avx2(x, q, mins, maxs, &s, threads);
        return s;
    }
#endif
    float glo = INFINITY, ghi = -INFINITY;
    int gnan = 0;
#pragma omp parallel num_threads(threads) reduction(min : glo) reduction(max : ghi) \
    reduction(| : gnan)
    {
        Summary s = {INFINITY, -INFINITY, 0};
#pragma omp for schedule(static)
        for (int64_t j = 0; j < q; ++j) rows16_scalar(x, j, j + 1, mins, maxs, &s);
        glo = s.lo < glo ? s.lo : glo;
        ghi = s.hi > ghi ? s.hi : ghi;
        gnan |= s.nan;
    }
    Summary s = {glo, ghi, gnan};
    return s;
}

/* the general case: any rows and group length, with the ranges' summary */
QO_CLONES static Summary minmax_rows(const float *x, int64_t n, int64_t q, int64_t g,
                                     float *mins, float *maxs, int threads) {
    /* many rows: each thread folds a block of rows (read in order) into its
     * own min/max, then the blocks are folded; one row: qparams split */
    float *part = n > 1 ? malloc((size_t)(threads * 2 * q) * sizeof(float)) : NULL;
    float glo = INFINITY, ghi = -INFINITY;
    int gnan = 0;
    if (!part) {
#pragma omp parallel for schedule(static) num_threads(threads) reduction(min : glo) \
    reduction(max : ghi) reduction(| : gnan)
        for (int64_t j = 0; j < q; ++j) {
            Summary s = {glo, ghi, gnan};
            qparam_minmax(x, n, q, g, j, mins + j, maxs + j);
            fold_range(&s, mins[j], maxs[j]);
            glo = s.lo;
            ghi = s.hi;
            gnan = s.nan;
        }
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
        Summary s = {glo, ghi, gnan};
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
            fold_range(&s, lo, hi);
        }
        free(part);
        return s;
    }
    Summary s = {glo, ghi, gnan};
    return s;
}

/* min and max per qparam; returns summarize's answer over them (their
 * summary folded in as they are found: no second pass) */
QO_CLONES int64_t qo_minmax(const float *x, int64_t n, int64_t q, int64_t g,
                            float *mins, float *maxs, float *absmax, int threads) {
    Summary s = n == 1 && g == 16 ? minmax_rows16(x, q, mins, maxs, threads)
                                  : minmax_rows(x, n, q, g, mins, maxs, threads);
    return summarize(s.lo, s.hi, s.nan, absmax);
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
 *     scale_fp8: s = e4m3(min(s, 448)), round half to even; s <= 0 -> eps;
 *     s = max(s, floor) (the smallest normal float32, or 0: no floor).
 * An empty range (min > max) counts as (0, 0) where empty_as_zero is set.
 * Returns 1, with `out` undefined, where the torch path must decide (and
 * raise): a non-finite value, min > max otherwise, an overflowing s. */
QO_WIDE_CLONES int64_t qo_symmetric_scales(const float *mn, const float *mx, int64_t n,
                                      float divisor, float g, int has_g,
                                      int scale_fp8, float eps, float floor,
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
        s = s > 0.0f ? s : eps;
        out[i] = s < floor ? floor : s;
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
