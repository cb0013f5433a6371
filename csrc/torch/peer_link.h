// The process-group transport's PeerLink over a torch.distributed backend
// (Gloo between CPU hosts): byte transfers become uint8 tensors viewing the
// transport's own buffers, sent with the backend's tagged send/recv.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "../transport/process_group.h"

namespace pycomm {

class C10dLink : public PeerLink {
 public:
  explicit C10dLink(c10::intrusive_ptr<c10d::Backend> backend) : backend_(std::move(backend)) {}

  int rank() const override { return backend_->getRank(); }

  std::shared_ptr<Transfer> send(const void* data, size_t bytes, int peer, uint32_t tag) override {
    std::vector<at::Tensor> t{view(const_cast<void*>(data), bytes)};
    return track(std::make_shared<C10dTransfer>(backend_->send(t, peer, static_cast<int>(tag)), tag));
  }

  std::shared_ptr<Transfer> recv(void* data, size_t bytes, int peer, uint32_t tag) override {
    std::vector<at::Tensor> t{view(data, bytes)};
    return track(std::make_shared<C10dTransfer>(backend_->recv(t, peer, static_cast<int>(tag)), tag));
  }

  // Work::abort() on Gloo's send and receive wakes the wait in progress, or
  // the next one, which returns false; the transfer stays posted and the
  // connection stays up. Messages' transfers that are spared stay tracked.
  void interrupt(Waits which) override {
    const uint32_t messages = pg_p2p_tag();
    std::vector<std::shared_ptr<C10dTransfer>> live;
    {
      std::lock_guard<std::mutex> lk(mu_);
      std::vector<std::weak_ptr<C10dTransfer>> spared;
      for (auto& w : live_) {
        auto t = w.lock();
        if (!t) continue;
        if (which == Waits::kCollectives && t->tag() == messages)
          spared.push_back(t);
        else
          live.push_back(std::move(t));
      }
      live_ = std::move(spared);
    }
    for (auto& t : live) t->interrupt();
  }

 private:
  class C10dTransfer : public Transfer {
   public:
    C10dTransfer(c10::intrusive_ptr<c10d::Work> work, uint32_t tag) : work_(std::move(work)), tag_(tag) {}
    uint32_t tag() const { return tag_; }
    bool wait(std::chrono::milliseconds timeout) override {
      const bool ok = work_->wait(timeout);
      if (ok) completed_ = true;
      return ok;
    }
    // Gloo marks a work completed (and successful) when its wait returns,
    // even when an interrupt woke it: after one, only a wait that returned
    // true proves the data moved.
    bool done() override {
      return completed_ || (!interrupted_ && work_->isCompleted() && work_->isSuccess());
    }
    void interrupt() {
      interrupted_ = true;
      work_->abort();
    }

   private:
    c10::intrusive_ptr<c10d::Work> work_;
    const uint32_t tag_;
    std::atomic<bool> completed_{false};
    std::atomic<bool> interrupted_{false};
  };

  // Remembers a transfer for interrupt() while anyone holds it.
  std::shared_ptr<Transfer> track(std::shared_ptr<C10dTransfer> t) {
    std::lock_guard<std::mutex> lk(mu_);
    // Forget finished transfers each time the list doubled: amortized O(1),
    // and never much longer than what is in flight.
    if (live_.size() >= prune_at_) {
      live_.erase(std::remove_if(live_.begin(), live_.end(), [](const auto& w) { return w.expired(); }),
                  live_.end());
      prune_at_ = std::max<size_t>(64, 2 * live_.size());
    }
    live_.push_back(t);
    return t;
  }

  static at::Tensor view(void* data, size_t bytes) {
    return at::from_blob(data, {static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
  }

  c10::intrusive_ptr<c10d::Backend> backend_;
  std::mutex mu_;
  std::vector<std::weak_ptr<C10dTransfer>> live_;
  size_t prune_at_ = 64;
};

}  // namespace pycomm
