// Regions through the C++ client and the `mlakv` CLI against the real server
// started with --allow_ipc: register / list / unregister a POSIX
// shared-memory object, appends that name it (packed and strided rows, all
// rows from regions or ckv from a region and kpe as bytes over several
// messages) store exactly what the same rows sent as bytes store (compared
// through ReadSequence and through `mlakv export` files), and the refusals:
// no --allow_ipc (PERMISSION_DENIED printed), unknown region (NOT_FOUND),
// out of range (OUT_OF_RANGE), bad flags (exit 2).
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/e2e_fixture.h"
#include "tests/testing/shm_object.h"
#include "tests/testing/vector_files.h"

namespace mlakv::e2e {
namespace {

constexpr uint64_t kCkvRow = 512 * 2;
constexpr uint64_t kKpeRow = 64 * 2;

using testing::ShmObject;

class RegionE2e : public E2eTest {
 protected:
  RegionE2e() { server_args_ = {"--allow_ipc"}; }

  // The raw bytes of `sequence` layer `layer` as QuantizedRows.
  QuantizedRows Stored(const std::string& sequence, uint32_t layer) {
    absl::StatusOr<StoredLayer> stored = client_->ReadLayer("", sequence, layer);
    EXPECT_TRUE(stored.ok()) << stored.status();
    return stored.ok() ? AsQuantized(*stored) : QuantizedRows{};
  }
};

// ---- C++ client ----

TEST_F(RegionE2e, ClientRegistersListsAndUnregisters) {
  ShmObject shm(1 << 20);
  absl::StatusOr<v1::Region> region = client_->RegisterShmRegion("prefill-0", shm.name(), 4096, 65536);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ(region->name(), "prefill-0");
  EXPECT_EQ(region->kind(), v1::REGION_KIND_SHM);
  EXPECT_EQ(region->byte_size(), 65536u);
  EXPECT_EQ(region->shm_name(), shm.name());
  EXPECT_EQ(region->shm_offset(), 4096u);
  // Size 0: to the end of the object.
  absl::StatusOr<v1::Region> rest = client_->RegisterShmRegion("rest", shm.name(), 8192);
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(rest->byte_size(), (1u << 20) - 8192);

  absl::StatusOr<std::vector<v1::Region>> listed = client_->ListRegions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].name(), "prefill-0");  // ordered by name
  EXPECT_EQ((*listed)[1].name(), "rest");
  EXPECT_EQ((*listed)[0].appends_in_flight(), 0u);

  absl::StatusOr<v1::Region> duplicate = client_->RegisterShmRegion("rest", shm.name());
  EXPECT_EQ(duplicate.status().code(), absl::StatusCode::kAlreadyExists) << duplicate.status();

  absl::StatusOr<uint32_t> in_flight = client_->UnregisterRegion("prefill-0");
  ASSERT_TRUE(in_flight.ok()) << in_flight.status();
  EXPECT_EQ(*in_flight, 0u);
  EXPECT_EQ(client_->UnregisterRegion("prefill-0").status().code(), absl::StatusCode::kNotFound);
  listed = client_->ListRegions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].name(), "rest");
}

TEST_F(RegionE2e, ClientAppendFromShmStoresTheBytesOfABytesAppend) {
  const TestRows rows = TestRows::Random(45, 31);  // 3 pages of 16
  // ckv packed at 4096; kpe strided (256 bytes per 128-byte row) after it.
  const uint64_t kpe_at = 4096 + 45 * kCkvRow;
  ShmObject shm(kpe_at + 45 * 256);
  shm.Put(4096, kCkvRow, rows.ckv, kCkvRow);
  shm.Put(kpe_at, 256, rows.kpe, kKpeRow);
  ASSERT_TRUE(client_->RegisterShmRegion("rows", shm.name()).ok());

  AppendRows by_ref = BothLayersAppend("", "by-ref", 0, rows);
  for (LayerBytes& layer : by_ref.layers) {
    layer.ckv = layer.kpe = {};
    layer.ckv_region = RegionRows{"rows", 4096, 0};
    layer.kpe_region = RegionRows{"rows", kpe_at, 256};
  }
  absl::StatusOr<v1::AppendResponse> response = client_->Append(by_ref);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->rows_written(), 2u * 45);
  ASSERT_TRUE(client_->Append(BothLayersAppend("", "by-bytes", 0, rows)).ok());
  const QuantizedRows expect = rows.Expected();
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    EXPECT_EQ(testing::DescribeMismatch(Stored("by-bytes", layer), Stored("by-ref", layer)), "") << layer;
    EXPECT_EQ(testing::DescribeMismatch(expect, Stored("by-ref", layer)), "") << layer;
  }
}

TEST_F(RegionE2e, ClientMixedBytesAndRegionOverSeveralMessages) {
  // ckv from the region, kpe as bytes; messages of 8 rows: each message's ref
  // must start 8 rows further on.
  const TestRows rows = TestRows::Random(40, 32);
  ShmObject shm(40 * kCkvRow);
  shm.Put(0, kCkvRow, rows.ckv, kCkvRow);
  ASSERT_TRUE(client_->RegisterShmRegion("ckv", shm.name()).ok());
  KvCacheClient::Options options = client_->options();
  options.append_message_bytes = 8 * kKpeRow * kLayers;  // only kpe bytes travel
  absl::StatusOr<std::unique_ptr<KvCacheClient>> small = KvCacheClient::Create(options);
  ASSERT_TRUE(small.ok()) << small.status();
  AppendRows append = BothLayersAppend("", "mixed", 0, rows);
  for (LayerBytes& layer : append.layers) {
    layer.ckv = {};
    layer.ckv_region = RegionRows{"ckv", 0, 0};
  }
  absl::StatusOr<v1::AppendResponse> response = (*small)->Append(append);
  ASSERT_TRUE(response.ok()) << response.status();
  const QuantizedRows expect = rows.Expected();
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    EXPECT_EQ(testing::DescribeMismatch(expect, Stored("mixed", layer)), "") << layer;
  }
}

TEST_F(RegionE2e, ClientRefusesMalformedRegionRowsBeforeSending) {
  const TestRows rows = TestRows::Random(4, 33);
  AppendRows append = OneLayerAppend("", "bad", 0, 0, rows);
  append.layers[0].ckv_region = RegionRows{"r", 0, 0};  // bytes and a region
  EXPECT_EQ(client_->Append(append).status().code(), absl::StatusCode::kInvalidArgument);
  append.layers[0].ckv = {};
  append.layers[0].ckv_region = RegionRows{"r", 0, kCkvRow - 2};  // stride below a row
  absl::Status s = client_->Append(append).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("stride"), absl::string_view::npos) << s;
  append.layers[0].ckv_region = RegionRows{"", 0, 0};
  EXPECT_EQ(client_->Append(append).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->GetSequence("", "bad").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(RegionE2e, ClientRefusalsCarryTheServerCodes) {
  const TestRows rows = TestRows::Random(4, 34);
  AppendRows append = OneLayerAppend("", "refused", 0, 0, rows);
  append.layers[0].ckv = append.layers[0].kpe = {};
  append.layers[0].ckv_region = RegionRows{"nope", 0, 0};
  append.layers[0].kpe_region = RegionRows{"nope", 8192, 0};
  absl::Status s = client_->Append(append).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("nope"), absl::string_view::npos) << s;

  ShmObject shm(4 * kCkvRow);
  ASSERT_TRUE(client_->RegisterShmRegion("small", shm.name()).ok());
  append.layers[0].ckv_region = RegionRows{"small", 0, 0};
  append.layers[0].kpe_region = RegionRows{"small", 4 * kCkvRow - kKpeRow, 0};  // 3 rows past the end
  s = client_->Append(append).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_EQ(client_->RegisterShmRegion("big", shm.name(), 0, 8 * kCkvRow).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(client_->RegisterShmRegion("gone", "/mlakv-e2e-no-such-object").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->RegisterCudaRegion("short", std::string(63, '\0'), 0, 1024).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->GetSequence("", "refused").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(PagesUsed(), 0u);
}

TEST_F(RegionE2e, ClientExportPool) {
  absl::StatusOr<v1::ExportPoolResponse> exported = client_->ExportPool("");
  if (SuiteDevice() == "cpu") {
    EXPECT_EQ(exported.status().code(), absl::StatusCode::kFailedPrecondition) << exported.status();
    return;
  }
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->num_pages(), kPages);
  EXPECT_EQ(exported->page_size(), kPageSize);
  ASSERT_EQ(exported->layers_size(), static_cast<int>(kLayers));
  EXPECT_EQ(exported->layers(0).ckv_cache().raw_handle().size(), 64u);
  EXPECT_EQ(exported->layers(0).kpe_cache().entry_stride_bytes(), 64u);
}

// ---- the mlakv CLI ----

TEST_F(RegionE2e, CliRegisterListUnregister) {
  ShmObject shm(1 << 16);
  CommandResult r = server_->RunCli(
      {"region", "register-shm", "--name", "cli-r", "--shm_name", shm.name(), "--offset", "4096", "--size", "8192"});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  EXPECT_NE(r.out.find("registered region cli-r: 8192 bytes, shm " + shm.name() + " +4096"), std::string::npos)
      << r.out;

  r = server_->RunCli({"regions"});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  EXPECT_NE(r.out.find("cli-r"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("8192"), std::string::npos) << r.out;

  r = server_->RunCli({"regions", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_EQ(j["regions"].size(), 1u) << r.out;
  EXPECT_EQ(j["regions"][0]["name"], "cli-r");
  EXPECT_EQ(j["regions"][0]["kind"], "REGION_KIND_SHM");
  EXPECT_EQ(j["regions"][0]["shm_name"], shm.name());
  EXPECT_EQ(j["regions"][0]["byte_size"], "8192");  // proto3 JSON: 64-bit integers are strings
  EXPECT_EQ(j["regions"][0]["shm_offset"], "4096");

  r = server_->RunCli({"region", "unregister", "--name", "cli-r", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  EXPECT_EQ(nlohmann::json::parse(r.out, nullptr, false)["appends_in_flight"], 0) << r.out;
  r = server_->RunCli({"regions"});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  EXPECT_NE(r.out.find("no regions registered"), std::string::npos) << r.out;

  r = server_->RunCli({"region", "unregister", "--name", "cli-r"});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_NE(r.err.find("mlakv region unregister: NOT_FOUND"), std::string::npos) << r.Describe();
}

TEST_F(RegionE2e, CliAppendFromRegionExportsTheBytesOfAFileAppend) {
  // A reference vector: its rows appended from a file and from a shm region
  // (ckv packed at an offset, kpe strided) export the same bytes, which are
  // the vector's expected ones.
  const std::string file = "f16_calibrated.safetensors";
  testing::VectorCase c = testing::LoadVectorCase(file);
  ASSERT_GT(c.rows, 1);
  const uint64_t n = static_cast<uint64_t>(c.rows), ckv_at = 512, kpe_at = ckv_at + n * kCkvRow;
  ShmObject shm(kpe_at + n * 192);
  shm.Put(ckv_at, kCkvRow, std::string(reinterpret_cast<const char*>(c.ckv.data()), n * kCkvRow), kCkvRow);
  shm.Put(kpe_at, 192, std::string(reinterpret_cast<const char*>(c.kpe.data()), n * kKpeRow), kKpeRow);

  CommandResult r = server_->RunCli({"region", "register-shm", "--name", "vec", "--shm_name", shm.name()});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  r = server_->RunCli({"append", "--sequence", "from-region", "--layer", "1", "--rows", std::to_string(n),
                       "--dtype", "f16", "--ckv_region", absl::StrCat("vec:", ckv_at), "--kpe_region",
                       absl::StrCat("vec:", kpe_at, ":192"), "--ckv_scale", absl::StrFormat("%.9g", c.ckv_scale),
                       "--kpe_scale", absl::StrFormat("%.9g", c.kpe_scale)});
  ASSERT_EQ(r.exit_code, 0) << r.Describe() << server_->Log();
  EXPECT_NE(r.out.find(absl::StrCat("appended ", n, " f16 rows (from regions)")), std::string::npos) << r.out;
  r = server_->RunCli({"append", "--sequence", "from-file", "--layer", "1", "--input",
                       testing::VectorsDir() + "/" + file});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();

  std::string problem;
  QuantizedRows exported[2];
  const char* sequences[2] = {"from-region", "from-file"};
  for (int i = 0; i < 2; ++i) {
    const std::string out = absl::StrCat(server_->scratch_dir(), "/", sequences[i], ".safetensors");
    r = server_->RunCli({"export", "--sequence", sequences[i], "--layer", "1", "--output", out});
    ASSERT_EQ(r.exit_code, 0) << r.Describe();
    exported[i] = ReadExport(out, &problem);
    ASSERT_EQ(problem, "") << sequences[i];
  }
  EXPECT_EQ(testing::DescribeMismatch(exported[1], exported[0]), "");
  EXPECT_EQ(testing::DescribeMismatch(c.expect, exported[0]), "");
}

TEST_F(RegionE2e, CliRefusalsPrintTheServerCode) {
  ShmObject shm(4 * kCkvRow);
  CommandResult r = server_->RunCli({"append", "--sequence", "s", "--layer", "0", "--rows", "4", "--ckv_region",
                                     "nope:0", "--kpe_region", "nope:4096", "--ckv_scale", "1", "--kpe_scale", "1"});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_NE(r.err.find("mlakv append: NOT_FOUND"), std::string::npos) << r.Describe();
  EXPECT_NE(r.err.find("nope"), std::string::npos) << r.Describe();

  r = server_->RunCli({"region", "register-shm", "--name", "small", "--shm_name", shm.name()});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  r = server_->RunCli({"append", "--sequence", "s", "--layer", "0", "--rows", "4", "--ckv_region", "small:0",
                       "--kpe_region", "small:4000", "--ckv_scale", "1", "--kpe_scale", "1"});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_NE(r.err.find("mlakv append: OUT_OF_RANGE"), std::string::npos) << r.Describe();

  r = server_->RunCli({"region", "register-shm", "--name", "big", "--shm_name", shm.name(), "--size", "1000000"});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_NE(r.err.find("mlakv region register-shm: OUT_OF_RANGE"), std::string::npos) << r.Describe();
  r = server_->RunCli({"region", "register-shm", "--name", "small", "--shm_name", shm.name()});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_NE(r.err.find("ALREADY_EXISTS"), std::string::npos) << r.Describe();

  // 64 bytes that are no handle: refused by CUDA where a GPU is visible, and
  // FAILED_PRECONDITION (no GPU) elsewhere; the server keeps serving.
  r = server_->RunCli({"region", "register-cuda", "--name", "c", "--handle_hex", std::string(128, '0'),
                       "--device_id", "0", "--size", "4096"});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_NE(r.err.find(testing::HaveCuda() ? "INVALID_ARGUMENT" : "FAILED_PRECONDITION"), std::string::npos)
      << r.Describe();
  EXPECT_EQ(PagesUsed(), 0u);
  EXPECT_EQ(server_->RunCli({"pools"}).exit_code, 0);
}

TEST_F(RegionE2e, CliUsageMistakesExitTwo) {
  const std::string handle_file = server_->scratch_dir() + "/handle.bin";
  { std::ofstream(handle_file, std::ios::binary) << std::string(10, 'x'); }
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"region"},
           {"region", "frobnicate", "--name", "x"},
           {"region", "register-shm", "--shm_name", "/x"},  // no --name
           {"region", "register-shm", "--name", "x"},       // no --shm_name
           {"region", "register-cuda", "--name", "x", "--handle_hex", "abc", "--device_id", "0", "--size", "1"},
           {"region", "register-cuda", "--name", "x", "--handle_hex", std::string(127, '0') + "g", "--device_id",
            "0", "--size", "1"},
           {"region", "register-cuda", "--name", "x", "--handle_file", handle_file, "--device_id", "0", "--size",
            "1"},
           {"region", "register-cuda", "--name", "x", "--handle_hex", std::string(128, '0'), "--size", "1"},
           {"region", "register-cuda", "--name", "x", "--handle_hex", std::string(128, '0'), "--device_id", "0"},
           {"regions", "extra"},
           {"export-pool", "extra"},
           {"append", "--sequence", "s", "--layer", "0", "--ckv_region", "r:0"},  // no --kpe_region
           {"append", "--sequence", "s", "--layer", "0", "--ckv_region", "r:0", "--kpe_region", "r:9"},  // no --rows
           {"append", "--sequence", "s", "--layer", "0", "--rows", "2", "--ckv_region", "r", "--kpe_region", "r:9"},
           {"append", "--sequence", "s", "--layer", "0", "--rows", "2", "--ckv_region", "r:-1", "--kpe_region",
            "r:9"},
           {"append", "--sequence", "s", "--layer", "0", "--rows", "2", "--ckv_region", ":0", "--kpe_region",
            "r:9"},
           {"append", "--sequence", "s", "--layer", "0", "--rows", "2", "--ckv_region", "r:0:x", "--kpe_region",
            "r:9"},
           {"append", "--sequence", "s", "--layer", "0", "--rows", "2", "--dtype", "f32", "--ckv_region", "r:0",
            "--kpe_region", "r:9"},
           {"append", "--sequence", "s", "--layer", "0", "--rows", "2", "--input", "x.safetensors", "--ckv_region",
            "r:0", "--kpe_region", "r:9"}}) {
    const CommandResult r = server_->RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << absl::StrJoin(args, " ") << ": " << r.Describe();
    EXPECT_NE(r.err.find("usage: mlakv"), std::string::npos) << r.Describe();
  }
}

TEST_F(RegionE2e, CliExportPool) {
  const CommandResult r = server_->RunCli({"export-pool"});
  if (SuiteDevice() == "cpu") {
    EXPECT_EQ(r.exit_code, 1) << r.Describe();
    EXPECT_NE(r.err.find("mlakv export-pool: FAILED_PRECONDITION"), std::string::npos) << r.Describe();
    return;
  }
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  EXPECT_NE(r.out.find("pool default on cuda:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("ckv_sf_cache"), std::string::npos) << r.out;
}

// ---- without --allow_ipc ----

class RegionE2eWithoutAllowIpc : public E2eTest {};

TEST_F(RegionE2eWithoutAllowIpc, EveryRegionCommandIsPermissionDenied) {
  ShmObject shm(1 << 16);
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"regions"},
           {"region", "register-shm", "--name", "r", "--shm_name", shm.name()},
           {"region", "unregister", "--name", "r"},
           {"region", "register-cuda", "--name", "c", "--handle_hex", std::string(128, '0'), "--device_id", "0",
            "--size", "4096"},
           {"export-pool"},
           {"append", "--sequence", "s", "--layer", "0", "--rows", "1", "--ckv_region", "r:0", "--kpe_region",
            "r:1024", "--ckv_scale", "1", "--kpe_scale", "1"}}) {
    const CommandResult r = server_->RunCli(args);
    EXPECT_EQ(r.exit_code, 1) << absl::StrJoin(args, " ") << ": " << r.Describe();
    EXPECT_NE(r.err.find("PERMISSION_DENIED"), std::string::npos) << r.Describe();
    EXPECT_NE(r.err.find("--allow_ipc"), std::string::npos) << r.Describe();
  }
  EXPECT_EQ(client_->ListRegions().status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(client_->RegisterShmRegion("r", shm.name()).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(PagesUsed(), 0u);
}

}  // namespace
}  // namespace mlakv::e2e
