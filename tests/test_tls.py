"""The leaf link over TLS: the hub's leaf listener with its own certificate, devices trusting
the fleet's CA (``hub.tls.ca_file``) and presenting a client certificate from it (mTLS, on
top of their NKeys). Certificates are made by the test (`tests.support.certs`).

Data and commands flow, and both resume within seconds of a 30 s cut, as without TLS; a
device without TLS, or with a certificate from another CA, is refused by the hub.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.js import JetStreamContext

from tests.support.certs import Authority
from tests.support.cluster import Hub, mirror_silent_for
from tests.support.waiting import RESUME_TIMEOUT, eventually

pytestmark = pytest.mark.slow

STALLED_S = 30  # a cut long enough that the stock mirrors would take 10-40 s to resume
DEADLINE_S = 8.0  # what fast resume must do better than (as in tests/test_resume.py)


def _tls(ca: Authority, client: Authority | None, name: str) -> dict[str, dict[str, str]]:
    """The device's ``[hub.tls]``: trust `ca`, and present a certificate `client` signed."""
    table = {"ca_file": str(ca.cert_file)}
    if client is not None:
        issued = client.issue(name, server=False)
        table |= {"cert_file": str(issued.cert_file), "key_file": str(issued.key_file)}
    return {"hub": {"tls": table}}


async def _has(hub: Hub, stream: str, subject: str) -> bool:
    info = await hub.js.stream_info(stream, subjects_filter=subject)
    return bool(info.state.subjects)


async def test_data_and_commands_cross_a_tls_link_and_resume_fast(
    tls_hub: Hub, pki: Authority
) -> None:
    a = await tls_hub.device("a", register_when_ready=True, sections=_tls(pki, pki, "a"))
    await a.wait_link(up=True)
    await a.js.publish("tele.r.0", b"over tls")
    await eventually(
        lambda: _has(tls_hub, "FLEET_TELEMETRY", "fleet.a.tele.r.0"),
        timeout=RESUME_TIMEOUT,
        what="a reading over TLS",
    )
    mirror = await tls_hub.mirror("a")

    a.proxy.cut()
    await a.wait_link(up=False)
    await a.js.publish("tele.r.1", b"during the cut")
    await tls_hub.js.publish("cmd.a.r1", b"{}")
    await eventually(
        lambda: mirror_silent_for(tls_hub.js, mirror, STALLED_S),
        timeout=STALLED_S + 30,
        what=f"the hub's mirror silent for {STALLED_S}s",
    )
    a.proxy.restore()
    await eventually(
        lambda: _has(tls_hub, "FLEET_TELEMETRY", "fleet.a.tele.r.1"),
        timeout=DEADLINE_S,
        what="the reading within seconds of the link's return",
    )
    await eventually(
        lambda: _island_has(a.js, "cmd.a.r1"), timeout=DEADLINE_S, what="the command on the island"
    )


async def _island_has(js: JetStreamContext, subject: str) -> bool:
    info = await js.stream_info("COMMANDS", subjects_filter=subject)
    return bool(info.state.subjects)


@pytest.mark.parametrize(
    ("kind", "reason"),
    # Without [hub.tls] the device cannot verify the hub's certificate and ends the
    # handshake; with a certificate from another CA it has none the hub asks for to offer.
    [("no TLS", "bad certificate"), ("another CA", "client didn't provide a certificate")],
)
async def test_the_hub_refuses_a_device_without_a_certificate_from_its_ca(
    tls_hub: Hub, pki: Authority, tmp_path: Path, kind: str, reason: str
) -> None:
    """The device's NKey is valid, yet its link never comes up: the TLS handshake fails (the
    hub's log says why)."""
    rogue = Authority(tmp_path / "rogue", "rogue-ca")
    sections = {"hub": {}} if kind == "no TLS" else _tls(pki, rogue, "r")
    device = await tls_hub.device("r", sections=sections)
    log = tls_hub.server.log_path

    async def refused() -> bool:
        lines = log.read_text(errors="replace").splitlines()
        return any("TLS leafnode handshake error" in line and reason in line for line in lines)

    await eventually(refused, timeout=30, what="the hub refusing the handshake")
    assert not await device.link_up()
