/* bench_layout.cu - bandwidth of the layout kernels against cudaMemcpyAsync (make bench-gpu).

   Rank 0 of an SP group of P = 8; H = 32 query and Hkv = 4 kv heads (so every kv head goes to
   two ranks and DKV's unpack sums two copies), D = 128, bf16, B = 2; S sized so that the query
   exchange moves 16 MB .. 1 GB (KV and DKV move a quarter of that: judge the target by the MB
   column, 64 MB and more being past the L2, 50 MB on an H100 and 60 MB on an H200). Each kernel
   is timed against a device-to-device cudaMemcpyAsync of its exchange buffer's bytes (what a
   pack writes or an unpack reads); ratio = the kernel's GB/s over the copy's, each counting the
   bytes it reads and writes once, target >= 0.9 at >= 64 MB. Sources and destinations are as
   in the layer: q, k and dK views into fused QKV buffers, head-layout tensors dense, all
   random. Median of 20 runs (bench_median_ms). Prints a table on stdout. Arguments: the sizes
   in MB (default 16 64 256 1024). */
#include "emu/cuda_emu.h"
/* A private copy (ULYSSES_STATIC): the compiler then drops the attention kernels, which this
   program never calls and which are most of its build otherwise. */
#define ULYSSES_STATIC
#define ULYSSES_IMPLEMENTATION
#include "../ulysses_cuda.cuh"
#include "bench_cuda.h"

enum { P = 8, B = 2, H = 32, HKV = 4, D = 128 };

/* Random bf16 values, not zeros: the memory system may move zeros faster. */
static void *device(int64_t bytes, cudaStream_t s) {
    return bench_random(bytes / 2, (uint32_t)bytes, s);
}

typedef struct kcase {
    const char *name;
    uly_xchg x;
    int unpack;
    int fused; /* the sequence-layout side is a view into a fused QKV buffer */
} kcase;

static const kcase kcases[] = {
    {"pack Q (fused QKV)", ULY_X_Q, 0, 1},  {"unpack Q", ULY_X_Q, 1, 0},
    {"pack KV (fused QKV)", ULY_X_KV, 0, 1}, {"unpack KV", ULY_X_KV, 1, 0},
    {"pack O", ULY_X_O, 0, 0},               {"unpack O", ULY_X_O, 1, 0},
    {"pack DKV", ULY_X_DKV, 0, 0},           {"unpack DKV (fused, sums)", ULY_X_DKV, 1, 1},
};

static void bench_size(double mb, cudaStream_t s) {
    const int64_t token_bytes = (int64_t)B * H * D * 2; /* of the query exchange, per token */
    const int64_t Sr = std::max<int64_t>(1, (int64_t)(mb * (1 << 20)) / token_bytes);
    uly_plan plan;
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    d.world_size = P, d.rank = 0, d.sp_size = P, d.batch = B, d.seq_len = Sr * P;
    d.n_heads = H, d.n_kv_heads = HKV, d.head_dim = D, d.dtype = ULY_BF16;
    bench_ok(uly_plan_init(&plan, &d), "uly_plan_init");
    const int64_t heads_r = uly_heads(&plan, 0).count, kv_r = uly_kv_heads(&plan, 0).count;
    const int64_t fused = (int64_t)B * Sr * (H + 2 * HKV) * D * 2;
    const int64_t head_side = (int64_t)B * d.seq_len * heads_r * D * 2;
    int64_t xbytes = 0;
    for (int x = ULY_X_Q; x <= ULY_X_DKV; x++)
        xbytes = std::max(xbytes, std::max(uly_send_bytes(&plan, (uly_xchg)x),
                                           uly_recv_bytes(&plan, (uly_xchg)x)));
    void *qkv = device(fused, s), *dense_seq = device(fused, s), *head = device(head_side, s);
    void *buf = device(xbytes, s), *copy = device(xbytes, s);
    uly_tensor fq, fk, fv;
    uly_qkv_views(qkv, ULY_BF16, B, Sr, H, HKV, D, &fq, &fk, &fv);
    uly_layout l = uly_cuda_layout();

    for (const kcase &c : kcases) {
        const int kv = c.x == ULY_X_KV || c.x == ULY_X_DKV, seq = (c.x <= ULY_X_KV) != c.unpack;
        uly_tensor t = seq ? (c.fused ? (kv ? fk : fq)
                                      : uly_dense(dense_seq, ULY_BF16, B, Sr, kv ? HKV : H, D))
                           : uly_dense(head, ULY_BF16, B, d.seq_len, kv ? kv_r : heads_r, D);
        const int64_t bytes = c.unpack ? uly_recv_bytes(&plan, c.x) : uly_send_bytes(&plan, c.x);
        /* Each byte of the buffer and of the view moves once: the KV pack reads a kv head
           once and writes its two copies, the summing unpack reads both and writes one, 1.5x
           the buffer where a copy moves 2x. */
        const int64_t traffic = bytes + t.b * t.s * t.h * t.d * 2;
        const double k = bench_median_ms(s, 3, 20, [&] {
            bench_ok(c.unpack ? l.unpack(l.ctx, &plan, c.x, buf, t, s)
                              : l.pack(l.ctx, &plan, c.x, t, buf, s), c.name);
        });
        const double m = bench_median_ms(s, 3, 20, [&] {
            CUDA_OK(cudaMemcpyAsync(copy, buf, (size_t)bytes, cudaMemcpyDeviceToDevice, s));
        });
        const double gbs = traffic / k / 1e6, copy_gbs = 2 * bytes / m / 1e6;
        printf("%-26s %9.1f %10.3f %10.3f %9.1f %9.1f %6.2f\n", c.name, bytes / 1048576.0, k, m,
               gbs, copy_gbs, gbs / copy_gbs);
    }
    void *all[] = {qkv, dense_seq, head, buf, copy};
    for (void *p : all) cudaFree(p);
}

int main(int argc, char **argv) {
    std::vector<double> sizes = {16, 64, 256, 1024};
    if (argc > 1) sizes.assign(argc - 1, 0);
    for (int i = 1; i < argc; i++) sizes[i - 1] = atof(argv[i]);
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t s;
    CUDA_OK(cudaStreamCreate(&s));
    printf("layout kernels on %s: P=%d B=%d H=%d Hkv=%d D=%d bf16, rank 0\n", prop.name, P, B, H,
           HKV, D);
    printf("%-26s %9s %10s %10s %9s %9s %6s\n", "kernel", "MB", "kernel ms", "memcpy ms",
           "GB/s", "memcpy", "ratio");
    for (double mb : sizes) bench_size(mb, s);
    return 0;
}
