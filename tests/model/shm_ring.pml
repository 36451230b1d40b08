/* shm_ring.pml: a Promela model of ShmRing's publish / release handshake and of its two doorbells
 * (csrc/hotloop/shm_ring.cpp, with the Doorbell and wait_any park path it uses), checked exhaustively by
 * tests/test_model_check.py.
 *
 * One writer writes M messages of one or two cells each (chosen freely at every message) into a ring of CAP
 * cells; two readers read every message. A cell stands for 8 bytes, a record's first cell for its 16-byte header.
 * A record never wraps: when the tail is too short the writer first writes a pad record, as put_record() does.
 * With 2-cell records in a 5-cell ring (the code caps a record at a quarter of the ring) the ring fills, pads
 * and wraps within three messages, which keeps the exhaustive search small.
 * Claims:
 *   - no torn read: the writer never writes a cell that a reader has not released (a ghost assertion at every
 *     cell write), and every cell a reader reads holds the value written for the sequence it expects;
 *   - in order, none lost or duplicated: each reader gets sequences 0, 1, ..., M-1 exactly;
 *   - no lost wake-up on either doorbell: every run is finite (bounded messages; a sleeper leaves the futex only
 *     after the word changed), so a reader parked on "data" or the writer parked on "space" with nobody left to
 *     wake it shows up as an invalid end state, which fails the check.
 *
 * Memory orders: write_pos is stored seq_cst and loaded seq_cst by ReaderSource::ready(); read_pos is stored
 * seq_cst by set_position() and loaded seq_cst by slowest_reader_pos(); both doorbells are rung with
 * ring_if_parked(), whose correctness needs exactly those seq_cst accesses. The acquire load in readable() is
 * also modelled as an interleaving step: it is used only on the reader's fast path (a positive answer, after
 * which acquire suffices to see the record); the decision to sleep is taken on ready()'s seq_cst load. Each
 * side's private copy of its own position (ShmRing::pos_) is the model's write_pos / read_pos[r]: only that
 * side stores to it.
 *
 * Mutants (each must make the verification fail):
 *   -DBROKEN_SPACE_RECHECK  the writer's park on the space doorbell skips the re-check after announce().
 *   -DBROKEN_DATA_RECHECK   a reader's park on the data doorbell skips the re-check after announce().
 *   -DBROKEN_RELEASE_ORDER  a reader advances its read position before it has read the record's payload.
 *   -DBROKEN_FASTEST_READER the writer takes the fastest reader's position, not the slowest, as the floor.
 */

#define CAP   5      /* Layout::capacity, in cells */
#define M     3      /* messages the writer writes */
#define NR    2      /* readers */

#define WHOLE 1      /* kWhole */
#define PAD   5      /* kPad */

/* The segment. */
byte write_pos;                 /* Layout::write_pos (absolute, in cells) */
byte read_pos[NR];              /* ReaderSlot::read_pos */
byte val[CAP];                  /* the bytes of each cell: sequence + 1 of the record that wrote it (0: never) */
byte kind[CAP];                 /* RecordHeader::kind of a record starting at this cell */
byte rlen[CAP];                  /* its length in cells (kRecordHeader + align8(size)) */

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
 * is min(write_pos, each reader's read_pos), one seq_cst load of a reader slot per step (write_pos is the
 * writer's own variable). Dead temporaries are reset to keep the state space small. */
inline has_space() {
  atomic {
    floor = write_pos;
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
    ok = (write_pos + need - floor <= CAP)
  }
}

/* ShmRing::wait_for_space(need). No shutdown, deadline or dead readers: the loop ends only with room.
 * wait_any()'s first check_all() and its spin phase only repeat the has_space() check just made. */
inline wait_for_space() {
  if
  :: write_pos + need - floor <= CAP -> skip        /* the cached floor (reader_floor_) says there is room */
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

/* ShmRing::write() of M messages of one or two cells, each by put_record(kWhole, ...). */
proctype Writer() {
  byte seq = 0;            /* next_seq_ */
  byte floor = 0;          /* reader_floor_ */
  byte rec, pos, tail, need, seen, p;
  bool ok;
  do
  :: seq == M -> break
  :: else ->
     if                                  /* the message's record length: kRecordHeader + align8(size) */
     :: rec = 1
     :: rec = 2
     fi;
     /* put_record() */
     pos = write_pos;
     tail = CAP - pos % CAP;
     if
     :: tail < rec -> need = tail + rec  /* a record never wraps: room for a pad over the tail, and the record */
     :: else -> need = rec
     fi;
     wait_for_space();
     if
     :: tail < rec ->                    /* the pad, published only with its record */
        atomic { write_cell(pos, seq + 1); kind[pos % CAP] = PAD; rlen[pos % CAP] = tail };
        pos = pos + tail
     :: else -> skip
     fi;
     atomic { write_cell(pos, seq + 1); kind[pos % CAP] = WHOLE; rlen[pos % CAP] = rec };   /* the header */
     if                                  /* the payload memcpy */
     :: rec == 2 -> atomic { write_cell(pos + 1, seq + 1); kind[(pos + 1) % CAP] = 0; rlen[(pos + 1) % CAP] = 0 }
     :: else -> skip
     fi;
     atomic { write_pos = pos + rec; pos = 0; tail = 0; need = 0; rec = 0 };   /* write_pos.store(seq_cst) */
     data_ring_if_parked();              /* data_bell.ring_if_parked() */
     seq++
  od
}

/* ---- readers ---- */

/* ShmRing::set_position(pos_ + n) (from release() and read()'s pad skip):
 * read_pos.store(seq_cst); space_bell.ring_if_parked() */
inline set_position(n) {
  read_pos[r] = read_pos[r] + (n);
  space_ring_if_parked()
}

/* wait_readable(): readable(), then wait_any(&ReaderSource) whose ready() is write_pos != read_pos (its first
 * check_all() and spin phase repeat the readable() check just made). */
inline wait_readable() {
  if
  :: write_pos != read_pos[r] -> skip               /* readable() */
  :: else ->
     do                                             /* park_once() until it returns a ready mask */
     :: true ->
        data_parked++;                              /* announce() */
        seen = data_seq;                            /* sequence() */
#ifndef BROKEN_DATA_RECHECK
        if
        :: write_pos != read_pos[r] -> atomic { seen = 0; data_parked-- }; break   /* check_all(); retract() */
        :: else -> skip
        fi;
#endif
        if                                          /* park(seen) = futex::wait(&seq_, seen) */
        :: atomic { data_seq == seen -> data_queued[r] = true; seen = 0 };
           !data_queued[r]                          /* asleep until a wake  @data_woken */
        :: atomic { data_seq != seen -> seen = 0 }  /* EAGAIN */
        fi;
        if
        :: write_pos != read_pos[r] -> data_parked--; break   /* check_bells(); ~ParkGuard: retract() */
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
        atomic {                                    /* published = write_pos - pos_; memcpy(&h, rec) */
          pos = read_pos[r];
          assert(write_pos - pos <= CAP);           /* read()'s own check: "more than a ring ahead" */
          k = kind[pos % CAP]; l = rlen[pos % CAP]; s = val[pos % CAP];
          assert(s == next + 1);                    /* the header of the record (or pad) we expect */
          assert(l >= 1 && l <= write_pos - pos);   /* read()'s own check: "runs past what was published" */
          s = 0
        };
        if
        :: k == PAD -> atomic { k = 0; pos = 0 }; set_position(l); l = 0   /* skip the pad, read on */
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
  fi
}

init {
  atomic {
    run Writer();
    run Reader(0);
    run Reader(1)
  }
}
