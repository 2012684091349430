// Ballast dashboard: the little that htmx attributes do not cover. No
// inline handlers anywhere (the CSP forbids them); everything is delegated.
(function () {
  "use strict";
  // "Select all" in the records list ticks every row's checkbox.
  document.addEventListener("change", function (e) {
    var t = e.target;
    if (t && t.classList && t.classList.contains("select-all")) {
      var boxes = document.querySelectorAll('input[type=checkbox][name=ids]');
      for (var i = 0; i < boxes.length; i++) { boxes[i].checked = t.checked; }
    }
  });
  // A request that never reached the server still tells the operator.
  document.addEventListener("htmx:sendError", function () {
    var flash = document.getElementById("flash");
    if (flash) {
      flash.textContent = "";
      var div = document.createElement("div");
      div.className = "flash error";
      div.textContent = "The server did not answer. Check your connection and try again.";
      flash.appendChild(div);
    }
  });
  // Keyboard shortcuts (`?` lists them): j/k move along a list of
  // records, x selects a row, r/p prepare a bulk retry/park, / searches.
  var current = -1;
  function rows() {
    return document.querySelectorAll("#records-list table.grid tbody tr");
  }
  function moveTo(i) {
    var all = rows();
    if (!all.length || all[0].querySelector("td.empty")) { return; }
    current = Math.max(0, Math.min(all.length - 1, i));
    for (var n = 0; n < all.length; n++) { all[n].classList.toggle("current", n === current); }
    var link = all[current].querySelector("a");
    if (link) { link.focus(); }
  }
  function box(row) { return row ? row.querySelector("input[type=checkbox][name=ids]") : null; }
  function prepare(action) {
    var form = document.getElementById("bulk");
    if (!form) { return; }
    var ticked = document.querySelectorAll("input[type=checkbox][name=ids]:checked");
    if (!ticked.length && current >= 0) {
      var b = box(rows()[current]);
      if (b) { b.checked = true; }
    }
    form.querySelector("select[name=action]").value = action;
    form.querySelector("input[name=reason]").focus();
  }
  document.addEventListener("keydown", function (e) {
    if (e.ctrlKey || e.metaKey || e.altKey || e.defaultPrevented) { return; }
    var t = e.target;
    var tag = t && t.tagName ? t.tagName.toLowerCase() : "";
    if (tag === "input" || tag === "textarea" || tag === "select" || (t && t.isContentEditable)) { return; }
    var help = document.getElementById("shortcuts");
    if (help && help.open) { return; }
    switch (e.key) {
      case "?":
        if (help) { help.showModal(); e.preventDefault(); }
        break;
      case "/":
        var q = document.querySelector("header .search input[name=q]");
        if (q) { q.focus(); e.preventDefault(); }
        break;
      case "j": moveTo(current + 1); break;
      case "k": moveTo(current - 1); break;
      case "x":
        var b = box(rows()[current]);
        if (b) { b.checked = !b.checked; }
        break;
      case "r": prepare("retry"); e.preventDefault(); break;
      case "p": prepare("park"); e.preventDefault(); break;
    }
  });
  // A new list (a filter changed) starts without a current row.
  document.addEventListener("htmx:afterSwap", function () { current = -1; });
  // Live parts (class `live`: they poll) stop asking while the page is
  // hidden or an operator pauses them.
  var paused = false;
  document.addEventListener("htmx:beforeRequest", function (e) {
    var elt = e.detail && e.detail.elt;
    if (elt && elt.classList && elt.classList.contains("live") && (paused || document.hidden)) {
      e.preventDefault();
    }
  });
  document.addEventListener("click", function (e) {
    var b = e.target;
    if (!b || b.id !== "live-toggle") { return; }
    paused = !paused;
    b.setAttribute("aria-pressed", paused ? "true" : "false");
    b.textContent = paused ? "Resume live updates" : "Pause live updates";
    var note = document.getElementById("live-note");
    if (note) {
      note.textContent = paused ? "Live updates paused: this page shows the record as it was."
                                : "This page follows the record as it changes.";
    }
  });
  // An action re-renders the record: its toggle says what still holds.
  document.addEventListener("htmx:afterSwap", function () {
    var b = document.getElementById("live-toggle");
    if (b && paused) {
      b.setAttribute("aria-pressed", "true");
      b.textContent = "Resume live updates";
    }
  });
  // A record's actions are not replaced under an operator filling them in
  // (a reason typed, a choice made, a field focused).
  function dirty(root) {
    if (root.contains(document.activeElement)) { return true; }
    var fields = root.querySelectorAll("input:not([type=hidden]), textarea");
    for (var i = 0; i < fields.length; i++) {
      if (fields[i].value !== fields[i].defaultValue) { return true; }
    }
    var selects = root.querySelectorAll("select");
    for (var j = 0; j < selects.length; j++) {
      for (var k = 0; k < selects[j].options.length; k++) {
        var o = selects[j].options[k];
        if (o.selected !== o.defaultSelected) { return true; }
      }
    }
    return false;
  }
  document.addEventListener("htmx:oobBeforeSwap", function (e) {
    var t = e.detail && e.detail.target;
    if (t && t.id === "record-actions" && dirty(t)) { e.detail.shouldSwap = false; }
  });
  // Say what changed where assistive technology listens.
  document.addEventListener("htmx:oobAfterSwap", function (e) {
    var t = e.detail && e.detail.target;
    var note = document.getElementById("live-note");
    var st = document.getElementById("record-state");
    if (t && t.id === "record-head" && note && st) {
      note.textContent = "The record changed: now " + st.textContent + ".";
    }
  });
  // Clear an old message when a new action starts.
  document.addEventListener("htmx:beforeRequest", function (e) {
    var flash = document.getElementById("flash");
    if (flash && e.detail && e.detail.requestConfig && e.detail.requestConfig.verb !== "get") {
      flash.textContent = "";
    }
  });
})();
