# ulysses - a plain Makefile.
#   make demo          one SP attention layer, 4 ranks on the local communicator (the main job)
#   make test          the whole suite (STRICT=1: a missing tool fails instead of skipping)
#   make bench         CPU benchmarks; make bench-gpu on a machine with a GPU
#   make test-gpu      the GPU tests, when a GPU is present
#   make sanitize-gpu  a subset of them under compute-sanitizer (memcheck, racecheck, synccheck)
#   make install PREFIX=/usr/local
# It detects mpicc, nvcc, PyTorch and a GPU, and says what it skips without them.

CC       ?= cc
CXX      ?= c++
CUDA_HOME ?= /usr/local/cuda
NVCC     ?= $(CUDA_HOME)/bin/nvcc
MPICC    ?= mpicc
PYTHON   ?= /usr/bin/python3
PREFIX   ?= /usr/local
BUILD    ?= build
STRICT   ?= 0

WARN     = -Wall -Wextra -Wpedantic -Werror
CFLAGS   = -std=c99 -O2 -g $(WARN) -I.
# -g1 (line tables, what a sanitizer's report and a backtrace need) builds the emulated kernels
# a quarter faster than -g, which a debugger needs to show locals. The C++ tests build at -O1 and
# the sanitized ones at -Og: GCC compiles an emulated kernel test in about two thirds of the time
# it takes at -O2 and -O1 respectively, and it runs as fast. The emulator and the doubles, the
# scheduling that is a third of an emulated kernel test's time, build at -O2 (the rules say so).
CXXFLAGS = -std=c++17 -O1 -g1 -Wall -Wextra -Werror -I.
SAN      = -Og -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
LDLIBS   = -lm -lpthread
# Open MPI refuses root unless told; CI runs as root.
MPIRUN   = OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe
# The emulator runs the real kernel source under the host compiler (tests/emu).
EMU_CXXFLAGS = $(CXXFLAGS) -Itests -isystem $(CUDA_HOME)/include
# nvcc's -O is the host code's (device code is optimized whatever it says): test harnesses,
# references and launches, which -O1 builds in half the time of -O3.
NVCCFLAGS = -std=c++17 -O1 -I. -Itests -Werror all-warnings -Xcompiler -Wall,-Wextra
NVARCH   = -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
# test_flash (whose ptxas report make test reads for spills) and the benchmarks build every
# kernel for both; the other GPU programs (tests, the NCCL example), the same kernels, build for
# the GPU here, which is all make test-gpu runs them on. Without a GPU nothing runs them, and
# make test builds them only to prove that they compile and link with warnings as errors: their
# device code stops at unoptimized PTX (cicc -O0), a third of the time of sm_90's machine code,
# which test_flash's build has.
GPU_SM  := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | \
                   head -n 1 | tr -d .)
TESTARCH = $(if $(GPU_SM),-arch=sm_$(GPU_SM),-gencode arch=compute_90,code=compute_90 -Xcicc -O0)

HAVE_MPI   := $(shell command -v $(MPICC) >/dev/null 2>&1 && echo 1)
HAVE_NVCC  := $(shell command -v $(NVCC) >/dev/null 2>&1 && echo 1)
HAVE_TORCH := $(shell $(PYTHON) -c 'import torch' >/dev/null 2>&1 && echo 1)
HAVE_MPL   := $(shell $(PYTHON) -c 'import matplotlib' >/dev/null 2>&1 && echo 1)
HAVE_GPU   := $(shell nvidia-smi -L 2>/dev/null | grep -q GPU && echo 1)

# Each section adds to these lists. TESTS are shell commands whose output ends in
# "N passed, M failed" ("skip:why" stands for one this machine cannot run); TEST_BINS are the
# files they need built. Likewise for the GPU tests and the benchmarks.
TESTS     =
TEST_BINS =
GPU_TESTS =
GPU_BINS  =
BENCHES   =
BENCH_BINS =
GPU_BENCHES =
GPU_BENCH_BINS =

.PHONY: all demo demo-mpi test build-gpu test-gpu sanitize-gpu bench bench-gpu install clean
all: $(BUILD)/demo

$(BUILD) $(BUILD)/asan:
	mkdir -p $@

# --- foundation (ulysses.h) ---

# Foundation tests (tests/test_*.c): every C test is built twice, plain in $(BUILD)/ and with
# $(SAN) in $(BUILD)/asan/, and both run. The MPI test needs mpicc, the torch test PyTorch.
ULY_CTESTS    = test_plan test_layer test_loss test_errors test_dtype test_edges test_torch
ULY_TEST_DEPS = ulysses.h tests/check.h tests/ref64.h tests/sp_case.h tests/attn_call.h
ULY_TORCH_RUN = $(PYTHON) tests/torch_attention.py
HAVE_CLANG   := $(shell command -v clang >/dev/null 2>&1 && \
                        command -v clang++ >/dev/null 2>&1 && echo 1)

$(BUILD)/hdr:
	mkdir -p $@

$(ULY_CTESTS:%=$(BUILD)/%): $(BUILD)/%: tests/%.c $(ULY_TEST_DEPS) | $(BUILD)
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)
$(ULY_CTESTS:%=$(BUILD)/asan/%): $(BUILD)/asan/%: tests/%.c $(ULY_TEST_DEPS) | $(BUILD)/asan
	$(CC) $(CFLAGS) $(SAN) -o $@ $< $(LDLIBS)

# Two translation units, one with the implementation; the second also as C++ (extern "C").
ULY_LINK_SRC   = tests/test_link_a.c tests/test_link_b.c
ULY_STATIC_SRC = tests/test_static_a.c tests/test_static_b.c
$(BUILD)/test_link: $(ULY_LINK_SRC) ulysses.h tests/check.h | $(BUILD)
	$(CC) $(CFLAGS) -o $@ $(ULY_LINK_SRC) $(LDLIBS)
$(BUILD)/asan/test_link: $(ULY_LINK_SRC) ulysses.h tests/check.h | $(BUILD)/asan
	$(CC) $(CFLAGS) $(SAN) -o $@ $(ULY_LINK_SRC) $(LDLIBS)
$(BUILD)/test_link_cxx: tests/test_link_a.c tests/test_link_b.c ulysses.h tests/check.h | $(BUILD)
	$(CC) $(CFLAGS) -c -o $@_a.o tests/test_link_a.c
	$(CXX) $(CXXFLAGS) -Wpedantic -x c++ -c -o $@_b.o tests/test_link_b.c
	$(CXX) -o $@ $@_a.o $@_b.o $(LDLIBS)
# Two private copies (ULYSSES_STATIC) in one program.
$(BUILD)/test_static: $(ULY_STATIC_SRC) ulysses.h tests/check.h | $(BUILD)
	$(CC) $(CFLAGS) -o $@ $(ULY_STATIC_SRC) $(LDLIBS)
$(BUILD)/asan/test_static: $(ULY_STATIC_SRC) ulysses.h tests/check.h | $(BUILD)/asan
	$(CC) $(CFLAGS) $(SAN) -o $@ $(ULY_STATIC_SRC) $(LDLIBS)

# The header with its implementation compiles as C99 and C++17 under gcc and clang, -Werror.
ULY_HDR_FLAGS = $(WARN) -I. -c tests/header_check.c
$(BUILD)/hdr/gcc-c99.o: tests/header_check.c ulysses.h | $(BUILD)/hdr
	gcc -std=c99 $(ULY_HDR_FLAGS) -o $@
$(BUILD)/hdr/gcc-c99-nothreads.o: tests/header_check.c ulysses.h | $(BUILD)/hdr
	gcc -std=c99 -DULYSSES_NO_THREADS $(ULY_HDR_FLAGS) -o $@
$(BUILD)/hdr/gxx-c++17.o: tests/header_check.c ulysses.h | $(BUILD)/hdr
	g++ -std=c++17 -x c++ $(ULY_HDR_FLAGS) -o $@
$(BUILD)/hdr/clang-c99.o: tests/header_check.c ulysses.h | $(BUILD)/hdr
	clang -std=c99 $(ULY_HDR_FLAGS) -o $@
$(BUILD)/hdr/clangxx-c++17.o: tests/header_check.c ulysses.h | $(BUILD)/hdr
	clang++ -std=c++17 -x c++ $(ULY_HDR_FLAGS) -o $@

TEST_BINS += $(ULY_CTESTS:%=$(BUILD)/%) $(ULY_CTESTS:%=$(BUILD)/asan/%)
TEST_BINS += $(BUILD)/test_link $(BUILD)/asan/test_link $(BUILD)/test_link_cxx
TEST_BINS += $(BUILD)/test_static $(BUILD)/asan/test_static
TEST_BINS += $(BUILD)/hdr/gcc-c99.o $(BUILD)/hdr/gcc-c99-nothreads.o $(BUILD)/hdr/gxx-c++17.o
# test_torch runs with its PyTorch reference (below).
ULY_CTESTS_RUN = $(filter-out test_torch,$(ULY_CTESTS)) test_link test_static
TESTS += $(foreach d,$(BUILD) $(BUILD)/asan,$(addprefix $(d)/,$(ULY_CTESTS_RUN)))
TESTS += $(BUILD)/test_link_cxx

# The README's complete integration as printed there, seq_len 8192 cut to 256 so that it runs in
# a second: it compiles with the tests' warnings as errors and runs, under ASan, with nothing on
# stderr (a failing call prints its message there).
$(BUILD)/readme_example.c: README.md | $(BUILD)
	awk '/^## A complete integration/ { f = 1 } f && /^```c$$/ { p = 1; next } \
	     p && /^```$$/ { exit } p' $< | sed 's/\.seq_len = 8192/.seq_len = 256/' > $@
	grep -q 'seq_len = 256' $@
$(BUILD)/readme_example: $(BUILD)/readme_example.c ulysses.h
	$(CC) $(CFLAGS) $(SAN) -o $@ $< $(LDLIBS)
TEST_BINS += $(BUILD)/readme_example
TESTS     += 'err=$$($(BUILD)/readme_example 2>&1 >/dev/null) && [ -z "$$err" ] && \
              echo "1 passed, 0 failed"'
ifeq ($(HAVE_CLANG),1)
TEST_BINS += $(BUILD)/hdr/clang-c99.o $(BUILD)/hdr/clangxx-c++17.o
else
TESTS += 'skip:header-check-with-clang (no clang or clang++)'
endif
ifeq ($(HAVE_TORCH),1)
TESTS += '$(BUILD)/test_torch $(ULY_TORCH_RUN)' '$(BUILD)/asan/test_torch $(ULY_TORCH_RUN)'
else
TESTS += 'skip:test_torch (no PyTorch for $(PYTHON): apt-get install python3-torch)'
endif
ifeq ($(HAVE_MPI),1)
$(BUILD)/test_mpi: tests/test_mpi.c $(ULY_TEST_DEPS) | $(BUILD)
	$(MPICC) $(CFLAGS) -o $@ $< $(LDLIBS)
$(BUILD)/asan/test_mpi: tests/test_mpi.c $(ULY_TEST_DEPS) | $(BUILD)/asan
	$(MPICC) $(CFLAGS) $(SAN) -o $@ $< $(LDLIBS)
TEST_BINS += $(BUILD)/test_mpi $(BUILD)/asan/test_mpi
TESTS += 'timeout 300 env $(MPIRUN) -np 4 $(BUILD)/test_mpi'
# Open MPI's own allocations are never freed; leaks are checked by the other ASan runs.
TESTS += 'timeout 300 env $(MPIRUN) -x ASAN_OPTIONS=detect_leaks=0 -np 4 $(BUILD)/asan/test_mpi'
else
TESTS += 'skip:test_mpi (no $(MPICC): apt-get install openmpi-bin libopenmpi-dev)'
endif

# The demo and the CPU benchmarks. -O3: the fp32 reference attention and the layout loops
# vectorize at -O3 (gcc's -O2 vectorizes little). DEMO_ARGS passes options, e.g. -s 8192.
ULY_FAST = $(CFLAGS) -O3
DEMO_ARGS ?=
$(BUILD)/demo: examples/demo.c ulysses.h | $(BUILD)
	$(CC) $(ULY_FAST) -o $@ $< $(LDLIBS)
$(BUILD)/demo-mpi: examples/demo.c ulysses.h | $(BUILD)
	$(MPICC) $(ULY_FAST) -DULYSSES_MPI -o $@ $< $(LDLIBS)
demo: $(BUILD)/demo
	$(BUILD)/demo $(DEMO_ARGS)
# make test runs both, on 300 tokens: 3 ranks split the kv groups and the tokens unevenly.
TESTS     += '$(BUILD)/demo -s 300 -p 3 -b 2 && echo "1 passed, 0 failed"'
TEST_BINS += $(BUILD)/demo
ifeq ($(HAVE_MPI),1)
demo-mpi: $(BUILD)/demo-mpi
	$(MPIRUN) -np 4 $(BUILD)/demo-mpi $(DEMO_ARGS)
TESTS     += 'env $(MPIRUN) -np 3 $(BUILD)/demo-mpi -s 300 -b 2 && echo "1 passed, 0 failed"'
TEST_BINS += $(BUILD)/demo-mpi
else
demo-mpi:
	@echo "demo-mpi: no $(MPICC) here (apt-get install openmpi-bin libopenmpi-dev)"; exit 1
TESTS     += 'skip:demo-mpi (no $(MPICC): apt-get install openmpi-bin libopenmpi-dev)'
endif

# The CPU benchmarks. make test runs each once at a small size, a smoke check (every call
# succeeds, the table prints; the times mean nothing), so that they keep running.
$(BUILD)/bench_cpu: bench/bench_cpu.c ulysses.h | $(BUILD)
	$(CC) $(ULY_FAST) -o $@ $< $(LDLIBS)
BENCH_BINS += $(BUILD)/bench_cpu
BENCHES    += $(BUILD)/bench_cpu
TESTS      += '$(BUILD)/bench_cpu -s 300 -h 6 -k 3 -d 16 -b 2 -p 4 && echo "1 passed, 0 failed"'
TEST_BINS  += $(BUILD)/bench_cpu
ifeq ($(HAVE_MPI),1)
$(BUILD)/bench_mpi: bench/bench_mpi.c ulysses.h | $(BUILD)
	$(MPICC) $(ULY_FAST) -o $@ $< $(LDLIBS)
BENCH_BINS += $(BUILD)/bench_mpi
# One process a core, 2 to 4: on shared cores every point where the ranks meet waits for the
# scheduler to run each of them, which times the machine rather than the exchange.
MPI_BENCH_NP := $(shell n=$$(nproc 2>/dev/null || echo 4); [ $$n -gt 4 ] && n=4; \
                        [ $$n -lt 2 ] && n=2; echo $$n)
BENCHES    += '$(MPIRUN) -np $(MPI_BENCH_NP) $(BUILD)/bench_mpi'
TESTS      += 'env $(MPIRUN) -np 4 $(BUILD)/bench_mpi 4096 && echo "1 passed, 0 failed"'
TEST_BINS  += $(BUILD)/bench_mpi
else
BENCHES    += 'skip:bench_mpi (no $(MPICC): apt-get install openmpi-bin libopenmpi-dev)'
TESTS      += 'skip:bench_mpi (no $(MPICC): apt-get install openmpi-bin libopenmpi-dev)'
endif

# --- emulator ---
# The CUDA host emulator (tests/emu): emulated tests link EMU_OBJ (EMU_ASAN_OBJ under SAN) and
# are compiled with $(CXX) $(EMU_CXXFLAGS) -x c++ test.cu.
# Kernels write `#pragma unroll`, which GCC before 13 warns about (and no pragma silences).
EMU_CXXFLAGS += -Wno-unknown-pragmas
EMU_HDRS     = tests/emu/cuda_emu.h ulysses.h ulysses_cuda.cuh tests/check.h
EMU_OBJ      = $(BUILD)/emu/cuda_emu.o
EMU_ASAN_OBJ = $(BUILD)/asan/emu/cuda_emu.o

# An emulated test's ASan run is its plain run's cases instrumented, less the cases that only
# repeat kernels and buffers the ASan run already covers (ASAN_SKIP_test, words of
# ULY_TEST_FILTER): a repeat costs ASan's 5x and finds no new access.
ASAN_RUN = $(if $(ASAN_SKIP_$(1)),'ULY_TEST_FILTER=$(ASAN_SKIP_$(1)) $(BUILD)/asan/$(1)', \
                                  $(BUILD)/asan/$(1))

$(EMU_OBJ): tests/emu/cuda_emu.cpp tests/emu/cuda_emu.h
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) -O2 -c $< -o $@
$(EMU_ASAN_OBJ): tests/emu/cuda_emu.cpp tests/emu/cuda_emu.h
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(SAN) -O2 -c $< -o $@
$(BUILD)/test_emu: tests/test_emu.cu $(EMU_HDRS) $(EMU_OBJ)
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) -x c++ $< -x none $(EMU_OBJ) -o $@ $(LDLIBS)
$(BUILD)/asan/test_emu: tests/test_emu.cu $(EMU_HDRS) $(EMU_ASAN_OBJ)
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(SAN) -x c++ $< -x none $(EMU_ASAN_OBJ) -o $@ $(LDLIBS)
$(BUILD)/bench_emu: bench/bench_emu.cu $(EMU_HDRS) $(EMU_OBJ)
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) -x c++ $< -x none $(EMU_OBJ) -o $@ $(LDLIBS)
# The same self-test on a GPU: built whenever nvcc is here (so make test proves that it
# compiles), run by make test-gpu.
$(BUILD)/gpu/test_emu: tests/test_emu.cu ulysses.h ulysses_cuda.cuh tests/check.h \
                       tests/emu/cuda_emu.h
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) $(TESTARCH) -x cu $< -o $@

TESTS      += $(BUILD)/test_emu $(BUILD)/asan/test_emu
TEST_BINS  += $(BUILD)/test_emu $(BUILD)/asan/test_emu $(if $(HAVE_NVCC),$(BUILD)/gpu/test_emu)
GPU_TESTS  += $(BUILD)/gpu/test_emu
GPU_BINS   += $(BUILD)/gpu/test_emu
BENCHES    += $(BUILD)/bench_emu
BENCH_BINS += $(BUILD)/bench_emu
TESTS      += '$(BUILD)/bench_emu && echo "1 passed, 0 failed"'
TEST_BINS  += $(BUILD)/bench_emu

# --- cuda ---
# The GPU layer (ulysses_cuda.cuh): layout kernels, device-local and NCCL communicators, the
# reference attention. test_cuda_layout and test_cuda_layer run under the emulator, plain and
# ASan (make test), and on a GPU (make test-gpu). make test also builds them and the NCCL
# example (libnccl.so.2) with nvcc (TESTARCH), -Werror, and fails if a layout kernel spills.
# test_nccl runs the NCCL communicator under the emulator against tests/emu/nccl_emu.cpp, an
# in-process NCCL whose ranks are threads (it needs nccl.h, not libnccl); it has no GPU build,
# since NCCL refuses two ranks on one GPU: on GPUs the NCCL example runs under MPI.
CUDA_HDRS  = ulysses.h ulysses_cuda.cuh tests/ref64.h tests/sp_case.h tests/sp_cuda_case.h \
             tests/attn_call.h tests/flash_case.h $(EMU_HDRS)
CUDA_TESTS = test_cuda_layout test_cuda_layer
# NCCL from the toolkit or the system; NCCL_HOME=DIR takes DIR/include/nccl.h and
# DIR/lib/libnccl.so.2 instead (PyTorch's nvidia/nccl wheel has that layout and no libnccl.so).
NCCL_HOME ?=
HAVE_NCCL := $(shell test -f $(CUDA_HOME)/include/nccl.h -o -f /usr/include/nccl.h \
                     $(if $(NCCL_HOME),-o -f $(NCCL_HOME)/include/nccl.h) && echo 1)
NCCL_INC   = $(if $(NCCL_HOME),-isystem $(NCCL_HOME)/include)
NCCL_LIBS  = $(if $(NCCL_HOME),-L$(NCCL_HOME)/lib -Xlinker -rpath=$(NCCL_HOME)/lib) -l:libnccl.so.2
NGPUS     := $(shell nvidia-smi -L 2>/dev/null | grep -c GPU)
# mpicc's flags in nvcc's words: nvcc takes no -pthread (it links libpthread itself) and spells
# -Wl,X as -Xlinker X.
MPI_NVCC    = $(patsubst -Wl$(comma)%,-Xlinker %,$(filter-out -pthread,$(1)))
comma      := ,
MPI_CUFLAGS = $(call MPI_NVCC,$(shell $(MPICC) --showme:compile 2>/dev/null))
MPI_CULIBS  = $(call MPI_NVCC,$(shell $(MPICC) --showme:link 2>/dev/null))

$(CUDA_TESTS:%=$(BUILD)/%): $(BUILD)/%: tests/%.cu $(CUDA_HDRS) $(EMU_OBJ)
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) -x c++ $< -x none $(EMU_OBJ) -o $@ $(LDLIBS)
$(CUDA_TESTS:%=$(BUILD)/asan/%): $(BUILD)/asan/%: tests/%.cu $(CUDA_HDRS) $(EMU_ASAN_OBJ)
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(SAN) -x c++ $< -x none $(EMU_ASAN_OBJ) -o $@ $(LDLIBS)
$(CUDA_TESTS:%=$(BUILD)/gpu/%): $(BUILD)/gpu/%: tests/%.cu $(CUDA_HDRS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) $(TESTARCH) -x cu $< -o $@
$(BUILD)/gpu/sp_attention_nccl: examples/sp_attention_nccl.cu $(CUDA_HDRS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) $(TESTARCH) $(NCCL_INC) $(MPI_CUFLAGS) -x cu $< -o $@ $(MPI_CULIBS) \
	    $(NCCL_LIBS)
$(BUILD)/emu/nccl_emu.o: tests/emu/nccl_emu.cpp tests/emu/nccl_emu.h tests/emu/cuda_emu.h
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(NCCL_INC) -O2 -c $< -o $@
$(BUILD)/asan/emu/nccl_emu.o: tests/emu/nccl_emu.cpp tests/emu/nccl_emu.h tests/emu/cuda_emu.h
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(NCCL_INC) $(SAN) -O2 -c $< -o $@
# test_nccl is compiled once and linked with the double twice: as it is, and (test_nccl_2_27)
# as an older library that reports 2.27.7 and has no ncclAlltoAll, which links only because the
# library's reference to it is weak.
$(BUILD)/emu/test_nccl.o: tests/test_nccl.cu tests/emu/nccl_emu.h $(CUDA_HDRS)
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(NCCL_INC) -x c++ -c $< -o $@
$(BUILD)/emu/nccl_emu_2_27.o: tests/emu/nccl_emu.cpp tests/emu/nccl_emu.h tests/emu/cuda_emu.h
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(NCCL_INC) -DULY_EMU_NCCL_2_27 -O2 -c $< -o $@
$(BUILD)/test_nccl: $(BUILD)/emu/test_nccl.o $(EMU_OBJ) $(BUILD)/emu/nccl_emu.o
	$(CXX) $^ -o $@ $(LDLIBS)
$(BUILD)/test_nccl_2_27: $(BUILD)/emu/test_nccl.o $(EMU_OBJ) $(BUILD)/emu/nccl_emu_2_27.o
	$(CXX) $^ -o $@ $(LDLIBS)
$(BUILD)/asan/test_nccl: tests/test_nccl.cu tests/emu/nccl_emu.h $(CUDA_HDRS) $(EMU_ASAN_OBJ) \
                         $(BUILD)/asan/emu/nccl_emu.o
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(NCCL_INC) $(SAN) -x c++ $< -x none $(filter %.o,$^) -o $@ $(LDLIBS)
# The same tests as NCCL before 2.28 runs them: no ncclAlltoAll, every exchange send/recv.
$(BUILD)/test_nccl_sendrecv: tests/test_nccl.cu tests/emu/nccl_emu.h $(CUDA_HDRS) $(EMU_OBJ) \
                             $(BUILD)/emu/nccl_emu.o
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(NCCL_INC) -DULY_NCCL_ALLTOALL=0 -x c++ $< -x none \
	    $(filter %.o,$^) -o $@ $(LDLIBS)

# Two private copies of ulysses_cuda.cuh's implementation (ULYSSES_STATIC) in one program, under
# the emulator (-Werror: a copy calls only some of the functions; no ASan build, since the pack
# it runs is test_cuda_layout's) and, by make test-gpu, with nvcc (not in make test: it compiles
# every kernel twice more, for a link that the emulator's build already makes).
CUDA_STATIC_SRC = tests/test_static_cuda_a.cu tests/test_static_cuda_b.cu
$(BUILD)/test_static_cuda: $(CUDA_STATIC_SRC) $(EMU_HDRS) $(EMU_OBJ)
	$(CXX) $(EMU_CXXFLAGS) -x c++ $(CUDA_STATIC_SRC) -x none $(EMU_OBJ) -o $@ $(LDLIBS)
$(BUILD)/gpu/test_static_cuda: $(CUDA_STATIC_SRC) $(EMU_HDRS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) $(TESTARCH) -x cu $(CUDA_STATIC_SRC) -o $@
TESTS     += $(BUILD)/test_static_cuda
# A toolkit older than 12.1 stops at the header's #error, which names the need.
TESTS     += 'out=$$($(CXX) $(EMU_CXXFLAGS) -fsyntax-only -x c++ tests/cuda_too_old.cu 2>&1); \
              echo "$$out" | grep "needs CUDA 12.1" && echo "1 passed, 0 failed"'
TEST_BINS += $(BUILD)/test_static_cuda
GPU_TESTS += $(BUILD)/gpu/test_static_cuda
GPU_BINS  += $(BUILD)/gpu/test_static_cuda

# The flash layer in bf16 (every case, half of them in each dQ mode): the f16 matrix runs the
# same kernels in another element type (each case in its other dQ mode); the split-group sums
# repeat the bf16 layer's kernels, and packed documents the layer's calls with test_flash's
# varlen kernels (ASan runs both). The reference layer in every dtype (a second each).
ASAN_SKIP_test_cuda_layer = -flash_layer_f16,-split_group,-attends_within_packed
TESTS     += $(CUDA_TESTS:%=$(BUILD)/%) $(foreach t,$(CUDA_TESTS),$(call ASAN_RUN,$(t)))
TEST_BINS += $(CUDA_TESTS:%=$(BUILD)/%) $(CUDA_TESTS:%=$(BUILD)/asan/%)
ifeq ($(HAVE_NVCC),1)
TESTS     += 'tests/ptxas_spills.sh $(BUILD)/gpu/test_flash.ptxas uly__box_copy'
TEST_BINS += $(CUDA_TESTS:%=$(BUILD)/gpu/%) $(BUILD)/gpu/test_flash
else
TESTS     += 'skip:layout kernel build and spill check (no nvcc)'
endif
ifeq ($(HAVE_NVCC)$(HAVE_MPI)$(HAVE_NCCL),111)
TEST_BINS += $(BUILD)/gpu/sp_attention_nccl
else
TESTS     += 'skip:NCCL example build (needs nvcc, $(MPICC) and nccl.h)'
endif
# The NCCL example itself, under the emulator with its ranks as threads: tests/emu/mpi_emu.cpp
# stands for MPI (the example's <mpi.h> is tests/emu/mpi/mpi.h; its main, renamed, runs once a
# rank) and nccl_emu.cpp for NCCL. Four ranks in SP groups of two make two DP groups; three,
# built with ASan, split GQA groups over ranks. Few tokens (100; 64, one tile, under ASan): every
# rank also runs the unsharded attention it checks against.
EX_EMU_FLAGS = $(NCCL_INC) -Itests/emu/mpi -Dmain=mpi_emu_main -include tests/emu/cuda_emu.h
$(BUILD)/emu/mpi_emu.o: tests/emu/mpi_emu.cpp tests/emu/mpi/mpi.h
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) -O2 -c $< -o $@
$(BUILD)/asan/emu/mpi_emu.o: tests/emu/mpi_emu.cpp tests/emu/mpi/mpi.h
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(SAN) -O2 -c $< -o $@
$(BUILD)/emu/sp_attention_nccl: examples/sp_attention_nccl.cu tests/emu/mpi/mpi.h $(CUDA_HDRS) \
                                $(EMU_OBJ) $(BUILD)/emu/nccl_emu.o $(BUILD)/emu/mpi_emu.o
	$(CXX) $(EMU_CXXFLAGS) $(EX_EMU_FLAGS) -x c++ $< -x none $(filter %.o,$^) -o $@ $(LDLIBS)
$(BUILD)/asan/emu/sp_attention_nccl: examples/sp_attention_nccl.cu tests/emu/mpi/mpi.h \
                                     $(CUDA_HDRS) $(EMU_ASAN_OBJ) $(BUILD)/asan/emu/nccl_emu.o \
                                     $(BUILD)/asan/emu/mpi_emu.o
	$(CXX) $(EMU_CXXFLAGS) $(SAN) $(EX_EMU_FLAGS) -x c++ $< -x none $(filter %.o,$^) -o $@ \
	    $(LDLIBS)
# The MPI double's own test, built as the example is: its collectives, and ranks that enter
# different ones end the process with a message.
$(BUILD)/emu/test_mpi_emu: tests/test_mpi_emu.c tests/emu/mpi/mpi.h $(BUILD)/emu/mpi_emu.o
	$(CC) $(CFLAGS) -Itests/emu/mpi -Dmain=mpi_emu_main -c $< -o $@.o
	$(CXX) $@.o $(BUILD)/emu/mpi_emu.o -o $@ $(LDLIBS)
TESTS     += '$(BUILD)/emu/test_mpi_emu -np 3'
TESTS     += 'out=$$($(BUILD)/emu/test_mpi_emu -np 2 mismatch 2>&1); [ $$? -ne 0 ] && \
              echo "$$out" | grep "called MPI_.* while rank [0-9]* called MPI_" && \
              echo "1 passed, 0 failed"'
TEST_BINS += $(BUILD)/emu/test_mpi_emu
ifeq ($(HAVE_NCCL),1)
TESTS     += $(BUILD)/test_nccl $(BUILD)/test_nccl_sendrecv $(BUILD)/asan/test_nccl
TESTS     += 'ULY_TEST_FILTER=an_older_nccl $(BUILD)/test_nccl_2_27'
TESTS     += '$(BUILD)/emu/sp_attention_nccl -np 4 2 100 && echo "1 passed, 0 failed"'
TESTS     += '$(BUILD)/asan/emu/sp_attention_nccl -np 3 3 64 && echo "1 passed, 0 failed"'
TEST_BINS += $(BUILD)/test_nccl $(BUILD)/test_nccl_sendrecv $(BUILD)/asan/test_nccl
TEST_BINS += $(BUILD)/test_nccl_2_27 $(BUILD)/emu/sp_attention_nccl
TEST_BINS += $(BUILD)/asan/emu/sp_attention_nccl
else
TESTS     += 'skip:test_nccl and the emulated NCCL example (no nccl.h; see NCCL_HOME)'
endif
GPU_TESTS += $(CUDA_TESTS:%=$(BUILD)/gpu/%)
GPU_BINS  += $(CUDA_TESTS:%=$(BUILD)/gpu/%)
ifeq ($(HAVE_MPI)$(HAVE_NCCL),11)
GPU_TESTS += 'env $(MPIRUN) -np $(NGPUS) $(BUILD)/gpu/sp_attention_nccl && \
              echo "1 passed, 0 failed"'
GPU_BINS  += $(BUILD)/gpu/sp_attention_nccl
else
GPU_TESTS += 'skip:the NCCL example (needs $(MPICC) and nccl.h; see NCCL_HOME)'
endif

# Layout bandwidth against cudaMemcpyAsync, and the phases of one SP layer on 4 virtual ranks.
CUDA_BENCHES = bench_layout bench_layer
$(CUDA_BENCHES:%=$(BUILD)/gpu/%): $(BUILD)/gpu/%: bench/%.cu bench/bench_cuda.h $(CUDA_HDRS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) $(NVARCH) -x cu $< -o $@
GPU_BINS    += $(CUDA_BENCHES:%=$(BUILD)/gpu/%)
GPU_BENCH_BINS += $(CUDA_BENCHES:%=$(BUILD)/gpu/%)
GPU_BENCHES += $(CUDA_BENCHES:%=$(BUILD)/gpu/%)

# The same benchmarks under the emulator, run once at a tiny size by make test: a smoke check
# (every call succeeds, the table prints; the times mean nothing), so that a lent GPU's time is
# not spent finding out that a benchmark does not run.
$(CUDA_BENCHES:%=$(BUILD)/emu/%): $(BUILD)/emu/%: bench/%.cu bench/bench_cuda.h $(CUDA_HDRS) \
                                                  $(EMU_OBJ)
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) -x c++ $< -x none $(EMU_OBJ) -o $@ $(LDLIBS)
TESTS     += '$(BUILD)/emu/bench_layout 1 && echo "1 passed, 0 failed"'
TESTS     += '$(BUILD)/emu/bench_layer 256 && echo "1 passed, 0 failed"'
TEST_BINS += $(CUDA_BENCHES:%=$(BUILD)/emu/%)

# --- attention kernels ---
# The flash kernels (ulysses_cuda.cuh). test_flash checks them against fp64, plain-precision
# and CPU references: under the emulator, plain and ASan builds (make test), and on a GPU (make
# test-gpu). Its nvcc build (sm_80 and sm_90, -Werror) keeps ptxas -v's report of every kernel,
# and make test fails if a flash or layout kernel spills registers. test_cublaslt checks the
# cuBLASLt attention and flash's agreement with it: under the emulator against
# tests/emu/cublaslt_emu.cpp (a double of the documented GEMM), and on a GPU against the real
# library.
FLASH_HDRS = ulysses.h ulysses_cuda.cuh tests/flash_case.h tests/ref64.h \
             $(EMU_HDRS)

$(BUILD)/test_flash: tests/test_flash.cu $(FLASH_HDRS) $(EMU_OBJ)
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) -x c++ $< -x none $(EMU_OBJ) -o $@ $(LDLIBS)
$(BUILD)/asan/test_flash: tests/test_flash.cu $(FLASH_HDRS) $(EMU_ASAN_OBJ)
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(SAN) -x c++ $< -x none $(EMU_ASAN_OBJ) -o $@ $(LDLIBS)
$(BUILD)/gpu/test_flash: tests/test_flash.cu $(FLASH_HDRS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) $(NVARCH) -Xptxas -v -x cu $< -o $@ 2> $@.ptxas || { cat $@.ptxas; exit 1; }

LT_EMU_SRC = tests/emu/cublaslt_emu.cpp tests/emu/cublaslt_emu.h tests/emu/cuda_emu.h
$(BUILD)/emu/cublaslt_emu.o: $(LT_EMU_SRC)
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) -O2 -c $< -o $@
$(BUILD)/asan/emu/cublaslt_emu.o: $(LT_EMU_SRC)
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(SAN) -O2 -c $< -o $@
$(BUILD)/test_cublaslt: tests/test_cublaslt.cu tests/emu/cublaslt_emu.h $(FLASH_HDRS) $(EMU_OBJ) \
                        $(BUILD)/emu/cublaslt_emu.o
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) -x c++ $< -x none $(filter %.o,$^) -o $@ $(LDLIBS)
$(BUILD)/asan/test_cublaslt: tests/test_cublaslt.cu tests/emu/cublaslt_emu.h $(FLASH_HDRS) \
                             $(EMU_ASAN_OBJ) $(BUILD)/asan/emu/cublaslt_emu.o
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(SAN) -x c++ $< -x none $(filter %.o,$^) -o $@ $(LDLIBS)
$(BUILD)/gpu/test_cublaslt: tests/test_cublaslt.cu $(FLASH_HDRS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) $(TESTARCH) -x cu $< -o $@ -lcublasLt

FLASH_TESTS = test_flash test_cublaslt
# Determinism's three runs repeat one run, the 1000-row cases the matrix's kernels over more
# tiles, the atomic f16 matrix the bf16 one's in another 2-byte type (the deterministic f16
# matrix and varlen keep f16 under ASan), the eight strides strided_inputs' accesses with other
# numbers, and the grid shapes' check the matrix's launches; cuBLASLt's agreement with flash
# repeats test_flash's kernels and the cuBLASLt calls of the other test_cublaslt cases.
ASAN_SKIP_test_flash    = -bitwise_stable,-long_1000,-matrix_f16,-every_tensor_has_its_own
ASAN_SKIP_test_flash   := $(ASAN_SKIP_test_flash),-flash_grids
ASAN_SKIP_test_cublaslt = -agrees_with_flash
TESTS     += $(FLASH_TESTS:%=$(BUILD)/%) $(foreach t,$(FLASH_TESTS),$(call ASAN_RUN,$(t)))
TEST_BINS += $(FLASH_TESTS:%=$(BUILD)/%) $(FLASH_TESTS:%=$(BUILD)/asan/%)
ifeq ($(HAVE_NVCC),1)
TESTS     += 'tests/ptxas_spills.sh $(BUILD)/gpu/test_flash.ptxas uly__flash'
TEST_BINS += $(FLASH_TESTS:%=$(BUILD)/gpu/%)
else
TESTS     += 'skip:flash kernel spill check (no nvcc)'
endif
# A trap ends a GPU's CUDA context, so test_flash's traps_on_cu_seqlens_* run a process each; the
# cases past CUDA's grid limits and int's (6.5 and 26 GB) run in one of their own, so that a
# GPU short of memory or time costs those two only.
FLASH_TRAPS = decreasing not_from_0 short_of_rows past_rows over_max backward bad_document_past_256
FLASH_HUGE  = grids_past_the_slice_size,dq_accumulator_past_2_31_elements
GPU_TESTS += 'ULY_TEST_FILTER=-traps_on,$(subst $(comma),$(comma)-,-$(FLASH_HUGE)) \
              $(BUILD)/gpu/test_flash' 'ULY_TEST_FILTER=$(FLASH_HUGE) $(BUILD)/gpu/test_flash' \
             $(BUILD)/gpu/test_cublaslt \
             $(foreach t,$(FLASH_TRAPS), \
                 'ULY_TEST_FILTER=traps_on_cu_seqlens_$(t) $(BUILD)/gpu/test_flash')
GPU_BINS  += $(FLASH_TESTS:%=$(BUILD)/gpu/%)

# TFLOP/s against PyTorch's SDPA, results under bench/ (bench/run_attn.sh says which files).
$(BUILD)/gpu/bench_attn: bench/bench_attn.cu bench/bench_cuda.h $(FLASH_HDRS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) $(NVARCH) -x cu $< -o $@
GPU_BINS    += $(BUILD)/gpu/bench_attn
GPU_BENCH_BINS += $(BUILD)/gpu/bench_attn
GPU_BENCHES += 'bench/run_attn.sh $(BUILD)/gpu/bench_attn $(PYTHON)'
# The same pipeline at a tiny size, bench_attn under the emulator and bench_sdpa.py on the CPU: a
# smoke check (every program runs, the table prints, the plot is drawn; the times mean nothing),
# into $(BUILD)/smoke_attn so that bench/'s results stay. Without PyTorch the table has our rows
# only; without matplotlib there is no plot.
$(BUILD)/emu/bench_attn: bench/bench_attn.cu bench/bench_cuda.h $(FLASH_HDRS) $(EMU_OBJ)
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) -x c++ $< -x none $(EMU_OBJ) -o $@ $(LDLIBS)
TESTS     += 'rm -rf $(BUILD)/smoke_attn && bench/run_attn.sh -o $(BUILD)/smoke_attn -d cpu \
              $(BUILD)/emu/bench_attn $(PYTHON) 256 128 256 128 \
              $(if $(HAVE_MPL),&& [ -s $(BUILD)/smoke_attn/attention.png ]) && \
              echo "1 passed, 0 failed"'
TEST_BINS += $(BUILD)/emu/bench_attn
ifneq ($(HAVE_TORCH),1)
TESTS     += 'skip:bench_sdpa.py smoke run (no PyTorch for $(PYTHON))'
endif
ifneq ($(HAVE_MPL),1)
TESTS     += 'skip:the attention plot (no matplotlib for $(PYTHON): apt-get install \
              python3-matplotlib)'
endif

# --- races ---
# ThreadSanitizer on everything that runs threads: the C tests of the local communicator, the
# NCCL communicator against its double, and the kernels. For kernels, the emulator is built with
# ULY_EMU_TSAN (itself not instrumented) and the tests with -fsanitize=thread, so a shared- or
# global-memory access that no __syncthreads, __syncwarp or cp.async wait orders against another
# thread's is a reported race whatever the schedule (tests/emu/cuda_emu.cpp says what counts as
# ordered). test_race proves the detector on kernels with and without the barrier. TSan makes
# the emulator ~15x slower, so test_flash and test_cuda_layer run a subset that still takes every
# dense kernel and code path (not varlen's check kernel and row offsets): both head dims, causal
# or not, tails, GQA, Sq != Sk, deterministic dQ, masked rows, the device-local exchange, and
# the flash layer over 4 and 3 device-local ranks (split_group: the layer's matrices repeat it
# over more shapes at 7x the time).
# -O1, not -Og: at -Og GCC's TSan instrumentation misses loads that go straight into a call's
# argument (a __nv_bfloat16 from shared memory, in test_race's cp.async race, went unreported).
TSAN          = -O1 -fsanitize=thread -fno-omit-frame-pointer
EMU_TSAN_OBJ  = $(BUILD)/tsan/emu/cuda_emu.o
TSAN_CTESTS   = test_layer test_loss test_errors
TSAN_TESTS    = test_race test_cuda_layout test_cuda_layer test_flash
TSAN_FLASH    = matrix_bf16,matrix_deterministic_f16_d64,masked,large_logits
TSAN_LAYER    = reference,layer_f32,split_group,device_local,rejects

$(TSAN_CTESTS:%=$(BUILD)/tsan/%): $(BUILD)/tsan/%: tests/%.c $(ULY_TEST_DEPS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) $(TSAN) -o $@ $< $(LDLIBS)
$(EMU_TSAN_OBJ): tests/emu/cuda_emu.cpp tests/emu/cuda_emu.h
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) -DULY_EMU_TSAN -O2 -c $< -o $@
$(TSAN_TESTS:%=$(BUILD)/tsan/%): $(BUILD)/tsan/%: tests/%.cu $(CUDA_HDRS) $(EMU_TSAN_OBJ)
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(TSAN) -x c++ $< -x none $(EMU_TSAN_OBJ) -o $@ $(LDLIBS)

TEST_BINS += $(TSAN_CTESTS:%=$(BUILD)/tsan/%) $(TSAN_TESTS:%=$(BUILD)/tsan/%)
# The longest first: make test ends with the TSan runs, and the other core takes the rest.
TESTS     += 'ULY_TEST_FILTER=$(TSAN_FLASH) $(BUILD)/tsan/test_flash'
TESTS     += $(TSAN_CTESTS:%=$(BUILD)/tsan/%)
# Not the large cases: the_grid_shares checks launch dims, and boxes_larger_than_the_grid is a
# copy whose every byte the plain run checks (a thread that wrote another's bytes would leave
# its own unwritten); nothing there for TSan to see.
TSAN_LAYOUT   = -the_grid_shares,-boxes_larger_than_the_grid
TESTS     += $(BUILD)/tsan/test_race 'ULY_TEST_FILTER=$(TSAN_LAYOUT) $(BUILD)/tsan/test_cuda_layout'
TESTS     += 'ULY_TEST_FILTER=$(TSAN_LAYER) $(BUILD)/tsan/test_cuda_layer'
# The MPI double, whose ranks are threads (a contribution overwritten before every peer has read
# it is a race TSan reports).
$(BUILD)/tsan/emu/mpi_emu.o: tests/emu/mpi_emu.cpp tests/emu/mpi/mpi.h
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(TSAN) -c $< -o $@
$(BUILD)/tsan/test_mpi_emu: tests/test_mpi_emu.c tests/emu/mpi/mpi.h $(BUILD)/tsan/emu/mpi_emu.o
	$(CC) $(CFLAGS) $(TSAN) -Itests/emu/mpi -Dmain=mpi_emu_main -c $< -o $@.o
	$(CXX) $(TSAN) $@.o $(BUILD)/tsan/emu/mpi_emu.o -o $@ $(LDLIBS)
TEST_BINS += $(BUILD)/tsan/test_mpi_emu
TESTS     += '$(BUILD)/tsan/test_mpi_emu -np 4'
ifeq ($(HAVE_NCCL),1)
$(BUILD)/tsan/emu/nccl_emu.o: tests/emu/nccl_emu.cpp tests/emu/nccl_emu.h tests/emu/cuda_emu.h
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(NCCL_INC) $(TSAN) -c $< -o $@
$(BUILD)/tsan/test_nccl: tests/test_nccl.cu tests/emu/nccl_emu.h $(CUDA_HDRS) $(EMU_TSAN_OBJ) \
                         $(BUILD)/tsan/emu/nccl_emu.o
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) $(NCCL_INC) $(TSAN) -x c++ $< -x none $(filter %.o,$^) -o $@ $(LDLIBS)
TEST_BINS += $(BUILD)/tsan/test_nccl
TESTS     += $(BUILD)/tsan/test_nccl
endif

# On a GPU the same question goes to NVIDIA's compute-sanitizer, when the toolkit has it:
# memcheck (out-of-bounds and misaligned accesses), synccheck (barriers) and racecheck
# (shared-memory hazards as the hardware ran them; the slowest, so last), on the kernels' subset
# above. memcheck also takes the varlen paths, the only ones whose rows come from device memory.
CSAN := $(firstword $(shell command -v compute-sanitizer) \
                   $(wildcard $(CUDA_HOME)/bin/compute-sanitizer))
GPU_SAN_BINS = $(BUILD)/gpu/test_flash $(BUILD)/gpu/test_cuda_layer $(BUILD)/gpu/test_cuda_layout
CSAN_FLASH_memcheck = $(TSAN_FLASH),varlen_documents
CSAN_LAYER_memcheck = $(TSAN_LAYER),flash_layer_bf16,attends_within
ifneq ($(CSAN),)
GPU_SAN_TESTS = $(foreach tool,memcheck synccheck racecheck, \
    'ULY_TEST_FILTER=$(or $(CSAN_FLASH_$(tool)),$(TSAN_FLASH)) $(CSAN) --tool $(tool) \
     --error-exitcode 1 $(BUILD)/gpu/test_flash' \
    'ULY_TEST_FILTER=$(or $(CSAN_LAYER_$(tool)),$(TSAN_LAYER)) $(CSAN) --tool $(tool) \
     --error-exitcode 1 $(BUILD)/gpu/test_cuda_layer')
GPU_SAN_TESTS += '$(CSAN) --tool memcheck --error-exitcode 1 $(BUILD)/gpu/test_cuda_layout'
else
GPU_SAN_TESTS = 'skip:compute-sanitizer (neither on PATH nor in $(CUDA_HOME)/bin)'
endif

# --- top-level targets ---
# The test binaries build in parallel, one job per core; then the tests run, as many at a time
# (tests/run.sh shows their outputs in order). The GPU tests run one at a time: they share the GPU.
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
test:
	@$(MAKE) --no-print-directory -j$(JOBS) $(TEST_BINS)
	@STRICT=$(STRICT) JOBS=$(JOBS) tests/run.sh $(TESTS)

# Every GPU program, built and not run (bench/lent_gpu.sh builds first, with make -k).
build-gpu: $(GPU_BINS)

# The GPU targets build what they can (-k) and then run everything: a program that failed to
# build is one failure, not a run with no tests. Each program gets at most GPU_TIMEOUT seconds.
GPU_TIMEOUT ?= 120
test-gpu:
ifeq ($(HAVE_GPU),1)
	-@$(MAKE) --no-print-directory -k -j$(JOBS) $(GPU_BINS)
	@TIMEOUT=$(GPU_TIMEOUT) tests/run.sh $(GPU_TESTS)
else
	@echo "test-gpu: no GPU here (nvidia-smi lists none); nothing run"
endif

sanitize-gpu:
ifeq ($(HAVE_GPU),1)
	-@$(MAKE) --no-print-directory -k -j$(JOBS) $(GPU_SAN_BINS)
	@TIMEOUT=$(GPU_TIMEOUT) tests/run.sh $(GPU_SAN_TESTS)
else
	@echo "sanitize-gpu: no GPU here (nvidia-smi lists none); nothing run"
endif

bench: $(BENCH_BINS)
	@rc=0; for b in $(BENCHES); do \
	    case $$b in skip:*) echo "skip $${b#skip:}";; *) sh -c "$$b" || rc=1;; esac; \
	done; exit $$rc

# Only the benchmarks' own programs: a test that fails to build stops no benchmark.
bench-gpu: $(if $(HAVE_GPU),$(GPU_BENCH_BINS))
ifeq ($(HAVE_GPU),1)
	@rc=0; for b in $(GPU_BENCHES); do sh -c "$$b" || rc=1; done; exit $$rc
else
	@echo "bench-gpu: no GPU here (nvidia-smi lists none); nothing run"
endif

install:
	install -d $(PREFIX)/include
	install -m 644 ulysses.h ulysses_cuda.cuh $(PREFIX)/include/

clean:
	rm -rf $(BUILD)
