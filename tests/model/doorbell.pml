/* doorbell.pml: a Promela model of the Doorbell wake-up protocol (csrc/hotloop/doorbell.h, doorbell.cpp,
 * futex.cpp, and the park path of wait_any.cpp), checked exhaustively by tests/test_model_check.py.
 *
 * Claim: no lost wake-up. Two waiters each wait, through wait_any(), for every publish of two producers; one
 * producer rings with Doorbell::ring(), the other with Doorbell::ring_if_parked() after a seq_cst publish (the
 * way ShmRing publishes). Waiter 1 may also watch a descriptor, and then sleeps in ppoll() on an eventfd the
 * ring writes to (Doorbell::watch, wake_parked; the sliced mixed-wait backend). A waiter asleep while a publish
 * it has not consumed exists, with nothing left to wake it, is a lost wake-up. Every run of this model is
 * finite (the producers publish a bounded number of times and a sleeper wakes only after something changed),
 * so the claim is the safety check "no invalid end state": a run that ends with a waiter still blocked in
 * futex::wait() or ppoll() fails, and each waiter asserts, when it finishes, that it consumed every publish.
 *
 * Memory orders: every access the protocol relies on is seq_cst in the code (announce, sequence, the
 * increment and the parked() load in ring / ring_if_parked, the ShmRing publish and ready() load), so one
 * interleaving of atomic steps models them. retract() is a release fetch_sub: as a read-modify-write it still
 * reads the latest parked_ value, and a stale higher parked() only costs an extra wake.
 *
 * Mutants (each must make the verification fail):
 *   -DBROKEN_RECHECK        park_once() skips the re-check of the sources after announce().
 *   -DBROKEN_PUBLISH_ORDER  the ring_if_parked() producer's parked() load passes its publish, which is what a
 *                           release (not seq_cst) publish store allows (x86 store buffer: StoreLoad reordering).
 *   -DBROKEN_WATCH_LATE     park_once() registers its eventfd (watch()) after the re-check, not before announce().
 */

#define NW    2            /* waiters */
#define PUBS  2            /* publishes per producer */
#define TOTAL (2 * PUBS)   /* publishes in all: two producers */

byte published;            /* the data the waiters watch: a count of publishes (Source::ready(): != consumed) */
byte seq;                  /* Doorbell::seq_, the futex word */
byte parked;               /* Doorbell::parked_ */
bool queued[NW];           /* the futex's wait queue: waiter w sleeps inside futex::wait() */
byte watchers;             /* Doorbell::watchers_ */
bool watching[NW];         /* the process-local registry: waiter w's eventfd is registered (watch()) */
bool efd[NW];              /* waiter w's eventfd counter is non-zero (readable) */

/* futex::wake(&seq_, INT_MAX): wakes every thread queued on the word. */
inline futex_wake_all() {
  atomic { queued[0] = false; queued[1] = false }
}

/* Doorbell::wake_parked(): the futex wake, then, when watchers_ != 0, an eventfd write to every registered
 * watcher (under the registry mutex, so one step). */
inline wake_parked() {
  futex_wake_all();
  if
  :: watchers != 0 -> atomic { efd[0] = efd[0] || watching[0]; efd[1] = efd[1] || watching[1] }
  :: else -> skip
  fi
}

/* Doorbell::ring(): seq_.fetch_add(1, seq_cst); if (parked_.load(seq_cst) != 0) wake_parked(). */
inline ring() {
  seq++;
  if
  :: parked != 0 -> wake_parked()
  :: else -> skip
  fi
}

/* Doorbell::ring_if_parked(): if (parked_.load(seq_cst) != 0) { seq_.fetch_add(1, seq_cst); wake_parked(); } */
inline ring_if_parked() {
  if
  :: parked != 0 -> seq++; wake_parked()
  :: else -> skip
  fi
}

/* A producer publishes (the data store, then a ring) PUBS times.
 * p == 0: a release publish followed by ring() (any release store is enough for ring()).
 * p == 1: a seq_cst publish followed by ring_if_parked() (ShmRing::put_record, ShmRing::release). */
proctype Producer(byte p) {
  byte n = 0;
  bool saw_parked;
  do
  :: n == PUBS -> break
  :: else ->
     if
     :: p == 0 ->
        published++;              /* the publish */
        ring()
     :: else ->
#ifdef BROKEN_PUBLISH_ORDER
        saw_parked = (parked != 0);   /* ring_if_parked()'s load, performed before the store below is visible */
        published++;
        if
        :: saw_parked -> seq++; wake_parked()
        :: else -> skip
        fi
#else
        published++;              /* the publish: a seq_cst store */
        ring_if_parked()
#endif
     fi;
     n++
  od
}

/* A waiter: wait_any() on one doorbell source with no deadline, then consumes what is published, until it has
 * consumed every publish. Waiter 1 may also watch a file descriptor (never readable here) in any wait_any()
 * call: park_once() then registers a fresh eventfd with the doorbell and sleeps in ppoll() instead of the futex. */
proctype Waiter(byte w) {
  byte got = 0;    /* publishes consumed */
  byte seen;       /* park_once(): seen[0] = sequence() */
  bool fds;        /* this wait_any() call also waits on a descriptor */
  do
  :: got == TOTAL -> break
  :: else ->
     /* wait_any(): check_all() first (the spin and yield phases only repeat this check). */
     if
     :: published != got -> skip
     :: else ->
        if
        :: w == 1 -> fds = true
        :: true -> fds = false
        fi;
        /* The park phase: park_once() until it returns a ready mask. */
        do
        :: true ->
#ifndef BROKEN_WATCH_LATE
           if
           :: fds -> atomic { efd[w] = false; watching[w] = true; watchers++ }   /* eventfd(); watch(efd) */
           :: else -> skip
           fi;
#endif
           parked++;                                   /* Doorbell::announce() (seq_cst fetch_add) */
           seen = seq;                                 /* Doorbell::sequence() */
#ifndef BROKEN_RECHECK
           if
           :: published != got ->                      /* set.check_all(): ready, return the mask */
              seen = 0;
              goto retract_ready                       /* ~ParkGuard */
           :: else -> skip
           fi;
#endif
#ifdef BROKEN_WATCH_LATE
           if
           :: fds -> atomic { efd[w] = false; watching[w] = true; watchers++ }   /* watch() after the re-check */
           :: else -> skip
           fi;
#endif
           if
           :: fds ->
              seen = 0;
              efd[w]                                   /* ppoll() until the eventfd is readable  @ppoll_woken */
           :: else ->
              /* Doorbell::park(seen) = futex::wait(&seq_, seen): compares and queues atomically (the futex
               * hash bucket lock), returns EAGAIN at once when the word already differs. */
              if
              :: atomic { seq == seen -> queued[w] = true; seen = 0 };
                 !queued[w]                            /* asleep until futex::wake() dequeues it  @woken */
              :: atomic { seq != seen -> seen = 0 }    /* EAGAIN: a ring landed after sequence() */
              fi
           fi;
           if
           :: published != got -> goto retract_ready   /* return set.check_bells() */
           :: else -> skip
           fi;
           parked--;                                   /* ~ParkGuard: retract() */
           if                                          /* unwatch(efd); close(efd) */
           :: fds -> atomic { watching[w] = false; watchers--; efd[w] = false }
           :: else -> skip
           fi
           /* wait_any() loops to another park_once() */
        od;
retract_ready:
        parked--;                                      /* ~ParkGuard: retract() */
        if
        :: fds -> atomic { watching[w] = false; watchers--; efd[w] = false; fds = false }   /* unwatch, close */
        :: else -> skip
        fi
     fi;
     got = published                                   /* the caller consumes what it found */
  od;
  assert(got == TOTAL)
}

init {
  atomic {
    run Producer(0);
    run Producer(1);
    run Waiter(0);
    run Waiter(1)
  }
}
