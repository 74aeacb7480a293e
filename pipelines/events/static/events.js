// The events page: cameras with their latest snapshot, a live timeline, search, a detail view.
//
// Descriptions are untrusted text (a camera scene can carry words that prompt-inject the
// VLM), so every value reaches the page through textContent or an attribute set on an
// element we created; nothing here parses HTML. The API key (when the server wants one) is
// asked once, kept in localStorage and sent as an Authorization header: the live stream is
// read with fetch() (EventSource cannot send headers) and snapshots are loaded as blobs.
"use strict";

(() => {
  const KEY_STORAGE = "vision-serve-ui-key";
  const PAGE_SIZE = 50;
  const $ = (id) => document.getElementById(id);

  const state = {
    key: localStorage.getItem(KEY_STORAGE) || "",
    q: "",
    camera: "",
    next: null,
    lastSeq: 0,
    rendered: new Map(), // event id -> its <li>
    stream: null, // AbortController of the live stream
    detailId: null,
    camerasTimer: null,
  };

  class Unauthorized extends Error {}

  // -- DOM helpers: elements and text only -----------------------------------------------
  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function when(ts) {
    return ts ? new Date(ts * 1000).toLocaleString() : "–";
  }

  function status(text) {
    $("status").textContent = text;
  }

  // -- API -------------------------------------------------------------------------------
  async function api(path, options = {}) {
    const headers = new Headers(options.headers || {});
    if (state.key) headers.set("Authorization", "Bearer " + state.key);
    const res = await fetch(path, { ...options, headers, cache: "no-store" });
    if (res.status === 401) {
      askForKey();
      throw new Unauthorized("API key needed");
    }
    return res;
  }

  async function apiJson(path, options) {
    const res = await api(path, options);
    const body = await res.json();
    if (!res.ok) throw new Error((body.error && body.error.message) || res.statusText);
    return body;
  }

  function eventPath(id) {
    return "/api/events/" + encodeURIComponent(id);
  }

  async function showSnapshot(img, id, boxes) {
    const res = await api(eventPath(id) + "/snapshot.jpg?boxes=" + (boxes ? 1 : 0));
    const previous = img.dataset.blob;
    if (!res.ok) {
      img.removeAttribute("src");
      img.alt = "no snapshot";
    } else {
      const url = URL.createObjectURL(await res.blob());
      img.src = url;
      img.dataset.blob = url;
    }
    if (previous) URL.revokeObjectURL(previous);
  }

  // -- the key ---------------------------------------------------------------------------
  function askForKey() {
    $("key-form").hidden = false;
    $("key").focus();
    status("An API key is needed.");
  }

  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.key = $("key").value.trim();
    localStorage.setItem(KEY_STORAGE, state.key);
    $("key").value = "";
    $("key-form").hidden = true;
    start();
  });

  $("forget-key").addEventListener("click", () => {
    localStorage.removeItem(KEY_STORAGE);
    state.key = "";
    if (state.stream) state.stream.abort();
    askForKey();
  });

  // -- cameras ---------------------------------------------------------------------------
  const STATES = new Set(["online", "disconnected", "stale", "offline"]);

  function seconds(value) {
    return value == null ? "–" : Number(value).toFixed(1) + " s";
  }

  // the pipeline's live numbers (null: no pipeline reads this camera) and the queue's
  function liveLine(cam) {
    const live = cam.live;
    const state = live && STATES.has(live.state) ? live.state : "offline";
    const line = el("p", "camera-live");
    line.dataset.state = state;
    line.append(el("span", "badge state-" + state, state));
    if (live) {
      const rate = Number(live.decoded_fps || 0).toFixed(1);
      const fps = el("span", "counter counter-fps", "fps " + rate);
      fps.title = "decoded per second; sampled: " + live.sampled + ", detected: " + live.detected;
      const drops = el("span", "counter counter-drops", "drops " + live.dropped_total);
      const reasons = Object.entries(live.dropped || {}).map(([k, v]) => k + ": " + v);
      drops.title = reasons.length ? reasons.join(", ") : "no frames dropped";
      const sent = el("span", "counter counter-enqueued", "sent " + live.enqueued);
      sent.title = "frames this pipeline put on the queue";
      line.append(fps, drops, sent);
    }
    const waiting = el("span", "counter counter-queue", "queue " + (cam.queued ?? "–"));
    waiting.title = "frames of this camera no describer has taken yet";
    const lag = el("span", "counter counter-lag", "lag " + seconds(cam.describer_lag_s));
    lag.title = "capture to description of the latest description";
    line.append(waiting, lag);
    if (live && live.last_error && state !== "online") line.title = live.last_error;
    return line;
  }

  async function loadCameras() {
    const body = await apiJson("/api/cameras");
    const box = $("cameras");
    const filter = $("camera-filter");
    const known = new Set(Array.from(filter.options, (o) => o.value));
    const cards = [];
    for (const cam of body.data) {
      if (!known.has(cam.id)) {
        const option = el("option", null, cam.id);
        option.value = cam.id;
        filter.append(option);
      }
      const card = el("article", "camera");
      card.dataset.camera = cam.id;
      card.append(el("h3", null, cam.id));
      card.append(liveLine(cam));
      const latest = cam.latest;
      if (latest) {
        const img = el("img", "snapshot");
        img.alt = "latest snapshot of " + cam.id;
        if (latest.has_snapshot) showSnapshot(img, latest.id, true).catch(() => {});
        img.addEventListener("click", () => openDetail(latest.id));
        card.append(img);
        card.append(el("p", "camera-text description", latest.text));
        card.append(el("p", "meta", when(latest.ts) + " · persons: " + latest.persons));
      } else {
        card.append(el("p", "meta", "no events yet"));
      }
      cards.push(card);
    }
    box.replaceChildren(...cards);
    const redis = body.redis || {};
    const parts = ["events stored: " + body.events.stored];
    if (redis.error) parts.push(redis.error);
    if (redis.queue) {
      parts.push("queue lag: " + redis.queue.lag, "pending: " + redis.queue.pending);
      parts.push("oldest waiting: " + seconds(redis.queue.lag_seconds));
    }
    if (redis.accounting) parts.push("described: " + redis.accounting.described);
    status(parts.join(" · "));
    $("forget-key").hidden = !state.key;
  }

  function refreshCamerasSoon() {
    if (state.camerasTimer) return;
    state.camerasTimer = setTimeout(() => {
      state.camerasTimer = null;
      loadCameras().catch(() => {});
    }, 500);
  }

  // -- the timeline ----------------------------------------------------------------------
  function eventItem(ev) {
    const li = el("li", "event");
    li.dataset.id = ev.id;
    li.dataset.seq = String(ev.seq);
    const head = el("div", "event-head");
    head.append(el("span", "event-camera", ev.camera));
    head.append(el("time", "event-time", when(ev.ts)));
    head.append(el("span", "event-persons", "persons: " + ev.persons));
    li.append(head, el("p", "event-text description", ev.text));
    li.tabIndex = 0;
    li.addEventListener("click", () => openDetail(ev.id));
    li.addEventListener("keydown", (e) => {
      if (e.key === "Enter") openDetail(ev.id);
    });
    return li;
  }

  function remember(ev) {
    state.lastSeq = Math.max(state.lastSeq, ev.seq);
  }

  async function loadEvents(reset) {
    const params = new URLSearchParams({ limit: String(PAGE_SIZE) });
    if (state.q) params.set("q", state.q);
    if (state.camera) params.set("camera", state.camera);
    if (!reset && state.next) params.set("before", state.next);
    const list = $("events");
    let body;
    try {
      body = await apiJson("/api/events?" + params);
    } catch (err) {
      if (!(err instanceof Unauthorized)) $("timeline-note").textContent = err.message;
      $("timeline-note").hidden = false;
      throw err;
    }
    if (reset) {
      list.replaceChildren();
      state.rendered.clear();
      $("timeline-note").hidden = true;
    }
    for (const ev of body.data) {
      remember(ev);
      if (state.rendered.has(ev.id)) continue;
      const li = eventItem(ev);
      state.rendered.set(ev.id, li);
      list.append(li);
    }
    state.next = body.next;
    $("more").hidden = !body.next;
    $("timeline-title").textContent = state.q ? "Search: " + state.q : "Latest events";
    if (reset && !body.data.length) {
      $("timeline-note").textContent = state.q ? "Nothing matches." : "No events yet.";
      $("timeline-note").hidden = false;
    }
  }

  function onLiveEvent(ev) {
    remember(ev);
    refreshCamerasSoon();
    if (state.rendered.has(ev.id)) return;
    if (state.q || (state.camera && state.camera !== ev.camera)) {
      $("timeline-note").textContent = "New events arrived; clear the search to see them.";
      $("timeline-note").hidden = false;
      return;
    }
    const li = eventItem(ev);
    li.classList.add("new");
    state.rendered.set(ev.id, li);
    $("events").prepend(li);
    $("timeline-note").hidden = true;
  }

  // -- the live stream (server-sent events over fetch) -----------------------------------
  async function stream() {
    if (state.stream) state.stream.abort();
    const controller = new AbortController();
    state.stream = controller;
    let delay = 1000;
    while (!controller.signal.aborted) {
      try {
        const after = state.lastSeq ? "?after=" + state.lastSeq : "";
        const res = await api("/api/events/stream" + after, { signal: controller.signal });
        if (!res.ok || !res.body) throw new Error("stream: HTTP " + res.status);
        delay = 1000;
        const reader = res.body.getReader();
        const decoder = new TextDecoder();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += decoder.decode(value, { stream: true });
          let end;
          while ((end = buffer.indexOf("\n\n")) >= 0) {
            handleBlock(buffer.slice(0, end));
            buffer = buffer.slice(end + 2);
          }
        }
      } catch (err) {
        if (controller.signal.aborted || err instanceof Unauthorized) return;
      }
      await new Promise((resolve) => setTimeout(resolve, delay));
      delay = Math.min(delay * 2, 15000);
    }
  }

  function handleBlock(block) {
    let name = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith("event:")) name = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
    }
    if (name !== "event" || !data.length) return;
    try {
      onLiveEvent(JSON.parse(data.join("\n")));
    } catch (err) {
      // a malformed block: skip it, the next one is independent
    }
  }

  // -- the detail view -------------------------------------------------------------------
  function fillDetail(ev) {
    $("detail-title").textContent = ev.camera + " · " + when(ev.ts);
    $("detail-text").textContent = ev.text;
    const meta = $("detail-meta");
    meta.replaceChildren();
    const rows = [
      ["event", ev.id],
      ["captured", when(ev.ts)],
      ["described", when(ev.described_at)],
      ["model", ev.model],
      ["persons", ev.persons],
      ["latency", ev.latency_s == null ? "–" : ev.latency_s.toFixed(2) + " s"],
    ];
    for (const [k, v] of rows) meta.append(el("dt", null, k), el("dd", null, v == null ? "–" : v));
    const history = $("detail-history");
    history.replaceChildren(
      ...(ev.history || [])
        .slice()
        .reverse()
        .map((h) => {
          const li = el("li", "history-item");
          li.append(el("p", "description", h.text), el("p", "meta", when(h.described_at)));
          return li;
        })
    );
    $("detail-history-title").hidden = !history.children.length;
    $("redescribe").disabled = !ev.has_snapshot;
    const li = state.rendered.get(ev.id);
    if (li) li.querySelector(".event-text").textContent = ev.text;
  }

  async function openDetail(id) {
    state.detailId = id;
    $("detail-error").textContent = "";
    try {
      const ev = await apiJson(eventPath(id));
      if (state.detailId !== id) return;
      fillDetail(ev);
      $("detail").hidden = false;
      await showSnapshot($("detail-img"), id, $("detail-boxes").checked);
    } catch (err) {
      if (!(err instanceof Unauthorized)) status("Error: " + err.message);
    }
  }

  $("detail-boxes").addEventListener("change", () => {
    if (state.detailId) showSnapshot($("detail-img"), state.detailId, $("detail-boxes").checked);
  });

  $("detail-close").addEventListener("click", () => {
    $("detail").hidden = true;
    state.detailId = null;
  });

  $("redescribe").addEventListener("click", async () => {
    const id = state.detailId;
    if (!id) return;
    const button = $("redescribe");
    button.disabled = true;
    $("detail-error").textContent = "Describing…";
    try {
      const ev = await apiJson(eventPath(id) + "/describe", { method: "POST" });
      if (state.detailId === id) fillDetail(ev);
      $("detail-error").textContent = "";
      refreshCamerasSoon();
    } catch (err) {
      $("detail-error").textContent = err.message;
    } finally {
      button.disabled = false;
    }
  });

  // -- search ----------------------------------------------------------------------------
  $("search").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.q = $("q").value.trim();
    state.camera = $("camera-filter").value;
    loadEvents(true).catch(() => {});
  });

  $("clear").addEventListener("click", () => {
    $("q").value = "";
    $("camera-filter").value = "";
    state.q = "";
    state.camera = "";
    loadEvents(true).catch(() => {});
  });

  $("more").addEventListener("click", () => loadEvents(false).catch(() => {}));

  // -- start -----------------------------------------------------------------------------
  async function start() {
    try {
      await loadCameras();
      stream();
      await loadEvents(true);
      document.body.dataset.ready = "1";
    } catch (err) {
      if (!(err instanceof Unauthorized)) status("Error: " + err.message);
    }
  }

  setInterval(() => {
    if (!$("key-form").hidden) return;
    loadCameras().catch(() => {});
  }, 5000);

  start();
})();
