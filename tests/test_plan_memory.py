"""Memory per rank: the arithmetic on a model small enough to count by hand, the activation formula
against the tensors autograd really saves, and the plan's refusal of a run that does not fit."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from flows.cli import main
from infra.spec import parse_spec
from training.model.inner import forward_precision
from training.model.registry import build_model
from training.planning.host_memory import (checkpoint_staging, exchange_in_flight, exchange_state, learner_host,
                                           this_host_bytes)
from training.planning.fit import MemoryRefused, check_fits, memory_plan
from training.planning.memory import (GB, activation_bytes, gathered_layer_bytes, head_activation_bytes_per_token,
                                      layer_activation_bytes_per_token, model_shape, model_sizes, rank_memory)

CONFIG_32B = Path(__file__).parents[1] / "configs" / "plan-brief-32b.yaml"


def spec_of(model=None, precision="fp32", parallelism="data_parallel", processes=1, device_memory_gb=None,
            batch_size=4, seq_len=16, outer="nesterov", compression="none", fragments=1, host_memory_gb=None, **island):
    return parse_spec({
        "islands": [{"name": "east", "learners": 1, "batch_size": batch_size, "seq_len": seq_len, "inner_steps": 1,
                     "precision": precision, "parallelism": parallelism, "processes_per_learner": processes,
                     "device_memory_gb": device_memory_gb, "host_memory_gb": host_memory_gb, **island}],
        "model": model or {"layers": 2, "width": 8, "heads": 2},
        "data": {"corpora": [{"name": "c", "source": "files", "paths": ["x"]}]},
        "sync": {"rounds": 1, "outer": {"name": outer},
                 "transport": {"compression": compression, "fragments": fragments}},
    })


# The toy byte GPT: 2 layers, width 8, 257 ids, seq_len 16. Token embedding 257 x 8 = 2056 (tied to the
# head), positions 16 x 8 = 128; a block: qkv 8 x 24 = 192, projection 64, up 8 x 32 = 256, down 256,
# two layer norms 2 x 16 = 32: 800; final norm 16. Total 2056 + 128 + 2 x 800 + 16 = 3800.
TOY_PARAMETERS = 3800
TOY_MATRICES = 2056 + 2 * (192 + 64 + 256 + 256)  # in matrix products: the tied head and the blocks' linears


def test_the_toy_model_is_counted_as_by_hand():
    sizes = model_sizes(spec_of())
    assert (sizes.parameters, sizes.active) == (TOY_PARAMETERS, TOY_PARAMETERS)
    assert sizes.largest_layer == 2056 + 128 + 16  # outside the blocks: more than a block's 800
    assert sizes.matrix_parameters == TOY_MATRICES
    assert sizes.outer_state == TOY_PARAMETERS  # Nesterov: one momentum per parameter


def test_data_parallel_holds_everything_whole_and_fsdp_a_share():
    # fp32, batch 4, seq 16. A block saves per token 2 x 4 x 8 (norm inputs) + 4 x (8 + 32 + 8 + 64)
    # (norm output, q k v, attention output, norm output, up and GELU outputs at width 32) + 4 x (2 + 4)
    # (log-sum-exp per head, norm statistics) = 64 + 448 + 24 = 536 bytes; outside the blocks
    # 8 x (4 + 4) + 4 x 257 + 16 = 1108. 64 tokens: 64 x (2 x 536 + 1108) = 139,520 bytes.
    spec = spec_of()
    shape = model_shape(spec)
    assert layer_activation_bytes_per_token(shape, "fp32") == 536
    assert activation_bytes(shape, 4, 16, "fp32") == 139_520
    sizes = model_sizes(spec)
    whole = rank_memory(spec, spec.islands[0], sizes, shape)
    assert whole.resident == {"weights": 15_200, "gradients": 15_200, "inner optimizer": 30_400}
    assert whole.transient["forward and backward"] == {"activations": 139_520}
    assert whole.transient["optimizer step"] == {"AdamW temporary": 15_200}
    assert whole.transient["applying an exchange"] == {"fragment weights": 15_200}  # one fragment: all of it
    assert whole.peak == 60_800 + 139_520

    spec = spec_of(parallelism="fsdp", processes=4, batch_size=4)
    shard = rank_memory(spec, spec.islands[0], sizes, shape)
    assert shard.resident == {"weights": 3800, "gradients": 3800, "inner optimizer": 7600}
    assert shard.rows == 1
    # A quarter of the batch each, and two layers' weights and one layer's gradient gathered whole.
    assert shard.transient["forward and backward"] == {"activations": 139_520 // 4, "gathered layers": 3 * 2200 * 4}
    assert shard.transient["optimizer step"] == {"AdamW temporary": 3800}
    assert "applying an exchange" not in shard.transient  # fsdp scatters a fragment parameter by parameter
    assert shard.peak == 15_200 + 34_880 + 26_400


def test_bf16_halves_what_the_products_save_and_adds_autocast_s_weight_copies():
    # bf16: the norm inputs stay fp32 (64 bytes), the rest halves: 64 + 2 x 112 + 24 = 312 bytes a token.
    fp32, bf16 = spec_of(), spec_of(precision="bf16")
    assert layer_activation_bytes_per_token(model_shape(bf16), "bf16") == 312
    sizes = model_sizes(bf16)
    parts = rank_memory(bf16, bf16.islands[0], sizes, model_shape(bf16)).transient["forward and backward"]
    assert parts == {"activations": 64 * (2 * 312 + 8 * (4 + 2) + 4 * 257 + 16), "bf16 weight copies": 2 * TOY_MATRICES}
    assert parts["activations"] < rank_memory(fp32, fp32.islands[0], sizes, model_shape(fp32)) \
        .transient["forward and backward"]["activations"]
    # Under fsdp, autocast casts the gathered weights: its copies are whole on every rank as well.
    sharded = spec_of(precision="bf16", parallelism="fsdp", processes=2)
    parts = rank_memory(sharded, sharded.islands[0], sizes, model_shape(sharded)).transient["forward and backward"]
    assert parts["bf16 weight copies"] == 2 * TOY_MATRICES and parts["gathered layers"] == 3 * 2200 * 4


def saved_for_backward(spec, precision, rows, bf16_parameters=False):
    """Bytes autograd saves in one forward pass of the spec's model, split into the bf16 copies of
    weights and everything else; with `bf16_parameters`, of the model in bf16, as FSDP2's mixed
    precision gathers it."""
    model = build_model(spec).to(torch.bfloat16 if bf16_parameters else torch.float32)
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    saved: dict[int, tuple[bool, int]] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = (tuple(tensor.shape) in shapes, storage.nbytes())
        return tensor

    data = torch.randint(0, 256, (rows, spec.max_seq_len + 1), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with forward_precision(torch.device("cpu"), precision):
            model.loss(data[:, :-1], data[:, 1:])
    return (sum(n for copy, n in saved.values() if not copy), sum(n for copy, n in saved.values() if copy))


TRANSFORMERS = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}


@pytest.mark.parametrize("model,precision", [
    ({"layers": 2, "width": 64, "heads": 4}, "fp32"),
    ({"layers": 2, "width": 64, "heads": 4}, "bf16"),
    ({"layers": 2, "width": 64, "heads": 4, "moe": {"experts": 4, "top_k": 2}}, "fp32"),
    ({"layers": 2, "width": 64, "heads": 4, "qk_norm": True}, "bf16"),
    ({"layers": 2, "width": 64, "heads": 4, "z_loss_weight": 1e-4}, "fp32"),
    ({"kind": "transformers", "transformers": {"architecture": "LlamaForCausalLM",
                                               "config": {**TRANSFORMERS, "intermediate_size": 176}}}, "fp32"),
    ({"kind": "transformers", "transformers": {"architecture": "LlamaForCausalLM",
                                               "config": {**TRANSFORMERS, "intermediate_size": 176}}}, "bf16"),
    ({"kind": "transformers", "transformers": {"architecture": "MixtralForCausalLM", "config": {
        **TRANSFORMERS, "intermediate_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2}}}, "fp32"),
])
def test_the_activation_formula_is_what_autograd_saves(model, precision):
    spec = spec_of(model, precision, batch_size=3, seq_len=40)
    activations, weight_copies = saved_for_backward(spec, precision, rows=3)
    assert activation_bytes(model_shape(spec), 3, 40, precision) == pytest.approx(activations, rel=0.03)
    if precision == "bf16":
        assert weight_copies == 2 * model_sizes(spec).matrix_parameters


@pytest.mark.parametrize("model", [{"layers": 2, "width": 64, "heads": 4},
                                   {"layers": 2, "width": 64, "heads": 4, "moe": {"experts": 4, "top_k": 2}},
                                   {"layers": 2, "width": 64, "heads": 4, "qk_norm": True},
                                   {"kind": "transformers", "transformers": {"architecture": "LlamaForCausalLM",
                                                                             "config": {**TRANSFORMERS,
                                                                                        "intermediate_size": 176}}},
                                   {"kind": "transformers", "transformers": {
                                       "architecture": "MixtralForCausalLM", "config": {
                                           **TRANSFORMERS, "intermediate_size": 128, "num_local_experts": 4,
                                           "num_experts_per_tok": 2}}}],
                         ids=["byte_gpt", "byte_moe", "qk_norm", "llama", "mixtral"])
def test_the_activation_formula_with_bf16_weights_is_what_autograd_saves(model):
    # FSDP2's mixed precision: the weights compute in bf16, so the residual stream is bf16 and autocast
    # copies nothing.
    spec = spec_of(model, "bf16", batch_size=3, seq_len=40)
    activations, weight_copies = saved_for_backward(spec, "bf16", rows=3, bf16_parameters=True)
    assert weight_copies == 0
    assert activation_bytes(model_shape(spec), 3, 40, "bf16", bf16_parameters=True) == pytest.approx(activations, rel=0.03)
    assert activations < saved_for_backward(spec, "bf16", rows=3)[0]


# Measures a forward pass's resident memory with every allocation above 64 KB its own mapping, so that
# freed tensors leave the process at once. Prints what the forward pass kept and the peak over both passes.
# The spec comes as JSON (argv[1]): importing this module there would import the CLI and the planner too.
RESIDENT_MEMORY = """
import re, sys, torch
from infra.spec import RunSpec
from training.model.parallel import LearnerParallelism
from training.model.registry import build_model
torch.set_num_threads(1)
def status(field):
    return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
spec = RunSpec.model_validate_json(sys.argv[1])
model = build_model(spec)
LearnerParallelism("data_parallel", 0, 1, torch.device("cpu"), activation_checkpointing=True).place(model)
data = torch.randint(0, 256, (8, 257), generator=torch.Generator().manual_seed(0))
model.loss(data[:, :-1], data[:, 1:]).backward()  # the gradients' own memory, before measuring
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from here
loss = model.loss(data[:, :-1], data[:, 1:])
kept = status("VmRSS") - before
loss.backward()
print(kept, status("VmHWM") - before)
"""


@pytest.mark.integration  # a process of its own, with torch
def test_checkpointed_activations_are_what_a_forward_pass_keeps():
    # Each block keeps its fp32 input, the head its activations; backward then recomputes one block at a
    # time (its gradients' temporaries are not counted: the peak is a few percent above the plan).
    spec = spec_of({"layers": 8, "width": 256, "heads": 4}, batch_size=8, seq_len=256)
    shape = model_shape(spec)
    measured = subprocess.run([sys.executable, "-c", RESIDENT_MEMORY, spec.model_dump_json()], capture_output=True,
                              text=True, check=True,
                              cwd=Path(__file__).parents[1], env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    kept, peak = map(int, measured.stdout.split())
    tokens = 8 * 256
    assert kept == pytest.approx(tokens * (8 * 4 * 256 + head_activation_bytes_per_token(shape, "fp32")), rel=0.05)
    planned = activation_bytes(shape, 8, 256, "fp32", checkpointed=True)
    assert planned == pytest.approx(peak, rel=0.1)
    assert planned < activation_bytes(shape, 8, 256, "fp32") / 4


def test_the_memory_options_lower_what_a_rank_needs():
    # The toy in bf16 under fsdp over 2 processes, 2 sequences of 16 a rank.
    base = spec_of(precision="bf16", parallelism="fsdp", processes=2)
    shape, sizes = model_shape(base), model_sizes(base)

    def forward_backward(**options):
        spec = spec_of(precision="bf16", parallelism="fsdp", processes=2, **options)
        rank = rank_memory(spec, spec.islands[0], sizes, shape)
        return rank.options, rank.transient["forward and backward"]

    assert forward_backward() == ((), {"activations": activation_bytes(shape, 2, 16, "bf16"),
                                       "gathered layers": 3 * 2200 * 4, "bf16 weight copies": 2 * TOY_MATRICES})
    # Mixed precision: no autocast copies, the gathered layers in bf16 with one fp32 gradient, a bf16 residual.
    options, parts = forward_backward(fsdp_mixed_precision=True)
    assert options == ("fsdp_mixed_precision",)
    assert parts == {"activations": activation_bytes(shape, 2, 16, "bf16", bf16_parameters=True),
                     "gathered layers": 2200 * (3 * 2 + 4)}
    assert parts["gathered layers"] == gathered_layer_bytes(sizes, bf16_parameters=True)
    assert parts["activations"] < activation_bytes(shape, 2, 16, "bf16")
    # Activation checkpointing: each of the 2 blocks keeps its fp32 input, and one is recomputed.
    options, parts = forward_backward(activation_checkpointing=True)
    assert options == ("activation_checkpointing",)
    assert parts["activations"] == 32 * (2 * 4 * 8 + layer_activation_bytes_per_token(shape, "bf16")
                                         + head_activation_bytes_per_token(shape, "bf16")) \
        < activation_bytes(shape, 2, 16, "bf16")
    # Planned under data parallelism (the other parallelism's figure), mixed precision takes no effect.
    mixed = spec_of(precision="bf16", parallelism="fsdp", processes=2, fsdp_mixed_precision=True)
    assert rank_memory(mixed, mixed.islands[0], sizes, shape, "data_parallel").options == ()


def test_host_memory_counts_the_exchange_s_state_where_it_lives():
    # Nesterov, lossless: initial weights, anchors, the outer optimizer's copy, its momentum and its
    # snapshot; a checkpoint stages the weights and both inner moments.
    spec = spec_of()
    sizes = model_sizes(spec)
    vector = 4 * TOY_PARAMETERS
    assert exchange_state(spec, sizes) == {"initial weights": vector, "anchors": vector, "outer parameters": vector,
                                           "outer state": vector, "outer state snapshot": vector,
                                           "error-feedback residual": 0}
    assert checkpoint_staging(spec, sizes) == 3 * vector
    # An exchange in flight, one fragment of everything, no peer (one learner): the weights sent, the
    # pseudo-gradient, the outer step's gradient, anchor and copy (5 vectors: an uncompressed message's
    # fields are those tensors), and the new snapshot of the momentum. Compressed, butterfly's two fields
    # as decoded and their residuals.
    assert exchange_in_flight(spec, spec.islands[0], sizes) == 5 * vector + vector
    compressed = spec_of(compression="int4")
    assert exchange_in_flight(compressed, compressed.islands[0], sizes) == (5 + 2 + 2) * vector + vector
    # int4 with error feedback keeps a residual per message field; two fragments checkpoint the anchors.
    lossy = spec_of(compression="int4", fragments=2)
    assert exchange_state(lossy, model_sizes(lossy))["error-feedback residual"] == 2 * vector
    assert checkpoint_staging(lossy, model_sizes(lossy)) == 4 * vector + 2 * vector
    # Shampoo: momentum, the graft's momentum and, per matrix, statistics and preconditioners of both sides.
    shampoo = spec_of(outer="shampoo")
    assert model_sizes(shampoo).outer_state > 2 * TOY_PARAMETERS


def test_a_learner_s_host_holds_every_rank_s_copy_and_on_cpu_the_ranks():
    # Two processes on one node: each keeps the exchange's state; on cpu, both ranks' own memory too.
    spec = spec_of(processes=2, batch_size=4)
    sizes, island = model_sizes(spec), spec.islands[0]
    state = sum(exchange_state(spec, sizes).values())
    parts = learner_host(spec, island, sizes, rank_peak=1000)
    assert parts == {"ranks on cpu": 2 * 1000, "exchange state": state, "other ranks' exchange state": state,
                     "checkpoint staging": checkpoint_staging(spec, sizes),
                     "exchange in flight": exchange_in_flight(spec, island, sizes)}
    # On an accelerator the ranks' memory is the device's; over two nodes, one rank on rank 0's host.
    two_nodes = parse_spec({**spec.model_dump(mode="json", exclude_unset=True), "islands": [{
        **island.model_dump(mode="json", exclude_unset=True), "device": "cuda", "nodes_per_learner": 2,
        "network_interface": "ib0"}]})
    parts = learner_host(two_nodes, two_nodes.islands[0], sizes, rank_peak=1000)
    assert parts["ranks on cpu"] == 0 and parts["other ranks' exchange state"] == 0


def test_a_host_too_small_is_refused_with_its_figures_and_what_would_fit():
    need = sum(learner_host(spec_of(), spec_of().islands[0], model_sizes(spec_of()),
                            peak_of(spec_of())).values())
    assert check_fits(spec_of(host_memory_gb=need / GB))["host"]["hosts"]["east"]["fits"]
    with pytest.raises(MemoryRefused) as refused:
        check_fits(spec_of(host_memory_gb=need / GB * 0.9))
    assert str(refused.value).startswith(f"island east: a learner's host needs {need / GB:.2g} GB of host memory, "
                                         f"it has {need / GB * 0.9:.2g} GB (its rank on cpu ")
    assert "nothing in the spec lowers it: hosts with more memory" in str(refused.value)
    # Shampoo's state on two ranks of a node: one rank per host, or Nesterov, fits with less.
    shampoo = spec_of(outer="shampoo", processes=2, host_memory_gb=1e-6)
    with pytest.raises(MemoryRefused, match=r"island east: .*the exchange's state [0-9.e-]+ on each of its 2 ranks "
                                            r"there.*even nodes_per_learner: 2 \(one rank per host\) and "
                                            r"sync.outer.name: nesterov needs"):
        check_fits(shampoo)


def test_the_learners_of_islands_without_host_memory_share_this_host():
    # A 1B-parameter model on three CPU learners: each needs its ranks' 16 bytes a parameter and more, and
    # all three live here: more than any machine that runs these tests has.
    spec = spec_of({"layers": 16, "width": 2048, "heads": 16}, batch_size=1, seq_len=64)
    spec = parse_spec({**spec.model_dump(mode="json", exclude_unset=True),
                       "islands": [{**spec.islands[0].model_dump(mode="json", exclude_unset=True), "learners": 3}]})
    plan = memory_plan(spec)
    here = plan["host"]["hosts"]["this host"]
    assert here["memory_bytes"] == this_host_bytes() and here["learners"] == 3
    assert here["need_bytes"] == 3 * sum(plan["host"]["islands"]["east"]["parts"].values()) > 3 * 16 * 0.8e9
    with pytest.raises(MemoryRefused, match=rf"^this host: the 3 learners of islands east need "
                                            rf"{here['need_bytes'] / GB:.1f} GB of host memory, it has "
                                            rf"{this_host_bytes() / GB:.1f} GB \(a learner of east: its rank on cpu"):
        check_fits(spec)


def peak_of(spec) -> int:
    return rank_memory(spec, spec.islands[0], model_sizes(spec), model_shape(spec)).peak


def test_a_run_that_does_not_fit_is_refused_naming_the_island_and_the_fix():
    unchecked = check_fits(spec_of())  # no device memory given: only this host is checked
    assert unchecked["islands"]["east"]["fits"] is None and unchecked["host"]["hosts"]["this host"]["fits"]
    # Data parallel over 4 processes, one sequence each: 60,800 + 34,880 bytes (see above).
    need = peak_of(spec_of(processes=4))
    assert need == 95_680
    assert check_fits(spec_of(processes=4, device_memory_gb=need / GB))["islands"]["east"]["fits"]
    with pytest.raises(MemoryRefused) as refused:
        check_fits(spec_of(processes=4, device_memory_gb=90e-6))
    assert str(refused.value) == ("island east: data_parallel over 4 processes needs 9.6e-05 GB per rank, its "
                                  "accelerators have 9e-05 GB; parallelism: fsdp over 4 processes needs 7.6e-05 GB "
                                  "per rank")
    # Too small for fsdp over its 2 processes: activation checkpointing would do; with it already on, 4
    # processes would (3 does not divide the batch of 4).
    two = peak_of(spec_of(parallelism="fsdp", processes=2))
    with pytest.raises(MemoryRefused, match=r"; activation_checkpointing: true needs [0-9.e-]+ GB per rank$"):
        check_fits(spec_of(parallelism="fsdp", processes=2, device_memory_gb=two / GB * 0.95))
    recomputing = spec_of(parallelism="fsdp", processes=2, activation_checkpointing=True)
    with pytest.raises(MemoryRefused, match=r"fsdp over 2 processes with activation_checkpointing needs .*; "
                                            r"parallelism: fsdp with at least 4 processes per learner \(1 sequence "
                                            r"per rank\) needs"):
        check_fits(spec_of(parallelism="fsdp", processes=2, activation_checkpointing=True,
                           device_memory_gb=peak_of(recomputing) / GB * 0.95))
    with pytest.raises(MemoryRefused, match=r"even fsdp over 4 processes \(one sequence per rank\) with "
                                            r"activation_checkpointing: true needs"):
        check_fits(spec_of(device_memory_gb=1e-6))


def test_a_registered_model_s_fit_is_not_guessed(installed_model):
    spec = spec_of({"kind": "tiny", "options": {"layers": 2}}, device_memory_gb=80)
    assert model_sizes(spec).parameters > 0
    with pytest.raises(MemoryRefused, match="island east: device_memory_gb is set, but the activations of model "
                                            "kind 'tiny' cannot be estimated"):
        check_fits(spec)


def brief_32b(**island_changes) -> dict:
    raw = yaml.safe_load(CONFIG_32B.read_text())
    for island in raw["islands"]:
        island.update(island_changes)
    return raw


def test_the_32b_brief_reports_host_memory_per_island_and_does_not_fit_its_hosts():
    # Shampoo's state on the host of each learner's rank 0, and a copy on each other rank there (4 GPUs a
    # GB300 tray, 8 a B300 node): more than the tray's 960 GB or the node's 2 TB, even with one rank per host
    # and Nesterov momentum instead.
    plan = memory_plan(parse_spec(brief_32b()))
    state = plan["host"]["exchange_state"]
    assert state["outer state"] > 5 * state["anchors"]  # Shampoo's statistics and roots, besides its momenta
    for name, ranks, memory in (("gb300", 4, 960), ("b300", 8, 2048)):
        island, host = plan["host"]["islands"][name], plan["host"]["hosts"][name]
        assert island["ranks"] == ranks and island["parts"]["other ranks' exchange state"] == \
            (ranks - 1) * sum(state.values())
        assert host["memory_bytes"] == memory * GB and host["need_bytes"] > 2 * memory * GB and not host["fits"]
        assert host["to_fit"].startswith("even nodes_per_learner: 72 (one rank per host) and sync.outer.name: "
                                         "nesterov needs")


def test_the_32b_run_fits_its_islands_with_fsdp_and_not_with_data_parallel():
    plan = memory_plan(parse_spec(brief_32b(), "plan"))
    assert plan["parameters"] > 32e9
    for name in ("gb300", "b300"):
        island = plan["islands"][name]
        assert island["rank"]["parallelism"] == "fsdp" and island["rank"]["processes"] == 72
        assert island["fits"]
        assert island["other_parallelism"]["parallelism"] == "data_parallel"
        assert island["other_parallelism"]["peak_bytes"] > 390 * GB


def test_plan_prints_memory_per_rank_and_per_host_and_refuses_what_does_not_fit(tmp_path, capsys):
    steps = ["--step-seconds", "gb300=0.30", "--step-seconds", "b300=0.25"]
    short = tmp_path / "short.yaml"  # the brief's run over fewer rounds: its memory is the same
    short.write_text(yaml.safe_dump({**brief_32b(), "sync": {**brief_32b()["sync"], "rounds": 4}}))
    # Its ranks fit their GPUs, its learners' Shampoo state does not fit their hosts: refused with the
    # plan's figures and the host memory table, and with --json the plan and the refusal.
    assert main(["plan", str(short), *steps, "--json", str(tmp_path / "plan.json")]) == 2
    captured = capsys.readouterr()
    assert "| gb300 | fsdp | 72 | 8 |" in captured.out and "| 148.9 | 288 | yes |" in captured.out
    assert "| gb300 | gb300 | 4 | 0 | 2215.7 | 6647.0 | 781.4 | 554.1 | 10198.2 | 960.0 | no |" in captured.out
    assert captured.err.startswith("error: island gb300: a learner's host needs 10198.2 GB of host memory, it has "
                                   "960.0 GB (the exchange's state 2215.7 on each of its 4 ranks there, checkpoint "
                                   "staging 781.4, exchange in flight 554.1); even nodes_per_learner: 72 (one rank per "
                                   "host) and sync.outer.name: nesterov needs 2084.1 GB: hosts with more memory\n")
    assert "link for 95% utilisation" not in captured.out  # refused before planning the link
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written["memory"]["host"]["hosts"]["b300"]["fits"] is False and len(written["refused"]) == 2
    # On hosts of 20 TB it fits and the link is planned.
    big_hosts = [*steps, "--host-memory-gb", "20000"]
    assert main(["plan", str(short), *big_hosts]) == 0
    printed = capsys.readouterr().out
    assert "| gb300 | gb300 | 4 |" in printed and "| 20000.0 | yes |" in printed and "link for 95% utilisation" in printed
    assert "- gb300: data_parallel over 72 processes would need" in printed
    assert "fsdp fits 288 GB from 36 processes per learner (16 sequences per rank" in printed
    # On H200s the GB300 island's 8 sequences per rank do not fit: FSDP2's mixed precision would.
    assert main(["plan", str(short), *big_hosts, "--device-memory-gb", "141"]) == 2
    captured = capsys.readouterr()
    assert "| gb300 | fsdp | 72 | 8 |" in captured.out and "| b300 | fsdp | 72 | 6 |" in captured.out
    assert captured.err == ("error: island gb300: fsdp over 72 processes needs 148.9 GB per rank, its accelerators "
                            "have 141 GB; fsdp_mixed_precision: true needs 75.0 GB per rank\n")
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(yaml.safe_dump({**brief_32b(fsdp_mixed_precision=True),
                                     "sync": {**brief_32b()["sync"], "rounds": 4}}))
    assert main(["plan", str(mixed), *big_hosts, "--device-memory-gb", "141"]) == 0
    assert "| gb300 | fsdp, fsdp_mixed_precision | 72 | 8 |" in capsys.readouterr().out
    data_parallel = tmp_path / "dp.yaml"
    data_parallel.write_text(yaml.safe_dump(brief_32b(parallelism="data_parallel")))
    assert main(["plan", str(data_parallel), *big_hosts]) == 2
    captured = capsys.readouterr()
    assert "| gb300 | data_parallel | 72 |" in captured.out and "| no |" in captured.out
    assert ("error: island gb300: data_parallel over 72 processes needs 651.2 GB per rank, its accelerators have "
            "288 GB; parallelism: fsdp over 72 processes needs 148.9 GB per rank") in captured.err
    for flag in ("--device-memory-gb", "--host-memory-gb"):
        for wrong in ("nowhere=80", "-3", "lots"):
            assert main(["plan", str(CONFIG_32B), *steps, flag, wrong]) == 2
            assert f"{flag} {wrong!r}" in capsys.readouterr().err


def fitting_32b(tmp_path, **island) -> Path:
    """A 32B run whose plan fits: the brief's, with one rank per host (nodes_per_learner 72) of 4 TB (a DGX
    B200's upgraded memory) and Nesterov momentum as the outer optimizer."""
    raw = brief_32b(**{"nodes_per_learner": 72, "host_memory_gb": 4096, **island})
    raw["sync"]["outer"] = {"name": "nesterov", "lr": 0.7, "momentum": 0.9}
    raw["store"] = {"url": str(tmp_path / "store")}
    path = tmp_path / f"fits-{len(list(tmp_path.glob('fits-*')))}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_run_dry_run_accepts_a_32b_run_that_fits_and_stops_before_any_work(tmp_path, capsys):
    assert main(["run", str(fitting_32b(tmp_path)), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "| gb300 | fsdp | 72 | 8 |" in printed and "| 148.9 | 288 | yes |" in printed
    assert "| gb300 | gb300 | 1 | 0 | 911.6 | 0 | 781.4 | 391.0 | 2084.1 | 4096.0 | yes |" in printed
    assert "32,558,848,000 parameters in 20 blocks (built on the meta device)" in printed
    assert "island b300: 4 learners of 72 cuda processes on 72 node(s), fsdp, bf16" in printed
    assert printed.rstrip().endswith("dry run: every check passed; nothing was started")
    assert [path.name for path in (tmp_path / "store").iterdir()] == ["_probe"]  # its reachability probe only
    assert not any((tmp_path / "store" / "_probe").iterdir())


def test_run_dry_run_refuses_a_host_or_a_rank_too_small_with_the_plan_s_figures(tmp_path, capsys):
    assert main(["run", str(fitting_32b(tmp_path, host_memory_gb=2000)), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("error: island gb300: a learner's host needs 2084.1 GB of host memory, it has 2000.0 GB "
                            "(the exchange's state 911.6, checkpoint staging 781.4, exchange in flight 391.0); nothing "
                            "in the spec lowers it: hosts with more memory; island b300: a learner's host needs 2084.1 "
                            "GB of host memory, it has 2000.0 GB (the exchange's state 911.6, checkpoint staging "
                            "781.4, exchange in flight 391.0); nothing in the spec lowers it: hosts with more memory\n")
    assert "dry run" not in captured.out
    assert main(["run", str(fitting_32b(tmp_path, device_memory_gb=141)), "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        "error: island gb300: fsdp over 72 processes needs 148.9 GB per rank, its accelerators have 141 GB; "
        "fsdp_mixed_precision: true needs 75.0 GB per rank\n")


async def read_artifacts(key: str, flow_run_id):
    """One flow run's artifacts of this key: every lifecycle on the session's Prefect API publishes a `memory`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    async with get_client() as client:
        return await client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))


def test_a_run_that_does_not_fit_fails_before_any_training(tmp_path, prefect_api, capsys):
    from flows.lifecycle import run_lifecycle
    from infra import layout
    from infra.stores import open_run

    raw = spec_of(processes=4, device_memory_gb=90e-6).model_dump(mode="json", exclude_unset=True)
    spec = parse_spec({**raw, "store": {"url": str(tmp_path / "store")}})
    state = run_lifecycle(spec, "too-big", return_state=True)
    assert state.is_failed()
    refused = state.result(raise_on_failure=False)
    assert isinstance(refused, MemoryRefused) and "island east: data_parallel over 4 processes" in str(refused)
    assert not open_run(spec, "too-big").exists(layout.SPEC)  # the run never started
    artifacts = asyncio.run(read_artifacts("memory", state.state_details.flow_run_id))
    assert artifacts and "| east | data_parallel | 4 | 1 |" in artifacts[0].data and "| no |" in artifacts[0].data
    config = tmp_path / "spec.yaml"
    config.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_unset=True)))
    assert main(["run", str(config)]) == 2
    assert "error: island east: data_parallel over 4 processes needs" in capsys.readouterr().err
