"""One word per idea: the names that plans, the command line, the cost models, the planner
and the runtime share, each defined here once.

Every package of hetpar may import this module, and it imports nothing of hetpar, so
``cost_models`` and ``runtime`` (which import nothing else of ours) can use it too. A
name is a ``StrEnum`` (an ``IntEnum`` for ZeRO stages): its members compare, hash and
print as their values, so a plan file keeps plain strings (``"schedule": "zb"``) and
``Schedule("zb")`` reads one back. The command line's choices are these enums
(``--schedule``, ``--recompute``, ``--dtype``...), so a choice, its plan field and the
code that acts on it cannot drift apart.

Naming rule: a class names the idea in the singular (``Schedule``, ``Recompute``); a
member is the value in capitals (``Recompute.FULL``) except where a value is not an
identifier (``Schedule.ONE_F_ONE_B`` is ``"1f1b"``, ``Schedule.ZERO_BUBBLE`` is ``"zb"``).
Code never spells a value as a string literal: ``tests/test_vocabulary.py`` finds a
second definition or a stray literal and fails.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum


class _Name(StrEnum):
    """A vocabulary name: prints, compares and hashes as its value, and its ``repr`` is its
    value's, so a member written into a message or a generated program reads as the string."""

    def __repr__(self) -> str:
        return repr(self.value)


class Schedule(_Name):
    """Pipeline schedules hetpar costs and runs (runtime/schedule.py draws each)."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    INTERLEAVED = "interleaved"  # interleaved 1F1B over ``virtual_stages`` chunks per pipeline rank
    ZERO_BUBBLE = "zb"  # ZB-H1: backward split into input-gradient (B) and weight-gradient (W) actions


class Recompute(_Name):
    """Activation recomputation of a stage's layers."""

    NONE = "none"
    SELECTIVE = "selective"  # the attention core recomputed, matmul outputs kept (Korthikanti et al. 2023)
    FULL = "full"  # each layer under torch.utils.checkpoint: only its input kept


class ZeroStage(IntEnum):
    """What data-parallel replicas shard (ZeRO, through FSDP2 in the program)."""

    def __repr__(self) -> str:
        return repr(self.value)

    NONE = 0  # plain data parallelism: every replica holds everything
    OPTIMIZER = 1  # optimizer state sharded
    GRADIENTS = 2  # optimizer state and gradients sharded
    PARAMETERS = 3  # optimizer state, gradients and parameters sharded


class Sharding(_Name):
    """How a module's weight is split across the tensor-parallel ranks of its stage
    ([Note: tensor-parallel ILP] in planner/capture)."""

    COLWISE = "colwise"  # output features split; the output stays sharded
    ROWWISE = "rowwise"  # input features split; outputs are summed (all-reduce)
    COLWISE_GATHER = "colwise_gather"  # output features split, the output all-gathered (replicated)
    ROWWISE_SLICE = "rowwise_slice"  # input features split from a replicated input; outputs all-reduced
    VOCAB_EMBEDDING = "vocab_embedding"  # an Embedding's rows (the vocabulary) split; outputs all-reduced
    VOCAB_HEAD = "vocab_head"  # the output Linear's vocabulary split; logits stay split into the loss


class DType(_Name):
    """Training precision: the compute dtype under autocast (parameters stay float32)."""

    FP32 = "fp32"  # float32 throughout, matmuls in IEEE float32 (torch's default)
    TF32 = "tf32"  # float32 tensors, matmuls and convolutions on TF32 tensor cores where the device has them
    BF16 = "bf16"
    FP16 = "fp16"  # with dynamic loss scaling


class Precision(_Name):
    """Number formats a device's peak matmul rate is quoted in (a profile's ``peak_flops_per_s``
    keys): the training dtypes, plus TF32 (fp32 matmuls on tensor cores) and FP8."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"


class Optimizer(_Name):
    """Optimizers the program builds and the cost model prices (state bytes, step time)."""

    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"


class CompressionKind(_Name):
    """Kinds of data-parallel gradient compression (runtime/sync_spec.py parses ``powersgd:R``, ``topk:F``)."""

    NONE = "none"
    BF16 = "bf16"
    FP16 = "fp16"
    POWERSGD = "powersgd"
    TOPK = "topk"
    SIGN = "sign"


class AggregationKind(_Name):
    """How replicas' gradients combine (runtime/sync_spec.py parses ``trimmed-mean:B``, ``krum:F``)."""

    MEAN = "mean"
    TRIMMED_MEAN = "trimmed-mean"
    MEDIAN = "median"
    KRUM = "krum"


class SyncScope(_Name):
    """Which replicas local SGD averages every ``sync_every`` steps."""

    ALL = "all"  # every replica, nothing in between
    NODE = "node"  # gradients all-reduced inside a node every step, averaged across nodes every K


class ObjectiveKind(_Name):
    """What a plan minimises (``hetpar plan --objective``)."""

    TIME = "time"  # step time on all devices
    COST = "cost"  # dollars per step over sub-clusters
    ENERGY = "energy"  # joules per step over sub-clusters


class SplitSolver(_Name):
    """How the search solves each candidate's layer split (``hetpar plan --split-solver``)."""

    AUTO = "auto"  # a dynamic programme where each rank holds one chunk, CP-SAT where the schedule interleaves
    CP_SAT = "cp-sat"  # CP-SAT for every candidate


class Switch(_Name):
    """A choice the user may leave to hetpar: ``--hetero-dp``, the program's ``--compile``."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"
