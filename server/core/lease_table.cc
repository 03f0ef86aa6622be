#include "server/core/lease_table.h"

namespace mlakv::server {

Lease* LeaseTable::Add(Lease lease) {
  auto owned = std::make_unique<Lease>(std::move(lease));
  Lease* raw = owned.get();
  by_expiry_.emplace(raw->expire_ns, raw->id);
  by_id_.emplace(raw->id, std::move(owned));
  return raw;
}

Lease* LeaseTable::Find(uint64_t id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second.get();
}

void LeaseTable::SetExpiry(Lease* lease, int64_t expire_ns) {
  by_expiry_.erase({lease->expire_ns, lease->id});
  lease->expire_ns = expire_ns;
  by_expiry_.emplace(expire_ns, lease->id);
}

Lease LeaseTable::Remove(uint64_t id) {
  auto it = by_id_.find(id);
  Lease out = std::move(*it->second);
  by_expiry_.erase({out.expire_ns, out.id});
  by_id_.erase(it);
  return out;
}

Lease* LeaseTable::Earliest() const { return by_expiry_.empty() ? nullptr : Find(by_expiry_.begin()->second); }

std::vector<const Lease*> LeaseTable::ListAfter(uint64_t after, size_t limit) const {
  std::vector<const Lease*> out;
  for (auto it = by_id_.upper_bound(after); it != by_id_.end() && out.size() < limit; ++it) {
    out.push_back(it->second.get());
  }
  return out;
}

}  // namespace mlakv::server
