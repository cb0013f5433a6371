// The process-group transport's PeerLink over a torch.distributed backend
// (Gloo between CPU hosts): byte transfers become uint8 tensors viewing the
// transport's own buffers, sent with the backend's tagged send/recv.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <memory>

#include "../transport/process_group.h"

namespace pycomm {

class C10dLink : public PeerLink {
 public:
  explicit C10dLink(c10::intrusive_ptr<c10d::Backend> backend) : backend_(std::move(backend)) {}

  int rank() const override { return backend_->getRank(); }

  std::shared_ptr<Transfer> send(const void* data, size_t bytes, int peer, uint32_t tag) override {
    std::vector<at::Tensor> t{view(const_cast<void*>(data), bytes)};
    return std::make_shared<C10dTransfer>(backend_->send(t, peer, static_cast<int>(tag)));
  }

  std::shared_ptr<Transfer> recv(void* data, size_t bytes, int peer, uint32_t tag) override {
    std::vector<at::Tensor> t{view(data, bytes)};
    return std::make_shared<C10dTransfer>(backend_->recv(t, peer, static_cast<int>(tag)));
  }

 private:
  class C10dTransfer : public Transfer {
   public:
    explicit C10dTransfer(c10::intrusive_ptr<c10d::Work> work) : work_(std::move(work)) {}
    bool wait(std::chrono::milliseconds timeout) override { return work_->wait(timeout); }
    bool done() override { return work_->isCompleted() && work_->isSuccess(); }

   private:
    c10::intrusive_ptr<c10d::Work> work_;
  };

  static at::Tensor view(void* data, size_t bytes) {
    return at::from_blob(data, {static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
  }

  c10::intrusive_ptr<c10d::Backend> backend_;
};

}  // namespace pycomm
