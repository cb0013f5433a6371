// Point-to-point messages between ranks on different hosts: the message
// protocol of p2p.h over the process group's link (Gloo between CPU hosts),
// so a message between hosts is self-describing, ordered and checked exactly
// like one over shared memory.
//
// Each header and each tensor's bytes is one tagged transfer. A send returns
// once its bytes are copied and posted, as a send into a shared-memory ring
// returns once the bytes are in the ring: backends such as Gloo complete a
// send only when the receiver posts the matching receive, and two ranks that
// send to each other first must not wait on each other. Up to
// kMaxPendingBytes per peer may wait for their receiver; beyond that a send
// waits for the oldest (bounded by its deadline). Every message
// between two ranks uses one tag that no collective uses
// (pg_p2p_tag(), process_group.h), so the backend's per-tag ordering is
// the channel's order; each direction of a pair is carried by one lane
// thread of the communicator, so transfers of one direction never overlap.
// Waits are bounded by the caller's deadline; a transfer that timed out
// leaves this object unusable (the backend may still deliver into it).
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "p2p.h"
#include "process_group.h"

namespace pycomm {

class PgChannels : public MessageChannels {
 public:
  // `link` ranks are the communicator's ranks; `rank` is this process's.
  PgChannels(std::shared_ptr<PeerLink> link, int rank);
  ~PgChannels() override;
  PgChannels(const PgChannels&) = delete;
  PgChannels& operator=(const PgChannels&) = delete;

  // Later receives raise `why`; sends still go out, so that the reason
  // itself can reach the peers. A receive already waiting keeps waiting
  // until its data, the peer's own failure message, or its deadline:
  // cancelling a Gloo receive (Work::abort) closes the connection under
  // the failure messages still in flight. Except when `blame` names a rank
  // gone for good (Blame::gone): then every wait, in progress (the caller
  // interrupts the link) or later, raises at once.
  void abort(const std::string& why, Blame blame = {});

  // Waits (at most `timeout_s` in all) until every posted send was taken by
  // its receiver; gives up silently after that (the receiver then fails).
  // Sends to a peer that failed are not waited for: its stream to this rank
  // ended with its abort's message, or `failed(peer)` says so (the failure
  // board). A failed rank posts no more receives, so they would hold this
  // close for the whole timeout, and two failed ranks each waiting for the
  // other's receive would both be held. After this rank's own abort it waits
  // 2 s at most: its peers may never receive from it again.
  void flush(double timeout_s, const std::function<bool(int)>& failed);

  // This rank's abort reason, as the last message of its stream to `peer`,
  // a rank it never exchanged a message with (no lane carries one): a
  // receive `peer` has waiting, or posts while this rank lives, raises it at
  // once instead of waiting for its timeout. Unasked, so flush() does not
  // wait for it: most such peers never receive from this rank.
  void send_unasked_failure(int peer, const std::string& why, const OpContext& ctx);
  void write(int peer, const void* data, size_t n, const OpContext& ctx) override;
  void read(int peer, void* data, size_t n, const OpContext& ctx) override;

 protected:
  [[noreturn]] void out_of_step(const std::string& why) override;
  int name(int peer) const override { return peer; }
  int self_name() const override { return rank_; }

 private:
  using TransferPtr = std::shared_ptr<PeerLink::Transfer>;
  struct Pending {
    TransferPtr work;
    std::unique_ptr<char[]> bytes;
    size_t n = 0;
    bool unasked = false;  // send_unasked_failure's: flush() does not wait for it
  };
  void check_broken();
  // A transfer the backend refused to post: the connection to `peer` is gone.
  CommError unreachable(const OpContext& ctx, int peer, const char* error) const;
  // Drops completed sends to `peer`; waits for the oldest while more than
  // `keep` bytes are pending. Called under send_mu_.
  void reap(int peer, size_t keep, const OpContext& ctx);
  void wait(TransferPtr work, int peer, const char* what, const OpContext& ctx);
  // The abort that declared a peer gone, if there was one.
  std::optional<CommError> peer_gone();

  std::shared_ptr<PeerLink> link_;
  int rank_;
  uint32_t tag_;
  std::mutex send_mu_;  // guards pending_ (one lane per direction, but per peer)
  std::map<int, std::deque<Pending>> pending_;
  std::map<int, size_t> pending_bytes_;
  std::mutex mu_;
  std::optional<CommError> broken_;
  std::optional<CommError> aborted_;  // guarded by mu_
  // Transfers abandoned by a failed wait stay referenced (the backend may
  // still touch them), with the staging buffers of small reads.
  std::vector<TransferPtr> abandoned_;
  std::vector<std::unique_ptr<char[]>> abandoned_buffers_;
};

}  // namespace pycomm
