"""Liveness of the ranks and completion of collectives, with a timeout that names lost ranks.

A JAX collective whose peer died or hung blocks inside XLA with no timeout of its own. So
every collective is completed off the caller's thread: a completion thread waits for the
result arrays and fulfils the collective's torch Future, and a monitor fails the Future when
the deadline passes. The error names the ranks at fault, found from two pieces of state every
rank publishes in torch's store (the TCPStore of ``init_process_group``):

* a heartbeat counter, bumped every ``HEARTBEAT_S`` by a daemon thread: a rank whose counter
  stops moving is dead (or its process is frozen);
* how many collectives it has launched in each group: a live rank that launched fewer than
  this one never reached the collective (hung, or on another code path).

If the store itself is unreachable, its host is gone: that is rank 0 unless the launcher
hosts the store (torchrun's agent), which is said in the message. So that the survivors can
still diagnose, a failing store host lingers before it exits until each live peer has posted
that it finished its own diagnosis (at most ``LINGER_S``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
import time

import jax

HEARTBEAT_S = 1.0
# Exit status of a process stopped because a collective blocked in dispatch past its deadline.
LOST_PEER_EXIT = 3
# Longest a failing store host keeps the store up for its peers' diagnoses (each takes
# 2.5 heartbeats, and the peers' deadlines pass at slightly different times).
LINGER_S = 10.0


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete: some peer rank died or hung."""


class Health:
    """Per-process heartbeat publisher and lost-rank diagnosis over a torch Store."""

    def __init__(self, store, rank: int, world_ranks, process_hooks: bool = True):
        """``process_hooks``: also name lost ranks from the process's excepthook and leave the
        JAX world in order at exit (what a rank does; off for a Health on its own)."""
        self.store = store
        self.rank = rank
        self.world_ranks = list(world_ranks)
        self.launched: dict[str, int] = {}  # group name -> collectives launched
        self._beats = 0
        self.faulty: list[int] = []  # ranks the last diagnosis found dead or hung
        self._stop = threading.Event()
        self._publish()
        threading.Thread(target=self._beat, name="tpu-heartbeat", daemon=True).start()
        if process_hooks:
            self._install_excepthook()
            atexit.register(self._orderly_exit)
            _current["health"] = self

    def _orderly_exit(self):
        """Leave the JAX world in order at a normal exit (runs before JAX's own handler).

        With the JAX service in recoverable mode its shutdown barrier no longer waits, so
        rank 0 (which hosts the service) could close it while a peer still disconnects, and
        that peer aborts. Every other rank shuts its JAX client down first and says so in the
        store; rank 0 waits for them, then exits normally.
        """
        import datetime

        import jax

        if len(self.world_ranks) < 2 or _exiting_after_failure["yes"]:
            return
        self.stop()
        wait = datetime.timedelta(seconds=60)
        try:
            if self.rank != self.world_ranks[0]:
                jax.distributed.shutdown()
                self.store.set(f"down/{self.rank}", "1")
            else:
                self.store.wait([f"down/{r}" for r in self.world_ranks[1:]], wait)
        except Exception as error:  # a peer is gone: nothing left to leave in order
            print(f"tpu_train.distributed: disorderly exit ({error})", file=sys.stderr)

    def _install_excepthook(self):
        """Name the lost rank when a transport error escapes to the top of the program.

        A peer's death can surface first where the program reads a value computed from a
        collective's result (``loss.item()``), as a bare JAX "connection reset" error.
        """
        previous = sys.excepthook

        def hook(kind, value, traceback):
            previous(kind, value, traceback)
            if kind is not CollectiveTimeoutError and _is_transport_error(value):
                print(f"{CollectiveTimeoutError.__name__}: "
                      f"{self.diagnose('', self.world_ranks, 'a collective')}",
                      file=sys.stderr, flush=True)
                _exit_without_jax_shutdown()

        sys.excepthook = hook

    def _publish(self):
        state = ";".join(f"{g}={n}" for g, n in self.launched.items())
        self.store.set(f"hb/{self.rank}", f"{self._beats}|{state}")

    def _beat(self):
        while not self._stop.wait(HEARTBEAT_S):
            self._beats += 1
            try:
                self._publish()
            except Exception:  # the store host is gone; diagnosis reports it when needed
                return

    def stop(self):
        self._stop.set()

    def _read(self, ranks):
        seen = {}
        for r in ranks:
            if not self.store.check([f"hb/{r}"]):
                seen[r] = None  # never published: it did not even start
                continue
            beats, _, state = self.store.get(f"hb/{r}").decode().partition("|")
            groups = dict(item.split("=") for item in state.split(";") if item)
            seen[r] = (int(beats), {g: int(n) for g, n in groups.items()})
        return seen

    def diagnose(self, group: str, ranks, what: str) -> str:
        """One sentence naming the ranks (global numbering) that made ``what`` fail."""
        message = self._diagnose(group, ranks, what)
        with contextlib.suppress(Exception):  # the store host may be gone: nothing to tell
            self.store.set(f"diagnosed/{self.rank}", "1")
        return message

    def linger_as_store_host(self):
        """Keep the store up until live peers have diagnosed (see the module docstring). The
        heartbeat goes on meanwhile: a peer whose diagnosis spans this wait must not find the
        store host's counter stopped and name it lost beside the rank that is."""
        if self.rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return
        waiting = [r for r in self.world_ranks if r != self.rank and r not in self.faulty]
        deadline = time.monotonic() + LINGER_S
        while waiting and time.monotonic() < deadline:
            try:
                waiting = [r for r in waiting if not self.store.check([f"diagnosed/{r}"])]
            except Exception:
                return
            time.sleep(0.1)

    def _diagnose(self, group: str, ranks, what: str) -> str:
        others = [r for r in ranks if r != self.rank]
        mine = self.launched.get(group, 0)
        try:
            first = self._read(others)
        except Exception as error:
            host = "the launcher's agent" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") \
                == "True" else "rank 0"
            return (f"{what} failed on rank {self.rank}: the rendezvous store hosted by {host} "
                    f"is unreachable ({type(error).__name__}); rank 0 is lost")
        time.sleep(2.5 * HEARTBEAT_S)
        try:
            second = self._read(others)
        except Exception:  # the store's host left meanwhile (it diagnosed first): judge
            second = None  # by the first reading alone
        if second is None:
            behind = [r for r in others if first[r] is not None and group
                      and first[r][1].get(group, 0) < mine]
            return (f"{what} failed on rank {self.rank}: rank(s) {behind or 'unknown'} did not "
                    f"reach collective #{mine} of group {group}; rank 0 (the store host) "
                    f"has since exited")
        dead = [r for r in others if first[r] is None or second[r] is None
                or second[r][0] == first[r][0]]
        self.faulty = dead
        if dead:
            return (f"{what} failed on rank {self.rank}: lost rank(s) {dead} (no heartbeat "
                    f"for {2.5 * HEARTBEAT_S:.1f} s: the process died or froze)")
        behind = [r for r in others if group and second[r][1].get(group, 0) < mine]
        self.faulty = behind
        if behind:
            return (f"{what} failed on rank {self.rank}: rank(s) {behind} are alive but did "
                    f"not reach collective #{mine} of group {group} (hung or on another code "
                    f"path)")
        return (f"{what} failed on rank {self.rank}: every peer is alive and reached it; the "
                f"transport failed or the job is too slow for the timeout "
                f"(set TPU_TRAIN_COLLECTIVE_TIMEOUT)")


def _is_transport_error(error) -> bool:
    text = str(error).lower()
    return type(error).__name__ == "JaxRuntimeError" and any(
        word in text for word in ("gloo", "connection", "collective", "peer", "socket"))


_exiting_after_failure = {"yes": False}
_current: dict = {}  # "health": this process's Health, once a tpu process group exists


def _exit_without_jax_shutdown():
    # jax.distributed's own exit handler waits for every peer at a shutdown barrier, which a
    # lost peer never reaches: leave at once, with a failing status.
    _exiting_after_failure["yes"] = True
    _exit_after_failure(1)


def _exit_after_failure(status: int):
    sys.stdout.flush()
    sys.stderr.flush()
    if "health" in _current:
        _current["health"].linger_as_store_host()
    os._exit(status)


class Completer:
    """Fulfils collectives' Futures when their arrays are ready, or fails them at a deadline.

    Some PJRT clients (the CPU one, for collectives) execute inside the dispatching call, so a
    lost peer can block the caller's thread itself: :meth:`dispatching` guards that stretch,
    and a collective still stuck there at its deadline ends the process with the diagnosis
    (status ``LOST_PEER_EXIT``): no Python exception can reach a thread blocked in XLA.
    """

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._pending: dict[int, tuple] = {}
        self._dispatching: dict[int, tuple] = {}
        self._failed = False
        self._lock = threading.Lock()
        self._ids = 0
        threading.Thread(target=self._complete, name="tpu-collectives", daemon=True).start()
        threading.Thread(target=self._monitor, name="tpu-collective-monitor", daemon=True).start()

    def submit(self, future, arrays, result, deadline_s: float, on_timeout, finish=None):
        """Set ``future``'s result to ``result`` (after ``finish()``) once ``arrays`` are
        ready; after ``deadline_s`` set the error ``on_timeout()`` returns instead."""
        with self._lock:
            self._ids += 1
            ident = self._ids
            self._pending[ident] = (future, time.monotonic() + deadline_s, on_timeout)
        self._queue.put((ident, arrays, result, finish, on_timeout))

    @contextlib.contextmanager
    def dispatching(self, deadline_s: float, on_timeout):
        with self._lock:
            self._ids += 1
            ident = self._ids
            self._dispatching[ident] = (time.monotonic() + deadline_s, on_timeout)
        try:
            yield
        finally:
            with self._lock:
                self._dispatching.pop(ident, None)

    def _fail(self, future, message):
        if not self._failed:
            self._failed = True
            _exiting_after_failure["yes"] = True
            atexit.register(_exit_without_jax_shutdown)
        future.set_exception(CollectiveTimeoutError(message))

    def _settle(self, ident):
        with self._lock:
            return self._pending.pop(ident, None)

    def _complete(self):
        while True:
            ident, arrays, result, finish, on_timeout = self._queue.get()
            error = None
            try:
                jax.block_until_ready(arrays)
                if finish is not None:
                    finish()
            except Exception as exc:  # a peer vanished under the transport
                error = exc
            entry = self._settle(ident)
            if entry is None:
                continue  # the monitor already failed it
            if error is None:
                entry[0].set_result(result)
            else:
                self._fail(entry[0], f"{on_timeout()} [transport error: {error}]")

    def _monitor(self):
        while True:
            time.sleep(0.2)
            now = time.monotonic()
            with self._lock:
                late = [i for i, (_, deadline, _) in self._pending.items() if deadline < now]
                stuck = [d for d in self._dispatching.values() if d[0] < now]
            for ident in late:
                entry = self._settle(ident)
                if entry is not None:
                    self._fail(entry[0], entry[2]())
            if stuck:
                message = stuck[0][1]()
                with self._lock:  # it may have completed while we diagnosed
                    still = any(d[0] < now for d in self._dispatching.values())
                if still:
                    print(f"{CollectiveTimeoutError.__name__}: {message}", file=sys.stderr,
                          flush=True)
                    _exit_after_failure(LOST_PEER_EXIT)
