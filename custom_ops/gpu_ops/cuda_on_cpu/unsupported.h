// CUDA constructs the executor does not implement. Each is defined here (after the toolkit's
// headers, which define some of them for the host) to stop the build with its name, so a kernel
// that starts using one cannot compile into something that silently means another thing.
// Device functions not implemented need nothing here: the host compiler finds no declaration of
// them (e.g. atomicAdd, __shfl_down_sync, __ldg) and names them in its error.
#pragma once

#define CUDA_ON_CPU_STR(x) #x
#define CUDA_ON_CPU_UNSUPPORTED(what) _Pragma(CUDA_ON_CPU_STR(GCC error "cuda_on_cpu: " what " is not implemented"))

#undef __constant__
#define __constant__ CUDA_ON_CPU_UNSUPPORTED("__constant__")
#undef __managed__
#define __managed__ CUDA_ON_CPU_UNSUPPORTED("__managed__")
#undef __grid_constant__
#define __grid_constant__ CUDA_ON_CPU_UNSUPPORTED("__grid_constant__")
#undef __maxnreg__
#define __maxnreg__(n) CUDA_ON_CPU_UNSUPPORTED("__maxnreg__")
