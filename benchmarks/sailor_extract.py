"""Sailor's validation plans as the runs file benchmarks/sailor_bench.py reads (issue 34).

    .venv/bin/python benchmarks/sailor_extract.py --git-dir SAILOR.git --check      # the development set,
                                                                                   # compared with sailor_dev.json
    .venv/bin/python benchmarks/sailor_extract.py --git-dir SAILOR.git --held-out -o heldout.json \\
        --set clariden_GPT-NEO:clariden/GPT-NEO:37ded108=setA_original ...

SAILOR.git is a clone of github.com/eth-easl/sailor (``fetch`` brings one to
/work/.mirror/eth-easl+sailor/repo). Each ``--set NAME:DIR:COMMIT=LABEL[,COMMIT=LABEL...]``
reads every ``plan_config_*.json`` under sailor/Planner/simulations/validation/DIR at each
commit and keeps, per plan, its degrees, micro-batch and global batch, each stage's layer
count and its replicas' machines, and its measured step (``real``: the mean iteration time
of 10 iterations, the first 3 dropped) under LABEL. Issue 34 keeps all but two parts of
that data for the held-out check: a directory other than those two (DEVELOPMENT) is read
only with ``--held-out``, the flag of the one run that checks the finished model; a file there
that is byte for byte a development run's is skipped, and said so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEV_FILE = ROOT / "benchmarks" / "published" / "sailor_dev.json"
VALIDATION = "sailor/Planner/simulations/validation"
# issue 34's development set: (directory, commit prefix) -> (set name, measurement label)
DEVELOPMENT = {
    ("clariden/OPT-350", "37ded108"): ("clariden_OPT-350", "setA_original"),
    ("clariden/OPT-350", "0dbb351b"): ("clariden_OPT-350", "setB_main_rerun"),
    ("mit", "37ded108"): ("mit_TitanRTX_RTX2080Ti_replaced", "single_set"),
}


class ExtractError(ValueError):
    """A plan file this extractor cannot read as one run; the message says which and why."""


def git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], capture_output=True, text=True, check=True).stdout


def plan_files(git_dir: str, commit: str, directory: str) -> dict[str, str]:
    """The plan files under ``directory`` at ``commit``, path -> blob id."""
    listed = git(git_dir, "ls-tree", "-r", commit, f"{VALIDATION}/{directory}")
    files = (line.split(None, 3)[2:] for line in listed.splitlines())
    return {path: blob for blob, path in sorted(files, key=lambda f: f[1])
            if Path(path).name.startswith("plan_config_") and path.endswith(".json")}


def development_copies(git_dir: str) -> dict[str, str]:
    """Blob id -> the development run it holds: a held-out file with one of these ids is a copy of a development
    run (Sailor's clariden/GPT-NEO/N4/plan_config_N4_D4.json is clariden/OPT-350's, byte for byte)."""
    return {blob: f"{directory}@{commit}/{Path(path).name}" for directory, commit in DEVELOPMENT
            for path, blob in plan_files(git_dir, commit, directory).items()}


def run_of(plan: dict, name: str) -> dict:
    """One plan file's fields as sailor_bench.py reads them (its measured time left to the caller).

    Raises:
        ExtractError: more than one pipeline, replicas of different tensor-parallel degrees, stages of
            different data-parallel degrees, or a stage whose replica count is not its dp.
    """
    if len(plan["pipeline_list"]) != 1:
        raise ExtractError(f"{name}: {len(plan['pipeline_list'])} pipelines; one expected")
    pipe = plan["pipeline_list"][0]
    stages, tps, gpus = [], set(), set()
    for layers, replicas in zip(pipe["layers_per_stage"], pipe["tmp_per_stage"], strict=True):
        machines = []
        for vms, tp in replicas:
            tps.add(tp)
            machines.append([vm for vm, _gpus, _zone in vms])
            gpus.update(g for _vm, g, _zone in vms)
        stages.append({"layers": len(layers), "replicas": machines})
    if len(gpus) != 1:
        raise ExtractError(f"{name}: machines of {sorted(gpus)} GPUs; sailor_bench.py types one count")
    if len(tps) != 1 or len(set(pipe["dp"])) != 1:
        raise ExtractError(f"{name}: tensor-parallel degrees {sorted(tps)}, data-parallel degrees {pipe['dp']}: "
                           "sailor_bench.py types one of each")
    if any(len(s["replicas"]) != pipe["dp"][0] for s in stages):
        raise ExtractError(f"{name}: a stage's replicas do not number its dp {pipe['dp'][0]}")
    run = {"dp": pipe["dp"][0], "tp": tps.pop(), "pp": pipe["num_stages"], "gbs": plan["gbs"], "mbs": plan["mbs"],
           "stages": stages}
    count = gpus.pop()
    if count != 4:  # sailor_bench.py's default
        run["gpus_per_machine"] = count
    return run


def extract(git_dir: str, sets: list[tuple[str, str, list[tuple[str, str]]]], held_out: bool) -> list[dict]:
    """The runs of ``sets`` ((set name, directory, [(commit, label)])), one per plan file with its measured
    steps by label.

    Raises:
        ExtractError: a directory outside the development set without ``held_out``, or a plan that
            differs between commits in anything but its measurement.
    """
    runs: dict[tuple[str, str], dict] = {}
    copies: dict[str, str] | None = None
    for set_name, directory, measurements in sets:
        for commit, label in measurements:
            development = any(directory == d and commit.startswith(c[: len(commit)]) and len(commit) >= 7
                              for d, c in DEVELOPMENT)
            if not held_out and not development:
                raise ExtractError(f"{directory}@{commit} is held out (issue 34); pass --held-out for the final check")
            for path, blob in plan_files(git_dir, commit, directory).items():
                relative = path[len(VALIDATION) + 1:]
                if not development:
                    copies = development_copies(git_dir) if copies is None else copies
                    if blob in copies:
                        print(f"sailor_extract: skipped {relative}@{commit}: the same file as development run "
                              f"{copies[blob]}", file=sys.stderr)
                        continue
                plan = json.loads(git(git_dir, "show", f"{commit}:{path}"))
                run = {"set": set_name, "run": relative, **run_of(plan, relative)}
                key = (set_name, relative)
                if key in runs:
                    kept = runs[key]
                    if {k: v for k, v in kept.items() if k != "iter_time_s"} != run:
                        raise ExtractError(f"{relative} differs between commits beyond its measurement")
                    run = kept
                run.setdefault("iter_time_s", {})[label] = plan.get("real")
                runs[key] = run
    return list(runs.values())


def parse_set(text: str) -> tuple[str, str, list[tuple[str, str]]]:
    try:
        name, directory, measured = text.split(":")
        pairs = [tuple(item.split("=")) for item in measured.split(",")]
        if not all(len(p) == 2 and p[0] and p[1] for p in pairs):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--set {text!r}: give NAME:DIR:COMMIT=LABEL[,COMMIT=LABEL...]") from None
    return name, directory, pairs


def check(git_dir: str) -> int:
    """Extract the development set again and compare it with benchmarks/published/sailor_dev.json's runs."""
    sets = {}
    for (directory, commit), (name, label) in DEVELOPMENT.items():
        sets.setdefault((name, directory), []).append((commit, label))
    runs = extract(git_dir, [(name, d, m) for (name, d), m in sets.items()], held_out=False)
    recorded = json.loads(DEV_FILE.read_text())["runs"]

    def key(r):  # sailor_dev.json names the replaced set's files "mit@37ded10/..."
        return r["set"], Path(r["run"]).name

    want = {key(r): {k: v for k, v in r.items() if k != "run"} for r in recorded}
    got = {key(r): {k: v for k, v in r.items() if k != "run"} for r in runs}
    if want != got:
        for k in sorted(set(want) | set(got)):
            if want.get(k) != got.get(k):
                print(f"differs: {k}: recorded {want.get(k)}, extracted {got.get(k)}", file=sys.stderr)
        return 1
    print(f"the {len(got)} development runs extract as benchmarks/published/sailor_dev.json records them")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--git-dir", required=True, help="a clone of github.com/eth-easl/sailor (bare or its .git)")
    parser.add_argument("--set", action="append", default=[], type=parse_set, help="NAME:DIR:COMMIT=LABEL[,...]")
    parser.add_argument("--held-out", action="store_true", help="read directories outside issue 34's development set")
    parser.add_argument("--check", action="store_true", help="compare the development set with sailor_dev.json")
    parser.add_argument("-o", "--output", type=Path, help="where to write the runs file (default: stdout)")
    ns = parser.parse_args()
    if ns.check:
        return check(ns.git_dir)
    if not ns.set:
        parser.error("give --set, or --check")
    try:
        runs = extract(ns.git_dir, ns.set, ns.held_out)
    except (ExtractError, subprocess.CalledProcessError) as exc:
        print(f"sailor_extract: {exc}", file=sys.stderr)
        return 2
    text = json.dumps({"source": {"repository": "github.com/eth-easl/sailor", "sets": [
        {"name": n, "dir": d, "measurements": dict(m)} for n, d, m in ns.set]}, "runs": runs}, indent=1) + "\n"
    if ns.output:
        ns.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
