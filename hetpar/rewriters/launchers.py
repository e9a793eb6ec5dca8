"""Launch files next to ``train.py``: ``launch.sh`` (torchrun on one host or many),
``slurm.sbatch`` (a Slurm batch job) and ``pytorchjob.yaml`` (a Kubeflow PyTorchJob
for Volcano gang scheduling). See docs/running.md.

[Note: node order]
The plan numbers ranks node by node: global rank = node rank * processes per node +
local rank, and on a mixed cluster the n-th node of the spec has the device type the
plan costed for those ranks. ``launch.sh`` and ``slurm.sbatch`` on a mixed cluster
therefore fix node ranks (``NODE_RANK``, ``SLURM_NODEID``) with torchrun's static
rendezvous. Where every node has the same device type, any order of nodes runs the
plan as costed, so ``slurm.sbatch`` and ``pytorchjob.yaml`` use the c10d rendezvous,
whose agents also agree on restarting every node's workers after a failure
(``--max-restarts``); the program then resumes from ``--checkpoint-dir`` (see
runtime/checkpoint.py).

[Note: elastic launch]
``hetpar compile --elastic MIN:MAX`` writes launch files for a job whose nodes may
change: torchrun ``--nnodes=MIN:MAX`` with the c10d rendezvous, so that losing a node
(down to MIN) or gaining one (up to MAX) makes torchrun stop and restart every worker
with the new world size instead of hanging. A plan is for one world size, so the
program then stops before training and says which ``hetpar plan --resume-from``
command plans for the nodes there are and resumes from the newest checkpoint
([Note: membership change] in runtime/cli.py); the launch files set ``HETPAR_ELASTIC``
for it. The job trains only at the plan's size: a node that comes back within the
restarts lets it go on by itself. Node ranks follow the rendezvous, so the plan must
have one device type (``elastic_problem``).
"""

from __future__ import annotations

import re

from hetpar.planner.plan import ParallelPlan

PROGRAM = "train.py"
LAUNCHER = "launch.sh"
SLURM = "slurm.sbatch"
PYTORCHJOB = "pytorchjob.yaml"


# ----------------------------------------------------------------------------- layout


def node_layout(plan: ParallelPlan) -> tuple[int, int]:
    """``(nodes, processes per node)`` read from a cluster spec like ``2x8xA100+2x8xV100``.

    A spec that does not read that way, or whose nodes differ in size, counts as one
    node holding the whole world.
    """
    parts = [re.fullmatch(r"\s*(\d+)x(\d+)x.+", p) for p in plan.cluster.spec.split("+")]
    if not parts or not all(parts):
        return 1, plan.cluster.world_size
    sizes = {int(m[2]) for m in parts}
    nodes = sum(int(m[1]) for m in parts)
    if len(sizes) != 1 or nodes * sizes.copy().pop() != plan.cluster.world_size:
        return 1, plan.cluster.world_size
    return nodes, sizes.pop()




# ----------------------------------------------------------------------------- launch.sh


def elastic_problem(plan: ParallelPlan, elastic: tuple[int, int]) -> str | None:
    """Why ``plan`` cannot run as an elastic job of ``elastic = (min, max)`` nodes, or None."""
    low, high = elastic
    nodes, _ = node_layout(plan)
    if not 1 <= low <= high:
        return f"--elastic {low}:{high}: need 1 <= MIN <= MAX nodes"
    if not low <= nodes <= high:
        return f"--elastic {low}:{high} does not hold the plan's {nodes} node{'s' if nodes != 1 else ''}"
    if len(device_kinds(plan)) > 1:
        return (f"--elastic: the plan mixes {', '.join(device_kinds(plan))}, whose ranks must keep their nodes, and an "
                "elastic rendezvous orders nodes freely; compile without --elastic (launch.sh and slurm.sbatch fix "
                "node ranks)")
    return None


def launcher_source(plan: ParallelPlan, *, elastic: tuple[int, int] | None = None) -> str:
    """The text of ``launch.sh``: torchrun on one host, or on many with NNODES etc. set;
    on a mixed cluster it also checks ``HETPAR_DEVICE_TYPE`` against the node rank's type.
    With ``elastic`` (min, max) nodes: torchrun ``--nnodes=MIN:MAX`` on every host with
    the c10d rendezvous ([Note: elastic launch])."""
    world = plan.cluster.world_size
    nodes, per_node = node_layout(plan)
    if elastic is not None:
        return _ELASTIC_LAUNCHER_TEMPLATE.format(world=world, nodes=nodes, per_node=per_node, low=elastic[0],
                                                 high=elastic[1], program=PROGRAM)
    node_types = _node_types(plan, nodes, per_node)
    node_lines = [
        f"#   NODE_RANK={n}: ranks {n * per_node}-{(n + 1) * per_node - 1} ({', '.join(kinds) or '?'})"
        for n, kinds in enumerate(node_types)
    ]
    planned = (
        f"# The plan is for {nodes} hosts of {per_node} processes; NODE_RANK n must be the\n"
        f"# n-th host of the cluster spec {plan.cluster.spec!r}:\n" + "\n".join(node_lines) + "\n"
        if nodes > 1
        else ""
    )
    return _LAUNCHER_TEMPLATE.format(world=world, planned=planned, program=PROGRAM,
                                     node_type_check=_node_type_check(node_types))


def _node_types(plan: ParallelPlan, nodes: int, per_node: int) -> list[list[str]]:
    """The device types of each node's ranks, in node order."""
    types = plan.cluster.device_types
    return [sorted({types[r] for r in range(n * per_node, (n + 1) * per_node) if r < len(types)}) for n in range(nodes)]


def _node_type_check(node_types: list[list[str]]) -> str:
    """Shell lines that stop a host declared (HETPAR_DEVICE_TYPE) as another type than its
    NODE_RANK's, before it joins the others; empty unless nodes differ in type.
    See [Note: rank device types] in runtime/devices.py."""
    kinds = list(dict.fromkeys(k for node in node_types if len(node) == 1 for k in node))
    if len(kinds) < 2 or any(len(node) != 1 for node in node_types):
        return ""
    cases = "\n".join(
        f"    {'|'.join(str(n) for n, node in enumerate(node_types) if node == [kind])}) PLANNED={kind} ;;"
        for kind in kinds
    )
    hints = "; ".join(
        f"{kind}: {','.join(str(n) for n, node in enumerate(node_types) if node == [kind])}" for kind in kinds
    )
    return _NODE_TYPE_CHECK.format(cases=cases, hints=hints)


_NODE_TYPE_CHECK = """\
# Mixed cluster: a host that says what it is (HETPAR_DEVICE_TYPE) must take a node rank of
# that type; train.py checks every rank again, also by detecting its GPU.
if [ -n "${{HETPAR_DEVICE_TYPE:-}}" ]; then
    case "$NODE_RANK" in
{cases}
    *) PLANNED= ;;
    esac
    if [ "$(printf %s "$HETPAR_DEVICE_TYPE" | tr '[:upper:]' '[:lower:]')" != \\
         "$(printf %s "$PLANNED" | tr '[:upper:]' '[:lower:]')" ]; then
        echo "launch.sh: NODE_RANK=$NODE_RANK is planned for ${{PLANNED:-no node}} but HETPAR_DEVICE_TYPE=$HETPAR_DEVICE_TYPE;" \\
            "node ranks by type: {hints}" >&2
        exit 2
    fi
fi
"""


_LAUNCHER_TEMPLATE = """\
#!/bin/sh
# Runs {program} (compiled by hetpar for {world} processes); arguments go to {program}.
#
# One host:    ./launch.sh --steps 100          (MASTER_PORT=29501 ./launch.sh ... for a second run)
# Many hosts:  on every host, with the same MASTER_ADDR (host of NODE_RANK=0):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 ./launch.sh --steps 100
# Global rank = NODE_RANK * (world size / NNODES) + local rank, as the plan numbers them.
# HETPAR_DEVICE_TYPE=A100-80GB (a device profile name) tells train.py what a host is where
# GPU detection cannot (see docs/running.md); train.py stops if a rank is not on its planned type.
# Fault tolerance: MAX_RESTARTS=3 ./launch.sh --steps 100 --checkpoint-dir ckpt --checkpoint-every 50
#   (torchrun restarts the workers after a failure; they resume from the newest checkpoint).
{planned}set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
PLAN_WORLD_SIZE={world}
NNODES=${{NNODES:-1}}
if [ "$NNODES" -eq 1 ]; then
    exec torchrun --nproc_per_node="$PLAN_WORLD_SIZE" ${{MASTER_PORT:+--master_port="$MASTER_PORT"}} \\
        ${{MAX_RESTARTS:+--max-restarts="$MAX_RESTARTS"}} "$HERE/{program}" "$@"
fi
if [ $((PLAN_WORLD_SIZE % NNODES)) -ne 0 ]; then
    echo "launch.sh: world size $PLAN_WORLD_SIZE does not split over NNODES=$NNODES hosts" >&2
    exit 2
fi
: "${{NODE_RANK:?set NODE_RANK (0..NNODES-1) on every host}}"
: "${{MASTER_ADDR:?set MASTER_ADDR to the host of NODE_RANK=0}}"
{node_type_check}exec torchrun --nnodes="$NNODES" --node_rank="$NODE_RANK" \\
    --nproc_per_node=$((PLAN_WORLD_SIZE / NNODES)) \\
    --master_addr="$MASTER_ADDR" --master_port="${{MASTER_PORT:-29500}}" \\
    ${{MAX_RESTARTS:+--max-restarts="$MAX_RESTARTS"}} "$HERE/{program}" "$@"
"""


_ELASTIC_LAUNCHER_TEMPLATE = """\
#!/bin/sh
# Runs {program} (compiled by hetpar for {world} processes: {nodes} hosts x {per_node}) as an elastic
# job of {low} to {high} hosts; arguments go to {program}. On every host, with the same MASTER_ADDR
# (the host that serves the c10d rendezvous) and RDZV_ID (one per job):
#
#   MASTER_ADDR=node0 RDZV_ID=job1 ./launch.sh --steps 1000 --checkpoint-dir /shared/ckpt --checkpoint-every 100
#
# torchrun --nnodes={low}:{high} starts training once the hosts have met, and when a host is lost
# (down to {low}) or one joins (up to {high}), it stops every worker and starts them again with the
# new world size. The plan is for {nodes} hosts: at another size {program} stops with one line
# giving the hetpar plan --resume-from command that re-plans for the hosts there are and resumes
# from the newest checkpoint (MAX_RESTARTS, default 3, more rendezvous first: if the lost host
# comes back, training goes on by itself). Give --checkpoint-dir on a file system every host sees.
# MASTER_PORT defaults to 29500. See docs/running.md, "Elastic jobs".
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
: "${{MASTER_ADDR:?set MASTER_ADDR to the host that serves the rendezvous (any one of them)}}"
HETPAR_ELASTIC={low}:{high}
export HETPAR_ELASTIC
exec torchrun --nnodes={low}:{high} --nproc_per_node={per_node} \\
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:${{MASTER_PORT:-29500}}" --rdzv-id="${{RDZV_ID:-hetpar}}" \\
    --max-restarts="${{MAX_RESTARTS:-3}}" "$HERE/{program}" "$@"
"""


# ----------------------------------------------------------------------------- shared


def device_kinds(plan: ParallelPlan) -> list[str]:
    """The plan's device types, in rank order, each once."""
    return list(dict.fromkeys(plan.cluster.device_types))


def _accelerator(device_type: str) -> str | None:
    """The vendor of an accelerator, from its hetpar device-type name; None for CPUs."""
    name = device_type.lower()
    if name.startswith("cpu"):
        return None
    if name.startswith("ascend"):
        return "ascend"
    if name.startswith("mi"):
        return "amd"
    return "nvidia"


_K8S_RESOURCE = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu", "ascend": "huawei.com/Ascend910"}


def k8s_name(text: str) -> str:
    """``text`` as a Kubernetes object name (DNS-1123: lowercase letters, digits, '-')."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return name[:53] or "hetpar"


# ----------------------------------------------------------------------------- slurm.sbatch


def slurm_source(plan: ParallelPlan, *, job_name: str, elastic: tuple[int, int] | None = None) -> str:
    """The text of ``slurm.sbatch``: one torchrun per node under ``srun``; see [Note: node order].
    With ``elastic`` (min, max) nodes: ``--nnodes=MIN:MAX``, and a lost node leaves the job
    running so the others can stop with the re-plan line ([Note: elastic launch])."""
    nodes, per_node = node_layout(plan)
    kinds = device_kinds(plan)
    vendors = {_accelerator(k) for k in kinds}
    gpus = f"#SBATCH --gpus-per-node={per_node}\n" if vendors <= {"nvidia", "amd"} and None not in vendors else ""
    if "ascend" in vendors:
        gpus = f"# Request the {per_node} NPUs of each node the way your site names them (e.g. --gres=npu:{per_node}).\n"
    if len(kinds) > 1:
        note = (
            f"# The cluster mixes {', '.join(kinds)}: node n of the allocation (SLURM_NODEID) must be the n-th node\n"
            f"# of the spec {plan.cluster.spec!r}, so node ranks are fixed (static rendezvous) and a failure\n"
            "# ends the job (MAX_RESTARTS defaults to 0); resubmit it and it resumes from --checkpoint-dir.\n"
            "# train.py checks each rank's GPU against its planned type and stops the job on a wrong order.\n"
        )
        torchrun = (
            'exec torchrun --nnodes="$SLURM_NNODES" --node_rank="$SLURM_NODEID" --nproc_per_node="$NPROC_PER_NODE" '
            '--master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --max-restarts="$MAX_RESTARTS" '
            f'"$HERE/{PROGRAM}" "$@"'
        )
        restarts = 0
    else:
        note = (
            "# After a failure the torchrun of every node restarts its workers (c10d rendezvous, MAX_RESTARTS\n"
            "# times); a killed worker costs only the steps since the last checkpoint.\n"
        )
        torchrun = (
            'exec torchrun --nnodes="$SLURM_NNODES" --nproc_per_node="$NPROC_PER_NODE" --rdzv-id="$SLURM_JOB_ID" '
            '--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --max-restarts="$MAX_RESTARTS" '
            f'"$HERE/{PROGRAM}" "$@"'
        )
        restarts = 3
    if elastic is not None:
        low, high = elastic
        note = (
            f"# Elastic ({low} to {high} nodes, c10d rendezvous): when a node is lost, the torchruns of the others\n"
            "# meet again without it and restart their workers with the smaller world size; the plan is for\n"
            f"# {nodes} nodes, so {PROGRAM} then stops with one line giving the hetpar plan --resume-from command\n"
            "# that re-plans for the nodes left and resumes from the newest checkpoint. --no-kill keeps the\n"
            "# job when a node fails, and srun no longer ends it when one torchrun does.\n"
        )
        torchrun = torchrun.replace('--nnodes="$SLURM_NNODES"', f"--nnodes={low}:{high}")
        kill, no_kill, env = "", "#SBATCH --no-kill\n", f"export HETPAR_ELASTIC={low}:{high}  # see train.py's re-plan line\n"
        srun_note = "a node's failure leaves the others to meet again."
    else:
        kill, no_kill, env = " --kill-on-bad-exit=1", "", ""
        srun_note = "srun ends the job if one fails for good."
    return _SLURM_TEMPLATE.format(program=PROGRAM, world=plan.cluster.world_size, nodes=nodes, per_node=per_node,
                                  job=job_name, gpus=gpus, note=note, torchrun=torchrun, restarts=restarts,
                                  kill=kill, no_kill=no_kill, env=env, srun_note=srun_note)


_SLURM_TEMPLATE = """\
#!/bin/bash
# Runs {program} (compiled by hetpar for {world} processes: {nodes} nodes x {per_node}) as a Slurm job;
# arguments go to {program}. Submit from this directory (Slurm runs a copy of this script):
#
#   sbatch slurm.sbatch --steps 1000 --checkpoint-dir /shared/ckpt --checkpoint-every 100
#
# MASTER_PORT (default 29500) and MAX_RESTARTS (default {restarts}) may be set for sbatch. Give
# --checkpoint-dir on a file system every node sees: a (re)started job resumes from it.
{note}#SBATCH --job-name={job}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{gpus}#SBATCH --requeue
{no_kill}#SBATCH --output=%x-%j.out
set -euo pipefail
{env}HERE=${{HETPAR_BUILD_DIR:-$SLURM_SUBMIT_DIR}}
PLAN_WORLD_SIZE={world}
NPROC_PER_NODE={per_node}
if [ $((SLURM_NNODES * NPROC_PER_NODE)) -ne "$PLAN_WORLD_SIZE" ]; then
    echo "slurm.sbatch: $SLURM_NNODES nodes x $NPROC_PER_NODE processes != world size $PLAN_WORLD_SIZE of the plan" >&2
    exit 2
fi
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${{MASTER_PORT:-29500}}
MAX_RESTARTS=${{MAX_RESTARTS:-{restarts}}}
export HERE NPROC_PER_NODE MASTER_ADDR MASTER_PORT MAX_RESTARTS
# One torchrun per node (it starts the node's processes); {srun_note}
srun{kill} bash -c '{torchrun}' bash "$@"
"""


# ----------------------------------------------------------------------------- pytorchjob.yaml


def pytorchjob_source(plan: ParallelPlan, *, job_name: str, build_dir: str,
                      elastic: tuple[int, int] | None = None) -> str:
    """The text of ``pytorchjob.yaml``: a Kubeflow PyTorchJob (``kubeflow.org/v1``) with an
    elastic policy (c10d rendezvous, restarts) and Volcano gang scheduling; with ``elastic``
    (min, max) pods, minReplicas and maxReplicas span them ([Note: elastic launch])."""
    nodes, per_node = node_layout(plan)
    kinds = device_kinds(plan)
    vendors = {_accelerator(k) for k in kinds} - {None}
    resource = _K8S_RESOURCE[vendors.pop()] if len(vendors) == 1 else None
    limits = (
        f"              resources:\n                limits:\n                  {resource}: {per_node}\n" if resource else ""
    )
    note = (
        f"#\n# NOTE: the cluster mixes {', '.join(kinds)}. The pods of a PyTorchJob share one template and\n"
        "# the c10d rendezvous orders them freely, so the plan's device types per rank are not kept:\n"
        "# run this plan with launch.sh or slurm.sbatch, which fix node ranks (train.py stops at start-up\n"
        "# when a rank's device is not its planned type).\n"
        if len(kinds) > 1
        else ""
    )
    name = k8s_name(job_name)
    low, high = elastic or (nodes, nodes)
    if elastic is None:
        gang, env = f"the {nodes} pods", ""
        sizes = ("The world size is the\n# plan's, so minReplicas = maxReplicas: the job restarts, it does not grow or "
                 "shrink (compile with\n# --elastic MIN:MAX for a job that may).")
    else:
        gang = f"at least {low} pods"
        env = f'              env:\n                - name: HETPAR_ELASTIC\n                  value: "{low}:{high}"\n'
        sizes = (f"Elastic: the job runs\n# with {low} to {high} pods and torchrun restarts the workers when one is lost "
                 f"or joins. The plan is\n# for {nodes} pods; at another number {PROGRAM} stops with one line in the pod "
                 "logs giving the\n# hetpar plan --resume-from command that re-plans for the pods there are and resumes "
                 "from the\n# newest checkpoint (if the lost pod comes back within maxRestarts, training goes on).")
    return _PYTORCHJOB_TEMPLATE.format(program=PROGRAM, world=plan.cluster.world_size, nodes=nodes, low=low, high=high,
                                       per_node=per_node, name=name, build_dir=build_dir, limits=limits, note=note,
                                       gang=gang, sizes=sizes, env=env)


_PYTORCHJOB_TEMPLATE = """\
# Kubeflow PyTorchJob for {program} (compiled by hetpar: {world} processes, {nodes} pods x {per_node}).
#
#   kubectl apply -f pytorchjob.yaml
#
# Needs the Kubeflow training operator (kubeflow.org/v1) started with --gang-scheduler-name=volcano,
# and Volcano: the operator makes schedulingPolicy.minAvailable a Volcano PodGroup, so {gang}
# start together or not at all. The image must hold torch, hetpar's runtime and this directory
# at /workspace/{build_dir}; the claim {name}-checkpoints must be a ReadWriteMany volume.
# elasticPolicy: torchrun in every pod joins a c10d rendezvous and restarts the workers of every pod
# after a failure, up to maxRestarts times; they resume from /checkpoints. {sizes}
{note}apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: {name}
spec:
  nprocPerNode: "{per_node}"
  elasticPolicy:
    rdzvBackend: c10d
    minReplicas: {low}
    maxReplicas: {high}
    maxRestarts: 3
  runPolicy:
    schedulingPolicy:
      minAvailable: {low}
      queue: default
  pytorchReplicaSpecs:
    Worker:
      replicas: {nodes}
      restartPolicy: OnFailure
      template:
        spec:
          schedulerName: volcano
          containers:
            - name: pytorch
              image: {name}:latest
              workingDir: /workspace/{build_dir}
              command: ["torchrun", "{program}"]
              args: ["--steps", "1000", "--checkpoint-dir", "/checkpoints", "--checkpoint-every", "100"]
{env}{limits}              volumeMounts:
                - name: checkpoints
                  mountPath: /checkpoints
                - name: shm
                  mountPath: /dev/shm
          volumes:
            - name: checkpoints
              persistentVolumeClaim:
                claimName: {name}-checkpoints
            - name: shm
              emptyDir:
                medium: Memory
"""


__all__ = [
    "LAUNCHER", "PROGRAM", "PYTORCHJOB", "SLURM",
    "device_kinds", "elastic_problem", "k8s_name", "launcher_source", "node_layout", "pytorchjob_source",
    "slurm_source",
]
