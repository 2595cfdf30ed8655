/* MSE candidate errors (qo_mse_errors) and pow24 (see qo_kernels.h). */
#include "qo_kernels.h"

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

/* one copy of score_block per (error power, zero point, float format), each
 * with its ISA clones: the hot loops of qo_mse_errors are all in here */
#define SCORER(KIND, ZP, FLOAT)                                                      \
    QO_CLONES static void score_##KIND##_##ZP##_##FLOAT(                             \
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
        for (int64_t j = 0; j < q; ++j)
            score(x, q, g, c, scale, zero_point, &f, out, 0, n, j, j + 1);
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

/* pow24 over an array: for the tests */
QO_CLONES void qo_pow24(const float *a, float *out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = pow24(a[i]);
}
