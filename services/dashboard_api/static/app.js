// berth's web dashboard: plain JavaScript, no build step. Five pages (jobs, one job,
// workers, the host timeline, schedules) rendered from the JSON API, re-rendered on each
// Server-Sent Event.
"use strict";

const EXAMPLE_SPEC = {
  name: "hello", command: ["sh", "-c", "echo hello from $BERTH_TASK_INDEX; sleep 2"],
  replicas: 2, resources: { cpu: 0.5, memory_mb: 64 },
};

const main = document.getElementById("main");
const tokenInput = document.getElementById("token");
tokenInput.value = localStorage.getItem("berth-token") || "";
tokenInput.addEventListener("change", () => {
  localStorage.setItem("berth-token", tokenInput.value.trim());
  connectEvents();
  render();
});

// --- helpers -------------------------------------------------------------------------------

const esc = (s) => String(s ?? "").replace(/[&<>"']/g,
  (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const badge = (s) => `<span class="badge status-${esc(s)}" data-state="${esc(s)}">${esc(s)}</span>`;
const when = (ts) => (ts ? new Date(ts * 1000).toLocaleTimeString() : "");
const ago = (ts) => (ts ? `${Math.max(0, Math.round(Date.now() / 1000 - ts))} s ago` : "never");
const jobLink = (id) => `<a href="/jobs/${encodeURIComponent(id)}" data-link>${esc(id)}</a>`;
const counts = (c) => Object.entries(c).map(([s, n]) => `${n} ${badge(s)}`).join(" ");

function authHeaders() {
  const token = tokenInput.value.trim();
  return token ? { Authorization: `Bearer ${token}` } : {};
}

async function api(path, options = {}) {
  const resp = await fetch(path, { ...options, headers: { ...authHeaders(), ...(options.headers || {}) } });
  const text = await resp.text();
  let body = text;
  try { body = JSON.parse(text); } catch (e) { /* logs are text */ }
  if (!resp.ok) {
    const detail = body && body.detail ? body.detail : `${resp.status} ${resp.statusText}`;
    const extra = body && body.extra ? ` ${JSON.stringify(body.extra)}` : "";
    // The API's detail speaks of headers; in the page the token goes in the field above.
    const hint = resp.status === 401 ? " (enter an API token in the field at the top)" : "";
    throw new Error(detail + extra + hint);
  }
  return body;
}

// State names come from the API (GET /api/states), so the filter offers exactly what
// /api/jobs?state= accepts; fetched once per page load.
let stateNames = null;
async function states() {
  if (!stateNames) stateNames = await api("/api/states");
  return stateNames;
}

// --- pages ---------------------------------------------------------------------------------

let jobsCursor = null; // the page of the jobs list being shown (null: the newest)

async function jobsPage() {
  const f = new URLSearchParams(location.search);
  const q = new URLSearchParams();
  for (const k of ["state", "name_prefix", "user", "parent"]) if (f.get(k)) q.set(k, f.get(k));
  q.set("limit", "50");
  if (jobsCursor) q.set("cursor", jobsCursor);
  const page = await api(`/api/jobs?${q}`);
  const rows = page.jobs.map((j) => `<tr data-job="${esc(j.job_id)}">
      <td>${jobLink(j.job_id)}</td><td>${esc(j.name)}</td><td>${esc(j.user)}</td>
      <td class="job-state">${badge(j.state)}</td><td>${counts(j.task_counts)}</td>
      <td>${when(j.submitted_at)}</td><td class="error">${esc(j.error)}</td></tr>`).join("");
  const options = ["", ...(await states()).job];
  return `<h1>Jobs</h1>
    <form class="filters" id="filters">
      <label>state <select name="state">${options.map((s) =>
        `<option ${f.get("state") === s ? "selected" : ""}>${s}</option>`).join("")}</select></label>
      <label>name prefix <input name="name_prefix" value="${esc(f.get("name_prefix"))}"></label>
      <label>user <input name="user" value="${esc(f.get("user"))}"></label>
      <button>filter</button>
    </form>
    <table id="jobs"><thead><tr><th>job</th><th>name</th><th>user</th><th>state</th>
      <th>tasks</th><th>submitted</th><th>error</th></tr></thead>
      <tbody>${rows || `<tr><td colspan="7" class="muted">no jobs</td></tr>`}</tbody></table>
    ${jobsCursor ? `<button id="newest">newest</button>` : ""}
    ${page.next_cursor ? `<button id="older" data-cursor="${esc(page.next_cursor)}">older →</button>` : ""}
    <details id="submit-box" ${submitBoxOpen() ? "open" : ""}>
      <summary>Submit a job</summary>
      <p class="muted">The same JSON as a message on <code>berth.submit.job</code>
        (<a href="/schema">API schema</a>). Needs the API token.</p>
      <textarea id="spec">${esc(sessionStorage.getItem("spec") || JSON.stringify(EXAMPLE_SPEC, null, 2))}</textarea>
      <div><button id="submit">submit</button> <span id="submit-result"></span></div>
    </details>`;
}

function attemptRows(task) {
  return task.attempts.map((a) => `<tr class="attempt" data-attempt="${a.attempt_id}">
      <td></td><td>attempt ${a.attempt_id}</td>
      <td>${badge(a.state)}${a.worker_failure ? ' <span class="worker-failure">(worker failure)</span>' : ""}</td>
      <td>on ${esc(a.worker_id)}${a.devices && a.devices.length ? ` (devices ${a.devices.join(",")})` : ""}${a.gpu ? `<div class="muted">GPU memory peak ${a.gpu.peak_memory_mb} MiB${a.gpu.mean_utilization === null ? "" : `, utilisation mean ${Math.round(a.gpu.mean_utilization)}% peak ${a.gpu.peak_utilization}%`}</div>` : ""}${a.usage ? `<div class="muted usage">cpu ${a.usage.cpu_seconds}s, peak RSS ${a.usage.peak_rss_mb} MiB</div>` : ""}</td>
      <td>${a.exit_code ?? ""}</td>
      <td>${when(a.started_at)}${a.finished_at ? ` → ${when(a.finished_at)}` : ""}</td>
      <td class="error">${esc(a.error)}</td>
      <td><a href="#" data-logs="${task.index}/${a.attempt_id}">logs</a></td></tr>`).join("");
}

async function jobPage(jobId) {
  const job = await api(`/api/jobs/${encodeURIComponent(jobId)}`);
  const ended = (await states()).job_terminal.includes(job.state);
  const tasks = job.tasks.map((t) => `<tr class="task" data-task="${t.index}">
      <td>${t.index}</td><td></td>
      <td class="task-state">${badge(t.state)}${t.pending_reason
        ? `<div class="pending-reason"${t.retry_at ? ` data-retry-at="${t.retry_at}" data-try="${t.retries + 1}"` : ""}>${esc(t.pending_reason)}</div>` : ""}</td>
      <td>${t.failure_count} failures, ${t.preemption_count} preemptions</td>
      <td>${t.exit_code ?? ""}</td><td></td><td class="error">${esc(t.error)}</td><td></td></tr>
      ${attemptRows(t)}`).join("");
  const children = job.children.map(jobLink).join(", ");
  return `<h1>Job ${esc(job.job_id)} <span id="job-state">${badge(job.state)}</span></h1>
    <dl class="facts">
      <dt>name</dt><dd>${esc(job.name)}</dd>
      ${job.user ? `<dt>user</dt><dd>${esc(job.user)}</dd>` : ""}
      <dt>tasks</dt><dd>${counts(job.task_counts)}</dd>
      <dt>submitted</dt><dd>${when(job.submitted_at)}</dd>
      ${job.started_at ? `<dt>started</dt><dd>${when(job.started_at)}</dd>` : ""}
      ${job.finished_at ? `<dt>finished</dt><dd>${when(job.finished_at)}</dd>` : ""}
      ${job.parent ? `<dt>parent</dt><dd>${jobLink(job.parent)}</dd>` : ""}
      ${children ? `<dt>children</dt><dd>${children}</dd>` : ""}
      ${job.spec.after.length ? `<dt>after</dt><dd>${job.spec.after.map(jobLink).join(", ")}</dd>` : ""}
      ${job.spec.after_any.length ? `<dt>after any</dt><dd>${job.spec.after_any.map(jobLink).join(", ")}</dd>` : ""}
      ${job.waiting_for ? `<dt>waiting for</dt><dd>${jobLink(job.waiting_for)}</dd>` : ""}
      ${job.error ? `<dt>error</dt><dd class="error">${esc(job.error)}</dd>` : ""}
      ${job.failure_reason ? `<dt>failure reason</dt><dd class="error">${esc(job.failure_reason)}</dd>` : ""}
      <dt>command</dt><dd><code>${esc(job.spec.command.join(" "))}</code></dd>
    </dl>
    ${ended ? "" : `<p><button id="cancel" data-job="${esc(job.job_id)}">cancel job</button>
      <span id="cancel-result"></span></p>`}
    <h2>Tasks</h2>
    <table id="tasks"><thead><tr><th>task</th><th></th><th>state</th><th>retries</th><th>exit</th>
      <th>ran</th><th>error</th><th></th></tr></thead><tbody>${tasks}</tbody></table>
    <div id="log-view">${logView ? `<h2>Logs of task ${esc(logView)}</h2><pre class="logs" id="logs"></pre>` : ""}</div>`;
}

let logView = null; // "index/attempt" whose logs are shown on the job page

// Each device (GPU) of a worker: its index, model, and the attempt holding it.
function deviceList(devices) {
  if (!devices || !devices.length) return "";
  const now = (d) => [d.utilization === null ? "" : `${d.utilization}% busy`,
    d.memory_used_mb === null ? "" : `${d.memory_used_mb} MiB used`,
    d.temperature_c === null ? "" : `${d.temperature_c} °C`].filter(Boolean).join(", ");
  return `<div class="muted">${devices.map((d) => `${d.index}${d.uuid ? ` <span title="${esc(d.uuid)}">${esc(d.model || "")}</span>` : ""}: ${d.held_by ? esc(d.held_by) : "free"}${d.unhealthy ? ` <span class="error">unhealthy: ${esc(d.unhealthy)}</span>` : ""}${now(d) ? ` (${now(d)})` : ""}`).join("<br>")}</div>`;
}

async function workersPage() {
  const workers = await api("/api/workers");
  const rows = workers.map((w) => `<tr data-worker="${esc(w.worker_id)}">
      <td>${esc(w.worker_id)}</td>
      <td>${w.healthy ? '<span style="color:#1a7f37">healthy</span>' : '<span class="error">dead</span>'}${w.out_of_service ? `<div class="error out-of-service">${esc(w.out_of_service)}${w.drain_deadline ? ` (deadline ${when(w.drain_deadline)})` : ""}</div>` : ""}</td>
      <td>${esc(w.address)}</td>
      <td>${w.cpu_free} / ${w.resources.cpu}</td>
      <td>${w.memory_free_mb} / ${w.resources.memory_mb}</td>
      <td>${w.resources.device.type === "cpu" ? "" : `${w.devices_free} / ${w.resources.device.count} ${esc(w.resources.device.variant)}`}${deviceList(w.devices)}</td>
      <td>${Object.entries(w.attributes).map(([k, v]) => `${esc(k)}=${esc(v)}`).join(" ")}</td>
      <td>${w.running_attempts.length}</td><td>${w.held_by_gang ? jobLink(w.held_by_gang) : ""}</td>
      <td>${ago(w.last_heartbeat)}</td></tr>`).join("");
  return `<h1>Workers</h1>
    <table id="workers"><thead><tr><th>worker</th><th>health</th><th>address</th><th>cpu free</th>
      <th>memory free (MiB)</th><th>devices free</th><th>attributes</th><th>running</th>
      <th>held by gang</th><th>last heartbeat</th></tr></thead>
      <tbody>${rows || `<tr><td colspan="10" class="muted">no workers</td></tr>`}</tbody></table>`;
}

async function schedulesPage() {
  const schedules = await api("/api/schedules");
  const rows = schedules.map((s) => `<tr data-schedule="${esc(s.schedule_id)}">
      <td>${esc(s.schedule_id)}</td><td>${esc(s.name)}</td><td>${esc(s.user)}</td>
      <td><code>${esc(s.cron)}</code> ${esc(s.timezone)}</td>
      <td>${s.cancelled_at ? `cancelled ${when(s.cancelled_at)}` : when(s.next_run)}</td>
      <td>${s.fired}</td><td>${s.last_job ? jobLink(s.last_job) : ""}</td></tr>`).join("");
  return `<h1>Schedules</h1>
    <table id="schedules"><thead><tr><th>schedule</th><th>name</th><th>user</th><th>cron</th>
      <th>next run</th><th>fired</th><th>last job</th></tr></thead>
      <tbody>${rows || `<tr><td colspan="7" class="muted">no schedules</td></tr>`}</tbody></table>`;
}

// --- the host timeline: one row per host, one bar per attempt, drawn as plain SVG ----------

const STATE_COLOURS = { // the badges' colours (app.css)
  pending: "#9a6700", assigned: "#bc4c00", building: "#8250df", running: "#0969da",
  succeeded: "#1a7f37", failed: "#cf222e", killed: "#57606a", worker_failed: "#8250df",
  unschedulable: "#cf222e",
};
const WINDOWS = [[300, "5 min"], [900, "15 min"], [3600, "1 hour"], [21600, "6 hours"], [86400, "24 hours"]];
const TL = { label: 170, lane: 14, gap: 3, pad: 4, axis: 22 };
let hostsCursor = null; // the page of hosts being shown (null: the first)

// A job's colour: the same hue for every attempt of a job, on every page load.
function jobColour(jobId) {
  let h = 0;
  for (const c of jobId) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  // The golden angle spreads ids that differ in one character far apart on the wheel.
  return `hsl(${Math.round((h * 137.508) % 360)}, 60%, 62%)`;
}

// Attempts that overlap in time go into separate lanes of their host's row: tasks of no
// gang may share a host within its capacity. Gangs of different jobs never may: such a
// pair is in the row's `overlaps` (from the API), and the row is marked.
function lanes(bars, until) {
  const ends = [];
  return bars.map((b) => {
    const end = b.end ?? until;
    let lane = ends.findIndex((e) => e <= b.start);
    if (lane < 0) { lane = ends.length; ends.push(end); } else ends[lane] = end;
    return lane;
  });
}

function niceStep(span, want) {
  const raw = span / want;
  return [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400]
    .find((s) => s >= raw) || 86400;
}

function timeAxis(since, until, x, y, height) {
  const step = niceStep(until - since, 8);
  let out = "";
  for (let t = Math.ceil(since / step) * step; t <= until; t += step) {
    const px = x(t).toFixed(1);
    out += `<line class="tick" x1="${px}" x2="${px}" y1="${y}" y2="${y + height}" stroke="#eaeef2"/>
      <text x="${px}" y="${y - 6}" font-size="11" text-anchor="middle" fill="#57606a">${esc(when(t))}</text>`;
  }
  return out;
}

// The window's times to x: the plot right of the labels, clamped to the window.
const timeScale = (tl, width) => (t) => TL.label
  + (Math.min(Math.max(t, tl.since), tl.until) - tl.since) / (tl.until - tl.since) * (width - TL.label - 8);

function hostRows(tl, width) {
  const x = timeScale(tl, width);
  let y = TL.axis;
  let body = "";
  for (const row of tl.hosts) {
    const lane = lanes(row.bars, tl.until);
    const height = Math.max(1, ...lane.map((l) => l + 1)) * (TL.lane + TL.gap) + TL.pad;
    const bad = row.overlaps.length > 0;
    body += `<g class="host-row${bad ? " overlap" : ""}" data-worker="${esc(row.worker_id)}" data-y="${y}" data-height="${height}">
      <rect x="0" y="${y}" width="${width}" height="${height}" fill="${bad ? "#ffebe9" : "transparent"}"/>
      <line x1="0" x2="${width}" y1="${y + height}" y2="${y + height}" stroke="#d0d7de"/>
      <text x="4" y="${y + 14}" font-size="12" fill="${row.alive ? "#1f2328" : "#cf222e"}">${esc(row.worker_id)}${bad ? " ⚠ overlap" : ""}</text>`;
    row.bars.forEach((b, i) => {
      const x0 = x(b.start);
      const w = Math.max(2, x(b.end ?? tl.until) - x0);
      const top = y + TL.pad / 2 + lane[i] * (TL.lane + TL.gap);
      const cap = Math.min(4, w / 2);
      const title = `${b.job_id} task ${b.task_index} attempt ${b.attempt_id}${b.group ? ` (gang ${b.group})` : ""}: ${b.state}, ${when(b.start)} → ${b.end ? when(b.end) : "now"}`;
      body += `<a href="/jobs/${encodeURIComponent(b.job_id)}" data-link><g class="bar" data-job="${esc(b.job_id)}" data-task="${b.task_index}" data-attempt="${b.attempt_id}" data-lane="${lane[i]}" data-state="${esc(b.state)}"${b.group ? ` data-gang="${esc(b.group)}"` : ""}>
        <title>${esc(title)}</title>
        <rect class="bar-body" x="${x0.toFixed(1)}" y="${top}" width="${w.toFixed(1)}" height="${TL.lane}" fill="${jobColour(b.job_id)}"${b.group ? ` stroke="#1f2328" stroke-width="2"` : ""}/>
        <rect class="bar-end" x="${(x0 + w - cap).toFixed(1)}" y="${top}" width="${cap.toFixed(1)}" height="${TL.lane}" fill="${STATE_COLOURS[b.state] || "#57606a"}"/>
      </g></a>`;
    });
    body += "</g>";
    y += height;
  }
  return `<svg id="timeline-hosts" width="${width}" height="${y + 2}" data-since="${tl.since}" data-until="${tl.until}" xmlns="http://www.w3.org/2000/svg">
    ${timeAxis(tl.since, tl.until, x, TL.axis, y - TL.axis)}${body}</svg>`;
}

// Tasks by state and busy hosts over the window, as step lines.
const SERIES = [["pending", "pending", "#9a6700", ""], ["assigned", "assigned", "#bc4c00", ""],
  ["running", "running", "#0969da", ""],
  ["hosts_busy", "hosts busy", "#1f2328", "5 3"]]; // dashed: it often runs along the running line
function clusterChart(tl, width) {
  const height = 140;
  const top = 24;
  const pts = tl.cluster;
  if (!pts.length) return `<p class="muted" id="cluster-chart">no cluster samples in this window</p>`;
  // Scaled to the hosts up too, so busy hosts read as a share of them.
  const max = Math.max(1, ...pts.flatMap((p) => [p.pending, p.assigned, p.running, p.hosts_up]));
  const x = timeScale(tl, width);
  const y = (v) => top + height - v / max * height;
  const lines = SERIES.map(([i, name, colour, dash]) => {
    let d = "";
    pts.forEach((p, k) => {
      d += k === 0 ? `M${x(p.ts).toFixed(1)},${y(p[i]).toFixed(1)}`
        : `H${x(p.ts).toFixed(1)}V${y(p[i]).toFixed(1)}`;
    });
    d += `H${x(Math.min(tl.until, Date.now() / 1000)).toFixed(1)}`;
    return `<path class="series" data-series="${name}" d="${d}" fill="none" stroke="${colour}" stroke-width="1.5"${dash ? ` stroke-dasharray="${dash}"` : ""}/>`;
  }).join("");
  const legend = SERIES.map(([, name, colour], k) =>
    `<text x="${TL.label + k * 110}" y="14" font-size="12" fill="${colour}">■ ${name}</text>`).join("")
    + `<text x="${TL.label + SERIES.length * 110}" y="14" font-size="12" fill="#57606a">hosts up: ${pts[pts.length - 1].hosts_up}</text>`;
  return `<svg id="cluster-chart" width="${width}" height="${top + height + 6}" xmlns="http://www.w3.org/2000/svg">
    ${legend}<text x="4" y="${top + 10}" font-size="11" fill="#57606a">${max}</text>
    <text x="4" y="${top + height}" font-size="11" fill="#57606a">0</text>
    <line x1="${TL.label}" x2="${width - 8}" y1="${top + height}" y2="${top + height}" stroke="#d0d7de"/>${lines}</svg>`;
}

async function timelinePage() {
  const f = new URLSearchParams(location.search);
  const span = Number(f.get("window")) || 3600;
  const q = new URLSearchParams();
  const until = f.get("until") ? Number(f.get("until")) : Date.now() / 1000;
  q.set("since", String(until - span));
  q.set("until", String(until));
  if (f.get("hosts")) q.set("hosts", f.get("hosts"));
  if (hostsCursor) q.set("cursor", hostsCursor);
  const tl = await api(`/api/timeline?${q}`);
  const width = Math.max(700, main.clientWidth - 8);
  const bad = tl.hosts.filter((r) => r.overlaps.length);
  return `<h1>Host timeline</h1>
    <form class="filters" id="timeline-filters">
      <label>window <select name="window">${(WINDOWS.some(([s]) => s === span) ? WINDOWS
        : [[span, `${Math.round(span)} s`], ...WINDOWS]).map(([s, name]) =>
        `<option value="${s}" ${s === span ? "selected" : ""}>${name}</option>`).join("")}</select></label>
      <label>hosts <input name="hosts" value="${esc(f.get("hosts"))}" placeholder="worker ids, comma-separated"></label>
      <button>show</button>
      <span class="muted">hosts ${tl.hosts.length ? `${esc(tl.hosts[0].worker_id)} … ${esc(tl.hosts[tl.hosts.length - 1].worker_id)}` : "none"} of ${tl.total_hosts}${tl.truncated ? "; some hosts had more attempts than shown (the oldest are left out)" : ""}</span>
    </form>
    <p class="muted">One row per host, one bar per attempt from assignment until its process was gone:
      the job's colour, a dark outline for a gang's task, the end in the colour of its state.
      Attempts at once on one host stack in lanes; two gangs on one host at once would mark the row red.</p>
    ${bad.length ? `<p class="error" id="overlaps">overlapping gangs: ${bad.map((r) => `${esc(r.worker_id)}: ${r.overlaps.map(esc).join("; ")}`).join(" — ")}</p>` : ""}
    ${hostRows(tl, width)}
    ${hostsCursor ? `<button id="hosts-first">first hosts</button>` : ""}
    ${tl.next_cursor ? `<button id="hosts-next" data-cursor="${esc(tl.next_cursor)}">next hosts →</button>` : ""}
    <h2>Cluster</h2>
    ${clusterChart(tl, width)}`;
}

// --- rendering and navigation ----------------------------------------------------------------

function route() {
  const m = location.pathname.match(/^\/jobs\/([^/]+)$/);
  if (m) return ["job", () => jobPage(decodeURIComponent(m[1]))];
  if (location.pathname === "/workers") return ["workers", workersPage];
  if (location.pathname === "/schedules") return ["schedules", schedulesPage];
  if (location.pathname === "/timeline") return ["timeline", timelinePage];
  return ["jobs", jobsPage];
}

let rendering = false;
let again = false;
let shown = null; // the page last rendered
let deferred = false; // a re-render waiting for the user to leave a field
let submitResult = ""; // kept across re-renders of the jobs page
let drawn = null; // the HTML now in main, as its page rendered it
main.addEventListener("focusout", () => { if (deferred) { deferred = false; render(); } });

const typing = () => main.contains(document.activeElement)
  && document.activeElement.matches("input, textarea, select");

async function render() {
  if (rendering) { again = true; return; }
  const [name, page] = route();
  if (typing() && name === shown) { deferred = true; return; } // never under the user's cursor
  rendering = true;
  const before = shown;
  shown = name;
  document.querySelectorAll("[data-nav]").forEach((a) =>
    a.classList.toggle("active", a.dataset.nav === (name === "job" ? "jobs" : name)));
  try {
    const html = await page();
    // The user may have begun typing while the page was fetched: not under the cursor
    // either (it was drawn before what they typed).
    if (typing() && name === before) { deferred = true; return; }
    const spec = document.getElementById("spec");
    if (spec) sessionStorage.setItem("spec", spec.value);
    // A page drawn again exactly as it is stays as it is: replacing it under the pointer
    // loses a click whose press and release land on different copies of the same button.
    if (html !== drawn) { main.innerHTML = html; drawn = html; }
    const result = document.getElementById("submit-result");
    if (result) result.innerHTML = submitResult;
    if (logView && document.getElementById("logs")) await showLogs();
  } catch (e) {
    main.innerHTML = `<p class="error">${esc(e.message)}</p>`;
    drawn = null;
  } finally {
    rendering = false;
    if (again) { again = false; render(); }
  }
}

async function showLogs() {
  const [index, attempt] = logView.split("/");
  const jobId = decodeURIComponent(location.pathname.split("/")[2]);
  const text = await api(`/api/jobs/${encodeURIComponent(jobId)}/tasks/${index}/logs?attempt=${attempt}&tail=500`);
  document.getElementById("logs").textContent = text || "(no output yet)";
}

function go(href) {
  history.pushState(null, "", href);
  jobsCursor = null;
  hostsCursor = null;
  logView = null;
  render();
}
window.addEventListener("popstate", () => { jobsCursor = null; hostsCursor = null; render(); });

document.addEventListener("click", async (ev) => {
  const el = ev.target.closest("a[data-link], [data-nav], #older, #newest, #submit, #cancel, a[data-logs], #hosts-next, #hosts-first");
  if (!el) return;
  ev.preventDefault();
  if (el.matches("a[data-link], [data-nav]")) return go(el.getAttribute("href"));
  if (el.id === "older") { jobsCursor = el.dataset.cursor; return render(); }
  if (el.id === "newest") { jobsCursor = null; return render(); }
  if (el.id === "hosts-next") { hostsCursor = el.dataset.cursor; return render(); }
  if (el.id === "hosts-first") { hostsCursor = null; return render(); }
  if (el.dataset.logs) { logView = el.dataset.logs; return render(); }
  if (el.id === "submit") return submitJob();
  if (el.id === "cancel") return cancelJob(el.dataset.job);
});

document.addEventListener("submit", (ev) => {
  const pages = { filters: "/", "timeline-filters": "/timeline" };
  if (!(ev.target.id in pages)) return;
  ev.preventDefault();
  const q = new URLSearchParams();
  for (const [k, v] of new FormData(ev.target)) if (v) q.set(k, v);
  go(`${pages[ev.target.id]}${q.toString() ? "?" + q : ""}`);
});

// The spec as typed, kept at once: a page drawn meanwhile starts from it.
document.addEventListener("input", (ev) => {
  if (ev.target.id === "spec") sessionStorage.setItem("spec", ev.target.value);
});

// Whether the submit box is drawn open: as it is on the page now, if it is there. A click on
// its summary opens it at once, but the "toggle" event that remembers that comes a task
// later: a page drawn in between (a live update) would have closed it again.
function submitBoxOpen() {
  const box = document.getElementById("submit-box");
  return box ? box.open : Boolean(sessionStorage.getItem("submit-open"));
}

document.addEventListener("toggle", (ev) => {
  if (ev.target.id === "submit-box") {
    if (ev.target.open) sessionStorage.setItem("submit-open", "1");
    else sessionStorage.removeItem("submit-open");
  }
}, true);

async function submitJob() {
  const out = document.getElementById("submit-result");
  const text = document.getElementById("spec").value;
  sessionStorage.setItem("spec", text);
  let spec;
  try { spec = JSON.parse(text); } catch (e) { out.innerHTML = `<span class="error">not JSON: ${esc(e.message)}</span>`; return; }
  out.textContent = "submitting …";
  try {
    const r = await api("/api/jobs", { method: "POST", body: JSON.stringify(spec),
                                       headers: { "Content-Type": "application/json" } });
    submitResult = r.job_id ? `accepted: ${jobLink(r.job_id)}` : `queued as submit ${esc(r.submit_seq)}`;
  } catch (e) {
    submitResult = `<span class="error">${esc(e.message)}</span>`;
  }
  const now = document.getElementById("submit-result");
  if (now) now.innerHTML = submitResult;
}

async function cancelJob(jobId) {
  const out = document.getElementById("cancel-result");
  try {
    await api(`/api/jobs/${encodeURIComponent(jobId)}/cancel`, { method: "POST",
      body: JSON.stringify({ reason: "cancelled from the dashboard" }),
      headers: { "Content-Type": "application/json" } });
    out.textContent = "cancel requested";
  } catch (e) {
    out.innerHTML = `<span class="error">${esc(e.message)}</span>`;
  }
}

// --- live updates: Server-Sent Events, read with fetch so the token can be sent ------------

let lastEventId = null;
let stream = null;
let pending = null;
const live = document.getElementById("live");

function setLive(on, text) {
  live.className = `live ${on ? "on" : "off"}`;
  live.textContent = on ? "● live" : `○ ${text}`;
}

function soon() {
  // Many events arrive in bursts: one re-render per burst is enough.
  if (!pending) pending = setTimeout(() => { pending = null; render(); }, 250);
}

async function connectEvents() {
  if (stream) stream.abort();
  const controller = new AbortController();
  stream = controller;
  while (stream === controller) {
    try {
      const headers = { ...authHeaders(), Accept: "text/event-stream" };
      if (lastEventId !== null) headers["Last-Event-ID"] = String(lastEventId);
      const resp = await fetch("/api/events", { headers, signal: controller.signal });
      if (!resp.ok) throw new Error(`${resp.status}`);
      setLive(true);
      soon(); // what changed while disconnected, or a page drawn before the token was
      const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const frame = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const id = frame.match(/^id: (\d+)$/m);
          if (id) { lastEventId = Number(id[1]); soon(); }
        }
      }
    } catch (e) {
      if (controller.signal.aborted) return;
      setLive(false, e.message === "401" ? "token needed" : "reconnecting");
    }
    await new Promise((r) => setTimeout(r, 2000));
  }
}

// Heartbeats are not events: the workers page also refreshes on a timer.
setInterval(() => { if (route()[0] === "workers") render(); }, 2000);
// A live window slides with the clock, and running bars grow, between events too.
setInterval(() => {
  if (route()[0] === "timeline" && !new URLSearchParams(location.search).get("until")) render();
}, 5000);
// A retry backoff's countdown moves without events (the API states it as of its answer).
setInterval(() => {
  for (const el of document.querySelectorAll("[data-retry-at]")) {
    const left = Math.ceil(Number(el.dataset.retryAt) - Date.now() / 1000);
    el.textContent = left > 0 ? `retrying in ${left}s (attempt ${el.dataset.try}, backoff)`
      : `retrying now (attempt ${el.dataset.try})`;
  }
}, 1000);
render();
connectEvents();
