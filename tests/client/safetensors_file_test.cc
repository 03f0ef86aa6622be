// Safetensors parsing: round trips, and every malformed header refused with a
// clear INVALID_ARGUMENT instead of a crash: sizes that overflow, offsets
// outside the file, out of order, overlapping or leaving bytes unclaimed,
// header lengths out of bounds, unknown dtypes, names quoted and bounded.
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
  ExpectInvalid(bytes, "exceeds the format's limit");
}

TEST(Safetensors, RejectsNonJsonHeader) { ExpectInvalid(Frame("{not json", ""), "header is not valid JSON"); }
TEST(Safetensors, RejectsArrayHeader) {
  ExpectInvalid(Frame("[1,2]", ""), "the header is an array of 2 elements, not a JSON object");
}

TEST(Safetensors, RejectsUnknownDtype) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"F7","shape":[1],"data_offsets":[0,1]}})", "x"),
                "tensor 'a' has unknown dtype 'F7' (known: BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, BF16, "
                "I32, U32, F32, F64, I64, U64)");
}

TEST(Safetensors, RejectsNonStringDtype) {
  ExpectInvalid(Frame(R"({"a":{"dtype":4,"shape":[1],"data_offsets":[0,1]}})", "x"), "dtype '4', not a dtype name");
}

TEST(Safetensors, RejectsMissingFields) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[1]}})", "x"), "needs dtype, shape and data_offsets");
}

TEST(Safetensors, RejectsNegativeDimension) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", "x"), "dimension");
}

TEST(Safetensors, RejectsOffsetsOutsideData) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", "xy"),
                "data_offsets [0, 4) past the end of the 2-byte data section");
}

TEST(Safetensors, RejectsReversedOffsets) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[2,1]}})", "xy"),
                "data_offsets [2, 1]: begin > end");
}

TEST(Safetensors, RejectsShapeByteCountMismatch) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "abcdefgh"),
                "tensor 'a' holds 4 bytes (data_offsets [0, 4)) but F32[2] is 8 bytes");
}

TEST(Safetensors, RejectsOverlappingTensors) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                      R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                      "abcdefgh"),
                "tensor 'b' at data bytes [2, 6) overlaps tensor 'a', which ends at 4");
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
  ExpectInvalid(Frame(R"({"__metadata__":{"a":1}})", ""), "__metadata__['a'] is '1', not a string");
}

TEST(Safetensors, RejectsNonObjectMetadata) {
  ExpectInvalid(Frame(R"({"__metadata__":[1]})", ""), "__metadata__ is an array of 1 elements, not an object");
}

// ---- sizes: every product is checked, so nothing wraps to a small number.

// [2^32, 2^32] has 2^64 elements: as uint64 the product wraps to 0, which
// "matched" 0 bytes and let `mlakv quantize` take the file (and numel()
// overflowed int64: undefined behaviour).
TEST(Safetensors, RejectsShapeWhoseElementCountOverflows) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", ""),
                "tensor 'a' has shape [4294967296, 4294967296], more than 2^63 - 1 elements");
}

TEST(Safetensors, RejectsOverflowEvenWhenALaterDimensionIsZero) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[4611686018427387904,4,0],"data_offsets":[0,0]}})", ""),
                "more than 2^63 - 1 elements");
}

TEST(Safetensors, RejectsShapeWhoseByteCountOverflows) {
  // 2^61 elements fit in int64; 2^61 x 8 bytes do not.
  ExpectInvalid(Frame(R"({"a":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", ""),
                "tensor 'a' is F64[2305843009213693952], more than 2^63 - 1 bytes");
}

TEST(Safetensors, RejectsDimensionBeyondInt64) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,0]}})", ""),
                "tensor 'a' has dimension 0 = '9223372036854775808'; dimensions are integers in [0, 2^63)");
}

TEST(Safetensors, RejectsNonIntegerDimensions) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", "x"), "dimension 0 = '1.5'");
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[1,"2"],"data_offsets":[0,2]}})", "xy"),
                "dimension 1 = the string '2'");
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":{"n":1},"data_offsets":[0,1]}})", "x"),
                "has shape an object of 1 members, not an array");
}

TEST(Safetensors, RejectsMalformedDataOffsets) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", "x"),
                "data_offsets an array of 3 elements; expected [begin, end], two non-negative integers");
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}})", "x"), "data_offsets");
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1e0]}})", "x"), "data_offsets");
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":"0-1"}})", "x"),
                "data_offsets the string '0-1'");
}

TEST(Safetensors, RejectsOffsetsNearUint64Max) {
  // end - begin matches U8[0] but the range lies past every file.
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[0],)"
                      R"("data_offsets":[18446744073709551615,18446744073709551615]}})",
                      ""),
                "past the end of the 0-byte data section");
}

// ---- the data section: tensors tile it exactly, in offset order.

TEST(Safetensors, RejectsBytesBetweenTensors) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                      R"("b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})",
                      "abcdef"),
                "data bytes [2, 4) before tensor 'b' belong to no tensor");
}

TEST(Safetensors, RejectsBytesBeforeTheFirstTensor) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})", "abc"),
                "data bytes [0, 1) before tensor 'a' belong to no tensor");
}

TEST(Safetensors, RejectsBytesAfterTheLastTensor) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "abcd"),
                "data bytes [2, 4) at the end of the file belong to no tensor");
  ExpectInvalid(Frame("{}", "x"), "data bytes [0, 1) at the end of the file belong to no tensor");
}

TEST(Safetensors, RejectsTwoTensorsOnTheSameBytes) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                      R"("b":{"dtype":"I16","shape":[1],"data_offsets":[0,2]}})",
                      "ab"),
                "overlaps tensor 'a'");
}

TEST(Safetensors, AcceptsTensorsListedOutOfOffsetOrderAndEmptyOnes) {
  // JSON order means nothing; a zero-size tensor takes no bytes.
  absl::StatusOr<SafetensorsFile> f =
      SafetensorsFile::Parse(Frame(R"({"z":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                                   R"("e":{"dtype":"F32","shape":[0,7],"data_offsets":[2,2]},)"
                                   R"("a":{"dtype":"I16","shape":[],"data_offsets":[2,4]}})",
                                   "abcd"),
                             "mem");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->Find("z")->data, "ab");
  EXPECT_EQ(f->Find("a")->data, "cd");
  EXPECT_EQ(f->Find("a")->numel(), 1);
  EXPECT_TRUE(f->Find("e")->data.empty());
  EXPECT_EQ(f->Find("e")->numel(), 0);
}

// ---- the header itself.

TEST(Safetensors, RejectsHeaderLengthBelowTwo) {
  std::string bytes(9, '\0');
  bytes[0] = 1;
  bytes[8] = '{';
  ExpectInvalid(bytes, "header length 1 is shorter than the smallest header, {} (2 bytes)");
  ExpectInvalid(std::string(8, '\0'), "header length 0 is shorter");
}

TEST(Safetensors, RejectsHeaderLengthOverTheFormatLimit) {
  std::string bytes = Frame("{}", "");
  const uint64_t n = kMaxSafetensorsHeaderBytes + 1;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  ExpectInvalid(bytes, "header length 100000001 exceeds the format's limit of 100000000 bytes");
}

TEST(Safetensors, RejectsATensorNamedTwice) {
  ExpectInvalid(Frame(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                      R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                      "xy"),
                "the header names 'a' twice");
}

TEST(Safetensors, RejectsTensorThatIsNotAnObject) {
  ExpectInvalid(Frame(R"({"a":[1,2]})", ""), "tensor 'a' is an array of 2 elements, not an object");
}

TEST(Safetensors, DeeplyNestedHeaderIsRefusedWithoutRecursion) {
  // A value nested 200,000 deep: messages describe it by kind, never dump it.
  const int depth = 200000;
  const std::string header = R"({"a":{"dtype":"U8","data_offsets":[0,0],"shape":)" + std::string(depth, '[') +
                             std::string(depth, ']') + "}}";
  ExpectInvalid(Frame(header, ""), "tensor 'a' has dimension 0 = an array of 1 elements");
}

TEST(Safetensors, NamesInMessagesAreEscapedAndBounded) {
  // The JSON name "evil\n\"name" followed by 10,000 x: a newline and a quote
  // that must not reach a log raw, and a length that must not either.
  const std::string header = R"({"evil\n\"name)" + std::string(10000, 'x') +
                             R"(":{"dtype":"NOPE","shape":[1],"data_offsets":[0,1]}})";
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Parse(Frame(header, "x"), "test.safetensors");
  ASSERT_FALSE(f.ok());
  const std::string message(f.status().message());
  EXPECT_NE(message.find(R"(tensor 'evil\n\"name)"), std::string::npos) << message;
  EXPECT_NE(message.find("(10010 bytes)"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << "a raw newline from the file reached the message";
  EXPECT_LT(message.size(), 600u) << message;
}

TEST(Safetensors, WriterRefusesShapesThatOverflow) {
  SafetensorsWriter w;
  absl::Status s = w.Add("big", "U8", {int64_t{1} << 32, int64_t{1} << 32}, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("more than 2^63 - 1 bytes"), std::string::npos) << s;
  EXPECT_EQ(w.Add("neg", "U8", {-1}, "").code(), absl::StatusCode::kInvalidArgument);
}

TEST(Safetensors, ScalarsAndEmptyTensorsRoundTrip) {
  SafetensorsWriter w;
  const float pi = 3.25f;
  ASSERT_TRUE(w.Add("s", "F32", {}, std::string_view(reinterpret_cast<const char*>(&pi), 4)).ok());
  ASSERT_TRUE(w.Add("e", "BF16", {0, 512}, "").ok());
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Parse(w.Serialize(), "mem");
  ASSERT_TRUE(f.ok()) << f.status();
  absl::StatusOr<float> s = f->GetScalarF32("s");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, pi);
  EXPECT_EQ(f->Find("e")->shape, (std::vector<int64_t>{0, 512}));
}

TEST(Safetensors, MissingFileIsNotFound) {
  EXPECT_EQ(SafetensorsFile::Read("/nonexistent/file.safetensors").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace mlakv
