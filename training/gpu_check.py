"""The `device: cuda` path on a real GPU (`archipelago gpu-check`): learners as separate processes training
on it in fp32 and in bf16, an NCCL process group, and what bf16 buys in throughput.

Data preparation reads the corpora (`datasets`, `datasketch`); a learner needs only torch and the store.
So the check's runs are prepared wherever the corpora are (`prepare_check_runs`) and trained where the
GPU is (`train_check_run`), in a local folder that travels with the repository; the command scores the
consolidated models (eval/) and writes the result."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from infra import layout
from infra.spec import RunSpec
from infra.store import ObjectStore
from infra.stores import open_run
from training.consolidate import consolidate
from training.learner.ledger import read_summaries
from training.stages import start_run, train_learners

PRECISIONS = ("fp32", "bf16")


def check_spec(base: RunSpec, store_url: str, precision: str) -> RunSpec:
    """The base spec's islands and data on the GPU, with a model large enough for the GPU to matter."""
    islands = [island.model_copy(update={"device": "cuda", "precision": precision, "batch_size": 32,
                                         "seq_len": 256, "accelerator": "H200"}) for island in base.islands]
    return RunSpec.model_validate({
        **base.model_dump(mode="json"), "name": f"gpu-{precision}",
        "islands": [i.model_dump(mode="json") for i in islands],
        "model": {**base.model.model_dump(mode="json"), "layers": 4, "width": 384, "heads": 6},
        "sync": {**base.sync.model_dump(mode="json"), "rounds": 12},
        # Fewer documents than the demo's, so that both runs' data travel to the GPU machine in a few MB.
        "data": {**base.data.model_dump(mode="json"),
                 "corpora": [{**c.model_dump(mode="json"), "max_documents": 60} for c in base.data.corpora]},
        "store": {"url": store_url}})


def prepare_check_runs(base: RunSpec, store_url: str) -> Iterator[str]:
    """Start one run per precision in `store_url` (run id: the precision) and prepare its data; yields each
    precision once its run is ready."""
    from training.data.shards import prepare_dataset  # the corpora's libraries, needed here only

    for precision in PRECISIONS:
        spec = check_spec(base, store_url, precision)
        prepare_dataset(spec, start_run(spec, precision))
        yield precision


def check_run_store(store_url: str, precision: str) -> ObjectStore:
    return ObjectStore(store_url).child(f"runs/{precision}")


def device_facts() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"torch": torch.__version__, "device": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1), "bf16_supported": torch.cuda.is_bf16_supported()}


def nccl_all_reduce() -> dict:
    """A one-rank NCCL group on this GPU (one GPU cannot hold two NCCL ranks) and an all-reduce."""
    rendezvous = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
    dist.init_process_group("nccl", store=rendezvous, rank=0, world_size=1)
    try:
        values = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        dist.all_reduce(values)
        torch.cuda.synchronize()
        version = torch.cuda.nccl.version()
        return {"backend": dist.get_backend(), "nccl_version": ".".join(map(str, version)) if isinstance(version, tuple)
                else str(version),
                "all_reduce_ok": bool(values[-1].item() == (1 << 20) - 1)}
    finally:
        dist.destroy_process_group()


def train_check_run(store_url: str, precision: str, relay: Callable[[str], None]) -> tuple[RunSpec, ObjectStore, dict]:
    """Train a prepared check run's learners on the GPU and consolidate them: the run's spec and store, and
    its wall seconds, compute tokens per second and share of the learners' time spent computing."""
    store = check_run_store(store_url, precision)
    spec = RunSpec.model_validate(store.get_json(layout.SPEC))
    started = time.monotonic()
    train_learners(spec, precision, relay)
    consensus = consolidate(spec, open_run(spec, precision))
    wall = time.monotonic() - started
    summaries = read_summaries(spec, store)
    computing = sum(s.seconds_computing for s in summaries)
    return spec, store, {
        "wall_s": round(wall, 1), "learners": len(summaries), "tokens": sum(s.tokens for s in summaries),
        "tokens_per_s_computing": round(sum(s.tokens for s in summaries) / computing) if computing else None,
        "utilisation": round(computing / (computing + sum(s.seconds_syncing for s in summaries)), 3),
        "max_weight_distance": consensus["max_weight_distance"]}
