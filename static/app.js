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
  // Clear an old message when a new action starts.
  document.addEventListener("htmx:beforeRequest", function (e) {
    var flash = document.getElementById("flash");
    if (flash && e.detail && e.detail.requestConfig && e.detail.requestConfig.verb !== "get") {
      flash.textContent = "";
    }
  });
})();
