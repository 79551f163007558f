// The device math the kernels call. __expf is the GPU's fast approximation (ex2.approx, a few ulp);
// here it is expf, correctly rounded on glibc: results agree with a GPU's to that error, not bit for
// bit (docs/gpu.md).
#pragma once

#include <math.h>

inline float __expf(float x) { return expf(x); }

// CUDA's integer and float min / max overloads (device code calls them unqualified).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
