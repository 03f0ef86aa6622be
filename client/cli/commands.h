// The `mlakv` command-line tool: one function per subcommand. Each takes the
// positional arguments after the subcommand name (flags are parsed globally
// by absl) and returns the process exit code: 0 ok, 1 the operation failed,
// 2 bad usage.
#pragma once

#include <string>
#include <vector>

namespace mlakv::cli {

int RunQuantize(const std::vector<std::string>& args);
int RunMakeRows(const std::vector<std::string>& args);
int RunPools(const std::vector<std::string>& args);
int RunSeqs(const std::vector<std::string>& args);
int RunSeq(const std::vector<std::string>& args);
int RunPage(const std::vector<std::string>& args);
int RunFree(const std::vector<std::string>& args);
int RunTruncate(const std::vector<std::string>& args);
int RunAppend(const std::vector<std::string>& args);
int RunExport(const std::vector<std::string>& args);
int RunBench(const std::vector<std::string>& args);
int RunRegions(const std::vector<std::string>& args);
int RunRegion(const std::vector<std::string>& args);
int RunExportPool(const std::vector<std::string>& args);
int RunPool(const std::vector<std::string>& args);
int RunFork(const std::vector<std::string>& args);
int RunLease(const std::vector<std::string>& args);
int RunMatch(const std::vector<std::string>& args);

}  // namespace mlakv::cli
