/* shm_ring.pml: a Promela model of ShmRing's publish / release handshake (layout 3: a header word per record)
 * and of its two doorbells (csrc/hotloop/shm_ring.cpp, with the Doorbell and wait_any park path it uses),
 * checked exhaustively by tests/test_model_check.py.
 *
 * One writer writes M messages of one or two cells each (chosen freely at every message) into a ring of CAP
 * cells; two readers read every message. A cell stands for 8 bytes, a record's first cell for its 16-byte header
 * (its header word in kind[], the rest in val[] and rlen[]). There is no shared write position: a reader waits
 * on the header word at its own position (0: nothing published there yet). The writer writes the payload and
 * header, clears the header word where the next record will start, then publishes the record by storing its
 * header word. A record never wraps: when the tail is too short the writer first writes a pad record, published
 * after the record, as put_record() does. With 2-cell records in a 5-cell ring (the code caps a record at a
 * quarter of the ring) the ring fills, pads and wraps within three messages, which keeps the exhaustive search
 * small.
 * Claims:
 *   - no torn read: the writer never writes a cell that a reader has not released (a ghost assertion at every
 *     cell write, the cleared header word included), and every cell a reader reads holds the value written for
 *     the sequence it expects;
 *   - no stale record: a reader never takes a header word left from the last lap for a new record (every header
 *     it reads is its next sequence's, and once it has read all M messages nothing is readable at its position);
 *   - in order, none lost or duplicated: each reader gets sequences 0, 1, ..., M-1 exactly;
 *   - no lost wake-up on either doorbell: every run is finite (bounded messages; a sleeper leaves the futex only
 *     after the word changed), so a reader parked on "data" or the writer parked on "space" with nobody left to
 *     wake it shows up as an invalid end state, which fails the check.
 *
 * Memory orders: the header word is stored seq_cst by put_record() and loaded seq_cst by ReaderSource::ready();
 * read_pos is stored seq_cst by advance() and loaded seq_cst by slowest_reader_pos(); both doorbells are rung
 * with ring_if_parked(), whose correctness needs exactly those seq_cst accesses. The acquire load in read() and
 * readable() is also modelled as an interleaving step: a positive answer needs only acquire to see the record
 * (its payload, header and the cleared next word are written before the release); the decision to sleep is
 * taken on ready()'s seq_cst load. The cleared word is a relaxed store ordered by the publishing store after
 * it. Each side's private copy of its own position (ShmRing::pos_) is the model's wp / read_pos[r]: only that
 * side stores to it.
 *
 * Mutants (each must make the verification fail):
 *   -DBROKEN_SPACE_RECHECK  the writer's park on the space doorbell skips the re-check after announce().
 *   -DBROKEN_DATA_RECHECK   a reader's park on the data doorbell skips the re-check after announce().
 *   -DBROKEN_RELEASE_ORDER  a reader advances its read position before it has read the record's payload.
 *   -DBROKEN_FASTEST_READER the writer takes the fastest reader's position, not the slowest, as the floor.
 *   -DBROKEN_NO_CLEAR       the writer does not clear the next record's header word.
 *   -DBROKEN_CLEAR_LATE     the writer clears it after publishing the record, not before.
 *   -DBROKEN_CLEAR_UNRESERVED the room the writer waits for stops at the record's end, short of the next header
 *                           word that it clears.
 */

#define CAP   5      /* Layout::capacity, in cells */
#define M     3      /* messages the writer writes */
#define NR    2      /* readers */

#define WHOLE 1      /* kWhole */
#define PAD   5      /* kPad */

/* The segment. */
byte read_pos[NR];              /* ReaderSlot::read_pos */
byte val[CAP];                  /* the bytes of each cell: sequence + 1 of the record that wrote it (0: never) */
byte kind[CAP];                 /* the header word of a record starting at this cell: its kind (0: nothing yet) */
byte rlen[CAP];                 /* the rest of the header: the length in cells (kRecordHeader + align8(size)) */

/* Layout::data_bell and Layout::space_bell: Doorbell::seq_ and parked_, and each futex's wait queue. */
byte data_seq, data_parked;
bool data_queued[NR];
byte space_seq, space_parked;
bool space_queued;

/* ---- Doorbell ---- */

/* Doorbell::ring_if_parked() on the data doorbell: wake_parked() is futex::wake(&seq_, INT_MAX). */
inline data_ring_if_parked() {
  if
  :: data_parked != 0 -> data_seq++; atomic { data_queued[0] = false; data_queued[1] = false }
  :: else -> skip
  fi
}

inline space_ring_if_parked() {
  if
  :: space_parked != 0 -> space_seq++; space_queued = false
  :: else -> skip
  fi
}

/* ---- writer ---- */

/* wait_for_space()'s has_space lambda: reader_floor_ = slowest_reader_pos(); then compares. slowest_reader_pos()
 * is min(wp, each reader's read_pos), one seq_cst load of a reader slot per step (wp is the writer's own
 * variable). Dead temporaries are reset to keep the state space small. */
inline has_space() {
  atomic {
    floor = wp;
    p = read_pos[0];
#ifdef BROKEN_FASTEST_READER
    floor = p
#else
    if
    :: p < floor -> floor = p
    :: else -> skip
    fi
#endif
  };
  atomic {
    p = read_pos[1];
#ifdef BROKEN_FASTEST_READER
    if
    :: p > floor -> floor = p
    :: else -> skip
    fi;
#else
    if
    :: p < floor -> floor = p
    :: else -> skip
    fi;
#endif
    p = 0;
    ok = (wp + need - floor <= CAP)
  }
}

/* ShmRing::wait_for_space(need). No shutdown, deadline or dead readers: the loop ends only with room.
 * wait_any()'s first check_all() and its spin phase only repeat the has_space() check just made. */
inline wait_for_space() {
  if
  :: wp + need - floor <= CAP -> skip               /* the cached floor (reader_floor_) says there is room */
  :: else ->
     has_space();
     do
     :: ok -> ok = false; break
     :: else ->
        do                                           /* wait_any(&SpaceSource): park_once() until ready */
        :: true ->
           space_parked++;                           /* announce() */
           seen = space_seq;                         /* sequence() */
#ifndef BROKEN_SPACE_RECHECK
           has_space();                              /* check_all() after announcing */
           if
           :: ok -> atomic { seen = 0; space_parked-- }; break   /* return; ~ParkGuard: retract() */
           :: else -> skip
           fi;
#endif
           if                                        /* park(seen) = futex::wait(&seq_, seen) */
           :: atomic { space_seq == seen -> space_queued = true; seen = 0 };
              !space_queued                          /* asleep until a wake  @space_woken */
           :: atomic { space_seq != seen -> seen = 0 }   /* EAGAIN */
           fi;
           has_space();                              /* return set.check_bells() */
           space_parked--;                           /* ~ParkGuard: retract() */
           if
           :: ok -> break
           :: else -> skip
           fi
        od;
        has_space()                                  /* the loop's "if (has_space()) return" */
     od
  fi
}

/* A cell write (put_record's header store or memcpy): the ghost check that no reader still holds the cell. */
inline write_cell(at, v) {
  atomic {
    assert((at) < read_pos[0] + CAP && (at) < read_pos[1] + CAP);
    val[(at) % CAP] = v
  }
}

/* The store of 0 to the next record's header word: a cell write like any other (its bytes change, and whatever
 * the last lap left there, a header or payload, is gone). */
inline clear_word(at) {
  atomic { write_cell(at, 0); kind[(at) % CAP] = 0 }
}

/* ShmRing::write() of M messages of one or two cells, each by put_record(kWhole, ...). */
proctype Writer() {
  byte wp = 0;             /* pos_: the write position, always a record's start */
  byte seq = 0;            /* next_seq_ */
  byte floor = 0;          /* reader_floor_ */
  byte rec, start, next, tail, need, seen, p;
  bool ok;
  do
  :: seq == M -> break
  :: else ->
     if                                  /* the message's record length: kRecordHeader + align8(size) */
     :: rec = 1
     :: rec = 2
     fi;
     /* put_record(): place() */
     tail = CAP - wp % CAP;
     if
     :: tail < rec -> start = wp + tail  /* a record never wraps: a pad record covers the tail */
     :: else -> start = wp
     fi;
     next = start + rec;
#ifdef BROKEN_CLEAR_UNRESERVED
     need = next - wp;
#else
     need = next + 1 - wp;               /* up to the next record's header word, cleared below */
#endif
     wait_for_space();
     if                                  /* the payload memcpy */
     :: rec == 2 -> write_cell(start + 1, seq + 1)
     :: else -> skip
     fi;
#ifndef BROKEN_CLEAR_LATE
#ifndef BROKEN_NO_CLEAR
     clear_word(next);   /* the next record's header word: nothing yet */
#endif
#endif
     atomic { write_cell(start, seq + 1); rlen[start % CAP] = rec };   /* the header's sequence (and size) */
     kind[start % CAP] = WHOLE;          /* header_word(start).store(seq_cst): published */
#ifdef BROKEN_CLEAR_LATE
     clear_word(next);
#endif
     if
     :: start != wp ->                   /* the pad, published after its record */
        atomic { write_cell(wp, seq + 1); rlen[wp % CAP] = tail };
        kind[wp % CAP] = PAD
     :: else -> skip
     fi;
     atomic { wp = next; start = 0; next = 0; tail = 0; need = 0; rec = 0 };
     data_ring_if_parked();              /* data_bell.ring_if_parked() */
     seq++
  od
}

/* ---- readers ---- */

/* ShmRing::advance(n) (from release() and read()'s pad skip): read_pos.store(seq_cst);
 * space_bell.ring_if_parked(). (A tail too short for a header, which advance() also skips, has no cell here.) */
inline set_position(n) {
  read_pos[r] = read_pos[r] + (n);
  space_ring_if_parked()
}

/* wait_readable(): readable(), then wait_any(&ReaderSource) whose ready() is "the header word at read_pos is not
 * 0" (its first check_all() and spin phase repeat the readable() check just made). */
inline wait_readable() {
  if
  :: kind[read_pos[r] % CAP] != 0 -> skip           /* readable() */
  :: else ->
     do                                             /* park_once() until it returns a ready mask */
     :: true ->
        data_parked++;                              /* announce() */
        seen = data_seq;                            /* sequence() */
#ifndef BROKEN_DATA_RECHECK
        if
        :: kind[read_pos[r] % CAP] != 0 -> atomic { seen = 0; data_parked-- }; break   /* check_all(); retract() */
        :: else -> skip
        fi;
#endif
        if                                          /* park(seen) = futex::wait(&seq_, seen) */
        :: atomic { data_seq == seen -> data_queued[r] = true; seen = 0 };
           !data_queued[r]                          /* asleep until a wake  @data_woken */
        :: atomic { data_seq != seen -> seen = 0 }  /* EAGAIN */
        fi;
        if
        :: kind[read_pos[r] % CAP] != 0 -> data_parked--; break   /* check_bells(); ~ParkGuard: retract() */
        :: else -> data_parked--
        fi
     od
  fi
}

/* A reader: M calls of ShmRing::read(), each followed by the caller reading the zero-copy view. */
proctype Reader(byte r) {
  byte next = 0;           /* next_seq_ */
  byte pending = 0;        /* pending_release_ */
  byte pos, k, l, s, c, seen;
  do
  :: next == M -> break
  :: else ->
     /* read(): release() the previous message first */
     if
     :: pending != 0 -> set_position(pending); pending = 0
     :: else -> skip
     fi;
     do
     :: true ->
        wait_readable();
        atomic {                                    /* the header word (acquire), then the rest of the header */
          pos = read_pos[r];
          k = kind[pos % CAP]; l = rlen[pos % CAP]; s = val[pos % CAP];
          assert(s == next + 1);                    /* the header of the record (or pad) we expect, not a stale one */
          assert(l >= 1 && pos % CAP + l <= CAP);   /* read()'s own check: "runs past the ring's end" */
          s = 0
        };
        if
        :: k == PAD ->                              /* skip the pad (it ends the ring), read on */
           assert(pos % CAP + l == CAP);
           atomic { k = 0; pos = 0 }; set_position(l); l = 0
        :: k == WHOLE ->
           atomic {
             k = 0;
             next++;                                /* next_seq_ = h.seq + 1 */
             pending = l                            /* pending_release_ = len */
           };
           break
        :: else -> assert(false)                    /* corrupt record */
        fi
     od;
#ifdef BROKEN_RELEASE_ORDER
     set_position(pending); pending = 0;                 /* frees the record before its payload is read */
#endif
     /* The caller reads the view (valid until release()): every cell holds this message's value. */
     atomic {
       c = 0;
       do
       :: c < l -> assert(val[(pos + c) % CAP] == next); c++
       :: else -> break
       od;
       c = 0; l = 0; pos = 0
     }
  od;
  /* The next read() (or release()) frees the last message. */
  if
  :: pending != 0 -> set_position(pending)
  :: else -> skip
  fi;
  /* Nothing more was written, so nothing may look readable (a header word from the last lap would). */
  assert(kind[read_pos[r] % CAP] == 0)
}

init {
  atomic {
    run Writer();
    run Reader(0);
    run Reader(1)
  }
}
