// mlakv append: rows of a safetensors file (as for `quantize`: ckv [N,512],
// kpe [N,64], BF16 or F16, optional ckv_scale / kpe_scale) appended to one
// layer of a sequence in one atomic Append stream.
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"
#include "client/row_file.h"

ABSL_FLAG(int64_t, start, -1, "append: position of the first row; default: the layer's current length");

namespace mlakv::cli {
namespace {

constexpr char kUsage[] =
    "append --sequence ID --layer L --input FILE [--start POS] [--pool P] [--ckv_scale X --kpe_scale Y] "
    "[--server ADDR] [--json]";

std::string_view Bytes(const std::vector<uint16_t>& v) {
  return {reinterpret_cast<const char*>(v.data()), v.size() * sizeof(uint16_t)};
}

// The layer's current length, or 0 for a sequence the server does not know.
absl::StatusOr<uint32_t> LayerLength(KvCacheClient& client, const std::string& pool, const std::string& sequence,
                                     uint32_t layer) {
  absl::StatusOr<v1::Sequence> seq = client.GetSequence(pool, sequence);
  if (absl::IsNotFound(seq.status())) return 0u;
  if (!seq.ok()) return seq.status();
  return layer < static_cast<uint32_t>(seq->layer_lengths_size()) ? seq->layer_lengths(layer) : 0u;
}

}  // namespace

int RunAppend(const std::vector<std::string>& args) {
  const std::string sequence = absl::GetFlag(FLAGS_sequence), input = absl::GetFlag(FLAGS_input);
  const int32_t layer = absl::GetFlag(FLAGS_layer);
  const int64_t start_flag = absl::GetFlag(FLAGS_start);
  if (!args.empty()) return UsageError(kUsage, "mlakv append takes no positional arguments");
  if (sequence.empty() || input.empty() || layer < 0) {
    return UsageError(kUsage, "mlakv append: --sequence, --layer (>= 0) and --input are required");
  }
  if (start_flag < -1 || start_flag > UINT32_MAX) return UsageError(kUsage, "mlakv append: --start must be >= 0");

  absl::StatusOr<RowFile> rows = LoadRowFile(input);
  if (!rows.ok()) return Fail("append", rows.status());
  if (rows->rows > UINT32_MAX) return Fail("append", absl::InvalidArgumentError("too many rows for one append"));
  absl::StatusOr<std::unique_ptr<KvCacheClient>> client = ConnectFromFlags();
  if (!client.ok()) return Fail("append", client.status());

  AppendRows append;
  append.pool = absl::GetFlag(FLAGS_pool);
  append.sequence = sequence;
  append.rows = static_cast<uint32_t>(rows->rows);
  append.dtype = rows->dtype == DType::kFloat16 ? v1::ROW_DTYPE_FLOAT16 : v1::ROW_DTYPE_BFLOAT16;
  LayerBytes& bytes = append.layers.emplace_back();
  bytes.layer = static_cast<uint32_t>(layer);
  bytes.ckv = Bytes(rows->ckv);
  bytes.kpe = Bytes(rows->kpe);
  bytes.ckv_scale = rows->ckv_scale;
  bytes.kpe_scale = rows->kpe_scale;
  if (std::optional<double> s = absl::GetFlag(FLAGS_ckv_scale)) bytes.ckv_scale = static_cast<float>(*s);
  if (std::optional<double> s = absl::GetFlag(FLAGS_kpe_scale)) bytes.kpe_scale = static_cast<float>(*s);
  if (start_flag >= 0) {
    append.start = static_cast<uint32_t>(start_flag);
  } else {
    absl::StatusOr<uint32_t> length = LayerLength(**client, append.pool, sequence, bytes.layer);
    if (!length.ok()) return Fail("append", length.status());
    append.start = *length;
  }

  absl::StatusOr<v1::AppendResponse> response = (*client)->Append(append);
  if (!response.ok()) return Fail("append", response.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ToJson(*response).c_str());
    return kExitOk;
  }
  const v1::Sequence& seq = response->sequence();
  const uint32_t layer_length =
      bytes.layer < static_cast<uint32_t>(seq.layer_lengths_size()) ? seq.layer_lengths(bytes.layer) : 0;
  std::printf("appended %u %s rows to sequence %s layer %d at positions [%u, %u): %u page(s) allocated; layer %d "
              "now %u tokens, sequence length %u, %d page(s)\n",
              append.rows, append.dtype == v1::ROW_DTYPE_FLOAT16 ? "f16" : "bf16", sequence.c_str(), layer,
              append.start, append.start + append.rows, response->pages_allocated(), layer, layer_length,
              seq.length(), seq.kv_indices_size());
  return kExitOk;
}

}  // namespace mlakv::cli
