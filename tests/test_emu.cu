// test_emu.cu: the CUDA host emulator and the PTX wrappers, each checked against an independent
// statement of the semantics (the PTX ISA's fragment formulas and the CUDA programming guide's
// shuffle rules are written out here, not shared with tests/emu/cuda_emu.cpp).
//
// The same source builds with nvcc and runs on a GPU (make test-gpu), which checks the emulator
// against hardware; tests of what only the emulator can see (poison, schedules, failure reports)
// are under #ifdef ULY_EMU.
#include "emu/cuda_emu.h"
// The PTX wrappers of ulysses_cuda.cuh (its declarations part; no implementation needed).
#include "ulysses_cuda.cuh"

#include <cfloat>
#include <csignal>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

// ---------------------------------------------------------------------------------------------
// Helpers.

template <typename T> static T *upload(const std::vector<T> &h) {
    T *d = nullptr;
    cudaMalloc(&d, h.size() * sizeof(T));
    cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
    return d;
}

template <typename T> static std::vector<T> download(const T *d, size_t n) {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
}

template <typename T> static T *device_zeros(size_t n) {
    T *d = nullptr;
    cudaMalloc(&d, n * sizeof(T));
    cudaMemset(d, 0, n * sizeof(T));
    return d;
}

// The launch's error, from the launch itself or from running it.
static cudaError_t launch_error() {
    cudaError_t e = cudaGetLastError();
    cudaError_t s = cudaDeviceSynchronize();
    return e != cudaSuccess ? e : s;
}

static unsigned rand_state = 12345;
static int small_int(int lo, int hi) {  // deterministic test data
    rand_state = rand_state * 1103515245u + 12345u;
    return lo + (int)((rand_state >> 16) % (unsigned)(hi - lo + 1));
}

template <typename T> __host__ __device__ inline uint16_t bits16(float x) {
    T h;
    if constexpr (std::is_same<T, __half>::value) h = __float2half(x);
    else h = __float2bfloat16(x);
    uint16_t b;
    memcpy(&b, &h, 2);
    return b;
}

// Two 16-bit elements in one register, the lower-indexed one in the low half.
template <typename T> __host__ __device__ inline uint32_t pack(float lo, float hi) {
    return (uint32_t)bits16<T>(lo) | (uint32_t)bits16<T>(hi) << 16;
}

// ---------------------------------------------------------------------------------------------
// Fragment layouts of mma.m16n8k16 with .f16/.bf16 inputs and .f32 accumulators, as written in
// the PTX ISA (section "Matrix Fragments for mma.m16n8k16 with floating point type"): element
// ai, bi, ci of a lane's fragment, with
// groupID = %laneid >> 2 and threadID_in_group = %laneid % 4. Register r holds elements 2r
// (low half) and 2r+1.

__host__ __device__ inline int group_id(int lane) { return lane >> 2; }
__host__ __device__ inline int thread_in_group(int lane) { return lane % 4; }

// m16n8k16 A (a0..a7): row = groupID for 0 <= i < 2 || 4 <= i < 6, else groupID + 8;
// col = threadID_in_group * 2 + (i & 1), plus 8 for i >= 4.
__host__ __device__ inline int a_row(int lane, int i) {
    return (i < 2 || (i >= 4 && i < 6)) ? group_id(lane) : group_id(lane) + 8;
}
__host__ __device__ inline int a_col(int lane, int i) {
    int col = thread_in_group(lane) * 2 + (i & 1);
    return i >= 4 ? col + 8 : col;
}

// m16n8k16 B (b0..b3): row = threadID_in_group * 2 + (i & 1), plus 8 for i >= 2; col = groupID.
__host__ __device__ inline int b_row(int lane, int i) {
    int row = thread_in_group(lane) * 2 + (i & 1);
    return i >= 2 ? row + 8 : row;
}
__host__ __device__ inline int b_col(int lane, int) { return group_id(lane); }

// C and D (c0..c3): row = groupID for c0, c1, else groupID + 8;
// col = threadID_in_group * 2 + (i & 1).
__host__ __device__ inline int c_row(int lane, int i) {
    return i < 2 ? group_id(lane) : group_id(lane) + 8;
}
__host__ __device__ inline int c_col(int lane, int i) {
    return thread_in_group(lane) * 2 + (i & 1);
}

enum { MMA_K = 16 }; /* k of m16n8k16 */

// Block e multiplies its own A (16xK, row-major), B (Kx8, row-major) and C (16x8): every lane
// builds its fragments from the formulas above, and scatters D back with them.
template <typename T>
__global__ void mma_probe(const float *A, const float *B, const float *C, float *D) {
    const float *a = A + blockIdx.x * 16 * MMA_K, *b = B + blockIdx.x * MMA_K * 8;
    const float *c = C + blockIdx.x * 128;
    float *d = D + blockIdx.x * 128;
    const int lane = threadIdx.x;
    uint32_t ra[MMA_K / 4], rb[MMA_K / 8];
    float rc[4], rd[4];
    for (int r = 0; r < MMA_K / 4; r++)
        ra[r] = pack<T>(a[a_row(lane, 2 * r) * MMA_K + a_col(lane, 2 * r)],
                        a[a_row(lane, 2 * r + 1) * MMA_K + a_col(lane, 2 * r + 1)]);
    for (int r = 0; r < MMA_K / 8; r++)
        rb[r] = pack<T>(b[b_row(lane, 2 * r) * 8 + b_col(lane, 2 * r)],
                        b[b_row(lane, 2 * r + 1) * 8 + b_col(lane, 2 * r + 1)]);
    for (int i = 0; i < 4; i++) rc[i] = c[c_row(lane, i) * 8 + c_col(lane, i)];
    uly_mma_m16n8k16<T>(rd, ra, rb, rc);
    for (int i = 0; i < 4; i++) d[c_row(lane, i) * 8 + c_col(lane, i)] = rd[i];
}

// A set of mma problems, one per block, and the plain GEMM loop that checks them.
struct MmaCase {
    std::vector<float> A, B, C;
    std::vector<std::string> names;

    size_t count() const { return names.size(); }
    void add(const std::string &name) {
        names.push_back(name);
        A.resize(count() * 16 * MMA_K);
        B.resize(count() * MMA_K * 8);
        C.resize(count() * 128);
    }
    float &a(int m, int i) { return A[(count() - 1) * 16 * MMA_K + m * MMA_K + i]; }
    float &b(int i, int n) { return B[(count() - 1) * MMA_K * 8 + i * 8 + n]; }
    float &c(int m, int n) { return C[(count() - 1) * 128 + m * 8 + n]; }
};

template <typename T> static void check_mma(const MmaCase &mc) {
    float *A = upload(mc.A), *B = upload(mc.B), *C = upload(mc.C);
    float *D = device_zeros<float>(mc.count() * 128);
    ULY_LAUNCH(mma_probe<T>, (unsigned)mc.count(), 32, 0, 0, A, B, C, D);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<float> d = download(D, mc.count() * 128);
    for (size_t e = 0; e < mc.count(); e++) {
        int bad = 0;
        for (int m = 0; m < 16; m++)
            for (int n = 0; n < 8; n++) {
                float want = mc.C[e * 128 + m * 8 + n];
                for (int i = 0; i < MMA_K; i++)
                    want += mc.A[e * 16 * MMA_K + m * MMA_K + i] * mc.B[e * MMA_K * 8 + i * 8 + n];
                float got = d[e * 128 + m * 8 + n];
                if (got != want && bad++ == 0)
                    CHECK(got == want, "%s: D(%d,%d) = %g, want %g", mc.names[e].c_str(), m, n,
                          got, want);
            }
    }
    cudaFree(A), cudaFree(B), cudaFree(C), cudaFree(D);
}

// Every element of A, B and C alone (one-hot), against operands whose entries name their
// position, so a misplaced element shows up as a wrong value at a wrong place; then random
// small integers, all exact in bf16, half and float.
template <typename T> static void mma_layout_sweep() {
    MmaCase mc;
    for (int m = 0; m < 16; m++)
        for (int i = 0; i < MMA_K; i++) {
            mc.add("A element (" + std::to_string(m) + "," + std::to_string(i) + ")");
            mc.a(m, i) = 1;
            for (int r = 0; r < MMA_K; r++)
                for (int n = 0; n < 8; n++) mc.b(r, n) = (float)(r * 8 + n + 1);
        }
    for (int i = 0; i < MMA_K; i++)
        for (int n = 0; n < 8; n++) {
            mc.add("B element (" + std::to_string(i) + "," + std::to_string(n) + ")");
            mc.b(i, n) = 1;
            for (int m = 0; m < 16; m++)
                for (int r = 0; r < MMA_K; r++) mc.a(m, r) = (float)(m * MMA_K + r + 1);
        }
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 8; n++) {
            mc.add("C element (" + std::to_string(m) + "," + std::to_string(n) + ")");
            mc.c(m, n) = 1000;
            for (int r = 0; r < MMA_K; r++) mc.a(m, r) = mc.b(r, n) = 1;
        }
    for (int t = 0; t < 8; t++) {
        mc.add("random " + std::to_string(t));
        for (int m = 0; m < 16; m++)
            for (int r = 0; r < MMA_K; r++) mc.a(m, r) = (float)small_int(-3, 3);
        for (int r = 0; r < MMA_K; r++)
            for (int n = 0; n < 8; n++) mc.b(r, n) = (float)small_int(-3, 3);
        for (int m = 0; m < 16; m++)
            for (int n = 0; n < 8; n++) mc.c(m, n) = (float)small_int(-50, 50);
    }
    check_mma<T>(mc);
}

TEST(mma_m16n8k16_bf16_fragment_layouts) { mma_layout_sweep<__nv_bfloat16>(); }
TEST(mma_m16n8k16_f16_fragment_layouts) { mma_layout_sweep<__half>(); }

// d may alias c: the accumulator is read before it is written.
__global__ void mma_in_place(float *out) {
    const int lane = threadIdx.x;
    uint32_t a[4], b[2];
    for (int r = 0; r < 4; r++) a[r] = pack<__nv_bfloat16>(1, 1);
    for (int r = 0; r < 2; r++) b[r] = pack<__nv_bfloat16>(1, 1);
    float acc[4] = {1, 2, 3, 4};
    uly_mma_m16n8k16<__nv_bfloat16>(acc, a, b, acc);
    uly_mma_m16n8k16<__nv_bfloat16>(acc, a, b, acc);
    for (int i = 0; i < 4; i++) out[lane * 4 + i] = acc[i];
}

TEST(mma_accumulates_in_place) {
    float *out = device_zeros<float>(128);
    ULY_LAUNCH(mma_in_place, 1, 32, 0, 0, out);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<float> h = download(out, 128);
    for (int i = 0; i < 128; i++)
        CHECK(h[i] == (float)(i % 4 + 1 + 32), "element %d: %g", i, h[i]);
    cudaFree(out);
}

// ---------------------------------------------------------------------------------------------
// ldmatrix.m8n8.b16, as the PTX ISA describes it: lanes 8i..8i+7 give the addresses of rows
// 0..7 of matrix i; lane t receives, in register i, row t/4 (groupID) and columns 2*(t%4),
// 2*(t%4)+1 of matrix i, low half first; with .trans, the same of the transposed matrix.

// The rows of the N matrices sit at scattered 16-byte slots, so each lane's address matters.
static int row_slot(int n, int matrix, int row) { return (matrix * 8 + row) * 5 % (8 * n); }

template <int N, bool TRANS>
__global__ void ldmatrix_probe(const uint16_t *mats, const int *slots, uint32_t *out) {
    ULY_DYN_SMEM(uint16_t, smem);
    for (int e = threadIdx.x; e < N * 64; e += 32) smem[slots[e / 8] * 8 + e % 8] = mats[e];
    __syncthreads();
    const int lane = threadIdx.x;
    // Lanes past 8N repeat valid addresses (sm_75 and older read every lane's).
    uint32_t r[N];
    uly_ldmatrix<N, TRANS>(r, uly_smem_addr(smem + slots[lane % (8 * N)] * 8));
    for (int i = 0; i < N; i++) out[lane * N + i] = r[i];
}

template <int N, bool TRANS> static void ldmatrix_layout() {
    std::vector<uint16_t> mats(N * 64);
    std::vector<int> slots(N * 8);
    for (int i = 0; i < N; i++)
        for (int r = 0; r < 8; r++) {
            slots[i * 8 + r] = row_slot(N, i, r);
            for (int c = 0; c < 8; c++)
                mats[i * 64 + r * 8 + c] = (uint16_t)(i << 12 | r << 8 | c << 4 | 5);
        }
    uint16_t *dm = upload(mats);
    int *ds = upload(slots);
    uint32_t *out = device_zeros<uint32_t>(32 * N);
    ULY_LAUNCH((ldmatrix_probe<N, TRANS>), 1, 32, N * 128, 0, dm, ds, out);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<uint32_t> h = download(out, 32 * N);
    for (int t = 0; t < 32; t++)
        for (int i = 0; i < N; i++)
            for (int half = 0; half < 2; half++) {
                int row = t / 4, col = 2 * (t % 4) + half;
                if (TRANS) std::swap(row, col);
                uint16_t want = mats[i * 64 + row * 8 + col];
                uint16_t got = (uint16_t)(h[t * N + i] >> (16 * half));
                CHECK(got == want, "x%d%s lane %d register %d half %d: 0x%04x, want 0x%04x", N,
                      TRANS ? ".trans" : "", t, i, half, got, want);
            }
    cudaFree(dm), cudaFree(ds), cudaFree(out);
}

TEST(ldmatrix_x1_lane_layout) { ldmatrix_layout<1, false>(); }
TEST(ldmatrix_x2_lane_layout) { ldmatrix_layout<2, false>(); }
TEST(ldmatrix_x4_lane_layout) { ldmatrix_layout<4, false>(); }
TEST(ldmatrix_x1_trans_lane_layout) { ldmatrix_layout<1, true>(); }
TEST(ldmatrix_x2_trans_lane_layout) { ldmatrix_layout<2, true>(); }
TEST(ldmatrix_x4_trans_lane_layout) { ldmatrix_layout<4, true>(); }

// ---------------------------------------------------------------------------------------------
// ldmatrix from sm_80 on reads only the addresses of lanes 0..8N-1: the PTX ISA requires valid
// addresses in every lane for sm_75 and below only ("For .num = .x1 and .num = .x2, addresses
// contained in lower threads can be copied to higher threads"). Here lanes 8N.. pass an address
// 2 bytes off the 16-byte alignment a row needs, which must be ignored, not reported.
template <int N> __global__ void ldmatrix_unused_lanes(const uint16_t *mats, uint32_t *out) {
    ULY_DYN_SMEM(uint16_t, smem);
    for (int e = threadIdx.x; e < N * 64; e += 32) smem[e] = mats[e];
    __syncthreads();
    const int lane = threadIdx.x;
    uint32_t r[N];
    uly_ldmatrix<N, false>(r, uly_smem_addr(smem + (lane < 8 * N ? lane * 8 : 1)));
    for (int i = 0; i < N; i++) out[lane * N + i] = r[i];
}

template <int N> static void ldmatrix_ignores_unused_lanes() {
    std::vector<uint16_t> mats(N * 64);
    for (int e = 0; e < N * 64; e++) mats[e] = (uint16_t)(0x1000 + e);
    uint16_t *dm = upload(mats);
    uint32_t *out = device_zeros<uint32_t>(32 * N);
    ULY_LAUNCH(ldmatrix_unused_lanes<N>, 1, 32, N * 128, 0, dm, out);
    CHECK(launch_error() == cudaSuccess, "x%d: the addresses of lanes %d.. were not ignored", N,
          8 * N);
    std::vector<uint32_t> h = download(out, 32 * N);
    for (int t = 0; t < 32; t++)
        for (int i = 0; i < N; i++)
            for (int half = 0; half < 2; half++) {
                uint16_t want = mats[i * 64 + (t / 4) * 8 + 2 * (t % 4) + half];
                uint16_t got = (uint16_t)(h[t * N + i] >> (16 * half));
                CHECK(got == want, "x%d lane %d register %d half %d: 0x%04x, want 0x%04x", N, t,
                      i, half, got, want);
            }
    cudaFree(dm), cudaFree(out);
}

TEST(ldmatrix_x1_x2_ignore_the_addresses_of_unused_lanes) {
    ldmatrix_ignores_unused_lanes<1>();
    ldmatrix_ignores_unused_lanes<2>();
}

// cp.async reads only src-size bytes of the source (PTX ISA, cp.async: "the remaining cp-size -
// src-size bytes ... are filled with zeros"): a 16-byte copy of a 4-byte allocation, whose other
// 12 bytes are not the source's to read (the AddressSanitizer build reports a read past them).
__global__ void cp_async_short_source(const uint32_t *src, uint32_t *out) {
    ULY_DYN_SMEM(uint32_t, smem);
    if (threadIdx.x == 0) uly_cp_async<16>(uly_smem_addr(smem), src, 4);
    uly_cp_async_wait_all();
    if (threadIdx.x == 0)
        for (int i = 0; i < 4; i++) out[i] = smem[i];
}

TEST(cp_async_reads_only_src_size_bytes) {
    uint32_t *src = upload(std::vector<uint32_t>{0x12345678u});
    uint32_t *out = device_zeros<uint32_t>(4);
    ULY_LAUNCH(cp_async_short_source, 1, 32, 16, 0, src, out);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<uint32_t> h = download(out, 4);
    CHECK(h[0] == 0x12345678u && h[1] == 0 && h[2] == 0 && h[3] == 0, "0x%x 0x%x 0x%x 0x%x",
          h[0], h[1], h[2], h[3]);
    cudaFree(src), cudaFree(out);
}

#ifdef ULY_EMU
// The emulator's count of ldmatrix bank conflicts (tests/test_flash.cu holds the kernels to it)
// against the bank rule applied by hand: lane l gives row address l * stride.
__global__ void ldmatrix_rows(int stride) {
    ULY_DYN_SMEM(unsigned char, smem);
    uint32_t r[4];
    uly_ldmatrix<4, false>(r, uly_smem_addr(smem + threadIdx.x * stride));
}

TEST(ldmatrix_bank_conflicts_are_counted) {
    const struct { int stride; unsigned long long extra; } cases[] = {
        {16, 0},   // a matrix's rows are 128 contiguous bytes: 8 groups
        {144, 0},  // rows padded by 16 bytes: groups 0, 1, ..., 7
        {128, 28}, // rows a 128-byte line apart: one group, 8 wavefronts per matrix
        {256, 28},
        {64, 12},  // groups 0, 4, 0, 4, ...: 4 wavefronts per matrix
        {0, 0},    // one address: a broadcast
    };
    for (const auto &c : cases) {
        const unsigned long long before = uly_emu_ldmatrix_conflicts();
        ULY_LAUNCH(ldmatrix_rows, 1, 32, 32 * 256 + 16, 0, c.stride);
        CHECK(launch_error() == cudaSuccess, "launch failed");
        const unsigned long long got = uly_emu_ldmatrix_conflicts() - before;
        CHECK(got == c.extra, "stride %d: %llu extra wavefronts, want %llu", c.stride, got,
              c.extra);
    }
}

// The same rule where the matrices differ and a repeated address is not the neighbouring row:
// lane l gives row address offsets[l].
__global__ void ldmatrix_row_table(const int *offsets) {
    ULY_DYN_SMEM(unsigned char, smem);
    uint32_t r[4];
    uly_ldmatrix<4, false>(r, uly_smem_addr(smem + offsets[threadIdx.x]));
}

TEST(ldmatrix_bank_conflicts_are_counted_per_matrix) {
    std::vector<int> alternate(32), one_bad(32);
    for (int l = 0; l < 32; l++) {
        alternate[l] = l % 2 * 128;  // 0, 128, 0, ...: each matrix, 2 addresses of group 0
        // Matrices 0, 2, 3: 8 rows in 8 groups; matrix 1: 8 rows 128 bytes apart, all in group 0.
        one_bad[l] = l / 8 == 1 ? 4096 + l % 8 * 128 : l * 16;
    }
    const struct { const char *name; const std::vector<int> &offsets; unsigned long long extra; }
        cases[] = {
            {"rows alternating between two addresses of one group", alternate, 4},  // 1 per matrix
            {"only matrix 1 in one group", one_bad, 7},
        };
    for (const auto &c : cases) {
        int *d = upload(c.offsets);
        const unsigned long long before = uly_emu_ldmatrix_conflicts();
        ULY_LAUNCH(ldmatrix_row_table, 1, 32, 8192, 0, d);
        CHECK(launch_error() == cudaSuccess, "launch failed");
        const unsigned long long got = uly_emu_ldmatrix_conflicts() - before;
        CHECK(got == c.extra, "%s: %llu extra wavefronts, want %llu", c.name, got, c.extra);
        cudaFree(d);
    }
}
#endif

// The attention pattern: S = Q K^T from ldmatrix(Q) (A) and ldmatrix(K) (B, K stored
// [key][dim]), S's accumulators repacked as the A operand P, then O = P V from ldmatrix.trans(V)
// (V stored [key][dim]). Q is 16x16, K 16x16, V 16x8.
__global__ void attention_chain(const __nv_bfloat16 *Q, const __nv_bfloat16 *K,
                                const __nv_bfloat16 *V, float *O) {
    ULY_DYN_SMEM(__nv_bfloat16, smem);
    __nv_bfloat16 *q = smem, *k = smem + 256, *v = smem + 512;
    for (int e = threadIdx.x; e < 256; e += 32) q[e] = Q[e], k[e] = K[e];
    for (int e = threadIdx.x; e < 128; e += 32) v[e] = V[e];
    __syncthreads();
    const int l = threadIdx.x;
    uint32_t qa[4];
    uly_ldmatrix<4, false>(qa, uly_smem_addr(q + (l % 16) * 16 + (l / 16) * 8));
    float s[2][4] = {};
    for (int nt = 0; nt < 2; nt++) {  // keys 8nt..8nt+7
        uint32_t kb[2];
        uly_ldmatrix<2, false>(kb, uly_smem_addr(k + (nt * 8 + l % 8) * 16 + (l / 8 % 2) * 8));
        uly_mma_m16n8k16<__nv_bfloat16>(s[nt], qa, kb, s[nt]);
    }
    uint32_t pa[4] = {pack<__nv_bfloat16>(s[0][0], s[0][1]), pack<__nv_bfloat16>(s[0][2], s[0][3]),
                      pack<__nv_bfloat16>(s[1][0], s[1][1]), pack<__nv_bfloat16>(s[1][2], s[1][3])};
    uint32_t vb[2];
    uly_ldmatrix<2, true>(vb, uly_smem_addr(v + (l % 16) * 8));
    float o[4] = {};
    uly_mma_m16n8k16<__nv_bfloat16>(o, pa, vb, o);
    for (int i = 0; i < 4; i++) O[c_row(l, i) * 8 + c_col(l, i)] = o[i];
}

TEST(ldmatrix_mma_chain_equals_gemm_loop) {
    std::vector<float> q(256), k(256), v(128);
    for (float &x : q) x = (float)small_int(-2, 2);
    for (float &x : k) x = (float)small_int(-2, 2);
    for (float &x : v) x = (float)small_int(-2, 2);
    auto to_bf16 = [](const std::vector<float> &f) {
        std::vector<__nv_bfloat16> h(f.size());
        for (size_t i = 0; i < f.size(); i++) h[i] = __float2bfloat16(f[i]);
        return h;
    };
    __nv_bfloat16 *Q = upload(to_bf16(q)), *K = upload(to_bf16(k)), *V = upload(to_bf16(v));
    float *O = device_zeros<float>(128);
    ULY_LAUNCH(attention_chain, 1, 32, 640 * 2, 0, Q, K, V, O);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<float> o = download(O, 128);
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 8; n++) {
            float want = 0;
            for (int key = 0; key < 16; key++) {
                float s = 0;  // |s| <= 64: exact in bf16
                for (int d = 0; d < 16; d++) s += q[m * 16 + d] * k[key * 16 + d];
                want += s * v[key * 8 + n];
            }
            CHECK(o[m * 8 + n] == want, "O(%d,%d) = %g, want %g", m, n, o[m * 8 + n], want);
        }
    cudaFree(Q), cudaFree(K), cudaFree(V), cudaFree(O);
}

// ---------------------------------------------------------------------------------------------
// Shuffles, as the CUDA programming guide states them for a warp split into groups of `width`
// lanes: __shfl_sync reads lane srcLane % width of the group; __shfl_up_sync lane - delta and
// __shfl_down_sync lane + delta, keeping their own value where that leaves the group;
// __shfl_xor_sync lane ^ laneMask, keeping its own value where that is in a later group.

enum { SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR };

struct ShflCase {
    int mode, arg, width;
};

static int shfl_reference(const ShflCase &c, int lane, const int *v) {
    int base = lane / c.width * c.width;
    switch (c.mode) {
    case SHFL_IDX: return v[base + c.arg % c.width];
    case SHFL_UP: return lane - base >= c.arg ? v[lane - c.arg] : v[lane];
    case SHFL_DOWN: return lane - base + c.arg < c.width ? v[lane + c.arg] : v[lane];
    default: return (lane ^ c.arg) < base + c.width ? v[lane ^ c.arg] : v[lane];
    }
}

__host__ __device__ inline int shfl_input(int tid) {
    return (tid / 32) * 1000 + (tid % 32) * 3 + 7;
}

// Block b runs case b on two warps.
__global__ void shfl_probe(const ShflCase *cases, int *out) {
    const ShflCase c = cases[blockIdx.x];
    const int v = shfl_input(threadIdx.x);
    int r;
    switch (c.mode) {
    case SHFL_IDX: r = __shfl_sync(0xffffffff, v, c.arg, c.width); break;
    case SHFL_UP: r = __shfl_up_sync(0xffffffff, v, c.arg, c.width); break;
    case SHFL_DOWN: r = __shfl_down_sync(0xffffffff, v, c.arg, c.width); break;
    default: r = __shfl_xor_sync(0xffffffff, v, c.arg, c.width); break;
    }
    out[blockIdx.x * 64 + threadIdx.x] = r;
}

TEST(shuffles_follow_the_programming_guide) {
    std::vector<ShflCase> cases;
    for (int width = 1; width <= 32; width *= 2) {
        for (int arg = 0; arg < 40; arg += 3) cases.push_back({SHFL_IDX, arg, width});
        for (int arg : {0, 1, 2, 3, 5, 8, 16, 31}) {
            cases.push_back({SHFL_UP, arg, width});
            cases.push_back({SHFL_DOWN, arg, width});
        }
        for (int arg = 0; arg < 32; arg++) cases.push_back({SHFL_XOR, arg, width});
    }
    ShflCase *dc = upload(cases);
    int *out = device_zeros<int>(cases.size() * 64);
    ULY_LAUNCH(shfl_probe, (unsigned)cases.size(), 64, 0, 0, dc, out);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<int> h = download(out, cases.size() * 64);
    static const char *names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                  "__shfl_xor_sync"};
    for (size_t b = 0; b < cases.size(); b++)
        for (int t = 0; t < 64; t++) {
            int v[32];
            for (int i = 0; i < 32; i++) v[i] = shfl_input(t / 32 * 32 + i);
            int want = shfl_reference(cases[b], t % 32, v), got = h[b * 64 + t];
            CHECK(got == want, "%s(arg %d, width %d), thread %d: %d, want %d",
                  names[cases[b].mode], cases[b].arg, cases[b].width, t, got, want);
        }
    cudaFree(dc), cudaFree(out);
}

// Each half-warp shuffles among itself with its own member mask, in divergent branches; values
// of 8 and 2 bytes move whole.
__global__ void shfl_halves(double *wide, float *narrow) {
    const int lane = threadIdx.x;
    double d = lane + 0.25;
    __nv_bfloat16 h = __float2bfloat16((float)lane);
    if (lane < 16) {
        d = __shfl_xor_sync(0x0000ffff, d, 1);
        h = __shfl_down_sync(0x0000ffff, h, 2, 16);
    } else {
        d = __shfl_xor_sync(0xffff0000, d, 2);
        h = __shfl_up_sync(0xffff0000, h, 2, 16);
    }
    wide[lane] = d;
    narrow[lane] = __bfloat162float(h);
}

TEST(shuffles_in_divergent_half_warps) {
    double *wide = device_zeros<double>(32);
    float *narrow = device_zeros<float>(32);
    ULY_LAUNCH(shfl_halves, 1, 32, 0, 0, wide, narrow);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<double> w = download(wide, 32);
    std::vector<float> n = download(narrow, 32);
    for (int l = 0; l < 32; l++) {
        double want_w = (l < 16 ? (l ^ 1) : (l ^ 2)) + 0.25;
        int in_group = l % 16;
        float want_n =
            (float)(l < 16 ? (in_group + 2 < 16 ? l + 2 : l) : (in_group >= 2 ? l - 2 : l));
        CHECK(w[l] == want_w, "lane %d: double %g, want %g", l, w[l], want_w);
        CHECK(n[l] == want_n, "lane %d: bf16 %g, want %g", l, n[l], want_n);
    }
    cudaFree(wide), cudaFree(narrow);
}

// ---------------------------------------------------------------------------------------------
// Votes and __syncwarp.

__global__ void votes(unsigned *out) {
    const int lane = threadIdx.x;
    const int pred = lane * 7 % 5 == 0;
    out[lane * 6 + 0] = __ballot_sync(0xffffffff, pred);
    out[lane * 6 + 1] = __any_sync(0xffffffff, lane == 17);
    out[lane * 6 + 2] = __all_sync(0xffffffff, lane < 32);
    out[lane * 6 + 3] = __all_sync(0xffffffff, lane != 9);
    out[lane * 6 + 4] = __any_sync(0xffffffff, 0);
    // Odd and even lanes vote apart; each ballot covers only its own member mask.
    out[lane * 6 + 5] =
        lane & 1 ? __ballot_sync(0xaaaaaaaa, 1) : __ballot_sync(0x55555555, lane < 8);
}

TEST(votes_cover_the_member_mask) {
    unsigned *out = device_zeros<unsigned>(32 * 6);
    ULY_LAUNCH(votes, 1, 32, 0, 0, out);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<unsigned> h = download(out, 32 * 6);
    unsigned ballot = 0;
    for (int l = 0; l < 32; l++) ballot |= (unsigned)(l * 7 % 5 == 0) << l;
    for (int l = 0; l < 32; l++) {
        const unsigned *o = &h[l * 6];
        CHECK(o[0] == ballot, "lane %d: ballot 0x%08x, want 0x%08x", l, o[0], ballot);
        CHECK(o[1] == 1 && o[2] == 1 && o[3] == 0 && o[4] == 0, "lane %d: any/all %u %u %u %u", l,
              o[1], o[2], o[3], o[4]);
        unsigned want = l & 1 ? 0xaaaaaaaau : 0x00000055u;
        CHECK(o[5] == want, "lane %d: half ballot 0x%08x, want 0x%08x", l, o[5], want);
    }
    cudaFree(out);
}

// Lanes exchange values through shared memory; __syncwarp orders the writes before the reads.
__global__ void syncwarp_exchange(int *out) {
    __shared__ int slot[64];
    const int t = threadIdx.x;
    slot[t] = t * 11 + (int)blockIdx.x;
    __syncwarp();
    out[blockIdx.x * 64 + t] = slot[t ^ 5];
}

TEST(syncwarp_orders_shared_memory_within_a_warp) {
    int *out = device_zeros<int>(8 * 64);
    ULY_LAUNCH(syncwarp_exchange, 8, 64, 0, 0, out);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<int> h = download(out, 8 * 64);
    for (int b = 0; b < 8; b++)
        for (int t = 0; t < 64; t++)
            CHECK(h[b * 64 + t] == (t ^ 5) * 11 + b, "block %d thread %d: %d", b, t, h[b * 64 + t]);
    cudaFree(out);
}

// A warp waits only for its own lanes: warp 0 shuffles while warp 1 already waits at the
// barrier, which a block-wide rendezvous would deadlock on.
__global__ void warp_alone(int *out) {
    int v = threadIdx.x;
    if (threadIdx.x < 32) v = __shfl_xor_sync(0xffffffff, v, 1);
    __syncthreads();
    out[threadIdx.x] = v;
}

TEST(warp_operations_wait_only_for_their_warp) {
    int *out = device_zeros<int>(64);
    ULY_LAUNCH(warp_alone, 1, 64, 0, 0, out);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<int> h = download(out, 64);
    for (int t = 0; t < 64; t++)
        CHECK(h[t] == (t < 32 ? t ^ 1 : t), "thread %d: %d", t, h[t]);
    cudaFree(out);
}

// ---------------------------------------------------------------------------------------------
// Barriers: a missing __syncthreads fails under the random schedule, the correct kernel passes.

template <bool SYNC> __global__ void neighbour_sum(int salt, int *out) {
    ULY_DYN_SMEM(int, smem);
    const int t = threadIdx.x, n = blockDim.x;
    smem[t] = t + salt;
    if (SYNC) __syncthreads();
    out[blockIdx.x * n + t] = smem[(t + 1) % n];
}

template <bool SYNC> static int neighbour_mismatches() {
    const int blocks = 4, n = 128, salt = 777;
    int *out = device_zeros<int>(blocks * n);
    ULY_LAUNCH(neighbour_sum<SYNC>, blocks, n, n * sizeof(int), 0, salt, out);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<int> h = download(out, blocks * n);
    int bad = 0;
    for (int i = 0; i < blocks * n; i++) bad += h[i] != (i % n + 1) % n + salt;
    cudaFree(out);
    return bad;
}

TEST(barrier_orders_shared_memory) {
    CHECK(neighbour_mismatches<true>() == 0, "the correct kernel failed");
}

#ifdef ULY_EMU
static bool contains(const std::string &s, const char *part) {
    return s.find(part) != std::string::npos;
}

// Thread t reads what thread t+1 wrote: in any order of the threads some thread reads first
// (they form a cycle), so without the barrier the poisoned shared memory always shows.
TEST(missing_syncthreads_fails_under_the_schedule) {
    CHECK(neighbour_mismatches<false>() > 0, "the kernel without __syncthreads passed");
}

// The order of threads is drawn anew after every barrier: tickets taken in arrival order.
__global__ void draw_tickets(int *counter, int *ticket) {
    ticket[threadIdx.x] = atomicAdd(&counter[0], 1);
    __syncthreads();
    ticket[blockDim.x + threadIdx.x] = atomicAdd(&counter[1], 1);
}

TEST(threads_run_in_a_random_order_between_barriers) {
    const int n = 128;
    int *counter = device_zeros<int>(2), *ticket = device_zeros<int>(2 * n);
    ULY_LAUNCH(draw_tickets, 1, n, 0, 0, counter, ticket);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<int> h = download(ticket, 2 * n);
    int first_in_index_order = 0, second_in_index_order = 0, same = 0;
    for (int t = 0; t < n; t++) {
        first_in_index_order += h[t] == t;
        second_in_index_order += h[n + t] == t;
        same += h[t] == h[n + t];
    }
    CHECK(first_in_index_order < n && second_in_index_order < n, "threads ran in index order");
    CHECK(same < n, "the order after the barrier repeats the order before it");
    cudaFree(counter), cudaFree(ticket);
}

// Failure detection: the launch fails, with a report that names kernel, block, threads, seed.
static std::string expect_failure(cudaError_t want) {
    cudaError_t e = launch_error();
    CHECK(e == want, "launch returned %s, want %s", cudaGetErrorName(e), cudaGetErrorName(want));
    std::string report = uly_emu_last_failure();
    CHECK(contains(report, ("seed " + std::to_string(uly_emu_seed())).c_str()),
          "report lacks the seed: %s", report.c_str());
    return report;
}

__global__ void diverging_barriers(int *out) {
    if (threadIdx.x < 64) __syncthreads();
    else __syncthreads();
    out[threadIdx.x] = 1;
}

TEST(divergent_barriers_are_reported) {
    int *out = device_zeros<int>(128);
    uly_emu_set_quiet(true);
    ULY_LAUNCH(diverging_barriers, 2, 128, 0, 0, out);
    std::string r = expect_failure(cudaErrorLaunchFailure);
    uly_emu_set_quiet(false);
    CHECK(contains(r, "diverging_barriers") && contains(r, "block (") &&
              contains(r, "different barriers") && contains(r, "test_emu.cu"),
          "report: %s", r.c_str());
    cudaFree(out);
}

__global__ void barrier_after_exit(int *out) {
    if (threadIdx.x >= 100) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}

TEST(barrier_after_an_exit_is_reported) {
    int *out = device_zeros<int>(128);
    uly_emu_set_quiet(true);
    ULY_LAUNCH(barrier_after_exit, 1, 128, 0, 0, out);
    std::string r = expect_failure(cudaErrorLaunchFailure);
    uly_emu_set_quiet(false);
    CHECK(contains(r, "exited"), "report: %s", r.c_str());
    cudaFree(out);
}

// Thread 0 waits in __syncwarp for lane 1, which waits at the barrier for thread 0.
__global__ void warp_barrier_deadlock(int *out) {
    if (threadIdx.x == 0) __syncwarp(0x3);
    else __syncthreads();
    out[threadIdx.x] = 1;
}

TEST(deadlock_is_reported_not_hung) {
    int *out = device_zeros<int>(64);
    uly_emu_set_quiet(true);
    ULY_LAUNCH(warp_barrier_deadlock, 1, 64, 0, 0, out);
    std::string r = expect_failure(cudaErrorLaunchFailure);
    uly_emu_set_quiet(false);
    CHECK(contains(r, "deadlock") && contains(r, "threads 1-63: wait at __syncthreads") &&
              contains(r, "thread 0: wait in __syncwarp, member mask 0x00000003"),
          "report: %s", r.c_str());
    cudaFree(out);
}

__global__ void lane_outside_mask(int *out) {
    out[threadIdx.x] = __shfl_sync(0x0000ffff, (int)threadIdx.x, 0);
}

__global__ void mask_past_partial_warp(int *out) {
    out[threadIdx.x] = __shfl_sync(0xffffffff, (int)threadIdx.x, 0);
}

TEST(member_masks_are_checked) {
    int *out = device_zeros<int>(64);
    uly_emu_set_quiet(true);
    ULY_LAUNCH(lane_outside_mask, 1, 32, 0, 0, out);
    std::string r = expect_failure(cudaErrorLaunchFailure);
    CHECK(contains(r, "not in its own member mask"), "report: %s", r.c_str());
    ULY_LAUNCH(mask_past_partial_warp, 1, 48, 0, 0, out);
    r = expect_failure(cudaErrorLaunchFailure);
    CHECK(contains(r, "do not exist"), "report: %s", r.c_str());
    uly_emu_set_quiet(false);
    cudaFree(out);
}

// The PTX ISA leaves the value read from a lane outside the shuffle unpredictable: the emulator
// hands back poison (all ones), so a kernel that relies on it shows. Each half-warp shuffles
// apart; a source in the other half is outside the member mask, a source in its own half is not.
__global__ void shfl_outside_mask(int *out) {
    const int lane = threadIdx.x;
    const unsigned mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    out[lane] = __shfl_sync(mask, lane + 100, lane ^ 16);
    out[32 + lane] = __shfl_sync(mask, lane + 100, lane ^ 1);
}

TEST(shuffle_from_a_lane_outside_the_mask_reads_poison) {
    int *out = device_zeros<int>(64);
    ULY_LAUNCH(shfl_outside_mask, 1, 32, 0, 0, out);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<int> h = download(out, 64);
    for (int l = 0; l < 32; l++) {
        CHECK(h[l] == -1, "lane %d read lane %d outside its mask: %d, want poison", l, l ^ 16,
              h[l]);
        CHECK(h[32 + l] == (l ^ 1) + 100, "lane %d: %d, want %d", l, h[32 + l], (l ^ 1) + 100);
    }
    cudaFree(out);
}

// ldmatrix and mma are .aligned: all threads of the warp must execute the same instruction,
// else the behaviour is undefined. Half-warps at two different ldmatrix never meet, which is
// reported as a deadlock. (The branches differ after the ldmatrix too, so the compiler cannot
// merge the two calls into one.)
__global__ void ldmatrix_two_sites(uint32_t *out) {
    ULY_DYN_SMEM(uint16_t, smem);
    const int t = threadIdx.x;
    uint32_t r[2];
    if (t < 16) {
        uly_ldmatrix<2, false>(r, uly_smem_addr(smem + t * 8));
        out[t] = r[0];
    } else {
        uly_ldmatrix<2, false>(r, uly_smem_addr(smem + (t - 16) * 8 + 256));
        out[64 - t] = r[1] * 3;
    }
}

TEST(lanes_at_different_ldmatrix_instructions_never_meet) {
    uint32_t *out = device_zeros<uint32_t>(64);
    uly_emu_set_quiet(true);
    ULY_LAUNCH(ldmatrix_two_sites, 1, 32, 1024, 0, out);
    std::string r = expect_failure(cudaErrorLaunchFailure);
    CHECK(contains(r, "deadlock") && contains(r, "ldmatrix"), "report: %s", r.c_str());
    uly_emu_set_quiet(false);
    cudaFree(out);
}
#endif

// A partial last warp works with a mask of the lanes it has.
__global__ void partial_warp_shuffle(int *out) {
    const unsigned mask = threadIdx.x < 32 ? 0xffffffffu : 0x0000ffffu;
    out[threadIdx.x] = __shfl_xor_sync(mask, (int)threadIdx.x, 1);
}

TEST(partial_warps_shuffle_among_their_lanes) {
    int *out = device_zeros<int>(48);
    ULY_LAUNCH(partial_warp_shuffle, 1, 48, 0, 0, out);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<int> h = download(out, 48);
    for (int t = 0; t < 48; t++) CHECK(h[t] == (t ^ 1), "thread %d: %d", t, h[t]);
    cudaFree(out);
}

// ---------------------------------------------------------------------------------------------
// ex2.approx.ftz.f32, as the PTX ISA states it: within 2 ulp of 2^x over the whole range; .ftz
// reads a subnormal input as zero and flushes a subnormal result to +0; 2^-inf = +0,
// 2^+-0 = 1, 2^inf = inf, NaN stays NaN.

__global__ void ex2_probe(const float *x, float *y, int n) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) y[i] = uly_ex2(x[i]);
}

TEST(ex2_follows_the_ptx_isa) {
    struct Special { float x, want; };
    const Special special[] = {
        {-INFINITY, 0.f}, {-0.f, 1.f},    {0.f, 1.f},    {INFINITY, INFINITY}, {-1e-40f, 1.f},
        {1e-40f, 1.f},    {-126.5f, 0.f}, {-127.f, 0.f}, {-200.f, 0.f},        {-126.f, 0x1p-126f}};
    const int ns = (int)(sizeof special / sizeof special[0]);
    std::vector<float> x;
    for (const Special &c : special) x.push_back(c.x);
    x.push_back(NAN);
    for (int i = 0; i < 4096; i++)
        x.push_back(-126.f + 253.f * (float)small_int(0, 1 << 20) / (1 << 20));
    const int n = (int)x.size();
    float *dx = upload(x), *dy = device_zeros<float>(x.size());
    ULY_LAUNCH(ex2_probe, (unsigned)(n + 127) / 128, 128, 0, 0, dx, dy, n);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    const std::vector<float> y = download(dy, x.size());
    for (int i = 0; i < ns; i++)
        CHECK(y[i] == special[i].want && !std::signbit(y[i]), "2^%g: %g, want %g", x[i], y[i],
              special[i].want);
    CHECK(std::isnan(y[ns]), "2^NaN: %g", y[ns]);
    for (int i = ns + 1; i < n; i++) {
        const double exact = std::exp2((double)x[i]), ulp = std::ldexp(1.0, std::ilogb(exact) - 23);
        CHECK(std::fabs(y[i] - exact) <= 2 * ulp, "2^%.9g: %.9g, exact %.17g", x[i], y[i], exact);
    }
    cudaFree(dx), cudaFree(dy);
}

// ---------------------------------------------------------------------------------------------
// cvt.rn.bf16x2.f32 and cvt.rn.f16x2.f32, as the kernels pack two results into a word
// (__floats2bfloat162_rn, __floats2half2_rn): the first float in the low half, each rounded to
// nearest even (PTX ISA, cvt), subnormals kept, a NaN still a NaN.

__global__ void pack2_probe(const float *x, uint32_t *bf, uint32_t *h, int n) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n) return;
    const __nv_bfloat162 b = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
    const __half2 f = __floats2half2_rn(x[2 * i], x[2 * i + 1]);
    memcpy(&bf[i], &b, 4);
    memcpy(&h[i], &f, 4);
}

static uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

// The top 16 bits, rounded to nearest even on the 16 below.
static uint16_t bf16_rne(float x) {
    const uint32_t u = f32_bits(x);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// 1 sign, 5 exponent (bias 15), 10 mantissa bits; below 2^-14, multiples of 2^-24.
static uint16_t f16_rne(float x) {
    const uint32_t u = f32_bits(x), sign = (u >> 16) & 0x8000, a = u & 0x7fffffff;
    if (a >= f32_bits(65520.f)) return (uint16_t)(sign | 0x7c00); /* 65504 + half an ulp */
    if (a < f32_bits(0x1p-14f)) /* m x 2^-24, m to nearest even (a carry makes 2^-14) */
        return (uint16_t)(sign | (uint32_t)nearbyint(std::fabs(x) * 0x1p24));
    uint32_t h = ((a >> 23) - 112) << 10 | (a & 0x7fffff) >> 13, rest = a & 0x1fff;
    h += rest > 0x1000 || (rest == 0x1000 && (h & 1)); /* a carry moves into the exponent */
    return (uint16_t)(sign | h);
}

static bool is_nan16(uint16_t b, bool bf16) {
    return bf16 ? (b & 0x7f80) == 0x7f80 && (b & 0x7f) : (b & 0x7c00) == 0x7c00 && (b & 0x3ff);
}

TEST(pack2_puts_the_first_float_low_and_rounds_to_nearest_even) {
    std::vector<float> x = {1.f, 2.f,                      /* 0x3f80, 0x4000; 0x3c00, 0x4000 */
                            1.f + 0x1p-8f, 1.f + 0x3p-8f,  /* bf16 ties: to even, down, up */
                            1.f + 0x1p-11f, 1.f + 0x3p-11f, /* f16 ties */
                            65519.f, 65520.f, 0x1p-25f, 0x3p-25f, 1e-30f, -0.f,
                            INFINITY, -INFINITY, 3.4e38f, -3.4e38f, NAN, -NAN};
    while (x.size() < 2 * 4096) { /* any bits: random exponents and mantissas */
        const uint32_t u = (uint32_t)small_int(0, 0xffff) << 16 | (uint32_t)small_int(0, 0xffff);
        float f;
        memcpy(&f, &u, 4);
        x.push_back(f);
    }
    const int n = (int)x.size() / 2;
    float *dx = upload(x);
    uint32_t *dbf = device_zeros<uint32_t>(n), *dh = device_zeros<uint32_t>(n);
    ULY_LAUNCH(pack2_probe, (unsigned)(n + 127) / 128, 128, 0, 0, dx, dbf, dh, n);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    const std::vector<uint32_t> bf = download(dbf, n), h = download(dh, n);
    int wrong = 0;
    for (int i = 0; i < 2 * n; i++) {
        const uint16_t gb = (uint16_t)(bf[i / 2] >> 16 * (i % 2));
        const uint16_t gh = (uint16_t)(h[i / 2] >> 16 * (i % 2));
        const bool nan = std::isnan(x[i]);
        const bool ok = nan ? is_nan16(gb, true) && is_nan16(gh, false)
                            : gb == bf16_rne(x[i]) && gh == f16_rne(x[i]);
        if (!ok && wrong++ < 8)
            CHECK(ok, "%s half of word %d, %a: bf16 0x%04x want 0x%04x, f16 0x%04x want 0x%04x",
                  i % 2 ? "high" : "low", i / 2, (double)x[i], gb, bf16_rne(x[i]), gh,
                  f16_rne(x[i]));
    }
    CHECK(wrong == 0, "%d of %d conversions wrong", wrong, 2 * n);
    cudaFree(dx), cudaFree(dbf), cudaFree(dh);
}

// ---------------------------------------------------------------------------------------------
// cp.async: groups, zero fill, waits.

// Thread t copies 16 bytes with src_bytes = t % 17 (0 = all zeros), then 8 and 4 bytes whole.
__global__ void cp_async_sizes(const unsigned char *src, unsigned char *out) {
    ULY_DYN_SMEM(unsigned char, smem);
    const int t = threadIdx.x;
    uly_cp_async<16>(uly_smem_addr(smem + t * 32), src + t * 32, t % 17);
    uly_cp_async<8>(uly_smem_addr(smem + t * 32 + 16), src + t * 32 + 16, 8);
    uly_cp_async<4>(uly_smem_addr(smem + t * 32 + 24), src + t * 32 + 24, 4);
    uly_cp_async_wait_all();
    for (int i = 0; i < 28; i++) out[t * 28 + i] = smem[t * 32 + i];
}

TEST(cp_async_copies_and_zero_fills) {
    std::vector<unsigned char> src(64 * 32);
    for (size_t i = 0; i < src.size(); i++) src[i] = (unsigned char)(i * 7 + 1);
    unsigned char *ds = upload(src), *out = device_zeros<unsigned char>(64 * 28);
    ULY_LAUNCH(cp_async_sizes, 1, 64, 64 * 32, 0, ds, out);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<unsigned char> h = download(out, 64 * 28);
    for (int t = 0; t < 64; t++)
        for (int i = 0; i < 28; i++) {
            unsigned char want = i < 16 && i >= t % 17 ? 0 : src[t * 32 + i];
            CHECK(h[t * 28 + i] == want, "thread %d byte %d: %d, want %d", t, i, h[t * 28 + i],
                  want);
        }
    cudaFree(ds), cudaFree(out);
}

// One warp of a cp.async kernel(src, seen) with as many words of shared memory as src has;
// returns the n_seen words the kernel wrote to seen.
static std::vector<uint32_t> run_copies(void (*kernel)(const uint32_t *, uint32_t *),
                                        const std::vector<uint32_t> &src, int n_seen) {
    uint32_t *ds = upload(src), *seen = device_zeros<uint32_t>(n_seen);
    ULY_LAUNCH(kernel, 1, 32, src.size() * 4, 0, ds, seen);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<uint32_t> h = download(seen, n_seen);
    cudaFree(ds), cudaFree(seen);
    return h;
}

// base, base + 1, ...: a copied word says where it came from.
static std::vector<uint32_t> numbered(int n, uint32_t base) {
    std::vector<uint32_t> v(n);
    for (int i = 0; i < n; i++) v[i] = base + i;
    return v;
}

// Three groups; wait_group<2>, <1>, <0> complete them oldest first. Under the emulator the
// groups still pending must hold poison (on a GPU they may or may not have landed).
__global__ void cp_async_groups(const uint32_t *src, uint32_t *seen) {
    ULY_DYN_SMEM(uint32_t, smem);
    const int t = threadIdx.x;
    for (int g = 0; g < 3; g++) {
        uly_cp_async<4>(uly_smem_addr(smem + g * 32 + t), src + g * 32 + t, 4);
        uly_cp_async_commit();
    }
    uly_cp_async_wait<2>();
    for (int g = 0; g < 3; g++) seen[0 * 96 + g * 32 + t] = smem[g * 32 + t];
    uly_cp_async_wait<1>();
    for (int g = 0; g < 3; g++) seen[1 * 96 + g * 32 + t] = smem[g * 32 + t];
    uly_cp_async_wait<0>();
    for (int g = 0; g < 3; g++) seen[2 * 96 + g * 32 + t] = smem[g * 32 + t];
}

TEST(cp_async_wait_group_completes_the_oldest_groups) {
    const std::vector<uint32_t> src = numbered(96, 0x1000u);
    const std::vector<uint32_t> h = run_copies(cp_async_groups, src, 3 * 96);
    for (int step = 0; step < 3; step++)       // after wait_group<2 - step>
        for (int g = 0; g < 3; g++)            // group g, committed g-th
            for (int t = 0; t < 32; t++) {
                uint32_t got = h[step * 96 + g * 32 + t];
                if (g <= step)
                    CHECK(got == src[g * 32 + t], "step %d group %d thread %d: 0x%x", step, g, t,
                          got);
#ifdef ULY_EMU
                else
                    CHECK(got == 0xffffffffu, "step %d: group %d landed before its wait: 0x%x",
                          step, g, got);
#endif
            }
}

// wait_group waits for committed groups only (the PTX ISA defines wait_all as commit_group then
// wait_group 0): a copy issued after the last commit belongs to no group, and under the
// emulator it stays poison through wait_group 0 until wait_all commits and waits for it.
__global__ void cp_async_uncommitted(const uint32_t *src, uint32_t *seen) {
    ULY_DYN_SMEM(uint32_t, smem);
    const int t = threadIdx.x;
    uly_cp_async<4>(uly_smem_addr(smem + t), src + t, 4);
    uly_cp_async_commit();
    uly_cp_async<4>(uly_smem_addr(smem + 32 + t), src + 32 + t, 4);
    uly_cp_async_wait<0>();
    seen[t] = smem[t];
    seen[32 + t] = smem[32 + t];
    uly_cp_async_wait_all();
    seen[64 + t] = smem[32 + t];
}

TEST(cp_async_wait_group_leaves_uncommitted_copies) {
    const std::vector<uint32_t> src = numbered(64, 0x2000u);
    const std::vector<uint32_t> h = run_copies(cp_async_uncommitted, src, 96);
    for (int t = 0; t < 32; t++) {
        CHECK(h[t] == src[t], "thread %d: committed copy 0x%x", t, h[t]);
#ifdef ULY_EMU
        CHECK(h[32 + t] == 0xffffffffu, "thread %d: uncommitted copy landed at wait_group 0: 0x%x",
              t, h[32 + t]);
#endif
        CHECK(h[64 + t] == src[32 + t], "thread %d: after wait_all 0x%x", t, h[64 + t]);
    }
}

// Groups keep their count from one round of copies to the next, empty groups included (an empty
// group is trivially complete). wait_group N returns at once while N or fewer groups are
// pending; under the emulator a group it need not wait for still holds poison.
__device__ inline void cp_async_word(uint32_t *smem, const uint32_t *src, int slot) {
    const int i = slot * 32 + (int)threadIdx.x;
    uly_cp_async<4>(uly_smem_addr(smem + i), src + i, 4);
    uly_cp_async_commit();
}

__global__ void cp_async_rounds(const uint32_t *src, uint32_t *seen) {
    ULY_DYN_SMEM(uint32_t, smem);
    const int t = threadIdx.x;
    cp_async_word(smem, src, 0);
    cp_async_word(smem, src, 1);
    uly_cp_async_wait<0>();                // round 1: both groups complete
    cp_async_word(smem, src, 2);
    uly_cp_async_wait<2>();                // 1 group pending <= 2: nothing to wait for
    seen[0 * 32 + t] = smem[2 * 32 + t];
    uly_cp_async_commit();                 // an empty group
    uly_cp_async_wait<1>();                // slot 2's group is not among the 1 most recent
    seen[1 * 32 + t] = smem[2 * 32 + t];
    cp_async_word(smem, src, 3);
    uly_cp_async_wait<1>();                // slot 3's group is the 1 most recent: may pend
    seen[2 * 32 + t] = smem[3 * 32 + t];
    uly_cp_async_wait<0>();
    seen[3 * 32 + t] = smem[3 * 32 + t];
}

TEST(cp_async_wait_group_counts_groups_across_rounds) {
    const std::vector<uint32_t> src = numbered(128, 0x3000u);
    const std::vector<uint32_t> h = run_copies(cp_async_rounds, src, 128);
    for (int t = 0; t < 32; t++) {
#ifdef ULY_EMU
        CHECK(h[t] == 0xffffffffu, "thread %d: wait_group 2 completed a group: 0x%x", t, h[t]);
        CHECK(h[64 + t] == 0xffffffffu, "thread %d: wait_group 1 completed the newest group: 0x%x",
              t, h[64 + t]);
#endif
        CHECK(h[32 + t] == src[64 + t], "thread %d: slot 2 after wait_group 1: 0x%x", t,
              h[32 + t]);
        CHECK(h[96 + t] == src[96 + t], "thread %d: slot 3 after wait_group 0: 0x%x", t,
              h[96 + t]);
    }
}

#ifdef ULY_EMU
// A store to the destination of a copy still in flight races with the copy, which may land
// after it (the wait missing before a tile is reused): the launch fails, whether a later wait
// completes the copy or none does. (Caught where the store comes before the copy lands: a store
// by another thread, unordered with the wait, would be caught in some schedules only.)
__global__ void store_over_a_copy_in_flight(const uint32_t *src, int wait) {
    ULY_DYN_SMEM(uint32_t, smem);
    const int t = threadIdx.x;
    uly_cp_async<4>(uly_smem_addr(smem + t), src + t, 4);
    uly_cp_async_commit();
    if (t == 7) smem[t] = 0;
    if (wait) uly_cp_async_wait_all();
}

TEST(a_store_over_a_copy_in_flight_is_reported) {
    uint32_t *src = upload(numbered(32, 0x4000u));
    uly_emu_set_quiet(true);
    for (int wait = 0; wait < 2; wait++) {
        ULY_LAUNCH(store_over_a_copy_in_flight, 1, 32, 128, 0, src, wait);
        const std::string r = expect_failure(cudaErrorLaunchFailure);
        CHECK(contains(r, "shared 0x1c..0x20, where a copy by thread 7 ") &&
                  contains(r, "was written before a wait completed the copy") &&
                  contains(r, wait ? "(found completing it)" : "(found at the end of the block)"),
              "wait %d: report: %s", wait, r.c_str());
    }
    uly_emu_set_quiet(false);
    cudaFree(src);
}

// Without the wait the destination still holds the poison; and a thread's wait completes only
// its own copies, so thread 0, which never waits, leaves its row poisoned for everyone.
__global__ void cp_async_without_wait(const uint32_t *src, uint32_t *seen) {
    ULY_DYN_SMEM(uint32_t, smem);
    const int t = threadIdx.x;
    smem[t] = 5;
    uly_cp_async<4>(uly_smem_addr(smem + t), src + t, 4);
    uly_cp_async_commit();
    seen[t] = smem[t];
    if (t != 0) uly_cp_async_wait<0>();
    __syncthreads();
    seen[32 + t] = smem[t];
}

TEST(cp_async_missing_wait_reads_poison) {
    const std::vector<uint32_t> h =
        run_copies(cp_async_without_wait, std::vector<uint32_t>(32, 42), 64);
    for (int t = 0; t < 32; t++) {
        CHECK(h[t] == 0xffffffffu, "thread %d read 0x%x before its wait", t, h[t]);
        uint32_t want = t == 0 ? 0xffffffffu : 42;
        CHECK(h[32 + t] == want, "thread %d after the barrier: 0x%x, want 0x%x", t, h[32 + t],
              want);
    }
}

__global__ void cp_async_out_of_bounds(const uint32_t *src) {
    ULY_DYN_SMEM(uint32_t, smem);
    uly_cp_async<16>(uly_smem_addr(smem + 4 * threadIdx.x), src, 16);
    uly_cp_async_wait_all();
}

__global__ void cp_async_misaligned(const uint32_t *src) {
    ULY_DYN_SMEM(uint32_t, smem);
    uly_cp_async<16>(uly_smem_addr(smem + 1), src, 16);
    uly_cp_async_wait_all();
}

__global__ void ldmatrix_out_of_bounds(uint32_t *out) {
    ULY_DYN_SMEM(uint16_t, smem);
    uint32_t r[4];
    uly_ldmatrix<4, false>(r, uly_smem_addr(smem + threadIdx.x * 8));
    out[threadIdx.x] = r[0];
}

TEST(shared_memory_bounds_are_checked) {
    std::vector<uint32_t> src(64, 1);
    uint32_t *ds = upload(src);
    uly_emu_set_quiet(true);
    ULY_LAUNCH(cp_async_out_of_bounds, 1, 32, 32 * 16 - 16, 0, ds);
    std::string r = expect_failure(cudaErrorIllegalAddress);
    CHECK(contains(r, "cp.async") && contains(r, "thread 31"), "report: %s", r.c_str());
    ULY_LAUNCH(cp_async_misaligned, 1, 32, 1024, 0, ds);
    r = expect_failure(cudaErrorMisalignedAddress);
    ULY_LAUNCH(ldmatrix_out_of_bounds, 1, 32, 31 * 16, 0, ds);
    r = expect_failure(cudaErrorIllegalAddress);
    CHECK(contains(r, "ldmatrix") && contains(r, "lane 31"), "report: %s", r.c_str());
    uly_emu_set_quiet(false);
    cudaFree(ds);
}

// Operands the PTX ISA rules out: an ldmatrix row is 16 bytes that four lanes load together, so
// its address "must be naturally aligned" to 16 bytes (lane 5's is 8 bytes off); cp.async's
// source, like its destination, is aligned to cp-size; src-size larger than cp-size is undefined.
__global__ void ldmatrix_misaligned(uint32_t *out) {
    ULY_DYN_SMEM(uint16_t, smem);
    const int row = threadIdx.x % 8;
    uint32_t r[1];
    uly_ldmatrix<1, false>(r, uly_smem_addr(smem + row * 8 + (row == 5 ? 4 : 0)));
    out[threadIdx.x] = r[0];
}

__global__ void cp_async_source_misaligned(const uint32_t *src) {
    ULY_DYN_SMEM(uint32_t, smem);
    uly_cp_async<16>(uly_smem_addr(smem + 4 * threadIdx.x), src + 2, 16);
    uly_cp_async_wait_all();
}

__global__ void cp_async_src_size_past_cp_size(const uint32_t *src) {
    ULY_DYN_SMEM(uint32_t, smem);
    uly_cp_async<4>(uly_smem_addr(smem + threadIdx.x), src, 8);
    uly_cp_async_wait_all();
}

TEST(misaligned_and_oversized_operands_are_reported) {
    std::vector<uint32_t> src(64, 1);
    uint32_t *ds = upload(src);
    uly_emu_set_quiet(true);
    ULY_LAUNCH(ldmatrix_misaligned, 1, 32, 1024, 0, ds);
    std::string r = expect_failure(cudaErrorMisalignedAddress);
    CHECK(contains(r, "ldmatrix") && contains(r, "lane 5"), "report: %s", r.c_str());
    ULY_LAUNCH(cp_async_source_misaligned, 1, 32, 1024, 0, ds);
    r = expect_failure(cudaErrorMisalignedAddress);
    CHECK(contains(r, "cp.async"), "report: %s", r.c_str());
    ULY_LAUNCH(cp_async_src_size_past_cp_size, 1, 32, 1024, 0, ds);
    r = expect_failure(cudaErrorLaunchFailure);
    CHECK(contains(r, "src-size"), "report: %s", r.c_str());
    // Lane 31's row starts inside the 504 bytes of shared memory and ends past them.
    ULY_LAUNCH(ldmatrix_out_of_bounds, 1, 32, 31 * 16 + 8, 0, ds);
    r = expect_failure(cudaErrorIllegalAddress);
    CHECK(contains(r, "ldmatrix") && contains(r, "lane 31"), "report: %s", r.c_str());
    uly_emu_set_quiet(false);
    cudaFree(ds);
}
#endif

// ---------------------------------------------------------------------------------------------
// Atomics, grids, shared memory, runtime.

__global__ void count_up(float *fsum, int *isum) {
    atomicAdd(fsum, 1.0f);
    atomicAdd(isum, 2);
}

TEST(atomics_add_across_concurrent_blocks) {
    float *f = device_zeros<float>(1);
    int *i = device_zeros<int>(1);
    ULY_LAUNCH(count_up, 64, 128, 0, 0, f, i);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    CHECK(download(f, 1)[0] == 8192.0f, "float sum %g", download(f, 1)[0]);
    CHECK(download(i, 1)[0] == 16384, "int sum %d", download(i, 1)[0]);
    cudaFree(f), cudaFree(i);
}

// The programming guide's atomics store f(old, val) and return old. Whatever the order of the
// threads: the adds hand out 0..n-1 once each; max and min end at the extremes; of the CASes
// from 0, one returns 0 and the rest the winner's value; the exchanges and the final value
// hold 0..n once each.
__global__ void atomic_rmw(int *ints, unsigned *uints, float *f, int *old, float *fold) {
    const int t = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    old[0 * 256 + t] = atomicAdd(&ints[0], 1);
    fold[t] = atomicAdd(&f[0], 1.0f);
    atomicMax(&ints[1], t - 100);
    atomicMin(&ints[2], t - 100);
    atomicMax(&uints[0], (unsigned)t);
    atomicMin(&uints[1], (unsigned)t + 7);
    old[1 * 256 + t] = atomicCAS(&ints[3], 0, t + 1);
    old[2 * 256 + t] = atomicExch(&ints[4], t + 1);
}

TEST(atomics_store_the_operation_and_return_the_old_value) {
    const int n = 256;
    std::vector<int> ints = {0, -1000, 1000, 0, 0};
    std::vector<unsigned> uints = {0, 0xffffffffu};
    int *di = upload(ints), *old = device_zeros<int>(3 * n);
    unsigned *du = upload(uints);
    float *df = device_zeros<float>(1), *fold = device_zeros<float>(n);
    ULY_LAUNCH(atomic_rmw, 4, 64, 0, 0, di, du, df, old, fold);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<int> hi = download(di, 5), ho = download(old, 3 * n);
    std::vector<unsigned> hu = download(du, 2);
    std::vector<float> hf = download(df, 1), hfold = download(fold, n);
    CHECK(hi[0] == n && hf[0] == (float)n, "sums %d %g", hi[0], hf[0]);
    std::vector<int> add_seen(n), fadd_seen(n), exch_seen(n + 1);
    int cas_zero = 0, cas_winner = 0;
    for (int t = 0; t < n; t++) {
        if (ho[t] >= 0 && ho[t] < n) add_seen[ho[t]]++;
        if (hfold[t] >= 0 && hfold[t] < n) fadd_seen[(int)hfold[t]]++;
        cas_zero += ho[n + t] == 0;
        cas_winner += ho[n + t] == hi[3];
        if (ho[2 * n + t] >= 0 && ho[2 * n + t] <= n) exch_seen[ho[2 * n + t]]++;
    }
    if (hi[4] >= 0 && hi[4] <= n) exch_seen[hi[4]]++;
    for (int v = 0; v < n; v++)
        CHECK(add_seen[v] == 1 && fadd_seen[v] == 1, "atomicAdd returned %d %d times (int), %d "
              "times (float)", v, add_seen[v], fadd_seen[v]);
    CHECK(hi[1] == n - 1 - 100 && hi[2] == -100, "int max %d, min %d", hi[1], hi[2]);
    CHECK(hu[0] == (unsigned)n - 1 && hu[1] == 7u, "unsigned max %u, min %u", hu[0], hu[1]);
    CHECK(hi[3] >= 1 && hi[3] <= n && cas_zero == 1 && cas_winner == n - 1,
          "atomicCAS: final %d, %d threads saw 0, %d the winner", hi[3], cas_zero, cas_winner);
    for (int v = 0; v <= n; v++)
        CHECK(exch_seen[v] == 1, "atomicExch: value %d seen %d times", v, exch_seen[v]);
    cudaFree(di), cudaFree(old), cudaFree(du), cudaFree(df), cudaFree(fold);
}

__global__ void add_pairs(float *p) { uly_red_add2(p, 1.0f, 2.0f); }

// uly_red_add2 adds both elements atomically; sm_90's one vector access needs 8-byte alignment,
// which the emulator holds it to (a GPU before sm_90 adds element by element and would not).
TEST(paired_atomic_adds_sum_and_need_8_byte_alignment) {
    float *f = device_zeros<float>(4);
    ULY_LAUNCH(add_pairs, 64, 128, 0, 0, f);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<float> h = download(f, 4);
    CHECK(h[0] == 8192.0f && h[1] == 16384.0f && h[2] == 0.0f, "sums %g %g %g", h[0], h[1], h[2]);
#ifdef ULY_EMU
    uly_emu_set_quiet(true);
    ULY_LAUNCH(add_pairs, 1, 32, 0, 0, f + 1);
    std::string r = expect_failure(cudaErrorMisalignedAddress);
    CHECK(contains(r, "red.global.add.v2.f32") && contains(r, "8-byte"), "report: %s", r.c_str());
    uly_emu_set_quiet(false);
#endif
    cudaFree(f);
}

// atomicAdd of a float is atom.add.f32 without .noftz, which the PTX ISA says flushes
// subnormal inputs and results to sign-preserving zero on global memory and keeps them on shared
// memory; red.global.add.v2.f32 flushes as red.add.f32 does. Cases: a subnormal added, a
// subnormal in memory, a positive and a negative subnormal sum, a subnormal added to a normal.
enum { N_NEAR_ZERO = 5 };
__global__ void add_near_zero(float *g, float *s_out, float *pair) {
    ULY_DYN_SMEM(float, s);
    const float m = FLT_MIN;
    const float start[N_NEAR_ZERO] = {0.f, m / 4, 1.5f * m, -1.5f * m, m};
    const float add[N_NEAR_ZERO] = {m / 4, 0.f, -m, m, m / 4};
    for (int i = 0; i < N_NEAR_ZERO; i++) {
        g[i] = s[i] = start[i];
        atomicAdd(&g[i], add[i]);
        atomicAdd(&s[i], add[i]);
        s_out[i] = s[i];
    }
    pair[0] = 1.5f * m, pair[1] = -1.5f * m;
    uly_red_add2(pair, -m, m);
}

#ifdef ULY_EMU
__global__ void red_on_shared(int at) {
    ULY_DYN_SMEM(float, s);
    uly_red_add2(s + at, 1.f, 1.f);
}
#endif

static bool same_bits(float a, float b) { return !memcmp(&a, &b, sizeof a); }

TEST(float_atomics_flush_subnormals_on_global_memory_only) {
    const float m = FLT_MIN;
    const float global[N_NEAR_ZERO] = {0.f, 0.f, 0.f, -0.f, m};
    const float shared[N_NEAR_ZERO] = {m / 4, m / 4, m / 2, -m / 2, 1.25f * m};
    float *g = device_zeros<float>(N_NEAR_ZERO), *s = device_zeros<float>(N_NEAR_ZERO);
    float *pair = device_zeros<float>(2);
    ULY_LAUNCH(add_near_zero, 1, 1, N_NEAR_ZERO * sizeof(float), 0, g, s, pair);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<float> hg = download(g, N_NEAR_ZERO), hs = download(s, N_NEAR_ZERO);
    std::vector<float> hp = download(pair, 2);
    for (int i = 0; i < N_NEAR_ZERO; i++)
        CHECK(same_bits(hg[i], global[i]) && same_bits(hs[i], shared[i]),
              "case %d: global %a (want %a), shared %a (want %a)", i, hg[i], global[i], hs[i],
              shared[i]);
    CHECK(same_bits(hp[0], 0.f) && same_bits(hp[1], -0.f), "red.global.add.v2.f32: %a %a",
          hp[0], hp[1]);
#ifdef ULY_EMU
    uly_emu_set_quiet(true);
    for (int at : {0, 4}) { /* in the launch's 8 bytes, and past them in the shared window */
        ULY_LAUNCH(red_on_shared, 1, 32, 8, 0, at);
        std::string r = expect_failure(cudaErrorIllegalAddress);
        CHECK(contains(r, "red.global.add.v2.f32") && contains(r, "shared"), "at %d: %s", at,
              r.c_str());
    }
    uly_emu_set_quiet(false);
#endif
    cudaFree(g), cudaFree(s), cudaFree(pair);
}

// Every thread of a 3D grid of 3D blocks finds its global index exactly once.
__global__ void index_3d(int *hits, int *where) {
    const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    const int id = block * blockDim.x * blockDim.y * blockDim.z + thread;
    atomicAdd(&hits[id], 1);
    where[id] =
        (int)(blockIdx.x | blockIdx.y << 4 | blockIdx.z << 8 | threadIdx.x << 12 |
              threadIdx.y << 16 | threadIdx.z << 20 | (thread % 32 == (int)uly_lane_id()) << 24);
}

TEST(grids_and_blocks_in_three_dimensions) {
    const dim3 grid(3, 2, 2), block(4, 2, 5);
    const int n = 12 * 40;
    int *hits = device_zeros<int>(n), *where = device_zeros<int>(n);
    ULY_LAUNCH(index_3d, grid, block, 0, 0, hits, where);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<int> h = download(hits, n), w = download(where, n);
    for (int id = 0; id < n; id++) {
        int b = id / 40, t = id % 40;
        int want = b % 3 | (b / 3 % 2) << 4 | (b / 6) << 8 | (t % 4) << 12 | (t / 4 % 2) << 16 |
                   (t / 8) << 20 | 1 << 24;
        CHECK(h[id] == 1 && w[id] == want, "thread %d: %d hits, 0x%x, want 0x%x", id, h[id],
              w[id], want);
    }
    cudaFree(hits), cudaFree(where);
}

// Each block sums its own values through a static __shared__ array; blocks run concurrently.
__global__ void block_sums(const int *in, int *out) {
    __shared__ int part[128];
    part[threadIdx.x] = in[blockIdx.x * 128 + threadIdx.x];
    __syncthreads();
    for (int s = 64; s > 0; s /= 2) {
        if ((int)threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = part[0];
}

TEST(static_shared_memory_is_per_block) {
    std::vector<int> in(64 * 128);
    for (size_t i = 0; i < in.size(); i++) in[i] = (int)(i % 1000);
    int *din = upload(in), *out = device_zeros<int>(64);
    ULY_LAUNCH(block_sums, 64, 128, 0, 0, din, out);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<int> h = download(out, 64);
    for (int b = 0; b < 64; b++) {
        int want = 0;
        for (int t = 0; t < 128; t++) want += in[b * 128 + t];
        CHECK(h[b] == want, "block %d: %d, want %d", b, h[b], want);
    }
    cudaFree(din), cudaFree(out);
}

// 100 KB of dynamic shared memory needs cudaFuncSetAttribute, as on the GPU.
__global__ void big_smem(int *out) {
    ULY_DYN_SMEM(int, smem);
    const int n = 25600;
    for (int i = threadIdx.x; i < n; i += blockDim.x) smem[i] = i;
    __syncthreads();
    int sum = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += smem[n - 1 - i];
    atomicAdd(out, sum);
}

TEST(dynamic_shared_memory_over_48k_needs_the_attribute) {
    const int bytes = 100 * 1024;
    int *out = device_zeros<int>(1);
    ULY_LAUNCH(big_smem, 1, 256, bytes, 0, out);
    CHECK(launch_error() == cudaErrorInvalidValue, "launch without the attribute ran");
    CHECK(cudaFuncSetAttribute(big_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) ==
              cudaSuccess,
          "attribute refused");
    ULY_LAUNCH(big_smem, 1, 256, bytes, 0, out);
    CHECK(launch_error() == cudaSuccess, "launch with the attribute failed");
    CHECK(download(out, 1)[0] == 25600 * 25599 / 2, "sum %d", download(out, 1)[0]);
    cudaFree(out);
}

__global__ void smem_offsets(uint32_t *out) {
    ULY_DYN_SMEM(unsigned char, smem);
    out[0] = uly_smem_addr(smem + 100) - uly_smem_addr(smem);
    out[1] = (uint32_t)(reinterpret_cast<uintptr_t>(smem) % 16);
}

TEST(shared_addresses_are_offsets_in_the_shared_window) {
    uint32_t *out = device_zeros<uint32_t>(2);
    ULY_LAUNCH(smem_offsets, 1, 32, 256, 0, out);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<uint32_t> h = download(out, 2);
    CHECK(h[0] == 100 && h[1] == 0, "offset %u, alignment remainder %u", h[0], h[1]);
    cudaFree(out);
}

// Host threads launch at once (the local communicator runs a thread per rank); each sees its
// own results and its own errors.
__global__ void add_two(int *sum) { atomicAdd(sum, 2); }

TEST(host_threads_launch_concurrently) {
    const int threads = 4, rounds = 20;
    std::vector<int *> sums(threads);
    std::vector<cudaError_t> errors(threads, cudaSuccess);
    std::vector<std::thread> ranks;
    for (int t = 0; t < threads; t++)
        ranks.emplace_back([&, t] {
            sums[t] = device_zeros<int>(1);
            for (int r = 0; r < rounds; r++) ULY_LAUNCH(add_two, 8, 64, 0, 0, sums[t]);
            errors[t] = launch_error();
        });
    for (auto &r : ranks) r.join();
    for (int t = 0; t < threads; t++) {
        int sum = download(sums[t], 1)[0];
        CHECK(errors[t] == cudaSuccess, "thread %d: %s", t, cudaGetErrorString(errors[t]));
        CHECK(sum == rounds * 8 * 64 * 2, "thread %d: sum %d", t, sum);
        cudaFree(sums[t]);
    }
}

// The error of a launch configuration the device cannot run: cudaErrorInvalidValue from CUDA 13's
// runtime (seen on an H100 with CUDA 13.0), cudaErrorInvalidConfiguration before it.
static const cudaError_t bad_configuration =
    CUDART_VERSION >= 13000 ? cudaErrorInvalidValue : cudaErrorInvalidConfiguration;

TEST(bad_launch_configurations_are_refused) {
    int *out = device_zeros<int>(1);
    cudaError_t e;
    ULY_LAUNCH(count_up, 1, 2048, 0, 0, (float *)nullptr, out);
    CHECK((e = launch_error()) == bad_configuration, "2048 threads per block: %s",
          cudaGetErrorName(e));
    ULY_LAUNCH(count_up, dim3(1, 70000), 32, 0, 0, (float *)nullptr, out);
    CHECK((e = launch_error()) == bad_configuration, "grid.y of 70000: %s",
          cudaGetErrorName(e));
    ULY_LAUNCH(count_up, dim3(0x80000000u), 32, 0, 0, (float *)nullptr, out);
    CHECK((e = launch_error()) == bad_configuration, "grid.x of 2^31: %s",
          cudaGetErrorName(e));
    cudaFree(out);
}

// cudaPeekAtLastError returns the last error and, unlike cudaGetLastError, leaves it in place
// (CUDA Runtime API, Error Handling).
TEST(peek_at_last_error_leaves_the_error_for_get_last_error) {
    int *out = device_zeros<int>(1);
    ULY_LAUNCH(count_up, 1, 2048, 0, 0, (float *)nullptr, out);
    const cudaError_t p1 = cudaPeekAtLastError(), p2 = cudaPeekAtLastError();
    CHECK(p1 == bad_configuration && p2 == p1, "peeks: %s, %s", cudaGetErrorName(p1),
          cudaGetErrorName(p2));
    const cudaError_t g1 = cudaGetLastError(), g2 = cudaGetLastError();
    CHECK(g1 == bad_configuration && g2 == cudaSuccess, "gets after peeks: %s, %s",
          cudaGetErrorName(g1), cudaGetErrorName(g2));
    cudaFree(out);
}

TEST(runtime_streams_events_and_copies) {
    cudaStream_t s = nullptr;
    cudaEvent_t start = nullptr, stop = nullptr;
    CHECK(cudaStreamCreate(&s) == cudaSuccess, "stream");
    CHECK(cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess,
          "events");
    int *d = nullptr;
    CHECK(cudaMalloc(&d, 64 * sizeof(int)) == cudaSuccess, "malloc");
    cudaEventRecord(start, s);
    cudaMemsetAsync(d, 0, 64 * sizeof(int), s);
    ULY_LAUNCH(count_up, 2, 32, 0, s, (float *)(d + 8), d);
    std::vector<int> h(64, 7);
    cudaMemcpyAsync(d + 32, h.data(), 32 * sizeof(int), cudaMemcpyHostToDevice, s);
    cudaEventRecord(stop, s);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess, "stream sync");
    float ms = -1;
    CHECK(cudaEventElapsedTime(&ms, start, stop) == cudaSuccess && ms >= 0, "elapsed %g", ms);
    h = download(d, 64);
    CHECK(h[0] == 128 && h[1] == 0 && h[32] == 7 && h[63] == 7, "%d %d %d %d", h[0], h[1], h[32],
          h[63]);
    CHECK(cudaGetLastError() == cudaSuccess, "error left over");
    CHECK(strlen(cudaGetErrorString(cudaErrorIllegalAddress)) > 0, "error string");
    cudaFree(d);
    cudaEventDestroy(start), cudaEventDestroy(stop);
    cudaStreamDestroy(s);
}

#ifdef ULY_EMU
// ---------------------------------------------------------------------------------------------
// Streams run their work after the call that queues it, each in order, on a worker of its own.
// A stalled stream (uly_emu_stall_stream) holds its work still, so a test can look at device
// memory (host memory here) before and after the work runs.

__global__ void scale_add(int *x, int mul, int add) { *x = *x * mul + add; }

static int peek(const int *d) {  // device memory read in place: emulator only
    return *(const volatile int *)d;
}

// A query's "not ready" is also the thread's last error (see the test after this): the tests
// take it, as a program must before its next launch check.
static bool not_ready(cudaError_t e) {
    return e == cudaErrorNotReady && cudaGetLastError() == cudaErrorNotReady;
}

// The query that sees the work queued answers "not ready", which stays the thread's last error
// until taken (CUDA Runtime API, cudaGetLastError: "the last error that has been produced by
// any of the runtime calls"), where the next launch's check would find it; the calls that wait
// for the work do not answer it.
TEST(stream_work_runs_after_its_call_in_queue_order) {
    cudaStream_t s;
    cudaStreamCreate(&s);
    int *x = device_zeros<int>(1);
    uly_emu_stall_stream(s, true);
    ULY_LAUNCH(scale_add, 1, 1, 0, s, x, 1, 1);
    ULY_LAUNCH(scale_add, 1, 1, 0, s, x, 10, 2);
    CHECK(cudaGetLastError() == cudaSuccess, "launch");
    CHECK(peek(x) == 0 && cudaStreamQuery(s) == cudaErrorNotReady, "ran while queued: %d",
          peek(x));
    uly_emu_stall_stream(s, false);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess && cudaStreamQuery(s) == cudaSuccess,
          "sync, or a later query, answers the earlier query's not ready");
    CHECK(peek(x) == 12, "x = %d, want (0 + 1) * 10 + 2", peek(x));
    CHECK(cudaPeekAtLastError() == cudaErrorNotReady && cudaGetLastError() == cudaErrorNotReady &&
              cudaGetLastError() == cudaSuccess,
          "not ready is not the last error until cudaGetLastError takes it");
    cudaFree(x);
    cudaStreamDestroy(s);
}

// What a GPU would hang on ends the test loudly here: a call that waits for a stalled stream
// (one naming it: a synchronize, a copy of pageable memory on it) aborts with a message naming
// the call. Each case runs in a child (this program again, ULY_EMU_DEATH=call, which main()
// runs instead of the tests).
static void wait_on_a_stalled_stream(const char *call) {
    cudaStream_t s;
    cudaStreamCreate(&s);
    int *x = device_zeros<int>(1), host = 0;
    uly_emu_stall_stream(s, true);
    ULY_LAUNCH(scale_add, 1, 1, 0, s, x, 1, 1);
    if (!strcmp(call, "cudaStreamSynchronize")) cudaStreamSynchronize(s);
    if (!strcmp(call, "cudaMemcpyAsync"))
        cudaMemcpyAsync(&host, x, sizeof host, cudaMemcpyDeviceToHost, s); /* pageable */
    printf("%s returned\n", call);
}

TEST(a_wait_for_a_stalled_stream_aborts_and_names_the_call) {
    for (const char *call : {"cudaStreamSynchronize", "cudaMemcpyAsync"}) {
        int out[2];
        CHECK(pipe(out) == 0, "pipe");
        const pid_t child = fork();
        if (child == 0) {
            dup2(out[1], 1), dup2(out[1], 2);
            setenv("ULY_EMU_DEATH", call, 1);
            execl("/proc/self/exe", "test_emu", (char *)NULL);
            _exit(127);
        }
        close(out[1]);
        std::string text;
        char buf[512];
        for (ssize_t n; (n = read(out[0], buf, sizeof buf)) > 0;) text.append(buf, (size_t)n);
        close(out[0]);
        int status = 0;
        waitpid(child, &status, 0);
        CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT, "%s: status %#x, output: %s",
              call, status, text.c_str());
        CHECK(contains(text, call) && contains(text, "waits for a stalled stream") &&
                  !contains(text, "returned"),
              "%s: %s", call, text.c_str());
    }
}

// On stalled stream a, x = 5 and a record of e; b waits for e, then copies x to y.
static void copy_after_a_stalled_record(cudaStream_t a, cudaStream_t b, cudaEvent_t e, int *x,
                                        int *y) {
    uly_emu_stall_stream(a, true);
    ULY_LAUNCH(scale_add, 1, 1, 0, a, x, 1, 5);
    cudaEventRecord(e, a);
    cudaStreamWaitEvent(b, e, 0);
    cudaMemcpyAsync(y, x, sizeof(int), cudaMemcpyDeviceToDevice, b);
}

// b copies what a computes: with the event between them the copy waits for a, without it the
// copy reads what was there before, as on a GPU whose a is still busy.
TEST(an_event_orders_work_across_streams_and_its_absence_shows) {
    cudaStream_t a, b;
    cudaEvent_t done;
    cudaStreamCreate(&a), cudaStreamCreate(&b), cudaEventCreate(&done);
    int *x = device_zeros<int>(1), *y = device_zeros<int>(1);
    copy_after_a_stalled_record(a, b, done, x, y);
    CHECK(not_ready(cudaStreamQuery(b)) && peek(y) == 0, "b went on: y = %d", peek(y));
    uly_emu_stall_stream(a, false);
    CHECK(cudaStreamSynchronize(b) == cudaSuccess && peek(y) == 5, "with the event: y = %d",
          peek(y));
    uly_emu_stall_stream(a, true);
    ULY_LAUNCH(scale_add, 1, 1, 0, a, x, 1, 2);
    cudaMemcpyAsync(y, x, sizeof(int), cudaMemcpyDeviceToDevice, b);
    CHECK(cudaStreamSynchronize(b) == cudaSuccess && peek(y) == 5, "without: y = %d", peek(y));
    uly_emu_stall_stream(a, false);
    cudaStreamSynchronize(a);
    CHECK(peek(x) == 7, "x = %d", peek(x));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, done, done) == cudaSuccess, "a reached event");
    cudaFree(x), cudaFree(y);
    cudaEventDestroy(done), cudaStreamDestroy(a), cudaStreamDestroy(b);
}

// The synchronous calls run on the legacy stream, after the work of every stream.
TEST(synchronous_copies_wait_for_every_stream) {
    cudaStream_t s;
    cudaStreamCreate(&s);
    int *x = device_zeros<int>(1);
    ULY_LAUNCH(scale_add, 1, 1, 0, s, x, 1, 3);
    CHECK(download(x, 1)[0] == 3, "cudaMemcpy read %d before the kernel", download(x, 1)[0]);
    cudaFree(x);
    cudaStreamDestroy(s);
}

// A fault ends a GPU's context; here it drops the host thread's later queued work until the
// host takes the error, and the stream still reaches its events.
__global__ void trap_now() { __trap(); }

TEST(a_fault_drops_later_work_until_the_error_is_taken) {
    cudaStream_t s;
    cudaEvent_t after;
    cudaStreamCreate(&s), cudaEventCreate(&after);
    int *x = device_zeros<int>(1);
    uly_emu_set_quiet(true);
    ULY_LAUNCH(trap_now, 1, 1, 0, s);
    CHECK(cudaGetLastError() == cudaSuccess, "the launch itself failed");
    ULY_LAUNCH(scale_add, 1, 1, 0, s, x, 1, 4);
    cudaEventRecord(after, s);
    CHECK(cudaEventSynchronize(after) == cudaErrorLaunchFailure, "no fault at the sync");
    uly_emu_set_quiet(false);
    CHECK(peek(x) == 0, "work after the fault ran: x = %d", peek(x));
    CHECK(cudaGetLastError() == cudaErrorLaunchFailure && cudaGetLastError() == cudaSuccess,
          "the error is taken once");
    ULY_LAUNCH(scale_add, 1, 1, 0, s, x, 1, 4);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess && peek(x) == 4, "after: x = %d", peek(x));
    cudaFree(x);
    cudaEventDestroy(after), cudaStreamDestroy(s);
}

// Async sets are stream work like a kernel: on a stalled stream they wait in queue order, not
// at the call (CUDA: "asynchronous with respect to the host"). The sleep only gives a stream
// that ignored its stall time to run; the stall itself decides the outcome.
TEST(async_sets_run_on_the_stream_in_queue_order) {
    cudaStream_t s;
    cudaStreamCreate(&s);
    int *x = device_zeros<int>(1), *y = device_zeros<int>(4);
    uly_emu_stall_stream(s, true);
    ULY_LAUNCH(scale_add, 1, 1, 0, s, x, 1, 5);
    cudaMemsetAsync(x, 0, sizeof(int), s);
    ULY_LAUNCH(scale_add, 1, 1, 0, s, x, 1, 2);
    ULY_LAUNCH(scale_add, 1, 1, 0, s, y, 1, 9);
    cudaMemset2DAsync(y, 2 * sizeof(int), 0, sizeof(int), 2, s);  // y[0] and y[2]
    ULY_LAUNCH(scale_add, 1, 1, 0, s, y + 2, 1, 3);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(peek(x) == 0 && peek(y) == 0 && peek(y + 2) == 0 && not_ready(cudaStreamQuery(s)),
          "ran while stalled: x = %d, y = %d %d", peek(x), peek(y), peek(y + 2));
    uly_emu_stall_stream(s, false);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess, "sync");
    CHECK(peek(x) == 2, "x = %d, want ((0 + 5) set to 0) + 2", peek(x));
    CHECK(peek(y) == 0 && peek(y + 2) == 3, "y = %d %d, want (9 set to 0) and (0 set to 0) + 3",
          peek(y), peek(y + 2));
    cudaFree(x), cudaFree(y);
    cudaStreamDestroy(s);
}

// An event completes when its stream reaches the record, not at cudaEventRecord: until then
// cudaEventElapsedTime answers cudaErrorNotReady (CUDA Runtime API, cudaEventElapsedTime).
TEST(an_event_completes_when_its_stream_reaches_the_record) {
    cudaStream_t s;
    cudaEvent_t e;
    cudaStreamCreate(&s), cudaEventCreate(&e);
    uly_emu_stall_stream(s, true);
    cudaEventRecord(e, s);
    float ms;
    CHECK(not_ready(cudaEventElapsedTime(&ms, e, e)), "complete on a stalled stream");
    uly_emu_stall_stream(s, false);
    CHECK(cudaEventSynchronize(e) == cudaSuccess &&
              cudaEventElapsedTime(&ms, e, e) == cudaSuccess,
          "not complete after the stream ran it");
    cudaEventDestroy(e), cudaStreamDestroy(s);
}

// Work that takes a while on s: the host waits that report "done" must have waited for it. The
// pass does not depend on timing; the sleep only makes a wait that returns early visible.
static void slow_store(cudaStream_t s, int *x, int v) {
    uly_emu_queue(s, [x, v] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        *(volatile int *)x = v;
    });
}

// cudaDeviceSynchronize waits for all work of every stream; work on the legacy default stream
// waits for the work of every blocking stream before it (CUDA Runtime API, stream
// synchronization behavior).
TEST(device_sync_and_the_legacy_stream_wait_for_other_streams) {
    cudaStream_t s;
    cudaStreamCreate(&s);
    int *x = device_zeros<int>(1);
    slow_store(s, x, 1);
    CHECK(cudaDeviceSynchronize() == cudaSuccess && peek(x) == 1, "device sync: x = %d", peek(x));
    slow_store(s, x, 2);
    ULY_LAUNCH(scale_add, 1, 1, 0, 0, x, 10, 0);  // the legacy stream: after s's store
    CHECK(cudaStreamSynchronize(s) == cudaSuccess && download(x, 1)[0] == 20,
          "legacy launch: x = %d, want 2 * 10", download(x, 1)[0]);
    cudaFree(x);
    cudaStreamDestroy(s);
}

// The emulator's mma model (cuda_emu.cpp, complete_mma): the products are exact and are summed
// with C exactly, then rounded once to float. The PTX ISA leaves the accumulation's internal
// precision to the hardware, so this checks the emulator's stated model, not a GPU. D(0,0): C = 1
// plus sixteen products 2^-25 is 1 + 2^-21, a float, where float additions one at a time lose
// every product (each under half an ulp of 1). D(1,1): C = -1 plus the products 1, 2^-24 and
// 2^-40 is 2^-24 + 2^-40, a float, where rounding the products' sum before adding C gives 2^-23.
// 2^-20 is subnormal in fp16, and still exact.
template <typename T> static void mma_rounds_once() {
    MmaCase mc;
    mc.add("one rounding");
    for (int i = 0; i < MMA_K; i++) mc.a(0, i) = 0x1p-12f, mc.b(i, 0) = 0x1p-13f;
    mc.c(0, 0) = 1.f;
    mc.a(1, 0) = mc.b(0, 1) = 1.f;
    mc.a(1, 1) = mc.b(1, 1) = 0x1p-12f;
    mc.a(1, 2) = mc.b(2, 1) = 0x1p-20f;
    mc.c(1, 1) = -1.f;
    float *A = upload(mc.A), *B = upload(mc.B), *C = upload(mc.C);
    float *D = device_zeros<float>(128);
    ULY_LAUNCH(mma_probe<T>, 1, 32, 0, 0, A, B, C, D);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<float> d = download(D, 128);
    CHECK(d[0] == 1.f + 0x1p-21f, "D(0,0) = %a, want %a", (double)d[0], 0x1p0 + 0x1p-21);
    CHECK(d[9] == 0x1p-24f + 0x1p-40f, "D(1,1) = %a, want %a", (double)d[9], 0x1p-24 + 0x1p-40);
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 8; n++) {
            double exact = mc.C[m * 8 + n];  // every sum here is exact in double
            for (int i = 0; i < MMA_K; i++)
                exact += (double)mc.A[m * MMA_K + i] * mc.B[i * 8 + n];
            CHECK(d[m * 8 + n] == (float)exact, "D(%d,%d) = %a, want %a", m, n,
                  (double)d[m * 8 + n], (double)(float)exact);
        }
    cudaFree(A), cudaFree(B), cudaFree(C), cudaFree(D);
}

TEST(mma_rounds_the_exact_sum_once_under_the_emulator) {
    mma_rounds_once<__nv_bfloat16>();
    mma_rounds_once<__half>();
}

// Dynamic shared memory starts as garbage in every block (CUDA leaves it uninitialized): the
// emulator fills it with poison (all ones) at each block's start, so a kernel that reads what it
// never wrote, or what an earlier block left, shows. Many more blocks than OS threads: the arena
// is reused.
__global__ void read_before_write(uint32_t *seen) {
    ULY_DYN_SMEM(uint32_t, smem);
    const int t = threadIdx.x;
    seen[blockIdx.x * 64 + t] = smem[t] & smem[32 + t];
    __syncthreads();
    smem[t] = smem[32 + t] = blockIdx.x;
}

TEST(dynamic_shared_memory_starts_poisoned_in_every_block) {
    const int blocks = 256;
    uint32_t *seen = device_zeros<uint32_t>(blocks * 64);
    ULY_LAUNCH(read_before_write, blocks, 32, 64 * 4, 0, seen);
    CHECK(launch_error() == cudaSuccess, "launch failed");
    std::vector<uint32_t> h = download(seen, blocks * 64);
    int bad = 0;
    for (int b = 0; b < blocks; b++)
        for (int t = 0; t < 32; t++)
            if (h[b * 64 + t] != 0xffffffffu && bad++ < 4)
                CHECK(false, "block %d thread %d read 0x%x before writing, want poison", b, t,
                      h[b * 64 + t]);
    CHECK(bad == 0, "%d reads of unwritten shared memory were not poison", bad);
    cudaFree(seen);
}

// cudaStreamWaitEvent waits for the event's most recent record before the call only: "The stream
// will wait only for the completion of the most recent host call to cudaEventRecord() on event.
// Once this call has returned, any functions (including cudaEventRecord() ...) may be called on
// event again, and the subsequent calls will not have any effect on stream" (CUDA Runtime API).
// And cudaEventElapsedTime answers cudaErrorNotReady while a record of either event has not
// completed, even when an earlier record of it has.
TEST(a_stream_waits_for_the_record_before_its_wait_only) {
    cudaStream_t a, b;
    cudaEvent_t e;
    cudaStreamCreate(&a), cudaStreamCreate(&b), cudaEventCreate(&e);
    int *x = device_zeros<int>(1), *y = device_zeros<int>(1);
    // First: while the record is not reached, b stays behind its wait however long it is given
    // (the sleep gives a b that ignored the wait time to run; the stall decides the outcome).
    copy_after_a_stalled_record(a, b, e, x, y);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CHECK(not_ready(cudaStreamQuery(b)), "b went past its wait for an unreached record");
    uly_emu_stall_stream(a, false);
    CHECK(cudaStreamSynchronize(b) == cudaSuccess && peek(y) == 5, "after the record: y = %d",
          peek(y));
    // Then: a record asked after the wait is not waited for.
    uly_emu_stall_stream(b, true);  // b runs its wait only after the second record is asked
    cudaStreamWaitEvent(b, e, 0);
    cudaMemcpyAsync(y, x, sizeof(int), cudaMemcpyDeviceToDevice, b);
    uly_emu_stall_stream(a, true);
    ULY_LAUNCH(scale_add, 1, 1, 0, a, x, 1, 2);
    cudaEventRecord(e, a);  // not reached while a is stalled
    float ms;
    CHECK(not_ready(cudaEventElapsedTime(&ms, e, e)), "a record not reached counts as complete");
    uly_emu_stall_stream(b, false);
    cudaError_t q = cudaErrorNotReady;
    for (int i = 0; i < 200 && q == cudaErrorNotReady; i++) {
        q = cudaStreamQuery(b);
        if (q == cudaErrorNotReady) {
            cudaGetLastError();
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
    }
    CHECK(q == cudaSuccess && peek(y) == 5, "b waited for the record after its wait: y = %d",
          peek(y));
    uly_emu_stall_stream(a, false);
    CHECK(cudaStreamSynchronize(a) == cudaSuccess && cudaStreamSynchronize(b) == cudaSuccess &&
              peek(x) == 7,
          "x = %d", peek(x));
    cudaFree(x), cudaFree(y);
    cudaEventDestroy(e), cudaStreamDestroy(a), cudaStreamDestroy(b);
}

TEST(device_properties_are_an_h100) {
    cudaDeviceProp p;
    CHECK(cudaGetDeviceProperties(&p, 0) == cudaSuccess, "properties");
    CHECK(p.multiProcessorCount == 132 && p.sharedMemPerMultiprocessor == 228 * 1024 &&
              p.sharedMemPerBlockOptin == 227 * 1024 && p.warpSize == 32 && p.major == 9,
          "%d SMs, %zu per SM, %zu per block", p.multiProcessorCount,
          p.sharedMemPerMultiprocessor, p.sharedMemPerBlockOptin);
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess &&
              sms == 132,
          "attribute %d", sms);
}
#endif

int main() {
#ifdef ULY_EMU
    if (const char *call = getenv("ULY_EMU_DEATH")) {
        uly_emu_set_quiet(true);
        wait_on_a_stalled_stream(call);
        return 0;
    }
#endif
    return uly_run_tests();
}
