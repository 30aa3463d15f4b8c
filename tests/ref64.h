/* ref64.h - the tests' independent reference: attention forward and backward in fp64, written
   straight from the formulas with plain loops, and the seeded data the tests feed it.

   Shapes follow the attention contract (uly_attn in ulysses.h), all dense and row-major:
   q, dout, out, dq [B, Sq, H, D]; k, v, dk, dv [B, Sk, Hkv, D]; lse [B, H, Sq].
       s[i][j] = scale * q_i . k_j              for keys kept by the mask
       causal (bottom-right): row i keeps j <= i + Sk - Sq
       lse_i   = log sum_j exp(s_ij)            (+inf for a row with no key kept)
       p_ij    = exp(s_ij - lse_i);  o_i = sum_j p_ij v_j   (0 for a row with no key)
       backward: dv_j = sum_i p_ij do_i;  dp_ij = do_i . v_j;  Dsum_i = sum_j p_ij dp_ij;
                 ds_ij = p_ij (dp_ij - Dsum_i);  dq_i = scale sum_j ds_ij k_j;
                 dk_j = scale sum_i ds_ij q_i;  GQA: query head h reads kv head h / (H / Hkv),
                 and dk, dv of a kv head sum over its query heads.
   Inputs are float (the data the library sees); results are double. */
#ifndef ULY_REF64_H
#define ULY_REF64_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------
   Seeded data: xorshift64, uniform in [-1, 1) */

typedef struct ref_rng {
    uint64_t s;
} ref_rng;

static inline ref_rng ref_seed(uint64_t seed) {
    ref_rng r;
    r.s = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
    if (!r.s) r.s = 1;
    return r;
}

static inline uint64_t ref_next(ref_rng *r) {
    uint64_t x = r->s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    r->s = x;
    return x;
}

/* Uniform in [-1, 1): 24 random bits, exact in float. */
static inline float ref_uniform(ref_rng *r) {
    return (float)((double)(ref_next(r) >> 40) / (double)(1 << 23) - 1.0);
}

static inline void ref_fill(float *x, int64_t n, uint64_t seed) {
    ref_rng r = ref_seed(seed);
    for (int64_t i = 0; i < n; i++) x[i] = ref_uniform(&r);
}

static inline float *ref_alloc_f(int64_t n) {
    return (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
}
static inline double *ref_alloc_d(int64_t n) {
    return (double *)calloc((size_t)(n > 0 ? n : 1), sizeof(double));
}

/* ---------------------------------------------------------------------------------------------
   fp64 attention */

typedef struct ref_shape {
    int64_t B, Sq, Sk, H, Hkv, D;
    int causal;
    double scale; /* 0 = 1/sqrt(D) */
} ref_shape;

static inline double ref_scale(const ref_shape *s) {
    return s->scale != 0 ? s->scale : 1.0 / sqrt((double)s->D);
}
static inline int ref_keeps(const ref_shape *s, int64_t i, int64_t j) {
    return !s->causal || j <= i + s->Sk - s->Sq;
}
static inline int64_t ref_qi(const ref_shape *s, int64_t b, int64_t i, int64_t h) {
    return ((b * s->Sq + i) * s->H + h) * s->D;
}
static inline int64_t ref_ki(const ref_shape *s, int64_t b, int64_t j, int64_t h) {
    return ((b * s->Sk + j) * s->Hkv + h) * s->D;
}

/* Row (b, h, i): p[0, Sk) (0 where masked), returns lse (+inf when no key is kept). */
static inline double ref_row_probs(const ref_shape *s, const float *q, const float *k, int64_t b,
                            int64_t h, int64_t i, double *p) {
    int64_t hk = h / (s->H / s->Hkv);
    double mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < s->Sk; j++) {
        if (!ref_keeps(s, i, j)) continue;
        double dot = 0;
        for (int64_t d = 0; d < s->D; d++)
            dot += (double)q[ref_qi(s, b, i, h) + d] * (double)k[ref_ki(s, b, j, hk) + d];
        p[j] = dot * ref_scale(s);
        if (p[j] > mx) mx = p[j];
    }
    if (mx == -INFINITY) {
        for (int64_t j = 0; j < s->Sk; j++) p[j] = 0;
        return INFINITY;
    }
    for (int64_t j = 0; j < s->Sk; j++)
        if (ref_keeps(s, i, j)) sum += exp(p[j] - mx);
    double lse = mx + log(sum);
    for (int64_t j = 0; j < s->Sk; j++) p[j] = ref_keeps(s, i, j) ? exp(p[j] - lse) : 0;
    return lse;
}

/* o [B, Sq, H, D], lse [B, H, Sq] (either may be NULL). */
static inline void ref64_forward(const ref_shape *s, const float *q, const float *k, const float *v,
                          double *o, double *lse) {
    double *p = ref_alloc_d(s->Sk);
    int64_t g = s->H / s->Hkv;
    for (int64_t b = 0; b < s->B; b++)
        for (int64_t h = 0; h < s->H; h++)
            for (int64_t i = 0; i < s->Sq; i++) {
                double l = ref_row_probs(s, q, k, b, h, i, p);
                if (lse) lse[(b * s->H + h) * s->Sq + i] = l;
                if (!o) continue;
                for (int64_t d = 0; d < s->D; d++) {
                    double acc = 0;
                    for (int64_t j = 0; j < s->Sk; j++)
                        acc += p[j] * (double)v[ref_ki(s, b, j, h / g) + d];
                    o[ref_qi(s, b, i, h) + d] = acc;
                }
            }
    free(p);
}

/* dq like q, dk and dv like k (overwritten). */
static inline void ref64_backward(const ref_shape *s, const float *q, const float *k,
                                  const float *v, const float *dout, double *dq, double *dk,
                                  double *dv) {
    double *p = ref_alloc_d(s->Sk), *dp = ref_alloc_d(s->Sk);
    int64_t g = s->H / s->Hkv;
    double scale = ref_scale(s);
    for (int64_t n = 0; n < s->B * s->Sq * s->H * s->D; n++) dq[n] = 0;
    for (int64_t n = 0; n < s->B * s->Sk * s->Hkv * s->D; n++) dk[n] = dv[n] = 0;
    for (int64_t b = 0; b < s->B; b++)
        for (int64_t h = 0; h < s->H; h++)
            for (int64_t i = 0; i < s->Sq; i++) {
                ref_row_probs(s, q, k, b, h, i, p);
                const float *doi = dout + ref_qi(s, b, i, h);
                double dsum = 0;
                for (int64_t j = 0; j < s->Sk; j++) {
                    const float *vj = v + ref_ki(s, b, j, h / g);
                    double acc = 0;
                    for (int64_t d = 0; d < s->D; d++) acc += (double)doi[d] * (double)vj[d];
                    dp[j] = acc;
                    dsum += p[j] * acc;
                }
                for (int64_t j = 0; j < s->Sk; j++) {
                    if (p[j] == 0) continue;
                    double ds = p[j] * (dp[j] - dsum);
                    int64_t kj = ref_ki(s, b, j, h / g);
                    for (int64_t d = 0; d < s->D; d++) {
                        dv[kj + d] += p[j] * (double)doi[d];
                        dq[ref_qi(s, b, i, h) + d] += scale * ds * (double)k[kj + d];
                        dk[kj + d] += scale * ds * (double)q[ref_qi(s, b, i, h) + d];
                    }
                }
            }
    free(p);
    free(dp);
}

/* |got - want|, where NaN, or an infinity the other side does not match, counts as +inf. */
static inline double ref_err(double got, double want) {
    if (isinf(got) || isinf(want)) return got == want ? 0 : INFINITY;
    return isnan(got - want) ? INFINITY : fabs(got - want);
}

/* Largest ref_err over n values. */
static inline double ref_maxdiff_fd(const float *got, const double *want, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, ref_err(got[i], want[i]));
    return m;
}

static inline double ref_maxdiff_ff(const float *got, const float *want, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, ref_err(got[i], want[i]));
    return m;
}

/* Number of positions where the two float arrays differ bitwise. */
static inline int64_t ref_bitdiff(const float *a, const float *b, int64_t n) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t x, y;
        memcpy(&x, a + i, 4);
        memcpy(&y, b + i, 4);
        c += x != y;
    }
    return c;
}

#endif
