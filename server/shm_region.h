// ShmRegion: a POSIX shared-memory object (shm_open) of a producer on this
// host, mapped read-only into the server. The producer writes its rows into
// the object; appends naming the region read them from the mapping.
//
// The mapping is made once at Create (size checked against fstat) and
// released (munmap) by the destructor, i.e. when the registry and every
// append in flight have let go. The producer must not shrink the object while
// it is registered: reading a truncated mapping would fault the server, so
// the descriptor stays open and CheckSize() re-checks the object's size
// before each append reads it (what remains is the race of a shrink during
// the read itself).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/region.h"

namespace mlakv::server {

class ShmRegion final : public Region {
 public:
  struct Options {
    std::string shm_name;   // shm_open name: "/" then 1..254 characters without "/"
    uint64_t offset = 0;    // bytes into the object where the region starts
    uint64_t byte_size = 0; // bytes of the region; 0: up to the end of the object
  };

  // INVALID_ARGUMENT for a malformed name or an empty region, NOT_FOUND when
  // the object does not exist, PERMISSION_DENIED when it cannot be opened for
  // reading, OUT_OF_RANGE when offset + byte_size exceeds the object.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Create(const Options& options);
  ~ShmRegion() override;

  Kind kind() const override { return Kind::kShm; }
  uint64_t byte_size() const override { return byte_size_; }
  const uint8_t* data() const override { return map_base_ + (offset_ - map_offset_); }
  std::string Describe() const override;

  const std::string& shm_name() const { return shm_name_; }
  uint64_t offset() const { return offset_; }
  // FAILED_PRECONDITION when the object no longer covers the region (the
  // producer shrank it with ftruncate).
  absl::Status CheckSize() const;

 private:
  ShmRegion(std::string shm_name, int fd, uint64_t offset, uint64_t byte_size, uint8_t* map_base,
            uint64_t map_offset, uint64_t map_bytes);

  const std::string shm_name_;
  const int fd_;  // read-only descriptor of the object, for CheckSize
  const uint64_t offset_;
  const uint64_t byte_size_;
  uint8_t* const map_base_;   // mmap result (page-aligned)
  const uint64_t map_offset_; // offset_ rounded down to a page
  const uint64_t map_bytes_;  // length passed to mmap
};

}  // namespace mlakv::server
