"""Shared by the fuzz harnesses: libFuzzer defaults, the finding type, and the "known finding" switch.

A known finding is a defect that a harness recognises and tolerates (it is reported in tests/fuzz/README.md and
waits for a fix in a file the fuzz harnesses do not own), so a long run goes on looking for new ones. Set
HOTLOOP_FUZZ_STRICT=1 to fail on known findings too; tests/test_fuzz.py replays their reproducers that way
(expected to fail until they are fixed).
"""

from __future__ import annotations

import os
import resource
import sys

STRICT = os.environ.get("HOTLOOP_FUZZ_STRICT", "") not in ("", "0")

# libFuzzer flags added when the command line does not set them: a hang is an input slower than 10 s, and the
# process may not grow past 3 GiB resident (torch alone takes a few hundred MiB).
DEFAULT_FLAGS = {"-timeout": "10", "-rss_limit_mb": "3072"}


class Finding(AssertionError):
    """An input broke the target's contract (raised out of TestOneInput: atheris saves the input as a crash)."""


def known(what: str) -> None:
    """A known finding: tolerated unless HOTLOOP_FUZZ_STRICT is set."""
    if STRICT:
        raise Finding(f"known finding (HOTLOOP_FUZZ_STRICT): {what}")


UNRAISABLE: list[str] = []  # exceptions Python could only print (destructors, callbacks): a harness fails on them


def _record_unraisable(u) -> None:
    UNRAISABLE.append(f"{u.exc_type.__name__}: {u.exc_value} ({u.err_msg or 'in'} {u.object!r})")


sys.unraisablehook = _record_unraisable


def peak_rss_mb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def libfuzzer_argv(argv: list[str]) -> list[str]:
    given = {a.split("=", 1)[0] for a in argv[1:] if a.startswith("-")}
    return [argv[0], *(f"{k}={v}" for k, v in DEFAULT_FLAGS.items() if k not in given), *argv[1:]]


def run_atheris(test_one_input) -> None:
    import atheris

    atheris.Setup(libfuzzer_argv(sys.argv), test_one_input)
    atheris.Fuzz()
