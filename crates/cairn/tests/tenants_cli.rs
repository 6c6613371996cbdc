//! End-to-end: the CLI given a tenant's token (`--token`, `CAIRN_TOKEN`)
//! sees and acts on that tenant's objects only, within its limits, the
//! way `cairn serve` does for the same token; another tenant's object
//! answers as an absent one does, word for word.

mod common;

use std::process::Output;

use common::{skip, stderr, stdout, Home};
use serde_json::Value;

/// `cairn ARGS` with `token` in CAIRN_TOKEN.
fn as_token(home: &Home, token: &str, args: &[&str]) -> Output {
    home.command(args)
        .env("CAIRN_TOKEN", token)
        .output()
        .expect("run cairn")
}

/// [`as_token`], asserting success; trimmed stdout.
fn ok_as(home: &Home, token: &str, args: &[&str]) -> String {
    let out = as_token(home, token, args);
    assert!(
        out.status.success(),
        "cairn {args:?} with a token failed with {}: {}{}",
        out.status,
        stdout(&out),
        stderr(&out)
    );
    stdout(&out).trim().to_string()
}

/// The error `cairn ARGS` prints with `token`, which must fail, with
/// `key` replaced by KEY so that answers about different keys compare.
fn refused(home: &Home, token: &str, args: &[&str], key: &str) -> String {
    let out = as_token(home, token, args);
    assert_eq!(
        out.status.code(),
        Some(125),
        "cairn {args:?} was expected to be refused: {}{}",
        stdout(&out),
        stderr(&out)
    );
    assert!(stdout(&out).is_empty(), "a refused command printed {:?}", stdout(&out));
    let err = stderr(&out);
    if key.is_empty() {
        err
    } else {
        err.replace(key, "KEY")
    }
}

/// Asserts that `args`, naming another tenant's object `key`, is refused
/// with exactly the answer the same command gets naming `absent`, an
/// object that does not exist (the keys aside).
fn answered_as_absent(home: &Home, token: &str, args: &[&str], key: &str, absent: &str) {
    let other = refused(home, token, args, key);
    let with_absent: Vec<String> = args.iter().map(|a| a.replace(key, absent)).collect();
    let with_absent: Vec<&str> = with_absent.iter().map(String::as_str).collect();
    assert_eq!(other, refused(home, token, &with_absent, absent), "{args:?}");
}

fn json_of(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

fn ids(list: &Value, field: &str) -> Vec<String> {
    let mut out: Vec<String> = list
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .map(|v| v[field].as_str().unwrap().to_string())
        .collect();
    out.sort();
    out
}

#[test]
fn a_tenants_token_on_the_cli_sees_and_acts_on_its_own_objects_only() {
    if skip("a_tenants_token_on_the_cli_sees_and_acts_on_its_own_objects_only") {
        return;
    }
    let home = Home::new();
    home.ok(&["tenant", "create", "acme", "--max-sandboxes", "3"]);
    home.ok(&["tenant", "create", "globex"]);
    let acme = home.ok(&["token", "create", "acme-cli", "--tenant", "acme"]);
    let globex = home.ok(&["token", "create", "globex-cli", "--tenant", "globex"]);
    let admin = home.ok(&["token", "create", "ops"]);
    let work = tempfile::tempdir().unwrap();

    // Both tenants name a sandbox "web": names are each tenant's own.
    let a = ok_as(&home, &acme, &["create", "--name", "web"]);
    let g = ok_as(&home, &globex, &["create", "--name", "web"]);
    let own = home.ok(&["create", "--name", "ops"]);
    let err = refused(&home, &acme, &["create", "--name", "web"], "web");
    assert!(err.contains("taken") || err.contains("exists"), "{err}");
    assert_eq!(
        ok_as(
            &home,
            &acme,
            &["exec", "web", "--", "sh", "-c", "echo acme > /f; cat /f"]
        ),
        "acme"
    );
    assert_eq!(ok_as(&home, &globex, &["exec", "web", "--", "hostname"]), "globex-web");
    let listed = ids(&json_of(&ok_as(&home, &globex, &["ps", "--json"])), "id");
    assert_eq!(listed, [g.as_str()], "globex lists its own sandbox only");
    let listed = ids(&json_of(&ok_as(&home, &acme, &["ps", "--json"])), "id");
    assert_eq!(listed, [a.as_str()]);
    let mut everyone = vec![a.clone(), g.clone(), own.clone()];
    everyone.sort();
    assert_eq!(ids(&json_of(&home.ok(&["ps", "--json"])), "id"), everyone);
    // An administrator's token is the administrator.
    assert_eq!(ids(&json_of(&ok_as(&home, &admin, &["ps", "--json"])), "id"), everyone);
    // The flag does what the variable does.
    let flag = home.ok(&["--token", &globex, "ps", "-q"]);
    assert_eq!(flag, g);

    // Globex reaches none of Acme's sandboxes, and cannot tell them from
    // absent ones: each answer is the absent one's, word for word.
    let snap = ok_as(&home, &acme, &["snapshot", "web", "--label", "acme-base"]);
    for key in [a.as_str(), &a[..6], "acme-web", "ops", own.as_str()] {
        for args in [
            vec!["exec", key, "--", "true"],
            vec!["logs", key],
            vec!["snapshot", key],
            vec!["fork", key],
            vec!["reset", key, "nosnapshot"],
            vec!["rm", "-f", key],
        ] {
            answered_as_absent(&home, &globex, &args, key, "nosuch");
        }
        let from = format!("{key}:/f");
        let to = work.path().join("f").display().to_string();
        answered_as_absent(&home, &globex, &["cp", &from, &to], key, "nosuch");
    }
    for key in [snap.as_str(), &snap[..8], "acme-base"] {
        for args in [
            vec!["restore", key],
            vec!["snapshot", "show", key],
            vec!["snapshot", "rm", key],
            vec!["snapshot", "flatten", key],
            vec!["diff", key, "web"],
        ] {
            answered_as_absent(&home, &globex, &args, key, "nosuch");
        }
    }
    let listed = json_of(&ok_as(&home, &globex, &["snapshots", "--json"]));
    assert_eq!(listed.as_array().map(Vec::len), Some(0), "{listed}");
    let listed = ids(&json_of(&ok_as(&home, &acme, &["snapshots", "--json"])), "id");
    assert_eq!(listed, [snap.as_str()]);
    assert!(stdout(&home.cairn(&["snapshots", "--json"])).contains(&snap));
    // What is made from a tenant's object is the tenant's.
    let restored = ok_as(&home, &acme, &["restore", "acme-base", "--name", "again"]);
    assert_eq!(ok_as(&home, &acme, &["exec", "again", "--", "cat", "/f"]), "acme");
    let listed = ids(&json_of(&ok_as(&home, &acme, &["ps", "--json"])), "id");
    let mut expected = vec![a.clone(), restored.clone()];
    expected.sort();
    assert_eq!(listed, expected);

    // Limits: a third sandbox fits, a fourth is refused and nothing is made.
    ok_as(&home, &acme, &["create", "--name", "third"]);
    let err = refused(&home, &acme, &["create", "--name", "fourth"], "fourth");
    assert!(err.contains("at most 3 sandboxes"), "{err}");
    let err = refused(&home, &acme, &["fork", "web"], "web");
    assert!(err.contains("at most 3 sandboxes"), "{err}");
    let err = refused(&home, &acme, &["run", "--", "true"], "true");
    assert!(err.contains("at most 3 sandboxes"), "{err}");
    assert_eq!(
        json_of(&ok_as(&home, &acme, &["ps", "--json"]))
            .as_array()
            .map(Vec::len),
        Some(3)
    );
    assert!(
        err.contains("cairn tenant set acme"),
        "the refusal says how to raise it: {err}"
    );
    // Raised, the next one fits; a limit lowered takes nothing away.
    assert!(
        !home.cairn(&["tenant", "set", "acme"]).status.success(),
        "set needs a limit"
    );
    assert!(!home
        .cairn(&["tenant", "set", "acme", "--max-sandboxes", "many"])
        .status
        .success());
    home.ok(&["tenant", "set", "acme", "--max-sandboxes", "4"]);
    ok_as(&home, &acme, &["create", "--name", "fourth"]);
    home.ok(&["tenant", "set", "acme", "--max-sandboxes", "1"]);
    assert_eq!(
        json_of(&ok_as(&home, &acme, &["ps", "--json"]))
            .as_array()
            .map(Vec::len),
        Some(4)
    );
    refused(&home, &acme, &["create", "--name", "fifth"], "fifth");
    let set = json_of(&home.ok(&["tenant", "set", "acme", "--max-sandboxes", "3", "--json"]));
    assert_eq!(set["max_sandboxes"], 3, "{set}");
    assert_eq!(set["max_memory"], Value::Null, "{set}");
    ok_as(&home, &acme, &["rm", "-f", "third", "again", "fourth"]);
    assert_eq!(ok_as(&home, &acme, &["run", "--", "echo", "ran"]), "ran");

    // Sessions.
    let s = ok_as(&home, &globex, &["session", "create", "--name", "agent"]);
    assert_eq!(
        ok_as(&home, &globex, &["session", "exec", "agent", "--", "echo", "hi"]),
        "hi"
    );
    for key in [s.as_str(), "agent", "globex-agent"] {
        for args in [
            vec!["session", "exec", key, "--", "true"],
            vec!["session", "show", key],
            vec!["session", "log", key],
            vec!["session", "suspend", key],
            vec!["session", "fork", key, "--at", "1", "--reason", "x"],
            vec!["session", "rm", key],
        ] {
            answered_as_absent(&home, &acme, &args, key, "nosuch");
        }
    }
    let listed = json_of(&ok_as(&home, &acme, &["session", "ls", "--json"]));
    assert_eq!(listed.as_array().map(Vec::len), Some(0), "{listed}");
    let listed = ids(&json_of(&ok_as(&home, &globex, &["session", "ls", "--json"])), "id");
    assert_eq!(listed, [s.as_str()]);

    // A run: its stages, dead letters and artifacts are Acme's alone.
    let file = work.path().join("p.toml");
    std::fs::write(
        &file,
        "[pipeline]\nname = \"t\"\nimage = \"busybox\"\n\
         [[stage]]\nname = \"make\"\nkey = \"make-v1\"\nrun = [\"mkdir -p /w\", \"echo made > /w/out\"]\nartifacts = [\"/w/out\"]\n\
         [[stage]]\nname = \"bad\"\nafter = \"make\"\nkey = \"bad-v1\"\nretries = 0\nrun = [\"exit 3\"]\n",
    )
    .unwrap();
    let out = as_token(&home, &acme, &["pipeline", "run", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "the run fails at `bad`: {}", stderr(&out));
    let run = stdout(&out).trim().to_string();
    let listed = ids(&json_of(&ok_as(&home, &acme, &["pipeline", "ls", "--json"])), "id");
    assert_eq!(listed, [run.as_str()]);
    let listed = json_of(&ok_as(&home, &globex, &["pipeline", "ls", "--json"]));
    assert_eq!(listed.as_array().map(Vec::len), Some(0), "{listed}");
    let letters = json_of(&ok_as(&home, &acme, &["dlq", "ls", "--json"]));
    let letter = letters[0]["id"].as_str().unwrap().to_string();
    let listed = json_of(&ok_as(&home, &globex, &["dlq", "ls", "--json"]));
    assert_eq!(listed.as_array().map(Vec::len), Some(0), "{listed}");
    let artifacts = json_of(&ok_as(&home, &acme, &["artifact", "ls", "--json"]));
    let artifact = artifacts[0]["id"].as_str().unwrap().to_string();
    assert_eq!(ok_as(&home, &acme, &["artifact", "get", &artifact, "-o", "-"]), "made");
    let listed = json_of(&ok_as(&home, &globex, &["artifact", "ls", "--json"]));
    assert_eq!(listed.as_array().map(Vec::len), Some(0), "{listed}");
    let stage = format!("{run}/make");
    for (key, args) in [
        (run.as_str(), vec!["pipeline", "show", run.as_str()]),
        (run.as_str(), vec!["pipeline", "resume", run.as_str()]),
        (run.as_str(), vec!["pipeline", "approve", run.as_str(), "bad"]),
        (run.as_str(), vec!["audit", run.as_str()]),
        (run.as_str(), vec!["logs", run.as_str(), "make"]),
        (run.as_str(), vec!["artifact", "ls", run.as_str()]),
        (stage.as_str(), vec!["diff", stage.as_str(), "web"]),
        (letter.as_str(), vec!["dlq", "show", letter.as_str()]),
        (letter.as_str(), vec!["dlq", "retry", letter.as_str()]),
        (artifact.as_str(), vec!["artifact", "get", artifact.as_str(), "-o", "-"]),
    ] {
        answered_as_absent(&home, &globex, &args, key, "000000000000");
    }
    assert!(ok_as(&home, &acme, &["pipeline", "show", &run]).contains("bad"));

    // Images: a tenant's are named in its namespace and seen by it and the
    // administrator; the administrator's are shared but not the tenant's to
    // remove.
    assert_eq!(ok_as(&home, &acme, &["image", "tag", "busybox", "tools"]), "acme-tools");
    let names = ids(&json_of(&ok_as(&home, &acme, &["image", "ls", "--json"])), "name");
    assert_eq!(names, ["acme-tools", "busybox"]);
    let names = ids(&json_of(&ok_as(&home, &globex, &["image", "ls", "--json"])), "name");
    assert_eq!(names, ["busybox"]);
    assert_eq!(
        refused(&home, &globex, &["image", "rm", "tools"], "tools"),
        refused(&home, &globex, &["image", "rm", "nosuch"], "nosuch")
    );
    let err = refused(&home, &globex, &["create", "--image", "acme-tools"], "acme-tools");
    assert!(err.contains("no image named"), "{err}");
    let err = refused(&home, &acme, &["image", "rm", "busybox"], "busybox");
    assert!(err.contains("the administrator's"), "{err}");
    ok_as(&home, &acme, &["create", "--image", "tools", "--name", "tooled"]);
    assert_eq!(ok_as(&home, &acme, &["image", "rm", "tools"]), "tools");

    // The administrator's commands are refused to a tenant's token.
    for args in [
        vec!["tenant", "ls"],
        vec!["token", "ls"],
        vec!["token", "create", "more"],
        vec!["gc"],
        vec!["verify", "--all"],
        vec!["worker", "ls"],
        vec!["serve", "--openapi"],
        vec!["agent", "ls"],
    ] {
        let err = refused(&home, &acme, &args, "");
        assert!(err.contains("is the administrator's"), "{args:?}: {err}");
    }
    assert!(home.ok(&["tenant", "ls"]).contains("acme"));

    // Every command made with a token is in the request log.
    let log = json_of(&home.ok(&["token", "log", "--tenant", "globex", "-n", "1000", "--json"]));
    let rows = log.as_array().unwrap();
    assert!(rows.iter().all(|r| r["tenant"] == "globex"), "{log}");
    assert!(
        rows.iter()
            .any(|r| r["surface"] == "cli" && r["path"] == "cairn session create" && r["status"] == 0),
        "{log}"
    );
    assert!(
        rows.iter()
            .any(|r| r["surface"] == "cli" && r["path"] == "cairn dlq retry" && r["status"] == 125),
        "{log}"
    );
    let log = json_of(&home.ok(&["token", "log", "--tenant", "acme", "-n", "1000", "--json"]));
    assert!(
        log.as_array()
            .unwrap()
            .iter()
            .any(|r| r["path"] == "cairn gc" && r["status"] == 125),
        "a refused command is logged: {log}"
    );

    // A token that is not one, is revoked, or whose tenant is removed is
    // refused before anything is done.
    let bogus = refused(&home, "cairn_not_a_token", &["ps"], "");
    assert!(bogus.contains("not one of this state directory's"), "{bogus}");
    let refused_rm = home.cairn(&["tenant", "rm", "globex"]);
    assert!(
        !refused_rm.status.success(),
        "globex still holds a sandbox and a session"
    );
    home.ok(&["tenant", "rm", "--force", "globex"]);
    let gone = refused(&home, &globex, &["ps"], "");
    assert_eq!(gone, bogus);
    home.ok(&["token", "rm", "acme-cli"]);
    assert_eq!(refused(&home, &acme, &["ps"], ""), bogus);
    // The administrator sees what is left: Acme's and its own.
    let left = ids(&json_of(&home.ok(&["ps", "--json"])), "id");
    assert!(
        left.contains(&a) && left.contains(&own) && !left.contains(&g),
        "{left:?}"
    );
}
