/* ulysses_cuda.cuh - the GPU side of ulysses: layout kernels, NCCL and device-local
   communicators, FlashAttention-compatible attention kernels, on the API of ulysses.h.

   (Under construction: the sections live in wip/ while several engineers write them, and are
   merged into this one file before release.)

   OPTIONS (define before including)
       ULYSSES_NCCL   build the NCCL communicator (include <nccl.h> first; link -lnccl)
   Under the project's CUDA host emulator (tests/emu) the same source runs on the CPU. */
#ifndef ULYSSES_CUDA_CUH
#define ULYSSES_CUDA_CUH

#include "ulysses.h"

#include "wip/cuda_ptx.cuh"
#include "wip/cuda_layout.cuh"
#include "wip/cuda_flash.cuh"

#endif
