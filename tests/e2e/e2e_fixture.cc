#include "tests/e2e/e2e_fixture.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "client/load_generator.h"
#include "client/safetensors_file.h"
#include "kernels/tensor_view.h"
#include "tests/testing/vector_files.h"

namespace mlakv::e2e {

std::string TestPoolsConfig(uint32_t num_layers) {
  return absl::StrCat("pools { name: \"default\" num_layers: ", num_layers, " page_size: ", kPageSize,
                      " num_pages: ", kPages, " }\n", "pools { name: \"", kTinyPool, "\" num_layers: 2 page_size: ",
                      kPageSize, " num_pages: ", kTinyPages, " }\n");
}

std::string SuiteDevice() {
  const char* device = std::getenv("MLAKV_E2E_DEVICE");
  return device != nullptr && *device != '\0' ? device : "cpu";
}

void E2eTest::SetUp() {
  if (SuiteDevice() != "cpu" && !testing::HaveCuda()) {
    GTEST_SKIP() << "no CUDA device visible; MLAKV_E2E_DEVICE=" << SuiteDevice() << " needs one";
  }
  StartServer(SuiteDevice());
}

// The server must end cleanly on SIGTERM: under ASan, LeakSanitizer and
// TSan (scripts/sanitize.sh) a report in the server process shows only as
// its exit status and in its log, so this is where a test sees it.
void E2eTest::TearDown() {
  if (server_ == nullptr) return;
  client_.reset();
  absl::StatusOr<int> code = server_->Stop(absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << server_->Log();
  EXPECT_EQ(*code, 0) << "mlakv-server exited with " << *code << " after SIGTERM (a sanitizer report?):\n"
                      << server_->Log();
}

void E2eTest::StartServer(const std::string& device, uint32_t num_layers) {
  ServerUnderTest::Options options;
  options.device = device;
  options.config_text = TestPoolsConfig(num_layers);
  options.extra_args = server_args_;
  absl::StatusOr<std::unique_ptr<ServerUnderTest>> server = ServerUnderTest::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  server_ = std::move(*server);
  client_ = server_->NewClient();
}

uint32_t E2eTest::PagesUsed(const std::string& pool) {
  absl::StatusOr<v1::Pool> info = client_->GetPool(pool);
  EXPECT_TRUE(info.ok()) << info.status();
  if (!info.ok()) return 0;
  EXPECT_EQ(info->pages_free() + info->pages_used(), info->pages_total()) << info->DebugString();
  return info->pages_used();
}

TestRows TestRows::Random(uint32_t rows, uint64_t seed) {
  return {rows, RandomRowBytes(size_t{rows} * 512, v1::ROW_DTYPE_BFLOAT16, 2 * seed),
          RandomRowBytes(size_t{rows} * 64, v1::ROW_DTYPE_BFLOAT16, 2 * seed + 1)};
}

TestRows TestRows::Slice(uint32_t first, uint32_t count) const {
  return {count, ckv.substr(size_t{first} * 1024, size_t{count} * 1024),
          kpe.substr(size_t{first} * 128, size_t{count} * 128)};
}

QuantizedRows TestRows::Expected() const {
  std::vector<uint16_t> c(ckv.size() / 2), k(kpe.size() / 2);
  std::memcpy(c.data(), ckv.data(), ckv.size());
  std::memcpy(k.data(), kpe.data(), kpe.size());
  absl::StatusOr<QuantizedRows> q =
      QuantizeRows(TensorView::Contiguous(c.data(), DType::kBFloat16, {rows, 512}),
                   TensorView::Contiguous(k.data(), DType::kBFloat16, {rows, 64}), kCkvScale, kKpeScale,
                   KernelDevice::kCpu);
  EXPECT_TRUE(q.ok()) << q.status();
  return q.ok() ? *q : QuantizedRows{};
}

QuantizedRows AsQuantized(const StoredLayer& stored) {
  QuantizedRows q;
  q.rows = stored.count;
  q.ckv_packed.assign(stored.ckv_packed.begin(), stored.ckv_packed.end());
  q.ckv_sf.assign(stored.ckv_sf.begin(), stored.ckv_sf.end());
  q.kpe.assign(stored.kpe.begin(), stored.kpe.end());
  return q;
}

QuantizedRows ReadExport(const std::string& path, std::string* problem) {
  QuantizedRows q;
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Read(path);
  if (!file.ok()) {
    *problem = file.status().ToString();
    return q;
  }
  auto copy = [&](const char* name, const char* dtype, int64_t width, std::vector<uint8_t>& dst) {
    absl::StatusOr<const SafetensorsFile::Tensor*> t = file->Get(name, {dtype}, 2);
    if (!t.ok()) {
      *problem += t.status().ToString() + "\n";
      return;
    }
    if ((*t)->shape[1] != width) *problem += absl::StrCat(name, " has width ", (*t)->shape[1], "\n");
    q.rows = (*t)->shape[0];
    dst.assign((*t)->data.begin(), (*t)->data.end());
  };
  copy("ckv_packed", "U8", 256, q.ckv_packed);
  copy("ckv_sf", "F8_E4M3", 32, q.ckv_sf);
  copy("kpe", "F8_E4M3", 64, q.kpe);
  return q;
}

AppendRows OneLayerAppend(const std::string& pool, const std::string& sequence, uint32_t layer, uint32_t start,
                          const TestRows& rows) {
  AppendRows append;
  append.pool = pool;
  append.sequence = sequence;
  append.start = start;
  append.rows = rows.rows;
  append.dtype = v1::ROW_DTYPE_BFLOAT16;
  append.layers.push_back(rows.ForLayer(layer));
  return append;
}

AppendRows BothLayersAppend(const std::string& pool, const std::string& sequence, uint32_t start,
                            const TestRows& rows) {
  AppendRows append = OneLayerAppend(pool, sequence, 0, start, rows);
  append.layers.push_back(rows.ForLayer(1));
  return append;
}

}  // namespace mlakv::e2e
