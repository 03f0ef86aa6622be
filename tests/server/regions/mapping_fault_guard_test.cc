// MappingFaultGuard: a shared mapping whose file shrinks under a read costs
// the reader zeros and a fault count, never the process.
#include "server/regions/mapping_fault_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace mlakv::server {
namespace {

class MappedFile {
 public:
  explicit MappedFile(size_t bytes) : bytes_(bytes) {
    char path[] = "/dev/shm/mlakv_guard_test_XXXXXX";
    fd_ = mkstemp(path);
    path_ = path;
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0);
    std::vector<char> fill(bytes, 'A');
    EXPECT_EQ(pwrite(fd_, fill.data(), bytes, 0), static_cast<ssize_t>(bytes));
    base_ = static_cast<const volatile char*>(mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd_, 0));
    EXPECT_NE(base_, MAP_FAILED);
  }
  ~MappedFile() {
    munmap(const_cast<char*>(base_), bytes_);
    close(fd_);
    unlink(path_.c_str());
  }
  void Shrink(size_t bytes) { ASSERT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0); }
  const volatile char* base() const { return base_; }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_;
  int fd_ = -1;
  std::string path_;
  const volatile char* base_ = nullptr;
};

const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));

TEST(MappingFaultGuard, ReadPastAShrunkFileGivesZerosAndCountsAFault) {
  MappedFile file(4 * kPage);
  auto guard = MappingFaultGuard::Register(const_cast<const char*>(file.base()), file.bytes());
  ASSERT_TRUE(guard.ok()) << guard.status();
  EXPECT_FALSE((*guard)->faulted());
  file.Shrink(kPage);
  EXPECT_EQ(file.base()[0], 'A');               // still backed
  EXPECT_EQ(file.base()[2 * kPage + 5], '\0');  // was SIGBUS: now a zero page
  EXPECT_EQ(file.base()[3 * kPage], '\0');      // the rest of the range went with it
  EXPECT_TRUE((*guard)->faulted());
  EXPECT_EQ((*guard)->faults(), 1u);
}

TEST(MappingFaultGuard, FaultsOnOtherThreadsAreAbsorbedToo) {
  MappedFile file(64 * kPage);
  auto guard = MappingFaultGuard::Register(const_cast<const char*>(file.base()), file.bytes());
  ASSERT_TRUE(guard.ok());
  file.Shrink(0);
  std::vector<std::thread> readers;
  std::vector<long> sums(4, -1);
  for (int t = 0; t < 4; ++t) {
    readers.emplace_back([&, t] {
      long sum = 0;
      for (size_t i = t * kPage; i < file.bytes(); i += kPage) sum += file.base()[i];
      sums[t] = sum;
    });
  }
  for (auto& r : readers) r.join();
  for (long s : sums) EXPECT_EQ(s, 0);
  EXPECT_GE((*guard)->faults(), 1u);
}

TEST(MappingFaultGuard, UnregisteredRangesStillDie) {
  // Dies of SIGBUS (or, under AddressSanitizer, of ASan's report of it: the
  // guard hands every fault outside its ranges to the previous handler).
  EXPECT_DEATH(
      {
        MappedFile file(2 * kPage);
        auto guard = MappingFaultGuard::Register(const_cast<const char*>(file.base()), kPage);  // first page only
        file.Shrink(0);
        volatile char c = file.base()[kPage];  // outside the guarded range
        (void)c;
        std::exit(0);
      },
      "");
}

// A SIGBUS another process sends (kill -BUS) is not a fault: it kills as
// it would have, and is never taken for a read of a guarded range -- its
// si_addr holds the sender's pid and uid, which may look like one. (It
// was absorbed once, leaving the guard uninstalled; or, crafted, it had a
// live mapping replaced by zeros.)
TEST(MappingFaultGuard, ASentSigbusStillKills) {
  EXPECT_DEATH(
      {
        MappedFile file(kPage);
        auto guard = MappingFaultGuard::Register(const_cast<const char*>(file.base()), kPage);
        raise(SIGBUS);
        std::exit(0);
      },
      "");
  EXPECT_DEATH(
      {
        MappedFile file(kPage);
        auto guard = MappingFaultGuard::Register(const_cast<const char*>(file.base()), kPage);
        siginfo_t info;
        std::memset(&info, 0, sizeof(info));
        info.si_signo = SIGBUS;
        info.si_code = SI_QUEUE;
        info.si_addr = const_cast<char*>(file.base());  // inside the guarded range
        syscall(SYS_rt_tgsigqueueinfo, getpid(), gettid(), SIGBUS, &info);
        std::exit(0);  // survived: the sent signal was taken for a fault
      },
      "");
}

TEST(MappingFaultGuard, SlotsAreReusedAfterRelease) {
  MappedFile file(kPage);
  for (int i = 0; i < MappingFaultGuard::kMaxRanges + 10; ++i) {
    auto guard = MappingFaultGuard::Register(const_cast<const char*>(file.base()), file.bytes());
    ASSERT_TRUE(guard.ok()) << i << " " << guard.status();
  }
}

TEST(MappingFaultGuard, MoreRangesThanSlotsIsResourceExhausted) {
  MappedFile file(kPage);
  std::vector<std::unique_ptr<MappingFaultGuard>> held;
  absl::Status last;
  for (int i = 0; i <= MappingFaultGuard::kMaxRanges; ++i) {
    auto guard = MappingFaultGuard::Register(const_cast<const char*>(file.base()), file.bytes());
    if (!guard.ok()) {
      last = guard.status();
      break;
    }
    held.push_back(std::move(*guard));
  }
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
}

}  // namespace
}  // namespace mlakv::server
