// A cpu pool that takes "device" rows: rows marked as device memory
// (RowSource::device 0, packed strides) are host bytes standing in for a CUDA
// region's, handed to the cpu backend as the host rows they are. With it the
// pool's handling of rows by reference (Pool::Stage's held writes) runs with
// no GPU. Records the layers of each Append and can fail the next one; its
// stand-in producers' events complete when the test says so.
#pragma once

#include <cstdint>
#include <set>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/backend/forwarding_backend.h"

namespace mlakv::server::testing {

class StandInDeviceBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status Append(std::span<const LayerAppend> layers) override {
    calls.emplace_back();
    std::vector<LayerAppend> host(layers.begin(), layers.end());
    std::vector<std::vector<AppendSegment>> segments(layers.size());
    for (size_t i = 0; i < host.size(); ++i) {
      calls.back().push_back(host[i].layer);
      if (host[i].rows) host[i].rows->device = -1;
      segments[i].assign(host[i].segments.begin(), host[i].segments.end());
      for (AppendSegment& s : segments[i]) s.rows.device = -1;
      host[i].segments = segments[i];
    }
    if (fail_next) {
      fail_next = false;
      return absl::InternalError("stand-in device failure");
    }
    return inner().Append(host);
  }

  // Stand-in producers' events: those in `pending` have not completed
  // (SourceWaiter's thread asks, beside the test's).
  absl::StatusOr<bool> EventsComplete(std::span<const void* const> events) override {
    absl::MutexLock lock(&events_mu);
    for (const void* ev : events) {
      if (ev == failing_event) return absl::InternalError("stand-in event query failure");
      if (pending.count(ev) != 0) return false;
    }
    return true;
  }
  void Complete(const void* ev) {
    absl::MutexLock lock(&events_mu);
    pending.erase(ev);
  }

  std::vector<std::vector<int32_t>> calls;  // per Append: the layers it wrote
  bool fail_next = false;
  absl::Mutex events_mu;
  std::set<const void*> pending ABSL_GUARDED_BY(events_mu);
  const void* failing_event ABSL_GUARDED_BY(events_mu) = nullptr;
};

// Marks packed host rows as stand-in device rows (see above).
inline void MarkAsDeviceRows(LayerRows& rows) {
  rows.source.device = 0;
  rows.source.ckv_stride_bytes = 512 * 2;
  rows.source.kpe_stride_bytes = 64 * 2;
}

}  // namespace mlakv::server::testing
