// PauseBarrier: lets the coordinator stop every client between two
// operations, so that no call of the soak is in flight while it compares the
// pool with the clients' models (and reads the models).
#pragma once

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace mlakv::soak {

class PauseBarrier {
 public:
  explicit PauseBarrier(int parties) : parties_(parties) {}

  // Clients, between operations: returns at once unless a pause was asked
  // for; then waits, parked, until Resume.
  void MaybePark();
  // A client that is done for good counts as parked from now on.
  void Leave();

  // Coordinator: asks every client to park; true once all have, false when
  // `timeout` passed first (the pause stays requested; call Resume).
  bool Pause(absl::Duration timeout);
  void Resume();

 private:
  bool AllParked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return parked_ + left_ == parties_; }
  bool Released() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !pause_requested_; }

  const int parties_;
  absl::Mutex mu_;
  bool pause_requested_ ABSL_GUARDED_BY(mu_) = false;
  int parked_ ABSL_GUARDED_BY(mu_) = 0;
  int left_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace mlakv::soak
