"""The lost-rank diagnosis's own state, without processes: the store host's heartbeat while it
keeps the store up for its peers."""

from tpu_train.distributed import health


class _Store:
    """The part of a torch Store that the diagnosis uses, in a dict."""

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.values[key]

    def check(self, keys):
        return all(k in self.values for k in keys)


def test_a_lingering_store_host_keeps_beating_so_its_peers_do_not_count_it_lost(monkeypatch):
    """Rank 0 keeps the store up after its own failure until its peers have diagnosed; a peer
    whose two heartbeat readings span that wait must see rank 0's counter move (it names only
    the rank that is lost, not rank 0 beside it)."""
    monkeypatch.setattr(health, "HEARTBEAT_S", 0.02)
    monkeypatch.setattr(health, "LINGER_S", 0.5)
    store = _Store()
    host = health.Health(store, 0, [0, 1, 2], process_hooks=False)
    host.faulty = [1]  # its own diagnosis found rank 1 lost
    try:
        before = int(store.get("hb/0").decode().partition("|")[0])
        host.linger_as_store_host()  # rank 2 never posts its diagnosis: the whole 0.5 s
        after = int(store.get("hb/0").decode().partition("|")[0])
    finally:
        host.stop()
    assert after > before + 5
