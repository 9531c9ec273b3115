"""``nox -s experiments``: run the matrix, write the report, check the findings.

    python -m experiments.run                 # every cell, then the report and the findings
    python -m experiments.run --cell Q8_0-cpu # one cell (to spread a sweep over machines)
    python -m experiments.run --report-only   # rebuild docs/ from the cached cells

The reference must exist (``nox -s reference``, which ``nox -s experiments`` runs first).
Exits non-zero, naming cell, metric, value and bound, if a finding does not hold.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments import findings, report
from experiments.matrix import CELLS, Cell, run_cell
from qllama.compare import Reference

RESULTS = Path("results")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cell", action="append", type=Cell.parse, help="run only this cell (repeatable)"
    )
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--docs", type=Path, default=Path("docs"), help="where results.md goes")
    p.add_argument("--force", action="store_true", help="rerun cells even if cached")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)

    ref_path = args.results / "reference.npz"
    if not ref_path.exists():
        print(f"no reference at {ref_path}: run `nox -s reference` first", file=sys.stderr)
        return 2
    ref = Reference.load(str(ref_path))
    cells = args.cell or CELLS
    if not args.report_only:
        for i, cell in enumerate(cells):
            print(f"== cell {i + 1}/{len(cells)}: {cell.id}", flush=True)
            run_cell(cell, ref, args.results, force=args.force)
    if args.cell:
        return 0  # a partial sweep: the report waits for all cells
    data = report.collect(ref, args.results)
    checks = findings.check(data)
    report.write(data, checks, args.docs)
    failed = [c for c in checks if not c.ok]
    for c in checks:
        print(("PASS " if c.ok else "FAIL ") + c.line())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
