# shardtrain — build, test, demo, benchmark.
#   make deps    install the Debian packages (scripts/install-deps.sh; root or sudo)
#   make build   build/shardtrain, the test binaries and (with nvcc) the CUDA plugin build/libshardtrain_cuda.so
#   make test    every test (unit, multi-rank under mpirun, end-to-end); prints "N passed, M failed"
#   make demo    2-rank training run on the bundled default corpus (Debian's fortunes); loss curves in build/demo-loss.png, TensorBoard files in build/demo-tb;
#                builds only build/shardtrain (and the CUDA plugin when `nvidia-smi -L` lists a GPU, or with CUDA=1)
#   make jobs-test  installation checks of the Slurm job files on one node (tests/jobs/run.sh, < 3 min)
#   make test-cp-matrix  the longer context-parallel matrix of issue 41 (tests/e2e/test_cp_matrix.sh, ~1 min)
#   make test-pp-matrix  the whole pipeline-parallel matrix of issue 42 (tests/e2e/test_pp_matrix.sh, ~5 min)
#   make test-sft-matrix the whole fine-tuning layout matrix of issue 55 (tests/e2e/test_sft.sh, ~3 min)
#   make test-link-races  the link-swap races of issues 39 and 53 (tests/e2e/link_swap_race.sh, hf_dir_swap_race.sh: 200 + 100 imports, ~5 min)
#   make slurm-test the job scripts under a real Slurm: a private two-node cluster on this machine (tests/slurm/run.sh, ~2 min)
#   make bench   benchmarks (tinyshakespeare if ../shared/data has it) and the PyTorch peer; results for docs/benchmarks.md
#   make bench-checkpoint  checkpoint saves, --checkpoint-async on vs off, ~99M parameters at W = 2 (make bench part 3's second half)
#   make bench-json  the bounded JSON reader: safetensors header time and peak RSS at 10^4 .. 1.4 x 10^6 tensors (tests/bench/json_bench.cpp)
#   make bench-overlap  --overlap off vs on (each --comm-progress) at W = 2 and 4 (make bench part 6 alone)
#   make comm-bench  MPI all-gather / reduce-scatter bandwidth at W = 2 and 4 ($(BUILD)/comm.jsonl; docs/scaling.md)
#   make scaling-check  docs/scaling.md's model against shardtrain's measured comm_ms at W = 2 and 4
#   make clean
SHELL := /bin/bash
CXX := mpicxx
BUILD := build
# -march=native: the binary is built on (and for) the machine that runs it, as is usual on HPC
# nodes; override with `make MARCH=x86-64-v3` to build for a different target.
MARCH ?= native
CXXFLAGS ?= -O3 -g
WARN := -Wall -Wextra -Wpedantic -Wshadow -Werror
CPPFLAGS := -DOMPI_SKIP_MPICXX=1 -Iinclude -I/usr/include/x86_64-linux-gnu/openblas-pthread -isystem /usr/include/hdf5/openmpi
# No errno from math functions and no FP traps: lets GCC vectorize the kernels' exp/sqrt loops.
# Neither reorders arithmetic (no -ffast-math), so results stay deterministic and NaN propagates.
MATHFLAGS := -fno-math-errno -fno-trapping-math
ALL_CXXFLAGS := -std=c++20 -march=$(MARCH) -fopenmp $(CXXFLAGS) $(MATHFLAGS) $(WARN) -MMD -MP
LDLIBS := -fopenmp -L/usr/lib/x86_64-linux-gnu/hdf5/openmpi -lhdf5 -lz -ldeflate -lboost_program_options -lopenblas -lsentencepiece_train -lsentencepiece -lpthread
GTEST_LIBS := -lgtest -lpthread
MPIRUN ?= mpirun --oversubscribe
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1

# CUDA backend (src/**/*.cu): built whenever nvcc is found (PATH, then /usr/local/cuda), as a plugin,
# $(BUILD)/libshardtrain_cuda.so: the .cu objects (position-independent) linked against cuBLAS, NCCL
# and the CUDA runtime. The executables link none of the CUDA libraries; they are linked with
# -rdynamic (the plugin takes Comm, CollectiveError, ... from them) and src/backend/cuda_plugin.cpp
# dlopen()s the plugin from the executable's directory (or $SHARDTRAIN_CUDA_PLUGIN) when a CUDA
# device is used, so CPU runs map no CUDA library. `make CUDA=0` forces a CPU-only build: no
# plugin, and asking for CUDA fails with "built without CUDA". GPU code targets sm_80 (A100) and
# sm_90 (H100/H200).
NVCC ?= $(firstword $(shell command -v nvcc 2>/dev/null) $(wildcard /usr/local/cuda/bin/nvcc))
CUDA ?= $(if $(NVCC),1,0)
CUDA_ARCHS ?= 80 90
ifeq ($(CUDA),1)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CUDA_SRCS := $(shell find src -name '*.cu')
CPPFLAGS_CUDA := -DSHARDTRAIN_CUDA=1
# Machine code for each of CUDA_ARCHS, plus PTX of the newest so that later GPUs can JIT it.
NVCCFLAGS := -std=c++20 -O3 -g -lineinfo $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
	-gencode arch=compute_$(lastword $(CUDA_ARCHS)),code=compute_$(lastword $(CUDA_ARCHS)) \
	-Werror all-warnings -Xcompiler -fPIC,-Wall,-Wextra,-Wshadow,-Werror,-fno-math-errno,-fno-trapping-math \
	-isystem $(CUDA_HOME)/include
CUDA_LIBS := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lnccl -lcublas -lcublasLt -lcudart
CUDA_PLUGIN := $(BUILD)/libshardtrain_cuda.so
# cuDNN's fused attention (src/backend/cuda/cudnn_attention.cu) is written against the cuDNN
# frontend, a header-only C++ API that NVIDIA ships as the PyPI wheel nvidia-cudnn-frontend (its
# include/ folder); the toolkit has cuDNN's own headers. The wheel is downloaded once into
# $(BUILD)/cudnn-frontend (CUDNN_FE_INC=DIR uses headers already on disk; CUDNN_FE=0 builds without,
# and the backend then always uses its own tiled attention kernels). libcudnn itself is loaded at
# run time (dlopen), so the plugin does not need it to load.
CUDNN_FE ?= 1
CUDNN_FE_VERSION := 1.32.0
ifeq ($(CUDNN_FE),1)
CUDNN_FE_INC ?= $(BUILD)/cudnn-frontend/include
# Host code only: compiled as C++ (-x c++; nvcc's per-architecture passes over the frontend's
# headers took 3.5 minutes).
$(BUILD)/src/backend/cuda/cudnn_attention.cu.o: NVCCFLAGS := -x c++ -std=c++20 -O2 -g -Werror all-warnings \
	-Xcompiler -fPIC,-Wall,-Wextra,-Wshadow,-Werror -isystem $(CUDA_HOME)/include -isystem $(CUDNN_FE_INC) \
	-DSHARDTRAIN_CUDNN=1
$(BUILD)/src/backend/cuda/cudnn_attention.cu.o: | $(CUDNN_FE_INC)/cudnn_frontend.h
endif
else
CUDA_SRCS :=
CPPFLAGS_CUDA :=
CUDA_PLUGIN :=
endif
CPPFLAGS += $(CPPFLAGS_CUDA)
# -rdynamic: the plugin's references to shardtrain symbols resolve against the executable.
LDLIBS += -rdynamic -ldl

# Unity groups: files that were one file until they were split for readers (issue 54: one operation
# or one concern per file) compile as one translation unit per group, as they did before the split.
# Compiled alone, each file parsed the group's headers again (the backend class, nlohmann::json,
# the CUDA headers) and instantiated their templates again: a fresh build of build/shardtrain took
# about 12% more CPU time, the CUDA plugin's 35% more. $(BUILD)/unity/NAME.cpp (.cu) only #includes
# the group's files; diagnostics and debug information name the files themselves. UNITY=0 compiles
# every file alone (an edit of one operation then recompiles one file).
UNITY ?= 1
ifeq ($(UNITY),1)
UNITY_GROUPS := trainer hf checkpoint_meta cpu_backend llama
UNITY_CU_GROUPS := $(if $(CUDA_SRCS),cuda_backend)
endif
# The class-instantiating file first: an explicit instantiation of a class instantiates only the
# members defined before it ([temp.explicit]), and each op file instantiates its own. moe.cpp stays
# a file of its own: inside the group it changed how GCC compiled the other kernels' inlined copies
# (par_ranges' serial and threaded copies of swiglu_backward then rounded differently:
# CpuThreads.RowAndElementwiseKernelsBitwise failed, and dense runs moved by an ulp against
# tests/bench/bitwise_ab.sh's reference).
UNITY_cpu_backend := src/backend/cpu/cpu_backend.cpp $(filter-out src/backend/cpu/blas_select.cpp \
	src/backend/cpu/cpu_backend.cpp src/backend/cpu/moe.cpp,$(sort $(wildcard src/backend/cpu/*.cpp)))
UNITY_llama := $(sort $(wildcard src/model/llama*.cpp))
UNITY_trainer := $(sort $(wildcard src/train/trainer*.cpp))
UNITY_checkpoint_meta := src/io/checkpoint_meta_read.cpp src/io/checkpoint_meta_compare.cpp
UNITY_hf := src/io/hf.cpp src/io/hf_generate.cpp
UNITY_cuda_backend := src/backend/cuda/cuda_backend.cu $(filter-out $(addprefix src/backend/cuda/,cuda_backend.cu \
	cudnn_attention.cu device_query.cu plugin.cu),$(sort $(wildcard src/backend/cuda/*.cu)))
UNITY_SRCS := $(foreach g,$(UNITY_GROUPS) $(UNITY_CU_GROUPS),$(UNITY_$(g)))
LIB_SRCS := $(filter-out src/main.cpp $(UNITY_SRCS),$(shell find src -name '*.cpp'))
# The groups first: they are the longest compiles, and make -j starts prerequisites in the order listed
# (with two jobs, a simulation from measured per-file times finds every order within 1% of half the
# CPU time, so this is a tidy default, not a speed-up; docs/benchmarks.md).
LIB_OBJS := $(UNITY_GROUPS:%=$(BUILD)/unity/%.o) $(LIB_SRCS:%.cpp=$(BUILD)/%.o)
CUDA_OBJS := $(UNITY_CU_GROUPS:%=$(BUILD)/unity/%.cu.o) $(patsubst %.cu,$(BUILD)/%.cu.o,$(filter-out $(UNITY_SRCS),$(CUDA_SRCS)))
UNIT_SRCS := $(wildcard tests/unit/*.cpp) tests/test_main.cpp
UNIT_OBJS := $(UNIT_SRCS:%.cpp=$(BUILD)/%.o)
MPI_SRCS := $(wildcard tests/mpi/*.cpp) tests/test_main.cpp
MPI_OBJS := $(MPI_SRCS:%.cpp=$(BUILD)/%.o)
GPU_SRCS := $(wildcard tests/gpu/*.cpp) tests/test_main.cpp
GPU_OBJS := $(GPU_SRCS:%.cpp=$(BUILD)/%.o)

.PHONY: bench-json all deps build binaries test test-cp-matrix test-pp-matrix test-sft-matrix test-link-races jobs-test slurm-test demo bench clean data venv comm-bench bench-overlap bench-checkpoint
all: build

deps:
	bash scripts/install-deps.sh

# `make build` compiles with one job per core (JOBS=1 for a serial build). GNU nproc honours
# OMP_NUM_THREADS / OMP_THREAD_LIMIT, which a user's shell may set to 1: not for the build.
JOBS ?= $(shell env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2)
build:
	$(MAKE) --no-print-directory -j$(JOBS) binaries
binaries: $(BUILD)/shardtrain $(BUILD)/unit_tests $(BUILD)/mpi_tests $(BUILD)/gpu_tests $(BUILD)/attention_bench \
	$(BUILD)/kernel_bench $(CUDA_PLUGIN)

$(BUILD)/%.o: %.cpp
	@mkdir -p $(dir $@)
	$(CXX) $(CPPFLAGS) $(ALL_CXXFLAGS) -c $< -o $@

# A group's unity file is written when make reads this Makefile, and only when its list of files
# changed (its object is then remade): no recipe makes it, so it takes no job slot and make -j starts
# the groups' compiles first (a generated prerequisite made them wait for a second pass over the
# list, last). -iquote . (nvcc: -I.): its #include "src/..." names; the files are included, so
# GCC's -Wsubobject-linkage (meant for headers shared by several translation units) would take their
# anonymous namespaces for a header's.
hash := \#
define newline


endef
unity_text = $(subst $(newline) ,$(newline),$(foreach f,$(UNITY_$(1)),$(hash)include "$(f)"$(newline)))
unity_differ = $(or $(subst $(strip $(1)),,$(strip $(2))),$(subst $(strip $(2)),,$(strip $(1))),$(if $(strip $(1)),,missing))
unity_write = $(if $(call unity_differ,$(file <$(1)),$(2)),$(shell mkdir -p $(dir $(1)))$(file >$(1),$(2)))
$(foreach g,$(UNITY_GROUPS),$(call unity_write,$(BUILD)/unity/$(g).cpp,$(call unity_text,$(g))))
$(foreach g,$(UNITY_CU_GROUPS),$(call unity_write,$(BUILD)/unity/$(g).cu,$(call unity_text,$(g))))
# Nothing remakes them (without this, make's built-in `%: %.o` would offer x.cu.o as a way to make x.cu).
$(UNITY_GROUPS:%=$(BUILD)/unity/%.cpp) $(UNITY_CU_GROUPS:%=$(BUILD)/unity/%.cu): ;
$(UNITY_GROUPS:%=$(BUILD)/unity/%.o): $(BUILD)/unity/%.o: $(BUILD)/unity/%.cpp
	$(CXX) $(CPPFLAGS) -iquote . $(ALL_CXXFLAGS) -Wno-subobject-linkage -c $< -o $@
$(UNITY_CU_GROUPS:%=$(BUILD)/unity/%.cu.o): $(BUILD)/unity/%.cu.o: $(BUILD)/unity/%.cu
	$(NVCC) $(CPPFLAGS) -I. $(NVCCFLAGS) -Xcompiler -Wno-subobject-linkage -MMD -MP -c $< -o $@

$(BUILD)/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(CPPFLAGS) $(NVCCFLAGS) -MMD -MP -c $< -o $@

# The cuDNN frontend headers: the wheel for CPython 3.11 / manylinux_2_28 (the headers are the same in
# every wheel), fetched with pip from a throw-away venv, unpacked with Python's zipfile.
$(BUILD)/cudnn-frontend/include/cudnn_frontend.h:
	@mkdir -p $(BUILD)/cudnn-frontend
	python3 -m venv $(BUILD)/cudnn-frontend/venv
	$(BUILD)/cudnn-frontend/venv/bin/pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
	  --python-version 3.11 --platform manylinux_2_28_x86_64 -d $(BUILD)/cudnn-frontend nvidia-cudnn-frontend==$(CUDNN_FE_VERSION)
	python3 -c 'import glob, sys, zipfile; z = zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0]); \
	  z.extractall(sys.argv[1], [n for n in z.namelist() if n.startswith("include/")])' $(BUILD)/cudnn-frontend
	rm -rf $(BUILD)/cudnn-frontend/venv $(BUILD)/cudnn-frontend/*.whl
	@test -f $@

# Made afresh: `ar r` keeps members whose objects are gone (e.g. .cu objects, now in the plugin).
$(BUILD)/libshardtrain.a: $(LIB_OBJS)
	rm -f $@
	ar rcs $@ $^

# The CUDA plugin. Linked without -z defs: its shardtrain symbols come from the executable.
# --as-needed drops the MPI libraries that mpicxx adds (the plugin calls MPI only through Comm).
$(BUILD)/libshardtrain_cuda.so: $(CUDA_OBJS)
	$(CXX) -shared -Wl,--as-needed $^ -o $@ $(CUDA_LIBS)

# build/shardtrain does not need the plugin to link or to run on the CPU (a CPU run never loads it;
# `--device auto` without it runs on the CPU): `make build` builds both, `make demo` the plugin only
# where it is used. gpu_tests, attention_bench and kernel_bench, which exist to load it, are built with it beside
# them (order-only: a new plugin needs no relink).
$(BUILD)/shardtrain: $(BUILD)/src/main.o $(BUILD)/libshardtrain.a
	$(CXX) $^ -o $@ $(LDLIBS)

$(BUILD)/unit_tests: $(UNIT_OBJS) $(BUILD)/libshardtrain.a
	$(CXX) $^ -o $@ $(GTEST_LIBS) $(LDLIBS)

$(BUILD)/mpi_tests: $(MPI_OBJS) $(BUILD)/libshardtrain.a
	$(CXX) $^ -o $@ $(GTEST_LIBS) $(LDLIBS)

# GPU tests (tests/gpu): CUDA backend and device collectives against the CPU backend. Built in
# every configuration; without a CUDA device each test reports "skipped: no CUDA device".
$(BUILD)/gpu_tests: $(GPU_OBJS) $(BUILD)/libshardtrain.a | $(CUDA_PLUGIN)
	$(CXX) $^ -o $@ $(GTEST_LIBS) $(LDLIBS)

# Attention TFLOP/s on a GPU, cuDNN's fused SDPA against the tiled kernels (tests/bench/attention_bench.cpp;
# tests/gpu/run.sh stage 5d). Without a GPU it says so and exits 0.
$(BUILD)/attention_bench: $(BUILD)/tests/bench/attention_bench.o $(BUILD)/libshardtrain.a | $(CUDA_PLUGIN)
	$(CXX) $^ -o $@ $(LDLIBS)

# The memory-bound kernels' bandwidth against a device copy of the same bytes (tests/bench/kernel_bench.cpp;
# tests/gpu/run.sh stage 5e). Without a GPU it says so and exits 0.
$(BUILD)/kernel_bench: $(BUILD)/tests/bench/kernel_bench.o $(BUILD)/libshardtrain.a | $(CUDA_PLUGIN)
	$(CXX) $^ -o $@ $(LDLIBS)

# The bounded JSON reader's cost against input size (tests/bench/json_bench.cpp; issue 53): the
# safetensors header table at N = 10^4 .. 1.4 * 10^6 tensors, the DOM reader at N values.
$(BUILD)/json_bench: $(BUILD)/tests/bench/json_bench.o $(BUILD)/libshardtrain.a
	$(CXX) $^ -o $@ $(LDLIBS)
bench-json: $(BUILD)/json_bench
	$(BUILD)/json_bench

# Default corpus: English text files of Debian's `fortunes` package (installed by make deps).
FORTUNES_DIR := /usr/share/games/fortunes
FORTUNES := fortunes literature riddles science wisdom people politics work education computers
data: $(BUILD)/data/fortunes.tok
$(BUILD)/data/fortunes.tok: $(BUILD)/shardtrain
	@mkdir -p $(dir $@)
	@for f in $(FORTUNES); do test -s $(FORTUNES_DIR)/$$f || { echo "missing $(FORTUNES_DIR)/$$f: run 'make deps'"; exit 1; }; done
	$(BUILD)/shardtrain --mode prepare $(addprefix --input $(FORTUNES_DIR)/,$(FORTUNES)) --out $@

# Python clients of our files (h5py; later transformers, safetensors), from PyPI, in a venv.
VENV := .venv
venv: $(VENV)/.ok
$(VENV)/.ok: tests/requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r tests/requirements.txt
	touch $@

test: deps build venv data
	BUILD=$(BUILD) bash tests/run_all.sh

# Context parallelism's whole loss matrix (issue 41; not in make test): 20 fp32 steps at cp 2, 4,
# (cp, dp) = (2, 2), (tp, cp) = (2, 2), ring and allgather, causal and document, each within 1e-5 of
# (1, 1); TP 2 x CP 2 against TP 4 and CP 4; bf16 --cp 2 within 2e-3. Ends with the table of worst
# relative differences (docs/benchmarks.md has a measured one).
test-cp-matrix: build venv
	bash tests/e2e/test_cp_matrix.sh $(BUILD)

test-pp-matrix: build venv
	bash tests/e2e/test_pp_matrix.sh $(BUILD)

# Supervised fine-tuning's whole layout matrix (issue 55; make test runs tests/e2e/test_sft.sh with
# its subset): dp 4, pp 2 x dp 2 zero-bubble, tp 2 x cp 2, pp 2 x tp 2, activation checkpointing,
# bf16 cp 2, beside the subset, each against (1, 1).
test-sft-matrix: build venv
	SFT_MATRIX=full bash tests/e2e/test_sft.sh $(BUILD)

# The link-swap races (not in make test: their outcome depends on timing; test_input_files.sh holds
# the deterministic tests): a link of the model directory flipped to a file outside (issue 39), and
# --hf-dir itself flipped between two models (issue 53). Each exits 1 on any outside byte or mix.
test-link-races: build venv
	bash tests/e2e/link_swap_race.sh $(BUILD)
	bash tests/e2e/hf_dir_swap_race.sh $(BUILD)

# What a user runs on one node before submitting jobs/*.sbatch: jobs/small-test.ini at 2 ranks (the loss
# falls), 4 -> 2 ranks through a checkpoint (the loss curve continues), export and transformers (the
# logits match), the job script run for real with LAUNCHER=mpirun. Ends "jobs-test: N passed, M failed".
jobs-test: deps build venv data
	bash tests/jobs/run.sh

# The job scripts under a real Slurm (tests/slurm/run.sh): a private cluster (munged, slurmctld, two
# slurmd emulating nodes n1 and n2 on this machine, private ports, all in a temporary folder) runs
# train-cpu (srun --mpi=pmix and LAUNCHER=mpirun), train-multinode on 2 nodes, preemption by scancel
# --signal (with a background checkpoint write in flight) and by the time-limit --signal (to the batch
# shell and to the ranks) with requeue and resume, train -> export (--dependency=afterok) -> transformers, an array sweep and a misuse that
# must fail fast. Every daemon is stopped by its PID.
# Ends "slurm-test: N passed, M failed"; when Slurm cannot start here it prints "slurm-test: skipped:
# REASON" and succeeds (exit status 77 of the script; SLURM_TEST_REQUIRE=1 makes it a failure).
slurm-test: deps build venv data
	BUILD=$(BUILD) bash tests/slurm/run.sh || [ $$? -eq 77 ]

# Train on 2 ranks (a fresh run each time), export the last checkpoint to Hugging Face layout on
# one rank, and sample from it. Builds only what the demo runs (issue 39): build/shardtrain, compiled
# as by `make build` (with nvcc, -DSHARDTRAIN_CUDA=1, so a later `make build` or `make test` adds
# the plugin and the test binaries without recompiling it), and the CUDA plugin only when
# `nvidia-smi -L` lists a GPU or CUDA=1 is given (make demo CUDA=1); jobs/demo.ini's device is the
# default, auto, which without the plugin runs on the CPU.
DEMO_GPU = $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU [0-9]' && echo yes)
DEMO_PLUGIN = $(if $(CUDA_PLUGIN),$(if $(or $(filter-out file default,$(origin CUDA)),$(DEMO_GPU)),$(CUDA_PLUGIN)))
.PHONY: demo-build
demo-build:
	$(if $(CUDA_PLUGIN),$(if $(DEMO_PLUGIN),,@echo "demo: nvidia-smi -L lists no GPU: the CUDA plugin is not built (make demo CUDA=1 builds it; make build builds everything)"))
	$(MAKE) --no-print-directory -j$(JOBS) $(BUILD)/shardtrain $(DEMO_PLUGIN)
demo: deps demo-build data
	rm -rf $(BUILD)/demo-ckpt $(BUILD)/demo-tb
	time $(MPIRUN) -np 2 $(BUILD)/shardtrain --config jobs/demo.ini
	@echo "--- TensorBoard event files (jobs/demo.ini: tensorboard = $(BUILD)/demo-tb): $$(ls $(BUILD)/demo-tb)"
	@echo "    watch: $(VENV)/bin/tensorboard --logdir $(BUILD)/demo-tb   (then open http://localhost:6006)"
	$(BUILD)/shardtrain --mode export $(BUILD)/demo-ckpt/$$(cat $(BUILD)/demo-ckpt/latest) --out $(BUILD)/demo-hf
	@echo "--- sample (--mode generate, temperature 0.8, top-k 40):"
	@$(BUILD)/shardtrain --mode generate $(BUILD)/demo-ckpt/$$(cat $(BUILD)/demo-ckpt/latest) --prompt "The secret of life is" --max-new-tokens 300
	@echo "--- loss curves (scripts/plot_metrics.py):"
	@if [ -x $(VENV)/bin/python ]; then $(VENV)/bin/python scripts/plot_metrics.py $(BUILD)/demo-metrics.jsonl --out $(BUILD)/demo-loss.png \
	  || echo "note: plotting failed (make venv installs matplotlib); the run itself is fine"; \
	else echo "note: no $(VENV) (make venv): $(BUILD)/demo-loss.png not drawn"; fi

bench: deps build venv
	bash tests/bench/run.sh

# make bench, part 3's asynchronous-save benchmark alone (issue 29 item 4): --checkpoint-async on
# against off, interleaved, with dd on the same disk (tests/bench/checkpoint.py; $(BUILD)/bench/ckpt-async.md).
bench-checkpoint: $(BUILD)/shardtrain $(BUILD)/data/fortunes.tok
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none \
	  python3 tests/bench/checkpoint.py --bin $(BUILD)/shardtrain --data $(BUILD)/data/fortunes.tok --out $(BUILD)/bench

# make bench, part 6 alone: --overlap off against on (thread, poll, wait progress) at W = 2 and 4,
# interleaved (tests/bench/overlap.py; $(BUILD)/bench/overlap.md for docs/benchmarks.md).
bench-overlap: $(BUILD)/shardtrain $(BUILD)/data/fortunes.tok
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none \
	  python3 tests/bench/overlap.py --bin $(BUILD)/shardtrain --data $(BUILD)/data/fortunes.tok --out $(BUILD)/bench

# Communication micro-benchmark (tests/bench/comm_bandwidth.cpp): median times, algorithm and bus
# bandwidth (nccl-tests' definitions) of MPI all-gather (fp32, bf16-sized) and reduce-scatter (fp32)
# from 4 KiB to 64 MiB, at W = 2 and 4; one JSON line per world size in $(BUILD)/comm.jsonl, which
# scripts/scaling_model.py reads (docs/scaling.md, "Checked against this machine").
COMM_WORLDS ?= 2 4
$(BUILD)/comm_bandwidth: tests/bench/comm_bandwidth.cpp
	@mkdir -p $(dir $@)
	$(CXX) $(CPPFLAGS) $(ALL_CXXFLAGS) $< -o $@
comm-bench: $(BUILD)/comm_bandwidth
	rm -f $(BUILD)/comm.jsonl
	for w in $(COMM_WORLDS); do $(MPIRUN) -np $$w $(BUILD)/comm_bandwidth --json $(BUILD)/comm.jsonl || exit 1; done
	@echo "comm-bench: $(BUILD)/comm.jsonl"

# The scaling model's communication part against shardtrain's own per-step comm_ms / exposed_comm_ms
# (--metrics) at W = 2 and 4 on tests/bench/scaling-config.json (hidden 1024, 4 layers, fp32, seq
# 256, micro-batch 1): fills docs/scaling.md's "Checked against this machine". Runs comm-bench
# first; needs a shardtrain with --overlap and those metrics fields.
SCALING_OVERLAP ?= off
SCALING_PREFETCH ?= $(if $(filter on,$(SCALING_OVERLAP)),1,0)
SCALING_STEPS ?= 12
.PHONY: scaling-check
scaling-check: $(BUILD)/shardtrain $(BUILD)/data/fortunes.tok
	$(MAKE) --no-print-directory comm-bench  # afresh: this machine's bandwidth varies with its load
	for w in $(COMM_WORLDS); do $(MPIRUN) -np $$w $(BUILD)/shardtrain --model tests/bench/scaling-config.json \
	  --data $(BUILD)/data/fortunes.tok --seq-len 256 --micro-batch 1 --global-batch $$w --steps $(SCALING_STEPS) \
	  --precision fp32 --threads 1 --log-every 1 --eval-every 0 --eval-batches 1 --overlap $(SCALING_OVERLAP) \
	  --metrics $(BUILD)/scaling-m$$w.jsonl || exit 1; done
	python3 scripts/scaling_model.py check --model tests/bench/scaling-config.json --seq-len 256 --micro-batch 1 \
	  --precision fp32 --prefetch $(SCALING_PREFETCH) --bandwidth-json $(BUILD)/comm.jsonl \
	  $(foreach w,$(COMM_WORLDS),--metrics $(BUILD)/scaling-m$(w).jsonl --world $(w))
	python3 tests/bench/test_scaling_model.py

clean:
	rm -rf $(BUILD) $(VENV)

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
