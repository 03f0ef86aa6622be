// LeaseTable: the leases of one pool, by id (listings) and by expiry (the
// reaper takes the expired ones from the front). A sequence lease names a
// Sequence (alive, or retained after a free) and the tokens it protects; a
// page lease holds one reference on each of its pages (MatchPrefix).
// What a lease means for the pool is the Pool's business; this is the
// bookkeeping, O(log n) per operation. Not thread-safe: the Pool's mutex.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace mlakv::server {

class Sequence;

struct Lease {
  uint64_t id = 0;
  std::string holder;
  int64_t expire_ns = 0;     // Unix nanoseconds
  int64_t duration_ms = 0;   // what the last acquire / renew asked for
  Sequence* sequence = nullptr;  // sequence lease; null for a page lease
  uint64_t generation = 0;
  uint32_t tokens = 0;          // sequence lease: [0, tokens) protected; page lease: pages x page_size
  std::vector<int32_t> pages;   // page lease: the pages it references
};

class LeaseTable {
 public:
  Lease* Add(Lease lease);
  Lease* Find(uint64_t id) const;
  void SetExpiry(Lease* lease, int64_t expire_ns);
  // Removes and returns the lease.
  Lease Remove(uint64_t id);
  // The lease that expires first, or null.
  Lease* Earliest() const;
  // Leases with id > `after`, in id order, at most `limit`.
  std::vector<const Lease*> ListAfter(uint64_t after, size_t limit) const;
  size_t size() const { return by_id_.size(); }

 private:
  std::map<uint64_t, std::unique_ptr<Lease>> by_id_;
  std::set<std::pair<int64_t, uint64_t>> by_expiry_;
};

}  // namespace mlakv::server
