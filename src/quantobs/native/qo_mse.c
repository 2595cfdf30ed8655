/* MSE candidate errors (qo_mse_errors) and pow24 (see qo_kernels.h). */
#include "qo_kernels.h"

/* Whether this build's baseline ISA has fused multiply-adds (with ISA
 * clones on x86, the fused scorers below are the clones of FMA CPUs). */
#if defined(__FMA__) || defined(__aarch64__) || defined(__ARM_FEATURE_FMA)
#define QO_FMA_BASELINE 1
#else
#define QO_FMA_BASELINE 0
#endif

/* a * b + c: one rounding where fused (fmaf: one instruction where the ISA
 * has it), two elsewhere */
#define MULADD(a, b, c, fused) ((fused) ? fmaf(a, b, c) : (a) * (b) + (c))

/* a ** 2.4 for a >= 0, with fused multiply-adds or without: a ** 2 *
 * 2 ** (0.4 k) * m ** 0.4 for a = m * 2 ** k, m in [1, 2). With e = k + 127
 * (the exponent field) = 5 q + r, r in [0, 4]: 2 ** (0.4 k) = 4 ** q * 2 **
 * (0.2 + 0.4 r) * 2 ** -51, q and r exact in float arithmetic (e <= 255).
 * 2 ** (0.2 + 0.4 r) is the quartic in r through its 5 values, and m ** 0.4
 * a degree-7 minimax polynomial in m - 1.5 (relative error 2.4e-8). All
 * float ops, no table, no select: about 25 vector instructions with FMA.
 * Relative error of the result, checked for every float a in [2**-52,
 * 2**53) (normal results), both ways: below 2.9e-7. Zero or subnormal a:
 * a * a is 0; inf: inf. */
ALWAYS_INLINE float pow24(float a, int fused) {
    uint32_t u = bits_of(a);
    float e = (float)(int32_t)(u >> 23);
    float q = floorf(MULADD(e, 0.2f, 0.1f, fused)); /* frac in [0.1, 0.9] */
    float r = MULADD(q, -5.0f, e, fused);
    float root = 0.0004987940192222595f; /* 2 ** (0.2 + 0.4 r) */
    root = MULADD(root, r, 0.0032517637591809034f, fused);
    root = MULADD(root, r, 0.04538576304912567f, fused);
    root = MULADD(root, r, 0.31788188219070435f, fused);
    root = MULADD(root, r, 1.148698329925537f, fused);
    float t = float_of((u & 0x7FFFFFu) | 0x3F800000u) - 1.5f; /* m - 1.5, exact */
    float p = 0.0015789433382451534f;                        /* m ** 0.4 */
    p = MULADD(p, t, -0.00276177772320807f, fused);
    p = MULADD(p, t, 0.004562105517834425f, fused);
    p = MULADD(p, t, -0.009600895456969738f, fused);
    p = MULADD(p, t, 0.022308865562081337f, fused);
    p = MULADD(p, t, -0.0627274289727211f, fused);
    p = MULADD(p, t, 0.3136208951473236f, fused);
    p = MULADD(p, t, 1.1760790348052979f, fused);
    float four_q = float_of((uint32_t)((int32_t)q + 38) << 24); /* 2 ** (2q - 51) */
    return (a * a) * (p * root * four_q);
}

/* kind: 0 powf, 1 pow24 (fused where the baseline ISA has FMA), 2 a * a, 3
 * pow24 fused */
ALWAYS_INLINE float error_power(float a, int kind, float norm) {
    if (kind == 1 || kind == 3) return pow24(a, kind == 3 || QO_FMA_BASELINE);
    if (kind == 2) return a * a;
    return powf(a, norm);
}

typedef struct {
    float qmin, qmax, norm;
    int mantissa_bits, emin;
} Format;

/* |fake_quant(x) - x| ** norm; fast: x * (1 / s) (inverse) instead of x / s,
 * within 1.5 ulp of it: a value's level changes only within an ulp of a
 * rounding midpoint, where both levels' errors are equal to an ulp */
ALWAYS_INLINE float element_error(float x, float s, float inverse, float zp, Format f,
                                  int kind, int has_zp, int is_float, int fast) {
    float v = fast ? x * inverse : x / s;
    if (has_zp) v = v + zp;
    v = v < f.qmin ? f.qmin : v;
    v = v > f.qmax ? f.qmax : v;
    v = round_format(v, is_float, f.mantissa_bits, f.emin);
    if (has_zp) v = v - zp;
    float d = v * s - x;
    return error_power(fabsf(d), kind, f.norm);
}

/* sum over one row x[0..g) of the error of candidate (s, zp): float32 sums
 * of 128 values (relative error below 2**-20), added in float64. Each sum
 * in 16 lanes (lane l: the values at l mod 16), added pairwise at the end,
 * where a simd reduction would end with 16 serial adds (with score_block's
 * loops of known length, the scorers are 1.04x faster). */
ALWAYS_INLINE double row_error(const float *restrict x, int64_t g, float s, float zp,
                               Format f, int kind, int has_zp, int is_float,
                               int fast) {
    float inverse = 1.0f / s;
    double total = 0.0;
    for (int64_t i0 = 0; i0 < g; i0 += 128) {
        int64_t i1 = g - i0 < 128 ? g : i0 + 128, i = i0;
        float lane[16] = {0.0f};
        for (; i + 16 <= i1; i += 16)
#pragma omp simd
            for (int l = 0; l < 16; ++l)
                lane[l] += element_error(x[i + l], s, inverse, zp, f, kind, has_zp,
                                         is_float, fast);
        for (; i < i1; ++i) /* g not a multiple of 16 */
            lane[0] += element_error(x[i], s, inverse, zp, f, kind, has_zp, is_float,
                                     fast);
        for (int w = 8; w > 0; w /= 2)
            for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
        total += (double)lane[0];
    }
    return total;
}

/* Which scores of a block of candidates a search skips (qo_mse_block): those
 * of qparams whose errors are torch's (exact, (Q,)), and those of a candidate
 * whose qparams equal those of the one before it (`first`: the block's first
 * candidate in the table, whose rows the scale and zero-point pointers start
 * at; -1: skip nothing). */
typedef struct {
    const uint8_t *exact;
    int64_t first;
} Skip;

/* whether candidates a and b of qparam j have equal qparams */
ALWAYS_INLINE int same_qparams(const float *scale, const float *zero_point, int64_t q,
                               int64_t a, int64_t b, int64_t j) {
    return scale[a * q + j] == scale[b * q + j] &&
           (!zero_point || zero_point[a * q + j] == zero_point[b * q + j]);
}

ALWAYS_INLINE int skipped(Skip skip, const float *scale, const float *zero_point,
                          int64_t q, int64_t k, int64_t j) {
    if (skip.first < 0) return 0;
    if (skip.exact[j]) return 1;
    return skip.first + k > 0 && same_qparams(scale, zero_point, q, k, k - 1, j);
}

/* out[k, j] += errors of rows (r, j) for r in [r0, r1), j in [j0, j1), but
 * for the scores the search skips */
ALWAYS_INLINE void score_block(const float *x, int64_t q, int64_t g, int64_t c,
                               const float *scale, const float *zero_point,
                               Skip skip, const Format *f, double *out, int64_t r0,
                               int64_t r1, int64_t j0, int64_t j1, int kind,
                               int has_zp, int is_float, int fast) {
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t j = j0; j < j1; ++j) {
            const float *row = x + (r * q + j) * g;
            for (int64_t k = 0; k < c; ++k) {
                if (skipped(skip, scale, zero_point, q, k, j)) continue;
                float zp = has_zp ? zero_point[k * q + j] : 0.0f;
                float sk = scale[k * q + j];
                /* groups of 128 (the common case) by loops of known length */
                if (g == 128)
                    out[k * q + j] +=
                        row_error(row, 128, sk, zp, *f, kind, has_zp, is_float, fast);
                else
                    out[k * q + j] +=
                        row_error(row, g, sk, zp, *f, kind, has_zp, is_float, fast);
            }
        }
}

typedef void (*Scorer)(const float *, int64_t, int64_t, int64_t, const float *,
                       const float *, Skip, const Format *, double *, int64_t, int64_t,
                       int64_t, int64_t);

/* one copy of score_block per (error power, zero point, float format, fast
 * division), each with its ISA clones (an AVX-512 one too: QO_WIDE_CLONES):
 * the hot loops of qo_mse_errors (exact division) and qo_mse_block (fast)
 * are all in here */
#define SCORER(KIND, ZP, FLOAT, FAST) SCORER_WITH(QO_WIDE_CLONES, KIND, ZP, FLOAT, FAST)
#define SCORER_WITH(CLONES, KIND, ZP, FLOAT, FAST)                                   \
    CLONES static void score_##KIND##_##ZP##_##FLOAT##_##FAST(                       \
        const float *x, int64_t q, int64_t g, int64_t c, const float *scale,        \
        const float *zero_point, Skip skip, const Format *f, double *out,           \
        int64_t r0, int64_t r1, int64_t j0, int64_t j1) {                            \
        score_block(x, q, g, c, scale, zero_point, skip, f, out, r0, r1, j0, j1,     \
                    KIND, ZP, FLOAT, FAST);                                          \
    }
#define SCORERS_OF(KIND, FAST)                                                       \
    SCORER(KIND, 0, 0, FAST)                                                         \
    SCORER(KIND, 0, 1, FAST) SCORER(KIND, 1, 0, FAST) SCORER(KIND, 1, 1, FAST)
SCORERS_OF(0, 0) SCORERS_OF(1, 0) SCORERS_OF(2, 0)
SCORERS_OF(0, 1) SCORERS_OF(1, 1) SCORERS_OF(2, 1)

#define ROW_OF(KIND, FAST)                                                           \
    score_##KIND##_0_0_##FAST, score_##KIND##_0_1_##FAST, score_##KIND##_1_0_##FAST, \
        score_##KIND##_1_1_##FAST
static const Scorer SCORERS[24] = {
    ROW_OF(0, 0), ROW_OF(1, 0), ROW_OF(2, 0), ROW_OF(0, 1), ROW_OF(1, 1), ROW_OF(2, 1),
};

/* Whether pow24 may use fused multiply-adds: the baseline ISA has them, or
 * the CPU runs the FMA clones (QO_FMA_CLONES). */
static int fused_clones(void) {
#ifdef QO_FMA_CLONES
    __builtin_cpu_init();
    return __builtin_cpu_supports(QO_FMA_ISA) != 0;
#else
    return 0;
#endif
}

static int fused_available(void) { return QO_FMA_BASELINE || fused_clones(); }

#ifdef QO_FMA_CLONES
/* The pow24 scorers with fused multiply-adds (kind 3), chosen where
 * fused_clones(): the ifunc then never picks their default clone (which
 * would call fmaf). With AVX-512 (Zen 4), qo_mse_block of norm 2.4 is 1.3x
 * faster than with the former pow24 (sqrtf, a degree-5 polynomial, selects
 * for 2 ** (0.4 r); this one without FMA is as fast as that). */
#define FUSED_SCORERS_OF(FAST)                                                       \
    SCORER_WITH(QO_FMA_CLONES, 3, 0, 0, FAST)                                        \
    SCORER_WITH(QO_FMA_CLONES, 3, 0, 1, FAST)                                        \
    SCORER_WITH(QO_FMA_CLONES, 3, 1, 0, FAST)                                        \
    SCORER_WITH(QO_FMA_CLONES, 3, 1, 1, FAST)
FUSED_SCORERS_OF(0)
FUSED_SCORERS_OF(1)
static const Scorer FUSED_SCORERS[8] = {ROW_OF(3, 0), ROW_OF(3, 1)};
#endif

/* Qparams per piece of the table's serial passes, split among threads
 * (each piece's rows in order: contiguous, vectorized) */
#define QO_PIECE 4096

/* out (c, q) = the errors of candidates (scale, zero_point) (c, q); the
 * scores skipped keep their value */
static void score_table(const float *x, int64_t n, int64_t q, int64_t g, int64_t c,
                       const float *scale, const float *zero_point, Skip skip,
                       float qmin, float qmax, int is_float, int mantissa_bits,
                       int emin, float norm, int fast, double *out, int threads) {
    Format f = {qmin, qmax, norm, mantissa_bits, emin};
    int kind = norm == 2.4f ? 1 : (norm == 2.0f ? 2 : 0);
    int has_zp = zero_point != NULL;
    Scorer score = SCORERS[(fast != 0) * 12 + kind * 4 + has_zp * 2 + (is_float != 0)];
#ifdef QO_FMA_CLONES
    if (kind == 1 && fused_clones())
        score = FUSED_SCORERS[(fast != 0) * 4 + has_zp * 2 + (is_float != 0)];
#endif
    /* the scores made start at 0 (in pieces, as the repeats' copies of
     * qo_mse_block: serial, each would cost 2 threads about 5% of a search
     * of 1024x4096 values) */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j0 = 0; j0 < q; j0 += QO_PIECE)
        for (int64_t k = 0; k < c; ++k)
            for (int64_t j = j0; j < j0 + QO_PIECE && j < q; ++j)
                if (!skipped(skip, scale, zero_point, q, k, j)) out[k * q + j] = 0.0;
    if (n == 1 || c * q > (1 << 22)) {
        /* one row, or tables too large to copy per thread: split qparams */
#pragma omp parallel for schedule(dynamic, 64) num_threads(threads)
        for (int64_t j = 0; j < q; ++j)
            score(x, q, g, c, scale, zero_point, skip, &f, out, 0, n, j, j + 1);
        return;
    }
    /* many rows: split them (read in order), one partial table per thread
     * (without memory for one, that thread adds to out in turn) */
#pragma omp parallel num_threads(threads)
    {
        double *mine = calloc((size_t)(c * q), sizeof(double));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; ++r) {
            if (mine) {
                score(x, q, g, c, scale, zero_point, skip, &f, mine, r, r + 1, 0, q);
                continue;
            }
#pragma omp critical
            score(x, q, g, c, scale, zero_point, skip, &f, out, r, r + 1, 0, q);
        }
        if (mine) {
#pragma omp critical
            for (int64_t i = 0; i < c * q; ++i) out[i] += mine[i];
            free(mine);
        }
    }
}

void qo_mse_errors(const float *x, int64_t n, int64_t q, int64_t g, int64_t c,
                   const float *scale, const float *zero_point, float qmin,
                   float qmax, int is_float, int mantissa_bits, int emin,
                   float norm, double *out, int threads) {
    Skip none = {NULL, -1};
    score_table(x, n, q, g, c, scale, zero_point, none, qmin, qmax, is_float,
                mantissa_bits, emin, norm, 0, out, threads);
}

/* ------------------------------------------- llm-compressor's search order
 *
 * The errors table (C, Q) of a search holds, per qparam j, the kernel's
 * errors, or torch's for every candidate where exact[j] (scored by the
 * caller). Candidate i "repeats" where its qparams equal candidate i - 1's:
 * its error is exactly that one's in every arithmetic. Two errors are "near"
 * where |a - b| <= tolerance * max(a, b): only then may the kernel's order of
 * them differ from torch's (quantobs.solvers.mse_ties). */

ALWAYS_INLINE int near(double a, double b, double tolerance) {
    return fabs(a - b) <= (a > b ? a : b) * tolerance;
}

/* Scores candidates [c0, c1) of the table (fast division: x * (1 / s)):
 * those of exact qparams are left as they are, repeated candidates copy
 * their predecessor's error. */
void qo_mse_block(const float *x, int64_t n, int64_t q, int64_t g, int64_t c0,
                  int64_t c1, const float *scale, const float *zero_point, float qmin,
                  float qmax, int is_float, int mantissa_bits, int emin, float norm,
                  const uint8_t *exact, double *errors, int threads) {
    if (c1 <= c0) return;
    Skip skip = {exact, c0};
    const float *zp = zero_point ? zero_point + c0 * q : NULL;
    score_table(x, n, q, g, c1 - c0, scale + c0 * q, zp, skip, qmin, qmax, is_float,
                mantissa_bits, emin, norm, 1, errors + c0 * q, threads);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j0 = 0; j0 < q; j0 += QO_PIECE)
        for (int64_t i = c0 > 0 ? c0 : 1; i < c1; ++i) /* in order: chains of repeats */
            for (int64_t j = j0; j < j0 + QO_PIECE && j < q; ++j)
                if (!exact[j] && same_qparams(scale, zero_point, q, i, i - 1, j))
                    errors[i * q + j] = errors[(i - 1) * q + j];
}

/* Columns (qparams) per piece of the comparisons' work: the pieces run
 * apart (OpenMP), each over its columns of every row. */
#define QO_COLUMNS 2048

static int thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* qo_mse_rows over columns [j0, j1); bits[i - c0]: bit 0, some column
 * improves; bit 1, one improves clearly; bit 2, one compares near */
ALWAYS_INLINE void rows_piece(const double *errors, int64_t q, int64_t c0, int64_t c1,
                              const float *scale, const float *zero_point,
                              const uint8_t *exact, double tolerance, double *least,
                              int64_t *best, uint8_t *bits, int64_t j0, int64_t j1) {
    for (int64_t i = c0; i < c1; ++i) {
        const double *row = errors + i * q;
        if (i == 0) {
            for (int64_t j = j0; j < j1; ++j) least[j] = row[j], best[j] = 0;
            continue;
        }
        const float *s = scale + i * q, *sp = s - q;
        const float *z = zero_point ? zero_point + i * q : s;
        const float *zp = zero_point ? z - q : s;
        int improved = 0, clear = 0, close = 0;
#pragma omp simd reduction(| : improved, clear, close)
        for (int64_t j = j0; j < j1; ++j) {
            double e = row[j], b = least[j];
            int below = e < b;
            int repeat = (s[j] == sp[j]) & (z[j] == zp[j]);
            int tight = near(e, b, tolerance) & !exact[j] & !repeat;
            close |= tight;
            clear |= below & !tight;
            improved |= below;
            int wins = below | ((e != e) & (b == b)); /* torch.argmin's NaN */
            least[j] = wins ? e : b;
            best[j] = wins ? i : best[j];
        }
        bits[i - c0] |= (uint8_t)(improved | (clear << 1) | (close << 2));
    }
}

QO_CLONES static void rows_pieces(const double *errors, int64_t q, int64_t c0,
                                  int64_t c1, const float *scale,
                                  const float *zero_point, const uint8_t *exact,
                                  double tolerance, double *least, int64_t *best,
                                  uint8_t *bits, int threads) {
    int64_t pieces = (q + QO_COLUMNS - 1) / QO_COLUMNS, rows = c1 - c0;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t k = 0; k < pieces; ++k) {
        int64_t j0 = k * QO_COLUMNS, j1 = j0 + QO_COLUMNS < q ? j0 + QO_COLUMNS : q;
        rows_piece(errors, q, c0, c1, scale, zero_point, exact, tolerance, least, best,
                   bits + (int64_t)thread_index() * rows, j0, j1);
    }
}

/* llm-compressor's comparisons of candidates [c0, c1): each error against
 * the least error of the candidates before it, per qparam. least (Q,): the
 * running least errors (set by candidate 0; a NaN stays, as torch.minimum's)
 * and best (Q,) their candidates (torch.argmin's: the first minimum, the
 * first NaN). flags[i]: bit 0, some qparam improves (its error is below the
 * least); bit 1, that is decided: some qparam improves clearly (not near the
 * least, or exact), or none compares near (the repeats' comparisons are
 * exact). Returns 1 if out of memory (nothing done), else 0. */
int64_t qo_mse_rows(const double *errors, int64_t q, int64_t c0, int64_t c1,
                    const float *scale, const float *zero_point, const uint8_t *exact,
                    double tolerance, double *least, int64_t *best, uint8_t *flags,
                    int threads) {
    if (c1 <= c0) return 0;
    int64_t rows = c1 - c0;
    threads = threads < 1 ? 1 : threads;
    uint8_t *bits = calloc((size_t)(threads * rows), 1); /* one slice per thread */
    if (!bits) return 1;
    rows_pieces(errors, q, c0, c1, scale, zero_point, exact, tolerance, least, best,
                bits, threads);
    for (int64_t r = 0; r < rows; ++r) {
        int any = 0;
        for (int t = 0; t < threads; ++t) any |= bits[t * rows + r];
        int improved = any & 1, clear = (any >> 1) & 1, close = (any >> 2) & 1;
        flags[c0 + r] = c0 + r == 0 ? 3 : (uint8_t)(improved | ((clear | !close) << 1));
    }
    free(bits);
    return 0;
}

/* qo_mse_marks over columns [j0, j1); returns how many it marked */
ALWAYS_INLINE int64_t marks_piece(const double *errors, int64_t q, int64_t end,
                                  int64_t reach, const float *scale,
                                  const float *zero_point, const uint8_t *exact,
                                  double tolerance, const uint8_t *flags, int known,
                                  int64_t *best, uint8_t *marks, int64_t j0,
                                  int64_t j1) {
    double least[QO_COLUMNS];
    float ws[QO_COLUMNS], wz[QO_COLUMNS]; /* the winners' qparams */
    int64_t width = j1 - j0;
    /* the running least (and, unless known, the winners) up to the last
     * undecided candidate: qparams near it there */
    for (int64_t j = 0; j < width; ++j) {
        least[j] = errors[j0 + j];
        if (!known) best[j0 + j] = 0;
    }
    for (int64_t i = 1; i < reach; ++i) {
        const double *row = errors + i * q + j0;
        const float *s = scale + i * q + j0, *sp = s - q;
        const float *z = zero_point ? zero_point + i * q + j0 : s;
        const float *zp = zero_point ? z - q : s;
        int undecided = !(flags[i] & 2);
        int64_t *bi = best + j0;
        uint8_t *mj = marks + j0;
        const uint8_t *ex = exact + j0;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) {
            double e = row[j], b = least[j];
            int repeat = (s[j] == sp[j]) & (z[j] == zp[j]);
            mj[j] |= undecided & near(e, b, tolerance) & !ex[j] & !repeat;
            int wins = (e < b) | ((e != e) & (b == b));
            least[j] = wins ? e : b;
            if (!known) bi[j] = wins ? i : bi[j];
        }
    }
    /* a winner near another candidate (one of other qparams: equal errors
     * in every arithmetic) */
    for (int64_t j = 0; j < width; ++j) {
        int64_t w = best[j0 + j] * q + j0 + j;
        least[j] = errors[w];
        ws[j] = scale[w];
        wz[j] = zero_point ? zero_point[w] : ws[j];
    }
    for (int64_t i = 0; i < end; ++i) {
        const double *row = errors + i * q + j0;
        const float *s = scale + i * q + j0;
        const float *z = zero_point ? zero_point + i * q + j0 : s;
        uint8_t *mj = marks + j0;
        const uint8_t *ex = exact + j0;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) {
            int same = (s[j] == ws[j]) & (z[j] == wz[j]);
            mj[j] |= near(row[j], least[j], tolerance) & !ex[j] & !same;
        }
    }
    int64_t count = 0;
    for (int64_t j = j0; j < j1; ++j) count += marks[j] != 0;
    return count;
}

QO_WIDE_CLONES static int64_t marks_pieces(const double *errors, int64_t q,
                                           int64_t end, int64_t reach,
                                           const float *scale, const float *zero_point,
                                           const uint8_t *exact, double tolerance,
                                           const uint8_t *flags, int known,
                                           int64_t *best, uint8_t *marks, int threads) {
    int64_t pieces = (q + QO_COLUMNS - 1) / QO_COLUMNS, count = 0;
#pragma omp parallel for schedule(static) reduction(+ : count) num_threads(threads)
    for (int64_t k = 0; k < pieces; ++k) {
        int64_t j0 = k * QO_COLUMNS, j1 = j0 + QO_COLUMNS < q ? j0 + QO_COLUMNS : q;
        count += marks_piece(errors, q, end, reach, scale, zero_point, exact,
                             tolerance, flags, known, best, marks, j0, j1);
    }
    return count;
}

/* The qparams whose kernel errors may decide llm-compressor's choice
 * otherwise than torch's, over the first `end` candidates (those it scores
 * before its early stop): those near the least at an undecided candidate
 * (flags, of qo_mse_rows) and those whose first least error (best (Q,):
 * its candidate, torch.argmin's; given where `known`, from qo_mse_rows over
 * the same `end` candidates) is near another candidate's of other qparams.
 * Sets marks[j] = 1 for them (exact ones never); returns how many are
 * marked. */
int64_t qo_mse_marks(const double *errors, int64_t q, int64_t end, const float *scale,
                     const float *zero_point, const uint8_t *exact, double tolerance,
                     const uint8_t *flags, int known, int64_t *best, uint8_t *marks,
                     int threads) {
    int64_t reach = end; /* the running least: to the last undecided candidate */
    if (known) {
        reach = 0;
        for (int64_t i = 1; i < end; ++i)
            if (!(flags[i] & 2)) reach = i + 1;
    }
    return marks_pieces(errors, q, end, reach, scale, zero_point, exact, tolerance,
                        flags, known, best, marks, threads < 1 ? 1 : threads);
}

/* pow24 over an array, either way (for the tests) */
QO_CLONES static void pow24_plain(const float *a, float *out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = pow24(a[i], 0);
}

#ifdef QO_FMA_CLONES
QO_FMA_CLONES
#endif
static void pow24_fused(const float *a, float *out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = pow24(a[i], 1);
}

/* fused: 1 with fused multiply-adds, 0 without, -1 as the MSE scorers do;
 * returns 1 or 0, how it was computed, or -1 (nothing done) where fused
 * multiply-adds are asked for and not available */
int64_t qo_pow24(const float *a, float *out, int64_t n, int fused) {
    fused = fused < 0 ? fused_available() : fused != 0;
    if (fused && !fused_available()) return -1;
    if (fused)
        pow24_fused(a, out, n);
    else
        pow24_plain(a, out, n);
    return fused;
}
