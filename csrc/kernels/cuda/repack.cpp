// Host-side repacking of AWQ "GEMM" tensors into the CUDA backend's int4 layout (ops_cuda.h, Linear).
// Plain C++, built on every machine, so that the layout is tested where no GPU is (tests/test_cuda_layout.py).
#include <string.h>

#include "core/check.h"
#include "kernels/cuda/ops_cuda.h"

namespace lmkit::cuda {
namespace {

constexpr int kAwqOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // nibble i of an AWQ int32 holds column 8c + kAwqOrder[i]

// Nibble of column `col` in row `row` of an AWQ-packed int32 matrix [rows, cols / 8].
inline uint32_t awq_nibble(const uint32_t* packed, int64_t cols8, int64_t row, int64_t col, const int* slot_of) {
  const uint32_t word = packed[row * cols8 + col / 8];
  return (word >> (4 * slot_of[col % 8])) & 15u;
}

}  // namespace

int64_t Linear::size_bytes() const {
  if (!is_int4()) return n * k * 2;
  return n * k / 2 + n * (k / group_size) * 3;
}

HostInt4 repack_awq(const Tensor& qweight, const Tensor& qzeros, const Tensor& scales, int32_t group_size) {
  LMKIT_CHECK_ARG(group_size == 32 || group_size == 64 || group_size == 128,
                  "AWQ group size must be 32, 64 or 128 for the CUDA backend, got ", group_size);
  LMKIT_CHECK_ARG(qweight.dtype == DType::I32 && qweight.ndim == 2, "qweight must be a 2-d I32 tensor, got ",
                  dtype_name(qweight.dtype), " with ", qweight.ndim, " dims");
  const int64_t K = qweight.shape[0], N = qweight.shape[1] * 8;
  LMKIT_CHECK_ARG(K % group_size == 0, "qweight has ", K, " input rows, not a multiple of the group size ", group_size);
  LMKIT_CHECK_ARG(qzeros.dtype == DType::I32 && qzeros.ndim == 2 && qzeros.shape[0] == K / group_size &&
                      qzeros.shape[1] == N / 8,
                  "qzeros must be I32 [", K / group_size, ", ", N / 8, "] to match qweight [", K, ", ", N / 8, "]");
  LMKIT_CHECK_ARG(scales.dtype == DType::F16 && scales.ndim == 2 && scales.shape[0] == K / group_size &&
                      scales.shape[1] == N,
                  "scales must be F16 [", K / group_size, ", ", N, "] to match qweight [", K, ", ", N / 8, "]");
  int slot_of[8];
  for (int i = 0; i < 8; ++i) slot_of[kAwqOrder[i]] = i;
  const int64_t G = K / group_size;
  HostInt4 out;
  out.n = N, out.k = K, out.group_size = group_size;
  out.qweight.reset(new uint32_t[N * (K / 8)]);
  out.scales.reset(new uint16_t[N * G]);
  out.zeros.reset(new uint8_t[N * G]);
  const uint32_t* qw = qweight.ptr<const uint32_t>();
  const uint32_t* qz = qzeros.ptr<const uint32_t>();
  const uint16_t* sc = scales.ptr<const uint16_t>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t w = 0; w < K / 8; ++w) {
      uint32_t word = 0;
      for (int i = 0; i < 8; ++i) word |= awq_nibble(qw, N / 8, 8 * w + i, n, slot_of) << (4 * i);
      out.qweight[n * (K / 8) + w] = word;
    }
    for (int64_t g = 0; g < G; ++g) {
      out.scales[n * G + g] = sc[g * N + n];
      out.zeros[n * G + g] = (uint8_t)awq_nibble(qz, N / 8, g, n, slot_of);
    }
  }
  return out;
}

}  // namespace lmkit::cuda
