#include "common/status_macros.h"

#include <gtest/gtest.h>

namespace mlakv {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  MLAKV_ASSIGN_OR_RETURN(int h, Half(x));
  MLAKV_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

absl::Status CheckQuarter(int x, int* calls) {
  ++*calls;
  MLAKV_RETURN_IF_ERROR(Quarter(x).status());
  return absl::OkStatus();
}

TEST(StatusMacros, AssignOrReturnPropagatesTheFirstError) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status(), absl::InvalidArgumentError("odd"));
  EXPECT_EQ(Quarter(3).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(StatusMacros, ReturnIfErrorEvaluatesOnceAndReturnsTheStatus) {
  int calls = 0;
  EXPECT_TRUE(CheckQuarter(4, &calls).ok());
  EXPECT_EQ(CheckQuarter(2, &calls).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(calls, 2);
}

TEST(StatusMacros, WithContextKeepsTheCodeAndPrefixesTheMessage) {
  EXPECT_EQ(WithContext(absl::NotFoundError("gone"), "region 'r'"), absl::NotFoundError("region 'r': gone"));
  EXPECT_TRUE(WithContext(absl::OkStatus(), "x").ok());
}

}  // namespace
}  // namespace mlakv
