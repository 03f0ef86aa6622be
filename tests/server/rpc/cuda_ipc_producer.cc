// cuda_ipc_producer: the producer side of the CUDA IPC region tests, a
// separate process as a real prefill worker would be (a handle cannot be
// opened by the process that exported it).
//
//   cuda_ipc_producer DEVICE BYTES
// reads BYTES bytes from stdin, cudaMallocs BYTES (+ 4096 spare) on DEVICE,
// copies them to the start of the allocation, creates an interprocess event
// and records it after the copy, then prints one line
//   "<128 hex of cudaIpcMemHandle_t> <128 hex of cudaIpcEventHandle_t> <allocation bytes>"
// and then reads commands from stdin until EOF (the test closes it), before
// freeing and exiting 0:
//   "delay MS\n"  its stream sleeps MS ms on the host (cudaLaunchHostFunc),
//                 then the event is recorded again, so that it completes MS
//                 ms from now (a producer still computing); prints "recorded"
// Any failure: a message on stderr and exit 1.
//
//   cuda_ipc_producer --read DEVICE HANDLE_HEX BYTES
// the decode side of ExportPool: opens the cudaIpcMemHandle_t, copies its
// first BYTES bytes to the host and writes them to stdout.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <string>
#include <vector>

namespace {

int Fail(const char* what, cudaError_t err) {
  std::fprintf(stderr, "cuda_ipc_producer: %s: %s\n", what, cudaGetErrorString(err));
  return 1;
}

std::string Hex(const void* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char b = static_cast<const unsigned char*>(p)[i];
    out.push_back(digits[b >> 4]);
    out.push_back(digits[b & 15]);
  }
  return out;
}

void CUDART_CB SleepOnTheStream(void* ms) { std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<int*>(ms))); }

}  // namespace

int Read(int device, const std::string& hex, size_t bytes) {
  if (hex.size() != 2 * sizeof(cudaIpcMemHandle_t)) {
    std::fprintf(stderr, "cuda_ipc_producer --read: handle must be %zu hex digits\n", 2 * sizeof(cudaIpcMemHandle_t));
    return 2;
  }
  cudaIpcMemHandle_t h;
  for (size_t i = 0; i < sizeof(h); ++i) {
    reinterpret_cast<unsigned char*>(&h)[i] = static_cast<unsigned char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  }
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return Fail("cudaSetDevice", e);
  void* dev = nullptr;
  if (cudaError_t e = cudaIpcOpenMemHandle(&dev, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
    return Fail("cudaIpcOpenMemHandle", e);
  }
  std::vector<unsigned char> host(bytes);
  if (cudaError_t e = cudaMemcpy(host.data(), dev, bytes, cudaMemcpyDeviceToHost); e != cudaSuccess) {
    return Fail("cudaMemcpy", e);
  }
  cudaIpcCloseMemHandle(dev);
  return std::fwrite(host.data(), 1, bytes, stdout) == bytes ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc == 5 && std::string(argv[1]) == "--read") {
    return Read(std::atoi(argv[2]), argv[3], std::strtoull(argv[4], nullptr, 10));
  }
  if (argc != 3) {
    std::fprintf(stderr, "usage: cuda_ipc_producer DEVICE BYTES < rows\n");
    return 2;
  }
  const int device = std::atoi(argv[1]);
  const size_t bytes = std::strtoull(argv[2], nullptr, 10);
  std::vector<unsigned char> host(bytes);
  if (std::fread(host.data(), 1, bytes, stdin) != bytes) {
    std::fprintf(stderr, "cuda_ipc_producer: stdin ended before %zu bytes\n", bytes);
    return 1;
  }
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return Fail("cudaSetDevice", e);
  const size_t alloc = bytes + 4096;
  void* dev = nullptr;
  if (cudaError_t e = cudaMalloc(&dev, alloc); e != cudaSuccess) return Fail("cudaMalloc", e);
  cudaStream_t stream;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return Fail("cudaStreamCreate", e);
  }
  cudaEvent_t event;
  if (cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventInterprocess | cudaEventDisableTiming);
      e != cudaSuccess) {
    return Fail("cudaEventCreate", e);
  }
  if (cudaError_t e = cudaMemcpyAsync(dev, host.data(), bytes, cudaMemcpyHostToDevice, stream); e != cudaSuccess) {
    return Fail("cudaMemcpyAsync", e);
  }
  if (cudaError_t e = cudaEventRecord(event, stream); e != cudaSuccess) return Fail("cudaEventRecord", e);
  // Pageable source: the copy has finished when cudaMemcpyAsync returns for
  // most sizes, but only the event says so; the server waits on it.
  cudaIpcMemHandle_t mh;
  if (cudaError_t e = cudaIpcGetMemHandle(&mh, dev); e != cudaSuccess) return Fail("cudaIpcGetMemHandle", e);
  cudaIpcEventHandle_t eh;
  if (cudaError_t e = cudaIpcGetEventHandle(&eh, event); e != cudaSuccess) return Fail("cudaIpcGetEventHandle", e);
  std::printf("%s %s %zu\n", Hex(&mh, sizeof(mh)).c_str(), Hex(&eh, sizeof(eh)).c_str(), alloc);
  std::fflush(stdout);
  char command[64];
  static int delay_ms = 0;  // read by the host function while the stream runs it
  while (std::fgets(command, sizeof(command), stdin) != nullptr) {
    if (std::sscanf(command, "delay %d", &delay_ms) == 1) {
      if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) return Fail("cudaStreamSynchronize", e);
      if (cudaError_t e = cudaLaunchHostFunc(stream, SleepOnTheStream, &delay_ms); e != cudaSuccess) {
        return Fail("cudaLaunchHostFunc", e);
      }
      if (cudaError_t e = cudaEventRecord(event, stream); e != cudaSuccess) return Fail("cudaEventRecord", e);
      std::printf("recorded\n");
      std::fflush(stdout);
    }
  }
  cudaStreamSynchronize(stream);
  cudaEventDestroy(event);
  cudaStreamDestroy(stream);
  cudaFree(dev);
  return 0;
}
