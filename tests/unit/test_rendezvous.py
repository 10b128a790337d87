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
    first, second = rdv.read(time.monotonic() + 1).splitlines()
    assert first == "tcp://10.0.0.5:1234/3" and second == f"host={socket.gethostname()}"
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
