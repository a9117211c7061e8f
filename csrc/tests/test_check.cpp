// Check messages: numbers print as a default C++ stream would, and the process's global C++ locale (which another
// library may have replaced) has no say in them.
#include <cstdint>
#include <limits>
#include <locale>
#include <string>

#include "core/check.h"
#include "tests/testing.h"

using namespace lmkit;

namespace {

enum class Kind : int8_t { kA = -3 };

// A locale that groups thousands and writes a foreign decimal point: a stream imbued with it would print
// 1234567 as "1,234,567" and 2.5 as "2#5".
struct Grouping : std::numpunct<char> {
  char do_thousands_sep() const override { return ','; }
  std::string do_grouping() const override { return "\3"; }
  char do_decimal_point() const override { return '#'; }
};

}  // namespace

TEST(numbers_print_as_a_default_stream_would) {
  EXPECT_EQ(detail::concat("a", 7, "b", -12L, "c", 3u), std::string("a7b-12c3"));
  EXPECT_EQ(detail::concat(std::numeric_limits<int64_t>::min()), std::string("-9223372036854775808"));
  EXPECT_EQ(detail::concat(std::numeric_limits<uint64_t>::max()), std::string("18446744073709551615"));
  EXPECT_EQ(detail::concat(0.5f, " ", 1e-7, " ", 123456789.0, " ", 1.0), std::string("0.5 1e-07 1.23457e+08 1"));
  EXPECT_EQ(detail::concat(true, false, 'x', std::string(" s"), std::string_view(" v")), std::string("10x s v"));
  EXPECT_EQ(detail::concat(Kind::kA, static_cast<int8_t>(5)), std::string("-35"));
  const char* null = nullptr;
  EXPECT_EQ(detail::concat(null), std::string("(null)"));
}

TEST(messages_ignore_the_global_cpp_locale) {
  const std::locale before = std::locale::global(std::locale(std::locale::classic(), new Grouping));
  const std::string got = detail::concat("n=", 1234567, " x=", 2.5);
  std::string thrown;
  try {
    LMKIT_CHECK_ARG(false, "context of ", 40000, " tokens");
  } catch (const InvalidArgument& e) {
    thrown = e.what();
  }
  std::locale::global(before);
  EXPECT_EQ(got, std::string("n=1234567 x=2.5"));
  EXPECT_EQ(thrown, std::string("context of 40000 tokens"));
}

int main() { return testing::run_all(); }
