# AddressSanitizer run of the dal.npu C++ kernels (not part of the default test run).
#   make -f mk/asan.mk asan      (or `include mk/asan.mk` from the top Makefile, then `make asan`)
# Builds a separate extension with -fsanitize=address (dal.npu.build.kernels(sanitize=True))
# and runs the kernels on a few test models, edge-size GEMMs and the never-a-crash fuzz corpus
# with libasan preloaded.
ASAN_PY  ?= .venv/bin/python
ASAN_FUZZ ?= 12
# (ASAN_FUZZ: fuzz-corpus cases per mutation kind, tests/npu/fuzz_corpus.py)
ASAN_LIB := $(shell gcc -print-file-name=libasan.so)

.PHONY: asan
asan:
	LD_PRELOAD=$(ASAN_LIB) ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	  $(ASAN_PY) tests/npu/asan_driver.py $(ASAN_FUZZ)
