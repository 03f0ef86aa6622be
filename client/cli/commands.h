// The `mlakv` command-line tool: one function per subcommand. Each takes the
// positional arguments after the subcommand name (flags are parsed globally
// by absl) and returns the process exit code: 0 ok, 1 the operation failed,
// 2 bad usage.
#pragma once

#include <string>
#include <vector>

namespace mlakv::cli {

int RunQuantize(const std::vector<std::string>& args);

}  // namespace mlakv::cli
