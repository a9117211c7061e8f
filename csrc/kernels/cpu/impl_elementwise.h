// Row-wise and element-wise ops: embedding, rmsnorm, add_rmsnorm, rope, silu_mul, gelu_tanh_mul, clamped_swiglu_mul,
// softcap, scale, log_sum_exp, kv_write.
// Textually included by isa_body.h inside the ISA namespace (see simd.h); written once for every ISA.

// Threads for an op touching `work` elements: small ops stay on the calling thread.
inline bool worth_threads(int64_t work) { return work >= (1 << 15); }

// out[i] = float(row[i]) for i < n
inline void convert_row(const void* row, DType dt, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) vstore(out + i, vload_w(row, dt, i));
  if (i < n) vstore_n(out + i, vload_w_n(row, dt, i, (int)(n - i)), (int)(n - i));
}

void embedding(const void* table, DType dt, int64_t hidden, const int32_t* ids, int64_t n, float* out) {
  const int64_t row_bytes = hidden * elem_bytes(dt);
  parallel_for(n, grain_for(n), worth_threads(n * hidden), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) convert_row((const char*)table + ids[t] * row_bytes, dt, hidden, out + t * hidden);
  });
}

// out = x * (1 / sqrt(mean(x^2) + eps)) * w, in HF's order: (x * inv_rms) * w.
inline void rmsnorm_row(const float* x, const void* w, DType dt, float eps, int64_t dim, float* out) {
  V s0 = vzero(), s1 = vzero();
  int64_t i = 0;
  for (; i + 2 * kW <= dim; i += 2 * kW) {
    V a = vload(x + i), b = vload(x + i + kW);
    s0 = vfma(a, a, s0);
    s1 = vfma(b, b, s1);
  }
  for (; i < dim; i += kW) {
    int r = dim - i < kW ? (int)(dim - i) : kW;
    V a = vload_n(x + i, r);
    s0 = vfma(a, a, s0);
  }
  const float inv = 1.0f / sqrtf(vsum(s0 + s1) / (float)dim + eps);
  const V vinv = vset1(inv);
  for (i = 0; i + kW <= dim; i += kW) vstore(out + i, (vload(x + i) * vinv) * vload_w(w, dt, i));
  if (i < dim) {
    int r = (int)(dim - i);
    vstore_n(out + i, (vload_n(x + i, r) * vinv) * vload_w_n(w, dt, i, r), r);
  }
}

void rmsnorm(const float* x, const void* w, DType dt, float eps, int64_t rows, int64_t dim, float* out) {
  parallel_for(rows, grain_for(rows), worth_threads(rows * dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rmsnorm_row(x + r * dim, w, dt, eps, dim, out + r * dim);
  });
}

void add_rmsnorm(float* residual, const float* x, const void* w, DType dt, float eps, int64_t rows,
                 int64_t dim, float* out) {
  parallel_for(rows, grain_for(rows), worth_threads(rows * dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* res = residual + r * dim;
      const float* xr = x + r * dim;
      int64_t i = 0;
      for (; i + kW <= dim; i += kW) vstore(res + i, vload(res + i) + vload(xr + i));
      if (i < dim) vstore_n(res + i, vload_n(res + i, (int)(dim - i)) + vload_n(xr + i, (int)(dim - i)), (int)(dim - i));
      rmsnorm_row(res, w, dt, eps, dim, out + r * dim);
    }
  });
}

// x[0:half] and x[half:2*half] of one head rotated by (c, s); the head's dims from 2 * half on are left as they are.
inline void rope_head(float* x, const float* c, const float* s, int half) {
  int i = 0;
  for (; i + kW <= half; i += kW) {
    V a = vload(x + i), b = vload(x + half + i), vc = vload(c + i), vs = vload(s + i);
    vstore(x + i, a * vc - b * vs);
    vstore(x + half + i, b * vc + a * vs);
  }
  for (; i < half; ++i) {
    float a = x[i], b = x[half + i];
    x[i] = a * c[i] - b * s[i];
    x[half + i] = b * c[i] + a * s[i];
  }
}

// rotary_dim (even, <= head_dim; checked at the door): the dims rotated at the start of each head.
void rope(float* q, float* k, const int32_t* positions, int64_t n, int num_heads, int num_kv_heads, int head_dim,
          const float* inv_freq, float scaling, int rotary_dim) {
  const int half = rotary_dim / 2;
  parallel_for(n, grain_for(n), worth_threads(n * (num_heads + num_kv_heads) * rotary_dim * 8),
               [&](int64_t t0, int64_t t1) {
    float c[512], s[512];  // rotary_dim <= head_dim <= 1024, checked at the door
    for (int64_t t = t0; t < t1; ++t) {
      const float pos = (float)positions[t];
      for (int i = 0; i < half; ++i) {
        const float angle = pos * inv_freq[i];  // fp32 product, as HF computes it
        float sn, cs;
        sincosf(angle, &sn, &cs);
        c[i] = cs * scaling;
        s[i] = sn * scaling;
      }
      for (int h = 0; h < num_heads; ++h) rope_head(q + (t * num_heads + h) * head_dim, c, s, half);
      for (int h = 0; h < num_kv_heads; ++h) rope_head(k + (t * num_kv_heads + h) * head_dim, c, s, half);
    }
  });
}

// f(i, r) for the vectors of [0, total): r = kW lanes from i, then one tail of r < kW; in chunks of 4096
// elements over the thread team when the op is large enough. f captures by value and runs as a private copy:
// captures reached through a pointer would be reloaded after every store (a float store may alias them).
template <class F>
inline void for_each_vector(int64_t total, const F& f) {
  const int64_t num_chunks = (total + 4095) / 4096;
  parallel_for(num_chunks, 1, worth_threads(total), [&](int64_t c0, int64_t c1) {
    const F fc = f;
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * 4096, end = begin + 4096 < total ? begin + 4096 : total;
      int64_t i = begin;
      for (; i + kW <= end; i += kW) fc(i, kW);
      if (i < end) fc(i, (int)(end - i));
    }
  });
}

// silu(g) = g * (1 / (1 + exp(-g))), the reciprocal by vrcp (a division costs twice the rest)
inline V vsilu(V g) { return g * vrcp(vset1(1.0f) + vexp(vzero() - g)); }

void silu_mul(const float* gate, const float* up, int64_t n, int64_t inter, float* out) {
  for_each_vector(n * inter, [=](int64_t i, int r) {
    vstore_r(out + i, vsilu(vload_r(gate + i, r)) * vload_r(up + i, r), r);
  });
}

// gelu_tanh(g) * u with 0.5 (1 + tanh(y)) = 1 / (1 + exp(-2y)), y = sqrt(2/pi) (g + 0.044715 g^3): silu_mul's
// form, without the cancellation of 1 + tanh(y) for g << 0 (and the same at the extremes: exp saturates).
void gelu_tanh_mul(const float* gate, const float* up, int64_t n, int64_t inter, float* out) {
  const V one = vset1(1.0f), c1 = vset1(-1.5957691216057308f), c3 = vset1(-0.07135481627260025f);  // -2 sqrt(2/pi) (1, 0.044715)
  for_each_vector(n * inter, [=](int64_t i, int r) {
    const V g = vload_r(gate + i, r), u = vload_r(up + i, r);
    vstore_r(out + i, g * vrcp(one + vexp(g * vfma(g * g, c3, c1))) * u, r);
  });
}

// gpt-oss's clamped SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit), out = g sigmoid(alpha g) (u + 1);
// the sigmoid by vrcp, as vsilu
void clamped_swiglu_mul(const float* gate, const float* up, int64_t n, int64_t inter, float alpha, float limit,
                        float* out) {
  const V one = vset1(1.0f), va = vset1(alpha), hi = vset1(limit), lo = vset1(-limit);
  for_each_vector(n * inter, [=](int64_t i, int r) {
    const V g = vmin(vload_r(gate + i, r), hi), u = vmin(vmax(vload_r(up + i, r), lo), hi);
    vstore_r(out + i, g * vrcp(one + vexp(vzero() - g * va)) * (u + one), r);
  });
}

// x = cap * tanh(x / cap), 1 / cap taken once (cap > 0, checked at the door)
void softcap(float* x, int64_t n, float cap) {
  const V vcap = vset1(cap), inv = vset1(1.0f / cap);
  for_each_vector(n, [=](int64_t i, int r) { vstore_r(x + i, vcap * vtanh(vload_r(x + i, r) * inv), r); });
}

void scale(float* x, int64_t n, float s) {
  const V vs = vset1(s);
  for_each_vector(n, [=](int64_t i, int r) { vstore_r(x + i, vload_r(x + i, r) * vs, r); });
}

// The first index holding m, the row's maximum: vectors skipped while no lane exceeds the float below m
// (should that float be a denormal read as 0, nothing is skipped wrongly: the scalar scan from the start).
inline int32_t first_index_of_max(const float* x, int64_t n, float m) {
  const V below = vset1(nextafterf(m, -__builtin_inff()));
  int64_t i = 0;
  for (; i + kW <= n; i += kW)
    if (vany_gt(vload(x + i), below)) break;
  for (int64_t j = i; j < n; ++j)
    if (x[j] == m) return (int32_t)j;
  for (int64_t j = 0; j < i; ++j)
    if (x[j] == m) return (int32_t)j;
  return 0;
}

// log(sum_i exp(x[i])) of one row: the max first, then exp(x - max) summed in fp32 lanes over blocks of
// 64 vectors, the blocks added in double (a 262k-entry row keeps ~1e-7 relative error). -inf entries add 0;
// a row of -inf gives -inf. *argmax (when given): the first index of the maximum (0 for a row of -inf or NaN).
inline float log_sum_exp_row(const float* x, int64_t n, int32_t* argmax) {
  const float neg_inf = -__builtin_inff();
  V vm = vset1(neg_inf);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) vm = vmax(vm, vload(x + i));
  float m = vhmax(vm);
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  if (argmax) *argmax = m > neg_inf ? first_index_of_max(x, n, m) : 0;
  if (!(m > neg_inf)) return m;  // all -inf (or NaN)
  const V vmx = vset1(m);
  double total = 0;
  i = 0;
  while (i + kW <= n) {
    V s = vzero();
    for (int b = 0; b < 64 && i + kW <= n; ++b, i += kW) s = s + vexp(vload(x + i) - vmx);
    total += vsum(s);
  }
  for (; i < n; ++i) total += expf(x[i] - m);
  return m + (float)log(total);
}

void log_sum_exp(const float* x, int64_t rows, int64_t n, float* out, int32_t* argmax) {
  parallel_for(rows, 1, rows > 1 && worth_threads(rows * n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out[r] = log_sum_exp_row(x + r * n, n, argmax ? argmax + r : nullptr);
  });
}

// k, v rows [n, num_kv_heads, head_dim] -> pool slots; a negative slot (padding) is skipped.
// One row of head_dim values quantized (bits 8 / 4) into `dst` with its fp16 (scale, zero) in `params`,
// exactly as ops.h / lmkit/kv_policy.py define it.
inline void kv_quant_row(const float* x, int hd, int bits, uint8_t* dst, uint16_t* params) {
  float mn = x[0], mx = x[0];
  for (int d = 1; d < hd; ++d) mn = x[d] < mn ? x[d] : mn, mx = x[d] > mx ? x[d] : mx;
  const float qmax = bits == 8 ? 255.0f : 15.0f;
  params[0] = float_to_half((mx - mn) / qmax);
  params[1] = float_to_half(mn);
  const float s = half_to_float(params[0]), z = half_to_float(params[1]);
  uint8_t q[kKVQuantMaxHeadDim];
  for (int d = 0; d < hd; ++d) {
    const float r = s == 0.0f ? 0.0f : nearbyintf((x[d] - z) / s);
    q[d] = (uint8_t)(r < 0.0f ? 0.0f : r > qmax ? qmax : r);
  }
  if (bits == 8) {
    memcpy(dst, q, (size_t)hd);
  } else {
    for (int d = 0; d < hd / 2; ++d) dst[d] = (uint8_t)(q[d] | q[d + hd / 2] << 4);
  }
}

void kv_write(const KVLayer& kv, const float* k, const float* v, const int32_t* slots, int64_t n) {
  const int64_t hd = kv.head_dim, nkv = kv.num_kv_heads, bs = kv.block_size_tokens;
  const int64_t rb = kv.row_bytes(), bb = kv.block_bytes();
  parallel_for(n, grain_for(n), worth_threads(n * nkv * hd * (kv.bits == 32 ? 1 : 16)), [&](int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t block = slot / bs, offset = slot % bs;
    char* kb = (char*)kv.k + block * bb;
    char* vb = (char*)kv.v + block * bb;
    for (int64_t h = 0; h < nkv; ++h) {
      const int64_t row = h * bs + offset, src = (t * nkv + h) * hd;
      if (kv.bits == 32) {
        memcpy(kb + row * rb, k + src, (size_t)hd * 4);
        memcpy(vb + row * rb, v + src, (size_t)hd * 4);
      } else if (kv.bits == 16) {  // K rows; V rows of a token pair interleaved (ops.h)
        uint16_t* kr = (uint16_t*)(kb + row * rb);
        uint16_t* vr = (uint16_t*)vb + (h * (bs / 2) + offset / 2) * hd * 2 + (offset & 1);
        for (int64_t d = 0; d < hd; ++d) kr[d] = bf16_bits(k[src + d]), vr[2 * d] = bf16_bits(v[src + d]);
      } else {
        kv_quant_row(k + src, (int)hd, kv.bits, (uint8_t*)kb + row * rb, (uint16_t*)(kb + nkv * bs * rb) + 2 * row);
        kv_quant_row(v + src, (int)hd, kv.bits, (uint8_t*)vb + row * rb, (uint16_t*)(vb + nkv * bs * rb) + 2 * row);
      }
    }
  }
  });
}
