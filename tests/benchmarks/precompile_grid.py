"""The giant-models grid: will T5.1.1-XXL + HyperPrompt-Global fit, and how, on a slice?

    python tests/benchmarks/precompile_grid.py [--slices v4-32,v5e-64]
        [--remats full,minimal,none] [--dims 2,1] [--models 16,8,...] [--timeout 480]
        [--stop_at 2026-11-25T00:20] [--no_skip] [--known grid.jsonl]

For every slice x data/model split x remat policy x parameter_partitioning_dims, one
`ktx precompile` command (its own process; the compile in that command's own child
process, `--timeout` seconds at most) of the run the docs' command line describes:
models/t5_1_1_xxl.gin + runs/train.gin + conditioning/hyperprompt_global.gin, 8 tasks,
batch 128, lengths 512/128, Adafactor, bfloat16 activations, SCAN_LAYERS=True,
MIXTURE_OR_TASK_NAME synthetic_quickstart. The model axis takes each divisor of the
slice's device count that also divides the 64 heads.

Each configuration prints one JSON line: its command, `status` ("fits", "does not fit",
"crashed", "timed out", "error", "does not fit (implied by <config>)", or "not run
(--stop_at)"), the per-device memory (GiB), XLA's figure when it refused the compile,
FLOPs per step and device, the predicted step time at the chip's peak, and the seconds
(`compile_seconds`: tracing + lowering + XLA in the child; `wall_seconds`: the whole
command). libtpu's compiler crashed (SIGSEGV, a fiber's stack overflowing) on some
configurations before `ktx precompile` raised its fiber stacks (docs/scale.md); a crashed
configuration is still compiled again, `--retries` times (the crashes are kept in
`earlier_crashes`). The last line is a JSON summary (every configuration's status; per slice the
fitting configurations and the one with the least memory).

Memory is taken as monotone in the remat policy (none >= minimal >= full), so unless
`--no_skip` a configuration is not compiled when one of the same slice, split and
`parameter_partitioning_dims` with a remat at most as hungry did not fit: it is recorded
as "does not fit (implied by <that config>)". Dims are not ordered: on v5e-64 2 x 32 and
1 x 64 dims 1 needed less memory than dims 2 (docs/scale.md). The run tries remat full /
dims 2 on every split first (the splits of the slices interleaved), then the hungrier
pairs, so that a run stopped by `--stop_at` has tried every split once.

`--known FILE` takes configurations measured before: a JSON-lines file of records in this
script's output format (a run's output will do: its summary line, blank lines and "not run
(--stop_at)" records are skipped; of two records of one configuration the later counts).
Those configurations are not compiled or printed again, but they count for the "implied
by" rule and in the summary line, which covers them and this run's. A malformed line is an
error naming the file and the line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time

# Slice name (Cloud's) -> (JAX topology, devices JAX exposes). A v4 chip is two devices
# (16 GiB each), a v5e chip one.
SLICES = {
    "v4-32": ("v4:2x2x4", 32),
    "v4-128": ("v4:4x4x4", 128),
    "v5e-64": ("v5e:8x8", 64),
    "v5e-256": ("v5e:16x16", 256),
}
ACCELERATOR_TYPE = {"v4-32": "v4-32", "v4-128": "v4-128", "v5e-64": "v5litepod-64",
                    "v5e-256": "v5litepod-256"}
NUM_HEADS = 64  # T5.1.1-XXL
REMAT_RANK = {"full": 0, "minimal": 1, "none": 2}  # memory: full <= minimal <= none
DIMS_RANK = {2: 0, 1: 1}  # the order dims are tried in (2 first)
GIN_FILES = ("models/t5_1_1_xxl.gin", "runs/train.gin", "conditioning/hyperprompt_global.gin")
GIB = 2.0 ** 30


def command(topology: str, model: int, remat: str, dims: int, timeout: float) -> list[str]:
    """The `ktx precompile` command line of one configuration (as docs/scale.md gives it)."""
    return [
        sys.executable, "-m", "ktx", "precompile", f"--topology={topology}",
        *(f"--gin_file={f}" for f in GIN_FILES),
        "--gin.NUM_TASKS=8", "--gin.TASK_FEATURE_LENGTHS={'inputs': 512, 'targets': 128}",
        "--gin.BATCH_SIZE=128", f"--gin.NUM_PARTITIONS={model}", "--gin.SCAN_LAYERS=True",
        "--gin.ACTIVATION_DTYPE='bfloat16'", f"--gin.REMAT_POLICY='{remat}'",
        f"--gin.train_script.train.parameter_partitioning_dims={dims}",
        "--gin.MIXTURE_OR_TASK_NAME='synthetic_quickstart'", f"--timeout={timeout:g}",
    ]


def parse_report(text: str) -> dict:
    """The figures of `PrecompileReport.format()`'s text (GiB, FLOPs, ms, s)."""
    out = {}
    patterns = {
        "argument_gib": r"arguments\s+([\d.]+) GiB",
        "output_gib": r"outputs\s+([\d.]+) GiB",
        "alias_gib": r"\(([\d.]+) GiB aliased",
        "temp_gib": r"temporaries\s+([\d.]+) GiB",
        "total_gib": r"total\s+([\d.]+) GiB",
        "live_peak_gib": r"live peak\s+([\d.]+) GiB",
        "hbm_gib": r"of ([\d.]+) GiB HBM",
        "flops_per_step": r"FLOPs/step\s+([\d.eE+-]+) per device",
        "predicted_step_ms": r"at peak ([\d.]+) ms/step",
        "compile_seconds": r"compiled in ([\d.]+) s",
    }
    for key, pattern in patterns.items():
        m = re.search(pattern, text)
        if m:
            out[key] = float(m.group(1))
    mesh = re.search(r"mesh (data=\d+ x model=\d+)", text)
    if mesh:
        out["mesh"] = mesh.group(1)
    return out


def xla_figure(err: str) -> str | None:
    """XLA's required vs available memory from a does-not-fit line, e.g. "Used 20.55G of
    15.25G hbm. Exceeded hbm capacity by 5.30G."."""
    line = next((ln for ln in err.splitlines() if ln.startswith("ktx precompile:")), "")
    m = re.search(r"(Used [\d.]+[KMGT]? of [\d.]+[KMGT]? \w+\.(?: Exceeded[^.]*\.[\d]*[KMGT]?\.?)?)", line)
    if m:
        return m.group(1).strip()
    m = re.search(r"does not fit: (.*)", line)
    return m.group(1).strip() if m else (line or None)


def run_one(slice_name: str, model: int, remat: str, dims: int, timeout: float) -> dict:
    topology, devices = SLICES[slice_name]
    cmd = command(topology, model, remat, dims, timeout)
    env = dict(os.environ, TPU_ACCELERATOR_TYPE=ACCELERATOR_TYPE[slice_name])
    record = dict(slice=slice_name, topology=topology, data=devices // model, model=model,
                  remat=remat, dims=dims,
                  command=f"TPU_ACCELERATOR_TYPE={ACCELERATOR_TYPE[slice_name]} ktx "
                          + shlex.join(cmd[3:]),
                  started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout + 120)
    except subprocess.TimeoutExpired:
        record.update(status="timed out", wall_seconds=round(time.perf_counter() - start, 1),
                      detail=f"the command ran over {timeout + 120:g} s")
        return record
    record["wall_seconds"] = round(time.perf_counter() - start, 1)
    record["exit"] = proc.returncode
    record.update(parse_report(proc.stdout))
    last = next((ln for ln in reversed(proc.stderr.splitlines()) if ln.startswith("ktx")), "")
    if proc.returncode == 0 and "  fits" in proc.stdout:
        record["status"] = "fits"
    elif proc.returncode == 3:
        record["status"] = "does not fit"
        if "total_gib" not in record:
            record["xla"] = xla_figure(proc.stderr)
    elif proc.returncode == 4:
        record["status"] = "timed out" if "time limit" in last else "crashed"
        record["detail"] = last
        pc = re.search(r"PC: @\s+\S+\s+\(unknown\)\s+(\S+)", proc.stderr)
        if "STACK OVERFLOW" in proc.stderr or pc:
            record["compiler"] = ("stack overflow " if "STACK OVERFLOW" in proc.stderr else "") + (
                f"in {pc.group(1)}" if pc else "")
    else:
        record["status"] = "error"
        record["detail"] = last or proc.stderr[-2000:]
    return record


def implied_by(config: tuple, done: dict) -> str | None:
    """A measured "does not fit" configuration of the same slice, split and dims with a
    remat policy at most as hungry as `config`'s, named, or None."""
    slice_name, model, remat, dims = config
    for (s, m, r, d), record in done.items():
        if (s, m) != (slice_name, model) or (r, d) == (remat, dims) or record["status"] != "does not fit":
            continue
        if d == dims and REMAT_RANK[r] <= REMAT_RANK[remat]:
            return f"{s} {SLICES[s][1] // m}x{m} remat {r} dims {d}"
    return None


def load_known(path: str) -> dict[tuple, dict]:
    """The records of `path` (JSON lines, this script's output format) by configuration
    (slice, model, remat, dims); ValueError, naming the file and line, on a malformed one."""
    known = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}, line {n}"
            try:
                record = json.loads(line.strip())
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: not a JSON object")
            if "summary" in record:
                continue
            s, m, r, d, status = (record.get(k) for k in ("slice", "model", "remat", "dims",
                                                          "status"))
            if not (isinstance(s, str) and s in SLICES):
                raise ValueError(f"{where}: slice={s!r}; accepted: {', '.join(sorted(SLICES))}")
            if type(m) is not int or m < 1 or SLICES[s][1] % m:
                raise ValueError(f"{where}: model={m!r}; accepted: a divisor of {s}'s "
                                 f"{SLICES[s][1]} devices")
            if not (isinstance(r, str) and r in REMAT_RANK):
                raise ValueError(f"{where}: remat={r!r}; accepted: {', '.join(REMAT_RANK)}")
            if type(d) is not int or d not in DIMS_RANK:
                raise ValueError(f"{where}: dims={d!r}; accepted: 1, 2")
            if not isinstance(status, str) or not status:
                raise ValueError(f"{where}: status={status!r}; accepted: a status this script prints")
            for key, value in (("topology", SLICES[s][0]), ("data", SLICES[s][1] // m)):
                if record.get(key, value) != value:
                    raise ValueError(f"{where}: {key}={record[key]!r}, but {s} at model={m} "
                                     f"has {key}={value!r}")
            if status != "not run (--stop_at)":
                known[(s, m, r, d)] = record
    return known


def plan(slices, models_order, remats, dims_list) -> list[tuple]:
    """Configurations in run order: the least memory-hungry remat/dims pair (full, dims 2)
    on every split of every slice first (the splits of the slices interleaved), then the
    next hungrier pairs, so that a run cut short by --stop_at has tried every split."""
    per_slice = []
    for s in slices:
        devices = SLICES[s][1]
        splits = [m for m in models_order if devices % m == 0 and NUM_HEADS % m == 0]
        per_slice.append([(s, m) for m in splits])
    order = []
    for i in range(max(len(p) for p in per_slice)):
        for p in per_slice:
            if i < len(p):
                order.append(p[i])
    levels = sorted(((r, d) for d in dims_list for r in remats),
                    key=lambda rd: (REMAT_RANK[rd[0]] + DIMS_RANK[rd[1]], DIMS_RANK[rd[1]]))
    return [(s, m, r, d) for r, d in levels for s, m in order]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slices", default="v4-32,v5e-64", help=f"of {sorted(SLICES)}")
    parser.add_argument("--remats", default="full,minimal,none")
    parser.add_argument("--dims", default="2,1")
    parser.add_argument("--models", default="16,8,32,4,64,2,1",
                        help="model-axis sizes, in the order the splits are tried")
    parser.add_argument("--timeout", type=float, default=480.0, help="seconds per compile")
    parser.add_argument("--stop_at", default=None,
                        help="UTC time (ISO, e.g. 2026-11-25T00:20) after which no compile starts")
    parser.add_argument("--retries", type=int, default=1,
                        help="compiles again a configuration whose compiler crashed, this many times")
    parser.add_argument("--no_skip", action="store_true",
                        help="compile configurations whose less hungry sibling did not fit too")
    parser.add_argument("--known", default=None,
                        help="JSON lines of configurations measured before (this script's "
                             "output): not compiled again, counted for skips and the summary")
    args = parser.parse_args(argv)
    slices = [s.strip() for s in args.slices.split(",") if s.strip()]
    for s in slices:
        if s not in SLICES:
            parser.error(f"--slices: {s!r}; accepted: {', '.join(sorted(SLICES))}")
    remats = [r.strip() for r in args.remats.split(",") if r.strip()]
    for r in remats:
        if r not in REMAT_RANK:
            parser.error(f"--remats: {r!r}; accepted: {', '.join(REMAT_RANK)}")
    dims_list = [int(d) for d in args.dims.split(",") if d.strip()]
    for d in dims_list:
        if d not in DIMS_RANK:
            parser.error(f"--dims: {d}; accepted: 1, 2")
    models_order = [int(m) for m in args.models.split(",") if m.strip()]
    stop_at = None
    if args.stop_at:
        stop_at = datetime.datetime.fromisoformat(args.stop_at)
        if stop_at.tzinfo is None:
            stop_at = stop_at.replace(tzinfo=datetime.timezone.utc)
    if not args.timeout > 0:
        parser.error(f"--timeout={args.timeout:g}; accepted: seconds > 0")

    done: dict[tuple, dict] = {}
    if args.known:
        try:
            done.update(load_known(args.known))
        except (OSError, ValueError) as e:
            parser.error(f"--known: {e}")
    started = time.perf_counter()
    for config in plan(slices, models_order, remats, dims_list):
        if config in done:
            continue  # measured before (--known)
        s, m, r, d = config
        base = dict(slice=s, topology=SLICES[s][0], data=SLICES[s][1] // m, model=m, remat=r, dims=d)
        reason = None if args.no_skip else implied_by(config, done)
        if reason:
            record = dict(base, status=f"does not fit (implied by {reason})")
        elif stop_at is not None and datetime.datetime.now(datetime.timezone.utc) >= stop_at:
            record = dict(base, status="not run (--stop_at)")
        else:
            record = run_one(s, m, r, d, args.timeout)
            crashes = []
            while record["status"] == "crashed" and len(crashes) < args.retries:
                crashes.append(record.get("detail"))
                record = run_one(s, m, r, d, args.timeout)
            if crashes:
                record["earlier_crashes"] = crashes
        done[config] = record
        print(json.dumps(record), flush=True)

    summary = {"seconds": round(time.perf_counter() - started, 1), "configurations": len(done),
               "status": {}, "fits": {}, "least_memory": {}}
    for (s, m, r, d), record in done.items():
        key = f"{s} {SLICES[s][1] // m}x{m} remat {r} dims {d}"
        summary["status"][key] = record["status"]
        if record["status"] == "fits":
            summary["fits"].setdefault(s, []).append(key)
            best = summary["least_memory"].get(s)
            if best is None or record.get("total_gib", 1e9) < best["total_gib"]:
                summary["least_memory"][s] = {"config": key, "total_gib": record.get("total_gib"),
                                              "command": record.get("command")}
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
