// The live tail of a running job's log: asks for what follows the bytes shown, waiting
// on the server for more, and appends it as text (never as markup) until the run ends.
(function () {
  "use strict";
  var log = document.getElementById("log");
  if (!log || log.dataset.live !== "true") { return; }
  var state = document.getElementById("tail-state");
  var offset = Number(log.dataset.offset || "0");
  var attempt = log.dataset.attempt || "";
  var decoder = new TextDecoder();
  function next() {
    var url = log.dataset.url + "?follow=true&waitMs=20000&offset=" + offset +
      (attempt ? "&attempt=" + encodeURIComponent(attempt) : "");
    fetch(url, { credentials: "same-origin", cache: "no-store" }).then(function (r) {
      if (!r.ok) { throw new Error("the server answered " + r.status); }
      var from = r.headers.get("ql-log-attempt") || "";
      var done = r.headers.get("ql-run-terminal") === "true";
      return r.arrayBuffer().then(function (body) {
        if (from && from !== attempt) { attempt = from; offset = 0; log.textContent = ""; }
        offset = Number(r.headers.get("ql-log-offset") || "0") + body.byteLength;
        log.appendChild(document.createTextNode(decoder.decode(body, { stream: !done })));
        log.scrollTop = log.scrollHeight;
        if (done && body.byteLength === 0) {
          if (state) { state.textContent = "the run has ended: reload for its stored log"; }
          return;
        }
        next();
      });
    }).catch(function (e) {
      if (state) { state.textContent = "live tail stopped: " + e.message; }
    });
  }
  if (state) { state.textContent = "following the log as it grows"; }
  next();
}());
