// Names and CPU placement of the engine's own threads (the engine loop, its kernel team, the callback thread),
// so that they can be told apart (top -H, py-spy, /proc/self/task/*/comm: lmkit/cpus.py finds them by name) and
// kept on the CPUs lmkit/cpus.py planned for them.
#pragma once
#include <pthread.h>
#include <sched.h>
#include <stdint.h>

#include <vector>

namespace lmkit {

// The calling thread's name (15 characters at most on Linux; longer names are cut).
inline void name_this_thread(const char* name) {
#if defined(__linux__)
  char cut[16] = {0};
  for (int i = 0; i < 15 && name[i]; ++i) cut[i] = name[i];
  pthread_setname_np(pthread_self(), cut);
#else
  (void)name;
#endif
}

// Restricts the calling thread, and the threads it starts from now on, to `cpus` (nothing when empty). False
// when the OS refuses (a CPU outside the process's cpuset): the thread then stays where it was.
inline bool pin_this_thread(const std::vector<int32_t>& cpus) {
#if defined(__linux__)
  if (cpus.empty()) return true;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int32_t c : cpus)
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
#else
  return cpus.empty();
#endif
}

}  // namespace lmkit
