// Host-side repacking of an int4 checkpoint (any layout, read through an Int4Source) into the CUDA backend's
// int4 layout (ops_cuda.h, Linear).
// Plain C++, built on every machine, so that the layout is tested where no GPU is (tests/kernels/test_cuda_layout.py).
#include <string.h>

#include <algorithm>
#include <vector>

#include "core/check.h"
#include "kernels/cuda/ops_cuda.h"

namespace lmkit::cuda {
int64_t Linear::size_bytes() const {
  if (!is_int4()) return n * k * 2;
  return n * k / 2 + n * (k / group_size) * 3;
}

HostInt4 repack_int4(const Int4Source& source) {
  const int64_t N = source.num_out, K = source.num_in, g = source.group_size;
  LMKIT_CHECK_ARG(!source.has_e8m0() && !source.has_nvfp4(), "MXFP4 and NVFP4 weights are not supported by the "
                  "CUDA backend yet; run them with device='cpu'");
  LMKIT_CHECK_ARG(g == 32 || g == 64 || g == 128, "int4 group size must be 32, 64 or 128 for the CUDA backend, got ",
                  g);
  LMKIT_CHECK_ARG(N > 0 && K > 0 && K % g == 0, "int4 weight [", N, ", ", K, "]: in_features is not a multiple of ",
                  "the group size ", g);
  LMKIT_CHECK_ARG(!source.has_offsets() && !source.has_kquant(), "int4 groups with float offsets (GGUF Q4_1, Q4_K) "
                  "are not supported by the CUDA backend yet; run them with device='cpu'");
  LMKIT_CHECK_ARG(!source.input_perm, "act-order int4 checkpoints (GPTQ desc_act, compressed-tensors actorder "
                  "'group') are not supported by the CUDA backend yet; use device='cpu'");
  const int64_t G = K / g;
  HostInt4 out;
  out.n = N, out.k = K, out.group_size = (int32_t)g;
  out.qweight.reset(new uint32_t[N * (K / 8)]());
  out.scales.reset(new uint16_t[N * G]);
  out.zeros.reset(new uint8_t[N * G]);
  constexpr int64_t kCols = 64;  // outputs read per call
  std::vector<uint8_t> q(g * kCols), z(kCols);
  std::vector<uint16_t> s(kCols);
  for (int64_t n0 = 0; n0 < N; n0 += kCols) {
    const int64_t count = std::min(kCols, N - n0);
    for (int64_t gi = 0; gi < G; ++gi) {
      source.read_group(gi, n0, count, q.data(), z.data(), s.data());
      for (int64_t c = 0; c < count; ++c) {
        const int64_t n = n0 + c;
        out.scales[n * G + gi] = s[c];
        out.zeros[n * G + gi] = z[c];
        for (int64_t r = 0; r < g; ++r) {
          const int64_t k = gi * g + r;
          out.qweight[n * (K / 8) + k / 8] |= (uint32_t)(q[r * count + c] & 15u) << (4 * (k % 8));
        }
      }
    }
  }
  return out;
}

}  // namespace lmkit::cuda
