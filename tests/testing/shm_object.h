// A POSIX shared-memory object for the region tests (in process and against
// the real server): created under a fresh name, sized and mapped read-write;
// unmapped and unlinked when it goes out of scope.
#pragma once

#include <cstdint>
#include <string>

namespace mlakv::testing {

class ShmObject {
 public:
  // `bytes` bytes; a failed shm_open, ftruncate or mmap is a test failure
  // (data() is then null).
  explicit ShmObject(uint64_t bytes);
  ~ShmObject();
  ShmObject(const ShmObject&) = delete;
  ShmObject& operator=(const ShmObject&) = delete;

  // "/mlakv-test-shm-PID-N": the name shm_open takes.
  const std::string& name() const { return name_; }
  uint8_t* data() { return data_; }
  // Rows of `row_bytes` each from `rows`, copied to `offset`, one every `stride` bytes.
  void Put(uint64_t offset, uint64_t stride, const std::string& rows, uint64_t row_bytes);

 private:
  std::string name_;
  uint64_t bytes_;
  uint8_t* data_ = nullptr;
};

}  // namespace mlakv::testing
