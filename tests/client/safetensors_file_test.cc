// Safetensors parsing: round trips, and every malformed header refused with a
// clear INVALID_ARGUMENT instead of a crash.
#include "client/safetensors_file.h"

#include <cstring>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace mlakv {
namespace {

std::string Frame(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + header + data;
}

void ExpectInvalid(const std::string& bytes, const std::string& needle) {
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Parse(bytes, "test.safetensors");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
  EXPECT_NE(std::string(f.status().message()).find(needle), std::string::npos) << f.status();
}

TEST(Safetensors, WriterOutputParsesBack) {
  SafetensorsWriter w;
  const std::string a(2 * 3 * 2, '\x11'), b(4, '\x22');
  ASSERT_TRUE(w.Add("a", "BF16", {2, 3}, a).ok());
  ASSERT_TRUE(w.Add("s", "F32", {1}, b).ok());
  w.SetMetadata("k", "v");
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Parse(w.Serialize(), "mem");
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_NE(f->Find("a"), nullptr);
  EXPECT_EQ(f->Find("a")->data, a);
  EXPECT_EQ(f->Find("a")->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f->Find("s")->data, b);
  EXPECT_EQ(f->metadata().at("k"), "v");
  EXPECT_TRUE(f->GetScalarF32("s").ok());
  EXPECT_FALSE(f->Get("a", {"F16"}).ok());
  EXPECT_EQ(f->Get("missing", {"F16"}).status().code(), absl::StatusCode::kNotFound);
}

TEST(Safetensors, WriterRefusesWrongByteCount) {
  SafetensorsWriter w;
  EXPECT_EQ(w.Add("a", "F32", {3}, std::string(11, 'x')).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.Add("a", "Q7", {3}, std::string(3, 'x')).code(), absl::StatusCode::kInvalidArgument);
}

TEST(Safetensors, RejectsTruncatedFile) { ExpectInvalid("abc", "shorter than the 8-byte header length"); }

TEST(Safetensors, RejectsHeaderLengthBeyondFile) {
  std::string bytes = Frame("{}", "");
  bytes[0] = 100;
  ExpectInvalid(bytes, "exceeds the file");
}

TEST(Safetensors, RejectsHugeHeaderLength) {
  std::string bytes(16, '\0');
  bytes[7] = 0x7F;
  ExpectInvalid(bytes, "exceeds the file");
}

TEST(Safetensors, RejectsNonJsonHeader) { ExpectInvalid(Frame("{not json", ""), "not a JSON object"); }
TEST(Safetensors, RejectsArrayHeader) { ExpectInvalid(Frame("[1,2]", ""), "not a JSON object"); }

TEST(Safetensors, RejectsUnknownDtype) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"F7","shape":[1],"data_offsets":[0,1]}})", "x"), "unknown dtype");
}

TEST(Safetensors, RejectsMissingFields) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[1]}})", "x"), "needs dtype, shape and data_offsets");
}

TEST(Safetensors, RejectsNegativeDimension) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", "x"), "dimension");
}

TEST(Safetensors, RejectsOffsetsOutsideData) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", "xy"), "outside");
}

TEST(Safetensors, RejectsReversedOffsets) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[2,1]}})", "xy"), "outside");
}

TEST(Safetensors, RejectsShapeByteCountMismatch) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "abcdefgh"), "needs 8");
}

TEST(Safetensors, RejectsOverlappingTensors) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                      R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                      "abcdefgh"),
                "overlap");
}

TEST(Safetensors, RejectsOverlapHiddenBehindAShortTensor) {
  // a covers [0,8); c [2,3) sorts between; b [5,7) overlaps a, not c.
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                      R"("c":{"dtype":"U8","shape":[1],"data_offsets":[2,3]},)"
                      R"("b":{"dtype":"U8","shape":[2],"data_offsets":[5,7]}})",
                      "abcdefgh"),
                "overlap");
}

TEST(Safetensors, RejectsNonStringMetadata) {
  ExpectInvalid(Frame(R"({"__metadata__":{"a":1}})", ""), "__metadata__");
}

TEST(Safetensors, MissingFileIsNotFound) {
  EXPECT_EQ(SafetensorsFile::Read("/nonexistent/file.safetensors").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace mlakv
