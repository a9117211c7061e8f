// A minimal test harness for the C++ unit tests run under ctest: TEST cases register themselves,
// EXPECT failures are counted, main() prints "N passed, M failed" and returns non-zero on failure.
#pragma once
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace lmkit::testing {

struct Case {
  const char* name;
  std::function<void()> body;
};

inline std::vector<Case>& registry() {
  static std::vector<Case> cases;
  return cases;
}

inline int& failures_in_case() {
  static int n = 0;
  return n;
}

struct Register {
  Register(const char* name, std::function<void()> body) { registry().push_back({name, std::move(body)}); }
};

inline int run_all() {
  int passed = 0, failed = 0;
  for (const Case& c : registry()) {
    failures_in_case() = 0;
    try {
      c.body();
    } catch (const std::exception& e) {
      std::printf("  %s: unexpected exception: %s\n", c.name, e.what());
      ++failures_in_case();
    }
    if (failures_in_case() == 0) {
      ++passed;
    } else {
      ++failed;
      std::printf("FAILED %s\n", c.name);
    }
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace lmkit::testing

#define LMKIT_TEST_CONCAT2(a, b) a##b
#define LMKIT_TEST_CONCAT(a, b) LMKIT_TEST_CONCAT2(a, b)
#define TEST(name)                                                                                  \
  static void name();                                                                               \
  static ::lmkit::testing::Register LMKIT_TEST_CONCAT(register_, name)(#name, name);                \
  static void name()

#define EXPECT(cond)                                                                           \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      std::printf("  %s:%d: expected %s\n", __FILE__, __LINE__, #cond);                        \
      ++::lmkit::testing::failures_in_case();                                                  \
    }                                                                                          \
  } while (0)

#define EXPECT_EQ(a, b)                                                                        \
  do {                                                                                         \
    if (!((a) == (b))) {                                                                       \
      std::printf("  %s:%d: expected %s == %s\n", __FILE__, __LINE__, #a, #b);                 \
      ++::lmkit::testing::failures_in_case();                                                  \
    }                                                                                          \
  } while (0)

#define EXPECT_THROWS(stmt)                                                                    \
  do {                                                                                         \
    bool thrown_ = false;                                                                      \
    try {                                                                                      \
      stmt;                                                                                    \
    } catch (const std::exception&) {                                                          \
      thrown_ = true;                                                                          \
    }                                                                                          \
    if (!thrown_) {                                                                            \
      std::printf("  %s:%d: expected %s to throw\n", __FILE__, __LINE__, #stmt);               \
      ++::lmkit::testing::failures_in_case();                                                  \
    }                                                                                          \
  } while (0)
