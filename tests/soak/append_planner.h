// AppendPlanner: random appends for one sequence (an Append stream of 1-4
// messages, or one entry of an AppendBatch) that the protocol must accept,
// and what the sequence's model becomes when they commit.
//
// Messages of a stream may write different layers, start anywhere from 0 to
// what the layer holds (committed or staged by an earlier message of the
// stream, so rewrites and overlaps happen), mix dtypes, name the layer's own
// scales or leave them unset, repeat the ids or leave them empty; the first
// may reserve pages and carry expect_length. Lengths stay within
// SoakOptions::max_tokens, so models stay bounded however long the run.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "mlakv/v1/kv_cache.pb.h"
#include "tests/soak/row_factory.h"
#include "tests/soak/sequence_model.h"
#include "tests/soak/soak_options.h"

namespace mlakv::soak {

struct PlannedLayer {
  LayerRowsData rows;
  bool name_scales = false;  // name the layer's own (config) scales in the request
};

struct PlannedMessage {
  uint32_t start = 0;
  uint32_t rows = 0;
  v1::RowDType dtype = v1::ROW_DTYPE_BFLOAT16;
  std::vector<PlannedLayer> layers;
  bool repeat_ids = true;  // messages after the first: repeat pool and sequence, or leave them empty
};

struct StreamPlan {
  std::string sequence;
  uint32_t reserve_tokens = 0;           // first message only
  std::optional<uint32_t> expect_length;  // first message only
  v1::SequenceView view = v1::SEQUENCE_VIEW_UNSPECIFIED;
  std::vector<PlannedMessage> messages;

  uint64_t rows_written() const;  // rows summed over layers and messages (AppendResponse.rows_written)
  uint64_t wire_bytes() const;    // ckv + kpe bytes of every message
};

enum class AppendShape {
  kExtend,   // each message starts at the end of the shortest layer it writes
  kRewrite,  // each message starts below what its layers hold
  kMixed,    // either, message by message
};

struct PlanRequest {
  AppendShape shape = AppendShape::kMixed;
  int min_messages = 1;
  int max_messages = 4;
  bool allow_reserve = true;
  bool allow_expect = true;
};

class AppendPlanner {
 public:
  AppendPlanner(const SoakOptions& options, const PoolGeometry& geometry, const RowFactory& rows)
      : options_(options), geometry_(geometry), rows_(rows) {}

  // A stream for `id` in state `before` (nullopt: the sequence does not
  // exist); nullopt when the shape has nothing to do there (a rewrite of an
  // empty sequence, an extension of a full one).
  absl::StatusOr<std::optional<StreamPlan>> PlanStream(std::mt19937_64& rng, const std::string& id,
                                                      const std::optional<SequenceModel>& before,
                                                      const PlanRequest& request) const;
  // One AppendBatch entry (one message, no reservation) in `dtype`.
  absl::StatusOr<std::optional<StreamPlan>> PlanBatchEntry(std::mt19937_64& rng, const std::string& id,
                                                          const std::optional<SequenceModel>& before,
                                                          v1::RowDType dtype) const;

  // The state after `plan` commits on top of `before`.
  std::optional<SequenceModel> Apply(const std::optional<SequenceModel>& before, const StreamPlan& plan) const;
  // The messages of the stream, as sent.
  std::vector<v1::AppendRequest> ToRequests(const StreamPlan& plan) const;
  // The plan (one message) as an AppendBatch entry.
  void ToBatchEntry(const StreamPlan& plan, v1::SequenceRows* out) const;

  const PoolGeometry& geometry() const { return geometry_; }

 private:
  // One message on top of the working lengths `have` (committed or staged).
  absl::StatusOr<std::optional<PlannedMessage>> PlanMessage(std::mt19937_64& rng, std::vector<uint32_t>& have,
                                                            AppendShape shape, v1::RowDType dtype,
                                                            int max_layers) const;
  void FillLayer(const PlannedLayer& layer, v1::LayerRows* out) const;

  const SoakOptions& options_;
  const PoolGeometry& geometry_;
  const RowFactory& rows_;
};

v1::RowDType RandomDType(std::mt19937_64& rng);

}  // namespace mlakv::soak
