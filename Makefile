# ulysses - a plain Makefile.
#   make demo          one SP attention layer, 4 ranks on the local communicator (the main job)
#   make test          the whole suite (STRICT=1: a missing tool fails instead of skipping)
#   make bench         CPU benchmarks; make bench-gpu on a machine with a GPU
#   make test-gpu      the GPU tests, when a GPU is present
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
CXXFLAGS = -std=c++17 -O2 -g -Wall -Wextra -Werror -I.
SAN      = -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
LDLIBS   = -lm -lpthread
# Open MPI refuses root unless told; CI runs as root.
MPIRUN   = OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe
# The emulator runs the real kernel source under the host compiler (tests/emu).
EMU_CXXFLAGS = $(CXXFLAGS) -Itests -isystem $(CUDA_HOME)/include
NVCCFLAGS = -std=c++17 -O3 -I. -Itests -Werror all-warnings -Xcompiler -Wall,-Wextra
NVARCH   = -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90

HAVE_MPI   := $(shell command -v $(MPICC) >/dev/null 2>&1 && echo 1)
HAVE_NVCC  := $(shell command -v $(NVCC) >/dev/null 2>&1 && echo 1)
HAVE_TORCH := $(shell $(PYTHON) -c 'import torch' >/dev/null 2>&1 && echo 1)
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

.PHONY: all demo demo-mpi test test-gpu bench bench-gpu install clean
all: $(BUILD)/demo

$(BUILD) $(BUILD)/asan:
	mkdir -p $@

# --- foundation (ulysses.h) ---

# --- emulator ---

# --- cuda ---

# --- attention kernels ---

# --- top-level targets ---
test: $(TEST_BINS)
	@STRICT=$(STRICT) tests/run.sh $(TESTS)

test-gpu: $(if $(HAVE_GPU),$(GPU_BINS))
ifeq ($(HAVE_GPU),1)
	@tests/run.sh $(GPU_TESTS)
else
	@echo "test-gpu: no GPU here (nvidia-smi lists none); nothing run"
endif

bench: $(BENCH_BINS)
	@for b in $(BENCHES); do case $$b in skip:*) echo "skip $${b#skip:}";; *) sh -c "$$b";; esac; done

bench-gpu: $(if $(HAVE_GPU),$(GPU_BINS))
ifeq ($(HAVE_GPU),1)
	@for b in $(GPU_BENCHES); do sh -c "$$b"; done
else
	@echo "bench-gpu: no GPU here (nvidia-smi lists none); nothing run"
endif

install:
	install -d $(PREFIX)/include
	install -m 644 ulysses.h ulysses_cuda.cuh $(PREFIX)/include/

clean:
	rm -rf $(BUILD)
