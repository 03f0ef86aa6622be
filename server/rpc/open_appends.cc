#include "server/rpc/open_appends.h"

#include "absl/strings/str_cat.h"
#include "common/quote.h"

namespace mlakv::server {

absl::Status OpenAppends::Add(const std::string& token, AppendReactor* stream) {
  absl::MutexLock lock(&mu_);
  if (!streams_.try_emplace(token, stream).second) {
    return absl::AlreadyExistsError(absl::StrCat("commit_token ", Quote(token),
                                                 " is held by another open Append stream on this server; give each "
                                                 "stream its own (e.g. a UUID)"));
  }
  return absl::OkStatus();
}

void OpenAppends::Remove(const std::string& token, const AppendReactor* stream) {
  absl::MutexLock lock(&mu_);
  if (auto it = streams_.find(token); it != streams_.end() && it->second == stream) streams_.erase(it);
}

bool OpenAppends::Take(const std::string& token, absl::FunctionRef<void(AppendReactor*)> claim) {
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(token);
  if (it == streams_.end()) return false;
  AppendReactor* stream = it->second;
  streams_.erase(it);
  claim(stream);
  return true;
}

size_t OpenAppends::size() const {
  absl::MutexLock lock(&mu_);
  return streams_.size();
}

}  // namespace mlakv::server
