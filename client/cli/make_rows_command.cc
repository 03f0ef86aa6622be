// mlakv make-rows: a row file of random rows (client/random_rows.h), so that
// the examples and a first `mlakv append` run on a fresh clone.
#include <cmath>
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"
#include "client/random_rows.h"

ABSL_FLAG(uint64_t, seed, 0, "make-rows: seed of the random rows (the same seed writes the same file)");
ABSL_FLAG(double, amax, 4.0, "make-rows: rows are uniform in [-amax, amax] (0 < amax <= 1000)");

namespace mlakv::cli {

int RunMakeRows(const std::vector<std::string>& args) {
  constexpr char kUsage[] = "make-rows --rows N --output FILE [--dtype bf16|f16] [--seed S] [--amax A]";
  if (!args.empty()) return UsageError(kUsage, "mlakv make-rows takes no arguments");
  const int64_t rows = absl::GetFlag(FLAGS_rows);
  const std::string output = absl::GetFlag(FLAGS_output), dtype = absl::GetFlag(FLAGS_dtype);
  const double amax = absl::GetFlag(FLAGS_amax);
  if (rows < 1 || rows > (int64_t{1} << 24)) return UsageError(kUsage, "mlakv make-rows: --rows must be 1..16777216");
  if (output.empty()) return UsageError(kUsage, "mlakv make-rows: --output FILE is required");
  if (dtype != "bf16" && dtype != "f16") {
    return UsageError(kUsage, absl::StrCat("mlakv make-rows: --dtype \"", dtype, "\" is not bf16 or f16"));
  }
  if (!(amax > 0 && amax <= 1000)) return UsageError(kUsage, "mlakv make-rows: --amax must be in (0, 1000]");
  const RowFile made = MakeRandomRows(rows, dtype == "f16" ? DType::kFloat16 : DType::kBFloat16,
                                      static_cast<float>(amax), absl::GetFlag(FLAGS_seed));
  if (absl::Status s = WriteRowFile(output, made); !s.ok()) return Fail("make-rows", s);
  std::printf("wrote %lld random %s rows (ckv [%lld, 512], kpe [%lld, 64], ckv_scale %.9g, kpe_scale %.9g) -> %s\n",
              static_cast<long long>(rows), dtype.c_str(), static_cast<long long>(rows),
              static_cast<long long>(rows), *made.ckv_scale, *made.kpe_scale, output.c_str());
  return kExitOk;
}

}  // namespace mlakv::cli
