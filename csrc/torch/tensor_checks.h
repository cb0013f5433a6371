// The checks a call's tensors pass before it takes its turn. Each returns
// "" when the tensors are usable, else a message a user can act on (the
// communicator then rejects the call in turn, so that every rank raises).
// Checks never throw: a tensor whose properties cannot be read (a sparse
// tensor has no strides) is reported like any other unusable tensor.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../core/codec.h"
#include "../core/collective.h"

namespace pycomm {

// `t` can take part in a collective: defined, dense and strided, on the
// CPU, holding its own storage, of a dtype pycomm moves, contiguous.
std::string check_tensor(const at::Tensor& t, const char* role, Collective coll);

// "" when `t`'s memory holds the values it reads as, else what to tell the
// user (to follow the tensor's name). Transports and kernels move memory: a
// tensor subclass that wraps others (DTensor; fake and functional tensors)
// has no storage of its own (its data pointer is null or not its data), and a
// lazy conjugate or negative view's memory holds other values than it reads
// as (torch.distributed refuses such views too). Check the layout first: a
// sparse tensor has no storage either.
std::string memory_mismatch(const at::Tensor& t);

bool overlaps(const at::Tensor& a, const at::Tensor& b);

// Whether `part` is block `rank` of `whole` (blocks of part's size): NCCL's
// in-place forms, an all-gather's input in its output and a reduce-scatter's
// output in its input. False for a tensor without storage of its own.
bool is_rank_block(const at::Tensor& part, const at::Tensor& whole, int rank);

// A collective with an input and an output tensor: each usable on its own,
// same dtype, and input.numel() * out_mult == output.numel() * in_mult.
std::string check_io(Collective coll, const at::Tensor& input, const at::Tensor& output, int64_t in_mult,
                     int64_t out_mult, int world);

// All-reduce: in place, or a separate tensor of the same size.
std::string check_all_reduce_io(const at::Tensor& input, const at::Tensor& output, int world);

// The dtypes a codec compresses (Python reads them as codec_dtypes).
constexpr at::ScalarType kCodecDtypes[] = {at::kFloat, at::kHalf, at::kBFloat16};

// A compressed all-reduce: the all-reduce checks, a float tensor, sum or
// avg, usable codec parameters, and residuals (may be undefined) of the
// right size (the server residual: the quantized all-reduce's shard).
std::string check_compressed(const at::Tensor& input, const at::Tensor& output, RedOp op, const Codec& codec,
                             const at::Tensor& worker_residual, const at::Tensor& server_residual, int world);

// A point-to-point message's tensors: at least one, each defined, dense,
// on the CPU, with at most `max_dims` dimensions (any strides: they travel
// as contiguous copies).
std::string check_send(const std::vector<at::Tensor>& tensors, int max_dims);
// A receive's `out` tensors (may be empty): defined, dense, contiguous, CPU.
std::string check_recv(const std::vector<at::Tensor>& out);

}  // namespace pycomm
