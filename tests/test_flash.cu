/* test_flash.cu - the flash attention kernels of ulysses_cuda.cuh against two references.

   For every case the inputs are random values already rounded to the dtype, and three things
   are computed from them:
     ref64   attention forward and backward in fp64, from the formulas (ref64.h);
     lowp    the same steps with every intermediate tensor rounded to the dtype, as a plain
             bf16/fp16 attention computes it (S, P, O, dP, dS, dQ, dK, dV);
     cpu     ulysses.h's fp32 reference, uly_cpu_attention.
   The accuracy rule is FlashAttention's own: for each output, the kernel's max error against
   ref64 is at most twice lowp's max error plus 1e-3; the kernel also agrees with cpu within the
   same bound. lse must be within 1e-3 (plus 1e-6 relative) of ref64, and +inf exactly where no
   key is kept.
   Each case's inputs are seeded by the case itself (flash_case.h's case_seed), so a failing case
   has the same data when ULY_TEST_FILTER runs it alone. Two cases are sized by where they run:
   grids_past_the_slice_size and dq_accumulator_past_2_31_elements pass CUDA's grid limits and
   int's on a GPU (6.5 and 26 GB), and run small under the emulator.
   Builds under the CUDA emulator (make test) and with nvcc for a GPU (make test-gpu).
   ULY_TEST_FILTER selects tests by name, e.g. ULY_TEST_FILTER=d128; ULY_FLASH_VERBOSE=1 prints
   every case's errors. Under the emulator main() asks for twice as many threads as the machine
   has, at least 4 (ULY_EMU_THREADS, when set, wins). The harness and the references are in
   flash_case.h. */
#include "emu/cuda_emu.h"
#define ULYSSES_IMPLEMENTATION
/* Under the emulator a grid runs in slices of at most 3 blocks along y and z, as one past CUDA's
   65535 does: every case of more than 3 sequences, blocks or (in the row passes) heads takes
   the sliced launches, and the others one launch. A GPU slices at CUDA's limit, where
   grids_past_the_slice_size passes it. */
#ifdef ULY_EMU
#define ULY__FA_GRID_YZ 3
#endif
#include "../ulysses_cuda.cuh"
#include "check.h"
#include "flash_case.h"

#include <algorithm>
#include <thread>
#ifdef ULY_EMU
#include <sys/mman.h>
#endif

/* ---------------------------------------------------------------------------------------------
   Tests */

/* ref64.h's attention on c's inputs, laid out as reference() lays out its outputs. A slice of
   query heads (0 < q_head0 < kv_group) is, for ref64, the last H of q_head0 + H heads whose
   first q_head0 have q = dout = 0: those add nothing to dK and dV, and their rows are dropped. */
static outputs ref64_of(const fcase &c, const inputs &in) {
    const int64_t pre = c.q_head0, Hg = pre + c.H, D = c.D, rows = c.B * c.Sq;
    const ref_shape s = {c.B, c.Sq, c.Sk, Hg, c.Hkv, D, c.causal, c.scale};
    fvec q((size_t)(rows * Hg * D), 0.f), dout = q;
    for (int64_t i = 0; i < rows * c.H * D; i++) {
        const int64_t g = (i / D / c.H * Hg + pre + i / D % c.H) * D + i % D;
        q[(size_t)g] = in.q[(size_t)i], dout[(size_t)g] = in.dout[(size_t)i];
    }
    dvec o(q.size()), lse((size_t)(rows * Hg)), dq(q.size());
    outputs r;
    r.dk.resize(in.k.size()), r.dv.resize(in.k.size());
    ref64_forward(&s, q.data(), in.k.data(), in.v.data(), o.data(), lse.data());
    ref64_backward(&s, q.data(), in.k.data(), in.v.data(), dout.data(), dq.data(), r.dk.data(),
                   r.dv.data());
    for (int64_t i = 0; i < rows * c.H * D; i++) {
        const int64_t g = (i / D / c.H * Hg + pre + i / D % c.H) * D + i % D;
        r.o.push_back(o[(size_t)g]), r.dq.push_back(dq[(size_t)g]);
    }
    for (int64_t b = 0; b < c.B; b++) /* lse [B, H, Sq] */
        r.lse.insert(r.lse.end(), &lse[(size_t)((b * Hg + pre) * c.Sq)],
                     &lse[(size_t)((b * Hg + Hg) * c.Sq)]);
    return r;
}

/* The fp64 reference of these tests (flash_case.h's reference_seq, which lowp shares) is the
   attention of ref64.h, which test_torch holds to PyTorch: GQA with B > 1, causal with Sq < Sk
   and Sq > Sk (its first rows keep no key: lse +inf, zeros), softmax_scale 0.3 and 1.7, and a
   slice of query heads that splits a kv group. */
TEST(fp64_reference_agrees_with_ref64) {
    const struct {
        shape s;
        float scale;
        int64_t q_head0, kv_group;
    } cases[] = {{{2, 9, 13, 4, 2, 1}, 0, 0, 0},
                 {{1, 13, 5, 2, 1, 1}, 0.3f, 0, 0},
                 {{2, 7, 7, 3, 3, 0}, 1.7f, 0, 0},
                 {{1, 11, 11, 3, 2, 1}, 0, 1, 2}};
    for (const auto &x : cases) {
        fcase c = make_case(x.s, 64, ULY_BF16, x.scale);
        c.q_head0 = x.q_head0, c.kv_group = x.kv_group;
        const inputs in = make_inputs(c, c.B * c.Sq, c.B * c.Sk);
        const std::vector<int> cq = dense_cu(c.B, c.Sq), ck = dense_cu(c.B, c.Sk);
        const outputs got = reference(c, cq, ck, false, in, false), want = ref64_of(c, in);
        for (const field &f : fields)
            CHECK(max_err(got.*f.want, want.*f.want) <= 1e-12, "%s: %s differs from ref64 by %.3g",
                  describe(c).c_str(), f.name, max_err(got.*f.want, want.*f.want));
        CHECK(max_err(got.lse, want.lse) <= 1e-12, "%s: lse differs from ref64 by %.3g",
              describe(c).c_str(), max_err(got.lse, want.lse));
    }
}

static void matrix(uly_dtype dt, int64_t D, int deterministic) {
    for (const matrix_shape &m : shapes) {
        fcase c = make_case(m.s, D, dt, m.scale);
        c.deterministic = deterministic;
        check_case(c);
    }
}

static int nonfinite_outputs(const run_out &r) {
    int bad = 0;
    for (const field &f : fields)
        for (float x : r.*f.got) bad += !std::isfinite(x);
    return bad;
}

TEST(matrix_bf16_d64) { matrix(ULY_BF16, 64, 0); }
TEST(matrix_bf16_d128) { matrix(ULY_BF16, 128, 0); }
TEST(matrix_f16_d64) { matrix(ULY_F16, 64, 0); }
TEST(matrix_f16_d128) { matrix(ULY_F16, 128, 0); }

/* Deterministic mode computes dQ with its own kernel (uly__flash_bwd_q) instead of atomics: the
   same matrix, causal and not. The other two dtype and head dim pairs are in
   deterministic_is_bitwise_stable and varlen_documents. */
TEST(matrix_deterministic_bf16_d128) { matrix(ULY_BF16, 128, 1); }
TEST(matrix_deterministic_f16_d64) { matrix(ULY_F16, 64, 1); }

/* Length 1000 (8 query blocks, a tail of 104) for a few configurations. */
TEST(long_1000_bf16_d128_causal) { check_case(make_case({1, 1000, 1000, 1, 1, 1}, 128, ULY_BF16)); }
TEST(long_1000_f16_d64) { check_case(make_case({1, 1000, 1000, 2, 1, 0}, 64, ULY_F16)); }
TEST(long_1000_bf16_d64_causal_sq_lt_sk) {
    check_case(make_case({1, 300, 1000, 1, 1, 1}, 64, ULY_BF16));
}

/* Padded heads, rows and batches: every stride differs from the dense one. The padding holds NaN
   going in, and run_attn checks that no kernel wrote it. */
TEST(strided_inputs) {
    for (int64_t D : {64, 128})
        for (uly_dtype dt : {ULY_BF16, ULY_F16}) {
            fcase c = make_case({2, 129, 65, 4, 2, 1}, D, dt);
            c.strided = 1;
            check_case(c);
        }
}

/* flash_case.h's extent_1_cases: the calls run and meet the accuracy rule. */
TEST(any_stride_on_dims_of_extent_1) {
    for (const fcase &c : extent_1_cases()) check_case(c);
}

/* q and k uniform in [-4, 4): logits of standard deviation 16 / 3, so a row's running maximum
   moves by several units between key tiles (300 keys: five forward tiles) and the online softmax
   rescales what it has by factors far from 1. The accuracy rule as everywhere. */
TEST(moderate_logits_rescale_between_tiles) {
    for (uly_dtype dt : {ULY_BF16, ULY_F16}) {
        fcase c = make_case({1, 130, 300, 1, 1, dt == ULY_BF16}, dt == ULY_BF16 ? 64 : 128, dt);
        c.magnitude = 4;
        check_case(c);
    }
}

/* Causal tiles whose last key is one past the diagonal at their first row (Sk - Sq = BN - 2: 62
   for the 64-key blocks, 126 for the 128-key ones) come closest to needing no mask, and still
   need it. That key, Sk - Sq + 1, is made 4 q_0, the key row 0 would attend to most, so letting
   it through changes row 0 entirely. Both dQ paths. */
TEST(causal_mask_edge_one_key_past_the_diagonal) {
    for (int64_t D : {64, 128})
        for (int64_t Sk : {126, 190})
            for (int deterministic : {0, 1}) {
                fcase c = make_case({1, 64, Sk, 1, 1, 1}, D, ULY_BF16);
                c.deterministic = deterministic;
                inputs in = make_inputs(c, c.Sq, c.Sk);
                const int64_t needle = Sk - c.Sq + 1;
                for (int64_t d = 0; d < D; d++)
                    in.k[(size_t)(needle * D + d)] = 4 * in.q[(size_t)d];
                check_inputs(c, in);
            }
}

/* An SP rank holding global query heads 1..3 of groups of 2: local heads 0 | 1, 2 read local kv
   heads 0 | 1, so one group is split across ranks. */
TEST(gqa_group_split_across_ranks) {
    for (int64_t D : {64, 128}) {
        fcase c = make_case({1, 65, 65, 3, 2, 1}, D, ULY_BF16);
        c.q_head0 = 1, c.kv_group = 2;
        check_case(c);
    }
}

/* A rank whose one query head (global head 0, of groups of 2^32) reads kv head 0 of 2: kv head
   1, read by no local head, gets dK = dV = 0 exactly. (Its head range was cut to 32 bits once,
   which made it 1 head and read query head 2^32.) */
TEST(a_kv_head_no_local_query_head_reads_gets_zero_gradients) {
    for (int deterministic : {0, 1}) {
        fcase c = make_case({1, 65, 65, 1, 2, 1}, 64, ULY_BF16);
        c.kv_group = (int64_t)1 << 32, c.deterministic = deterministic;
        const run_out r = check_case(c);
        if (!r.ok) continue;
        int nonzero = 0; /* dk, dv [1, 65, 2, 64]: kv head 1 is the second half of each row */
        for (size_t row = 0; row < 65; row++)
            for (size_t e = 64; e < 128; e++)
                nonzero += r.dk[row * 128 + e] != 0 || r.dv[row * 128 + e] != 0;
        CHECK(nonzero == 0, "deterministic=%d: %d dK, dV values of kv head 1 are not 0",
              deterministic, nonzero);
    }
}

/* Sq > Sk, causal: rows 0 .. Sq - Sk - 1 keep no key. */
TEST(fully_masked_rows_are_zero_with_inf_lse) {
    for (int deterministic : {0, 1}) {
        fcase c = make_case({1, 150, 20, 2, 1, 1}, 64, ULY_BF16);
        c.deterministic = deterministic;
        const run_out r = check_case(c);
        if (!r.ok) continue;
        const int bad = masked_rows_wrong(c, r, row_range(0, c.Sq - c.Sk));
        CHECK(bad == 0, "deterministic=%d: %d values of fully masked rows are not 0 (lse +inf)",
              deterministic, bad);
        CHECK(nonfinite_outputs(r) == 0, "deterministic=%d: %d outputs are NaN or inf",
              deterministic, nonfinite_outputs(r));
    }
}

/* Logits up to +-1e4 that differ between the keys of a row by a few units only, so the softmax
   is not one-hot and every output and gradient is O(1) or more. Every key is K0 = 48 in each
   channel plus x, -x in pairs of channels (48 +- x stays in [32, 64], exact in both dtypes), so
   every key's channel sum is D * K0; each channel of query row i is a_i, of either sign, plus a
   value in [-3, 3). The logits of row i all gain a_i * D * K0 * scale (up to +-1e4), which the
   softmax does not see; what differs between keys is scale * q_i . x_j, a few units.
   bf16 and fp16 space values near 1e4 by 64 and 8, so the plain reference, which rounds S to the
   dtype, is no bound here. The kernels keep S in fp32: each score is summed over D / 16 <= 8 MMA
   steps, each rounding at up to its magnitude, so it is off by at most 4 fp32 ulps (8 where
   the hardware truncates). The bound is the accuracy rule against a reference that rounds S to
   20 significant bits (off by up to 8 ulps) and every other step to the dtype. A wrong running
   maximum or rescale, an overflow, or a dS that loses the offset is off by O(1). */
static double to_20_bits(uly_dtype, double x) {
    if (x == 0 || !std::isfinite(x)) return x;
    const int e = std::ilogb(x) - 19;
    return std::ldexp(std::nearbyint(std::ldexp(x, -e)), e);
}

/* Inputs of c with row offsets reaching `logit` in the logits, as above. */
static inputs offset_inputs(const fcase &c, double logit) {
    inputs in = make_inputs(c, c.B * c.Sq, c.B * c.Sk);
    const double K0 = 48, a = logit / (c.D * K0 * softmax_scale(c));
    ref_rng r = ref_seed(case_seed(c) + 1);
    for (size_t j = 0; j < in.k.size(); j += 2) {
        const float x = round_to(c.dt, K0 + in.k[j]);
        in.k[j] = x, in.k[j + 1] = (float)(2 * K0 - x);
    }
    for (size_t row = 0; row < in.q.size() / c.D; row++) {
        const double u = ref_uniform(&r), ai = (u < 0 ? -a : a) * (0.5 + 0.5 * fabs(u));
        for (int64_t d = 0; d < c.D; d++) {
            float &x = in.q[row * c.D + d];
            x = round_to(c.dt, ai + x);
        }
    }
    return in;
}

TEST(large_logits_keep_fp32_accuracy) {
    const rounding fp32_scores = {to_20_bits, rounded};
    for (uly_dtype dt : {ULY_BF16, ULY_F16})
        for (int causal : {0, 1}) {
            fcase c = make_case({1, 130, 130, 1, 1, causal}, dt == ULY_BF16 ? 64 : 128, dt);
            c.magnitude = 3;
            const inputs in = offset_inputs(c, 1e4);
            const std::vector<int> cq = dense_cu(1, c.Sq), ck = dense_cu(1, c.Sk);
            const run_out r = run_attn(c, cq, ck, false, in, uly_flash_attention());
            if (!r.ok) continue;
            CHECK(nonfinite_outputs(r) == 0, "%s: %d outputs are not finite", describe(c).c_str(),
                  nonfinite_outputs(r));
            check_outputs(c, r, reference(c, cq, ck, false, in, false),
                          reference_with(c, cq, ck, false, in, fp32_scores), NULL);
        }
}

/* Deterministic mode: three runs give bitwise-identical outputs, where an atomic dQ would not.
   Sk = 520 is five key blocks of the backward kernel (BN = 128), each adding its part of every
   query row's dQ. main() gives the emulator more threads than the machine has cores, so blocks of
   the same rows run at once and are preempted at unpredictable points: an atomic accumulator
   takes the parts in a different order from run to run (from zero, the first two adds commute;
   the later ones do not). The keys share an offset of 64: that moves every logit of a row by the
   same amount, so the softmax does not change, but it adds 64 times a key block's sum of dS to
   that block's part of dQ, and those sums cancel over the row; so a change of order changes the
   rounded dq, not only fp32 bits that rounding to the dtype hides.
   The control reruns the atomic dQ on the same inputs: it must change at least once, or this
   test could not see a change of order. It is checked only with more emulator threads than
   hardware threads: with one thread per core the blocks can keep one order for many runs
   (ULY_EMU_THREADS=2 on 2 cores: the causal case mostly does, both cases did in 1 of 10). */
static run_out run_dense(const fcase &c, const inputs &in) {
    return run_attn(c, dense_cu(c.B, c.Sq), dense_cu(c.B, c.Sk), false, in, uly_flash_attention());
}

static bool same_bits(const fvec &a, const fvec &b) {
    return a.size() == b.size() && memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

TEST(deterministic_is_bitwise_stable) {
    const struct {
        shape s;
        int64_t D;
        uly_dtype dt;
    } runs[] = {{{1, 130, 520, 4, 2, 1}, 64, ULY_BF16}, {{1, 64, 520, 4, 2, 0}, 128, ULY_F16}};
    bool atomic_changed = false;
    for (const auto &x : runs) {
        fcase c = make_case(x.s, x.D, x.dt);
        c.deterministic = 1;
        inputs in = make_inputs(c, c.B * c.Sq, c.B * c.Sk);
        for (float &k : in.k) k = round_to(c.dt, k + 64);
        const std::vector<int> cq = dense_cu(c.B, c.Sq), ck = dense_cu(c.B, c.Sk);
        const run_out first = run_dense(c, in);
        if (!first.ok) continue;
        check_outputs(c, first, reference(c, cq, ck, false, in, false),
                      reference(c, cq, ck, false, in, true), NULL);
        for (int run = 1; run < 3; run++) {
            const run_out again = run_dense(c, in);
            for (const field &f : fields)
                CHECK(same_bits(again.*f.got, first.*f.got),
                      "%s run %d: %s differs bitwise from run 0", describe(c).c_str(), run, f.name);
            CHECK(same_bits(again.lse, first.lse), "%s run %d: lse differs bitwise from run 0",
                  describe(c).c_str(), run);
        }
        if (atomic_changed) continue;
        c.deterministic = 0;
        const run_out atomic0 = run_dense(c, in);
        for (int run = 1; run < 5 && !atomic_changed; run++)
            atomic_changed = !same_bits(run_dense(c, in).dq, atomic0.dq);
    }
#ifdef ULY_EMU
    const char *threads = getenv("ULY_EMU_THREADS");
    CHECK(atomic_changed || !threads || atoi(threads) <= (int)std::thread::hardware_concurrency(),
          "the atomic dQ gave the same bits in every rerun: this test cannot see a change of "
          "summation order");
#endif
}

#ifdef ULY_EMU
/* The whole grid g as ULY__FA_GRID_YZ = 3 slices it: at most 3 blocks along y and z, z outer and
   y inner, the order in which one grid would start its blocks. */
static std::vector<dim3> slices_of(dim3 g) {
    std::vector<dim3> out;
    for (unsigned z = 0; z < g.z; z += 3)
        for (unsigned y = 0; y < g.y; y += 3)
            out.push_back(dim3(g.x, std::min(3u, g.y - y), std::min(3u, g.z - z)));
    return out;
}

/* The flash grids are (heads, sequences, blocks), so blocks start position by position across
   every head and sequence, longest first (ulysses_cuda.cuh, above uly__fa_query_block); the row
   passes' are (rows, heads, sequences). Each goes in slices (slices_of). B = 4, H = 4 over
   Hkv = 2, 200 rows: 2 forward and dK/dV blocks of 128 rows, 4 dQ blocks of 64, 50 row-pass
   blocks of 4 rows. check_case holds every output to the references, so each slice worked on
   its own part of the grid. */
TEST(flash_grids_are_heads_sequences_blocks_in_slices) {
    typedef __nv_bfloat16 T;
    for (int det : {0, 1}) {
        fcase c = make_case({4, 200, 200, 4, 2, 1}, 64, ULY_BF16);
        c.deterministic = det;
        uly_emu_record_reset();
        check_case(c);
        const void *kv = det ? (const void *)uly__flash_bwd_kv<T, 64, false>
                             : (const void *)uly__flash_bwd_kv<T, 64, true>;
        const struct {
            const char *name;
            const void *kernel;
            dim3 whole;
            bool runs;
        } grids[] = {{"forward", (const void *)uly__flash_fwd<T, 64>, dim3(4, 4, 2), true},
                     {"dK/dV", kv, dim3(2, 4, 2), true},
                     {"dQ", (const void *)uly__flash_bwd_q<T, 64>, dim3(4, 4, 4), det == 1},
                     {"Dsum", (const void *)uly__flash_bwd_pre<T>, dim3(50, 4, 4), true},
                     {"dQ's conversion", (const void *)uly__flash_bwd_post<T>, dim3(50, 4, 4),
                      det == 0}};
        for (const auto &g : grids) {
            const std::vector<dim3> want = slices_of(g.whole);
            size_t n = 0, wrong = 0;
            for (const uly_emu_op &op : uly_emu_recorded_ops()) {
                if (op.kernel != g.kernel) continue;
                const dim3 &w = want[n++ % want.size()];
                wrong += op.grid.x != w.x || op.grid.y != w.y || op.grid.z != w.z;
            }
            CHECK(g.runs ? n > 0 && n % want.size() == 0 && !wrong : n == 0,
                  "deterministic=%d, %s: %zu launches, %zu not the slice due, want %s of %zu "
                  "slices", det, g.name, n, wrong, g.runs ? "runs" : "none", want.size());
        }
    }
}
#endif

#ifdef ULY_EMU
/* Every ldmatrix of every kernel (forward; backward with atomic and with deterministic dQ) reads
   each 8 x 8 matrix in one shared-memory wavefront: the tiles' swizzle leaves no bank conflict. */
TEST(ldmatrix_reads_have_no_bank_conflicts) {
    for (int64_t D : {64, 128})
        for (int det : {0, 1}) {
            fcase c = make_case({1, 130, 130, 2, 1, 1}, D, ULY_BF16);
            c.deterministic = det;
            const unsigned long long before = uly_emu_ldmatrix_conflicts();
            check_case(c);
            const unsigned long long extra = uly_emu_ldmatrix_conflicts() - before;
            CHECK(extra == 0, "D=%lld deterministic=%d: %llu extra ldmatrix wavefronts",
                  (long long)D, det, extra);
        }
}
#endif

#ifdef ULY_EMU
/* The forward and backward of c on tensors in one sparse mapping far larger than what they
   touch (device memory is host memory under the emulator): token rows ss elements apart, heads
   sh, each tensor at its own offset in a row; checked as check_case checks. */
static void check_sparse(const fcase &c, int64_t ss, int64_t sh) {
    const size_t bytes = (size_t)(c.B * c.Sq * ss) * 2;
    void *map = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    CHECK(map != MAP_FAILED, "mmap of %zu bytes", bytes);
    if (map == MAP_FAILED) return;
    uint16_t *mem = (uint16_t *)map;
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    uly_tensor *const t[8] = {&a.q, &a.k, &a.v, &a.dout, &a.o, &a.dq, &a.dk, &a.dv};
    for (int i = 0; i < 8; i++) {
        const bool kv = t[i] == &a.k || t[i] == &a.v || t[i] == &a.dk || t[i] == &a.dv;
        *t[i] = uly_dense(mem + i * c.D, c.dt, c.B, c.Sq, kv ? c.Hkv : c.H, c.D);
        t[i]->sh = sh, t[i]->ss = ss, t[i]->sb = c.Sq * ss;
    }
    const inputs in = make_inputs(c, c.B * c.Sq, c.B * c.Sk);
    const std::pair<const uly_tensor *, const fvec *> ins[4] = {
        {&a.q, &in.q}, {&a.k, &in.k}, {&a.v, &in.v}, {&a.dout, &in.dout}};
    for (const auto &x : ins) put_rows((uint16_t *)x.first->data, *x.first, *x.second);
    const std::vector<int> cu = dense_cu(c.B, c.Sq);
    run_out got;
    got.ok = run_kernels(c, cu, cu, false, uly_flash_attention(), a, &got.lse);
    const std::pair<const uly_tensor *, fvec *> outs[4] = {
        {&a.o, &got.o}, {&a.dq, &got.dq}, {&a.dk, &got.dk}, {&a.dv, &got.dv}};
    for (const auto &x : outs) *x.second = get_rows((const uint16_t *)x.first->data, *x.first);
    if (got.ok) {
        const outputs cpu = run_cpu(c, in);
        check_outputs(c, got, reference(c, cu, cu, false, in, false),
                      reference(c, cu, cu, false, in, true), &cpu);
    }
    munmap(map, bytes);
}

/* 64-bit offsets: 1M tokens x 32 heads x 128 dims is 2^32 elements, so offsets past int32 are
   the everyday case. Token rows 2^25 elements apart, heads 2^23: 65 tokens span 2^31 + 2^25
   elements and batch 1 begins there; a row offset computed in 32 bits reads or writes the wrong
   row. */
TEST(offsets_past_int32) {
    for (int deterministic : {0, 1}) {
        fcase c = make_case({2, 65, 65, 2, 1, 1}, 128, ULY_BF16);
        c.deterministic = deterministic;
        check_sparse(c, int64_t(1) << 25, int64_t(1) << 23);
    }
}

/* The same with Sq = Sk = 130 and rows 2^27 elements apart. Three forward key blocks (BN = 64):
   the forward loads key block 1, 64 rows = 2^33 elements in, while it works on block 2, and one
   16-row round of a tile's cp.async (D = 64: 128 threads of 8 chunks a row) steps 2^31 elements.
   offsets_past_int32 reaches neither (its 65 keys are two key blocks, its D = 128 rounds are 8
   rows of 2^25). H = 1, so sh is never applied. */
TEST(offsets_past_int32_in_later_key_blocks_and_tile_rounds) {
    for (int deterministic : {0, 1}) {
        fcase c = make_case({1, 130, 130, 1, 1, 0}, 64, ULY_BF16);
        c.deterministic = deterministic;
        check_sparse(c, int64_t(1) << 27, 1);
    }
}
#endif

/* Packed documents: lengths 1 and several tiles, Sq != Sk per document, causal within each, a
   document of keys only (0, 23: its dK and dV are 0), one with more queries than keys (150, 20:
   under a causal mask its first 130 rows keep no key) and one with no keys at all (18, 0). Rows
   that keep no key are 0 with lse = +inf, as in a dense batch. Each dtype, head dim, mask, dQ
   mode and layout (dense, padded) is in two of the four configurations. */
TEST(varlen_documents) {
    const std::vector<int> cq = {0, 1, 131, 195, 212, 212, 362, 380};
    const std::vector<int> ck = {0, 1, 131, 260, 277, 300, 320, 320};
    const struct {
        int64_t D;
        uly_dtype dt;
        int causal, deterministic, strided;
    } runs[] = {{64, ULY_BF16, 0, 0, 0}, {64, ULY_F16, 1, 1, 1}, {128, ULY_BF16, 1, 0, 1},
                {128, ULY_F16, 0, 1, 0}};
    for (const auto &x : runs) {
        fcase c = make_case({1, cq.back(), ck.back(), 4, 2, x.causal}, x.D, x.dt);
        c.deterministic = x.deterministic, c.strided = x.strided;
        const inputs in = make_inputs(c, cq.back(), ck.back());
        const run_out got = run_attn(c, cq, ck, true, in, uly_flash_attention());
        if (!got.ok) continue;
        check_outputs(c, got, reference(c, cq, ck, true, in, false),
                      reference(c, cq, ck, true, in, true), NULL);
        std::vector<int64_t> masked = row_range(cq[6], cq[7]); /* no keys */
        if (x.causal)
            for (int64_t i : row_range(cq[5], cq[6] - (ck[6] - ck[5]))) masked.push_back(i);
        const int bad = masked_rows_wrong(c, got, masked);
        CHECK(bad == 0, "%s: %d values of rows that keep no key are not 0 (lse +inf)",
              describe(c).c_str(), bad);
        int unseen = 0; /* keys of the keys-only document: no query sees them */
        for (int64_t e = ck[4] * c.Hkv * c.D; e < ck[5] * c.Hkv * c.D; e++)
            unseen += got.dk[(size_t)e] != 0 || got.dv[(size_t)e] != 0;
        CHECK(unseen == 0, "%s: %d dK, dV values of keys no query sees are not 0",
              describe(c).c_str(), unseen);
        CHECK(nonfinite_outputs(got) == 0, "%s: %d outputs are NaN or inf", describe(c).c_str(),
              nonfinite_outputs(got));
    }
}

/* cu_seqlens that break uly_varlen's rules stop the call. On a GPU a trap ends the CUDA context,
   so each test traps once and make test-gpu runs each in a process of its own (FLASH_TRAPS in
   the Makefile); the emulator's failures are not sticky. */

/* A varlen forward, or backward, of documents cu_q and cu_k over tensors of nq and nk rows with
   max_seqlen max_q and max_k: the call or the next sync fails, and under the emulator the check
   kernel is what trapped, before any flash kernel wrote an output. */
static void expect_trap(const std::vector<int> &cu_q, const std::vector<int> &cu_k, int64_t nq,
                        int64_t nk, int64_t max_q, int64_t max_k, bool backward) {
    const int64_t H = 2, D = 64;
    dev_tensor x[8];
    for (int i = 0; i < 8; i++) /* q k v o, dout dk dv dq: keys' rows at 1, 2, 5 and 6 */
        x[i] = dev_alloc(ULY_BF16, 1, i % 4 == 1 || i % 4 == 2 ? nk : nq, H, D, 0);
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = x[0].t, a.k = x[1].t, a.v = x[2].t, a.o = x[3].t;
    a.dout = x[4].t, a.dk = x[5].t, a.dv = x[6].t, a.dq = x[7].t;
    cudaMalloc((void **)&a.lse, (size_t)(H * nq * 4));
    const uly_attn fa = uly_flash_attention();
    a.workspace_bytes = std::max<int64_t>(16, fa.workspace(fa.ctx, &a));
    cudaMalloc(&a.workspace, (size_t)a.workspace_bytes);
    int32_t *cu = NULL;
    uly_varlen vl = varlen_on_device(cu_q, cu_k, &cu);
    vl.max_seqlen_q = max_q, vl.max_seqlen_k = max_k;
#ifdef ULY_EMU
    uly_emu_set_quiet(true);
#endif
    printf("     (a kernel message below is expected)\n");
    fflush(stdout);
    const uly_status st = backward ? uly_flash_varlen_bwd(&a, &vl) : uly_flash_varlen_fwd(&a, &vl);
    const cudaError_t e = cudaDeviceSynchronize();
    CHECK(st.code != ULY_OK || e != cudaSuccess, "%s ran: %s, sync: %s",
          backward ? "backward" : "forward", st.msg, cudaGetErrorString(e));
#ifdef ULY_EMU
    uly_emu_set_quiet(false);
    const std::string why = uly_emu_last_failure();
    CHECK(why.find("uly__fa_check_docs") != std::string::npos &&
              why.find("__trap") != std::string::npos,
          "not the cu_seqlens check's trap: %s", why.c_str());
    const char *names[8] = {"q", "k", "v", "o", "dout", "dk", "dv", "dq"};
    for (int i = 0; i < 8; i++) {
        std::vector<uint16_t> bits((size_t)x[i].elems);
        cudaMemcpy(bits.data(), x[i].t.data, bits.size() * 2, cudaMemcpyDeviceToHost);
        CHECK(std::count(bits.begin(), bits.end(), pad_bits) == x[i].elems, "%s was written",
              names[i]);
    }
#endif
    for (int i = 0; i < 8; i++) cudaFree(x[i].t.data);
    cudaFree(a.lse), cudaFree(a.workspace), cudaFree(cu);
}

/* Documents of 40 and 30 rows, in tensors of 70: each rule broken once. */
TEST(traps_on_cu_seqlens_decreasing) {
    expect_trap({0, 40, 30, 70}, {0, 40, 70, 70}, 70, 70, 40, 40, false);
}
TEST(traps_on_cu_seqlens_not_from_0) {
    expect_trap({0, 40, 70}, {5, 40, 70}, 70, 70, 40, 40, false);
}
TEST(traps_on_cu_seqlens_short_of_rows) {
    expect_trap({0, 40, 60}, {0, 40, 70}, 70, 70, 40, 40, false);
}
TEST(traps_on_cu_seqlens_past_rows) {
    expect_trap({0, 40, 70}, {0, 40, 80}, 70, 70, 40, 40, false);
}
TEST(traps_on_cu_seqlens_over_max) {
    expect_trap({0, 40, 70}, {0, 40, 70}, 70, 70, 39, 40, false);
}
TEST(traps_on_cu_seqlens_backward) {
    expect_trap({0, 40, 70}, {0, 30, 70}, 70, 70, 40, 30, true);
}

/* What the kernels do not take is a named error, not a wrong answer. */
TEST(rejects_what_the_kernels_do_not_take) {
    alignas(16) static uint16_t buf[4 * 96 + 8];
    float lse[4];
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = a.k = a.v = a.o = uly_dense(buf, ULY_BF16, 1, 4, 1, 96);
    a.lse = lse;
    const uly_attn fa = uly_flash_attention();
    uly_status st = fa.fwd(fa.ctx, &a);
    CHECK(st.code == ULY_EUNSUPPORTED && strstr(st.msg, "q.d"), "D = 96: %s", st.msg);
    a.q = a.k = a.v = a.o = uly_dense(buf, ULY_F32, 1, 2, 1, 64);
    st = fa.fwd(fa.ctx, &a);
    CHECK(st.code == ULY_EUNSUPPORTED && strstr(st.msg, "f32"), "fp32: %s", st.msg);
    a.q = a.k = a.v = a.o = uly_dense(buf + 1, ULY_BF16, 1, 4, 1, 64);
    st = fa.fwd(fa.ctx, &a);
    CHECK(st.code == ULY_EUNSUPPORTED && strstr(st.msg, "16-byte"), "misaligned: %s", st.msg);
}

/* Arguments every flash call takes: eight padded bf16 tensors of one shape [B, S, H, D] (q, k,
   v, o, dout, dq, dk, dv; strides multiples of 8), lse, and the backward's workspace, on the
   device. The misuse tests break one thing each; the checks come before any kernel reads
   memory. D is 64 unless given. */
typedef struct flash_args {
    uly_attn_args a;
    dev_tensor x[8];
} flash_args;

/* bf16 tensors of Sq query rows and Sk key rows (dev_alloc's pad: NaN outside the views, and
   in them until written), lse and the workspace, on the device. */
static flash_args alloc_args(int64_t B, int64_t Sq, int64_t Sk, int64_t H, int64_t D, int pad) {
    flash_args f;
    memset(&f, 0, sizeof f);
    uly_tensor *const t[8] = {&f.a.q, &f.a.k, &f.a.v, &f.a.o, &f.a.dout, &f.a.dq, &f.a.dk, &f.a.dv};
    for (int i = 0; i < 8; i++) {
        const bool kv = i == 1 || i == 2 || i == 6 || i == 7;
        f.x[i] = dev_alloc(ULY_BF16, B, kv ? Sk : Sq, H, D, pad), *t[i] = f.x[i].t;
    }
    cudaMalloc((void **)&f.a.lse, (size_t)(B * H * Sq * 4));
    const uly_attn fa = uly_flash_attention();
    f.a.workspace_bytes = fa.workspace(fa.ctx, &f.a);
    cudaMalloc(&f.a.workspace, (size_t)f.a.workspace_bytes);
    return f;
}

static flash_args valid_args(int64_t B, int64_t S, int64_t H, int64_t D = 64) {
    return alloc_args(B, S, S, H, D, 1);
}

static void free_args(flash_args &f) {
    for (dev_tensor &x : f.x) cudaFree(x.t.data);
    cudaFree(f.a.lse), cudaFree(f.a.workspace);
}

/* st is code, its message naming what; else a failed check that says what was called. */
static void expect_status(uly_status st, uly_code code, const char *what, const char *call) {
    CHECK(st.code == code && strstr(st.msg, what), "%s: status %d '%s', want %d naming '%s'",
          call, (int)st.code, st.msg, (int)code, what);
}

/* The misuse tests' arguments are good as they stand: each rejection is the broken field's. */
TEST(misuse_tests_start_from_args_that_run) {
    flash_args f = valid_args(2, 16, 2);
    const uly_attn fa = uly_flash_attention();
    expect_status(fa.fwd(fa.ctx, &f.a), ULY_OK, "", "forward");
    expect_status(fa.bwd(fa.ctx, &f.a), ULY_OK, "", "backward");
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "kernels ran");
    free_args(f);
}

/* The kernels take a positive scale (0: 1/sqrt(D)); a negative one is refused, not run. */
/* The softmax runs in log2 units: a scale whose product with log2(e) overflows a float would
   turn every row into NaN (0 x inf), so it is refused; one just below is taken. */
TEST(rejects_a_negative_softmax_scale_or_one_that_overflows_in_log2_units) {
    flash_args f = valid_args(2, 16, 2);
    const uly_attn fa = uly_flash_attention();
    for (float scale : {-0.5f, 3e38f}) {
        f.a.softmax_scale = scale;
        expect_status(fa.fwd(fa.ctx, &f.a), ULY_EUNSUPPORTED, "softmax_scale", "forward");
        expect_status(fa.bwd(fa.ctx, &f.a), ULY_EUNSUPPORTED, "softmax_scale", "backward");
    }
    f.a.softmax_scale = 2e38f;
    const uly_status st = fa.check(fa.ctx, &f.a, 1);
    CHECK(!st.code, "softmax_scale 2e38: '%s'", st.msg);
    free_args(f);
}

/* The backward keeps Dsum and the fp32 dQ accumulator in the workspace, which must be there,
   16-byte aligned and as big as workspace() says for these args; the forward uses none. A
   workspace sized in deterministic mode has no room for the accumulator the other mode adds. */
TEST(backward_rejects_a_null_misaligned_or_short_workspace) {
    flash_args f = valid_args(2, 16, 2);
    const uly_attn fa = uly_flash_attention();
    void *const ws = f.a.workspace;
    const int64_t bytes = f.a.workspace_bytes;
    f.a.workspace = NULL;
    expect_status(fa.bwd(fa.ctx, &f.a), ULY_EINVAL, "workspace", "backward, NULL workspace");
    expect_status(fa.fwd(fa.ctx, &f.a), ULY_OK, "", "forward, NULL workspace");
    f.a.workspace = (char *)ws + 8;
    expect_status(fa.bwd(fa.ctx, &f.a), ULY_EINVAL, "16-byte", "backward, workspace + 8 bytes");
    f.a.workspace = ws, f.a.workspace_bytes = bytes - 1;
    expect_status(fa.bwd(fa.ctx, &f.a), ULY_EINVAL, "workspace_bytes", "backward, a byte short");
    f.a.deterministic = 1, f.a.workspace_bytes = fa.workspace(fa.ctx, &f.a);
    f.a.deterministic = 0;
    CHECK(f.a.workspace_bytes < bytes, "deterministic size %lld, atomic %lld",
          (long long)f.a.workspace_bytes, (long long)bytes);
    expect_status(fa.bwd(fa.ctx, &f.a), ULY_EINVAL, "workspace_bytes",
                  "backward, sized for deterministic mode");
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "kernels ran");
    free_args(f);
}

/* Grids past the slice size n = ULY__FA_GRID_YZ along y and z: n + 2 sequences of one row, then
   one sequence of n * 128 + 1 rows (the forward's and dQ's blocks); each over one key, in both
   dQ modes. Under the emulator n is 3; on a GPU it is CUDA's 65535, so there the sizes are
   65537 sequences and 8388481 rows (1 GB a tensor), past what one grid holds. With one key the
   softmax is exactly 1: out is v's row bit for bit, lse is scale q.k, dv is the sum of dout over
   the rows (bit for bit over one row), and dq and dk are 0 but for the rounding of dP - Dsum,
   two fp32 sums of the same products (P is recomputed from lse). The inputs are bf16 bits from a
   hash, and the checks read bits (through a table where they need values): fvec's conversions
   would take the 8388481 rows a minute. */
__host__ __device__ static uint16_t one_key_bits(uint64_t i, uint64_t stream) { /* +-[0.5, 1) */
    uint64_t h = (i * 4 + stream + 1) * 0x9E3779B97F4A7C15ull;
    h = (h ^ h >> 31) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    return (uint16_t)(0x3F00 | (h & 0x7F) | (h >> 7 & 1) << 15);
}

/* The value of every bf16 bit pattern. */
static fvec bf16_values(void) {
    fvec value(65536);
    for (uint32_t x = 0; x < 65536; x++) value[x] = from_bits(ULY_BF16, (uint16_t)x);
    return value;
}

/* Forward, then backward, of f's args; both ran and the device is done. */
static void run_both(flash_args &f, const char *what) {
    const uly_attn fa = uly_flash_attention();
    uly_status st = fa.fwd(fa.ctx, &f.a);
    if (!st.code) st = fa.bwd(fa.ctx, &f.a);
    CHECK(!st.code && cudaDeviceSynchronize() == cudaSuccess, "%s: '%s'", what, st.msg);
}

static void one_key_case(int64_t B, int64_t S) {
    typedef std::vector<uint16_t> bits;
    const int64_t D = 64, rows = B * S, n[8] = {rows, B, B, rows, rows, rows, B, B};
    const double scale = 1 / sqrt((double)D);
    const fvec value = bf16_values();
    flash_args f = alloc_args(B, S, 1, 1, D, 0);
    bits in[8]; /* q k v o dout dq dk dv, rows of D */
    for (int t = 0; t < 8; t++) {
        in[t].resize((size_t)(n[t] * D));
        if (t < 3 || t == 4) {
            for (size_t e = 0; e < in[t].size(); e++) in[t][e] = one_key_bits(e, (uint64_t)t);
            cudaMemcpy(f.x[t].t.data, in[t].data(), in[t].size() * 2, cudaMemcpyHostToDevice);
        }
    }
    const bits &q = in[0], &k = in[1], &v = in[2], &dout = in[4];
    dvec dot((size_t)rows, 0.0), sum((size_t)(B * D), 0.0); /* q.k of each row, dout's sums */
    for (int64_t e = 0; e < rows * D; e++) {
        const size_t kv = (size_t)(e / D / S * D + e % D);
        dot[(size_t)(e / D)] += (double)value[q[(size_t)e]] * value[k[kv]];
        sum[kv] += value[dout[(size_t)e]];
    }
    const uint16_t small = to_bits(ULY_BF16, 1e-3f), smallish = to_bits(ULY_BF16, 1e-2f);
    for (f.a.deterministic = 0; f.a.deterministic < 2; f.a.deterministic++) {
        for (int t : {3, 5, 6, 7}) /* NaN again: unwritten */
            cudaMemset(f.x[t].t.data, 0xff, (size_t)f.x[t].elems * 2);
        run_both(f, f.a.deterministic ? "deterministic" : "atomic dQ");
        for (int t : {3, 5, 6, 7})
            cudaMemcpy(in[t].data(), f.x[t].t.data, in[t].size() * 2, cudaMemcpyDeviceToHost);
        fvec lse((size_t)rows);
        cudaMemcpy(lse.data(), f.a.lse, (size_t)rows * 4, cudaMemcpyDeviceToHost);
        const bits &o = in[3], &dq = in[5], &dk = in[6], &dv = in[7];
        int64_t bad[5] = {0, 0, 0, 0, 0}; /* o, lse, dv, dq, dk */
        for (int64_t e = 0; e < rows * D; e++) {
            bad[0] += o[(size_t)e] != v[(size_t)(e / D / S * D + e % D)];
            bad[3] += (dq[(size_t)e] & 0x7fff) > small;
        }
        for (int64_t i = 0; i < rows; i++) {
            const double got = lse[(size_t)i], want = scale * dot[(size_t)i];
            bad[1] += !(fabs(got - want) <= 1e-3 + 1e-6 * fabs(want));
        }
        for (size_t e = 0; e < sum.size(); e++) {
            const double got = value[dv[e]], tol = 1e-2 * (1 + fabs(sum[e]));
            bad[2] += S == 1 ? dv[e] != dout[e] : !(fabs(got - sum[e]) <= tol);
            bad[4] += (dk[e] & 0x7fff) > smallish;
        }
        CHECK(!bad[0] && !bad[1] && !bad[2] && !bad[3] && !bad[4], "B %lld, S %lld, "
              "deterministic %d: wrong o %lld, lse %lld, dv %lld, dq %lld, dk %lld", (long long)B,
              (long long)S, f.a.deterministic, (long long)bad[0], (long long)bad[1],
              (long long)bad[2], (long long)bad[3], (long long)bad[4]);
    }
    free_args(f);
}

TEST(grids_past_the_slice_size) {
    one_key_case(ULY__FA_GRID_YZ + 2, 1);
    one_key_case(1, ULY__FA_GRID_YZ * 128 + 1);
}

static __global__ void fill_bits(uint16_t *x, int64_t n, uint64_t stream) {
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += step)
        x[i] = one_key_bits((uint64_t)i, stream);
}

/* fp64 attention of query row i of fill_bits' q and dout (streams 0 and 3) over two keys k, v
   ([2][D] bf16 bits): out, lse and dq of the row. */
static void two_key_row(int64_t i, int64_t D, const fvec &value, const std::vector<uint16_t> &k,
                        const std::vector<uint16_t> &v, double *o, double *lse, double *dq) {
    const double scale = 1 / sqrt((double)D);
    double q[128], dout[128], s[2] = {0, 0}, dp[2] = {0, 0}, p[2], dsum = 0;
    for (int64_t d = 0; d < D; d++) {
        q[d] = value[one_key_bits((uint64_t)(i * D + d), 0)];
        dout[d] = value[one_key_bits((uint64_t)(i * D + d), 3)];
    }
    for (int j = 0; j < 2; j++)
        for (int64_t d = 0; d < D; d++) {
            s[j] += scale * q[d] * value[k[(size_t)(j * D + d)]];
            dp[j] += dout[d] * value[v[(size_t)(j * D + d)]];
        }
    const double m = std::max(s[0], s[1]), z = exp(s[0] - m) + exp(s[1] - m);
    for (int j = 0; j < 2; j++) p[j] = exp(s[j] - m) / z;
    *lse = m + log(z);
    for (int64_t d = 0; d < D; d++) {
        o[d] = p[0] * value[v[(size_t)d]] + p[1] * value[v[(size_t)(D + d)]];
        dsum += dout[d] * o[d];
    }
    for (int64_t d = 0; d < D; d++)
        dq[d] = scale * (p[0] * (dp[0] - dsum) * value[k[(size_t)d]] +
                         p[1] * (dp[1] - dsum) * value[k[(size_t)(D + d)]]);
}

/* The atomic dQ accumulator (fp32, D of them a query row) past 2^31 elements, where an int index
   wraps: on a GPU one sequence of 2^24 + 256 rows of D = 128 (26 GB in all) over two keys; under
   the emulator 300 rows, the same checks. q and dout are filled on the device (fill_bits); out,
   lse and dq are held to fp64 (two_key_row) at the first 256 rows and the last 512, which on a
   GPU straddle element 2^31: out within 1e-2 (its rounding), lse within 1e-3, dq within 1e-2
   (Dsum reads the rounded out), where dq's own values reach past 0.05 (a dq left 0 fails). */
TEST(dq_accumulator_past_2_31_elements) {
#ifdef ULY_EMU
    const int64_t S = 300;
#else
    const int64_t S = ((int64_t)1 << 24) + 256;
#endif
    const int64_t D = 128;
    const fvec value = bf16_values();
    std::vector<uint16_t> k((size_t)(2 * D)), v(k.size());
    for (size_t e = 0; e < k.size(); e++) k[e] = one_key_bits(e, 1), v[e] = one_key_bits(e, 2);
    flash_args f = alloc_args(1, S, 2, 1, D, 0);
    ULY_LAUNCH(fill_bits, dim3(1024), dim3(256), 0, 0, (uint16_t *)f.a.q.data, S * D, 0);
    ULY_LAUNCH(fill_bits, dim3(1024), dim3(256), 0, 0, (uint16_t *)f.a.dout.data, S * D, 3);
    cudaMemcpy(f.a.k.data, k.data(), k.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(f.a.v.data, v.data(), v.size() * 2, cudaMemcpyHostToDevice);
    run_both(f, "atomic dQ");
    int64_t bad[3] = {0, 0, 0}; /* out, lse, dq */
    double most = 0, ref_o[128], ref_lse, ref_dq[128];
    std::vector<uint16_t> o((size_t)D), dq((size_t)D);
    for (int64_t i = 0; i < S; i++) {
        if (i >= 256 && i < S - 512) continue;
        float lse;
        cudaMemcpy(o.data(), (uint16_t *)f.a.o.data + i * D, (size_t)D * 2, cudaMemcpyDeviceToHost);
        cudaMemcpy(dq.data(), (uint16_t *)f.a.dq.data + i * D, (size_t)D * 2,
                   cudaMemcpyDeviceToHost);
        cudaMemcpy(&lse, f.a.lse + i, 4, cudaMemcpyDeviceToHost);
        two_key_row(i, D, value, k, v, ref_o, &ref_lse, ref_dq);
        bad[1] += !(fabs(lse - ref_lse) <= 1e-3 + 1e-6 * fabs(ref_lse));
        for (int64_t d = 0; d < D; d++) {
            bad[0] += !(fabs(value[o[(size_t)d]] - ref_o[d]) <= 1e-2);
            bad[2] += !(fabs(value[dq[(size_t)d]] - ref_dq[d]) <= 1e-2);
            most = std::max(most, fabs(ref_dq[d]));
        }
    }
    CHECK(!bad[0] && !bad[1] && !bad[2] && most > 0.05, "S %lld: wrong out %lld, lse %lld, dq "
          "%lld; largest dq %.3g", (long long)S, (long long)bad[0], (long long)bad[1],
          (long long)bad[2], most);
    free_args(f);
}

/* The kernels count rows in int and add two counts: at most 2^30 rows a sequence. Batches and
   heads (a grid's x) are at most 2^31 - 1; past CUDA's 65535 along y or z a grid goes in slices.
   Every tensor is a view over one small buffer and the workspace claims INT64_MAX bytes: the
   checks come before anything is read. At each limit both passes check. */
TEST(rejects_rows_past_2_30_and_batches_or_heads_past_2_31) {
    void *buf;
    float *lse;
    cudaMalloc(&buf, 64 * 2), cudaMalloc((void **)&lse, 4);
    const uly_attn fa = uly_flash_attention();
    const int64_t rows = (int64_t)1 << 30, most = INT_MAX;
    const struct {
        const char *what;
        int64_t b, sq, sk, h, hk;
        const char *refusal; /* what the message says, naming the field; NULL: accepted */
    } cases[] = {
        {"q.s = 2^30 + 1", 1, rows + 1, 1, 1, 1, "q.s (1073741825), k.s (1): at most 2^30 rows"},
        {"k.s = 2^30 + 1", 1, 1, rows + 1, 1, 1, "k.s (1073741825): at most 2^30 rows"},
        {"q.s = k.s = 2^30", 1, rows, rows, 1, 1, NULL},
        {"q.b = 2^31", most + 1, 1, 1, 1, 1, "q.b (2147483648), q.h (1), k.h (1): at most 2^31"},
        {"q.h = 2^31", 1, 1, 1, most + 1, 1, "q.h (2147483648), k.h (1): at most 2^31 - 1"},
        {"k.h = 2^31", 1, 1, 1, 1, most + 1, "k.h (2147483648): at most 2^31 - 1"},
        {"q.b = 2^31 - 1", most, 1, 1, 1, 1, NULL},
        {"q.h = k.h = 2^31 - 1", 1, 1, 1, most, most, NULL}};
    for (const auto &x : cases)
        for (int backward = 0; backward < 2; backward++) {
            uly_attn_args a;
            memset(&a, 0, sizeof a);
            a.q = a.o = a.dout = a.dq = uly_dense(buf, ULY_BF16, x.b, x.sq, x.h, 64);
            a.k = a.v = a.dk = a.dv = uly_dense(buf, ULY_BF16, x.b, x.sk, x.hk, 64);
            a.kv_group = x.h % x.hk ? 1 : 0; /* k.h past q.h: query head i reads kv head i */
            a.lse = lse, a.workspace = buf, a.workspace_bytes = INT64_MAX;
            const uly_status st = fa.check(fa.ctx, &a, backward);
            CHECK(x.refusal ? st.code == ULY_EUNSUPPORTED && strstr(st.msg, x.refusal) : !st.code,
                  "%s, %s: status %d '%s', want %s", backward ? "backward" : "forward", x.what,
                  (int)st.code, st.msg, x.refusal ? x.refusal : "success");
        }
    cudaFree(buf), cudaFree(lse);
}

/* Rows move in 16-byte chunks: a stride of a dim longer than 1 that is not a multiple of 8
   elements is refused, naming the tensor (a dim of extent 1 may have any stride:
   any_stride_on_dims_of_extent_1). Padded [2, 16, 2, 64]: sh 72, ss 152, sb 2440, each made 4
   smaller, still a view whose rows do not overlap. */
TEST(rejects_strides_not_multiples_of_8) {
    flash_args f = valid_args(2, 16, 2);
    const uly_attn fa = uly_flash_attention();
    const uly_attn_args good = f.a;
    f.a.q.sh -= 4;
    expect_status(fa.fwd(fa.ctx, &f.a), ULY_EUNSUPPORTED, "q: rows move in 16-byte", "q.sh 68");
    f.a = good, f.a.k.ss -= 4;
    expect_status(fa.fwd(fa.ctx, &f.a), ULY_EUNSUPPORTED, "k: rows move in 16-byte", "k.ss 148");
    f.a = good, f.a.o.sb -= 4;
    expect_status(fa.fwd(fa.ctx, &f.a), ULY_EUNSUPPORTED, "o: rows move in 16-byte", "o.sb 2436");
    f.a = good, f.a.dk.sh -= 4;
    expect_status(fa.bwd(fa.ctx, &f.a), ULY_EUNSUPPORTED, "dk: rows move in 16-byte", "dk.sh 68");
    f.a = good;
    free_args(f);
}

/* Varlen arguments the kernels cannot size a grid from are refused before the cu_seqlens check
   runs: q.b must be 1, batch in [1, 2^30], both cu_seqlens set, max_seqlen within the rows. */
TEST(varlen_rejects_bad_arguments) {
    flash_args f = valid_args(1, 70, 2);
    int32_t *cu = NULL;
    const uly_varlen good = varlen_on_device({0, 40, 70}, {0, 30, 70}, &cu);
    expect_status(uly_flash_varlen_fwd(&f.a, &good), ULY_OK, "", "forward, good");
    const struct {
        const char *what;
        int64_t batch, max_q, max_k;
        bool no_cu_q, no_cu_k;
    } bad[] = {{"batch 0", 0, 40, 40, false, false},
               {"batch 2^30 + 1", ((int64_t)1 << 30) + 1, 40, 40, false, false},
               {"cu_seqlens_q NULL", 2, 40, 40, true, false},
               {"cu_seqlens_k NULL", 2, 40, 40, false, true},
               {"max_seqlen_q 71", 2, 71, 40, false, false},
               {"max_seqlen_k 71", 2, 40, 71, false, false}};
    for (const auto &x : bad) {
        uly_varlen vl = good;
        vl.batch = x.batch, vl.max_seqlen_q = x.max_q, vl.max_seqlen_k = x.max_k;
        if (x.no_cu_q) vl.cu_seqlens_q = NULL;
        if (x.no_cu_k) vl.cu_seqlens_k = NULL;
        expect_status(uly_flash_varlen_fwd(&f.a, &vl), ULY_EINVAL, "varlen", x.what);
        expect_status(uly_flash_varlen_bwd(&f.a, &vl), ULY_EINVAL, "varlen", x.what);
    }
    expect_status(uly_flash_varlen_fwd(&f.a, NULL), ULY_EINVAL, "uly_varlen is NULL", "NULL");
    const uly_attn none = uly_flash_varlen_attention(NULL);
    expect_status(none.check(none.ctx, &f.a, 0), ULY_EINVAL, "uly_varlen is NULL", "ctx NULL");
    uly_varlen odd = good; /* int32 arrays 2 bytes in: a misaligned read on a GPU */
    odd.cu_seqlens_k = (const int32_t *)((const char *)good.cu_seqlens_k + 2);
    expect_status(uly_flash_varlen_fwd(&f.a, &odd), ULY_EINVAL, "4-byte aligned", "cu_k + 2");
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "kernels ran");
    free_args(f);
    flash_args two = valid_args(2, 70, 2); /* q.b = 2 */
    expect_status(uly_flash_varlen_fwd(&two.a, &good), ULY_EINVAL, "varlen", "q.b 2");
    expect_status(uly_flash_varlen_bwd(&two.a, &good), ULY_EINVAL, "varlen", "q.b 2");
    free_args(two);
    cudaFree(cu);
}

/* ---------------------------------------------------------------------------------------------
   Edges that mutation testing found unguarded: a one-off change in a kernel's bounds, strides or
   head mapping, or a dropped argument check, that every test above let pass. */

/* A causal query block whose last row's last key is alone in its key block: Sk - Sq = 65, so
   forward row 127 (end of query block 0, BM = 128) keeps keys <= 192 = 3 * 64, and dQ rows 63 and
   127 (BM = 64) keep keys <= 128 and <= 192, the first key of a 64- or 128-key block. Those keys
   are made 4 q of their row, so dropping them changes the row entirely. */
TEST(causal_block_end_one_key_into_a_key_block) {
    for (int64_t D : {64, 128})
        for (int deterministic : {0, 1}) {
            fcase c = make_case({1, 200, 265, 1, 1, 1}, D, ULY_BF16);
            c.deterministic = deterministic;
            inputs in = make_inputs(c, c.Sq, c.Sk);
            const int64_t needles[2][2] = {{127, 192}, {63, 128}}; /* row, its last key */
            for (const auto &n : needles)
                for (int64_t d = 0; d < D; d++)
                    in.k[(size_t)(n[1] * D + d)] = 4 * in.q[(size_t)(n[0] * D + d)];
            check_inputs(c, in);
        }
}

/* Non-causal, Sk = 127: the last key block is one key short of full (64 and 128 keys), so the
   only key the tail mask removes is the zero-filled row Sk. */
TEST(key_tail_one_short_of_a_block) {
    for (int64_t D : {64, 128})
        for (int deterministic : {0, 1}) {
            fcase c = make_case({1, 65, 127, 2, 1, 0}, D, ULY_BF16);
            c.deterministic = deterministic;
            check_case(c);
        }
}

/* An SP rank past the first group: global query heads 3..6 in groups of 2 read global kv heads
   1, 2, 2, 3, i.e. local kv heads 0, 1, 1, 2 (q_head0 / kv_group = 1 is subtracted). */
TEST(gqa_rank_past_the_first_group) {
    for (int64_t D : {64, 128})
        for (int deterministic : {0, 1}) {
            fcase c = make_case({1, 65, 65, 4, 3, 1}, D, ULY_BF16);
            c.q_head0 = 3, c.kv_group = 2, c.deterministic = deterministic;
            check_case(c);
        }
}

/* Each of the eight tensors padded differently (flash_case.h's OWN_STRIDES), in every kernel. */
TEST(every_tensor_has_its_own_strides) {
    for (int64_t D : {64, 128})
        for (int deterministic : {0, 1}) {
            fcase c = make_case({2, 129, 130, 4, 2, 1}, D, ULY_BF16);
            c.deterministic = deterministic, c.strided = OWN_STRIDES;
            check_case(c);
        }
}

/* Breaks one tensor of valid args with `breaks`, for each of the eight, and expects every call
   that reads or writes it (the backward all eight; the forward q, k, v, o) to refuse it as
   rows that cannot move in 16-byte chunks. */
static void expect_each_tensor_refused(void (*breaks)(uly_tensor *)) {
    flash_args f = valid_args(2, 16, 2);
    const uly_attn fa = uly_flash_attention();
    const uly_attn_args good = f.a;
    typedef uly_tensor uly_attn_args::*tensor_of;
    const tensor_of ts[8] = {&uly_attn_args::q,  &uly_attn_args::k,    &uly_attn_args::v,
                             &uly_attn_args::o,  &uly_attn_args::dout, &uly_attn_args::dq,
                             &uly_attn_args::dk, &uly_attn_args::dv};
    const char *names[8] = {"q", "k", "v", "o", "dout", "dq", "dk", "dv"};
    for (int i = 0; i < 8; i++) {
        f.a = good;
        breaks(&(f.a.*ts[i]));
        char what[64];
        snprintf(what, sizeof what, "%s: rows move in 16-byte", names[i]);
        expect_status(fa.check(fa.ctx, &f.a, 1), ULY_EUNSUPPORTED, what, names[i]);
        if (i < 4) expect_status(fa.check(fa.ctx, &f.a, 0), ULY_EUNSUPPORTED, what, names[i]);
    }
    f.a = good;
    free_args(f);
}

/* Every tensor's stride rule, not only q, k, o and dk's: each of the eight with sh 68. */
static void sh_off_by_4(uly_tensor *t) { t->sh -= 4; }
TEST(rejects_strides_not_multiples_of_8_for_every_tensor) {
    expect_each_tensor_refused(sh_off_by_4);
}

/* cu_seqlens_q misaligned, as cu_seqlens_k is in varlen_rejects_bad_arguments. */
TEST(varlen_rejects_a_misaligned_cu_seqlens_q) {
    flash_args f = valid_args(1, 70, 2);
    int32_t *cu = NULL;
    const uly_varlen good = varlen_on_device({0, 40, 70}, {0, 30, 70}, &cu);
    uly_varlen odd = good;
    odd.cu_seqlens_q = (const int32_t *)((const char *)good.cu_seqlens_q + 2);
    expect_status(uly_flash_varlen_fwd(&f.a, &odd), ULY_EINVAL, "4-byte aligned", "cu_q + 2");
    expect_status(uly_flash_varlen_bwd(&f.a, &odd), ULY_EINVAL, "4-byte aligned", "cu_q + 2");
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "kernels ran");
    free_args(f);
    cudaFree(cu);
}

/* More documents than the check kernel's 256 threads: the bad one, the last (it ends short of
   the rows), is checked in a second round. */
TEST(traps_on_cu_seqlens_bad_document_past_256) {
    std::vector<int> cu_q, cu_k;
    for (int b = 0; b <= 300; b++) cu_q.push_back(std::min(b, 299)), cu_k.push_back(b);
    expect_trap(cu_q, cu_k, 300, 300, 1, 1, false);
}

/* Nothing past lse and the workspace is written: both allocated with a guard of -0.0f, which
   any store or atomic add (even of +0) changes. */
TEST(nothing_written_past_lse_or_workspace) {
    for (int deterministic : {0, 1}) {
        fcase c = make_case({1, 65, 65, 1, 1, 0}, 64, ULY_BF16);
        c.deterministic = deterministic;
        const inputs in = make_inputs(c, c.Sq, c.Sk);
        dev_tensor x[8];
        for (int i = 0; i < 8; i++) x[i] = dev_alloc(c.dt, 1, 65, 1, 64, 0);
        upload(x[0], in.q), upload(x[1], in.k), upload(x[2], in.v), upload(x[4], in.dout);
        uly_attn_args a;
        memset(&a, 0, sizeof a);
        a.q = x[0].t, a.k = x[1].t, a.v = x[2].t, a.o = x[3].t, a.dout = x[4].t;
        a.dq = x[5].t, a.dk = x[6].t, a.dv = x[7].t;
        a.deterministic = deterministic;
        const uly_attn fa = uly_flash_attention();
        const int64_t G = 64 * 128, nlse = 65, ws = fa.workspace(fa.ctx, &a); /* guard floats */
        std::vector<float> guard((size_t)G, -0.0f);
        cudaMalloc((void **)&a.lse, (size_t)(nlse + G) * 4);
        cudaMalloc(&a.workspace, (size_t)ws + G * 4);
        a.workspace_bytes = ws;
        cudaMemcpy(a.lse + nlse, guard.data(), G * 4, cudaMemcpyHostToDevice);
        cudaMemcpy((char *)a.workspace + ws, guard.data(), G * 4, cudaMemcpyHostToDevice);
        const uly_status f = fa.fwd(fa.ctx, &a), b = fa.bwd(fa.ctx, &a);
        CHECK(!f.code && !b.code && cudaDeviceSynchronize() == cudaSuccess, "ran: %s %s", f.msg,
              b.msg);
        std::vector<float> after((size_t)G);
        cudaMemcpy(after.data(), a.lse + nlse, G * 4, cudaMemcpyDeviceToHost);
        CHECK(!memcmp(after.data(), guard.data(), G * 4), "det=%d: past lse written",
              deterministic);
        cudaMemcpy(after.data(), (char *)a.workspace + ws, G * 4, cudaMemcpyDeviceToHost);
        CHECK(!memcmp(after.data(), guard.data(), G * 4), "det=%d: past the workspace written",
              deterministic);
        for (dev_tensor &t : x) cudaFree(t.t.data);
        cudaFree(a.lse), cudaFree(a.workspace);
    }
}

/* Rows move in 16-byte chunks (16-byte cp.async, uint4 stores), which a GPU faults on at an
   address 8 bytes off 16-byte alignment: a tensor 8 bytes off is refused as one 2 bytes off is
   (rejects_what_the_kernels_do_not_take), each of the eight. */
static void data_off_by_8(uly_tensor *t) { t->data = (char *)t->data + 8; }
TEST(rejects_data_8_bytes_off_16_byte_alignment) { expect_each_tensor_refused(data_off_by_8); }

#ifdef ULY_EMU
/* A GPU that gives a block less shared memory than a kernel needs refuses the call before
   anything runs, in the direction that needs it. At an sm_86's 99 KB (101376 bytes) the
   backward's dK/dV kernel at D = 128 (164864 bytes) is refused while its forward (64 KB) and
   the backward at D = 64 (99328 bytes) are taken; at 60 KB the forward at D = 128 is refused. */
TEST(refuses_what_the_gpu_shared_memory_cannot_hold) {
    const struct {
        size_t optin;
        int64_t D;
        int backward, ok;
    } runs[] = {{101376, 128, 1, 0}, {101376, 128, 0, 1}, {101376, 64, 1, 1}, {61440, 128, 0, 0}};
    const uly_attn fa = uly_flash_attention();
    for (const auto &r : runs) {
        flash_args f = valid_args(1, 16, 2, r.D);
        char what[64];
        snprintf(what, sizeof what, "%zu bytes, D=%lld, backward=%d", r.optin, (long long)r.D,
                 r.backward);
        uly_emu_set_smem_optin(r.optin);
        const uly_status st = fa.check(fa.ctx, &f.a, r.backward);
        uly_emu_set_smem_optin(0);
        expect_status(st, r.ok ? ULY_OK : ULY_EUNSUPPORTED, r.ok ? "" : "shared memory", what);
        free_args(f);
    }
}
#endif

/* A negative max_seqlen_q or max_seqlen_k is refused up front, as one past q.s or k.s is. Let
   through, every document is longer than it, and the cu_seqlens check kernel traps: on a GPU
   that ends the CUDA context. */
TEST(varlen_rejects_a_negative_max_seqlen) {
    flash_args f = valid_args(1, 70, 2);
    int32_t *cu = NULL;
    const uly_varlen good = varlen_on_device({0, 40, 70}, {0, 30, 70}, &cu);
    for (int k = 0; k < 2; k++) {
        uly_varlen vl = good;
        (k ? vl.max_seqlen_k : vl.max_seqlen_q) = -1;
        const char *what = k ? "max_seqlen_k -1" : "max_seqlen_q -1";
        expect_status(uly_flash_varlen_fwd(&f.a, &vl), ULY_EINVAL, "varlen", what);
        expect_status(uly_flash_varlen_bwd(&f.a, &vl), ULY_EINVAL, "varlen", what);
    }
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "nothing ran that failed");
    free_args(f);
    cudaFree(cu);
}

/* Varlen grids are sized from max_seqlen_q (query blocks, row passes) and max_seqlen_k (the
   dK/dV kernel's key blocks), which varlen_documents cannot tell apart: its longest documents
   (150 queries, 130 keys) take as many blocks of 64 and 128 either way. Here the longest key
   document (300 keys: 3 key blocks of 128) is 15 times the longest query document (20 rows:
   one block), and then the other way round, so a grid sized from the other count leaves dK, dV
   (or o, lse, dq) rows unwritten. Both against the fp64 reference. */
TEST(varlen_grids_take_each_max_seqlen) {
    const struct {
        std::vector<int> cq, ck;
        int64_t D;
        uly_dtype dt;
        int causal, deterministic;
    } runs[] = {{{0, 10, 30}, {0, 300, 310}, 64, ULY_BF16, 0, 0},
                {{0, 10, 30}, {0, 300, 310}, 128, ULY_F16, 1, 1},
                {{0, 300, 310}, {0, 10, 30}, 64, ULY_BF16, 1, 0}};
    for (const auto &x : runs) {
        fcase c = make_case({1, x.cq.back(), x.ck.back(), 2, 1, x.causal}, x.D, x.dt);
        c.deterministic = x.deterministic;
        const inputs in = make_inputs(c, x.cq.back(), x.ck.back());
        const run_out got = run_attn(c, x.cq, x.ck, true, in, uly_flash_attention());
        if (!got.ok) continue;
        check_outputs(c, got, reference(c, x.cq, x.ck, true, in, false),
                      reference(c, x.cq, x.ck, true, in, true), NULL);
        CHECK(nonfinite_outputs(got) == 0, "%s: %d outputs are NaN or inf", describe(c).c_str(),
              nonfinite_outputs(got));
    }
}

/* The query and key rows from `first` on of a varlen result of n rows each (lse [H, n]), as a
   batch of one. */
template <typename R> static R rows_from(const R &r, const fcase &c, int64_t n, int64_t first) {
    const int64_t wq = c.H * c.D, wk = c.Hkv * c.D;
    R d = r;
    d.o.assign(r.o.begin() + first * wq, r.o.end());
    d.dq.assign(r.dq.begin() + first * wq, r.dq.end());
    d.dk.assign(r.dk.begin() + first * wk, r.dk.end());
    d.dv.assign(r.dv.begin() + first * wk, r.dv.end());
    d.lse.clear();
    for (int64_t h = 0; h < c.H; h++)
        d.lse.insert(d.lse.end(), r.lse.begin() + h * n + first, r.lse.begin() + (h + 1) * n);
    return d;
}

/* A document's last query block runs past its end over the next document's rows, whose dQ the
   dK/dV kernel must not add to (from finite inputs those adds are zeros, which no other test
   tells apart). An infinite key in document 0 makes them NaN (0 * inf): document 1's outputs
   must still match the fp64 reference. */
TEST(varlen_tail_rows_stay_out_of_the_next_documents_dq) {
    const std::vector<int> cu = {0, 40, 70};
    const fcase c = make_case({1, 70, 70, 2, 1, 0}, 64, ULY_BF16);
    const fcase doc1 = make_case({1, 30, 30, 2, 1, 0}, 64, ULY_BF16);
    inputs in = make_inputs(c, 70, 70);
    in.k[3 * c.Hkv * c.D] = INFINITY; /* key 3 of document 0 */
    const run_out got = run_attn(c, cu, cu, true, in, uly_flash_attention());
    if (!got.ok) return;
    const outputs r64 = reference(c, cu, cu, true, in, false);
    const outputs low = reference(c, cu, cu, true, in, true);
    check_outputs(doc1, rows_from(got, c, 70, 40), rows_from(r64, c, 70, 40),
                  rows_from(low, c, 70, 40), NULL);
}

int main(void) {
#ifdef ULY_EMU
    /* Twice as many emulator threads as hardware threads (at least 4), unless the caller chose;
       the first launch reads it. deterministic_is_bitwise_stable needs blocks that share output
       rows to run at once and be preempted (the emulator takes at most 64). */
    char threads[16];
    snprintf(threads, sizeof threads, "%u", std::max(4u, 2 * std::thread::hardware_concurrency()));
    setenv("ULY_EMU_THREADS", threads, 0);
#endif
    return uly_run_tests();
}
