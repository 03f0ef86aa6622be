#include "server/observability/malloc_library.h"

#include <dlfcn.h>

#include <string_view>

namespace mlakv::server {

std::string MallocLibrary() {
  // The first definition in the process's lookup order: the one every call
  // to malloc binds to.
  void* const symbol = dlsym(RTLD_DEFAULT, "malloc");
  Dl_info info{};
  if (symbol == nullptr || dladdr(symbol, &info) == 0 || info.dli_fname == nullptr) return "unknown";
  std::string_view path(info.dli_fname);
  if (const size_t slash = path.rfind('/'); slash != std::string_view::npos) path.remove_prefix(slash + 1);
  if (path.starts_with("libc.so") || path.starts_with("libc-")) return "system";
  return std::string(path);
}

}  // namespace mlakv::server
