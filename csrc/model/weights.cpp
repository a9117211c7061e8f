#include "model/weights.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/check.h"

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

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

ModelWeights ModelWeights::load(const ModelConfig& config, const std::map<std::string, TensorSource>& sources) {
  config.validate();
  ModelWeights w;
  std::map<std::string, std::shared_ptr<MappedFile>> files;

  auto get = [&](const std::string& role, std::vector<int64_t> shape, bool required = true) -> Tensor {
    auto it = sources.find(role);
    if (it == sources.end()) {
      LMKIT_CHECK_ARG(!required, config.architecture, ": checkpoint has no tensor for '", role, "'");
      return Tensor{};
    }
    const TensorSource& src = it->second;
    LMKIT_CHECK_ARG(is_float(src.dtype), config.architecture, ": tensor '", role, "' has dtype ",
                    dtype_name(src.dtype), "; only F32, F16 and BF16 weights are supported");
    LMKIT_CHECK_ARG(src.shape == shape, config.architecture, ": tensor '", role, "' has shape ", shape_str(src.shape),
                    ", the config implies ", shape_str(shape));
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

  const int64_t H = config.hidden_size, I = config.intermediate_size, V = config.vocab_size;
  const int64_t Q = config.q_size(), KV = config.kv_size();
  w.embed_tokens = get("embed_tokens", {V, H});
  w.final_norm = get("norm", {H});
  w.lm_head = get("lm_head", {V, H}, !config.tie_word_embeddings);
  if (w.lm_head.is_empty()) w.lm_head = w.embed_tokens;
  for (int32_t i = 0; i < config.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    LayerWeights l;
    l.input_norm = get(p + "input_norm", {H});
    l.post_attention_norm = get(p + "post_attention_norm", {H});
    l.q_proj = get(p + "q_proj", {Q, H});
    l.k_proj = get(p + "k_proj", {KV, H});
    l.v_proj = get(p + "v_proj", {KV, H});
    l.o_proj = get(p + "o_proj", {H, Q});
    l.q_bias = get(p + "q_bias", {Q}, config.has_qkv_bias);
    l.k_bias = get(p + "k_bias", {KV}, config.has_qkv_bias);
    l.v_bias = get(p + "v_bias", {KV}, config.has_qkv_bias);
    l.gate_proj = get(p + "gate_proj", {I, H});
    l.up_proj = get(p + "up_proj", {I, H});
    l.down_proj = get(p + "down_proj", {H, I});
    w.layers.push_back(l);
  }
  for (auto& kv : files) w.files.push_back(kv.second);
  return w;
}

}  // namespace lmkit
