// The steady clock in seconds, one definition for every part that times or stamps (the engine's outputs, the disk
// store's pauses, speculative decoding's step timings).
#pragma once
#include <chrono>

namespace lmkit {

inline double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace lmkit
