#include "tests/testing/vector_files.h"

#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kernels/nvfp4_format.h"

namespace mlakv::testing {

std::string VectorsDir() {
  const char* env = std::getenv("MLAKV_VECTORS_DIR");
  return env != nullptr && *env != '\0' ? env : MLAKV_VECTORS_DIR;
}

std::vector<std::string> VectorFileNames() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(VectorsDir(), ec)) {
    if (e.path().extension() == ".safetensors") names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

VectorCase LoadVectorCase(const std::string& file_name) {
  VectorCase c;
  c.name = file_name;
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Read(VectorsDir() + "/" + file_name);
  EXPECT_TRUE(f.ok()) << f.status();
  if (!f.ok()) return c;
  auto copy = [&](const char* name, auto& dst) {
    const SafetensorsFile::Tensor* t = f->Find(name);
    EXPECT_NE(t, nullptr) << file_name << " lacks " << name;
    if (t == nullptr) return;
    dst.resize(t->data.size() / sizeof(dst[0]));
    std::memcpy(dst.data(), t->data.data(), t->data.size());
  };
  const SafetensorsFile::Tensor* ckv = f->Find("ckv");
  EXPECT_NE(ckv, nullptr);
  if (ckv == nullptr) return c;
  c.dtype = ckv->dtype == "BF16" ? DType::kBFloat16 : DType::kFloat16;
  c.rows = ckv->shape[0];
  copy("ckv", c.ckv);
  copy("kpe", c.kpe);
  c.ckv_scale = f->GetScalarF32("ckv_scale").value();
  c.kpe_scale = f->GetScalarF32("kpe_scale").value();
  c.expect.rows = c.rows;
  copy("expect_ckv_packed", c.expect.ckv_packed);
  copy("expect_ckv_sf", c.expect.ckv_sf);
  copy("expect_kpe", c.expect.kpe);
  return c;
}

std::string DescribeMismatch(const QuantizedRows& expect, const QuantizedRows& got) {
  if (expect.rows != got.rows) return absl::StrFormat("rows %d != %d", expect.rows, got.rows);
  const std::tuple<const char*, const std::vector<uint8_t>*, const std::vector<uint8_t>*, int> parts[] = {
      {"ckv_packed", &expect.ckv_packed, &got.ckv_packed, format::kCkvPackedBytes},
      {"ckv_sf", &expect.ckv_sf, &got.ckv_sf, format::kCkvSfBytes},
      {"kpe", &expect.kpe, &got.kpe, format::kKpeBytes}};
  for (const auto& [name, e, g, width] : parts) {
    if (e->size() != g->size()) return absl::StrFormat("%s size %d != %d", name, e->size(), g->size());
    for (size_t i = 0; i < e->size(); ++i) {
      if ((*e)[i] != (*g)[i]) {
        return absl::StrFormat("%s row %d byte %d: expected 0x%02x, got 0x%02x", name, i / width, i % width, (*e)[i],
                               (*g)[i]);
      }
    }
  }
  return "";
}

bool HaveCuda() { return CudaDeviceCount() > 0; }

std::string VectorTestName(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param.substr(0, info.param.find('.'));
  for (char& ch : n) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  return n;
}

}  // namespace mlakv::testing
