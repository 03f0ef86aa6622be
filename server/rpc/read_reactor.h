// ReadReactor: one ReadSequence stream, a server-streaming call on the
// server's completion queue (cq/calls.h). Chunks are produced one at a time
// on the pool's worker (copy out of the cache, dequantize if asked) and
// written from there; the next chunk is produced when the previous write has
// completed, so a client that stops reading holds one chunk and nothing
// else. The work is bounded by the request: each layer at most once, and a
// token range that the sequence holds.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "mlakv/v1/kv_cache.pb.h"
#include "server/rpc/kv_cache_service.h"
#include "server/core/pool.h"
#include "server/cq/calls.h"

namespace mlakv::server {

class ReadReactor final : public cq::WriterCall<v1::ReadSequenceRequest, v1::ReadSequenceResponse> {
 public:
  // Serves ReadSequence on `queue` from now on.
  static void Serve(KvCacheService* service, cq::QueueThreads* queue) { Arm(new ReadReactor(service, queue)); }

 private:
  ReadReactor(KvCacheService* service, cq::QueueThreads* queue) : WriterCall(queue), service_(service) {}

  void Request(void* tag) override;
  Call* NextCall() override { return new ReadReactor(service_, queue_); }
  void OnStart() override;
  void OnWriteDone(bool ok) override;

  struct Chunk {
    int32_t layer;
    uint32_t start;
    uint32_t count;
  };

  absl::Status Plan(KvCacheService* service, const v1::ReadSequenceRequest* req);
  // The next chunk: up to per_message_ tokens of the current layer; then the
  // next layer. Advances the cursor.
  Chunk TakeChunk();
  void Next();
  // On the worker.
  absl::Status Produce(const Chunk& c);
  void Done(const absl::Status& status);

  KvCacheService* const service_;
  SequenceRef sequence_;  // the id, its expected generation, or the lease to read through
  // The generation in sequence_ is the one the plan found, not the client's.
  bool generation_pinned_ = false;
  std::string detail_;
  Pool* pool_ = nullptr;
  bool dequantize_ = false;
  std::vector<int32_t> layers_;  // layers to read, in order
  uint32_t start_ = 0;           // first token
  uint32_t count_ = 0;           // tokens per layer
  uint32_t per_message_ = 1;     // tokens per response message
  size_t layer_index_ = 0;       // cursor: layer being read
  uint32_t offset_ = 0;          // cursor: tokens of it already sent
  uint64_t sent_ = 0;            // messages produced
  v1::ReadSequenceResponse resp_;
};

}  // namespace mlakv::server
