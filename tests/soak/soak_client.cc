#include "tests/soak/soak_client.h"

#include <iostream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace mlakv::soak {

void SoakClient::Run(absl::Time end) {
  const absl::Duration corrupt_after = session_->options().corrupt_model_after;
  const absl::Time corrupt_at =
      corrupt_after > absl::ZeroDuration() && session_->index() == 0 ? absl::Now() + corrupt_after : absl::InfiniteFuture();
  bool corrupted = false;
  while (!stop_->load() && absl::Now() < end) {
    barrier_->MaybePark();
    if (stop_->load() || absl::Now() >= end) break;
    if (!corrupted && absl::Now() >= corrupt_at) corrupted = CorruptOneModel();
    Step();
  }
  barrier_->Leave();
}

bool SoakClient::CorruptOneModel() {
  for (Slot& slot : session_->slots()) {
    if (!slot.model) continue;
    for (int l = 0; l < slot.model->num_layers(); ++l) {
      if (slot.model->layer_length(l) == 0) continue;
      slot.model->CorruptForSelfCheck(l, 0);
      std::cerr << "self-check: corrupted the model of " << slot.id << " layer " << l << " token 0" << std::endl;
      // Read it back at once: a later rewrite or free would hide the change.
      if (absl::Status s = session_->verifier().Verify(slot.id, slot.model); !s.ok()) {
        session_->report().Violation("self-check read-back", s.message());
      }
      session_->Resync(slot);
      return true;
    }
  }
  return false;
}

void SoakClient::Step() {
  ClientSession& s = *session_;
  std::string name;
  std::vector<Slot*> touched;
  const bool fault = s.Chance(s.options().fault_fraction);
  const absl::Status status = fault ? faults_.RunOne(&name, &touched) : ops_.RunOne(&name, &touched);
  if (status.ok()) return;
  // A mismatch says what differs; any other error is a call that should have worked.
  const std::string what = IsMismatch(status) ? std::string(status.message())
                                              : absl::StrCat("unexpected ", absl::StatusCodeToString(status.code()),
                                                             ": ", status.message());
  s.report().Violation(absl::StrCat("client ", s.index(), fault ? " fault " : " op ", name), what);
  for (Slot* slot : touched) s.Resync(*slot);
  if (s.report().violations() >= s.options().max_violations) stop_->store(true);
}

}  // namespace mlakv::soak
