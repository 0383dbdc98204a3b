"""testing.ports: ports for local clusters and stand-ins come from below the kernel's ephemeral range (which
every outgoing connection draws from: CI lost a Serve proxy's port to one) and above Ray's worker ports."""
import socket

from spotfill.testing import ports


def test_ports_are_distinct_free_and_outside_what_the_kernel_and_ray_hand_out():
    got = ports.free_ports(20)
    assert len(set(got)) == 20
    low = ports._ephemeral_low()
    assert all(ports.LOW <= p < low for p in got), (got, low)
    for p in got:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_given(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "LOW", taken)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: taken + 2)    # the range: the taken one and one more
        assert ports.free_ports(1) == [taken + 1] or not ports.bindable("127.0.0.1", taken + 1)


def test_no_quiet_range_falls_back_to_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports.LOW)        # empty range
    got = ports.free_ports(3)
    assert len(set(got)) == 3 and all(p >= ports.LOW for p in got)
