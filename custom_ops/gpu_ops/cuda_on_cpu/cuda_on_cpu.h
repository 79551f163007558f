// The CUDA-on-CPU executor (docs/gpu.md): the project's CUDA sources compiled by the host C++
// compiler (`g++ -x c++ -include cuda_on_cpu.h`) and run on the CPU. It implements exactly the
// CUDA constructs the kernels and the harness use, one concept per file below; whatever else
// stops the build with its name (unsupported.h). The toolkit's host headers supply the types
// (dim3, float2, ...) and the 16- and 8-bit float conversions, bit-exact to CUDA's definitions.
#pragma once

#define CUDA_ON_CPU 1

#include "qualifiers.h"  // before the toolkit's headers, which keep qualifiers already defined

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "atomics.h"
#include "device_math.h"
#include "dynamic_shared.h"
#include "launch.h"
#include "runtime_extras.h"
#include "sync.h"
#include "thread_index.h"
#include "unsupported.h"
