#include "server/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace mlakv::server {

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Create(const Options& options) {
  const std::string& name = options.shm_name;
  if (name.size() < 2 || name.size() > 255 || name[0] != '/' || name.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("shm_name '", name,
                                                   "' is not a POSIX shared-memory name: expected \"/\" then 1..254 "
                                                   "characters without \"/\" (as passed to shm_open)"));
  }
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) {
    const int err = errno;
    const std::string why = absl::StrCat("shm_open('", name, "', O_RDONLY): ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(why, "; create the object before registering it"));
    if (err == EACCES) return absl::PermissionDeniedError(why);
    return absl::InternalError(why);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("fstat of shared-memory object '", name, "': ", std::strerror(err)));
  }
  const uint64_t object_size = static_cast<uint64_t>(st.st_size);
  if (options.offset >= object_size && !(options.offset == 0 && object_size == 0)) {
    close(fd);
    return absl::OutOfRangeError(absl::StrCat("offset ", options.offset, " is outside shared-memory object '", name,
                                              "' of ", object_size, " bytes"));
  }
  const uint64_t byte_size = options.byte_size == 0 ? object_size - options.offset : options.byte_size;
  if (byte_size == 0) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory object '", name, "' is empty (0 bytes); size it (ftruncate) before registering"));
  }
  if (byte_size > object_size - options.offset) {
    close(fd);
    return absl::OutOfRangeError(absl::StrCat("offset ", options.offset, " + byte_size ", byte_size,
                                              " exceeds shared-memory object '", name, "' of ", object_size,
                                              " bytes"));
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t map_offset = options.offset / page * page;
  const uint64_t map_bytes = options.offset - map_offset + byte_size;
  void* base = mmap(nullptr, map_bytes, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(map_offset));
  if (base == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("mmap of ", map_bytes, " bytes of shared-memory object '", name,
                                            "' at ", map_offset, ": ", std::strerror(err)));
  }
  return std::unique_ptr<ShmRegion>(new ShmRegion(name, fd, options.offset, byte_size, static_cast<uint8_t*>(base),
                                                  map_offset, map_bytes));
}

ShmRegion::ShmRegion(std::string shm_name, int fd, uint64_t offset, uint64_t byte_size, uint8_t* map_base,
                     uint64_t map_offset, uint64_t map_bytes)
    : shm_name_(std::move(shm_name)),
      fd_(fd),
      offset_(offset),
      byte_size_(byte_size),
      map_base_(map_base),
      map_offset_(map_offset),
      map_bytes_(map_bytes) {}

ShmRegion::~ShmRegion() {
  munmap(map_base_, map_bytes_);
  close(fd_);
}

absl::Status ShmRegion::CheckSize() const {
  struct stat st;
  if (fstat(fd_, &st) != 0) {
    return absl::InternalError(absl::StrCat("fstat of shared-memory object '", shm_name_, "': ", std::strerror(errno)));
  }
  if (static_cast<uint64_t>(st.st_size) < offset_ + byte_size_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shared-memory object '", shm_name_, "' shrank to ", st.st_size, " bytes but the region spans [", offset_,
        ", ", offset_ + byte_size_, "); re-register it after resizing"));
  }
  return absl::OkStatus();
}

std::string ShmRegion::Describe() const {
  return absl::StrCat("shm '", shm_name_, "' offset ", offset_, " bytes ", byte_size_);
}

}  // namespace mlakv::server
