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
  document.addEventListener("htmx:sendError", function (e) {
    // A poll that cannot reach the server says so once, quietly.
    if (e.target && e.target.classList && e.target.classList.contains("live")) {
      var note = document.getElementById("live-note");
      var text = "The server did not answer; trying again.";
      if (note && note.textContent !== text) { note.textContent = text; }
      return;
    }
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
  var currentId = null;
  function rows() {
    return document.querySelectorAll("#records-list table.grid tbody tr");
  }
  function moveTo(i) {
    var all = rows();
    if (!all.length || all[0].querySelector("td.empty")) { return; }
    current = Math.max(0, Math.min(all.length - 1, i));
    for (var n = 0; n < all.length; n++) {
      all[n].classList.toggle("current", n === current);
      if (n === current) { all[n].setAttribute("aria-current", "true"); } else { all[n].removeAttribute("aria-current"); }
    }
    var link = all[current].querySelector("a");
    if (link) { link.focus(); }
    var b = box(all[current]);
    currentId = b ? b.value : (link ? link.textContent : null);
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
  // Keys go to a field being typed in, not to the shortcuts (a checkbox
  // or a button is not typed in).
  function typing(t) {
    if (!t || !t.tagName) { return false; }
    var tag = t.tagName.toLowerCase();
    if (tag === "textarea" || tag === "select" || t.isContentEditable) { return true; }
    if (tag !== "input") { return false; }
    return ["checkbox", "radio", "button", "submit", "reset"].indexOf((t.type || "text").toLowerCase()) < 0;
  }
  document.addEventListener("keydown", function (e) {
    if (e.ctrlKey || e.metaKey || e.altKey || e.defaultPrevented || typing(e.target)) { return; }
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
  // A new list keeps the current row if its record is still there (the
  // list updated itself), else starts without one (a filter changed).
  document.addEventListener("htmx:afterSwap", function (e) {
    var t = e.detail && e.detail.target;
    if (!t || t.id !== "records-list") { return; }
    var was = currentId;
    current = -1;
    currentId = null;
    var all = rows();
    for (var n = 0; was !== null && n < all.length; n++) {
      var b = box(all[n]);
      var link = all[n].querySelector("a");
      var id = b ? b.value : (link ? link.textContent : null);
      if (id === was) {
        current = n;
        currentId = was;
        all[n].classList.add("current");
        all[n].setAttribute("aria-current", "true");
      }
    }
  });

  // Live parts (class `live`: they poll) stop asking while the page is
  // hidden, while an operator pauses them, and for good once the server
  // refuses one (the page says so; it is never sent to the login page
  // under a reason being typed).
  var paused = false;
  var stopped = false;
  var behind = false;
  var lastState = null;
  function say(text) {
    var note = document.getElementById("live-note");
    if (note) { note.textContent = text; }
  }
  function isLive(elt) { return elt && elt.classList && elt.classList.contains("live"); }
  document.addEventListener("htmx:beforeRequest", function (e) {
    if (isLive(e.target)) {
      if (paused || stopped || document.hidden) { e.preventDefault(); }
      return;
    }
    // An action starts: a poll still in flight would land after it and
    // put back (or remove) what the action replaces.
    if (window.htmx) {
      var live = document.querySelectorAll(".live");
      for (var i = 0; i < live.length; i++) { window.htmx.trigger(live[i], "htmx:abort"); }
    }
  });
  document.addEventListener("htmx:beforeOnLoad", function (e) {
    var xhr = e.detail && e.detail.xhr;
    if (isLive(e.target) && xhr && xhr.status >= 400) {
      e.preventDefault();
      stopped = true;
      say("Live updates stopped: the server answered " + xhr.status + ". Reload the page to follow it again.");
    }
  });
  // Actions kept while being filled in are brought up to date by the
  // first poll after the operator leaves them.
  document.addEventListener("htmx:configRequest", function (e) {
    // A page refreshing itself is no one using the session: the server
    // does not count it against the idle timeout.
    if (isLive(e.target)) { e.detail.headers["X-Ballast-Live"] = "1"; }
    var actions = document.getElementById("record-actions");
    if (isLive(e.target) && behind && actions && !dirty(actions)) {
      e.detail.path = e.detail.path.replace(/([?&]v=)[^&]*/, "$1");
    }
  });
  document.addEventListener("click", function (e) {
    var b = e.target;
    if (!b || b.id !== "live-toggle") { return; }
    paused = !paused;
    b.setAttribute("aria-pressed", paused ? "true" : "false");
    say(paused ? "Live updates paused: this page shows what it showed then."
               : "Live updates resumed.");
  });
  // An action re-renders the record: its toggle and note say what holds.
  document.addEventListener("htmx:afterSwap", function (e) {
    var t = e.detail && e.detail.target;
    if (!t || t.id !== "detail") { return; }
    var b = document.getElementById("live-toggle");
    if (b && paused) {
      b.setAttribute("aria-pressed", "true");
      say("Live updates paused: this page shows what it showed then.");
    }
    var st = document.getElementById("record-state");
    lastState = st ? st.textContent : null;
  });
  // A record's actions are not replaced under an operator filling them in
  // (a reason typed, a choice made, a field focused).
  function dirty(root) {
    if (root.contains(document.activeElement)) { return true; }
    var fields = root.querySelectorAll("input:not([type=hidden]), textarea");
    for (var i = 0; i < fields.length; i++) {
      var f = fields[i];
      var box = f.type === "checkbox" || f.type === "radio";
      if (box ? f.checked !== f.defaultChecked : f.value !== f.defaultValue) { return true; }
    }
    var selects = root.querySelectorAll("select");
    for (var j = 0; j < selects.length; j++) {
      var s = selects[j];
      var initial = 0;
      for (var k = 0; k < s.options.length; k++) {
        if (s.options[k].defaultSelected) { initial = k; break; }
      }
      if (s.options.length && s.selectedIndex !== initial) { return true; }
    }
    return false;
  }
  // A live part holding a form being filled in (a pause reason) waits,
  // and says so; it updates again once the form is left.
  var held = false;
  document.addEventListener("htmx:beforeSwap", function (e) {
    // Only a live part's own poll: an action or a filter aimed at it
    // always lands.
    var src = e.detail.requestConfig && e.detail.requestConfig.elt;
    var status = e.detail.xhr.status;
    if (!isLive(e.target) || src !== e.target || status === 204 || status >= 400) { return; }
    if (dirty(e.target)) {
      e.detail.shouldSwap = false;
      if (!held) { say("Updates wait while a form here is being filled in."); }
      held = true;
    } else if (held) {
      held = false;
      var note = document.getElementById("live-note");
      if (note && note.dataset.usual) { say(note.dataset.usual); }
    }
  });
  document.addEventListener("htmx:oobBeforeSwap", function (e) {
    var t = e.detail && e.detail.target;
    if (t && t.id === "record-actions" && dirty(t)) {
      e.detail.shouldSwap = false;
      behind = true;
    }
  });
  // Say what changed where assistive technology listens: a new state.
  document.addEventListener("htmx:oobAfterSwap", function (e) {
    var t = e.detail && e.detail.target;
    // (Fired for a swap that was held back too.)
    if (t && t.id === "record-actions" && e.detail.shouldSwap) { behind = false; }
    var st = document.getElementById("record-state");
    if (t && t.id === "record-head" && st) {
      if (lastState !== null && st.textContent !== lastState) {
        say("The record changed: now " + st.textContent + ".");
      }
      lastState = st.textContent;
    }
  });
  // On a phone the records filters start closed (the list on the first
  // screen) unless one is set; on wider screens they stay open.
  function foldFilters() {
    var box = document.querySelector("details.filter-box");
    if (box && box.dataset.filtered !== "1" && window.matchMedia("(max-width: 40rem)").matches) {
      box.open = false;
    }
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", foldFilters);
  } else {
    foldFilters();
  }
  document.addEventListener("DOMContentLoaded", function () {
    var st = document.getElementById("record-state");
    lastState = st ? st.textContent : null;
  });
  // Clear an old message when a new action starts.
  document.addEventListener("htmx:beforeRequest", function (e) {
    var flash = document.getElementById("flash");
    if (flash && e.detail && e.detail.requestConfig && e.detail.requestConfig.verb !== "get") {
      flash.textContent = "";
    }
  });
})();
