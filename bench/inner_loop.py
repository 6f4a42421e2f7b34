"""Inner-loop throughput: a learner's inner steps against a bare PyTorch loop, side by side.

Same model, batch, sequence length, optimizer and gradient clipping; the two alternate within
one process so machine noise hits both alike. Reports the median tokens/s of each over several
repeats and their ratio (target: learner / bare >= 0.9).

    .venv/bin/python bench/inner_loop.py [--repeats 7] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from infra import layout
from infra.spec import parse_spec
from infra.store import ObjectStore
from training.data.shards import prepare_dataset
from training.data.streams import WindowSampler, read_stream
from training.model.inner import inner_optimizer, optimizer_step
from training.learner.loop import Learner
from training.model.gpt import build_model


def bench_spec(store_url: str, batch: int, seq_len: int, steps: int):
    return parse_spec({
        "name": "bench",
        "islands": [{"name": "solo", "learners": 1, "batch_size": batch, "seq_len": seq_len, "inner_steps": steps}],
        "model": {"layers": 2, "width": 128, "heads": 4},
        "data": {"corpora": [{"name": "code", "source": "python_stdlib", "max_documents": 60}]},
        "sync": {"mode": "allreduce", "rounds": 1000, "warmup_steps": 0},
        "store": {"url": store_url},
    })


class BareLoop:
    """The textbook loop: sample, forward, backward, clip, step."""

    def __init__(self, spec, stream: torch.Tensor):
        self.island = spec.islands[0]
        self.model = build_model(spec)
        self.lr = spec.sync.inner_lr
        self.optimizer = inner_optimizer(self.model.parameters(), self.lr, spec.sync.weight_decay)
        self.sampler = WindowSampler(stream, self.island.seq_len, seed=1)

    def run(self, steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            inputs, targets = self.sampler.batch(self.island.batch_size)
            loss = self.model.loss(inputs, targets)
            self.optimizer.zero_grad(set_to_none=False)
            loss.backward()
            optimizer_step(self.model, self.optimizer, self.lr)
        return steps * self.island.batch_size * self.island.seq_len / (time.perf_counter() - started)


def learner_loop(learner: Learner, round_index: int) -> float:
    started = time.perf_counter()
    learner.inner_steps(round_index)
    return learner.slot.tokens_per_round() / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/results/inner_loop.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        store = ObjectStore(tmp).child("runs/bench")
        spec = bench_spec(tmp, args.batch, args.seq_len, args.steps)
        store.put_json(layout.SPEC, spec.model_dump(mode="json"))
        manifest = prepare_dataset(spec, store)
        stream = read_stream(store, manifest["shards"][0])
        learner, bare = Learner(spec, store, 0), BareLoop(spec, stream)
        learner_loop(learner, 0)  # warm up both paths before measuring
        bare.run(args.steps)
        learner_rates, bare_rates = [], []
        for repeat in range(args.repeats):
            learner_rates.append(learner_loop(learner, repeat + 1))
            bare_rates.append(bare.run(args.steps))
            print(f"repeat {repeat + 1}/{args.repeats}: learner {learner_rates[-1]:,.0f} tok/s, "
                  f"bare {bare_rates[-1]:,.0f} tok/s", flush=True)
    result = {"learner_tokens_per_s": statistics.median(learner_rates),
              "bare_tokens_per_s": statistics.median(bare_rates),
              "ratio": statistics.median(learner_rates) / statistics.median(bare_rates),
              "repeats": args.repeats, "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
              "threads": args.threads, "model": "d=128 x 2 layers", "learner_runs": learner_rates,
              "bare_runs": bare_rates}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"median: learner {result['learner_tokens_per_s']:,.0f} tok/s, bare {result['bare_tokens_per_s']:,.0f} "
          f"tok/s, ratio {result['ratio']:.3f}")


if __name__ == "__main__":
    main()
