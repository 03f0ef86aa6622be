// ShmRegion: a POSIX shared-memory object (shm_open) of a producer on this
// host, mapped read-only into the server. The producer writes its rows into
// the object; appends naming the region read them from the mapping.
//
// What a hostile or careless producer cannot do (docs/reliability.md
// "Regions"): make registration block (the object is opened O_NONBLOCK, so a
// FIFO does not wait for a writer), make the server follow a link
// (O_NOFOLLOW) or map anything but a regular object (fstat before mmap:
// FIFOs, directories, devices are refused), reach outside /dev/shm (one path
// component, no "." or "..", no NUL), or crash the server by shrinking the
// object: CheckSize() re-checks the size before each append, and a shrink
// during the read itself is absorbed by MappingFaultGuard (the append then
// fails and the region is poisoned: faulted()).
//
// The mapping is made once at Create and released (munmap) by the
// destructor, i.e. when the registry and every append in flight have let go.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/regions/mapping_fault_guard.h"
#include "server/regions/region.h"

namespace mlakv::server {

class ShmRegion final : public Region {
 public:
  struct Options {
    std::string shm_name;   // shm_open name: "/" then 1..254 bytes, no "/", NUL or control byte, not "." or ".."
    uint64_t offset = 0;    // bytes into the object where the region starts
    uint64_t byte_size = 0; // bytes of the region; 0: up to the end of the object
  };

  // Checks the spelling of a shm_open name (INVALID_ARGUMENT saying what is wrong).
  static absl::Status CheckName(const std::string& shm_name);
  // INVALID_ARGUMENT for a malformed name, a symbolic link or an empty
  // region; NOT_FOUND when the object does not exist; PERMISSION_DENIED when
  // it cannot be opened for reading; FAILED_PRECONDITION when it is not a
  // regular object (a FIFO, directory, device); OUT_OF_RANGE when offset +
  // byte_size exceeds the object. Never blocks.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Create(const Options& options);
  ~ShmRegion() override;

  Kind kind() const override { return Kind::kShm; }
  uint64_t byte_size() const override { return byte_size_; }
  const uint8_t* data() const override { return map_base_ + (offset_ - map_offset_); }
  std::string Describe() const override;
  bool faulted() const override { return guard_->faulted(); }

  const std::string& shm_name() const { return shm_name_; }
  uint64_t offset() const { return offset_; }
  // FAILED_PRECONDITION when the object no longer covers the region (the
  // producer shrank it with ftruncate) or a read already faulted.
  absl::Status CheckSize() const;

 private:
  ShmRegion(std::string shm_name, int fd, uint64_t offset, uint64_t byte_size, uint8_t* map_base,
            uint64_t map_offset, uint64_t map_bytes, std::unique_ptr<MappingFaultGuard> guard);

  const std::string shm_name_;
  const int fd_;  // read-only descriptor of the object, for CheckSize
  const uint64_t offset_;
  const uint64_t byte_size_;
  uint8_t* const map_base_;   // mmap result (page-aligned)
  const uint64_t map_offset_; // offset_ rounded down to a page
  const uint64_t map_bytes_;  // length passed to mmap
  std::unique_ptr<MappingFaultGuard> guard_;  // released before the munmap
};

}  // namespace mlakv::server
