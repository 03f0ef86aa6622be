// The write side of a client Append stream against a scripted writer: the
// half-close is started exactly once, with the last message, even when the
// write carrying it fails (a second one aborts the process inside gRPC), and
// a broken stream stops the writing and still reports the server's status.
#include "client/append_stream.h"
#include "mlakv/v1/kv_cache.pb.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace mlakv {
namespace {

// Records what the stream was asked to do; Write fails from the
// `fail_from`-th write on (0-based), as a stream the server has closed does.
class ScriptedWriter : public grpc::ClientWriterInterface<v1::AppendRequest> {
 public:
  explicit ScriptedWriter(size_t fail_from, grpc::Status finish_status = grpc::Status::OK)
      : fail_from_(fail_from), finish_status_(std::move(finish_status)) {}

  bool Write(const v1::AppendRequest& msg, grpc::WriteOptions options) override {
    EXPECT_FALSE(finished_) << "Write after Finish";
    EXPECT_EQ(half_closes_, 0) << "Write after the half-close";
    sequences_written_.push_back(msg.sequence());
    rows_written_.push_back(msg.row_count());
    if (options.is_last_message()) ++half_closes_;
    return sequences_written_.size() <= fail_from_;
  }
  bool WritesDone() override {
    EXPECT_FALSE(finished_) << "WritesDone after Finish";
    ++half_closes_;
    ++writes_done_calls_;
    return true;
  }
  grpc::Status Finish() override {
    EXPECT_FALSE(finished_) << "Finish twice";
    finished_ = true;
    return finish_status_;
  }

  size_t writes() const { return rows_written_.size(); }
  const std::vector<uint32_t>& rows_written() const { return rows_written_; }
  const std::vector<std::string>& sequences_written() const { return sequences_written_; }
  int half_closes() const { return half_closes_; }
  int writes_done_calls() const { return writes_done_calls_; }
  bool finished() const { return finished_; }

 private:
  size_t fail_from_;
  grpc::Status finish_status_;
  std::vector<uint32_t> rows_written_;
  std::vector<std::string> sequences_written_;
  int half_closes_ = 0;
  int writes_done_calls_ = 0;
  bool finished_ = false;
};

// Message i: `i + 1` rows; only the first names the sequence.
v1::AppendRequest Message(size_t i) {
  v1::AppendRequest m;
  if (i == 0) m.set_sequence("s");
  m.set_row_count(static_cast<uint32_t>(i + 1));
  return m;
}

constexpr size_t kNeverFails = ~size_t{0};

TEST(WriteAppendStream, AllMessagesInOrderTheLastCarryingTheHalfClose) {
  ScriptedWriter writer(kNeverFails);
  const grpc::Status status = WriteAppendStream<v1::AppendRequest>(writer, 3, Message);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(writer.rows_written(), (std::vector<uint32_t>{1, 2, 3}));
  EXPECT_EQ(writer.sequences_written(), (std::vector<std::string>{"s", "", ""}));
  EXPECT_EQ(writer.half_closes(), 1);
  EXPECT_EQ(writer.writes_done_calls(), 0);  // the last write carried it
  EXPECT_TRUE(writer.finished());
}

TEST(WriteAppendStream, OneMessageIsOneWriteWithTheHalfClose) {
  ScriptedWriter writer(kNeverFails);
  EXPECT_TRUE(WriteAppendStream<v1::AppendRequest>(writer, 1, Message).ok());
  EXPECT_EQ(writer.writes(), 1u);
  EXPECT_EQ(writer.half_closes(), 1);
  EXPECT_EQ(writer.writes_done_calls(), 0);
}

// The case that aborted a client under load: the server answered while the
// last write was in flight, so that write returned false.
TEST(WriteAppendStream, FailedLastWriteIsNotFollowedByASecondHalfClose) {
  for (size_t messages : {1u, 2u, 5u}) {
    SCOPED_TRACE(messages);
    ScriptedWriter writer(/*fail_from=*/messages - 1,
                          grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "rows do not continue the sequence"));
    const grpc::Status status = WriteAppendStream<v1::AppendRequest>(writer, messages, Message);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(status.error_message(), "rows do not continue the sequence");
    EXPECT_EQ(writer.writes(), messages);
    EXPECT_EQ(writer.half_closes(), 1);
    EXPECT_EQ(writer.writes_done_calls(), 0);
    EXPECT_TRUE(writer.finished());
  }
}

TEST(WriteAppendStream, FailedEarlierWriteStopsWritingAndHalfClosesOnce) {
  ScriptedWriter writer(/*fail_from=*/1, grpc::Status(grpc::StatusCode::NOT_FOUND, "pool 'x' does not exist"));
  const grpc::Status status = WriteAppendStream<v1::AppendRequest>(writer, 4, Message);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(writer.writes(), 2u);  // the second write failed; the rest were never tried
  EXPECT_EQ(writer.half_closes(), 1);
  EXPECT_EQ(writer.writes_done_calls(), 1);
  EXPECT_TRUE(writer.finished());
}

}  // namespace
}  // namespace mlakv
