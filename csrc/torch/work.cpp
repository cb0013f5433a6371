#include "work.h"

#include <sstream>

namespace pycomm {

void Work::finish(std::exception_ptr error) {
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  {
    std::lock_guard<std::mutex> lk(mu_);
    finished_ = std::chrono::steady_clock::now();
    done_ = true;
    error_ = error;
    fut = future_;
  }
  cv_.notify_all();
  // Completed outside the lock: the future's callbacks (a DDP hook's
  // continuation, say) run right here, on the progress thread.
  if (fut) {
    if (error) {
      fut->setError(error);
    } else {
      fut->markCompleted(c10::IValue(outputs_));
    }
  }
  inputs_.clear();
  body_ = nullptr;
  before_ = nullptr;
  after_ = nullptr;
  caller_state_.reset();
}

double Work::run_seconds() {
  std::lock_guard<std::mutex> lk(mu_);
  return done_ ? std::chrono::duration<double>(finished_ - started_).count() : 0.0;
}

bool Work::wait(double timeout_s) {
  if (forked_from(owner_pid_)) {
    // The child is alone with its copy: no thread writes done_ here, and mu_
    // may have been copied locked.
    if (!done_)
      throw CommError("pycomm: Work.wait: this " + std::string(collective_name(desc_.coll)) + " was still in "
                      "progress when this process was made by fork() from process " + std::to_string(owner_pid_) +
                      "; it completes there, never here");
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  if (help_ && timeout_s < 0 && !is_completed()) help_();
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout_s < 0) {
    cv_.wait(lk, [&] { return done_; });
  } else if (!cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return done_; })) {
    std::ostringstream os;
    os << "pycomm: Work.wait: " << timed_out_waiting(timeout_s) << "; " << collective_name(desc_.coll) << " #"
       << seq_ << " is still in progress";
    throw CommError(os.str());
  }
  if (error_) std::rethrow_exception(error_);
  return true;
}

bool Work::is_completed() {
  if (forked_from(owner_pid_)) return done_;  // as in wait()
  std::lock_guard<std::mutex> lk(mu_);
  return done_;
}

bool Work::is_success() {
  std::lock_guard<std::mutex> lk(mu_);
  return done_ && !error_;
}

std::string Work::error_message() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!error_) return "";
  try {
    std::rethrow_exception(error_);
  } catch (const std::exception& e) {
    return e.what();
  }
}

std::exception_ptr Work::error() {
  std::lock_guard<std::mutex> lk(mu_);
  return error_;
}

c10::intrusive_ptr<c10::ivalue::Future> Work::get_future() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!future_) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    if (done_) {
      if (error_) {
        future_->setError(error_);
      } else {
        future_->markCompleted(c10::IValue(outputs_));
      }
    }
  }
  return future_;
}

const char* range_name(Collective coll) {
  switch (coll) {
    case Collective::kAllReduce: return "pycomm::all_reduce";
    case Collective::kReduceScatter: return "pycomm::reduce_scatter";
    case Collective::kAllGather: return "pycomm::all_gather";
    case Collective::kBroadcast: return "pycomm::broadcast";
    case Collective::kAllToAll: return "pycomm::all_to_all";
    case Collective::kSend: return "pycomm::send";
    case Collective::kRecv: return "pycomm::recv";
    default: return "pycomm::barrier";
  }
}

void StageRanges::enter(const char* name) {
  current_.reset();
  if (name == nullptr) return;
  current_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (current_->isActive()) current_->before(name);
}

}  // namespace pycomm
