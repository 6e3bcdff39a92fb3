// Loops over independent work items, on OpenMP threads only when that pays.
//
// Why not OpenMP's `if` clause alone: with the clause false, GCC still calls GOMP_parallel, which
// builds and tears down a team of one thread per loop. A QAT step of SSDlite makes ~800 kernel
// calls on one thread, and that runtime entry cost ~4 ms of its ~370 ms (py-spy, 2026-12-03).
// The serial branch below is the same loop in the same order: every item writes its own output,
// so the bits do not depend on the branch taken.
#pragma once
#include <cstdint>

namespace dal_parallel {

// body(i) for i in [0, items): on `nthreads` threads when `parallel` (and nthreads > 1).
template <class Body>
inline void for_each(int64_t items, int nthreads, bool parallel, const Body& body) {
    if (nthreads > 1 && parallel) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t i = 0; i < items; ++i) body(i);
    } else {
        for (int64_t i = 0; i < items; ++i) body(i);
    }
}

// for_each with a verdict: 1 when body(i) returned true for every i. Every item runs either way
// (each writes its own outputs, which callers may read even on a 0).
template <class Body>
inline int all_of(int64_t items, int nthreads, bool parallel, const Body& body) {
    int ok = 1;
    if (nthreads > 1 && parallel) {
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(&& : ok)
        for (int64_t i = 0; i < items; ++i) ok = body(i) && ok;
    } else {
        for (int64_t i = 0; i < items; ++i) ok = body(i) && ok;
    }
    return ok;
}

}  // namespace dal_parallel
