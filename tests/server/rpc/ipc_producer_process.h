// IpcProducerProcess: the producer side of the CUDA IPC region tests in its
// own process (tests/server/cuda_ipc_producer.cc), as a real prefill worker
// would be: a handle cannot be opened by the process that exported it.
// Also the decode side of ExportPool (ReadExported) and hex helpers.
//
// The helper binary is $MLAKV_CUDA_IPC_PRODUCER when set (a bundled copy on
// the GPU machine), else the one this build made.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "kernels/quantize_rows.h"
#include "mlakv/v1/kv_cache.pb.h"

namespace mlakv::server::testing {

class IpcProducerProcess {
 public:
  // Starts the producer on cuda:`device`, hands it `bytes` (copied to the
  // start of a cudaMalloc of bytes + 4096 there) and reads back its handles.
  // Failures are gtest failures; mem_handle() is then empty.
  explicit IpcProducerProcess(const std::string& bytes, int device = 0);
  ~IpcProducerProcess() { Exit(); }
  IpcProducerProcess(const IpcProducerProcess&) = delete;
  IpcProducerProcess& operator=(const IpcProducerProcess&) = delete;

  // Lets the producer free its allocation and exit; waits for it.
  void Exit();
  // Records the event again behind `ms` ms of host sleep on the producer's
  // stream: it completes `ms` ms from now, as a producer's event does while
  // its GPU still computes. Returns once it is recorded.
  void DelayEvent(int ms);
  const std::string& mem_handle() const { return mem_handle_; }      // 64 bytes of cudaIpcMemHandle_t
  const std::string& event_handle() const { return event_handle_; }  // 64 bytes of cudaIpcEventHandle_t
  uint64_t allocation_bytes() const { return allocation_bytes_; }
  int device() const { return device_; }

 private:
  int device_ = 0;
  pid_t pid_ = -1;
  int to_child_ = -1;
  FILE* from_child_ = nullptr;
  std::string mem_handle_, event_handle_;
  uint64_t allocation_bytes_ = 0;
};

// The decode side of ExportPool in its own process: the first `bytes` bytes
// behind `handle`, opened with cuda:`device` current (cuda_ipc_producer
// --read), or "" on failure.
std::string ReadExported(const std::string& handle, uint64_t bytes, int device = 0);

// ExportPool seen from the decode side: for each cache of layer `layer` in
// `exp` (ckv, ckv_sf, kpe), a decode-side process opens the handle with
// cuda:`device` current, and the entries `seq`'s page table names for
// positions [0, positions) hold the bytes of `stored` (read back by
// ReadSequence). `what` starts each failure message. Fatal failures (the
// process could not read a cache) end the check; wrap it in
// ASSERT_NO_FATAL_FAILURE to end the test too.
void ExpectDecodeSideReads(const v1::ExportPoolResponse& exp, uint32_t layer, const v1::Sequence& seq,
                           const QuantizedRows& stored, uint32_t positions, int device, const std::string& what);

}  // namespace mlakv::server::testing
