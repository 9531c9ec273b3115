"""Where cells run: in this process, in local processes, or as tasks on a Dask cluster.

An executor takes jobs (a function, its arguments, a key, the resources it needs) and yields
each job with its result (or the exception it raised) as it completes, in any order. The
local ones need nothing beyond the standard library; ``dask`` needs the ``distributed``
package (``pip install 'qllama[dask]'``).

* ``local``: one job after another, here.
* ``process``: a pool of fresh processes (``spawn``), ``workers`` at a time.
* ``dask``: one task per job on a ``distributed`` cluster: the scheduler at ``address``, or a
  ``LocalCluster`` of ``workers`` single-threaded processes bound to 127.0.0.1. Each task
  declares its resources (``CPU=1`` and its memory in MiB as ``MEM``) where the workers
  advertise them; a worker that dies mid-task has its task rerun elsewhere by the scheduler
  (up to ``distributed.scheduler.allowed-failures`` times).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from qllama.study.declaration import StudyError

EXECUTORS = ("local", "process", "dask")


@dataclass(frozen=True)
class Job:
    """One call ``fn(*args, shipped)`` to run somewhere.

    ``ship`` is ``(name, read)``: data the workers may not reach on their own (a reference's
    bytes), which the ``dask`` executor reads once and sends to a remote cluster; ``shipped``
    is then that data, and None otherwise (the worker reads the driver's path).
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    key: str
    label: str
    memory_mb: int = 2048
    ship: tuple[str, Callable[[], Any]] | None = None


@dataclass
class Outcome:
    job: Job
    result: Any = None
    error: BaseException | None = None


class Local:
    """Every job here, one after another."""

    name = "local"

    def __init__(self) -> None:
        self.slots = 1

    def run(self, jobs: Sequence[Job]) -> Iterator[Outcome]:
        for job in jobs:
            try:
                yield Outcome(job, job.fn(*job.args, None))
            except Exception as e:
                yield Outcome(job, error=e)

    def close(self) -> None:
        pass


class Process:
    """A pool of ``workers`` fresh processes (spawned, so no state leaks from the driver)."""

    name = "process"

    def __init__(self, workers: int | None = None) -> None:
        self.slots = max(1, workers or os.cpu_count() or 1)
        self._pool: Any = None

    def run(self, jobs: Sequence[Job]) -> Iterator[Outcome]:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        from qllama.study.worker import watch_parent

        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")
            # each worker exits when the driver dies (killed, not interrupted): no orphan
            # goes on computing cells whose results nobody will save
            self._pool = ProcessPoolExecutor(
                max_workers=self.slots, mp_context=ctx, initializer=watch_parent
            )
        futures = {}
        for job in jobs:
            futures[self._pool.submit(job.fn, *job.args, None)] = job
        for f in as_completed(futures):
            e = f.exception()
            yield Outcome(futures[f], error=e) if e else Outcome(futures[f], f.result())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None


class Dask:
    """One task per job on a ``distributed`` cluster (an address, or a local one)."""

    name = "dask"

    def __init__(
        self, address: str | None = None, workers: int | None = None, memory_mb: int = 4096
    ) -> None:
        if importlib.util.find_spec("distributed") is None:
            raise StudyError(
                "the dask executor needs the distributed package: pip install 'qllama[dask]'"
            )
        from distributed import Client, LocalCluster

        self._cluster = None
        if address is None:
            n = max(1, workers or os.cpu_count() or 1)
            self._cluster = LocalCluster(
                n_workers=n,
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address=":0",
                memory_limit=f"{memory_mb}MiB",
                resources={"CPU": 1, "MEM": memory_mb},
            )
            self.client = Client(self._cluster)
        else:
            self.client = Client(address)
        info = self.client.scheduler_info()["workers"].values()
        self.slots = max(1, sum(w.get("nthreads", 1) for w in info))
        # declare resources only where the workers advertise them, else no task would start
        self._resources = all({"CPU", "MEM"} <= set(w.get("resources", {})) for w in info)
        self._shipped: dict[str, Any] = {}
        # workers of a local cluster read the driver's files; remote ones get them sent
        self._ship = address is not None

    def run(self, jobs: Sequence[Job]) -> Iterator[Outcome]:
        from distributed import as_completed

        futures = {}
        for job in jobs:
            shipped = None
            if job.ship is not None and self._ship:
                name, read = job.ship
                if name not in self._shipped:
                    # a task holding the data in its spec, not scattered data: if the worker
                    # that holds the result dies, the scheduler can compute it again
                    self._shipped[name] = self.client.submit(_given, read(), key=name, pure=False)
                shipped = self._shipped[name]
            resources = {"CPU": 1, "MEM": job.memory_mb} if self._resources else None
            f = self.client.submit(
                job.fn, *job.args, shipped, key=job.key, resources=resources, pure=False
            )
            futures[f.key] = (f, job)
        for f in as_completed([f for f, _ in futures.values()]):
            job = futures[f.key][1]
            try:
                yield Outcome(job, f.result())
            except Exception as e:
                yield Outcome(job, error=e)
            f.release()

    def close(self) -> None:
        self.client.close()
        if self._cluster is not None:
            self._cluster.close()


def _given(data: Any) -> Any:
    return data


def executor(
    name: str, *, workers: int | None = None, scheduler: str | None = None
) -> Local | Process | Dask:
    """The executor ``name`` (local, process or dask)."""
    if name == "local":
        return Local()
    if name == "process":
        return Process(workers)
    if name == "dask":
        return Dask(scheduler, workers)
    raise StudyError(f"unknown executor {name!r}; choose one of {', '.join(EXECUTORS)}")
