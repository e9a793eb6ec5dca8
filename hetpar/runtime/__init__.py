"""runtime: what a generated program imports. Depends on torch and hetpar.vocabulary only, never on planner, cost_models or rewriters.

Modules, in the order a program uses them:

- ``cli``: the program's options and the world-size check.
- ``distributed``: process group, this rank's place in the plan, its groups and pipeline peers, teardown.
- ``devices``: each rank's device type (HETPAR_DEVICE_TYPE or detection) checked against the plan's.
- ``model_file``: the model-file contract (build, loss, data).
- ``model_args`` and ``errors``: ``--model-arg`` parsing and the errors the CLI names, importing no torch.
- ``data``: ``--data``, a flat token file read behind the model file's ``batches`` (a replica reads its rows).
- ``graph``: fx capture, layers, and stage cuts.
- ``module_stage``: stages of Hugging Face decoder-only LMs cut at module boundaries (the model's own modules).
- ``shard``: this rank's stage, tensor parallel, its replica's rows of each batch, its micro-batches.
- ``context``: context parallelism: sequences split over ranks, attention all-gathering keys and values.
- ``experts``: modules of experts (the contract hetpar recognises) and expert parallelism: experts split over
  replicas, rows exchanged by all-to-all.
- ``materialize``: the model built on the meta device, and only this rank's tensors computed (or read from --init-from).
- ``hf_checkpoint``: Hugging Face checkpoint directories (safetensors): read by --init-from, each rank its slices;
  written by --save-hf.
- ``recompute``: each layer of a stage under torch.utils.checkpoint.
- ``data_parallel``: gradients of a stage's replicas: all-reduce, DDP comm hooks, ZeRO through FSDP2, or one of:
  ``compression`` (top-k and sign with error feedback), ``robust`` (trimmed mean, median, Multi-Krum),
  ``local_sgd`` (average every K steps); ``buckets`` holds what they share, ``sync_spec`` the plan's options.
- ``rebalance``: replica shares of the batch moved by measured speed.
- ``faults``: bad gradients and slow ranks injected on purpose, for testing.
- ``precision``: fp16 loss scaling agreed by every rank.
- ``schedule``: pipeline schedules as data (``1F0``), generators and a deadlock simulator.
- ``executor``: runs a stage's action list with point-to-point sends and receives.
- ``timing``: step and action times true on every device (a synchronize per step, CUDA events per action).
- ``tied``: parameters shared by stages on different ranks kept equal (their gradients summed).
- ``checkpoint``: atomic torch.distributed.checkpoint checkpoints and resume.
- ``training``: optimizer, reported loss, metrics, the final state_dict gathered.

``hetpar profile``'s microbenchmarks and reference workload live in the ``profiler``
package, which imports runtime.
"""
