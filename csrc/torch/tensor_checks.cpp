#include "tensor_checks.h"

#include <algorithm>
#include <climits>
#include <iterator>
#include <sstream>

#include "../compression/quantized_allreduce.h"
#include "dtype.h"

namespace pycomm {

namespace {

// The device part of a message: what the communicator takes, whatever the
// build, and where a user with tensors elsewhere should go.
void explain_device(std::ostringstream& os, const at::Tensor& t, const char* role) {
  os << role << " is on device '" << t.device()
     << "', but pycomm's communicator takes CPU tensors only (for CUDA tensors give the group a CUDA backend, "
        "e.g. init_process_group(\"cpu:pycomm,cuda:nccl\"), or use pycomm.cuda_ipc.IpcAllReduce within a host)";
}

// Strided, dense, on the CPU, its memory holding what it reads as. Checked
// first: a sparse tensor's strides (and so is_contiguous()) throw, outside
// the call's turn.
bool check_layout(std::ostringstream& os, const at::Tensor& t, const char* role) {
  if (!t.defined()) {
    os << role << " is undefined";
    return false;
  }
  if (t.layout() != at::kStrided || t.is_quantized() || t.is_nested()) {
    os << role << " must be a dense tensor (got layout " << t.layout() << (t.is_quantized() ? ", quantized" : "")
       << (t.is_nested() ? ", nested" : "") << ")";
    return false;
  }
  if (!t.device().is_cpu()) {
    explain_device(os, t, role);
    return false;
  }
  const std::string why = memory_mismatch(t);
  if (!why.empty()) {
    os << role << " " << why;
    return false;
  }
  return true;
}

}  // namespace

std::string memory_mismatch(const at::Tensor& t) {
  if (!t.has_storage() || t.unsafeGetTensorImpl()->is_python_dispatch())
    return "is a tensor subclass without storage of its own (a DTensor, or a fake or functional tensor); pass a "
           "plain tensor, e.g. dtensor.to_local() for this rank's shard or dtensor.full_tensor() for the whole";
  if (t.is_conj() || t.is_neg())
    return std::string("is a lazy ") + (t.is_conj() ? "conjugate" : "negative") +
           " view (its memory holds other values than it reads as); pass " +
           (t.is_conj() ? "tensor.resolve_conj()" : "tensor.resolve_neg()");
  return "";
}

std::string check_tensor(const at::Tensor& t, const char* role, Collective coll) {
  std::ostringstream os;
  os << "pycomm." << collective_name(coll) << ": ";
  if (!check_layout(os, t, role)) return os.str();
  DType dt;
  if (!to_dtype(t.scalar_type(), &dt)) {
    os << role << " has dtype torch." << c10::getDtypeNames(t.scalar_type()).first
       << ", which pycomm cannot move (every dtype with whole bytes per element is supported)";
    return os.str();
  }
  if (!t.is_contiguous()) {
    os << role << " is not contiguous (shape " << t.sizes() << ", strides " << t.strides()
       << "); pass tensor.contiguous()";
    return os.str();
  }
  return "";
}

bool is_rank_block(const at::Tensor& part, const at::Tensor& whole, int rank) {
  return part.has_storage() && whole.has_storage() &&
         part.data_ptr() == static_cast<const char*>(whole.data_ptr()) + rank * part.nbytes();
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const char* a0 = static_cast<const char*>(a.data_ptr());
  const char* b0 = static_cast<const char*>(b.data_ptr());
  const char* a1 = a0 + a.numel() * a.element_size();
  const char* b1 = b0 + b.numel() * b.element_size();
  return a0 < b1 && b0 < a1;
}

std::string check_io(Collective coll, const at::Tensor& input, const at::Tensor& output, int64_t in_mult,
                     int64_t out_mult, int world) {
  std::string why = check_tensor(input, "input", coll);
  if (why.empty()) why = check_tensor(output, "output", coll);
  if (!why.empty()) return why;
  const std::string name = std::string("pycomm.") + collective_name(coll) + ": ";
  if (output.scalar_type() != input.scalar_type()) return name + "output dtype differs from input dtype";
  if (input.numel() * out_mult != output.numel() * in_mult) {
    std::ostringstream os;
    os << name;
    if (in_mult == out_mult) {
      os << "output has " << output.numel() << " elements but input has " << input.numel();
    } else if (in_mult > out_mult) {
      os << "input must have world_size (" << world << ") x output.numel() (" << output.numel()
         << ") elements, got " << input.numel();
    } else {
      os << "output must have world_size (" << world << ") x input.numel() (" << input.numel()
         << ") elements, got " << output.numel();
    }
    return os.str();
  }
  return "";
}

std::string check_all_reduce_io(const at::Tensor& input, const at::Tensor& output, int world) {
  std::string why = check_io(Collective::kAllReduce, input, output, 1, 1, world);
  if (why.empty() && output.data_ptr() != input.data_ptr() && overlaps(input, output))
    why = "pycomm.all_reduce: output partially overlaps input; pass the same tensor or a separate one";
  return why;
}

std::string check_compressed(const at::Tensor& input, const at::Tensor& output, RedOp op, const Codec& codec,
                             const at::Tensor& worker_residual, const at::Tensor& server_residual, int world) {
  std::string why = check_all_reduce_io(input, output, world);
  if (why.empty() && std::find(std::begin(kCodecDtypes), std::end(kCodecDtypes), input.scalar_type()) ==
                         std::end(kCodecDtypes))
    why = std::string("pycomm.all_reduce: compression needs a float32, float16 or bfloat16 tensor, got torch.") +
          std::string(c10::getDtypeNames(input.scalar_type()).first);
  if (why.empty() && op != RedOp::kSum && op != RedOp::kAvg)
    why = std::string("pycomm.all_reduce: compression supports op=sum and op=avg, not ") + redop_name(op);
  if (why.empty()) {
    why = codec.check();
    if (!why.empty()) why = "pycomm.all_reduce: " + why;
  }
  if (why.empty() && input.numel() > INT32_MAX && codec.kind == CodecKind::kTopK)
    why = "pycomm.all_reduce: TopK indexes with int32; the tensor has more than 2^31-1 elements";
  auto check_residual = [&](const at::Tensor& r, const char* name, int64_t want) {
    if (!why.empty() || !r.defined()) return;
    std::ostringstream os;
    if (r.layout() != at::kStrided || !r.device().is_cpu() || r.scalar_type() != at::kFloat ||
        !r.is_contiguous()) {
      os << "pycomm.all_reduce: the " << name << " residual must be a dense, contiguous float32 CPU tensor";
    } else if (r.numel() != want) {
      os << "pycomm.all_reduce: the " << name << " residual has " << r.numel() << " elements, expected " << want;
    } else if (overlaps(r, input) || overlaps(r, output)) {
      os << "pycomm.all_reduce: the " << name << " residual overlaps the tensor";
    }
    why = os.str();
  };
  check_residual(worker_residual, "worker", input.numel());
  // Reached only with a usable tensor and codec: the shard size needs both.
  if (codec.quantized() && why.empty())
    check_residual(server_residual, "server",
                   static_cast<int64_t>(QuantizedAllReduce::shard_elems(input.numel(), world, codec.block)));
  return why;
}

std::string check_send(const std::vector<at::Tensor>& tensors, int max_dims) {
  if (tensors.empty()) return "nothing to send (an empty list of tensors)";
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    std::ostringstream os;
    const std::string role = "tensor " + std::to_string(i);
    if (!check_layout(os, t, role.c_str())) return os.str();
    if (t.dim() > max_dims) {
      os << role << " has " << t.dim() << " dimensions; at most " << max_dims << " are supported";
      return os.str();
    }
  }
  return "";
}

std::string check_recv(const std::vector<at::Tensor>& out) {
  for (size_t i = 0; i < out.size(); ++i) {
    std::ostringstream os;
    const std::string role = "out tensor " + std::to_string(i);
    if (!check_layout(os, out[i], role.c_str())) return os.str();
    if (!out[i].is_contiguous()) return role + " must be contiguous";
  }
  return "";
}

}  // namespace pycomm
