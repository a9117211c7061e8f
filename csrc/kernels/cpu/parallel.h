// Parallel loops over the calling thread's team (thread_pool.h), for kernel code. Textually included
// inside an anonymous namespace (isa_body.h, linear_formats.cpp), like simd.h: every instantiation has
// internal linkage, so code built for one instruction set never mixes with another's.
//
// parallel_for(n, grain, worth, f): f(i0, i1) over chunks [i0, i1) of [0, n) of at most `grain` items,
// handed out dynamically (a late thread delays only its chunk); inline on the calling thread when !worth.
// A body keeps no state between chunks except through what it captures; per-thread buffers live on the
// body's stack (one chunk at a time per thread).

template <class F>
inline void parallel_for(int64_t n, int64_t grain, bool worth, F f) {
  if (n <= 0) return;
  if (!worth) {
    f((int64_t)0, n);
    return;
  }
  ::lmkit::ops::cpu::run_chunks([](void* ctx, int64_t i0, int64_t i1) { (*static_cast<F*>(ctx))(i0, i1); }, &f, n,
                                grain);
}

// A grain that gives each thread about `per_thread` chunks of [0, n) (at least 1 item).
inline int64_t grain_for(int64_t n, int64_t per_thread = 4) {
  const int64_t chunks = (int64_t)::lmkit::ops::cpu::team_threads() * per_thread;
  const int64_t g = (n + chunks - 1) / chunks;
  return g < 1 ? 1 : g;
}
