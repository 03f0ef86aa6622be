#include "tests/server/rpc/ipc_producer_process.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/escaping.h"

extern char** environ;

#ifndef MLAKV_CUDA_IPC_PRODUCER
#error "MLAKV_CUDA_IPC_PRODUCER (path of the producer helper) must be defined"
#endif

namespace mlakv::server::testing {
namespace {

const char* ProducerPath() {
  const char* env = std::getenv("MLAKV_CUDA_IPC_PRODUCER");
  return env != nullptr && env[0] != '\0' ? env : MLAKV_CUDA_IPC_PRODUCER;
}

}  // namespace

IpcProducerProcess::IpcProducerProcess(const std::string& bytes, int device) : device_(device) {
  // A producer that dies early makes the writes below fail with EPIPE (and
  // the test fail, naming the producer) rather than kill the test binary.
  static const bool sigpipe_ignored = std::signal(SIGPIPE, SIG_IGN) != SIG_ERR;
  (void)sigpipe_ignored;
  int in[2], out[2];
  EXPECT_EQ(pipe(in), 0);
  EXPECT_EQ(pipe(out), 0);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  posix_spawn_file_actions_addclose(&fa, in[1]);
  posix_spawn_file_actions_addclose(&fa, out[0]);
  const std::string dev = std::to_string(device), size = std::to_string(bytes.size());
  char* argv[] = {const_cast<char*>(ProducerPath()), const_cast<char*>(dev.c_str()), const_cast<char*>(size.c_str()),
                  nullptr};
  const int rc = posix_spawn(&pid_, ProducerPath(), &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(in[0]);
  close(out[1]);
  if (rc != 0) {
    // No child reads the pipe: writing to it would end this test binary
    // with SIGPIPE instead of a failure that names the helper.
    ADD_FAILURE() << "cannot start the producer " << ProducerPath() << ": " << std::strerror(rc)
                  << " (set MLAKV_CUDA_IPC_PRODUCER to its path)";
    close(in[1]);
    close(out[0]);
    pid_ = -1;
    return;
  }
  to_child_ = in[1];
  from_child_ = fdopen(out[0], "r");
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = write(to_child_, bytes.data() + off, bytes.size() - off);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  char line[512] = {};
  if (std::fgets(line, sizeof(line), from_child_) == nullptr) {
    ADD_FAILURE() << "the producer on cuda:" << device << " printed no handles (see its stderr)";
    return;
  }
  char mh[200] = {}, eh[200] = {};
  unsigned long long alloc = 0;
  if (std::sscanf(line, "%199s %199s %llu", mh, eh, &alloc) != 3) {
    ADD_FAILURE() << "unexpected producer line: " << line;
    return;
  }
  mem_handle_ = absl::HexStringToBytes(mh);
  event_handle_ = absl::HexStringToBytes(eh);
  allocation_bytes_ = alloc;
}

void IpcProducerProcess::DelayEvent(int ms) {
  const std::string command = "delay " + std::to_string(ms) + "\n";
  ASSERT_EQ(write(to_child_, command.data(), command.size()), static_cast<ssize_t>(command.size()));
  char line[64] = {};
  ASSERT_NE(std::fgets(line, sizeof(line), from_child_), nullptr) << "the producer did not answer " << command;
  EXPECT_EQ(std::string(line), "recorded\n");
}

void IpcProducerProcess::Exit() {
  if (to_child_ >= 0) close(to_child_);
  to_child_ = -1;
  if (from_child_ != nullptr) std::fclose(from_child_);
  from_child_ = nullptr;
  if (pid_ > 0) {
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  pid_ = -1;
}

std::string ReadExported(const std::string& handle, uint64_t bytes, int device) {
  int out[2];
  if (pipe(out) != 0) return "";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  posix_spawn_file_actions_addclose(&fa, out[0]);
  const std::string hex = absl::BytesToHexString(handle), size = std::to_string(bytes), dev = std::to_string(device);
  char* argv[] = {const_cast<char*>(ProducerPath()), const_cast<char*>("--read"), const_cast<char*>(dev.c_str()),
                  const_cast<char*>(hex.c_str()), const_cast<char*>(size.c_str()), nullptr};
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, ProducerPath(), &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(out[1]);
  std::string data;
  if (rc == 0) {
    char buf[1 << 16];
    ssize_t n;
    while ((n = read(out[0], buf, sizeof(buf))) > 0) data.append(buf, static_cast<size_t>(n));
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) data.clear();
  }
  close(out[0]);
  return data.size() == bytes ? data : "";
}

void ExpectDecodeSideReads(const v1::ExportPoolResponse& exp, uint32_t layer, const v1::Sequence& seq,
                           const QuantizedRows& stored, uint32_t positions, int device, const std::string& what) {
  const uint32_t ps = exp.page_size();
  const v1::ExportedLayer& l = exp.layers(layer);
  struct Cache {
    const v1::ExportedBuffer* buf;
    const std::vector<uint8_t>* stored;
  } caches[] = {{&l.ckv_cache(), &stored.ckv_packed},
                {&l.ckv_sf_cache(), &stored.ckv_sf},
                {&l.kpe_cache(), &stored.kpe}};
  for (const Cache& c : caches) {
    const uint32_t stride = c.buf->entry_stride_bytes();
    const std::string mem = ReadExported(c.buf->raw_handle(), c.buf->byte_size(), device);
    ASSERT_EQ(mem.size(), c.buf->byte_size()) << what << ": the decode-side process could not read the exported cache";
    for (uint32_t p = 0; p < positions; ++p) {
      const uint64_t entry = uint64_t{seq.kv_indices(p / ps)} * ps + p % ps;
      EXPECT_EQ(0, std::memcmp(mem.data() + c.buf->offset() + entry * stride, c.stored->data() + p * stride, stride))
          << what << ": position " << p << " stride " << stride;
    }
  }
}

}  // namespace mlakv::server::testing
