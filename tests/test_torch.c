/* test_torch.c - uly_cpu_attention against PyTorch autograd (float64, explicit math).

   Usage: test_torch PYTHON tests/torch_attention.py  (make test passes $(PYTHON)).
   For every case this writes q, k, v, dout and the config to DIR/case_i.bin in a fresh temp
   dir, runs the python script once over all of them, reads back torch's out, lse, dq, dk, dv,
   and compares the C attention (forward and backward) within 1e-5. It also holds the fp64
   reference of ref64.h to torch within 1e-10, so the other tests' reference is checked too. */
#define _XOPEN_SOURCE 700 /* mkdtemp */
#define ULYSSES_IMPLEMENTATION
#include "../ulysses.h"
#include "check.h"
#include "ref64.h"
#include "attn_call.h"

#include <unistd.h>

typedef struct torch_case {
    const char *name;
    int64_t B, Sq, Sk, H, Hkv, D;
    int causal;
    float scale;
} torch_case;

static const torch_case cases[] = {
    {"mha", 2, 7, 7, 3, 3, 8, 0, 0},
    {"mha_causal", 1, 9, 9, 2, 2, 16, 1, 0},
    {"gqa_causal", 2, 11, 11, 6, 2, 8, 1, 0},
    {"mqa_causal_sq_below_sk", 1, 5, 9, 4, 1, 8, 1, 0},
    {"causal_sq_above_sk_rows_without_keys", 2, 9, 5, 2, 2, 8, 1, 0},
    {"gqa_explicit_scale_sq_below_sk", 1, 6, 10, 4, 2, 16, 0, 0.2f},
    {"gqa_causal_explicit_scale_sq_above_sk", 1, 8, 6, 8, 2, 8, 1, 0.7f},
};
enum { NCASES = sizeof cases / sizeof *cases };

static const char *python = "/usr/bin/python3", *script = "tests/torch_attention.py";

/* Per case: the inputs, the C results, torch's results. */
typedef struct run {
    float *q, *k, *v, *dout;
    float *o, *lse, *dq, *dk, *dv;
    double *t[5]; /* torch: out, lse, dq, dk, dv */
    int64_t n[5];
    uly_status st;
} run;

static run runs[NCASES];
static int torch_done;
static char torch_err[1400];

static int write_all(const char *path, const void *a, size_t n, const void *b, size_t m,
                     const float *const *arrays, const int64_t *counts, int narrays) {
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    int ok = fwrite(a, 1, n, f) == n && fwrite(b, 1, m, f) == m;
    for (int i = 0; i < narrays && ok; i++)
        ok = fwrite(arrays[i], sizeof(float), (size_t)counts[i], f) == (size_t)counts[i];
    return fclose(f) == 0 && ok;
}

/* Makes every case's data and C results, and runs torch once over all of them. */
static void run_all(void) {
    if (torch_done) return;
    torch_done = 1;
    char dir[] = "/tmp/uly_torch_XXXXXX";
    if (!mkdtemp(dir)) {
        snprintf(torch_err, sizeof torch_err, "mkdtemp failed");
        return;
    }
    for (int i = 0; i < NCASES; i++) {
        const torch_case *c = &cases[i];
        run *r = &runs[i];
        int64_t nq = c->B * c->Sq * c->H * c->D, nk = c->B * c->Sk * c->Hkv * c->D;
        int64_t nl = c->B * c->H * c->Sq;
        r->q = ref_alloc_f(nq), r->k = ref_alloc_f(nk), r->v = ref_alloc_f(nk);
        r->dout = ref_alloc_f(nq);
        r->o = ref_alloc_f(nq), r->lse = ref_alloc_f(nl), r->dq = ref_alloc_f(nq);
        r->dk = ref_alloc_f(nk), r->dv = ref_alloc_f(nk);
        ref_fill(r->q, nq, 500 + 4 * (uint64_t)i), ref_fill(r->k, nk, 501 + 4 * (uint64_t)i);
        ref_fill(r->v, nk, 502 + 4 * (uint64_t)i), ref_fill(r->dout, nq, 503 + 4 * (uint64_t)i);
        int64_t n[5] = {nq, nl, nq, nk, nk};
        memcpy(r->n, n, sizeof n);

        ref_shape shape = {c->B, c->Sq, c->Sk, c->H, c->Hkv, c->D, c->causal, c->scale};
        attn_bufs x = {r->q, r->k, r->v, r->o, r->lse, r->dout, r->dq, r->dk, r->dv};
        r->st = attn_run(attn_args(&shape, &x), 1);

        int64_t hdr[8] = {c->B, c->Sq, c->Sk, c->H, c->Hkv, c->D, c->causal, 0};
        double scale = c->scale; /* the float the C side uses, exactly */
        const float *arrays[4] = {r->q, r->k, r->v, r->dout};
        int64_t counts[4] = {nq, nk, nk, nq};
        char path[600];
        snprintf(path, sizeof path, "%s/case_%d.bin", dir, i);
        if (!write_all(path, hdr, sizeof hdr, &scale, sizeof scale, arrays, counts, 4)) {
            snprintf(torch_err, sizeof torch_err, "cannot write %s", path);
            return;
        }
    }
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "'%s' '%s' '%s' %d", python, script, dir, (int)NCASES);
    int rc = system(cmd);
    if (rc != 0) snprintf(torch_err, sizeof torch_err, "%s exited with %d", cmd, rc);
    for (int i = 0; i < NCASES; i++) {
        char path[600];
        snprintf(path, sizeof path, "%s/torch_%d.bin", dir, i);
        FILE *f = rc == 0 ? fopen(path, "rb") : NULL;
        for (int j = 0; j < 5; j++) {
            runs[i].t[j] = ref_alloc_d(runs[i].n[j]);
            if (f && fread(runs[i].t[j], sizeof(double), (size_t)runs[i].n[j], f) !=
                         (size_t)runs[i].n[j] && !torch_err[0])
                snprintf(torch_err, sizeof torch_err, "%s is short", path);
        }
        if (f) fclose(f);
        else if (!torch_err[0]) snprintf(torch_err, sizeof torch_err, "no %s", path);
        remove(path);
        snprintf(path, sizeof path, "%s/case_%d.bin", dir, i);
        remove(path);
    }
    rmdir(dir);
}

static const char *what[5] = {"out", "lse", "dq", "dk", "dv"};

static void check_case(int i) {
    run_all();
    CHECK(!torch_err[0], "%s", torch_err);
    if (torch_err[0]) return;
    run *r = &runs[i];
    const torch_case *c = &cases[i];
    CHECK(r->st.code == ULY_OK, "%s: %s", c->name, r->st.msg);
    const float *got[5] = {r->o, r->lse, r->dq, r->dk, r->dv};
    for (int j = 0; j < 5; j++) {
        double e = ref_maxdiff_fd(got[j], r->t[j], r->n[j]);
        CHECK(e <= 1e-5, "%s: %s differs from torch by %g", c->name, what[j], e);
    }
}

TEST(mha_matches_torch) { check_case(0); }
TEST(mha_causal_matches_torch) { check_case(1); }
TEST(gqa_causal_matches_torch) { check_case(2); }
TEST(mqa_causal_with_fewer_queries_than_keys_matches_torch) { check_case(3); }
TEST(causal_with_more_queries_than_keys_matches_torch_including_rows_without_keys) {
    check_case(4);
}
TEST(gqa_with_explicit_scale_and_fewer_queries_than_keys_matches_torch) { check_case(5); }
TEST(gqa_causal_with_explicit_scale_and_more_queries_than_keys_matches_torch) { check_case(6); }

TEST(the_tests_fp64_reference_agrees_with_torch_to_1e_10) {
    run_all();
    CHECK(!torch_err[0], "%s", torch_err);
    if (torch_err[0]) return;
    for (int i = 0; i < NCASES; i++) {
        const torch_case *c = &cases[i];
        run *r = &runs[i];
        ref_shape s = {c->B, c->Sq, c->Sk, c->H, c->Hkv, c->D, c->causal, c->scale};
        double *ref[5];
        for (int j = 0; j < 5; j++) ref[j] = ref_alloc_d(r->n[j]);
        ref64_forward(&s, r->q, r->k, r->v, ref[0], ref[1]);
        ref64_backward(&s, r->q, r->k, r->v, r->dout, ref[2], ref[3], ref[4]);
        for (int j = 0; j < 5; j++) {
            double e = 0;
            for (int64_t k = 0; k < r->n[j]; k++) e = fmax(e, ref_err(ref[j][k], r->t[j][k]));
            CHECK(e <= 1e-10, "%s: ref64 %s differs from torch by %g", c->name, what[j], e);
            free(ref[j]);
        }
    }
}

int main(int argc, char **argv) {
    if (argc > 1) python = argv[1];
    if (argc > 2) script = argv[2];
    return uly_run_tests();
}
