// A pipeline's page (templates/console/pipeline.html): each step's live figures, refreshed every 2 s. A file of
// its own, not an inline script: the console's Content-Security-Policy runs scripts from this server's static
// files only. The page's script tag names the live figures' URL (data-live-url).
const LIVE_URL = document.currentScript.dataset.liveUrl;
async function refresh() {
  try {
    const r = await fetch(LIVE_URL, {credentials: "same-origin"});
    if (!r.ok) return;
    const data = await r.json();
    const show = (v) => v === null ? "—" : v;
    document.getElementById("calls").textContent = data.calls;
    document.getElementById("fallbacks").textContent = data.fallbacks;
    const body = document.getElementById("steps");
    body.replaceChildren();
    for (const [step, s] of Object.entries(data.steps)) {
      const tr = document.createElement("tr");
      for (const v of [step, s.calls, s.rows, s.refused, show(s.p50_ms), show(s.p99_ms)]) {
        const td = document.createElement("td");
        td.textContent = v;
        tr.appendChild(td);
      }
      body.appendChild(tr);
      const live = document.querySelector(`g[data-step="${CSS.escape(step)}"] .live`);
      if (live) live.textContent = `p50 ${show(s.p50_ms)} · p99 ${show(s.p99_ms)} ms · ${s.rows} rows`;
    }
  } catch (e) { /* the next tick tries again */ }
}
refresh();
setInterval(refresh, 2000);
