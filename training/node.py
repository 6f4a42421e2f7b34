"""One node of a learner that spans several hosts, started on its host: `python -m training.node
--store URL --run-id RUN --spec-sha256 HASH --learner I`, as the task srun starts on each of the
learner's nodes (`pool.launcher: srun`, infra.launch.srun_wrapper), through `infra.launch`'s guard.

It takes its node rank from Slurm (SLURM_NODEID, one of 0 to nodes_per_learner - 1, else it refuses
to start), reads the run's spec from the run's store and refuses it unless it hashes to what the
control plane passed, and starts its node with `training.stages.train_learner_node`: node 0 publishes
the rendezvous, the others join it. Its output, the node's torchrun's included, goes to srun. Store
keys come from the environment srun hands on, never the command line. It exits non-zero when its
node fails, and srun then ends the other nodes' tasks.
"""

from __future__ import annotations

import sys

from infra.launch import learner_arguments, slurm_node_rank, started_spec
from infra.supervision import LearnerFailed
from training.stages import train_learner_node


def main(argv: list[str] | None = None) -> int:
    args = learner_arguments("Start this host's node of an Archipelago learner that spans several.").parse_args(argv)
    spec = started_spec(args)
    island = spec.learners[args.learner].island
    try:
        node = slurm_node_rank(island.nodes_per_learner)
    except ValueError as err:
        sys.exit(f"learner {args.learner} of island {island.name}: {err}; not starting")
    try:
        train_learner_node(spec, args.run_id, args.learner, node, lambda line: print(line, flush=True),
                           args.until, args.lease_term)
    except LearnerFailed as err:
        sys.exit(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
