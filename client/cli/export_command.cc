// mlakv export: the stored bytes of one layer of a sequence, in token order,
// as a safetensors file with the names `quantize` writes (ckv_packed U8
// [T,256], ckv_sf F8_E4M3 [T,32], kpe F8_E4M3 [T,64]), plus the page table
// `kv_indices` I32 [P] and the layer's scales as F32 [1] tensors; metadata
// repeats scales, page size and lengths as text.
#include <cstdio>
#include <cstring>

#include "absl/flags/flag.h"
#include "common/status_macros.h"
#include "absl/strings/str_format.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"
#include "client/row_file.h"
#include "nlohmann/json.hpp"

namespace mlakv::cli {
namespace {

constexpr char kUsage[] = "export --sequence ID --layer L --output FILE [--pool P] [--server ADDR] [--json]";

std::vector<uint8_t> ToVector(const std::string& bytes) { return {bytes.begin(), bytes.end()}; }

std::string_view Bytes(const void* data, size_t size) { return {static_cast<const char*>(data), size}; }

absl::Status WriteExport(const std::string& path, const StoredLayer& stored, const v1::Sequence& seq) {
  QuantizedRows rows;
  rows.rows = stored.count;
  rows.ckv_packed = ToVector(stored.ckv_packed);
  rows.ckv_sf = ToVector(stored.ckv_sf);
  rows.kpe = ToVector(stored.kpe);
  SafetensorsWriter writer;
  MLAKV_RETURN_IF_ERROR(AddQuantizedTensors(rows, writer));
  const std::vector<int32_t> kv_indices(seq.kv_indices().begin(), seq.kv_indices().end());
  MLAKV_RETURN_IF_ERROR(writer.Add("kv_indices", "I32", {static_cast<int64_t>(kv_indices.size())}, Bytes(kv_indices.data(), kv_indices.size() * sizeof(int32_t))));
  MLAKV_RETURN_IF_ERROR(writer.Add("ckv_scale", "F32", {1}, Bytes(&stored.ckv_scale, sizeof(float))));
  MLAKV_RETURN_IF_ERROR(writer.Add("kpe_scale", "F32", {1}, Bytes(&stored.kpe_scale, sizeof(float))));
  writer.SetMetadata("pool", seq.pool());
  writer.SetMetadata("sequence", seq.id());
  writer.SetMetadata("layer", absl::StrFormat("%u", stored.layer));
  writer.SetMetadata("tokens", absl::StrFormat("%u", stored.count));
  writer.SetMetadata("page_size", absl::StrFormat("%u", seq.page_size()));
  writer.SetMetadata("sequence_length", absl::StrFormat("%u", seq.length()));
  writer.SetMetadata("last_page_len", absl::StrFormat("%u", seq.last_page_len()));
  writer.SetMetadata("ckv_scale", absl::StrFormat("%.9g", stored.ckv_scale));
  writer.SetMetadata("kpe_scale", absl::StrFormat("%.9g", stored.kpe_scale));
  return writer.Write(path);
}

}  // namespace

int RunExport(const std::vector<std::string>& args) {
  const std::string sequence = absl::GetFlag(FLAGS_sequence), output = absl::GetFlag(FLAGS_output);
  const std::string pool = absl::GetFlag(FLAGS_pool);
  const int32_t layer = absl::GetFlag(FLAGS_layer);
  if (!args.empty()) return UsageError(kUsage, "mlakv export takes no positional arguments");
  if (sequence.empty() || output.empty() || layer < 0) {
    return UsageError(kUsage, "mlakv export: --sequence, --layer (>= 0) and --output are required");
  }
  absl::StatusOr<Connection> client = ConnectForSequence(sequence);
  if (!client.ok()) return Fail("export", client.status());
  absl::StatusOr<StoredLayer> stored = (*client)->ReadLayer(pool, sequence, static_cast<uint32_t>(layer));
  if (!stored.ok()) return Fail("export", stored.status());
  absl::StatusOr<v1::Sequence> seq = (*client)->GetSequence(pool, sequence);
  if (!seq.ok()) return Fail("export", seq.status());
  if (absl::Status s = WriteExport(output, *stored, *seq); !s.ok()) return Fail("export", s);

  if (absl::GetFlag(FLAGS_json)) {
    const nlohmann::json summary = {{"output", output},           {"sequence", sequence},
                                    {"layer", layer},             {"tokens", stored->count},
                                    {"page_size", seq->page_size()}, {"pages", seq->kv_indices_size()},
                                    {"ckv_scale", stored->ckv_scale}, {"kpe_scale", stored->kpe_scale}};
    std::printf("%s\n", summary.dump().c_str());
  } else {
    std::printf("exported %u tokens of sequence %s layer %d (%d page(s) of %u, ckv_scale %.9g, kpe_scale %.9g) -> %s\n",
                stored->count, sequence.c_str(), layer, seq->kv_indices_size(), seq->page_size(), stored->ckv_scale,
                stored->kpe_scale, output.c_str());
  }
  return kExitOk;
}

}  // namespace mlakv::cli
