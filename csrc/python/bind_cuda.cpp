// lmkit._engine.cuda: the CUDA backend's runtime queries and, for the GPU tests, its kernels one by one on
// device pointers (ints, e.g. torch's data_ptr()), enqueued on the legacy default stream: the tests compare
// each against torch. Also, on every build, the host-side int4 repacking, so its layout is tested without a GPU.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <vector>

#include "core/check.h"
#include "kernels/cuda/ops_cuda.h"
#include "model/int4_layouts.h"
#ifdef LMKIT_WITH_CUDA
#include "kernels/cuda/cublas.h"
#endif

namespace py = pybind11;
using namespace lmkit;

namespace {

using I32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

cuda::HostInt4 repack_from_numpy(const I32Array& qweight, const I32Array& qzeros, const py::array& scales,
                                 int32_t group_size) {
  LMKIT_CHECK_ARG(qweight.ndim() == 2 && qzeros.ndim() == 2 && scales.ndim() == 2,
                  "qweight, qzeros and scales must be 2-d arrays");
  LMKIT_CHECK_ARG(scales.dtype().kind() == 'f' && scales.itemsize() == 2 && (scales.flags() & py::array::c_style),
                  "scales must be a C-contiguous float16 array");
  const Tensor qw = make_view(const_cast<int32_t*>(qweight.data()), DType::I32, qweight.shape(0), qweight.shape(1));
  const Tensor qz = make_view(const_cast<int32_t*>(qzeros.data()), DType::I32, qzeros.shape(0), qzeros.shape(1));
  const Tensor sc = make_view(const_cast<void*>(scales.data()), DType::F16, scales.shape(0), scales.shape(1));
  Int4Tensors awq;
  awq.layout = Int4Layout::AwqGemm;
  awq.values = qw, awq.zeros = qz, awq.scales = sc;
  return cuda::repack_int4(int4_source(awq, qw.shape[1] * 8, qw.shape[0], group_size, "AWQ"));
}

#ifdef LMKIT_WITH_CUDA
DType act_dtype(const std::string& s) {
  if (s == "F16") return DType::F16;
  if (s == "BF16") return DType::BF16;
  if (s == "F32") return DType::F32;
  throw InvalidArgument("dtype must be 'F16', 'BF16' or 'F32', got '" + s + "'");
}
template <typename T = void>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

// kv: (k_ptr, v_ptr, bits, num_blocks, num_kv_heads, block_size_tokens, head_dim)
ops::KVLayer kv_layer(const py::tuple& t) {
  ops::KVLayer kv;
  kv.k = ptr(t[0].cast<uintptr_t>());
  kv.v = ptr(t[1].cast<uintptr_t>());
  kv.bits = t[2].cast<int32_t>();
  kv.num_blocks = t[3].cast<int32_t>();
  kv.num_kv_heads = t[4].cast<int32_t>();
  kv.block_size_tokens = t[5].cast<int32_t>();
  kv.head_dim = t[6].cast<int32_t>();
  return kv;
}
#endif

}  // namespace

void bind_cuda(py::module_& parent) {
  py::module_ m = parent.def_submodule("cuda", "The CUDA backend (kernels exposed for the GPU tests).");
  m.def("repack_awq", [](const I32Array& qweight, const I32Array& qzeros, const py::array& scales, int32_t group_size) {
    const cuda::HostInt4 h = repack_from_numpy(qweight, qzeros, scales, group_size);
    const int64_t G = h.k / h.group_size;
    py::array_t<uint32_t> qw({(py::ssize_t)h.n, (py::ssize_t)(h.k / 8)});
    py::array_t<uint16_t> sc({(py::ssize_t)h.n, (py::ssize_t)G});
    py::array_t<uint8_t> zr({(py::ssize_t)h.n, (py::ssize_t)G});
    std::memcpy(qw.mutable_data(), h.qweight.get(), h.n * h.k / 2);
    std::memcpy(sc.mutable_data(), h.scales.get(), h.n * G * 2);
    std::memcpy(zr.mutable_data(), h.zeros.get(), h.n * G);
    return py::make_tuple(qw, sc, zr);
  }, py::arg("qweight"), py::arg("qzeros"), py::arg("scales"), py::arg("group_size"),
  "AWQ GEMM tensors -> the CUDA int4 layout: (qweight uint32 [N, K/8], scales fp16 bits [N, K/g], zeros uint8 [N, K/g]).");

#ifndef LMKIT_WITH_CUDA
  m.attr("is_built") = false;
  m.attr("archs") = std::string();
  m.def("is_available", []() { return false; });
#else
  m.attr("is_built") = true;
  m.attr("archs") = std::string(LMKIT_CUDA_ARCHS_LIST);  // what the build compiled for, e.g. "80,90a"
  m.def("is_available", &cuda::is_available);
  m.def("device_count", &cuda::device_count);
  m.def("device_name", &cuda::device_name);
  m.def("compute_capability", &cuda::compute_capability);
  m.def("memory_info", []() {
    int64_t f = 0, t = 0;
    cuda::memory_info(&f, &t);
    return py::make_tuple(f, t);
  });
  m.def("measure_copy_bandwidth", &cuda::measure_copy_bandwidth, py::arg("size_bytes"), py::arg("repeats"),
        py::call_guard<py::gil_scoped_release>());
  m.def("synchronize", []() { cuda::synchronize(nullptr); }, py::call_guard<py::gil_scoped_release>());
  m.def("dense_gemm_backend", &cuda::dense_gemm_backend);
  m.def("set_dense_gemm_backend", &cuda::set_dense_gemm_backend);
  m.def("load_cublas", &cuda::load_cublas);

  m.def("embedding", [](uintptr_t table, const std::string& table_dtype, int64_t vocab, uintptr_t ids, int64_t n,
                        int64_t hidden, uintptr_t out, const std::string& act) {
    cuda::embedding(ptr(table), act_dtype(table_dtype), vocab, ptr<const int32_t>(ids), n, hidden, ptr(out),
                    act_dtype(act), nullptr);
  });
  m.def("rmsnorm", [](uintptr_t x, uintptr_t w, const std::string& wdtype, float eps, int64_t rows, int64_t dim,
                      uintptr_t out, const std::string& act) {
    cuda::rmsnorm(ptr(x), ptr(w), act_dtype(wdtype), eps, rows, dim, ptr(out), act_dtype(act), nullptr);
  });
  m.def("add_rmsnorm", [](uintptr_t residual, uintptr_t x, uintptr_t w, const std::string& wdtype, float eps,
                          int64_t rows, int64_t dim, uintptr_t out, const std::string& act) {
    cuda::add_rmsnorm(ptr(residual), ptr(x), ptr(w), act_dtype(wdtype), eps, rows, dim, ptr(out), act_dtype(act),
                      nullptr);
  });
  m.def("silu_mul", [](uintptr_t gate_up, int64_t n, int64_t inter, uintptr_t out, const std::string& act) {
    cuda::silu_mul(ptr(gate_up), n, inter, ptr(out), act_dtype(act), nullptr);
  });
  m.def("gather_rows", [](uintptr_t x, uintptr_t rows, int64_t num_rows, int64_t dim, uintptr_t out,
                          const std::string& act) {
    cuda::gather_rows(ptr(x), ptr<const int32_t>(rows), num_rows, dim, ptr(out), act_dtype(act), nullptr);
  });
  m.def("qkv_rope_kv_write", [](uintptr_t qkv, uintptr_t bias, uintptr_t positions, uintptr_t slots, int64_t n,
                                int32_t num_heads, uintptr_t inv_freq, float attention_scaling, const py::tuple& kv,
                                const std::string& act) {
    cuda::qkv_rope_kv_write(ptr(qkv), ptr(bias), ptr<const int32_t>(positions), ptr<const int32_t>(slots), n,
                            num_heads, ptr<const float>(inv_freq), attention_scaling, kv_layer(kv), act_dtype(act),
                            nullptr);
  }, "kv: (k_ptr, v_ptr, bits, num_blocks, num_kv_heads, block_size_tokens, head_dim); bias 0 = none");
  m.def("attention_workspace_bytes", &cuda::attention_workspace_bytes);
  m.def("paged_attention", [](uintptr_t q, int64_t q_row_stride, const py::tuple& kv, uintptr_t q_start,
                              uintptr_t ctx_lens, uintptr_t block_tables, uintptr_t row_seq, int32_t num_seqs,
                              int32_t num_rows, int32_t max_blocks_per_seq, int32_t max_ctx_len, int32_t num_heads,
                              float scale, int32_t sliding_window, uintptr_t workspace, uintptr_t out,
                              const std::string& act) {
    cuda::AttnBatch b;
    b.q_start = ptr<const int32_t>(q_start);
    b.ctx_lens = ptr<const int32_t>(ctx_lens);
    b.block_tables = ptr<const int32_t>(block_tables);
    b.row_seq = ptr<const int32_t>(row_seq);
    b.num_seqs = num_seqs, b.num_rows = num_rows, b.max_blocks_per_seq = max_blocks_per_seq, b.max_ctx_len = max_ctx_len;
    cuda::paged_attention(ptr(q), q_row_stride, kv_layer(kv), b, num_heads, scale, sliding_window, ptr(workspace),
                          ptr(out), act_dtype(act), nullptr);
  });

  py::class_<cuda::Linear>(m, "Linear")
      .def_readonly("n", &cuda::Linear::n)
      .def_readonly("k", &cuda::Linear::k)
      .def_readonly("group_size", &cuda::Linear::group_size)
      .def_property_readonly("size_bytes", &cuda::Linear::size_bytes);
  m.def("upload_int4", [](const I32Array& qweight, const I32Array& qzeros, const py::array& scales, int32_t group_size,
                          const std::string& act) {
    return cuda::upload_int4(repack_from_numpy(qweight, qzeros, scales, group_size), act_dtype(act), nullptr);
  });
  m.def("upload_dense", [](const py::array& weight, const std::string& act) {
    LMKIT_CHECK_ARG(weight.ndim() == 2 && (weight.flags() & py::array::c_style), "weight must be a C-contiguous 2-d array");
    DType dt = weight.dtype().kind() == 'f' && weight.itemsize() == 4 ? DType::F32
               : weight.dtype().kind() == 'f' && weight.itemsize() == 2 ? DType::F16
                                                                        : DType::I32;
    LMKIT_CHECK_ARG(dt != DType::I32, "weight must be float32 or float16");
    const Tensor t = make_view(const_cast<void*>(weight.data()), dt, weight.shape(0), weight.shape(1));
    return cuda::upload_dense(t, act_dtype(act), nullptr);
  });
  m.def("linear", [](uintptr_t x, int64_t M, const cuda::Linear& w, uintptr_t bias, uintptr_t out, const std::string& act,
                     uintptr_t stream) {
    cuda::linear(ptr(x), M, w, ptr(bias), ptr(out), act_dtype(act), reinterpret_cast<cuda::Stream>(stream));
  }, py::arg("x"), py::arg("M"), py::arg("w"), py::arg("bias"), py::arg("out"), py::arg("act"), py::arg("stream") = 0,
     "stream: a cudaStream_t (torch.cuda.current_stream().cuda_stream, e.g. under graph capture); 0 = the default");
  m.def("set_skinny_rows", &cuda::set_skinny_rows, py::arg("int4_rows"), py::arg("dense_rows"));
  m.def("skinny_rows", &cuda::skinny_rows);
  m.def("set_skinny_pipeline", &cuda::set_skinny_pipeline, py::arg("on"));
  m.def("skinny_pipeline", &cuda::skinny_pipeline);

  py::class_<cuda::SampleParams>(m, "SampleParams")
      .def(py::init<>())
      .def_readwrite("temperature", &cuda::SampleParams::temperature)
      .def_readwrite("top_k", &cuda::SampleParams::top_k)
      .def_readwrite("top_p", &cuda::SampleParams::top_p)
      .def_readwrite("min_p", &cuda::SampleParams::min_p)
      .def_readwrite("repetition_penalty", &cuda::SampleParams::repetition_penalty)
      .def_readwrite("presence_penalty", &cuda::SampleParams::presence_penalty)
      .def_readwrite("frequency_penalty", &cuda::SampleParams::frequency_penalty)
      .def_readwrite("seed", &cuda::SampleParams::seed)
      .def_readwrite("step", &cuda::SampleParams::step);
  m.def("sample", [](uintptr_t logits, const std::string& dtype, int64_t rows, int64_t vocab,
                     const std::vector<cuda::SampleParams>& params, uintptr_t penalty_offsets, uintptr_t penalty_tokens,
                     uintptr_t penalty_counts, uintptr_t out_tokens) {
    LMKIT_CHECK_ARG((int64_t)params.size() == rows, "sample: ", params.size(), " params for ", rows, " rows");
    auto dev = cuda::allocate((int64_t)(params.size() * sizeof(cuda::SampleParams)));
    cuda::copy_to_device(dev.get(), params.data(), (int64_t)(params.size() * sizeof(cuda::SampleParams)), nullptr);
    cuda::sample(ptr(logits), act_dtype(dtype), rows, vocab, static_cast<const cuda::SampleParams*>(dev.get()),
                 ptr<const int32_t>(penalty_offsets), ptr<const int32_t>(penalty_tokens),
                 ptr<const int32_t>(penalty_counts), ptr<int32_t>(out_tokens), nullptr);
    cuda::synchronize(nullptr);  // the params buffer dies here
  });
#endif
}
