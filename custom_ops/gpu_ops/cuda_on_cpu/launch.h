// Kernel launches. A launch site is written CUDA_LAUNCH(grid, block, smem, stream, kernel)(args...);
// under nvcc that is kernel<<<grid, block, smem, stream>>>(args...) (append_attn_common.cuh), here it
// hands the kernel and its arguments to run_kernel (launch.cpp), which runs every block on fibers
// before returning (a launch is synchronous; streams order nothing more).
#pragma once

#include <cuda_runtime_api.h>

#include <tuple>
#include <utility>

namespace cuda_on_cpu {

struct LaunchSite {
  const void* kernel;    // identity, for cudaFuncSetAttribute's limits
  const char* name;      // the kernel expression as written at the launch site
  const char* launcher;  // the function that launches it (template arguments included)
  const char* file;
  int line;
  dim3 grid, block;
  size_t dynamic_smem;
};

// Runs body(ctx) once per thread of every block of the grid; sets the launch error on failure.
void run_kernel(const LaunchSite& site, void (*body)(void*), void* ctx);

template <typename... Params>
class Launch {
 public:
  Launch(void (*kernel)(Params...), const LaunchSite& site) : kernel_(kernel), site_(site) {}

  // CUDA copies the arguments once at the launch; every thread then gets them by value.
  template <typename... Args>
  void operator()(Args&&... args) const {
    struct Ctx {
      void (*kernel)(Params...);
      std::tuple<std::decay_t<Params>...> args;
    } ctx{kernel_, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
    run_kernel(site_, [](void* c) {
      Ctx* ctx = static_cast<Ctx*>(c);
      std::apply(ctx->kernel, ctx->args);
    }, &ctx);
  }

 private:
  void (*kernel_)(Params...);
  LaunchSite site_;
};

template <typename... Params>
Launch<Params...> make_launch(void (*kernel)(Params...), const char* name, const char* launcher, const char* file,
                              int line, dim3 grid, dim3 block, size_t smem,
                              cudaStream_t /*stream: launches are synchronous*/) {
  return Launch<Params...>(kernel, LaunchSite{reinterpret_cast<const void*>(kernel), name, launcher, file, line,
                                              grid, block, smem});
}

}  // namespace cuda_on_cpu

#define CUDA_LAUNCH(grid, block, smem, stream, ...) \
  ::cuda_on_cpu::make_launch(__VA_ARGS__, #__VA_ARGS__, __PRETTY_FUNCTION__, __FILE__, __LINE__, grid, \
                             block, smem, stream)
