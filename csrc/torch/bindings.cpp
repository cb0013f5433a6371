// The only file that talks to Python. Enums cross as small ints, and the
// extension publishes the tables that name them (algorithms, collectives,
// reduce ops, codecs and their defaults): Python reads them instead of
// restating them.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>

#include "../algorithms/schedule.h"
#include "../algorithms/tuner.h"
#include "../compression/compressed_allreduce.h"
#include "../compression/quantized_allreduce.h"
#include "../compression/sparse_allreduce.h"
#include "../transport/program_sim.h"
#include "../transport/thread_name.h"
#include "../kernels/quant.h"
#include "backend.h"
#include "communicator.h"
#include "dtype.h"
#include "tensor_checks.h"

#ifdef PYCOMM_WITH_CUDA
#include "ipc.h"
#endif

namespace py = pybind11;

namespace pycomm {
namespace {

// Joining the progress thread may wait for a future callback that needs the
// GIL, so never destroy a communicator while holding it. The last reference
// may also go inside such a callback (a closure that held the communicator),
// on the communicator's own thread, which can neither join itself nor go on
// in a destroyed object: another thread ends it then.
//
// In a fork() child the copy is left undestroyed: its threads are the
// parent's, and ending it would wait for them forever (transport/process.h).
struct GilFreeDelete {
  void operator()(Communicator* c) const {
    if (c->forked_copy()) return;
    if (c->on_own_thread()) {
      named_thread("close", [c] { delete c; }).detach();
      return;
    }
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      delete c;
    } else {
      delete c;
    }
  }
};

// Deletes an object that owns threads, except in a fork() child of the
// process that made it, where the copy is left as it is (GilFreeDelete says
// why).
template <class T>
struct DeleteInOwnProcess {
  int32_t owner = current_pid();
  void operator()(T* p) const {
    if (!forked_from(owner)) delete p;
  }
};

// Ids a caller may pass: the user-facing algorithms and the concrete
// schedules (the resolved hierarchical forms are the tuner's alone).
Algorithm to_algo(int a) {
  if (a < 0 || a > static_cast<int>(Algorithm::kHier)) throw CommError("pycomm: unknown algorithm id");
  return static_cast<Algorithm>(a);
}
RedOp to_op(int op) {
  if (op < 0 || op > kLastRedOp) throw CommError("pycomm: unknown reduce op id");
  return static_cast<RedOp>(op);
}
Collective to_coll(int c) {
  if (c < 0 || c > static_cast<int>(Collective::kAllToAll)) throw CommError("pycomm: unknown collective id");
  return static_cast<Collective>(c);
}

// Python's pycomm.CommError, created once; instances carry the structured
// blame: `blamed_rank` (None when nobody is to blame) and `failure`
// ("died", "shut_down", "waiting", "rejected", "silent" or None).
py::object& comm_error_type() {
  static py::object type;
  return type;
}

void raise_comm_error(const CommError& e) {
  py::object inst = comm_error_type()(e.what());
  const Blame& b = e.blame();
  const bool blamed = b.kind != FailureKind::kNone && b.rank >= 0;
  inst.attr("blamed_rank") = blamed ? py::object(py::int_(b.rank)) : py::object(py::none());
  inst.attr("failure") = blamed ? py::object(py::str(failure_kind_name(b.kind))) : py::object(py::none());
  PyErr_SetObject(comm_error_type().ptr(), inst.ptr());
}

// The tables Python reads.
py::dict algorithm_table() {
  py::dict d;
  for (const auto& c : kAlgorithmChoices) d[c.name] = static_cast<int>(c.algo);
  return d;
}
py::list collective_table() {
  py::list l;
  for (int c = 0; c <= kLastCollective; ++c) l.append(collective_name(static_cast<Collective>(c)));
  return l;
}
py::list algorithm_names() {
  py::list l;
  for (int a = 0; a <= kLastAlgorithm; ++a) l.append(algorithm_name(static_cast<Algorithm>(a)));
  return l;
}
py::dict op_kind_table() {
  py::dict d;
  d["send"] = static_cast<int>(OpKind::kSend);
  d["recv_reduce"] = static_cast<int>(OpKind::kRecvReduce);
  d["recv_copy"] = static_cast<int>(OpKind::kRecvCopy);
  return d;
}
py::dict redop_table() {
  py::dict d;
  for (int op = 0; op <= kLastRedOp; ++op) d[redop_name(static_cast<RedOp>(op))] = op;
  return d;
}
py::dict codec_table() {
  py::dict d;
  for (int k = 1; k <= kLastCodecKind; ++k) d[codec_kind_name(static_cast<CodecKind>(k))] = k;
  return d;
}
// A codec as Python passes it (compression.core_args), checked only for its
// kind: what else is wrong with it is Codec::check()'s to say.
Codec make_codec(int kind, int block, bool stochastic, uint64_t seed, double ratio, bool exact, double tolerance,
                 double sample_fraction) {
  if (kind < 1 || kind > kLastCodecKind) throw CommError("pycomm: unknown codec id " + std::to_string(kind));
  Codec codec;
  codec.kind = static_cast<CodecKind>(kind);
  codec.block = block;
  codec.stochastic = stochastic;
  codec.seed = seed;
  codec.ratio = ratio;
  codec.exact = exact;
  codec.tolerance = tolerance;
  codec.sample_fraction = sample_fraction;
  return codec;
}
py::dict codec_defaults() {
  const Codec c;
  py::dict d;
  d["block"] = c.block;
  d["stochastic"] = c.stochastic;
  d["seed"] = c.seed;
  d["ratio"] = c.ratio;
  d["exact"] = c.exact;
  d["tolerance"] = c.tolerance;
  d["sample_fraction"] = c.sample_fraction;
  return d;
}

// Data-free view of a schedule, for tests and for reading along:
// [(kind, phase, peer, chunk, sent_step), ...] of `rank` at `step`.
std::vector<std::tuple<int, int, int, int, int>> schedule_ops(int algo, int coll, int rank, int world, int root,
                                                             int step) {
  Schedule s{to_algo(algo), to_coll(coll), world, root};
  std::vector<ScheduleOp> ops;
  s.ops(rank, step, ops);
  std::vector<std::tuple<int, int, int, int, int>> out;
  for (const auto& op : ops)
    out.emplace_back(static_cast<int>(op.kind), op.phase, op.peer, op.chunk, op.sent_step);
  return out;
}

}  // namespace
}  // namespace pycomm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace pycomm;
  m.doc() = "pycomm compiled core";
  // A torch.distributed.DistBackendError (so a RuntimeError), as NCCL's and
  // Gloo's failures are: code that catches torch's error types catches
  // pycomm's too.
  py::object base = py::reinterpret_borrow<py::object>(PyExc_RuntimeError);
  try {
    base = py::module_::import("torch.distributed").attr("DistBackendError");
  } catch (const py::error_already_set&) {
    PyErr_Clear();  // torch without distributed support: a plain RuntimeError
  }
  comm_error_type() = py::reinterpret_borrow<py::object>(
      PyErr_NewExceptionWithDoc("pycomm._C.CommError",
                                "A collective failed: bad input, ranks that disagree, a dead peer, a timeout. "
                                "blamed_rank and failure name the rank that caused it, where known.",
                                base.ptr(), nullptr));
  m.attr("CommError") = comm_error_type();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CommError& e) {
      raise_comm_error(e);
    }
  });
  m.attr("algorithms") = algorithm_table();
  m.attr("collectives") = collective_table();
  // Every algorithm by id, concrete ones included ("direct(one-shot)", ...),
  // and the kinds of a schedule's ops: what schedule_ops() returns.
  m.attr("algorithm_names") = algorithm_names();
  m.attr("op_kinds") = op_kind_table();
  m.attr("all_peers") = kAllPeers;
  m.attr("reduce_ops") = redop_table();
  m.attr("codecs") = codec_table();
  m.attr("wire_version") = kWireVersion;
  m.attr("codec_defaults") = codec_defaults();
  // What is wrong with a codec's parameters ("" if nothing): the codecs check
  // themselves when built, with the words every call would use.
  m.def("codec_problem",
        [](int kind, int block, bool stochastic, uint64_t seed, double ratio, bool exact, double tolerance,
           double sample_fraction) {
          return make_codec(kind, block, stochastic, seed, ratio, exact, tolerance, sample_fraction).check();
        },
        py::arg("kind"), py::arg("block"), py::arg("stochastic"), py::arg("seed"), py::arg("ratio"),
        py::arg("exact"), py::arg("tolerance"), py::arg("sample_fraction"));
  py::tuple codec_dtypes(std::size(kCodecDtypes));
  for (size_t i = 0; i < std::size(kCodecDtypes); ++i) codec_dtypes[i] = c10::getDtypeNames(kCodecDtypes[i]).first;
  m.attr("codec_dtypes") = codec_dtypes;
  // The devices whose tensors the Communicator (and so the c10d backend)
  // takes, whatever the build: the backend registers these and no others.
  m.attr("collective_devices") = py::make_tuple("cpu");

  py::class_<Work, std::shared_ptr<Work>>(m, "Work")
      .def("wait", [](Work& w, std::optional<double> timeout) { return w.wait(timeout.value_or(-1)); },
           py::arg("timeout") = py::none(), py::call_guard<py::gil_scoped_release>(),
           "Block until the collective finished; raises pycomm.CommError if it failed.")
      .def("is_completed", &Work::is_completed)
      .def("is_success", &Work::is_success)
      .def("exception", [](Work& w) -> std::optional<std::string> {
        auto msg = w.error_message();
        if (msg.empty()) return std::nullopt;
        return msg;
      })
      .def("result", [](Work& w) { return w.result(); })
      .def("get_future",
           [](Work& w) { return std::make_shared<torch::jit::PythonFutureWrapper>(w.get_future()); },
           "A torch.futures.Future holding [output tensors], completed by the progress engine.")
      .def_property_readonly("seq", &Work::seq)
      .def_property_readonly("bytes_sent", [](Work& w) { return w.stats().bytes_sent; },
                             "Bytes this rank handed to its peers (compressed all-reduce; 0 otherwise).")
      .def_property_readonly("bytes_uncompressed", [](Work& w) { return w.stats().bytes_uncompressed; },
                             "Bytes the uncompressed all-reduce would have sent from this rank.")
      .def_property_readonly("algorithm", [](Work& w) { return std::string(algorithm_name(w.algorithm())); })
      .def_property_readonly("run_seconds", &Work::run_seconds,
                             "Seconds the op ran, from its turn to its completion (0 until it completed).");

  // Shared: a torch.distributed backend built on a communicator keeps it.
  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator")
      .def(py::init([](int rank, int world, double timeout, bool use_shm, int local_rank, int local_size,
                       const std::string& name, const std::string& token, bool create, size_t round_bytes, int host,
                       std::vector<std::vector<int>> host_ranks,
                       std::optional<c10::intrusive_ptr<c10d::Backend>> backend, size_t pg_round_bytes,
                       int pg_window, std::optional<c10::intrusive_ptr<c10d::Store>> store, size_t p2p_bytes) {
             CommunicatorOptions o;
             TopologyConfig& t = o.topology;
             t.rank = rank;
             t.world = world;
             t.timeout_s = timeout;
             t.use_shm = use_shm;
             t.local_rank = local_rank;
             t.local_size = local_size;
             t.shm_name = name;
             t.token = token;
             t.create = create;
             t.round_bytes = round_bytes;
             t.host = host;
             t.host_ranks = std::move(host_ranks);
             t.pg_round_bytes = pg_round_bytes;
             t.pg_window = pg_window;
             t.p2p_bytes = p2p_bytes;
             if (backend) o.backend = *backend;
             if (store) o.store = *store;
             return std::shared_ptr<Communicator>(new Communicator(o), GilFreeDelete());
           }),
           py::arg("rank"), py::arg("world"), py::arg("timeout"), py::arg("use_shm") = true,
           py::arg("local_rank") = 0, py::arg("local_size") = 1, py::arg("shm_name") = "", py::arg("token") = "",
           py::arg("create") = false, py::arg("round_bytes") = 1 << 20, py::arg("host") = 0,
           py::arg("host_ranks") = std::vector<std::vector<int>>{}, py::arg("backend") = py::none(),
           py::arg("pg_round_bytes") = 4 << 20, py::arg("pg_window") = 4, py::arg("store") = py::none(),
           py::arg("p2p_bytes") = 4 << 20, py::call_guard<py::gil_scoped_release>())
      .def("all_reduce",
           [](Communicator& c, const at::Tensor& in, const at::Tensor& out, int op, int algo, bool strict,
              bool async_op) { return c.all_reduce(in, out, to_op(op), to_algo(algo), strict, async_op); },
           py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter",
           [](Communicator& c, const at::Tensor& out, const at::Tensor& in, int op, int algo, bool strict,
              bool async_op) { return c.reduce_scatter(out, in, to_op(op), to_algo(algo), strict, async_op); },
           py::call_guard<py::gil_scoped_release>())
      .def("all_gather",
           [](Communicator& c, const at::Tensor& out, const at::Tensor& in, int algo, bool strict, bool async_op) {
             return c.all_gather(out, in, to_algo(algo), strict, async_op);
           },
           py::call_guard<py::gil_scoped_release>())
      .def("broadcast",
           [](Communicator& c, const at::Tensor& t, int src, int algo, bool strict, bool async_op) {
             return c.broadcast(t, src, to_algo(algo), strict, async_op);
           },
           py::call_guard<py::gil_scoped_release>())
      .def("all_to_all",
           [](Communicator& c, const at::Tensor& out, const at::Tensor& in, bool async_op) {
             return c.all_to_all(out, in, async_op);
           },
           py::call_guard<py::gil_scoped_release>())
      .def("all_reduce_compressed",
           [](Communicator& c, const at::Tensor& in, const at::Tensor& out, int op, int kind, int block,
              bool stochastic, uint64_t seed, double ratio, bool exact, double tolerance, double sample_fraction,
              std::optional<at::Tensor> worker_residual, std::optional<at::Tensor> server_residual, bool async_op) {
             const Codec codec = make_codec(kind, block, stochastic, seed, ratio, exact, tolerance, sample_fraction);
             return c.all_reduce_compressed(in, out, to_op(op), codec, worker_residual.value_or(at::Tensor()),
                                            server_residual.value_or(at::Tensor()), async_op);
           },
           py::arg("input"), py::arg("output"), py::arg("op"), py::arg("kind"), py::arg("block"),
           py::arg("stochastic"), py::arg("seed"), py::arg("ratio"), py::arg("exact"), py::arg("tolerance"),
           py::arg("sample_fraction"), py::arg("worker_residual"), py::arg("server_residual"), py::arg("async_op"),
           py::call_guard<py::gil_scoped_release>())
      .def("compressed_shard_elems", &Communicator::compressed_shard_elems, py::arg("numel"), py::arg("block"))
      .def("send", &Communicator::send, py::arg("tensors"), py::arg("dst"), py::arg("tag"), py::arg("async_op"),
           py::call_guard<py::gil_scoped_release>())
      .def("recv", &Communicator::recv, py::arg("out"), py::arg("src"), py::arg("tag"), py::arg("async_op"),
           py::call_guard<py::gil_scoped_release>())
      .def("barrier", &Communicator::barrier, py::arg("async_op"), py::arg("timeout_s") = 0.0,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "empty",
          [](Communicator& c, const std::vector<int64_t>& sizes, const at::Tensor& like) {
            return c.empty(sizes, like.scalar_type());
          },
          py::arg("sizes"), py::arg("like"), py::call_guard<py::gil_scoped_release>())
      .def("registered_by", &Communicator::registered_by, py::arg("tensor"))
      .def(
          "caller_scratch", [](Communicator& c, size_t bytes) { return c.scratch(Communicator::kScratchCaller, bytes); },
          py::arg("bytes"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("in_place_calls", &Communicator::in_place_calls)
      .def("gone_ranks", &Communicator::gone_ranks, py::call_guard<py::gil_scoped_release>())
      .def("failure", &Communicator::failure, py::call_guard<py::gil_scoped_release>())
      .def("resolve",
           [](Communicator& c, int coll, int algo, size_t bytes) {
             return c.resolve(to_coll(coll), to_algo(algo), bytes);
           })
      .def("wait_ready", &Communicator::wait_ready, py::call_guard<py::gil_scoped_release>())
      .def("wait_ready_for", &Communicator::wait_ready_for, py::arg("seconds"),
           py::call_guard<py::gil_scoped_release>())
      .def("abandon_ready", &Communicator::abandon_ready)
      .def("reject", &Communicator::reject, py::arg("why"), py::call_guard<py::gil_scoped_release>())
      .def("shutdown", &Communicator::shutdown, py::call_guard<py::gil_scoped_release>())
      .def(
          "abort", [](Communicator& c, const std::string& why) { c.abort(why); }, py::arg("why"),
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("world", &Communicator::world)
      .def_property_readonly("round_bytes", &Communicator::round_bytes)
      .def_property_readonly("transport", &Communicator::transport_name)
      .def_property("timeout", &Communicator::timeout, &Communicator::set_timeout)
      .def_property("heartbeat_timeout", &Communicator::heartbeat_timeout, &Communicator::set_heartbeat_timeout);

  m.def(
      "make_backend",
      [](std::shared_ptr<Communicator> comm, std::optional<c10::intrusive_ptr<c10d::Backend>> peer,
         const std::vector<int>& algorithms) {
        std::vector<Algorithm> algos;
        for (int a : algorithms) algos.push_back(to_algo(a));
        return c10::intrusive_ptr<c10d::Backend>(c10::make_intrusive<C10dBackend>(
            std::move(comm), peer.value_or(c10::intrusive_ptr<c10d::Backend>()), algos));
      },
      py::arg("communicator"), py::arg("peer") = py::none(), py::arg("algorithms") = std::vector<int>{},
      "A torch.distributed backend (c10d Backend) running on `communicator`; `peer` carries point-to-point calls.");
  // The compressed all-reduce's sizes (shard, payload, top-k entries and
  // capacity) and rounding keys, for the same algorithm composed over a
  // torch.distributed group (pycomm/group.py): one definition, so both
  // compute the same bits.
  m.def("compressed_shard_elems", &QuantizedAllReduce::shard_elems, py::arg("numel"), py::arg("world"),
        py::arg("block"));
  m.def("topk_entries", &SparseAllReduce::entries, py::arg("numel"), py::arg("ratio"));
  m.def("quant_payload_bytes", &kernels::quant_payload_bytes, py::arg("numel"), py::arg("bits"), py::arg("block"));
  m.def("topk_payload_bytes", &kernels::topk_payload_bytes, py::arg("capacity"), py::arg("elem_size"));
  m.def("topk_capacity", &kernels::topk_capacity, py::arg("k"), py::arg("numel"), py::arg("exact"),
        py::arg("tolerance"));
  m.def("rounding_seed", &rounding_seed, py::arg("user_seed"), py::arg("seq"), py::arg("rank"), py::arg("which"));
  m.def("schedule_ops", &schedule_ops, py::arg("algorithm"), py::arg("collective"), py::arg("rank"),
        py::arg("world"), py::arg("root"), py::arg("step"));
  m.def(
      "simulate_program",
      [](int algo, int coll, int root, int op, const std::vector<at::Tensor>& inputs,
         const std::vector<at::Tensor>& outputs, size_t round_bytes, uint64_t seed) {
        TORCH_CHECK(!inputs.empty() && inputs.size() == outputs.size(),
                    "pycomm: simulate_program takes one input and one output per rank");
        std::vector<const void*> in;
        std::vector<void*> out;
        for (size_t r = 0; r < inputs.size(); ++r) {
          for (const at::Tensor* t : {&inputs[r], &outputs[r]}) {
            const std::string why = check_tensor(*t, "tensor", to_coll(coll));
            TORCH_CHECK(why.empty(), why);
            TORCH_CHECK(t->scalar_type() == inputs[0].scalar_type(), "pycomm: every tensor must have one dtype");
          }
          in.push_back(inputs[r].data_ptr());
          out.push_back(outputs[r].data_ptr());
        }
        // The count is per rank's shard for the sharded collectives, as in
        // a CollectiveDesc.
        const Collective c = to_coll(coll);
        const int64_t world = static_cast<int64_t>(inputs.size());
        const int64_t count = c == Collective::kReduceScatter ? outputs[0].numel() : inputs[0].numel();
        const int64_t in_n = c == Collective::kReduceScatter ? count * world : count;
        const int64_t out_n = c == Collective::kAllGather ? count * world : count;
        for (size_t r = 0; r < inputs.size(); ++r)
          TORCH_CHECK(inputs[r].numel() == in_n && outputs[r].numel() == out_n,
                      "pycomm: simulate_program: inputs of ", in_n, " and outputs of ", out_n, " elements expected");
        DType dt = DType::kFloat32;
        to_dtype(inputs[0].scalar_type(), &dt);
        py::gil_scoped_release nogil;
        simulate_program(to_algo(algo), c, root, dt, to_op(op), static_cast<size_t>(count), in, out, round_bytes,
                         seed);
      },
      py::arg("algorithm"), py::arg("collective"), py::arg("root"), py::arg("op"), py::arg("inputs"),
      py::arg("outputs"), py::arg("round_bytes"), py::arg("seed") = 0,
      "Every rank's program of the CUDA executor of schedules run on the CPU, in this process (tests).");
  m.def(
      "program_traffic",
      [](int algo, int coll, int world, int root, int element_size, size_t count, size_t round_bytes) {
        // Only the element size matters (chunks are cut in elements).
        const DType dt = element_size == 1   ? DType::kUInt8
                         : element_size == 2 ? DType::kFloat16
                         : element_size == 8 ? DType::kFloat64
                                             : DType::kFloat32;
        TORCH_CHECK(element_size == 1 || element_size == 2 || element_size == 4 || element_size == 8,
                    "pycomm: program_traffic takes an element size of 1, 2, 4 or 8 bytes");
        return program_traffic(to_algo(algo), to_coll(coll), world, root, dt, count, round_bytes);
      },
      py::arg("algorithm"), py::arg("collective"), py::arg("world"), py::arg("root"), py::arg("element_size"),
      py::arg("count"), py::arg("round_bytes"),
      "Bytes every rank's program of a call reads and writes, summed over the ranks.");
  m.def("schedule_shape", [](int algo, int coll, int world, int root) {
    Schedule s{to_algo(algo), to_coll(coll), world, root};
    return std::make_pair(s.num_chunks(), s.num_steps());
  });
  m.def("algorithm_supports", [](int algo, int coll) { return algorithm_supports(to_algo(algo), to_coll(coll)); });
  m.def("algorithm_applies", [](int algo, int coll) { return algorithm_applies(to_algo(algo), to_coll(coll)); });
  m.def("tune", [](int algo, int coll, size_t bytes, int world) {
    return static_cast<int>(tune(to_algo(algo), to_coll(coll), bytes, world));
  });
  m.def("tune_multihost", [](int algo, int coll, size_t bytes, int hosts, int local_size) {
    const Resolved r = tune_multihost(to_algo(algo), to_coll(coll), bytes, hosts, local_size);
    return std::make_pair(std::string(algorithm_name(r.algo)), std::string(algorithm_name(r.inter)));
  });
#ifdef PYCOMM_WITH_CUDA
  py::class_<CudaIpcAllReduce, std::shared_ptr<CudaIpcAllReduce>>(m, "CudaIpcAllReduce")
      .def(py::init([](int rank, int world, size_t buffer_bytes, size_t round_bytes, double timeout,
                       bool double_buffer) {
             return std::shared_ptr<CudaIpcAllReduce>(
                 new CudaIpcAllReduce(rank, world, buffer_bytes, round_bytes, timeout, double_buffer),
                 DeleteInOwnProcess<CudaIpcAllReduce>());
           }),
           py::arg("rank"), py::arg("world"),
           py::arg("buffer_bytes"), py::arg("round_bytes") = 0, py::arg("timeout") = 300.0,
           py::arg("double_buffer") = false,
           "Allocates the staging buffer and signal block on the current CUDA device.")
      .def_property_readonly("double_buffer", [](const CudaIpcAllReduce& c) { return c.double_buffer(); })
      .def("handles", [](const CudaIpcAllReduce& c, int fused_blocks) { return py::bytes(c.handles(fused_blocks)); },
           py::arg("fused_blocks") = 0)
      .def("open", &CudaIpcAllReduce::open, py::arg("handles"), py::call_guard<py::gil_scoped_release>())
      .def(
          "all_reduce",
          [](CudaIpcAllReduce& c, const at::Tensor& in, const at::Tensor& out, int op, int algo) {
            ipc_all_reduce(c, in, out, to_op(op), algo);
          },
          py::arg("input"), py::arg("output"), py::arg("op"), py::arg("algorithm"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "all_reduce_sync",
          [](CudaIpcAllReduce& c, const at::Tensor& in, const at::Tensor& out, int op, int algo, int64_t side_id,
             int64_t side_device, int64_t side_type) {
            ipc_all_reduce_sync(c, in, out, to_op(op), algo, side_id, side_device, side_type);
          },
          py::arg("input"), py::arg("output"), py::arg("op"), py::arg("algorithm"), py::arg("side_id"),
          py::arg("side_device"), py::arg("side_type"), py::call_guard<py::gil_scoped_release>())
      .def(
          "quantized_all_reduce",
          [](CudaIpcAllReduce& c, const at::Tensor& in, const at::Tensor& out, bool avg, int bits, int block,
             bool stochastic, uint64_t seed_quantize, uint64_t seed_requantize, std::optional<at::Tensor> worker,
             std::optional<at::Tensor> server, bool fused) {
            ipc_quantized_all_reduce(c, in, out, avg, bits, block, stochastic, seed_quantize, seed_requantize,
                                     worker.value_or(at::Tensor()), server.value_or(at::Tensor()), fused);
          },
          py::arg("input"), py::arg("output"), py::arg("avg"), py::arg("bits"), py::arg("block"),
          py::arg("stochastic"), py::arg("seed_quantize"), py::arg("seed_requantize"), py::arg("worker_residual"),
          py::arg("server_residual"), py::arg("fused") = true, py::call_guard<py::gil_scoped_release>())
      .def(
          "quantized_all_reduce_sync",
          [](CudaIpcAllReduce& c, const at::Tensor& in, const at::Tensor& out, bool avg, int bits, int block,
             bool stochastic, uint64_t seed_quantize, uint64_t seed_requantize, std::optional<at::Tensor> worker,
             std::optional<at::Tensor> server, bool fused, int64_t side_id, int64_t side_device, int64_t side_type) {
            ipc_quantized_all_reduce_sync(c, in, out, avg, bits, block, stochastic, seed_quantize, seed_requantize,
                                          worker.value_or(at::Tensor()), server.value_or(at::Tensor()), fused,
                                          side_id, side_device, side_type);
          },
          py::arg("input"), py::arg("output"), py::arg("avg"), py::arg("bits"), py::arg("block"),
          py::arg("stochastic"), py::arg("seed_quantize"), py::arg("seed_requantize"), py::arg("worker_residual"),
          py::arg("server_residual"), py::arg("fused"), py::arg("side_id"), py::arg("side_device"),
          py::arg("side_type"), py::call_guard<py::gil_scoped_release>())
      .def("quantized_bytes",
           [](const CudaIpcAllReduce& c, size_t n, int bits, int block) {
             return ipc_quantized_bytes(n, c.world(), bits, block);
           },
           py::arg("numel"), py::arg("bits"), py::arg("block"),
           "Staging bytes per rank a quantized call of numel elements needs.")
      .def("failure", &CudaIpcAllReduce::failure,
           "'' unless a wait of a launch gave up (read once the stream is done); else why.")
      .def("abort", &CudaIpcAllReduce::abort, py::arg("why"), "Makes every wait give up and every later call raise.")
      .def_property_readonly("buffer_bytes", &CudaIpcAllReduce::buffer_bytes)
      .def_property_readonly("round_bytes", &CudaIpcAllReduce::round_bytes)
      .def_property_readonly("blocks", &CudaIpcAllReduce::blocks)
      .def_property_readonly("fused_blocks",
                             [](const CudaIpcAllReduce& c) { return fused_grid_cap(c.kernel_view()); });
  py::dict ipc;
  ipc["auto"] = static_cast<int>(IpcAlgo::kAuto);
  ipc["one_shot"] = static_cast<int>(IpcAlgo::kOneShot);
  ipc["two_shot"] = static_cast<int>(IpcAlgo::kTwoShot);
  ipc["ring"] = static_cast<int>(IpcAlgo::kRing);
  ipc["tree"] = static_cast<int>(IpcAlgo::kTree);
  ipc["direct"] = static_cast<int>(IpcAlgo::kDirect);
  m.attr("ipc_algorithms") = ipc;
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
}
