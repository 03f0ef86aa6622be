// KV events: what a router needs to know about the pages a server holds
// (docs/events.md). Three kinds, numbered 1, 2, 3, ... in the order the
// server recorded them:
//   * stored:  pages that became complete (page_size tokens in every layer)
//              in a sequence, with the block hashes the client gave them;
//   * removed: stored pages whose bytes are gone or no longer those stored
//              (freed by FreeSequence, truncation, eviction, the idle TTL, a
//              lease's end; rewritten or truncated into);
//   * cleared: everything this server held is gone (recorded at start).
//
// EventLog keeps the last `replay_capacity` events in a ring, and no more of
// them than `replay_bytes` hold (an event's page list is as long as what it
// stored or freed: 65,536 events of a 262,144-token sequence's 4,096 pages
// would hold over 1 GiB by count alone). Recording
// never waits for a reader: a reader (KvEventReader) follows the ring by
// number, and one whose next event has already left the ring has fallen
// behind and is told so (RESOURCE_EXHAUSTED), so a slow watcher can never
// slow an append. The log knows nothing of gRPC or of the wire formats
// (server/rpc/watch_events_reactor, server/events/zmq_publisher).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace mlakv::server {

struct KvEvent {
  enum class Kind { kStored, kRemoved, kCleared };
  uint64_t number = 0;   // assigned by EventLog::Record
  int64_t time_unix_ns = 0;
  Kind kind = Kind::kStored;
  std::string pool{};      // empty for kCleared (every pool)
  // kStored: the sequence whose pages completed and where they start in its
  // page table; kRemoved: the sequence that held them when known (freed
  // pages retained by a lease may have outlived it: empty then).
  std::string sequence{};
  uint32_t first_page_index = 0;   // kStored
  uint32_t page_size = 0;          // tokens per page
  std::vector<int32_t> pages{};      // page ids
  // One per page (empty string: the client gave that page no hash), or
  // empty when none of the pages has one.
  std::vector<std::string> block_hashes{};
  // kStored: the hash of the page-table entry before first_page_index, when
  // there is one and it has a hash (a router's chain link).
  std::string parent_block_hash{};
  // kRemoved: "free", "truncate", "rewrite", "evict", "ttl", "lease_end".
  std::string reason{};
};

// The memory `event` holds: the struct, its vectors' buffers and the heap
// of its strings (a short string lives in the struct). What EventLog's
// replay_bytes bounds.
size_t KvEventBytes(const KvEvent& event);

// What a publisher that follows the log for another transport (the
// ZeroMQ publisher, server/events) reports; here, beside the log, so that the
// metrics read it without depending on the transport.
struct EventPublisherStats {
  uint64_t batches = 0;            // published (numbered 0 .. batches - 1)
  uint64_t replays_done = 0;       // replays sent whole, end marker included
  uint64_t replays_abandoned = 0;  // the reader left, or took nothing for too long
  uint64_t replays_dropped = 0;    // asked while the most replays were under way
  int64_t replays_active = 0;      // under way now
};

class EventLog {
 public:
  struct Options {
    size_t replay_capacity = 65536;  // events kept for readers that resume by number (>= 1)
    // Most bytes the kept events hold (KvEventBytes); the newest event is
    // kept whatever its size, so a reader can always have the last one.
    size_t replay_bytes = size_t{64} << 20;
  };
  explicit EventLog(Options options);

  // Numbers `event`, stamps it if unstamped, keeps it, wakes waiting readers.
  // Never blocks on a reader. Returns the number.
  uint64_t Record(KvEvent event);

  // The oldest event still kept (0 when none yet) and the number the next
  // event will get.
  uint64_t oldest() const;
  uint64_t next() const;
  size_t capacity() const { return options_.replay_capacity; }
  size_t replay_bytes() const { return options_.replay_bytes; }
  // One consistent reading of the ring (the metrics read it).
  struct Stats {
    uint64_t recorded = 0;  // events numbered since the start
    size_t kept = 0;        // events in the replay buffer
    // What they hold (KvEventBytes summed): <= replay_bytes, or one
    // event's worth when the newest alone is larger.
    size_t kept_bytes = 0;
  };
  Stats stats() const;

  // Copies up to `max` events from number `from` on into `out`, and no more
  // of them than `max_bytes` hold (KvEventBytes; the first is copied
  // whatever its size), waiting up to `timeout` for the first one.
  // OUT_OF_RANGE when `from` has already left the ring (the message names
  // the oldest kept), UNAVAILABLE once Close()d.
  absl::Status Read(uint64_t from, size_t max, absl::Duration timeout, std::vector<KvEvent>* out,
                    size_t max_bytes = SIZE_MAX) const;

  // Wakes every waiting reader for good (shutdown).
  void Close();

 private:
  const Options options_;
  mutable absl::Mutex mu_;
  std::deque<KvEvent> ring_ ABSL_GUARDED_BY(mu_);
  size_t ring_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // KvEventBytes of ring_'s events
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 1;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace mlakv::server
