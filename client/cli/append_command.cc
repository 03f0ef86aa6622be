// mlakv append: rows of a safetensors file (as for `quantize`: ckv [N,512],
// kpe [N,64], BF16 or F16, optional ckv_scale / kpe_scale) appended to one
// layer of a sequence in one atomic Append stream; or, with --ckv_region and
// --kpe_region, N rows the server reads from registered regions itself.
#include <cstdio>
#include <memory>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"
#include "client/row_file.h"

ABSL_FLAG(int64_t, start, -1, "append: position of the first row; default: the layer's current length");
ABSL_FLAG(std::string, ckv_region, "",
          "append: take the ckv rows from a registered region, NAME:OFFSET[:STRIDE] (bytes; STRIDE 0 or omitted: "
          "packed rows); instead of --input, with --kpe_region, --rows and --dtype");
ABSL_FLAG(std::string, kpe_region, "", "append: take the kpe rows from a registered region, NAME:OFFSET[:STRIDE]");

namespace mlakv::cli {
namespace {

constexpr char kUsage[] =
    "append --sequence ID --layer L --input FILE [--start POS] [--pool P] [--ckv_scale X --kpe_scale Y] "
    "[--server ADDR] [--json]\n"
    "       mlakv append --sequence ID --layer L --ckv_region NAME:OFFSET[:STRIDE] --kpe_region NAME:OFFSET[:STRIDE] "
    "--rows N [--dtype bf16|f16] [--start POS] [--pool P] [--ckv_scale X --kpe_scale Y] [--server ADDR] [--json]";

// NAME:OFFSET or NAME:OFFSET:STRIDE. With two or more ':' the last two fields
// are OFFSET and STRIDE and NAME is the rest (so a name containing ':' needs
// the three-field form).
bool ParseUint64(absl::string_view text, uint64_t* value) {
  return !text.empty() && text[0] != '-' && text[0] != '+' && absl::SimpleAtoi(text, value);
}

absl::StatusOr<RegionRows> ParseRegionFlag(const char* flag, const std::string& text) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("mlakv append: --", flag, " \"", text, "\": ", why,
                                                   "; expected NAME:OFFSET[:STRIDE] (bytes)"));
  };
  const size_t last = text.rfind(':');
  if (last == std::string::npos) return bad("no ':OFFSET'");
  const size_t prev = last == 0 ? std::string::npos : text.rfind(':', last - 1);
  RegionRows region;
  absl::string_view offset;
  if (prev == std::string::npos) {
    region.region = text.substr(0, last);
    offset = absl::string_view(text).substr(last + 1);
  } else {
    region.region = text.substr(0, prev);
    offset = absl::string_view(text).substr(prev + 1, last - prev - 1);
    if (!ParseUint64(absl::string_view(text).substr(last + 1), &region.row_stride_bytes)) {
      return bad("STRIDE is not a non-negative integer");
    }
  }
  if (region.region.empty()) return bad("empty region name");
  if (!ParseUint64(offset, &region.offset)) return bad("OFFSET is not a non-negative integer");
  return region;
}

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
  const std::string ckv_region = absl::GetFlag(FLAGS_ckv_region), kpe_region = absl::GetFlag(FLAGS_kpe_region);
  const int32_t layer = absl::GetFlag(FLAGS_layer);
  const int64_t start_flag = absl::GetFlag(FLAGS_start), rows_flag = absl::GetFlag(FLAGS_rows);
  const bool from_regions = !ckv_region.empty() || !kpe_region.empty();
  if (!args.empty()) return UsageError(kUsage, "mlakv append takes no positional arguments");
  if (sequence.empty() || layer < 0 || (input.empty() && !from_regions)) {
    return UsageError(kUsage,
                      "mlakv append: --sequence, --layer (>= 0) and --input (or --ckv_region and --kpe_region) are "
                      "required");
  }
  if (start_flag < -1 || start_flag > UINT32_MAX) return UsageError(kUsage, "mlakv append: --start must be >= 0");

  AppendRows append;
  append.pool = absl::GetFlag(FLAGS_pool);
  append.sequence = sequence;
  LayerBytes& bytes = append.layers.emplace_back();
  bytes.layer = static_cast<uint32_t>(layer);
  // The rows the byte views point into (file input), sent by reference:
  // gRPC holds the file's buffers until it has written them.
  std::shared_ptr<const RowFile> file;
  if (from_regions) {
    if (!input.empty()) return UsageError(kUsage, "mlakv append: give --input or the region flags, not both");
    if (ckv_region.empty() || kpe_region.empty()) {
      return UsageError(kUsage, "mlakv append: --ckv_region and --kpe_region go together");
    }
    if (rows_flag < 0 || rows_flag > UINT32_MAX) {
      return UsageError(kUsage, "mlakv append: --rows N (>= 0) is required with the region flags");
    }
    const std::string dtype = absl::GetFlag(FLAGS_dtype);
    if (dtype != "bf16" && dtype != "f16") {
      return UsageError(kUsage, absl::StrCat("mlakv append: --dtype \"", dtype, "\" is not bf16 or f16"));
    }
    absl::StatusOr<RegionRows> ckv = ParseRegionFlag("ckv_region", ckv_region);
    if (!ckv.ok()) return UsageError(kUsage, std::string(ckv.status().message()));
    absl::StatusOr<RegionRows> kpe = ParseRegionFlag("kpe_region", kpe_region);
    if (!kpe.ok()) return UsageError(kUsage, std::string(kpe.status().message()));
    append.rows = static_cast<uint32_t>(rows_flag);
    append.dtype = dtype == "f16" ? v1::ROW_DTYPE_FLOAT16 : v1::ROW_DTYPE_BFLOAT16;
    bytes.ckv_region = *std::move(ckv);
    bytes.kpe_region = *std::move(kpe);
  } else {
    if (rows_flag >= 0) return UsageError(kUsage, "mlakv append: --rows is for the region flags; --input has its rows");
    absl::StatusOr<RowFile> loaded = LoadRowFile(input);
    if (!loaded.ok()) return Fail("append", loaded.status());
    file = std::make_shared<const RowFile>(*std::move(loaded));
    if (file->rows > UINT32_MAX) return Fail("append", absl::InvalidArgumentError("too many rows for one append"));
    append.rows = static_cast<uint32_t>(file->rows);
    append.dtype = file->dtype == DType::kFloat16 ? v1::ROW_DTYPE_FLOAT16 : v1::ROW_DTYPE_BFLOAT16;
    bytes.ckv = Bytes(file->ckv);
    bytes.kpe = Bytes(file->kpe);
    bytes.ckv_scale = file->ckv_scale;
    bytes.kpe_scale = file->kpe_scale;
    append.rows_owner = file;
  }
  if (std::optional<double> s = absl::GetFlag(FLAGS_ckv_scale)) bytes.ckv_scale = static_cast<float>(*s);
  if (std::optional<double> s = absl::GetFlag(FLAGS_kpe_scale)) bytes.kpe_scale = static_cast<float>(*s);
  absl::StatusOr<Connection> client = ConnectForSequence(sequence);
  if (!client.ok()) return Fail("append", client.status());
  if (start_flag >= 0) {
    append.start = static_cast<uint32_t>(start_flag);
  } else {
    absl::StatusOr<uint32_t> length = LayerLength(**client, append.pool, sequence, bytes.layer);
    if (!length.ok()) return Fail("append", length.status());
    append.start = *length;
    // Appending at the end: only if the end is still there, so that running
    // the command again after a lost response cannot append the rows twice.
    append.expect_length = *length;
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
  std::printf("appended %u %s rows%s to sequence %s layer %d at positions [%u, %u): %u page(s) allocated; layer %d "
              "now %u tokens, sequence length %u, %d page(s)\n",
              append.rows, append.dtype == v1::ROW_DTYPE_FLOAT16 ? "f16" : "bf16",
              from_regions ? " (from regions)" : "", sequence.c_str(), layer,
              append.start, append.start + append.rows, response->pages_allocated(), layer, layer_length,
              seq.length(), seq.kv_indices_size());
  return kExitOk;
}

}  // namespace mlakv::cli
