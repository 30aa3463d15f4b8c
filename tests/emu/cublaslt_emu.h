// cublaslt_emu.h: the test hooks of tests/emu/cublaslt_emu.cpp, the cuBLASLt double (tests only;
// not part of the product).
#ifndef ULY_CUBLASLT_EMU_H
#define ULY_CUBLASLT_EMU_H
#include <cublasLt.h>
#include <cstdint>

// The least MIN_ALIGNMENT_*_BYTES that any cublasLtMatmulAlgoGetHeuristic call was asked for
// since the last call of this (256 if none), which starts the count again.
uint32_t uly_emu_cublaslt_least_alignment();

// The next cublasLtMatmulAlgoGetHeuristic call finds no kernel, as on a GPU that has none for
// the product: it returns s (CUBLAS_STATUS_SUCCESS or CUBLAS_STATUS_NOT_SUPPORTED, both of
// which cuBLASLt may answer) with a count of 0. Once.
void uly_emu_cublaslt_no_kernel(cublasStatus_t s);

#endif
