/* ulysses_cuda.cuh with a toolkit older than 12.1, which cannot pass the layout kernel its
   7 KB parameter: make test expects this file to stop at the header's #error, with its message,
   rather than at ptxas ("Formal parameter space overflowed") or at the first launch. */
#include "emu/cuda_emu.h"
#undef CUDART_VERSION
#define CUDART_VERSION 12000
#include "../ulysses_cuda.cuh"
