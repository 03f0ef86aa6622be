#include "tests/soak/sequence_verifier.h"

#include <cstring>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/dequantize.h"

namespace mlakv::soak {
namespace {

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// The three arrays of a read interleaved into entries (the model's layout).
std::string Interleave(const StoredLayer& stored) {
  std::string out(size_t{stored.count} * kEntryBytes, '\0');
  for (uint32_t i = 0; i < stored.count; ++i) {
    char* e = out.data() + size_t{i} * kEntryBytes;
    std::memcpy(e, stored.ckv_packed.data() + size_t{i} * kCkvPackedBytes, kCkvPackedBytes);
    std::memcpy(e + kCkvPackedBytes, stored.ckv_sf.data() + size_t{i} * kCkvSfBytes, kCkvSfBytes);
    std::memcpy(e + kCkvPackedBytes + kCkvSfBytes, stored.kpe.data() + size_t{i} * kKpeBytes, kKpeBytes);
  }
  return out;
}

std::string Hex(absl::string_view bytes) { return absl::BytesToHexString(bytes.substr(0, 16)); }

}  // namespace

absl::Status Mismatch(absl::string_view what) { return absl::DataLossError(what); }

bool IsMismatch(const absl::Status& status) { return absl::IsDataLoss(status); }

std::string SequenceVerifier::DiffBytes(int layer, uint32_t first_token, absl::string_view got,
                                        absl::string_view want) const {
  if (got == want) return "";
  if (got.size() != want.size()) {
    return absl::StrCat("layer ", layer, ": read ", got.size() / kEntryBytes, " tokens, the model holds ",
                        want.size() / kEntryBytes);
  }
  size_t at = 0;
  while (got[at] == want[at]) ++at;
  const size_t token = at / kEntryBytes, in_entry = at % kEntryBytes;
  const char* part = in_entry < kCkvPackedBytes                 ? "ckv_packed"
                     : in_entry < kCkvPackedBytes + kCkvSfBytes ? "ckv_sf"
                                                                : "kpe";
  size_t differing = 0;
  for (size_t i = 0; i < got.size(); i += kEntryBytes) differing += got.substr(i, kEntryBytes) != want.substr(i, kEntryBytes);
  return absl::StrCat("layer ", layer, " token ", first_token + token, ": ", part, " differs at byte ", in_entry,
                      " of the entry (", differing, " of ", got.size() / kEntryBytes,
                      " tokens differ); read ", Hex(got.substr(at)), " expected ", Hex(want.substr(at)));
}

absl::StatusOr<ServerSequence> SequenceVerifier::Fetch(const std::string& id, bool read_bytes) const {
  ServerSequence out;
  absl::StatusOr<v1::Sequence> meta = client_->GetSequence(options_.pool, id);
  if (absl::IsNotFound(meta.status())) return out;
  if (!meta.ok()) return WithContext(meta.status(), absl::StrCat("GetSequence ", id));
  out.exists = true;
  out.meta = *std::move(meta);
  if (!read_bytes) return out;
  out.read = true;
  out.layers.resize(geometry_.num_layers);
  for (int l = 0; l < geometry_.num_layers && l < out.meta.layer_lengths_size(); ++l) {
    if (out.meta.layer_lengths(l) == 0) continue;
    MLAKV_ASSIGN_OR_RETURN(StoredLayer stored, client_->ReadLayer(options_.pool, id, l, 0, 0));
    if (!SameBits(stored.ckv_scale, geometry_.scales[l].ckv) || !SameBits(stored.kpe_scale, geometry_.scales[l].kpe)) {
      return Mismatch(absl::StrCat("sequence ", id, " layer ", l, ": read scales ", stored.ckv_scale, "/",
                                   stored.kpe_scale, " but the layer's fixed scales are ", geometry_.scales[l].ckv,
                                   "/", geometry_.scales[l].kpe));
    }
    out.layers[l] = Interleave(stored);
  }
  return out;
}

std::string SequenceVerifier::DiffMeta(const v1::Sequence& seq, const SequenceModel& expected, v1::SequenceView view,
                                       uint32_t pages_before) const {
  std::vector<std::string> diffs;
  const bool lengths = view == v1::SEQUENCE_VIEW_LENGTHS;  // no page at all
  const bool basic = view == v1::SEQUENCE_VIEW_BASIC || view == v1::SEQUENCE_VIEW_COMPACT || lengths;  // new pages
  if ((view == v1::SEQUENCE_VIEW_COMPACT || lengths) && (!seq.pool().empty() || !seq.server_id().empty())) {
    diffs.push_back("a COMPACT or LENGTHS view names the pool or the server");
  }
  const uint32_t ps = geometry_.page_size;
  if (seq.length() != expected.length()) diffs.push_back(absl::StrCat("length ", seq.length(), " != ", expected.length()));
  if (seq.page_size() != ps) diffs.push_back(absl::StrCat("page_size ", seq.page_size(), " != ", ps));
  if (seq.capacity_tokens() != expected.pages() * ps) {
    diffs.push_back(absl::StrCat("capacity_tokens ", seq.capacity_tokens(), " != ", expected.pages(), " pages x ", ps));
  }
  const uint32_t last = expected.length() == 0 ? 0 : (expected.length() - 1) % ps + 1;
  if (seq.last_page_len() != last) diffs.push_back(absl::StrCat("last_page_len ", seq.last_page_len(), " != ", last));
  const uint32_t offset = lengths ? expected.pages() : basic ? std::min(pages_before, expected.pages()) : 0;
  if (seq.kv_indices_offset() != offset) {
    diffs.push_back(absl::StrCat("kv_indices_offset ", seq.kv_indices_offset(), " != ", offset));
  }
  if (static_cast<uint32_t>(seq.kv_indices_size()) != expected.pages() - offset) {
    diffs.push_back(absl::StrCat("kv_indices has ", seq.kv_indices_size(), " pages, expected ",
                                 expected.pages() - offset));
  }
  std::set<uint32_t> distinct(seq.kv_indices().begin(), seq.kv_indices().end());
  if (distinct.size() != static_cast<size_t>(seq.kv_indices_size())) diffs.push_back("kv_indices repeats a page");
  if (!distinct.empty() && *distinct.rbegin() >= geometry_.pages_total) {
    diffs.push_back(absl::StrCat("page ", *distinct.rbegin(), " is outside the pool's ", geometry_.pages_total));
  }
  if (basic) {
    if (seq.layer_lengths_size() != 0) diffs.push_back("a BASIC, COMPACT or LENGTHS view carries layer_lengths");
  } else if (seq.layer_lengths_size() != expected.num_layers()) {
    diffs.push_back(absl::StrCat("layer_lengths has ", seq.layer_lengths_size(), " entries"));
  } else {
    for (int l = 0; l < expected.num_layers(); ++l) {
      if (seq.layer_lengths(l) != expected.layer_length(l)) {
        diffs.push_back(absl::StrCat("layer ", l, " length ", seq.layer_lengths(l), " != ", expected.layer_length(l)));
      }
    }
  }
  return absl::StrJoin(diffs, "; ");
}

std::string SequenceVerifier::Diff(const ServerSequence& server, const std::optional<SequenceModel>& expected) const {
  if (!expected) {
    return server.exists ? absl::StrCat("exists (length ", server.meta.length(), ", ", server.meta.kv_indices_size(),
                                        " pages) but must not")
                         : "";
  }
  if (!server.exists) {
    return absl::StrCat("NOT_FOUND, but must hold ", expected->max_length(), " tokens in ", expected->pages(),
                        " pages");
  }
  std::string diff = DiffMeta(server.meta, *expected, v1::SEQUENCE_VIEW_FULL);
  if (!diff.empty() || !server.read) return diff;
  for (int l = 0; l < expected->num_layers(); ++l) {
    const std::string d = DiffBytes(l, 0, server.layers[l], expected->Entries(l, 0, expected->layer_length(l)));
    if (!d.empty()) return d;
  }
  return "";
}

absl::Status SequenceVerifier::Verify(const std::string& id, const std::optional<SequenceModel>& expected,
                                      bool read_bytes) const {
  MLAKV_ASSIGN_OR_RETURN(ServerSequence server, Fetch(id, read_bytes));
  if (const std::string d = Diff(server, expected); !d.empty()) return Mismatch(absl::StrCat("sequence ", id, ": ", d));
  return absl::OkStatus();
}

absl::StatusOr<int> SequenceVerifier::WhichOf(const std::string& id, const std::optional<SequenceModel>& a,
                                              const std::optional<SequenceModel>& b) const {
  MLAKV_ASSIGN_OR_RETURN(ServerSequence server, Fetch(id, true));
  const std::string da = Diff(server, a);
  if (da.empty()) return 0;
  const std::string db = Diff(server, b);
  if (db.empty()) return 1;
  return Mismatch(absl::StrCat("sequence ", id, " is neither the state before the append (", da,
                               ") nor the state after it (", db, ")"));
}

absl::Status SequenceVerifier::VerifyRange(const std::string& id, const SequenceModel& expected, int layer,
                                           uint32_t start, uint32_t count) const {
  MLAKV_ASSIGN_OR_RETURN(StoredLayer stored, client_->ReadLayer(options_.pool, id, layer, start, count));
  if (stored.start != start || stored.count != count) {
    return Mismatch(absl::StrCat("sequence ", id, " layer ", layer, ": read [", start, ", +", count, ") returned [",
                                 stored.start, ", +", stored.count, ")"));
  }
  const std::string d = DiffBytes(layer, start, Interleave(stored), expected.Entries(layer, start, count));
  if (!d.empty()) return Mismatch(absl::StrCat("sequence ", id, " ranged read: ", d));
  return absl::OkStatus();
}

absl::Status SequenceVerifier::VerifyDequantized(v1::KvCache::Stub& stub, const std::string& id,
                                                 const SequenceModel& expected, int layer) const {
  const uint32_t n = expected.layer_length(layer);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.call_timeout));
  v1::ReadSequenceRequest request;
  request.set_pool(options_.pool);
  request.set_sequence(id);
  request.add_layers(layer);
  request.set_format(v1::READ_FORMAT_DEQUANTIZED);
  auto reader = stub.ReadSequence(&context, request);
  std::string ckv, kpe;
  v1::ReadSequenceResponse chunk;
  while (reader->Read(&chunk)) {
    ckv += chunk.ckv_float();
    kpe += chunk.kpe_float();
  }
  MLAKV_RETURN_IF_ERROR(WithContext(FromGrpcStatus(reader->Finish()), absl::StrCat("ReadSequence DEQUANTIZED ", id)));
  // The model's bytes split back into the three arrays, dequantized here.
  std::vector<uint8_t> packed(size_t{n} * kCkvPackedBytes), sf(size_t{n} * kCkvSfBytes), rope(size_t{n} * kKpeBytes);
  const absl::string_view entries = expected.Entries(layer, 0, n);
  for (uint32_t i = 0; i < n; ++i) {
    const char* e = entries.data() + size_t{i} * kEntryBytes;
    std::memcpy(packed.data() + size_t{i} * kCkvPackedBytes, e, kCkvPackedBytes);
    std::memcpy(sf.data() + size_t{i} * kCkvSfBytes, e + kCkvPackedBytes, kCkvSfBytes);
    std::memcpy(rope.data() + size_t{i} * kKpeBytes, e + kCkvPackedBytes + kCkvSfBytes, kKpeBytes);
  }
  std::vector<float> want_ckv(size_t{n} * format::kCkvDim), want_kpe(size_t{n} * format::kKpeDim);
  DequantizeParams p;
  p.ckv_packed = packed.data();
  p.ckv_sf = sf.data();
  p.kpe = rope.data();
  p.num_rows = n;
  p.out_ckv = want_ckv.data();
  p.out_kpe = want_kpe.data();
  p.ckv_scale = geometry_.scales[layer].ckv;
  p.kpe_scale = geometry_.scales[layer].kpe;
  DequantizeHost(p);
  const bool same = ckv.size() == want_ckv.size() * sizeof(float) && kpe.size() == want_kpe.size() * sizeof(float) &&
                    std::memcmp(ckv.data(), want_ckv.data(), ckv.size()) == 0 &&
                    std::memcmp(kpe.data(), want_kpe.data(), kpe.size()) == 0;
  if (!same) {
    return Mismatch(absl::StrCat("sequence ", id, " layer ", layer, ": DEQUANTIZED read (", ckv.size() / 4, " + ",
                                 kpe.size() / 4, " floats) differs from DequantizeHost of the expected bytes (",
                                 want_ckv.size(), " + ", want_kpe.size(), " floats)"));
  }
  return absl::OkStatus();
}

}  // namespace mlakv::soak
