"""The `device: cuda` path on a real GPU: learners as separate processes training on it in fp32 and
in bf16, an NCCL process group, and what bf16 buys in throughput and costs in bits per byte.

Data preparation reads the corpora (`datasets`, `datasketch`); a learner needs only torch and the
store. So the runs are prepared wherever the corpora are, and trained where the GPU is:

    python -m bench.device_check prepare [--store .gpu-check/store]
    python -m bench.device_check run [--store .gpu-check/store] [--out FILE]

`run` prints one JSON document (and writes it to --out): the device, the NCCL all-reduce, and per
precision the wall seconds, tokens per second of compute, and held-out bpb of the consolidated model.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bench.harness import Log, train_islands
from bench.results_page import provenance
from eval.evaluate import heldout_bpb
from infra import layout
from infra.spec import RunSpec, load_spec
from infra.store import ObjectStore
from training.learner.ledger import read_summaries

PRECISIONS = ("fp32", "bf16")
DEFAULT_STORE = ".gpu-check/store"


def check_spec(base: RunSpec, store_url: str, precision: str) -> RunSpec:
    """The demo's islands and data on the GPU, with a model large enough for the GPU to matter."""
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


def prepare(args) -> None:
    from training.data.shards import prepare_dataset  # the corpora's libraries, needed here only
    from training.stages import start_run

    base = load_spec(args.config)
    for precision in PRECISIONS:
        spec = check_spec(base, args.store, precision)
        prepare_dataset(spec, start_run(spec, precision))
        print(f"prepared run {precision} in {args.store}", flush=True)


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


def train(store_url: str, precision: str, log: Log) -> dict:
    store = ObjectStore(store_url).child(f"runs/{precision}")
    spec = RunSpec.model_validate(store.get_json(layout.SPEC))
    started = time.monotonic()
    consensus = train_islands(spec, precision, log)
    wall = time.monotonic() - started
    summaries = read_summaries(spec, store)
    computing = sum(s.seconds_computing for s in summaries)
    return {"wall_s": round(wall, 1), "learners": len(summaries),
            "tokens": sum(s.tokens for s in summaries),
            "tokens_per_s_computing": round(sum(s.tokens for s in summaries) / computing) if computing else None,
            "utilisation": round(computing / (computing + sum(s.seconds_syncing for s in summaries)), 3),
            "max_weight_distance": consensus["max_weight_distance"],
            "bpb": heldout_bpb(spec, store, layout.CONSOLIDATED)}


def run(args) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run `prepare` here and `run` on the GPU machine")
    log = Log(Path(args.out).with_suffix(".log"))
    props = torch.cuda.get_device_properties(0)
    result = {**provenance(), "torch": torch.__version__, "device": props.name, "capability": f"{props.major}.{props.minor}",
              "memory_gib": round(props.total_memory / 2**30, 1), "bf16_supported": torch.cuda.is_bf16_supported(),
              "nccl": nccl_all_reduce(), "runs": {}}
    log(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    for precision in PRECISIONS:
        result["runs"][precision] = train(args.store, precision, log)
        log(f"{precision}: {json.dumps(result['runs'][precision])}")
    fp32, bf16 = (result["runs"][p] for p in PRECISIONS)
    result["bf16_vs_fp32"] = {
        "compute_speedup": round(bf16["tokens_per_s_computing"] / fp32["tokens_per_s_computing"], 3),
        "bpb_relative": {name: round(bf16["bpb"][name] / fp32["bpb"][name] - 1, 5) for name in fp32["bpb"]}}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("prepare", "run"))
    parser.add_argument("--config", default="configs/demo.yaml", help="islands and data of the check (prepare)")
    parser.add_argument("--store", default=DEFAULT_STORE, help="a local folder that travels with the repository")
    parser.add_argument("--out", default=os.environ.get("OUT", ".") + "/device_check.json")
    args = parser.parse_args()
    prepare(args) if args.step == "prepare" else run(args)


if __name__ == "__main__":
    main()
