#include "tests/testing/shm_object.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "gtest/gtest.h"

namespace mlakv::testing {

ShmObject::ShmObject(uint64_t bytes) : bytes_(bytes) {
  static std::atomic<int> counter{0};
  name_ = "/mlakv-test-shm-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
  const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  EXPECT_GE(fd, 0) << name_ << ": " << std::strerror(errno);
  if (fd < 0) return;
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0) << std::strerror(errno);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  EXPECT_NE(p, MAP_FAILED) << std::strerror(errno);
  data_ = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
}

ShmObject::~ShmObject() {
  if (data_ != nullptr) munmap(data_, bytes_);
  shm_unlink(name_.c_str());
}

void ShmObject::Put(uint64_t offset, uint64_t stride, const std::string& rows, uint64_t row_bytes) {
  for (uint64_t i = 0; i * row_bytes < rows.size(); ++i) {
    std::memcpy(data_ + offset + i * stride, rows.data() + i * row_bytes, row_bytes);
  }
}

}  // namespace mlakv::testing
