"""A learner sharded with FSDP2 (`islands[].parallelism: fsdp`) over real gloo processes: it trains as a
one-process learner does on the same rows, its checkpoints are the canonical whole-model layout that
a one-process learner resumes from (and it resumes from theirs), sparse MoEs train sharded as they do
data-parallel, FSDP2's mixed precision and activation checkpointing change how a learner computes and not
what it keeps, and an fsdp island (in bf16, with both) trains with a data-parallel one through
`archipelago run`."""

from __future__ import annotations

import json
import shutil
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch.distributed.tensor import DTensor

from infra import layout
from infra.spec.model import BYTE_VOCAB
from infra.spec import parse_spec
from infra.store import ObjectStore, run_store
from tests.corpora import corpus_folder
from tests.test_baseline import free_port
from tests.test_models import MODELS, spec_with
from training.data.shards import prepare_dataset
from training.learner.loop import Learner
from training.model.gpt import ByteGPT, GPTConfig
from training.model.inner import forward_precision, inner_optimizer, optimizer_step
from training.model.parallel import LearnerParallelism
from training.model.registry import build_model
from training.model.params import flat_parameters

pytestmark = pytest.mark.integration  # gloo processes, learner processes, a Prefect API

TOLERANCE = 1e-5


def text_data(tmp_path) -> dict:
    corpus = corpus_folder(tmp_path)
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(f"document {i} says something of its own " * 60)
    return {"corpora": [{"name": "text", "source": "files", "paths": [str(corpus / "doc*.txt")], "eval_fraction": 0.25,
                         "max_eval_bytes": 1000}]}


def one_learner_spec(tmp_path, **island) -> dict:
    return {
        "name": "fsdp",
        "islands": [{"name": "a", "learners": 1, "batch_size": 4, "seq_len": 16, "inner_steps": 3, **island}],
        "model": {"layers": 2, "width": 16, "heads": 2},
        "data": text_data(tmp_path),
        "training": {"warmup_steps": 1, "keep_checkpoints": None},
        # Two fragments, each applied an inner step after it is sent: checkpoints hold an exchange in flight.
        "sync": {"mode": "butterfly", "rounds": 3, "transport": {"fragments": 2, "tau": 1}},
        "store": {"url": str(tmp_path / "store")},
    }


def prepared(raw: dict, run_id: str):
    spec = parse_spec(raw)
    store = ObjectStore(spec.store.url).child(f"runs/{run_id}")
    store.put_json(layout.SPEC, spec.model_dump(mode="json"))
    prepare_dataset(spec, store)
    return spec, store


def sharded_rank(rank: int, port: int, spec, store_url: str, phases: list[tuple[str, list[int]]]) -> None:
    """Rank `rank` of 2 gloo processes: the sparse models' check, then an fsdp learner: in each phase,
    learner 0 of run `run_id` resumes (a new life) and trains `rounds`. One group of processes for
    both, as starting one costs seconds."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        sparse_models_train_sharded_as_data_parallel(rank)
        memory_options_change_how_it_computes_not_what_it_learns(rank)
        for run_id, rounds in phases:
            learner = Learner(spec, ObjectStore(store_url).child(f"runs/{run_id}"), 0, rank, 2)
            parameters = list(learner.model.parameters())
            # Sharded: each rank holds about half of every parameter, and half of the optimizer's state.
            assert all(isinstance(p, DTensor) for p in parameters)
            assert sum(p.to_local().numel() for p in parameters) <= sum(p.numel() for p in parameters) // 2 + 64
            learner.resume()
            for t in rounds:
                learner.run_round(t)
            learner.checkpoints.finish()
    finally:
        dist.destroy_process_group()


def sparse_models_train_sharded_as_data_parallel(rank: int) -> None:
    """Sparse MoEs train sharded exactly as data parallelism trains them: the byte GPT's where an expert
    gets tokens on one rank only (every rank still reduce-scatters its gradient, zeros where unused),
    and a transformers Mixtral, whose `loss` runs its modules without its own `forward`."""
    byte_moe, mixtral = GPTConfig(layers=1, width=16, heads=2, max_seq_len=8, experts=8, top_k=1), spec_with(MODELS["mixtral"])
    for build, vocab in [(lambda: ByteGPT(byte_moe), BYTE_VOCAB), (lambda: build_model(mixtral), mixtral.vocab_size)]:
        windows = torch.randint(0, vocab, (1, 5), generator=torch.Generator().manual_seed(rank))
        trained = []
        for parallelism in ("fsdp", "data_parallel"):
            torch.manual_seed(0)
            model = build()
            parallel = LearnerParallelism(parallelism, rank, 2, torch.device("cpu"))
            parallel.place(model)
            optimizer = inner_optimizer(model.parameters(), 1e-2, 0.1)
            for step in range(2):
                optimizer.zero_grad(set_to_none=False)
                model.loss(windows[:, :-1], windows[:, 1:]).backward()
                if parallelism == "data_parallel" and step == 0 and isinstance(model, ByteGPT):
                    used = torch.tensor([[p.grad is not None for p in expert.parameters()]
                                         for expert in model.blocks[0].ffn.experts], dtype=torch.float32)
                    dist.all_reduce(used)
                    assert (used == 1).any(), "no expert is used on exactly one rank: the check checks nothing"
                parallel.sync_gradients(model)
                optimizer_step(model, optimizer, 1e-2)
            trained.append(parallel.gather(list(model.parameters())))
        if rank == 0:
            # Sharded and data-parallel gradients are sums in another order, so they differ in the last bits. AdamW
            # divides by sqrt(v) + 1e-8, which turns such a difference in a near-zero gradient (an expert that
            # saw almost nothing) into up to about 1e-5 of a weight on some CPUs: two steps of lr 1e-2 agree to
            # 1% of one step, where a wrong shard or a missed reduction moves weights by up to a whole step.
            assert torch.allclose(trained[0], trained[1], atol=1e-4, rtol=0), float((trained[0] - trained[1]).abs().max())


def memory_options_change_how_it_computes_not_what_it_learns(rank: int) -> None:
    """Sharded, under bf16 autocast: FSDP2's mixed precision gathers each block's weights in bf16 while the
    shards, their gradients and the inner optimizer stay fp32; activation checkpointing, with or without
    it, gives the very losses and weights of keeping the activations."""
    windows = torch.randint(0, BYTE_VOCAB, (2, 17), generator=torch.Generator().manual_seed(rank))
    trained = {}
    for mixed, checkpointed in [(False, False), (False, True), (True, False), (True, True)]:
        torch.manual_seed(0)
        model = ByteGPT(GPTConfig(layers=2, width=16, heads=2, max_seq_len=16))
        parallel = LearnerParallelism("fsdp", rank, 2, torch.device("cpu"), mixed, checkpointed)
        parallel.place(model)
        computed_in = set()
        model.blocks[0].register_forward_pre_hook(lambda block, _: computed_in.add(next(block.parameters()).dtype))
        optimizer = inner_optimizer(model.parameters(), 1e-2, 0.1)
        losses = []
        for _ in range(2):
            optimizer.zero_grad(set_to_none=False)
            with forward_precision(torch.device("cpu"), "bf16"):
                loss = model.loss(windows[:, :-1], windows[:, 1:])
            loss.backward()
            optimizer_step(model, optimizer, 1e-2)
            losses.append(loss.item())
        kept = {p.dtype for p in model.parameters()} | {p.grad.dtype for p in model.parameters()} | \
            {state["exp_avg"].dtype for state in optimizer.state.values()}
        assert computed_in == {torch.bfloat16 if mixed else torch.float32} and kept == {torch.float32}
        trained[mixed, checkpointed] = losses, parallel.gather(list(model.parameters()))
    if rank == 0:
        for mixed in (False, True):
            assert trained[mixed, True][0] == trained[mixed, False][0]
            assert torch.equal(trained[mixed, True][1], trained[mixed, False][1])
        assert trained[True, False][0] != trained[False, False][0]  # bf16 weights: another computation
        assert trained[True, False][0] == pytest.approx(trained[False, False][0], abs=1e-2)


BYTE_MODELS = {"byte_gpt": {"layers": 2, "width": 16, "heads": 2},
               "byte_moe": {"layers": 2, "width": 16, "heads": 2, "moe": {"experts": 4, "top_k": 2}}}


@pytest.mark.parametrize("model", [*BYTE_MODELS, *MODELS])
def test_activation_checkpointing_gives_the_gradients_of_keeping_the_activations(model):
    """Every model kind's blocks recompute in backward exactly what they would have kept (transformers'
    decoder layers, called with keyword arguments, included); a one-process learner checkpoints too."""
    spec = spec_with({**BYTE_MODELS, **MODELS}[model])
    windows = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        built = build_model(spec)
        LearnerParallelism("data_parallel", 0, 1, torch.device("cpu"), activation_checkpointing=checkpointed).place(built)
        loss = built.loss(windows[:, :-1], windows[:, 1:])
        loss.backward()
        results.append((loss.item(), torch.cat([p.grad.reshape(-1) for p in built.parameters() if p.grad is not None])))
    assert results[1][0] == results[0][0] and torch.equal(results[1][1], results[0][1])


def checkpoint(store: ObjectStore, t: int) -> dict[str, torch.Tensor]:
    return store.read_committed(layout.checkpoint(0, t))[0]


def test_an_fsdp_learner_trains_as_one_process_does_and_shares_its_checkpoints(tmp_path):
    single, single_store = prepared(one_learner_spec(tmp_path), "single")
    # The sharded learner recomputes its blocks' activations in backward: the same learning, to float rounding.
    sharded, sharded_store = prepared(one_learner_spec(tmp_path, processes_per_learner=2, parallelism="fsdp",
                                                       activation_checkpointing=True), "sharded")
    # One process, rounds 0 and 1; a copy of the run as it stands then; round 2.
    reference = Learner(single, single_store, 0)
    reference.resume()
    weights = []
    for t in range(2):
        reference.run_round(t)
        weights.append(flat_parameters(reference.model))
    shutil.copytree(tmp_path / "store/runs/single", tmp_path / "store/runs/single-copy")
    reference.run_round(2)
    weights.append(flat_parameters(reference.model))

    # Two fsdp processes: rounds 0 and 1 from the start, then round 2 of the copy, resumed from the
    # one-process learner's checkpoint of round 1.
    mp.spawn(sharded_rank, args=(free_port(), sharded, single.store.url, [("sharded", [0, 1]), ("single-copy", [2])]),
             nprocs=2, join=True)

    for t in range(2):
        written = checkpoint(sharded_store, t)
        assert written["weights"].shape == weights[t].shape
        assert torch.allclose(written["weights"], weights[t], atol=TOLERANCE, rtol=0)
    # Its inner optimizer's moments are checkpointed whole, in the one-process learner's layout.
    ours, theirs = checkpoint(sharded_store, 1), checkpoint(single_store, 1)
    assert set(ours) == set(theirs) and any(name.startswith("inner.") for name in ours)
    for name in theirs:
        assert ours[name].shape == theirs[name].shape
        assert torch.allclose(ours[name], theirs[name], atol=TOLERANCE, rtol=0), name
    assert not torch.allclose(weights[2], weights[0], atol=1e-3)
    # Its per-step gradient norms (the trackers' grad_norm) are the whole model's, not rank 0's shards'.
    norms = [[norm for entry in store.read_committed(layout.checkpoint(0, 1))[1]["traffic"]["rounds"]
              for norm in entry["steps"]["grad_norm"]] for store in (sharded_store, single_store)]
    assert len(norms[0]) == 2 * single.islands[0].inner_steps and norms[0] == pytest.approx(norms[1], rel=1e-4)

    # The fsdp learner's checkpoint resumes on one process: its weights exactly, and it continues as
    # the one-process learner did, which it can only with the inner moments restored.
    resumed = Learner(single, sharded_store, 0)
    resumed.resume()
    assert resumed.start_round == 2
    assert torch.equal(flat_parameters(resumed.model), checkpoint(sharded_store, 1)["weights"])
    resumed.run_round(2)
    assert torch.allclose(flat_parameters(resumed.model), weights[2], atol=TOLERANCE, rtol=0)
    # And the one-process learner's checkpoint resumed on two fsdp processes.
    assert torch.allclose(checkpoint(ObjectStore(single.store.url).child("runs/single-copy"), 2)["weights"],
                          weights[2], atol=TOLERANCE, rtol=0)


def test_an_fsdp_island_and_a_data_parallel_island_train_together(tmp_path, prefect_api):
    from flows.cli import main

    config = tmp_path / "mixed.yaml"
    config.write_text(yaml.safe_dump({
        "name": "mixed",
        "islands": [{"name": "sharded", "learners": 1, "batch_size": 4, "seq_len": 16, "inner_steps": 3,
                     "processes_per_learner": 2, "parallelism": "fsdp", "precision": "bf16",
                     "fsdp_mixed_precision": True, "activation_checkpointing": True},
                    {"name": "replicated", "learners": 1, "batch_size": 4, "seq_len": 16, "inner_steps": 2,
                     "processes_per_learner": 2, "parallelism": "data_parallel"}],
        "model": {"layers": 2, "width": 16, "heads": 2},
        "data": text_data(tmp_path),
        "training": {"warmup_steps": 2},
        "sync": {"mode": "butterfly", "rounds": 2, "partner_timeout_s": 60},
        "evaluation": {"baseline": "none"},
        "store": {"url": str(tmp_path / "store")},
    }))
    report_path = tmp_path / "report.json"
    assert main(["run", str(config), "--report", str(report_path)]) == 0
    report = json.loads(report_path.read_text())

    assert report["compute"]["islands_tokens"] == (4 * 3 + 4 * 2) * 16 * 2
    for scores in report["evals"].values():
        assert 0 < scores["islands_bpb"] < 9
    assert report["communication"]["inter_island_bytes"] > 0
    # Every round's exchange crosses the islands: the last one leaves both learners on one anchor.
    assert report["consensus"]["max_weight_distance"] < 1e-5
    store = run_store(parse_spec(yaml.safe_load(config.read_text())).store, report["run_id"])
    assert [store.get_json(layout.learner_summary(i))["processes"] for i in range(2)] == [2, 2]
    assert all(store.get_json(layout.learner_summary(i))["missed_exchanges"] == [] for i in range(2))
