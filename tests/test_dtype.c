/* test_dtype.c - bf16 and fp16 in the CPU layout: the element conversions, and the DKV unpack
   that sums the gradient copies of a shared kv head.

   The reference is written here from the formats' definitions, in fp64:
       bf16  1 sign, 8 exponent (bias 127), 7 mantissa bits; fp16  1, 5 (bias 15), 10;
       exponent 0 is subnormal, all ones is inf (mantissa 0) or NaN.
   Rounding to a format is rint (ties to even) at the format's unit in the last place, and inf
   past its largest finite value. The conversions are checked over every bit pattern and every
   tie, and the DKV sum against fp32 additions in peer order (each one an fp64 sum rounded to
   float, which is exact) rounded once. Which peers hold a kv head, and their token counts, come
   from the plan (uly_kv_heads, uly_tokens), which test_plan checks against formulas of its own:
   this file tests the sums, not the ranges. */
#define ULYSSES_IMPLEMENTATION
#include "../ulysses.h"
#include "check.h"
#include "ref64.h"

#include <float.h>

/* A binary format: significant bits, smallest normal exponent, largest finite value, field
   widths. */
typedef struct fmt {
    const char *name;
    int bits, emin, ebits, mbits;
    double max;
    float (*widen)(uint16_t);
    uint16_t (*round)(float);
} fmt;

static const fmt bf16 = {"bf16", 8, -126, 8, 7, 0x1.fep127, uly__bf16_to_f32, uly__f32_to_bf16};
static const fmt fp16 = {"fp16", 11, -14, 5, 10, 65504.0, uly__f16_to_f32, uly__f32_to_f16};

/* The value of bit pattern h, from its fields. */
static double ref_value(const fmt *f, uint16_t h) {
    int bias = (1 << (f->ebits - 1)) - 1, e = (h >> f->mbits) & ((1 << f->ebits) - 1);
    int m = h & ((1 << f->mbits) - 1);
    double sign = h >> 15 ? -1.0 : 1.0;
    if (e == (1 << f->ebits) - 1) return m ? NAN : sign * INFINITY;
    if (e == 0) return sign * ldexp(m, 1 - bias - f->mbits);
    return sign * ldexp(m + (1 << f->mbits), e - bias - f->mbits);
}

/* x rounded to the format: to nearest, ties to even; inf past the largest finite value. */
static double ref_round(const fmt *f, double x) {
    int e;
    if (isnan(x) || isinf(x)) return x;
    frexp(x, &e); /* |x| in [2^(e-1), 2^e) */
    double ulp = ldexp(1.0, (e - 1 < f->emin ? f->emin : e - 1) - (f->bits - 1));
    double r = rint(x / ulp) * ulp;
    return fabs(r) > f->max ? copysign(INFINITY, x) : r;
}

/* Same value and sign (so -0 is not 0), or both NaN. */
static int same(double a, double b) {
    return (isnan(a) && isnan(b)) || (a == b && signbit(a) == signbit(b));
}

static float f32_of(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* ---------------------------------------------------------------------------------------------
   Conversions */

static void check_widen_all(const fmt *f) {
    for (uint32_t h = 0; h < 65536; h++) {
        float got = f->widen((uint16_t)h);
        CHECK(same(got, ref_value(f, (uint16_t)h)), "%s %#06x widens to %a, want %a", f->name, h,
              got, ref_value(f, (uint16_t)h));
    }
}

static void check_round(const fmt *f, float x) {
    uint16_t got = f->round(x);
    if (isnan(x))
        CHECK(got == 0x7fff, "%s: NaN %#x rounds to %#06x, want the canonical 0x7fff", f->name,
              (unsigned)uly__f32_bits(x), got);
    else
        CHECK(same(ref_value(f, got), ref_round(f, x)), "%s: %a rounds to %#06x (%a), want %a",
              f->name, x, got, ref_value(f, got), ref_round(f, x));
}

/* Around every value v of the format: v, the ties with its neighbours, one fp32 ulp either side
   of each, and some random fp32 values; then the specials. */
static void check_round_all(const fmt *f) {
    static const float special[] = {0.0f,     -0.0f,    INFINITY, -INFINITY, NAN,
                                    -NAN,     FLT_MAX,  -FLT_MAX, FLT_MIN,   0x1p-149f,
                                    0x1p-25f, 0x1p-24f, 0x1p-26f, 65519.99f, 65520.0f,
                                    0x1.ff8p127f, 1e10f, 1.0f};
    for (uint32_t h = 0; h < 65536; h++) {
        double v = ref_value(f, (uint16_t)h), up = ref_value(f, (uint16_t)(h + 1));
        if (isnan(v) || isinf(v)) continue;
        check_round(f, (float)v);
        if (isnan(up)) continue;
        /* past the largest finite value, the tie is half its ulp above it */
        double half = isinf(up) ? copysign(ldexp(1.0, (int)log2(f->max) - f->bits), v)
                                : (up - v) / 2;
        float tie = (float)(v + half);
        check_round(f, tie);
        check_round(f, nextafterf(tie, INFINITY));
        check_round(f, nextafterf(tie, -INFINITY));
    }
    ref_rng r = ref_seed(1);
    for (int i = 0; i < 1000000; i++) check_round(f, f32_of((uint32_t)ref_next(&r)));
    for (size_t i = 0; i < sizeof special / sizeof *special; i++) check_round(f, special[i]);
}

TEST(bf16_widens_every_bit_pattern_exactly) { check_widen_all(&bf16); }
TEST(fp16_widens_every_bit_pattern_exactly_incl_subnormals_inf_nan) { check_widen_all(&fp16); }
TEST(bf16_rounds_to_nearest_even_at_every_tie_and_overflows_to_inf) { check_round_all(&bf16); }
TEST(fp16_rounds_to_nearest_even_at_every_tie_incl_subnormals_and_overflows_to_inf) {
    check_round_all(&fp16);
}

/* ---------------------------------------------------------------------------------------------
   The DKV unpack: every kv head the sum of its copies, in fp32 in peer order, rounded once */

/* P, H, Hkv: which kv heads are shared, and by how many ranks. */
typedef struct dcase {
    int P;
    int64_t H, Hkv;
} dcase;

static const dcase dcases[] = {
    {4, 8, 2}, /* every kv head on two ranks */
    {4, 4, 1}, /* MQA: one kv head on four ranks */
    {3, 6, 2}, /* g = 3: rank 1 holds a copy of both */
    {4, 6, 3}, /* kv heads 0 and 1 on one rank each, 2 on two */
};

/* A random finite value of dtype t, of exponents far enough apart that some fp32 sums round
   (fp16: every finite exponent, subnormals and the largest included). */
static void random_elem(uly_dtype t, ref_rng *r, char *x) {
    uint64_t b = ref_next(r);
    if (t == ULY_F32) {
        float v = ref_uniform(r) * ldexpf(1.0f, (int)(b % 9) - 4);
        memcpy(x, &v, 4);
        return;
    }
    /* any sign and mantissa; bf16: 2^-27 to 2^27 */
    uint16_t h = t == ULY_BF16 ? (uint16_t)((b & 0x807f) | (100 + (b >> 16) % 55) << 7)
                               : (uint16_t)((b & 0x83ff) | ((b >> 16) % 31) << 10);
    memcpy(x, &h, 2);
}

static double elem_value(uly_dtype t, const char *x) {
    uint16_t h;
    float v;
    if (t == ULY_F32) {
        memcpy(&v, x, 4);
        return v;
    }
    memcpy(&h, x, 2);
    return ref_value(t == ULY_BF16 ? &bf16 : &fp16, h);
}

/* Element (b, s, kv head h, e) of the DKV unpack on p's rank: the copies of the peers that hold
   h, added in fp32 in peer order (each addition an fp64 sum rounded to float, which is exact),
   rounded once to the dtype. Peer j's block in recv is [B, S_r, its kv heads, D]. */
static double want_sum(const uly_plan *p, const char *recv, int64_t b, int64_t s, int64_t h,
                       int64_t e) {
    uly_dtype t = p->desc.dtype;
    int64_t B = p->desc.batch, Sr = uly_tokens(p, p->sp_rank).count, D = p->desc.head_dim;
    float acc = 0;
    int copies = 0;
    for (int j = 0; j < p->desc.sp_size; j++) {
        uly_range kv = uly_kv_heads(p, j);
        if (h >= kv.start && h < kv.start + kv.count) {
            int64_t i = ((b * Sr + s) * kv.count + h - kv.start) * D + e;
            double x = elem_value(t, recv + i * p->elem_size);
            acc = copies++ ? (float)((double)acc + x) : (float)x;
        }
        recv += B * Sr * kv.count * D * p->elem_size;
    }
    CHECK(copies > 0, "kv head %lld: no peer holds it", (long long)h);
    return t == ULY_F32 ? acc : ref_round(t == ULY_BF16 ? &bf16 : &fp16, acc);
}

/* Unpack DKV on rank `rank` of case c, of random copies, into a dense dst; compare every
   element. */
static void check_dkv_sum(const dcase *c, int rank, uly_dtype t) {
    const int64_t B = 2, S = 7, D = 5, es = uly_dtype_size(t);
    uly_plan p;
    uly_status st = uly_plan_init(&p, &(uly_plan_desc){
        .world_size = c->P, .rank = rank, .sp_size = c->P, .batch = B, .seq_len = S,
        .n_heads = c->H, .n_kv_heads = c->Hkv, .head_dim = D, .dtype = t});
    CHECK(!st.code, "plan: %s", st.msg);
    if (st.code) return;
    int64_t n = uly_recv_bytes(&p, ULY_X_DKV), Sr = uly_tokens(&p, rank).count;
    char *recv = malloc((size_t)n), *dst = malloc((size_t)(B * Sr * c->Hkv * D * es));
    ref_rng r = ref_seed((uint64_t)(rank + 10 * c->P + 100 * t));
    for (int64_t i = 0; i < n; i += es) random_elem(t, &r, recv + i);
    memset(dst, 0x7f, (size_t)(B * Sr * c->Hkv * D * es));
    uly_layout l = uly_cpu_layout();
    st = l.unpack(l.ctx, &p, ULY_X_DKV, recv, uly_dense(dst, t, B, Sr, c->Hkv, D), NULL);
    CHECK(!st.code, "unpack: %s", st.msg);
    int64_t bad = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < Sr; s++)
            for (int64_t h = 0; h < c->Hkv; h++)
                for (int64_t e = 0; e < D; e++) {
                    double got = elem_value(t, dst + (((b * Sr + s) * c->Hkv + h) * D + e) * es);
                    bad += !same(got, want_sum(&p, recv, b, s, h, e));
                }
    CHECK(bad == 0, "%s, P %d H %lld Hkv %lld rank %d: %lld of %lld elements differ from the "
          "sum in peer order rounded once", uly__dtype_name(t), c->P, (long long)c->H,
          (long long)c->Hkv, rank, (long long)bad, (long long)(B * Sr * c->Hkv * D));
    free(recv);
    free(dst);
}

static void check_dkv_sums(uly_dtype t) {
    for (size_t i = 0; i < sizeof dcases / sizeof *dcases; i++)
        for (int rank = 0; rank < dcases[i].P; rank++) check_dkv_sum(&dcases[i], rank, t);
}

TEST(dkv_unpack_sums_shared_kv_heads_in_f32_in_peer_order) { check_dkv_sums(ULY_F32); }
TEST(dkv_unpack_sums_shared_kv_heads_of_bf16_in_f32_and_rounds_once) { check_dkv_sums(ULY_BF16); }
TEST(dkv_unpack_sums_shared_kv_heads_of_fp16_in_f32_and_rounds_once) { check_dkv_sums(ULY_F16); }

/* 1 + 2^-24 + 2^-24 - 1 in fp32 in that order is 0 (each 2^-24 is half an ulp of 1, a tie kept
   at 1); in any other order, or exactly, it is 2^-23. MQA on four ranks: one copy each. */
TEST(dkv_unpack_adds_in_fp32_in_peer_order_before_it_rounds) {
    static const float f32[4] = {1.0f, 0x1p-24f, 0x1p-24f, -1.0f}; /* the copies, peer order */
    static const uint16_t bits[3][4] = {{0}, {0x3f80, 0x3380, 0x3380, 0xbf80},  /* bf16 */
                                        {0x3c00, 0x0001, 0x0001, 0xbc00}}; /* fp16 */
    for (int t = ULY_F32; t <= ULY_F16; t++) {
        uly_dtype dt = (uly_dtype)t;
        int64_t es = uly_dtype_size(dt), n = 2 * 3 * 4; /* per peer: B 2, S_r 3, D 4 */
        char recv[4 * 2 * 3 * 4 * 4], dst[2 * 3 * 4 * 4];
        uly_plan p;
        uly_status st = uly_plan_init(&p, &(uly_plan_desc){
            .world_size = 4, .rank = 1, .sp_size = 4, .batch = 2, .seq_len = 12, .n_heads = 4,
            .n_kv_heads = 1, .head_dim = 4, .dtype = dt});
        CHECK(!st.code && uly_recv_bytes(&p, ULY_X_DKV) == 4 * n * es, "plan: %s", st.msg);
        for (int j = 0; j < 4; j++)
            for (int64_t i = 0; i < n; i++)
                memcpy(recv + (j * n + i) * es,
                       t == ULY_F32 ? (const void *)&f32[j] : (const void *)&bits[t][j],
                       (size_t)es);
        uly_layout l = uly_cpu_layout();
        st = l.unpack(l.ctx, &p, ULY_X_DKV, recv, uly_dense(dst, dt, 2, 3, 1, 4), NULL);
        CHECK(!st.code, "unpack: %s", st.msg);
        for (int64_t i = 0; i < n; i++)
            CHECK(same(elem_value(dt, dst + i * es), 0.0), "%s: element %lld is %a, want 0",
                  uly__dtype_name(dt), (long long)i, elem_value(dt, dst + i * es));
    }
}

int main(void) { return uly_run_tests(); }
