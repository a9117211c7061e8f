// cuBLAS, loaded at run time (dlopen) so that neither the build nor the wheel needs it: the dense GEMM
// of the CUDA backend uses it when found, and its own tensor-core kernel otherwise.
#pragma once
#include <stdint.h>

#include <string>

#include "core/dtype.h"

namespace lmkit::cuda {

// Whether libcublas is loaded (the first call tries the usual sonames: libcublas.so.13, .12, .so).
bool cublas_available();
// Loads libcublas from a file (e.g. the nvidia-cublas Python package's); false when it cannot.
bool load_cublas(const std::string& path);
// out[M, N] = x[M, K] @ w[N, K]^T, row-major, act = F16 / BF16, fp32 accumulation, on `stream`; out's rows
// ldo elements apart (0: N), so that column blocks of a wider out can be written one at a time.
void cublas_gemm(const void* x, const void* w, void* out, int64_t M, int64_t N, int64_t K, DType act, void* stream,
                 int64_t ldo = 0);

}  // namespace lmkit::cuda
