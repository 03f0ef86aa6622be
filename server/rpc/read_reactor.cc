#include "server/rpc/read_reactor.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "kernels/dequantize.h"
#include "kernels/nvfp4_format.h"
#include "server/rpc/call_support.h"
#include "server/rpc/grpc_status.h"

namespace mlakv::server {
namespace {

using format::kCkvDim;
using format::kCkvPackedBytes;
using format::kCkvSfBytes;
using format::kKpeBytes;
using format::kKpeDim;

constexpr uint64_t kTargetReadMessageBytes = 4 << 20;

}  // namespace

void ReadReactor::Request(void* tag) {
  grpc::ServerCompletionQueue* queue = queue_->queue();
  service_->async()->RequestReadSequence(&ctx_, request(), writer(), queue, queue, tag);
}

void ReadReactor::OnStart() {
  const v1::ReadSequenceRequest* req = request();
  sequence_ = SequenceRef(req->sequence());
  detail_ = absl::StrCat("pool=", Quote(req->pool()), " sequence=", Quote(req->sequence()));
  const absl::Status status = Plan(service_, req);
  if (!status.ok() || count_ == 0 || layers_.empty()) {
    Done(status);
    return;
  }
  Next();
}

absl::Status ReadReactor::Plan(KvCacheService* service, const v1::ReadSequenceRequest* req) {
  if (service->draining()) return DrainingError();
  MLAKV_RETURN_IF_ERROR(CheckFieldLength("pool", req->pool()));
  MLAKV_RETURN_IF_ERROR(CheckFieldLength("sequence", req->sequence(), kMaxSequenceIdBytes));
  MLAKV_ASSIGN_OR_RETURN(pool_, service->FindPool(req->pool()));
  switch (req->format()) {
    case v1::READ_FORMAT_UNSPECIFIED:
    case v1::READ_FORMAT_RAW: dequantize_ = false; break;
    case v1::READ_FORMAT_DEQUANTIZED: dequantize_ = true; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("format ", static_cast<int>(req->format()),
                                                     " is not a ReadFormat; use READ_FORMAT_RAW or "
                                                     "READ_FORMAT_DEQUANTIZED"));
  }
  if (req->layers_size() > pool_->num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("ReadSequence names ", req->layers_size(), " layers but pool ",
                                                   Quote(pool_->name()), " has ", pool_->num_layers(),
                                                   "; name each layer at most once"));
  }
  uint32_t count = req->count();
  std::vector<uint32_t> layers(req->layers().begin(), req->layers().end());
  if (req->has_expect_generation()) sequence_.expect_generation = req->expect_generation();
  sequence_.lease_id = req->lease_id();
  uint64_t generation = 0;
  MLAKV_ASSIGN_OR_RETURN(layers_, pool_->PlanRead(sequence_, layers, req->start(), &count, &generation));
  // Every chunk reads the incarnation planned: freed (or evicted) and
  // appended again between two chunks, the id names another one, whose rows
  // must not follow this one's in the same stream.
  generation_pinned_ = !sequence_.expect_generation.has_value();
  sequence_.expect_generation = generation;
  const uint64_t per_token =
      dequantize_ ? (kCkvDim + kKpeDim) * sizeof(float) : format::kEntryBytes;
  const uint64_t per_message = req->tokens_per_message() != 0
                                   ? req->tokens_per_message()
                                   : std::max<uint64_t>(1, kTargetReadMessageBytes / per_token);
  const uint64_t cap = std::max<uint64_t>(1, (service->options().max_message_bytes - 4096) / per_token);
  per_message_ = static_cast<uint32_t>(std::min(per_message, cap));
  start_ = req->start();
  count_ = count;
  return absl::OkStatus();
}

void ReadReactor::OnWriteDone(bool ok) {
  if (!ok) {
    Done(absl::CancelledError("the client stopped reading"));
    return;
  }
  if (layer_index_ < layers_.size()) {
    Next();
  } else {
    Done(absl::OkStatus());
  }
}

ReadReactor::Chunk ReadReactor::TakeChunk() {
  const uint32_t n = std::min(per_message_, count_ - offset_);
  Chunk c{layers_[layer_index_], start_ + offset_, n};
  offset_ += n;
  if (offset_ == count_) {
    offset_ = 0;
    ++layer_index_;
  }
  ++sent_;
  return c;
}

void ReadReactor::Next() {
  pool_->worker().Post([this] {
    absl::Status status = Produce(TakeChunk());
    if (!status.ok()) {
      Done(status);
      return;
    }
    StartWrite(&resp_);
  });
}

absl::Status ReadReactor::Produce(const Chunk& c) {
  resp_.Clear();
  resp_.set_layer(static_cast<uint32_t>(c.layer));
  resp_.set_start(c.start);
  resp_.set_count(c.count);
  std::string* ckv = resp_.mutable_ckv_packed();
  std::string* sf = resp_.mutable_ckv_sf();
  std::string* kpe = resp_.mutable_kpe();
  ckv->resize(static_cast<size_t>(c.count) * kCkvPackedBytes);
  sf->resize(static_cast<size_t>(c.count) * kCkvSfBytes);
  kpe->resize(static_cast<size_t>(c.count) * kKpeBytes);
  LayerSnapshot layer;
  if (absl::Status read = pool_->ReadRows(sequence_, c.layer, c.start, c.count,
                                          {reinterpret_cast<uint8_t*>(ckv->data()),
                                           reinterpret_cast<uint8_t*>(sf->data()),
                                           reinterpret_cast<uint8_t*>(kpe->data())},
                                          &layer);
      !read.ok()) {
    if (generation_pinned_ && absl::IsFailedPrecondition(read)) {
      return absl::AbortedError(absl::StrCat("the sequence was freed and created again while this ReadSequence "
                                             "read it (", sent_ - 1, " messages were of generation ",
                                             *sequence_.expect_generation, "); read it again: ", read.message()));
    }
    return read;
  }
  resp_.set_ckv_scale(layer.ckv_scale);
  resp_.set_kpe_scale(layer.kpe_scale);
  if (dequantize_) {
    std::string* ckv_f = resp_.mutable_ckv_float();
    std::string* kpe_f = resp_.mutable_kpe_float();
    ckv_f->resize(static_cast<size_t>(c.count) * kCkvDim * sizeof(float));
    kpe_f->resize(static_cast<size_t>(c.count) * kKpeDim * sizeof(float));
    DequantizeParams p;
    p.ckv_packed = reinterpret_cast<const uint8_t*>(ckv->data());
    p.ckv_sf = reinterpret_cast<const uint8_t*>(sf->data());
    p.kpe = reinterpret_cast<const uint8_t*>(kpe->data());
    p.num_rows = c.count;
    p.out_ckv = reinterpret_cast<float*>(ckv_f->data());
    p.out_kpe = reinterpret_cast<float*>(kpe_f->data());
    p.ckv_scale = layer.ckv_scale;
    p.kpe_scale = layer.kpe_scale;
    DequantizeHost(p);  // little-endian float32 on every supported host
    resp_.clear_ckv_packed();
    resp_.clear_ckv_sf();
    resp_.clear_kpe();
  }
  return absl::OkStatus();
}

void ReadReactor::Done(const absl::Status& status) {
  LogCall("ReadSequence",
          absl::StrCat(detail_, " layers=", layers_.size(), " start=", start_, " count=", count_, " messages=", sent_),
          status);
  Finish(ToGrpcStatus(status));
}

}  // namespace mlakv::server
