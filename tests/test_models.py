"""Models from the registry: the byte GPT and transformers causal LMs (dense Llama, sparse Mixtral and
Qwen2-MoE) built from their configs, behind the interface every arm uses."""

from __future__ import annotations

import pytest
import torch

from infra.spec import SpecError, parse_spec
from tests.learners import assert_restart_continues_exactly
from training.exchange.fragments import FragmentLayout
from training.learner.loop import Learner
from training.model.params import flat_parameters
from training.model.registry import build_model

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
         "intermediate_size": 64}
MODELS = {
    "llama": {"kind": "transformers", "transformers": {"architecture": "LlamaForCausalLM", "config": SMALL}},
    "mixtral": {"kind": "transformers", "transformers": {"architecture": "MixtralForCausalLM", "config": {
        **SMALL, "num_local_experts": 4, "num_experts_per_tok": 1, "router_aux_loss_coef": 0.02}}},
    "qwen2_moe": {"kind": "transformers", "transformers": {"architecture": "Qwen2MoeForCausalLM", "config": {
        **SMALL, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32}}},
}


def spec_with(model: dict, **sync):
    return parse_spec({
        "name": "models", "model": model,
        "islands": [{"name": name, "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2}
                    for name in ("a", "b")],
        "data": {"corpora": [{"name": "text", "source": "files", "paths": ["unused/*.txt"]}]},
        "sync": {"rounds": 2, **sync},
    })


@pytest.mark.parametrize("config, problem", [
    ({"architecture": "LlamaForCausalLM", "config": {**SMALL, "hiddn_size": 30}}, "has no field hiddn_size"),
    ({"architecture": "LlamaForCausalLM", "config": {**SMALL, "num_attention_heads": 3, "num_key_value_heads": 3}},
     "transformers refuses LlamaForCausalLM's config: .*multiple of the number of attention heads"),
    ({"architecture": "LlamaForCausalLM", "config": {**SMALL, "vocab_size": 50000}}, "vocab_size: set by the run"),
    ({"architecture": "GPT2LMHeadModel", "config": {}}, "architecture"),
])
def test_a_transformers_config_the_library_refuses_is_named_before_any_work(config, problem):
    with pytest.raises(SpecError, match=problem):
        spec_with({"kind": "transformers", "transformers": config})


QWEN2_MOE = MODELS["qwen2_moe"]["transformers"]["config"]


@pytest.mark.parametrize("architecture, config, problem", [
    ("Qwen2MoeForCausalLM", {**QWEN2_MOE, "num_attention_heads": 3, "num_key_value_heads": 3},
     r"model.transformers: .*config.num_attention_heads: 3 does not divide hidden_size 32"),
    ("Qwen2MoeForCausalLM", {**QWEN2_MOE, "num_attention_heads": 4, "num_key_value_heads": 3},
     r"config.num_key_value_heads: 3 does not divide num_attention_heads 4"),
    ("MixtralForCausalLM", {**SMALL, "hidden_size": 36, "num_attention_heads": 4, "num_key_value_heads": 4},
     r"config.num_attention_heads: 4 heads of hidden_size 36 are 9 wide, and rotary .* even"),
    ("Qwen2MoeForCausalLM", {**QWEN2_MOE, "num_experts_per_tok": 5}, r"config.num_experts_per_tok: 5 with num_experts 4"),
    ("Qwen2MoeForCausalLM", {**QWEN2_MOE, "mlp_only_layers": [2]}, r"config.mlp_only_layers: \[2\] are not layers"),
])
def test_a_transformers_shape_the_library_accepts_but_cannot_train_is_refused_at_load(architecture, config, problem):
    with pytest.raises(SpecError, match=problem):
        spec_with({"kind": "transformers", "transformers": {"architecture": architecture, "config": config}})


@pytest.mark.parametrize("model, problem", [
    ({"layers": 2, "width": 130, "heads": 4}, r"model: .*heads: 4 does not divide width 130"),
    ({"layers": 2, "width": 32, "heads": 4, "moe": {"experts": 2, "top_k": 3}}, r"model.moe: .*top_k 3 exceeds experts 2"),
])
def test_a_byte_gpt_shape_that_cannot_train_is_refused_at_load(model, problem):
    with pytest.raises(SpecError, match=problem):
        spec_with(model)


def test_a_transformers_section_needs_its_kind():
    with pytest.raises(SpecError, match="needs the transformers section"):
        spec_with({"kind": "transformers"})
    with pytest.raises(SpecError, match="are for kind transformers, not byte_gpt"):
        spec_with({"transformers": MODELS["llama"]["transformers"]})


@pytest.mark.parametrize("name", list(MODELS))
def test_every_learner_builds_the_same_initial_model_and_the_spec_counts_it(name):
    spec = spec_with(MODELS[name])
    first, second = build_model(spec), build_model(spec)
    assert torch.equal(flat_parameters(first), flat_parameters(second))
    counts = first.parameter_counts()
    assert counts["total"] == spec.model.parameter_count(spec.max_seq_len) == flat_parameters(first).numel()
    with torch.device("meta"):
        assert sum(p.numel() for p in build_model(spec).parameters()) == counts["total"]


def test_a_sparse_model_counts_top_k_of_its_routed_experts_as_active():
    model = build_model(spec_with(MODELS["mixtral"]))
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    counts = model.parameter_counts()
    assert routed > 0 and counts["active"] == counts["total"] - routed * 3 // 4  # top 1 of 4 experts
    qwen = build_model(spec_with(MODELS["qwen2_moe"])).parameter_counts()
    assert qwen["total"] > qwen["active"] > 0  # top 2 of 4, the shared expert always active


def test_the_router_s_auxiliary_loss_trains_the_router():
    model = build_model(spec_with(MODELS["mixtral"]))
    tokens = torch.randint(0, 257, (2, 17))
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    logits = model(tokens[:, :-1])
    plain = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert loss > plain  # the balance term is added
    loss.backward()
    router = next(p for name, p in model.named_parameters() if name.endswith("mlp.gate.weight"))
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_fragments_deal_a_transformers_model_s_layers():
    model = build_model(spec_with(MODELS["llama"]))
    layout = FragmentLayout.build(model, 2, "strided")
    assert sum(layout.sizes) == flat_parameters(model).numel()
    for fragment, names in enumerate(layout.names):
        layers = {model.block_of(name) for name in names} - {None}
        assert layers == {fragment}
    assert {"lm.model.embed_tokens.weight", "lm.lm_head.weight"} <= set(layout.names[0] + layout.names[1])


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_a_restarted_transformers_learner_continues_exactly(two_learner_run, name):
    """Shampoo outer steps over the model's matrices (the experts' are 3-D), fragments, int8 messages."""
    spec, store = two_learner_run(f"restart-{name}", layers=1, inner_steps=2, model=MODELS[name], rounds=4,
                                  partner_timeout_s=0.3,
                                  outer={"name": "shampoo", "lr": 0.7, "momentum": 0.9,
                                         "shampoo": {"graft": "sgd", "start_preconditioning_step": 2}},
                                  transport={"fragments": 2, "compression": "int8"})
    assert_restart_continues_exactly(spec, store)


def test_a_model_an_installed_package_registers_trains_like_the_built_in_ones(installed_model, two_learner_run):
    spec, store = two_learner_run("registered", layers=1, inner_steps=2, rounds=2, partner_timeout_s=0.3,
                                  model={"kind": "tiny", "options": {"layers": 2}}, transport={"fragments": 2})
    model = build_model(spec)
    assert spec.model.blocks == 2 and "tiny_models:build" in spec.model.describe()
    assert model.parameter_counts()["total"] == spec.model.parameter_count(spec.max_seq_len, spec.vocab_size)
    learner = Learner(spec, store, 0)
    learner.resume()
    learner.run_round(0)
    assert not torch.equal(flat_parameters(learner.model), flat_parameters(model))


def test_a_model_kind_nothing_registers_or_without_the_interface_is_named(installed_model):
    with pytest.raises(SpecError, match=r"neither built in .* nor registered .* \(registered: \['broken', 'tiny'\]\)"):
        spec_with({"kind": "unknown"})
    with pytest.raises(SpecError, match="its model has no loss, block_of, parameter_counts"):
        spec_with({"kind": "broken"})
    with pytest.raises(SpecError, match="options are for a registered model"):
        spec_with({"options": {"layers": 2}})


BYTE_GPT = {"layers": 2, "width": 32, "heads": 4}


def test_qk_layernorm_makes_attention_blind_to_the_scale_of_queries_and_keys():
    spec = spec_with({**BYTE_GPT, "qk_norm": True})
    model = build_model(spec)
    assert model.parameter_counts()["total"] == spec.model.parameter_count(spec.max_seq_len, spec.vocab_size)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    before = model(idx)
    width = BYTE_GPT["width"]
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[:2 * width] *= 30.0  # the query and key projections
    assert torch.allclose(model(idx), before, atol=1e-4)
    plain = build_model(spec_with(BYTE_GPT))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "_norm" not in k})
    assert not torch.allclose(plain(idx), before, atol=1e-2)  # without the norms the scale matters


def test_the_z_loss_adds_the_mean_squared_log_partition_and_pulls_it_towards_zero():
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    inputs, targets = idx[:, :-1], idx[:, 1:]
    model = build_model(spec_with({**BYTE_GPT, "z_loss_weight": 0.5}))
    plain = build_model(spec_with(BYTE_GPT))
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        model.head.weight.add_(0.5)  # tied to the embedding: shifts every logit, so log Z is far from 0
        plain.head.weight.add_(0.5)
        log_z = model(inputs).logsumexp(dim=-1)
    assert torch.allclose(model.loss(inputs, targets), plain.loss(inputs, targets) + 0.5 * log_z.square().mean())
    model.loss(inputs, targets).backward()
    plain.loss(inputs, targets).backward()
    step = 1e-3
    with torch.no_grad():
        for p, q in zip(model.parameters(), plain.parameters()):
            p.sub_(step * p.grad), q.sub_(step * q.grad)
        assert model(inputs).logsumexp(dim=-1).square().mean() < plain(inputs).logsumexp(dim=-1).square().mean()


def test_qk_norm_and_z_loss_belong_to_the_byte_gpt():
    with pytest.raises(SpecError, match="qk_norm and z_loss_weight are settings of byte_gpt"):
        spec_with({**MODELS["llama"], "qk_norm": True})


def test_plan_refuses_a_qwen2_moe_spec_whose_heads_do_not_divide_its_width_as_it_loads(tmp_path, capsys):
    import yaml

    from flows.cli import main

    config = tmp_path / "qwen.yaml"
    model = {"kind": "transformers", "transformers": {"architecture": "Qwen2MoeForCausalLM", "config": {
        **QWEN2_MOE, "hidden_size": 100, "num_attention_heads": 12, "num_key_value_heads": 4}}}
    config.write_text(yaml.safe_dump({**spec_with(MODELS["qwen2_moe"]).model_dump(mode="json"), "model": model}))
    for command in (["plan", str(config)], ["run", str(config)]):
        assert main(command) == 2
        out, err = capsys.readouterr()
        assert not out and err == ("error: invalid run spec: model.transformers: Value error, "
                                   "config.num_attention_heads: 12 does not divide hidden_size 100 "
                                   "(a head's width would be 8.333)\n")
