"""The shaped-link benchmark's parts that need no root: rate arithmetic, the step calibration, the
namespace plan, the per-connection byte meter (on loopback) and the utilisation window."""

import time

import pytest

from benchmarks.link_rates import brief_scaled_rate_bps, calibrate_step_seconds, dp_matched_rate_bps, dp_need_bps
from benchmarks.link_sites import dp_threads
from benchmarks.netns import IFNAME_MAX, LinkPlan, link_bytes, tbf_burst_bytes


def test_brief_scaling_keeps_parameters_per_bit():
    assert brief_scaled_rate_bps(32_000_000_000) == pytest.approx(25e9)
    assert brief_scaled_rate_bps(443_776) == pytest.approx(443_776 * 25 / 32)


def test_dp_need_puts_the_transfer_in_the_idle_share_of_a_step():
    rate = dp_need_bps(bytes_each_way_per_step=1_000_000, step_seconds=0.5, utilisation=0.95)
    transfer = 1_000_000 * 8 / rate
    assert transfer / (0.5 + transfer) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="utilisation"):
        dp_need_bps(1, 1, utilisation=1.0)
    with pytest.raises(ValueError, match="step_seconds"):
        dp_need_bps(1, 0)


def test_matched_rate_is_the_briefs_fraction_of_dp_need():
    need = dp_need_bps(2_000_000, 0.2)
    # 25 Gbit/s against the 100-300 Gbit/s per-step data parallelism needs: about 1/6.9.
    assert dp_matched_rate_bps(2_000_000, 0.2) / need == pytest.approx(25 / (100 * 300) ** 0.5)


def test_the_step_is_calibrated_through_standard_training_s_own_step_with_a_rank_s_threads():
    import torch
    from infra.spec import parse_spec

    spec = parse_spec({"name": "calibrate", "islands": [
        {"name": "east", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2},
        {"name": "west", "learners": 2, "batch_size": 4, "seq_len": 16, "inner_steps": 1}],
        "model": {"layers": 1, "width": 16, "heads": 2}, "sync": {"rounds": 2},
        "data": {"corpora": [{"name": "text", "source": "files", "paths": ["unused/*.txt"]}]}})
    threads = torch.get_num_threads()
    try:
        seconds = calibrate_step_seconds(spec, repeats=2)
        assert torch.get_num_threads() == dp_threads(2)
    finally:
        torch.set_num_threads(threads)
    assert 0 < seconds < float("inf")


def test_burst_covers_ten_milliseconds_and_a_floor():
    assert tbf_burst_bytes(1e6) == 16 * 1024
    assert tbf_burst_bytes(1e9) == 1_250_000


def test_plan_names_fit_linux_and_stay_under_the_prefix():
    plan = LinkPlan.for_islands(["east", "west"], 50e6, tag="a1b2c3")
    assert [e.namespace for e in plan.ends] == ["arch-a1b2c3-east", "arch-a1b2c3-west"]
    assert all(len(e.device) <= IFNAME_MAX for e in plan.ends)
    assert plan.server.island == "east" and plan.exec_in("west") == ("ip", "netns", "exec", "arch-a1b2c3-west")
    tbf = [c for c in plan.setup_commands() if c[0] == "tc"]
    assert [c[c.index("dev") + 1] for c in tbf] == [e.device for e in plan.ends]  # both directions shaped
    assert all("50000000bit" in c for c in tbf)


def test_plan_refusals():
    with pytest.raises(ValueError, match="exactly two"):
        LinkPlan.for_islands(["east", "west", "north"], 50e6)
    with pytest.raises(ValueError, match="exactly two"):
        LinkPlan.for_islands(["east", "east"], 50e6)
    with pytest.raises(ValueError, match="tag"):
        LinkPlan.for_islands(["east", "west"], 50e6, tag="Bad-Tag")
    with pytest.raises(ValueError, match="rate"):
        LinkPlan.for_islands(["east", "west"], 100, tag="a1")
    plan = LinkPlan.for_islands(["east", "west"], 50e6, tag="a1")
    with pytest.raises(ValueError, match="already exists"):
        plan.validate({"arch-a1-west"})


def test_link_bytes_are_each_ends_transmissions():
    plan = LinkPlan.for_islands(["east", "west"], 50e6, tag="a1")
    before = {"east": {"tx_bytes": 100, "rx_bytes": 10}, "west": {"tx_bytes": 5, "rx_bytes": 95}}
    after = {"east": {"tx_bytes": 1100, "rx_bytes": 310}, "west": {"tx_bytes": 305, "rx_bytes": 1095}}
    assert link_bytes(before, after, plan) == {"east_to_west": 1000, "west_to_east": 300, "total": 1300,
                                               "total_seen_by_receivers": 1300}


def test_connection_bytes_count_one_peers_connections_to_a_port_from_the_kernel():
    import socket
    import threading

    from benchmarks.netns import SEGMENT_HEADER_BYTES, ConnectionBytes

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    sent, received = 200_000, 30_000

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            got = 0
            while got < received:
                got += len(conn.recv(65536))
            conn.sendall(b"x" * sent)
            conn.recv(1)  # hold the connection open until the client has read everything

    thread = threading.Thread(target=serve)
    thread.start()
    with ConnectionBytes(port, "127.0.0.1", every_s=0.05) as meter, socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"y" * received)
        got = 0
        while got < sent:
            got += len(client.recv(65536))
        time.sleep(0.2)
        meter.sample()
        client.sendall(b"!")
    thread.join()
    server.close()
    assert len(meter.seen) == 1
    # payload both ways, plus a header per segment: more than the payload, less than twice it
    assert sent + received + SEGMENT_HEADER_BYTES < meter.total < 2 * (sent + received)
    assert ConnectionBytes(port, "10.0.0.9").seen == {}


def test_steady_utilisation_starts_once_every_learner_has_finished_a_round():
    from types import SimpleNamespace

    from benchmarks.link_arms import steady_utilisation

    def learner(ends: list[float], compute: float):
        return SimpleNamespace(rounds=[{"ended_at": t, "compute_s": compute} for t in ends])

    # Learner 0 started 5 s early and waited for learner 1 in its second round (ended at 6).
    early = learner([1.0, 6.0, 7.0, 8.0], compute=0.9)
    late = learner([5.0, 6.0, 7.0, 8.0], compute=0.9)
    # Each counted from its first round ending at or after 5 s, when both had finished one: 4.5 compute s in 5 s.
    assert steady_utilisation([early, late]) == pytest.approx(0.9)


def test_time_to_quality_interpolates_the_islands_curve_to_the_standard_arms_final_bpb():
    from benchmarks.shaped_link import time_to_quality
    standard = [{"bpb": {"code": 3.0, "prose": 3.5}, "wall_seconds": 100.0},
                {"bpb": {"code": 3.2, "prose": 3.7}, "wall_seconds": 120.0},
                {"bpb": {"code": 3.0, "prose": 3.5}, "wall_seconds": 90.0}]  # medians: 3.0 / 3.5 in 100 s
    reaching = {"heldout_curve": [{"seconds": 10.0, "bpb": {"code": 4.0, "prose": 4.0}},
                                  {"seconds": 20.0, "bpb": {"code": 2.9, "prose": 3.4}}]}
    reach = time_to_quality(standard, [reaching])
    # code crosses 3.0 at 10 + 10 * 1.0 / 1.1 s, prose 3.5 earlier: the later of the two counts.
    assert reach["ratio"] == pytest.approx((10 + 10 / 1.1) / 100)
    short = {"heldout_curve": [{"seconds": 10.0, "bpb": {"code": 4.0, "prose": 4.0}},
                               {"seconds": 20.0, "bpb": {"code": 3.3, "prose": 3.4}}]}
    reach = time_to_quality(standard, [reaching, short])
    assert reach["ratio"] is None and reach["islands_seconds"][1] is None
    assert reach["final_gap"] == pytest.approx(((2.9 + 3.3) / 2) / 3.0 - 1)
    extrapolated = [{**run, "bpb": None} for run in standard]
    assert time_to_quality(extrapolated, [reaching])["ratio"] is None
