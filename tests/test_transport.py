"""The transport: multipart messages, priorities, bandwidth budgets on an injected clock, counters."""

import threading

import pytest
import torch

from infra.store import ObjectExists, ObjectStore
from training.exchange.transport import LinkBudget, Transport


class FakeClock:
    """Time that passes only when someone sleeps: budgets are checked without timing anything."""

    def __init__(self):
        self.now = 100.0
        self.slept = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def test_budget_paces_chunks_to_the_rate():
    clock = FakeClock()
    budget = LinkBudget(1000, clock, clock.sleep)
    waited = [budget.finish(budget.book(500)) for _ in range(4)]
    assert waited == [0.5, 0.5, 0.5, 0.5] and clock.now == 102.0


def test_budget_counts_time_the_transfer_itself_took():
    clock = FakeClock()
    budget = LinkBudget(1000, clock, clock.sleep)
    began = clock()
    clock.now += 0.75  # the store took 0.75 s of the 1 s the link needs
    done_at = budget.book(1000, began)
    assert budget.finish(done_at) == pytest.approx(0.25)


def test_budget_does_not_bank_idle_time_beyond_now():
    clock = FakeClock()
    budget = LinkBudget(1000, clock, clock.sleep)
    budget.finish(budget.book(1000))
    clock.now += 10  # idle link
    assert budget.finish(budget.book(1000)) == 1.0


def test_unlimited_budget_never_waits():
    clock = FakeClock()
    budget = LinkBudget(None, clock, clock.sleep)
    assert budget.finish(budget.book(10**12)) == 0.0 and clock.slept == []


def tensors():
    return {"delta": torch.arange(4000, dtype=torch.float32), "q": torch.arange(100, dtype=torch.int8)}


def test_a_large_message_travels_in_parts_and_reads_back_verified(tmp_path):
    store = ObjectStore(str(tmp_path))
    clock = FakeClock()
    transport = Transport(store, chunk_bytes=4096, bytes_per_s={"inter": 8192}, clock=clock, sleep=clock.sleep)
    written = transport.send("m/message", tensors(), {"round": 3}, "inter")
    parts = [k for k in store.list("m") if ".part-" in k]
    payload = sum(len(store.get_bytes(k)) for k in parts)
    assert payload > 16000 and len(parts) == -(-payload // 4096)
    assert all(len(store.get_bytes(k)) == 4096 for k in parts[:-1])
    assert written == sum(len(store.get_bytes(k)) for k in store.list("m"))
    got, meta, nbytes = transport.read_own("m/message", "inter", 1 << 20)
    assert meta == {"round": 3} and nbytes == written
    assert all(torch.equal(got[k], v) for k, v in tensors().items())
    counters = transport.report()
    assert counters["inter"]["bytes_written"] == counters["inter"]["bytes_read"] == written
    assert counters["intra"]["bytes_written"] == 0
    # Every byte crossed an 8 kB/s link twice (out and back), the JSON commit included.
    assert counters["inter"]["seconds_paced"] == pytest.approx(2 * written / 8192, rel=0.01)


def test_a_small_message_keeps_the_plain_commit_layout(tmp_path):
    store = ObjectStore(str(tmp_path))
    Transport(store).send("m/message", tensors(), {"round": 0}, "intra")
    assert store.list("m") == ["m/message.json", "m/message.safetensors"]
    got, meta, _ = store.read_committed("m/message")
    assert torch.equal(got["delta"], tensors()["delta"])


def test_a_resend_after_a_crash_mid_send_does_not_collide_with_orphan_parts(tmp_path):
    store = ObjectStore(str(tmp_path))
    transport = Transport(store, chunk_bytes=4096)
    other = {"delta": torch.ones(4000)}
    transport._put_chunk("m/message.part-0000", b"x" * 4096, "inter")  # a dead life's part, never committed
    store.put_bytes("s/message.safetensors", b"half-written")  # and one that died before its commit
    transport.send("m/message", other, {}, "inter")
    transport.send("s/message", {"delta": torch.ones(3)}, {}, "inter")
    assert torch.equal(transport.read_own("m/message", "inter", 1 << 20)[0]["delta"], other["delta"])
    assert torch.equal(transport.read_own("s/message", "inter", 1 << 20)[0]["delta"], torch.ones(3))


def test_a_different_committed_message_is_not_overwritten(tmp_path):
    transport = Transport(ObjectStore(str(tmp_path)))
    transport.send("m/message", {"d": torch.ones(3)}, {}, "intra")
    transport.send("m/message", {"d": torch.ones(3)}, {}, "intra")  # same bytes: a no-op
    with pytest.raises(ObjectExists):
        transport.send("m/message", {"d": torch.zeros(3)}, {}, "intra")


def test_inter_island_jobs_go_before_queued_intra_island_ones(tmp_path):
    transport = Transport(ObjectStore(str(tmp_path)))
    started, gate, order = threading.Event(), threading.Event(), []

    def hold_the_thread():
        started.set()
        gate.wait()

    first = transport.submit("intra", hold_the_thread)
    assert started.wait(timeout=30)  # the thread is busy before the queue fills, so it holds all four
    jobs = [transport.submit(link, order.append, name)
            for link, name in [("intra", "intra-1"), ("inter", "inter-1"), ("intra", "intra-2"), ("inter", "inter-2")]]
    assert transport.pending() == 4
    gate.set()
    for job in [first, *jobs]:
        job.result(timeout=30)
    assert order == ["inter-1", "inter-2", "intra-1", "intra-2"]


def test_a_failed_job_hands_its_error_to_the_waiter(tmp_path):
    transport = Transport(ObjectStore(str(tmp_path)))
    with pytest.raises(ZeroDivisionError):
        transport.submit("inter", lambda: 1 / 0).result(timeout=30)
    assert transport.submit("inter", lambda: 7).result(timeout=30) == 7


def test_counters_survive_a_restart_through_their_report(tmp_path):
    transport = Transport(ObjectStore(str(tmp_path)))
    transport.send("m/message", {"d": torch.ones(3)}, {}, "inter")
    again = Transport(ObjectStore(str(tmp_path)))
    again.load_report(transport.report())
    assert again.report() == transport.report()


def test_report_sums_link_classes_and_gives_bytes_per_round_of_each_fragment():
    from eval.report import fragment_bytes, link_classes
    from training.learner.ledger import LearnerSummary

    summaries = [LearnerSummary(
                     fragment_sizes=[10, 8],
                     links={"inter": {"bytes_read": 5, "seconds_paced": 1.0}, "intra": {"bytes_read": 1, "seconds_paced": 0}},
                     exchanges=[{"round": 0, "fragment": 0, "bytes_sent": 40, "bytes_received": 40},
                                {"round": 1, "fragment": 1, "bytes_sent": 32, "bytes_received": 30},
                                {"round": 2, "fragment": 0, "bytes_sent": 40, "bytes_received": 40}]),
                 LearnerSummary(links={"inter": {"bytes_read": 7, "seconds_paced": 0.5}},
                                exchanges=[{"round": 0, "fragment": 0, "bytes_sent": 40, "bytes_received": 40}])]
    assert link_classes(summaries) == {"inter": {"bytes_read": 12, "seconds_paced": 1.5},
                                       "intra": {"bytes_read": 1, "seconds_paced": 0}}
    assert fragment_bytes(summaries) == [
        {"fragment": 0, "parameters": 10, "rounds": 2, "bytes_sent_per_round": 60.0, "bytes_received_per_round": 60.0},
        {"fragment": 1, "parameters": 8, "rounds": 1, "bytes_sent_per_round": 32.0, "bytes_received_per_round": 30.0}]
