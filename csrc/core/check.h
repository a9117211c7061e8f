// Checks with messages. LMKIT_CHECK throws lmkit::Error, which the Python binding turns
// into a Python exception carrying the same text, so every message must say what to fix.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace lmkit {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Invalid user input (bad parameters, impossible requests): surfaces as ValueError.
struct InvalidArgument : Error {
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace lmkit

#define LMKIT_CHECK(cond, ...)                                                            \
  do {                                                                                    \
    if (!(cond))                                                                          \
      throw ::lmkit::Error(::lmkit::detail::concat("lmkit: ", __VA_ARGS__, " [", #cond,   \
                                                   " at ", __FILE__, ":", __LINE__, "]")); \
  } while (0)

#define LMKIT_CHECK_ARG(cond, ...)                                                \
  do {                                                                            \
    if (!(cond)) throw ::lmkit::InvalidArgument(::lmkit::detail::concat(__VA_ARGS__)); \
  } while (0)
