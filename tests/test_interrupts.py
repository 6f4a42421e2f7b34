"""Interrupting `archipelago run` mid-islands: SIGINT stops the learners and the temporary Prefect
server, releases the run's lease and prints the resume command; after a SIGKILL, the kernel ends
them with the command and `resume` takes the dead holder's lease at once. The last resume finishes
the run with the bpb of one never interrupted. Real learners (one a torchrun group), a real
temporary server per command, a local store."""

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from infra import layout
from infra.lease import LeaseHeld, RunLease, newest_term_number, released_key, this_process
from infra.spec import parse_spec
from infra.store import ObjectStore
from tests.corpora import corpus_folder

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


def mid_islands(command: Command, round_pattern: str) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """The command's temporary server and learner processes, once a learner logged a round of `round_pattern`."""
    command.wait_for(rf"learner-\d+' - round {round_pattern}/8 ")
    processes = command.descendants()
    server = [p for p in processes if "prefect" in p.cmdline() and "server" in p.cmdline()]
    learners = [p for p in processes if "infra.launch" in p.cmdline()]
    assert len(server) == 1 and len(learners) >= 4, [p.cmdline() for p in processes]  # east, west's torchrun and its 2
    return server, learners


def assert_closed_to_others(server: psutil.Process) -> None:
    """The temporary server asks for an auth string that is on no command line, lets browsers of other
    origins read nothing, and keeps its files where only its user can read them."""
    env = server.environ()
    secret, port = env["PREFECT_SERVER_API_AUTH_STRING"], env["PREFECT_SERVER_API_PORT"]
    assert len(secret) > 32 and not any(secret in " ".join(p.info["cmdline"] or ())
                                        for p in psutil.process_iter(["cmdline"]))
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/api/flows/filter", data=b"{}"))
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/api/health",
                                                       headers={"Origin": "http://elsewhere.example"})) as answer:
        assert answer.headers.get("access-control-allow-origin") is None
    home = Path(env["PREFECT_HOME"])
    assert stat.S_IMODE(home.parent.stat().st_mode) == stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "prefect.db").stat().st_mode) == 0o600


def test_sigint_then_sigkill_mid_islands_stop_everything_and_the_resumes_finish_the_run_unchanged(
        spec_file, uninterrupted_bpb):
    """One run, interrupted twice: SIGINT while its learners train, then SIGKILL of the resume the
    SIGINT printed, while its learners train; a last resume finishes it."""
    store_url = parse_spec(yaml.safe_load(spec_file.read_text())).store.url

    run = Command("run", str(spec_file), cwd=spec_file.parent)
    server, learners = mid_islands(run, "1")
    assert_closed_to_others(server[0])
    run.process.send_signal(signal.SIGINT)
    interrupted_at = time.monotonic()
    assert run.finish(STOPPED_WITHIN_S) == 130, run.output[-3000:]
    assert gone_within(server + learners, STOPPED_WITHIN_S - (time.monotonic() - interrupted_at)) == []
    printed = re.search(r"interrupted \(SIGINT\).*continue with: "
                        r"(archipelago resume (\S+) --store \S+ --control-public-key \S+)$",
                        run.output, re.M)
    assert printed, run.output[-3000:]
    resume_command, run_id = printed.groups()
    store = ObjectStore(store_url).child(f"runs/{run_id}")
    assert store.exists(released_key(newest_term_number(store)))
    assert not store.exists(layout.REPORT)

    resumed = Command(*resume_command.split()[1:], cwd=spec_file.parent)  # the printed command, as it is
    server, learners = mid_islands(resumed, "[2-7]")
    server_folder = Path(server[0].environ()["PREFECT_HOME"]).parent
    resumed.process.kill()
    resumed.finish()
    assert gone_within(server + learners, STOPPED_WITHIN_S) == []
    shutil.rmtree(server_folder)  # a killed command cannot remove its server's temporary folder
    term = newest_term_number(store)
    assert not store.exists(released_key(term))  # its holder is dead; its lease has not expired
    assert not store.exists(layout.REPORT)

    last = Command(*resume_command.split()[1:], cwd=spec_file.parent)
    assert last.finish() == 0, last.output[-3000:]
    assert f"term {term}, held by" in last.output and "taken over without waiting" in last.output
    assert store.get_json(layout.REPORT)["evals"]["text"]["islands_bpb"] == uninterrupted_bpb


def test_a_live_holder_or_one_on_another_host_still_holds_the_run(tmp_path):
    """Only a holder provably gone is taken over: a claim naming a pid that runs here (this test's), or
    a dead pid of another host or pid space, still blocks until its lease expires."""
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
