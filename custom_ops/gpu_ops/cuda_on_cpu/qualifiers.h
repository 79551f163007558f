// CUDA's function and variable qualifiers for the host compiler. Defined before the toolkit's
// headers are read: its crt/host_defines.h keeps a qualifier that is already defined.
#pragma once

#define __global__
#define __device__
#define __host__
// A block's __shared__ variables: one copy per OS thread, which runs one block at a time, so the
// block's threads (fibers on that OS thread) share it. Block-scope thread_local implies static.
#define __shared__ thread_local
#define __launch_bounds__(...)
