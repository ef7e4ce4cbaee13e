// The capacity lab (/console/planner/): sliders and number boxes kept in step, the analytic answer fetched as
// JSON as the inputs move (the server renders the results: serving/planner_views.py), scenario cards, the
// simulation check, and "from my fleet". Served from static/ so that a policy refusing inline scripts allows it.
(function () {
  "use strict";
  const form = document.getElementById("planner");
  if (!form) { return; }
  const results = document.getElementById("results");
  const status = document.getElementById("lab-status");  // what an action did (fleet, check, a refusal)
  const summary = document.getElementById("lab-summary");  // the answer to the inputs now, announced
  const sources = document.getElementById("lab-sources");
  const checkButton = document.getElementById("check");
  const fleetButton = document.getElementById("from-fleet");
  const sliders = Array.from(form.querySelectorAll("input.slider"));
  const STEPS = 1000;

  // --- sliders: positions 0..STEPS over [low, high], on a log scale where asked (0 sits at the left end) ---
  function position(slider, value) {
    const low = Number(slider.dataset.low), high = Number(slider.dataset.high);
    if (!Number.isFinite(value)) { return 0; }
    const v = Math.min(Math.max(value, low), high);
    if (slider.dataset.scale === "log") {
      const floor = Math.max(low, 1e-9);
      if (v <= floor) { return 0; }
      return Math.round(STEPS * Math.log(v / floor) / Math.log(high / floor));
    }
    return Math.round(STEPS * (v - low) / (high - low));
  }

  function valueAt(slider, pos) {
    const low = Number(slider.dataset.low), high = Number(slider.dataset.high);
    let v;
    if (slider.dataset.scale === "log") {
      const floor = Math.max(low, 1e-9);
      v = floor * Math.pow(high / floor, pos / STEPS);
    } else {
      v = low + (high - low) * pos / STEPS;
    }
    if (slider.dataset.integer) { return String(Math.round(v)); }
    return String(Number(v.toPrecision(v < 10 ? 2 : 3)));
  }

  function boxOf(slider) { return document.getElementById(slider.dataset.for); }

  function syncSlider(slider) { slider.value = String(position(slider, Number(boxOf(slider).value))); }

  sliders.forEach(function (slider) {
    syncSlider(slider);
    slider.addEventListener("input", function () {
      boxOf(slider).value = valueAt(slider, Number(slider.value));
      changed();
    });
    boxOf(slider).addEventListener("input", function () { syncSlider(slider); changed(); });
  });
  form.querySelectorAll("input[type=checkbox]").forEach(function (box) {
    box.addEventListener("change", changed);
  });

  // Autoscaled, the replicas are the autoscaler's pick (the results say how many): the input stands aside.
  const autoscale = form.elements.namedItem("autoscale");
  function replicasFollowAutoscale() {
    const off = Boolean(autoscale && autoscale.checked);
    ["in-replicas", "slider-replicas"].forEach(function (id) {
      const el = document.getElementById(id);
      if (el) { el.disabled = off; }
    });
    const hint = document.getElementById("range-replicas");
    if (hint) {
      hint.dataset.range = hint.dataset.range || hint.textContent;
      hint.textContent = off ? "autoscaled: the results show the autoscaler's pick" : hint.dataset.range;
    }
  }
  if (autoscale) { autoscale.addEventListener("change", replicasFollowAutoscale); }
  replicasFollowAutoscale();

  // --- the analytic answer: one request in flight, the newest inputs asked next; older answers never win ---
  let started = 0, shown = 0, inFlight = false, again = false;

  function query() {
    const params = new URLSearchParams(new FormData(form));
    params.delete("csrfmiddlewaretoken");
    params.set("format", "json");
    return params;
  }

  function show(seq, doc) {
    if (seq < shown) { return false; }
    shown = seq;
    results.innerHTML = doc.html;
    results.dataset.updates = String(Number(results.dataset.updates || 0) + 1);
    form.querySelectorAll("[aria-invalid]").forEach(function (el) { el.removeAttribute("aria-invalid"); });
    return true;
  }

  function refuse(doc) {
    status.textContent = doc.error || "the planner refused these inputs";
    status.dataset.state = "error";
    if (doc.field) {
      const box = document.getElementById("in-" + doc.field);
      if (box) { box.setAttribute("aria-invalid", "true"); }
    }
  }

  async function refresh() {
    if (inFlight) { again = true; return; }
    inFlight = true;
    again = false;
    results.dataset.busy = "1";  // until the newest inputs are answered (tests wait on it)
    const seq = ++started;
    try {
      const resp = await fetch("?" + query(), {headers: {"Accept": "application/json"}, credentials: "same-origin"});
      const doc = await resp.json();
      if (!resp.ok) { refuse(doc); } else if (show(seq, doc)) {
        if (status.dataset.state === "error") { status.dataset.state = ""; status.textContent = ""; }
        summary.textContent = "Bottleneck: " + doc.bottleneck + "; p99 " +
          (doc.p99_ms === null ? "unbounded" : doc.p99_ms.toFixed(0) + " ms");
      }
    } catch (err) {
      refuse({error: "the planner did not answer (" + err + ")"});
    } finally {
      inFlight = false;
      if (again) { refresh(); } else { results.dataset.busy = "0"; }
    }
  }

  function changed() {
    if (status.dataset.kind === "check") {  // the check was of the inputs before this change
      status.textContent = "";
      status.dataset.kind = "";
    }
    document.querySelectorAll(".card[aria-pressed=true]").forEach(function (c) {
      if (!c.dataset.applying) { c.setAttribute("aria-pressed", "false"); }
    });
    refresh();
  }

  // --- inputs from a card or the fleet ---
  function setInputs(inputs) {
    Object.keys(inputs).forEach(function (name) {
      const value = inputs[name];
      const el = form.elements.namedItem(name);
      if (!el) { return; }
      if (el.type === "checkbox") {
        el.checked = name === "device" ? value === "accelerator" : Boolean(value);
      } else {
        el.value = String(value);
      }
    });
    sliders.forEach(syncSlider);
    replicasFollowAutoscale();
  }

  document.querySelectorAll(".card").forEach(function (card) {
    card.addEventListener("click", function () {
      document.querySelectorAll(".card").forEach(function (c) { c.setAttribute("aria-pressed", "false"); });
      card.setAttribute("aria-pressed", "true");
      sources.textContent = "";
      setInputs(JSON.parse(card.dataset.inputs));
      card.dataset.applying = "1";
      changed();
      delete card.dataset.applying;
    });
  });

  fleetButton.addEventListener("click", async function () {
    fleetButton.disabled = true;
    status.dataset.state = "";
    status.textContent = "Reading the fleet…";
    try {
      const resp = await fetch("fleet/", {headers: {"Accept": "application/json"}, credentials: "same-origin"});
      const doc = await resp.json();
      if (!resp.ok) { refuse(doc); return; }
      setInputs(doc.inputs);
      sources.textContent = "";
      Object.keys(doc.sources).forEach(function (name) {
        const li = document.createElement("li");
        li.textContent = name + ": " + doc.sources[name];
        sources.appendChild(li);
      });
      if (doc.missing.length) {
        const li = document.createElement("li");
        li.textContent = "kept as they were (the fleet does not say): " + doc.missing.join(", ");
        sources.appendChild(li);
      }
      document.querySelectorAll(".card").forEach(function (c) { c.setAttribute("aria-pressed", "false"); });
      status.textContent = "Filled from the fleet: " + doc.nodes + " live nodes, " + doc.versions + " servable versions.";
      changed();
    } catch (err) {
      refuse({error: "the fleet did not answer (" + err + ")"});
    } finally {
      fleetButton.disabled = false;
    }
  });

  // --- the simulation check: POST the same inputs; its answer carries the plot with the simulated points ---
  form.addEventListener("submit", async function (event) {
    event.preventDefault();
    checkButton.disabled = true;
    status.dataset.state = "";
    status.textContent = "Simulating…";
    const seq = ++started;
    const body = new FormData(form);
    body.set("format", "json");
    try {
      const resp = await fetch(location.pathname, {
        method: "POST", body: body, headers: {"Accept": "application/json"}, credentials: "same-origin",
      });
      const doc = await resp.json();
      if (!resp.ok) { refuse(doc); return; }
      if (show(seq, doc)) {
        status.dataset.kind = "check";
        status.textContent = "Simulated " + doc.points.length + " rates (" + doc.simulation.requests +
          " requests at this one): p99 " + (doc.simulation.latency_ms.p99 === null ? "n/a" :
          doc.simulation.latency_ms.p99.toFixed(0) + " ms") + " against " +
          (doc.p99_ms === null ? "unbounded" : doc.p99_ms.toFixed(0) + " ms") + " analytic.";
      }
    } catch (err) {
      refuse({error: "the simulation did not answer (" + err + ")"});
    } finally {
      checkButton.disabled = false;
    }
  });
})();
