"""The dask executor on a real LocalCluster bound to 127.0.0.1: a worker killed in the middle
of a cell, the cell rerun elsewhere, the results complete and equal to a local run's."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from study_support import MEASURES, write_study

from qllama.study import Options, load_study, run
from qllama.study.cells import product

pytest.importorskip("distributed")

VOLATILE = ("seconds", "environment")


def numbers(results: Path) -> dict[str, dict]:
    out = {}
    for js in (results / "cells").glob("*.json"):
        doc = json.loads(js.read_text())
        out[doc["cell"]] = {k: v for k, v in doc.items() if k not in VOLATILE}
    return out


def kill_when_held(folder: Path, killed: list[int], stop: threading.Event) -> None:
    """Wait (at most two minutes) for a cell to hold, then SIGKILL the worker holding it."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not stop.is_set():
        held = list(folder.glob("held-*"))
        if held:
            pid = int(held[0].name.split("-")[1])
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The tiny study (with a measure that can hold a cell), run here, and its folder."""
    folder = tmp_path_factory.mktemp("dask")
    mp = pytest.MonkeyPatch()
    mp.setenv("QLLAMA_CACHE", str(folder / "cache"))
    (folder / "hold").mkdir()
    hold = folder / "hold"
    measures = MEASURES + f', {{name = "study_support:hold_once", options = {{folder = "{hold}"}}}}'
    study = load_study(write_study(folder, measures=measures))
    assert run(study, Options(results=folder / "local", executor="local")) == 0
    mp.undo()
    return folder, study


def test_a_worker_killed_mid_cell_loses_nothing(local_run, monkeypatch):
    tmp_path, study = local_run
    monkeypatch.setenv("QLLAMA_CACHE", str(tmp_path / "cache"))
    hold, local = tmp_path / "hold", tmp_path / "local"

    (hold / "armed").write_text("")
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=kill_when_held, args=(hold, killed, stop))
    killer.start()
    remote = tmp_path / "dask"
    try:
        code = run(study, Options(results=remote, executor="dask", workers=2))
    finally:
        stop.set()
        killer.join()
    assert code == 0
    assert len(killed) == 1 and killed[0] != os.getpid()  # a worker died in the middle of a cell
    assert not (hold / "armed").exists()
    # every cell is there, once, with the numbers of the local run
    got = numbers(remote)
    assert sorted(got) == sorted(c.id for c in product(study))
    assert got == numbers(local)
    # nothing half-written: every result has both its files, and no temporary file is left
    names = {p.name for p in (remote / "cells").iterdir()}
    assert all(n.endswith((".json", ".npz")) for n in names)
    assert {n[:-5] for n in names if n.endswith(".json")} == {
        n[:-4] for n in names if n.endswith(".npz")
    }


def test_a_cluster_at_an_address_gets_the_references_sent(local_run, monkeypatch):
    """Workers of a scheduler given by address may not see the driver's files: the references
    travel through the cluster, and the tasks declare their CPU and memory."""
    from distributed import LocalCluster

    tmp_path, study = local_run
    monkeypatch.setenv("QLLAMA_CACHE", str(tmp_path / "cache"))
    with LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        host="127.0.0.1",
        dashboard_address=":0",
        resources={"CPU": 1, "MEM": 4096},
    ) as cluster:
        remote = tmp_path / "address"
        options = Options(results=remote, executor="dask", scheduler=cluster.scheduler_address)
        assert run(study, options) == 0
    assert numbers(remote) == numbers(tmp_path / "local")
