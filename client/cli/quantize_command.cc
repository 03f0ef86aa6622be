// mlakv quantize: rows from a safetensors file through the service's own
// kernel (CPU or CUDA), written back as the bytes the cache would hold.
#include <cmath>
#include <cstdio>
#include <optional>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli/cli_flags.h"
#include "client/cli/commands.h"
#include "client/row_file.h"
#include "kernels/nvfp4_format.h"

ABSL_FLAG(std::string, device, "auto", "quantize: cpu, cuda, cuda:N, or auto (cuda:0 when a GPU is visible, else cpu)");

namespace mlakv::cli {
namespace {

struct DeviceChoice {
  KernelDevice kind;
  int index;
  std::string name;
};

std::optional<DeviceChoice> ParseDevice(const std::string& text) {
  if (text == "cpu") return DeviceChoice{KernelDevice::kCpu, 0, "cpu"};
  if (text == "auto") {
    if (CudaDeviceCount() > 0) return DeviceChoice{KernelDevice::kCuda, 0, "cuda:0"};
    return DeviceChoice{KernelDevice::kCpu, 0, "cpu"};
  }
  int index = 0;
  if (text == "cuda" || (text.rfind("cuda:", 0) == 0 && absl::SimpleAtoi(text.substr(5), &index) && index >= 0)) {
    return DeviceChoice{KernelDevice::kCuda, index, absl::StrCat("cuda:", index)};
  }
  return std::nullopt;
}

// ||dequant(q(x)) - x|| / ||x|| over the finite inputs, in double.
double RelativeL2(const std::vector<uint16_t>& bits, DType dtype, const std::vector<float>& restored) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < bits.size(); ++i) {
    const float x = dtype == DType::kBFloat16 ? format::Bf16BitsToFloat(bits[i]) : format::HalfBitsToFloat(bits[i]);
    if (!std::isfinite(x)) continue;
    diff += (static_cast<double>(restored[i]) - x) * (static_cast<double>(restored[i]) - x);
    norm += static_cast<double>(x) * x;
  }
  return norm > 0 ? std::sqrt(diff / norm) : 0.0;
}

}  // namespace

int RunQuantize(const std::vector<std::string>& args) {
  if (!args.empty() || absl::GetFlag(FLAGS_input).empty() || absl::GetFlag(FLAGS_output).empty()) {
    std::fprintf(stderr, "usage: mlakv quantize --input IN.safetensors --output OUT.safetensors "
                         "[--device cpu|cuda|cuda:N|auto] [--ckv_scale X] [--kpe_scale Y]\n");
    return 2;
  }
  const std::optional<DeviceChoice> device = ParseDevice(absl::GetFlag(FLAGS_device));
  if (!device) {
    std::fprintf(stderr, "mlakv quantize: --device \"%s\" is not cpu, cuda, cuda:N or auto\n",
                 absl::GetFlag(FLAGS_device).c_str());
    return 2;
  }
  absl::StatusOr<RowFile> rows = LoadRowFile(absl::GetFlag(FLAGS_input));
  if (!rows.ok()) {
    std::fprintf(stderr, "mlakv quantize: %s\n", std::string(rows.status().message()).c_str());
    return 1;
  }
  if (rows->rows == 0) {
    std::fprintf(stderr, "mlakv quantize: %s holds no rows (ckv [0, 512]); nothing to quantize\n",
                 absl::GetFlag(FLAGS_input).c_str());
    return 1;
  }
  std::optional<double> ckv_scale = absl::GetFlag(FLAGS_ckv_scale), kpe_scale = absl::GetFlag(FLAGS_kpe_scale);
  if (!ckv_scale && rows->ckv_scale) ckv_scale = *rows->ckv_scale;
  if (!kpe_scale && rows->kpe_scale) kpe_scale = *rows->kpe_scale;
  if (!ckv_scale || !kpe_scale) {
    std::fprintf(stderr, "mlakv quantize: %s gives no %s; pass --ckv_scale and --kpe_scale\n",
                 absl::GetFlag(FLAGS_input).c_str(), !ckv_scale ? "ckv_scale" : "kpe_scale");
    return 2;
  }
  absl::StatusOr<QuantizedRows> q =
      QuantizeRows(rows->ckv_view(), rows->kpe_view(), *ckv_scale, *kpe_scale, device->kind, device->index);
  if (!q.ok()) {
    std::fprintf(stderr, "mlakv quantize: %s\n", std::string(q.status().message()).c_str());
    return 1;
  }
  const DequantizedRows restored = DequantizeRows(*q, static_cast<float>(*ckv_scale), static_cast<float>(*kpe_scale));
  const std::map<std::string, std::string> metadata = {
      {"ckv_scale", absl::StrFormat("%.9g", static_cast<float>(*ckv_scale))},
      {"kpe_scale", absl::StrFormat("%.9g", static_cast<float>(*kpe_scale))},
      {"device", device->name}};
  if (absl::Status s = WriteQuantizedFile(absl::GetFlag(FLAGS_output), *q, metadata); !s.ok()) {
    std::fprintf(stderr, "mlakv quantize: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::printf("quantized %lld rows on %s: ckv rel L2 error %.6f, kpe rel L2 error %.6f -> %s\n",
              static_cast<long long>(rows->rows), device->name.c_str(), RelativeL2(rows->ckv, rows->dtype, restored.ckv),
              RelativeL2(rows->kpe, rows->dtype, restored.kpe), absl::GetFlag(FLAGS_output).c_str());
  return 0;
}

}  // namespace mlakv::cli
