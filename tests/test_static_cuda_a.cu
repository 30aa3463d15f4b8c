/* test_static_cuda_a.cu - with test_static_cuda_b.cu: two translation units each embed a private
   copy of ulysses_cuda.cuh's implementation (ULYSSES_STATIC) and link into one program, as
   test_static does for ulysses.h. Each copy's layout packs a one-rank Q exchange, which is a
   plain copy of the tensor. Builds under the CUDA emulator (make test) and with nvcc. */
#include "emu/cuda_emu.h"
#define ULYSSES_STATIC
#define ULYSSES_IMPLEMENTATION
#include "../ulysses_cuda.cuh"
#include "check.h"

#include <string.h>

uly_layout static_b_layout(void); /* test_static_cuda_b.cu's uly_cuda_layout(), its own copy */

/* Packs a [1, 4, 2, 8] bf16 tensor numbered 1, 2, ... for a plan of one rank with layout l, and
   says whether the exchange buffer holds the tensor's bytes. */
static int packs_a_copy(uly_layout l) {
    enum { N = 4 * 2 * 8 };
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    d.world_size = 1, d.sp_size = 1, d.batch = 1, d.seq_len = 4, d.n_heads = 2;
    d.n_kv_heads = 2, d.head_dim = 8, d.dtype = ULY_BF16;
    uly_plan p;
    uint16_t src[N], got[N];
    for (int i = 0; i < N; i++) src[i] = (uint16_t)(i + 1);
    void *t = NULL, *send = NULL;
    int ok = !uly_plan_init(&p, &d).code && uly_send_bytes(&p, ULY_X_Q) == sizeof src &&
             cudaMalloc(&t, sizeof src) == cudaSuccess &&
             cudaMalloc(&send, sizeof src) == cudaSuccess &&
             cudaMemcpy(t, src, sizeof src, cudaMemcpyHostToDevice) == cudaSuccess &&
             !l.pack(l.ctx, &p, ULY_X_Q, uly_dense(t, ULY_BF16, 1, 4, 2, 8), send, NULL).code &&
             cudaMemcpy(got, send, sizeof got, cudaMemcpyDeviceToHost) == cudaSuccess &&
             !memcmp(got, src, sizeof src);
    cudaFree(t), cudaFree(send);
    return ok;
}

TEST(two_static_copies_of_the_cuda_implementation_link_and_each_packs) {
    const uly_layout a = uly_cuda_layout(), b = static_b_layout();
    CHECK(a.pack != b.pack, "one copy, not two: both packs at %p", (void *)a.pack);
    CHECK(packs_a_copy(a), "this copy's pack");
    CHECK(packs_a_copy(b), "test_static_cuda_b.cu's pack");
}

int main(void) { return uly_run_tests(); }
