"""Quality in an honest regime: the brief's 8 learners against standard training tuned as hard, at 20
tokens per active parameter.

Every arm trains the brief's sparse MoE (configs/brief.yaml's model and data) on 20 tokens per active
parameter (the rounds of configs/brief.yaml scaled to that), and is scored in bits per byte on the
same held-out documents, with the bits kept per document for a paired bootstrap. Arms:

- `b`: standard training at its best global batch and learning rate: the learning rate swept per
  batch, and the batch swept (halving or doubling past whichever edge wins) until both optima are
  interior;
- `c`: one learner (M=1) with the islands' rows per round, inner and outer optimizer: its outer
  optimizer chosen, its inner learning rate swept, then its outer learning rate, its outer momentum,
  then its global batch;
- `islands`: configs/brief-hierarchical.yaml (DiLoCo inside each island on exact means, crossings
  between them): its outer optimizer chosen, its outer learning rate swept, then its inner learning
  rate, its outer momentum, its global batch (rows per inner step, inner steps per round scaled
  inversely), then how often the islands cross, down to the most frequent crossing that still moves
  at least 100x fewer inter-island bytes than per-step all-reduce (the bytes goal is a constraint, the
  validation score the objective); last, with QK-LayerNorm and z-loss as chosen, how the bytes goal is
  spent: the recipe's int4 at that interval, or int8 or fp32 each at its own most frequent crossing
  within the goal (`spending_sweep`);
- `butterfly_today`: configs/brief.yaml as it is, untuned.

Once the headline has its seeds, the islands' arm as swept (the recipe's int4 crossings) runs again
(seed 0) with one part of the method taken away at a time (`DIAGNOSTICS`): what each change gains on
validation is what binds.

Every sweep runs on seed 0 and ranks by the validation split only (the mean over its evaluations);
the held-out sets never choose anything. The chosen settings then run on seeds 1 and 2. Standard
training's held-out curve (its snapshots, scored on every held-out byte) says how many tokens it needs
to reach a bpb: `token_ratio_to_c` is the tokens it needs to reach the islands' bpb over those it needs
to reach (c)'s (interpolated in log tokens between points; beyond its last point, extrapolated from a
line in log tokens through its last three, and marked so).

Each arm holds the CPU lock (`benchmarks.harness.CPU_LOCK`) while it trains and writes
`arms/<arm>.json`, so a rerun resumes arm by arm; progress with an ETA goes to `progress.log`; `summary.json` and docs/results/honest.md are
rebuilt after every arm from whatever has finished.

    .venv/bin/python -m experiments.honest            # everything still to run, resuming
    .venv/bin/python -m experiments.honest --plan     # the arms known still to run
    .venv/bin/python -m experiments.honest --table    # only rebuild the summary and the page
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import yaml

from benchmarks.arms import (SEEDS, SWEEP_SEED, batch_and_rate_sweep, interior_sweep, merged, nice, one_learner, run_arm,
                             seeds_bootstrap, validation_score)
from benchmarks.harness import CPU_LOCK, Log, load_arms, resumable_main, run_arms
from benchmarks.results_page import recorded, write_results_page
from eval.report import FP32, allreduce_equivalent
from infra.spec import RunSpec, parse_spec
from training.baseline import BaselinePlan
from training.model.registry import build_model
from training.planning.planner import replay

RESULTS = Path("experiments/honest/results")
TOKENS_PER_ACTIVE_PARAMETER = 20
# The summary's name of each kind of arm.
KINDS = {"b": "standard", "c": "single", "islands": "islands", "butterfly_today": "butterfly_today"}
LABELS = {"b": "(b)", "c": "(c)", "islands": "islands", "butterfly_today": "butterfly today"}
CONFIGS = {"islands": Path("configs/brief-hierarchical.yaml"), "butterfly_today": Path("configs/brief.yaml")}
FIRST_BATCH = 24
FIRST_LEARNING_RATES = (2.5e-3, 5e-3, 1e-2)  # (b)'s sweep at FIRST_BATCH
# (b)'s batches: down to 3 rows a step (23,000 steps), so that its best batch, 6 in the sweep so far,
# is interior rather than the sweep's edge.
BATCH_LIMITS = (3, 192)
OUTER_FACTORS = (0.7, 1.0, 1.4)
INNER_FACTORS = (0.5, 1.0, 2.0)
BATCH_FACTORS = (0.5, 1.0, 2.0)
# The islands' global batch scales every island's rows per inner step and, inversely, its inner steps
# per round: tokens per round, rounds and outer steps stay the recipe's. West's 2 processes per learner
# need 2 rows and east's round at least one step: 12 to 96 for the recipe's 48.
ISLAND_BATCH_LIMITS = (12, 96)
# The outer optimizers the learners' sweeps choose among first, each at its own learning rate: the
# recipe's (None: Shampoo-directed, SGD-grafted, momentum 0.5, lr 1), DiLoCo's Nesterov (lr 0.7, momentum
# 0.9), and plain averaging (lr 1, no momentum: the next anchor is the mixed learners' weights).
OUTER_OPTIMIZERS = {"nesterov": {"name": "nesterov", "lr": 0.7, "momentum": 0.9},
                    "averaging": {"name": "nesterov", "lr": 1.0, "momentum": 0.0}}
CURVE_POINTS = 10
# Each tuned kind is tried once more at its chosen settings with these (seed 0, validation split), and
# keeps them where they help: the published work trained with both.
STABILITY = {"qk_norm": True, "z_loss_weight": 1e-4}


def rounds_between_crossings(raw: dict) -> int:
    """Rounds between one fragment's crossings of islands: each of the F fragments crosses every
    `inter_island_every` of its exchanges, one exchange in F rounds."""
    return raw["sync"]["inter_island_every"] * raw["sync"]["transport"]["fragments"]


# One change each to the islands' chosen arm, as overrides of its raw spec: what binds is what its
# removal gains.
DIAGNOSTICS = {
    "cross-every": ("islands cross at every exchange", lambda raw: {"sync": {"inter_island_every": 1}}),
    # As many rounds between crossings as before (`rounds_between_crossings`).
    "whole": ("the whole model every round, applied at once (1 fragment, tau 0; crossings as many rounds apart)",
              lambda raw: {"sync": {"inter_island_every": rounds_between_crossings(raw),
                                    "transport": {"fragments": 1, "tau": 0}}}),
    # The same with the overlap kept: which of the two the gain of "whole" comes from.
    "one-fragment": ("the whole model every round, overlapped as chosen (1 fragment; crossings as many rounds apart)",
                     lambda raw: {"sync": {"inter_island_every": rounds_between_crossings(raw),
                                           "transport": {"fragments": 1}}}),
    "fp32": ("crossings in fp32, not int4", lambda raw: {"sync": {"transport": {"compression": "none"}}}),
    # Only where the sweep chose Shampoo (the recipe's outer optimizer): the tuned Nesterov control.
    "nesterov": ("Nesterov's direction, not Shampoo's (same rate and momentum)",
                 lambda raw: {"sync": {"outer": {"name": "nesterov"}}}),
}
# The other ways to spend the bytes goal than the recipe's int4: each at its own most frequent crossing
# within the goal (arm name: transport.compression).
COMPRESSIONS = {"int8": "int8", "fp32": "none"}
GOAL = -0.01  # the islands at least 1% below (b) on every evaluation
TOKEN_RATIO_GOAL = 1.5  # and within 1.5x of (c) in standard training's tokens
# (b) at its chosen settings once more on every seed on this many times the regime's tokens, so that its
# held-out curve reaches (c)'s bpb rather than a line drawn past its end.
LONGER_B = 2
BYTES_GOAL = 100  # at least 100x fewer inter-island bytes than per-step all-reduce, counted
# The islands' chosen arm as a config (seed 0, written with the summary once the sweep is finished), and
# that config across a shaped link beside per-step all-reduce of the same model, at the recipe's 150
# rounds: `python -m benchmarks.shaped_link --standard experiments/honest/results/islands-chosen.yaml --butterfly
# experiments/honest/results/islands-chosen.yaml --arms standard,butterfly --repeats 1
# --dp-utilisation 0.15 --out experiments/honest/results/shaped_link.json` (as root).
CHOSEN_CONFIG = RESULTS / "islands-chosen.yaml"
SHAPED_LINK = RESULTS / "shaped_link.json"
SHAPED_LINK_ROUNDS = 150


@functools.cache
def honest_rounds(config: Path) -> int:
    """The rounds in which `config`'s learners train 20 tokens per active parameter of its model."""
    spec = parse_spec(yaml.safe_load(config.read_text()))
    tokens = TOKENS_PER_ACTIVE_PARAMETER * build_model(spec).parameter_counts()["active"]
    return math.ceil(tokens / sum(slot.tokens_per_round() for slot in spec.learners))


@functools.cache
def islands_recipe() -> dict:
    """configs/brief-hierarchical.yaml as written: where the learners' sweeps start (read, never changed)."""
    return yaml.safe_load(CONFIGS["islands"].read_text())


def recipe_rates() -> tuple[float, float]:
    """The islands recipe's (inner, outer) learning rates."""
    raw = islands_recipe()
    return raw["training"]["lr"], raw["sync"]["outer"]["lr"]


def recipe_crossing_every() -> int:
    """The islands recipe's exchanges of a fragment between its crossings of islands."""
    return islands_recipe()["sync"]["inter_island_every"]


def compression_name(arm: HonestArm) -> str:
    """An arm's crossing compression by its sweep name: a key of COMPRESSIONS, or the recipe's own."""
    return arm.compression or islands_recipe()["sync"]["transport"]["compression"]


def outer_momentum(optimizer: str | None) -> float:
    """The outer momentum an optimizer of the sweep starts from (None: the recipe's)."""
    if optimizer is not None:
        return OUTER_OPTIMIZERS[optimizer]["momentum"]
    return islands_recipe()["sync"]["outer"]["momentum"]


def recipe(config: Path, seed: int) -> dict:
    """`config` at 20 tokens per active parameter: its rounds scaled, its store the benchmark's."""
    raw = yaml.safe_load(config.read_text())
    raw["seed"] = seed
    raw["sync"]["rounds"] = honest_rounds(config)
    raw["store"] = {"url": str(RESULTS / "store")}
    raw.setdefault("evaluation", {})["curve_points"] = CURVE_POINTS
    return raw


def global_batch(raw: dict) -> int:
    """A raw spec's rows per inner step over all its learners."""
    return sum(island["learners"] * island["batch_size"] for island in raw["islands"])


def recipe_batch() -> int:
    """The islands recipe's global batch."""
    return global_batch(islands_recipe())


def with_global_batch(raw: dict, batch: int) -> dict:
    """`raw` with every island's rows per inner step scaled to a global batch of `batch`, and its inner
    steps per round scaled inversely (tokens per round, rounds and outer steps unchanged)."""
    scale = Fraction(batch, global_batch(raw))
    islands = []
    for island in raw["islands"]:
        rows, steps = island["batch_size"] * scale, island["inner_steps"] / scale
        if rows.denominator != 1 or steps.denominator != 1:
            raise ValueError(f"global batch {batch}: island {island['name']} would take {float(rows):g} rows "
                             f"and {float(steps):g} inner steps, not whole numbers")
        islands.append({**island, "batch_size": int(rows), "inner_steps": int(steps)})
    return {**raw, "islands": islands}


@dataclass(frozen=True)
class HonestArm:
    """One run. `kind`: "standard" (b), "single" (c), "islands" or "butterfly_today"; `lr`: standard
    training's learning rate, or the learners' inner one (None: the recipe's); `outer_lr`: the learners'
    outer learning rate (None: the recipe's); `outer_optimizer`: a key of OUTER_OPTIMIZERS (None: the
    recipe's); `stable`: the model with QK-LayerNorm and z-loss
    (`STABILITY`); `batch`: standard training's global batch, or the islands' rows per inner step over all
    learners (None: the recipe's); `outer_momentum`: None for the outer optimizer's own; `diagnostic`: a
    key of DIAGNOSTICS; `crossing_every`: the islands' `sync.inter_island_every` (None: the recipe's);
    `compression`: a key of COMPRESSIONS (None: the recipe's); `tokens_factor`: standard training's
    tokens as a multiple of the regime's (its schedule stretched with them)."""

    kind: str
    seed: int
    lr: float | None = None
    batch: int | None = None
    outer_lr: float | None = None
    outer_optimizer: str | None = None
    outer_momentum: float | None = None
    stable: bool = False
    diagnostic: str | None = None
    crossing_every: int | None = None
    compression: str | None = None
    tokens_factor: int = 1

    @property
    def family(self) -> str:
        return self.kind

    @property
    def name(self) -> str:
        stable = "-qkz" if self.stable else ""
        if self.kind == "standard":
            longer = f"-t{self.tokens_factor}" if self.tokens_factor != 1 else ""
            return f"b-b{self.batch}-lr{self.lr:g}{stable}{longer}-s{self.seed}"
        settings = (f"-lr{self.lr:g}" if self.lr is not None else "") + \
                   (f"-{self.outer_optimizer}" if self.outer_optimizer else "") + \
                   (f"-outer{self.outer_lr:g}" if self.outer_lr is not None else "") + \
                   (f"-m{self.outer_momentum:g}" if self.outer_momentum is not None else "") + \
                   (f"-b{self.batch}" if self.batch is not None else "") + \
                   (f"-x{self.crossing_every}" if self.crossing_every is not None else "") + \
                   (f"-{self.compression}" if self.compression is not None else "")
        diagnostic = f"-{self.diagnostic}" if self.diagnostic else ""
        return f"{'c' if self.kind == 'single' else self.kind}{settings}{stable}{diagnostic}-s{self.seed}"

    def raw(self) -> dict:
        raw = recipe(CONFIGS["butterfly_today" if self.kind == "butterfly_today" else "islands"], self.seed)
        if self.stable:
            raw["model"].update(STABILITY)
        if self.kind == "standard":
            raw["baseline"] = {"lr": self.lr, "global_batch": self.batch}
            raw["sync"]["rounds"] *= self.tokens_factor
            raw["evaluation"]["curve_points"] *= self.tokens_factor
            return raw
        if self.batch is not None:
            raw = with_global_batch(raw, self.batch)
        if self.kind == "single":
            raw = one_learner(raw)
        overrides = {"training": {"lr": self.lr}} if self.lr is not None else {}
        outer = {**(OUTER_OPTIMIZERS[self.outer_optimizer] if self.outer_optimizer else {}),
                 **({"lr": self.outer_lr} if self.outer_lr is not None else {}),
                 **({"momentum": self.outer_momentum} if self.outer_momentum is not None else {})}
        if outer:
            overrides["sync"] = {"outer": outer}
        if self.crossing_every is not None:
            overrides.setdefault("sync", {})["inter_island_every"] = self.crossing_every
        if self.compression is not None:
            overrides.setdefault("sync", {})["transport"] = {"compression": COMPRESSIONS[self.compression]}
        raw = merged(raw, overrides)
        return merged(raw, DIAGNOSTICS[self.diagnostic][1](raw)) if self.diagnostic else raw

    def spec(self) -> RunSpec:
        return parse_spec(self.raw())


def load_results() -> dict[str, dict]:
    return load_arms(RESULTS)


# -- which arms to run, given what has finished ------------------------------------------------------

@dataclass
class Plan:
    todo: list[HonestArm]
    b: tuple[int, float] | None = None  # (global batch, learning rate)
    b_final: bool = False  # whether (b)'s sweep is finished; until then `b` is its best finished arm's
    c: HonestArm | None = None  # the sweep's chosen arm (seed 0, without QK-LayerNorm and z-loss)
    islands: HonestArm | None = None
    islands_final: bool = False  # whether the islands' sweep is finished; until then `islands` is its best so far
    stable: dict[str, bool] = field(default_factory=dict)  # kind: whether QK-LayerNorm and z-loss helped it
    # The islands' (compression, crossing interval), chosen last among COMPRESSIONS and the recipe's
    # int4; None until every candidate has run, the swept arm's until then.
    spending: tuple[str | None, int | None] | None = None

    def swept(self, kind: str, seed: int) -> HonestArm | None:
        """The arm of `kind` at the settings its sweep chose, on `seed`; None while the sweep is not finished."""
        if kind == "butterfly_today":
            return HonestArm(kind, seed)
        if kind == "standard":
            return self.b and HonestArm(kind, seed, lr=self.b[1], batch=self.b[0])
        chosen = self.c if kind == "single" else self.islands
        return chosen and replace(chosen, seed=seed)

    def before_spending(self, kind: str, seed: int) -> HonestArm | None:
        """The arm of `kind` at its swept settings on `seed`, stability included; None until chosen."""
        arm = self.swept(kind, seed)
        if arm is None or kind == "butterfly_today":
            return arm
        return replace(arm, stable=self.stable[kind]) if kind in self.stable else None

    def chosen(self, kind: str, seed: int) -> HonestArm | None:
        """The arm of `kind` at its chosen settings on `seed`: the islands' with the compression and
        crossing interval chosen for them once they are."""
        arm = self.before_spending(kind, seed)
        if arm is None or kind != "islands" or self.spending is None:
            return arm
        return replace(arm, compression=self.spending[0], crossing_every=self.spending[1])


def standard_sweep(results: dict[str, dict]) -> list[dict]:
    """(b)'s sweep arms that have finished: seed 0, the regime's tokens, without QK-LayerNorm and z-loss."""
    return [r for r in results.values() if r["kind"] == "standard" and r["seed"] == SWEEP_SEED and not r.get("stable")
            and r.get("tokens_factor", 1) == 1]


def b_sweep(results: dict[str, dict]) -> tuple[list[HonestArm], tuple[int, float] | None, bool]:
    """Standard training's batch and learning rate, from FIRST_BATCH and FIRST_LEARNING_RATES. Returns the
    arms still to run, (batch, learning rate), and whether the sweep is finished: until it is, the best
    finished arm's settings, so the headline reads against the strongest (b) measured so far."""
    todo, chosen = batch_and_rate_sweep(
        results, lambda batch, lr: HonestArm("standard", SWEEP_SEED, lr=lr, batch=batch),
        FIRST_BATCH, FIRST_LEARNING_RATES, BATCH_LIMITS)
    if chosen is not None:
        return todo, chosen, True
    best = min(standard_sweep(results), key=validation_score, default=None)
    return todo, best and (best["global_batch"], best["lr"]), False


@functools.cache
def inter_island_reduction(arm: HonestArm) -> float:
    """Per-step all-reduce's inter-island bytes over `arm`'s, as the planner's replay counts them (within
    0.1% of the learners' own counters: the replay leaves out a few small records). Bytes depend on
    neither step times nor the link, so any will do, and the full plan's bandwidth search is not needed."""
    spec = arm.spec()
    planned = replay(spec, {island.name: 1.0 for island in spec.islands}, link_bps=1e12)
    allreduce = allreduce_equivalent(spec, build_model(spec).parameter_counts()["total"], BaselinePlan.of(spec).steps)
    return allreduce["inter_island_bytes"] / sum(learner.bytes_read["inter"] for learner in planned)


def most_frequent_crossing(arm: HonestArm) -> int:
    """The smallest `inter_island_every` at which `arm` still moves at least BYTES_GOAL times fewer
    inter-island bytes than per-step all-reduce: a crossing's bytes are fixed, so they scale with
    1 / inter_island_every, and the first guess is checked against the planner either way."""
    recipe_every = recipe_crossing_every()

    def meets(every: int) -> bool:
        return inter_island_reduction(replace(arm, crossing_every=every)) >= BYTES_GOAL
    every = max(1, math.ceil(recipe_every * BYTES_GOAL / inter_island_reduction(replace(arm, crossing_every=recipe_every))))
    while not meets(every):
        every += 1
    while every > 1 and meets(every - 1):
        every -= 1
    return every


def learner_sweep(results: dict[str, dict], kind: str) -> tuple[list[HonestArm], HonestArm | None]:
    """A learners' arm: its outer optimizer chosen first (the recipe's or one of OUTER_OPTIMIZERS, each at
    its own rate, at the recipe's inner rate), then its outer learning rate swept at the recipe's inner
    rate, then its inner rate at the best of those (single: inner first, then outer, as standard
    training's rate is swept first), then its outer momentum (in 1 - momentum, halved or doubled, up to
    no momentum), then its global batch (`with_global_batch`), and for the islands last how often they
    cross: from the recipe's interval down to the most frequent crossing within the bytes goal
    (`most_frequent_crossing`). Returns the arms still to run, and the chosen arm once every sweep is
    interior; while only the crossing interval is still swept, the best finished arm so far with the
    arms still to run, so the headline reads against the islands' best measured so far."""
    inner0, recipe_outer = recipe_rates()
    inner_grid = tuple(nice(inner0 * k) for k in INNER_FACTORS)
    candidates = {None: recipe_outer, **{name: o["lr"] for name, o in OUTER_OPTIMIZERS.items()}}
    arms = {name: HonestArm(kind, SWEEP_SEED, lr=inner0, outer_lr=lr, outer_optimizer=name) for name, lr in candidates.items()}
    todo = [arm for arm in arms.values() if arm.name not in results]
    if todo:
        return todo, None
    optimizer = min(arms, key=lambda name: validation_score(results[arms[name].name]))
    outer0, outer_grid = candidates[optimizer], tuple(nice(candidates[optimizer] * k) for k in OUTER_FACTORS)
    batch0, momentum0 = recipe_batch(), outer_momentum(optimizer)

    def arm(lr: float, outer_lr: float, batch: int = batch0, momentum: float = momentum0) -> HonestArm:
        return HonestArm(kind, SWEEP_SEED, lr=lr, outer_lr=outer_lr, outer_optimizer=optimizer,
                         batch=None if batch == batch0 else batch,
                         outer_momentum=None if momentum == momentum0 else momentum)

    if kind == "single":
        todo, inner = interior_sweep(results, lambda lr: arm(lr, outer0), inner_grid)
        if inner is None:
            return todo, None
        todo, outer = interior_sweep(results, lambda o: arm(inner, o), outer_grid, step=1.4)
    else:
        todo, outer = interior_sweep(results, lambda o: arm(inner0, o), outer_grid, step=1.4)
        if outer is None:
            return todo, None
        todo, inner = interior_sweep(results, lambda lr: arm(lr, outer), inner_grid)
    if inner is None or outer is None:
        return todo, None
    # Swept as 1 - momentum (the horizon momentum averages over), halved and doubled: from momentum 0.5,
    # 0.75 and 0 (none, the bound).
    todo, keep = interior_sweep(results, lambda d: arm(inner, outer, momentum=round(1 - d, 4)),
                                        tuple(sorted({min(1.0, (1 - momentum0) * k) for k in (0.5, 1, 2)})),
                                        bounds=(0.01, 1.0))
    if keep is None:
        return todo, None
    momentum = round(1 - keep, 4)
    todo, batch = interior_sweep(results, lambda b: arm(inner, outer, int(b), momentum),
                                         tuple(int(batch0 * k) for k in BATCH_FACTORS), bounds=ISLAND_BATCH_LIMITS)
    if batch is None:
        return todo, None
    chosen = arm(inner, outer, int(batch), momentum)
    if kind == "single":
        return [], chosen
    recipe_every, fewest = recipe_crossing_every(), most_frequent_crossing(chosen)
    if fewest >= recipe_every:
        return [], chosen

    def crossing(every: float) -> HonestArm:
        return replace(chosen, crossing_every=None if round(every) == recipe_every else round(every))
    # The interval's geometric middle between the bounds, and a factor 3 past a winning edge (never past
    # the bounds, so an edge that wins is the answer).
    grid = tuple(sorted({fewest, round(math.sqrt(fewest * recipe_every)), recipe_every}))
    todo, every = interior_sweep(results, crossing, grid, step=3, bounds=(fewest, recipe_every))
    if every is not None:
        return [], crossing(every)
    finished = [arm for every in grid if (arm := crossing(every)).name in results]
    return todo, min(finished, key=lambda arm: validation_score(results[arm.name]), default=None)


def spending_arms(islands: HonestArm) -> list[HonestArm]:
    """The ways to spend the bytes goal from the islands' swept arm: the recipe's int4 at the swept
    interval, or each of COMPRESSIONS at its own most frequent crossing within the goal (never more
    frequent than the swept interval)."""
    arms = [islands]
    for name in COMPRESSIONS:
        candidate = replace(islands, compression=name)
        every = max(islands.crossing_every or recipe_crossing_every(), most_frequent_crossing(candidate))
        arms.append(replace(candidate, crossing_every=None if every == recipe_crossing_every() else every))
    return arms


def spending_sweep(results: dict[str, dict], islands: HonestArm) -> tuple[list[HonestArm], tuple | None]:
    """How the islands spend the bytes goal (`spending_arms`), ranked on validation. Returns the arms still
    to run, and (compression, crossing interval) once chosen."""
    arms = spending_arms(islands)
    todo = [arm for arm in arms if arm.name not in results]
    if todo:
        return todo, None
    best = min(arms, key=lambda arm: validation_score(results[arm.name]))
    return [], (best.compression, best.crossing_every)


def plan(results: dict[str, dict]) -> Plan:
    """The islands and today's butterfly at the recipe's settings first (the first reading of the
    headline), then the islands' and (b)'s sweeps, each with QK-LayerNorm and z-loss, the islands' way of
    spending the bytes goal, and their seeds 1, 2 (the headline); then (c)'s sweep, stability and seeds
    (the token ratio); the diagnostics of the islands' swept arm, since they explain the headline
    rather than make it; last (b) on LONGER_B times the tokens on every seed, for the token ratio's curve."""
    out = Plan([])
    inner0, outer0 = recipe_rates()
    out.todo += [HonestArm("islands", SWEEP_SEED, lr=inner0, outer_lr=outer0), HonestArm("butterfly_today", SWEEP_SEED)]
    todo, out.islands = learner_sweep(results, "islands")
    out.islands_final = out.islands is not None and not todo
    out.todo += todo
    todo, out.b, out.b_final = b_sweep(results)
    out.todo += todo
    single_todo, out.c = learner_sweep(results, "single")

    def tuned(kinds: tuple[str, ...]) -> list[HonestArm]:
        """Each swept kind of `kinds` with QK-LayerNorm and z-loss, then each at its chosen settings on
        every seed."""
        todo = []
        for kind in kinds:
            if kind != "butterfly_today" and (plain := out.swept(kind, SWEEP_SEED)) is not None:
                stable = replace(plain, stable=True)
                if stable.name in results:
                    out.stable[kind] = validation_score(results[stable.name]) < validation_score(results[plain.name])
                else:
                    todo.append(stable)
        return todo + [arm for seed in SEEDS for kind in kinds if (arm := out.chosen(kind, seed))]

    # The headline's pair on every seed before today's butterfly, the reference it is read beside.
    out.todo += tuned(("standard", "islands"))
    swept = out.before_spending("islands", SWEEP_SEED) if out.islands_final else None
    if swept is not None:
        todo, out.spending = spending_sweep(results, swept)
        out.todo += todo + [out.chosen("islands", seed) for seed in SEEDS]
    out.todo += tuned(("butterfly_today",)) + single_todo + tuned(("single",))
    if swept is not None:
        out.todo += [diagnostic_arm(swept, name) for name in DIAGNOSTICS
                     if name != "nesterov" or swept.outer_optimizer is None]
    if out.chosen("single", SWEEP_SEED) is not None:
        out.todo += [replace(b, tokens_factor=LONGER_B) for seed in SEEDS if (b := out.chosen("standard", seed))]
    out.todo = [arm for arm in dict.fromkeys(out.todo) if arm.name not in results]
    return out


def run(log: Log) -> None:
    def train(arm: HonestArm, finished: dict[str, dict]) -> dict:
        return {**run_arm(arm, log, curve=arm.kind == "standard"), "kind": arm.kind, "outer_lr": arm.outer_lr,
                "outer_optimizer": arm.outer_optimizer, "stable": arm.stable, "tokens_factor": arm.tokens_factor}

    run_arms(RESULTS, lambda finished: plan(finished).todo, train, lambda: write_page(log), log, CPU_LOCK)


# -- the summary ---------------------------------------------------------------------------------------

def tokens_to_reach(curve: list[dict], evaluation: str, bpb: float) -> tuple[float, bool]:
    """Standard training's tokens to reach `bpb` on `evaluation` by its held-out curve, and whether that
    is extrapolated past its last point. Between points the bpb is taken as linear in log tokens."""
    tokens = np.log([p["tokens"] for p in curve])
    values = np.array([p["bpb"][evaluation] for p in curve])
    for i in range(1, len(curve)):
        if values[i] <= bpb:
            if values[i - 1] <= bpb:
                return float(np.exp(tokens[i - 1])), False
            fall = (values[i - 1] - bpb) / (values[i - 1] - values[i])
            return float(np.exp(tokens[i - 1] + fall * (tokens[i] - tokens[i - 1]))), False
    slope, intercept = np.polyfit(tokens[-3:], values[-3:], 1)
    if slope >= 0:
        return math.inf, True
    return float(np.exp((bpb - intercept) / slope)), True


def fewest_tokens(curves: list[list[dict]], evaluation: str, bpb: float) -> tuple[float, bool]:
    """The fewest tokens any of standard training's runs (their held-out curves) needs to reach `bpb`
    (`tokens_to_reach`), read off a curve where one reaches it, extrapolated only where none does."""
    reads = [tokens_to_reach(curve, evaluation, bpb) for curve in curves]
    return min(reads, key=lambda read: (read[1], read[0]))


def diagnostic_arm(islands: HonestArm, name: str) -> HonestArm:
    """The islands' arm with diagnostic `name`. Crossing at every exchange sets the interval itself, so
    it is one arm (and one run) whatever interval the islands chose."""
    return replace(islands, diagnostic=name, crossing_every=None if name == "cross-every" else islands.crossing_every)


def spending(chosen: Plan, results: dict[str, dict]) -> list[dict]:
    """Each way of spending the bytes goal that has run (seed 0): its compression, crossing interval,
    planned reduction against the per-step ring all-reduce, and validation score."""
    islands = chosen.before_spending("islands", SWEEP_SEED) if chosen.islands_final else None
    if islands is None:
        return []
    return [{"arm": arm.name, "compression": compression_name(arm),
             "inter_island_every": arm.spec().sync.inter_island_every,
             "reduction_planned": inter_island_reduction(arm), "validation": validation_score(results[arm.name])}
            for arm in spending_arms(islands) if arm.name in results]


def diagnostics(chosen: Plan, results: dict[str, dict]) -> dict:
    """Each diagnostic that has run: its validation score and its change against the islands' swept arm."""
    islands = chosen.before_spending("islands", SWEEP_SEED)
    if islands is None or islands.name not in results:
        return {}
    reference = validation_score(results[islands.name])
    out = {}
    for name, (what, _) in DIAGNOSTICS.items():
        if (result := results.get(diagnostic_arm(islands, name).name)) is not None:
            score = validation_score(result)
            out[name] = {"change": what, "validation": score, "relative_to_islands": score / reference - 1}
    return out


def gap_steps(chosen: Plan, results: dict[str, dict]) -> list[dict]:
    """The islands' gap to (b) taken apart into measured steps (seed 0, validation split, the sweeps' arms,
    without QK-LayerNorm and z-loss): standard training from its best batch to the islands' global batch,
    then to the islands at that batch; and, once (c) is chosen, standard training at (c)'s batch to (c),
    and (c) to the islands: what one learner's rounds cost, and what the other seven and the exchange add."""
    sweep = standard_sweep(results)
    if not sweep:
        return []

    def standard_at(batch: int) -> dict | None:
        return min((r for r in sweep if r["global_batch"] == batch), key=validation_score, default=None)

    def step(what_from: str, start: dict | None, what_to: str, end: dict | None) -> list[dict]:
        if start is None or end is None or start is end:
            return []
        before, after = validation_score(start), validation_score(end)
        return [{"from": what_from, "from_arm": start["arm"], "to": what_to, "to_arm": end["arm"],
                 "from_validation": before, "to_validation": after, "change": after / before - 1}]

    best = min(sweep, key=validation_score)
    steps = []
    islands = chosen.islands and results.get(chosen.islands.name)
    single = chosen.c and results.get(chosen.c.name)
    if islands is not None:
        batch = chosen.islands.batch or recipe_batch()
        steps += step(f"standard training at its best batch, {best['global_batch']}", best,
                      f"standard training at the islands' global batch, {batch}", standard_at(batch))
        steps += step(f"standard training at batch {batch}", standard_at(batch), "the islands, 8 learners", islands)
    if single is not None:
        batch = chosen.c.batch or recipe_batch()
        steps += step(f"standard training at batch {batch}", standard_at(batch),
                      "(c), one learner with the learners' rounds and outer step", single)
        steps += step("(c), one learner", single, "the islands, 8 learners", islands)
    return steps


def communication(chosen: Plan, results: dict[str, dict]) -> dict:
    """The islands' inter-island bytes as their learners counted them (each seed's chosen arm that has
    run) against per-step all-reduce of the same steps; and the recipe across the shaped link, when
    that result file is there."""
    counted = [{"seed": seed, "commit": result["commit"], **result["communication"]}
               for seed in SEEDS if (arm := chosen.chosen("islands", seed)) and (result := results.get(arm.name))]
    out: dict = {"counted": counted, "goal": BYTES_GOAL}
    if SHAPED_LINK.exists():
        shaped = json.loads(SHAPED_LINK.read_text())
        ran = shaped["arms"]["butterfly"]["settings"]
        islands = chosen.chosen("islands", SWEEP_SEED) if chosen.islands_final else None
        out["shaped_link"] = {"commit": shaped["commit"], "rate_bps": shaped["link"]["rate_bps"],
                              "rounds": ran["sync"]["rounds"], "inter_island_every": ran["sync"]["inter_island_every"],
                              "at_chosen_settings": islands is not None and same_settings(ran, islands.spec()),
                              "ring_over_island_allreduce": ring_over_island_allreduce(CONFIGS["islands"]),
                              "utilisation": statistics.median(shaped["arms"]["butterfly"]["utilisation"]),
                              "standard_utilisation": statistics.median(shaped["arms"]["standard"]["utilisation"]),
                              "bytes_reduction_counted": shaped["targets"]["butterfly_bytes_reduction_counted"],
                              "time_to_quality_ratio": shaped["targets"]["time_to_quality"]["ratio"]}
    return out


def ring_over_island_allreduce(config: Path) -> float:
    """Inter-island bytes per step of the ring all-reduce over every learner that the bytes goal counts
    against, over those of an all-reduce between one process per island (one gradient each way, as the
    shaped link's per-step all-reduce runs): 1.75 for 8 learners in 2 islands."""
    spec = parse_spec(yaml.safe_load(config.read_text()))
    parameters = build_model(spec).parameter_counts()["total"]
    islands = len([island for island in spec.islands if island.learners])
    return allreduce_equivalent(spec, parameters, 1)["inter_island_bytes"] / (2 * (islands - 1) * parameters * FP32)


def same_settings(ran: dict, spec: RunSpec) -> bool:
    """Whether a run's recorded model, training and sync settings are `spec`'s, its rounds aside."""
    mine = spec.model_dump(mode="json", include={"model", "training", "sync"})
    return all({**ran[k], "rounds": None} == {**mine[k], "rounds": None} if k == "sync" else ran[k] == mine[k]
               for k in mine)


def summary(results: dict[str, dict]) -> dict:
    chosen = plan(results)
    runs = {name: [results.get(arm.name) if (arm := chosen.chosen(kind, seed)) else None for seed in SEEDS]
            for name, kind in KINDS.items()}
    complete = {k: v for k, v in runs.items() if all(v)}
    any_result = next(iter(results.values()), None)
    out = {**recorded(list(results.values())), "tokens_per_active_parameter": TOKENS_PER_ACTIVE_PARAMETER,
           "tokens": any_result and any_result["tokens"],
           "settings": {"b": chosen.b and {"global_batch": chosen.b[0], "lr": chosen.b[1], "final": chosen.b_final},
                        **{name: arm and {"inner_lr": arm.lr, "outer_lr": arm.outer_lr,
                                          "outer_optimizer": arm.outer_optimizer or "recipe",
                                          "outer_momentum": arm.outer_momentum if arm.outer_momentum is not None
                                          else outer_momentum(arm.outer_optimizer),
                                          "global_batch": arm.batch or recipe_batch(),
                                          **({"inter_island_every": arm.crossing_every or recipe_crossing_every(),
                                              "compression": compression_name(arm),
                                              "final": chosen.islands_final and chosen.spending is not None}
                                             if name == "islands" else {})}
                           for name, arm in (("c", chosen.c),
                                             ("islands", chosen.chosen("islands", SWEEP_SEED) or chosen.islands))},
                        "qk_norm_and_z_loss": {name: chosen.stable[kind] for name, kind in KINDS.items() if kind in chosen.stable}},
           "gap_steps": gap_steps(chosen, results), "spending": spending(chosen, results),
           "diagnostics": diagnostics(chosen, results),
           "communication": communication(chosen, results),
           "still_to_run": [a.name for a in chosen.todo], "evaluations": {}}
    for evaluation in (any_result["bpb"] if any_result else {}):
        entry = {k: [r["bpb"][evaluation] for r in v] for k, v in complete.items()}
        if "b" in complete and "islands" in complete:
            entry["relative_to_b"] = [i / b - 1 for i, b in zip(entry["islands"], entry["b"])]
            entry["bootstrap_ci_to_b"] = seeds_bootstrap(complete["islands"], complete["b"], evaluation)
        if "b" in complete and "c" in complete and "islands" in complete:
            ratios, extrapolated, factors = [], [], []
            for seed, b_run, islands_bpb, c_bpb in zip(SEEDS, complete["b"], entry["islands"], entry["c"]):
                longer = results.get(replace(chosen.chosen("standard", seed), tokens_factor=LONGER_B).name)
                runs_of_b = [b_run] + ([longer] if longer else [])
                (to_islands, past_i), (to_c, past_c) = (
                    fewest_tokens([r["heldout_curve"] for r in runs_of_b], evaluation, x) for x in (islands_bpb, c_bpb))
                ratios.append(to_islands / to_c)
                extrapolated.append(past_i or past_c)
                factors.append([r.get("tokens_factor", 1) for r in runs_of_b])
            entry["token_ratio_to_c"] = ratios
            entry["token_ratio_extrapolated"] = extrapolated
            entry["token_ratio_b_runs"] = factors
        out["evaluations"][evaluation] = entry
    return out


def figure(results: dict[str, dict], chosen: Plan, path: Path) -> None:
    """Validation bpb against the AdamW learning rate (seed 0): standard training, a line per global batch,
    and the islands' inner rate at their other chosen settings; today's butterfly as a level."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    sweep = standard_sweep(results)
    for i, batch in enumerate(sorted({r["global_batch"] for r in sweep})):
        points = sorted((r["lr"], validation_score(r)) for r in sweep if r["global_batch"] == batch)
        ax.plot(*zip(*points), "o-", color=f"C{i}", label=f"(b) standard, batch {batch}")
    islands = chosen.islands or HonestArm("islands", SWEEP_SEED, outer_lr=recipe_rates()[1])
    points = sorted((r["lr"], validation_score(r)) for r in results.values() if r["kind"] == "islands"
                    and r["arm"] == replace(islands, lr=r["lr"]).name)
    if points:
        ax.plot(*zip(*points), "s-", color="black", label=f"islands, inner rate (batch {islands.batch or recipe_batch()})")
    if (today := results.get(HonestArm("butterfly_today", SWEEP_SEED).name)) is not None:
        ax.axhline(validation_score(today), color="grey", ls="--", label="butterfly today (untuned)")
    ax.set_xscale("log")
    ax.set_xlabel("AdamW learning rate (the islands' inner rate)")
    ax.set_ylabel("validation bpb, mean over evaluations")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def learner_settings(chosen: dict | None) -> str:
    if not chosen:
        return "sweep not finished"
    crossing = (f", crossing every {chosen['inter_island_every']} exchanges in {chosen['compression']}"
                if "inter_island_every" in chosen else "")
    best_so_far = "" if chosen.get("final", True) else " (the best so far: its sweep goes on)"
    return (f"inner learning rate {chosen['inner_lr']:g}, outer {chosen['outer_lr']:g} ({chosen['outer_optimizer']}, "
            f"momentum {chosen['outer_momentum']:g}), global batch {chosen['global_batch']}{crossing}{best_so_far}")


def page(table: dict, results: dict[str, dict]) -> str:
    settings = table["settings"]
    lines = ["# Quality in an honest regime",
             "",
             f"The brief's sparse MoE at {table['tokens_per_active_parameter']} tokens per active parameter "
             f"({table['tokens'] or 0:,} tokens), bits per byte on the held-out documents, seeds 0, 1, 2. Every setting "
             "was chosen on the validation split (seed 0).",
             "",
             "- (b) standard training: " + (f"global batch {settings['b']['global_batch']}, learning rate "
                                           f"{settings['b']['lr']:g}" + ("" if settings["b"]["final"] else
                                                                         " (the best so far: its sweep goes on)")
                                           if settings["b"] else "sweep not finished"),
             "- (c) one learner: " + learner_settings(settings["c"]),
             "- islands (configs/brief-hierarchical.yaml, 8 learners): " + learner_settings(settings["islands"]),
             "- butterfly today: configs/brief.yaml, untuned",
             "- QK-LayerNorm and z-loss (1e-4), kept where they helped on validation: " +
             (", ".join(f"{LABELS[k]} {'yes' if v else 'no'}" for k, v in settings["qk_norm_and_z_loss"].items())
              or "not tried yet"), ""]
    if any(table["evaluations"].values()):
        lines += ["| evaluation | (b) | (c) | islands | butterfly today | islands vs (b), per seed | 95% interval | "
                  "tokens vs (c) |", "|---|---|---|---|---|---|---|---|"]
        for evaluation, entry in table["evaluations"].items():
            cells = [f"{statistics.fmean(entry[k]):.4f}" if k in entry else "-"
                     for k in ("b", "c", "islands", "butterfly_today")]
            relative = ", ".join(f"{r:+.2%}" for r in entry["relative_to_b"]) if "relative_to_b" in entry else "-"
            interval = "[{:+.2%}, {:+.2%}]".format(*entry["bootstrap_ci_to_b"]) if "bootstrap_ci_to_b" in entry else "-"
            ratio = (f"{statistics.fmean(entry['token_ratio_to_c']):.2f}x"
                     + (" (extrapolated)" if any(entry["token_ratio_extrapolated"]) else "")) if "token_ratio_to_c" in entry else "-"
            lines.append(f"| {evaluation} | " + " | ".join(cells) + f" | {relative} | {interval} | {ratio} |")
        lines.append("")
    if table["gap_steps"] or table["diagnostics"]:
        lines += ["## What binds (seed 0, validation split)", ""]
    if table["gap_steps"]:
        lines += ["The gap to (b), one measured step at a time (the sweeps' arms, without QK-LayerNorm and z-loss):", "",
                  "| from | to | validation bpb | change |", "|---|---|---|---|"]
        lines += [f"| {s['from']} | {s['to']} | {s['from_validation']:.4f} to {s['to_validation']:.4f} | {s['change']:+.2%} |"
                  for s in table["gap_steps"]]
        lines.append("")
    if table["spending"]:
        lines += ["How the islands spend the bytes goal, chosen last (with QK-LayerNorm and z-loss as kept): each "
                  "compression at its most frequent crossing within the goal.", "",
                  "| compression | crossing every | fewer bytes than the ring all-reduce (planned) | validation bpb |",
                  "|---|---|---|---|"]
        lines += [f"| {s['compression']} | {s['inter_island_every']} | {s['reduction_planned']:.0f}x | {s['validation']:.4f} |"
                  for s in table["spending"]]
        lines.append("")
    if table["diagnostics"]:
        lines += ["The islands' arm as swept (int4 crossings at the swept interval, before the bytes goal's spending "
                  "is chosen) with one change each; a negative change is a gain.", "",
                  "| change | validation bpb | against the islands |", "|---|---|---|"]
        lines += [f"| {d['change']} | {d['validation']:.4f} | {d['relative_to_islands']:+.2%} |"
                  for d in table["diagnostics"].values()]
        lines.append("")
    bytes_ = table["communication"]
    if bytes_["counted"]:
        lines += ["Inter-island bytes, counted by the islands' learners against a per-step ring all-reduce over the "
                  f"same 8 learners and steps (`eval.report.allreduce_equivalent`; goal: at least {bytes_['goal']}x "
                  "fewer): " + "; ".join(
                      f"seed {c['seed']} (commit {c['commit']}) {c['inter_island_bytes'] / 1e6:.1f} MB against "
                      f"{c['allreduce_equivalent_bytes'] / 1e9:.2f} GB, {c['inter_island_reduction']:.0f}x fewer"
                      for c in bytes_["counted"]) + ".", ""]
    if "shaped_link" in bytes_:
        link = bytes_["shaped_link"]
        settings = "the islands' chosen settings" if link["at_chosen_settings"] else "settings that are not the chosen ones"
        lines += [f"Across a shaped link ({link['rate_bps'] / 1e6:.1f} Mbit/s, {settings} at {link['rounds']} rounds, "
                  f"one crossing in {link['inter_island_every']} exchanges, one run at commit "
                  f"{link['commit']}, [honest-shaped-link.md](honest-shaped-link.md)): "
                  f"utilisation {link['utilisation']:.1%} against per-step all-reduce's {link['standard_utilisation']:.1%}, "
                  f"{link['bytes_reduction_counted']:.0f}x fewer inter-island bytes counted, and per-step all-reduce's "
                  f"final held-out bpb reached in {link['time_to_quality_ratio']:.2f}x its wall time. That all-reduce runs "
                  "one process per island, so only one copy of the gradient crosses each way per step: "
                  f"{link['ring_over_island_allreduce']:.2f}x fewer bytes than the ring over 8 learners above, and the ratio "
                  "against it is as many times smaller.", ""]
    lines += [f"Goal: the islands at least {-GOAL:.0%} below (b) on every evaluation (mean of 3 seeds, interval below "
              f"zero) and within {TOKEN_RATIO_GOAL}x of (c) in standard training's tokens.", ""]
    against_b = {e: statistics.fmean(v["islands"]) / statistics.fmean(v["b"]) - 1
                 for e, v in table["evaluations"].items() if "relative_to_b" in v}
    if against_b:
        met = all(r <= GOAL and table["evaluations"][e]["bootstrap_ci_to_b"][1] < 0 for e, r in against_b.items())
        lines += ["Against (b), mean of 3 seeds: " + ", ".join(f"{e} {r:+.2%}" for e, r in against_b.items()) +
                  (": met." if met else "; not met, short by " +
                   ", ".join(f"{r - GOAL:.2%} on {e}" for e, r in against_b.items()) + "."), ""]
    # token_ratio_to_c is the islands' standard-training tokens over (c)'s: its inverse is how many times the
    # islands' tokens (c) is worth.
    ratios = {e: v for e, v in table["evaluations"].items() if "token_ratio_to_c" in v}
    worth = {e: 1 / statistics.fmean(v["token_ratio_to_c"]) for e, v in ratios.items()}
    if worth:
        def per_seed(entry: dict) -> str:
            return ", ".join(f"{1 / r:.2f}x" + ("*" if past else "")
                             for r, past in zip(entry["token_ratio_to_c"], entry["token_ratio_extrapolated"]))
        seeds_by_runs: dict[tuple, list[int]] = {}
        for seed, runs in zip(SEEDS, next(iter(ratios.values()))["token_ratio_b_runs"]):
            seeds_by_runs.setdefault(tuple(runs), []).append(seed)
        read = "; ".join("seed" + ("s " if len(seeds) > 1 else " ") + ", ".join(map(str, seeds)) + ": (b) at "
                         + " and ".join(f"{f}x" for f in runs) + " the tokens" for runs, seeds in seeds_by_runs.items())
        lines += ["Against (c), in standard training's tokens: (c)'s bpb is worth "
                  + ", ".join(f"{w:.2f}x the islands' on {e} (per seed {per_seed(ratios[e])})"
                              for e, w in worth.items())
                  + (": met." if all(w <= TOKEN_RATIO_GOAL for w in worth.values()) else "; not met.")
                  + f" Each seed reads the fewest tokens that any of (b)'s runs needed ({read})."
                  + (" \\* extrapolated past (b)'s curve on a line through its last three points, since no run of it "
                     "reached that bpb." if any(any(v["token_ratio_extrapolated"]) for v in ratios.values()) else ""), ""]
    lines += ["## Sweeps (seed 0, validation split)", "",
              "![validation bpb against the learning rate](../../experiments/honest/results/sweeps.png)", "",
              "| arm | validation bpb (mean over evaluations) | train s |", "|---|---|---|"]
    for name, result in sorted(results.items()):
        if result["seed"] == SWEEP_SEED:
            lines.append(f"| {name} | {validation_score(result):.4f} | {result['train_seconds']:.0f} |")
    if table["still_to_run"]:
        lines += ["", f"Not run yet: {', '.join(table['still_to_run'])} (sweeps may add more)."]
    return "\n".join(lines) + "\n"


def write_page(log: Log | None = None) -> None:
    results = load_results()
    table = summary(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.json").write_text(json.dumps(table, indent=1))
    chosen = plan(results)
    if chosen.islands_final and (islands := chosen.chosen("islands", SWEEP_SEED)) is not None:
        raw = islands.raw()
        raw["sync"]["rounds"] = SHAPED_LINK_ROUNDS
        CHOSEN_CONFIG.write_text(f"# The islands' arm {islands.name}, written by python -m experiments.honest --table; "
                                 f"rounds set to the shaped-link run's.\n" + yaml.safe_dump(raw, sort_keys=False))
    figure(results, chosen, RESULTS / "sweeps.png")
    write_results_page("honest", page(table, results), sources=str(RESULTS), command="python -m experiments.honest --table",
                       commit=table["commit"], date=table["date"])
    if log:
        log(f"wrote {RESULTS / 'summary.json'}, sweeps.png and docs/results/honest.md")


def main(argv: list[str] | None = None) -> int:
    return resumable_main(argv, __doc__.split("\n")[0], RESULTS, lambda finished: plan(finished).todo, run, write_page)

