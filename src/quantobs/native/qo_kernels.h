/* The native kernels of quantobs: one shared library with a plain C ABI (no
 * Python or torch headers), loaded with ctypes by quantobs/native/loader.py,
 * which declares the argument types of every function below: keep the two in
 * step. Built at install time by setup.py (an optional extension) or, for
 * development, by quantobs/native/build.py; both compile every qo_*.c file of
 * this folder into the one library, with the same portable flags.
 *
 * Every kernel has an eager torch twin that gives the same numbers, used when
 * the library is absent. Data are contiguous float32 (the histogram tables of
 * the L2 scorer: float64); `threads` is the OpenMP team size (ignored in a
 * build without OpenMP).
 *
 * qo_minmax.c (min/max and scales)
 *   qo_minmax: min and max per qparam of x viewed as (N, Q, G), reduced over
 *     N and G (the canonical layout of quantobs.core.layout). NaN propagates
 *     like torch.amin / torch.amax. Also says whether every value was finite,
 *     and the largest |value|: what the caller would otherwise read them
 *     again for. Rows of 16 (N = 1, NVFP4's groups) have their own loop:
 *     AVX2 intrinsics where the CPU has them (chosen at run time, not a
 *     clone), streaming stores for outputs past 2**17 rows.
 *   qo_all_finite: whether every value is finite.
 *   qo_symmetric_scales: scales of symmetric args from min/max ranges, with
 *     calculate_qparams' float32 arithmetic in its order (NVFP4's group
 *     scales).
 *   qo_range_absmax: the largest |value| of non-empty ranges (global scales).
 *
 * qo_histogram.c (histogram counting)
 *   qo_histogram: exact integer counts of x on each qparam's power-of-two
 *     grid (quantobs.stats.histogram's binning).
 *   qo_histogram_pass: min/max and counts on a known grid in one pass (a
 *     per-tensor histogram's speculative update), the rest set aside.
 *   qo_histc: torch.histc's float32 bin selection with exact integer counts.
 *
 * qo_mse.c (MSE candidate errors)
 *   qo_mse_errors: for each candidate c and qparam q, the error
 *     sum_{n,g} |fake_quant(x[n,q,g]) - x[n,q,g]| ** norm, with fake_quant's
 *     float32 arithmetic in its order:
 *         v = x / s; v += zp; v = clamp(v, qmin, qmax); v = round(v);
 *         v -= zp; d = v * s - x
 *     round is half-to-even to an integer (int formats) or to the grid of a
 *     signed float format (mantissa_bits, emin: the exponent of its smallest
 *     normal). norm 2.4 uses pow24 (polynomials in the exponent's residue
 *     mod 5 and in the mantissa, fused multiply-adds where the CPU has them;
 *     relative error below 3e-7 either way, against 1 ulp for powf) and
 *     norm 2 squares; other norms call powf. Sums: float32 over each 128
 *     values of a row, float64 across.
 *   qo_pow24: pow24 over an array, with or without fused multiply-adds
 *     (for the tests).
 *   qo_mse_block, qo_mse_rows, qo_mse_marks: llm-compressor's grid search in
 *     blocks of candidates over one errors table (quantobs.solvers.mse_ties):
 *     the block's errors (qo_mse_errors' with x * (1 / s) for x / s, as the
 *     Triton searches; repeated candidates copied, qparams whose errors are
 *     torch's left as they are); the comparisons of each candidate with the
 *     least error before it (which improve, which are decided); the qparams
 *     whose near errors may order candidates otherwise than torch's.
 *
 * qo_search.c (histogram searches)
 *   qo_torch_l2_terms: the per-bin terms of torch.ao's histogram L2 error.
 *   qo_l2_errors: exact L2 errors of candidate ranges over a histogram (the
 *     certificate of the global L2 search); qo_l2_survivors: the ranges
 *     whose lower bound leaves them in the running.
 *   qo_l2_candidates: L2 errors (O(1) or exact) of candidate ranges of
 *     many small histograms, each row's prefix table made in the kernel (the
 *     batched L2 and histogram MSE searches per channel / per group);
 *     qo_l2_symmetric: the batched symmetric L2 search, every amax of each
 *     row scored in the kernel.
 *
 * qo_entropy.c (entropy calibration)
 *   qo_entropy: KL divergences of entropy calibration's candidates (the same
 *     for every histogram row, or one list per row); qo_entropy_search: the
 *     coarse-to-fine entropy search, one row at a time.
 *
 * qo_info.c (what the loader checks and `quantobs info` reports)
 *   qo_source_hash: the hash of the C sources this library was built from
 *     (QO_SOURCE_HASH, given by the build); the loader refuses a library
 *     whose hash differs from the sources next to it (a stale build).
 *   qo_build_info: "openmp=<_OPENMP or 0>;clones=<targets>;compiler=<name>".
 *   qo_isa: the clone the ifunc resolvers picked on this CPU for the MSE
 *     scorers and symmetric scales, the widest ("default" when the build has
 *     no clones; the other cloned kernels stop at avx2).
 */
#ifndef QO_KERNELS_H
#define QO_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h> /* also defines __GLIBC__ where the libc is glibc */
#ifdef _OPENMP
#include <omp.h>
#endif

#define QO_STR_(x) #x
#define QO_STR(x) QO_STR_(x)

/* Exported symbols: a DLL exports only what is marked. */
#if defined(_WIN32)
#define QO_API __declspec(dllexport)
#else
#define QO_API
#endif

#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#elif defined(_MSC_VER)
#define ALWAYS_INLINE static __forceinline
#else
#define ALWAYS_INLINE static inline
#endif

#if defined(_MSC_VER) && !defined(__clang__)
#define restrict __restrict
#endif

/* Runtime ISA dispatch. The library is compiled for the target's baseline
 * ISA (never -march=native: the build must run on every CPU of its
 * platform); the hot kernels, marked QO_CLONES, get one extra copy per
 * wider ISA, and an ifunc resolver picks the copy at load time. Measured on
 * an AMD EPYC (Zen 2: AVX2, no AVX-512), the baseline x86-64 (SSE2) copy
 * against the AVX2 one: MSE errors 6 to 18x slower (rintf and floorf become
 * calls), symmetric scales 6 to 14x, histogram counting 1.1 to 4.5x, pow24
 * 5x, torch's L2 terms 1.6 to 2.4x, min/max and finiteness about 1.15x. Not
 * cloned: the entropy and global L2 searches (float64, latency bound: no
 * gain) and min/max on rows of 16 (the AVX2 copy of its scalar loop is 1.25x
 * slower; it has a hand-written AVX2 loop instead, see qo_minmax.c). The MSE
 * scorers and the symmetric scales (QO_WIDE_CLONES) have an AVX-512 copy
 * too (x86-64-v4 with GCC 12+, avx512f elsewhere): on an AMD EPYC with
 * AVX-512 (Zen 4), 1.45x faster than their AVX2 one (symmetric scales:
 * 1.3x), and so are the MSE search's marks (qo_mse_marks, 1.5x; its
 * comparisons, qo_mse_rows, are no faster). The other kernels were not
 * measured with it. The norm 2.4 scorers have a second set, QO_FMA_CLONES
 * (x86-64-v4 and v3, GCC 12+), whose pow24 uses fused multiply-adds,
 * chosen at run time on CPUs of x86-64-v3 and up (QO_FMA_ISA; 1.3x faster
 * with AVX-512 than without FMA); other CPUs keep the unfused clones.
 *
 * target_clones needs GCC >= 6 or clang >= 14 on x86, and ifunc support from
 * the object format and libc (ELF with glibc or FreeBSD; not musl, macOS,
 * Windows). Elsewhere, or with -DQO_NO_CLONES (the build's fallback when the
 * attribute fails to compile), QO_CLONES and QO_WIDE_CLONES are empty and
 * the baseline copy is all there is. Keep QO_CLONE_TARGETS and qo_isa
 * (qo_info.c) in step. */
#if !defined(QO_NO_CLONES) && defined(__has_attribute) &&                    \
    (defined(__x86_64__) || defined(__i386__)) && defined(__ELF__) &&        \
    (defined(__GLIBC__) || defined(__FreeBSD__))
#if __has_attribute(target_clones)
#define QO_HAS_CLONES 1
#define QO_CLONES __attribute__((target_clones("avx2", "default")))
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define QO_WIDE_ISA "x86-64-v4"
#define QO_WIDE_CLONES                                                             \
    __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define QO_WIDE_ISA "avx512f"
#define QO_WIDE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#define QO_CLONE_TARGETS QO_WIDE_ISA ",avx2,default"
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define QO_FMA_ISA "x86-64-v3"
#define QO_FMA_CLONES                                                              \
    __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#endif
#ifndef QO_HAS_CLONES
#define QO_HAS_CLONES 0
#define QO_CLONES
#define QO_WIDE_CLONES
#define QO_CLONE_TARGETS ""
#endif

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

/* v rounded half to even to an integer (int formats), or to the grid of a
 * signed float format with `mantissa_bits` and `emin` (the exponent of its
 * smallest normal) */
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

/* ---------------------------------------------------------------- the ABI */

/* qo_minmax.c */
QO_API int64_t qo_minmax(const float *x, int64_t n, int64_t q, int64_t g, float *mins,
                         float *maxs, float *absmax, int threads);
QO_API int64_t qo_all_finite(const float *x, int64_t n, int threads);
QO_API int64_t qo_symmetric_scales(const float *mn, const float *mx, int64_t n,
                                   float divisor, float g, int has_g, int scale_fp8,
                                   float eps, float floor, int empty_as_zero,
                                   float *out, int threads);
QO_API int64_t qo_range_absmax(const float *mn, const float *mx, int64_t n, float *out,
                               int threads);

/* qo_histogram.c */
QO_API void qo_histogram(const float *x, int64_t n, int64_t q, int64_t g,
                         const float *inv, const float *off, int64_t bins, int absolute,
                         int64_t *counts, int threads);
QO_API int64_t qo_histogram_pass(const float *x, int64_t len, float inv, float off,
                                 int64_t bins, int absolute, int64_t *counts,
                                 float *minmax, float *side, int64_t cap,
                                 int64_t *side_count, int threads);
QO_API void qo_histc(const float *x, int64_t n, float lo, float hi, int64_t bins,
                     int64_t *counts, int threads);

/* qo_mse.c */
QO_API void qo_mse_errors(const float *x, int64_t n, int64_t q, int64_t g, int64_t c,
                          const float *scale, const float *zero_point, float qmin,
                          float qmax, int is_float, int mantissa_bits, int emin,
                          float norm, double *out, int threads);
QO_API int64_t qo_pow24(const float *a, float *out, int64_t n, int fused);
QO_API void qo_mse_block(const float *x, int64_t n, int64_t q, int64_t g, int64_t c0,
                         int64_t c1, const float *scale, const float *zero_point,
                         float qmin, float qmax, int is_float, int mantissa_bits,
                         int emin, float norm, const uint8_t *exact, double *errors,
                         int threads);
QO_API int64_t qo_mse_rows(const double *errors, int64_t q, int64_t c0, int64_t c1,
                           const float *scale, const float *zero_point,
                           const uint8_t *exact, double tolerance, double *least,
                           int64_t *best, uint8_t *flags, int threads);
QO_API int64_t qo_mse_marks(const double *errors, int64_t q, int64_t end,
                            const float *scale, const float *zero_point,
                            const uint8_t *exact, double tolerance,
                            const uint8_t *flags, int known, int64_t *best,
                            uint8_t *marks, int threads);

/* qo_search.c */
QO_API int64_t qo_torch_l2_terms(const float *hist, int64_t bins, int64_t shared,
                                 int64_t count, const int64_t *starts,
                                 const int64_t *ends, const double *bin_width,
                                 int64_t dst_nbins, float *out, int threads);
QO_API void qo_l2_errors(const double *table, int64_t bins, const double *lo,
                         const double *hi, int64_t count, int64_t levels, double *out,
                         int threads);
QO_API int64_t qo_l2_survivors(const double *at, const double *start,
                               const double *total, const double *jumps,
                               double jump_weight, int64_t bins, int64_t levels,
                               int64_t na, int64_t b0, double limit, int64_t *out,
                               int64_t cap, int threads);
QO_API int64_t qo_l2_candidates(const double *counts, int64_t q, int64_t bins,
                                const double *lo_u, const double *hi_u, int64_t count,
                                int64_t levels, int exact, double *out, int threads);
QO_API int64_t qo_l2_symmetric(const int64_t *counts, int64_t q, int64_t bins,
                               const double *origin, const double *amax, double qmin,
                               double qmax, int exact, double *best, int threads);

/* qo_entropy.c */
QO_API void qo_entropy(const double *h, int64_t q, int64_t bins, const int64_t *cands,
                       int64_t cand_stride, int64_t count, int64_t levels,
                       int64_t masses, double *out, int threads);
QO_API int64_t qo_entropy_search(const int64_t *counts, int64_t q, int64_t bins,
                                 const int64_t *levels, int64_t start_bin,
                                 int64_t stride, int64_t coarse, int64_t keep,
                                 int64_t reach, int64_t masses, int64_t *best,
                                 int threads);

/* qo_info.c */
QO_API const char *qo_source_hash(void);
QO_API const char *qo_build_info(void);
QO_API const char *qo_isa(void);

#endif /* QO_KERNELS_H */
