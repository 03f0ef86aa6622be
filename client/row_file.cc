#include "client/row_file.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/safetensors_file.h"
#include "common/status_macros.h"

namespace mlakv {

absl::StatusOr<RowFile> LoadRowFile(const std::string& path) {
  MLAKV_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Read(path));
  return RowFileFromSafetensors(file);
}

absl::StatusOr<RowFile> RowFileFromSafetensors(const SafetensorsFile& file) {
  MLAKV_ASSIGN_OR_RETURN(const SafetensorsFile::Tensor* ckv, file.Get("ckv", {"BF16", "F16"}, 2));
  MLAKV_ASSIGN_OR_RETURN(const SafetensorsFile::Tensor* kpe, file.Get("kpe", {"BF16", "F16"}, 2));
  const auto& c = *ckv;
  const auto& k = *kpe;
  if (c.shape[1] != 512 || k.shape[1] != 64 || c.shape[0] != k.shape[0] || c.dtype != k.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(file.name(), ": expected ckv [N, 512] and kpe [N, 64] of one dtype, got ckv ",
                                                   c.dtype, "[", c.shape[0], ", ", c.shape[1], "] and kpe ", k.dtype,
                                                   "[", k.shape[0], ", ", k.shape[1], "]"));
  }
  RowFile rows;
  rows.dtype = c.dtype == "BF16" ? DType::kBFloat16 : DType::kFloat16;
  rows.rows = c.shape[0];
  rows.ckv.resize(c.data.size() / 2);
  rows.kpe.resize(k.data.size() / 2);
  // N = 0 leaves both vectors empty, their data() possibly null: memcpy to
  // null is undefined even for 0 bytes (UBSan, `mlakv quantize` on [0, 512]).
  if (!c.data.empty()) std::memcpy(rows.ckv.data(), c.data.data(), c.data.size());
  if (!k.data.empty()) std::memcpy(rows.kpe.data(), k.data.data(), k.data.size());
  for (auto [name, slot] : {std::pair{"ckv_scale", &rows.ckv_scale}, {"kpe_scale", &rows.kpe_scale}}) {
    if (file.Find(name) == nullptr) continue;
    MLAKV_ASSIGN_OR_RETURN(float v, file.GetScalarF32(name));
    *slot = v;
  }
  return rows;
}

absl::Status AddQuantizedTensors(const QuantizedRows& rows, SafetensorsWriter& writer) {
  auto bytes = [](const std::vector<uint8_t>& v) { return std::string_view(reinterpret_cast<const char*>(v.data()), v.size()); };
  MLAKV_RETURN_IF_ERROR(writer.Add("ckv_packed", "U8", {rows.rows, 256}, bytes(rows.ckv_packed)));
  MLAKV_RETURN_IF_ERROR(writer.Add("ckv_sf", "F8_E4M3", {rows.rows, 32}, bytes(rows.ckv_sf)));
  return writer.Add("kpe", "F8_E4M3", {rows.rows, 64}, bytes(rows.kpe));
}

absl::Status WriteQuantizedFile(const std::string& path, const QuantizedRows& rows,
                                const std::map<std::string, std::string>& metadata) {
  SafetensorsWriter w;
  MLAKV_RETURN_IF_ERROR(AddQuantizedTensors(rows, w));
  for (const auto& [k, v] : metadata) w.SetMetadata(k, v);
  return w.Write(path);
}

}  // namespace mlakv
