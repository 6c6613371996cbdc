//! `cairn-scripted-model --script FILE [--listen ADDR]`: the scripted model
//! server as a process, for tests in other languages.

use cairn_testkit::model_server::{Script, ScriptedModel};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::ExitCode;

/// The largest script file read.
const SCRIPT_MAX: u64 = 64 << 20;

const HELP: &str = "\
cairn-scripted-model: a model server that plays a script, for tests

Usage: cairn-scripted-model --script FILE [--listen ADDR]

Answers Anthropic's Messages API (POST /v1/messages) and OpenAI's Chat
Completions (POST /v1/chat/completions) from FILE, a JSON script:

  {\"turns\": [{\"text\": \"...\", \"tool_calls\": [{\"name\": \"t\", \"arguments\": {...}}],
              \"fail\": [{\"status\": 429, \"retry_after\": 1}, {\"delay_ms\": 3000}],
              \"stop\": \"end_turn\", \"usage\": {\"input\": 10, \"output\": 5}}, ...]}

The reply to a request is turn N, N being the number of assistant messages
it carries. `fail` entries are served one per request before the reply.
\"{{results[-1].a.b[0]}}\" in an argument is filled from the conversation's
tool results. `raw_arguments` sends malformed arguments (Anthropic: as
input {\"_raw\": text}). Requests are checked as the real APIs would; a bad
one is answered 400 and recorded as a violation.

Base URLs: Anthropic http://ADDR, OpenAI http://ADDR/v1.
GET /_requests returns {\"requests\": [...], \"violations\": [...]}.

Options:
  --script FILE    the script (JSON)
  --listen ADDR    where to listen [default: 127.0.0.1:0, any free port]
  -h, --help       this text

The first line on stdout is `listening http://HOST:PORT`; it serves until
killed.
";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cairn-scripted-model: {e}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<(), String> {
    let mut script_path = None;
    let mut listen = SocketAddr::from(([127, 0, 0, 1], 0));
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-h" | "--help" => {
                print!("{HELP}");
                return Ok(());
            }
            "--script" => script_path = Some(args.next().ok_or("--script needs a file")?),
            "--listen" => {
                let addr = args.next().ok_or("--listen needs an address such as 127.0.0.1:8080")?;
                listen = addr
                    .parse()
                    .map_err(|e| format!("--listen {addr}: {e} (give HOST:PORT)"))?;
            }
            other => return Err(format!("unknown argument {other:?}; see --help")),
        }
    }
    let path = script_path.ok_or("--script FILE is required; see --help")?;
    let file = std::fs::File::open(&path).map_err(|e| format!("cannot open the script {path}: {e}"))?;
    let mut text = String::new();
    file.take(SCRIPT_MAX + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read the script {path}: {e}"))?;
    if text.len() as u64 > SCRIPT_MAX {
        return Err(format!("the script {path} is over {SCRIPT_MAX} bytes"));
    }
    let value = serde_json::from_str(&text).map_err(|e| format!("the script {path} is not JSON: {e}"))?;
    let script = Script::from_json(value).map_err(|e| format!("the script {path}: {e}"))?;
    let model = ScriptedModel::bind(script, listen).map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "listening {}", model.url())
        .and_then(|()| out.flush())
        .map_err(|e| format!("stdout: {e}"))?;
    drop(out);
    loop {
        std::thread::park();
    }
}
