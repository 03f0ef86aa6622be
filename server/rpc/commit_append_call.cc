// KvCacheService::CommitAppend: commits an open Append stream by the
// commit_token its first message named, and is answered when that stream
// ends -- with its status and response (append_reactor.cc,
// AnswerCommitCall). docs/server.md "Committing an Append stream by a unary
// call" says why it exists and what each failure means.
#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "server/rpc/append_reactor.h"
#include "server/rpc/call_support.h"
#include "server/rpc/kv_cache_service.h"

namespace mlakv::server {

void KvCacheService::CommitAppend(CommitAppendCall* call) {
  RpcScope scope = StartRpc(kRpcCommitAppend);
  const v1::CommitAppendRequest& req = call->request();
  const auto detail = [&] { return absl::StrCat("commit_token=", Quote(req.commit_token()), " messages=", req.messages()); };
  absl::Status checked = CheckFieldLength("commit_token", req.commit_token(), kMaxCommitTokenBytes);
  if (checked.ok() && req.commit_token().empty()) {
    checked = absl::InvalidArgumentError("commit_token is empty: name the Append stream by the commit_token its first "
                                         "message set");
  }
  if (checked.ok() && req.messages() == 0) {
    checked = absl::InvalidArgumentError("messages is 0: name how many messages the client sent on the stream "
                                         "(an Append stream carries at least one)");
  }
  if (!checked.ok()) {
    // The stream, if one holds the token, stays open: it can still be
    // committed, by a correct CommitAppend or by its half-close.
    call->Finish(scope.Done(FinishCall("CommitAppend", detail, checked)));
    return;
  }
  // Not refused while draining: the stream it names is a call in flight,
  // which a drain lets run to its end.
  AppendReactor* stream = nullptr;
  bool start = false;
  const bool found = open_appends_.Take(req.commit_token(), [&](AppendReactor* s) {
    stream = s;
    start = s->OnCommitRequested(call, req.messages(), scope);
  });
  if (!found) {
    call->Finish(scope.Done(FinishCall(
        "CommitAppend", detail,
        absl::NotFoundError(absl::StrCat(
            "no open Append stream holds commit_token ", Quote(req.commit_token()),
            " on this server: its first message did not set it, or the stream has ended (committed or rolled back; "
            "its own status says which, GetSequence shows the rows), or another CommitAppend took it")))));
    return;
  }
  // Counted in the stream's queued_ (OnCommitRequested): it cannot end
  // before the commit task has run.
  if (start) stream->StartCommit();
}

}  // namespace mlakv::server
