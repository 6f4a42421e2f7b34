"""The planner replays the learners' own schedule: its bytes are the bytes learners move, and its
times follow the overlap rule and the link."""

import json

import pytest
import torch

from flows.cli import main
from infra.spec import parse_spec
from infra.store import ObjectStore
from training.exchange.transport import Transport
from training.exchange.compression import Codec
from training.planning.planner import bandwidth_for, fragment_sizes, message_bytes, message_requests, plan_run, replay
from training.exchange.modes import MODES


def spec_of(mode="butterfly", fragments=1, tau=0, compression="none", islands=2, learners=2, rounds=6, steps=(4, 2),
            inter_island_every=1):
    return parse_spec({
        "islands": [{"name": f"i{k}", "learners": learners, "batch_size": 2 * (k + 1), "seq_len": 16,
                     "inner_steps": steps[k % len(steps)]} for k in range(islands)],
        "model": {"layers": 2, "width": 16, "heads": 2},
        "data": {"corpora": [{"name": "c", "source": "files", "paths": ["x"]}]},
        "sync": {"mode": mode, "rounds": rounds, "inter_island_every": inter_island_every,
                 "transport": {"fragments": fragments, "tau": tau, "compression": compression}},
    })


@pytest.mark.parametrize("mode,compression,fragments", [("butterfly", "none", 1), ("butterfly", "int4", 2),
                                                        ("allreduce", "int8", 2)])
def test_a_message_is_planned_at_the_bytes_the_transport_reads(tmp_path, mode, compression, fragments):
    spec = spec_of(mode, fragments=fragments, compression=compression)
    settings = spec.sync.transport
    codec = Codec(settings.compression, settings.scale_chunk, settings.topk)
    transport = Transport(ObjectStore(str(tmp_path)))
    for fragment, numel in enumerate(fragment_sizes(spec)):
        payload = {}
        for name in MODES[mode].fields:
            payload.update({name: torch.randn(numel)} if codec.lossless else
                           codec.encode(name, torch.randn(numel), sparsify=name != "anchor"))
        key = f"learners/001/round-0000{fragment}/message" + (f"-fragment-{fragment:03d}" if fragments > 1 else "")
        meta = {"learner": 1, "round": fragment, "tokens": spec.learners[1].tokens_per_round(), "fragment": fragment,
                "anchor_from_initial": not codec.lossless}
        transport.send(key, payload, meta, "inter")
        _, _, read = transport.fetch(1, key, "inter", 1 << 30, 1.0, give_up=lambda: False)
        assert message_bytes(spec, numel, learner=1, round_index=fragment) == read



@pytest.mark.parametrize("chunk_bytes", [64 << 20, 4096])
def test_a_message_is_planned_at_the_requests_the_transport_makes(tmp_path, chunk_bytes):
    raw = spec_of(compression="none").model_dump(mode="json")
    raw["sync"]["transport"]["chunk_bytes"] = chunk_bytes
    spec = parse_spec(raw)
    transport = Transport(ObjectStore(str(tmp_path)), chunk_bytes=chunk_bytes)
    numel = fragment_sizes(spec)[0]
    key = "learners/001/round-00000/message"
    transport.send(key, {n: torch.randn(numel) for n in MODES["butterfly"].fields},
                          {"learner": 1, "round": 0, "tokens": spec.learners[1].tokens_per_round(), "fragment": 0,
                           "anchor_from_initial": False}, "inter")
    assert transport.fetch(1, key, "inter", 1 << 30, 1.0, give_up=lambda: False) is not None
    planned = message_requests(spec, message_bytes(spec, numel, learner=1))
    assert planned == (2 if chunk_bytes > numel * 8 else -(-numel * 8 // chunk_bytes) + 1)
    counters = transport.counters["inter"]
    assert counters.requests == 2 * planned - 1  # written once, read once (the commit came with the poll)
    assert counters.polls == 1  # the commit was there at the first look


def test_a_reader_that_waits_polls_more_than_once(tmp_path):
    transport = Transport(ObjectStore(str(tmp_path)))
    assert transport.fetch(0, "learners/000/round-00000/message", "intra", 1 << 20, 0.3, give_up=lambda: False) is None
    assert transport.counters["intra"].polls > 1 and transport.counters["intra"].requests == 0


@pytest.mark.parametrize("shard", [False, True])
def test_plans_count_a_message_s_requests_for_its_writer_and_each_reader(shard):
    raw = spec_of("allreduce", learners=2, rounds=3).model_dump(mode="json")
    raw["sync"]["shard_outer_step"] = shard
    spec = parse_spec(raw)
    assert message_requests(spec, message_bytes(spec, fragment_sizes(spec)[0])) == 2  # a part and its commit
    for plan in replay(spec, {"i0": 0.1, "i1": 0.2}, 1e9):
        # 4 learners. The whole step: each round a learner writes one message and reads the 3 others'.
        # Sharded: it writes its pseudo-gradient on each of the 3 others' shards and its own shard of the
        # anchor, and reads the 3 others' of each.
        writes, reads = (4, 6) if shard else (1, 3)
        assert plan.requests == 3 * (2 * writes + reads)
        assert plan.polls == 3 * reads


def test_fragments_cover_the_model_as_the_learners_split_it():
    from training.exchange.fragments import FragmentLayout
    from training.model.registry import build_model
    spec = spec_of(fragments=2)
    assert fragment_sizes(spec) == FragmentLayout.build(build_model(spec), 2).sizes


def test_an_unlimited_link_leaves_only_the_slower_island_s_compute_to_wait_for():
    spec = spec_of(steps=(4, 2))
    # Both islands take 0.4 s of compute per round: nobody waits on an unlimited link.
    plans = replay(spec, {"i0": 0.1, "i1": 0.2}, 1e18)
    assert all(p.blocked_s < 1e-9 for p in plans)
    assert plans[0].round_ends[-1] == pytest.approx(6 * 0.4)
    # West twice as slow: east waits for its partners every round it exchanges across the link.
    slow = replay(spec, {"i0": 0.1, "i1": 0.4}, 1e18)
    assert slow[0].blocked_s > 0 and slow[2].blocked_s == pytest.approx(0, abs=1e-9)


def test_overlap_hides_a_transfer_shorter_than_tau_steps():
    spec_now, spec_later = spec_of(fragments=2, tau=0), spec_of(fragments=2, tau=2)
    nbytes = message_bytes(spec_now, max(fragment_sizes(spec_now)))
    rate = nbytes * 8 / 0.15  # a message takes 0.15 s to cross; two inner steps take 0.2 s
    waiting = plan_run(spec_now, {"i0": 0.1, "i1": 0.2}, rate)
    hidden = plan_run(spec_later, {"i0": 0.1, "i1": 0.2}, rate)
    assert waiting["blocked_s"] > 0.15 * 2  # every crossing exchange is waited for
    assert hidden["utilisation"] > waiting["utilisation"]
    assert hidden["exchange_bytes"] == waiting["exchange_bytes"]


def test_the_link_for_a_goal_is_the_slowest_that_reaches_it():
    spec = spec_of(fragments=2, tau=1, compression="int8")
    steps = {"i0": 0.1, "i1": 0.2}
    need = bandwidth_for(spec, steps, 0.95)
    assert plan_run(spec, steps, need * 1.01)["utilisation"] >= 0.95 > plan_run(spec, steps, need * 0.9)["utilisation"]
    assert bandwidth_for(spec, steps, 0.99) > need
    # Compute-bound: an island twice as slow holds the other back whatever the link.
    assert bandwidth_for(spec, {"i0": 0.1, "i1": 0.4}, 0.95) is None


def test_a_profile_covers_whole_periods_of_the_modes_island_crossings():
    from training.planning.profile import PROFILE_ROUNDS, profile_rounds
    # After the timed rounds, a checkpoint's round and the next (no overlap), then the last round, untimed.
    assert profile_rounds(spec_of("allreduce", fragments=2)) == PROFILE_ROUNDS + 2 + 1
    assert profile_rounds(spec_of("hierarchical")) == PROFILE_ROUNDS + 2 + 1  # it crosses every round
    # With overlap, the checkpoint holds up the next exchange, applied tau steps into the round after.
    assert profile_rounds(spec_of("hierarchical", tau=1)) == PROFILE_ROUNDS + 1 + 3 + 1
    # 8 learners make 3 butterfly stages; 2 fragments; pairs across islands meet every 5th cycle.
    # Both first cross islands in round 28, so their rounds are timed from round 29 on.
    assert profile_rounds(spec_of("butterfly", fragments=2, learners=4, inter_island_every=5)) == 29 + 2 * 3 * 5 + 2 + 1
    assert profile_rounds(spec_of("hierarchical", fragments=2, learners=4, inter_island_every=15)) == 29 + 2 * 15 + 2 + 1


def test_a_profile_leaves_the_islands_start_up_lag_to_the_start_up(tmp_path):
    """Learner 1 starts 3.5 s after learner 0, which waits for it in the first round that crosses
    islands (round 1: every 2nd exchange of one fragment): the wait is learner 1's late start, not a
    round's overhead. The last round drains the exchanges in flight and writes the final checkpoint
    (2 s more than a timed round here), once a run: the teardown's, not a round's."""
    from types import SimpleNamespace
    from training.planning.profile import profile_rounds, profile_spec, summarise
    spec = spec_of("hierarchical", learners=1, inter_island_every=2, rounds=6)
    assert profile_rounds(spec) == 2 + 4 + 2 + 1
    # Applied tau steps into the next round, the first crossing's exchange waits there.
    assert profile_rounds(spec_of("hierarchical", learners=1, inter_island_every=2, rounds=6, tau=1)) == 3 + 4 + 3 + 1
    profiled = profile_spec(spec, {"url": str(tmp_path)})
    assert profiled.training.checkpoint_every == 7  # the checkpoint in round 6, after the timed rounds 2 to 5
    rounds = [{"compute_s": 0.4, "sync_s": 0.0} for _ in range(9)]
    exchanges = [{"blocked_s": 0.0, "seconds": {"publish": 0.0, "receive": 0.0, "outer_step": 0.0}}] * 9
    summaries = [SimpleNamespace(learner=k, rounds=rounds, exchanges=exchanges) for k in (0, 1)]
    ends = {0: [1.0, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5, 8.0, 10.5], 1: [4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5, 8.0, 10.5]}
    profile = summarise(profiled, summaries, ends, exits={0: 11.0, 1: 11.0}, checkpoints_per_run_round=0.1)
    assert profile.round_overhead_s == pytest.approx({"i0": 0.1, "i1": 0.1})
    assert profile.checkpoint_s == pytest.approx({"i0": 0.0, "i1": 0.0})
    assert profile.startup_s == pytest.approx(4.5 - 0.4 - 0.1)
    assert profile.teardown_s == pytest.approx(0.5 + 2.0)
    with pytest.raises(ValueError, match="after the first 2, before a checkpoint in round 6 and the 1 after it"):
        summarise(profiled, summaries, {0: [1.0, 5.0, 5.5], 1: [4.5, 5.0, 5.5]}, exits={0: 7.5, 1: 7.5},
                  checkpoints_per_run_round=0.1)


@pytest.mark.integration  # the CLI in a process of its own, with learners
def test_plan_command_prints_and_writes_the_plan(tmp_path, capsys):
    config = tmp_path / "spec.yaml"
    config.write_text(json.dumps(spec_of(fragments=2, tau=1).model_dump(mode="json")))
    out = tmp_path / "plan.json"
    assert main(["plan", str(config), "--link-gbps", "0.01", "--step-seconds", "i0=0.1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "measured here" in printed and "link for 95% utilisation" in printed
    written = json.loads(out.read_text())
    assert written["islands"]["i0"]["step_seconds"] == 0.1 and written["islands"]["i1"]["step_seconds"] > 0
    assert main(["plan", str(config), "--step-seconds", "nowhere=1"]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_the_plan_flow_publishes_the_plan_as_an_artifact(prefect_api):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.deployments import plan

    spec = spec_of(fragments=2, tau=1, compression="int4")
    result = plan(spec, link_gbps=0.001, step_seconds={"i0": 0.1, "i1": 0.2})
    assert result["exchange_bytes"]["inter"] > 0

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["plan"])))

    artifacts = asyncio.run(read())
    assert artifacts and "link for 95% utilisation" in artifacts[0].data
    assert f"{result['exchange_bytes']['inter']:,} bytes" in artifacts[0].data


def test_data_parallel_waits_for_the_whole_gradient_each_step():
    from training.baseline import BaselinePlan
    from training.planning.planner import plan_data_parallel
    spec = spec_of()
    parameters = sum(fragment_sizes(spec))
    # Two ranks: a ring sends the whole fp32 gradient each way, 32 bits a parameter; at this rate 0.1 s.
    link_bps = parameters * 32 / 0.1
    planned = plan_data_parallel(spec, 0.3, link_bps, startup_s=2.0, teardown_s=1.0)
    steps = BaselinePlan.of(spec).steps
    assert planned["utilisation"] == pytest.approx(0.75)
    assert planned["wall_s"] == pytest.approx(3.0 + steps * 0.4)
    assert planned["exchange_bytes"]["inter"] == steps * parameters * 4 * 2


def test_a_profiled_round_overhead_and_start_and_end_add_to_the_plan():
    spec = spec_of(steps=(4, 4), rounds=5)
    bare = plan_run(spec, {"i0": 0.1, "i1": 0.1}, 1e18)
    profiled = plan_run(spec, {"i0": 0.1, "i1": 0.1}, 1e18, startup_s=3.0,
                        round_overhead_s={"i0": 0.1, "i1": 0.1}, teardown_s=2.0)
    assert bare["utilisation"] == pytest.approx(1.0)
    # Each round: 0.4 s of inner steps and 0.1 s besides them.
    assert profiled["utilisation"] == pytest.approx(0.8)
    assert profiled["wall_s"] == pytest.approx(3.0 + 5 * 0.5 + 2.0)
    assert profiled["bandwidth_for_utilisation"]["0.90"] is None


def test_a_profile_is_read_from_round_ends_and_per_round_compute(tmp_path):
    from types import SimpleNamespace
    from training.planning.profile import profile_spec, summarise
    spec = profile_spec(spec_of(steps=(4, 2), learners=1), {"url": str(tmp_path)}, at_least=3)
    # Round 0 settles, rounds 1 and 2 are timed, round 3 checkpoints, round 4 pays for it, round 5 is the last.
    assert (spec.sync.rounds, spec.training.checkpoint_every) == (6, 4)

    def rounds(compute):
        return [{"compute_s": c, "sync_s": 0.05} for c in compute]

    def exchanges(outer_steps):
        return [{"blocked_s": 0.01, "seconds": {"publish": 0.02, "receive": 0.0, "outer_step": s}} for s in outer_steps]

    # The parts of rounds that are not timed are left out (the first's and the last's outer step here 9 s).
    summaries = [SimpleNamespace(learner=0, rounds=rounds((0.5, 0.4, 0.4, 0.4, 0.6, 0.4)),
                                 exchanges=exchanges((9.0, 0.1, 0.3, 5.0, 5.0, 9.0))),
                 SimpleNamespace(learner=1, rounds=rounds((0.6,) * 6),
                                 exchanges=exchanges((9.0, 0.2, 0.2, 5.0, 5.0, 9.0)))]
    # Learner 0's timed rounds end 0.5 s apart: 0.4 s of inner steps and 0.1 s besides; its checkpoint
    # costs 0.3 s in its own round and 1 s in the next, where it slows the inner steps by 0.2 s. Learner
    # 1's rounds end 0.8 s apart, checkpoint or not.
    ends = {0: [5.0, 5.5, 6.0, 6.8, 8.3, 8.8], 1: [6.0, 6.8, 7.6, 8.4, 9.2, 10.0]}
    profile = summarise(spec, summaries, ends, exits={0: 9.8, 1: 11.0}, checkpoints_per_run_round=0.1)
    assert profile.checkpoint_s == pytest.approx({"i0": 1.3, "i1": 0.0})
    # A checkpoint every 10th round of the run adds a tenth of its cost to each: to the inner steps
    # what it slowed them by, to the overhead the rest.
    assert profile.step_seconds == pytest.approx({"i0": 0.1 + 0.02 / 4, "i1": 0.3})
    assert profile.round_overhead_s == pytest.approx({"i0": 0.1 + 0.11, "i1": 0.2})
    assert profile.startup_s == pytest.approx(6.0 - 0.6 - 0.2)
    assert profile.teardown_s == pytest.approx(1.0)
    assert profile.round_parts_s["i0"] == pytest.approx({
        "inner_steps": 0.4, "sync": 0.05, "waiting_for_exchange": 0.01, "checkpoint": 0.13,
        "publish": 0.02, "receive": 0.0, "outer_step": 0.2})
    assert profile.round_parts_s["i1"]["outer_step"] == pytest.approx(0.2)
    part, seconds = profile.largest_part("i0")
    assert part == "outer_step" and seconds == pytest.approx(0.2)
    # 128 tokens a round on each island; two timed rounds each, from 5.0 s to 7.6 s.
    assert profile.tokens_per_s == pytest.approx(4 * 128 / 2.6)


def test_a_run_s_periodic_checkpoints_are_counted_without_its_last():
    from training.planning.profile import checkpoints_per_round
    assert checkpoints_per_round(spec_of(rounds=150)) == pytest.approx(
        149 // spec_of(rounds=150).training.checkpoint_every / 150)
    raw = spec_of(rounds=150).model_dump(mode="json")
    raw["training"]["checkpoint_every"] = 10
    assert checkpoints_per_round(parse_spec(raw)) == pytest.approx(14 / 150)  # rounds 9, 19, ..., 139; 149 is the last
    raw["training"]["checkpoint_every"] = 150
    assert checkpoints_per_round(parse_spec(raw)) == 0


@pytest.mark.integration  # the CLI in a process of its own, with learners
def test_plan_command_profiles_with_the_run_s_own_learners(tmp_path, capsys):
    config = tmp_path / "spec.yaml"
    config.write_text(json.dumps({
        "islands": [{"name": "east", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2},
                    {"name": "west", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2}],
        "model": {"layers": 1, "width": 16, "heads": 2},
        "data": {"corpora": [{"name": "code", "source": "python_stdlib", "max_documents": 40}]},
        "sync": {"mode": "butterfly", "rounds": 50},
        "store": {"url": str(tmp_path / "never-written")}}))
    out = tmp_path / "plan.json"
    assert main(["plan", str(config), "--profile-run", "--link-gbps", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "profiling run of 2 learners" in printed and "east: besides its inner steps" in printed
    written = json.loads(out.read_text())
    overheads = written["overheads"]
    assert set(overheads["round_overhead_s"]) == {"east", "west"} and overheads["startup_s"] > 0
    # The plan's 50 rounds, each with its inner steps and its overhead, between start-up and teardown.
    per_round = max(2 * written["islands"][i]["step_seconds"] + overheads["round_overhead_s"][i] for i in ("east", "west"))
    assert written["wall_s"] >= overheads["startup_s"] + 50 * per_round + overheads["teardown_s"] - 1e-6
    assert not (tmp_path / "never-written").exists()  # the profile's store is a temporary folder


def test_plan_without_step_seconds_refuses_at_once_a_model_this_machine_cannot_step(capsys):
    """The brief's 32B spec: measuring its inner steps here would hold its 8 learners' whole models at
    once. `plan` says so and what to pass instead, in one line, instead of starting them."""
    assert main(["plan", "configs/plan-brief-32b.yaml"]) == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr
    assert errors[0].startswith("error: cannot measure the inner steps here: the 8 learners")
    assert "--step-seconds gb300=S --step-seconds b300=S" in errors[0]


def test_a_profiling_process_s_error_comes_back_as_one_line_and_releases_the_others():
    import multiprocessing

    from training.planning.profile import _profile_learner

    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(2), context.Queue()
    _profile_learner({"islands": []}, 1, 2, 1, start, results, 0.0)
    learner, error, _ = results.get(timeout=10)
    assert learner == 1 and error.startswith("invalid run spec: islands") and "\n" not in error
    assert start.broken  # a learner waiting to start is released, not left at the barrier


@pytest.mark.integration  # processes of its own, each with torch
def test_a_profiling_process_that_dies_ends_the_measurement_at_once():
    import multiprocessing
    import os
    import signal
    import threading
    import time

    from training.planning.profile import ProfilingFailed, measure_step_seconds

    def kill_one() -> None:
        while len(multiprocessing.active_children()) < 4:
            time.sleep(0.05)
        os.kill(multiprocessing.active_children()[-1].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_one)
    killer.start()
    with pytest.raises(ProfilingFailed, match=r"learner \d's process died \(killed by signal 9\)"):
        measure_step_seconds(spec_of(), steps=100_000)  # its 4 learners would step for hours
    killer.join()
    assert multiprocessing.active_children() == []  # the others were ended with it


@pytest.mark.integration  # the run's own learners, as processes
def test_a_learner_that_dies_ends_the_profiling_run_at_once(tmp_path):
    """Its partner would otherwise wait out partner_timeout_s for its message."""
    from training.planning.profile import ProfilingFailed, profile_run

    spec = parse_spec({
        "islands": [{"name": name, "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2}
                    for name in ("east", "west")],
        "model": {"layers": 1, "width": 16, "heads": 2},
        "data": {"corpora": [{"name": "code", "source": "python_stdlib", "max_documents": 40}]},
        "sync": {"mode": "butterfly", "rounds": 50, "partner_timeout_s": 3600},
        "faults": [{"kind": "kill_learner", "learner": 0, "round": 1}]})
    with pytest.raises(ProfilingFailed, match=r"^profiling run: learner 0 failed \(killed by signal 9\)"):
        profile_run(spec)
