// Dynamic shared memory (the launch's third <<<>>> argument). The kernels name it through one
// file-scope declaration, `extern __shared__ __align__(16) unsigned char dynamic_shared_memory[];`
// (append_attn_common.cuh): with __shared__ = thread_local that declares this array, the running
// block's buffer on the OS thread that runs it, as large as the largest opt-in limit of a GPU
// (sm_90: 227 KiB). Any other extern __shared__ name stays undefined and fails the link with it.
#pragma once

constexpr unsigned long cuda_on_cpu_max_dynamic_smem = 227 * 1024;
extern thread_local __attribute__((aligned(16))) unsigned char dynamic_shared_memory[];
