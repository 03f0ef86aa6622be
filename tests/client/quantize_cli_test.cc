// `mlakv quantize` as a user runs it: the real binary on every vector file,
// its output file compared byte for byte, and its refusals of bad input.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "client/safetensors_file.h"
#include "gtest/gtest.h"
#include "tests/testing/vector_files.h"

namespace mlakv {
namespace {

struct Result {
  int exit_code;
  std::string output;  // stdout + stderr
};

// The binary under test: $MLAKV_CLI (a bundled copy on the GPU machine), else the build's.
std::string Cli() {
  const char* env = std::getenv("MLAKV_CLI");
  return env != nullptr && *env != '\0' ? env : MLAKV_CLI;
}

Result RunCli(const std::string& args) {
  const std::string cmd = Cli() + " " + args + " 2>&1";
  Result r{-1, ""};
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("mlakv_cli_test_" + std::to_string(getpid()) + "_" + name)).string();
}

void ExpectFileMatchesVector(const std::string& out_path, const testing::VectorCase& c) {
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Read(out_path);
  ASSERT_TRUE(f.ok()) << f.status();
  QuantizedRows got;
  got.rows = c.rows;
  for (auto [name, dst] : {std::pair{"ckv_packed", &got.ckv_packed}, {"ckv_sf", &got.ckv_sf}, {"kpe", &got.kpe}}) {
    const SafetensorsFile::Tensor* t = f->Find(name);
    ASSERT_NE(t, nullptr) << name;
    dst->assign(t->data.begin(), t->data.end());
  }
  EXPECT_EQ(f->Find("ckv_packed")->dtype, "U8");
  EXPECT_EQ(f->Find("ckv_sf")->dtype, "F8_E4M3");
  EXPECT_EQ(f->Find("kpe")->dtype, "F8_E4M3");
  EXPECT_EQ(f->Find("kpe")->shape, (std::vector<int64_t>{c.rows, 64}));
  EXPECT_EQ(testing::DescribeMismatch(c.expect, got), "");
}

class QuantizeCliTest : public ::testing::TestWithParam<std::string> {};

#if MLAKV_CLI_TEST_CUDA
// Built as its own binary, labelled gpu.
TEST_P(QuantizeCliTest, CudaReproducesVectorFile) {
  if (!testing::HaveCuda()) GTEST_SKIP() << "no CUDA device visible: GPU test not run";
  const testing::VectorCase c = testing::LoadVectorCase(GetParam());
  const std::string out = TempPath("cuda_" + GetParam());
  const Result r = RunCli("quantize --device cuda --input " + testing::VectorsDir() + "/" + GetParam() + " --output " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("on cuda:0"), std::string::npos) << r.output;
  ExpectFileMatchesVector(out, c);
  std::filesystem::remove(out);
}

#else

TEST_P(QuantizeCliTest, CpuReproducesVectorFile) {
  const testing::VectorCase c = testing::LoadVectorCase(GetParam());
  const std::string out = TempPath(GetParam());
  const Result r = RunCli("quantize --device cpu --input " + testing::VectorsDir() + "/" + GetParam() + " --output " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("quantized " + std::to_string(c.rows) + " rows on cpu"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ckv rel L2 error"), std::string::npos) << r.output;
  ExpectFileMatchesVector(out, c);
  std::filesystem::remove(out);
}

TEST(QuantizeCli, FlagScalesOverrideFileScales) {
  const std::string in = testing::VectorsDir() + "/" + testing::VectorFileNames().at(0);
  const std::string a = TempPath("a"), b = TempPath("b");
  ASSERT_EQ(RunCli("quantize --device cpu --input " + in + " --output " + a).exit_code, 0);
  const Result r = RunCli("quantize --device cpu --ckv_scale 0.125 --kpe_scale 3 --input " + in + " --output " + b);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto fa = SafetensorsFile::Read(a), fb = SafetensorsFile::Read(b);
  ASSERT_TRUE(fa.ok() && fb.ok());
  EXPECT_NE(fa->Find("ckv_sf")->data, fb->Find("ckv_sf")->data);
  EXPECT_EQ(fb->metadata().at("ckv_scale"), "0.125");
  std::filesystem::remove(a);
  std::filesystem::remove(b);
}

TEST(QuantizeCli, RejectsBadScaleFlag) {
  const std::string in = testing::VectorsDir() + "/" + testing::VectorFileNames().at(0);
  const Result r = RunCli("quantize --device cpu --ckv_scale -1 --input " + in + " --output " + TempPath("x"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("ckv_scale -1 is not a positive normal float32"), std::string::npos) << r.output;
}

TEST(QuantizeCli, RefusesFileWithoutScalesUnlessFlagsGiveThem) {
  // A row file with ckv/kpe only.
  SafetensorsWriter w;
  ASSERT_TRUE(w.Add("ckv", "BF16", {1, 512}, std::string(1024, '\x3f')).ok());
  ASSERT_TRUE(w.Add("kpe", "BF16", {1, 64}, std::string(128, '\x3f')).ok());
  const std::string in = TempPath("noscale.safetensors"), out = TempPath("noscale_out");
  ASSERT_TRUE(w.Write(in).ok());
  Result r = RunCli("quantize --device cpu --input " + in + " --output " + out);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--ckv_scale"), std::string::npos) << r.output;
  r = RunCli("quantize --device cpu --ckv_scale 1 --kpe_scale 1 --input " + in + " --output " + out);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::filesystem::remove(in);
  std::filesystem::remove(out);
}

TEST(QuantizeCli, CorruptFileGetsAClearErrorNotACrash) {
  const std::string in = TempPath("corrupt.safetensors");
  std::ofstream(in, std::ios::binary) << std::string("\x10\x00\x00\x00\x00\x00\x00\x00{\"ckv\":[1,2,3]}  ", 24);
  const Result r = RunCli("quantize --device cpu --input " + in + " --output " + TempPath("y"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("not a valid safetensors file"), std::string::npos) << r.output;
  std::filesystem::remove(in);
}

// A scale declared [2^32, 2^32] in 0 bytes: the element count used to wrap to
// 0 and "match" the empty byte range, and the file was taken.
TEST(QuantizeCli, ShapeWhoseSizeOverflowsIsRefused) {
  const std::string header =
      R"({"ckv":{"dtype":"BF16","shape":[1,512],"data_offsets":[0,1024]},)"
      R"("kpe":{"dtype":"BF16","shape":[1,64],"data_offsets":[1024,1152]},)"
      R"("ckv_scale":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[1152,1152]}})";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  bytes += header + std::string(1152, '\x3f');
  const std::string in = TempPath("overflow.safetensors");
  std::ofstream(in, std::ios::binary) << bytes;
  const Result r = RunCli("quantize --device cpu --kpe_scale 1 --input " + in + " --output " + TempPath("w"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("tensor 'ckv_scale' has shape [4294967296, 4294967296], more than 2^63 - 1 elements"),
            std::string::npos)
      << r.output;
  std::filesystem::remove(in);
}

// ckv [0, 512]: the row file's copies used to memcpy into an empty vector's
// null data() (UBSan: invalid-null-argument, client/row_file.cc).
TEST(QuantizeCli, FileWithoutRowsGetsAClearError) {
  SafetensorsWriter w;
  ASSERT_TRUE(w.Add("ckv", "BF16", {0, 512}, "").ok());
  ASSERT_TRUE(w.Add("kpe", "BF16", {0, 64}, "").ok());
  const std::string in = TempPath("no_rows.safetensors");
  ASSERT_TRUE(w.Write(in).ok());
  const Result r = RunCli("quantize --device cpu --ckv_scale 1 --kpe_scale 1 --input " + in + " --output " + TempPath("v"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("holds no rows (ckv [0, 512]); nothing to quantize"), std::string::npos) << r.output;
  std::filesystem::remove(in);
}

TEST(QuantizeCli, WrongShapeIsRefused) {
  SafetensorsWriter w;
  ASSERT_TRUE(w.Add("ckv", "BF16", {1, 256}, std::string(512, '\x3f')).ok());
  ASSERT_TRUE(w.Add("kpe", "BF16", {1, 64}, std::string(128, '\x3f')).ok());
  const std::string in = TempPath("shape.safetensors");
  ASSERT_TRUE(w.Write(in).ok());
  const Result r = RunCli("quantize --device cpu --ckv_scale 1 --kpe_scale 1 --input " + in + " --output " + TempPath("z"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("expected ckv [N, 512]"), std::string::npos) << r.output;
  std::filesystem::remove(in);
}

TEST(QuantizeCli, MissingArgumentsIsUsageError) {
  const Result r = RunCli("quantize");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("usage: mlakv quantize"), std::string::npos) << r.output;
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// `mlakv make-rows` writes what `quantize` (and `append`) read, the same
// bytes for the same seed, and refuses what it cannot make.
TEST(MakeRowsCli, WritesARowFileQuantizeReads) {
  const std::string rows = TempPath("made.safetensors"), again = TempPath("again.safetensors"),
                    q = TempPath("made_q.safetensors");
  Result r = RunCli("make-rows --rows 40 --dtype f16 --seed 5 --output " + rows);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("wrote 40 random f16 rows"), std::string::npos) << r.output;
  ASSERT_EQ(RunCli("make-rows --rows 40 --dtype f16 --seed 5 --output " + again).exit_code, 0);
  EXPECT_EQ(Slurp(rows), Slurp(again));
  r = RunCli("quantize --device cpu --input " + rows + " --output " + q);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Read(q);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->Find("kpe")->shape, (std::vector<int64_t>{40, 64}));
  for (const std::string& p : {rows, again, q}) std::filesystem::remove(p);
}

TEST(MakeRowsCli, BadFlagsAreUsageErrors) {
  for (const char* args : {"make-rows --output x", "make-rows --rows 0 --output x", "make-rows --rows 3",
                           "make-rows --rows 3 --dtype fp8 --output x", "make-rows --rows 3 --amax 0 --output x",
                           "make-rows extra --rows 3 --output x"}) {
    const Result r = RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find("usage: mlakv make-rows"), std::string::npos) << r.output;
  }
  const Result r = RunCli("make-rows --rows 3 --output /nonexistent-dir/x.safetensors");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("/nonexistent-dir/x.safetensors"), std::string::npos) << r.output;
}

#endif

INSTANTIATE_TEST_SUITE_P(AllFiles, QuantizeCliTest, ::testing::ValuesIn(testing::VectorFileNames()),
                         testing::VectorTestName);

}  // namespace
}  // namespace mlakv
