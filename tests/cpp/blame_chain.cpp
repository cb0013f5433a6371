// The chain of blame between hosts follows structured Blame fields, never
// the wording of messages: the reports below use wording no transport
// writes, and the chain must still find the rank that died.
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>

#include "transport/blame.h"

using namespace pycomm;

namespace {

class MemoryBoard : public FailureBoard {
 public:
  void publish(int rank, const std::string& report) override {
    std::lock_guard<std::mutex> lk(mu_);
    reports_[rank] = report;
  }
  std::optional<std::string> lookup(int rank) override {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = reports_.find(rank);
    if (it == reports_.end()) return std::nullopt;
    return it->second;
  }

 private:
  std::mutex mu_;
  std::map<int, std::string> reports_;
};

int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what);
    ++failures;
  }
}

CommError explained(const std::shared_ptr<FailureBoard>& board, int rank, const CommError& mine) {
  try {
    std::rethrow_exception(explain_failure(board, rank, std::make_exception_ptr(mine), std::chrono::milliseconds(300)));
  } catch (const CommError& e) {
    return e;
  }
}

}  // namespace

int main() {
  // 1. Reports survive the round trip, messages with newlines included.
  CommError back("");
  expect(decode_failure(encode_failure(CommError("two\nlines", {FailureKind::kWaiting, 7})), &back),
         "a report decodes");
  expect(std::string(back.what()) == "two\nlines" && back.blame().kind == FailureKind::kWaiting &&
             back.blame().rank == 7,
         "message and blame survive");
  expect(!decode_failure("some text", &back) && back.blame().kind == FailureKind::kNone, "plain text has no blame");

  // 2. 0 -> 1 -> 2 -> 3 died: rank 0 names rank 3, whatever the words.
  auto board = std::make_shared<MemoryBoard>();
  board->publish(1, encode_failure(CommError("lost contact (one)", {FailureKind::kWaiting, 2})));
  board->publish(2, encode_failure(CommError("peer vanished (two)", {FailureKind::kDied, 3})));
  CommError e = explained(board, 0, CommError("connection reset", {FailureKind::kWaiting, 1}));
  expect(e.blame().kind == FailureKind::kDied && e.blame().rank == 3, "the chain ends at the death");
  expect(std::string(e.what()).find("peer vanished (two)") == 0, "the root cause's message comes first");
  expect(std::string(e.what()).find("[rank 0 saw: connection reset]") != std::string::npos, "this rank's view");
  expect(board->lookup(0).has_value(), "this rank published its own report");

  // 3. A rank that never reports is the one that stopped.
  auto silent = std::make_shared<MemoryBoard>();
  e = explained(silent, 0, CommError("gave up", {FailureKind::kWaiting, 5}));
  expect(e.blame().kind == FailureKind::kSilent && e.blame().rank == 5, "an unreported rank is named");

  // 3b. A dead rank reports nothing, but a rank that saw it die said so: a
  //     rank blaming it (across hosts: "connection closed") learns the
  //     death at once, not after the budget.
  auto seen = std::make_shared<MemoryBoard>();
  CommError died = explained(seen, 2, CommError("peer gone (two)", {FailureKind::kDied, 3}));
  expect(died.blame().kind == FailureKind::kDied && died.blame().rank == 3, "the witness keeps its own error");
  expect(seen->lookup_death(3).has_value(), "the witness published the death of rank 3");
  const auto t0 = std::chrono::steady_clock::now();
  e = explained(seen, 0, CommError("closed (zero)", {FailureKind::kWaiting, 3}));
  const auto waited = std::chrono::steady_clock::now() - t0;
  expect(e.blame().kind == FailureKind::kDied && e.blame().rank == 3, "the death is found beside the reports");
  expect(std::string(e.what()).find("peer gone (two)") == 0, "the witness's words explain it");
  expect(waited < std::chrono::milliseconds(150), "without waiting out the budget");

  // 4. Nothing to follow: the error stays as it was.
  e = explained(board, 4, CommError("bad input"));
  expect(std::string(e.what()) == "bad input" && e.blame().kind == FailureKind::kNone, "no blame, no chain");
  // A cycle (each blames the other) stops rather than loops.
  auto cycle = std::make_shared<MemoryBoard>();
  cycle->publish(1, encode_failure(CommError("waiting", {FailureKind::kWaiting, 0})));
  e = explained(cycle, 0, CommError("waiting too", {FailureKind::kWaiting, 1}));
  expect(std::string(e.what()) == "waiting too", "a cycle keeps the rank's own error");

  std::printf("%s\n", failures ? "failed" : "ok");
  return failures ? 1 : 0;
}
