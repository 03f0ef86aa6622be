#include "server/regions/region_registry.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "kernels/nvfp4_format.h"
#include "server/regions/cuda_ipc_region.h"
#include "server/regions/shm_region.h"
#include "common/status_macros.h"

namespace mlakv::server {
namespace {

constexpr size_t kMaxNameBytes = kMaxRegionNameBytes;
constexpr size_t kCudaIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t) and sizeof(cudaIpcEventHandle_t)
// Both row dtypes (fp16, bf16) have 2-byte elements, so a row's bytes do not
// depend on which one the append names (Pool::Stage checks the dtype).
constexpr uint64_t kElementBytes = 2;

}  // namespace

absl::Status RegionHold::CheckNoFaults(const std::string& who) const {
  for (const auto& region : regions) {
    if (region->faulted()) {
      return absl::FailedPreconditionError(absl::StrCat(
          who, ": ", region->Describe(),
          " shrank while this append read it, so the rows read are not the producer's; nothing was written. "
          "Unregister the region and register it again (a producer must not shrink an object while it is "
          "registered)"));
    }
  }
  return absl::OkStatus();
}

RegionRegistry::RegionRegistry(Options options) : options_(options), worker_(std::make_unique<SerialExecutor>()) {}

RegionRegistry::~RegionRegistry() {
  worker_.reset();  // finishes the registrations and releases queued
}

absl::Status RegionRegistry::Admit(const std::string& name, uint64_t bytes) {
  // Count first, then check, so that concurrent registrations cannot all pass.
  const uint32_t regions = accounting_->regions.fetch_add(1) + 1;
  const uint64_t total = accounting_->bytes.fetch_add(bytes) + bytes;
  if (regions <= options_.max_regions && total <= options_.max_region_bytes) return absl::OkStatus();
  accounting_->regions.fetch_sub(1);
  accounting_->bytes.fetch_sub(bytes);
  return absl::ResourceExhaustedError(absl::StrCat(
      "region ", Quote(name), " of ", bytes, " bytes would make ", regions, " regions of ", total,
      " bytes, over this server's limits of ", options_.max_regions, " regions and ", options_.max_region_bytes,
      " bytes (max_regions, max_region_bytes; unregistered regions count until the appends holding them end); "
      "unregister regions you no longer use"));
}

std::shared_ptr<const Region> RegionRegistry::Adopt(std::unique_ptr<Region> region, uint64_t bytes) {
  return std::shared_ptr<const Region>(region.release(), [accounting = accounting_, bytes](const Region* r) {
    delete r;
    accounting->regions.fetch_sub(1);
    accounting->bytes.fetch_sub(bytes);
  });
}

absl::Status RegionRegistry::CheckAllowed(const char* what) const {
  if (options_.allow_ipc) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat(what, " is refused: this server was started without --allow_ipc (regions let another process's "
                   "memory be read by the server; enable them only where producers are trusted)"));
}

absl::Status RegionRegistry::CheckNewName(const std::string& name) const {
  if (name.empty() || name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("region name ", Quote(name), " has ", name.size(),
                                                   " bytes; a region name has 1..", kMaxNameBytes, " bytes"));
  }
  if (auto it = regions_.find(name); it != regions_.end()) {
    return absl::AlreadyExistsError(absl::StrCat("region ", Quote(name), " is already registered (",
                                                 it->second->Describe(),
                                                 "); unregister it first or pick another name"));
  }
  return absl::OkStatus();
}

RegionInfo RegionRegistry::InfoOf(const std::string& name, const Region& region, long use_count) {
  RegionInfo out;
  out.name = name;
  out.kind = region.kind();
  out.byte_size = region.byte_size();
  out.appends_in_flight = static_cast<uint32_t>(std::max(0L, use_count - 1));
  if (region.kind() == Region::Kind::kShm) {
    const auto& shm = static_cast<const ShmRegion&>(region);
    out.shm_name = shm.shm_name();
    out.shm_offset = shm.offset();
  } else {
    out.device = region.device();
    out.has_event = static_cast<const CudaIpcRegion&>(region).event() != nullptr;
  }
  return out;
}

absl::StatusOr<RegionInfo> RegionRegistry::Insert(const std::string& name, std::shared_ptr<const Region> region) {
  absl::MutexLock lock(&mu_);
  MLAKV_RETURN_IF_ERROR(CheckNewName(name));  // `region` is released if the name was taken meanwhile
  RegionInfo info = InfoOf(name, *region, 1);
  regions_.emplace(name, std::move(region));
  return info;
}

absl::StatusOr<RegionInfo> RegionRegistry::RegisterShm(const std::string& name, const ShmRegion::Options& shm) {
  MLAKV_RETURN_IF_ERROR(CheckAllowed("RegisterShmRegion"));
  {
    absl::ReaderMutexLock lock(&mu_);
    MLAKV_RETURN_IF_ERROR(CheckNewName(name));
  }
  const std::string where = absl::StrCat("region ", Quote(name));
  MLAKV_RETURN_IF_ERROR(WithContext(ShmRegion::CheckName(shm.shm_name), where));
  // Mapped outside the lock; the name is checked again before it is taken.
  absl::StatusOr<std::unique_ptr<ShmRegion>> region = ShmRegion::Create(shm);
  if (!region.ok()) return WithContext(region.status(), where);
  const uint64_t bytes = (*region)->byte_size();
  MLAKV_RETURN_IF_ERROR(Admit(name, bytes));
  return Insert(name, Adopt(std::move(*region), bytes));
}

absl::StatusOr<RegionInfo> RegionRegistry::RegisterCuda(const std::string& name, const CudaIpcRegion::Options& cuda) {
  MLAKV_RETURN_IF_ERROR(CheckAllowed("RegisterCudaRegion"));
  {
    absl::ReaderMutexLock lock(&mu_);
    MLAKV_RETURN_IF_ERROR(CheckNewName(name));
  }
  const std::string where = absl::StrCat("region ", Quote(name));
  if (cuda.raw_handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": raw_handle has ", cuda.raw_handle.size(),
                                                   " bytes; a cudaIpcMemHandle_t has ", kCudaIpcHandleBytes));
  }
  if (!cuda.raw_event_handle.empty() && cuda.raw_event_handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": raw_event_handle has ", cuda.raw_event_handle.size(),
                                                   " bytes; a cudaIpcEventHandle_t has ", kCudaIpcHandleBytes,
                                                   " (or leave it empty)"));
  }
  if (cuda.byte_size == 0) return absl::InvalidArgumentError(absl::StrCat(where, ": byte_size is 0"));
  // Counted before the open, so the limits hold while it runs.
  MLAKV_RETURN_IF_ERROR(Admit(name, cuda.byte_size));
  // Opened outside the lock (cudaIpcOpenMemHandle may take milliseconds).
  absl::StatusOr<std::unique_ptr<CudaIpcRegion>> region = CudaIpcRegion::Create(cuda);
  if (!region.ok()) {
    accounting_->regions.fetch_sub(1);
    accounting_->bytes.fetch_sub(cuda.byte_size);
    return WithContext(region.status(), where);
  }
  return Insert(name, Adopt(std::move(*region), cuda.byte_size));
}

absl::StatusOr<uint32_t> RegionRegistry::Unregister(const std::string& name) {
  MLAKV_RETURN_IF_ERROR(CheckAllowed("UnregisterRegion"));
  if (name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("region name ", Quote(name), " has ", name.size(),
                                                   " bytes; a region name has 1..", kMaxNameBytes, " bytes"));
  }
  std::shared_ptr<const Region> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(name);
    if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("region ", Quote(name), " is not registered"));
    region = std::move(it->second);
    regions_.erase(it);
  }
  // `region` is the registry's former reference; the others are appends'.
  const uint32_t holders = static_cast<uint32_t>(std::max(0L, region.use_count() - 1));
  // The release (munmap, cudaIpcCloseMemHandle) happens on the worker when
  // this was the last reference.
  worker_->Post([region = std::move(region)]() mutable { region.reset(); });
  return holders;
}

absl::StatusOr<std::vector<RegionInfo>> RegionRegistry::List() const {
  MLAKV_RETURN_IF_ERROR(CheckAllowed("ListRegions"));
  absl::ReaderMutexLock lock(&mu_);
  std::vector<RegionInfo> out;
  for (const auto& [name, region] : regions_) out.push_back(InfoOf(name, *region, region.use_count()));
  return out;
}

size_t RegionRegistry::size() const {
  absl::ReaderMutexLock lock(&mu_);
  return regions_.size();
}

void RegionRegistry::Clear() {
  std::map<std::string, std::shared_ptr<const Region>, std::less<>> dropped;
  absl::MutexLock lock(&mu_);
  dropped.swap(regions_);
}

absl::StatusOr<RegionRegistry::Resolved> RegionRegistry::ResolveOne(absl::FunctionRef<std::string()> who, const char* field,
                                                                    const RegionRef& ref, uint64_t row_bytes,
                                                                    uint32_t row_count, const Device& pool_device,
                                                                    RegionHold* hold) const {
  // Built only for a message (a decode step resolves 122 references).
  const auto what = [&] { return absl::StrCat(who(), ": ", field, "_ref region ", Quote(ref.region)); };
  if (ref.region.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what(), " names a region of ", ref.region.size(), " bytes; region names have 1..", kMaxNameBytes));
  }
  std::shared_ptr<const Region> region;
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = regions_.find(ref.region);
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat(what(), " is not registered (RegisterShmRegion / RegisterCudaRegion)"));
    }
    region = it->second;
  }
  uint64_t stride = ref.row_stride_bytes == 0 ? row_bytes : ref.row_stride_bytes;
  if (stride < row_bytes || stride % kElementBytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what(), ": row_stride_bytes ", ref.row_stride_bytes,
                                                   " must be 0 (packed) or a multiple of 2 that is at least the ",
                                                   row_bytes, " bytes of a row"));
  }
  // One row never steps: its stride is the row's. (Kept as given, a stride
  // of 2^63 or more passed the bounds check below, which never multiplies it
  // for one row, and turned negative as a CUDA row's int64 stride -- read
  // as host memory, a device pointer the staging copy dereferenced.) With
  // two rows or more the check bounds it by the region's size.
  if (row_count <= 1) stride = row_bytes;
  const uint64_t size = region->byte_size();
  // offset + (rows - 1) x stride + row_bytes <= size, without overflow.
  const bool inside = ref.offset <= size &&
                      (row_count == 0 || (row_bytes <= size - ref.offset &&
                                          (row_count - 1) <= (size - ref.offset - row_bytes) / stride));
  if (!inside) {
    return absl::OutOfRangeError(absl::StrCat(what(), ": offset ", ref.offset, " + ", row_count, " rows of ", row_bytes,
                                              " bytes at stride ", stride, " reaches past the region's ", size,
                                              " bytes"));
  }
  // Where the pool reads the region: kShm, the mapping; kCuda, a pointer
  // valid on the pool's device (the region's own, or the handle opened
  // again on the pool's device with peer access: docs/server.md "Multiple GPUs").
  const uint8_t* base = region->data();
  if (region->kind() == Region::Kind::kCuda) {
    if (!pool_device.is_cuda()) {
      return absl::FailedPreconditionError(absl::StrCat(
          what(), " is CUDA memory on cuda:", region->device(), " but the pool is on the ", pool_device.ToString(),
          " backend, which cannot read device memory; register a shared-memory region or send the rows as bytes"));
    }
    absl::StatusOr<const uint8_t*> mapped = static_cast<const CudaIpcRegion&>(*region).DataOn(pool_device.ordinal());
    if (!mapped.ok()) return WithContext(mapped.status(), what());
    base = *mapped;
  }
  if (std::find(hold->regions.begin(), hold->regions.end(), region) == hold->regions.end()) {
    hold->regions.push_back(region);
  }
  if (region->faulted()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what(), ": ", region->Describe(),
        " shrank while an earlier append read it and cannot be read again; unregister it and register it again"));
  }
  if (region->kind() == Region::Kind::kShm) {
    if (absl::Status st = static_cast<const ShmRegion&>(*region).CheckSize(); !st.ok()) return WithContext(st, what());
  }
  const uint8_t* first = base + ref.offset;
  Resolved out;
  out.bytes = row_count * row_bytes;
  if (region->kind() == Region::Kind::kCuda) {
    // A device pointer: never dereferenced here; the stride travels along.
    out.data = first;
    out.device_stride = static_cast<int64_t>(stride);
    out.event = static_cast<const CudaIpcRegion&>(*region).event();
    return out;
  }
  if (stride == row_bytes) {
    out.data = first;
    return out;
  }
  // Strided host rows: packed into one buffer the append holds (the staging
  // paths take packed rows).
  auto packed = std::make_unique<std::string>(row_count * row_bytes, '\0');
  for (uint32_t i = 0; i < row_count; ++i) {
    std::memcpy(packed->data() + i * row_bytes, first + i * stride, row_bytes);
  }
  out.data = packed->data();
  hold->gathered.push_back(std::move(packed));
  return out;
}

absl::Status RegionRegistry::ResolveRows(absl::FunctionRef<std::string()> who, const LayerRowsRequest& in, uint32_t row_count,
                                         const Device& pool_device, LayerRows* out, RegionHold* hold) const {
  out->layer = in.layer;
  out->source = RowSource{.ckv = in.ckv.data(), .kpe = in.kpe.data()};
  out->ckv_bytes = in.ckv.size();
  out->kpe_bytes = in.kpe.size();
  if (in.ckv_pieces != nullptr) {
    out->source.ckv = nullptr;
    out->source.ckv_pieces = in.ckv_pieces;
    out->ckv_bytes = in.ckv_pieces->size();
  }
  if (in.kpe_pieces != nullptr) {
    out->source.kpe = nullptr;
    out->source.kpe_pieces = in.kpe_pieces;
    out->kpe_bytes = in.kpe_pieces->size();
  }
  out->ckv_scale = in.ckv_scale;
  out->kpe_scale = in.kpe_scale;
  if (!in.ckv_ref && !in.kpe_ref) return absl::OkStatus();
  MLAKV_RETURN_IF_ERROR(CheckAllowed("an append naming a region"));
  // One tensor's rows by reference, when it names a region.
  auto resolve = [&](const char* tensor, const std::optional<RegionRef>& ref, uint64_t inline_bytes,
                     uint64_t row_bytes) -> absl::StatusOr<std::optional<Resolved>> {
    if (!ref) return std::optional<Resolved>();
    if (inline_bytes != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(who(), ": carries both ", tensor, " bytes and ", tensor, "_ref; send the rows one way"));
    }
    MLAKV_ASSIGN_OR_RETURN(Resolved r, ResolveOne(who, tensor, *ref, row_bytes, row_count, pool_device, hold));
    return std::optional<Resolved>(r);
  };
  MLAKV_ASSIGN_OR_RETURN(std::optional<Resolved> ckv,
                         resolve("ckv", in.ckv_ref, out->ckv_bytes, format::kCkvDim * kElementBytes));
  MLAKV_ASSIGN_OR_RETURN(std::optional<Resolved> kpe,
                         resolve("kpe", in.kpe_ref, out->kpe_bytes, format::kKpeDim * kElementBytes));
  if (ckv) {
    out->source.ckv = ckv->data;
    out->ckv_bytes = ckv->bytes;
  }
  if (kpe) {
    out->source.kpe = kpe->data;
    out->kpe_bytes = kpe->bytes;
  }
  // CUDA rows: both tensors must come from CUDA regions (one backend call
  // reads a row's ckv and kpe the same way); their pointers are valid on the
  // pool's device, whichever GPU each region is on.
  const bool ckv_device = ckv && ckv->device_stride > 0, kpe_device = kpe && kpe->device_stride > 0;
  if (ckv_device != kpe_device) {
    return absl::InvalidArgumentError(absl::StrCat(
        who(), ": ", ckv_device ? "ckv" : "kpe", " comes from a CUDA region but ", ckv_device ? "kpe" : "ckv",
        " does not; name CUDA regions for both, or send both from host memory"));
  }
  if (ckv_device) {
    out->source.device = pool_device.ordinal();  // the pointers resolved above are valid there
    out->source.ckv_stride_bytes = ckv->device_stride;
    out->source.kpe_stride_bytes = kpe->device_stride;
    out->source.wait_events[0] = ckv->event;
    out->source.wait_events[1] = kpe->event == ckv->event ? nullptr : kpe->event;
  }
  return absl::OkStatus();
}

std::vector<const void*> RegionRegistry::EventsOf(std::span<const absl::string_view> names, RegionHold* hold) const {
  std::vector<const void*> events;
  absl::ReaderMutexLock lock(&mu_);
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0 && names[i] == names[i - 1]) continue;  // a request names one region many times in a row
    auto it = regions_.find(names[i]);
    if (it == regions_.end() || it->second->kind() != Region::Kind::kCuda) continue;
    const void* event = static_cast<const CudaIpcRegion&>(*it->second).event();
    if (event == nullptr || std::find(events.begin(), events.end(), event) != events.end()) continue;
    events.push_back(event);
    hold->regions.push_back(it->second);
  }
  return events;
}

}  // namespace mlakv::server
