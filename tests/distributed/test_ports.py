"""Rendezvous ports: drawn below the ephemeral range, and the JAX coordinator's address agreed
through torch's store when its default port is taken (in-process, with torch's HashStore)."""

import datetime
import logging
import socket

import pytest
import torch.distributed as dist

from tpu_train.distributed import init, ports

# Binds and probes loopback ports, the rendezvous of the multi-process runs.
pytestmark = pytest.mark.multiprocess


@pytest.fixture
def master_port(monkeypatch):
    port = ports.free_port_pair()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv(init.COORDINATOR_ENV, raising=False)
    return port


def _listening(port):
    sock = socket.socket()
    # As gRPC binds: a drawn port whose earlier connection is still in TIME_WAIT is free.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def _store():
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    return store


def test_free_port_pair_is_drawn_below_the_ephemeral_range_and_free():
    low, _ = ports.ephemeral_port_range()
    for _ in range(20):
        port = ports.free_port_pair()
        assert ports.LOWEST_DRAWN <= port and port + 1 < low
        assert ports.port_is_free(port) and ports.port_is_free(port + 1)
    # a span of exactly two ports yields its first
    assert ports.free_port_pair((port, port + 1)) == port


def test_a_listening_socket_makes_its_port_busy_on_the_wildcard_too():
    port = ports.free_port()
    with _listening(port):  # bound to loopback only: JAX's [::] bind would still fail
        assert not ports.port_is_free(port)
        with pytest.raises(RuntimeError, match="no 2 free consecutive port"):
            ports.free_port_pair((port, port + 1), attempts=3)
    assert ports.port_is_free(port)
    with pytest.raises(ValueError, match="fewer than 2 ports"):
        ports.free_port_pair((port, port))


def test_default_coordinator_port_is_announced_to_the_other_ranks(master_port):
    store = _store()
    address = init.agree_on_coordinator(0, store)
    assert address == f"127.0.0.1:{master_port + 1}"
    assert init.agree_on_coordinator(1, store) == address


def test_a_taken_default_port_is_replaced_by_a_drawn_one(master_port, caplog):
    store = _store()
    with _listening(master_port + 1), caplog.at_level(logging.WARNING):
        address = init.agree_on_coordinator(0, store)
    host, _, port = address.rpartition(":")
    assert host == "127.0.0.1" and int(port) != master_port + 1 and ports.port_is_free(int(port))
    assert init.agree_on_coordinator(1, store) == address
    assert f"port {master_port + 1} (MASTER_PORT+1) is in use" in caplog.text


def test_other_ranks_wait_for_rank_zero_within_the_stores_timeout(monkeypatch):
    """Rank 0 alone reads MASTER_PORT: the others take the address it announces."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv(init.COORDINATOR_ENV, raising=False)
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=0.2))
    with pytest.raises(Exception, match="[Tt]imeout|timed out"):
        init.agree_on_coordinator(1, store)
    store.set(init.COORDINATOR_KEY, "10.0.0.1:1234")
    assert init.agree_on_coordinator(1, store) == "10.0.0.1:1234"


@pytest.mark.parametrize("value", ["10.0.0.2", "10.0.0.2:x", ":8477", "10.0.0.2:70000"])
def test_a_malformed_fixed_address_is_a_one_line_error(monkeypatch, value):
    monkeypatch.setenv(init.COORDINATOR_ENV, value)
    with pytest.raises(init.DistributedInitError, match="is not host:port with a port below 65536"):
        init.agree_on_coordinator(0, _store())


@pytest.mark.parametrize("explicit", [True, False])
def test_a_taken_fixed_port_is_a_one_line_error_on_rank_zero(master_port, monkeypatch, explicit):
    """A fixed address (TPU_TRAIN_JAX_COORDINATOR, or no store to announce another) is kept:
    rank 0 names the taken port before JAX's service fails to bind it."""
    busy = ports.free_port()
    if explicit:
        monkeypatch.setenv(init.COORDINATOR_ENV, f"127.0.0.1:{busy}")
    else:
        busy = master_port + 1
    store = _store() if explicit else None
    with _listening(busy):
        with pytest.raises(init.DistributedInitError, match=f"port {busy} for the JAX "
                           "coordinator .* is already in use on this host: choose a free port"):
            init.agree_on_coordinator(0, store)
        assert init.agree_on_coordinator(1, store) == f"127.0.0.1:{busy}"
