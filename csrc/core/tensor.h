// A non-owning view of a dense row-major tensor: dtype, shape, device, data.
// Weights are views into memory-mapped checkpoint files; activations are views into engine buffers.
#pragma once
#include <stdint.h>

#include <string>
#include <vector>

#include "dtype.h"

namespace lmkit {

enum class Device : int32_t { CPU = 0, CUDA = 1 };

struct Tensor {
  static constexpr int kMaxDims = 4;
  void* data = nullptr;
  DType dtype = DType::F32;
  Device device = Device::CPU;
  int32_t ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};

  bool is_empty() const { return data == nullptr; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return ndim == 0 ? 0 : n;
  }
  int64_t size_bytes() const { return numel() / dtype_block_elems(dtype) * dtype_block_bytes(dtype); }
  int64_t dim(int i) const { return shape[i < 0 ? ndim + i : i]; }
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
};

// Element i of a float tensor (F32 / F16 / BF16) as fp32.
inline float float_value(const Tensor& t, int64_t i) {
  if (t.dtype == DType::F32) return t.ptr<const float>()[i];
  const uint16_t h = t.ptr<const uint16_t>()[i];
  return t.dtype == DType::F16 ? f16_to_f32(h) : bf16_to_f32(h);
}

// "[d0, d1, ...]", for messages.
inline std::string shape_str(const int64_t* dims, int64_t ndim) {
  std::string out = "[";
  for (int64_t i = 0; i < ndim; ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}
inline std::string shape_str(const std::vector<int64_t>& dims) { return shape_str(dims.data(), (int64_t)dims.size()); }
inline std::string shape_str(const Tensor& t) { return shape_str(t.shape, t.ndim); }

inline Tensor make_view(void* data, DType dtype, int64_t d0, int64_t d1 = -1, int64_t d2 = -1) {
  Tensor t;
  t.data = data;
  t.dtype = dtype;
  t.shape[0] = d0;
  t.ndim = 1;
  if (d1 >= 0) t.shape[t.ndim++] = d1;
  if (d2 >= 0) t.shape[t.ndim++] = d2;
  return t;
}

}  // namespace lmkit
