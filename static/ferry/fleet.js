// The fleet page (templates/console/fleet.html): the server renders every section; the socket sends them again
// as the fleet changes. A file of its own, not an inline script: the console's Content-Security-Policy runs
// scripts from this server's static files only.
(function () {
  const live = document.getElementById("fleet-live");
  let delay = 500;
  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const socket = new WebSocket(scheme + location.host + "/ws/fleet/");
    socket.onopen = function () { delay = 500; live.dataset.state = "live"; live.textContent = "live"; };
    socket.onmessage = function (message) {
      const data = JSON.parse(message.data);
      if (data.type !== "fleet") { return; }
      document.getElementById("fleet-nodes").innerHTML = data.html.nodes;
      document.getElementById("fleet-events").innerHTML = data.html.events;
      document.getElementById("fleet-versions").innerHTML = data.html.versions;
      live.dataset.updates = String(Number(live.dataset.updates || 0) + 1);
    };
    socket.onclose = function () {
      live.dataset.state = "reconnecting"; live.textContent = "reconnecting…";
      setTimeout(connect, delay);
      delay = Math.min(delay * 2, 10000);
    };
  }
  connect();
})();
