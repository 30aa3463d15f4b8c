/* sp_cuda_case.h - the SP layer on the device, for the layer tests over a device communicator
   (test_cuda_layer.cu: the device-local one; test_nccl.cu: NCCL under the emulator's double).

   sp_case.h's cases and host staging, moved to device tensors of any dtype: one rank's run of
   uly_forward and uly_backward (gpu_run_rank, rank_main; under the emulator it also notes what
   the two calls asked of the device), the same attention run unsharded on the device
   (gpu_attention), the gradients of kv heads whose group is split across ranks as the layer
   must sum them (summed_shares), and check_layer, which compares the layer with the unsharded
   runs bit for bit, and in fp32 with the unsharded CPU reference.

   Include after ulysses_cuda.cuh (with its implementation), check.h, ref64.h and sp_case.h. */
#ifndef ULY_SP_CUDA_CASE_H
#define ULY_SP_CUDA_CASE_H

#include "flash_case.h"

#include <time.h>

static const char *const output_names[] = {"out", "lse", "dq", "dk", "dv"};

static const char *dtype_name(uly_dtype t) {
    return t == ULY_F32 ? "f32" : t == ULY_BF16 ? "bf16" : "f16";
}

/* ---------------------------------------------------------------------------------------------
   Host floats <-> device tensors of any dtype */

static void round_all(float *x, int64_t n, uly_dtype t) {
    for (int64_t i = 0; i < n; i++) x[i] = round_to(t, x[i]);
}

/* n values of dtype t on the device, from host floats (NULL: NaN). */
static void *to_dev(const float *x, int64_t n, uly_dtype t) {
    int64_t es = uly_dtype_size(t);
    char *tmp = (char *)malloc((size_t)(n * es + 1));
    void *d = NULL;
    for (int64_t i = 0; x && i < n; i++) {
        if (t == ULY_F32) memcpy(tmp + 4 * i, &x[i], 4);
        else if (t == ULY_BF16) ((__nv_bfloat16 *)tmp)[i] = __float2bfloat16_rn(x[i]);
        else ((__half *)tmp)[i] = __float2half_rn(x[i]);
    }
    CHECK(cudaMalloc(&d, (size_t)(n * es + 1)) == cudaSuccess, "cudaMalloc");
    if (x) cudaMemcpy(d, tmp, (size_t)(n * es), cudaMemcpyHostToDevice);
    else cudaMemset(d, 0xff, (size_t)(n * es)); /* as the emulator's cudaMalloc, on a GPU too */
    free(tmp);
    return d;
}

static void from_dev(float *x, const void *d, int64_t n, uly_dtype t) {
    int64_t es = uly_dtype_size(t);
    char *tmp = (char *)malloc((size_t)(n * es + 1));
    CHECK(cudaMemcpy(tmp, d, (size_t)(n * es), cudaMemcpyDeviceToHost) == cudaSuccess,
          "cudaMemcpy back");
    for (int64_t i = 0; i < n; i++)
        x[i] = t == ULY_F32 ? ((float *)tmp)[i]
               : t == ULY_BF16 ? __bfloat162float(((__nv_bfloat16 *)tmp)[i])
                               : __half2float(((__half *)tmp)[i]);
    free(tmp);
}

/* The device twin of host view v into the buffer at host: same shape and strides. */
static uly_tensor on_dev(uly_tensor v, const float *host, void *dev, uly_dtype t) {
    v.data = (char *)dev + ((const float *)v.data - host) * uly_dtype_size(t);
    v.dtype = t;
    return v;
}

/* ---------------------------------------------------------------------------------------------
   The reference attention, unsharded, on device copies of full float tensors */

static uly_status gpu_attention(const sp_case *c, uly_dtype t, sp_full *f, int backward) {
    int64_t nq = sp_nq(c), nkv = sp_nkv(c);
    void *q = to_dev(f->q, nq, t), *k = to_dev(f->k, nkv, t), *v = to_dev(f->v, nkv, t);
    void *o = to_dev(NULL, nq, t), *dout = to_dev(f->dout, nq, t), *dq = to_dev(NULL, nq, t);
    void *dk = to_dev(NULL, nkv, t), *dv = to_dev(NULL, nkv, t), *lse = NULL, *ws = NULL;
    uly_attn attn = uly_cuda_reference_attention();
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = uly_dense(q, t, c->B, c->S, c->H, c->D);
    a.k = uly_dense(k, t, c->B, c->S, c->Hkv, c->D);
    a.v = uly_dense(v, t, c->B, c->S, c->Hkv, c->D);
    a.o = uly_dense(o, t, c->B, c->S, c->H, c->D);
    a.dout = uly_dense(dout, t, c->B, c->S, c->H, c->D);
    a.dq = uly_dense(dq, t, c->B, c->S, c->H, c->D);
    a.dk = uly_dense(dk, t, c->B, c->S, c->Hkv, c->D);
    a.dv = uly_dense(dv, t, c->B, c->S, c->Hkv, c->D);
    a.softmax_scale = c->scale;
    a.causal = c->causal;
    cudaMalloc(&lse, (size_t)sp_nlse(c) * 4);
    a.workspace_bytes = attn.workspace(attn.ctx, &a) + 1;
    cudaMalloc(&ws, (size_t)a.workspace_bytes);
    a.lse = (float *)lse;
    a.workspace = ws;
    uly_status st = attn.fwd(attn.ctx, &a);
    if (!st.code && backward) st = attn.bwd(attn.ctx, &a);
    cudaDeviceSynchronize();
    from_dev(f->out, o, nq, t);
    from_dev(f->lse, lse, sp_nlse(c), ULY_F32);
    if (backward) {
        from_dev(f->dq, dq, nq, t);
        from_dev(f->dk, dk, nkv, t);
        from_dev(f->dv, dv, nkv, t);
    }
    void *all[] = {q, k, v, o, dout, dq, dk, dv, lse, ws};
    for (int i = 0; i < 10; i++) cudaFree(all[i]);
    return st;
}

/* The largest |a - b| / (1 + |b|), or NaN if any element is NaN. */
static double maxdiff(const float *a, const float *b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n && m == m; i++) {
        double d = fabs((double)a[i] - (double)b[i]) / (1 + fabs((double)b[i]));
        if (!(d <= m)) m = d;
    }
    return m;
}

static int64_t bitdiff(const float *a, const float *b, int64_t n) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) k += memcmp(&a[i], &b[i], 4) != 0;
    return k;
}

/* dk and dv as the layer must give them, bit for bit. A kv head whose group of query heads spans
   several ranks gets a share of its gradient from each of them (the attention over that rank's
   heads, rounded to t), and the DKV unpack widens the shares to fp32, adds them to the first
   in rank order and rounds once (ulysses.h). grads(heads, kv, share_k, share_v) gives rank r's
   share: the gradients [B, S, Hkv, D] that query heads `heads` give kv heads `kv` (r's ranges;
   other kv heads are not read). Only the ranks holding a kv head add theirs (a sum started at
   +0 would turn a share of -0 into +0). Where a group lies on one rank, that is the unsharded
   result itself. Not within an ulp of the unsharded result in general: each share is rounded on
   its own scale, which can be far above the sum's when the shares cancel. */
template <typename G>
static void summed_shares(const sp_case *c, uly_dtype t, float *dk, float *dv, G grads) {
    const int64_t nkv = sp_nkv(c);
    fvec share_k((size_t)nkv), share_v((size_t)nkv), sum_k((size_t)nkv), sum_v((size_t)nkv);
    std::vector<char> summed((size_t)c->Hkv, 0); /* a rank before this one held the kv head */
    for (int r = 0; r < c->P; r++) {
        uly_plan plan;
        const uly_status st = sp_plan(c, c->P, r, t, &plan);
        CHECK(!st.code, "plan of rank %d: %s", r, st.msg);
        const uly_range kv = uly_kv_heads(&plan, r);
        grads(uly_heads(&plan, r), kv, share_k.data(), share_v.data());
        for (int64_t i = 0; i < nkv; i++) { /* dk, dv are [B, S, Hkv, D] */
            const int64_t head = i / c->D % c->Hkv;
            if (head < kv.start || head >= kv.start + kv.count) continue;
            sum_k[i] = summed[head] ? sum_k[i] + share_k[i] : share_k[i];
            sum_v[i] = summed[head] ? sum_v[i] + share_v[i] : share_v[i];
        }
        for (int64_t g = kv.start; g < kv.start + kv.count; g++) summed[g] = 1;
    }
    for (int64_t i = 0; i < nkv; i++) dk[i] = round_to(t, sum_k[i]), dv[i] = round_to(t, sum_v[i]);
}

/* ---------------------------------------------------------------------------------------------
   The layer: one rank of P, on the device, over any device communicator */

/* What one rank's uly_forward and uly_backward asked of the device, from the emulator's record
   (tests/emu/cuda_emu.h; zero on a GPU): the operations queued on streams, the first one that
   was not on the rank's stream (NULL if none), and the allocations. */
typedef struct rank_calls {
    int64_t ops;
    const char *off_stream;
    unsigned long long allocs;
} rank_calls;

#ifdef ULY_EMU
static rank_calls recorded_calls(cudaStream_t stream) {
    rank_calls c = {0, NULL, uly_emu_recorded_allocs()};
    for (const uly_emu_op &op : uly_emu_recorded_ops()) {
        c.ops++;
        if (op.stream != stream && !c.off_stream) c.off_stream = op.what;
    }
    return c;
}
#endif

typedef struct job {
    const sp_case *c;
    uly_dtype t;
    uly_attn attn;     /* the reference or the flash attention */
    int deterministic;
    sp_full *f;
    uly_status st[8];
    rank_calls calls[8]; /* under the emulator */
} job;

/* Like sp_run_rank (sp_case.h), with every buffer on the device in dtype t. */
static uly_status gpu_run_rank(const uly_comm *comm, job *j) {
    const sp_case *c = j->c;
    const uly_dtype t = j->t;
    uly_plan plan;
    uly_status st = sp_plan(c, c->P, comm->rank, t, &plan);
    if (st.code) return st;
    sp_shard s = sp_shard_alloc(c, &plan); /* host staging in float, laid out as on the device */
    sp_shard_load(&s, c, j->f);
    const int64_t nqkv = c->B * s.tok.count * (c->H + 2 * c->Hkv) * c->D;
    const int64_t no = c->B * s.tok.count * c->H * c->D;
    void *in_d = to_dev(s.in, nqkv, t), *dout_d = to_dev(s.dout, no, t);
    void *out_d = to_dev(NULL, no, t), *grad_d = to_dev(NULL, nqkv, t);

    cudaStream_t stream;
    cudaStreamCreate(&stream);
    /* The layer from its parts, not uly_cuda_layer (whose defaults have a test of their own):
       test_nccl, which runs the reference attention, then builds no flash kernel (ULYSSES_STATIC
       drops what nothing names), a third of its build. */
    uly_layer L;
    memset(&L, 0, sizeof L);
    L.plan = &plan, L.comm = comm, L.stream = stream;
    L.layout = uly_cuda_layout();
    L.attn = j->attn; /* flash or the reference */
    L.softmax_scale = c->scale;
    L.causal = c->causal;
    L.deterministic = j->deterministic;
    L.workspace_bytes = uly_layer_workspace(&L);
    void *saved = NULL;
    cudaMalloc(&L.workspace, (size_t)L.workspace_bytes + 1);
    const int64_t nsaved = uly_saved_bytes(&plan) + 1;
    cudaMalloc(&saved, (size_t)nsaved);

#ifdef ULY_EMU
    uly_emu_record_reset();
#endif
    st = uly_forward(&L, on_dev(s.q, s.in, in_d, t), on_dev(s.k, s.in, in_d, t),
                     on_dev(s.v, s.in, in_d, t), on_dev(s.o, s.out, out_d, t), saved, nsaved);
    if (!st.code)
        st = uly_backward(&L, on_dev(s.dO, s.dout, dout_d, t), saved, nsaved,
                          on_dev(s.dq, s.grad, grad_d, t), on_dev(s.dk, s.grad, grad_d, t),
                          on_dev(s.dv, s.grad, grad_d, t));
#ifdef ULY_EMU
    j->calls[comm->rank] = recorded_calls(stream);
#endif
    cudaStreamSynchronize(stream);
    if (!st.code) {
        from_dev(s.out, out_d, no, t);
        from_dev(s.grad, grad_d, nqkv, t);
        sp_shard_store(&s, c, j->f, 1);
        const int64_t nl = c->B * s.heads.count * c->S; /* lse [B, H_r, S] */
        float *lse = ref_alloc_f(nl);
        from_dev(lse, uly_saved_lse(&plan, saved), nl, ULY_F32);
        sp_shard_store_lse(&s, c, lse, j->f);
        free(lse);
    }
    cudaStreamDestroy(stream);
    void *all[] = {in_d, dout_d, out_d, grad_d, L.workspace, saved};
    for (int i = 0; i < 6; i++) cudaFree(all[i]);
    sp_shard_free(&s);
    return st;
}

static void rank_main(const uly_comm *comm, void *user) {
    job *j = (job *)user;
    j->st[comm->rank] = gpu_run_rank(comm, j);
}

/* A communicator's runner: fn(comm, user) on `size` threads, one per rank (uly_cuda_local_run's
   signature); the first error of the run. */
typedef uly_status (*sp_runner)(int size, void (*fn)(const uly_comm *comm, void *user),
                                void *user);

/* The layer on P ranks of run's communicator against the attention run unsharded on the GPU,
   and in f32 against the unsharded CPU reference. Emulated, each rank's uly_forward and
   uly_backward, the communicator's calls included, queue only on its stream and allocate
   nothing. */
static void check_layer(const sp_case *c, uly_dtype t, sp_runner run) {
    sp_full layer = sp_alloc(c, 7), whole = sp_alloc(c, 7), cpu = sp_alloc(c, 7);
    sp_full *all[3] = {&layer, &whole, &cpu};
    for (int i = 0; i < 3; i++) {
        round_all(all[i]->q, sp_nq(c), t), round_all(all[i]->k, sp_nkv(c), t);
        round_all(all[i]->v, sp_nkv(c), t), round_all(all[i]->dout, sp_nq(c), t);
    }
    job j;
    memset(&j, 0, sizeof j);
    j.c = c, j.t = t, j.f = &layer, j.attn = uly_cuda_reference_attention();
    uly_status st = run(c->P, rank_main, &j);
    for (int r = 0; r < c->P && !st.code; r++) st = j.st[r];
    uly_status ws = gpu_attention(c, t, &whole, 1);
#ifdef ULY_EMU
    for (int r = 0; r < c->P && !st.code; r++)
        CHECK(j.calls[r].ops > 0 && !j.calls[r].off_stream && !j.calls[r].allocs,
              "%s " SP_CASE_FMT ": rank %d queued %lld operations, %s not on its stream, and "
              "allocated %llu times", dtype_name(t), SP_CASE_ARGS(c), r,
              (long long)j.calls[r].ops, j.calls[r].off_stream ? j.calls[r].off_stream : "none",
              j.calls[r].allocs);
#endif
    CHECK(!st.code && !ws.code, "%s " SP_CASE_FMT ": layer '%s', unsharded '%s'", dtype_name(t),
          SP_CASE_ARGS(c), st.msg, ws.msg);
    if (st.code || ws.code) goto done;
    CHECK(!bitdiff(layer.out, whole.out, sp_nq(c)) && !bitdiff(layer.lse, whole.lse, sp_nlse(c)),
          "%s " SP_CASE_FMT ": forward differs from unsharded: %lld out, %lld lse", dtype_name(t),
          SP_CASE_ARGS(c), (long long)bitdiff(layer.out, whole.out, sp_nq(c)),
          (long long)bitdiff(layer.lse, whole.lse, sp_nlse(c)));
    {
        /* dq of a head depends on that head alone (no sum crosses ranks): the unsharded dq. dk
           and dv: the ranks' shares, summed as the layer sums them. */
        fvec dk((size_t)sp_nkv(c)), dv((size_t)sp_nkv(c)), out((size_t)sp_nq(c));
        fvec lse((size_t)sp_nlse(c)), dq((size_t)sp_nq(c));
        /* A rank's share: the unsharded attention with dout zero outside its heads, since the
           other heads then add exact zeros. */
        fvec dout((size_t)sp_nq(c));
        summed_shares(c, t, dk.data(), dv.data(),
                      [&](uly_range h, uly_range, float *share_k, float *share_v) {
                          for (int64_t i = 0; i < sp_nq(c); i++) { /* [B, S, H, D] */
                              const int64_t head = i / c->D % c->H;
                              const bool in = head >= h.start && head < h.start + h.count;
                              dout[i] = in ? whole.dout[i] : 0.f;
                          }
                          sp_full m = whole; /* its inputs; outputs into scratch */
                          m.dout = dout.data(), m.out = out.data(), m.lse = lse.data();
                          m.dq = dq.data(), m.dk = share_k, m.dv = share_v;
                          const uly_status ms = gpu_attention(c, t, &m, 1);
                          CHECK(!ms.code, "a rank's share: %s", ms.msg);
                      });
        const int64_t n[3] = {sp_nq(c), sp_nkv(c), sp_nkv(c)};
        const float *got[3] = {layer.dq, layer.dk, layer.dv};
        const float *want[3] = {whole.dq, dk.data(), dv.data()};
        for (int i = 0; i < 3; i++)
            CHECK(!bitdiff(got[i], want[i], n[i]),
                  "%s " SP_CASE_FMT ": %s differs from the unsharded %s in %lld values, by %g",
                  dtype_name(t), SP_CASE_ARGS(c), output_names[2 + i],
                  i ? "shares summed" : "attention", (long long)bitdiff(got[i], want[i], n[i]),
                  maxdiff(got[i], want[i], n[i]));
    }
    if (t == ULY_F32) {
        uly_status cs = sp_cpu_reference(c, &cpu);
        double e[5] = {maxdiff(layer.out, cpu.out, sp_nq(c)),
                       maxdiff(layer.lse, cpu.lse, sp_nlse(c)),
                       maxdiff(layer.dq, cpu.dq, sp_nq(c)), maxdiff(layer.dk, cpu.dk, sp_nkv(c)),
                       maxdiff(layer.dv, cpu.dv, sp_nkv(c))};
        CHECK(!cs.code, "cpu: %s", cs.msg);
        for (int i = 0; i < 5; i++)
            CHECK(e[i] <= 2e-6, "f32 " SP_CASE_FMT ": %s differs from the CPU reference by %g",
                  SP_CASE_ARGS(c), output_names[i], e[i]);
    }
done:
    sp_free(&layer), sp_free(&whole), sp_free(&cpu);
}

#ifdef ULY_EMU
/* Work on s that keeps it busy for ms milliseconds, so that whatever reads the stream's later
   results before waiting for it reads them stale. */
static void sleep_on_stream(cudaStream_t s, long ms) {
    uly_emu_queue(s, [ms] {
        const struct timespec t = {ms / 1000, ms % 1000 * 1000000L};
        nanosleep(&t, NULL);
    });
}
#endif

/* ---------------------------------------------------------------------------------------------
   A communicator's barrier holds every rank until all arrive: rank r comes 20 r ms late, and
   none may leave before the last has come. run is the communicator's uly_local_run. */

/* A communicator's runner: uly_cuda_local_run, or test_nccl's nccl_run and its variants. */
typedef uly_status (*rank_runner)(int size, void (*fn)(const uly_comm *, void *), void *user);

/* Runs fn on `size` ranks of run over a zeroed job J and returns the job; a run that fails is a
   failed check. */
template <typename J>
static J run_job(rank_runner run, int size, void (*fn)(const uly_comm *, void *)) {
    J j;
    memset(&j, 0, sizeof j);
    const uly_status st = run(size, fn, &j);
    CHECK(!st.code, "%s", st.msg);
    return j;
}

typedef struct barrier_job {
    int arrived[4];
    int early[4]; /* ranks not yet arrived when this one left the barrier */
    uly_status st[4];
} barrier_job;

static void barrier_main(const uly_comm *c, void *user) {
    barrier_job *j = (barrier_job *)user;
    const struct timespec late = {0, 20000000L * c->rank}; /* the last rank comes 60 ms late */
    nanosleep(&late, NULL);
    __atomic_store_n(&j->arrived[c->rank], 1, __ATOMIC_SEQ_CST);
    j->st[c->rank] = c->barrier(c->ctx);
    for (int q = 0; q < c->size; q++)
        j->early[c->rank] += !__atomic_load_n(&j->arrived[q], __ATOMIC_SEQ_CST);
}

static void check_barrier(rank_runner run) {
    const barrier_job j = run_job<barrier_job>(run, 4, barrier_main);
    for (int r = 0; r < 4; r++)
        CHECK(!j.st[r].code && !j.early[r], "rank %d: '%s', left while %d ranks had not arrived",
              r, j.st[r].msg, j.early[r]);
}

/* ---------------------------------------------------------------------------------------------
   uly_layer_agree over a device communicator (its allreduce_sum of host memory): on 3 ranks,
   first alike layers, then rank 2's with causal 0. */

typedef struct agree_job {
    uly_status alike[3], odd[3];
} agree_job;

static void agree_main(const uly_comm *c, void *user) {
    agree_job *j = (agree_job *)user;
    uly_plan p;
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    d.world_size = 3, d.rank = c->rank, d.sp_size = 3, d.batch = 1, d.seq_len = 40;
    d.n_heads = 6, d.n_kv_heads = 2, d.head_dim = 64, d.dtype = ULY_BF16;
    const uly_status st = uly_plan_init(&p, &d);
    uly_layer l;
    memset(&l, 0, sizeof l);
    l.plan = &p, l.comm = c, l.causal = 1;
    j->alike[c->rank] = st.code ? st : uly_layer_agree(&l);
    l.causal = c->rank != 2;
    j->odd[c->rank] = st.code ? st : uly_layer_agree(&l);
}

static void check_agree(rank_runner run) {
    const agree_job j = run_job<agree_job>(run, 3, agree_main);
    for (int r = 0; r < 3; r++) {
        const char *want = r == 2 ? "causal is 0 on this rank (sp rank 2), 1 on sp rank 0"
                                  : "1 of 3 sp ranks";
        CHECK(!j.alike[r].code, "rank %d, alike layers: %s", r, j.alike[r].msg);
        CHECK(j.odd[r].code == ULY_EINVAL && strstr(j.odd[r].msg, want),
              "rank %d, rank 2 not causal: '%s' (want '%s')", r, j.odd[r].msg, want);
    }
}

#endif
