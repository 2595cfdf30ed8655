/* Histogram L2 searches: torch.ao's L2 terms, the global L2 certificate,
 * the batched per-channel / per-group candidates (see qo_kernels.h). */
#include "qo_kernels.h"

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

/* The (bins, 4) table of quantobs.solvers.l2_error.prefix_moments for one
 * row of counts, in its arithmetic: A_p[j] = P_p[j] - h[j] * l_j^(p+1)/(p+1)
 * with l_j = j - bins / 2 and P_p the running sum of h * (l_{j+1}^(p+1) -
 * l_j^(p+1)) / (p+1) (torch.cumsum's order); column 3 holds h. */
static void prefix_table(const double *counts, int64_t bins, double *table) {
    const double half = (double)bins / 2;
    double run[3] = {0.0, 0.0, 0.0};
    for (int64_t j = 0; j < bins; ++j) {
        double a = (double)j - half, b = (double)(j + 1) - half, c = counts[j];
        double pa[3] = {a, a * a / 2, a * a * a / 3};
        double pb[3] = {b, b * b / 2, b * b * b / 3};
        for (int p = 0; p < 3; ++p) {
            table[4 * j + p] = run[p] - c * pa[p];
            run[p] += c * (pb[p] - pa[p]);
        }
        table[4 * j + 3] = c;
    }
}

/* int (x - center)^2 rho between two sets of moments (region_error) */
ALWAYS_INLINE double region(const double hi[3], const double lo[3], double center) {
    double d0 = hi[0] - lo[0], d1 = hi[1] - lo[1], d2 = hi[2] - lo[2];
    return d2 - 2 * center * d1 + center * center * d0;
}

/* The L2 error of the range [lo, hi] (bin units, hi > lo) over a row's
 * prefix_table: the O(1) form of quantobs.solvers.l2_error.approx_errors
 * (exact = 0) or the exact sum over levels of exact_errors (exact = 1), in
 * their arithmetic (the levels summed in order); zero and top: the moments
 * at 0 and at bins. */
ALWAYS_INLINE double range_error(const double *table, int64_t bins, const double zero[3],
                                 const double top[3], double lo, double hi,
                                 int64_t levels, int exact) {
    const double half = (double)bins / 2;
    double width = (hi - lo) / (double)levels, total = 0.0;
    if (exact) {
        double prev[3] = {zero[0], zero[1], zero[2]}, next[3];
        for (int64_t l = 0; l < levels; ++l) {
            double edge = l + 1 == levels ? (double)bins : lo + (double)(l + 1) * width;
            moments_at(table, bins, edge, next);
            double center = lo + ((double)l + 0.5) * width - half;
            total += region(next, prev, center);
            prev[0] = next[0], prev[1] = next[1], prev[2] = next[2];
        }
        return total;
    }
    double at_lo[3], at_hi[3];
    moments_at(table, bins, lo, at_lo);
    moments_at(table, bins, hi, at_hi);
    double first = lo + width / 2 - half, last = hi - width / 2 - half;
    double left = region(at_lo, zero, first);
    double right = region(top, at_hi, last);
    double inside = (at_hi[0] - at_lo[0]) * width * width / 12;
    return left + right + inside;
}

/* A row's prefix_table (from float64 or int64 counts) and its end moments. */
static void row_table(const double *counts_f, const int64_t *counts_i, int64_t bins,
                      double *row, double *table, double zero[3], double top[3]) {
    if (counts_i)
        for (int64_t j = 0; j < bins; ++j) row[j] = (double)counts_i[j];
    prefix_table(counts_i ? row : counts_f, bins, table);
    moments_at(table, bins, 0.0, zero);
    moments_at(table, bins, (double)bins, top);
}

/* The L2 error of each candidate range [lo_u[r, k], hi_u[r, k]] (bin units)
 * of each histogram row r of counts (Q, B) (range_error; +inf where hi <=
 * lo). Each thread builds a row's prefix_table in its own buffer. Returns 1
 * (computing nothing) when out of memory. */
int64_t qo_l2_candidates(const double *counts, int64_t q, int64_t bins,
                         const double *lo_u, const double *hi_u, int64_t count,
                         int64_t levels, int exact, double *out, int threads) {
    double *tables = malloc((size_t)threads * 4 * (size_t)bins * sizeof(double));
    if (!tables) return 1;
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads)
    for (int64_t r = 0; r < q; ++r) {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        double *table = tables + (int64_t)t * 4 * bins, zero[3], top[3];
        row_table(counts + r * bins, NULL, bins, NULL, table, zero, top);
        for (int64_t k = 0; k < count; ++k) {
            double lo = lo_u[r * count + k], hi = hi_u[r * count + k];
            out[r * count + k] =
                hi > lo ? range_error(table, bins, zero, top, lo, hi, levels, exact)
                        : INFINITY;
        }
    }
    free(tables);
    return 0;
}

/* The symmetric batched L2 search (quantobs.solvers.l2_batched): for each
 * row of int64 counts (Q, B), every amax p = min(k, amax[r]), k = max(1,
 * floor(amax[r]) - B) .. ceil(amax[r]) (bin units), scored over [(qmin - 1/2) s, (qmax + 1/2) s] -
 * origin[r] with s = p / ((qmax - qmin) / 2) and qmax - qmin + 1 levels
 * (range_error); best[r]: the first minimum. Returns 1 when out of memory. */
int64_t qo_l2_symmetric(const int64_t *counts, int64_t q, int64_t bins,
                        const double *origin, const double *amax, double qmin,
                        double qmax, int exact, double *best, int threads) {
    double *buffers = malloc((size_t)threads * 5 * (size_t)bins * sizeof(double));
    if (!buffers) return 1;
    const int64_t levels = (int64_t)(qmax - qmin + 1);
    const double half = (qmax - qmin) / 2;
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads)
    for (int64_t r = 0; r < q; ++r) {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        double *row = buffers + (int64_t)t * 5 * bins, *table = row + bins;
        double zero[3], top[3];
        row_table(NULL, counts + r * bins, bins, row, table, zero, top);
        double a = amax[r], o = origin[r];
        double first = floor(a) - (double)bins;
        first = first < 1.0 ? 1.0 : first;
        double chosen = first < a ? first : a, least = INFINITY;
        /* whole steps from first (a count: at 2**53 and above k + 1 == k) */
        int64_t count = (int64_t)(ceil(a) - first) + 1;
        for (int64_t j = 0; j < count; ++j) {
            double k = first + (double)j, p = k < a ? k : a;
            double scale = p / half;
            double lo = (qmin - 0.5) * scale - o, hi = (qmax + 0.5) * scale - o;
            double err = hi > lo ? range_error(table, bins, zero, top, lo, hi, levels,
                                               exact)
                                 : INFINITY;
            if (err < least) least = err, chosen = p;
        }
        best[r] = chosen;
    }
    free(buffers);
    return 0;
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
QO_CLONES int64_t qo_torch_l2_terms(const float *hist, int64_t bins, int64_t shared,
                                    int64_t count, const int64_t *starts,
                                    const int64_t *ends, const double *bin_width,
                                    int64_t dst_nbins, float *out, int threads) {
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
