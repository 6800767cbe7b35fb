# fourbit: the two commands a fresh machine needs are `make demo` and `make test`.
# Everything else (build, test-asan, bench) is here too. Install steps live in
# scripts/install-deps.sh, which every target runs first (idempotent, quick when done).

BUILD      ?= build
BUILD_ASAN ?= build-asan
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=
FOURBIT    := $(BUILD)/fourbit

.PHONY: all deps build test test-asan demo bench convergence interop clean

all: build

deps:
	@scripts/install-deps.sh

$(BUILD)/build.ninja: | deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)

build: deps $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# AddressSanitizer + UndefinedBehaviorSanitizer build of the test suite (CPU only: the sanitizers
# do not see into CUDA kernels, and CI has no GPU). ASAN_SKIP: the sweeps of every float32 bit
# pattern through the scalar encoders (fast_quant_test.cpp), arithmetic on registers with no
# memory for AddressSanitizer to watch, whose code the other tests run under both sanitizers; they
# took ~50 s of its CPU time.
ASAN_SKIP ?= FastQuantE2m1.RoundingEqualsTheGenericEncoderOnEveryFloat|FastQuantE4m3.ScaleValueEqualsTheGenericEncoderAndDecoder|FastQuantE4m3.ScaleEncodeEqualsTheGenericEncoder
test-asan: deps
	cmake -S . -B $(BUILD_ASAN) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFOURBIT_SANITIZE=ON \
	      -DFOURBIT_CUDA=OFF -DFOURBIT_BENCH=OFF $(CMAKE_ARGS)
	cmake --build $(BUILD_ASAN) -j $(JOBS)
	cd $(BUILD_ASAN) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	    ctest --output-on-failure -j $(JOBS) -E '$(ASAN_SKIP)'

demo: build
	@scripts/demo.sh $(BUILD)

bench: build
	@scripts/bench.sh $(BUILD)

# 300-step runs of every recipe on configs/tiny.toml, checked against the unigram entropy and
# against each other (about 12 minutes on 2 cores; not part of `make test`).
convergence: build
	@mkdir -p runs/convergence && scripts/convergence.sh $(BUILD)

# fourbit against Hugging Face transformers: the hf export loads with no missing or unexpected
# keys and gives fourbit's logits; a random transformers qwen2_moe imports and scores the same.
# Installs torch (CPU) + transformers into a venv unless python3 already has them (not part of
# `make test`; docs/export.md).
interop: build
	@scripts/interop.sh $(BUILD)

clean:
	rm -rf $(BUILD) $(BUILD_ASAN)
