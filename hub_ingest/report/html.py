"""The fleet report as one self-contained HTML page (``hub-ingest report --html FILE``).

Everything is inline (the report as JSON, the styles, a small script), so the page opens
from a file or a mail attachment with no network: a health grid of every device that sorts
by any column and filters by text or flag, the fleet's totals, and, for the device selected,
its replication path from the island's streams to the archive. The view can be put in the
link: ``report.html#flagged=1&sort=lag&desc=1&filter=depot``.
"""

from __future__ import annotations

import json

from hub_ingest.report.model import FleetReport

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Fleet report __GENERATED__</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; margin: 0 0 8px; }
#totals span { display: inline-block; margin-right: 18px; }
#totals b { font-size: 16px; }
#controls { margin: 10px 0; }
#controls input[type=search] { width: 260px; padding: 3px; }
#warnings { color: #a40; }
table { border-collapse: collapse; width: 100%; }
th, td { padding: 3px 6px; border-bottom: 1px solid #ddd; text-align: left;
         white-space: nowrap; }
th { cursor: pointer; background: #f3f3f3; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.err { white-space: normal; max-width: 420px; color: #a00; }
tr.flagged td:first-child { border-left: 4px solid #d33; }
tr.selected { background: #fff4c2; }
tr:hover { background: #f7f7ff; cursor: pointer; }
.up { color: #080; } .down { color: #c00; } .unknown { color: #888; }
#path { margin: 12px 0; padding: 8px; border: 1px solid #ccc; background: #fafafa; }
#path .hop { display: inline-block; padding: 4px 8px; border: 1px solid #999;
             border-radius: 4px; background: #fff; margin: 2px; }
#path .bad { border-color: #c00; color: #c00; }
</style>
</head>
<body>
<h1>Fleet report <small id="generated"></small></h1>
<div id="totals"></div>
<div id="warnings"></div>
<div id="controls">
  <input type="search" id="filter" placeholder="filter: device id, error, flag">
  <label><input type="checkbox" id="flaggedOnly"> flagged only</label>
  <span id="shown"></span>
</div>
<div id="path">Select a device to see its replication path.</div>
<table>
<thead><tr id="head"></tr></thead>
<tbody id="rows"></tbody>
</table>
<script type="application/json" id="report">__REPORT__</script>
<script>
"use strict";
const report = JSON.parse(document.getElementById("report").textContent);
const esc = text => String(text).replace(/[&<>"']/g, c => `&#${c.charCodeAt(0)};`);
const age = s => s === null || s === undefined ? "never"
  : s < 60 ? s.toFixed(0) + "s" : s < 3600 ? (s / 60).toFixed(0) + "m"
  : s < 86400 ? (s / 3600).toFixed(0) + "h" : (s / 86400).toFixed(0) + "d";
const lag = d => d.sources.reduce((sum, s) => sum + (s.lag || 0), 0);
const backlog = d => Object.values(d.uplinks || {})
  .reduce((sum, u) => sum + (u.backlog_messages || 0), 0);
const lastError = d => d.last_error
  ? `${d.last_error.command_id} ${d.last_error.status}: ${d.last_error.error || "-"}` : "";
const columns = [
  ["device", d => d.device_id, d => d.device_id],
  ["link", d => d.link_connected === null ? 2 : d.link_connected ? 1 : 0,
   d => d.link_connected === null ? "?" : d.link_connected ? "up" : "down"],
  ["last seen", d => d.last_seen_s === null ? Infinity : d.last_seen_s, d => age(d.last_seen_s)],
  ["lag", lag, lag],
  ["backlog", backlog, backlog],
  ["drops", d => d.telemetry_dropped || 0, d => d.telemetry_dropped ?? "-"],
  ["dead letters", d => d.dead_letters || 0, d => d.dead_letters ?? "-"],
  ["pending", d => d.commands.pending, d => d.commands.pending],
  ["failed", d => d.commands.failed, d => d.commands.failed],
  ["flags", d => d.flags.join(" "), d => d.flags.join(" ").replace(/_/g, " ")],
  ["last error", lastError, lastError],
];
let sortBy = 0, ascending = true, selected = null;
// Flagged devices first until a column is chosen.
let order = (a, b) => (b.flagged - a.flagged) || a.device_id.localeCompare(b.device_id);

function totals() {
  const t = report.totals;
  document.getElementById("generated").textContent = report.generated_at;
  document.getElementById("totals").innerHTML = [
    ["devices", t.devices], ["connected", t.connected], ["flagged", t.flagged],
    ["lag", t.lag], ["commands pending", t.commands_pending],
    ["failed", t.commands_failed]].map(([k, v]) => `<span>${k} <b>${esc(v)}</b></span>`)
    .join("");
  document.getElementById("warnings").textContent = report.warnings.join("; ");
}

function head() {
  const row = document.getElementById("head");
  row.replaceChildren(...columns.map(([name], i) => {
    const th = document.createElement("th");
    th.textContent = name + (i === sortBy && order === byColumn ? (ascending ? " ▲" : " ▼") : "");
    if (i > 1 && i < 9) th.style.textAlign = "right";
    th.onclick = () => { ascending = sortBy === i ? !ascending : true; sortBy = i;
                         order = byColumn; render(); };
    return th;
  }));
}

function byColumn(a, b) {
  const key = columns[sortBy][1], x = key(a), y = key(b);
  const c = typeof x === "string" ? x.localeCompare(y) : x - y;
  return ascending ? c : -c;
}

function render() {
  head();
  const text = document.getElementById("filter").value.toLowerCase();
  const flaggedOnly = document.getElementById("flaggedOnly").checked;
  const shown = report.devices.filter(d => (!flaggedOnly || d.flagged) && (!text ||
    [d.device_id, lastError(d), d.flags.join(" ")].join(" ").toLowerCase().includes(text)))
    .sort(order);
  const body = document.getElementById("rows");
  body.replaceChildren(...shown.map(d => {
    const tr = document.createElement("tr");
    tr.className = (d.flagged ? "flagged" : "") + (d === selected ? " selected" : "");
    tr.dataset.device = d.device_id;
    columns.forEach(([name, , show], i) => {
      const td = document.createElement("td");
      td.textContent = show(d);
      if (i === 1) td.className = d.link_connected === null ? "unknown"
        : d.link_connected ? "up" : "down";
      else if (name === "last error") td.className = "err";
      else if (i > 1 && i < 9) td.className = "num";
      tr.appendChild(td);
    });
    tr.onclick = () => { selected = d; path(d); render(); };
    return tr;
  }));
  document.getElementById("shown").textContent =
    `${shown.length} of ${report.devices.length} devices`;
}

function path(d) {
  const hops = d.sources.map(s => {
    const bad = s.error || !s.sourced ? " bad" : "";
    const mirror = (d.incarnations || []).filter(i => i.stream === s.device_stream).pop();
    const mirrorName = mirror ? `EDGE_${s.device_stream}_${d.device_id}_${mirror.id}`
      : "(not mirrored yet)";
    return `<div><span class="hop">edge-${esc(d.device_id)} / ${esc(s.device_stream)}</span> →
      <span class="hop">hub / ${esc(mirrorName)}</span> →
      <span class="hop${bad}">hub / ${esc(s.stream)} (lag ${s.lag ?? "?"},
      active ${age(s.last_active_s)} ago${s.error ? ", " + esc(s.error) : ""})</span> →
      <span class="hop">archive</span></div>`;
  });
  document.getElementById("path").innerHTML =
    `<b>${esc(d.device_id)}</b> (${esc(d.domain)}, shard ${d.shard}) ` + (hops.join("") ||
    "has no streams at the hub yet");
}

// A link can carry the view: #filter=text&flagged=1&sort=lag&desc=1
const view = new URLSearchParams(location.hash.slice(1));
document.getElementById("filter").value = view.get("filter") || "";
document.getElementById("flaggedOnly").checked = view.get("flagged") === "1";
const chosen = columns.findIndex(([name]) => name === view.get("sort"));
if (chosen >= 0) { sortBy = chosen; ascending = view.get("desc") !== "1"; order = byColumn; }
document.getElementById("filter").oninput = render;
document.getElementById("flaggedOnly").onchange = render;
totals();
render();
</script>
</body>
</html>
"""


def render_html(report: FleetReport) -> str:
    document = json.dumps(report.to_dict())
    # Inside <script>, "</" could end the element early: JSON allows escaping the slash.
    safe = document.replace("</", "<\\/")
    return _PAGE.replace("__GENERATED__", report.generated_at).replace("__REPORT__", safe)
