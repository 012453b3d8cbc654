"""Start-up time of the command line: `hf-lookaround --help`, `<command> --help`, `import hf_lookaround`.

Each case runs in a fresh subprocess (as a user types it), several times; the median wall time is
reported, with the minimum and maximum. Also reported: whether the case imported torch/transformers.

    python benchmarks/cli_startup.py                 # every command, 7 runs each
    python benchmarks/cli_startup.py --runs 3 --json startup.json

The console script `hf-lookaround` is used when it is on PATH next to this Python; otherwise
`python -m hf_lookaround.cli` (the same code, plus Python's -m start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHECK = ("import sys, runpy; sys.argv = ['hf-lookaround', *{args!r}]\n"
         "try:\n    runpy.run_module('hf_lookaround.cli', run_name='__main__')\n"
         "except SystemExit:\n    pass\n"
         "print('HEAVY', sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)\n")


def entry_point() -> list[str]:
    script = Path(sys.executable).with_name("hf-lookaround")
    if script.exists():
        return [str(script)]
    found = shutil.which("hf-lookaround")
    return [found] if found else [sys.executable, "-m", "hf_lookaround.cli"]


def time_case(command: list[str], runs: int) -> dict:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs": runs}


def heavy_imports(args: list[str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", CHECK.format(args=args)], capture_output=True, text=True)
    line = [l for l in done.stderr.splitlines() if l.startswith("HEAVY")]
    return eval(line[-1].split(" ", 1)[1]) if line else ["?"]  # noqa: S307  (our own printed list)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hf_lookaround.cli import COMMANDS

    exe = entry_point()
    cases = {"import hf_lookaround": ([sys.executable, "-c", "import hf_lookaround"], None),
             "python -c pass (interpreter alone)": ([sys.executable, "-c", "pass"], None),
             "hf-lookaround --help": (exe + ["--help"], ["--help"])}
    for name in COMMANDS:
        cases[f"hf-lookaround {name} --help"] = (exe + [name, "--help"], [name, "--help"])
    rows = []
    print(f"{'case':<42} {'median s':>9} {'min':>6} {'max':>6}  imports torch/transformers")
    for label, (command, cli_args) in cases.items():
        result = time_case(command, args.runs)
        result["heavy_imports"] = heavy_imports(cli_args) if cli_args else None
        rows.append({"case": label, **result})
        heavy = "–" if result["heavy_imports"] is None else (", ".join(result["heavy_imports"]) or "no")
        print(f"{label:<42} {result['median_s']:>9.3f} {result['min_s']:>6.3f} {result['max_s']:>6.3f}  {heavy}",
              flush=True)
    info = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "load_average": os.getloadavg(),
            "entry_point": " ".join(exe)}
    print(f"\n{info}")
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
