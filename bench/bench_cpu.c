/* bench_cpu.c - the CPU layout (uly_cpu_layout) against memcpy of the same bytes.

   For each exchange on SP rank 0 of a plan, times pack (tensor -> send buffer) and unpack
   (receive buffer -> tensor) and reports the bandwidth as a ratio to one memcpy of as many
   bytes. Buffers are far larger than the caches, so both stream from memory.
   Options: -s S -h H -k Hkv -d D -b B -p P (defaults 16384 16 4 128 2 4; f32). */
#define _POSIX_C_SOURCE 200112L
#define ULYSSES_IMPLEMENTATION
#include "ulysses.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { REPS = 5 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *alloc(int64_t bytes) {
    void *p = malloc((size_t)bytes);
    if (!p) fprintf(stderr, "bench_cpu: out of memory (%lld bytes)\n", (long long)bytes), exit(1);
    memset(p, 1, (size_t)bytes); /* touch every page before timing */
    return p;
}

/* Best of REPS: the run least disturbed by the rest of the machine. */
static double best_memcpy(void *dst, const void *src, int64_t bytes) {
    double best = 1e30;
    for (int i = 0; i < REPS; i++) {
        double t = now();
        memcpy(dst, src, (size_t)bytes);
        t = now() - t;
        if (t < best) best = t;
    }
    return best;
}

static double best_layout(const uly_plan *p, uly_xchg x, int pack, uly_tensor t, void *buf) {
    uly_layout l = uly_cpu_layout();
    double best = 1e30;
    for (int i = 0; i < REPS; i++) {
        double s = now();
        uly_status st = pack ? l.pack(l.ctx, p, x, t, buf, NULL)
                             : l.unpack(l.ctx, p, x, buf, t, NULL);
        s = now() - s;
        if (st.code) fprintf(stderr, "bench_cpu: %s\n", st.msg), exit(1);
        if (s < best) best = s;
    }
    return best;
}

int main(int argc, char **argv) {
    int64_t v[6] = {16384, 16, 4, 128, 2, 4}; /* S H Hkv D B P */
    const char *opts = "shkdbp";
    for (int i = 1; i < argc; i += 2) {
        const char *o = argv[i][0] == '-' ? strchr(opts, argv[i][1]) : NULL;
        if (!o || !argv[i][1] || argv[i][2] || i + 1 == argc) {
            fprintf(stderr, "usage: bench_cpu [-s S] [-h H] [-k Hkv] [-d D] [-b B] [-p P]\n");
            return 2;
        }
        v[o - opts] = atoll(argv[i + 1]);
    }
    uly_plan p;
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    d.seq_len = v[0], d.n_heads = v[1], d.n_kv_heads = v[2], d.head_dim = v[3], d.batch = v[4];
    d.world_size = d.sp_size = (int)v[5], d.rank = 0, d.dtype = ULY_F32;
    uly_status st = uly_plan_init(&p, &d);
    if (st.code) return fprintf(stderr, "bench_cpu: %s\n", st.msg), 1;

    printf("bench_cpu: uly_cpu_layout vs memcpy of the same bytes, rank 0 of P = %d, B = %lld, "
           "S = %lld, H = %lld, Hkv = %lld, D = %lld, f32 (best of %d)\n", d.sp_size,
           (long long)d.batch, (long long)d.seq_len, (long long)d.n_heads,
           (long long)d.n_kv_heads, (long long)d.head_dim, REPS);
    printf("  exchange  step     MB       layout GB/s  memcpy GB/s  ratio\n");
    static const char *names[4] = {"Q", "KV", "O", "DKV"};
    for (int x = ULY_X_Q; x <= ULY_X_DKV; x++) {
        int kv = x == ULY_X_KV || x == ULY_X_DKV, to_head = x == ULY_X_Q || x == ULY_X_KV;
        uly_range tok = uly_tokens(&p, 0), heads = kv ? uly_kv_heads(&p, 0) : uly_heads(&p, 0);
        int64_t H = kv ? d.n_kv_heads : d.n_heads;
        int64_t seq_bytes = d.batch * tok.count * H * d.head_dim * 4;
        int64_t head_bytes = d.batch * d.seq_len * heads.count * d.head_dim * 4;
        void *seq = alloc(seq_bytes), *head = alloc(head_bytes);
        int64_t sent = uly_send_bytes(&p, (uly_xchg)x), got = uly_recv_bytes(&p, (uly_xchg)x);
        void *buf = alloc(sent > got ? sent : got);
        uly_tensor ts = uly_dense(seq, ULY_F32, d.batch, tok.count, H, d.head_dim);
        uly_tensor th = uly_dense(head, ULY_F32, d.batch, d.seq_len, heads.count, d.head_dim);
        for (int pack = 1; pack >= 0; pack--) {
            /* seq->head packs the sequence layout and unpacks into the head layout */
            uly_tensor t = pack == to_head ? ts : th;
            int64_t bytes = pack ? sent : got;
            double tl = best_layout(&p, (uly_xchg)x, pack, t, buf);
            double tm = best_memcpy(buf, t.data, bytes);
            printf("  %-8s  %-7s  %7.1f  %11.2f  %11.2f  %5.2f\n", names[x],
                   pack ? "pack" : "unpack", bytes / 1e6, bytes / tl / 1e9, bytes / tm / 1e9,
                   tm / tl);
        }
        free(seq), free(head), free(buf);
    }
    return 0;
}
