// Device queries, memory and streams of the CUDA backend, and the copy-bandwidth roofline probe.
#include <stdio.h>

#include <memory>

#include "kernels/cuda/common.cuh"

namespace lmkit::cuda {

bool is_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later calls report their own
    return false;
  }
  return n > 0;
}

int device_count() {
  int n = 0;
  LMKIT_CUDA_OK(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
  return n;
}

std::string device_name() {
  int dev = 0;
  LMKIT_CUDA_OK(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop;
  LMKIT_CUDA_OK(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  char buf[320];
  snprintf(buf, sizeof buf, "%s (sm_%d%d, %d SMs)", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  return buf;
}

int compute_capability() {
  int dev = 0, major = 0, minor = 0;
  LMKIT_CUDA_OK(cudaGetDevice(&dev), "cudaGetDevice");
  LMKIT_CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
  LMKIT_CUDA_OK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "cudaDeviceGetAttribute");
  return 10 * major + minor;
}

void set_device(int device) { LMKIT_CUDA_OK(cudaSetDevice(device), "cudaSetDevice"); }

void memory_info(int64_t* free_bytes, int64_t* total_bytes) {
  size_t f = 0, t = 0;
  LMKIT_CUDA_OK(cudaMemGetInfo(&f, &t), "cudaMemGetInfo");
  *free_bytes = (int64_t)f;
  *total_bytes = (int64_t)t;
}

std::shared_ptr<void> allocate(int64_t size_bytes) {
  LMKIT_CHECK(size_bytes >= 0, "cuda::allocate: negative size ", size_bytes);
  void* p = nullptr;
  if (size_bytes > 0) {
    const cudaError_t err = cudaMalloc(&p, (size_t)size_bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      size_t f = 0, t = 0;
      cudaMemGetInfo(&f, &t);
      throw Error(detail::concat("lmkit (CUDA): cannot allocate ", size_bytes, " bytes of device memory (",
                                 (int64_t)f, " free of ", (int64_t)t, "): ", cudaGetErrorString(err)));
    }
  }
  return std::shared_ptr<void>(p, [](void* q) {
    if (q) cudaFree(q);
  });
}

void copy_to_device(void* dst, const void* src_host, int64_t size_bytes, Stream stream) {
  if (size_bytes == 0) return;
  LMKIT_CUDA_OK(cudaMemcpyAsync(dst, src_host, (size_t)size_bytes, cudaMemcpyHostToDevice, as_stream(stream)),
                "copy to device");
}
void copy_to_host(void* dst_host, const void* src, int64_t size_bytes, Stream stream) {
  if (size_bytes == 0) return;
  LMKIT_CUDA_OK(cudaMemcpyAsync(dst_host, src, (size_t)size_bytes, cudaMemcpyDeviceToHost, as_stream(stream)),
                "copy to host");
}
void copy_device(void* dst, const void* src, int64_t size_bytes, Stream stream) {
  if (size_bytes == 0) return;
  LMKIT_CUDA_OK(cudaMemcpyAsync(dst, src, (size_t)size_bytes, cudaMemcpyDeviceToDevice, as_stream(stream)),
                "device copy");
}
void fill_bytes(void* dst, int value, int64_t size_bytes, Stream stream) {
  if (size_bytes == 0) return;
  LMKIT_CUDA_OK(cudaMemsetAsync(dst, value, (size_t)size_bytes, as_stream(stream)), "memset");
}
void synchronize(Stream stream) { LMKIT_CUDA_OK(cudaStreamSynchronize(as_stream(stream)), "stream synchronize"); }

Stream create_stream() {
  cudaStream_t s = nullptr;
  LMKIT_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  return s;
}
void destroy_stream(Stream stream) {
  if (!stream) return;
  cudaStreamDestroy(as_stream(stream));
  release_dequant_scratch(stream);  // cudaFree waits for the stream's work
}

void begin_capture(Stream stream) {
  LMKIT_CUDA_OK(cudaStreamBeginCapture(as_stream(stream), cudaStreamCaptureModeThreadLocal), "begin graph capture");
}

std::shared_ptr<void> end_capture(Stream stream) {
  cudaGraph_t graph = nullptr;
  cudaError_t err = cudaStreamEndCapture(as_stream(stream), &graph);
  cudaGraphExec_t exec = nullptr;
  if (err == cudaSuccess) {
    err = cudaGraphInstantiate(&exec, graph, 0);  // the CUDA 12 signature (CMake requires CUDA >= 12)
    cudaGraphDestroy(graph);
  }
  if (err != cudaSuccess) cudaGetLastError();  // a failed capture is not sticky: leave no stale error behind
  LMKIT_CUDA_OK(err, "end graph capture");
  return std::shared_ptr<void>(exec, [](void* e) {
    if (e) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(e));
  });
}

void abort_capture(Stream stream) noexcept {
  cudaGraph_t graph = nullptr;
  if (cudaStreamEndCapture(as_stream(stream), &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
  cudaGetLastError();
}

void launch_graph(const std::shared_ptr<void>& graph, Stream stream) {
  LMKIT_CUDA_OK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph.get()), as_stream(stream)), "graph launch");
}

double measure_copy_bandwidth(int64_t size_bytes, int repeats) {
  LMKIT_CHECK_ARG(size_bytes > 0 && repeats > 0, "measure_copy_bandwidth: size and repeats must be positive");
  auto a = allocate(size_bytes), b = allocate(size_bytes);
  // stream and events released on every path (the checks below throw)
  std::shared_ptr<CUstream_st> stream(as_stream(create_stream()), [](cudaStream_t q) { cudaStreamDestroy(q); });
  cudaStream_t s = stream.get();
  cudaEvent_t start = nullptr, stop = nullptr;
  LMKIT_CUDA_OK(cudaEventCreate(&start), "cudaEventCreate");
  std::shared_ptr<CUevent_st> start_guard(start, [](cudaEvent_t e) { cudaEventDestroy(e); });
  LMKIT_CUDA_OK(cudaEventCreate(&stop), "cudaEventCreate");
  std::shared_ptr<CUevent_st> stop_guard(stop, [](cudaEvent_t e) { cudaEventDestroy(e); });
  LMKIT_CUDA_OK(cudaMemcpyAsync(b.get(), a.get(), (size_t)size_bytes, cudaMemcpyDeviceToDevice, s), "warm-up copy");
  LMKIT_CUDA_OK(cudaEventRecord(start, s), "cudaEventRecord");
  for (int i = 0; i < repeats; ++i)
    LMKIT_CUDA_OK(cudaMemcpyAsync(i % 2 ? a.get() : b.get(), i % 2 ? b.get() : a.get(), (size_t)size_bytes,
                                  cudaMemcpyDeviceToDevice, s), "timed copy");
  LMKIT_CUDA_OK(cudaEventRecord(stop, s), "cudaEventRecord");
  LMKIT_CUDA_OK(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  LMKIT_CUDA_OK(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  return 2.0 * (double)size_bytes * repeats / (ms * 1e-3);
}

}  // namespace lmkit::cuda
