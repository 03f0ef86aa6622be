// SoakClient: one client thread of the soak. Between operations it parks
// when the coordinator asks (PauseBarrier); each step is an ordinary
// operation (WorkloadOps) or, with SoakOptions::fault_fraction, a fault
// (FaultInjector). A step that finds a broken promise reports it and
// resyncs the sequences it touched, so one bug is reported once.
#pragma once

#include <atomic>
#include <memory>

#include "absl/time/time.h"
#include "tests/soak/client_session.h"
#include "tests/soak/fault_injector.h"
#include "tests/soak/pause_barrier.h"
#include "tests/soak/workload_ops.h"

namespace mlakv::soak {

class SoakClient {
 public:
  SoakClient(std::unique_ptr<ClientSession> session, PauseBarrier* barrier, std::atomic<bool>* stop)
      : session_(std::move(session)), ops_(*session_), faults_(*session_), barrier_(barrier), stop_(stop) {}

  // The thread's body: steps until `end` (or a stop), then leaves the barrier.
  void Run(absl::Time end);
  // Frees every sequence the client holds (after Run).
  void FreeAll() { ops_.FreeAll(); }
  // Read only while the client is parked or done.
  const ClientSession& session() const { return *session_; }

 private:
  void Step();
  // SoakOptions::corrupt_model_after: flips one byte of one model and reads
  // the sequence back (which must now be a violation); true once done.
  bool CorruptOneModel();

  std::unique_ptr<ClientSession> session_;
  WorkloadOps ops_;
  FaultInjector faults_;
  PauseBarrier* barrier_;
  std::atomic<bool>* stop_;
};

}  // namespace mlakv::soak
