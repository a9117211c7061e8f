// The decoder's weights: views into memory-mapped safetensors files, in their stored dtype.
// lmkit.models (Python) reads the headers and the per-architecture key table and hands over one
// TensorSource per role; this file maps the files and checks every shape against the config.
#pragma once
#include <stdint.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/model_config.h"

namespace lmkit {

// Where one tensor lives: a byte range of a file, as recorded in its safetensors header.
struct TensorSource {
  std::string path;
  int64_t offset = 0;  // absolute byte offset in the file
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
};

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  int64_t size_bytes() const { return size_; }

 private:
  std::string path_;
  uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

// One linear layer as stored: a dense weight, or the AWQ int4 tensors of DESIGN.md section 4.
struct LinearTensors {
  Tensor weight;                   // [out, in] F32/F16/BF16; empty for AWQ
  Tensor qweight, qzeros, scales;  // AWQ GEMM: I32 [in, out / 8], I32 [in / g, out / 8], F16 [in / g, out]
  bool is_awq() const { return !qweight.is_empty(); }
};

struct LayerWeights {
  Tensor input_norm, post_attention_norm;           // [hidden]
  LinearTensors q_proj, k_proj, v_proj, o_proj;     // [q_size, hidden], [kv_size, hidden] x2, [hidden, q_size]
  Tensor q_bias, k_bias, v_bias;                    // empty unless has_qkv_bias
  LinearTensors gate_proj, up_proj, down_proj;      // [inter, hidden] x2, [hidden, inter]
};

struct ModelWeights {
  Tensor embed_tokens;  // [vocab, hidden]
  Tensor final_norm;    // [hidden]
  Tensor lm_head;       // [vocab, hidden]; the embedding when tied
  std::vector<LayerWeights> layers;
  std::vector<std::shared_ptr<MappedFile>> files;  // keep the mappings alive
  int64_t size_bytes = 0;

  // Roles: "embed_tokens", "norm", "lm_head" (optional when tied), and per layer i
  // "layers.{i}.{input_norm,post_attention_norm,q_proj,k_proj,v_proj,o_proj,q_bias,k_bias,v_bias,gate_proj,up_proj,down_proj}".
  // An AWQ linear comes as "<role>.qweight", "<role>.qzeros", "<role>.scales" instead of "<role>"
  // (config.awq_group_size > 0); linears left dense (modules_to_not_convert) keep the plain role.
  static ModelWeights load(const ModelConfig& config, const std::map<std::string, TensorSource>& sources);

  // Once a backend has packed the linear layers (and the lm_head) into buffers of its own, their file pages
  // leave this process's resident memory (MADV_DONTNEED on the read-only private mapping: a later read
  // refaults from the file, so a view that is still read, such as a tied embedding, stays valid).
  void release_linear_pages() const;
};

}  // namespace lmkit
