// Naming the rank that caused a failure between hosts.
//
// Inside a host a death is seen directly (the shared-memory transport
// watches every peer's process). Between hosts it shows as a cascade: the
// rank next to the dead one sees its connection close and raises; its own
// peers then see *that* rank's connection close, and so on. So every
// failing rank publishes its failure (message and structured Blame) on a
// board every rank can read (the bootstrap store) before it raises, and
// then follows the chain of blame: the rank it blames, the rank that one
// blames, ..., until a report of a death, or a rank that published nothing:
// that rank is the one that died (or hangs).
//
// The chain follows Blame fields, never the wording of messages.
#pragma once

#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <string>

#include "../core/common.h"

namespace pycomm {

// Where failing ranks leave their reports.
class FailureBoard {
 public:
  virtual ~FailureBoard() = default;
  // Throws on a board that cannot be reached.
  virtual void publish(int rank, const std::string& report) = 0;
  // `rank`'s report if it published one; does not wait. Throws on a board
  // that cannot be reached.
  virtual std::optional<std::string> lookup(int rank) = 0;
  // A rank that saw `dead` die says so where others look for `dead`'s own
  // report, which never comes: a peer on another host, whose error only
  // says that a connection closed, learns the cause at once instead of
  // after the budget. Kept beside the reports, under negative indices.
  virtual void publish_death(int dead, const std::string& report) { publish(-2 - dead, report); }
  virtual std::optional<std::string> lookup_death(int dead) { return lookup(-2 - dead); }
};

// A report as it travels: "pycomm-failure/1 <kind> <rank>\n<message>".
std::string encode_failure(const CommError& error);
// False for text that is no report (then *error holds it without blame).
bool decode_failure(const std::string& report, CommError* error);

// Publishes `error` as `rank`'s report and follows the chain of blame for
// at most `budget` (on a helper thread, so a board that does not answer
// cannot hold the error longer). Returns the root cause with this rank's
// view appended, or `error` itself when there is nothing better to say.
std::exception_ptr explain_failure(std::shared_ptr<FailureBoard> board, int rank, std::exception_ptr error,
                                   std::chrono::milliseconds budget);

}  // namespace pycomm
