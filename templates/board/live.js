"use strict";
// Everything on this page is rendered by the server; this script only keeps it
// current: times tick, and a committed change (SSE /events) re-fetches the page and
// swaps its live region. Operator buttons (node page) call the API with the token
// kept in this tab's sessionStorage.
const NODE = document.body.dataset.node || null;
function human(s) {
  s = Math.max(0, Math.floor(s));
  if (s < 120) return s + " s";
  if (s < 7200) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  if (s < 172800) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
}
function tick() {
  for (const td of document.querySelectorAll(".in-stage")) {
    const since = Date.parse(td.dataset.since);
    if (isNaN(since)) continue;
    const el = (Date.now() - since) / 1000;
    const exp = td.dataset.expected ? Number(td.dataset.expected) : null;
    const span = td.querySelector(".elapsed");
    if (span) span.textContent = human(el) + (exp !== null ? " of " + human(exp) : "");
    const due = td.dataset.overdueAt ? Date.parse(td.dataset.overdueAt) : NaN;
    const over = (exp !== null && el > exp) || (!isNaN(due) && Date.now() > due);
    if (over && !td.querySelector(".overdue-mark")) {
      const m = document.createElement("span");
      m.className = "overdue-mark";
      m.title = "in this stage longer than expected";
      m.textContent = "⚠ overdue";
      td.appendChild(m);
      const tr = td.closest("tr");
      if (tr) tr.classList.add("overdue");
    }
  }
}
function setLive(text) {
  const l = document.getElementById("live");
  if (l) l.textContent = text;
}
// The same URL, rendered again by the server; only the live region is replaced.
async function refresh() {
  const r = await fetch(location.pathname + location.search, {cache: "no-store", credentials: "same-origin"});
  if (!r.ok) { setLive("update failed: HTTP " + r.status); return; }
  const doc = new DOMParser().parseFromString(await r.text(), "text/html");
  for (const id of ["counts", "board", "region", "buttons-region", "region-rest"]) {
    const now = document.getElementById(id), next = doc.getElementById(id);
    if (now && next) now.replaceWith(next);
  }
  setLive("updated " + new Date().toISOString() + " (live)");
  applyToken();
  tick();
}
// A burst of changes (a rack reinstalled at once) refreshes once, not once each.
let pending = null;
function soon() {
  if (pending === null) pending = setTimeout(() => { pending = null; refresh(); }, 250);
}
function connect() {
  const es = new EventSource("/events");
  es.addEventListener("node", (m) => {
    if (NODE !== null) {
      try { if (String(JSON.parse(m.data).node_id) !== NODE) return; } catch (e) { /* refresh anyway */ }
    }
    soon();
  });
  es.addEventListener("resync", soon);
  es.onerror = () => setLive("reconnecting…");
  // Catches what changed between the first render and the stream's start.
  es.onopen = () => { setLive("live"); soon(); };
}

// --- operator actions (node page) ---
const KEY = "pxed-token";
function token() { try { return sessionStorage.getItem(KEY); } catch (e) { return null; } }
function applyToken() {
  const ops = document.getElementById("ops");
  if (!ops) return;
  ops.hidden = false;
  const t = token();
  document.getElementById("token-form").hidden = !!t;
  document.getElementById("token-set").hidden = !t;
  for (const b of document.querySelectorAll("button[data-op]")) {
    b.disabled = !t || !!b.dataset.off;
    b.title = b.dataset.off || (t ? "" : "enter the API token to act on this node");
  }
}
function result(text, bad) {
  const r = document.getElementById("op-result");
  r.textContent = text;
  r.className = bad ? "error" : "";
}
async function act(b) {
  const headers = {"Authorization": "Bearer " + token()};
  let body;
  if (b.dataset.op === "reinstall") headers["Idempotency-Key"] = "board-" + Date.now() + "-" + Math.random().toString(16).slice(2);
  if (b.dataset.reason !== undefined) {
    const why = document.getElementById("op-reason").value.trim() || "from the board";
    headers["Content-Type"] = "application/json";
    body = JSON.stringify({reason: why});
  }
  result(b.dataset.label + "…", false);
  let r;
  try {
    r = await fetch("/api/v1" + b.dataset.path, {method: b.dataset.method, headers, body});
  } catch (e) { result(b.dataset.label + " failed: " + e, true); return; }
  const j = await r.json().catch(() => ({}));
  if (r.status === 401) {
    sessionStorage.removeItem(KEY);
    applyToken();
    result("the API refused the token; enter it again", true);
  } else if (!r.ok) {
    result(b.dataset.label + " refused: " + (j.detail || j.error || ("HTTP " + r.status)), true);
  } else {
    result(b.dataset.label + ": done" + (j.state ? " (now " + j.state + (j.generation !== undefined ? ", generation " + j.generation : "") + ")" : ""), false);
    soon();
  }
}
document.addEventListener("click", (ev) => {
  const b = ev.target.closest("button[data-op]");
  if (!b || b.disabled) return;
  // Two clicks: the first arms the button for a few seconds.
  if (!b.classList.contains("armed")) {
    b.classList.add("armed");
    b.textContent = "confirm " + b.dataset.label;
    setTimeout(() => { b.classList.remove("armed"); b.textContent = b.dataset.label; }, 5000);
    return;
  }
  b.classList.remove("armed");
  b.textContent = b.dataset.label;
  act(b);
});
document.addEventListener("submit", async (ev) => {
  if (ev.target.id === "token-form") {
    ev.preventDefault();
    const t = document.getElementById("token-input").value.trim();
    if (!t) return;
    const r = await fetch("/api/v1/nodes/" + NODE, {headers: {"Authorization": "Bearer " + t}});
    if (r.ok) {
      sessionStorage.setItem(KEY, t);
      document.getElementById("token-input").value = "";
      result("token accepted for this tab", false);
    } else {
      result("the API refused that token", true);
    }
    applyToken();
  } else if (ev.target.id === "login-form") {
    // The viewer cookie never holds the token; the tab keeps it for the buttons.
    const t = document.getElementById("login-token").value.trim();
    if (t) sessionStorage.setItem(KEY, t);
  }
});
document.addEventListener("click", (ev) => {
  if (ev.target.id === "token-forget") {
    sessionStorage.removeItem(KEY);
    result("token forgotten", false);
    applyToken();
  }
});
applyToken();
tick();
setInterval(tick, 1000);
if (document.getElementById("live")) setTimeout(connect, 300);
