"""Memory per rank: the arithmetic on a model small enough to count by hand, the activation formula
against the tensors autograd really saves, and the plan's refusal of a run that does not fit."""

import asyncio
from pathlib import Path

import pytest
import torch
import yaml

from flows.cli import main
from infra.spec import parse_spec
from training.model.inner import forward_precision
from training.model.registry import build_model
from training.planning.memory import (GB, MemoryRefused, activation_bytes, check_fits, host_bytes,
                                      layer_activation_bytes_per_token, memory_plan, model_shape, model_sizes,
                                      rank_memory)

CONFIG_32B = Path(__file__).parents[1] / "configs" / "plan-brief-32b.yaml"


def spec_of(model=None, precision="fp32", parallelism="data_parallel", processes=1, device_memory_gb=None,
            batch_size=4, seq_len=16, outer="nesterov", compression="none", fragments=1):
    return parse_spec({
        "islands": [{"name": "east", "learners": 1, "batch_size": batch_size, "seq_len": seq_len, "inner_steps": 1,
                     "precision": precision, "parallelism": parallelism, "processes_per_learner": processes,
                     "device_memory_gb": device_memory_gb}],
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


def saved_for_backward(spec, precision, rows):
    """Bytes autograd saves in one forward pass of the spec's model, split into the bf16 copies of
    weights and everything else."""
    model = build_model(spec)
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


def test_host_memory_counts_the_exchange_s_state_where_it_lives():
    # Nesterov, lossless: initial weights, anchors, the outer optimizer's copy, its momentum and its
    # snapshot; a checkpoint stages the weights and both inner moments.
    host = host_bytes(spec_of(), model_sizes(spec_of()))
    vector = 4 * TOY_PARAMETERS
    assert host == {"initial weights": vector, "anchors": vector, "outer parameters": vector, "outer state": vector,
                    "outer state snapshot": vector, "error-feedback residual": 0, "checkpoint staging": 3 * vector}
    # int4 with error feedback keeps a residual per message field; two fragments checkpoint the anchors.
    lossy = spec_of(compression="int4", fragments=2)
    host = host_bytes(lossy, model_sizes(lossy))
    assert host["error-feedback residual"] == 2 * vector and host["checkpoint staging"] == 4 * vector + 2 * vector
    # Shampoo: momentum, the graft's momentum and, per matrix, statistics and preconditioners of both sides.
    shampoo = spec_of(outer="shampoo")
    assert model_sizes(shampoo).outer_state > 2 * TOY_PARAMETERS


def peak_of(spec) -> int:
    return rank_memory(spec, spec.islands[0], model_sizes(spec), model_shape(spec)).peak


def test_a_run_that_does_not_fit_is_refused_naming_the_island_and_the_fix():
    assert check_fits(spec_of()) is None  # no device memory given: nothing checked
    # Data parallel over 4 processes, one sequence each: 60,800 + 34,880 bytes (see above).
    need = peak_of(spec_of(processes=4))
    assert need == 95_680
    assert check_fits(spec_of(processes=4, device_memory_gb=need / GB))["islands"]["east"]["fits"]
    with pytest.raises(MemoryRefused) as refused:
        check_fits(spec_of(processes=4, device_memory_gb=90e-6))
    assert str(refused.value) == ("island east: data_parallel over 4 processes needs 9.6e-05 GB per rank, its "
                                  "accelerators have 9e-05 GB; parallelism: fsdp over 4 processes needs 7.6e-05 GB "
                                  "per rank")
    # Too small for fsdp over its 2 processes: 4 would do (3 does not divide the batch of 4).
    with pytest.raises(MemoryRefused, match=r"fsdp with at least 4 processes per learner \(1 sequence per rank\)"):
        check_fits(spec_of(parallelism="fsdp", processes=2,
                           device_memory_gb=peak_of(spec_of(parallelism="fsdp", processes=2)) / GB * 0.95))
    with pytest.raises(MemoryRefused, match=r"even fsdp over 4 processes \(one sequence per rank\) needs"):
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


def test_the_32b_run_fits_its_islands_with_fsdp_and_not_with_data_parallel():
    plan = memory_plan(parse_spec(brief_32b(), "plan"))
    assert plan["parameters"] > 32e9
    for name in ("gb300", "b300"):
        island = plan["islands"][name]
        assert island["rank"]["parallelism"] == "fsdp" and island["rank"]["processes"] == 72
        assert island["fits"]
        assert island["other_parallelism"]["parallelism"] == "data_parallel"
        assert island["other_parallelism"]["peak_bytes"] > 390 * GB


def test_plan_prints_memory_per_rank_and_refuses_what_does_not_fit(tmp_path, capsys):
    steps = ["--step-seconds", "gb300=0.30", "--step-seconds", "b300=0.25"]
    short = tmp_path / "short.yaml"  # the brief's run over fewer rounds: its memory is the same
    short.write_text(yaml.safe_dump({**brief_32b(), "sync": {**brief_32b()["sync"], "rounds": 4}}))
    assert main(["plan", str(short), *steps]) == 0
    printed = capsys.readouterr().out
    assert "| gb300 | fsdp | 72 | 8 |" in printed and "| yes |" in printed and "link for 95% utilisation" in printed
    assert "- gb300: data_parallel over 72 processes would need" in printed
    assert "fsdp fits 288 GB from 36 processes per learner (16 sequences per rank" in printed
    # On H200s the GB300 island's 8 sequences per rank do not fit: twice the processes would.
    assert main(["plan", str(short), *steps, "--device-memory-gb", "141"]) == 2
    captured = capsys.readouterr()
    assert "| gb300 | fsdp | 72 | 8 |" in captured.out and "| b300 | fsdp | 72 | 6 |" in captured.out
    assert captured.err == ("error: island gb300: fsdp over 72 processes needs 148.9 GB per rank, its accelerators "
                            "have 141 GB; parallelism: fsdp with at least 144 processes per learner (4 sequences per "
                            "rank) needs 116.7 GB per rank\n")
    data_parallel = tmp_path / "dp.yaml"
    data_parallel.write_text(yaml.safe_dump(brief_32b(parallelism="data_parallel")))
    assert main(["plan", str(data_parallel), *steps]) == 2
    captured = capsys.readouterr()
    assert "| gb300 | data_parallel | 72 |" in captured.out and "| no |" in captured.out
    assert ("error: island gb300: data_parallel over 72 processes needs 651.2 GB per rank, its accelerators have "
            "288 GB; parallelism: fsdp over 72 processes needs 148.9 GB per rank") in captured.err
    assert "link for 95% utilisation" not in captured.out  # refused before planning the link
    for wrong in ("nowhere=80", "-3", "lots"):
        assert main(["plan", str(CONFIG_32B), "--device-memory-gb", wrong]) == 2
        assert wrong in capsys.readouterr().err


async def read_artifacts(key: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async with get_client() as client:
        return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


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
    artifacts = asyncio.run(read_artifacts("memory"))
    assert artifacts and "| east | data_parallel | 4 | 1 |" in artifacts[0].data and "| no |" in artifacts[0].data
    config = tmp_path / "spec.yaml"
    config.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_unset=True)))
    assert main(["run", str(config)]) == 2
    assert "error: island east: data_parallel over 4 processes needs" in capsys.readouterr().err
