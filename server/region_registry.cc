#include "server/region_registry.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "kernels/nvfp4_format.h"
#include "server/cuda_ipc_region.h"
#include "server/shm_region.h"
#include "common/status_macros.h"

namespace mlakv::server {
namespace {

constexpr size_t kMaxNameBytes = 256;
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
  if (regions_.contains(name)) {
    return absl::AlreadyExistsError(absl::StrCat("region ", Quote(name), " is already registered (",
                                                 regions_.at(name)->Describe(),
                                                 "); unregister it first or pick another name"));
  }
  return absl::OkStatus();
}

v1::Region RegionRegistry::ToProto(const std::string& name, const Region& region, long use_count) const {
  v1::Region out;
  out.set_name(name);
  out.set_byte_size(region.byte_size());
  out.set_appends_in_flight(static_cast<uint32_t>(std::max(0L, use_count - 1)));
  if (region.kind() == Region::Kind::kShm) {
    const auto& shm = static_cast<const ShmRegion&>(region);
    out.set_kind(v1::REGION_KIND_SHM);
    out.set_shm_name(shm.shm_name());
    out.set_shm_offset(shm.offset());
  } else {
    out.set_kind(v1::REGION_KIND_CUDA);
    out.set_device_id(region.device());
    out.set_has_event(static_cast<const CudaIpcRegion&>(region).event() != nullptr);
  }
  return out;
}

absl::StatusOr<v1::Region> RegionRegistry::RegisterShm(const v1::RegisterShmRegionRequest& req) {
  if (absl::Status s = CheckAllowed("RegisterShmRegion"); !s.ok()) return s;
  {
    absl::ReaderMutexLock lock(&mu_);
    if (absl::Status s = CheckNewName(req.name()); !s.ok()) return s;
  }
  const std::string where = absl::StrCat("region ", Quote(req.name()));
  if (absl::Status s = ShmRegion::CheckName(req.shm_name()); !s.ok()) return WithContext(s, where);
  // Mapped outside the lock; the name is checked again before it is taken.
  absl::StatusOr<std::unique_ptr<ShmRegion>> region =
      ShmRegion::Create({.shm_name = req.shm_name(), .offset = req.offset(), .byte_size = req.byte_size()});
  if (!region.ok()) return WithContext(region.status(), where);
  const uint64_t bytes = (*region)->byte_size();
  if (absl::Status s = Admit(req.name(), bytes); !s.ok()) return s;
  std::shared_ptr<const Region> shared = Adopt(std::move(*region), bytes);
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckNewName(req.name()); !s.ok()) return s;
  regions_.emplace(req.name(), shared);
  return ToProto(req.name(), *shared, 1);
}

absl::StatusOr<v1::Region> RegionRegistry::RegisterCuda(const v1::RegisterCudaRegionRequest& req) {
  if (absl::Status s = CheckAllowed("RegisterCudaRegion"); !s.ok()) return s;
  {
    absl::ReaderMutexLock lock(&mu_);
    if (absl::Status s = CheckNewName(req.name()); !s.ok()) return s;
  }
  const std::string where = absl::StrCat("region ", Quote(req.name()));
  if (req.raw_handle().size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": raw_handle has ",
                                                   req.raw_handle().size(), " bytes; a cudaIpcMemHandle_t has ",
                                                   kCudaIpcHandleBytes));
  }
  if (!req.raw_event_handle().empty() && req.raw_event_handle().size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": raw_event_handle has ",
                                                   req.raw_event_handle().size(),
                                                   " bytes; a cudaIpcEventHandle_t has ", kCudaIpcHandleBytes,
                                                   " (or leave it empty)"));
  }
  if (req.byte_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": byte_size is 0"));
  }
  // Counted before the open, so the limits hold while it runs.
  if (absl::Status s = Admit(req.name(), req.byte_size()); !s.ok()) return s;
  // Opened outside the lock (cudaIpcOpenMemHandle may take milliseconds).
  absl::StatusOr<std::unique_ptr<CudaIpcRegion>> region =
      CudaIpcRegion::Create({.raw_handle = req.raw_handle(),
                             .device_id = req.device_id(),
                             .byte_size = req.byte_size(),
                             .raw_event_handle = req.raw_event_handle()});
  if (!region.ok()) {
    accounting_->regions.fetch_sub(1);
    accounting_->bytes.fetch_sub(req.byte_size());
    return WithContext(region.status(), where);
  }
  std::shared_ptr<const Region> shared = Adopt(std::move(*region), req.byte_size());
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckNewName(req.name()); !s.ok()) return s;  // `shared` closes the handle
  regions_.emplace(req.name(), shared);
  return ToProto(req.name(), *shared, 1);
}

absl::StatusOr<uint32_t> RegionRegistry::Unregister(const std::string& name) {
  if (absl::Status s = CheckAllowed("UnregisterRegion"); !s.ok()) return s;
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

absl::StatusOr<std::vector<v1::Region>> RegionRegistry::List() const {
  if (absl::Status s = CheckAllowed("ListRegions"); !s.ok()) return s;
  absl::ReaderMutexLock lock(&mu_);
  std::vector<v1::Region> out;
  for (const auto& [name, region] : regions_) out.push_back(ToProto(name, *region, region.use_count()));
  return out;
}

size_t RegionRegistry::size() const {
  absl::ReaderMutexLock lock(&mu_);
  return regions_.size();
}

void RegionRegistry::Clear() {
  std::map<std::string, std::shared_ptr<const Region>> dropped;
  absl::MutexLock lock(&mu_);
  dropped.swap(regions_);
}

absl::StatusOr<std::string_view> RegionRegistry::ResolveOne(const std::string& who, const char* field,
                                                            const v1::RegionRef& ref, uint64_t row_bytes,
                                                            uint32_t row_count, const std::string& pool_device,
                                                            RegionHold* hold, int64_t* device_stride,
                                                            const void** device_events) const {
  const std::string what = absl::StrCat(who, ": ", field, "_ref region ", Quote(ref.region()));
  if (ref.region().size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " names a region of ", ref.region().size(), " bytes; region names have 1..", kMaxNameBytes));
  }
  std::shared_ptr<const Region> region;
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = regions_.find(ref.region());
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat(what, " is not registered (RegisterShmRegion / RegisterCudaRegion)"));
    }
    region = it->second;
  }
  const uint64_t stride = ref.row_stride_bytes() == 0 ? row_bytes : ref.row_stride_bytes();
  if (stride < row_bytes || stride % kElementBytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": row_stride_bytes ", ref.row_stride_bytes(),
                                                   " must be 0 (packed) or a multiple of 2 that is at least the ",
                                                   row_bytes, " bytes of a row"));
  }
  const uint64_t size = region->byte_size();
  // offset + (rows - 1) x stride + row_bytes <= size, without overflow.
  const bool inside = ref.offset() <= size &&
                      (row_count == 0 || (row_bytes <= size - ref.offset() &&
                                          (row_count - 1) <= (size - ref.offset() - row_bytes) / stride));
  if (!inside) {
    return absl::OutOfRangeError(absl::StrCat(what, ": offset ", ref.offset(), " + ", row_count, " rows of ",
                                              row_bytes, " bytes at stride ", stride,
                                              " reaches past the region's ", size, " bytes"));
  }
  // Where the pool reads the region: kShm, the mapping; kCuda, a pointer
  // valid on the pool's device (the region's own, or the handle opened
  // again on the pool's device with peer access: docs/server.md "Multiple GPUs").
  const uint8_t* base = region->data();
  if (region->kind() == Region::Kind::kCuda) {
    const int pool_ordinal = CudaOrdinal(pool_device);
    if (pool_ordinal < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, " is CUDA memory on cuda:", region->device(), " but the pool is on the ", pool_device,
          " backend, which cannot read device memory; register a shared-memory region or send the rows as bytes"));
    }
    absl::StatusOr<const uint8_t*> mapped = static_cast<const CudaIpcRegion&>(*region).DataOn(pool_ordinal);
    if (!mapped.ok()) return absl::Status(mapped.status().code(), absl::StrCat(what, ": ", mapped.status().message()));
    base = *mapped;
  }
  if (std::find(hold->regions.begin(), hold->regions.end(), region) == hold->regions.end()) {
    hold->regions.push_back(region);
  }
  if (region->faulted()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": ", region->Describe(),
        " shrank while an earlier append read it and cannot be read again; unregister it and register it again"));
  }
  if (region->kind() == Region::Kind::kShm) {
    if (absl::Status s = static_cast<const ShmRegion&>(*region).CheckSize(); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
    }
  }
  const uint8_t* first = base + ref.offset();
  if (region->kind() == Region::Kind::kCuda) {
    // A device pointer: never dereferenced here; the size is the packed byte
    // count Pool::Stage checks, the stride travels in *stride.
    *device_stride = static_cast<int64_t>(stride);
    *device_events = static_cast<const CudaIpcRegion&>(*region).event();
    return std::string_view(reinterpret_cast<const char*>(first), row_count * row_bytes);
  }
  if (stride == row_bytes) {
    return std::string_view(reinterpret_cast<const char*>(first), row_count * row_bytes);
  }
  // Strided host rows: packed into one buffer the append holds (the staging
  // paths take packed rows).
  auto packed = std::make_unique<std::string>(row_count * row_bytes, '\0');
  for (uint32_t i = 0; i < row_count; ++i) {
    std::memcpy(packed->data() + i * row_bytes, first + i * stride, row_bytes);
  }
  std::string_view view(*packed);
  hold->gathered.push_back(std::move(packed));
  return view;
}

absl::Status RegionRegistry::ResolveRows(const std::string& who, const v1::LayerRows& in, uint32_t row_count,
                                         const std::string& pool_device, LayerRowsIn* out, RegionHold* hold) const {
  out->layer = in.layer();
  out->ckv = in.ckv();
  out->kpe = in.kpe();
  out->ckv_scale = in.ckv_scale();
  out->kpe_scale = in.kpe_scale();
  if (!in.has_ckv_ref() && !in.has_kpe_ref()) return absl::OkStatus();
  if (absl::Status s = CheckAllowed("an append naming a region"); !s.ok()) return s;
  int64_t ckv_device_stride = 0, kpe_device_stride = 0;  // > 0: rows in a CUDA region
  const void* events[2] = {nullptr, nullptr};
  // One tensor's rows by reference, when it names a region.
  auto resolve = [&](const char* tensor, bool has_ref, const std::string& inline_bytes, const v1::RegionRef& ref,
                     int64_t row_bytes, int64_t* device_stride, const void** event,
                     std::string_view* rows) -> absl::Status {
    if (!has_ref) return absl::OkStatus();
    if (!inline_bytes.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": carries both ", tensor, " bytes and ", tensor,
                                                     "_ref; send the rows one way"));
    }
    absl::StatusOr<std::string_view> v =
        ResolveOne(who, tensor, ref, row_bytes, row_count, pool_device, hold, device_stride, event);
    if (!v.ok()) return v.status();
    *rows = *v;
    return absl::OkStatus();
  };
  if (absl::Status s = resolve("ckv", in.has_ckv_ref(), in.ckv(), in.ckv_ref(), format::kCkvDim * kElementBytes,
                               &ckv_device_stride, &events[0], &out->ckv);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = resolve("kpe", in.has_kpe_ref(), in.kpe(), in.kpe_ref(), format::kKpeDim * kElementBytes,
                               &kpe_device_stride, &events[1], &out->kpe);
      !s.ok()) {
    return s;
  }
  // CUDA rows: both tensors must come from CUDA regions (one backend call
  // reads a row's ckv and kpe the same way); their pointers are valid on the
  // pool's device, whichever GPU each region is on.
  const bool ckv_device = ckv_device_stride > 0, kpe_device = kpe_device_stride > 0;
  if (ckv_device != kpe_device) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": ", ckv_device ? "ckv" : "kpe", " comes from a CUDA region but ", ckv_device ? "kpe" : "ckv",
        " does not; name CUDA regions for both, or send both from host memory"));
  }
  if (ckv_device) {
    out->rows_device = CudaOrdinal(pool_device);  // the pointers resolved above are valid there
    out->ckv_stride_bytes = ckv_device_stride;
    out->kpe_stride_bytes = kpe_device_stride;
    out->wait_events[0] = events[0];
    out->wait_events[1] = events[1] == events[0] ? nullptr : events[1];
  }
  return absl::OkStatus();
}

}  // namespace mlakv::server
