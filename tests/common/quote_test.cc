#include "common/quote.h"

#include <gtest/gtest.h>

#include <string>

namespace mlakv {
namespace {

TEST(Quote, ShortPrintableStringIsQuotedAsIs) { EXPECT_EQ(Quote("req-1"), "'req-1'"); }

TEST(Quote, NewlinesAndControlBytesAreEscaped) {
  EXPECT_EQ(Quote("a\nb"), "'a\\nb'");
  EXPECT_EQ(Quote(std::string("a\0z", 3)), "'a\\x00z'");
  EXPECT_EQ(Quote("it's"), "'it\\'s'");
  EXPECT_EQ(Quote("\xff"), "'\\xff'");
}

TEST(Quote, LongStringsKeepABoundedPrefixAndSayTheirLength) {
  const std::string id(70000, 'x');
  const std::string q = Quote(id);
  EXPECT_LT(q.size(), kQuotePrefixBytes + 32);
  EXPECT_EQ(q, "'" + std::string(kQuotePrefixBytes, 'x') + "'... (70000 bytes)");
}

TEST(Quote, EscapingCountsAgainstTheInputPrefixNotTheOutput) {
  std::string escaped;
  for (int i = 0; i < 16; ++i) escaped += "\\n";
  EXPECT_EQ(Quote(std::string(10000, '\n'), 16), "'" + escaped + "'... (10000 bytes)");
}

}  // namespace
}  // namespace mlakv
