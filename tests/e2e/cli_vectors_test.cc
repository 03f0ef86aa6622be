// Every file of ../shared/vectors appended through the `mlakv` CLI to its own
// layer of one sequence, exported back with `mlakv export`, byte for byte
// against the file's expect_* tensors; on --device cpu, and on cuda:0 (label
// gpu, skipped when no GPU is visible).
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "client/safetensors_file.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/e2e_fixture.h"
#include "tests/testing/vector_files.h"

namespace mlakv::e2e {
namespace {

class CliVectorRoundTrip : public E2eTest, public ::testing::WithParamInterface<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() != "cpu" && !testing::HaveCuda()) {
      GTEST_SKIP() << "no CUDA device visible; " << GetParam() << " needs one";
    }
    files_ = testing::VectorFileNames();
    ASSERT_FALSE(files_.empty()) << "no *.safetensors in " << testing::VectorsDir();
    StartServer(GetParam(), std::max<uint32_t>(kLayers, files_.size()));
  }
  std::vector<std::string> files_;
};

TEST_P(CliVectorRoundTrip, AppendThenExportIsByteExact) {
  const std::string sequence = "vectors";
  for (size_t layer = 0; layer < files_.size(); ++layer) {
    const CommandResult r = server_->RunCli({"append", "--sequence", sequence, "--layer", std::to_string(layer),
                                             "--input", testing::VectorsDir() + "/" + files_[layer], "--json"});
    ASSERT_EQ(r.exit_code, 0) << files_[layer] << ": " << r.Describe() << server_->Log();
    const nlohmann::json response = nlohmann::json::parse(r.out);
    EXPECT_EQ(response["sequence"]["layer_lengths"][layer].get<uint32_t>(),
              testing::LoadVectorCase(files_[layer]).rows)
        << r.out;
  }
  absl::StatusOr<v1::Sequence> seq = client_->GetSequence("", sequence);
  ASSERT_TRUE(seq.ok()) << seq.status();

  for (size_t layer = 0; layer < files_.size(); ++layer) {
    SCOPED_TRACE(files_[layer]);
    testing::VectorCase c = testing::LoadVectorCase(files_[layer]);
    const std::string out = absl::StrCat(server_->scratch_dir(), "/layer", layer, ".safetensors");
    const CommandResult r = server_->RunCli(
        {"export", "--sequence", sequence, "--layer", std::to_string(layer), "--output", out});
    ASSERT_EQ(r.exit_code, 0) << r.Describe();
    std::string problem;
    const QuantizedRows got = ReadExport(out, &problem);
    ASSERT_EQ(problem, "");
    EXPECT_EQ(testing::DescribeMismatch(c.expect, got), "");

    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Read(out);
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ(file->GetScalarF32("ckv_scale").value_or(-1), c.ckv_scale);
    EXPECT_EQ(file->GetScalarF32("kpe_scale").value_or(-1), c.kpe_scale);
    EXPECT_EQ(file->metadata().at("page_size"), std::to_string(kPageSize));
    absl::StatusOr<const SafetensorsFile::Tensor*> indices = file->Get("kv_indices", {"I32"}, 1);
    ASSERT_TRUE(indices.ok()) << indices.status();
    std::vector<int32_t> kv_indices((*indices)->numel());
    std::memcpy(kv_indices.data(), (*indices)->data.data(), (*indices)->data.size());
    EXPECT_EQ(kv_indices, std::vector<int32_t>(seq->kv_indices().begin(), seq->kv_indices().end()));
  }
}

INSTANTIATE_TEST_SUITE_P(Device, CliVectorRoundTrip, ::testing::Values("cpu", "cuda:0"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param == "cpu" ? std::string("Cpu") : std::string("Cuda");
                         });

}  // namespace
}  // namespace mlakv::e2e
