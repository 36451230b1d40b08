"""CurveZMQ keys and the ZAP handler that admits them.

``new_keys`` makes a queue's keys: a server pair and one client pair per remote rank, fresh per queue, so a client
key names one rank of one queue. ``ZapHandler`` (one per process, run by ``context.ProcessZmq``, in a thread of
its own) admits, per writer's ZAP domain, exactly that queue's client keys, and answers each connection's
User-Id with its rank; it must never raise, since its one thread serves every queue of the process.
"""

from __future__ import annotations

import logging

import zmq
import zmq.auth.thread
import zmq.utils.z85

ZAP_DOMAIN = "hotloop"

log = logging.getLogger("hotloop.queue.remote")


def new_keys(ranks: range) -> tuple[tuple[bytes, bytes], tuple[tuple[bytes, bytes], ...]]:
    """Fresh CurveZMQ keys for one queue: the server pair and one client pair per remote rank (z85 text)."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE security; install a pyzmq wheel built with libsodium "
                           "(the PyPI wheels are)")
    return zmq.curve_keypair(), tuple(zmq.curve_keypair() for _ in ranks)


class ZapHandler(zmq.auth.thread.ThreadAuthenticator):
    """The process's ZAP handler: admits, per writer (its ZAP domain), the client keys of that queue's remote ranks,
    and names each connection by its rank (keys are fresh per queue, so a key names one rank of one queue)."""

    def __init__(self, ctx: zmq.Context):
        super().__init__(ctx, log=log.getChild("zap"))
        self._domains: dict[str, dict[bytes, int]] = {}  # ZAP domain -> {z85 public key -> rank}
        self._ranks: dict[bytes, int] = {}  # every admitted key -> its rank

    def admit(self, domain: str, client_keys: dict[bytes, int]) -> None:
        self._ranks.update(client_keys)
        self._domains[domain] = client_keys
        self.configure_curve_callback(domain, credentials_provider=self)

    def forget(self, domain: str) -> None:
        for key in self._domains.pop(domain, {}):
            self._ranks.pop(key, None)
        self.credentials_providers.pop(domain, None)

    def callback(self, domain: str, key: bytes) -> bool:  # the credentials provider's hook
        return key in self._domains.get(domain, ())

    def curve_user_id(self, client_public_key: bytes) -> str:
        # .get: the writer may have closed (forget) between callback() and here; an exception would end the
        # handler's thread, which serves every queue of the process. Rank -1 matches no rank topic.
        return str(self._ranks.get(zmq.utils.z85.encode(client_public_key), -1))
