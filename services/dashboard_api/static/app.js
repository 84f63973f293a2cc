// berth's web dashboard: plain JavaScript, no build step. Four pages (jobs, one job,
// workers, schedules) rendered from the JSON API, re-rendered on each Server-Sent Event.
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
    <details id="submit-box" ${sessionStorage.getItem("submit-open") ? "open" : ""}>
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

// --- rendering and navigation ----------------------------------------------------------------

function route() {
  const m = location.pathname.match(/^\/jobs\/([^/]+)$/);
  if (m) return ["job", () => jobPage(decodeURIComponent(m[1]))];
  if (location.pathname === "/workers") return ["workers", workersPage];
  if (location.pathname === "/schedules") return ["schedules", schedulesPage];
  return ["jobs", jobsPage];
}

let rendering = false;
let again = false;
let shown = null; // the page last rendered
let deferred = false; // a re-render waiting for the user to leave a field
let submitResult = ""; // kept across re-renders of the jobs page
main.addEventListener("focusout", () => { if (deferred) { deferred = false; render(); } });

async function render() {
  if (rendering) { again = true; return; }
  const [name, page] = route();
  const typing = main.contains(document.activeElement)
    && document.activeElement.matches("input, textarea, select");
  if (typing && name === shown) { deferred = true; return; } // never under the user's cursor
  rendering = true;
  shown = name;
  document.querySelectorAll("[data-nav]").forEach((a) =>
    a.classList.toggle("active", a.dataset.nav === (name === "job" ? "jobs" : name)));
  try {
    const html = await page();
    const spec = document.getElementById("spec");
    if (spec) sessionStorage.setItem("spec", spec.value);
    main.innerHTML = html;
    const result = document.getElementById("submit-result");
    if (result) result.innerHTML = submitResult;
    if (logView && document.getElementById("logs")) await showLogs();
  } catch (e) {
    main.innerHTML = `<p class="error">${esc(e.message)}</p>`;
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
  logView = null;
  render();
}
window.addEventListener("popstate", () => { jobsCursor = null; render(); });

document.addEventListener("click", async (ev) => {
  const el = ev.target.closest("a[data-link], [data-nav], #older, #newest, #submit, #cancel, a[data-logs]");
  if (!el) return;
  ev.preventDefault();
  if (el.matches("a[data-link], [data-nav]")) return go(el.getAttribute("href"));
  if (el.id === "older") { jobsCursor = el.dataset.cursor; return render(); }
  if (el.id === "newest") { jobsCursor = null; return render(); }
  if (el.dataset.logs) { logView = el.dataset.logs; return render(); }
  if (el.id === "submit") return submitJob();
  if (el.id === "cancel") return cancelJob(el.dataset.job);
});

document.addEventListener("submit", (ev) => {
  if (ev.target.id !== "filters") return;
  ev.preventDefault();
  const q = new URLSearchParams();
  for (const [k, v] of new FormData(ev.target)) if (v) q.set(k, v);
  go(`/${q.toString() ? "?" + q : ""}`);
});

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
      if (lastEventId !== null) soon(); // what changed while disconnected
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
