"""`localrun bench ab`: one measurement of two builds or two configurations, each trial in a fresh process.

    localrun bench ab --measure itl|ttft|decode|throughput [--rounds 3]
                      [--a-rev REV | --a-path DIR] [--b-rev REV | --b-path DIR]     two builds
                      [--a-env K=V ...] [--b-env K=V ...]                           two environments
                      [--a-engine K=V ...] [--b-engine K=V ...] [--engine K=V ...]  two engine configurations
                      [--shape llama-3.1-8b] [--device cuda] [--prompt-len N] [--output-len N] [--batch N]
                      [--repeats N] [--prompts FILE|bundled] [--output FILE] [--json]

A side is a source tree (--X-path; a git revision --X-rev is checked out to a temporary directory with
`git archive`), or this localrun, run with the side's environment variables and EngineConfig options. Every
trial is a fresh process (localrun/bench/ab_trial.py: engine built with random weights of --shape, one
untimed warm-up, then the measure), and the sides alternate A, B, B, A, A, B, ... so that neither always
runs first. Printed: each side's median over its trials and the difference B - A with a bootstrap
interval (resampling each side's trial values); written: a JSON file with every trial
(default results/ab-<measure>-<device>-<date>.json). The method: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import localrun.bench.ab_trial as trial_module

SIDES = ("a", "b")


class AbError(Exception):
    """A side could not be prepared, or one of its trials failed; the message says which and why."""


def _pairs(items: list[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise AbError(f"{what}: expected KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def _value(text: str) -> Any:
    """An engine option's value: JSON when it parses (8, 0.5, true, null), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def add_parser(sub, positive_int) -> None:
    p = sub.add_parser("ab", help="A/B of two builds or two configurations: a fresh process per trial, alternated")
    p.add_argument("--measure", choices=sorted(trial_module.UNITS), required=True)
    p.add_argument("--rounds", type=positive_int, default=3, help="pairs of trials (A,B then B,A ...; default 3)")
    for s in SIDES:
        S = s.upper()
        g = p.add_mutually_exclusive_group()
        g.add_argument(f"--{s}-rev", metavar="REV", help=f"side {S}: this git revision, checked out to a temp dir")
        g.add_argument(f"--{s}-path", type=Path, metavar="DIR", help=f"side {S}: the localrun source tree in DIR")
        p.add_argument(f"--{s}-env", action="append", metavar="K=V", help=f"side {S}: an environment variable")
        p.add_argument(f"--{s}-engine", action="append", metavar="K=V", help=f"side {S}: an EngineConfig option")
        p.add_argument(f"--{s}-name", default=None, help=f"side {S}'s name in the output (default: what it is)")
    p.add_argument("--engine", action="append", metavar="K=V", help="an EngineConfig option of both sides")
    p.add_argument("--repo", type=Path, default=None, help="git repository of --a-rev/--b-rev (default: this tree)")
    p.add_argument("--shape", default=None, help="random weights of this shape (default: llama-3.1-8b on CUDA, "
                                                 "else tiny)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--prompt-len", type=positive_int, default=None, help="prompt tokens (default 512; CPU 32)")
    p.add_argument("--output-len", type=positive_int, default=None, help="tokens out (default 256; CPU 16)")
    p.add_argument("--batch", type=positive_int, default=None, help="decode/throughput prompts (default 64; CPU 4)")
    p.add_argument("--repeats", type=positive_int, default=None, help="requests or passes measured in one trial")
    p.add_argument("--prompts", default=None, help="throughput: a `bench sample` prompt file, or 'bundled' (the "
                                                   "ShareGPT file the package ships, SmolLM2-tokenized)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--level", type=float, default=0.95, help="the interval's coverage (default 0.95)")
    p.add_argument("--trial-timeout", type=float, default=600.0, help="seconds one trial may take (default 600)")
    p.add_argument("--output", type=Path, default=None, help="the JSON results file (default: results/ab-<measure>-"
                                                             "<device>-<date>.json)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (table on stderr)")


def this_tree() -> Path:
    """The directory that holds the localrun package this process runs."""
    return Path(__file__).resolve().parents[2]


def checkout(repo: Path, rev: str, dest: Path) -> str:
    """`rev` of `repo` extracted into dest (git archive); its full commit id."""
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{rev}^{{commit}}"], check=True,
                             capture_output=True, text=True).stdout.strip()
        data = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", sha], check=True,
                              capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        raise AbError(f"git revision {rev!r} of {repo}: {err.decode(errors='replace').strip() or exc}") from None
    dest.mkdir(parents=True)
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(dest, filter="data")
    return sha


def prepare(a: argparse.Namespace, side: str, work: Path) -> dict[str, Any]:
    """A side: its source root (None: this localrun), environment, engine options and a name."""
    rev, path = getattr(a, f"{side}_rev"), getattr(a, f"{side}_path")
    env = _pairs(getattr(a, f"{side}_env"), f"--{side}-env")
    engine = {k: _value(v) for k, v in _pairs(a.engine, "--engine").items()}
    engine.update({k: _value(v) for k, v in _pairs(getattr(a, f"{side}_engine"), f"--{side}-engine").items()})
    out: dict[str, Any] = {"root": None, "rev": None, "env": env, "engine": engine}
    if rev:
        out["rev"] = checkout(a.repo or this_tree(), rev, work / side)
        out["root"] = str(work / side)
    elif path:
        root = path.expanduser().resolve()
        if not (root / "localrun" / "__init__.py").is_file():
            raise AbError(f"--{side}-path {path}: no localrun/__init__.py there (a localrun source tree)")
        out["root"] = str(root)
    what = [f"rev {rev} ({out['rev'][:12]})" if rev else f"tree {out['root']}" if path else "this tree"]
    what += [f"{k}={v}" for k, v in env.items()] + [f"engine {k}={v}" for k, v in engine.items()]
    out["what"] = ", ".join(what)
    out["name"] = getattr(a, f"{side}_name") or side.upper()
    return out


def order(rounds: int) -> list[str]:
    """A, B, B, A, A, B, ...: each round a pair, the first of the pair alternating."""
    return [s for r in range(rounds) for s in (("a", "b") if r % 2 == 0 else ("b", "a"))]


def run_trial(side: dict[str, Any], spec: dict[str, Any], timeout: float, cwd: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items()}
    env.update(side["env"])
    root = side["root"] or str(this_tree())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    source = Path(trial_module.__file__).read_text(encoding="utf-8")
    args = {**spec, "root": root, "engine": side["engine"]}
    try:
        p = subprocess.run([sys.executable, "-c", source, json.dumps(args)], cwd=cwd, env=env, timeout=timeout,
                           capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        raise AbError(f"side {side['name']} ({side['what']}): a trial ran past {timeout:g} s") from None
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(trial_module.MARK)]
    if p.returncode != 0 or not lines:
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-15:])
        raise AbError(f"side {side['name']} ({side['what']}): a trial exited with code {p.returncode}:\n{tail}")
    return json.loads(lines[-1][len(trial_module.MARK):])


def compare(a_vals: list[float], b_vals: list[float], better: str, level: float = 0.95, draws: int = 2000,
            seed: int = 0) -> dict[str, Any]:
    """Medians, B - A, and a percentile bootstrap interval of the difference of medians (each side's trials
    resampled with replacement; seeded, so the same numbers give the same interval)."""
    ma, mb = statistics.median(a_vals), statistics.median(b_vals)
    pct = (lambda x: 100.0 * x / ma) if ma else (lambda x: None)
    out = {"a_median": ma, "b_median": mb, "diff": mb - ma, "diff_pct": pct(mb - ma), "interval": None,
           "interval_pct": None, "level": level, "draws": draws, "better": better}
    if min(len(a_vals), len(b_vals)) < 2:
        return {**out, "verdict": "one trial a side: no interval (--rounds 2 or more)"}
    rng = random.Random(seed)
    diffs = sorted(statistics.median(rng.choices(b_vals, k=len(b_vals)))
                   - statistics.median(rng.choices(a_vals, k=len(a_vals))) for _ in range(draws))
    k = int((1 - level) / 2 * draws)
    lo, hi = diffs[k], diffs[draws - 1 - k]
    if lo > 0 or hi < 0:
        up = lo > 0
        verdict = "B better" if up == (better == "higher") else "B worse"
    else:
        verdict = "no difference the interval can tell"
    return {**out, "interval": [lo, hi], "interval_pct": [pct(lo), pct(hi)], "verdict": verdict}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def run(a: argparse.Namespace, console=None) -> int:
    from localrun.bench.results import environment, print_table

    if not 0 < a.level < 1:
        raise AbError("--level must be between 0 and 1")
    prompts = a.prompts
    if prompts == "bundled":
        from localrun.bench.throughput import BUNDLED_PROMPTS

        prompts = str(BUNDLED_PROMPTS)
    elif prompts:
        prompts = str(Path(prompts).expanduser().resolve())
    spec = {"measure": a.measure, "shape": a.shape, "device": a.device, "prompt_len": a.prompt_len,
            "output_len": a.output_len, "batch": a.batch, "repeats": a.repeats, "seed": a.seed,
            "prompts_file": prompts}
    work = Path(tempfile.mkdtemp(prefix="localrun-ab-"))
    try:
        sides = {s: prepare(a, s, work) for s in SIDES}
        empty = work / "cwd"
        empty.mkdir()
        trials = []
        for i, s in enumerate(order(a.rounds)):
            if console is not None:
                console.print(f"[bold]ab[/bold]: trial {i + 1}/{2 * a.rounds}, side {sides[s]['name']}")
            res = run_trial(sides[s], spec, a.trial_timeout, empty)
            trials.append({"side": s, **res})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    vals = {s: [t["value"] for t in trials if t["side"] == s] for s in SIDES}
    first = trials[0]
    stats = compare(vals["a"], vals["b"], first["better"], a.level, seed=a.seed)
    result = {"mode": "ab", "measure": a.measure, "unit": first["unit"], "device": first["device"],
              "shape": first["shape"], "sizes": {k: first[k] for k in ("prompt_len", "output_len", "batch",
                                                                          "repeats")},
              "prompts_file": prompts, "rounds": a.rounds, "order": order(a.rounds),
              "sides": {s: {k: v for k, v in sides[s].items() if k != "root"} | {"root": sides[s]["root"],
                                                                                  "values": vals[s]}
                        for s in SIDES},
              "comparison": stats, "trials": trials, "env": environment()}
    out = a.output or Path("results") / (f"ab-{a.measure}-{_slug(first['device'])}-"
                                          f"{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    result["saved_to"] = str(out)

    from rich.console import Console

    con = Console(stderr=a.json)
    unit = first["unit"]
    print_table(f"ab: {a.measure} ({unit}, {stats['better']} is better) on {first['device']}, {first['shape']}, "
                f"{a.rounds} rounds", ["side", "what", f"median {unit}", "trials"],
                [[sides[s]["name"], sides[s]["what"], statistics.median(vals[s]),
                  " ".join(f"{v:.4g}" for v in vals[s])] for s in SIDES], con)
    pct = "" if stats["diff_pct"] is None else f" ({stats['diff_pct']:+.2f}%)"
    span = "" if stats["interval"] is None else "; {:.0%} interval [{:+.4g}, {:+.4g}] {}".format(
        stats["level"], *stats["interval"], unit)
    con.print(f"B - A: {stats['diff']:+.4g} {unit}{pct}{span}: {stats['verdict']}")
    con.print(f"[dim]wrote {out}[/dim]")
    if a.json:
        print(json.dumps(result, indent=2, default=str))
    return 0
