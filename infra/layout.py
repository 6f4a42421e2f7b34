"""Object keys of one run, relative to the run's prefix `runs/<run_id>/` in the store.

Every writer and reader goes through these names, so the store's layout is readable in one
place: the spec, the data, each learner's per-round messages and checkpoints, the models.
"""

import re

SPEC = "spec.json"
DATA_MANIFEST = "data/manifest.json"
CONSOLIDATED = "models/consolidated"
INITIAL = "models/initial"  # the weights of `model.init_from`, committed by the control plane
BASELINE = "models/baseline"
BASELINE_SNAPSHOTS = "models/baseline-snapshots"
REPORT = "report/report.json"


def shard(learner: int) -> str:
    return f"data/shards/learner-{learner:03d}.safetensors"


def heldout(corpus: str) -> str:
    return f"data/heldout/{corpus}.safetensors"


def validation(corpus: str) -> str:
    """Documents held out from training for tuning; separate from the evaluation's held-out set."""
    return f"data/validation/{corpus}.safetensors"


def learner_prefix(learner: int) -> str:
    return f"learners/{learner:03d}"


def round_prefix(learner: int, round_index: int) -> str:
    return f"{learner_prefix(learner)}/round-{round_index:05d}"


def message(learner: int, round_index: int, fragment: int | None = None) -> str:
    """What a learner sends its partners in a round; the JSON commit is written after the tensors.

    A run split into fragments names the fragment the round exchanges: each fragment's message is
    its own committed object.
    """
    name = "message" if fragment is None else f"message-fragment-{fragment:03d}"
    return f"{round_prefix(learner, round_index)}/{name}"


def crossing_message(learner: int, round_index: int, fragment: int | None = None) -> str:
    """What a learner sends the other islands in a round that crosses them (`sync.mode: hierarchical`):
    its slice of its island's anchor, apart from its `message` of the round."""
    name = "message-crossing" if fragment is None else f"message-crossing-fragment-{fragment:03d}"
    return f"{round_prefix(learner, round_index)}/{name}"


def mixed_slice_message(learner: int, round_index: int, fragment: int | None = None) -> str:
    """What a learner shares with its own island after a crossing: the islands' mean of its slice."""
    name = "message-mixed" if fragment is None else f"message-mixed-fragment-{fragment:03d}"
    return f"{round_prefix(learner, round_index)}/{name}"


def scattered_message(learner: int, round_index: int, fragment: int | None, shard: int) -> str:
    """What a learner sends the owner of shard `shard` of the fragment's outer step (`sync.shard_outer_step`):
    its pseudo-gradient there."""
    name = f"message-to-{shard:03d}" if fragment is None else f"message-fragment-{fragment:03d}-to-{shard:03d}"
    return f"{round_prefix(learner, round_index)}/{name}"


def stepped_slice_message(learner: int, round_index: int, fragment: int | None = None) -> str:
    """What a learner shares with the learners it shares an anchor with, when each takes the outer step
    of its own shard of the fragment (`sync.shard_outer_step`): its shard of the new anchor."""
    name = "message-stepped" if fragment is None else f"message-stepped-fragment-{fragment:03d}"
    return f"{round_prefix(learner, round_index)}/{name}"


def checkpoint(learner: int, round_index: int) -> str:
    """A learner's state after a round; it exists only once its JSON manifest does."""
    return f"{round_prefix(learner, round_index)}/checkpoint"


def curve_weights(learner: int, round_index: int) -> str:
    """A learner's weights alone after a round the bpb curve scores: all the curve reads of that round,
    a third of a checkpoint's bytes or less (no optimizer moments, anchors or residual), so that
    round's checkpoint is retired like any other."""
    return f"{round_prefix(learner, round_index)}/curve-weights"


def liveness_prefix(learner: int) -> str:
    """Where a learner's lives are recorded, apart from its rounds so a partner lists them cheaply."""
    return f"liveness/learner-{learner:03d}"


def learner_life(learner: int, life: int) -> str:
    """Written when a life of a learner starts: where it resumes and which rounds it will never send."""
    return f"{liveness_prefix(learner)}/life-{life:03d}.json"


def learner_paused(learner: int, life: int) -> str:
    """Written when a life ends cleanly at its capacity window's end: the next life is no restart after a death."""
    return f"{liveness_prefix(learner)}/paused-{life:03d}.json"


def rendezvous(learner: int, life: int) -> str:
    """Where node 0 of a learner that spans several nodes publishes, for one life, the address its
    other nodes join (infra/rendezvous.py): a new life gets a new key, so none is ever rewritten."""
    return f"{liveness_prefix(learner)}/rendezvous-{life:03d}.json"


def rendezvous_lives(keys: list[str]) -> list[int]:
    """The lives of the rendezvous records among a learner's liveness keys (as `store.list` returns them);
    a key of any other shape is none."""
    return [int(found.group(1)) for key in keys if (found := re.search(r"/rendezvous-(\d{3,9})\.json$", key))]


def learner_summary(learner: int, slot: int = 0) -> str:
    """What a learner writes once it has trained every round. A later slot, past every one its store lists,
    is where it writes when something it did not write took slot 0 (a key squatted in its store)."""
    return f"{learner_prefix(learner)}/summary.json" if slot == 0 else f"{learner_prefix(learner)}/summary-{slot}.json"


def summary_slots(keys: list[str]) -> list[int]:
    """The later slots (1 and up) of the summaries among a learner's keys (as `store.list` returns them), in order."""
    return sorted(slot for key in keys if (found := re.search(r"/summary-(\d{1,9})\.json$", key))
                  and (slot := int(found.group(1))) > 0)


def baseline_snapshot(step: int) -> str:
    """Standard training's weights after a step, for the bpb-versus-tokens curve."""
    return f"{BASELINE_SNAPSHOTS}/step-{step:06d}"


def figure(name: str) -> str:
    return f"report/figures/{name}.png"


def rewrite(key: str, attempt: int) -> str:
    """Where a derived object (a model the lifecycle computed) is committed again when its earlier
    commit came out corrupt: objects are written once, so a damaged one is never replaced in place."""
    return f"rewrites/{attempt}/{key}"


def checkpoint_rounds(keys: list[str]) -> list[int]:
    """The rounds of the committed checkpoints among a learner's keys (as `store.list` returns them)."""
    return [int(key.split("/round-")[1].split("/")[0]) for key in keys if key.endswith("/checkpoint.json")]


def committed_messages(keys: list[str]) -> list[tuple[int, str]]:
    """(round, key) of the committed messages among a learner's keys (as `store.list` returns them)."""
    return [(int(key.split("/round-")[1].split("/")[0]), key.removesuffix(".json"))
            for key in keys if "/message" in key and key.endswith(".json")]


KILLED_LEARNER, CLOSED_WINDOW, FAILED_STAGE = "killed-learner", "closed-window", "failed-stage"


def fault_marker(kind: str, learner: int, round_index: int) -> str:
    """Remembers that an injected fault already struck, so a restarted learner does not meet it again."""
    return f"faults/{kind}-{learner:03d}-round-{round_index:05d}.json"


def failed_stage_marker(stage: str) -> str:
    return f"faults/{FAILED_STAGE}-{stage}.json"


def count_fault_markers(keys: list[str], kind: str) -> int:
    return sum(f"{kind}-" in key for key in keys)
