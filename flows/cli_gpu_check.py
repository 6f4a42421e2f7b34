"""`archipelago gpu-check prepare|run`: the check of a GPU machine (training/gpu_check.py). `prepare` splits the
check's data into a local store where the corpora are; `run`, on the GPU machine with the repository and that
store, trains it in fp32 and in bf16, all-reduces over NCCL, scores both models and writes one JSON document."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from flows.cli_run import load_spec_or_say_why
from infra import layout
from training import events
from training.gpu_check import (PRECISIONS, check_run_store, device_facts, nccl_all_reduce, prepare_check_runs,
                                train_check_run)


def add_gpu_check_parser(commands, spec_options: argparse.ArgumentParser) -> None:
    parser = commands.add_parser("gpu-check", parents=[spec_options],
                                 help="check a GPU machine: prepare the check's runs here, train and score them there")
    parser.add_argument("step", choices=("prepare", "run"))
    parser.add_argument("--config", default="configs/demo.yaml", help="islands and data of the check (prepare)")
    parser.add_argument("--store", default=".gpu-check/store", help="a local folder that travels with the repository")
    parser.add_argument("--out", default=".gpu-check/result.json", help="where run writes its JSON document")
    parser.set_defaults(handler=gpu_check)


def gpu_check(args: argparse.Namespace) -> int:
    return prepare(args) if args.step == "prepare" else run(args)


def prepare(args: argparse.Namespace) -> int:
    base = load_spec_or_say_why(args.config, overrides=args.overrides)
    if base is None:
        return 2
    for precision in prepare_check_runs(base, args.store):
        print(f"prepared run {precision} in {args.store}", flush=True)
    return 0


def progress(line: str) -> None:
    """Learner 0's rounds and anything that went wrong, from the learners' event lines."""
    event = events.parse(line)
    if event is None:
        return
    if event["event"] == "round" and event["learner"] == 0:
        print(f"  learner 0 round {event['round'] + 1}/{event['rounds']} loss {event['loss']:.3f} "
              f"{event['tokens_per_s']:,} tok/s", flush=True)
    elif event["event"] in ("missed_exchange", "fault", "resumed", "skipping_rounds"):
        print(f"  {event}", flush=True)


def run(args: argparse.Namespace) -> int:
    from eval.evaluate import heldout_bpb
    from flows.cli import version_text

    missing = [p for p in PRECISIONS if not check_run_store(args.store, p).exists(layout.SPEC)]
    if missing:
        print(f"error: no prepared check run {', '.join(missing)} in {args.store}: run `archipelago gpu-check prepare` "
              "where the corpora are and bring the store along", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA device here: `archipelago gpu-check run` trains on the GPU machine", file=sys.stderr)
        return 2
    result = {"archipelago": version_text(), **device_facts(), "nccl": nccl_all_reduce(), "runs": {}}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    for precision in PRECISIONS:
        spec, store, figures = train_check_run(args.store, precision, progress)
        result["runs"][precision] = {**figures, "bpb": heldout_bpb(spec, store, layout.CONSOLIDATED)}
        print(f"{precision}: {json.dumps(result['runs'][precision])}", flush=True)
    fp32, bf16 = (result["runs"][p] for p in PRECISIONS)
    result["bf16_vs_fp32"] = {
        "compute_speedup": round(bf16["tokens_per_s_computing"] / fp32["tokens_per_s_computing"], 3),
        "bpb_relative": {name: round(bf16["bpb"][name] / fp32["bpb"][name] - 1, 5) for name in fp32["bpb"]}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2), flush=True)
    return 0
