#include "model/weights.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "model/mxfp4.h"

namespace lmkit {

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  LMKIT_CHECK_ARG(fd >= 0, "cannot open weight file ", path, ": ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    LMKIT_CHECK_ARG(false, "cannot stat weight file ", path, ": ", std::strerror(errno));
  }
  size_ = st.st_size;
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    LMKIT_CHECK_ARG(p != MAP_FAILED, "cannot map weight file ", path, ": ", std::strerror(errno));
    data_ = static_cast<uint8_t*>(p);
  } else {
    ::close(fd);
  }
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(data_, size_);
}

namespace {

bool is_float(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; }

}  // namespace

Int8Source int8_channel_source(const Tensor& weight, const Tensor& scales, const std::string& what) {
  LMKIT_CHECK_ARG(weight.dtype == DType::I8 && weight.ndim == 2, what, ": an int8 weight must be [N, K] int8");
  const int64_t N = weight.shape[0], K = weight.shape[1];
  LMKIT_CHECK_ARG(K % 32 == 0, what, ": int8 weights need a multiple of 32 inputs, got ", K);
  LMKIT_CHECK_ARG(is_float(scales.dtype), what, ": weight_scale must be F32, F16 or BF16, got ",
                  dtype_name(scales.dtype));
  // [N, 1] or [N] per channel, [N, G] per group of K / G inputs
  const int64_t G = scales.ndim == 1 ? 1 : scales.shape[1];
  LMKIT_CHECK_ARG(scales.shape[0] == N && (scales.ndim == 1 || scales.ndim == 2) && G > 0 && K % G == 0 &&
                      (K / G) % 16 == 0,
                  what, ": weight_scale has shape ", shape_str(scales), "; [", N, ", 1] (per channel) or [", N,
                  ", G] with K / G a multiple of 16 expected (K = ", K, ")");
  const int64_t group = K / G;
  // blocks of 32 with fp16 scales (the int8 kernels' compact form) where every scale is an fp16 value and groups
  // are whole blocks of 32; else blocks of 16 with fp32 scales. Either holds the checkpoint's numbers exactly.
  bool fp16_exact = group % 32 == 0;
  for (int64_t i = 0; i < N * G; ++i) {
    const float v = float_value(scales, i);
    LMKIT_CHECK_ARG(std::isfinite(v), what, ": weight_scale ", i, " is not finite (", v, ")");
    fp16_exact = fp16_exact && f16_to_f32(f32_to_f16(v)) == v;
  }
  Int8Source src;
  src.num_out = N;
  src.num_in = K;
  const int8_t* w = weight.ptr<const int8_t>();
  // block of `len` inputs from `first`, outputs [n0, n0 + count): q[r * count + c], and the block's scale per output
  auto values = [w, K](int64_t first, int64_t len, int64_t n0, int64_t count, int8_t* q) {
    for (int64_t c = 0; c < count; ++c)
      for (int64_t r = 0; r < len; ++r) q[r * count + c] = w[(n0 + c) * K + first + r];
  };
  auto scale = [scales, G, group](int64_t first, int64_t n) { return float_value(scales, n * G + first / group); };
  if (fp16_exact)
    src.read_block = [values, scale](int64_t b, int64_t n0, int64_t count, int8_t* q, uint16_t* s) {
      values(32 * b, 32, n0, count, q);
      for (int64_t c = 0; c < count; ++c) s[c] = f32_to_f16(scale(32 * b, n0 + c));
    };
  else
    src.read_block16 = [values, scale](int64_t b, int64_t n0, int64_t count, int8_t* q, float* s) {
      values(16 * b, 16, n0, count, q);
      for (int64_t c = 0; c < count; ++c) s[c] = scale(16 * b, n0 + c);
    };
  return src;
}

LinearTensors single_tensor_linear(const Tensor& weight, const RowOrder& rows, const std::string& what,
                                   std::vector<std::shared_ptr<void>>* owned) {
  LinearTensors t;
  t.weight = weight;
  if (dtype_is_int8_block(weight.dtype)) {
    t.int8_source = ggml_int8_source(weight, rows, what);
  } else if (dtype_is_block(weight.dtype)) {
    t.int4_source = ggml_int4_source(weight, rows, what);
  } else if (rows) {
    LMKIT_CHECK(owned != nullptr, what, ": reordering a float weight's rows needs somewhere to keep the copy");
    owned->emplace_back();
    t.weight = reorder_rows(weight, rows, owned->back());
  }
  return t;
}

namespace {

// The rows `rows` (output n of the result is stored row rows[n]) of an int4 weight, read one stored row at a time.
Int4Source int4_rows(const Int4Source& source, const RowOrder& rows) {
  auto base = std::make_shared<Int4Source>(source);
  Int4Source out = source;
  out.num_out = (int64_t)rows->size();
  const int64_t G = source.group_size;
  out.read_group = [base, rows, G](int64_t g, int64_t n0, int64_t count, uint8_t* q, uint8_t* zeros,
                                   uint16_t* scales) {
    std::vector<uint8_t> row_q(G);
    for (int64_t c = 0; c < count; ++c) {
      base->read_group(g, (*rows)[n0 + c], 1, row_q.data(), zeros + c, scales + c);
      for (int64_t r = 0; r < G; ++r) q[r * count + c] = row_q[r];
    }
  };
  if (source.read_offsets)
    out.read_offsets = [base, rows](int64_t g, int64_t n0, int64_t count, uint16_t* offsets) {
      for (int64_t c = 0; c < count; ++c) base->read_offsets(g, (*rows)[n0 + c], 1, offsets + c);
    };
  if (source.read_e8m0)
    out.read_e8m0 = [base, rows](int64_t g, int64_t n0, int64_t count, uint8_t* e) {
      for (int64_t c = 0; c < count; ++c) base->read_e8m0(g, (*rows)[n0 + c], 1, e + c);
    };
  if (source.read_kquant)
    out.read_kquant = [base, rows](int64_t g, int64_t n0, int64_t count, uint16_t* d, uint16_t* dmin, uint8_t* sc,
                                   uint8_t* m) {
      for (int64_t c = 0; c < count; ++c) base->read_kquant(g, (*rows)[n0 + c], 1, d + c, dmin + c, sc + c, m + c);
    };
  return out;
}

}  // namespace

ModelWeights ModelWeights::load(const ModelConfig& config, const std::map<std::string, TensorSource>& sources) {
  config.validate();
  ModelWeights w;
  std::map<std::string, std::shared_ptr<MappedFile>> files;

  // want: the one dtype allowed, or F32 to allow any float dtype (and the GGUF block types with blocks_ok)
  auto get = [&](const std::string& role, std::vector<int64_t> shape, bool required = true,
                 DType want = DType::F32, bool blocks_ok = false) -> Tensor {
    auto it = sources.find(role);
    if (it == sources.end()) {
      LMKIT_CHECK_ARG(!required, config.architecture, ": checkpoint has no tensor for '", role, "'");
      return Tensor{};
    }
    const TensorSource& src = it->second;
    if (want == DType::F32 && blocks_ok)
      LMKIT_CHECK_ARG(is_float(src.dtype) || dtype_is_block(src.dtype), config.architecture, ": tensor '", role,
                      "' has dtype ", dtype_name(src.dtype),
                      "; only F32, F16, BF16, Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0 and MXFP4 are supported");
    else if (want == DType::F32)
      LMKIT_CHECK_ARG(is_float(src.dtype), config.architecture, ": tensor '", role, "' has dtype ",
                      dtype_name(src.dtype), "; only F32, F16 and BF16 weights are supported");
    else
      LMKIT_CHECK_ARG(src.dtype == want, config.architecture, ": tensor '", role, "' has dtype ",
                      dtype_name(src.dtype), ", it must be ", dtype_name(want));
    LMKIT_CHECK_ARG(src.shape == shape, config.architecture, ": tensor '", role, "' has shape ", shape_str(src.shape),
                    ", the config implies ", shape_str(shape));
    LMKIT_CHECK_ARG(!dtype_is_block(src.dtype) ||
                        (shape.size() >= 2 && shape.back() % dtype_block_elems(src.dtype) == 0),
                    config.architecture, ": tensor '", role, "' of ", dtype_name(src.dtype), " blocks has shape ",
                    shape_str(shape), ": its rows must be whole blocks");
    auto& file = files[src.path];
    if (!file) file = std::make_shared<MappedFile>(src.path);
    Tensor t;
    t.dtype = src.dtype;
    t.ndim = (int32_t)shape.size();
    for (int i = 0; i < t.ndim; ++i) t.shape[i] = shape[i];
    LMKIT_CHECK_ARG(src.offset >= 0 && src.offset + t.size_bytes() <= file->size_bytes(), "tensor '", role,
                    "' lies beyond the end of ", src.path, " (truncated or corrupt file)");
    t.data = const_cast<uint8_t*>(file->data() + src.offset);
    w.size_bytes += t.size_bytes();
    return t;
  };

  // an int4 tensor: any shape and dtype here, int4_source checks them against the layer
  auto get_stored = [&](const std::string& role) -> Tensor {
    auto it = sources.find(role);
    if (it == sources.end()) return Tensor{};
    const TensorSource& src = it->second;
    LMKIT_CHECK_ARG(!src.shape.empty() && (int)src.shape.size() <= Tensor::kMaxDims, config.architecture,
                    ": tensor '", role, "' has shape ", shape_str(src.shape));
    return get(role, src.shape, true, src.dtype);
  };
  const Int4Layout layout = parse_int4_layout(config.int4_layout);
  auto is_int4 = [&](const std::string& role) {
    return layout != Int4Layout::None && sources.count(role + ".values") > 0;
  };
  // rows: the stored order of the outputs (GGUF llama q/k), or null
  auto get_linear = [&](const std::string& role, int64_t N, int64_t K, const RowOrder& rows = nullptr) -> LinearTensors {
    LinearTensors t;
    const auto stored = sources.find(role);
    if (stored != sources.end() && stored->second.dtype == DType::I8) {  // compressed-tensors int8 + its scales
      LMKIT_CHECK_ARG(!rows, config.architecture, ": ", role, ": interleaved rotary rows in an int8 checkpoint");
      LMKIT_CHECK_ARG(sources.count(role + ".scales") > 0, config.architecture, ": int8 tensor '", role,
                      "' has no scales (weight_scale)");
      const std::string what = config.architecture + ": " + role;
      t.weight = get(role, {N, K}, true, DType::I8);
      t.int8_scales = get_stored(role + ".scales");
      t.int8_source = int8_channel_source(t.weight, t.int8_scales, what);
      return t;
    }
    if (!is_int4(role))
      return single_tensor_linear(get(role, {N, K}, true, DType::F32, true), rows, config.architecture + ": " + role,
                                  &w.owned);
    LMKIT_CHECK_ARG(!rows, config.architecture, ": ", role, ": interleaved rotary rows in an int4 checkpoint layout");
    t.int4.layout = layout;
    t.int4.values = get_stored(role + ".values");
    t.int4.zeros = get_stored(role + ".zeros");
    t.int4.scales = get_stored(role + ".scales");
    t.int4.g_idx = get_stored(role + ".g_idx");
    t.int4.global_scale = get_stored(role + ".global_scale");
    t.int4_source = int4_source(t.int4, N, K, config.int4_group_size, config.architecture + ": " + role);
    return t;
  };

  auto has = [&](const std::string& role) { return sources.count(role) > 0 || is_int4(role); };
  // The linear `role` [N, K] read as several: part j is its stored rows parts[j] in that order (together a
  // permutation of the N rows). A checkpoint int4 layout reads each part's rows as needed; a float weight is
  // reordered once and each part is a slice of the copy.
  auto split_linear = [&](const std::string& role, int64_t N, int64_t K,
                          const std::vector<std::vector<int32_t>>& parts) -> std::vector<LinearTensors> {
    const LinearTensors whole = get_linear(role, N, K);
    std::vector<LinearTensors> out;
    const std::string what = config.architecture + ": " + role;
    if (whole.is_int4() && !dtype_is_block(whole.weight.dtype)) {
      for (const std::vector<int32_t>& rows : parts) {
        out.push_back(whole);
        out.back().int4_source = int4_rows(whole.int4_source, std::make_shared<std::vector<int32_t>>(rows));
      }
      return out;
    }
    if (dtype_is_block(whole.weight.dtype)) {  // GGUF blocks run along a row: each part reads its own rows
      for (const std::vector<int32_t>& rows : parts) {
        out.push_back(single_tensor_linear(whole.weight, std::make_shared<std::vector<int32_t>>(rows), what));
      }
      return out;
    }
    LMKIT_CHECK_ARG(!whole.is_int8(), what, ": splitting a fused projection with int8 weights is not supported yet");
    auto order = std::make_shared<std::vector<int32_t>>();
    for (const std::vector<int32_t>& rows : parts) order->insert(order->end(), rows.begin(), rows.end());
    w.owned.emplace_back();
    const Tensor reordered = reorder_rows(whole.weight, order, w.owned.back());
    int64_t first = 0;
    for (const std::vector<int32_t>& rows : parts) {
      Tensor t = reordered;
      t.shape[0] = (int64_t)rows.size();
      t.data = static_cast<uint8_t*>(reordered.data) + first * K * dtype_size_bytes(reordered.dtype);
      out.push_back(single_tensor_linear(t, nullptr, what));
      first += (int64_t)rows.size();
    }
    return out;
  };
  const int64_t H = config.hidden_size, V = config.vocab_size;
  const bool is_gemma = config.family == "gemma";
  w.embed_tokens = get("embed_tokens", {V, H}, true, DType::F32, true);
  w.final_norm = get("norm", {H});
  w.lm_head = get("lm_head", {V, H}, !config.tie_word_embeddings, DType::F32, true);
  LMKIT_CHECK_ARG(!config.qk_rotary_interleaved || config.layer_head_dim.empty(), config.architecture,
                  ": interleaved rotary rows with per-layer head dims are not supported");
  const RowOrder q_rows =
      config.qk_rotary_interleaved ? ggml_rotary_row_order(config.num_heads, config.head_dim) : nullptr;
  const RowOrder k_rows =
      config.qk_rotary_interleaved ? ggml_rotary_row_order(config.num_kv_heads, config.head_dim) : nullptr;
  if (w.lm_head.is_empty()) w.lm_head = w.embed_tokens;
  const int64_t P = config.per_layer_input_size, LP = (int64_t)config.num_layers * P;
  if (P > 0) {
    w.embed_tokens_per_layer = get("embed_tokens_per_layer", {V, LP}, true, DType::F32, true);
    w.per_layer_model_projection = get_linear("per_layer_model_projection", LP, H);
    w.per_layer_projection_norm = get("per_layer_projection_norm", {P});
  }
  // Expert e's part of a tensor stacked over the experts ([E, ...] -> [...]), a view.
  auto expert_view = [](Tensor t, int64_t e) {
    int64_t bytes = dtype_size_bytes(t.dtype);
    for (int d = 1; d < t.ndim; ++d) bytes *= t.shape[d];
    t.data = static_cast<uint8_t*>(t.data) + e * bytes;
    for (int d = 1; d < t.ndim; ++d) t.shape[d - 1] = t.shape[d];
    t.shape[--t.ndim] = 0;
    return t;
  };
  // gpt-oss's experts (ModelConfig::experts_interleaved): gate j and up j in rows (MXFP4) or columns (float) 2j and
  // 2j + 1. MXFP4 is read in place through row orders; a float checkpoint ([E, hidden, 2 moe_inter] and [E, moe_inter,
  // hidden], inputs first, as transformers holds them) is transposed once into [E, 2 moe_inter, hidden] (gate rows,
  // then up rows) and [E, hidden, moe_inter] copies in its own dtype. Gate's and up's biases are F32 copies, apart.
  auto load_interleaved_experts = [&](const std::string& p, LayerWeights& l) {
    const int64_t E = config.num_experts, MI = config.moe_intermediate_size;
    const std::string what = config.architecture + ": " + p + "experts";
    auto gate_rows = std::make_shared<std::vector<int32_t>>(), up_rows = std::make_shared<std::vector<int32_t>>();
    for (int64_t j = 0; j < MI; ++j) gate_rows->push_back((int32_t)(2 * j)), up_rows->push_back((int32_t)(2 * j + 1));
    const Tensor gu_bias = get(p + "experts.gate_up_bias", {E, 2 * MI}, config.moe_biases);
    const Tensor down_bias = get(p + "experts.down_bias", {E, H}, config.moe_biases);
    // gate's and up's biases apart, each [E * MI] (they alternate in the checkpoint's [E, 2 MI])
    std::shared_ptr<float> biases;
    if (config.moe_biases) {
      biases = std::shared_ptr<float>(new float[2 * E * MI], std::default_delete<float[]>());
      w.owned.push_back(biases);
      for (int64_t i = 0; i < 2 * E * MI; ++i) biases.get()[i % 2 * E * MI + i / 2] = float_value(gu_bias, i);
    }
    const bool mxfp4 = has(p + "experts.gate_up_proj_blocks");
    Tensor gu_blocks, gu_scales, dn_blocks, dn_scales, gu_t, dn_t;
    if (mxfp4) {
      LMKIT_CHECK_ARG(H % 32 == 0 && MI % 32 == 0, what, ": MXFP4 needs hidden and moe_intermediate_size % 32 == 0");
      gu_blocks = get(p + "experts.gate_up_proj_blocks", {E, 2 * MI, H / 32, 16}, true, DType::U8);
      gu_scales = get(p + "experts.gate_up_proj_scales", {E, 2 * MI, H / 32}, true, DType::U8);
      dn_blocks = get(p + "experts.down_proj_blocks", {E, H, MI / 32, 16}, true, DType::U8);
      dn_scales = get(p + "experts.down_proj_scales", {E, H, MI / 32}, true, DType::U8);
    } else {
      const Tensor gu = get(p + "experts.gate_up_proj", {E, H, 2 * MI}), dn = get(p + "experts.down_proj", {E, MI, H});
      const int64_t es = dtype_size_bytes(gu.dtype);
      LMKIT_CHECK_ARG(dn.dtype == gu.dtype, what, ": gate_up_proj and down_proj differ in dtype");
      auto copy = std::shared_ptr<uint8_t>(new uint8_t[(size_t)(E * 3 * MI * H * es)], std::default_delete<uint8_t[]>());
      w.owned.push_back(copy);
      uint8_t* gu_out = copy.get();  // [E, 2 MI, H]: expert e's gate rows, then its up rows
      uint8_t* dn_out = copy.get() + E * 2 * MI * H * es;  // [E, H, MI]
      const uint8_t* gu_in = static_cast<const uint8_t*>(gu.data);
      const uint8_t* dn_in = static_cast<const uint8_t*>(dn.data);
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t h = 0; h < H; ++h)
          for (int64_t c = 0; c < 2 * MI; ++c) {
            const int64_t row = c % 2 ? MI + c / 2 : c / 2;
            std::memcpy(gu_out + ((e * 2 * MI + row) * H + h) * es, gu_in + ((e * H + h) * 2 * MI + c) * es, es);
          }
        for (int64_t i = 0; i < MI; ++i)
          for (int64_t h = 0; h < H; ++h)
            std::memcpy(dn_out + ((e * H + h) * MI + i) * es, dn_in + ((e * MI + i) * H + h) * es, es);
      }
      gu_t = gu, dn_t = dn;
      gu_t.ndim = dn_t.ndim = 2;
      gu_t.shape[0] = MI, gu_t.shape[1] = H, gu_t.shape[2] = 0;  // one expert's gate (or up) rows
      dn_t.shape[0] = H, dn_t.shape[1] = MI, dn_t.shape[2] = 0;
      gu_t.data = gu_out, dn_t.data = dn_out;
    }
    for (int64_t e = 0; e < E; ++e) {
      LayerWeights::Expert ex;
      if (mxfp4) {
        const Tensor gb = expert_view(gu_blocks, e), gs = expert_view(gu_scales, e);
        ex.gate_proj.int4_source = mxfp4_source(gb, gs, gate_rows, what + ".gate_up_proj");
        ex.up_proj.int4_source = mxfp4_source(gb, gs, up_rows, what + ".gate_up_proj");
        ex.gate_proj.weight = ex.up_proj.weight = gb;  // what release_linear_pages drops once packed
        ex.down_proj.weight = expert_view(dn_blocks, e);
        ex.down_proj.int4_source =
            mxfp4_source(ex.down_proj.weight, expert_view(dn_scales, e), nullptr, what + ".down_proj");
      } else {
        Tensor g = gu_t, u = gu_t, d = dn_t;
        const int64_t es = dtype_size_bytes(gu_t.dtype);
        g.data = static_cast<uint8_t*>(gu_t.data) + e * 2 * MI * H * es;
        u.data = static_cast<uint8_t*>(g.data) + MI * H * es;
        d.data = static_cast<uint8_t*>(dn_t.data) + e * H * MI * es;
        ex.gate_proj = single_tensor_linear(g, nullptr, what);
        ex.up_proj = single_tensor_linear(u, nullptr, what);
        ex.down_proj = single_tensor_linear(d, nullptr, what);
      }
      if (config.moe_biases) {
        ex.gate_bias = make_view(biases.get() + e * MI, DType::F32, MI);
        ex.up_bias = make_view(biases.get() + (E + e) * MI, DType::F32, MI);
        ex.down_bias = expert_view(down_bias, e);
      }
      l.experts.push_back(std::move(ex));
    }
  };
  auto load_dense_mlp = [&](int32_t i, const std::string& p, LayerWeights& l) {
    const int64_t I = config.intermediate_of(i);
    if (has(p + "gate_up_proj")) {
      l.gate_up_proj = get_linear(p + "gate_up_proj", 2 * I, H);
    } else {
      l.gate_proj = get_linear(p + "gate_proj", I, H);
      l.up_proj = get_linear(p + "up_proj", I, H);
    }
    l.down_proj = get_linear(p + "down_proj", H, I);
  };
  auto load_mlp = [&](int32_t i, const std::string& p, LayerWeights& l) {
    if (config.is_moe_layer(i) && config.moe_beside_mlp) {  // Gemma 4: the dense MLP too, and the block's norms
      load_dense_mlp(i, p, l);
      l.post_mlp_norm_1 = get(p + "post_mlp_norm_1", {H});
      l.pre_moe_norm = get(p + "pre_moe_norm", {H});
      l.post_moe_norm = get(p + "post_moe_norm", {H});
      l.router_scale = get(p + "router_scale", {H});
      l.expert_scale = get(p + "expert_scale", {(int64_t)config.num_experts});
    }
    if (config.is_moe_layer(i)) {
      const int64_t E = config.num_experts, MI = config.moe_intermediate_size;
      l.router = get_linear(p + "router", E, H);
      l.router_bias = get(p + "router_bias", {E}, config.moe_biases);
      // gpt-oss as lite awq writes it: one int4 linear per expert, gate and up apart (read below, biases too)
      if (config.experts_interleaved && !has(p + "experts.0.gate_proj")) {
        load_interleaved_experts(p, l);
        return;
      }
      // Every expert in 3D tensors, read as views of expert e's rows (any dtype, GGUF blocks included: a row is
      // whole blocks): gate_up_proj [E, 2 moe_inter, hidden] (each expert's gate rows, then its up rows) and
      // down_proj [E, hidden, moe_inter], Qwen3.5-MoE as shipped; or gate_exps and up_exps [E, moe_inter, hidden]
      // apart and down_exps [E, hidden, moe_inter], llama.cpp's GGUF files (ffn_gate_exps, ...).
      const bool fused = has(p + "experts.gate_up_proj"), stacked = has(p + "experts.gate_exps");
      auto slab = [&](const Tensor& t, int64_t first_row, int64_t rows) {
        Tensor v = t;
        v.ndim = 2;
        v.shape[0] = rows, v.shape[1] = t.shape[t.ndim - 1], v.shape[2] = 0;
        v.data = static_cast<uint8_t*>(t.data) +
                 first_row * (v.shape[1] / dtype_block_elems(t.dtype) * dtype_block_bytes(t.dtype));
        return single_tensor_linear(v, nullptr, config.architecture + ": " + p + "experts");
      };
      if (fused || stacked) {
        const Tensor down = get(p + (fused ? "experts.down_proj" : "experts.down_exps"), {E, H, MI}, true, DType::F32,
                                true);
        const Tensor gate_up = fused ? get(p + "experts.gate_up_proj", {E, 2 * MI, H}, true, DType::F32, true)
                                     : get(p + "experts.gate_exps", {E, MI, H}, true, DType::F32, true);
        const Tensor up = fused ? Tensor{} : get(p + "experts.up_exps", {E, MI, H}, true, DType::F32, true);
        // stacked with biases (gpt-oss's GGUF files: llama.cpp splits its gate and up apart)
        const bool biased = stacked && config.moe_biases;
        const Tensor gate_bias = biased ? get(p + "experts.gate_exps_bias", {E, MI}) : Tensor{};
        const Tensor up_bias = biased ? get(p + "experts.up_exps_bias", {E, MI}) : Tensor{};
        const Tensor down_bias = biased ? get(p + "experts.down_exps_bias", {E, H}) : Tensor{};
        LMKIT_CHECK_ARG(!config.moe_biases || stacked, config.architecture, ": ", p,
                        "experts with biases come as gate_exps, up_exps and down_exps");
        for (int64_t e = 0; e < E; ++e) {
          LayerWeights::Expert ex;
          ex.gate_proj = fused ? slab(gate_up, e * 2 * MI, MI) : slab(gate_up, e * MI, MI);
          ex.up_proj = fused ? slab(gate_up, e * 2 * MI + MI, MI) : slab(up, e * MI, MI);
          ex.down_proj = slab(down, e * H, H);
          if (biased) {
            ex.gate_bias = expert_view(gate_bias, e);
            ex.up_bias = expert_view(up_bias, e);
            ex.down_bias = expert_view(down_bias, e);
          }
          l.experts.push_back(std::move(ex));
        }
      }
      for (int64_t e = 0; e < E && !fused && !stacked; ++e) {
        const std::string x = p + "experts." + std::to_string(e) + ".";
        LayerWeights::Expert ex;
        ex.gate_proj = get_linear(x + "gate_proj", MI, H);
        ex.up_proj = get_linear(x + "up_proj", MI, H);
        ex.down_proj = get_linear(x + "down_proj", H, MI);
        if (config.moe_biases) {
          ex.gate_bias = get(x + "gate_bias", {MI});
          ex.up_bias = get(x + "up_bias", {MI});
          ex.down_bias = get(x + "down_bias", {H});
        }
        l.experts.push_back(std::move(ex));
      }
      if (const int64_t SI = config.shared_expert_intermediate_size; SI > 0) {
        l.shared_expert.gate_proj = get_linear(p + "shared_expert.gate_proj", SI, H);
        l.shared_expert.up_proj = get_linear(p + "shared_expert.up_proj", SI, H);
        l.shared_expert.down_proj = get_linear(p + "shared_expert.down_proj", H, SI);
        l.shared_expert_gate = get_linear(p + "shared_expert_gate", 1, H);
      }
    } else {
      load_dense_mlp(i, p, l);
    }
  };
  auto load_recurrent = [&](const std::string& p, LayerWeights& l) {
    const int64_t KD = config.linear_key_dim(), VD = config.linear_value_dim(), HV = config.linear_num_value_heads;
    const int64_t C = config.linear_conv_dim(), K = config.linear_conv_kernel;
    if (has(p + "in_proj_qkvz")) {
      // Qwen3-Next: in_proj_qkvz holds per key head g its q rows, k rows, then its r = Hv / Hk value heads' v rows
      // and z rows; in_proj_ba per key head its r b rows, then r a rows. Read as the q | k | v, z, b, a above.
      const int64_t HK = config.linear_num_key_heads, DK = config.linear_key_head_dim;
      const int64_t RV = HV / HK * config.linear_value_head_dim, R = HV / HK, block = 2 * DK + 2 * RV;
      std::vector<int32_t> q, k, v, z, b, a;
      auto rows = [](std::vector<int32_t>& to, int64_t first, int64_t n) {
        for (int64_t r = 0; r < n; ++r) to.push_back((int32_t)(first + r));
      };
      for (int64_t g = 0; g < HK; ++g) {
        rows(q, g * block, DK), rows(k, g * block + DK, DK);
        rows(v, g * block + 2 * DK, RV), rows(z, g * block + 2 * DK + RV, RV);
        rows(b, g * 2 * R, R), rows(a, g * 2 * R + R, R);
      }
      std::vector<int32_t> qkv = q;
      qkv.insert(qkv.end(), k.begin(), k.end());
      qkv.insert(qkv.end(), v.begin(), v.end());
      std::vector<LinearTensors> qkvz = split_linear(p + "in_proj_qkvz", HK * block, H, {qkv, z});
      std::vector<LinearTensors> ba = split_linear(p + "in_proj_ba", 2 * HV, H, {b, a});
      l.in_proj_qkv = std::move(qkvz[0]), l.in_proj_z = std::move(qkvz[1]);
      l.in_proj_b = std::move(ba[0]), l.in_proj_a = std::move(ba[1]);
    } else {
      l.in_proj_qkv = get_linear(p + "in_proj_qkv", 2 * KD + VD, H);
      l.in_proj_z = get_linear(p + "in_proj_z", VD, H);
      if (has(p + "in_proj_ba")) {  // llama.cpp's qwen3next files: q | k | v and z apart, b and a still fused
        const int64_t HK = config.linear_num_key_heads, R = HV / HK;
        std::vector<int32_t> b, a;
        for (int64_t g = 0; g < HK; ++g)
          for (int64_t r = 0; r < R; ++r) {
            b.push_back((int32_t)(g * 2 * R + r));
            a.push_back((int32_t)(g * 2 * R + R + r));
          }
        std::vector<LinearTensors> ba = split_linear(p + "in_proj_ba", 2 * HV, H, {b, a});
        l.in_proj_b = std::move(ba[0]), l.in_proj_a = std::move(ba[1]);
      } else {
        l.in_proj_b = get_linear(p + "in_proj_b", HV, H);
        l.in_proj_a = get_linear(p + "in_proj_a", HV, H);
      }
    }
    l.out_proj = get_linear(p + "out_proj", H, VD);
    l.conv1d = get_stored(p + "conv1d");
    LMKIT_CHECK_ARG(!l.conv1d.is_empty() && l.conv1d.shape[0] == C && l.conv1d.numel() == C * K &&
                        !dtype_is_block(l.conv1d.dtype),
                    config.architecture, ": ", p, "conv1d must be a float [", C, ", 1, ", K, "] tensor");
    l.dt_bias = get(p + "dt_bias", {HV});
    l.a_log = get(p + "A_log", {HV});
    l.linear_norm = get(p + "linear_norm", {(int64_t)config.linear_value_head_dim});
  };
  // The roles under p of a layer shaped as layer i (an MTP layer's are those of mtp_shape_layer()).
  auto load_layer = [&](int32_t i, const std::string& p) -> LayerWeights {
    LayerWeights l;
    l.input_norm = get(p + "input_norm", {H});
    l.pre_mlp_norm = get(p + "pre_mlp_norm", {H});
    l.post_attention_norm = get(p + "post_attention_norm", {H}, is_gemma);
    l.post_mlp_norm = get(p + "post_mlp_norm", {H}, is_gemma);
    if (config.is_recurrent_layer(i)) {
      load_recurrent(p, l);
      load_mlp(i, p, l);
      return l;
    }
    l.layer_scalar = get(p + "layer_scalar", {1}, config.has_layer_scalar);
    // this layer's attention shape (Gemma 4's global layers are wider than its sliding ones)
    const int64_t Q = config.q_size_of(i), KV = config.kv_size_of(i), D = config.head_dim_of(i);
    l.q_norm = get(p + "q_norm", {config.qk_norm_whole ? Q : D}, config.has_qk_norm);
    const bool shared_kv = config.reads_shared_kv(i);  // its K/V are layer kv_source(i)'s: q only
    l.k_norm = get(p + "k_norm", {config.qk_norm_whole ? KV : D}, config.has_qk_norm && !shared_kv);
    LMKIT_CHECK_ARG(!config.v_from_k(i) || (!config.has_qkv_bias && !config.attn_output_gate), config.architecture,
                    ": values taken from k_proj go with neither q/k/v biases nor an output gate");
    LMKIT_CHECK_ARG(!config.qk_rotary_interleaved || !has(p + "qkv_proj"), config.architecture,
                    ": interleaved rotary rows need separate q_proj and k_proj");
    LMKIT_CHECK_ARG(!config.qk_rotary_interleaved || !config.has_qkv_bias, config.architecture,
                    ": interleaved rotary rows with q/k biases are not supported");
    LMKIT_CHECK_ARG(!config.attn_output_gate || !has(p + "qkv_proj"), config.architecture,
                    ": an attention output gate needs a separate q_proj");
    if (shared_kv) {
      LMKIT_CHECK_ARG(!config.has_qkv_bias && !config.attn_output_gate && !has(p + "qkv_proj"), config.architecture,
                      ": a layer reading another's KV cache has a plain q_proj (no bias, gate or fused qkv)");
      l.q_proj = get_linear(p + "q_proj", Q, H, q_rows);
    } else if (config.attn_output_gate) {
      // q_proj [heads, 2, head_dim] rows: each head's query, then its gate. Split into two [q_size, hidden] weights.
      std::vector<int32_t> query, gate;
      for (int64_t h = 0; h < config.num_heads; ++h)
        for (int64_t d = 0; d < D; ++d) {
          query.push_back((int32_t)(h * 2 * D + d));
          gate.push_back((int32_t)(h * 2 * D + D + d));
        }
      std::vector<LinearTensors> parts = split_linear(p + "q_proj", 2 * Q, H, {query, gate});
      l.q_proj = std::move(parts[0]);
      l.attn_gate = std::move(parts[1]);
      l.k_proj = get_linear(p + "k_proj", KV, H, k_rows);
      l.v_proj = get_linear(p + "v_proj", KV, H);
    } else if (has(p + "qkv_proj")) {
      l.qkv_proj = get_linear(p + "qkv_proj", Q + 2 * KV, H);
    } else if (config.v_from_k(i)) {  // the values are k_proj's output: one weight read twice
      LMKIT_CHECK_ARG(!has(p + "v_proj"), config.architecture, ": ", p, "v_proj is present on a layer whose values "
                      "are its keys (attention_k_eq_v)");
      l.q_proj = get_linear(p + "q_proj", Q, H, q_rows);
      l.k_proj = get_linear(p + "k_proj", KV, H, k_rows);
      l.v_proj = get_linear(p + "k_proj", KV, H);
    } else {
      l.q_proj = get_linear(p + "q_proj", Q, H, q_rows);
      l.k_proj = get_linear(p + "k_proj", KV, H, k_rows);
      l.v_proj = get_linear(p + "v_proj", KV, H);
    }
    l.q_bias = get(p + "q_bias", {Q}, config.has_qkv_bias);
    l.k_bias = get(p + "k_bias", {KV}, config.has_qkv_bias);
    l.v_bias = get(p + "v_bias", {KV}, config.has_qkv_bias);
    l.o_proj = get_linear(p + "o_proj", H, Q);
    l.o_bias = get(p + "o_bias", {H}, config.has_o_bias);
    l.sinks = get(p + "sinks", {(int64_t)config.num_heads}, config.attention_sinks);
    load_mlp(i, p, l);
    if (P > 0) {
      l.per_layer_input_gate = get_linear(p + "per_layer_input_gate", P, H);
      l.per_layer_projection = get_linear(p + "per_layer_projection", H, P);
      l.post_per_layer_input_norm = get(p + "post_per_layer_input_norm", {H});
    }
    return l;
  };
  for (int32_t i = 0; i < config.num_layers; ++i)
    w.layers.push_back(load_layer(i, "layers." + std::to_string(i) + "."));
  // The MTP head: every tensor required once the config names its layers (Qwen ships them with every checkpoint;
  // one missing means a damaged or trimmed file), counted apart from the model's bytes.
  const int64_t model_bytes = w.size_bytes;
  try {
    if (config.mtp_num_layers > 0) {
      w.mtp.fc = get_linear("mtp.fc", H, 2 * H);
      w.mtp.pre_fc_norm_embedding = get("mtp.pre_fc_norm_embedding", {H});
      w.mtp.pre_fc_norm_hidden = get("mtp.pre_fc_norm_hidden", {H});
      w.mtp.norm = get("mtp.norm", {H});
    }
    for (int32_t j = 0; j < config.mtp_num_layers; ++j)
      w.mtp.layers.push_back(load_layer(config.mtp_shape_layer(), "mtp.layers." + std::to_string(j) + "."));
  } catch (const InvalidArgument& e) {
    LMKIT_CHECK_ARG(false, "the multi-token-prediction head (config mtp_num_hidden_layers = ", config.mtp_num_layers,
                    "): ", e.what(), "; a checkpoint without it needs mtp_num_hidden_layers = 0");
  }
  w.mtp.size_bytes = w.size_bytes - model_bytes;
  w.size_bytes = model_bytes;
  for (auto& kv : files) w.files.push_back(kv.second);
  return w;
}

void ModelWeights::release_linear_pages() const {
  static const uintptr_t page = (uintptr_t)::sysconf(_SC_PAGESIZE);
  auto release = [](const Tensor& t) {
    if (t.is_empty()) return;
    // only the pages that lie wholly inside the tensor: its neighbours (norms, biases) stay resident
    const uintptr_t begin = ((uintptr_t)t.data + page - 1) / page * page;
    const uintptr_t end = ((uintptr_t)t.data + t.size_bytes()) / page * page;
    if (end > begin) ::madvise((void*)begin, end - begin, MADV_DONTNEED);
  };
  auto release_linear = [&](const LinearTensors& l) {
    for (const Tensor* t : {&l.weight, &l.int4.values, &l.int4.zeros, &l.int4.scales, &l.int8_scales}) release(*t);
  };
  for (const LayerWeights& l : layers)
    for (const LinearTensors* t : l.linears()) release_linear(*t);
  for (const LayerWeights& l : mtp.layers)  // packed when the head runs, else never read
    for (const LinearTensors* t : l.linears()) release_linear(*t);
  release_linear(mtp.fc);
  release(lm_head);
}

}  // namespace lmkit
