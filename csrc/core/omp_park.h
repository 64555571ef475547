// A parked OpenMP team: one thread that opened a team of its own in the
// process's OpenMP runtime and sleeps, so the runtime counts more OpenMP
// threads than CPUs.
//
// Why: libgomp (torch's OpenMP runtime on Linux) lets a worker spin about
// 300,000 iterations (milliseconds) after every parallel region before it
// sleeps, unless the process has more OpenMP threads than CPUs: then 100
// with OMP_WAIT_POLICY unset (GOMP_SPINCOUNT in libgomp's manual). With
// NVMe offload the main thread runs short parallel regions between waits
// for I/O, so torch's workers spin through those waits on the cores aio's
// I/O threads need. The spin count is read once, when the runtime loads, so
// it cannot be lowered later; the parked team makes the runtime take its
// short count instead. Python (aio.optim.OpenMPThrottle) parks only in
// libgomp.
#pragma once

#include "cpu_adam.h"  // ParallelFn

namespace aio {

// Parks a team of `threads` (>= 2) OpenMP threads through `parallel` (the
// runtime's GOMP_parallel), on the first acquire; later acquires only count
// (their `threads` is not used). Returns once the team exists. Throws
// std::invalid_argument for a null `parallel` or fewer than 2 threads, and
// std::system_error when no thread can be started (nothing changes then).
void omp_park_acquire(ParallelFn parallel, unsigned threads);

// Drops one acquire; the last one wakes the parked thread and joins it (its
// team ends with it). In a child forked while a team was parked (the child
// has none of its threads) the count is reset and nothing is joined.
void omp_park_release();

// The parked team's members as the runtime gave them (it may give fewer than
// asked), 0 when none is parked in this process.
unsigned omp_parked_threads();

}  // namespace aio
