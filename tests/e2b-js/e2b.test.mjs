// E2B's JavaScript SDK (npm `e2b`, the version package.json pins) against
// `cairn serve --e2b` on a fresh state directory: what an agent written in
// TypeScript does, the way tests/e2b/ drives the Python SDK.
//
// The binary is $CAIRN_BIN, else target/<host tuple>/debug/cairn (this
// builds nothing). Needs root: the sandboxes are real.

import { after, before, test } from 'node:test'
import assert from 'node:assert/strict'
import { execFileSync, spawn } from 'node:child_process'
import { mkdtempSync, rmSync } from 'node:fs'
import { createServer } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'

import { CommandExitError, Sandbox } from 'e2b'

const repo = fileURLToPath(new URL('../..', import.meta.url))
const binary =
  process.env.CAIRN_BIN ||
  join(repo, 'target', execFileSync('rustc', ['--print', 'host-tuple']).toString().trim(), 'debug', 'cairn')

let server
let home

function freePort() {
  return new Promise((resolve, reject) => {
    const s = createServer()
    s.on('error', reject)
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address()
      s.close(() => resolve(port))
    })
  })
}

before(async () => {
  home = mkdtempSync(join(tmpdir(), 'cairn-e2b-js-'))
  const env = { ...process.env, CAIRN_HOME: home }
  const created = execFileSync(binary, ['token', 'create', 'e2b-js'], { env }).toString()
  const secret = created.split(/\s+/).find((w) => w.length >= 20)
  const port = await freePort()
  server = spawn(binary, ['serve', '--e2b', `127.0.0.1:${port}`, '--e2b-base', 'busybox'], { env, stdio: 'ignore' })
  const url = `http://127.0.0.1:${port}`
  const deadline = Date.now() + 30_000
  for (;;) {
    try {
      if ((await fetch(`${url}/health`)).status < 500) break
    } catch {}
    if (Date.now() > deadline) throw new Error(`cairn serve --e2b did not answer on ${url}`)
    await new Promise((r) => setTimeout(r, 100))
  }
  Object.assign(process.env, { E2B_API_URL: url, E2B_SANDBOX_URL: url, E2B_API_KEY: secret })
  delete process.env.E2B_DEBUG
})

after(() => {
  server?.kill('SIGTERM')
  if (home) rmSync(home, { recursive: true, force: true })
})

/** A sandbox for `fn`, killed afterwards whatever happens. */
async function withSandbox(fn, opts) {
  const sbx = await Sandbox.create(opts)
  try {
    await fn(sbx)
  } finally {
    await Sandbox.kill(sbx.sandboxId)
  }
}

test('commands stream their output as it comes and report exit codes', () =>
  withSandbox(async (sbx) => {
    const chunks = []
    const r = await sbx.commands.run('echo one; sleep 0.3; echo two 1>&2; pwd', {
      onStdout: (d) => chunks.push(['out', d]),
      onStderr: (d) => chunks.push(['err', d]),
    })
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'one\n/home/user\n')
    assert.equal(r.stderr, 'two\n')
    assert.deepEqual(chunks[0], ['out', 'one\n'])
    await assert.rejects(sbx.commands.run('echo partial; exit 3'), (e) => {
      assert.ok(e instanceof CommandExitError, String(e))
      assert.equal(e.exitCode, 3)
      assert.equal(e.stdout, 'partial\n')
      return true
    })
  }))

test('a background command runs on, takes stdin and is killed', () =>
  withSandbox(async (sbx) => {
    const h = await sbx.commands.run('head -n 1', { background: true, stdin: true })
    assert.ok((await sbx.commands.list()).some((p) => p.pid === h.pid))
    await sbx.commands.sendStdin(h.pid, 'typed\n')
    assert.equal((await h.wait()).stdout, 'typed\n')
    const sleeper = await sbx.commands.run('sleep 300', { background: true })
    assert.equal(await sbx.commands.kill(sleeper.pid), true)
    await assert.rejects(sleeper.wait(), (e) => e instanceof CommandExitError && e.exitCode === -1)
    assert.equal(await sbx.commands.kill(sleeper.pid), false)
  }))

test('files are written, read, listed, renamed and removed', () =>
  withSandbox(async (sbx) => {
    await sbx.files.write('/tmp/js/a.txt', 'alpha')
    await sbx.files.write([
      { path: '/tmp/js/b.bin', data: new Uint8Array([0, 1, 2, 255]).buffer },
      { path: '/tmp/js/c.txt', data: 'gamma' },
    ])
    assert.equal(await sbx.files.read('/tmp/js/a.txt'), 'alpha')
    const bytes = await sbx.files.read('/tmp/js/b.bin', { format: 'bytes' })
    assert.deepEqual([...bytes], [0, 1, 2, 255])
    const names = (await sbx.files.list('/tmp/js')).map((e) => e.name).sort()
    assert.deepEqual(names, ['a.txt', 'b.bin', 'c.txt'])
    await sbx.files.rename('/tmp/js/a.txt', '/tmp/js/z.txt')
    assert.equal(await sbx.files.exists('/tmp/js/a.txt'), false)
    await sbx.files.remove('/tmp/js/z.txt')
    assert.equal(await sbx.files.exists('/tmp/js/z.txt'), false)
    const big = 'x'.repeat(5 << 20)
    await sbx.files.write('/tmp/big.txt', big)
    assert.equal((await sbx.files.read('/tmp/big.txt')).length, big.length)
  }))

test('a paused sandbox connects again with its files', async () => {
  const sbx = await Sandbox.create()
  try {
    await sbx.files.write('/home/user/kept.txt', 'kept')
    await sbx.pause()
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')
    const back = await Sandbox.connect(sbx.sandboxId)
    assert.equal(back.sandboxId, sbx.sandboxId)
    assert.equal(await back.files.read('/home/user/kept.txt'), 'kept')
    assert.equal((await back.commands.run('cat /home/user/kept.txt')).stdout, 'kept')
  } finally {
    await Sandbox.kill(sbx.sandboxId)
  }
})

test('a snapshot is a template, and forks diverge from their parent', () =>
  withSandbox(async (sbx) => {
    await sbx.files.write('/home/user/state.txt', 'parent')
    const snap = await sbx.createSnapshot()
    await withSandbox(async (child) => {
      assert.equal(await child.files.read('/home/user/state.txt'), 'parent')
    }, snap.snapshotId)
    const forks = await sbx.fork({ count: 2 })
    try {
      assert.equal(forks.length, 2)
      for (const [i, f] of forks.entries()) {
        assert.ok(f instanceof Sandbox, String(f))
        assert.equal(await f.files.read('/home/user/state.txt'), 'parent')
        await f.files.write('/home/user/state.txt', `fork ${i}`)
      }
      assert.equal(await forks[1].files.read('/home/user/state.txt'), 'fork 1')
      assert.equal(await sbx.files.read('/home/user/state.txt'), 'parent')
    } finally {
      for (const f of forks) if (f instanceof Sandbox) await Sandbox.kill(f.sandboxId)
    }
  }))

test('a terminal runs a shell and is resized', () =>
  withSandbox(async (sbx) => {
    let shown = ''
    const pty = await sbx.pty.create({ rows: 24, cols: 80, onData: (d) => (shown += Buffer.from(d).toString()) })
    const until = async (want) => {
      const deadline = Date.now() + 30_000
      while (!shown.includes(want)) {
        if (Date.now() > deadline) throw new Error(`${want} never came: ${shown}`)
        await new Promise((r) => setTimeout(r, 50))
      }
    }
    const type = (s) => sbx.pty.sendInput(pty.pid, new TextEncoder().encode(s))
    await type('stty size; echo mark-$((6*7))\n')
    await until('mark-42')
    assert.ok(shown.includes('24 80'), shown)
    await sbx.pty.resize(pty.pid, { rows: 40, cols: 100 })
    await type('stty size; echo mark-$((6*8))\n')
    await until('mark-48')
    assert.ok(shown.includes('40 100'), shown)
    await type('exit 5\n')
    await assert.rejects(pty.wait(), (e) => e instanceof CommandExitError && e.exitCode === 5)
  }))

test('a wrong API key and an unknown sandbox are refused clearly', async () => {
  await assert.rejects(Sandbox.create({ apiKey: 'cairn_wrong_wrong_wrong_wrong' }), /401|[Uu]nauthori|[Ii]nvalid/)
  await assert.rejects(Sandbox.connect('no-such-sandbox'), /not found|404/i)
})
