/* sp_attention_nccl.cu - one Ulysses attention layer over MPI + NCCL, one GPU per rank, forward
   and backward with the flash kernels (uly_cuda_layer), checked on every rank against the same
   attention computed unsharded.

       make build/gpu/sp_attention_nccl
       mpirun -np 4 build/gpu/sp_attention_nccl [sp_size [seq_len]]

   sp_size defaults to every rank in one SP group, seq_len to 1024.

   make test-gpu runs it with one rank per GPU of the machine; make test runs it on the CPU, ranks
   as threads (tests/emu: the CUDA emulator, NCCL and MPI doubles). Each rank takes the GPU of its
   index on its node, so a node may hold no more ranks than GPUs (NCCL refuses two ranks on one
   GPU).

   MPI only starts the processes and shares the NCCL id; the layer's all-to-alls run on NCCL.
   The world splits into SP groups of sp_size consecutive ranks and DP groups across them (each
   DP group here runs the same sample). q, k, v come as one fused QKV buffer per rank,
   [B, S_r, H + 2*Hkv, D] in bf16, as a trainer's projection writes it. */
#define OMPI_SKIP_MPICXX 1 /* the C API only: Open MPI's C++ bindings warn under -Wextra */
#include <mpi.h>
#include <nccl.h>
#define ULYSSES_NCCL
#define ULYSSES_IMPLEMENTATION
#include "ulysses_cuda.cuh"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 2, H = 16, HKV = 4, D = 64 };

#define CUDA_OK(call)                                                                             \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_) {                                                                                 \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));           \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                         \
        }                                                                                         \
    } while (0)

static void nccl_ok(ncclResult_t r, const char *what) {
    if (r == ncclSuccess) return;
    fprintf(stderr, "%s: %s\n", what, ncclGetErrorString(r));
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/* The library's messages name the call that failed; `during` says what the example was doing. */
static void ulysses_ok(uly_status st, const char *during) {
    if (!st.code) return;
    fprintf(stderr, "sp_attention_nccl: %s: %s\n", during, st.msg);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/* The same pseudo-random bf16 values on every rank. */
static void fill(__nv_bfloat16 *x, int64_t n, uint64_t seed) {
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = __float2bfloat16_rn((float)(seed >> 40) / (float)(1 << 23) - 1.0f);
    }
}

/* n elements in new GPU memory: a copy of x, or (x NULL) NaN, so that an output nothing
   writes fails the comparison. */
static __nv_bfloat16 *to_gpu(const __nv_bfloat16 *x, int64_t n) {
    __nv_bfloat16 *d;
    CUDA_OK(cudaMalloc((void **)&d, (size_t)n * 2));
    if (x) CUDA_OK(cudaMemcpy(d, x, (size_t)n * 2, cudaMemcpyHostToDevice));
    else CUDA_OK(cudaMemset(d, 0xff, (size_t)n * 2));
    return d;
}

/* A [b, s, h, d] view, densely, in float: the bytes it spans, copied whole, then its elements. */
static float *to_host(const uly_tensor *t) {
    const int64_t span = (t->b - 1) * t->sb + (t->s - 1) * t->ss + (t->h - 1) * t->sh + t->d;
    __nv_bfloat16 *raw = (__nv_bfloat16 *)malloc((size_t)span * 2);
    CUDA_OK(cudaMemcpy(raw, t->data, (size_t)span * 2, cudaMemcpyDeviceToHost));
    float *x = (float *)malloc((size_t)(t->b * t->s * t->h * t->d) * sizeof(float)), *xi = x;
    for (int64_t b = 0; b < t->b; b++)
        for (int64_t s = 0; s < t->s; s++)
            for (int64_t h = 0; h < t->h; h++)
                for (int64_t e = 0; e < t->d; e++)
                    *xi++ = __bfloat162float(raw[b * t->sb + s * t->ss + h * t->sh + e]);
    free(raw);
    return x;
}

/* max |got - want| / (1 + |want|) between a shard and tokens [s0, s0 + got.s) of want, the full
   [B, S, got.h, got.d] tensor in float; a NaN is an infinite error (fmax would drop it). */
static double shard_error(uly_tensor got, const float *want, int64_t S, int64_t s0) {
    const int64_t row = got.h * got.d;
    float *g = to_host(&got);
    double err = 0;
    for (int64_t b = 0, i = 0; b < got.b; b++)
        for (int64_t s = 0; s < got.s; s++)
            for (int64_t e = 0; e < row; e++, i++) {
                const double w = want[(b * S + s0 + s) * row + e];
                const double x = fabs((double)g[i] - w) / (1 + fabs(w));
                if (!(x <= err)) err = isnan(x) ? INFINITY : x;
            }
    free(g);
    return err;
}

/* dk and dv as the layer forms them, into want_k and want_v ([B, S, HKV, D], S = a.q.s). A kv
   head whose query heads lie on several ranks of the SP group gets a share of its gradient from
   each (the backward over that rank's heads, rounded to bf16), which the exchange back sums in
   fp32 in rank order, rounding once. Not always within an ulp of the unsharded gradient, which
   rounds the group's sum once: shares that cancel are rounded on a larger scale than their sum.
   A rank's share is the unsharded backward `a` with dout zero outside the rank's heads, whose
   terms are then exact zeros. */
static void layer_dkv(const uly_plan *plan, const uly_attn *attn, uly_attn_args a,
                      const __nv_bfloat16 *h_dout, float *want_k, float *want_v) {
    const int64_t S = a.q.s, nq = B * S * H * D, nkv = B * S * HKV * D;
    __nv_bfloat16 *masked = (__nv_bfloat16 *)malloc((size_t)nq * 2);
    a.dout = uly_dense(to_gpu(NULL, nq), ULY_BF16, B, S, H, D);
    a.dq = uly_dense(to_gpu(NULL, nq), ULY_BF16, B, S, H, D);
    a.dk = uly_dense(to_gpu(NULL, nkv), ULY_BF16, B, S, HKV, D);
    a.dv = uly_dense(to_gpu(NULL, nkv), ULY_BF16, B, S, HKV, D);
    int64_t held = 0; /* kv heads [0, held) have a share from an earlier rank */
    for (int j = 0; j < plan->desc.sp_size; j++) {
        const uly_range h = uly_heads(plan, j), kv = uly_kv_heads(plan, j);
        for (int64_t i = 0; i < nq; i++) {
            const int64_t head = i / D % H;
            masked[i] = head >= h.start && head < h.start + h.count ? h_dout[i]
                                                                     : __float2bfloat16_rn(0.f);
        }
        CUDA_OK(cudaMemcpy(a.dout.data, masked, (size_t)nq * 2, cudaMemcpyHostToDevice));
        ulysses_ok(attn->bwd(attn->ctx, &a), "a rank's share of dK, dV");
        CUDA_OK(cudaStreamSynchronize((cudaStream_t)a.stream));
        float *share_k = to_host(&a.dk), *share_v = to_host(&a.dv);
        for (int64_t i = 0; i < nkv; i++) {
            const int64_t hk = i / D % HKV;
            if (hk < kv.start || hk >= kv.start + kv.count) continue;
            want_k[i] = hk < held ? want_k[i] + share_k[i] : share_k[i];
            want_v[i] = hk < held ? want_v[i] + share_v[i] : share_v[i];
        }
        held = kv.start + kv.count;
        free(share_k), free(share_v);
    }
    for (int64_t i = 0; i < nkv; i++) {
        want_k[i] = __bfloat162float(__float2bfloat16_rn(want_k[i]));
        want_v[i] = __bfloat162float(__float2bfloat16_rn(want_v[i]));
    }
    free(masked);
    const uly_tensor gpu[4] = {a.dout, a.dq, a.dk, a.dv};
    for (int i = 0; i < 4; i++) CUDA_OK(cudaFree(gpu[i].data));
}

int main(int argc, char **argv) {
    int rank, world, local, nlocal, ndev;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    const int P = argc > 1 ? atoi(argv[1]) : world, S = argc > 2 ? atoi(argv[2]) : 1024;

    /* The GPU: this rank's index on its node, or the only one it sees (a launcher that binds
       each rank to its GPU through CUDA_VISIBLE_DEVICES). rank % ndev would give two ranks one
       GPU unless every node holds ndev consecutive ranks. */
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local);
    MPI_Comm_size(node, &nlocal);
    MPI_Comm_free(&node);
    CUDA_OK(cudaGetDeviceCount(&ndev));
    if (ndev > 1 && nlocal > ndev) {
        fprintf(stderr, "rank %d: %d ranks on its node but %d GPUs: run one rank per GPU\n",
                rank, nlocal, ndev);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    CUDA_OK(cudaSetDevice(ndev == 1 ? 0 : local));

    /* NCCL: rank 0 makes the id, MPI shares it; then SP and DP communicators. */
    ncclUniqueId id;
    ncclComm_t all, sp, dp;
    if (rank == 0) nccl_ok(ncclGetUniqueId(&id), "ncclGetUniqueId");
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    nccl_ok(ncclCommInitRank(&all, world, id, rank), "ncclCommInitRank");
    ulysses_ok(uly_nccl_split(all, P, 0, &sp, &dp), "the communicators");
    /* One stream for everything here. A blocking one (cudaStreamCreate): it waits for the legacy
       stream, where the cudaMemcpy calls below may still be landing. */
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreate(&stream));
    uly_nccl nccl = {sp, NULL, 60.0, stream}; /* waits give up after a minute */
    CUDA_OK(cudaMalloc((void **)&nccl.scratch, ULY_NCCL_SCRATCH * sizeof(double)));
    uly_comm comm;
    ulysses_ok(uly_nccl_comm(&nccl, &comm), "the communicators");

    uly_plan plan;
    uly_plan_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.world_size = world, desc.rank = rank, desc.sp_size = P;
    desc.batch = B, desc.seq_len = S, desc.n_heads = H, desc.n_kv_heads = HKV, desc.head_dim = D;
    desc.dtype = ULY_BF16;
    ulysses_ok(uly_plan_init(&plan, &desc), "the plan");
    const uly_range tok = uly_tokens(&plan, plan.sp_rank);

    /* The full sample, on every rank: q, k, v fused [B, S, H + 2 HKV, D], and dout. */
    const int64_t nqkv = (int64_t)B * S * (H + 2 * HKV) * D, nq = (int64_t)B * S * H * D;
    __nv_bfloat16 *h_qkv = (__nv_bfloat16 *)malloc((size_t)nqkv * 2);
    __nv_bfloat16 *h_dout = (__nv_bfloat16 *)malloc((size_t)nq * 2);
    fill(h_qkv, nqkv, 1), fill(h_dout, nq, 2);
    uly_tensor q, k, v, dq, dk, dv;
    ulysses_ok(uly_qkv_views(to_gpu(h_qkv, nqkv), ULY_BF16, B, S, H, HKV, D, &q, &k, &v),
               "views");
    ulysses_ok(uly_qkv_views(to_gpu(NULL, nqkv), ULY_BF16, B, S, H, HKV, D, &dq, &dk, &dv),
               "views");
    uly_tensor out = uly_dense(to_gpu(NULL, nq), ULY_BF16, B, S, H, D);
    uly_tensor dout = uly_dense(to_gpu(h_dout, nq), ULY_BF16, B, S, H, D);

    /* This rank's shard: its tokens of the fused buffer (a trainer's projection output). */
    const int64_t nqkv_r = (int64_t)B * tok.count * (H + 2 * HKV) * D;
    const int64_t nq_r = (int64_t)B * tok.count * H * D;
    __nv_bfloat16 *qkv_r = to_gpu(NULL, nqkv_r), *dqkv_r = to_gpu(NULL, nqkv_r);
    for (int64_t b = 0; b < B; b++)
        CUDA_OK(cudaMemcpy(qkv_r + b * tok.count * (H + 2 * HKV) * D,
                           (__nv_bfloat16 *)q.data + b * q.sb + tok.start * q.ss,
                           (size_t)(tok.count * (H + 2 * HKV) * D * 2), cudaMemcpyDeviceToDevice));
    uly_tensor q_r, k_r, v_r, dq_r, dk_r, dv_r, dout_r = dout;
    ulysses_ok(uly_qkv_views(qkv_r, ULY_BF16, B, tok.count, H, HKV, D, &q_r, &k_r, &v_r),
               "views");
    ulysses_ok(uly_qkv_views(dqkv_r, ULY_BF16, B, tok.count, H, HKV, D, &dq_r, &dk_r, &dv_r),
               "views");
    uly_tensor out_r = uly_dense(to_gpu(NULL, nq_r), ULY_BF16, B, tok.count, H, D);
    dout_r.data = (__nv_bfloat16 *)dout.data + tok.start * dout.ss, dout_r.s = tok.count;

    /* The layer: forward, then backward. */
    uly_layer L = uly_cuda_layer(&plan, &comm, stream); /* the flash kernels */
    L.causal = 1;
    L.deterministic = 1; /* dQ's key blocks summed in order, so the check below is bitwise */
    L.workspace_bytes = uly_layer_workspace(&L);
    void *saved;
    CUDA_OK(cudaMalloc(&L.workspace, (size_t)L.workspace_bytes));
    const int64_t nsaved = uly_saved_bytes(&plan);
    CUDA_OK(cudaMalloc(&saved, (size_t)nsaved));
    ulysses_ok(uly_layer_agree(&L), "the SP layer"); /* every rank planned the same layer */
    ulysses_ok(uly_forward(&L, q_r, k_r, v_r, out_r, saved, nsaved), "the SP layer");
    ulysses_ok(uly_backward(&L, dout_r, saved, nsaved, dq_r, dk_r, dv_r), "the SP layer");
    ulysses_ok(uly_nccl_wait(sp, stream, 60.0), "the SP layer");

    /* The same flash attention, unsharded, on this GPU. */
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = q, a.k = k, a.v = v, a.o = out, a.dout = dout, a.dq = dq, a.dk = dk, a.dv = dv;
    a.causal = 1, a.deterministic = 1, a.stream = stream;
    CUDA_OK(cudaMalloc((void **)&a.lse, (size_t)B * H * S * sizeof(float)));
    a.workspace_bytes = L.attn.workspace(L.attn.ctx, &a);
    CUDA_OK(cudaMalloc(&a.workspace, (size_t)a.workspace_bytes));
    ulysses_ok(L.attn.fwd(L.attn.ctx, &a), "the unsharded forward");
    ulysses_ok(L.attn.bwd(L.attn.ctx, &a), "the unsharded backward");
    CUDA_OK(cudaStreamSynchronize(stream));

    /* The flash kernels run per (batch, head, query block) and per (batch, kv head, key block),
       and deterministic dQ sums a row's key blocks in order, so out and dq are bitwise the
       unsharded rows, and dk and dv bitwise the shares summed as the layer sums them. (Without
       deterministic, dQ's fp32 atomics sum in any order, run to run, sharded or not.) */
    const int64_t nkv = (int64_t)B * S * HKV * D;
    const uly_tensor got[4] = {out_r, dq_r, dk_r, dv_r};
    float *want[4] = {to_host(&out), to_host(&dq), (float *)malloc((size_t)nkv * sizeof(float)),
                      (float *)malloc((size_t)nkv * sizeof(float))};
    layer_dkv(&plan, &L.attn, a, h_dout, want[2], want[3]);
    double err[4];
    for (int i = 0; i < 4; i++) err[i] = shard_error(got[i], want[i], S, tok.start);
    int bad = err[0] > 0 || err[1] > 0 || err[2] > 0 || err[3] > 0, any_bad;
    printf("rank %d (sp %d/%d, dp %d): tokens [%lld, %lld): out %.1e dq %.1e dk %.1e dv %.1e %s\n",
           rank, plan.sp_rank, P, plan.dp_rank, (long long)tok.start,
           (long long)(tok.start + tok.count), err[0], err[1], err[2], err[3], bad ? "FAIL" : "ok");
    MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0)
        printf("%s\n", any_bad ? "FAIL" : "ok: the SP layer matches unsharded attention");
    for (int i = 0; i < 4; i++) free(want[i]);
    free(h_qkv), free(h_dout);

    void *gpu[] = {q.data,      dq.data, out.data,  dout.data, qkv_r,       dqkv_r,
                   out_r.data, saved,   L.workspace, a.lse,   a.workspace, nccl.scratch};
    for (size_t i = 0; i < sizeof gpu / sizeof *gpu; i++) CUDA_OK(cudaFree(gpu[i]));
    CUDA_OK(cudaStreamDestroy(stream));
    ncclCommDestroy(dp), ncclCommDestroy(sp), ncclCommDestroy(all);
    MPI_Finalize();
    return any_bad;
}
