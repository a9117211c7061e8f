#include "model/int4_layouts.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "model/mxfp4.h"

namespace lmkit {

namespace {

constexpr int kAwqNibbleOf[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // output column n % 8 -> nibble (AutoAWQ GEMM order)

void check_tensor(const Tensor& t, bool is_float, const std::vector<int64_t>& shape, const std::string& what,
                  const char* name) {
  LMKIT_CHECK_ARG(!t.is_empty(), what, ": no '", name, "' tensor");
  const bool dtype_ok = is_float ? (t.dtype == DType::F16 || t.dtype == DType::BF16 || t.dtype == DType::F32)
                                 : t.dtype == DType::I32;
  LMKIT_CHECK_ARG(dtype_ok, what, ".", name, " has dtype ", dtype_name(t.dtype), "; it must be ",
                  is_float ? "F16, BF16 or F32" : "I32");
  bool shape_ok = t.ndim == (int32_t)shape.size();
  for (int i = 0; shape_ok && i < t.ndim; ++i) shape_ok = t.shape[i] == shape[i];
  LMKIT_CHECK_ARG(shape_ok, what, ".", name, " has shape ", shape_str(t), "; the layer's shape implies ",
                  shape_str(shape));
}

// The checkpoint's names of a layout's tensors, for messages: values, zeros, scales, g_idx.
struct TensorNames {
  const char *values, *zeros, *scales, *g_idx;
};
TensorNames names_of(Int4Layout layout) {
  if (layout == Int4Layout::PackQuantized) return {"weight_packed", "weight_zero_point", "weight_scale", "weight_g_idx"};
  return {"qweight", "qzeros", "scales", "g_idx"};
}

uint16_t scale_bits(const Tensor& s, int64_t i) {
  return s.dtype == DType::F16 ? s.ptr<const uint16_t>()[i] : f32_to_f16(float_value(s, i));
}
uint8_t nibble(uint32_t word, int64_t i) { return (uint8_t)((word >> (4 * i)) & 15u); }

constexpr int kIdentityNibbleOf[8] = {0, 1, 2, 3, 4, 5, 6, 7};

// Whether every zero nibble of a zeros tensor (I32 words of 8, plus word_bias) is 8: a symmetric checkpoint
// (Int4Source::symmetric). A padding nibble that is not 8 only makes the answer no.
bool zeros_all_eight(const Tensor& zeros, uint32_t word_bias) {
  const uint32_t* qz = zeros.ptr<const uint32_t>();
  for (int64_t i = 0; i < zeros.numel(); ++i)
    if (qz[i] + word_bias != 0x88888888u) return false;
  return true;
}

// AWQ's and GPTQ's zeros I32 [G, N / 8] (output n at nibble nibble_of[n % 8] of word [sg, n / 8], the word plus
// word_bias first) and scales [G, N]: group sg of outputs n0 .. n0 + count.
void read_zeros_scales_by_group(const Tensor& zeros, const Tensor& scales, int64_t N, int64_t sg, int64_t n0,
                                int64_t count, const int* nibble_of, uint32_t word_bias, uint8_t* z, uint16_t* s) {
  const uint32_t* qz = zeros.ptr<const uint32_t>();
  for (int64_t c = 0; c < count; ++c) {
    const int64_t n = n0 + c;
    z[c] = nibble(qz[sg * (N / 8) + n / 8] + word_bias, nibble_of[n % 8]);
    s[c] = scale_bits(scales, sg * N + n);
  }
}

// The order that makes the g_idx groups contiguous: inputs sorted by group (stable); null where g_idx is
// empty or already in order. Every group 0..G-1 must have exactly group_size inputs.
std::shared_ptr<const std::vector<int32_t>> order_of_groups(const Tensor& g_idx, int64_t K, int64_t gs,
                                                            const std::string& what, const char* name) {
  if (g_idx.is_empty()) return nullptr;
  check_tensor(g_idx, false, {K}, what, name);
  const int32_t* gi = g_idx.ptr<const int32_t>();
  const int64_t G = K / gs;
  std::vector<int64_t> count(G, 0);
  bool in_order = true;
  for (int64_t k = 0; k < K; ++k) {
    LMKIT_CHECK_ARG(gi[k] >= 0 && gi[k] < G, what, ".", name, "[", k, "] = ", gi[k], " is not a group 0..", G - 1);
    ++count[gi[k]];
    in_order = in_order && gi[k] == k / gs;
  }
  if (in_order) return nullptr;
  for (int64_t g = 0; g < G; ++g)
    LMKIT_CHECK_ARG(count[g] == gs, what, ".", name, " puts ", count[g], " inputs in group ", g,
                    "; every group must have group_size = ", gs);
  auto perm = std::make_shared<std::vector<int32_t>>(K);
  std::iota(perm->begin(), perm->end(), 0);
  std::stable_sort(perm->begin(), perm->end(), [&](int32_t a, int32_t b) { return gi[a] < gi[b]; });
  return perm;
}

// The fp16 bits of an FP8 E4M3 byte's value (exact: E4M3's normal and subnormal values are fp16 normals).
uint16_t e4m3_f16_bits(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float magnitude = e == 0 ? std::ldexp((float)m, -9) : std::ldexp((float)(8 + m), e - 10);
  return f32_to_f16(b & 0x80 ? -magnitude : magnitude);
}

void check_u8(const Tensor& t, const std::vector<int64_t>& shape, const std::string& what, const char* name) {
  LMKIT_CHECK_ARG(!t.is_empty(), what, ": no '", name, "' tensor");
  LMKIT_CHECK_ARG(t.dtype == DType::U8, what, ".", name, " has dtype ", dtype_name(t.dtype), "; it must be U8");
  LMKIT_CHECK_ARG(t.ndim == 2 && t.shape[0] == shape[0] && t.shape[1] == shape[1], what, ".", name, " has shape ",
                  shape_str(t), "; the layer's shape implies ", shape_str(shape));
}

// The FP4 layouts (int4_layouts.h): compressed-tensors' MXFP4 through model/mxfp4.h's reader of HF's layout (the
// same bytes); compressed-tensors' and ModelOpt's NVFP4 here.
Int4Source fp4_source(const Int4Tensors& t, int64_t N, int64_t K, int64_t group_size, const std::string& what) {
  const bool modelopt = t.layout == Int4Layout::Nvfp4ModelOpt;
  const bool nv = t.layout == Int4Layout::Nvfp4PackQuantized || modelopt;
  // the checkpoint's names, for messages
  const char* values_name = modelopt ? "weight" : "weight_packed";
  const char* global_name = modelopt ? "weight_scale_2" : "weight_global_scale";
  const int64_t B = nv ? 16 : 32;
  LMKIT_CHECK_ARG(N > 0 && K > 0 && group_size == B && K % 32 == 0, what, ": an ", nv ? "NVFP4" : "MXFP4",
                  " layer [", N, ", ", K, "] with group_size ", group_size, ": the format's blocks are ", B,
                  " inputs and in_features must be a multiple of 32");
  check_u8(t.values, {N, K / 2}, what, values_name);
  check_u8(t.scales, {N, K / B}, what, "weight_scale");
  if (!nv) {
    Tensor blocks = t.values;
    blocks.ndim = 3;
    blocks.shape[1] = K / 32, blocks.shape[2] = 16;
    return mxfp4_source(blocks, t.scales, nullptr, what);
  }
  const Tensor& global = t.global_scale;
  LMKIT_CHECK_ARG(!global.is_empty(), what, ": no '", global_name, "' tensor (NVFP4 has one per weight)");
  LMKIT_CHECK_ARG(global.numel() == 1 && (global.dtype == DType::F32 || global.dtype == DType::F16 ||
                                          global.dtype == DType::BF16),
                  what, ".", global_name, " must be one F32, F16 or BF16 value, got ", dtype_name(global.dtype), " ",
                  shape_str(global));
  const float stored = float_value(global, 0);
  LMKIT_CHECK_ARG(std::isfinite(stored) && stored > 0.0f, what, ".", global_name, " is ", stored,
                  "; it must be positive and finite");
  const float gscale = modelopt ? 1.0f / stored : stored;  // ModelOpt's is a multiplier
  LMKIT_CHECK_ARG(std::isfinite(gscale) && gscale > 0.0f, what, ".", global_name, " is ", stored,
                  ": its reciprocal is out of fp32's range");
  Int4Source src;
  src.num_out = N;
  src.num_in = K;
  src.group_size = 16;
  src.nvfp4_global_scale = gscale;
  const Tensor values = t.values, scales = t.scales;
  src.read_group = [=](int64_t g, int64_t n0, int64_t count, uint8_t* q, uint8_t* z, uint16_t* s) {
    const uint8_t* packed = values.ptr<const uint8_t>();
    const uint8_t* sc = scales.ptr<const uint8_t>();
    for (int64_t c = 0; c < count; ++c) {
      const int64_t n = n0 + c;
      const uint8_t b = sc[n * (K / 16) + g];
      LMKIT_CHECK_ARG((b & 0x7f) != 0x7f, what, ".weight_scale[", n, ", ", g, "] is NaN (E4M3 byte ", (int)b, ")");
      s[c] = e4m3_f16_bits(b), z[c] = 0;
      for (int64_t r = 0; r < 16; ++r) {
        const uint8_t byte = packed[n * (K / 2) + (16 * g + r) / 2];
        q[r * count + c] = r % 2 ? byte >> 4 : byte & 15;
      }
    }
  };
  return src;
}

}  // namespace

Int4Layout parse_int4_layout(const std::string& name) {
  if (name.empty()) return Int4Layout::None;
  for (Int4Layout l : {Int4Layout::AwqGemm, Int4Layout::Gptq, Int4Layout::GptqV2, Int4Layout::PackQuantized,
                       Int4Layout::Mxfp4PackQuantized, Int4Layout::Nvfp4PackQuantized, Int4Layout::Nvfp4ModelOpt})
    if (name == int4_layout_name(l)) return l;
  LMKIT_CHECK_ARG(false, "unknown int4 layout '", name, "'; known: awq, gptq, gptq_v2, pack_quantized, "
                  "mxfp4_pack_quantized, nvfp4_pack_quantized, nvfp4_modelopt");
  return Int4Layout::None;
}

const char* int4_layout_name(Int4Layout layout) {
  switch (layout) {
    case Int4Layout::None: return "";
    case Int4Layout::AwqGemm: return "awq";
    case Int4Layout::Gptq: return "gptq";
    case Int4Layout::GptqV2: return "gptq_v2";
    case Int4Layout::PackQuantized: return "pack_quantized";
    case Int4Layout::Mxfp4PackQuantized: return "mxfp4_pack_quantized";
    case Int4Layout::Nvfp4PackQuantized: return "nvfp4_pack_quantized";
    case Int4Layout::Nvfp4ModelOpt: return "nvfp4_modelopt";
  }
  return "?";
}

Int4Source int4_source(const Int4Tensors& t, int64_t N, int64_t K, int64_t group_size, const std::string& what) {
  if (t.layout == Int4Layout::Mxfp4PackQuantized || t.layout == Int4Layout::Nvfp4PackQuantized ||
      t.layout == Int4Layout::Nvfp4ModelOpt)
    return fp4_source(t, N, K, group_size, what);
  const TensorNames names = names_of(t.layout);
  const int64_t gs = group_size > 0 ? group_size : K;
  LMKIT_CHECK_ARG(N > 0 && K > 0 && gs % 32 == 0 && K % gs == 0, what, ": an int4 layer (", int4_layout_name(t.layout),
                  " layout) [", N, ", ", K, "] with group_size ", group_size,
                  ": in_features must be a multiple of the group size, and the group size a multiple of 32");
  const int64_t G = K / gs;
  Int4Source src;
  src.num_out = N;
  src.num_in = K;
  src.group_size = gs % 128 == 0 ? 128 : gs % 64 == 0 ? 64 : 32;  // kernel groups repeat the checkpoint's
  const int64_t kg = src.group_size;
  const Tensor values = t.values, zeros = t.zeros, scales = t.scales;
  switch (t.layout) {
    case Int4Layout::AwqGemm: {
      LMKIT_CHECK_ARG(N % 8 == 0, what, ": AWQ needs out_features divisible by 8, got ", N);
      check_tensor(values, false, {K, N / 8}, what, names.values);
      check_tensor(zeros, false, {G, N / 8}, what, names.zeros);
      check_tensor(scales, true, {G, N}, what, names.scales);
      src.symmetric = zeros_all_eight(zeros, 0u);
      src.read_group = [=](int64_t g, int64_t n0, int64_t count, uint8_t* q, uint8_t* z, uint16_t* s) {
        const uint32_t* qw = values.ptr<const uint32_t>();
        read_zeros_scales_by_group(zeros, scales, N, g * kg / gs, n0, count, kAwqNibbleOf, 0u, z, s);
        for (int64_t r = 0; r < kg; ++r)
          for (int64_t c = 0; c < count; ++c) {
            const int64_t n = n0 + c;
            q[r * count + c] = nibble(qw[(g * kg + r) * (N / 8) + n / 8], kAwqNibbleOf[n % 8]);
          }
      };
      break;
    }
    case Int4Layout::Gptq:
    case Int4Layout::GptqV2: {
      LMKIT_CHECK_ARG(N % 8 == 0, what, ": GPTQ needs out_features divisible by 8, got ", N);
      check_tensor(values, false, {K / 8, N}, what, names.values);
      check_tensor(zeros, false, {G, N / 8}, what, names.zeros);
      check_tensor(scales, true, {G, N}, what, names.scales);
      src.input_perm = order_of_groups(t.g_idx, K, gs, what, names.g_idx);
      const uint32_t zero_bias = t.layout == Int4Layout::Gptq ? 0x11111111u : 0u;  // gptq stores zero - 1
      src.symmetric = zeros_all_eight(zeros, zero_bias);
      auto perm = src.input_perm;
      src.read_group = [=](int64_t g, int64_t n0, int64_t count, uint8_t* q, uint8_t* z, uint16_t* s) {
        const uint32_t* qw = values.ptr<const uint32_t>();
        read_zeros_scales_by_group(zeros, scales, N, g * kg / gs, n0, count, kIdentityNibbleOf, zero_bias, z, s);
        for (int64_t r = 0; r < kg; ++r) {
          const int64_t k = perm ? (*perm)[g * kg + r] : g * kg + r;
          for (int64_t c = 0; c < count; ++c) q[r * count + c] = nibble(qw[(k / 8) * N + n0 + c], k % 8);
        }
      };
      break;
    }
    case Int4Layout::PackQuantized: {
      check_tensor(values, false, {N, (K + 7) / 8}, what, names.values);
      if (!zeros.is_empty()) check_tensor(zeros, false, {(N + 7) / 8, G}, what, names.zeros);
      check_tensor(scales, true, {N, G}, what, names.scales);
      src.input_perm = order_of_groups(t.g_idx, K, gs, what, names.g_idx);
      src.symmetric = zeros.is_empty() || zeros_all_eight(zeros, 0u);
      auto perm = src.input_perm;
      src.read_group = [=](int64_t g, int64_t n0, int64_t count, uint8_t* q, uint8_t* z, uint16_t* s) {
        const uint32_t* qw = values.ptr<const uint32_t>();
        const uint32_t* qz = zeros.is_empty() ? nullptr : zeros.ptr<const uint32_t>();
        const int64_t sg = g * kg / gs, words = (K + 7) / 8;
        for (int64_t c = 0; c < count; ++c) {
          const int64_t n = n0 + c;
          z[c] = qz ? nibble(qz[(n / 8) * G + sg], n % 8) : 8;
          s[c] = scale_bits(scales, n * G + sg);
        }
        for (int64_t r = 0; r < kg; ++r) {
          const int64_t k = perm ? (*perm)[g * kg + r] : g * kg + r;
          for (int64_t c = 0; c < count; ++c) q[r * count + c] = nibble(qw[(n0 + c) * words + k / 8], k % 8);
        }
      };
      break;
    }
    case Int4Layout::Mxfp4PackQuantized:
    case Int4Layout::Nvfp4PackQuantized:
    case Int4Layout::Nvfp4ModelOpt:  // fp4_source above
    case Int4Layout::None: LMKIT_CHECK_ARG(false, what, ": not an int4 layer");
  }
  return src;
}

}  // namespace lmkit
