/* test_flash_gpu.cu - the cuBLASLt unfused attention (GPU only; make test-gpu): the second,
   independent GPU reference for the flash kernels, and the fallback for other head dims.

   - On the shape matrix of test_flash.cu, in bf16 and fp16, D = 64 and 128, the cuBLASLt path
     meets the accuracy rule against fp64 (flash_case.h), and flash agrees with it within the
     same bound (twice the error of a plain attention in that precision, plus 1e-3).
   - Head dims the flash kernels do not take (8, 96, 256) meet the accuracy rule. */
#include <cublasLt.h>
#define ULYSSES_CUBLASLT
#define ULYSSES_IMPLEMENTATION
#include "../ulysses_cuda.cuh"
#include "check.h"
#include "flash_case.h"

static cublasLtHandle_t lt_handle(void) {
    static cublasLtHandle_t h;
    if (!h) CHECK(cublasLtCreate(&h) == CUBLAS_STATUS_SUCCESS, "cublasLtCreate");
    return h;
}

/* cuBLASLt against fp64, and flash against cuBLASLt. */
static void agree(const fcase &c) {
    const inputs in = make_inputs(c, c.B * c.Sq, c.B * c.Sk);
    const std::vector<int> cq = dense_cu(c.B, c.Sq), ck = dense_cu(c.B, c.Sk);
    const run_out lt = run_attn(c, cq, ck, false, in, uly_cublaslt_attention(lt_handle()));
    const run_out fa = run_attn(c, cq, ck, false, in, uly_flash_attention());
    if (!lt.ok || !fa.ok) return;
    const outputs r64 = reference(c, cq, ck, false, in, false), low = reference(c, cq, ck, false, in, true);
    check_outputs(c, lt, r64, low, NULL);
    for (const field &f : fields) {
        const double err = max_err(fa.*f.got, lt.*f.got), base = max_err(low.*f.want, r64.*f.want);
        CHECK(err <= 2 * base + 1e-3, "%s: flash %s differs from cuBLASLt by %.3g",
              describe(c).c_str(), f.name, err);
    }
}

TEST(cublaslt_agrees_with_flash) {
    for (uly_dtype dt : {ULY_BF16, ULY_F16})
        for (int64_t D : {64, 128})
            for (const shape &s : shapes) agree(make_case(s, D, dt));
}

TEST(cublaslt_other_head_dims) {
    for (int64_t D : {8, 96, 256}) {
        const fcase c = make_case({2, 129, 77, 4, 2, 1}, D, ULY_BF16);
        const inputs in = make_inputs(c, c.B * c.Sq, c.B * c.Sk);
        const std::vector<int> cq = dense_cu(c.B, c.Sq), ck = dense_cu(c.B, c.Sk);
        const run_out lt = run_attn(c, cq, ck, false, in, uly_cublaslt_attention(lt_handle()));
        if (lt.ok)
            check_outputs(c, lt, reference(c, cq, ck, false, in, false),
                          reference(c, cq, ck, false, in, true), NULL);
    }
}

int main(void) { return uly_run_tests(); }
