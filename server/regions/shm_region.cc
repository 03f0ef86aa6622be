#include "server/regions/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"

namespace mlakv::server {
namespace {

const char* FileKind(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

}  // namespace

absl::Status ShmRegion::CheckName(const std::string& name) {
  auto bad = [&](const char* why) {
    return absl::InvalidArgumentError(absl::StrCat("shm_name ", Quote(name), " ", why,
                                                   "; a POSIX shared-memory name is \"/\" then 1..254 bytes without "
                                                   "\"/\", NUL or control characters (as passed to shm_open)"));
  };
  if (name.size() < 2 || name[0] != '/') return bad("does not start with \"/\" followed by a name");
  if (name.size() > 255) return bad(absl::StrCat("has ", name.size(), " bytes").c_str());
  const std::string rest = name.substr(1);
  if (rest == "." || rest == "..") return bad("names a directory");
  for (unsigned char c : rest) {
    if (c == '/') return bad("has more than one path component");
    if (c == '\0') return bad("contains a NUL byte");
    if (c < 0x20 || c == 0x7f) return bad("contains a control character");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Create(const Options& options) {
  const std::string& name = options.shm_name;
  MLAKV_RETURN_IF_ERROR(CheckName(name));
  const std::string quoted = Quote(name);
  // O_NONBLOCK: opening a FIFO does not wait for a writer. O_NOFOLLOW: a
  // symbolic link in /dev/shm is refused (ELOOP) instead of followed.
  const int fd = shm_open(name.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0) {
    const int err = errno;
    const std::string why = absl::StrCat("shm_open(", quoted, ", O_RDONLY): ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(why, "; create the object before registering it"));
    if (err == EACCES) return absl::PermissionDeniedError(why);
    if (err == ELOOP) return absl::InvalidArgumentError(absl::StrCat(why, "; the name is a symbolic link, which is refused"));
    return absl::FailedPreconditionError(why);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("fstat of shared-memory object ", quoted, ": ", std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "shared-memory object ", quoted, " is ", FileKind(st.st_mode),
        ", not a regular object; register an object made with shm_open(O_CREAT) and ftruncate"));
  }
  const uint64_t object_size = static_cast<uint64_t>(st.st_size);
  if (options.offset >= object_size && !(options.offset == 0 && object_size == 0)) {
    close(fd);
    return absl::OutOfRangeError(absl::StrCat("offset ", options.offset, " is outside shared-memory object ", quoted,
                                              " of ", object_size, " bytes"));
  }
  const uint64_t byte_size = options.byte_size == 0 ? object_size - options.offset : options.byte_size;
  if (byte_size == 0) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory object ", quoted, " is empty (0 bytes); size it (ftruncate) before registering"));
  }
  if (byte_size > object_size - options.offset) {
    close(fd);
    return absl::OutOfRangeError(absl::StrCat("offset ", options.offset, " + byte_size ", byte_size,
                                              " exceeds shared-memory object ", quoted, " of ", object_size,
                                              " bytes"));
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t map_offset = options.offset / page * page;
  const uint64_t map_bytes = options.offset - map_offset + byte_size;
  void* base = mmap(nullptr, map_bytes, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(map_offset));
  if (base == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("mmap of ", map_bytes, " bytes of shared-memory object ", quoted, " at ",
                                            map_offset, ": ", std::strerror(err)));
  }
  absl::StatusOr<std::unique_ptr<MappingFaultGuard>> guard = MappingFaultGuard::Register(base, map_bytes);
  if (!guard.ok()) {
    munmap(base, map_bytes);
    close(fd);
    return guard.status();
  }
  return std::unique_ptr<ShmRegion>(new ShmRegion(name, fd, options.offset, byte_size, static_cast<uint8_t*>(base),
                                                  map_offset, map_bytes, std::move(*guard)));
}

ShmRegion::ShmRegion(std::string shm_name, int fd, uint64_t offset, uint64_t byte_size, uint8_t* map_base,
                     uint64_t map_offset, uint64_t map_bytes, std::unique_ptr<MappingFaultGuard> guard)
    : shm_name_(std::move(shm_name)),
      fd_(fd),
      offset_(offset),
      byte_size_(byte_size),
      map_base_(map_base),
      map_offset_(map_offset),
      map_bytes_(map_bytes),
      guard_(std::move(guard)) {}

ShmRegion::~ShmRegion() {
  guard_.reset();  // no reader is left (the region is released), so no fault can race this
  munmap(map_base_, map_bytes_);
  close(fd_);
}

absl::Status ShmRegion::CheckSize() const {
  if (faulted()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shared-memory object ", Quote(shm_name_),
        " shrank while an earlier append read it, so the region no longer reads the object; unregister it and "
        "register it again"));
  }
  struct stat st;
  if (fstat(fd_, &st) != 0) {
    return absl::InternalError(
        absl::StrCat("fstat of shared-memory object ", Quote(shm_name_), ": ", std::strerror(errno)));
  }
  if (static_cast<uint64_t>(st.st_size) < offset_ + byte_size_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shared-memory object ", Quote(shm_name_), " shrank to ", st.st_size, " bytes but the region spans [", offset_,
        ", ", offset_ + byte_size_, "); re-register it after resizing"));
  }
  return absl::OkStatus();
}

std::string ShmRegion::Describe() const {
  return absl::StrCat("shm ", Quote(shm_name_), " offset ", offset_, " bytes ", byte_size_);
}

}  // namespace mlakv::server
