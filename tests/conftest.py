"""Test-wide set-up: helpers at the top of tests/ (e.g. mnist_helpers) are importable from every folder,
and Hypothesis draws the same examples on every run."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

try:
    from hypothesis import settings
except ImportError:  # a dev extra; only the property tests need it
    settings = None

if settings is not None:
    # derandomize: examples come from a fixed seed (derived from each test), so a CI failure
    # reproduces on rerun; deadline=None: no wall-clock limit per example. Loaded here, before
    # the test modules are imported, so their own @settings(...) inherit both.
    settings.register_profile("dal", derandomize=True, deadline=None, print_blob=True)
    settings.load_profile("dal")

# `make test` runs one xdist worker per core: one torch thread per worker, not two workers
# fighting over both cores (tests that measure threading pass their thread count explicitly).
import torch  # noqa: E402

torch.set_num_threads(1)
