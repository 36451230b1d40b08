// ShmRing litmus: the ring's publish/consume pairs between threads of one process, where ThreadSanitizer sees
// them (test_shm_ring.cpp's readers are other processes, which it does not). A writer publishes messages whose
// every byte follows from their sequence number; readers check each one in ring memory (the zero-copy view)
// before releasing it. What a missing or misplaced barrier would show (shm_ring.h, "Ordering"):
//   - a reader that sees a header word before the payload, sequence or cleared next header it publishes: wrong
//     bytes, a wrong sequence, or a stale header taken for a new record (the ring is small: it laps every few
//     dozen messages, with pad records and skipped tails);
//   - a writer that reuses bytes a reader has not released: the in-place check fails;
//   - a lost wake-up between ring_if_parked and a parked reader or writer (every side parks at once): a read or
//     write that times out.
// Plain, ASan and TSan builds: the counts are sized to run in about a second (TSan: a quarter of the messages).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "hotloop/shm_ring.h"
#include "test_util.h"

namespace hotloop {
namespace {

constexpr int64_t kTimeout = 20'000'000'000;  // a lost wake-up fails the test instead of hanging it
constexpr uint64_t kCapacity = 4096;           // laps every few dozen messages

// Message `seq`: mostly small (a record or a pad at the ring's end), every 16th larger than a quarter of the
// ring (fragmented into several records).
size_t size_of(uint64_t seq) { return seq % 16 == 15 ? 1500 + seq % 300 : (seq * 37) % 240; }
uint8_t byte_of(uint64_t seq, size_t i) { return uint8_t((seq * 0x9E3779B97F4A7C15ull) >> (8 * (i % 8))) ^ uint8_t(i); }

std::vector<uint8_t> body_of(uint64_t seq) {
  std::vector<uint8_t> b(size_of(seq));
  for (size_t i = 0; i < b.size(); ++i) b[i] = byte_of(seq, i);
  return b;
}

// Reads `count` messages; returns "" or what was wrong with the first bad one (the reader then leaves the ring,
// so that the writer is not held back and the test ends).
std::string check_all(ShmRing& r, uint64_t count, WaitPolicy policy);
std::string read_all(ShmRing& r, uint64_t count, WaitPolicy policy) {
  std::string error;
  try {
    error = check_all(r, count, policy);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!error.empty()) r.close();
  return error;
}

std::string check_all(ShmRing& r, uint64_t count, WaitPolicy policy) {
  ShmRing::Message m;
  for (uint64_t seq = 0; seq < count; ++seq) {
    if (!r.read(m, kTimeout, policy)) return "timed out waiting for message " + std::to_string(seq);
    if (m.seq != seq) return "message " + std::to_string(seq) + " came with sequence " + std::to_string(m.seq);
    if (m.size != size_of(seq)) {
      return "message " + std::to_string(seq) + " has " + std::to_string(m.size) + " bytes, not " +
             std::to_string(size_of(seq));
    }
    for (size_t i = 0; i < m.size; ++i) {  // in place: the record stays unreleased until the next read()
      if (m.data[i] != byte_of(seq, i)) {
        return "message " + std::to_string(seq) + " byte " + std::to_string(i) + " is wrong (" +
               (m.owned.empty() ? "in ring memory" : "assembled from fragments") + ")";
      }
    }
  }
  r.release();
  return "";
}

// Writes `count` messages with `writer_policy` while `policies.size()` reader threads check them; returns "" or
// what went wrong (each reader's first error, or the writer's).
std::string run(uint64_t count, const std::vector<WaitPolicy>& policies, WaitPolicy writer_policy) {
  const uint32_t n = uint32_t(policies.size());
  ShmRing w = ShmRing::create(RingGeometry{kCapacity, n, 0, DeadReaderPolicy::kRaise});
  std::vector<ShmRing> readers;
  // on the writer's mapping: TSan matches accesses by address (a second mapping would hide every pair from it)
  for (uint32_t rank = 0; rank < n; ++rank) readers.push_back(ShmRing::attach_in_process(w, rank));
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (uint32_t rank = 0; rank < n; ++rank) {
    threads.emplace_back([&, rank] { errors[rank] = read_all(readers[rank], count, policies[rank]); });
  }
  std::string out;
  try {
    for (uint64_t seq = 0; seq < count; ++seq) {
      std::vector<uint8_t> b = body_of(seq);
      ShmRing::Part part{b.data(), b.size()};
      w.write(&part, 1, kTimeout, writer_policy);  // throws QueueTimeout on a lost space wake-up
    }
  } catch (const std::exception& e) {
    out = std::string("writer: ") + e.what();
    w.close();  // the readers end with ClosedError
  }
  for (auto& t : threads) t.join();
  for (uint32_t rank = 0; rank < n; ++rank) {
    if (!errors[rank].empty()) out += (out.empty() ? "" : "; ") + ("reader rank " + std::to_string(rank) + ": ") + errors[rank];
  }
  return out;
}

uint64_t message_count() { return (test::under_tsan() ? 8000 : 40000) * uint64_t(test::stress_scale()); }

// No side ever parks (they yield between looks, for up to a minute), so no doorbell is rung: the header word's
// release/acquire is the only writer -> reader edge, and the read position's the only reader -> writer one. A
// relaxed header store, or a relaxed read_pos store, is a data race that TSan reports here (the doorbell's
// seq_cst increments would otherwise hide it: they order everything before them too).
TEST(RingLitmus, PublishAndReuseWithoutDoorbells) {
  const WaitPolicy yield_only(0, 60'000'000'000, false);
  EXPECT_EQ(run(message_count(), {yield_only, yield_only}, yield_only), "");
}

// Every side parks at once: each message and each freed byte range goes through a doorbell's announce /
// ring_if_parked pair; a lost wake-up times out.
TEST(RingLitmus, NoLostWakeUpWhenEverySideParks) {
  const WaitPolicy park_at_once(0, 0, false);
  EXPECT_EQ(run(message_count() / 4, {park_at_once, park_at_once, WaitPolicy()}, park_at_once), "");
}

// try_write (the binding's GIL-held path) publishes through the same header-word store: the same check with a
// writer that never waits, only retries (messages too large for one record, every 16th, are refused by
// try_write: the writer sends them with write()).
TEST(RingLitmus, TryWritePublishesWholeRecords) {
  const uint64_t count = message_count();
  ShmRing w = ShmRing::create(RingGeometry{kCapacity, 1, 0, DeadReaderPolicy::kRaise});
  ShmRing r = ShmRing::attach_in_process(w, 0);
  std::string error;
  std::atomic<bool> reader_done{false};
  std::thread reader([&] {
    error = read_all(r, count, WaitPolicy());
    reader_done.store(true, std::memory_order_release);
  });
  std::string write_error;
  try {
  for (uint64_t seq = 0; seq < count;) {
    std::vector<uint8_t> b = body_of(seq);
    ShmRing::Part part{b.data(), b.size()};
    if (size_of(seq) > kCapacity / 4 - 16) {
      WaitPolicy wp;
      w.write(&part, 1, kTimeout, wp);
      ++seq;
    } else if (w.try_write(&part, 1)) {
      ++seq;
    } else if (reader_done.load(std::memory_order_acquire)) {
      break;  // the reader gave up: its error says why
    } else {
      std::this_thread::yield();  // full: the reader frees space
    }
  }
  } catch (const std::exception& e) {
    write_error = e.what();
    w.close();
  }
  reader.join();
  EXPECT_EQ(write_error, "");
  EXPECT_EQ(error, "");
}

}  // namespace
}  // namespace hotloop
