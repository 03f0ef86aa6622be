#include "tests/server/core/pool_model.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/nvfp4_format.h"
#include "kernels/quantize_rows.h"
#include "server/core/pool.h"
#include "tests/server/core/random_rows.h"
#include "tests/server/core/stand_in_device_backend.h"

namespace mlakv::server::testing {
namespace {

constexpr int kLayers = 2;
constexpr int kPageSize = 2;
constexpr int kPages = 12;
constexpr int kSequences = 4;     // ids "s0".."s3"
constexpr uint32_t kMaxSequences = 3;
constexpr float kCkv = 0.25f, kKpe = 0.5f;


int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Reads the script's bytes; 0 once they run out.
class Script {
 public:
  Script(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool done() const { return pos_ >= size_; }
  uint8_t Next() { return pos_ < size_ ? data_[pos_++] : 0; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};


struct SequenceModel {
  bool exists = false;
  std::vector<std::vector<Entry>> layers = std::vector<std::vector<Entry>>(kLayers);  // committed tokens
  size_t pages = 0;
  uint32_t length() const {
    size_t m = layers[0].size();
    for (const auto& l : layers) m = std::min(m, l.size());
    return static_cast<uint32_t>(m);
  }
  uint32_t max_length() const {
    size_t m = 0;
    for (const auto& l : layers) m = std::max(m, l.size());
    return static_cast<uint32_t>(m);
  }
};

struct TxnModel {
  std::unique_ptr<AppendTransaction> txn;
  bool created = false;
  std::vector<std::map<uint32_t, Entry>> staged = std::vector<std::map<uint32_t, Entry>>(kLayers);
  std::vector<uint32_t> staged_end = std::vector<uint32_t>(kLayers, 0);
  size_t extra_pages = 0;
  // An Append stream by reference: its rows are stand-in device rows and
  // Pool::Stage holds what it can here until the commit (AtomicAppend).
  bool by_reference = false;
  Pool::DeferredWrites held;
  // The bytes standing in for the region: like a stream's regions, alive
  // until the transaction ends (moving a string keeps its buffer).
  std::vector<std::string> region_bytes;
};

// What one operation of the script asks to stage for one transaction.
struct StageSpec {
  uint32_t start = 0;
  uint32_t n = 0;
  std::vector<int64_t> layers;
  uint32_t reserve = 0;
  std::optional<uint32_t> expect_length;
  bool wrong_bytes = false;   // one byte short in the last layer's kpe
  bool wrong_scales = false;  // names scales other than the configured ones
  RowSet rows;
};

class Runner {
 public:
  absl::Status Init() {
    Pool::Options o;
    o.name = "model";
    o.device = Device::Cpu();
    o.num_layers = kLayers;
    o.page_size = kPageSize;
    o.num_pages = kPages;
    o.max_sequences = kMaxSequences;
    o.layer_scales.assign(kLayers, Pool::Options::Scales{kCkv, kKpe});
    o.wrap_backend = [](std::unique_ptr<CacheBackend> inner) {
      return std::make_unique<StandInDeviceBackend>(std::move(inner));
    };
    absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::Create(o);
    if (!pool.ok()) return pool.status();
    pool_ = std::move(*pool);
    return absl::OkStatus();
  }

  absl::Status Run(Script& script) {
    for (int op = 0; !script.done() && op < 400; ++op) {
      op_ = op;
      const uint8_t code = script.Next();
      const int s = script.Next() % kSequences;
      absl::Status st;
      switch (code % 9) {
        case 0: st = Begin(s); break;
        case 1:
        case 2: st = StageOne(s, script); break;
        case 3: st = StageTwo(s, script); break;
        case 4: st = Commit(s); break;
        case 5: st = Abort(s); break;
        case 6: st = Free(s); break;
        case 7: st = Truncate(s, script.Next()); break;
        case 8: st = Verify(s); break;
      }
      if (!st.ok()) return st;
      if (absl::Status c = CheckPool(); !c.ok()) return c;
    }
    for (int s = 0; s < kSequences; ++s) {
      if (absl::Status a = Abort(s); !a.ok()) return a;
      if (absl::Status v = Verify(s); !v.ok()) return v;
    }
    return CheckPool();
  }

 private:
  static std::string Id(int s) { return absl::StrCat("s", s); }

  absl::Status Fail(const std::string& what) const {
    return absl::InternalError(absl::StrCat("operation ", op_, ": ", what));
  }
  absl::Status Expect(const absl::Status& got, absl::StatusCode want, const std::string& what) const {
    if (got.code() == want) return absl::OkStatus();
    return Fail(absl::StrCat(what, ": expected ", absl::StatusCodeToString(want), ", got ", got.ToString()));
  }

  size_t SequencesHeld() const {
    size_t n = 0;
    for (int s = 0; s < kSequences; ++s) n += seqs_[s].exists || (txns_[s] && txns_[s]->created) ? 1 : 0;
    return n;
  }

  absl::Status Begin(int s) {
    absl::StatusOr<std::unique_ptr<AppendTransaction>> txn = pool_->BeginAppend(Id(s));
    if (txns_[s]) return Expect(txn.status(), absl::StatusCode::kAborted, "begin on a busy sequence");
    if (!seqs_[s].exists && SequencesHeld() >= kMaxSequences) {
      return Expect(txn.status(), absl::StatusCode::kResourceExhausted, "begin past max_sequences");
    }
    if (!txn.ok()) return Fail(absl::StrCat("begin: ", txn.status().ToString()));
    txns_[s] = std::make_unique<TxnModel>();
    txns_[s]->txn = std::move(*txn);
    txns_[s]->created = !seqs_[s].exists;
    txns_[s]->by_reference = (op_ + s) % 2 == 0;
    return absl::OkStatus();
  }

  StageSpec ReadSpec(Script& script, int s) {
    StageSpec spec;
    const uint8_t a = script.Next(), b = script.Next(), c = script.Next();
    const uint32_t have = seqs_[s].max_length();
    spec.start = a % (have + 3);  // sometimes a hole
    spec.n = b % 6;
    const int mask = (c & 3) == 0 ? 3 : (c & 3);  // layer 0, 1 or both
    for (int l = 0; l < kLayers; ++l) {
      if (mask & (1 << l)) spec.layers.push_back(l);
    }
    if (c & 0x04) spec.layers.clear();  // rows without layers: INVALID_ARGUMENT when n > 0
    if (c & 0x08) spec.reserve = (c >> 4) * 2;
    if ((c & 0x30) == 0x30) spec.expect_length = a % 4;
    spec.wrong_bytes = (a & 0xf0) == 0xf0 && !spec.layers.empty() && spec.n > 0;
    spec.wrong_scales = (b & 0xf0) == 0xf0 && !spec.layers.empty();
    spec.rows = MakeRows(spec.n, ++row_seed_, kCkv, kKpe);
    return spec;
  }

  // The status Pool::Stage must return for these transactions and specs
  // (checks in its documented order: shape for all, state per transaction,
  // then capacity), and on success the pages each needs.
  absl::Status Predict(const std::vector<int>& ids, const std::vector<StageSpec>& specs,
                       std::vector<size_t>* new_pages) const {
    for (const StageSpec& sp : specs) {
      if (sp.n > 0 && sp.layers.empty()) return absl::InvalidArgumentError("rows without layers");
      if (sp.wrong_bytes) return absl::InvalidArgumentError("wrong bytes");
    }
    int64_t total = 0;
    new_pages->assign(ids.size(), 0);
    for (size_t i = 0; i < ids.size(); ++i) {
      const SequenceModel& seq = seqs_[ids[i]];
      const TxnModel& t = *txns_[ids[i]];
      const StageSpec& sp = specs[i];
      if (sp.expect_length) {
        if (sp.layers.empty()) {
          if (seq.length() != *sp.expect_length) return absl::FailedPreconditionError("expect_length");
        }
        for (int64_t l : sp.layers) {
          if (seq.layers[l].size() != *sp.expect_length) return absl::FailedPreconditionError("expect_length");
        }
      }
      for (int64_t l : sp.layers) {
        if (sp.wrong_scales) return absl::FailedPreconditionError("scales");
        const uint32_t have = std::max<uint32_t>(static_cast<uint32_t>(seq.layers[l].size()), t.staged_end[l]);
        if (sp.n > 0 && sp.start > have) return absl::OutOfRangeError("hole");
      }
      const int64_t needed = std::max<int64_t>(sp.n > 0 && !sp.layers.empty() ? sp.start + sp.n : 0, sp.reserve);
      if (needed > int64_t{kPages} * kPageSize) return absl::ResourceExhaustedError("longer than the pool");
      const int64_t held = static_cast<int64_t>(seq.pages + t.extra_pages);
      (*new_pages)[i] = static_cast<size_t>(std::max<int64_t>(0, CeilDiv(needed, kPageSize) - held));
      total += static_cast<int64_t>((*new_pages)[i]);
    }
    if (total > kPages - static_cast<int64_t>(PagesHeld())) return absl::ResourceExhaustedError("pool full");
    return absl::OkStatus();
  }

  absl::Status StageMany(const std::vector<int>& ids, std::vector<StageSpec>& specs) {
    std::vector<SequenceRowsIn> rows(ids.size());
    std::vector<AppendTransaction*> raw;
    std::vector<const SequenceRowsIn*> row_ptrs;
    for (size_t i = 0; i < ids.size(); ++i) {
      StageSpec& sp = specs[i];
      SequenceRowsIn& r = rows[i];
      r.start = sp.start;
      r.row_count = sp.n;
      r.reserve_tokens = sp.reserve;
      r.expect_length = sp.expect_length;
      for (int64_t l : sp.layers) {
        LayerRows in = LayerRows::FromBytes(static_cast<int32_t>(l), sp.rows.ckv, sp.rows.kpe);
        if (sp.wrong_scales) in.ckv_scale = kCkv * 2, in.kpe_scale = kKpe;
        if (ids.size() == 1 && txns_[ids[i]]->by_reference) MarkAsDeviceRows(in);
        r.layers.push_back(in);
      }
      if (sp.wrong_bytes) --r.layers.back().kpe_bytes;
      raw.push_back(txns_[ids[i]]->txn.get());
    }
    for (const SequenceRowsIn& r : rows) row_ptrs.push_back(&r);
    std::vector<size_t> new_pages;
    const absl::Status predicted = Predict(ids, specs, &new_pages);
    // One stream by reference holds its writes; a call of two (an
    // AppendBatch) writes at once, after what either has held.
    Pool::DeferredWrites* held = ids.size() == 1 && txns_[ids[0]]->by_reference ? &txns_[ids[0]]->held : nullptr;
    if (held == nullptr) {
      for (int s : ids) {
        if (absl::Status f = pool_->Flush(txns_[s]->held); !f.ok()) return Fail(absl::StrCat("flush: ", f.ToString()));
      }
    }
    const absl::Status got = pool_->Stage(raw, row_ptrs, DType::kBFloat16, held);
    if (got.code() != predicted.code()) {
      return Fail(absl::StrCat("stage: model says ", predicted.ToString(), ", pool says ", got.ToString()));
    }
    if (!got.ok()) {
      // As the RPC layer does: a failed stage aborts every transaction of the call.
      for (int s : ids) {
        if (absl::Status a = Abort(s); !a.ok()) return a;
      }
      return absl::OkStatus();
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      TxnModel& t = *txns_[ids[i]];
      const StageSpec& sp = specs[i];
      t.extra_pages += new_pages[i];
      if (t.txn->pages_allocated() != t.extra_pages) {
        return Fail(absl::StrCat("transaction holds ", t.txn->pages_allocated(), " new pages, model ", t.extra_pages));
      }
      if (held != nullptr) {
        t.region_bytes.push_back(std::move(specs[i].rows.ckv));
        t.region_bytes.push_back(std::move(specs[i].rows.kpe));
      }
      if (sp.n == 0) continue;
      for (int64_t l : sp.layers) {
        for (uint32_t k = 0; k < sp.n; ++k) t.staged[l][sp.start + k] = sp.rows.expected[k];
        t.staged_end[l] = std::max(t.staged_end[l], sp.start + sp.n);
      }
    }
    return absl::OkStatus();
  }

  absl::Status StageOne(int s, Script& script) {
    if (!txns_[s]) return Begin(s);  // nothing open: open one instead
    std::vector<StageSpec> specs;
    specs.push_back(ReadSpec(script, s));
    return StageMany({s}, specs);
  }

  // One call staging rows for two open transactions (an AppendBatch).
  absl::Status StageTwo(int s, Script& script) {
    const int other = (s + 1 + script.Next() % (kSequences - 1)) % kSequences;
    if (!txns_[s] || !txns_[other]) return Begin(txns_[s] ? other : s);
    std::vector<StageSpec> specs;
    specs.push_back(ReadSpec(script, s));
    specs.push_back(ReadSpec(script, other));
    return StageMany({s, other}, specs);
  }

  absl::Status Commit(int s) {
    if (!txns_[s]) return absl::OkStatus();
    TxnModel& t = *txns_[s];
    if (absl::Status f = pool_->Flush(t.held); !f.ok()) return Fail(absl::StrCat("flush at commit: ", f.ToString()));
    const SequenceSnapshot snap = pool_->Commit(*t.txn);
    SequenceModel& seq = seqs_[s];
    for (int l = 0; l < kLayers; ++l) {
      for (const auto& [pos, entry] : t.staged[l]) {
        if (pos < seq.layers[l].size()) {
          seq.layers[l][pos] = entry;
        } else if (pos == seq.layers[l].size()) {
          seq.layers[l].push_back(entry);
        } else {
          return Fail("model: a staged position past the end (the hole check let it through)");
        }
      }
    }
    seq.pages += t.extra_pages;
    seq.exists = seq.pages > 0 || seq.max_length() > 0;
    txns_[s].reset();
    if (snap.length != seq.length() || snap.kv_indices.size() != seq.pages) {
      return Fail(absl::StrCat("commit: pool says length ", snap.length, " pages ", snap.kv_indices.size(),
                               ", model ", seq.length(), " / ", seq.pages));
    }
    return absl::OkStatus();
  }

  absl::Status Abort(int s) {
    if (!txns_[s]) return absl::OkStatus();
    txns_[s]->held.Clear();
    pool_->Abort(*txns_[s]->txn);
    txns_[s].reset();
    return absl::OkStatus();
  }

  absl::Status Free(int s) {
    absl::StatusOr<uint32_t> freed = [&]() -> absl::StatusOr<uint32_t> {
      MLAKV_ASSIGN_OR_RETURN(FreeResult r, pool_->FreeSequence(Id(s)));
      return r.pages_freed;
    }();
    SequenceModel& seq = seqs_[s];
    if (!seq.exists) return Expect(freed.status(), absl::StatusCode::kNotFound, "free of a missing sequence");
    if (txns_[s]) return Expect(freed.status(), absl::StatusCode::kAborted, "free of a busy sequence");
    if (!freed.ok() || *freed != seq.pages) {
      return Fail(absl::StrCat("free: ", freed.ok() ? absl::StrCat(*freed, " pages") : freed.status().ToString(),
                               ", model ", seq.pages));
    }
    seq = SequenceModel{};
    return absl::OkStatus();
  }

  absl::Status Truncate(int s, uint8_t arg) {
    SequenceModel& seq = seqs_[s];
    const uint32_t length = arg % (seq.max_length() + 2);
    absl::StatusOr<SequenceSnapshot> cut = pool_->TruncateSequence(Id(s), length);
    if (!seq.exists) return Expect(cut.status(), absl::StatusCode::kNotFound, "truncate of a missing sequence");
    if (txns_[s]) return Expect(cut.status(), absl::StatusCode::kAborted, "truncate of a busy sequence");
    if (length > seq.max_length()) return Expect(cut.status(), absl::StatusCode::kOutOfRange, "truncate too far");
    if (!cut.ok()) return Fail(absl::StrCat("truncate: ", cut.status().ToString()));
    for (auto& l : seq.layers) {
      if (l.size() > length) l.resize(length);
    }
    seq.pages = std::min<size_t>(seq.pages, static_cast<size_t>(CeilDiv(length, kPageSize)));
    seq.exists = seq.pages > 0 || seq.max_length() > 0;
    return absl::OkStatus();
  }

  absl::Status Verify(int s) {
    if (txns_[s]) return absl::OkStatus();  // in-flight rewrites may be visible (docs/server.md)
    const SequenceModel& seq = seqs_[s];
    absl::StatusOr<SequenceSnapshot> snap = pool_->GetSequence(Id(s));
    if (!seq.exists) return Expect(snap.status(), absl::StatusCode::kNotFound, "get of a missing sequence");
    if (!snap.ok()) return Fail(absl::StrCat("get: ", snap.status().ToString()));
    if (snap->kv_indices.size() != seq.pages) {
      return Fail(absl::StrCat("sequence ", s, " holds ", snap->kv_indices.size(), " pages, model ", seq.pages));
    }
    for (int l = 0; l < kLayers; ++l) {
      const uint32_t n = static_cast<uint32_t>(seq.layers[l].size());
      if (snap->layer_lengths[l] != n) {
        return Fail(absl::StrCat("sequence ", s, " layer ", l, " holds ", snap->layer_lengths[l], ", model ", n));
      }
      if (n == 0) continue;
      std::vector<uint8_t> ckv(n * 256), sf(n * 32), kpe(n * 64);
      LayerSnapshot state;
      if (absl::Status r = pool_->ReadRows(Id(s), l, 0, n, {ckv.data(), sf.data(), kpe.data()}, &state); !r.ok()) {
        return Fail(absl::StrCat("read: ", r.ToString()));
      }
      for (uint32_t p = 0; p < n; ++p) {
        const Entry& e = seq.layers[l][p];
        if (std::memcmp(ckv.data() + p * 256, e.data(), 256) != 0 ||
            std::memcmp(sf.data() + p * 32, e.data() + 256, 32) != 0 ||
            std::memcmp(kpe.data() + p * 64, e.data() + 288, 64) != 0) {
          return Fail(absl::StrCat("sequence ", s, " layer ", l, " position ", p, " does not read back byte-exact"));
        }
      }
    }
    return absl::OkStatus();
  }

  size_t PagesHeld() const {
    size_t n = 0;
    for (int s = 0; s < kSequences; ++s) n += seqs_[s].pages + (txns_[s] ? txns_[s]->extra_pages : 0);
    return n;
  }

  absl::Status CheckPool() const {
    if (absl::Status inv = pool_->CheckInvariants(); !inv.ok()) return Fail(absl::StrCat("invariants: ", inv.ToString()));
    const PoolSnapshot p = pool_->Snapshot();
    if (static_cast<size_t>(p.pages_used) != PagesHeld()) {
      return Fail(absl::StrCat("pool uses ", p.pages_used, " pages, model ", PagesHeld()));
    }
    size_t exists = 0;
    for (const SequenceModel& s : seqs_) exists += s.exists ? 1 : 0;
    if (p.sequences != exists) return Fail(absl::StrCat("pool has ", p.sequences, " sequences, model ", exists));
    return absl::OkStatus();
  }

  std::unique_ptr<Pool> pool_;
  SequenceModel seqs_[kSequences];
  std::unique_ptr<TxnModel> txns_[kSequences];
  uint32_t row_seed_ = 0;
  int op_ = 0;
};

}  // namespace

absl::Status RunPoolScript(const uint8_t* data, size_t size) {
  Runner runner;
  if (absl::Status s = runner.Init(); !s.ok()) return s;
  Script script(data, size);
  return runner.Run(script);
}

}  // namespace mlakv::server::testing
