// server.mjs: a toy payments API. Each charge takes 1.5 s. With an
// Idempotency-Key header, the first result is stored and replayed.
import { createHash } from "node:crypto";
import http from "node:http";

const charges = [];
const keys = new Map(); // key -> { fingerprint, done, status, body }
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function reply(res, status, body, headers = {}) {
  res.writeHead(status, { "Content-Type": "application/json", ...headers });
  res.end(JSON.stringify(body) + "\n");
}

http
  .createServer(async (req, res) => {
    if (req.method === "GET") return reply(res, 200, { charges: charges.length });
    let raw = "";
    for await (const chunk of req) raw += chunk;
    const key = req.headers["idempotency-key"];
    const fingerprint = createHash("sha256").update(raw).digest("hex");
    if (key) {
      const seen = keys.get(key);
      if (seen && seen.fingerprint !== fingerprint)
        return reply(res, 422, { error: "key reused with a different body" });
      if (seen && !seen.done)
        return reply(res, 409, { error: "a request with this key is in progress" });
      if (seen) return reply(res, seen.status, seen.body, { "Idempotent-Replayed": "true" });
      keys.set(key, { fingerprint, done: false }); // claim the key BEFORE the work
    }
    await sleep(1500); // the slow part, like a call to a card network
    const charge = { id: `ch_${charges.length + 1}`, body: raw };
    charges.push(charge);
    if (key) keys.set(key, { fingerprint, done: true, status: 201, body: charge });
    console.log("charges so far:", charges.length);
    reply(res, 201, charge);
  })
  .listen(4242, "127.0.0.1", () => console.log("listening on 127.0.0.1:4242"));
