// Linear layers on the CPU: the packed weight formats (one entry each in the traits table below: bytes,
// packing, kernel, availability), their packing from checkpoint tensors, and the one ops::linear entry
// point, which checks its inputs and hands them to the weight's format. The kernels themselves are in the
// ISA tables (impl_linear.h, impl_linear_bf16.h); dispatch.cpp picks those tables for this CPU.
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "core/check.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/ops.h"

namespace lmkit::ops {
namespace {

// Bytes of one int8 panel block (ops.h's layouts; int4 groups: ops::linear_int4_group_bytes), for the packers
// and the traits table alike: a block of 32 (fp16 scales, or fp32 scales and offsets; then one byte per value) or
// 16 (fp32 scales).
constexpr int64_t kInt8Block = 32;
constexpr int64_t kInt8BlockBytes = kLinearPanelCols * 2 + kInt8Block * kLinearPanelCols;
constexpr int64_t kInt8FineBytes = kLinearPanelCols * 4 + 16 * kLinearPanelCols;  // a block of 16, fp32 scales
constexpr int64_t kInt8OffsetBytes = kLinearPanelCols * 8 + kInt8Block * kLinearPanelCols;  // fp32 scales, offsets
int64_t int8_block_bytes(int64_t g, GroupHead head) {
  return head == GroupHead::Offsets ? kInt8OffsetBytes : g == 16 ? kInt8FineBytes : kInt8BlockBytes;
}
#include "kernels/cpu/parallel.h"
std::shared_ptr<void> alloc_packed(int64_t bytes, const char* what) {
  bytes = (bytes + 63) / 64 * 64;
  void* buf = std::aligned_alloc(64, (size_t)bytes);
  LMKIT_CHECK(buf != nullptr, "out of memory packing ", what, " (", bytes, " bytes)");
  return std::shared_ptr<void>(buf, std::free);
}

// Panels are independent: fn(p0, p1) over contiguous ranges of them on plain threads, which end with the
// load. (Not a kernel team: one created on the loading thread would keep its workers alive beside the
// engine thread's team.)
template <typename Fn>
void for_panel_ranges(int64_t num_panels, Fn&& fn) {
  const int64_t num_threads =
      std::max<int64_t>(1, std::min<int64_t>({(int64_t)std::thread::hardware_concurrency(), num_panels / 8, 16}));
  std::vector<std::exception_ptr> errors(num_threads);  // a reader's or a check's error reaches the caller
  auto run = [&](int64_t t) {
    try {
      fn(num_panels * t / num_threads, num_panels * (t + 1) / num_threads);
    } catch (...) {
      errors[t] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  for (int64_t t = 1; t < num_threads; ++t) threads.emplace_back(run, t);
  run(0);
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

template <typename E>
void pack_panels(const E* w, int64_t N, int64_t K, E* dst) {
  constexpr int64_t P = kLinearPanelCols, KB = 16;  // 32 x 16 blocks: rows read in runs, panel rows written whole
  const int64_t num_panels = (N + P - 1) / P;
  auto pack_range = [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      E* panel = dst + p * K * P;
      for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t k1 = std::min(K, k0 + KB);
        for (int64_t j = 0; j < P; ++j) {
          const int64_t n = p * P + j;
          const E* row = w + n * K;
          for (int64_t k = k0; k < k1; ++k) panel[k * P + j] = n < N ? row[k] : E{};
        }
      }
    }
  };
  for_panel_ranges(num_panels, pack_range);
}
}  // namespace

LinearWeight pack_linear(const Tensor& weight) {
  cpu::check_weight(weight, "pack_linear", "weight");
  LMKIT_CHECK(weight.ndim == 2, "pack_linear: weight must be [N, K], got ndim ", weight.ndim);
  LinearWeight packed;
  packed.dtype = weight.dtype;
  packed.n = weight.shape[0];
  packed.k = weight.shape[1];
  LMKIT_CHECK(packed.n > 0 && packed.k > 0, "pack_linear: bad shape [", packed.n, ", ", packed.k, "]");
  packed.storage = alloc_packed(packed.size_bytes(), "a linear weight");
  void* buf = packed.storage.get();
  if (weight.dtype == DType::F32)
    pack_panels(weight.ptr<const uint32_t>(), packed.n, packed.k, static_cast<uint32_t*>(buf));
  else
    pack_panels(weight.ptr<const uint16_t>(), packed.n, packed.k, static_cast<uint16_t*>(buf));
  return packed;
}

namespace {
// dst[r, j] = x[r, perm[j]]: the inputs in the order of a weight's input_perm (int4 act-order checkpoints)
void gather_inputs(const float* x, int64_t M, const std::vector<int32_t>& perm, std::vector<float>& dst) {
  const int64_t K = (int64_t)perm.size();
  dst.resize(M * K);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t j = 0; j < K; ++j) dst[r * K + j] = x[r * K + perm[j]];
}
}  // namespace

LinearWeight pack_linear_int4(const Int4Source& source) {
  const int64_t N = source.num_out, K = source.num_in, g = source.group_size;
  LMKIT_CHECK_ARG(g == 32 || g == 64 || g == 128 || (g == 16 && source.has_nvfp4()),
                  "int4: group_size must be 32, 64 or 128 (16 for NVFP4), got ", g);
  LMKIT_CHECK_ARG(N > 0 && K > 0 && K % g == 0, "int4: in_features ", K, " is not a multiple of group_size ", g);
  LMKIT_CHECK_ARG(source.read_group != nullptr, "int4: the source has no reader");
  LMKIT_CHECK_ARG(!source.input_perm || (int64_t)source.input_perm->size() == K, "int4: input_perm has ",
                  source.input_perm ? source.input_perm->size() : 0, " entries for ", K, " inputs");
  LMKIT_CHECK_ARG(!source.has_kquant() || (g == kLinearKQuantSub && K % kLinearKQuantGroup == 0),
                  "int4: K-quant groups are sub-blocks of 32 inputs in super-blocks of 256, got group_size ", g,
                  " and ", K, " inputs");
  LMKIT_CHECK_ARG(!source.has_e8m0() || (g == 32 && !source.has_offsets() && !source.has_kquant() && !source.symmetric),
                  "int4: MXFP4 groups are 32 inputs with an e8m0 scale alone, got group_size ", g);
  LMKIT_CHECK_ARG(!source.has_nvfp4() || (g == 16 && K % 32 == 0 && std::isfinite(source.nvfp4_global_scale) &&
                                           source.nvfp4_global_scale > 0.0f && !source.has_e8m0() &&
                                           !source.has_offsets() && !source.has_kquant() && !source.symmetric),
                  "int4: NVFP4 groups are 16 inputs (in rows of a multiple of 32) with a scale alone and a positive "
                  "global scale, got group_size ", g, ", ", K, " inputs, global scale ", source.nvfp4_global_scale);
  LinearWeight packed;
  packed.format = WeightFormat::Int4;
  packed.dtype = DType::F16;
  // a packed group: one head (a K-quant super-block; two NVFP4 blocks)
  packed.group_size = (int32_t)(source.has_kquant() ? kLinearKQuantGroup : source.has_nvfp4() ? 2 * g : g);
  packed.n = N;
  packed.k = K;
  packed.input_perm = source.input_perm;
  LMKIT_CHECK_ARG(!(source.has_offsets() && source.has_kquant()),
                  "int4: a source has offsets or K-quant groups, not both");
  LMKIT_CHECK_ARG(!source.symmetric || !(source.has_offsets() || source.has_kquant()),
                  "int4: a symmetric source has neither offsets nor K-quant groups");
  packed.group_head = source.has_kquant()    ? GroupHead::KQuant
                     : source.has_e8m0()    ? GroupHead::Mxfp4
                     : source.has_nvfp4()   ? GroupHead::Nvfp4
                     : source.has_offsets() ? GroupHead::Offsets
                     : source.symmetric     ? GroupHead::Symmetric
                                            : GroupHead::Zeros;
  if (source.has_nvfp4()) packed.output_scale = 0.5f / source.nvfp4_global_scale;  // e2m1x2 is twice e2m1
  packed.storage = alloc_packed(packed.size_bytes(), "an int4 weight");
  constexpr int64_t P = kLinearPanelCols;
  const int64_t head = linear_int4_head_bytes(packed.group_head), pg = packed.group_size;
  const int64_t group_bytes = linear_int4_group_bytes(pg, packed.group_head), num_panels = (N + P - 1) / P;
  uint8_t* dst = static_cast<uint8_t*>(packed.storage.get());
  auto pack_range = [&](int64_t p0, int64_t p1) {
    std::vector<uint8_t> q(pg * P), zeros(P), sc(P), m(P), e8m0(P);
    std::vector<uint16_t> scales(P), offsets(P), dmin(P), d0(P), dmin0(P);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t count = std::min(P, N - p * P);  // columns past count: zero heads (q is not read)
      for (auto* v : {&zeros, &sc, &m}) std::fill(v->begin(), v->end(), 0);
      for (auto* v : {&scales, &offsets, &dmin}) std::fill(v->begin(), v->end(), 0);
      for (int64_t gi = 0; gi < K / pg; ++gi) {
        uint8_t* blk = dst + (p * (K / pg) + gi) * group_bytes;
        if (packed.group_head == GroupHead::KQuant) {  // d | dmin | sc [8] | m [8], from the 8 source groups
          for (int64_t sb = 0; sb < pg / g; ++sb) {
            const int64_t si = gi * (pg / g) + sb;
            source.read_group(si, p * P, count, q.data() + sb * g * count, zeros.data(), scales.data());
            source.read_kquant(si, p * P, count, scales.data(), dmin.data(), sc.data(), m.data());
            if (sb == 0) d0 = scales, dmin0 = dmin;
            LMKIT_CHECK_ARG(scales == d0 && dmin == dmin0, "int4: K-quant sub-block ", si, " of panel ", p,
                            " has a d or dmin of its own: a super-block shares one");
            std::memcpy(blk + (4 + sb) * P, sc.data(), P);
            std::memcpy(blk + (12 + sb) * P, m.data(), P);
          }
          std::memcpy(blk + 2 * P, dmin.data(), 2 * P);
        } else if (packed.group_head == GroupHead::Mxfp4) {  // f = e - 1, the fp32 exponent field of 2^(e - 128)
          source.read_group(gi, p * P, count, q.data(), zeros.data(), scales.data());
          source.read_e8m0(gi, p * P, count, e8m0.data());
          for (int64_t c = 0; c < P; ++c) blk[c] = c < count && e8m0[c] > 1 ? (uint8_t)(e8m0[c] - 1) : 0;
        } else if (packed.group_head == GroupHead::Nvfp4) {  // s [2]: the two source blocks' scales
          for (int64_t sb = 0; sb < 2; ++sb) {
            source.read_group(2 * gi + sb, p * P, count, q.data() + sb * g * count, zeros.data(), scales.data());
            std::memcpy(blk + sb * 2 * P, scales.data(), 2 * P);
          }
        } else if (packed.group_head == GroupHead::Offsets) {
          source.read_group(gi, p * P, count, q.data(), zeros.data(), scales.data());
          source.read_offsets(gi, p * P, count, offsets.data());
          std::memcpy(blk + 2 * P, offsets.data(), 2 * P);
        } else {
          source.read_group(gi, p * P, count, q.data(), zeros.data(), scales.data());
          if (packed.group_head == GroupHead::Zeros) std::memcpy(blk + 2 * P, zeros.data(), P);
          else  // Symmetric: no zeros stored, each one checked
            for (int64_t c = 0; c < count; ++c)
              LMKIT_CHECK_ARG(zeros[c] == 8, "int4: a symmetric source has zero ", (int)zeros[c], " in group ", gi,
                              ", output ", p * P + c, " (every zero must be 8)");
        }
        if (packed.group_head != GroupHead::Mxfp4 && packed.group_head != GroupHead::Nvfp4)
          std::memcpy(blk, scales.data(), 2 * P);
        // quads of 4 k: byte i of 32-bit lane j = q[k0 + i, j] | q[k0 + i, j + 16] << 4
        for (int64_t r = 0; r < pg; ++r)
          for (int64_t j = 0; j < P / 2; ++j) {
            const uint8_t lo = j < count ? q[r * count + j] : 0, hi = j + P / 2 < count ? q[r * count + j + P / 2] : 0;
            blk[head + (r / 4) * 64 + 4 * j + r % 4] = (uint8_t)((lo & 15u) | (hi & 15u) << 4);
          }
      }
    }
  };
  for_panel_ranges(num_panels, pack_range);
  return packed;
}

LinearWeight pack_linear_bf16(const Tensor& weight) {
  cpu::check_weight(weight, "pack_linear_bf16", "weight");
  LMKIT_CHECK(weight.ndim == 2 && weight.shape[0] > 0 && weight.shape[1] > 0,
              "pack_linear_bf16: weight must be [N, K], got ", shape_str(weight));
  require_bf16_dot();
  LinearWeight packed;
  packed.format = WeightFormat::Bf16Pairs;
  packed.dtype = DType::BF16;
  packed.n = weight.shape[0];
  packed.k = weight.shape[1];
  packed.storage = alloc_packed(packed.size_bytes(), "a bf16 weight");
  constexpr int64_t P = kLinearPanelCols;
  const int64_t N = packed.n, K = packed.k, R = (K + 1) / 2, num_panels = (N + P - 1) / P;
  uint32_t* dst = static_cast<uint32_t*>(packed.storage.get());
  auto pack_range = [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < P; ++j) {
        const int64_t n = p * P + j;
        for (int64_t r = 0; r < R; ++r) {
          uint32_t lo = 0, hi = 0;
          if (n < N) {
            lo = f32_to_bf16(float_value(weight, n * K + 2 * r));
            if (2 * r + 1 < K) hi = f32_to_bf16(float_value(weight, n * K + 2 * r + 1));
          }
          dst[(p * R + r) * P + j] = lo | hi << 16;
        }
      }
  };
  for_panel_ranges(num_panels, pack_range);
  return packed;
}

namespace {
bool same_perm(const std::shared_ptr<const std::vector<int32_t>>& a,
               const std::shared_ptr<const std::vector<int32_t>>& b) {
  return a == b || (a && b && *a == *b);
}
}  // namespace

LinearWeight concat_linear(const std::vector<const LinearWeight*>& parts) {
  if (parts.size() < 2) return {};
  const LinearWeight& first = *parts.front();
  LinearWeight fused = first;
  fused.n = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const LinearWeight& w = *parts[i];
    LMKIT_CHECK(!w.is_empty(), "concat_linear: part ", i, " is empty");
    const bool same = w.format == first.format && w.k == first.k && w.dtype == first.dtype &&
                      w.group_size == first.group_size && w.int8_activations == first.int8_activations &&
                      w.group_head == first.group_head && w.output_scale == first.output_scale &&
                      same_perm(w.input_perm, first.input_perm);
    if (!same || (i + 1 < parts.size() && w.n % kLinearPanelCols != 0)) return {};
    fused.n += w.n;
  }
  fused.storage = alloc_packed(fused.size_bytes(), "a fused linear weight");
  char* dst = static_cast<char*>(fused.storage.get());
  for (const LinearWeight* w : parts) {
    std::memcpy(dst, w->storage.get(), (size_t)w->size_bytes());
    dst += w->size_bytes();
  }
  return fused;
}

// One block for all of a model's weights, 2 MiB-aligned, which the kernel is asked to back with huge pages
// (MADV_HUGEPAGE; Linux's default THP mode "madvise" honours it, elsewhere it is advice that does nothing).
// Decode streams every weight once per token: with 4 KiB pages the stream crosses a page, a TLB miss and a
// stop of the L2 hardware prefetcher (which stays within a page), every 4 KiB.
void gather_weights(const std::vector<LinearWeight*>& weights) {
  constexpr int64_t kAlign = 64, kHugePage = 2 << 20;
  auto padded = [](int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; };
  int64_t total = 0;
  for (const LinearWeight* w : weights)
    if (!w->is_empty()) total += padded(w->size_bytes());
  if (total == 0) return;
  void* buf = nullptr;
  LMKIT_CHECK(::posix_memalign(&buf, (size_t)kHugePage, (size_t)total) == 0 && buf != nullptr,
              "out of memory gathering the packed weights (", total, " bytes)");
#ifdef MADV_HUGEPAGE
  ::madvise(buf, (size_t)total, MADV_HUGEPAGE);
#endif
  const std::shared_ptr<char> block(static_cast<char*>(buf), std::free);
  int64_t offset = 0;
  for (LinearWeight* w : weights) {
    if (w->is_empty()) continue;
    const int64_t bytes = w->size_bytes();
    std::memcpy(block.get() + offset, w->storage.get(), (size_t)bytes);
    w->storage = std::shared_ptr<void>(block, block.get() + offset);  // frees the old copy (its last owner)
    offset += padded(bytes);
  }
}

namespace {
// A Q6_K-style source (blocks of 16 whose scales are a super-block's d times their own int8 sc, values -32..31)
// into int6 panels: the values, d and sc as they are (ops.h's Int6 layout).
LinearWeight pack_linear_int6(const Int8Source& source) {
  const int64_t N = source.num_out, K = source.num_in;
  LinearWeight packed;
  packed.format = WeightFormat::Int6;
  packed.dtype = DType::F16;
  packed.group_size = (int32_t)kLinearInt6Group;
  packed.n = N;
  packed.k = K;
  packed.storage = alloc_packed(packed.size_bytes(), "an int6 weight");
  constexpr int64_t P = kLinearPanelCols, S = kLinearInt6Group / kLinearInt6Sub;
  const int64_t ng = K / kLinearInt6Group, num_panels = (N + P - 1) / P;
  uint8_t* dst = static_cast<uint8_t*>(packed.storage.get());
  auto pack_range = [&](int64_t p0, int64_t p1) {
    std::vector<int8_t> q(kLinearInt6Group * P), sc(P);
    std::vector<float> scales(P);
    std::vector<uint16_t> d(P), d0(P);
    std::vector<uint8_t> u(kLinearInt6Group * P);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t count = std::min(P, N - p * P);  // columns past count: d 0, sc 0, u 32
      for (int64_t gi = 0; gi < ng; ++gi) {
        uint8_t* blk = dst + (p * ng + gi) * kLinearInt6GroupBytes;
        std::fill(d.begin(), d.end(), 0);
        std::fill(u.begin(), u.end(), 32);
        for (int64_t b = 0; b < S; ++b) {
          const int64_t bi = gi * S + b;
          std::fill(sc.begin(), sc.end(), 0);
          source.read_block16(bi, p * P, count, q.data(), scales.data());
          source.read_block16_kquant(bi, p * P, count, d.data(), sc.data());
          if (b == 0) d0 = d;
          LMKIT_CHECK_ARG(d == d0, "int6: block ", bi, " of panel ", p, " has a d of its own: a super-block shares one");
          for (int64_t c = 0; c < count; ++c) {
            LMKIT_CHECK_ARG(scales[c] == f16_to_f32(d[c]) * (float)sc[c], "int6: block ", bi, " of output ", p * P + c,
                            " has scale ", scales[c], ", not its d * sc");
            for (int64_t r = 0; r < kLinearInt6Sub; ++r) {
              const int v = q[r * count + c];
              LMKIT_CHECK_ARG(v >= -32 && v < 32, "int6: value ", v, " of block ", bi, " is outside -32..31");
              u[(b * kLinearInt6Sub + r) * P + c] = (uint8_t)(v + 32);
            }
          }
          std::memcpy(blk + (2 + b) * P, sc.data(), P);
        }
        std::memcpy(blk, d.data(), 2 * P);
        // octet o = r / 8, quad A or B = (r % 8) / 4, byte i = r % 4 of lane j (< 16): nibbles of columns j, j + 16
        for (int64_t r = 0; r < kLinearInt6Group; ++r) {
          uint8_t* oct = blk + kLinearInt6HeadBytes + (r / 8) * kLinearInt6OctetBytes;
          const int64_t quad = (r % 8) / 4, i = r % 4;
          for (int64_t j = 0; j < P / 2; ++j) {
            const uint8_t lo = u[r * P + j], hi = u[r * P + j + P / 2];
            oct[quad * 64 + 4 * j + i] = (uint8_t)((lo & 15u) | (hi & 15u) << 4);
            uint8_t& plane = oct[128 + 4 * j + i];
            if (quad == 0) plane = 0;
            plane |= (uint8_t)(((lo >> 4) | (hi >> 4) << 2) << (4 * quad));
          }
        }
      }
    }
  };
  for_panel_ranges(num_panels, pack_range);
  return packed;
}
}  // namespace

LinearWeight pack_linear_int8(const Int8Source& source) {
  const int64_t N = source.num_out, K = source.num_in;
  if (source.read_block16 != nullptr && source.read_block16_kquant != nullptr && N > 0 && K > 0 &&
      K % kLinearInt6Group == 0)
    return pack_linear_int6(source);
  LMKIT_CHECK_ARG(N > 0 && K > 0 && K % 32 == 0, "int8: weight must be [N, K] with K a multiple of 32, got [", N,
                  ", ", K, "]");
  const bool fine = source.read_block16 != nullptr, offsets = source.read_block_offsets != nullptr;
  LMKIT_CHECK_ARG((int)fine + (int)offsets + (int)(source.read_block != nullptr) == 1,
                  "int8: the source needs exactly one reader");
  LinearWeight packed;
  packed.format = WeightFormat::Int8;
  packed.dtype = fine || offsets ? DType::F32 : DType::F16;
  packed.group_size = fine ? 16 : 32;
  packed.group_head = offsets ? GroupHead::Offsets : GroupHead::Zeros;
  packed.n = N;
  packed.k = K;
  packed.storage = alloc_packed(packed.size_bytes(), "an int8 weight");
  constexpr int64_t P = kLinearPanelCols;
  const int64_t B = packed.group_size, block_bytes = int8_block_bytes(B, packed.group_head);
  const int64_t head = offsets ? 8 * P : fine ? 4 * P : 2 * P;
  const int64_t nb = K / B, num_panels = (N + P - 1) / P;
  uint8_t* dst = static_cast<uint8_t*>(packed.storage.get());
  auto pack_range = [&](int64_t p0, int64_t p1) {
    std::vector<int8_t> q(B * P);
    std::vector<uint16_t> scales(P);
    std::vector<float> scales32(P), offsets32(P);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t count = std::min(P, N - p * P);  // columns past count: scale 0 (offset 0), u8 128
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* blk = dst + (p * nb + b) * block_bytes;
        if (offsets) {
          std::fill(scales32.begin(), scales32.end(), 0.0f);
          std::fill(offsets32.begin(), offsets32.end(), 0.0f);
          source.read_block_offsets(b, p * P, count, q.data(), scales32.data(), offsets32.data());
          std::memcpy(blk, scales32.data(), 4 * P);
          std::memcpy(blk + 4 * P, offsets32.data(), 4 * P);
        } else if (fine) {
          std::fill(scales32.begin(), scales32.end(), 0.0f);
          source.read_block16(b, p * P, count, q.data(), scales32.data());
          std::memcpy(blk, scales32.data(), 4 * P);
        } else {
          std::fill(scales.begin(), scales.end(), 0);
          source.read_block(b, p * P, count, q.data(), scales.data());
          std::memcpy(blk, scales.data(), 2 * P);
        }
        for (int64_t j = 0; j < P; ++j)
          for (int64_t i = 0; i < B; ++i)  // quad t = i / 4, half h = j / 16: byte i % 4 of lane j % 16
            blk[head + (i / 4) * 128 + (j / 16) * 64 + (j % 16) * 4 + i % 4] =
                (uint8_t)((j < count ? (int)q[i * count + j] : 0) + 128);
      }
    }
  };
  for_panel_ranges(num_panels, pack_range);
  return packed;
}

LinearWeight pack_linear_int8(const Tensor& weight) {
  cpu::check_weight(weight, "pack_linear_int8", "weight");
  LMKIT_CHECK(weight.ndim == 2 && weight.shape[1] % 32 == 0 && weight.shape[0] > 0,
              "pack_linear_int8: weight must be [N, K] with K a multiple of 32, got ", shape_str(weight));
  // quantized per 32 values as llama.cpp's Q8_0: d = fp16(max |w| / 127), q = round(w / d) (half to even)
  Int8Source source;
  source.num_out = weight.shape[0];
  source.num_in = weight.shape[1];
  const int64_t K = source.num_in;
  source.read_block = [&weight, K](int64_t b, int64_t n0, int64_t count, int8_t* q, uint16_t* scales) {
    for (int64_t c = 0; c < count; ++c) {
      float w[32], amax = 0.0f;
      for (int64_t i = 0; i < 32; ++i) {
        w[i] = float_value(weight, (n0 + c) * K + b * 32 + i);
        amax = std::max(amax, std::fabs(w[i]));
      }
      scales[c] = f32_to_f16(amax / 127.0f);
      const float d = f16_to_f32(scales[c]);
      for (int64_t i = 0; i < 32; ++i)
        q[i * count + c] = (int8_t)(d == 0.0f ? 0.0f : std::clamp(std::nearbyint(w[i] / d), -127.0f, 127.0f));
    }
  };
  return pack_linear_int8(source);
}

void linear(const float* x, int64_t M, const LinearWeight& weight, const Tensor& bias, float* out) {
  LMKIT_CHECK(!weight.is_empty(), "linear: weight is empty (not packed with pack_linear)");
  const int64_t N = weight.n, K = weight.k;
  LMKIT_CHECK(M >= 0, "linear: bad shape M ", M, " N ", N, " K ", K);
  if (M == 0) return;
  LMKIT_CHECK(x != nullptr && out != nullptr, "linear: x and out must be non-null");
  LMKIT_CHECK(out + M * N <= x || x + M * K <= out, "linear: out must not overlap x");
  const float* b = nullptr;
  thread_local std::vector<float> bias_f32;
  if (!bias.is_empty()) {
    cpu::check_weight(bias, "linear", "bias");
    LMKIT_CHECK(bias.numel() == N, "linear: bias must have N = ", N, " values, got ", bias.numel());
    if (bias.dtype == DType::F32) {
      b = bias.ptr<float>();
    } else {
      bias_f32.resize(N);
      const uint16_t* h = bias.ptr<uint16_t>();
      for (int64_t n = 0; n < N; ++n) bias_f32[n] = bias.dtype == DType::F16 ? f16_to_f32(h[n]) : bf16_to_f32(h[n]);
      b = bias_f32.data();
    }
  }
  const WeightFormatTraits& traits = weight.traits();
  const char* missing = traits.unavailable();
  LMKIT_CHECK(missing == nullptr, "linear: ", traits.name, " weights ", missing);
  if (weight.input_perm) {
    thread_local std::vector<float> gathered;
    gather_inputs(x, M, *weight.input_perm, gathered);
    x = gathered.data();
  }
  traits.run(x, M, weight, b, out);
}

void linear(const float* x, int64_t M, const Tensor& weight, const Tensor& bias, float* out) {
  linear(x, M, pack_linear(weight), bias, out);
}

namespace {
int64_t num_panels(const LinearWeight& w) { return (w.n + kLinearPanelCols - 1) / kLinearPanelCols; }
}  // namespace

void linear_group(const LinearJob* jobs, int64_t num_jobs) {
  // A panel of job j costs M_j + kReadRows: its rows' arithmetic plus reading the panel (worth a few rows in
  // decode, where reading dominates). A chunk [lo, hi) of the total cost C takes the panels whose cost
  // interval starts in it: contiguous panel ranges of one or more jobs.
  constexpr int64_t kReadRows = 4;
  std::vector<int64_t> base(num_jobs + 1, 0);
  for (int64_t j = 0; j < num_jobs; ++j) {
    const LinearJob& job = jobs[j];
    LMKIT_CHECK(job.w != nullptr && !job.w->is_empty(), "linear_group: job ", j, " has no packed weight");
    LMKIT_CHECK(job.M >= 0, "linear_group: job ", j, " has M ", job.M);
    const LinearWeight& w = *job.w;
    if (job.M > 0) {
      LMKIT_CHECK(job.x != nullptr && job.out != nullptr, "linear_group: job ", j, ": x and out must be non-null");
      LMKIT_CHECK(job.out + job.M * w.n <= job.x || job.x + job.M * w.k <= job.out,
                  "linear_group: job ", j, ": out must not overlap x");
      const char* missing = w.traits().unavailable();
      LMKIT_CHECK(missing == nullptr, "linear_group: ", w.traits().name, " weights ", missing);
      LMKIT_CHECK(w.size_bytes() % num_panels(w) == 0, "linear_group: ", w.traits().name, " panels are not uniform");
    }
    base[j + 1] = base[j] + (job.M > 0 ? num_panels(w) * (job.M + kReadRows) : 0);
  }
  const int64_t total = base[num_jobs];
  if (total == 0) return;
  auto ceil_div = [](int64_t a, int64_t b) { return a <= 0 ? 0 : (a + b - 1) / b; };
  // chunks of the cost range over the thread team: a late thread delays only the chunk it holds
  // jobs whose weight takes its inputs permuted (act-order int4) read a gathered copy
  std::vector<std::vector<float>> gathered(num_jobs);
  std::vector<const float*> xs(num_jobs);
  for (int64_t j = 0; j < num_jobs; ++j) {
    xs[j] = jobs[j].x;
    if (jobs[j].M > 0 && jobs[j].w->input_perm) {
      gather_inputs(jobs[j].x, jobs[j].M, *jobs[j].w->input_perm, gathered[j]);
      xs[j] = gathered[j].data();
    }
  }
  parallel_for(total, grain_for(total), total >= 2 * (1 + kReadRows), [&](int64_t lo, int64_t hi) {
    thread_local std::vector<float> scratch;
    for (int64_t j = 0; j < num_jobs; ++j) {
      if (base[j + 1] <= lo || base[j] >= hi) continue;
      const LinearJob& job = jobs[j];
      const LinearWeight& w = *job.w;
      const int64_t P = num_panels(w), cost = job.M + kReadRows;
      const int64_t p0 = std::min(P, ceil_div(lo - base[j], cost)), p1 = std::min(P, ceil_div(hi - base[j], cost));
      if (p0 >= p1) continue;
      LinearWeight part = w;  // panels [p0, p1): columns [p0 * 32, min(n, p1 * 32))
      part.n = std::min(w.n, p1 * kLinearPanelCols) - p0 * kLinearPanelCols;
      part.storage = std::shared_ptr<void>(w.storage, static_cast<char*>(w.storage.get()) + p0 * (w.size_bytes() / P));
      float* out = job.out + p0 * kLinearPanelCols;
      if (job.M == 1 || part.n == w.n) {  // the part's rows are the output's rows
        w.traits().run(xs[j], job.M, part, nullptr, out);
        continue;
      }
      scratch.resize(job.M * part.n);
      w.traits().run(xs[j], job.M, part, nullptr, scratch.data());
      for (int64_t r = 0; r < job.M; ++r)
        std::memcpy(out + r * w.n, scratch.data() + r * part.n, part.n * sizeof(float));
    }
  });
}

namespace {

const char* needs_bf16_dot() {
  return bf16_dot_available() ? nullptr : "need a CPU with AVX-512 and AVX512_BF16";
}

void run_dense(const float* x, int64_t M, const LinearWeight& w, const float* b, float* out) {
  cpu::active().linear(x, M, w.storage.get(), w.dtype, w.n, w.k, b, out);
}
void run_int4(const float* x, int64_t M, const LinearWeight& w, const float* b, float* out) {
  if (w.output_scale != 1.0f) {  // NVFP4's global scale: once per output, then the bias
    LinearWeight unscaled = w;
    unscaled.output_scale = 1.0f;
    run_int4(x, M, unscaled, nullptr, out);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t n = 0; n < w.n; ++n) out[r * w.n + n] = out[r * w.n + n] * w.output_scale + (b ? b[n] : 0.0f);
    return;
  }
  const bool amx_fits = w.int8_activations && M >= kLinearAmxInt8MinRows &&
                        (w.group_head == GroupHead::Zeros || w.group_head == GroupHead::Symmetric);
  const cpu::KernelTable* amx = amx_fits ? cpu::amx_int8_table_in_use() : nullptr;
  const cpu::KernelTable* q8 = w.int8_activations ? cpu::q8_table() : nullptr;
  if (amx != nullptr)
    amx->linear_int4_amx(x, M, w.storage.get(), w.n, w.k, w.group_size, w.group_head, b, out);
  else if (q8 != nullptr)
    q8->linear_int4_q8(x, M, w.storage.get(), w.n, w.k, w.group_size, w.group_head, b, out);
  else
    cpu::active().linear_int4(x, M, w.storage.get(), w.n, w.k, w.group_size, w.group_head, b, out);
}
void run_int8(const float* x, int64_t M, const LinearWeight& w, const float* b, float* out) {
  const cpu::KernelTable* q8 = w.int8_activations ? cpu::q8_table() : nullptr;
  if (q8 != nullptr)
    q8->linear_int8_q8(x, M, w.storage.get(), w.n, w.k, w.group_size, w.group_head, b, out);
  else
    cpu::active().linear_int8(x, M, w.storage.get(), w.n, w.k, w.group_size, w.group_head, b, out);
}
void run_int6(const float* x, int64_t M, const LinearWeight& w, const float* b, float* out) {
  const cpu::KernelTable* q8 = w.int8_activations ? cpu::q8_table() : nullptr;
  if (q8 != nullptr)
    q8->linear_int6_q8(x, M, w.storage.get(), w.n, w.k, b, out);
  else
    cpu::active().linear_int6(x, M, w.storage.get(), w.n, w.k, b, out);
}
void run_bf16_pairs(const float* x, int64_t M, const LinearWeight& w, const float* b, float* out) {
  const cpu::KernelTable* amx = cpu::amx_table_in_use();  // every call: one summation order for every row count
  if (amx != nullptr)
    amx->linear_bf16_amx(x, M, w.storage.get(), w.n, w.k, b, out);
  else
    cpu::bf16_table()->linear_bf16(x, M, w.storage.get(), w.n, w.k, b, out);
}

// The traits table, indexed by WeightFormat.
const WeightFormatTraits kWeightFormats[] = {
    {WeightFormat::Dense, "dense",
     [](const LinearWeight& w) { return num_panels(w) * kLinearPanelCols * w.k * dtype_size_bytes(w.dtype); },
     pack_linear, [] { return (const char*)nullptr; }, run_dense},
    {WeightFormat::Int4, "int4",
     [](const LinearWeight& w) {
       return num_panels(w) * (w.k / w.group_size) * linear_int4_group_bytes(w.group_size, w.group_head);
     },
     nullptr, [] { return (const char*)nullptr; }, run_int4},
    {WeightFormat::Int8, "int8",
     [](const LinearWeight& w) {
       return num_panels(w) * (w.k / w.group_size) * int8_block_bytes(w.group_size, w.group_head);
     },
     [](const Tensor& w) { return pack_linear_int8(w); }, [] { return (const char*)nullptr; }, run_int8},
    {WeightFormat::Bf16Pairs, "bf16_pairs",
     [](const LinearWeight& w) { return num_panels(w) * ((w.k + 1) / 2) * kLinearPanelCols * 4; },
     pack_linear_bf16, needs_bf16_dot, run_bf16_pairs},
    {WeightFormat::Int6, "int6",
     [](const LinearWeight& w) { return num_panels(w) * (w.k / kLinearInt6Group) * kLinearInt6GroupBytes; }, nullptr,
     [] { return (const char*)nullptr; }, run_int6},
};
}  // namespace

const WeightFormatTraits& weight_format_traits(WeightFormat format) {
  const auto i = static_cast<size_t>(format);
  LMKIT_CHECK(i < std::size(kWeightFormats) && kWeightFormats[i].format == format, "unknown weight format ", i);
  return kWeightFormats[i];
}

}  // namespace lmkit::ops
