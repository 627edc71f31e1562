"""Fixtures: a real hub nats-server (or a cluster of three) per test, and a factory for
devices linked to it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from hub_ingest.ingest.job import spark_session
from hub_ingest.local.fleet import share_ports
from tests.support.certs import Authority
from tests.support.cluster import Hub, start_hub
from tests.support.hubcluster import ClusterHub, start_cluster_hub
from tests.support.leaks import EXIT_GRACE_S, kill, still_running_after
from tests.support.releases import NEXT_VERSION, build_wheelhouse, release_wheel


def pytest_configure(config: pytest.Config) -> None:
    """Parallel workers (pytest-xdist) pick ports from disjoint shares: a port one worker's
    server has not bound yet, or lets go of while it restarts, is never another's."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None:
        share_ports(int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A process the test started under its directory and left running is killed and fails
    the test, instead of answering on its ports in the tests after it."""
    if "tmp_path" not in request.fixturenames:
        yield
        return
    tmp_path: Path = request.getfixturevalue("tmp_path")
    yield
    leaked = still_running_after(tmp_path, EXIT_GRACE_S)
    kill(leaked)
    assert not leaked, f"left running: {leaked}"


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[Hub]:
    """A hub with COMMANDS and empty aggregates; `await hub.device("a")` adds a device."""
    hub = await start_hub(tmp_path)
    try:
        yield hub
    finally:
        await hub.close()


@pytest.fixture
async def users_file_hub(tmp_path: Path) -> AsyncIterator[Hub]:
    """`hub`, admitting its devices by users file (``server.admission``) rather than by the
    watcher's auth callout."""
    hub = await start_hub(tmp_path, admission="users_file")
    try:
        yield hub
    finally:
        await hub.close()


@pytest.fixture
def pki(tmp_path: Path) -> Authority:
    """The fleet's certificate authority (`tests.support.certs`)."""
    return Authority(tmp_path / "pki", "fleet-ca")


@pytest.fixture
async def tls_hub(tmp_path: Path, pki: Authority) -> AsyncIterator[Hub]:
    """A hub whose leaf listener requires TLS and a client certificate `pki` signed."""
    server = pki.issue("hub", server=True)
    leaf_tls = {
        "cert_file": str(server.cert_file),
        "key_file": str(server.key_file),
        "ca_file": str(pki.cert_file),
        "verify": True,
    }
    hub = await start_hub(tmp_path, leaf_tls=leaf_tls)
    try:
        yield hub
    finally:
        await hub.close()


@pytest.fixture
async def cluster_hub(tmp_path: Path) -> AsyncIterator[ClusterHub]:
    """The same hub on a three-node JetStream cluster, every stream at three replicas."""
    hub = await start_cluster_hub(tmp_path)
    try:
        yield hub
    finally:
        await hub.close()


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This tree as release VERSION and NEXT_VERSION, with every dependency wheel."""
    house = build_wheelhouse(tmp_path_factory.mktemp("wheelhouse"))
    release_wheel(house, NEXT_VERSION, tmp_path_factory.mktemp("next-release"))
    return house


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One local Spark session for every Spark test: starting one takes ~8 s."""
    session = spark_session("local[2]")
    try:
        yield session
    finally:
        session.stop()
