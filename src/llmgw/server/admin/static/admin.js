// llmgw admin pages: keep a server-rendered page live. Every 15 s the page fetches itself and
// swaps its <main> for the new one (the server escaped everything in it); scroll position and
// open <details> survive. Written for these pages, no library.
"use strict";
(function () {
  const main = document.getElementById("main");
  const stamp = document.getElementById("updated");
  const shown = () => { if (stamp) stamp.textContent = "updated " + new Date().toLocaleTimeString(); };
  shown();
  if (!main || !main.dataset.refresh) return;
  const every = Number(main.dataset.refresh) * 1000;
  async function refresh() {
    try {
      const response = await fetch(location.href, { credentials: "same-origin", cache: "no-store" });
      if (!response.ok) { if (stamp) stamp.textContent = "refresh failed: HTTP " + response.status; return; }
      const doc = new DOMParser().parseFromString(await response.text(), "text/html");
      const fresh = doc.getElementById("main");
      if (!fresh) return;
      const open = new Set([...main.querySelectorAll("details[open]")].map((d, i) => i));
      const y = window.scrollY;
      main.replaceChildren(...fresh.childNodes);
      main.querySelectorAll("details").forEach((d, i) => { if (open.has(i)) d.open = true; });
      window.scrollTo(0, y);
      shown();
    } catch (err) {
      if (stamp) stamp.textContent = "refresh failed: " + err.message;
    }
  }
  window.setInterval(refresh, every);
})();
