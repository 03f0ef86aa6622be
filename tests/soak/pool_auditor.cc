#include "tests/soak/pool_auditor.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace mlakv::soak {
namespace {

constexpr absl::Duration kConvergenceGrace = absl::Seconds(5);
constexpr int kPagesSampled = 12;

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

}  // namespace

PoolAuditor::PoolAuditor(KvCacheClient* client, const SoakOptions& options, const PoolGeometry& geometry,
                         SoakReport* report, PoolBaseline baseline)
    : client_(client),
      options_(options),
      geometry_(geometry),
      report_(report),
      baseline_(std::move(baseline)),
      verifier_(client, options, geometry),
      pages_seen_(geometry.pages_total, false) {}

std::string PoolAuditor::DiffPool(const v1::Pool& pool, const Expected& expected) const {
  std::vector<std::string> diffs;
  if (pool.pages_free() + pool.pages_used() != pool.pages_total()) {
    diffs.push_back(absl::StrCat("pages_free ", pool.pages_free(), " + pages_used ", pool.pages_used(),
                                 " != pages_total ", pool.pages_total()));
  }
  if (pool.pages_used() != baseline_.pages_used + expected.pages) {
    diffs.push_back(absl::StrCat("pages_used ", pool.pages_used(), " != ", baseline_.pages_used + expected.pages,
                                 " (the models hold ", expected.pages, ")"));
  }
  if (pool.sequences() != baseline_.sequences + expected.sequences) {
    diffs.push_back(absl::StrCat("sequences ", pool.sequences(), " != ", baseline_.sequences + expected.sequences));
  }
  for (int l = 0; l < geometry_.num_layers && l < pool.layers_size(); ++l) {
    const v1::LayerScales& layer = pool.layers(l);
    if (layer.tokens() != baseline_.tokens[l] + expected.tokens[l]) {
      diffs.push_back(absl::StrCat("layer ", l, " tokens ", layer.tokens(), " != ",
                                   baseline_.tokens[l] + expected.tokens[l]));
    }
    if (!layer.set() || !SameBits(layer.ckv_scale(), geometry_.scales[l].ckv) ||
        !SameBits(layer.kpe_scale(), geometry_.scales[l].kpe)) {
      diffs.push_back(absl::StrCat("layer ", l, " scales changed to ", layer.ckv_scale(), "/", layer.kpe_scale()));
    }
  }
  return absl::StrJoin(diffs, "; ");
}

absl::Duration PoolAuditor::CheckCounters(const Expected& expected) {
  const absl::Time start = absl::Now();
  std::string diff;
  v1::Pool pool;
  while (true) {
    absl::StatusOr<v1::Pool> got = client_->GetPool(options_.pool);
    if (!got.ok()) {
      report_->Violation("audit", absl::StrCat("GetPool failed: ", got.status().ToString()));
      return absl::Now() - start;
    }
    pool = *std::move(got);
    diff = DiffPool(pool, expected);
    if (diff.empty()) return absl::Now() - start;
    if (absl::Now() - start > kConvergenceGrace) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  report_->Violation("audit pool", absl::StrCat("with no call in flight for ", absl::FormatDuration(kConvergenceGrace),
                                                ": ", diff));
  // Take the difference as the new baseline, so that it is reported once
  // and later checks find what changes after it.
  baseline_.pages_used = pool.pages_used() - static_cast<uint32_t>(expected.pages);
  baseline_.sequences = pool.sequences() - expected.sequences;
  for (int l = 0; l < geometry_.num_layers && l < pool.layers_size(); ++l) {
    baseline_.tokens[l] = pool.layers(l).tokens() - expected.tokens[l];
  }
  return absl::Now() - start;
}

void PoolAuditor::CheckListing(const std::vector<std::pair<std::string, const SequenceModel*>>& models) {
  absl::StatusOr<std::vector<v1::SequenceSummary>> listed = client_->ListSequences(options_.pool);
  if (!listed.ok()) {
    report_->Violation("audit", absl::StrCat("ListSequences failed: ", listed.status().ToString()));
    return;
  }
  std::map<std::string, v1::SequenceSummary> ours;
  for (const v1::SequenceSummary& s : *listed) {
    if (absl::StartsWith(s.id(), options_.run_prefix)) ours[s.id()] = s;
  }
  std::vector<std::string> diffs;
  for (const auto& [id, model] : models) {
    auto it = ours.find(id);
    if (it == ours.end()) {
      diffs.push_back(absl::StrCat(id, " is not listed"));
      continue;
    }
    if (it->second.length() != model->length() || it->second.pages() != model->pages()) {
      diffs.push_back(absl::StrCat(id, " is listed with length ", it->second.length(), " and ", it->second.pages(),
                                   " pages; the model has ", model->length(), " and ", model->pages()));
    }
    ours.erase(it);
  }
  for (const auto& [id, s] : ours) {
    diffs.push_back(absl::StrCat(id, " is listed (length ", s.length(), ", ", s.pages(), " pages) but no model has it"));
  }
  if (!diffs.empty()) report_->Violation("audit ListSequences", absl::StrJoin(diffs, "; "));
}

void PoolAuditor::CheckPagination(std::mt19937_64& rng) {
  absl::StatusOr<std::vector<v1::SequenceSummary>> whole = client_->ListSequences(options_.pool);
  if (!whole.ok()) return;  // CheckListing reported it
  v1::ListSequencesRequest request;
  request.set_pool(options_.pool);
  request.set_page_size(static_cast<uint32_t>(1 + rng() % 7));
  std::vector<std::string> paged;
  for (int pages = 0; pages <= static_cast<int>(whole->size()) + 1; ++pages) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + options_.call_timeout));
    v1::ListSequencesResponse response;
    if (grpc::Status s = client_->stub().ListSequences(&context, request, &response); !s.ok()) {
      report_->Violation("audit ListSequences", absl::StrCat("a page of ", request.page_size(), ": ", s.error_message()));
      return;
    }
    if (response.total() != whole->size()) {
      report_->Violation("audit ListSequences",
                         absl::StrCat("total ", response.total(), " but the whole listing has ", whole->size()));
      return;
    }
    for (const v1::SequenceSummary& s : response.sequences()) paged.push_back(s.id());
    if (response.next_page_token().empty()) break;
    request.set_page_token(response.next_page_token());
  }
  std::vector<std::string> ids;
  for (const v1::SequenceSummary& s : *whole) ids.push_back(s.id());
  if (paged != ids) {
    report_->Violation("audit ListSequences", absl::StrCat("pages of ", request.page_size(), " list ", paged.size(),
                                                           " ids, one page lists ", ids.size(), " (or in another order)"));
  }
}

void PoolAuditor::CheckPageTables(const std::vector<std::pair<std::string, const SequenceModel*>>& models,
                                  std::mt19937_64& rng) {
  struct Owner {
    const std::string* id;
    const SequenceModel* model;
    uint32_t index;
  };
  std::map<uint32_t, Owner> owners;
  for (const auto& [id, model] : models) {
    absl::StatusOr<v1::Sequence> seq = client_->GetSequence(options_.pool, id);
    if (!seq.ok()) {
      report_->Violation("audit GetSequence", absl::StrCat(id, ": ", seq.status().ToString()));
      continue;
    }
    if (const std::string d = verifier_.DiffMeta(*seq, *model, v1::SEQUENCE_VIEW_FULL); !d.empty()) {
      report_->Violation("audit GetSequence", absl::StrCat(id, ": ", d));
    }
    for (int i = 0; i < seq->kv_indices_size(); ++i) {
      if (seq->kv_indices(i) < pages_seen_.size()) pages_seen_[seq->kv_indices(i)] = true;
      auto [it, fresh] = owners.emplace(seq->kv_indices(i), Owner{&id, model, static_cast<uint32_t>(i)});
      if (!fresh) {
        report_->Violation("audit page tables", absl::StrCat("page ", seq->kv_indices(i), " is in the tables of both ",
                                                             *it->second.id, " and ", id));
      }
    }
  }
  // GetPage of random pages, and of random pages the soak owns.
  std::vector<uint32_t> pages;
  for (int i = 0; i < kPagesSampled / 2; ++i) pages.push_back(static_cast<uint32_t>(rng() % geometry_.pages_total));
  if (!owners.empty()) {
    std::vector<uint32_t> owned;
    for (const auto& [page, owner] : owners) owned.push_back(page);
    for (int i = 0; i < kPagesSampled / 2; ++i) pages.push_back(owned[rng() % owned.size()]);
  }
  for (uint32_t page : pages) {
    absl::StatusOr<v1::Page> got = client_->GetPage(options_.pool, page);
    if (!got.ok()) {
      report_->Violation("audit GetPage", absl::StrCat("page ", page, ": ", got.status().ToString()));
      continue;
    }
    auto it = owners.find(page);
    std::string diff;
    if (it == owners.end()) {
      // Another user's page on a shared pool; with none, it must be free.
      if (baseline_.pages_used == 0 && (got->used() || !got->sequence().empty())) {
        diff = absl::StrCat("is used by ", got->sequence(), " but in no model's page table");
      }
    } else {
      const Owner& o = it->second;
      std::vector<uint32_t> filled;
      for (int l = 0; l < o.model->num_layers(); ++l) filled.push_back(o.model->FilledInPage(l, o.index));
      const std::vector<uint32_t> got_filled(got->filled_per_layer().begin(), got->filled_per_layer().end());
      if (!got->used() || got->sequence() != *o.id || got->page_index() != o.index ||
          got->first_position() != o.index * geometry_.page_size || got_filled != filled) {
        diff = absl::StrCat("GetPage says used=", got->used(), " owner ", got->sequence(), " index ",
                            got->page_index(), " filled [", absl::StrJoin(got_filled, ","), "]; expected owner ",
                            *o.id, " index ", o.index, " filled [", absl::StrJoin(filled, ","), "]");
      }
    }
    if (!diff.empty()) report_->Violation("audit GetPage", absl::StrCat("page ", page, ": ", diff));
  }
}

void PoolAuditor::Audit(const std::vector<const ClientSession*>& sessions, bool read_all, std::mt19937_64& rng,
                        std::optional<int64_t> rss_kb) {
  Expected expected;
  expected.tokens.assign(geometry_.num_layers, 0);
  std::vector<std::pair<std::string, const SequenceModel*>> models;
  for (const ClientSession* s : sessions) {
    for (const Slot& slot : s->slots()) {
      if (!slot.model) continue;
      models.emplace_back(slot.id, &*slot.model);
      expected.pages += slot.model->pages();
      ++expected.sequences;
      for (int l = 0; l < geometry_.num_layers; ++l) expected.tokens[l] += slot.model->layer_length(l);
    }
  }
  const absl::Duration convergence = CheckCounters(expected);
  CheckListing(models);
  CheckPagination(rng);
  CheckPageTables(models, rng);
  std::shuffle(models.begin(), models.end(), rng);
  const size_t reads = read_all ? models.size() : std::min<size_t>(models.size(), options_.sample_reads);
  for (size_t i = 0; i < reads; ++i) {
    if (absl::Status s = verifier_.Verify(models[i].first, *models[i].second); !s.ok()) {
      report_->Violation("audit read-back", s.message());
    }
  }
  report_->CountCheck(convergence, rss_kb);
  report_->SetPagesSeen(static_cast<uint32_t>(std::count(pages_seen_.begin(), pages_seen_.end(), true)),
                        geometry_.pages_total);
}

absl::StatusOr<v1::Pool> PoolAuditor::CheckEmptied() {
  Expected nothing;
  nothing.tokens.assign(geometry_.num_layers, 0);
  CheckCounters(nothing);
  CheckListing({});
  return client_->GetPool(options_.pool);
}

}  // namespace mlakv::soak
