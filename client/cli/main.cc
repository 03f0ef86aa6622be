#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "client/cli/commands.h"

namespace {

struct Command {
  std::function<int(const std::vector<std::string>&)> run;
  const char* help;
};

const std::map<std::string, Command>& Commands() {
  static const auto* commands = new std::map<std::string, Command>{
      {"quantize",
       {mlakv::cli::RunQuantize,
        "--input IN.safetensors --output OUT.safetensors [--device cpu|cuda|cuda:N|auto] [--ckv_scale X] "
        "[--kpe_scale Y]\n      quantize rows offline with the service's kernel"}},
  };
  return *commands;
}

std::string Usage() {
  std::string text = "usage: mlakv COMMAND [flags]\n\ncommands:\n";
  for (const auto& [name, cmd] : Commands()) text += "  " + name + " " + cmd.help + "\n";
  text += "\nmlakv --help lists every flag.";
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(Usage());
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() < 2) {
    std::fprintf(stderr, "%s\n", Usage().c_str());
    return 2;
  }
  auto it = Commands().find(positional[1]);
  if (it == Commands().end()) {
    std::fprintf(stderr, "mlakv: unknown command \"%s\"\n\n%s\n", positional[1], Usage().c_str());
    return 2;
  }
  return it->second.run(std::vector<std::string>(positional.begin() + 2, positional.end()));
}
