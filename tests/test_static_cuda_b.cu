/* test_static_cuda_b.cu - the second private copy for test_static_cuda_a.cu. */
#include "emu/cuda_emu.h"
#define ULYSSES_STATIC
#define ULYSSES_IMPLEMENTATION
#include "../ulysses_cuda.cuh"

uly_layout static_b_layout(void);
uly_layout static_b_layout(void) { return uly_cuda_layout(); }
