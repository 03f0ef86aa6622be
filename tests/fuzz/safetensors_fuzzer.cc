// libFuzzer target: SafetensorsFile::Parse on arbitrary bytes, then the
// row-file reading of `mlakv quantize` / `mlakv append` (RowFileFromSafetensors)
// on every file it accepts.
//
// Besides ASan/UBSan, it checks what the parser promises of a file it
// accepts: every tensor's bytes lie inside the buffer and are exactly
// numel x dtype size, no two tensors share a byte, the accessors the CLI uses
// do not fail in unexpected ways, and the file survives a round trip through
// SafetensorsWriter unchanged. A broken promise is a crash (__builtin_trap),
// which libFuzzer reports with the input.
#include <cstddef>
#include <cstdint>
#include <string>

#include "client/row_file.h"
#include "client/safetensors_file.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<mlakv::SafetensorsFile> file = mlakv::SafetensorsFile::Parse(bytes, "fuzz.safetensors");
  if (!file.ok()) {
    Check(file.status().code() == absl::StatusCode::kInvalidArgument);
    Check(file.status().message().size() < 4096);  // messages stay bounded whatever the file holds
    return 0;
  }
  mlakv::SafetensorsWriter writer;
  uint64_t total = 0;
  for (const auto& [name, t] : file->tensors()) {
    const int64_t numel = t.numel();
    Check(numel >= 0);
    Check(static_cast<uint64_t>(numel) * mlakv::SafetensorsDTypeSize(t.dtype) == t.data.size());
    total += t.data.size();
    if (t.dtype == "F32") (void)file->GetScalarF32(name);
    (void)file->Get(name, {"BF16", "F16"}, 2);
    Check(writer.Add(name, t.dtype, t.shape, t.data).ok());
  }
  Check(8 + total <= size);  // the tensors tile the data section: no byte counted twice
  absl::StatusOr<mlakv::RowFile> rows = mlakv::RowFileFromSafetensors(*file);
  if (rows.ok()) {
    Check(rows->ckv.size() == static_cast<size_t>(rows->rows) * 512 && rows->kpe.size() == rows->ckv.size() / 8);
  }
  for (const auto& [k, v] : file->metadata()) writer.SetMetadata(k, v);

  absl::StatusOr<mlakv::SafetensorsFile> again = mlakv::SafetensorsFile::Parse(writer.Serialize(), "round trip");
  Check(again.ok());
  Check(again->metadata() == file->metadata());
  Check(again->tensors().size() == file->tensors().size());
  for (const auto& [name, t] : file->tensors()) {
    const mlakv::SafetensorsFile::Tensor* u = again->Find(name);
    Check(u != nullptr && u->dtype == t.dtype && u->shape == t.shape && u->data == t.data);
  }
  return 0;
}
