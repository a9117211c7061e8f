// Token sampling of the CUDA backend, one CTA per row of logits, no sort:
//   1. penalties (one thread per (row, token) entry, in place on the logits);
//   2. greedy rows: arg max, lowest id on ties;
//   3. others: z = (logit - max logit) / T <= 0; top-k and top-p become thresholds on z found by bisection (count or mass of
//      z >= t is monotone in t), min-p is z >= max + log(min_p); the token is the arg max of z + Gumbel noise
//      over the survivors (Gumbel-max = a draw from their softmax), the noise a hash of (seed, step, token).
// The CPU sampler (kernels/cpu/sampling.cpp) keeps exactly k / the smallest prefix reaching top_p; here
// tokens tied with the threshold all survive. The random streams differ from the CPU backend's.
#include <cfloat>

#include "kernels/cuda/common.cuh"

namespace lmkit::cuda {
namespace {

constexpr int kSampleThreads = 1024;
constexpr int kBisectSteps = 32;

template <typename L>
__global__ void penalty_kernel(L* logits, int64_t vocab, const SampleParams* __restrict__ params,
                               const int32_t* __restrict__ offsets, const int32_t* __restrict__ tokens,
                               const int32_t* __restrict__ counts, int64_t rows) {
  const int64_t r = blockIdx.x;
  if (r >= rows) return;
  const SampleParams p = params[r];
  for (int32_t e = offsets[r] + threadIdx.x; e < offsets[r + 1]; e += blockDim.x) {
    const int32_t tok = tokens[e], count = counts[e];
    if (tok < 0 || tok >= vocab) continue;
    L* x = logits + r * vocab + tok;
    float l = to_float(*x);
    if (count < 0) {
      l = -INFINITY;
    } else {
      if (p.repetition_penalty != 1.0f) l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
      if (count > 0) l -= p.presence_penalty + p.frequency_penalty * (float)count;
    }
    *x = from_float<L>(l);
  }
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// Uniform strictly inside (0, 1) from (seed, step, token): an odd numerator over 2^24, exact in fp32 (the
// Gumbel noise -log(-log(u)) is finite for every draw; u == 1 would make one token win whatever its logit).
__device__ __forceinline__ float uniform(uint64_t seed, uint64_t step, int64_t token) {
  const uint64_t h = splitmix64(seed ^ splitmix64(step * 0xD1B54A32D192ED03ull ^ splitmix64((uint64_t)token)));
  return (float)(((h >> 41) << 1) | 1u) * (1.0f / 16777216.0f);
}

// Arg max over the block of (value, index), lowest index on ties; every thread gets the winner.
__device__ void block_argmax(float& v, int64_t& i, float* sv, int64_t* si) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
  }
  __syncthreads();
  if (lane == 0) sv[warp] = v, si[warp] = i;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x >> 5) ? sv[lane] : -INFINITY;
    i = lane < (int)(blockDim.x >> 5) ? si[lane] : INT64_MAX;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int64_t oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
    }
    if (lane == 0) sv[0] = v, si[0] = i;
  }
  __syncthreads();
  v = sv[0], i = si[0];
  __syncthreads();
}

template <typename L>
__global__ void __launch_bounds__(kSampleThreads) sample_kernel(const L* __restrict__ logits, int64_t vocab,
                                                                const SampleParams* __restrict__ params,
                                                                int32_t* __restrict__ out_tokens) {
  __shared__ float scratch[32];
  __shared__ float sv[32];
  __shared__ int64_t si[32];
  const int64_t r = blockIdx.x;
  const L* x = logits + r * vocab;
  const SampleParams p = params[r];
  const bool greedy = p.temperature <= 0.0f || p.top_k == 1;
  // z = (logit - max logit) / t <= 0: never inf - inf, even for a temperature so small that logit / t
  // overflows (1 / t is capped: a subnormal t would make it inf, and 0 * inf is NaN).
  const float inv_t = greedy ? 1.0f : fminf(1.0f / p.temperature, 3.0e38f);

  // The max logit and its (lowest) index: the answer for greedy rows, the origin of z for the others;
  // and the min finite logit, whose z is the smallest finite z (z is monotone in the logit).
  float best = -INFINITY, lo_logit = INFINITY;
  int64_t best_i = INT64_MAX;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = to_float(x[i]);
    if (v > best) best = v, best_i = i;  // i increases per thread: strict > keeps the lowest index
    if (v > -INFINITY) lo_logit = fminf(lo_logit, v);
  }
  block_argmax(best, best_i, sv, si);
  if (greedy || best == -INFINITY) {
    if (threadIdx.x == 0) out_tokens[r] = best_i == INT64_MAX ? 0 : (int32_t)best_i;
    return;
  }
  const float xmax = best;
  auto z_of = [&](float logit) {
    const float d = logit - xmax;
    return d == 0.0f ? 0.0f : d * inv_t;
  };
  auto zf = [&](int64_t i) { return z_of(to_float(x[i])); };
  lo_logit = -block_max(-lo_logit, scratch);
  // When 1 / t is so large that this z overflows to -inf, start at the lowest finite float instead: every
  // finite z is still >= lo, and such a row keeps only its best token in practice anyway.
  const float lo = fmaxf(z_of(lo_logit), -FLT_MAX);
  const float top = 0.0f;  // z of the best token
  float threshold = lo;  // keep z >= threshold
  if (p.top_k > 0 && p.top_k < vocab) {  // largest t with count(z >= t) >= k
    float a = lo, b = top;
    for (int it = 0; it < kBisectSteps; ++it) {
      const float mid = 0.5f * (a + b);
      float c = 0.0f;
      for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) c += zf(i) >= mid ? 1.0f : 0.0f;
      c = block_sum(c, scratch);
      if (c >= (float)p.top_k) a = mid; else b = mid;
    }
    threshold = a;
  }
  if (p.top_p < 1.0f) {  // largest t >= threshold with mass(z >= t) >= top_p * mass(z >= threshold)
    float total = 0.0f;
    for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
      const float z = zf(i);
      if (z >= threshold) total += __expf(z - top);
    }
    total = block_sum(total, scratch);
    const float target = p.top_p * total;
    float a = threshold, b = top;
    for (int it = 0; it < kBisectSteps; ++it) {
      const float mid = 0.5f * (a + b);
      float mass = 0.0f;
      for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float z = zf(i);
        if (z >= mid) mass += __expf(z - top);
      }
      mass = block_sum(mass, scratch);
      if (mass >= target) a = mid; else b = mid;
    }
    threshold = a;
  }
  if (p.min_p > 0.0f) threshold = fmaxf(threshold, top + logf(p.min_p));
  threshold = fminf(threshold, top);  // the best token always survives
  float v = -INFINITY;
  int64_t vi = INT64_MAX;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float z = zf(i);
    if (z < threshold) continue;
    const float g = z - logf(-logf(uniform(p.seed, p.step, i)));
    if (g > v) v = g, vi = i;
  }
  block_argmax(v, vi, sv, si);
  if (threadIdx.x == 0) out_tokens[r] = (int32_t)vi;
}

}  // namespace

void sample(void* logits, DType logits_dtype, int64_t rows, int64_t vocab, const SampleParams* params,
            const int32_t* penalty_offsets, const int32_t* penalty_tokens, const int32_t* penalty_counts,
            int32_t* out_tokens, Stream stream) {
  LMKIT_CHECK_ARG(rows >= 0 && vocab > 0, "cuda::sample: bad shape rows=", rows, " vocab=", vocab);
  if (rows == 0) return;
  cudaStream_t s = as_stream(stream);
  dispatch_float(logits_dtype, "cuda::sample", [&](auto t) {
    using L = decltype(t);
    if (penalty_offsets)
      penalty_kernel<L><<<(unsigned)rows, 128, 0, s>>>(static_cast<L*>(logits), vocab, params,
                                                       penalty_offsets, penalty_tokens, penalty_counts, rows);
    sample_kernel<L><<<(unsigned)rows, kSampleThreads, 0, s>>>(static_cast<const L*>(logits), vocab, params, out_tokens);
  });
  LMKIT_CUDA_LAUNCHED("cuda::sample");
}

}  // namespace lmkit::cuda
