// The CPU kernels' threads: a team per calling thread (the engine thread, a test, a benchmark), sized by
// ops::set_num_threads, that runs one parallel loop at a time. Declarations only, no templates: the ISA
// units include this (see isa_prelude.h); the loop templates they call are in parallel.h.
//
// Why not OpenMP: its barriers spin for a fixed count and then every thread waits for the slowest, so a
// worker descheduled by another process on its core stalls the whole step for a time slice (a busy
// neighbour took SmolLM2's decode from 100 to 7 tok/s, benchmark/results/cpu-speed.md "Shared cores"). Here:
//   - work is handed out in chunks from an atomic counter: a late thread delays only the chunk it holds,
//     and a thread that arrives after the last chunk was taken does nothing;
//   - the caller waits for the chunks to be done, not for every thread to show up;
//   - idle workers spin briefly (a decode step's loops follow each other within microseconds), then
//     sleep on a futex, so a team never burns a core that another process needs for long.
#pragma once
#include <stdint.h>

namespace lmkit::ops::cpu {

// body(ctx, i0, i1) for chunks [i0, i1) of [0, n) of at most `grain` items (grain >= 1), on the calling
// thread's team (the caller takes chunks too); returns when every chunk is done. With a team of one, or
// called from inside a body (a nested loop), it runs body(ctx, 0, n) on the calling thread.
typedef void (*ChunkBody)(void* ctx, int64_t i0, int64_t i1);
void run_chunks(ChunkBody body, void* ctx, int64_t n, int64_t grain);

// Threads of the calling thread's team, the caller included (1 until set_num_threads).
int team_threads();

// How long an idle worker (or a caller waiting for the last chunk) polls before it sleeps, in microseconds
// (default kDefaultSpinUs; 0: sleep at once), for every team of the process. For tests and benchmarks.
constexpr int kDefaultSpinUs = 50;
void set_spin_us(int us);

}  // namespace lmkit::ops::cpu
