// ShmRing: a one-writer, many-reader broadcast ring of messages in named POSIX shared memory. Every reader
// receives every message, in order.
//
// Segment (layout 3): a header (magic, layout version, geometry, writer pid, state), two doorbells ("data": rung
// by the writer after publishing; "space": rung by a reader after releasing), one cache line per reader (its
// read position, pid, attach state), then `capacity` bytes of records. Positions count bytes since creation; a
// record starts at an 8-byte boundary, at least a header's length before the ring's end, and never wraps (a
// pad record covers a shorter tail; a tail too short for a header is skipped). Record: a header word
// {uint32 size, uint32 kind} (0: nothing published there yet), the uint64 message sequence, then the payload.
// A message larger than a record may be (capacity / 4) is split into first / middle / last fragments carrying
// the same sequence.
//
// Handshake. There is no shared write position: a reader waits on the header word at its own position, so a
// message costs the readers the record's own cache lines and nothing else. The writer writes the sequence and
// payload, clears the header word where the next record will start (so that a reader arriving there never
// takes the last lap's header for a new one), then stores the header word (seq_cst, for the doorbell): one
// store publishes a record (a pad record is published after the record that follows it, so a reader never
// finds a pad alone). The writer keeps the slowest reader's position as it last read it and reads the readers'
// slots only when that says the ring is full; the room it needs reaches the next record's header word.
//
// Writer: write(parts) copies the parts into the ring (the one copy), waiting with the wait policy while the
// slowest live reader is a full ring behind; the timeout error names that reader. A reader whose process died
// is detected as soon as the writer finds the ring full (then every ~500 ms while it waits), and either
// raises (DeadPeerError) or is dropped
// (DeadReaderPolicy::kDrop: its cursor no longer holds the writer back). Readers: read() returns the next
// message: a zero-copy view of ring memory for a message in one record (valid until release()), or an owned
// buffer assembled from its fragments. A reader waiting for data notices shutdown (ClosedError) and a dead
// writer (DeadPeerError) within ~500 ms, or at once where it can watch the writer's pidfd (process_exit.h: a
// reader of another process, on a kernel with pidfd_open and a park backend other than "sliced"). A wait opens
// the pidfd at its second park, kFirstParkNs in, and closes it as it returns: a wait ended by the next message
// parks on the doorbell alone, and no descriptor outlives a wait. Messages published before either are still
// delivered.
//
// Trust: the segment is 0600 and shared with the queue's own processes only, yet a faulty reader can scribble
// on it. Each side keeps its own copy of the geometry (capacity, readers, limits, writer identity) and of its
// own position, taken at create/attach, and validates every value it reads from shared memory (positions,
// record headers) against them: a corrupted segment raises an error naming the queue, never reads or writes
// outside the mapping. Record sizes are 32-bit, so rings are at most 4 GiB (larger messages are fragmented).
//
// Ordering (reviewed for weakly ordered CPUs, aarch64; tests/cpp/test_ring_litmus.cpp runs the pairs between
// threads, where TSan checks them, and tests/model/ has Spin models of the protocol):
//   - Publishing a record: the payload and sequence (plain stores) and the cleared next header word (relaxed) come
//     before the header word's seq_cst store, a release (STLR on aarch64); a reader loads the word with acquire
//     (or seq_cst) before it reads the record, so a nonzero word brings all of them, and the next header word it
//     reaches through this record is at least the cleared one. A pad is published by its own seq_cst store after
//     its record's: a reader that acquires the pad sees the record's header.
//   - Reusing space: a reader's reads of a record (in ring memory, until release()) come before its seq_cst
//     store of read_pos, a release; the writer loads read_pos with seq_cst (acquire) before it writes over those
//     bytes. reader_floor_, the writer's copy of the slowest position, is stale only in the safe direction
//     (positions grow).
//   - Wake-ups: both doorbells are rung with ring_if_parked, so each needs the Dekker pair of doorbell.h: data
//     bell: header word store (seq_cst) then parked_ load, against announce() then ReaderSource::ready()'s
//     seq_cst load of the word; space bell: read_pos store (seq_cst) then parked_ load, against announce() then
//     slowest_reader_pos()'s seq_cst loads. The acquire loads elsewhere (readable(), read()'s spin) are not part
//     of a pair and need no more.
//   - state, cancelled_ and a closing reader's dropped: release stores followed by a full ring() (a seq_cst
//     increment: no ring_if_parked pair needed).
//   - Attaching: a reader claims its slot (attached, seq_cst CAS), stores start_time, then pid (release); the
//     writer's liveness check reads pid (acquire) and only then start_time, and takes pid 0 for a reader still
//     attaching. (It used to read both in unspecified order: a reader between its claim and its pid store looked
//     dead, and was dropped or reported.)
//
// Threads: one thread at a time reads (or writes) through one ShmRing. cancel_waits() may be called from any
// thread: every wait of this object, running or later, ends with ClosedError (the segment and the other
// processes are untouched); the binding uses it to close a ring that another thread is waiting on.
//
// Lifetime: the creator sets the segment up; a copy inherited by a forked child neither shuts the ring down
// nor detaches its reader when destroyed there (it only unmaps); attach() maps it by name and checks magic, version, geometry and
// rank. The name is unlinked as soon as every reader has attached (so a later SIGKILL leaves nothing in
// /dev/shm), or by the writer's destructor; reap_stale_segments() removes segments whose creator died before
// that point.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "hotloop/doorbell.h"
#include "hotloop/errors.h"
#include "hotloop/owned_bytes.h"
#include "hotloop/source.h"
#include "hotloop/wait_any.h"
#include "hotloop/wait_policy.h"

namespace hotloop {

enum class DeadReaderPolicy : uint32_t { kRaise = 0, kDrop = 1 };
struct ReaderSlot;

struct RingGeometry {
  uint64_t capacity = 1 << 24;   // data bytes, a power of two >= 4096
  uint32_t n_readers = 1;
  uint64_t max_message = 0;      // bytes; 0 = no limit beyond what fits in memory
  DeadReaderPolicy dead_reader = DeadReaderPolicy::kRaise;
};

class ShmRing {
 public:
  static constexpr uint32_t kLayoutVersion = 3;  // 3: a header word per record instead of a write position
  static constexpr uint64_t kMaxCapacity = uint64_t(1) << 32;  // a record's 32-bit size field covers the ring
  static constexpr uint64_t kRecordHeaderBytes = 16;

  // Writer: creates the segment. `name` must start with '/'; empty picks a fresh "/hotloop-<pid>-<n>-<rand>".
  static ShmRing create(const RingGeometry& g, std::string name = "");
  // Reader `rank` (0 <= rank < n_readers): maps the segment and marks the rank attached.
  // Throws BadHandleError (no such segment, not a ring, other layout or geometry, rank taken or out of range).
  static ShmRing attach(const std::string& name, uint32_t rank, uint64_t expect_capacity, uint32_t expect_readers);
  // Reader `rank` in the writer's own process, on the writer's mapping instead of a second one (the writer must
  // outlive it). For tests: ThreadSanitizer matches accesses by address, so a second mapping of the segment hides
  // every publish/consume pair from it (tests/cpp/test_ring_litmus.cpp).
  static ShmRing attach_in_process(const ShmRing& writer, uint32_t rank);

  ShmRing(ShmRing&& other) noexcept;
  ShmRing& operator=(ShmRing&& other) = delete;
  ShmRing(const ShmRing&) = delete;
  ~ShmRing();

  const std::string& name() const noexcept { return name_; }
  bool is_writer() const noexcept { return rank_ < 0; }
  int rank() const noexcept { return rank_; }
  uint64_t capacity() const noexcept { return geo_.capacity; }
  uint32_t n_readers() const noexcept { return geo_.n_readers; }
  uint32_t attached_readers() const noexcept;
  bool all_attached() const noexcept { return attached_readers() == n_readers(); }
  // Writer: waits (wait policy; attaching readers ring the space doorbell) until every reader has attached.
  // Returns false on timeout.
  bool wait_all_attached(int64_t timeout_ns, WaitPolicy& policy, const WaitHooks* hooks = nullptr);
  // Unlinks the name if still linked (idempotent). Mapped peers keep working.
  void unlink() noexcept;
  bool shut_down() const noexcept;
  // Any thread: ends every wait of this object, running or later, with ClosedError (see "Threads" above).
  void cancel_waits() noexcept;
  // Any thread: this side leaves the queue now (a writer shuts it down and unlinks it; a reader stops holding
  // the writer back) and its waits are cancelled. The memory stays mapped until destruction, so a thread still
  // inside a call finishes safely (with ClosedError). Idempotent; the destructor calls it. Does nothing in a
  // copy inherited through fork (that side belongs to the parent).
  void close() noexcept;
  bool waits_cancelled() const noexcept { return cancelled_.load(std::memory_order_acquire); }

  // ---- writer ----
  // Writes one message made of the concatenated parts. timeout_ns < 0: no deadline. Throws QueueTimeout
  // (naming the slowest reader), DeadPeerError, ClosedError (after shutdown), std::length_error (> max_message).
  // `hooks` (may be null) slice the wait (the Python binding checks for Ctrl-C there).
  struct Part {
    const void* data;
    size_t size;
  };
  void write(const Part* parts, size_t n, int64_t timeout_ns, WaitPolicy& policy, const WaitHooks* hooks = nullptr);
  // Marks the ring shut down and wakes every parked reader (they get ClosedError once drained).
  void shutdown() noexcept;
  // Marks the ring abandoned: the writer lost its own source (a node's relay lost the queue's writer). Parked
  // readers wake and get DeadPeerError once drained, as if the writer had died.
  void abandon() noexcept;
  // Closes every reader slot not attached yet: it no longer holds the writer back, and attaching it fails. A
  // ring sized for more readers than come (a node's relay: one slot per remote rank of the queue) calls it once
  // its readers are in. Returns how many slots it closed.
  uint32_t close_unattached() noexcept;
  // Writes a message only if it fits one record and the ring has room now (never waits); false otherwise.
  // For callers that can write without releasing a lock (the Python binding keeps the GIL for it).
  bool try_write(const Part* parts, size_t n);
  uint64_t messages_written() const noexcept { return next_seq_; }

  // ---- reader ----
  // A message: either a view into the ring (`owned` empty; valid until release()) or an owned buffer.
  struct Message {
    const uint8_t* data = nullptr;
    size_t size = 0;
    OwnedBytes owned;
    uint64_t seq = 0;
  };
  // Whether a message (or a pad to skip) is waiting: one atomic load, no system call.
  bool readable() const noexcept;
  // Waits for the next message; false on timeout. Throws ClosedError (shut down and drained), DeadPeerError
  // (writer died and nothing left), std::runtime_error on a corrupt record. With a nonzero timeout and a policy
  // that spins, it first looks at the record kQuickChecks more times (a pause between) before it reads the
  // clock and waits: a message that lands by then is taken like one that was there (no wait is recorded).
  bool read(Message& out, int64_t timeout_ns, WaitPolicy& policy, const WaitHooks* hooks = nullptr);
  // About 0.1-1 us of pauses: longer than a round trip between two cores, shorter than a wait's set-up and
  // end (clock reads, wait_any's bookkeeping), which would otherwise sit on the reply's path.
  static constexpr int kQuickChecks = 16;
  // Waits until a message is readable (true) or the timeout passes (false); throws as read() does.
  bool wait(int64_t timeout_ns, WaitPolicy& policy, const WaitHooks* hooks = nullptr);
  // Releases the message returned by the last read() (frees its ring space for the writer).
  void release() noexcept;
  uint64_t messages_read() const noexcept { return next_seq_; }

  // The reader's wait_any source: ready when readable() or the ring is shut down.
  Source& source() noexcept;

  // Removes /dev/shm/hotloop-* segments made in this PID namespace whose creating process no longer exists
  // (a node relay's ring, "hotloop-node-<pid namespace>-...", by the writer pid in its header).
  // Returns how many.
  static int reap_stale_segments() noexcept;
  // The identity of this process's PID namespace (the inode of /proc/self/ns/pid), as segment names carry it.
  static uint64_t pid_namespace() noexcept;

 public:
  struct Layout;  // the segment's header (shm_ring.cpp)
  static constexpr uint32_t kAbandoned = 2;  // Layout::state of an abandoned ring (1: shut down)

 private:
  class ReaderSource;
  ShmRing() = default;

  // This side's own copy of the segment's geometry and identity, taken at create/attach (see "Trust").
  struct Geometry {
    uint64_t capacity = 0;
    uint32_t n_readers = 0;
    uint64_t max_message = 0;
    DeadReaderPolicy dead_reader = DeadReaderPolicy::kRaise;
    int32_t writer_pid = 0;
    uint64_t writer_start_time = 0;
  };

  Layout* layout_ = nullptr;
  size_t map_size_ = 0;
  Geometry geo_;
  uint8_t* data_ = nullptr;       // the records, at the offset this side computed
  ReaderSlot* slots_ = nullptr;   // the reader slots, likewise
  uint64_t pos_ = 0;  // always a record's start. Writer: the write position (its own only); reader: its read
                      // position (its slot holds a copy for the writer)
  std::atomic<bool> cancelled_{false};
  std::string name_;
  int rank_ = -1;
  int owner_pid_ = 0;  // the process that created/attached it: a forked copy only unmaps on destruction
  bool owns_mapping_ = true;  // false for attach_in_process(): the writer's mapping, unmapped by the writer
  std::atomic<bool> linked_{false};
  std::atomic<bool> closed_{false};
  uint64_t next_seq_ = 0;     // writer: next sequence to write; reader: next expected
  uint64_t pending_release_ = 0;  // reader: bytes to advance on release()
  uint64_t reader_floor_ = 0;     // writer: the slowest reader's position when last read (never ahead of it)
  ReaderSource* source_ = nullptr;
  bool watch_writer_exit_ = false;  // reader: a long wait watches the writer's pidfd (see above)
  OwnedBytes partial_;  // reader: a fragmented message being assembled
  uint64_t partial_seq_ = 0;
  uint64_t partial_filled_ = 0;
  bool assembling_ = false;

  void wait_for_space(uint64_t need, int64_t deadline, WaitPolicy& policy, const WaitHooks* hooks);
  uint64_t slowest_reader_pos(int* slowest_rank) noexcept;
  // wait_for_space(): drops or reports the dead readers that hold back a record ending at `end`; throws
  // QueueTimeout naming the slowest reader (the writer at `pos`).
  void check_readers(uint64_t end);
  [[noreturn]] void throw_full(uint64_t pos);
  // Where the writer puts a record of `rec` bytes: its start (after a pad record over a too-short tail), the
  // next record's start, and how many bytes from the write position must be free (up to the next record's
  // header word, which is cleared when this record is published).
  struct Placement {
    uint64_t start, next, need;
  };
  Placement place(uint64_t rec) const noexcept;
  void put_record(uint32_t kind, uint64_t seq, const Part* parts, size_t n, size_t skip, size_t size,
                  int64_t deadline, WaitPolicy& policy, const WaitHooks* hooks);
  // The header word of the record starting at `pos` (0: nothing published there yet).
  std::atomic_ref<uint64_t> header_word(uint64_t pos) const noexcept {
    return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(data_ + (pos & (geo_.capacity - 1))));
  }
  // `pos`, or the start of the next lap when the ring's tail from `pos` is too short for a record header.
  static uint64_t next_header(uint64_t pos, uint64_t capacity) noexcept {
    const uint64_t tail = capacity - (pos & (capacity - 1));
    return tail < kRecordHeaderBytes ? pos + tail : pos;
  }
  // `now`: the time if the caller has just read it, else -1.
  bool wait_readable(int64_t deadline, WaitPolicy& policy, const WaitHooks* hooks, int64_t now = -1);
  void advance(uint64_t n) noexcept;
  // read(): takes the record at the read position, whose header word is `word`. Returns true when it completed a
  // message (in `out`), false when the next record must be read (after a pad record or a fragment not the last).
  bool take_record(uint64_t word, Message& out);
  // A fragmented message's first part (starts assembling it) and its later parts (`last`: the message is whole).
  void take_first_fragment(const uint8_t* payload, uint32_t size, uint64_t seq);
  bool take_fragment(const uint8_t* payload, uint32_t size, bool last, uint64_t seq, uint64_t len, Message& out);
  void throw_if_cancelled() const;
  [[noreturn]] void corrupt(const std::string& what) const;
  static ShmRing mapped(Layout* l, size_t size, std::string name, int rank, const Geometry& g);
  // attach(): claims reader slot `rank` of the mapped segment `l` (throws BadHandleError, leaving the mapping).
  static ShmRing claim_slot(Layout* l, size_t size, const std::string& name, uint32_t rank, uint64_t expect_capacity,
                            uint32_t expect_readers, bool owns_mapping);
  // attach(): why reader `rank` cannot attach to the mapped segment `l` of a ring of `capacity` bytes and
  // `n_readers` readers ("" when it can, up to claiming its slot); *start: the slot's read position.
  static std::string attach_refusal(const Layout* l, uint32_t rank, uint64_t capacity, uint32_t n_readers,
                                    uint64_t* start);
};

}  // namespace hotloop
