"""Predicted against measured on Sailor's development runs (issue 34): OPT-350M on GH200 and on TITAN RTX + RTX 2080 Ti.

    .venv/bin/python benchmarks/sailor_bench.py            # the table, about 100 s on 2 cores
    .venv/bin/python benchmarks/sailor_bench.py --json     # the rows as JSON
    .venv/bin/python benchmarks/sailor_bench.py --data RUNS.json   # runs benchmarks/sailor_extract.py wrote

Sailor (Strati et al., SOSP'25, github.com/eth-easl/sailor) trained OPT-350M with its
Megatron-DeepSpeed fork and recorded each plan with its measured iteration time
(benchmarks/published/sailor_dev.json says which files, commits and fields). Issue 34 sets
these runs apart for development: the Clariden set (GH200, 4 per node, 15 plans, measured
twice) and the TITAN RTX + RTX 2080 Ti set the authors later replaced (10 plans, one with no
time). The rest of Sailor's validation data is the held-out check, read only through --data and
an extraction of it (docs/benchmarks/sailor-heldout_cpu-2core_2026-12-07.md, run once).

Each run is typed into ``planner.estimate`` as it ran: its dp, tp (4 everywhere), pp,
micro-batch and global batch, its layers per stage (Sailor's layer 0 is the embedding, 25
the final norm and head: benchmarks/published/gpt.py's numbering at 24 blocks), its nodes
in stage order (Megatron's rank order puts stage s's replicas after stage s - 1's, so a
stage whose replicas are of two types spans both and runs at the slower's pace), 1F1B,
no recompute, ZeRO off, AdamW, eager. The model: benchmarks/published/gpt.py at OPT-350M's
shape (24 blocks, hidden 1024, 16 heads, sequence 2048, vocabulary 50688: GPT-2's 50257
padded by Megatron to a multiple of 128 x tp; another set's model is its entry in MODELS). As the runs ran ("as ran"): attention
written out (Sailor's Megatron-DeepSpeed ``OPTParallelAttention``: baddbmm, the scale-mask-
softmax, which falls back to separate torch ops for fp32 inputs, and bmm; no dropout in the
layer), ``attention=unfused dropout=0``; fp32 (no --fp16 or --bf16) in Sailor's container,
built FROM nvcr.io/nvidia/pytorch:24.10-py3 (its Dockerfile and README), and NGC's PyTorch
containers set ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``, so cuBLAS runs the fp32 matmuls in
TF32 (MONAI's "Precision and Accelerating" documents the variable and the NGC default): the
GH200 rows are typed ``--dtype tf32``; Turing has no TF32, so the RTX rows stay fp32. The
column "fused, FP32 rate" is the reading before: one fused attention call and every
matmul at the FP32 rate. Then each run is calibrated on alone (``hetpar calibrate``'s fit
to its measured step, as ran) and every other run of its set predicted with the result.
Links: Clariden's nodes on 4 x 200 Gb/s Slingshot ("@200gx4", CSCS's published node design, not in Sailor's
repository); the TITAN RTX and RTX 2080 Ti machines on one 25 Gb/s link each ("@25gx1"). Issue 34 describes the
consumer cluster as joined by 1 GbE, which holds for its RTX 3090 machines but not between these two: Sailor's
measured link between a 4-GPU TITAN RTX machine and a 4-GPU RTX 2080 Ti machine reaches 2.87 GB/s at a
data-parallel bucket's size (sailor/providers/multizone_bandwidths_het.json, added in Sailor's commit b54fa6d:
pair "Titan-RTX/4" to "RTX-2080/4", a quadratic in log2 of the message's MB), a 25 Gb/s link's rate, where every
pair it did not measure (the RTX 3090s, one or eight GPUs per machine) shares one entry of 0.11 GB/s, 1 GbE; and
the runs' own times leave no room for 1 GbE (N2_D2 measured 16.2 s in all, where its 350 MB gradient all-reduce
per rank, four ranks to a NIC, takes 11 s at 1 Gb/s beside at least 14 s of compute). Only the link's class is
taken from that file, as a user would type their NICs; no Sailor profile goes into a prediction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hetpar.cost_models.cluster import parse_cluster  # noqa: E402
from hetpar.planner.calibrate import Run, calibrate  # noqa: E402
from hetpar.planner.capture import trace_model  # noqa: E402
from hetpar.planner.estimate import EstimateConfig, estimate  # noqa: E402
from hetpar.runtime.model_file import load_model_file  # noqa: E402

DATA = ROOT / "benchmarks" / "published" / "sailor_dev.json"
GPT = ROOT / "benchmarks" / "published" / "gpt.py"
OPT_350M = dict(n_layers=24, hidden=1024, heads=16, seq_len=2048, vocab=50688)
AS_RAN = dict(attention="unfused", dropout=0.0)  # Sailor's OPT layer: attention written out, no dropout
# Sailor's GPT-Neo as it ran (its run_gpt_neo.slurm and megatron/model/gpt_neo_model.py, read for the held-out
# check): 32 blocks of 2560, 20 heads, GPT-2's vocabulary padded to 50688 at tp 4, attention written out (the
# fused softmax falls back to torch's in fp32; the local window is computed but never applied), dropout 0.1 on
# the embedding and the residual branches and none on the attention probabilities, no output layer (the last
# stage ends in the final norm)
GPT_NEO = dict(n_layers=32, hidden=2560, heads=20, seq_len=2048, vocab=50688)
GPT_NEO_AS_RAN = dict(attention="unfused", dropout=0.1, attention_dropout=0.0, head=0)
# set name prefix -> (the model's shape, how it ran); "mit" covers the replacing consumer set (mit_v2) too: it
# trained OPT-350M as the set it replaced did (Sailor's sailor/Planner/baselines/Aceso/scripts_mit/
# aceso_opt_execute.sh sets model_name=OPT-350 for the RTX 3090, TITAN RTX and RTX 2080 Ti machines run_mit.sh names)
MODELS = {"clariden_OPT-350": (OPT_350M, AS_RAN), "mit": (OPT_350M, AS_RAN), "clariden_GPT-NEO": (GPT_NEO, GPT_NEO_AS_RAN)}
# the RTX 3090 machines reach every other machine at 0.11 GB/s in Sailor's measurements: 1 GbE
DEVICES = {"GH-96": "GH200-96GB@200gx4", "Titan-RTX": "TitanRTX-24GB@25gx1", "RTX-2080": "RTX2080Ti-11GB@25gx1",
           "RTX-3090": "RTX3090-24GB@1gx1"}
GPUS_PER_ENTRY = 4  # a machine's GPUs, unless the run says otherwise ("gpus_per_machine")


def cluster_spec(run: dict) -> str:
    """Nodes in Megatron's rank order: stage by stage, replica by replica, as groups of equal neighbours."""
    entries = [vm for stage in run["stages"] for replica in stage["replicas"] for vm in replica]
    groups: list[list] = []
    for vm in entries:
        if groups and groups[-1][0] == vm:
            groups[-1][1] += 1
        else:
            groups.append([vm, 1])
    unknown = sorted({vm for vm, _ in groups} - set(DEVICES))
    if unknown:
        sys.exit(f"{run['run']}: machines {unknown} have no device in DEVICES; add their profile and link")
    gpus = run.get("gpus_per_machine", GPUS_PER_ENTRY)
    return "+".join(f"{n}x{gpus}x{DEVICES[vm]}" for vm, n in groups)


def as_ran_dtype(run: dict) -> str:
    """TF32 matmuls on the GH200s (NGC's cuBLAS override; see the module docstring), fp32 on Turing."""
    return "tf32" if run["set"].startswith("clariden") else "fp32"


def config_of(run: dict, dtype: str) -> EstimateConfig:
    """The run's configuration; one stage holds every layer, whatever its file counts (Sailor's GPT-Neo plan of
    one stage records OPT-350M's 26)."""
    layers = tuple(s["layers"] for s in run["stages"]) if run["pp"] > 1 else None
    return EstimateConfig(global_batch_size=run["gbs"], dp=run["dp"], tp=run["tp"], pp=run["pp"], micro_batch_size=run["mbs"],
                          dtype=dtype, stage_layers=layers)


def predict(graph, run: dict, dtype: str, profiles=None) -> float:
    return estimate(graph, parse_cluster(cluster_spec(run), profiles=profiles), config_of(run, dtype)).predicted.step_time_s


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else 0.0


def model_of(run: dict) -> tuple[dict, dict]:
    """The run's model shape and how it ran (MODELS, by the set's name)."""
    found = next((v for prefix, v in MODELS.items() if run["set"].startswith(prefix)), None)
    if found is None:
        sys.exit(f"set {run['set']!r}: no model for it in MODELS; add its shape and how it ran")
    return found


def graphs_of(data: dict) -> dict:
    """For each model the runs use: (as ran, the fused FP32 reading's model) traced once."""
    out = {}
    for run in data["runs"]:
        shape, as_ran = model_of(run)
        key = json.dumps(shape, sort_keys=True)
        if key not in out:
            out[key] = (trace_model(load_model_file(str(GPT), {**shape, **as_ran})), trace_model(load_model_file(str(GPT), shape)))
    return out


def rows(data: dict, graphs: dict) -> list[dict]:
    """Each measurement with its prediction as ran (the model as it ran: attention written out) and as read
    before (one fused attention call, matmuls at the FP32 rate)."""
    out = []
    for run in data["runs"]:
        graph, fused = graphs[json.dumps(model_of(run)[0], sort_keys=True)]
        for measurement, measured in run["iter_time_s"].items():
            if not measured:
                continue  # Sailor's RTX N1_D1 recorded memory only
            row = {"set": run["set"], "run": run["run"].split("/")[-1], "measurement": measurement, "cluster": cluster_spec(run),
                   "dp": run["dp"], "tp": run["tp"], "pp": run["pp"], "mbs": run["mbs"], "gbs": run["gbs"], "measured_s": measured,
                   "as_ran_s": predict(graph, run, as_ran_dtype(run)), "fused_fp32_s": predict(fused, run, "fp32")}
            row["_run"], row["_graph"] = run, graph
            out.append(row)
    return out


def leave_one_out(rs: list[dict]) -> list[dict]:
    """For each run c of a set (one cluster, one measurement), ``hetpar calibrate``'s fit to c's measured step
    alone ([Note: fitting steps]: one factor on the kernels' rate, one on the per-op overhead), then every other
    run of the set predicted with it: (calibrated on, predicted, measured, predicted seconds)."""
    pairs = []
    sets = sorted({(r["set"], r["measurement"]) for r in rs})
    for key in sets:
        members = [r for r in rs if (r["set"], r["measurement"]) == key]
        for c in members:
            run = Run(name=c["run"], graph=c["_graph"], cluster_spec=c["cluster"], config=config_of(c["_run"], as_ran_dtype(c["_run"])),
                      step_s=c["measured_s"])
            fitted, fits = calibrate([run])
            factors = {f.field: f.after / f.before for f in fits}
            for r in members:
                if r is not c:
                    pairs.append({"set": key, "on": c["run"], "run": r["run"], "gbs": r["gbs"], "measured_s": r["measured_s"],
                                  "same_mbs": c["mbs"] == r["mbs"],
                                  "calibrated_s": predict(r["_graph"], r["_run"], as_ran_dtype(r["_run"]), fitted),
                                  "flagged": any(f.fixed_cost_bound for f in fits),
                                  "rate_factor": factors["kernel_efficiency"], "overhead_factor": factors["op_overhead_s"]})
    return pairs


def summary(rs: list[dict], key: str) -> str:
    errors = [abs(r[key] / r["measured_s"] - 1) for r in rs]
    rho = spearman([r["gbs"] / r[key] for r in rs], [r["gbs"] / r["measured_s"] for r in rs])
    return f"median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}, Spearman {rho:.3f} over {len(rs)} runs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--data", type=Path, default=DATA, help="a runs file (benchmarks/sailor_extract.py writes one; "
                                                                  "default: the development set)")
    ns = parser.parse_args()
    data = json.loads(ns.data.read_text())
    rs = rows(data, graphs_of(data))
    pairs = leave_one_out(rs)
    if ns.json:
        print(json.dumps({"rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rs], "calibrated": pairs},
                         indent=1))
        return
    print("| set | run | measured as | cluster | dp, tp, pp | mbs x gbs | measured s | as ran s | error | fused, FP32 rate s | error |")
    print("|---|---|---|---|---|---|---:|---:|---:|---:|---:|")
    for r in rs:
        print(f"| {r['set']} | {r['run']} | {r['measurement']} | {r['cluster']} | {r['dp']}, {r['tp']}, {r['pp']} | "
              f"{r['mbs']} x {r['gbs']} | {r['measured_s']:.4g} | {r['as_ran_s']:.4g} | {r['as_ran_s'] / r['measured_s'] - 1:+.1%} | "
              f"{r['fused_fp32_s']:.4g} | {r['fused_fp32_s'] / r['measured_s'] - 1:+.1%} |")
    print()
    labels = {"clariden_OPT-350": "GH200", "mit_TitanRTX_RTX2080Ti_replaced": "TITAN RTX + RTX 2080 Ti"}
    for name, sel in [("all", rs)] + [(labels.get(k, k), [r for r in rs if r["set"] == k]) for k in sorted({r["set"] for r in rs})]:
        print(f"- {name}: as ran {summary(sel, 'as_ran_s')}; fused at the FP32 rate {summary(sel, 'fused_fp32_s')}")
    print()
    print("Calibrated on one run of the set, every other run of the set predicted (all choices of the one run):")
    print()
    for key in sorted({p["set"] for p in pairs}):
        sel = [p for p in pairs if p["set"] == key]
        errors = [abs(p["calibrated_s"] / p["measured_s"] - 1) for p in sel]
        per_choice = [statistics.median(abs(p["calibrated_s"] / p["measured_s"] - 1) for p in sel if p["on"] == on)
                      for on in sorted({p["on"] for p in sel})]
        print(f"- {key[0]} ({key[1]}): median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} over "
              f"{len(sel)} predictions; the median per calibration run ranges {min(per_choice):.1%}-{max(per_choice):.1%}")
        rates, overheads = [p["rate_factor"] for p in sel], [p["overhead_factor"] for p in sel]
        print(f"  - fitted: kernels' rate x{min(rates):.3g}-{max(rates):.3g}, per-op overhead x{min(overheads):.3g}-"
              f"{max(overheads):.3g} over the choices of the run")
        same = [abs(p["calibrated_s"] / p["measured_s"] - 1) for p in sel if p["same_mbs"]]
        if same:
            print(f"  - where the run calibrated on has the predicted run's micro-batch size: median |error| "
                  f"{statistics.median(same):.1%}, worst {max(same):.1%} over {len(same)} predictions")
        kept = [p for p in sel if not p["flagged"]]
        if kept and len(kept) < len(sel):
            good = [abs(p["calibrated_s"] / p["measured_s"] - 1) for p in kept]
            ons = sorted({p["on"] for p in sel if p["flagged"]})
            print(f"  - leaving out the fits `hetpar calibrate` flags as fixed-cost bound ({', '.join(ons)}): median "
                  f"|error| {statistics.median(good):.1%}, worst {max(good):.1%} over {len(kept)} predictions")


if __name__ == "__main__":
    main()
