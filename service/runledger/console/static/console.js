// runledger console: live updates. The server sends an event on /api/stream (server-sent
// events, driven by LISTEN runledger_events) for each change an operator sees; this page
// then fetches its own fragment (?fragment=1) and swaps it in. On a read replica (a hot
// standby: no NOTIFY reaches it) the stream says "replica" and the page polls instead.
// No build step.
(function () {
  "use strict";
  var body = document.body;
  var main = document.getElementById("live");
  var badge = document.getElementById("live-state");
  var stale = document.getElementById("stale");
  if (!main || !window.EventSource) { return; }
  var run = body.getAttribute("data-run");
  var poll = parseInt(body.getAttribute("data-poll") || "0", 10);
  var busy = false, again = false, timer = null, editing = false, refreshes = 0;
  var replicaPoll = null;

  function state(on, text) {
    body.setAttribute("data-live", on ? "on" : "off");
    badge.className = "live " + (on ? "on" : "off");
    badge.textContent = text;
  }

  main.addEventListener("input", function () { editing = true; });

  function swap(html) {
    main.innerHTML = html;
    refreshes += 1;
    body.setAttribute("data-refreshes", String(refreshes));
  }

  function refresh() {
    timer = null;
    if (busy) { again = true; return; }
    if (editing) { stale.hidden = false; return; }
    busy = true;
    var url = new URL(window.location.href);
    url.searchParams.set("fragment", "1");
    url.hash = "";
    fetch(url.toString(), { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) { if (html !== null && !editing) { swap(html); } })
      .catch(function () {})
      .then(function () {
        busy = false;
        if (again) { again = false; schedule(); }
      });
  }

  function schedule() {
    if (timer === null) { timer = window.setTimeout(refresh, 200); }
  }

  document.getElementById("stale-reload").addEventListener("click", function () {
    editing = false;
    stale.hidden = true;
    refresh();
  });

  var source = new EventSource("/api/stream" + (run ? "?run=" + encodeURIComponent(run) : ""));
  var opened = false;
  source.addEventListener("ready", function () {
    state(true, "live");
    if (replicaPoll !== null) { window.clearInterval(replicaPoll); replicaPoll = null; }
    if (opened) { schedule(); }  // back after a break: what changed meanwhile
    opened = true;
  });
  source.addEventListener("replica", function (e) {
    state(false, "read replica: no live updates");
    var every = 5;
    try { every = JSON.parse(e.data).poll || every; } catch (err) { /* the default */ }
    if (replicaPoll === null && !(poll > 0)) {
      replicaPoll = window.setInterval(schedule, every * 1000);
    }
    opened = true;
  });
  source.addEventListener("change", schedule);
  source.addEventListener("resync", schedule);
  source.addEventListener("offline", function () { state(false, "offline"); });
  source.onerror = function () { state(false, "reconnecting"); };
  if (poll > 0) { window.setInterval(schedule, poll * 1000); }
})();
