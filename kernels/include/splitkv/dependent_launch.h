// Programmatic dependent launch (sm_90+). A kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the previous kernel of its
// stream still runs; both calls below are no-ops without that attribute and below sm_90.
#pragma once

#include <cute/config.hpp>

namespace splitkv {

// Blocks until the previous grid of the stream has finished and its writes are visible. Every
// global-memory access of a kernel must come after it: the previous kernel may have written this
// call's inputs (a KV-cache append) or still be reading the workspace this call writes.
CUTE_DEVICE void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel of the stream launch now. Its CTAs stop in wait_for_previous_grid until
// this grid has finished, so triggering as soon as this grid passed its own wait only hides the
// next launch's latency; it cannot take SM slots from this grid (the next grid launches once
// every CTA of this one has started and triggered).
CUTE_DEVICE void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace splitkv
