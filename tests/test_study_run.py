"""Running a study end to end on a tiny synthetic model: the cache and its keys, resuming,
the executors agreeing, draws in their own environment, the report and the findings."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from study_support import write_study
from test_architectures import FAMILIES

from qllama.study import Check, FindingSpec, Options, StudyError, View, load_study, run
from qllama.study.cache import CellCache
from qllama.study.cells import product
from qllama.study.declaration import with_prompts
from qllama.study.worker import environment

DRAW = """
[[draw]]
name = "haswell"
settings = ["cpu"]
variants = ["Q8_0"]
env = {OPENBLAS_CORETYPE = "Haswell"}
"""

VOLATILE = ("seconds", "environment")  # how long a cell took, and where: not its numbers


def numbers(results: Path) -> dict[str, Any]:
    """Every cached cell's numbers by cell id, without what may differ between runs."""
    out = {}
    for js in sorted((results / "cells").glob("*.json")):
        doc = json.loads(js.read_text())
        out[doc["cell"]] = {k: v for k, v in doc.items() if k not in VOLATILE}
    return out


def arrays(results: Path) -> dict[str, dict[str, np.ndarray]]:
    cache = CellCache(results)
    out = {}
    for js in (results / "cells").glob("*.json"):
        r = cache.load(js.stem)
        assert r is not None
        out[r.numbers["cell"]] = r.arrays
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("qllama-cache")


@pytest.fixture(autouse=True)
def _cache(cache_dir, monkeypatch):
    monkeypatch.setenv("QLLAMA_CACHE", str(cache_dir))  # the variants the studies build


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, cache_dir):
    """The tiny study with a draw, run once here, one cell after another."""
    mp = pytest.MonkeyPatch()
    mp.setenv("QLLAMA_CACHE", str(cache_dir))
    folder = tmp_path_factory.mktemp("study")
    study = load_study(write_study(folder, extra=DRAW))
    code = run(study, Options(results=folder / "results", docs=folder / "docs", executor="local"))
    mp.undo()
    return folder, study, code


def test_every_cell_runs_and_the_report_is_written(local_run):
    folder, study, code = local_run
    assert code == 0
    got = numbers(folder / "results")
    assert sorted(got) == sorted(c.id for c in product(study))
    c = got["raw/Q8_0-cpu"]
    assert c["measures"]["teacher_forcing"]["steps"] == 6
    assert 0 < c["measures"]["last_position"]["max_abs"] < 1
    # teacher forcing's first step is the last position, computed by its own prefill
    tf = c["measures"]["teacher_forcing"]
    assert tf["step0_max_abs"] == c["measures"]["last_position"]["max_abs"]
    doc = json.loads((folder / "docs" / "results.json").read_text())
    assert set(doc["prompts"]) == {"raw", "chat"}
    assert set(doc["prompts"]["raw"]["draws"]["haswell"]) == {"Q8_0-cpu"}
    assert doc["prompts"]["raw"]["compare"]["Q8_0-cpu vs Q8_0-dequantize-all"]["steps"] == 6
    md = (folder / "docs" / "results.md").read_text()
    assert "## Prompt `raw`" in md and "## Summary across prompts" in md
    # each setting with its options, as the declaration writes them (no Python reprs)
    assert "**dequantize-all** = `numpy` with `dequantize_all = true`" in md and "{'" not in md
    assert (folder / "docs" / "plots" / "raw-max_abs.png").stat().st_size > 1000


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_a_mixture_of_experts_study_runs_unchanged(tmp_path, name):
    """The tiny declaration on a MoE file: its Q8_0 variant quantized from the F32 file
    (experts slab by slab), every cell measured in both settings, the report written."""
    study = load_study(write_study(tmp_path, family=FAMILIES[name]))
    code = run(study, Options(results=tmp_path / "results", docs=tmp_path / "docs"))
    assert code == 0
    got = numbers(tmp_path / "results")
    assert sorted(got) == sorted(c.id for c in product(study))
    c = got["raw/Q8_0-cpu"]
    assert c["measures"]["teacher_forcing"]["steps"] == 6
    q8, f32 = (got[f"raw/{v}-cpu"]["measures"]["last_position"]["max_abs"] for v in ("Q8_0", "F32"))
    assert 0 <= f32 < 1e-3 < q8  # the random tiny mixture routes on small margins: q8 moves
    doc = json.loads((tmp_path / "docs" / "results.json").read_text())
    assert doc["prompts"]["raw"]["compare"]["Q8_0-cpu vs Q8_0-dequantize-all"]["steps"] == 6


def test_a_draw_runs_in_its_own_environment(local_run):
    folder, _, _ = local_run
    got = numbers(folder / "results")
    pools = {
        c: {p["internal_api"]: p["architecture"] for p in r["environment"]["threadpools"]}
        for c, r in ((c, json.loads(p.read_text())) for c, p in _paths(folder).items())
    }
    assert pools["raw/Q8_0-cpu~haswell"]["openblas"] == "Haswell"
    # the plain cell keeps the host's kernel, which is Haswell's itself on some AVX2 machines
    host = {p["internal_api"]: p["architecture"] for p in environment()["threadpools"]}
    assert pools["raw/Q8_0-cpu"]["openblas"] == host["openblas"]
    assert got["raw/Q8_0-cpu~haswell"]["env"] == {"OPENBLAS_CORETYPE": "Haswell"}


def _paths(folder: Path) -> dict[str, Path]:
    return {
        json.loads(p.read_text())["cell"]: p for p in (folder / "results" / "cells").glob("*.json")
    }


def test_a_rerun_computes_nothing_and_a_changed_setting_only_its_cells(local_run, tmp_path):
    folder, study, _ = local_run
    results = tmp_path / "results"
    shutil.copytree(folder / "results", results)
    before = {p.name: p.stat().st_mtime_ns for p in (results / "cells").iterdir()}
    assert run(study, Options(results=results, executor="local")) == 0
    assert {p.name: p.stat().st_mtime_ns for p in (results / "cells").iterdir()} == before

    # another activation rounding for the cpu setting: its cells (and its draw's) rerun
    settings = tuple(
        replace(s, options={"activation_rounding": "simd"}) if s.name == "cpu" else s
        for s in study.settings
    )
    changed = replace(study, settings=settings)
    assert run(changed, Options(results=results, executor="local")) == 0
    new = {p.name for p in (results / "cells").iterdir()} - set(before)
    cells = {
        json.loads((results / "cells" / n).read_text())["cell"] for n in new if n.endswith(".json")
    }
    assert cells == {c.id for c in product(study) if c.setting == "cpu"}


def test_an_interrupted_sweep_resumes_where_it_stopped(local_run, tmp_path):
    folder, study, _ = local_run
    results = tmp_path / "results"
    assert run(study, Options(results=results, executor="local", patterns=("raw/*",))) == 0
    first = numbers(results)
    assert sorted(first) == sorted(c.id for c in product(study) if c.prompt == "raw")
    assert not (tmp_path / "docs").exists()  # the report waits for every cell
    assert run(study, Options(results=results, docs=tmp_path / "docs", executor="local")) == 0
    assert numbers(results) == numbers(folder / "results")


def test_the_process_executor_gives_the_local_numbers_bit_for_bit(local_run, tmp_path):
    folder, study, _ = local_run
    results = tmp_path / "results"
    shutil.copytree(folder / "results" / "references", results / "references")
    assert run(study, Options(results=results, executor="process", workers=2)) == 0
    assert numbers(results) == numbers(folder / "results")
    a, b = arrays(results), arrays(folder / "results")
    for cell, arrs in a.items():
        for k, v in arrs.items():
            np.testing.assert_array_equal(v, b[cell][k], err_msg=f"{cell} {k}")


def test_report_only_rebuilds_the_report_from_the_cache(local_run, tmp_path):
    folder, study, _ = local_run
    docs = tmp_path / "docs"
    assert run(study, Options(results=folder / "results", docs=docs, report_only=True)) == 0
    old = json.loads((folder / "docs" / "results.json").read_text())
    new = json.loads((docs / "results.json").read_text())
    assert new["prompts"] == old["prompts"]
    with pytest.raises(StudyError, match="not cached"):
        run(study, Options(results=tmp_path / "empty", report_only=True))


# --- findings ----------------------------------------------------------------------------------


def q8_cpu_error_below(bound: float) -> Any:
    def finding(view: View) -> list[Check]:
        c = view.cell("Q8_0", "cpu")
        assert c is not None
        v = c.teacher_forcing.median_max_abs
        return [Check("Q8_0-cpu", "median max|Δ|", v, f"< {bound}", v < bound)]

    return finding


def gpu_flips_to_test(view: View) -> list[Check]:
    """A check about a setting this study does not have: nothing to test, not a pass."""
    c = view.cell("Q8_0", "gpu")
    flips = None if c is None else len(c.teacher_forcing.flips)
    return [Check("Q8_0-gpu", "flips", flips, "> 0", None if flips is None else flips > 0)]


def test_findings_hold_against_every_draw_and_fail_the_study(local_run, capsys):
    folder, study, _ = local_run
    findings = (
        FindingSpec("holds", q8_cpu_error_below(10.0)),
        FindingSpec("seen", q8_cpu_error_below(0.0), asserted=False),
        FindingSpec("empty", gpu_flips_to_test),
    )
    options = Options(results=folder / "results", report_only=True)
    assert run(replace(study, findings=findings), options) == 0
    out = capsys.readouterr().out
    assert "PASS holds: holds on 2/2 prompts" in out
    assert "SEEN seen: holds on 0/2 prompts; fails on raw, chat" in out
    assert "N/A empty: holds on 0/2 prompts; nothing to test on raw, chat" in out

    assert run(replace(study, findings=(FindingSpec("x", q8_cpu_error_below(0.0)),)), options) == 1


def test_a_run_on_one_prompt_checks_its_findings_and_says_what_it_left_out(
    local_run, tmp_path, capsys
):
    from qllama.cli import main

    folder, study, _ = local_run
    results = tmp_path / "results"
    shutil.copytree(folder / "results", results)
    before = {p.name: p.stat().st_mtime_ns for p in (results / "cells").iterdir()}
    args = ["study", "run", str(folder / "tiny.toml"), "--executor", "local"]
    docs = tmp_path / "docs"
    assert main([*args, "--results", str(results), "--docs", str(docs), "--prompt", "chat"]) == 0
    # the full run's cells of that prompt are this run's: nothing is computed again
    assert {p.name: p.stat().st_mtime_ns for p in (results / "cells").iterdir()} == before
    doc = json.loads((docs / "results.json").read_text())
    assert set(doc["prompts"]) == {"chat"} and doc["study"]["skipped_prompts"] == ["raw"]
    md = (docs / "results.md").read_text()
    assert "**Not run here** (`qllama study run --prompt`): the prompts `raw`" in md
    assert "## Prompt `raw`" not in md
    # the findings are checked on the prompts run, and fail the run there
    capsys.readouterr()
    options = Options(results=results, report_only=True)
    held = replace(study, findings=(FindingSpec("holds", q8_cpu_error_below(10.0)),))
    assert run(with_prompts(held, ["chat"]), options) == 0
    assert "PASS holds: holds on 1/1 prompts" in capsys.readouterr().out
    failing = replace(study, findings=(FindingSpec("x", q8_cpu_error_below(0.0)),))
    assert run(with_prompts(failing, ["chat"]), options) == 1


def test_a_check_holds_only_if_it_holds_in_every_draw():
    from qllama.study.findings import combine

    def c(v: float, ok: bool | None) -> list[Check]:
        return [Check("Q8_0-cpu", "m", v, "< 1", ok)]

    (both,) = combine({"": c(0.5, True), "a": c(0.7, True)})
    assert both.ok and both.band == (0.5, 0.7) and both.text() == "0.5 [0.5, 0.7]"
    (one,) = combine({"": c(0.5, True), "a": c(1.5, False), "b": c(0.6, True)})
    assert one.ok is False and one.failing == ["a"] and one.draws == {"a": "1.5", "b": "0.6"}
    (none,) = combine({"": c(0.0, None), "a": c(0.0, None)})
    assert none.ok is None  # nothing to test in any draw: not a pass
    (some,) = combine({"": c(0.0, None), "a": c(0.2, True)})
    assert some.ok is True


def test_the_cli_lists_cells_runs_and_refuses_bad_studies(local_run, tmp_path, capsys):
    from qllama.cli import main

    folder, _, _ = local_run
    toml = str(folder / "tiny.toml")
    assert main(["study", "cells", toml, "--cells", "chat/*~*"]) == 0
    assert capsys.readouterr().out.split() == ["chat/Q8_0-cpu~haswell"]
    args = ["study", "run", toml, "--results", str(folder / "results"), "--report-only"]
    assert main([*args, "--docs", str(tmp_path / "docs")]) == 0
    assert (tmp_path / "docs" / "results.md").exists()
    (tmp_path / "bad.toml").write_text('name = "x"\nmodel = "m.gguf"\ncolour = 1\n')
    assert main(["study", "run", str(tmp_path / "bad.toml")]) == 1
    assert "qllama study: error: " in (err := capsys.readouterr().err)
    assert "bad.toml:3: unknown top-level key 'colour'" in err


def test_the_process_executors_workers_exit_when_the_driver_is_killed(tmp_path):
    """A driver killed outright (no interrupt to pass on) leaves no worker computing."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "worker.pid"
    driver = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from study_support import hold_pid\n"
        "from qllama.study.executors import Job, Process\n"
        "list(Process(1).run([Job(hold_pid, (sys.argv[2],), 'k', 'hold')]))\n"
    )
    tests = str(Path(__file__).parent)
    proc = subprocess.Popen([sys.executable, "-c", driver, tests, str(pid_file)])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "no worker started"
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15  # the worker polls its parent every second
        while True:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                break
            try:  # a zombie of ours? reap it (it is the driver's child, now init's)
                os.waitpid(worker, os.WNOHANG)
            except ChildProcessError:
                pass
            assert time.monotonic() < deadline, "the worker outlived its driver"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_summary_plot_says_what_its_bars_are():
    from qllama.study.plots import summary_title

    assert "no draws: no bands" in summary_title([]) and "bars" not in summary_title([])
    assert "the band over the draws avx2, sse" in summary_title(["avx2", "sse"])
