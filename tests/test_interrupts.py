"""Interrupting `archipelago run` mid-islands: SIGINT stops the learners and the temporary Prefect
server, releases the run's lease and prints the resume command; after a SIGKILL, the kernel ends
them with the command and `resume` takes the dead holder's lease at once. Either way the printed
resume finishes the run with the bpb of an uninterrupted one. Real learners (one a torchrun group),
a real temporary server per command, a local store."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from infra import layout
from infra.lease import RunLease, newest_term_number, released_key, this_process
from infra.spec import parse_spec
from infra.store import ObjectStore
from tests.corpora import corpus_folder

pytestmark = pytest.mark.integration

ARCHIPELAGO = str(Path(sys.executable).with_name("archipelago"))
# The interrupted command's learners, server and their process groups are gone within this.
STOPPED_WITHIN_S = 30


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory):
    """A run of two islands (one learner, one torchrun learner of 2 processes), long enough to
    interrupt after its first round, without standard training."""
    root = tmp_path_factory.mktemp("interrupts")
    corpus = corpus_folder(root)
    for i in range(8):
        (corpus / f"doc{i}.txt").write_text(" ".join(f"word{(i * 7 + j * j) % 53}" for j in range(1500)))
    raw = {
        "name": "interrupted",
        "islands": [{"name": "east", "learners": 1, "batch_size": 4, "seq_len": 32, "inner_steps": 3},
                    {"name": "west", "learners": 1, "batch_size": 4, "seq_len": 32, "inner_steps": 2,
                     "processes_per_learner": 2}],
        "model": {"layers": 1, "width": 32, "heads": 2},
        "data": {"corpora": [{"name": "text", "source": "files", "paths": [str(corpus / "doc*.txt")],
                              "eval_fraction": 0.25}]},
        "training": {"warmup_steps": 2},
        "sync": {"mode": "butterfly", "rounds": 8, "partner_timeout_s": 60},
        "evaluation": {"baseline": "none"},
        "store": {"url": str(root / "store")},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def uninterrupted_bpb(spec_file, prefect_api):
    from flows.lifecycle import run_lifecycle
    from training.stages import new_run_id

    spec = parse_spec(yaml.safe_load(spec_file.read_text()))
    return run_lifecycle(spec, new_run_id(spec))["evals"]["text"]["islands_bpb"]


class Command:
    """An `archipelago` command in a session of its own (so a signal reaches its process alone), its
    output collected line by line, and its temporary server and learners as they were last seen."""

    def __init__(self, *args: str, cwd: Path):
        env = {**os.environ}
        env.pop("PREFECT_API_URL", None)  # the command starts a temporary server of its own
        self.process = subprocess.Popen([ARCHIPELAGO, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self.reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, self.output, re.M):
            assert self.process.poll() is None, f"it exited {self.process.returncode} first:\n{self.output[-3000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout_s} s:\n{self.output[-3000:]}"
            time.sleep(0.2)

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)

    def finish(self, timeout_s: float = 300) -> int:
        code = self.process.wait(timeout_s)
        self.reader.join(10)
        return code


def gone_within(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of `processes`, and of the process groups they lead (the server, each learner and torchrun's
    workers start sessions of their own), still running after `timeout_s`."""
    groups = {process.pid for process in processes}
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in psutil.process_iter() if running(p) and group_of(p) in groups]
        left += [p for p in processes if running(p) and p not in left]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group_of(process: psutil.Process) -> int | None:
    try:
        return os.getpgid(process.pid)
    except ProcessLookupError:
        return None


def started_mid_islands(spec_file: Path) -> tuple[Command, list[psutil.Process], list[psutil.Process]]:
    """`archipelago run` once its learners' first round is logged; its temporary server and learners."""
    command = Command("run", str(spec_file), cwd=spec_file.parent)
    command.wait_for(r"learner-\d+' - round 1/8")
    processes = command.descendants()
    server = [p for p in processes if "prefect" in p.cmdline() and "server" in p.cmdline()]
    learners = [p for p in processes if "infra.launch" in p.cmdline()]
    assert len(server) == 1 and len(learners) >= 4, [p.cmdline() for p in processes]  # east, west's torchrun and its 2
    return command, server, learners


def resumed_bpb(command_line: str, spec_file: Path) -> tuple[str, float]:
    """Output and held-out bpb of the resume command as printed, run as it is."""
    run_id = command_line.split()[2]
    resume = Command(*command_line.split()[1:], cwd=spec_file.parent)
    assert resume.finish() == 0, resume.output[-3000:]
    store_url = parse_spec(yaml.safe_load(spec_file.read_text())).store.url
    report = ObjectStore(store_url).child(f"runs/{run_id}").get_json(layout.REPORT)
    return resume.output, report["evals"]["text"]["islands_bpb"]


def test_sigint_stops_learners_and_server_releases_the_lease_and_the_printed_resume_finishes_the_run(
        spec_file, uninterrupted_bpb):
    command, server, learners = started_mid_islands(spec_file)
    command.process.send_signal(signal.SIGINT)
    interrupted_at = time.monotonic()

    assert command.finish(STOPPED_WITHIN_S) == 130, command.output[-3000:]
    assert gone_within(server + learners, STOPPED_WITHIN_S - (time.monotonic() - interrupted_at)) == []
    resume = re.search(r"interrupted \(SIGINT\).*continue with: (archipelago resume \S+ --store \S+)$",
                       command.output, re.M)
    assert resume, command.output[-3000:]
    run_id = resume.group(1).split()[2]
    store = ObjectStore(parse_spec(yaml.safe_load(spec_file.read_text())).store.url).child(f"runs/{run_id}")
    assert store.exists(released_key(newest_term_number(store)))
    assert not store.exists(layout.REPORT)

    _, bpb = resumed_bpb(resume.group(1), spec_file)
    assert bpb == uninterrupted_bpb


def test_after_sigkill_server_and_learners_die_with_it_and_resume_takes_the_dead_holders_lease_at_once(
        spec_file, uninterrupted_bpb):
    command, server, learners = started_mid_islands(spec_file)
    run_id = re.search(r"^run (\S+): store", command.output, re.M).group(1)
    command.process.kill()
    command.finish()

    assert gone_within(server + learners, STOPPED_WITHIN_S) == []
    store_url = parse_spec(yaml.safe_load(spec_file.read_text())).store.url
    store = ObjectStore(store_url).child(f"runs/{run_id}")
    term = newest_term_number(store)
    assert not store.exists(released_key(term))  # the lease is live: its holder is dead, not expired

    output, bpb = resumed_bpb(f"archipelago resume {run_id} --store {store_url}", spec_file)
    assert f"term {term}, held by" in output and "taken over without waiting" in output
    assert bpb == uninterrupted_bpb


def test_a_live_holder_or_one_on_another_host_still_holds_the_run(tmp_path):
    """Only a holder provably gone is taken over: a claim naming a pid that runs here (this test's), or
    a dead pid of another host or pid space, still blocks until its lease expires."""
    from infra.lease import LeaseHeld

    store = ObjectStore(str(tmp_path / "store")).child("runs/r")
    dead = subprocess.Popen(["true"])
    dead.wait()
    RunLease.acquire(store, "r", this_process(**{"flow run": "live"}))
    with pytest.raises(LeaseHeld, match="flow run live"):
        RunLease.acquire(store, "r", this_process())
    for n, elsewhere in enumerate([{"host": "another-host"}, {"pid space": "another-boot/1"}]):
        other = ObjectStore(str(tmp_path / f"other-{n}")).child("runs/r")
        RunLease.acquire(other, "r", {**this_process(), "pid": str(dead.pid), **elsewhere})
        with pytest.raises(LeaseHeld):
            RunLease.acquire(other, "r", this_process())
    gone = ObjectStore(str(tmp_path / "gone")).child("runs/r")
    first = RunLease.acquire(gone, "r", {**this_process(), "pid": str(dead.pid)})
    taken = RunLease.acquire(gone, "r", this_process())
    assert taken.term == first.term + 1 and f"pid {dead.pid}" in taken.taken_from
