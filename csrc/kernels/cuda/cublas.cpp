// cuBLAS through dlopen: the few entry points the dense GEMM needs, declared here with cuBLAS's stable C
// ABI (opaque handle, int enums), so no cuBLAS header or library is needed to build.
#include "kernels/cuda/cublas.h"

#include <dlfcn.h>

#include <memory>
#include <mutex>

#include "core/check.h"
#include "kernels/cuda/ops_cuda.h"

namespace lmkit::cuda {
namespace {

using Handle = void*;
using CreateFn = int (*)(Handle*);
using SetStreamFn = int (*)(Handle, void*);
using SetWorkspaceFn = int (*)(Handle, void*, size_t);
using GemmExFn = int (*)(Handle, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
                         const void*, void*, int, int, int, int);
// Values of cuBLAS's and CUDA's enums (cublas_api.h, library_types.h).
constexpr int kOpN = 0, kOpT = 1;
constexpr int kR16F = 2, kR16BF = 14;
constexpr int kCompute32F = 68;
constexpr int kGemmDefault = -1;
constexpr int64_t kWorkspaceBytes = 32 << 20;

struct Cublas {
  void* lib = nullptr;
  CreateFn create = nullptr;
  SetStreamFn set_stream = nullptr;
  GemmExFn gemm_ex = nullptr;
  SetWorkspaceFn set_workspace = nullptr;
  Handle handle = nullptr;
  std::shared_ptr<void> workspace;  // given to cuBLAS so that it never allocates (CUDA graph capture)
  bool tried = false;
};
Cublas g_cublas;
std::mutex g_mutex;

bool open_locked(const char* path) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) return false;
  Cublas c;
  c.lib = lib;
  c.create = reinterpret_cast<CreateFn>(dlsym(lib, "cublasCreate_v2"));
  c.set_stream = reinterpret_cast<SetStreamFn>(dlsym(lib, "cublasSetStream_v2"));
  c.gemm_ex = reinterpret_cast<GemmExFn>(dlsym(lib, "cublasGemmEx"));
  c.set_workspace = reinterpret_cast<SetWorkspaceFn>(dlsym(lib, "cublasSetWorkspace_v2"));
  if (!c.create || !c.set_stream || !c.gemm_ex || c.create(&c.handle) != 0) {
    dlclose(lib);
    return false;
  }
  if (c.set_workspace) c.workspace = allocate(kWorkspaceBytes);  // given to cuBLAS on every call (cublas_gemm)
  c.tried = true;
  g_cublas = c;
  return true;
}

}  // namespace

bool cublas_available() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_cublas.tried) {
    g_cublas.tried = true;
    for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"})
      if (open_locked(name)) break;
  }
  return g_cublas.handle != nullptr;
}

bool load_cublas(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_cublas.handle) return true;
  return open_locked(path.c_str());
}

void cublas_gemm(const void* x, const void* w, void* out, int64_t M, int64_t N, int64_t K, DType act, void* stream,
                 int64_t ldo) {
  LMKIT_CHECK(cublas_available(), "cuBLAS is not loaded");
  if (ldo == 0) ldo = N;
  LMKIT_CHECK_ARG(M <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX && ldo <= INT32_MAX && ldo >= N,
                  "cuBLAS GEMM: dimensions beyond int32 or out's row stride under N");
  const int type = act == DType::F16 ? kR16F : kR16BF;
  const float alpha = 1.0f, beta = 0.0f;
  std::lock_guard<std::mutex> lock(g_mutex);  // one handle: its stream is per call
  int status = g_cublas.set_stream(g_cublas.handle, stream);
  // cublasSetStream drops a user workspace (cuBLAS docs, "cublasSetStream"): give it back after every call,
  // or a GEMM under CUDA graph capture would allocate its own.
  if (status == 0 && g_cublas.set_workspace)
    status = g_cublas.set_workspace(g_cublas.handle, g_cublas.workspace.get(), kWorkspaceBytes);
  // Column-major view: out^T [N, M] = W [N, K] (stored as K x N, transposed) x x^T [K, M].
  if (status == 0)
    status = g_cublas.gemm_ex(g_cublas.handle, kOpT, kOpN, (int)N, (int)M, (int)K, &alpha, w, type, (int)K, x, type,
                              (int)K, &beta, out, type, (int)ldo, kCompute32F, kGemmDefault);
  LMKIT_CHECK(status == 0, "cublasGemmEx failed with status ", status, " (M=", M, " N=", N, " K=", K, ")");
}

}  // namespace lmkit::cuda
