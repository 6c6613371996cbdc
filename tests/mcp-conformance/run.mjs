// The MCP conformance suite (npm @modelcontextprotocol/conformance, the
// version package-lock.json pins) against `cairn serve`'s /mcp.
//
// The suite's client sends no credentials, so it reaches /mcp through a
// loopback relay that adds the bearer token of a token this script makes
// (every other byte passes through as sent, streams included). Scenarios
// listed in expected-failures.yml are the suite's own baseline: each is
// there with the reason. Exits non-zero when any other scenario fails, or
// one listed passes.
//
// The binary is $CAIRN_BIN, else target/<host tuple>/debug/cairn.

import { execFileSync, spawn } from 'node:child_process'
import { mkdtempSync, rmSync } from 'node:fs'
import http from 'node:http'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'

const here = fileURLToPath(new URL('.', import.meta.url))
const repo = join(here, '..', '..')
const binary =
  process.env.CAIRN_BIN ||
  join(repo, 'target', execFileSync('rustc', ['--print', 'host-tuple']).toString().trim(), 'debug', 'cairn')

function listen(server) {
  return new Promise((resolve) => server.listen(0, '127.0.0.1', () => resolve(server.address().port)))
}

async function freePort() {
  const s = http.createServer()
  const port = await listen(s)
  await new Promise((r) => s.close(r))
  return port
}

const home = mkdtempSync(join(tmpdir(), 'cairn-mcp-conformance-'))
const env = { ...process.env, CAIRN_HOME: home }
const secret = execFileSync(binary, ['token', 'create', 'conformance'], { env })
  .toString()
  .split(/\s+/)
  .find((w) => w.length >= 20)
const apiPort = await freePort()
const server = spawn(binary, ['serve', '--listen', `127.0.0.1:${apiPort}`], { env, stdio: 'ignore' })
let status = 1
try {
  const deadline = Date.now() + 30_000
  for (;;) {
    try {
      await fetch(`http://127.0.0.1:${apiPort}/healthz`)
      break
    } catch {}
    if (Date.now() > deadline) throw new Error('cairn serve did not start')
    await new Promise((r) => setTimeout(r, 100))
  }
  const relay = http.createServer((req, res) => {
    const headers = { ...req.headers, authorization: `Bearer ${secret}` }
    const up = http.request({ host: '127.0.0.1', port: apiPort, method: req.method, path: req.url, headers }, (r) => {
      res.writeHead(r.statusCode, r.headers)
      r.pipe(res)
    })
    up.on('error', () => res.destroy())
    req.pipe(up)
  })
  const relayPort = await listen(relay)
  const suite = join(here, 'node_modules', '@modelcontextprotocol', 'conformance', 'dist', 'index.js')
  // Every scenario, pending ones included, against the baseline; more
  // arguments (`--scenario NAME`, `-o DIR`) are passed on.
  const args = [
    suite,
    'server',
    '--url',
    `http://127.0.0.1:${relayPort}/mcp`,
    '--suite',
    'all',
    '--expected-failures',
    join(here, 'expected-failures.yml'),
    ...process.argv.slice(2),
  ]
  status = await new Promise((resolve) => {
    const run = spawn(process.execPath, args, { stdio: 'inherit', cwd: here })
    run.on('exit', (code) => resolve(code ?? 1))
  })
  relay.close()
} finally {
  server.kill('SIGTERM')
  rmSync(home, { recursive: true, force: true })
}
process.exit(status)
