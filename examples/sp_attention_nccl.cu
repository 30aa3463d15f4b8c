/* sp_attention_nccl.cu - one Ulysses attention layer over MPI + NCCL, one GPU per rank, forward
   and backward with the flash kernels (uly_cuda_layer), checked on every rank against the same
   attention computed unsharded.

       make build/gpu/sp_attention_nccl
       mpirun -np 4 build/gpu/sp_attention_nccl [sp_size]   (default: every rank in one SP group)

   make test-gpu runs it with one rank per GPU of the machine. Each rank takes the GPU of its
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

enum { B = 2, S = 1024, H = 16, HKV = 4, D = 64 };

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

static void ulysses_ok(uly_status st, const char *what) {
    if (!st.code) return;
    fprintf(stderr, "%s: %s\n", what, st.msg);
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

static float *to_host(const uly_tensor *t) { /* a [b, s, h, d] view, densely, in float */
    const int64_t hd = t->h * t->d;
    float *x = (float *)malloc((size_t)(t->b * t->s * hd) * sizeof(float));
    __nv_bfloat16 *token = (__nv_bfloat16 *)malloc((size_t)hd * 2);
    for (int64_t b = 0, i = 0; b < t->b; b++)
        for (int64_t s = 0; s < t->s; s++, i += hd) { /* a token's heads, sh apart */
            const __nv_bfloat16 *src = (const __nv_bfloat16 *)t->data + b * t->sb + s * t->ss;
            const int64_t pitch = t->h > 1 ? t->sh : t->d;
            CUDA_OK(cudaMemcpy2D(token, (size_t)t->d * 2, src, (size_t)pitch * 2,
                                 (size_t)t->d * 2, (size_t)t->h, cudaMemcpyDeviceToHost));
            for (int64_t e = 0; e < hd; e++) x[i + e] = __bfloat162float(token[e]);
        }
    free(token);
    return x;
}

/* max |got - want| / (1 + |want|) between a shard and tokens [s0, s0 + got.s) of a full tensor;
   a NaN is an infinite error (fmax would drop it). */
static double shard_error(uly_tensor got, uly_tensor full, int64_t s0) {
    full.data = (__nv_bfloat16 *)full.data + s0 * full.ss;
    full.s = got.s;
    float *g = to_host(&got), *w = to_host(&full);
    double err = 0;
    for (int64_t i = 0; i < got.b * got.s * got.h * got.d; i++) {
        const double e = fabs((double)g[i] - w[i]) / (1 + fabs((double)w[i]));
        if (!(e <= err)) err = isnan(e) ? INFINITY : e;
    }
    free(g), free(w);
    return err;
}

int main(int argc, char **argv) {
    int rank, world, local, nlocal, ndev;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    const int P = argc > 1 ? atoi(argv[1]) : world;

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
    ulysses_ok(uly_nccl_split(all, P, 0, &sp, &dp), "uly_nccl_split");
    uly_nccl nccl = {sp, NULL, 60.0, NULL}; /* waits give up after a minute; no own stream */
    CUDA_OK(cudaMalloc((void **)&nccl.scratch, ULY_NCCL_SCRATCH * sizeof(double)));
    uly_comm comm;
    ulysses_ok(uly_nccl_comm(&nccl, &comm), "uly_nccl_comm");

    uly_plan plan;
    uly_plan_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.world_size = world, desc.rank = rank, desc.sp_size = P;
    desc.batch = B, desc.seq_len = S, desc.n_heads = H, desc.n_kv_heads = HKV, desc.head_dim = D;
    desc.dtype = ULY_BF16;
    ulysses_ok(uly_plan_init(&plan, &desc), "uly_plan_init");
    const uly_range tok = uly_tokens(&plan, plan.sp_rank);

    /* The full sample, on every rank: q, k, v fused [B, S, H + 2 HKV, D], and dout. */
    const int64_t nqkv = (int64_t)B * S * (H + 2 * HKV) * D, nq = (int64_t)B * S * H * D;
    __nv_bfloat16 *h_qkv = (__nv_bfloat16 *)malloc((size_t)nqkv * 2);
    __nv_bfloat16 *h_dout = (__nv_bfloat16 *)malloc((size_t)nq * 2);
    fill(h_qkv, nqkv, 1), fill(h_dout, nq, 2);
    uly_tensor q, k, v, dq, dk, dv;
    uly_qkv_views(to_gpu(h_qkv, nqkv), ULY_BF16, B, S, H, HKV, D, &q, &k, &v);
    uly_qkv_views(to_gpu(NULL, nqkv), ULY_BF16, B, S, H, HKV, D, &dq, &dk, &dv);
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
    uly_qkv_views(qkv_r, ULY_BF16, B, tok.count, H, HKV, D, &q_r, &k_r, &v_r);
    uly_qkv_views(dqkv_r, ULY_BF16, B, tok.count, H, HKV, D, &dq_r, &dk_r, &dv_r);
    uly_tensor out_r = uly_dense(to_gpu(NULL, nq_r), ULY_BF16, B, tok.count, H, D);
    dout_r.data = (__nv_bfloat16 *)dout.data + tok.start * dout.ss, dout_r.s = tok.count;

    /* The layer: forward, then backward, on one stream. A blocking one (cudaStreamCreate): it
       waits for the legacy stream, where the cudaMemcpy calls above may still be landing. */
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreate(&stream));
    uly_layer L = uly_cuda_layer(&plan, &comm, stream); /* the flash kernels */
    L.causal = 1;
    L.workspace_bytes = uly_layer_workspace(&L);
    void *saved;
    CUDA_OK(cudaMalloc(&L.workspace, (size_t)L.workspace_bytes));
    const int64_t nsaved = uly_saved_bytes(&plan);
    CUDA_OK(cudaMalloc(&saved, (size_t)nsaved));
    ulysses_ok(uly_layer_agree(&L), "uly_layer_agree"); /* every rank planned the same layer */
    ulysses_ok(uly_forward(&L, q_r, k_r, v_r, out_r, saved, nsaved), "uly_forward");
    ulysses_ok(uly_backward(&L, dout_r, saved, nsaved, dq_r, dk_r, dv_r), "uly_backward");
    ulysses_ok(uly_nccl_wait(sp, stream, 60.0), "the layer's stream");

    /* The same flash attention, unsharded, on this GPU. */
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = q, a.k = k, a.v = v, a.o = out, a.dout = dout, a.dq = dq, a.dk = dk, a.dv = dv;
    a.causal = 1, a.stream = stream;
    CUDA_OK(cudaMalloc((void **)&a.lse, (size_t)B * H * S * sizeof(float)));
    a.workspace_bytes = L.attn.workspace(L.attn.ctx, &a);
    CUDA_OK(cudaMalloc(&a.workspace, (size_t)a.workspace_bytes));
    ulysses_ok(L.attn.fwd(L.attn.ctx, &a), "unsharded forward");
    ulysses_ok(L.attn.bwd(L.attn.ctx, &a), "unsharded backward");
    CUDA_OK(cudaStreamSynchronize(stream));

    /* The flash forward runs per (batch, head, query block), so out is bitwise the unsharded
       rows. The gradients may differ by one bf16 ulp (relative to 1 + |want|): dQ's fp32 atomics
       sum in any order, and a GQA group whose heads are split across ranks sums its dK and dV
       copies, each already rounded to bf16, in another order. */
    double err[4] = {shard_error(out_r, out, tok.start), shard_error(dq_r, dq, tok.start),
                     shard_error(dk_r, dk, tok.start), shard_error(dv_r, dv, tok.start)};
    int bad = err[0] > 0 || err[1] > 0x1p-7 || err[2] > 0x1p-7 || err[3] > 0x1p-7, any_bad;
    printf("rank %d (sp %d/%d, dp %d): tokens [%lld, %lld): out %.1e dq %.1e dk %.1e dv %.1e %s\n",
           rank, plan.sp_rank, P, plan.dp_rank, (long long)tok.start,
           (long long)(tok.start + tok.count), err[0], err[1], err[2], err[3], bad ? "FAIL" : "ok");
    MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0)
        printf("%s\n", any_bad ? "FAIL" : "ok: the SP layer matches unsharded attention");

    cudaFree(nccl.scratch);
    ncclCommDestroy(dp), ncclCommDestroy(sp), ncclCommDestroy(all);
    MPI_Finalize();
    return any_bad;
}
