"""Rank layout, pipeline peers, data slicing and the program's command line; no processes."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from hetpar.runtime import cli
from hetpar.runtime.distributed import StageSpec, locate, peers_of
from hetpar.runtime.shard import ShardError, loss_weight, microbatches


def layout(tps: list[int], dp: int) -> list[StageSpec]:
    stages, rank = [], 0
    for s, tp in enumerate(tps):
        ranks = []
        for _ in range(dp):
            ranks.append(list(range(rank, rank + tp)))
            rank += tp
        stages.append(StageSpec(layers=(s, s), device_type="cpu", tensor_parallel=tp, ranks=ranks))
    return stages


def test_locate_finds_stage_replica_and_tp_index():
    stages = layout([2, 1], dp=2)  # stage 0: [[0, 1], [2, 3]], stage 1: [[4], [5]]
    me = locate(stages, 3)
    assert (me.stage, me.replica, me.tp_index) == (0, 1, 1)
    assert (locate(stages, 5).stage, locate(stages, 5).replica) == (1, 1)
    with pytest.raises(ValueError, match="rank 6 is in no stage"):
        locate(stages, 6)


@pytest.mark.parametrize("tps,dp", [([1, 1], 1), ([2, 2], 2), ([1, 2, 1], 1), ([2, 1, 4, 2], 2), ([4, 2], 1)])
def test_every_pipeline_message_has_one_sender_and_one_receiver(tps, dp):
    stages = layout(tps, dp)
    world = sum(tp * dp for tp in tps)
    peers = {r: peers_of(stages, locate(stages, r)) for r in range(world)}
    forward_sent = {(src, dst) for src, p in peers.items() for dst in p.send_activations_to}
    forward_read = {(p.recv_activations_from, dst) for dst, p in peers.items() if p.recv_activations_from is not None}
    assert forward_sent == forward_read
    backward_sent = {(src, dst) for src, p in peers.items() for dst in p.send_grads_to}
    backward_read = {(p.recv_grads_from, dst) for dst, p in peers.items() if p.recv_grads_from is not None}
    assert backward_sent == backward_read
    for r, p in peers.items():
        me = locate(stages, r)
        # Peers stay in the replica and in the neighbouring stage.
        for other in itertools.chain(p.send_activations_to, p.send_grads_to):
            them = locate(stages, other)
            assert them.replica == me.replica and abs(them.stage - me.stage) == 1
        # Every rank past the first stage reads activations; every rank before the last reads gradients.
        assert (p.recv_activations_from is None) == (me.stage == 0)
        assert (p.recv_grads_from is None) == (me.stage == len(stages) - 1)


def test_same_tp_pairs_index_with_index():
    stages = layout([2, 2], dp=1)
    p = peers_of(stages, locate(stages, 1))
    assert p.send_activations_to == (3,) and p.recv_grads_from == 3


def test_microbatches_take_the_replicas_rows_in_order():
    inputs = (torch.arange(8).reshape(8, 1), torch.arange(8) * 10)
    targets = torch.arange(8) * 100
    mbs = microbatches(inputs, targets, replica=1, data_parallel=2, num_microbatches=2, device=torch.device("cpu"))
    assert [mb[1].tolist() for mb in mbs] == [[400, 500], [600, 700]]
    assert [mb[0][1].tolist() for mb in mbs] == [[40, 50], [60, 70]]
    assert mbs[0][0][0].shape == (2, 1)


def test_microbatches_refuse_a_batch_that_does_not_split():
    with pytest.raises(ShardError, match=r"data_parallel\(2\) \* num_microbatches\(2\)"):
        microbatches((torch.zeros(6),), torch.zeros(6), replica=0, data_parallel=2, num_microbatches=2,
                     device=torch.device("cpu"))


def test_command_line_defaults_and_options(tmp_path):
    args = cli.parse_args(argv=[])
    assert (args.steps, args.lr, args.optimizer, args.seed) == (10, 1e-3, "adamw", 0)
    assert args.init_from is args.save_final is args.metrics is None
    init = tmp_path / "init.pt"
    init.write_bytes(b"")
    args = cli.parse_args(argv=["--steps", "3", "--optimizer", "sgd", "--lr", "0.5", "--init-from", str(init),
                                "--save-final", "f.pt", "--metrics", "m.jsonl", "--seed", "7"])
    assert (args.steps, args.optimizer, args.lr, args.seed, args.init_from) == (3, "sgd", 0.5, 7, init)


def test_command_line_rejects_a_missing_init_file(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv=["--init-from", "nope.pt"])
    assert exc.value.code == 2
    assert "--init-from 'nope.pt': no such file" in capsys.readouterr().err


def test_world_size_check(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cli.check_world_size(2, "train.py")
    with pytest.raises(SystemExit) as exc:
        cli.check_world_size(4, "/some/dir/train.py")
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "hetpar: this program was compiled for world size 4 but torchrun started 2 processes; "
        "run: torchrun --nproc_per_node=4 train.py\n"
    )


def test_master_port_zero_is_refused_at_once(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "0")
    with pytest.raises(SystemExit) as exc:
        cli.check_launch(2, "train.py")
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("hetpar: torchrun --master-port 0 gives the workers port 0")


def test_a_one_process_program_runs_without_torchrun(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # so that monkeypatch restores the variable afterwards
        monkeypatch.delenv(name)
    cli.check_launch(1, "train.py")
    assert (os.environ["WORLD_SIZE"], os.environ["RANK"]) == ("1", "0") and os.environ["MASTER_PORT"]


def test_checkpoint_and_powersgd_options(tmp_path, capsys):
    args = cli.parse_args(argv=["--checkpoint-dir", "ck"])
    assert (str(args.checkpoint_dir), args.checkpoint_every, args.checkpoint_keep) == ("ck", 100, 3)
    args = cli.parse_args(argv=["--checkpoint-dir", "ck", "--checkpoint-every", "5", "--checkpoint-keep", "1",
                                "--powersgd-rank", "4", "--powersgd-start-step", "10"], powersgd=True)
    assert (args.checkpoint_every, args.checkpoint_keep, args.powersgd_rank, args.powersgd_start_step) == (5, 1, 4, 10)
    assert (cli.parse_args(argv=[]).powersgd_rank, cli.parse_args(argv=[]).powersgd_start_step) == (1, 2)
    for argv, message in ((["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
                          (["--checkpoint-dir", "ck", "--checkpoint-every", "0"], "--checkpoint-every 0 must be >= 1"),
                          (["--powersgd-start-step", "1"], "--powersgd-start-step 1 must be >= 2"),
                          (["--powersgd-rank", "4"], "unrecognized arguments: --powersgd-rank")):  # a plan without PowerSGD
        with pytest.raises(SystemExit):
            cli.parse_args(argv=argv, powersgd=argv[0] != "--powersgd-rank")
        assert message in capsys.readouterr().err


def test_unequal_replica_shares_take_consecutive_rows():
    targets = torch.arange(8)
    sizes = [3, 1]  # replica 0: 2 micro-batches of 3 rows, replica 1: 2 of 1
    first = microbatches((targets,), targets, replica=0, data_parallel=2, num_microbatches=2,
                         device=torch.device("cpu"), micro_batch_sizes=sizes)
    second = microbatches((targets,), targets, replica=1, data_parallel=2, num_microbatches=2,
                          device=torch.device("cpu"), micro_batch_sizes=sizes)
    assert [mb[1].tolist() for mb in first] == [[0, 1, 2], [3, 4, 5]]
    assert [mb[1].tolist() for mb in second] == [[6], [7]]
    assert (loss_weight(sizes, 0), loss_weight(sizes, 1), loss_weight([2, 2], 1)) == (1.5, 0.5, 1.0)
    with pytest.raises(ShardError, match=r"micro-batches of \[3, 2\] rows per replica"):
        microbatches((targets,), targets, replica=0, data_parallel=2, num_microbatches=2, device=torch.device("cpu"),
                     micro_batch_sizes=[3, 2])
