#include "blame.h"

#include <algorithm>
#include <cstdio>
#include <future>
#include <thread>
#include <vector>

#include "thread_name.h"

namespace pycomm {

namespace {

constexpr const char* kReportPrefix = "pycomm-failure/1 ";

// How often a follower looks for a report that is not there yet. Peers
// that detect a death publish it within microseconds of raising.
constexpr auto kPollPeriod = std::chrono::milliseconds(10);

CommError error_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const CommError& x) {
    return x;
  } catch (const std::exception& x) {
    return CommError(x.what());
  } catch (...) {
    return CommError("unknown error");
  }
}

}  // namespace

std::string encode_failure(const CommError& error) {
  return std::string(kReportPrefix) + std::to_string(static_cast<int>(error.blame().kind)) + " " +
         std::to_string(error.blame().rank) + "\n" + error.what();
}

bool decode_failure(const std::string& report, CommError* error) {
  const std::string prefix(kReportPrefix);
  const size_t nl = report.find('\n');
  int kind = 0, rank = -1;
  if (report.compare(0, prefix.size(), prefix) != 0 || nl == std::string::npos ||
      std::sscanf(report.c_str() + prefix.size(), "%d %d", &kind, &rank) != 2 || kind < 0 ||
      kind > static_cast<int>(FailureKind::kSilent)) {
    *error = CommError(report);
    return false;
  }
  *error = CommError(report.substr(nl + 1), Blame{static_cast<FailureKind>(kind), rank});
  return true;
}

std::exception_ptr explain_failure(std::shared_ptr<FailureBoard> board, int rank, std::exception_ptr error,
                                   std::chrono::milliseconds budget) {
  const CommError mine = error_of(error);
  // The walk owns copies of what it uses: it may outlive this call.
  auto task = std::make_shared<std::packaged_task<std::optional<CommError>()>>(
      [board, rank, mine, budget]() -> std::optional<CommError> {
        try {
          board->publish(rank, encode_failure(mine));
          const Blame own = mine.blame();
          if (own.gone() && own.rank >= 0)
            board->publish_death(own.rank, encode_failure(mine));
        } catch (...) {
          return std::nullopt;
        }
        CommError at = mine;
        std::vector<int> seen{rank};
        const auto deadline = std::chrono::steady_clock::now() + budget;
        while (true) {
          const Blame blame = at.blame();
          if (blame.gone()) return at;
          const int p = blame.rank;
          if (blame.kind == FailureKind::kNone || p < 0 || std::find(seen.begin(), seen.end(), p) != seen.end())
            return std::nullopt;
          try {
            std::optional<std::string> report = board->lookup(p);
            while (!report && std::chrono::steady_clock::now() < deadline) {
              // A dead rank reports nothing; one that saw it die may have.
              report = board->lookup_death(p);
              if (report) break;
              std::this_thread::sleep_for(kPollPeriod);
              report = board->lookup(p);
            }
            if (!report) {
              return CommError("pycomm: rank " + std::to_string(p) +
                                   " stopped without reporting an error: it died, was killed or hangs",
                               Blame{FailureKind::kSilent, p});
            }
            decode_failure(*report, &at);
          } catch (...) {
            return std::nullopt;
          }
          // A rank that blames nobody (its own bad input, a stage that raised
          // and aborted) is where the cascade started: its words explain it.
          if (at.blame().kind == FailureKind::kNone) return at;
          seen.push_back(p);
        }
      });
  auto cause = task->get_future();
  named_thread("blame", [task] { (*task)(); }).detach();
  // A little beyond the walk's own budget: publishing and the last lookup.
  if (cause.wait_for(budget + std::chrono::milliseconds(300)) != std::future_status::ready) return error;
  const std::optional<CommError> root = cause.get();
  if (!root || std::string(root->what()) == mine.what()) return error;
  return std::make_exception_ptr(
      CommError(std::string(root->what()) + " [rank " + std::to_string(rank) + " saw: " + mine.what() + "]",
                root->blame()));
}

}  // namespace pycomm
