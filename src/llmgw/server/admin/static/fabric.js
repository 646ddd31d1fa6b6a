// llmgw fabric page (first slice): the topology's counts; the canvas drawing follows.
"use strict";
(function () {
  const fabric = document.body.dataset.fabric;
  const message = document.getElementById("fabric-message");
  window.llmgwFabric = { ready: false, switches: 0, adapters: 0 };
  fetch("/api/v1/fabrics/" + encodeURIComponent(fabric) + "/topology", { credentials: "same-origin" })
    .then((r) => r.ok ? r.json() : Promise.reject(new Error("HTTP " + r.status)))
    .then((topo) => {
      window.llmgwFabric = { ready: true, switches: topo.switches.length, adapters: topo.adapters.length };
      document.getElementById("fabric-counts").textContent =
        topo.switches.length + " switches, " + topo.adapters.length + " adapters, " + topo.links.length + " cables";
      message.textContent = "";
    })
    .catch((err) => { message.textContent = "cannot load the topology: " + err.message; });
})();
