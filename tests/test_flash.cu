/* test_flash.cu - the flash attention kernels of ulysses_cuda.cuh against two references.

   For every case the inputs are random values already rounded to the dtype, and three things
   are computed from them:
     ref64   attention forward and backward in fp64, from the formulas (below);
     lowp    the same steps with every intermediate tensor rounded to the dtype, as a plain
             bf16/fp16 attention computes it (S, P, O, dP, dS, dQ, dK, dV);
     cpu     ulysses.h's fp32 reference, uly_cpu_attention.
   The accuracy rule is FlashAttention's own: for each output, the kernel's max error against
   ref64 is at most twice lowp's max error plus 1e-3; the kernel also agrees with cpu within the
   same bound. lse must be within 1e-3 (plus 1e-6 relative) of ref64, and +inf exactly where no
   key is kept.
   Builds under the CUDA emulator (make test) and with nvcc for a GPU (make test-gpu).
   ULY_TEST_FILTER selects tests by name, e.g. ULY_TEST_FILTER=d128; ULY_FLASH_VERBOSE=1 prints
   every case's errors. Under the emulator main() asks for twice as many threads as the machine
   has, at least 4 (ULY_EMU_THREADS, when set, wins). The harness and the references are in flash_case.h. */
#include "emu/cuda_emu.h"
#define ULYSSES_IMPLEMENTATION
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

static void matrix(uly_dtype dt, int64_t D, int deterministic) {
    for (const shape &s : shapes) {
        fcase c = make_case(s, D, dt);
        c.deterministic = deterministic;
        check_case(c);
    }
}

/* Query rows that keep no key must give o and dq exactly 0 and lse = +inf; returns how many of
   those values differ. rows index a batch of one (dense, or packed documents) of nrows rows in
   all, so lse is [H, nrows]. */
static int masked_rows_wrong(const fcase &c, const run_out &r, int64_t nrows,
                             const std::vector<int64_t> &rows) {
    int bad = 0;
    for (int64_t h = 0; h < c.H; h++)
        for (int64_t i : rows) {
            const float l = r.lse[(size_t)(h * nrows + i)];
            bad += !(std::isinf(l) && l > 0);
            for (int64_t d = 0; d < c.D; d++)
                bad += r.o[(size_t)((i * c.H + h) * c.D + d)] != 0 ||
                       r.dq[(size_t)((i * c.H + h) * c.D + d)] != 0;
        }
    return bad;
}

static int nonfinite_outputs(const run_out &r) {
    int bad = 0;
    for (const field &f : fields)
        for (float x : r.*f.got) bad += !std::isfinite(x);
    return bad;
}

static std::vector<int64_t> row_range(int64_t begin, int64_t end) {
    std::vector<int64_t> rows;
    for (int64_t i = begin; i < end; i++) rows.push_back(i);
    return rows;
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

/* An SP rank holding global query heads 1..3 of groups of 2: local heads 0 | 1, 2 read local kv
   heads 0 | 1, so one group is split across ranks. */
TEST(gqa_group_split_across_ranks) {
    for (int64_t D : {64, 128}) {
        fcase c = make_case({1, 65, 65, 3, 2, 1}, D, ULY_BF16);
        c.q_head0 = 1, c.kv_group = 2;
        check_case(c);
    }
}

/* Sq > Sk, causal: rows 0 .. Sq - Sk - 1 keep no key. */
TEST(fully_masked_rows_are_zero_with_inf_lse) {
    for (int deterministic : {0, 1}) {
        fcase c = make_case({1, 150, 20, 2, 1, 1}, 64, ULY_BF16);
        c.deterministic = deterministic;
        const run_out r = check_case(c);
        if (!r.ok) continue;
        const int bad = masked_rows_wrong(c, r, c.Sq, row_range(0, c.Sq - c.Sk));
        CHECK(bad == 0, "deterministic=%d: %d values of fully masked rows are not 0 (lse +inf)",
              deterministic, bad);
        CHECK(nonfinite_outputs(r) == 0, "deterministic=%d: %d outputs are NaN or inf",
              deterministic, nonfinite_outputs(r));
    }
}

/* Logits of magnitude ~1e4 (q, k uniform in [-170, 170), D = 64): exp never overflows. The
   accuracy rule is no use here: plain bf16 or fp16 rounds such logits by several units, so its
   error, and with it the bound, is as often large as not. Instead a bound from the kernels' own
   rounding: the two largest logits of a row are typically hundreds apart, so P is one-hot and o
   is exactly a row of V. Near a tie, the logits' fp32 error (~1e-3: sums of products up to 3e4)
   moves P by about as much, and so o, dV and dS, which dQ and dK multiply by |k| / sqrt(D) and
   |q| / sqrt(D), ~21. So o and dV must be within 2e-2 of ref64 (times their largest magnitude
   where above 1: dV sums rows of dO), dQ and dK within 4e-2 * 170 / sqrt(D); 240 random draws
   stayed within a quarter of that. A wrong maximum, an overflow or a row mixed with the wrong
   keys is off by O(1) of those units. */
TEST(large_logits_do_not_overflow) {
    for (uly_dtype dt : {ULY_BF16, ULY_F16})
        for (int causal : {0, 1}) {
            fcase c = make_case({1, 70, 70, 1, 1, causal}, 64, dt);
            c.magnitude = 170;
            const inputs in = make_inputs(c, c.Sq, c.Sk);
            const std::vector<int> cq = dense_cu(1, c.Sq), ck = dense_cu(1, c.Sk);
            const run_out r = run_attn(c, cq, ck, false, in, uly_flash_attention());
            if (!r.ok) continue;
            const outputs r64 = reference(c, cq, ck, false, in, false);
            check_lse(c, r, r64);
            CHECK(nonfinite_outputs(r) == 0, "%s: %d outputs are not finite", describe(c).c_str(),
                  nonfinite_outputs(r));
            for (const field &f : fields) {
                const dvec &want = r64.*f.want;
                const bool through_ds = f.want == &outputs::dq || f.want == &outputs::dk;
                const double bound =
                    through_ds ? 4e-2 * c.magnitude / sqrt((double)c.D)
                               : 2e-2 * std::max(1.0, max_err(dvec(want.size(), 0.0), want));
                const double err = max_err(r.*f.got, want);
                CHECK(err <= bound, "%s: %s max error %.3g > %.3g", describe(c).c_str(), f.name,
                      err, bound);
            }
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
/* 64-bit offsets: 1M tokens x 32 heads x 128 dims is 2^32 elements, so offsets past int32 are
   the everyday case. Under the emulator device memory is host memory, and the eight tensors lie
   in one sparse mapping far larger than what they touch: token rows 2^25 elements apart, heads
   2^23, each tensor at its own offset in a row. 65 tokens span 2^31 + 2^25 elements and batch 1
   begins there; a row offset computed in 32 bits reads or writes the wrong row. */
TEST(offsets_past_int32) {
    const int64_t ss = int64_t(1) << 25, sh = int64_t(1) << 23;
    for (int deterministic : {0, 1}) {
        fcase c = make_case({2, 65, 65, 2, 1, 1}, 128, ULY_BF16);
        c.deterministic = deterministic;
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
        const int bad = masked_rows_wrong(c, got, cq.back(), masked);
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
    cudaMalloc(&a.workspace, (size_t)std::max<int64_t>(16, fa.workspace(fa.ctx, &a)));
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
