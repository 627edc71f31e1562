"""A Spark standalone cluster on loopback: a master and workers started with the pyspark
package's own launcher (``bin/spark-class``), each leading its own session as if on a machine
of its own, and drivers (``hub-ingest run --master``, ``spark-submit``) as subprocesses.

Everything the cluster writes stays under its root: the daemons' logs, the workers' work
directories (executor logs), ``conf/spark-defaults.conf`` for the drivers and their event
logs, which say which executor ran (or lost) which task of which batch. `spark_cluster`
kills every process of every session it started, however the test ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyspark

from edge_agent.protocol.monitor import Monitor
from hub_ingest.local.fleet import free_port
from tests.support.waiting import eventually

SPARK_HOME = Path(pyspark.__file__).parent
START_TIMEOUT = 90.0  # two JVMs starting on a busy two-core machine
# Variables of the test's own process that would decide for the cluster behind its back:
# a driver must find the package installed, and name its executors' Python itself.
_INHERITED = ("PYTHONPATH", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_CONF_DIR")
_BATCH = re.compile(r"^batch = (\d+)$", re.MULTILINE)
_WORKER_PORT = re.compile(r"^https?://[^/]+:(\d+)/")


def kill_session(sid: int) -> None:
    """SIGKILL every process group in session `sid`: a daemon, the executors it launched and
    their Python workers (Spark's Python daemon makes a process group of its own)."""
    groups = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getsid(int(entry.name)) == sid:
                    groups.add(os.getpgid(int(entry.name)))
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


@dataclass
class Daemon:
    """A master or worker JVM (``spark-class`` execs it: the JVM is the process started)."""

    name: str
    process: subprocess.Popen[bytes]
    webui_port: int
    log: Path

    def kill(self) -> None:
        kill_session(self.process.pid)
        self.process.wait(timeout=30)


@dataclass(frozen=True, slots=True)
class DriverRun:
    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True, slots=True)
class TaskEnd:
    """One task attempt, from a driver's event log."""

    stage: int
    index: int
    executor: str
    reason: str  # "Success", "ExecutorLostFailure", …
    launched_ms: int
    finished_ms: int


@dataclass
class AppEvents:
    """What a driver's event log says about its executors, batches and tasks."""

    executor_ports: dict[str, int] = field(default_factory=dict)  # worker web UI port
    executor_removed_ms: dict[str, int] = field(default_factory=dict)
    stage_batch: dict[int, int] = field(default_factory=dict)  # streaming batch of a stage
    tasks: list[TaskEnd] = field(default_factory=list)
    job_end_ms: list[int] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> AppEvents:
        events = cls()
        for line in path.read_text(encoding="utf-8").splitlines():
            events._add(json.loads(line))
        return events

    def _add(self, event: dict[str, Any]) -> None:
        kind = event["Event"]
        if kind == "SparkListenerExecutorAdded":
            urls = event["Executor Info"]["Log Urls"]
            port = _WORKER_PORT.match(urls["stderr"])
            assert port, f"no worker port in {urls}"
            self.executor_ports[event["Executor ID"]] = int(port[1])
        elif kind == "SparkListenerExecutorRemoved":
            self.executor_removed_ms[event["Executor ID"]] = event["Timestamp"]
        elif kind == "SparkListenerJobStart":
            described = _BATCH.search(
                (event.get("Properties") or {}).get("spark.job.description", "")
            )
            for stage in event["Stage IDs"]:
                if described:
                    self.stage_batch[stage] = int(described[1])
        elif kind == "SparkListenerTaskEnd":
            info = event["Task Info"]
            self.tasks.append(
                TaskEnd(
                    event["Stage ID"],
                    info["Index"],
                    info["Executor ID"],
                    event["Task End Reason"]["Reason"],
                    info["Launch Time"],
                    info["Finish Time"],
                )
            )
        elif kind == "SparkListenerJobEnd":
            self.job_end_ms.append(event["Completion Time"])


@dataclass
class SparkCluster:
    root: Path
    port: int
    master: Daemon
    workers: dict[str, Daemon] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    @property
    def events_dir(self) -> Path:
        return self.root / "events"

    @property
    def conf_dir(self) -> Path:
        return self.root / "conf"

    def start_worker(self, name: str, env: Mapping[str, str] | None = None) -> Daemon:
        """A worker with one core and 1 GiB for executors; `env` reaches its executors."""
        work = self.root / name
        work.mkdir(exist_ok=True)
        webui = free_port()
        args = ["--host", "127.0.0.1", "--webui-port", str(webui), "--cores", "1"]
        args += ["--memory", "1g", "--work-dir", str(work / "work"), self.url]
        worker = _start(name, "worker.Worker", args, work, webui, env=env)
        self.workers[name] = worker
        return worker

    async def state(self) -> dict[str, Any]:
        """The master's view (``/json/``): workers, applications."""
        return await Monitor(f"http://127.0.0.1:{self.master.webui_port}").get("/json/")

    async def wait_workers(self, timeout: float = START_TIMEOUT) -> None:
        """Until the master has exactly `workers` ALIVE (a killed one no longer)."""
        want = sorted(f"http://127.0.0.1:{w.webui_port}" for w in self.workers.values())

        async def registered() -> bool:
            workers = (await self.state()).get("workers", [])
            return sorted(w["webuiaddress"] for w in workers if w["state"] == "ALIVE") == want

        try:
            await eventually(registered, timeout=timeout, interval=0.5, what=f"{want} ALIVE")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log_tails()}") from None

    def log_tails(self, lines: int = 15) -> str:
        """The last lines each daemon logged, for a failure's message."""
        parts = []
        for daemon in (self.master, *self.workers.values()):
            tail = daemon.log.read_text(errors="replace").splitlines()[-lines:]
            parts.append("\n".join([f"--- {daemon.name}:", *tail]))
        return "\n".join(parts)

    def driver_env(self, **extra: str) -> dict[str, str]:
        """A driver's environment: this Spark, `conf_dir`'s defaults, nothing of ours."""
        env = {k: v for k, v in os.environ.items() if k not in _INHERITED}
        env.update(_spark_env(), SPARK_CONF_DIR=str(self.conf_dir), **extra)
        return env

    async def run_driver(
        self, argv: Sequence[str], cwd: Path, *, env: Mapping[str, str], timeout: float = 180
    ) -> DriverRun:
        """Run a driver to its end in a session of its own (killed whole afterwards)."""
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=cwd,
            env=dict(env),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        finally:
            kill_session(proc.pid)
            await proc.wait()
        assert proc.returncode is not None
        return DriverRun(proc.returncode, out.decode(), err.decode())

    def event_logs(self) -> list[Path]:
        """The drivers' event logs, oldest first (application ids sort by start)."""
        return sorted(p for p in self.events_dir.iterdir() if not p.name.endswith(".inprogress"))

    def worker_of(self, events: AppEvents, executor: str) -> str:
        port = events.executor_ports[executor]
        return next(name for name, w in self.workers.items() if w.webui_port == port)

    def close(self) -> None:
        for daemon in (*self.workers.values(), self.master):
            daemon.kill()


def _spark_env() -> dict[str, str]:
    return {
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOCAL_HOSTNAME": "127.0.0.1",
        "SPARK_DAEMON_MEMORY": "256m",
    }


def _start(
    name: str,
    main: str,
    args: Sequence[str],
    cwd: Path,
    webui: int,
    *,
    env: Mapping[str, str] | None = None,
) -> Daemon:
    log = cwd / f"{name}.log"
    environment = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    environment.update(_spark_env(), SPARK_CONF_DIR=str(cwd), **(env or {}))
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-class"), f"org.apache.spark.deploy.{main}", *args],
            cwd=cwd,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a "machine": killing its session kills what it runs
        )
    return Daemon(name, process, webui, log)


def _defaults(cluster: SparkCluster, executors: int) -> str:
    """spark-defaults.conf for the drivers: small executors, and every one of them registered
    before the first batch, so that a batch's tasks can spread over all of them."""
    settings = {
        "spark.executor.cores": "1",
        "spark.executor.memory": "512m",
        "spark.driver.memory": "768m",
        "spark.cores.max": str(executors),
        "spark.scheduler.minRegisteredResourcesRatio": "1.0",
        "spark.scheduler.maxRegisteredResourcesWaitingTime": f"{START_TIMEOUT:.0f}s",
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": f"file://{cluster.events_dir}",
        "spark.eventLog.compress": "false",
        "spark.eventLog.rolling.enabled": "false",
    }
    return "".join(f"{key} {value}\n" for key, value in settings.items())


@contextlib.asynccontextmanager
async def spark_cluster(
    root: Path, workers: Sequence[str] = ("a", "b")
) -> AsyncIterator[SparkCluster]:
    """A master and `workers` (one core each), all ALIVE; every process killed at the end."""
    root.mkdir(parents=True, exist_ok=True)
    master_dir = root / "master"
    master_dir.mkdir()
    port, webui = free_port(), free_port()
    args = ["--host", "127.0.0.1", "--port", str(port), "--webui-port", str(webui)]
    cluster = SparkCluster(root, port, _start("master", "master.Master", args, master_dir, webui))
    try:
        cluster.events_dir.mkdir()
        cluster.conf_dir.mkdir()
        (cluster.conf_dir / "spark-defaults.conf").write_text(_defaults(cluster, len(workers)))
        for name in workers:
            cluster.start_worker(name)
        await cluster.wait_workers()
        yield cluster
    finally:
        cluster.close()
