# AddressSanitizer run of the dal.npu C++ kernels (not part of the default test run).
#   make -f mk/asan.mk asan      (or `include mk/asan.mk` from the top Makefile, then `make asan`)
# Builds a separate extension with -fsanitize=address (dal.npu.build.kernels(sanitize=True))
# and runs the kernels on a few test models and edge-size GEMMs with libasan preloaded.
ASAN_PY  ?= .venv/bin/python
ASAN_LIB := $(shell gcc -print-file-name=libasan.so)

.PHONY: asan
asan:
	LD_PRELOAD=$(ASAN_LIB) ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	  $(ASAN_PY) tests/npu/asan_driver.py
