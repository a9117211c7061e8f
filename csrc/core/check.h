// Checks with messages. LMKIT_CHECK throws lmkit::Error, which the Python binding turns
// into a Python exception carrying the same text, so every message must say what to fix.
#pragma once
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace lmkit {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Invalid user input (bad parameters, impossible requests): surfaces as ValueError.
struct InvalidArgument : Error {
  using Error::Error;
};

namespace detail {
// Message text without iostreams: a stream formats numbers through the process's global C++ locale, which
// another library may have replaced; on the H100 machine (2026-11-26) `os << int` in a message crashed the
// process once torch and transformers were loaded. std::to_string and snprintf take no locale.
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, std::string_view v) { s.append(v.data(), v.size()); }
inline void append(std::string& s, const char* v) { s += v ? v : "(null)"; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? '1' : '0'; }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>,
                                       int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(v);
}
template <typename T, std::enable_if_t<std::is_enum_v<T>, int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(static_cast<std::underlying_type_t<T>>(v));
}
template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
void append(std::string& s, T v) {  // %g: what a stream prints by default
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
  s += buf;
}

template <typename... Args>
std::string concat(Args&&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
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
