// The bootstrap Store as the communicator's failure board (blame.h) and
// heartbeat board (peer_watch.h). Kept out of the torch-free layers: they
// speak c10d::Store, which only csrc/torch may include.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <optional>
#include <string>
#include <vector>

#include "../transport/blame.h"
#include "../transport/peer_watch.h"

namespace pycomm {

// Failure reports in the bootstrap store, one key per rank.
class StoreBoard : public FailureBoard {
 public:
  explicit StoreBoard(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void publish(int rank, const std::string& report) override { store_->set(key(rank), report); }
  std::optional<std::string> lookup(int rank) override {
    if (!store_->check({key(rank)})) return std::nullopt;
    const auto v = store_->get(key(rank));
    return std::string(v.begin(), v.end());
  }

 private:
  static std::string key(int rank) { return "failure/" + std::to_string(rank); }
  c10::intrusive_ptr<c10d::Store> store_;
};

// Heartbeat counters in the bootstrap store, one key per rank, over the
// connection of the store object the communicator was given. Not one of
// their own: opening a store connection took seconds at times, and held up
// this process's other calls on the store meanwhile (the blame chain's). A
// caller's blocking call on the same store object (a wait for a key that
// does not come) holds the beats up; docs/fault_tolerance.md says what to do about it.
class StoreBeats : public BeatBoard {
 public:
  explicit StoreBeats(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void beat(int rank) override { store_->add(key(rank), 1); }
  void mark(int rank, int64_t mark) override {
    const std::string v = std::to_string(mark);
    store_->set(key(rank), std::vector<uint8_t>(v.begin(), v.end()));
  }
  std::vector<int64_t> read(const std::vector<int>& ranks) override {
    std::vector<std::string> keys;
    for (int r : ranks) keys.push_back(key(r));
    std::vector<int64_t> out(ranks.size(), 0);
    // multiGet waits for keys that do not exist yet (a peer that did not
    // beat yet): read only what is there.
    if (store_->check(keys)) {
      const auto values = store_->multiGet(keys);
      for (size_t i = 0; i < values.size() && i < out.size(); ++i) out[i] = parse(values[i]);
    } else {
      for (size_t i = 0; i < keys.size(); ++i)
        if (store_->check({keys[i]})) out[i] = parse(store_->get(keys[i]));
    }
    return out;
  }

 private:
  static std::string key(int rank) { return "beat/" + std::to_string(rank); }
  static int64_t parse(const std::vector<uint8_t>& v) {
    try {
      return std::stoll(std::string(v.begin(), v.end()));
    } catch (const std::exception&) {
      return 0;
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace pycomm
