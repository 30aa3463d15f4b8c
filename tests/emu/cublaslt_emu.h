// cublaslt_emu.h: the test hook of tests/emu/cublaslt_emu.cpp, the cuBLASLt double (tests only;
// not part of the product).
#ifndef ULY_CUBLASLT_EMU_H
#define ULY_CUBLASLT_EMU_H
#include <cstdint>

// The least MIN_ALIGNMENT_*_BYTES that any cublasLtMatmulAlgoGetHeuristic call was asked for
// since the last call of this (256 if none), which starts the count again.
uint32_t uly_emu_cublaslt_least_alignment();

#endif
