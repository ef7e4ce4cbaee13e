// The models page (templates/console/models.html): each version's live figures, refreshed every 2 s. A file of
// its own, not an inline script: the console's Content-Security-Policy runs scripts from this server's static
// files only. The page's script tag names the live figures' URL (data-live-url).
const LIVE_URL = document.currentScript.dataset.liveUrl;
async function refresh() {
  try {
    const r = await fetch(LIVE_URL, {credentials: "same-origin"});
    if (!r.ok) return;
    const data = (await r.json()).versions;
    for (const tr of document.querySelectorAll("tr[data-key]")) {
      const live = data[tr.dataset.key];
      if (!live) continue;
      const show = (v) => v === null ? "—" : v;
      tr.querySelector(".rate").textContent = show(live.rate);
      tr.querySelector(".errors").textContent = show(live.errors);
      tr.querySelector(".p50").textContent = show(live.p50_ms);
      tr.querySelector(".p99").textContent = show(live.p99_ms);
      tr.querySelector(".batch").textContent = show(live.mean_batch);
      tr.querySelector(".loaded").textContent = live.loaded ? "loaded" : "—";
      const sat = tr.querySelector(".sat"), level = live.saturation.level;
      sat.textContent = show(level);
      sat.className = "sat sat-" + (level === null ? "none" : level);
      tr.querySelector(".sat-detail").textContent = level === null ? "no answers" :
        `${live.saturation.fallback_pct}% fb · ${live.saturation.shed_pct}% shed · ${live.saturation.error_pct}% err`;
    }
  } catch (e) { /* the next tick tries again */ }
}
setInterval(refresh, 2000);
