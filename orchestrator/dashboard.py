"""The operator dashboard: one self-contained page (HTML + inline JS + SVG charts, no CDN) that polls
`/v1/status/history` with the admin token given as `/#token=...`. Kept as a Python string so it ships
with the package without package-data configuration."""

import base64
import hashlib
import re

HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>swarmrl dashboard</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
  /* Self-contained: no CDN, no fonts, no libraries (the cluster may have no internet). */
  body { font-family: system-ui, sans-serif; margin: 16px; background: #f6f7f9; color: #1d232b; }
  h1 { font-size: 20px; margin: 0 0 4px 0; }
  #sub { color: #667; font-size: 13px; margin-bottom: 12px; }
  #tiles { display: grid; grid-template-columns: repeat(auto-fill, minmax(150px, 1fr)); gap: 8px; margin-bottom: 12px; }
  .tile { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 8px 10px; }
  .tile .k { font-size: 11px; color: #667; text-transform: uppercase; letter-spacing: .04em; }
  .tile .v { font-size: 20px; font-weight: 600; margin-top: 2px; }
  #charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(380px, 1fr)); gap: 10px; }
  .chart { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 8px; }
  .chart h2 { font-size: 13px; margin: 0 0 4px 0; font-weight: 600; }
  svg { width: 100%; height: 160px; display: block; }
  table { border-collapse: collapse; width: 100%; background: #fff; margin-top: 12px; font-size: 13px; }
  th, td { border-bottom: 1px solid #e6e8eb; padding: 4px 8px; text-align: left; }
  th { background: #eef0f3; }
  #err { color: #b00020; font-size: 13px; min-height: 1em; }
  #auth { display: none; margin-bottom: 12px; }
</style>
</head>
<body>
<h1>swarmrl <span id="run"></span></h1>
<div id="sub">operator dashboard &middot; refreshes every 2 s &middot; token from <code>#token=...</code></div>
<div id="auth"><input id="tok" type="password" placeholder="admin token" size="32"> <button id="go">connect</button></div>
<div id="err"></div>
<div id="tiles"></div>
<div id="charts"></div>
<table id="workers"><thead><tr><th>worker</th><th>name</th><th>online</th><th>state</th><th>version</th>
  <th>accepted</th><th>rejected</th><th>strikes</th><th>verified tokens</th><th title="leases given back (charged: after their free window) and the share of its token's recent leases given back charged">given back (charged, token %)</th><th>banned</th></tr></thead><tbody></tbody></table>
<script>
"use strict";
const CHARTS = [
  ["mean_reward", "mean reward (last 60 s)", "#2e7d32"],
  ["rollout_tokens_per_s", "verified rollout tokens / s", "#1565c0"],
  ["submissions_per_s", "verified submissions / s", "#6a1b9a"],
  ["acceptance", "acceptance rate (last 60 s)", "#ef6c00"],
  ["workers_online", "workers online", "#00838f"],
  ["buffer_depth", "buffer depth (samples)", "#5d4037"],
  ["verify_queue", "verification queue (submissions)", "#c62828"],
  ["verifier_actors", "verifier actors (live)", "#455a64"],
];
function getToken() {
  const m = location.hash.match(/token=([^&]+)/);
  if (m) { sessionStorage.setItem("swarmrl-token", decodeURIComponent(m[1])); }
  return sessionStorage.getItem("swarmrl-token") || "";
}
function fmt(v, digits) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  if (Math.abs(v) >= 1000) return v.toFixed(0);
  return v.toFixed(digits === undefined ? 2 : digits);
}
function el(tag, attrs, text) {
  const ns = ["svg", "path", "line", "text", "rect", "polyline", "circle"].includes(tag) ? "http://www.w3.org/2000/svg" : null;
  const e = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function drawChart(box, title, color, points) {
  box.innerHTML = "";
  box.appendChild(el("h2", {}, title));
  const W = 400, H = 160, L = 44, R = 8, T = 8, B = 22;
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
  const pts = points.filter(p => p[1] !== null && p[1] !== undefined && isFinite(p[1]));
  svg.appendChild(el("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "#fafbfc", stroke: "#e1e4e8" }));
  if (pts.length === 0) {
    svg.appendChild(el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#999", "font-size": 12 }, "no data yet"));
    box.appendChild(svg);
    return;
  }
  const t0 = pts[0][0], t1 = Math.max(pts[pts.length - 1][0], t0 + 1);
  let lo = Math.min(...pts.map(p => p[1])), hi = Math.max(...pts.map(p => p[1]));
  if (lo > 0 && lo < hi * 0.5) lo = 0;
  if (hi - lo < 1e-9) { hi += 0.5; lo -= 0.5; if (lo < 0 && pts.every(p => p[1] >= 0)) lo = 0; }
  const x = t => L + (t - t0) / (t1 - t0) * (W - L - R);
  const y = v => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const v = lo + (hi - lo) * i / 4;
    svg.appendChild(el("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: "#eceef1" }));
    svg.appendChild(el("text", { x: L - 4, y: y(v) + 4, "text-anchor": "end", fill: "#667", "font-size": 10 }, fmt(v, hi - lo < 0.1 ? 3 : 2)));
  }
  const span = t1 - t0;
  svg.appendChild(el("text", { x: L, y: H - 6, fill: "#667", "font-size": 10 }, `-${fmt(span, 0)} s`));
  svg.appendChild(el("text", { x: W - R, y: H - 6, "text-anchor": "end", fill: "#667", "font-size": 10 }, "now"));
  const d = pts.map((p, i) => `${i ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
  svg.appendChild(el("path", { d, fill: "none", stroke: color, "stroke-width": 2, "vector-effect": "non-scaling-stroke" }));
  const last = pts[pts.length - 1];
  svg.appendChild(el("circle", { cx: x(last[0]), cy: y(last[1]), r: 3, fill: color }));
  box.appendChild(svg);
}
function render(data) {
  const s = data.status;
  document.getElementById("run").textContent = "· " + s.run_name;
  const tiles = [
    ["step", s.step], ["policy version", s.policy_version], ["async level", s.async_level],
    ["workers online", s.workers_online], ["buffer depth", s.buffer_depth],
    ["acceptance", fmt(s.acceptance_rate * 100, 1) + " %"], ["accepted", s.submissions_accepted],
    ["rejected", s.submissions_rejected], ["mean reward", fmt(s.mean_reward, 3)],
    ["tokens / s", fmt(s.rollout_tokens_per_s, 1)], ["trained samples / s", fmt(s.trained_samples_per_s, 2)],
    ["zero-signal groups", s.groups_dropped_zero_signal], ["stale samples", s.samples_dropped_stale],
    ["verification queue", s.verify_queue], ["verified / s (in / s)", fmt(s.verify_out_per_s, 2) + " (" + fmt(s.verify_in_per_s, 2) + ")"],
    ["verified tokens / s", fmt(s.verify_tokens_per_s, 1)], ["verifier actors (pending)", s.verifier_actors + " (" + s.verifier_actors_pending + ")"],
    ["task level (pass rate)", s.curriculum ? s.curriculum.level + " / " + (s.curriculum.levels - 1) +
      (s.curriculum.pass_rate == null ? "" : " (" + fmt(s.curriculum.pass_rate * 100, 0) + " %)") : "none"],
    ["restarts (time lost)", Object.entries(s.restarts || {}).map(([c, r]) => `${c} ${r.count} (${fmt(r.seconds_lost, 0)} s)`).join(", ") || "none"],
  ];
  const tbox = document.getElementById("tiles");
  tbox.innerHTML = "";
  for (const [k, v] of tiles) {
    const t = el("div", { class: "tile" });
    t.appendChild(el("div", { class: "k" }, k));
    t.appendChild(el("div", { class: "v" }, typeof v === "number" ? String(v) : v));
    tbox.appendChild(t);
  }
  const cbox = document.getElementById("charts");
  if (cbox.children.length !== CHARTS.length) {
    cbox.innerHTML = "";
    for (let i = 0; i < CHARTS.length; i++) cbox.appendChild(el("div", { class: "chart" }));
  }
  const now = data.history.length ? data.history[data.history.length - 1].t : 0;
  CHARTS.forEach(([key, title, color], i) => {
    drawChart(cbox.children[i], title, color, data.history.map(h => [h.t - now, h[key]]));
  });
  const tb = document.querySelector("#workers tbody");
  tb.innerHTML = "";
  for (const w of data.workers) {
    const tr = el("tr");
    for (const v of [w.worker_id, w.name, w.online ? "yes" : "no", w.state || "–", w.loaded_policy_version ?? "–",
                     w.submissions_accepted, w.submissions_rejected, w.strikes, w.verified_tokens,
                     `${w.leases_released} (${w.releases_charged}, ${fmt(w.token_release_ratio * 100, 0)} %)`, w.banned ? "BANNED" : ""]) {
      tr.appendChild(el("td", {}, String(v)));
    }
    tb.appendChild(tr);
  }
}
async function poll() {
  const err = document.getElementById("err");
  const token = getToken();
  if (!token) { document.getElementById("auth").style.display = "block"; err.textContent = "admin token needed"; return; }
  try {
    const r = await fetch("/v1/status/history", { headers: { Authorization: "Bearer " + token } });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      err.textContent = `HTTP ${r.status}: ${body.detail || r.statusText}`;
      if (r.status === 401 || r.status === 403) document.getElementById("auth").style.display = "block";
      return;
    }
    err.textContent = "";
    render(await r.json());
    document.body.dataset.rendered = "1";
  } catch (e) {
    err.textContent = "orchestrator unreachable: " + e;
  }
}
document.getElementById("go").onclick = () => {
  sessionStorage.setItem("swarmrl-token", document.getElementById("tok").value);
  document.getElementById("auth").style.display = "none";
  poll();
};
poll();
setInterval(poll, 2000);
</script>
</body>
</html>
"""  # noqa: E501 - the page as served (its script and style are hashed into the CSP); wrapping it would change it


def _hashes(tag: str) -> str:
    """CSP sources for the page's inline <tag> elements, hashed from the served text so they cannot drift."""
    bodies = re.findall(rf"<{tag}\b[^>]*>(.*?)</{tag}>", HTML, flags=re.S)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
        for b in bodies) or "'none'"


# No 'unsafe-inline': only this page's own script and style run, and it talks only to its own origin.
CSP = "; ".join([
    "default-src 'none'",
    f"script-src {_hashes('script')}",
    f"style-src {_hashes('style')}",
    "connect-src 'self'",
    "img-src 'self'",  # the browser's own favicon request
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
