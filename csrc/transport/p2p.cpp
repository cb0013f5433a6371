#include "p2p.h"

#include <errno.h>
#include <sched.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <thread>

#include "futex.h"
#include "shm_file.h"

namespace pycomm {

namespace {

constexpr uint64_t kChannelMagic = 0x3250324d4f435950ull;  // "PYCOM2P2"
constexpr size_t kPage = 4096;
// A writer publishes at most this much at a time, so that the reader copies
// out one piece while the writer copies in the next (both stay in L2).
constexpr size_t kGrainBytes = 256 * 1024;
// Receives are posted long before their data comes (a pipeline posts a
// step's worth at once), so a waiting lane spins only briefly: a longer spin
// would take the core from the computation that produces the data.
constexpr auto kMaxSpin = std::chrono::microseconds(50);
// Unbound, the scheduler at times puts both ends of a channel on one CPU (it
// pulls a woken task to its waker's CPU) and leaves them there for ms to
// seconds. Every message then costs a switch between the two processes,
// ~30 us on the development VM, and a spin only delays the peer it waits
// for: 4 KiB one way took 50-155 us (2 ranks unbound: both ranks on one CPU
// in 1-10 % of 20-round-trip samples, and in most of them in some launches).
// So each side records the CPU it last wrote or read on, and a waiter that
// finds the peer's on its own CPU moves itself to another CPU its affinity
// allows (its affinity is left as it was), at most every kMoveEvery; where
// it cannot, it skips the spin and yields (each yield runs the peer).
constexpr int kSharedCpuYields = 16;
constexpr auto kMoveEvery = std::chrono::milliseconds(1);

// 1 + the CPU this thread runs on now (0 is left for "not yet known").
uint32_t this_cpu() { return static_cast<uint32_t>(sched_getcpu()) + 1; }

// Moves this thread off CPU `cpu` - 1 when its affinity allows another one:
// the kernel migrates a thread at once when its mask drops its CPU, and
// restoring the mask leaves it where it landed. False if it stayed.
bool move_off_cpu(uint32_t cpu) {
  thread_local std::chrono::steady_clock::time_point last{};
  const auto now = std::chrono::steady_clock::now();
  if (now - last < kMoveEvery) return false;
  last = now;
  cpu_set_t mask;
  if (sched_getaffinity(0, sizeof(mask), &mask) != 0 || CPU_COUNT(&mask) < 2) return false;
  cpu_set_t elsewhere = mask;
  CPU_CLR(static_cast<int>(cpu - 1), &elsewhere);
  if (CPU_COUNT(&elsewhere) == 0 || sched_setaffinity(0, sizeof(elsewhere), &elsewhere) != 0) return false;
  sched_setaffinity(0, sizeof(mask), &mask);
  return this_cpu() != cpu;
}

constexpr uint32_t kMessageMagic = 0x50325031u;  // "1P2P": a tensor of a message follows
constexpr uint32_t kFailureMagic = 0x52524550u;  // "PERR": the sender failed; its reason follows
// A failure header's `tag`: whether the sender's stream ends with it.
constexpr uint32_t kFailureOnce = 0;  // a send it refused; later messages may follow
constexpr uint32_t kFailureLast = 1;  // it aborted

// One tensor's description on the wire. No padding holes.
struct MessageHeader {
  uint32_t magic;
  uint32_t tag;
  uint32_t index;  // this tensor's position in its message
  uint32_t total;  // tensors in the message
  uint64_t nbytes;
  uint8_t dtype;
  uint8_t ndim;
  uint8_t pad[6];
  int64_t shape[kP2PMaxDims];
  uint8_t pad2[32];
};
static_assert(sizeof(MessageHeader) == 128, "two cache lines");

}  // namespace

// The sender owns `written`, the receiver `consumed` (both count bytes
// modulo 2^32; the capacity is a power of two, so they also give positions).
struct ChannelSegment {
  uint64_t magic;
  uint64_t capacity;
  char token[64];
  std::atomic<uint32_t> attached;
  // Each side's CPU (1 + its number, see this_cpu) sits in the line it
  // publishes anyway, so that the peer reads it at no extra transfer.
  alignas(64) std::atomic<uint32_t> written;
  std::atomic<uint32_t> writer_cpu;
  alignas(64) std::atomic<uint32_t> consumed;
  std::atomic<uint32_t> reader_cpu;
  alignas(64) std::atomic<uint32_t> writer_waiting;
  alignas(64) std::atomic<uint32_t> reader_waiting;
};

namespace {

// Only the side that maps a channel second removes its name, after both
// mapped it: a name gone while this side still waits for the creator means
// the creator removed it, having failed to set it up.
bool creator_gave_up(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd >= 0) ::close(fd);
  return fd < 0 && errno == ENOENT;
}

CommError gave_up_error(const std::string& name) {
  return CommError("pycomm: the peer removed point-to-point segment " + name +
                   " before this rank attached: it could not set it up (it raised why; most often /dev/shm has "
                   "no room left) or it closed");
}

}  // namespace

ShmChannels::ShmChannels(ShmTransport& shm, std::string prefix, std::string token, size_t capacity)
    : shm_(shm), prefix_(std::move(prefix)), token_(std::move(token)), capacity_(capacity) {
  if (capacity_ < kPage || (capacity_ & (capacity_ - 1)) != 0 || capacity_ > (size_t{1} << 30))
    throw CommError("pycomm: point-to-point ring size must be a power of two between 4 KiB and 1 GiB");
  if (token_.size() >= sizeof(ChannelSegment::token)) throw CommError("pycomm: segment token too long");
}

ShmChannels::~ShmChannels() {
  close();
  for (auto& [key, ch] : channels_) munmap(ch.seg, ch.size);
}

void ShmChannels::close() {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& [key, ch] : channels_)
    if (ch.seg->attached.load() < 2) shm_unlink(ch.name.c_str());
  // A peer killed between creating a channel with this rank (its send, or
  // its receive posted first) and this rank mapping it leaves a name nobody
  // else would remove. Every channel name between this rank and a peer that
  // this rank did not map goes too: the names carry this communicator's
  // token, and the only other process that could have mapped one is that
  // peer, which created it and keeps its mapping.
  const int me = shm_.rank();
  for (int peer = 0; peer < shm_.world(); ++peer) {
    if (peer == me) continue;
    for (const auto& [src, dst] : {std::make_pair(peer, me), std::make_pair(me, peer)})
      if (channels_.find({src, dst}) == channels_.end()) shm_unlink(channel_name(src, dst).c_str());
  }
}

std::string ShmChannels::channel_name(int src, int dst) const {
  return prefix_ + "." + std::to_string(shm_.name(src)) + "." + std::to_string(shm_.name(dst));
}

ShmChannels::Channel& ShmChannels::channel(int src, int dst, const OpContext& ctx) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = channels_.find({src, dst});
  if (it != channels_.end()) return it->second;

  Channel ch;
  ch.name = channel_name(src, dst);
  ch.size = kPage + capacity_;
  // 1. Create it, or attach if the peer came first. O_EXCL and 0600 as for
  //    the collective segment: never adopt somebody else's.
  bool created = true;
  int fd = shm_open(ch.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 && errno == EEXIST) {
    created = false;
    fd = shm_open(ch.name.c_str(), O_RDWR, 0);
  }
  if (fd < 0)
    throw CommError("pycomm: cannot open point-to-point segment " + ch.name + ": " + std::strerror(errno));
  if (created) {
    const std::string why = size_shm_file(fd, ch.size, "point-to-point segment " + ch.name);
    if (!why.empty()) {
      ::close(fd);
      shm_unlink(ch.name.c_str());
      throw CommError("pycomm: " + why);
    }
  } else {
    // The creator sizes it right after creating it.
    struct stat st;
    while (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) < ch.size) {
      if (std::chrono::steady_clock::now() >= ctx.deadline) break;
      if (creator_gave_up(ch.name)) {
        ::close(fd);
        throw gave_up_error(ch.name);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (static_cast<size_t>(st.st_size) != ch.size) {
      ::close(fd);
      throw CommError("pycomm: point-to-point segment " + ch.name +
                      " has the wrong size: ranks disagree on PYCOMM_P2P_BYTES");
    }
  }
  // Populated now, as the collective segment: otherwise every message until
  // the ring first wraps (~1000 of 4 KiB in the default 4 MiB) takes a page
  // fault on each side, 4 KiB one way 9 us instead of 3.
  void* base = mmap(nullptr, ch.size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  const int map_err = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    if (created) shm_unlink(ch.name.c_str());
    throw CommError("pycomm: cannot map point-to-point segment " + ch.name + ": " + std::strerror(map_err));
  }
  ch.seg = static_cast<ChannelSegment*>(base);
  ch.data = static_cast<char*>(base) + kPage;

  // 2. The creator's fields, magic last; the attacher checks them.
  if (created) {
    ch.seg->capacity = capacity_;
    std::memcpy(ch.seg->token, token_.data(), token_.size());
    __atomic_store_n(&ch.seg->magic, kChannelMagic, __ATOMIC_RELEASE);
  } else {
    while (__atomic_load_n(&ch.seg->magic, __ATOMIC_ACQUIRE) != kChannelMagic &&
           std::chrono::steady_clock::now() < ctx.deadline) {
      if (creator_gave_up(ch.name) && __atomic_load_n(&ch.seg->magic, __ATOMIC_ACQUIRE) != kChannelMagic) {
        munmap(base, ch.size);
        throw gave_up_error(ch.name);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (__atomic_load_n(&ch.seg->magic, __ATOMIC_ACQUIRE) != kChannelMagic || ch.seg->capacity != capacity_ ||
        std::strncmp(ch.seg->token, token_.c_str(), sizeof(ch.seg->token)) != 0) {
      munmap(base, ch.size);
      throw CommError("pycomm: point-to-point segment " + ch.name +
                      " does not belong to this job or ranks disagree on PYCOMM_P2P_BYTES");
    }
  }
  // 3. The second side to map it removes the name, as for the collective
  //    segment: a killed job leaves nothing in /dev/shm.
  if (ch.seg->attached.fetch_add(1) + 1 == 2) shm_unlink(ch.name.c_str());
  return channels_.emplace(std::make_pair(src, dst), std::move(ch)).first->second;
}

template <typename Ready>
void ShmChannels::wait(std::atomic<uint32_t>* word, std::atomic<uint32_t>* waiters,
                       const std::atomic<uint32_t>& peer_cpu, int peer, const OpContext& ctx, const char* what,
                       Ready ready) {
  // Lanes run concurrently, so each wait keeps its own liveness timer.
  auto next_liveness = std::chrono::steady_clock::now();
  const uint32_t cpu = this_cpu();
  const bool shared_cpu = peer_cpu.load(std::memory_order_relaxed) == cpu && !move_off_cpu(cpu);
  const auto spin = shared_cpu ? std::chrono::steady_clock::duration::zero()
                               : std::min<std::chrono::steady_clock::duration>(shm_.spin_, kMaxSpin);
  shm_.wait_until(word, waiters, peer, ctx, spin, &next_liveness, ready, [&] {
                    std::ostringstream os;
                    os << "pycomm: " << collective_name(ctx.coll) << " #" << ctx.seq << " on rank "
                       << shm_.name(shm_.rank_) << ": " << timed_out_waiting(ctx.timeout_s) << " for rank "
                       << shm_.name(peer) << " (" << what << ")";
                    return os.str();
                  },
                  shared_cpu ? kSharedCpuYields : -1);
}

void ShmChannels::write(int peer, const void* data, size_t n, const OpContext& ctx) {
  Channel& ch = channel(shm_.rank_, peer, ctx);
  ChannelSegment& s = *ch.seg;
  const auto* src = static_cast<const char*>(data);
  const uint32_t cap = static_cast<uint32_t>(capacity_);
  uint32_t w = s.written.load(std::memory_order_relaxed);
  s.writer_cpu.store(this_cpu(), std::memory_order_relaxed);
  while (n > 0) {
    const uint32_t want = static_cast<uint32_t>(std::min({n, kGrainBytes, capacity_}));
    auto free_bytes = [&] { return cap - (w - s.consumed.load(std::memory_order_acquire)); };
    if (free_bytes() < want)
      wait(&s.consumed, &s.writer_waiting, s.reader_cpu, peer, ctx, "it to read earlier data",
           [&] { return free_bytes() >= want; });
    const uint32_t k = std::min<uint32_t>(want, free_bytes());
    const uint32_t pos = w & (cap - 1);
    const uint32_t first = std::min(k, cap - pos);
    std::memcpy(ch.data + pos, src, first);
    std::memcpy(ch.data, src + first, k - first);
    w += k;
    src += k;
    n -= k;
    s.written.store(w, std::memory_order_seq_cst);
    if (s.reader_waiting.load(std::memory_order_seq_cst) > 0) futex_wake_all(&s.written);
  }
}

void ShmChannels::read(int peer, void* data, size_t n, const OpContext& ctx) {
  Channel& ch = channel(peer, shm_.rank_, ctx);
  ChannelSegment& s = *ch.seg;
  auto* dst = static_cast<char*>(data);
  const uint32_t cap = static_cast<uint32_t>(capacity_);
  uint32_t c = s.consumed.load(std::memory_order_relaxed);
  s.reader_cpu.store(this_cpu(), std::memory_order_relaxed);
  while (n > 0) {
    auto avail = [&] { return s.written.load(std::memory_order_acquire) - c; };
    if (avail() == 0)
      wait(&s.written, &s.reader_waiting, s.writer_cpu, peer, ctx, "its data", [&] { return avail() > 0; });
    const uint32_t k = static_cast<uint32_t>(std::min<size_t>(n, avail()));
    const uint32_t pos = c & (cap - 1);
    const uint32_t first = std::min(k, cap - pos);
    std::memcpy(dst, ch.data + pos, first);
    std::memcpy(dst + first, ch.data, k - first);
    c += k;
    dst += k;
    n -= k;
    s.consumed.store(c, std::memory_order_seq_cst);
    if (s.writer_waiting.load(std::memory_order_seq_cst) > 0) futex_wake_all(&s.consumed);
  }
}

void ShmChannels::write_tensor(int peer, const void* header, size_t header_bytes, const void* data, size_t n,
                               const OpContext& ctx) {
  // Up to 4 KiB of payload: one copy into a stack buffer costs less than a
  // second publication (a store the reader must see, and its wake-up check).
  constexpr size_t kSmall = 4096;
  if (n > kSmall || header_bytes > 256) {
    MessageChannels::write_tensor(peer, header, header_bytes, data, n, ctx);
    return;
  }
  alignas(64) char buf[256 + kSmall];
  std::memcpy(buf, header, header_bytes);
  if (n) std::memcpy(buf + header_bytes, data, n);
  write(peer, buf, header_bytes + n, ctx);
}

bool ShmChannels::await_readable(int peer, std::chrono::microseconds max_wait, const OpContext& ctx) {
  ChannelSegment& s = *channel(peer, shm_.rank_, ctx).seg;
  auto readable = [&] {
    return s.written.load(std::memory_order_acquire) != s.consumed.load(std::memory_order_acquire);
  };
  if (readable()) return true;
  // Dekker pair with the writer, as in wait(): it sees our count and wakes
  // us, or we see its bytes before sleeping.
  s.reader_waiting.fetch_add(1, std::memory_order_seq_cst);
  const uint32_t v = s.written.load(std::memory_order_seq_cst);
  if (v == s.consumed.load(std::memory_order_acquire)) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(max_wait).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    futex_op(&s.written, FUTEX_WAIT, v, &ts);
  }
  s.reader_waiting.fetch_sub(1, std::memory_order_seq_cst);
  return readable();
}

void ShmChannels::out_of_step(const std::string& why) { shm_.fail(why); }
int ShmChannels::name(int peer) const { return shm_.name(peer); }
int ShmChannels::self_name() const { return shm_.name(shm_.rank_); }

void MessageChannels::send_message(int peer, uint32_t tag, const TensorMeta* metas, const void* const* data,
                               uint32_t count, const OpContext& ctx) {
  if (auto why = ended_reason(peer))
    throw CommError("pycomm.send #" + std::to_string(ctx.seq) + " on rank " + std::to_string(self_name()) +
                    " to rank " + std::to_string(name(peer)) + ": rank " + std::to_string(name(peer)) +
                    " failed and receives nothing more: " + *why);
  for (uint32_t i = 0; i < count; ++i) {
    const TensorMeta& m = metas[i];
    MessageHeader h{};
    h.magic = kMessageMagic;
    h.tag = tag;
    h.index = i;
    h.total = count;
    h.nbytes = m.nbytes;
    h.dtype = m.dtype;
    h.ndim = static_cast<uint8_t>(m.ndim);
    for (int d = 0; d < m.ndim; ++d) h.shape[d] = m.shape[d];
    write_tensor(peer, &h, sizeof h, data[i], h.nbytes, ctx);
  }
}

void MessageChannels::send_failure(int peer, const std::string& why, const OpContext& ctx, bool last) {
  MessageHeader h{};
  h.magic = kFailureMagic;
  h.tag = last ? kFailureLast : kFailureOnce;
  h.nbytes = why.size();
  write(peer, &h, sizeof h, ctx);
  write(peer, why.data(), why.size(), ctx);
}

void MessageChannels::recv_message(int peer, uint32_t tag, MessageSink& sink, const OpContext& ctx) {
  const int src = name(peer);
  auto where = [&] {
    std::ostringstream os;
    os << "pycomm.recv #" << ctx.seq << " on rank " << self_name() << " from rank " << src << ": ";
    return os.str();
  };
  if (auto why = ended_reason(peer)) throw CommError(where() + "the sender failed: " + *why);
  uint32_t total = 1;
  for (uint32_t i = 0; i < total; ++i) {
    MessageHeader h{};
    read(peer, &h, sizeof h, ctx);
    if (h.magic == kFailureMagic) {
      std::string msg(h.nbytes, '\0');
      read(peer, msg.data(), msg.size(), ctx);
      if (h.tag == kFailureLast) {
        std::lock_guard<std::mutex> lk(ended_mu_);
        ended_.emplace(peer, msg);
        any_ended_.store(true, std::memory_order_relaxed);
      }
      throw CommError(where() + "the sender failed: " + msg);
    }
    // From here on a mismatch leaves the channel out of step with the
    // sender: it fails the communicator on every local rank (as collectives
    // whose headers disagree do) rather than deliver the wrong bytes later.
    if (h.magic != kMessageMagic || h.index != i || h.total == 0 || h.ndim > kP2PMaxDims)
      out_of_step(where() + "the channel is out of step (corrupt message header)");
    if (h.tag != tag)
      out_of_step(where() + "expected tag " + std::to_string(tag) + " but the next message from rank " +
                std::to_string(src) + " has tag " + std::to_string(h.tag) +
                " (messages between two ranks arrive in the order they were sent)");
    total = h.total;
    TensorMeta meta;
    meta.dtype = h.dtype;
    meta.ndim = h.ndim;
    for (int d = 0; d < h.ndim; ++d) meta.shape[d] = h.shape[d];
    meta.nbytes = h.nbytes;
    std::string why;
    void* dst = sink.place(i, total, meta, &why);
    if (!why.empty()) out_of_step(where() + why);
    if (h.nbytes) read(peer, dst, h.nbytes, ctx);
  }
}

bool MessageChannels::ended(int peer) const { return ended_reason(peer).has_value(); }

std::optional<std::string> MessageChannels::ended_reason(int peer) const {
  // Relaxed is enough: a stream's end is read on the lane that reads that
  // stream (which set it, under the lock), or raced by a send that may as
  // well have come a moment earlier.
  if (!any_ended_.load(std::memory_order_relaxed)) return std::nullopt;
  std::lock_guard<std::mutex> lk(ended_mu_);
  auto it = ended_.find(peer);
  if (it == ended_.end()) return std::nullopt;
  return it->second;
}

}  // namespace pycomm
