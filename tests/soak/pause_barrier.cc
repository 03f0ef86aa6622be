#include "tests/soak/pause_barrier.h"

namespace mlakv::soak {

void PauseBarrier::MaybePark() {
  absl::MutexLock lock(&mu_);
  if (!pause_requested_) return;
  ++parked_;
  mu_.Await(absl::Condition(this, &PauseBarrier::Released));
  --parked_;
}

void PauseBarrier::Leave() {
  absl::MutexLock lock(&mu_);
  ++left_;
}

bool PauseBarrier::Pause(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  pause_requested_ = true;
  return mu_.AwaitWithTimeout(absl::Condition(this, &PauseBarrier::AllParked), timeout);
}

void PauseBarrier::Resume() {
  absl::MutexLock lock(&mu_);
  pause_requested_ = false;
}

}  // namespace mlakv::soak
