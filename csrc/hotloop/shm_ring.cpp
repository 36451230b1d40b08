#include "hotloop/shm_ring.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <random>

#include "hotloop/clock.h"
#include "hotloop/errors.h"
#include "hotloop/nvtx.h"
#include "hotloop/process_exit.h"
#include "hotloop/wait_any.h"

namespace hotloop {
namespace {

constexpr uint64_t kMagic = 0x51504f4f4c544f48ull;  // "HOTLOOPQ"
constexpr int64_t kLivenessSliceNs = 500'000'000;    // peers are checked this often while waiting
// A reader watching its writer's pidfd parks on the doorbell alone this long first: most waits end sooner (the
// next message), and a park over a doorbell and a descriptor together costs more to set up (wait_any.h).
constexpr int64_t kFirstParkNs = 50'000'000;
constexpr uint32_t kWhole = 1, kFirst = 2, kMiddle = 3, kLast = 4, kPad = 5;
// A record header: the header word, stored last and atomically (word_of(size, kind); 0: nothing published here
// yet), then the uint64 message sequence.
constexpr uint64_t kRecordHeader = ShmRing::kRecordHeaderBytes;
static_assert(kRecordHeader == 2 * sizeof(uint64_t));

uint64_t word_of(uint64_t size, uint32_t kind) { return size | uint64_t(kind) << 32; }

// A wait that ends every liveness slice anyway runs the caller's slice hook (the binding's signal check, every
// 500 ms) at those ends instead of at slices of its own, when its slices are at least half as long: one wake-up
// a slice does both, and the hook runs at most twice as far apart. The park still runs the hook whenever
// something else interrupts it (a signal: EINTR). Returns the hooks to wait with.
const WaitHooks* liveness_sliced(const WaitHooks* hooks, WaitHooks& unsliced) {
  if (hooks == nullptr || hooks->slice_ns * 2 < kLivenessSliceNs) return hooks;
  unsliced = *hooks;
  unsliced.slice_ns = 0;
  return &unsliced;
}

// After a liveness slice ended: the hook that liveness_sliced took over.
void end_of_liveness_slice(const WaitHooks* inner, const WaitHooks& unsliced) {
  if (inner == &unsliced && unsliced.on_slice != nullptr) unsliced.on_slice(unsliced.ctx);
}
uint32_t size_of_word(uint64_t word) { return uint32_t(word); }
uint32_t kind_of_word(uint64_t word) { return uint32_t(word >> 32); }

uint64_t align8(uint64_t n) { return (n + 7) & ~uint64_t(7); }

// Copies `size` bytes of the concatenated parts, from byte `skip` on, to `dst`.
void copy_parts(uint8_t* dst, const ShmRing::Part* parts, size_t n, size_t skip, size_t size) {
  for (size_t i = 0; i < n && size > 0; ++i) {
    if (skip >= parts[i].size) {
      skip -= parts[i].size;
      continue;
    }
    size_t take = std::min(parts[i].size - skip, size);
    std::memcpy(dst, static_cast<const uint8_t*>(parts[i].data) + skip, take);
    dst += take;
    size -= take;
    skip = 0;
  }
}

// The start time of a live (not zombie) process in clock ticks since boot, or 0 if there is none. Read from its
// main thread's entry, /proc/PID/task/PID/stat, which the kernel fills exactly as /proc/PID/stat: qemu-user (the
// aarch64 suite, and emulated CI builds downstream) answers /proc/self/stat and /proc/<own pid>/stat itself, with
// a start time of its own per thread, so a queue's threads in one emulated process took each other for dead.
uint64_t process_start_time(int pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/task/%d/stat", pid, pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return 0;
  char buf[1024];
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // the command name may contain spaces and parentheses
  if (p == nullptr || p[1] == '\0') return 0;
  char state = p[2];
  if (state == 'Z' || state == 'X') return 0;
  // fields after ')': 3 state ... 22 starttime
  p += 2;
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p, ' ');
    if (p == nullptr) return 0;
    ++p;
  }
  return std::strtoull(p, nullptr, 10);
}

bool process_alive(int pid, uint64_t start_time) {
  return pid > 0 && process_start_time(pid) == start_time && start_time != 0;
}

}  // namespace

struct alignas(kCacheLine) ReaderSlot {
  std::atomic<uint64_t> read_pos{0};
  std::atomic<int32_t> pid{0};
  std::atomic<uint32_t> attached{0};
  std::atomic<uint32_t> dropped{0};  // closed, or died under DeadReaderPolicy::kDrop: not waited for
  uint64_t start_time = 0;
};

struct ShmRing::Layout {
  std::atomic<uint64_t> magic{0};
  uint32_t version = 0;
  uint32_t n_readers = 0;
  uint64_t capacity = 0;
  uint64_t max_message = 0;
  uint32_t dead_reader = 0;
  int32_t writer_pid = 0;
  uint64_t writer_start_time = 0;
  std::atomic<uint32_t> state{0};  // 1: shut down; 2: abandoned (the writer lost its own source)
  std::atomic<uint32_t> attached{0};
  Doorbell data_bell{true};   // rung by the writer after publishing
  Doorbell space_bell{true};  // rung by readers after releasing
  // Layout 2 kept the write position here; the line stays so that the segment keeps its size and a peer of
  // layout 2 reaches its version check (and names both versions) instead of failing on the size.
  alignas(kCacheLine) uint64_t unused_line[kCacheLine / 8] = {};

  // Offsets computed from this side's own geometry, never from the header's copy of it.
  static size_t slots_offset() { return sizeof(Layout); }
  static size_t data_offset(uint32_t n) { return sizeof(Layout) + n * sizeof(ReaderSlot); }
};

// A reader's wait source: ready when a record waits, the ring is shut down, or this reader's waits were
// cancelled. Holds the ring (re-pointed when the ring moves) because the reader's position is private.
class ShmRing::ReaderSource final : public Source {
 public:
  explicit ReaderSource(const ShmRing* r) : r_(r) {}
  // seq_cst load (a plain load on x86): the writer publishes with ring_if_parked (see doorbell.h).
  bool ready() const noexcept override {
    return r_->header_word(r_->pos_).load(std::memory_order_seq_cst) != 0 ||
           r_->layout_->state.load(std::memory_order_acquire) != 0 || r_->waits_cancelled();
  }
  Doorbell* doorbell() noexcept override { return &r_->layout_->data_bell; }
  const ShmRing* r_;
};

namespace {

// The writer's wait source: ready when `need` bytes are free (checked by the ring), on shutdown, or when its
// waits are cancelled.
struct SpaceSource final : Source {
  const std::atomic<uint32_t>* state;
  const std::atomic<bool>* cancelled;
  Doorbell* bell;
  std::function<bool()> has_space;
  bool ready() const noexcept override {
    return state->load(std::memory_order_acquire) != 0 || cancelled->load(std::memory_order_acquire) ||
           has_space();
  }
  Doorbell* doorbell() noexcept override { return bell; }
};

// "/hotloop-<pid namespace>-<pid>-<start time>-<n>-<random>": what the reaper needs to prove its creator dead.
std::string fresh_name() {
  static std::atomic<uint32_t> counter{0};
  std::random_device rd;
  char buf[128];
  std::snprintf(buf, sizeof buf, "/hotloop-%llu-%d-%llu-%u-%08x",
                static_cast<unsigned long long>(ShmRing::pid_namespace()), int(getpid()),
                static_cast<unsigned long long>(process_start_time(getpid())), counter.fetch_add(1), rd());
  return buf;
}

}  // namespace

uint64_t ShmRing::pid_namespace() noexcept {
  struct stat st {};
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;  // no /proc: 0, which the reaper treats as unknown
  return uint64_t(st.st_ino);
}

ShmRing ShmRing::mapped(Layout* l, size_t size, std::string name, int rank, const Geometry& g) {
  ShmRing r;
  r.layout_ = l;
  r.map_size_ = size;
  r.geo_ = g;
  r.slots_ = reinterpret_cast<ReaderSlot*>(reinterpret_cast<uint8_t*>(l) + Layout::slots_offset());
  r.data_ = reinterpret_cast<uint8_t*>(l) + Layout::data_offset(g.n_readers);
  r.name_ = std::move(name);
  r.rank_ = rank;
  r.owner_pid_ = int(getpid());
  r.linked_ = true;
  if (rank >= 0) r.source_ = new ReaderSource(&r);  // re-pointed by the move that returns it
  return r;
}

ShmRing ShmRing::create(const RingGeometry& g, std::string name) {
  if (g.capacity < 4096 || g.capacity > kMaxCapacity || (g.capacity & (g.capacity - 1)) != 0) {
    throw std::invalid_argument("ring capacity must be a power of two from 4096 bytes to 4 GiB (got " +
                                std::to_string(g.capacity) + "); larger messages are split into records, so a "
                                "bigger ring is never needed");
  }
  if (g.n_readers == 0 || g.n_readers > 1024) {
    throw std::invalid_argument("a ring has 1 to 1024 local readers (got " + std::to_string(g.n_readers) + ")");
  }
  if (name.empty()) name = fresh_name();
  if (name[0] != '/' || name.find('/', 1) != std::string::npos || name.size() > 250) {
    throw std::invalid_argument("shared-memory name '" + name + "' must be '/' followed by up to 250 characters "
                                "without '/'");
  }
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    throw std::runtime_error("cannot create shared-memory segment " + name + ": " + std::strerror(errno) +
                             (errno == EEXIST ? " (pick another name)" : " (is /dev/shm mounted and writable?)"));
  }
  size_t size = Layout::data_offset(g.n_readers) + g.capacity;
  if (ftruncate(fd, off_t(size)) != 0) {
    int e = errno;
    ::close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error("cannot size shared-memory segment " + name + " to " + std::to_string(size) +
                             " bytes: " + std::strerror(e) + " (is /dev/shm large enough?)");
  }
  // MAP_POPULATE: fault every page in now, not on the data path (a fresh 64 KiB message would otherwise pay
  // 16 page faults in each process).
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    int e = errno;
    shm_unlink(name.c_str());
    throw std::runtime_error("cannot map shared-memory segment " + name + ": " + std::strerror(e));
  }
  auto* l = new (p) Layout();
  l->version = kLayoutVersion;
  l->n_readers = g.n_readers;
  l->capacity = g.capacity;
  l->max_message = g.max_message;
  l->dead_reader = uint32_t(g.dead_reader);
  l->writer_pid = int32_t(getpid());
  l->writer_start_time = process_start_time(getpid());
  auto* slots = reinterpret_cast<ReaderSlot*>(static_cast<uint8_t*>(p) + Layout::slots_offset());
  for (uint32_t i = 0; i < g.n_readers; ++i) new (&slots[i]) ReaderSlot();
  l->magic.store(kMagic, std::memory_order_release);
  Geometry geo{g.capacity, g.n_readers, g.max_message, g.dead_reader, l->writer_pid, l->writer_start_time};
  return mapped(l, size, name, -1, geo);
}

namespace {

// Opens and maps the segment `name` that a handle describes (a ring of `capacity` bytes and `n_readers` readers),
// after checking that geometry and the segment's size. Returns the mapping; its size is *size.
void* map_segment(const std::string& name, uint64_t capacity, uint32_t n_readers, size_t* size) {
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    throw BadHandleError("no shared-memory segment " + name + " (" + std::strerror(errno) +
                         "): its writer closed the queue, or every reader already attached (the name is "
                         "removed then); create the reader from a fresh handle before the writer's "
                         "wait_until_ready() times out");
  }
  if (capacity < 4096 || capacity > ShmRing::kMaxCapacity || (capacity & (capacity - 1)) != 0 ||
      n_readers == 0 || n_readers > 1024) {
    ::close(fd);
    throw BadHandleError("queue " + name + ": the handle's geometry (capacity " + std::to_string(capacity) +
                         ", " + std::to_string(n_readers) + " readers) is not one a ring can have: the "
                         "handle is corrupt");
  }
  struct stat st {};
  fstat(fd, &st);
  const size_t min_size = ShmRing::Layout::data_offset(n_readers) + capacity;
  if (size_t(st.st_size) < sizeof(ShmRing::Layout) || size_t(st.st_size) != min_size) {
    ::close(fd);
    throw BadHandleError("shared-memory segment " + name + " has " + std::to_string(st.st_size) +
                         " bytes, not the " + std::to_string(min_size) + " the handle describes: "
                         "the handle is corrupt or from another queue");
  }
  void* p = mmap(nullptr, min_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw std::runtime_error("cannot map " + name + ": " + std::strerror(errno));
  *size = min_size;
  return p;
}

}  // namespace

std::string ShmRing::attach_refusal(const Layout* l, uint32_t rank, uint64_t capacity, uint32_t n_readers,
                                    uint64_t* start) {
  if (l->magic.load(std::memory_order_acquire) != kMagic) return "the segment is not a hotloop message queue";
  if (l->version != ShmRing::kLayoutVersion) {
    return "its layout version is " + std::to_string(l->version) + ", this hotloop reads version " +
           std::to_string(ShmRing::kLayoutVersion) + ": use the same hotloop version in every process";
  }
  if (l->capacity != capacity || l->n_readers != n_readers) {
    return "the handle's geometry does not match the segment's (the handle is corrupt or forged)";
  }
  if (rank >= n_readers) {
    return "reader rank " + std::to_string(rank) + " is out of range: the queue has " + std::to_string(n_readers) +
           " local readers (ranks 0-" + std::to_string(n_readers - 1) + ")";
  }
  const ReaderSlot& slot =
      reinterpret_cast<const ReaderSlot*>(reinterpret_cast<const uint8_t*>(l) + Layout::slots_offset())[rank];
  // 0 for a fresh slot (only its reader stores to it); anything but a record's start is corrupt.
  *start = slot.read_pos.load(std::memory_order_acquire);
  if ((*start & 7) != 0 || next_header(*start, capacity) != *start) {
    return "reader rank " + std::to_string(rank) + "'s position " + std::to_string(*start) + " is not the start "
           "of a record: the segment is corrupt, recreate the queue";
  }
  if (slot.dropped.load(std::memory_order_acquire) != 0 && slot.attached.load(std::memory_order_acquire) == 0) {
    return "reader rank " + std::to_string(rank) + " was closed to readers: the queue's writer was already "
           "sending (create every reader before the writer's wait_until_ready() returns)";
  }
  return "";
}

ShmRing ShmRing::attach(const std::string& name, uint32_t rank, uint64_t expect_capacity, uint32_t expect_readers) {
  size_t size = 0;
  void* p = map_segment(name, expect_capacity, expect_readers, &size);
  try {
    return claim_slot(static_cast<Layout*>(p), size, name, rank, expect_capacity, expect_readers, true);
  } catch (...) {
    munmap(p, size);
    throw;
  }
}

ShmRing ShmRing::attach_in_process(const ShmRing& writer, uint32_t rank) {
  if (!writer.is_writer() || writer.layout_ == nullptr) {
    throw std::logic_error("attach_in_process: pass the ring's writer (created in this process)");
  }
  return claim_slot(writer.layout_, writer.map_size_, writer.name_, rank, writer.geo_.capacity,
                    writer.geo_.n_readers, false);
}

ShmRing ShmRing::claim_slot(Layout* l, size_t size, const std::string& name, uint32_t rank,
                            uint64_t expect_capacity, uint32_t expect_readers, bool owns_mapping) {
  void* p = l;
  auto fail = [&](const std::string& why) { throw BadHandleError("cannot attach to queue " + name + ": " + why); };
  uint64_t start = 0;
  std::string refusal = attach_refusal(l, rank, expect_capacity, expect_readers, &start);
  if (!refusal.empty()) fail(refusal);
  ReaderSlot& slot = reinterpret_cast<ReaderSlot*>(static_cast<uint8_t*>(p) + Layout::slots_offset())[rank];
  uint32_t expected = 0;
  if (!slot.attached.compare_exchange_strong(expected, 1)) {
    fail("reader rank " + std::to_string(rank) + " is already attached (by pid " + std::to_string(slot.pid.load()) +
         "): each rank attaches once");
  }
  slot.start_time = process_start_time(getpid());
  slot.pid.store(int32_t(getpid()), std::memory_order_release);

  Geometry geo{expect_capacity, expect_readers, l->max_message, DeadReaderPolicy(l->dead_reader & 1),
               l->writer_pid, l->writer_start_time};
  ShmRing r = mapped(l, size, name, int(rank), geo);
  r.owns_mapping_ = owns_mapping;
  r.watch_writer_exit_ = owns_mapping && geo.writer_pid != int32_t(getpid()) &&
                         park_backend().backend != ParkBackend::kSliced;
  r.pos_ = start;
  if (l->attached.fetch_add(1, std::memory_order_acq_rel) + 1 == expect_readers) r.unlink();
  l->space_bell.ring();  // a writer may be waiting in wait_all_attached
  return r;
}

ShmRing::ShmRing(ShmRing&& o) noexcept
    : layout_(o.layout_), map_size_(o.map_size_), geo_(o.geo_), data_(o.data_), slots_(o.slots_), pos_(o.pos_),
      cancelled_(o.cancelled_.load()), name_(std::move(o.name_)), rank_(o.rank_),
      owner_pid_(o.owner_pid_), owns_mapping_(o.owns_mapping_), linked_(o.linked_.load()),
      closed_(o.closed_.load()),
      next_seq_(o.next_seq_), pending_release_(o.pending_release_), reader_floor_(o.reader_floor_),
      source_(o.source_), watch_writer_exit_(o.watch_writer_exit_),
      partial_(std::move(o.partial_)), partial_seq_(o.partial_seq_), partial_filled_(o.partial_filled_),
      assembling_(o.assembling_) {
  if (source_ != nullptr) source_->r_ = this;
  o.layout_ = nullptr;
  o.source_ = nullptr;
  o.linked_ = false;
}

ShmRing::~ShmRing() {
  if (layout_ == nullptr) return;
  close();
  delete source_;
  if (owns_mapping_) munmap(layout_, map_size_);
}

void ShmRing::close() noexcept {
  if (int(getpid()) != owner_pid_) return;  // a copy inherited through fork: the parent's side, not ours
  if (closed_.exchange(true)) return;
  cancel_waits();
  if (is_writer()) {
    shutdown();
    unlink();
  } else {
    slots_[rank_].dropped.store(1, std::memory_order_release);  // no longer holds the writer back
    layout_->space_bell.ring();
  }
}

uint32_t ShmRing::attached_readers() const noexcept { return layout_->attached.load(std::memory_order_acquire); }
bool ShmRing::shut_down() const noexcept { return layout_->state.load(std::memory_order_acquire) != 0; }

void ShmRing::unlink() noexcept {
  if (linked_.exchange(false)) shm_unlink(name_.c_str());  // ENOENT when a peer unlinked it first: fine
}

void ShmRing::shutdown() noexcept {
  layout_->state.store(1, std::memory_order_release);
  layout_->data_bell.ring();
  layout_->space_bell.ring();
}

void ShmRing::abandon() noexcept {
  layout_->state.store(kAbandoned, std::memory_order_release);
  layout_->data_bell.ring();
  layout_->space_bell.ring();
}

uint32_t ShmRing::close_unattached() noexcept {
  uint32_t closed = 0;
  for (uint32_t i = 0; i < geo_.n_readers; ++i) {
    ReaderSlot& r = slots_[i];
    if (r.attached.load(std::memory_order_acquire) != 0 || r.dropped.exchange(1) != 0) continue;
    ++closed;
  }
  return closed;
}

void ShmRing::cancel_waits() noexcept {
  cancelled_.store(true, std::memory_order_seq_cst);
  // Both doorbells are shared with the other processes: they wake, find nothing new and park again.
  layout_->data_bell.ring();
  layout_->space_bell.ring();
}

void ShmRing::throw_if_cancelled() const {
  if (waits_cancelled()) {
    throw ClosedError("queue " + name_ + ": this " + (is_writer() ? "writer" : "reader") +
                      " was closed or shut down (by another thread, or before this call)");
  }
}

void ShmRing::corrupt(const std::string& what) const {
  throw std::runtime_error("queue " + name_ + ": corrupt shared memory at byte " + std::to_string(pos_) + " (" +
                           what + "); the segment was overwritten by something other than its writer: "
                           "recreate the queue");
}

// ---- writer ----

bool ShmRing::wait_all_attached(int64_t timeout_ns, WaitPolicy& policy, const WaitHooks* hooks) {
  struct AttachedSource final : Source {
    const ShmRing* r;
    bool ready() const noexcept override {
      return r->layout_->attached.load(std::memory_order_acquire) >= r->geo_.n_readers || r->waits_cancelled();
    }
    Doorbell* doorbell() noexcept override { return &r->layout_->space_bell; }
  } src;
  src.r = this;
  Source* s = &src;
  throw_if_cancelled();
  if (src.ready()) return true;
  bool ok = wait_any(&s, 1, timeout_ns, policy, hooks) != 0;
  throw_if_cancelled();
  if (ok) unlink();  // every reader has mapped it: nothing can be left behind now
  return ok;
}

uint64_t ShmRing::slowest_reader_pos(int* slowest_rank) noexcept {
  uint64_t min_pos = pos_;
  for (uint32_t i = 0; i < geo_.n_readers; ++i) {
    ReaderSlot& s = slots_[i];
    if (s.dropped.load(std::memory_order_acquire)) continue;
    uint64_t p = s.read_pos.load(std::memory_order_seq_cst);  // readers release with ring_if_parked
    if (p < min_pos) {  // a position past ours is corrupt: it holds nothing back
      min_pos = p;
      if (slowest_rank) *slowest_rank = int(i);
    }
  }
  return min_pos;
}

// Are the readers that hold the writer back (short of `end`, the end of the record it waits to write) alive? A
// dead one is dropped (DeadReaderPolicy::kDrop) or reported.
void ShmRing::check_readers(uint64_t end) {
  for (uint32_t i = 0; i < geo_.n_readers; ++i) {
    ReaderSlot& r = slots_[i];
    if (r.dropped.load(std::memory_order_acquire) || !r.attached.load(std::memory_order_acquire)) continue;
    if (end - r.read_pos.load(std::memory_order_acquire) <= geo_.capacity) continue;
    // attach() claims the slot (attached = 1), then stores start_time and, last, pid (release): pid first
    // (acquire), then start_time. A pid of 0 is a reader between the two (it is reading /proc/self/stat): alive.
    const int32_t pid = r.pid.load(std::memory_order_acquire);
    if (pid == 0 || process_alive(pid, r.start_time)) continue;
    if (geo_.dead_reader == DeadReaderPolicy::kDrop) {
      r.dropped.store(1, std::memory_order_release);
      continue;
    }
    throw DeadPeerError("reader rank " + std::to_string(i) + " (pid " + std::to_string(pid) +
                        ") of queue " + name_ + " died: the writer will not wait for it; restart the workers, "
                        "or create the queue with dead_reader='drop' to go on without it");
  }
}

void ShmRing::throw_full(uint64_t pos) {
  int rank = -1;
  uint64_t slow = slowest_reader_pos(&rank);
  ReaderSlot& r = slots_[rank < 0 ? 0 : rank];
  bool attached = r.attached.load(std::memory_order_acquire) != 0;
  throw QueueTimeout("queue " + name_ + " is full: reader rank " + std::to_string(rank) +
                     (attached ? " (pid " + std::to_string(r.pid.load()) + ")" : " (not attached yet)") + " is " +
                     std::to_string(pos - slow) + " bytes behind, a full ring; it is stuck or slow: make it "
                     "read, raise the timeout, or use a larger ring");
}

void ShmRing::wait_for_space(uint64_t need, int64_t deadline, WaitPolicy& policy, const WaitHooks* hooks) {
  Layout* l = layout_;
  const uint64_t pos = pos_;
  const uint64_t cap = geo_.capacity;
  // The slowest reader's position as last read: reading the readers' cache lines only when that is not
  // enough saves a cache-line transfer per message.
  if (pos + need - reader_floor_ <= cap) return;
  auto has_space = [&] {
    reader_floor_ = slowest_reader_pos(nullptr);
    return pos + need - reader_floor_ <= cap;
  };
  if (has_space()) return;
  SpaceSource src;
  src.state = &l->state;
  src.cancelled = &cancelled_;
  src.bell = &l->space_bell;
  src.has_space = has_space;
  Source* s = &src;
  WaitHooks unsliced;
  const WaitHooks* inner = liveness_sliced(hooks, unsliced);
  int64_t next_check = 0;
  for (;;) {
    throw_if_cancelled();
    if (l->state.load(std::memory_order_acquire) != 0) {
      throw ClosedError("queue " + name_ + " was shut down while a message was being written");
    }
    if (has_space()) return;
    int64_t now = now_ns();
    // The readers holding the writer back are checked as soon as the ring is full (a reader that died while the
    // writer was not waiting is found at once) and then every liveness slice.
    if (now >= next_check) {
      check_readers(pos + need);
      next_check = now + kLivenessSliceNs;
      if (has_space()) return;  // a dead reader was dropped
    }
    if (now >= deadline) throw_full(pos);
    if (wait_any(&s, 1, std::min(deadline, next_check) - now, policy, inner) == 0) {
      end_of_liveness_slice(inner, unsliced);
    }
  }
}

ShmRing::Placement ShmRing::place(uint64_t rec) const noexcept {
  const uint64_t pos = pos_;  // a record's start (next_header keeps it one)
  const uint64_t tail = geo_.capacity - (pos & (geo_.capacity - 1));
  Placement at;
  at.start = tail < rec ? pos + tail : pos;  // a record never wraps: a pad record covers a short tail
  at.next = next_header(at.start + rec, geo_.capacity);
  at.need = at.next + sizeof(uint64_t) - pos;  // up to the next record's header word, cleared now
  return at;
}

void ShmRing::put_record(uint32_t kind, uint64_t seq, const Part* parts, size_t n, size_t skip, size_t size,
                         int64_t deadline, WaitPolicy& policy, const WaitHooks* hooks) {
  const uint64_t mask = geo_.capacity - 1;
  const uint64_t pos = pos_;
  const Placement at = place(kRecordHeader + align8(size));
  wait_for_space(at.need, deadline, policy, hooks);
  uint8_t* rec = data_ + (at.start & mask);
  // Readers spin on the header's cache line: it is written last, in one burst (the payload beyond that line, and
  // the next record's cleared header word, first), so that a spinning reader does not pull the line away
  // between the writer's stores to it.
  const size_t head = std::min<size_t>(size, kCacheLine - (at.start + kRecordHeader) % kCacheLine);
  copy_parts(rec + kRecordHeader + head, parts, n, skip + head, size - head);
  // Readers arriving at the next record must find "nothing yet" there, not a header from the last lap: its word
  // is cleared before this record is published (the readers' acquire of this record orders the two).
  header_word(at.next).store(0, std::memory_order_relaxed);
  copy_parts(rec + kRecordHeader, parts, n, skip, head);
  std::memcpy(rec + sizeof(uint64_t), &seq, sizeof seq);
  // Published by the header word, seq_cst for ring_if_parked (see doorbell.h). A pad is published after its
  // record, so that a reader never finds a pad alone.
  header_word(at.start).store(word_of(size, kind), std::memory_order_seq_cst);
  if (at.start != pos) {
    std::memcpy(data_ + (pos & mask) + sizeof(uint64_t), &seq, sizeof seq);
    header_word(pos).store(word_of(at.start - pos - kRecordHeader, kPad), std::memory_order_seq_cst);
  }
  pos_ = at.next;
  layout_->data_bell.ring_if_parked();
}

bool ShmRing::try_write(const Part* parts, size_t n) {
  Layout* l = layout_;
  if (!is_writer() || l->state.load(std::memory_order_acquire) != 0 || waits_cancelled()) return false;
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) total += parts[i].size;
  const uint64_t cap = geo_.capacity;
  const uint64_t max_payload = (cap / 4 - kRecordHeader) & ~uint64_t(7);
  if (total > max_payload || (geo_.max_message != 0 && total > geo_.max_message)) return false;
  const uint64_t pos = pos_;
  const uint64_t need = place(kRecordHeader + align8(total)).need;
  if (pos + need - reader_floor_ > cap) {
    reader_floor_ = slowest_reader_pos(nullptr);
    if (pos + need - reader_floor_ > cap) return false;
  }
  WaitPolicy unused;
  put_record(kWhole, next_seq_++, parts, n, 0, total, kForever, unused, nullptr);  // has room: never waits
  return true;
}

void ShmRing::write(const Part* parts, size_t n, int64_t timeout_ns, WaitPolicy& policy, const WaitHooks* hooks) {
  nvtx::Scope range(nvtx::Range::kEnqueue);
  Layout* l = layout_;
  if (!is_writer()) throw std::logic_error("queue " + name_ + ": only the writer enqueues");
  throw_if_cancelled();
  if (l->state.load(std::memory_order_acquire) != 0) {
    throw ClosedError("queue " + name_ + " was shut down: no more messages can be enqueued");
  }
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) total += parts[i].size;
  if (geo_.max_message != 0 && total > geo_.max_message) {
    throw std::length_error("a message of " + std::to_string(total) + " bytes exceeds the maximum of " +
                            std::to_string(geo_.max_message) + " bytes of queue " + name_ +
                            ": send it in pieces, or create the queue with a larger maximum");
  }
  const int64_t deadline = deadline_after(timeout_ns);
  const uint64_t seq = next_seq_++;  // consumed even if the write fails: readers then drop a partial message
  const uint64_t max_payload = (geo_.capacity / 4 - kRecordHeader) & ~uint64_t(7);
  if (total <= max_payload) {
    put_record(kWhole, seq, parts, n, 0, total, deadline, policy, hooks);
    return;
  }
  std::vector<Part> all;
  all.reserve(n + 1);
  all.push_back(Part{&total, sizeof total});
  all.insert(all.end(), parts, parts + n);
  const uint64_t length = total + sizeof total;
  for (uint64_t off = 0; off < length;) {
    uint64_t chunk = std::min(max_payload, length - off);
    uint32_t kind = off == 0 ? kFirst : off + chunk == length ? kLast : kMiddle;
    put_record(kind, seq, all.data(), all.size(), off, chunk, deadline, policy, hooks);
    off += chunk;
  }
}

// ---- reader ----

Source& ShmRing::source() noexcept { return *source_; }

bool ShmRing::wait(int64_t timeout_ns, WaitPolicy& policy, const WaitHooks* hooks) {
  const int64_t now = now_ns();
  return wait_readable(deadline_after(timeout_ns, now), policy, hooks, now);
}

bool ShmRing::readable() const noexcept {
  return header_word(pos_).load(std::memory_order_acquire) != 0;
}

// Reader: moves its position past `n` bytes to the next record's start (own copy first, then the slot the writer
// reads) and wakes a waiting writer.
void ShmRing::advance(uint64_t n) noexcept {
  const uint64_t pos = next_header(pos_ + n, geo_.capacity);
  pos_ = pos;
  slots_[rank_].read_pos.store(pos, std::memory_order_seq_cst);
  layout_->space_bell.ring_if_parked();
}

void ShmRing::release() noexcept {
  if (pending_release_ == 0 || is_writer()) return;
  advance(pending_release_);
  pending_release_ = 0;
}

bool ShmRing::wait_readable(int64_t deadline, WaitPolicy& policy, const WaitHooks* hooks, int64_t now) {
  Layout* l = layout_;
  Source* s = source_;
  WaitHooks unsliced;
  const WaitHooks* inner = liveness_sliced(hooks, unsliced);
  auto writer_died = [&] {
    throw DeadPeerError("the writer (pid " + std::to_string(geo_.writer_pid) + ") of queue " + name_ +
                        " died; every message it published was delivered: recreate the queue");
  };
  bool parked = false;
  bool watch_exit = watch_writer_exit_;
  std::unique_ptr<ProcessExit> writer_exit;  // the writer's pidfd, from the second park of this wait on
  for (;; now = -1) {
    throw_if_cancelled();
    if (readable()) return true;
    if (l->state.load(std::memory_order_acquire) != 0) {
      if (l->state.load(std::memory_order_acquire) == kAbandoned) {
        throw DeadPeerError("the writer (pid " + std::to_string(geo_.writer_pid) + ") of queue " + name_ +
                            " lost its own source (a node's relay lost the queue's writer); every message it "
                            "received was delivered: recreate the queue");
      }
      throw ClosedError("queue " + name_ + " was shut down by its writer (every message before that was "
                        "delivered)");
    }
    if (parked && watch_exit && writer_exit == nullptr) {
      // Opened first, then confirmed: if the writer still holds its pid now, the pidfd is the writer's.
      writer_exit = ProcessExit::open(geo_.writer_pid);
      if (writer_exit == nullptr) {
        watch_exit = false;  // no pidfd here: the liveness slices alone
      } else if (!process_alive(geo_.writer_pid, geo_.writer_start_time)) {
        if (!readable()) writer_died();
        continue;
      }
    }
    if (now < 0) now = now_ns();
    if (now >= deadline) return false;
    // The first park watches the doorbell alone (kFirstParkNs where the writer's pidfd is watched after it);
    // later ones the pidfd too: a writer that dies is then seen at once, not at the end of a slice.
    Source* sources[2] = {s, writer_exit ? &writer_exit->source() : nullptr};
    const size_t n = writer_exit ? 2 : 1;
    const int64_t slice = watch_exit && !parked ? kFirstParkNs : kLivenessSliceNs;
    parked = true;
    const uint64_t ready = wait_any(sources, n, std::min(deadline, now + slice) - now, policy, inner);
    if (ready & 1) continue;
    if (ready == 0) end_of_liveness_slice(inner, unsliced);
    if (!readable() && !waits_cancelled() && !process_alive(geo_.writer_pid, geo_.writer_start_time)) writer_died();
    if ((ready & 2) && !readable()) {  // cannot be (it exited, yet lives): never spin on it
      writer_exit.reset();
      watch_exit = false;
    }
  }
}

bool ShmRing::read(Message& out, int64_t timeout_ns, WaitPolicy& policy, const WaitHooks* hooks) {
  nvtx::Scope range(nvtx::Range::kDequeue);
  if (is_writer()) throw std::logic_error("queue " + name_ + ": the writer does not dequeue");
  release();
  throw_if_cancelled();
  int64_t deadline = -1;  // computed when the first wait needs it (a message already there costs no clock read)
  for (;;) {
    uint64_t word = header_word(pos_).load(std::memory_order_acquire);
    // A reply often lands within a few hundred nanoseconds: look again a few times before reading the clock and
    // setting up a wait, which would cost more than that (see kQuickChecks).
    for (int i = 0; word == 0 && i < kQuickChecks && timeout_ns != 0 && policy.spin_ns() > 0; ++i) {
      cpu_relax();
      word = header_word(pos_).load(std::memory_order_acquire);
    }
    if (word == 0) {  // nothing published here yet
      int64_t now = -1;  // read once for the deadline and the wait
      if (deadline < 0) {
        now = now_ns();
        deadline = deadline_after(timeout_ns, now);
      }
      if (!wait_readable(deadline, policy, hooks, now)) return false;
      continue;
    }
    // Found without a wait: when it came is not known to the paced estimate (a wait feeds it when one ends).
    if (deadline < 0 && policy.paced()) policy.observe_ready_unknown();
    if (take_record(word, out)) return true;
  }
}

bool ShmRing::take_record(uint64_t word, Message& out) {
  // Everything read from shared memory is checked against this reader's own position and geometry.
  const uint64_t cap = geo_.capacity;
  const uint64_t tail = cap - (pos_ & (cap - 1));  // >= kRecordHeader: pos_ is a record's start
  const uint8_t* rec = data_ + (pos_ & (cap - 1));
  const uint32_t size = size_of_word(word);
  const uint32_t kind = kind_of_word(word);
  uint64_t seq;
  std::memcpy(&seq, rec + sizeof(uint64_t), sizeof seq);
  const uint64_t len = kRecordHeader + align8(size);
  if (len > tail) corrupt("record of " + std::to_string(size) + " bytes runs past the ring's end");
  const uint8_t* payload = rec + kRecordHeader;
  switch (kind) {
    case kPad:
      if (len != tail) corrupt("a pad record that does not end the ring");
      advance(len);
      return false;
    case kWhole:
      if (seq < next_seq_) corrupt("message sequence went back");
      partial_.reset();
      assembling_ = false;
      out.owned.reset();
      out.data = payload;
      out.size = size;
      out.seq = seq;
      next_seq_ = seq + 1;
      pending_release_ = len;
      return true;
    case kFirst:
      take_first_fragment(payload, size, seq);
      advance(len);
      return false;
    case kMiddle:
    case kLast:
      return take_fragment(payload, size, kind == kLast, seq, len, out);
    default:
      corrupt("unknown record kind " + std::to_string(kind));
  }
}

void ShmRing::take_first_fragment(const uint8_t* payload, uint32_t size, uint64_t seq) {
  if (seq < next_seq_ || size < 8) corrupt("bad first fragment");
  uint64_t total;
  std::memcpy(&total, payload, sizeof total);
  if (geo_.max_message != 0 && total > geo_.max_message) corrupt("message longer than the maximum");
  if (total > (uint64_t(1) << 46)) corrupt("message length " + std::to_string(total) + " is not plausible");
  partial_.allocate(total);  // a half-assembled earlier message (its write failed) is dropped
  partial_seq_ = seq;
  partial_filled_ = std::min<uint64_t>(size - 8, total);
  std::memcpy(partial_.data(), payload + 8, partial_filled_);
  assembling_ = true;
}

bool ShmRing::take_fragment(const uint8_t* payload, uint32_t size, bool last, uint64_t seq, uint64_t len,
                            Message& out) {
  if (!assembling_ || seq != partial_seq_) corrupt("fragment without its first part");
  if (partial_filled_ + size > partial_.size()) corrupt("fragments longer than the message");
  std::memcpy(partial_.data() + partial_filled_, payload, size);
  partial_filled_ += size;
  advance(len);
  if (!last) return false;
  if (partial_filled_ != partial_.size()) corrupt("fragments shorter than the message");
  assembling_ = false;
  out.owned = std::move(partial_);
  out.data = out.owned.data();
  out.size = out.owned.size();
  out.seq = seq;
  next_seq_ = seq + 1;
  return true;
}

// ---- cleanup of segments whose creator died before every reader attached ----

namespace {
// Whether the ring named `entry` (a /dev/shm entry) is a ring whose writer process is gone. Anything it cannot
// read as a ring is left alone.
bool node_ring_writer_dead(const char* entry) {
  std::string name = std::string("/") + entry;
  int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  struct stat st {};
  bool dead = false;
  if (fstat(fd, &st) == 0 && size_t(st.st_size) >= sizeof(ShmRing::Layout)) {
    void* p = mmap(nullptr, sizeof(ShmRing::Layout), PROT_READ, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) {
      auto* l = static_cast<const ShmRing::Layout*>(p);
      dead = l->magic.load(std::memory_order_acquire) == kMagic && l->writer_pid > 0 &&
             !process_alive(l->writer_pid, l->writer_start_time);
      munmap(p, sizeof(ShmRing::Layout));
    }
  }
  ::close(fd);
  return dead;
}
}  // namespace

int ShmRing::reap_stale_segments() noexcept {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  const uint64_t own_ns = pid_namespace();
  while (dirent* e = readdir(dir)) {
    unsigned long long ns = 0, start = 0;
    int pid = 0;
    if (std::sscanf(e->d_name, "hotloop-node-%llu-", &ns) == 1) {  // named by its node: its header says whose
      if (own_ns != 0 && ns == own_ns && node_ring_writer_dead(e->d_name)) {
        std::string name = std::string("/") + e->d_name;
        if (shm_unlink(name.c_str()) == 0) ++removed;
      }
      continue;
    }
    if (std::sscanf(e->d_name, "hotloop-%llu-%d-%llu-", &ns, &pid, &start) != 3) continue;
    // A pid means something only in the namespace that issued it: a segment from another PID namespace (a
    // container sharing /dev/shm) or of unknown origin is never proven dead here.
    if (own_ns == 0 || ns != own_ns || process_alive(pid, start)) continue;
    std::string name = std::string("/") + e->d_name;
    if (shm_unlink(name.c_str()) == 0) ++removed;
  }
  closedir(dir);
  return removed;
}

}  // namespace hotloop
