"""The fault injector: each kind fires and is counted, the rate holds, the config is checked."""

import uuid

import fsspec
import pytest

from infra.faults import FaultInjectingFileSystem, InjectedServiceUnavailable, StoreFaults


@pytest.fixture
def memory_root():
    """A private folder of the memory filesystem, whose contents every instance shares."""
    fs = fsspec.filesystem("memory")
    root = f"/faults-{uuid.uuid4().hex}"
    yield fs, root
    if fs.exists(root):
        fs.rm(root, recursive=True)


def flaky(fs, kind, rate=1.0, **extra):
    return FaultInjectingFileSystem(fs, StoreFaults(rate, (kind,), **extra))


@pytest.mark.parametrize("kind, error", [("timeout", TimeoutError),
                                         ("unavailable", InjectedServiceUnavailable),
                                         ("disconnect", ConnectionResetError)])
def test_failing_kinds_raise_are_counted_and_write_nothing(memory_root, kind, error):
    fs, root = memory_root
    wrapped = flaky(fs, kind)
    with pytest.raises(error, match="pipe_file"):
        wrapped.pipe_file(f"{root}/a", b"data")
    with pytest.raises(error):
        wrapped.exists(f"{root}/a")
    assert not fs.exists(f"{root}/a")
    assert wrapped.counts[kind] == 2 and sum(wrapped.counts.values()) == 2


def test_unavailable_looks_like_an_s3fs_503():
    err = InjectedServiceUnavailable("cat_file x")
    assert isinstance(err, OSError) and "503 Service Unavailable" in str(err)


def test_slow_delays_then_delegates(memory_root):
    fs, root = memory_root
    wrapped = flaky(fs, "slow", slow_seconds=0.001)
    wrapped.pipe_file(f"{root}/a", b"data")
    assert wrapped.cat_file(f"{root}/a") == b"data"
    assert wrapped.find(root) == [f"{root}/a"]
    wrapped.rm_file(f"{root}/a")
    assert not wrapped.exists(f"{root}/a")
    assert wrapped.counts["slow"] == 5


def test_truncate_cuts_reads_short_and_leaves_other_calls_alone(memory_root):
    fs, root = memory_root
    wrapped = flaky(fs, "truncate")
    wrapped.pipe_file(f"{root}/a", b"0123456789")
    assert wrapped.exists(f"{root}/a") and wrapped.counts["truncate"] == 0
    data = wrapped.cat_file(f"{root}/a")
    assert len(data) < 10 and b"0123456789".startswith(data)
    assert wrapped.counts["truncate"] == 1


def test_rate_is_honoured_and_seed_replays_the_same_faults(memory_root):
    fs, root = memory_root

    def pattern():
        wrapped = flaky(fs, "timeout", rate=0.05, seed=7)
        failed = []
        for _ in range(2000):
            try:
                wrapped.exists(f"{root}/a")
                failed.append(False)
            except TimeoutError:
                failed.append(True)
        assert wrapped.counts["timeout"] == sum(failed)
        return failed

    first = pattern()
    assert 0.03 * 2000 <= sum(first) <= 0.07 * 2000
    assert pattern() == first


def test_zero_rate_injects_nothing(memory_root):
    fs, root = memory_root
    wrapped = FaultInjectingFileSystem(fs, StoreFaults(0.0, ("timeout", "unavailable")))
    for _ in range(100):
        wrapped.exists(f"{root}/a")
    assert sum(wrapped.counts.values()) == 0


def test_other_attributes_are_delegated(memory_root):
    fs, _ = memory_root
    assert flaky(fs, "timeout").protocol == fs.protocol


@pytest.mark.parametrize("kwargs, field", [
    ({"error_rate": 1.5, "kinds": ("timeout",)}, "error_rate"),
    ({"error_rate": -0.1, "kinds": ("timeout",)}, "error_rate"),
    ({"error_rate": 0.1, "kinds": ()}, "kinds"),
    ({"error_rate": 0.1, "kinds": ("timeout", "flood")}, "kinds.*flood"),
    ({"error_rate": 0.1, "kinds": ("slow",), "slow_seconds": -1.0}, "slow_seconds"),
])
def test_validation_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StoreFaults(**kwargs)
