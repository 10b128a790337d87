"""``streamer.transport.rendezvous``: the file and ``tcp://HOST:PORT`` forms of the store plane's
rendezvous, and the refusal of a loopback address offered to a rank on another host."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from formats.errors import UsageError
from streamer.transport.rendezvous import FileRendezvous, TcpRendezvous, rendezvous_from


def test_forms_are_parsed_and_bad_ones_refused(tmp_path: Path) -> None:
    assert isinstance(rendezvous_from(tmp_path / "rdv"), FileRendezvous)
    t = rendezvous_from("tcp://10.0.0.5:29600")
    assert isinstance(t, TcpRendezvous) and (t.host, t.port) == ("10.0.0.5", 29600) and str(t) == "tcp://10.0.0.5:29600"
    assert (TcpRendezvous.parse("tcp://[::1]:80").host) == "::1"
    for bad in ("tcp://host", "tcp://host:0", "tcp://host:x", "tcp://:80", "tcp://h:70000"):
        with pytest.raises(UsageError, match="expected tcp://HOST:PORT"):
            rendezvous_from(bad)


def test_a_file_names_the_store_and_its_host(tmp_path: Path) -> None:
    rdv = FileRendezvous(tmp_path / "rdv")
    rdv.publish(None, "10.0.0.5:1234", 3)
    first, second, at = rdv.read(time.monotonic() + 1).splitlines()
    assert first == "tcp://10.0.0.5:1234/3" and second == f"host={socket.gethostname()}"
    assert abs(float(at.removeprefix("at=")) - time.time()) < 60  # when: a rank that started later ignores older
    rdv.retire(None)
    assert not (tmp_path / "rdv").exists() and rdv.read(time.monotonic() + 0.1) == ""


def test_a_loopback_address_from_another_host_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "rdv").write_text("tcp://127.0.1.1:1/0\nhost=some-other-node\n")
    with pytest.raises(UsageError) as e:
        FileRendezvous(tmp_path / "rdv").dial(time.monotonic() + 2, 2, None, "the receiver job's store")
    assert "receiver rank 0 (host some-other-node) offers the loopback address 127.0.1.1" in str(e.value)
    assert "SHARDSTREAM_MASTER_ADDR" in str(e.value)


def test_tcp_rendezvous_serves_publishes_and_dials() -> None:
    from streamer.transport.torch_dist import free_port

    rdv = TcpRendezvous("127.0.0.1", free_port())
    store, address = rdv.serve(10)
    try:
        client, text = None, ""
        with pytest.raises(Exception, match="timed out"):  # nothing published yet: a sender waits
            rdv.dial(time.monotonic() + 0.5, 0.5, None, "the receiver job's store")
        rdv.publish(store, address, 2)
        client, text = rdv.dial(time.monotonic() + 10, 10, None, "the receiver job's store")
        assert text == f"{address}/2"
        rdv.retire(store)
        assert not client.check(["rdv/epoch"])
    finally:
        del store
    with pytest.raises(UsageError, match="cannot serve the store there"):
        TcpRendezvous("192.0.2.1", free_port()).serve(2)  # TEST-NET-1: not an address of this host


def test_a_replica_stays_registered_with_the_trainers_registry_until_it_retires() -> None:
    """``tcp://HOST:PORT@NAME``: the replica's rank 0 serves its own store and keeps its entry in
    the registry that trainer rank 0 serves at HOST:PORT: entered once the registry is up (not
    before), read by the replica's other ranks and the trainer, entered again into a restarted
    trainer's empty registry, and withdrawn at retire."""
    from streamer.transport.registry import registered
    from streamer.transport.rendezvous import RegistryRendezvous
    from streamer.transport.torch_dist import free_port

    port = free_port()
    rdv = rendezvous_from(f"tcp://127.0.0.1:{port}@a")
    assert isinstance(rdv, RegistryRendezvous) and str(rdv) == f"tcp://127.0.0.1:{port}@a"
    store, address = rdv.serve(10)  # the replica's own store, on a free port
    rdv.publish(store, address, 3)  # no registry yet: the registrar keeps trying
    with pytest.raises(Exception, match="timed out.*registry"):
        rdv.dial(time.monotonic() + 0.5, 0.5, None, "replica a's store")
    registry, _ = TcpRendezvous("127.0.0.1", port).serve(10)  # the trainer comes up
    deadline = time.monotonic() + 10
    while "a" not in registered(registry) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert registered(registry)["a"].split("\n")[0] == f"tcp://{address}/3"
    client, text = rdv.dial(time.monotonic() + 10, 10, None, "replica a's store")
    assert text == f"{address}/3"
    client.set("x", "1")
    assert store.get("x") == b"1"  # the entry names the replica's own store
    del registry  # the trainer dies; a new one serves an empty registry at the same address
    registry, _ = TcpRendezvous("127.0.0.1", port).serve(10)
    deadline = time.monotonic() + 10
    while "a" not in registered(registry) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "a" in registered(registry)
    rdv.retire(store)  # every rank joined: withdrawn, so a trainer listing now does not join it again
    assert registered(registry) == {}


def test_a_replica_offers_the_address_that_reaches_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``gethostbyname(hostname)`` is 127.0.1.1 on many machines, which a trainer on another host
    refuses. A replica whose registry is at a routable address offers the address of its interface
    toward the registry instead, which the trainer's check accepts; ``SHARDSTREAM_MASTER_ADDR``
    still wins, and with the registry on loopback (one host) the host's own address stands."""
    from helpers import this_hosts_address

    from streamer.transport.rendezvous import RegistryRendezvous, check_reachable
    from streamer.transport.store import open_store
    from streamer.transport.torch_dist import free_port, host_address

    ip = this_hosts_address()
    if ip is None:
        pytest.skip("this host has no route off it: no non-loopback address to offer")
    monkeypatch.delenv("SHARDSTREAM_MASTER_ADDR", raising=False)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    assert host_address() == host_address(toward="127.0.0.1") == "127.0.1.1"
    assert host_address(toward=ip) == ip
    store, address = RegistryRendezvous(ip, free_port(), "a").serve(10)
    try:
        host = address.rsplit(":", 1)[0]
        assert host == ip
        check_reachable(host, "the-trainers-host", "the registry")  # a trainer elsewhere accepts it
        client = open_store(host, int(address.rsplit(":", 1)[1]), server=False, timeout=10)
        client.set("x", "1")  # and the store answers there
        assert store.get("x") == b"1"
    finally:
        del store
    monkeypatch.setenv("SHARDSTREAM_MASTER_ADDR", "10.1.2.3")
    assert host_address(toward=ip) == "10.1.2.3"


def test_replicas_rendezvous_names() -> None:
    from streamer.transport.rendezvous import replica_rendezvous

    assert replica_rendezvous("tcp://10.0.0.5:29600", "a") == "tcp://10.0.0.5:29600@a"
    assert replica_rendezvous("/shared/rdv", "b") == "/shared/rdv@b"
    with pytest.raises(UsageError, match="replica name"):
        replica_rendezvous("tcp://10.0.0.5:29600", "a@b")
    with pytest.raises(UsageError, match="expected tcp://HOST:PORT"):
        replica_rendezvous("tcp://10.0.0.5", "a")
