// SequenceTable: ownership of pages, counts kept as state changes, and the
// use-order list of idle committed sequences.
#include "server/core/sequence_table.h"

#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <vector>

namespace mlakv::server {
namespace {

std::vector<std::string> UseOrder(const SequenceTable& t) {
  std::vector<std::string> out;
  for (const Sequence* s = t.LeastRecentlyUsed(); s != nullptr; s = SequenceTable::MoreRecent(s)) out.push_back(s->id());
  return out;
}

// Adds `id` and commits it, idle, used at `when`.
Sequence* Committed(SequenceTable& t, const std::string& id, int64_t when) {
  Sequence* s = t.Add(id, 1);
  t.SetCommitted(s);
  t.MarkIdle(s, when);
  return s;
}

TEST(SequenceTable, NewSequencesAreBusyUncommittedAndUnlisted) {
  SequenceTable t(2, 8);
  Sequence* s = t.Add("a", 1);
  EXPECT_TRUE(s->busy());
  EXPECT_FALSE(s->committed());
  EXPECT_EQ(t.committed_count(), 0u);
  EXPECT_EQ(t.size(), 1u);
  EXPECT_EQ(t.LeastRecentlyUsed(), nullptr);
  EXPECT_TRUE(t.ListAfter("", 10).empty());
}

TEST(SequenceTable, UseOrderFollowsTouchesAndSkipsBusySequences) {
  SequenceTable t(1, 8);
  Sequence* a = Committed(t, "a", 10);
  Sequence* b = Committed(t, "b", 20);
  Committed(t, "c", 30);
  EXPECT_EQ(UseOrder(t), (std::vector<std::string>{"a", "b", "c"}));
  t.Touch(a, 40);
  EXPECT_EQ(UseOrder(t), (std::vector<std::string>{"b", "c", "a"}));
  t.MarkBusy(b);
  EXPECT_EQ(UseOrder(t), (std::vector<std::string>{"c", "a"}));
  t.Touch(b, 50);  // a busy sequence's use is recorded, it joins the list when idle
  EXPECT_EQ(UseOrder(t), (std::vector<std::string>{"c", "a"}));
  t.MarkIdle(b, 60);
  EXPECT_EQ(UseOrder(t), (std::vector<std::string>{"c", "a", "b"}));
  EXPECT_EQ(t.committed_count(), 3u);
}

TEST(SequenceTable, ClockSteppingBackKeepsTheListOrdered) {
  SequenceTable t(1, 8);
  Committed(t, "a", 100);
  Sequence* b = Committed(t, "b", 50);  // earlier than the tail: clamped
  EXPECT_EQ(b->last_used_ns(), 100);
  EXPECT_EQ(UseOrder(t), (std::vector<std::string>{"a", "b"}));
}

TEST(SequenceTable, EraseUnlinksAndUncounts) {
  SequenceTable t(1, 8);
  Committed(t, "a", 1);
  Sequence* b = Committed(t, "b", 2);
  Committed(t, "c", 3);
  t.Erase(b);
  EXPECT_EQ(UseOrder(t), (std::vector<std::string>{"a", "c"}));
  EXPECT_EQ(t.committed_count(), 2u);
  EXPECT_EQ(t.Find("b"), nullptr);
  Sequence* pending = t.Add("d", 1);  // uncommitted: erasing it does not touch the count
  t.Erase(pending);
  EXPECT_EQ(t.committed_count(), 2u);
  EXPECT_EQ(t.size(), 2u);
}

TEST(SequenceTable, PagesRecordTheirOwnerAndAreReleasedOnDetach) {
  SequenceTable t(1, 8);
  Sequence* s = Committed(t, "a", 1);
  const std::vector<int32_t> pages = {5, 2, 7};
  t.AttachPages(s, pages);
  EXPECT_EQ(t.OwnerOf(2).sequence, s);
  EXPECT_EQ(t.OwnerOf(2).page_index, 1u);
  EXPECT_EQ(t.DetachTail(s, 1), (std::vector<int32_t>{2, 7}));
  EXPECT_EQ(t.OwnerOf(7).sequence, nullptr);
  EXPECT_EQ(t.OwnerOf(5).sequence, s);
}

TEST(SequenceTable, ListAfterPaginatesCommittedIdsInOrder) {
  SequenceTable t(1, 8);
  for (const char* id : {"d", "b", "a", "c"}) Committed(t, id, 1);
  t.Add("bb", 1);  // uncommitted: never listed
  std::vector<std::string> ids;
  for (const Sequence* s : t.ListAfter("a", 2)) ids.push_back(s->id());
  EXPECT_EQ(ids, (std::vector<std::string>{"b", "c"}));
}

}  // namespace
}  // namespace mlakv::server

namespace mlakv::server {
namespace {

TEST(SequenceTableHolders, APageSharedByManyTablesDropsHoldersInAnyOrder) {
  SequenceTable t(1, 4);
  std::vector<Sequence*> seqs;
  for (int i = 0; i < 5; ++i) {
    Sequence* s = t.Add("s" + std::to_string(i), i + 1);
    t.AttachPages(s, std::vector<int32_t>{2, i % 2});
    seqs.push_back(s);
  }
  EXPECT_EQ(t.HoldersOf(2).size(), 5u);
  for (int i : {3, 0, 4}) t.DetachTail(seqs[i], 0);
  ASSERT_EQ(t.HoldersOf(2).size(), 2u);
  for (const SequenceTable::Owner& o : t.HoldersOf(2)) {
    EXPECT_TRUE(o.sequence == seqs[1] || o.sequence == seqs[2]);
    EXPECT_EQ(o.page_index, 0u);
    EXPECT_EQ(o.sequence->pages()[o.page_index], 2);
  }
  EXPECT_EQ(t.ReplacePage(seqs[1], 0, 3), 2);
  EXPECT_EQ(t.HoldersOf(2).size(), 1u);
  EXPECT_EQ(t.OwnerOf(3).sequence, seqs[1]);
  t.DetachTail(seqs[2], 0);
  EXPECT_TRUE(t.HoldersOf(2).empty());
}

TEST(SequenceTableHolders, OnlyReapableSequencesAreInTheUseOrderList) {
  SequenceTable t(1, 4);
  Sequence* a = t.Add("a", 1);
  Sequence* b = t.Add("b", 2);
  for (Sequence* s : {a, b}) {
    t.SetCommitted(s);
    t.MarkIdle(s, 10);
  }
  EXPECT_EQ(t.LeastRecentlyUsed(), a);
  t.SetPinned(a);
  EXPECT_EQ(t.LeastRecentlyUsed(), b) << "a pinned sequence is not a candidate";
  t.AddLease(b, 5);
  EXPECT_EQ(t.LeastRecentlyUsed(), nullptr) << "nor a leased one";
  t.RemoveLease(b, 5, 20);
  EXPECT_EQ(t.LeastRecentlyUsed(), b);
  EXPECT_EQ(b->last_used_ns(), 20) << "the end of a lease is a use";
}

// Find goes through a hash index beside the ordered map: every way out of
// the table (erase, extract, retain for leases) takes the id out of the
// index at once, and an id freed that way finds only its next incarnation.
TEST(SequenceTable, FindSeesEveryWayInAndOutOfTheTable) {
  SequenceTable t(1, 8);
  Sequence* a = Committed(t, "a", 1);
  Sequence* b = Committed(t, "b", 2);
  Sequence* c = Committed(t, "c", 3);
  EXPECT_EQ(t.Find("a"), a);
  EXPECT_EQ(t.Find(std::string_view("bx", 1)), b);  // the view's own length, not a C string
  EXPECT_EQ(t.Find("bx"), nullptr);
  EXPECT_EQ(t.Find(""), nullptr);

  SequencesById::node_type retained = t.Retain(a);  // freed while leased: the node lives on
  EXPECT_EQ(t.Find("a"), nullptr);
  Sequence* a2 = t.Add("a", 2);  // the id is free again at once
  EXPECT_NE(a2, a);
  EXPECT_EQ(t.Find("a"), a2);
  EXPECT_EQ(retained.mapped().get(), a);  // the retained one still holds its id, unseen by Find
  EXPECT_EQ(a->id(), "a");

  SequencesById::node_type extracted = t.Extract(b);
  EXPECT_EQ(t.Find("b"), nullptr);
  extracted = {};  // destroyed: nothing in the table points at it any more
  EXPECT_EQ(t.Find("b"), nullptr);
  t.Erase(c);
  EXPECT_EQ(t.Find("c"), nullptr);
  EXPECT_TRUE(t.IndexMatches());

  // Many ids (the index grows and rehashes), then every other one out.
  std::vector<Sequence*> many;
  for (int i = 0; i < 5000; ++i) many.push_back(Committed(t, "s" + std::to_string(i), 10 + i));
  for (int i = 0; i < 5000; i += 2) t.Erase(many[i]);
  for (int i = 0; i < 5000; ++i) {
    EXPECT_EQ(t.Find("s" + std::to_string(i)), i % 2 == 0 ? nullptr : many[i]) << i;
  }
  EXPECT_TRUE(t.IndexMatches());
  EXPECT_EQ(t.size(), 2501u);  // "a" and the 2,500 odd ones
}

}  // namespace
}  // namespace mlakv::server
